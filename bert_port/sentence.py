"""`SentenceEncoder`: sentence embeddings the way sentence-transformers computes them.

A sentence-transformers checkpoint says in `modules.json` how its embedding is made: the
Transformer (this BERT) gives token vectors, `1_Pooling/config.json` says how to pool them
(mean over real tokens for all-MiniLM-L6-v2), and a `Normalize` module, when listed, scales
each embedding to unit length. `sentence_bert_config.json` gives `max_seq_length` (256 for
all-MiniLM-L6-v2, not the 512 positions the model has): longer texts are truncated to it.

The pooler output (`BertModel(...).pooler_output`, a dense layer and tanh on [CLS]) is not
such a checkpoint's embedding: it was never trained for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor, nn
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from . import saving
from .bert import BertModel
from .loader_arguments import LoaderArgumentError
from .sentence_api import SentenceTransformerAPI, check_output_value, check_precision, finish_output, first_argument
from .sentence_folder import (
    LEGACY_POOLING_KEYS,
    NORMALIZE,
    POOLING,
    POOLING_FOLDER,
    POOLING_MODES,
    TRANSFORMER,
    pool,
    pooling_modes,
    read_json,
    read_pipeline,
)
from .threads import governed
from .tokenization import encode, load_tokenizer

log = logging.getLogger(__name__)


class SentenceEncoder(SentenceTransformerAPI, nn.Module):
    """A BERT encoder, pooling and optional normalisation: `encode(texts)` returns what
    sentence-transformers' `SentenceTransformer(path).encode(texts)` does (within the fp32
    tolerance in float32).

    `forward(input_ids, attention_mask, token_type_ids)` gives the (B, D) embeddings of a
    tokenized batch with gradients, for fine-tuning."""

    def __init__(
        self,
        model: BertModel,
        tokenizer: Tokenizer,
        pooling: str | Sequence[str] = "mean",
        normalize: bool = False,
        max_seq_length: int | None = None,
        do_lower_case: bool = False,
        *,
        prompts: dict[str, str] | None = None,
        default_prompt_name: str | None = None,
        similarity_fn_name: str = "cosine",
        truncate_dim: int | None = None,
        include_prompt: bool = True,
    ):
        super().__init__()
        if not isinstance(model, BertModel):
            raise TypeError(f"SentenceEncoder wraps a BertModel, got {type(model).__name__}")
        self.model = model
        self.tokenizer = tokenizer
        self.pooling = pooling_modes(pooling, "pooling", "pass one of them, or a list")
        self.normalize = normalize
        limit = model.config.max_position_embeddings
        if max_seq_length is None:
            truncation = tokenizer.truncation
            max_seq_length = min(limit, truncation["max_length"]) if truncation else limit
        if not isinstance(max_seq_length, int) or not 0 < max_seq_length <= limit:
            raise ValueError(
                f"max_seq_length must be an integer in [1, {limit}] (the model's max_position_embeddings), "
                f"got {max_seq_length!r}"
            )
        self.max_seq_length = max_seq_length
        self.do_lower_case = do_lower_case
        # As config_sentence_transformers.json says; `encode` puts a prompt's text before each text.
        self.prompts = dict(prompts or {})
        if default_prompt_name is not None and default_prompt_name not in self.prompts:
            raise ValueError(
                f"default_prompt_name {default_prompt_name!r} is not one of prompts {sorted(self.prompts)}"
            )
        self.default_prompt_name = default_prompt_name
        self.similarity_fn_name = similarity_fn_name
        self.truncate_dim = truncate_dim
        self.include_prompt = include_prompt
        self._warned_truncation = False  # the truncation warning is given once per encoder
        self.threads: int | str | None = "auto"  # CPU threads while encoding (`threads.governed`)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        pooling: str | Sequence[str] | None = None,
        normalize: bool | None = None,
        max_seq_length: int | None = None,
        **model_kwargs,
    ) -> SentenceEncoder:
        """Load a checkpoint (directory or model id in the HF cache, as `BertModel.from_pretrained`)
        and follow its sentence-transformers files: the BERT weights from the Transformer
        module's folder (the checkpoint itself, or `0_BERT/` in older folders), pooling from
        `1_Pooling/config.json`, normalisation when `modules.json` lists `Normalize`,
        `max_seq_length` from `sentence_bert_config.json`. Arguments given here override those. `model_kwargs` go to
        `BertModel.from_pretrained` (dtype, device, attn_implementation, ...)."""
        root = Path(path).expanduser()
        # A folder is read as one save (model, tokenizer and pipeline files), however saves race.
        with ckpt.read_snapshot(root) if root.is_dir() else contextlib.nullcontext():
            model, settings = cls._load_parts(path, root, model_kwargs)
            tokenizer = load_tokenizer(model.source_dir)
        return cls(
            model,
            tokenizer,
            pooling=settings["pooling"] if pooling is None else pooling,
            normalize=settings["normalize"] if normalize is None else normalize,
            max_seq_length=settings["max_seq_length"] if max_seq_length is None else max_seq_length,
            do_lower_case=settings["do_lower_case"],
            prompts=settings["prompts"],
            default_prompt_name=settings["default_prompt_name"],
            similarity_fn_name=settings["similarity_fn_name"],
            include_prompt=settings["include_prompt"],
        ).eval()  # as the model: `encode` restores the mode it finds, and an int8 model runs only in eval

    @classmethod
    def _load_parts(cls, path: str | os.PathLike, root: Path, model_kwargs: dict) -> tuple[BertModel, dict]:
        """The BERT model and the pipeline settings of a checkpoint (see `from_pretrained`)."""
        try:
            model = None
            if not root.is_dir():  # a model id or weights file: the folder it resolves to
                model = BertModel.from_pretrained(path, **model_kwargs)
                root = Path(model.source_dir)
            settings = read_pipeline(root)
            if settings["transformer"] or model is None:  # older folders keep BERT in 0_BERT/ or 0_Transformer/
                model = BertModel.from_pretrained(root / settings["transformer"], **model_kwargs)
        except LoaderArgumentError as exc:  # the caller called SentenceEncoder.from_pretrained
            raise exc.named(f"{cls.__name__}.from_pretrained", ("pooling", "normalize", "max_seq_length")) from None
        return model, settings

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None, **kwargs
    ) -> Tensor:
        """(B, T) ids and mask -> (B, D) embeddings, normalised when `self.normalize`."""
        kwargs.pop("offset_mapping", None)
        hidden = self.model(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, **kwargs
        ).last_hidden_state
        embeddings = pool(hidden, attention_mask, self.pooling)
        return F.normalize(embeddings, p=2, dim=1) if self.normalize else embeddings

    @torch.inference_mode()
    def encode(
        self,
        texts: str | Sequence[str] | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        output_value: str = "sentence_embedding",
        precision: str = "float32",
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
        device: str | torch.device | None = None,
        normalize_embeddings: bool = False,
        truncate_dim: int | None = None,
        *,
        sentences: str | Sequence[str] | None = None,
        inputs: str | Sequence[str] | None = None,
    ) -> np.ndarray | Tensor | list[Tensor]:
        """Embeddings of `texts`, as `SentenceTransformer.encode` with the same arguments returns
        them: a (N, D) float32 numpy array by default (bf16 upcast); with `convert_to_tensor` one
        (N, D) tensor; with neither, a list of N (D,) tensors. One bare string gives one (D,)
        embedding. The texts may be given as `sentences=` or `inputs=` too, sentence-transformers'
        names. `show_progress_bar` (None: shown when this module logs at INFO or DEBUG,
        sentence-transformers' rule) draws a bar over the batches.

        `prompt` (or `prompts[prompt_name]`, or the default prompt) is put before each text.
        The checkpoint's Normalize module runs, then `truncate_dim` (or `self.truncate_dim`)
        keeps the first dimensions, then `normalize_embeddings` scales to unit length. `precision`
        int8/uint8/binary/ubinary quantises as `quantize_embeddings` (the int8 ranges from these
        embeddings, so one text alone is refused). `output_value="token_embeddings"` gives instead
        each text's (n_i, H) token vectors, its real tokens only, unnormalised, as a list of tensors.
        `device` moves the encoder there first. Texts longer than `max_seq_length`
        tokens are truncated to it; the first time, a warning says how many were. Batches are
        formed from texts of similar length (fewer pads), and the result is in the order of `texts`."""
        texts = first_argument(texts, sentences, inputs)
        single = isinstance(texts, str)
        texts = [texts] if single else list(texts)
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        check_precision(precision)
        check_output_value(output_value, precision)
        texts = self._with_prompt(texts, self.resolve_prompt(prompt, prompt_name))
        if device is not None:
            self.to(device)
        if show_progress_bar is None:
            show_progress_bar = log.getEffectiveLevel() <= logging.INFO
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        tokens = output_value == "token_embeddings"
        was_training = self.training
        self.eval()
        try:
            outputs = self._embed_in_order(texts, order, batch_size, show_progress_bar, tokens)
        finally:
            self.train(was_training)
        if tokens:
            rows = [outputs[position] for position in np.argsort(order)]
            return rows[0] if single else rows
        embeddings = self._scaled(outputs, truncate_dim, normalize_embeddings)
        embeddings = embeddings[torch.argsort(torch.tensor(order, device=embeddings.device))]
        return finish_output(embeddings, precision, convert_to_numpy, convert_to_tensor, single)

    def _scaled(self, embeddings: Tensor, truncate_dim: int | None, normalize_embeddings: bool) -> Tensor:
        """(N, D) pooled embeddings through the Normalize module, `truncate_dim` and `normalize_embeddings`."""
        if self.normalize:
            embeddings = F.normalize(embeddings, p=2, dim=1)
        truncate_dim = self.truncate_dim if truncate_dim is None else truncate_dim
        if truncate_dim is not None:
            embeddings = embeddings[:, :truncate_dim]
        if normalize_embeddings:
            embeddings = F.normalize(embeddings, p=2, dim=1)
        return embeddings

    def _with_prompt(self, texts: list[str], prompt: str | None) -> list[str]:
        """`texts` with `prompt` before each; a loud error where the pooling must leave the prompt out."""
        if not prompt:
            return texts
        if not self.include_prompt:
            raise ValueError(
                "this model's pooling excludes the prompt's tokens (include_prompt: false), which SentenceEncoder "
                "does not compute; use sentence-transformers for prompts with this model"
            )
        return [prompt + text for text in texts]

    def embedding_dimension(self) -> int:
        """The width of the pooled vector: one hidden size per pooling mode."""
        return len(self.pooling) * self.model.config.hidden_size

    def _embed_in_order(
        self, texts: list[str], order: list[int], batch_size: int, show_progress_bar: bool, tokens: bool = False
    ) -> Tensor | list[Tensor]:
        """The pooled (N, D) embeddings of `texts` taken in `order`, `batch_size` at a time (with
        `tokens`, each text's (n_i, H) real-token vectors instead, a list); warns, once per
        encoder, when texts were cut to `max_seq_length` tokens."""
        chunks, truncated = [], 0
        starts = tqdm(
            range(0, len(texts), batch_size), desc="Batches", disable=not show_progress_bar, dynamic_ncols=True
        )
        with governed(self.model, self.threads if self.model.device.type == "cpu" else None):
            for start in starts:
                batch = [texts[i] for i in order[start : start + batch_size]]
                batch = [t.lower() for t in batch] if self.do_lower_case else batch
                inputs = encode(self.tokenizer, batch, max_length=self.max_seq_length).to(self.model.device)
                truncated += sum(bool(e.overflowing) for e in inputs.encodings)
                hidden = self.model(**inputs).last_hidden_state
                if tokens:
                    chunks.extend(h[m] for h, m in zip(hidden, inputs["attention_mask"].bool()))
                else:
                    chunks.append(pool(hidden, inputs["attention_mask"], self.pooling))
        if truncated and not self._warned_truncation:
            self._warned_truncation = True
            log.warning(
                "%d of %d texts had more than max_seq_length=%d tokens and were truncated to it: their embeddings "
                "read only their first %d tokens (said once for this encoder)",
                truncated,
                len(texts),
                self.max_seq_length,
                self.max_seq_length,
            )
        if tokens or chunks:
            return chunks if tokens else torch.cat(chunks)
        return torch.empty(0, self.embedding_dimension(), device=self.model.device)

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Write the model (`BertModel.save_pretrained`: HF format, tokenizer files) and the
        sentence-transformers files describing this encoder's pipeline (`_pipeline_files`), so
        that both `SentenceEncoder.from_pretrained` and `SentenceTransformer(save_directory)`
        load it. Those of the folder the model came from are kept (its
        `config_sentence_transformers.json`, module folders), with this pipeline written over
        them; `saving` writes them all."""
        files, folders = self._pipeline_files()
        carried = saving.carried_sentence_files(self.model, save_directory)
        model_config = self._model_config_text(carried.files.get(ckpt.ST_MODEL_CONFIG))
        if model_config is not None:
            files[ckpt.ST_MODEL_CONFIG] = model_config
        return saving.save_pretrained(self.model, save_directory, sentence=carried.updated(files, folders))

    def _model_config_text(self, carried: Path | None) -> str | None:
        """`config_sentence_transformers.json` with this encoder's prompts and similarity function
        over the carried one's other fields; None when both are the defaults and nothing carried sets them."""
        source = carried or Path(self.model.source_dir or ".") / ckpt.ST_MODEL_CONFIG
        config = read_json(source) if os.path.lexists(source) else {}
        settings = {"prompts": self.prompts, "default_prompt_name": self.default_prompt_name}
        settings["similarity_fn_name"] = self.similarity_fn_name
        if not (self.prompts or self.default_prompt_name or self.similarity_fn_name != "cosine") and not (
            set(settings) & set(config)
        ):
            return None
        return json.dumps({**config, **settings}, indent=2) + "\n"

    def _pipeline_files(self) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
        """The texts of `modules.json` and `sentence_bert_config.json`, and of the module
        folders' files (`1_Pooling/config.json`), that describe this encoder's pipeline."""
        modules = [{"idx": 0, "name": "0", "path": "", "type": TRANSFORMER}]
        modules.append({"idx": 1, "name": "1", "path": POOLING_FOLDER, "type": POOLING})
        if self.normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": NORMALIZE})
        pooling = {"word_embedding_dimension": self.model.config.hidden_size}
        if self.pooling == tuple(m for m in POOLING_MODES if m in self.pooling):
            # The booleans every sentence-transformers version reads; they fix this order.
            pooling.update({key: mode in self.pooling for key, mode in LEGACY_POOLING_KEYS.items()})
        else:
            pooling["pooling_mode"] = list(self.pooling)  # sentence-transformers 6 keeps any order
        settings = {"max_seq_length": self.max_seq_length, "do_lower_case": self.do_lower_case}
        files = {
            ckpt.ST_CONFIG: json.dumps(settings, indent=2) + "\n",
            ckpt.ST_MODULES: json.dumps(modules, indent=2) + "\n",
        }
        return files, {POOLING_FOLDER: {"config.json": json.dumps(pooling, indent=2) + "\n"}}
