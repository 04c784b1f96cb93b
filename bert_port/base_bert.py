"""`BertPreTrainedModel`: what every port model shares: weight initialisation, its dtype
and device, transformers' conveniences (input embeddings, tied weights, gradient
checkpointing, resizing the vocabulary). Its `from_pretrained`, `load_hf_state_dict`,
`save_pretrained` and `hf_state_dict` are the functions of `loading` and `saving`, a layer up,
which install them on this class when imported (`import bert_port` imports both).
`meta_init` builds a model without initialising weights that a load will replace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .config import BertConfig

# transformers' Megatron-BERT class of a port class, where it is not "Megatron" + the port's name.
MEGATRON_ARCHITECTURES = {"BertLMHeadModel": "MegatronBertForCausalLM"}


@contextmanager
def meta_init() -> Iterator[None]:
    """Build modules on the meta device without running their random initialisers: the
    weights are about to be replaced by the checkpoint's, and `normal_` on a meta tensor
    imports torch._dynamo (slow, on the first load in a process). Like transformers'
    `no_init_weights`, it swaps `torch.nn.init`'s in-place initialisers for no-ops while
    the model is constructed."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_") and callable(getattr(nn.init, n))]
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
        with torch.device("meta"):
            yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


class BertPreTrainedModel(nn.Module):
    # Port keys (by prefix) that a checkpoint may lack: they are initialised afresh and
    # reported, e.g. a classifier head when fine-tuning from a base checkpoint.
    keys_to_init_if_missing: ClassVar[tuple[str, ...]] = ()
    # Prefix that HF gives the encoder's keys in this model's own checkpoints.
    hf_encoder_prefix: ClassVar[str] = ""
    # Prefix of the encoder's keys in this model's own state dict ("bert." for a task
    # model holding its encoder as `self.bert`); the key table maps the names below it.
    port_encoder_prefix: ClassVar[str] = ""
    # HF head prefixes this model owns whose keys `checkpoint.hf_to_port` would otherwise drop
    # as pretraining heads (`cls.predictions.` for BertForMaskedLM), see heads.py.
    hf_head_prefixes: ClassVar[tuple[str, ...]] = ()
    # The head's entry in the family's head key table (`checkpoint.HEAD_TABLES`: "sequence",
    # "masked_lm"), for the families whose head names are not BERT's (RoBERTa's `lm_head`).
    head_keys: ClassVar[str | None] = None
    # Tied parameters, port names: target -> source (the MLM decoder is the word embedding).
    # Targets are neither read from nor written to checkpoints, as in transformers.
    tied_weights: ClassVar[dict[str, str]] = {}
    # Whether `save_pretrained` copies the sentence-transformers files (modules.json,
    # 1_Pooling/, ...) of the folder the model was loaded from: true for a bare encoder, which
    # is the Transformer module those files describe; a task model's encoder no longer is.
    keeps_sentence_transformers_files: ClassVar[bool] = True
    # Set by gradient_checkpointing_enable() on every BertModel inside the model.
    gradient_checkpointing: bool = False

    def __init__(self, config: BertConfig):
        super().__init__()
        family, name = config.family, type(self).__name__
        if not family.supports(name):
            uses = " or ".join(("BertModel", *family.tasks)) if family.tasks else "the Bert* models"
            raise ValueError(
                f"{name} has no {family.model_type} counterpart in transformers that the port computes the same "
                f"(no such head in that family, or one not checked against it); with a {family.model_type} "
                f"checkpoint use {uses}"
            )
        self.config = config
        self.source_dir: Path | None = None  # checkpoint directory, for its tokenizer files
        self.loading_info: dict[str, object] = {}  # set by load_hf_state_dict

    # -- initialisation ---------------------------------------------------------------

    def init_weights(self) -> None:
        if not any(p.is_meta for p in self.parameters()):
            self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """HF's BERT init: N(0, initializer_range) for linear and embedding weights, zero
        biases and padding row, LayerNorm at identity."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    # -- loading and saving: installed by `loading` and `saving` ------------------------
    # They read and write files, a layer above the model, so the model cannot import them: each
    # module sets its functions here when imported, and `bert_port/__init__.py` imports both, so
    # the methods are there after any import of the package. What each one is:

    # `loading.from_pretrained(cls, path, ...)` as a classmethod: the checkpoint, a config and
    # dtype/device choices -> a model in eval mode, the speed layer swapped in.
    from_pretrained: ClassVar[Callable[..., Any]]
    # `loading.load_hf_state_dict(model, state_dict, ...)`: strict, all-or-nothing; returns the
    # keys initialised afresh.
    load_hf_state_dict: Callable[..., list[str]]
    # `saving.save_pretrained(model, directory, max_shard_size)`: one staged write of the folder.
    save_pretrained: Callable[..., Path]
    # `saving.hf_state_dict(model)`: the state dict under Hugging Face names.
    hf_state_dict: Callable[..., dict[str, Tensor]]

    @property
    def hf_architecture(self) -> str:
        """transformers' class of this model (config.json's `architectures`): the class of the
        same name, or for a pre-LN config (`config.pre_norm`) its Megatron-BERT counterpart. A
        class swapped in by `bert_port.speed` names the plain class it stands for (`plain_class`)."""
        name = getattr(type(self), "plain_class", type(self)).__name__
        if self.config.pre_norm:
            return MEGATRON_ARCHITECTURES.get(name, "Megatron" + name)
        return self.config.family.architecture(name)  # RobertaForTokenClassification for a RoBERTa

    # -- transformers' fine-tuning conveniences ---------------------------------------

    @property
    def encoder(self) -> nn.Module:
        """The `BertModel` inside (the model itself for a `BertModel`)."""
        return self.get_submodule(self.port_encoder_prefix.rstrip("."))

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.word_embedding

    def set_input_embeddings(self, embeddings: nn.Embedding) -> None:
        self.encoder.word_embedding = embeddings
        self.tie_weights()

    def get_output_embeddings(self) -> nn.Module | None:
        """The layer that maps hidden states to vocabulary logits (the MLM decoder); None
        for a model without one, as in transformers."""
        return None

    def tie_weights(self) -> None:
        """Make every target of `tied_weights` the very parameter of its source again (after a
        load assigned new parameters, or a resize)."""
        for target, source in self.tied_weights.items():
            owner, attr = target.rsplit(".", 1)
            setattr(self.get_submodule(owner), attr, self.get_parameter(source))

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Recompute each layer's activations in backward instead of keeping them (less memory,
        about one more forward of time), in train mode only, as transformers does. Gradients are
        those of the model without it: the recomputation restores the RNG, so dropout repeats.
        `gradient_checkpointing_kwargs` may only say `{"use_reentrant": False}`, the one mode used."""
        extra = {k: v for k, v in (gradient_checkpointing_kwargs or {}).items() if (k, v) != ("use_reentrant", False)}
        if extra:
            raise ValueError(
                f"gradient_checkpointing_kwargs {extra} are not supported: the port always uses torch's "
                "non-reentrant checkpoint; pass None or {'use_reentrant': False}"
            )
        self._set_gradient_checkpointing(True)

    def gradient_checkpointing_disable(self) -> None:
        self._set_gradient_checkpointing(False)

    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(self.encoder.gradient_checkpointing)

    def _set_gradient_checkpointing(self, enable: bool) -> None:
        for module in self.modules():
            if isinstance(module, BertPreTrainedModel):
                module.gradient_checkpointing = enable

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> nn.Embedding:
        """Grow or shrink the vocabulary to `new_num_tokens` (rounded up to a multiple of
        `pad_to_multiple_of`), as transformers does: existing rows are kept, `config.vocab_size`
        follows, the output embeddings (the MLM decoder and its bias) are resized with it: the
        same parameter when tied, their own rows when `config.tie_word_embeddings` is False.

        New rows: with `mean_resizing` the mean of the old rows (new output-bias entries are
        zero, as transformers 5 leaves them for a tied decoder). transformers samples them from
        a normal around that mean with covariance 1e-9 times the old rows', so its rows differ
        from ours by that small noise; ours are deterministic. Without it, N(0,
        initializer_range) as a fresh model's.
        Returns the input embedding."""
        embedding = self.get_input_embeddings()
        if new_num_tokens is None and pad_to_multiple_of is None:
            return embedding
        old_num = embedding.weight.shape[0]
        new_num = old_num if new_num_tokens is None else new_num_tokens
        if pad_to_multiple_of is not None:
            if (
                isinstance(pad_to_multiple_of, bool)
                or not isinstance(pad_to_multiple_of, int)
                or pad_to_multiple_of < 1
            ):
                raise ValueError(f"pad_to_multiple_of must be a positive integer, got {pad_to_multiple_of!r}")
            new_num = -(-new_num // pad_to_multiple_of) * pad_to_multiple_of
        if isinstance(new_num, bool) or not isinstance(new_num, int) or new_num < 1:
            raise ValueError(f"new_num_tokens must be a positive integer, got {new_num_tokens!r}")
        if new_num != old_num:
            with torch.no_grad():
                embedding.weight = nn.Parameter(
                    self._resized(embedding.weight, new_num, mean_resizing, init=embedding),
                    requires_grad=embedding.weight.requires_grad,
                )
            embedding.num_embeddings = new_num
            if embedding.padding_idx is not None and embedding.padding_idx >= new_num:
                embedding.padding_idx = None
            self._resize_output_embeddings(new_num, mean_resizing)
        self.config.vocab_size = new_num
        self.tie_weights()
        return embedding

    def _resize_output_embeddings(self, new_num: int, mean_resizing: bool) -> None:
        """Resize what the output layer holds beside the input embedding (its bias; an untied
        decoder's weight): overridden by the MLM heads."""

    def _resized(self, weight: Tensor, new_num: int, mean_resizing: bool, init: nn.Module | None = None) -> Tensor:
        """`weight` (V, ...) with its first `new_num` rows kept and any new row initialised."""
        old_num = weight.shape[0]
        if new_num <= old_num:
            return weight[:new_num].clone()
        added = new_num - old_num
        if mean_resizing:
            fresh = weight.float().mean(0, keepdim=True).expand(added, *weight.shape[1:]).to(weight.dtype)
        elif weight.dim() == 2:
            fresh = torch.empty(added, *weight.shape[1:], dtype=weight.dtype, device=weight.device)
            nn.init.normal_(fresh, mean=0.0, std=self.config.initializer_range)
        else:  # a bias: zero, as a fresh layer's
            fresh = weight.new_zeros(added)
        return torch.cat([weight, fresh])
