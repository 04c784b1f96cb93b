"""`BertPreTrainedModel`: weight initialisation, `from_pretrained`, `save_pretrained`.

Loading builds the model on the meta device and assigns the checkpoint's tensors in
place, so no random initialisation is computed and thrown away and no second copy of the
weights is held. Every missing, unexpected or mis-shaped tensor is reported in one error.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn

from . import checkpoint as ckpt
from .config import SHAPE_FIELDS, BertConfig

log = logging.getLogger(__name__)


CHECK_FINITE_MODES = ("error", "warn", "ignore")


_NO_NETWORK = "the port never uses the network: it reads local folders and the local HF cache only"
_ONE_DEVICE = "the port keeps the whole model on one device (pass device= or device_map='cuda:0')"
_NO_QUANTISATION = "quantised loading is not supported; load in floating point (dtype=torch.float16, ...)"
_NOT_TORCH = "only PyTorch (.bin) and safetensors weights are read; convert the weights with transformers first"
# transformers' from_pretrained arguments the port does not take, and why: a user passing them
# is told so, not to check the spelling.
UNSUPPORTED_LOADER_ARGUMENTS = {
    "token": _NO_NETWORK,
    "use_auth_token": _NO_NETWORK,
    "force_download": _NO_NETWORK,
    "resume_download": _NO_NETWORK,
    "proxies": _NO_NETWORK,
    "mirror": _NO_NETWORK,
    "trust_remote_code": "the port runs only its own BERT code, never code shipped with a checkpoint",
    "low_cpu_mem_usage": (
        "there is nothing to switch: loading always builds the model on the meta device and adopts the "
        "checkpoint's tensors, without a second copy"
    ),
    "subfolder": "pass the subfolder's path itself as the checkpoint",
    "from_tf": _NOT_TORCH,
    "from_flax": _NOT_TORCH,
    "use_safetensors": "the loader takes model.safetensors when there is one, else pytorch_model.bin",
    "variant": "variant weight files (model.fp16.safetensors) are not looked for; pass the weights file itself",
    "quantization_config": _NO_QUANTISATION,
    "load_in_8bit": _NO_QUANTISATION,
    "load_in_4bit": _NO_QUANTISATION,
    "max_memory": _ONE_DEVICE,
    "offload_folder": _ONE_DEVICE,
    "offload_state_dict": _ONE_DEVICE,
    "offload_buffers": _ONE_DEVICE,
    "tp_plan": _ONE_DEVICE,
    "key_mapping": "checkpoint names are mapped by the port's own key table (bert_port.checkpoint.keys)",
}


class LoaderArgumentError(TypeError):
    """A keyword argument `from_pretrained` does not take: transformers loader arguments the
    port does not support (each said why), or names that are neither an argument nor a config
    field (`unknown`). `named` gives the same error for a caller's own from_pretrained."""

    def __init__(self, owner: str, unsupported: list[str], unknown: list[str], arguments: Iterable[str]):
        self.owner, self.unsupported, self.unknown = owner, unsupported, unknown
        self.arguments = sorted(set(arguments))
        parts = [f"{owner}() does not support {k}=: {UNSUPPORTED_LOADER_ARGUMENTS[k]}" for k in unsupported]
        if unknown:
            parts.append(
                f"{owner}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}: not a "
                f"from_pretrained argument ({', '.join(self.arguments)}), nor a field of BertConfig or of the "
                "checkpoint's config.json; check the spelling"
            )
        super().__init__("; ".join(parts))

    def named(self, owner: str, arguments: Iterable[str] = ()) -> LoaderArgumentError:
        return LoaderArgumentError(owner, self.unsupported, self.unknown, [*self.arguments, *arguments])


@contextmanager
def meta_init() -> Iterator[None]:
    """Build modules on the meta device without running their random initialisers: the
    weights are about to be replaced by the checkpoint's, and `normal_` on a meta tensor
    imports torch._dynamo (seconds, on the first load in a process). Like transformers'
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


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A floating dtype from `torch.float16`, `"float16"`, `"torch.float16"`, or None /
    `"auto"` for the checkpoint's own (as transformers accepts them). Anything else is a
    `ValueError`, raised before a file is read or a tensor is touched."""
    if dtype is None or dtype == "auto":
        return None
    resolved = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(
            f"dtype must be a floating torch dtype (torch.float32, 'float16', 'bfloat16', ...) or 'auto', "
            f"got {dtype!r}: BERT's weights are floating point"
        )
    return resolved


def _resolve_device(device: str | torch.device | None) -> torch.device | None:
    try:
        return torch.device(device) if device is not None else None
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a device torch knows ({exc})") from None


def resolve_device_map(device: str | torch.device | None, device_map: object) -> torch.device | None:
    """transformers' `device_map` when it names one device (`"cuda:0"`, `0`, `torch.device`,
    `{"": "cuda:0"}`, or `"auto"`: the accelerator when there is one, else the CPU); this port
    holds a model on one device, so a map over several is a `ValueError`."""
    if device_map is None:
        return _resolve_device(device)
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if isinstance(device_map, dict):
        # A dict is a valid device_map; what it asks for (several devices) is not supported.
        raise ValueError(  # noqa: TRY004
            f"device_map {device_map!r} spreads the model over several devices; this port keeps a model on "
            "one device: pass one device, e.g. device_map='cuda:0' or device='cpu'"
        )
    if device_map == "auto":
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        device_map = accelerator if accelerator is not None else "cpu"
    resolved = _resolve_device(device_map)
    if device is not None and _resolve_device(device) != resolved:
        raise ValueError(f"device={device!r} and device_map={device_map!r} disagree; pass only one of them")
    return resolved


def _check_finite_mode(mode: str) -> None:
    if mode not in CHECK_FINITE_MODES:
        raise ValueError(f"check_finite must be one of {CHECK_FINITE_MODES}, got {mode!r}")


def _same_shape(config_file: Path, config: dict) -> bool:
    """Whether the config.json already in a folder (if any) describes a model shaped like
    `config`. No config there: nothing says its tokenizer files belong to another model."""
    try:
        previous = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        return False
    return isinstance(previous, dict) and all(previous.get(f) == config.get(f) for f in SHAPE_FIELDS)


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

    # -- loading ----------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device | None = None,
        torch_dtype: torch.dtype | str | None = None,
        device_map: str | int | torch.device | dict | None = None,
        config: BertConfig | None = None,
        config_file: str | os.PathLike | None = None,
        check_finite: str = "error",
        revision: str = "main",
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = True,
        output_loading_info: bool = False,
        **kwargs,
    ):
        """Load an HF BERT checkpoint: a directory, a weights file (with `config.json`
        beside it or `config_file=`), or a model id (`bert-base-uncased`, `org/name`)
        found in the local HF cache, never over the network.

        dtype: cast floating weights to it (a torch dtype or its name, "float16"); None or
            "auto" keeps the checkpoint's, casting any odd tensor to the dtype most of its
            tensors have, as transformers does. `torch_dtype` is transformers' older name for it.
        device: where the weights go (default CPU). `device_map` (transformers' name) may give
            it instead, as one device ("cuda:0", 0, {"": "cuda:0"}, "auto").
        check_finite: "error" (default, raises `CheckpointError`), "warn" (`RuntimeWarning`)
            or "ignore" for NaN/Inf weights.
        revision: the cache ref or commit hash to use for a model id.
        cache_dir: the HF cache to look a model id up in, instead of the one the environment
            names (HF_HUB_CACHE, HF_HOME, ...), as in transformers.
        local_files_only: accepted for transformers' calls and ignored: the port never uses
            the network, so every load is local.
        output_loading_info: also return `model.loading_info` (what was renamed, dropped,
            skipped or newly initialised), as transformers' flag of the same name does.
        Other keyword arguments override config fields (e.g. `attn_implementation="eager"`,
        `num_labels=3`, or any field the checkpoint's config.json has) or go to the
        constructor (e.g. `add_pooling_layer=False`); anything else is a `TypeError`
        (`LoaderArgumentError`) naming it, as in transformers, and saying why for transformers
        loader arguments the port does not support (`token`, `trust_remote_code`, ...). Runtime choices (`attn_implementation`, `unpad_inputs`, dtype,
        device) are never written to config.json by `save_pretrained`. Returns the model in
        eval mode.
        """
        unsupported = [k for k in kwargs if k in UNSUPPORTED_LOADER_ARGUMENTS]
        if unsupported:
            raise LoaderArgumentError(f"{cls.__name__}.from_pretrained", unsupported, [], cls._argument_names())
        _check_finite_mode(check_finite)
        if torch_dtype is not None:
            if dtype is not None and resolve_dtype(dtype) != resolve_dtype(torch_dtype):
                raise ValueError(f"dtype={dtype!r} and torch_dtype={torch_dtype!r} disagree; pass only dtype")
            dtype = torch_dtype
        dtype = resolve_dtype(dtype)
        device = resolve_device_map(device, device_map)  # before any file is read
        directory = ckpt.locate_checkpoint(path, config_file, revision, cache_dir).directory
        with ckpt.read_snapshot(directory):  # config and weights of one save
            files = ckpt.locate_checkpoint(path, config_file, revision, cache_dir)
            init_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in cls._init_kwarg_names()}
            cls._check_overrides(kwargs, config if config is not None else files.config_file)
            if config is None:
                config = BertConfig.from_json_file(files.config_file, **kwargs)
            elif kwargs:
                runtime = {"attn_implementation": config.attn_implementation, "unpad_inputs": config.unpad_inputs}
                config = BertConfig.from_dict(config.to_dict(), **{**runtime, **kwargs})
            weights = ckpt.read_weights(files.weights_file)
        ckpt.check_layer_count(weights.tensors, config.num_hidden_layers, str(files.weights_file))
        with meta_init():
            model = cls(config, **init_kwargs)
        model.load_hf_state_dict(
            weights.tensors,
            dtype=dtype,
            device=device,
            check_finite=check_finite,
            source=str(files.weights_file),
            spans=weights.spans,
        )
        model.source_dir = files.directory
        model.eval()
        return (model, model.loading_info) if output_loading_info else model

    @classmethod
    def _check_overrides(cls, overrides: dict, config: BertConfig | Path) -> None:
        """A `TypeError` naming every keyword that is neither a config field (BertConfig's, or
        one the checkpoint's config.json has) nor an argument: transformers refuses those too,
        and keeping them would write a typo into config.json."""
        fields = BertConfig.field_names()
        unknown = [k for k in overrides if k not in fields]
        if unknown:
            known = config if isinstance(config, BertConfig) else BertConfig.from_json_file(config)
            unknown = [k for k in unknown if k not in known.extra]
        if unknown:
            raise LoaderArgumentError(f"{cls.__name__}.from_pretrained", [], unknown, cls._argument_names())

    @classmethod
    def _argument_names(cls) -> set[str]:
        """The keyword arguments from_pretrained takes (its own and the constructor's)."""
        own = inspect.signature(BertPreTrainedModel.from_pretrained.__func__).parameters
        return {n for n, p in own.items() if p.kind == p.KEYWORD_ONLY} | cls._init_kwarg_names()

    @classmethod
    def _init_kwarg_names(cls) -> set[str]:
        return set(inspect.signature(cls.__init__).parameters) - {"self", "config"}

    def load_hf_state_dict(
        self,
        state_dict: dict[str, Tensor],
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        check_finite: str = "error",
        source: str = "state dict",
        spans: dict | None = None,
    ) -> list[str]:
        """Load an HF-named state dict strictly. Returns the keys initialised afresh.

        Raises `CheckpointError` listing every missing, unexpected and mis-shaped key
        before anything is written into the model.
        """
        _check_finite_mode(check_finite)
        dtype = resolve_dtype(dtype)
        device = _resolve_device(device)
        conversion = ckpt.hf_to_port(state_dict, keep_heads=self.hf_head_prefixes)
        incoming, sources = conversion.state_dict, conversion.sources
        if self.port_encoder_prefix:  # encoder keys move under the encoder's attribute; heads and unmapped stay
            keep = set(conversion.unmapped)

            def place(k: str) -> str:
                return k if k in keep or k.startswith(ckpt.HEAD_PREFIXES) else self.port_encoder_prefix + k

            incoming = {place(k): v for k, v in incoming.items()}
            sources = {place(k): raw for k, raw in sources.items()}

        def name(key: str) -> str:
            # Errors name a tensor as the file does (or, for one it lacks, would), since that
            # is what the user can look up; then the port's name, where it differs.
            in_file = sources.get(key) or conversion.layout.spell(key.removeprefix(self.port_encoder_prefix))
            return in_file if in_file == key else f"{in_file} -> {key}"

        expected = {k: v for k, v in self.state_dict().items() if k not in self.tied_weights}
        # A tied copy in the file (`.bin` checkpoints hold the MLM decoder beside the embedding
        # it is tied to) must equal what it is tied to; it is then not loaded, only tied.
        tied = [k for k in incoming if k in self.tied_weights]
        untied = [
            k
            for k in tied
            if self.tied_weights[k] in incoming
            and not torch.equal(incoming[k], incoming[self.tied_weights[k]].to(incoming[k].dtype))
        ]
        if untied:
            raise ckpt.CheckpointError(
                f"cannot load {source}: "
                + ", ".join(f"{name(k)} differs from {name(self.tied_weights[k])}" for k in untied)
                + f", which {type(self).__name__} ties together (as transformers does with tie_word_embeddings); "
                "this checkpoint has untied heads, which the port does not support. Nothing was loaded"
            )
        # A tied copy without what it is tied to (a file holding `cls.predictions.decoder.bias`
        # but no `cls.predictions.bias`) is that tensor: it loads under the source's name, as
        # transformers 5 loads it.
        for k in tied:
            source_key = self.tied_weights[k]
            if source_key not in incoming:
                incoming[source_key], sources[source_key] = incoming[k], sources[k]
        incoming = {k: v for k, v in incoming.items() if k not in tied}

        missing = [k for k in expected if k not in incoming]
        new_keys = [k for k in missing if k.startswith(self.init_if_missing_prefixes)]
        missing = [k for k in missing if k not in new_keys]
        unexpected = [k for k in incoming if k not in expected]
        unused = [k for k in unexpected if self._is_unused_ok(k)]
        unexpected = [k for k in unexpected if k not in unused]
        mismatched = [k for k in incoming if k in expected and incoming[k].shape != expected[k].shape]

        # A tensor the model holds as floating point must be floating in the file (an int64 or
        # bool weight is a broken export, not something to cast); integer buffers keep theirs.
        wrong_kind = [
            k
            for k in incoming
            if k in expected
            and k not in mismatched
            and (
                incoming[k].is_floating_point() != expected[k].is_floating_point()
                or (not expected[k].is_floating_point() and incoming[k].dtype != expected[k].dtype)
            )
        ]
        if missing or unexpected or mismatched or wrong_kind:
            raise ckpt.CheckpointError(
                self._describe_mismatch(source, name, incoming, expected, missing, unexpected, mismatched, wrong_kind)
            )
        if check_finite != "ignore":
            spans = spans or {}
            bad = ckpt.non_finite(
                {name(k): v for k, v in incoming.items()},
                {name(k): spans[sources[k]] for k in incoming if sources.get(k) in spans},
            )
            if bad:
                msg = f"{source} has non-finite weights: " + "; ".join(bad) + "."
                if check_finite == "error":
                    raise ckpt.CheckpointError(
                        msg, hint="Pass {} to load it anyway", argument="check_finite", value="warn"
                    )
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
        if unused:
            log.warning("%s: not used by %s (ignored): %s", source, type(self).__name__, ", ".join(map(name, unused)))

        # One floating dtype for the whole model: the one asked for, else the one most of the
        # file's tensors have (transformers casts every tensor to the model's dtype too). An
        # odd tensor kept as it is would load, then fail inside forward (fp16 meeting fp32).
        floating = [t.dtype for k, t in incoming.items() if k not in unused and t.is_floating_point()]
        target = dtype or (Counter(floating).most_common(1)[0][0] if floating else None)
        odd = sorted(
            name(k) for k, t in incoming.items() if k not in unused and t.is_floating_point() and t.dtype != target
        )
        if dtype is None and odd:
            log.warning(
                "%s: cast %d tensor(s) to %s, the dtype of the others: %s",
                source,
                len(odd),
                str(target).removeprefix("torch."),
                ckpt.short_list(odd),
            )
        prepared = {}
        for key, tensor in incoming.items():
            if key in unused:
                continue
            if target is not None and tensor.is_floating_point():
                tensor = tensor.to(target)
            if device is not None:
                tensor = tensor.to(device)
            prepared[key] = tensor
        if any(p.is_meta for p in self.parameters()):
            # Built on the meta device (from_pretrained): adopt the tensors, no copy made.
            self.load_state_dict(prepared, strict=False, assign=True)
        else:
            # A live model: copy into its parameters, as torch does, so that the caller's
            # tensors are not shared and an optimiser built earlier still holds the weights.
            # Everything that can fail (names, shapes, dtypes, values, the dtype and device
            # arguments) was checked above, so the copies below do not stop halfway.
            self.load_state_dict(prepared, strict=False)
            if dtype is not None or device is not None:
                self.to(device=device, dtype=dtype)
        self.loading_info = {
            "renamed": dict(conversion.renamed),  # checkpoint key -> HF name (prefixes, gamma/beta)
            "dropped": list(conversion.dropped),  # pretraining heads
            "buffers": list(conversion.buffers),  # position_ids / token_type_ids, recomputed
            "unused": unused,
            "newly_initialized": new_keys,
            "tied": tied,  # tied copies in the file, equal to what they are tied to
        }
        if new_keys:
            self._materialize_new(new_keys, dtype, device)
            log.warning("%s: newly initialised (not in the checkpoint): %s", type(self).__name__, ", ".join(new_keys))
        self.tie_weights()  # an assigning load replaced the tied parameters' sources
        return new_keys

    @property
    def init_if_missing_prefixes(self) -> tuple[str, ...]:
        """Prefixes of the port keys a checkpoint may lack: `keys_to_init_if_missing` and, when
        the model has a pooling layer, the pooler, which transformers initialises (with a
        warning) when a BertModel loads a checkpoint saved without one (BertForMaskedLM's)."""
        pooler = (self.port_encoder_prefix + "pooler_dense.",) if self.encoder.add_pooling_layer else ()
        return self.keys_to_init_if_missing + pooler

    def _is_unused_ok(self, key: str) -> bool:
        # A checkpoint's pooler is fine to ignore for a model built without one, and a task
        # head (a fine-tuned classifier's `classifier.*`) for a model without that head, as
        # transformers does when a BertModel loads a BertForSequenceClassification checkpoint.
        if key.startswith(ckpt.HEAD_PREFIXES):
            return True
        # The BertModel decides (a task model's `bert`): MLM, token and QA models have no pooler.
        return key.startswith(("pooler_dense.", "bert.pooler_dense.")) and not self.encoder.add_pooling_layer

    def _materialize_new(self, keys: list[str], dtype: torch.dtype | None, device: torch.device | None) -> None:
        owners = {k.rsplit(".", 1)[0] for k in keys}
        reference = next(p for p in self.parameters() if not p.is_meta)
        for name in owners:
            module = self.get_submodule(name)
            # Only the missing tensors are new: a loaded one beside them (a file with the pooler's
            # weight but not its bias) is put back after the module is initialised.
            # (to_empty may swap a parameter's data in place, hence the detached reference.)
            loaded = {
                n: p.detach()
                for n, p in module.named_parameters(recurse=False)
                if not p.is_meta and f"{name}.{n}" not in keys
            }
            module.to_empty(device=device or reference.device, recurse=False)
            self._init_weights(module)
            module.to(dtype or reference.dtype)
            for attr, tensor in loaded.items():
                getattr(module, attr).data = tensor

    @staticmethod
    def _describe_mismatch(source, name, incoming, expected, missing, unexpected, mismatched, wrong_kind=()) -> str:
        limit = 50  # per list: a config or file off by thousands of tensors still gives a readable error

        def listed(keys, describe):
            out = [f"    {describe(k)}" for k in keys[:limit]]
            return out + ([f"    ... and {len(keys) - limit} more"] if len(keys) > limit else [])

        lines = [
            (
                f"cannot load {source}: the checkpoint does not fit the model. "
                "Tensors are named as in the file (-> the port's name, where it differs)."
            )
        ]
        if missing:
            lines.append(f"  missing ({len(missing)}), the model needs these and the checkpoint lacks them:")
            lines += listed(missing, lambda k: f"{name(k)}: expected {tuple(expected[k].shape)}")
        if unexpected:
            lines.append(f"  unexpected ({len(unexpected)}), in the checkpoint but not in the model:")
            lines += listed(unexpected, lambda k: f"{name(k)}: {tuple(incoming[k].shape)}")
        if wrong_kind:
            lines.append(f"  wrong dtype ({len(wrong_kind)}), not castable to what the model holds:")
            lines += listed(
                wrong_kind, lambda k: f"{name(k)}: checkpoint {incoming[k].dtype}, model {expected[k].dtype}"
            )
        if mismatched:
            lines.append(f"  wrong shape ({len(mismatched)}):")
            lines += listed(
                mismatched,
                lambda k: f"{name(k)}: checkpoint {tuple(incoming[k].shape)}, model {tuple(expected[k].shape)}",
            )
            lines.append(
                "  Shapes come from config.json (hidden_size, vocab_size, intermediate_size, ...): check that "
                "the config belongs to these weights."
            )
        lines.append("Nothing was loaded. Check that the checkpoint is a BERT model matching its config.json.")
        return "\n".join(lines)

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
        follows, tied output embeddings (the MLM decoder and its bias) are resized with it.

        New rows: with `mean_resizing` the mean of the old rows (new output-bias entries are
        zero, as transformers 5 leaves them for a tied decoder). transformers samples them from a normal around that mean with covariance 1e-9 times the
        old rows' (a spread of about 3e-5 of theirs), so its rows differ from ours by that noise;
        ours are deterministic. Without it, N(0, initializer_range) as a fresh model's.
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
            self._resize_output_bias(new_num, mean_resizing)
        self.config.vocab_size = new_num
        self.tie_weights()
        return embedding

    def _resize_output_bias(self, new_num: int, mean_resizing: bool) -> None:
        """Resize the output layer's own bias (tied models): overridden by the MLM heads."""

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

    # -- saving -----------------------------------------------------------------------

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The state dict under Hugging Face names (the inverse of the key table)."""
        state = {
            k.removeprefix(self.port_encoder_prefix): v
            for k, v in self.state_dict().items()
            if k not in self.tied_weights  # written once, under the name of what they are tied to
        }
        return ckpt.port_to_hf(state, encoder_prefix=self.hf_encoder_prefix)

    def save_pretrained(self, save_directory: str | os.PathLike, max_shard_size: int | str = "5GB") -> Path:
        """Write an HF-format checkpoint that `transformers` loads: `config.json` (every
        field that was read, plus `architectures` and `dtype`, which describe what is
        saved), `model.safetensors` under HF names (or shards and an index above
        `max_shard_size`, e.g. "500MB") and, when the model was loaded from a directory with
        tokenizer files, copies of those (another model's tokenizer files in the folder are
        removed, see `_stage_tokenizer`). The save is one `checkpoint.StagedWrite`: files are
        staged under temporary names and committed together under a lock on the folder, so an
        interrupted, killed or concurrent save leaves one whole checkpoint, the old or the new."""
        ckpt.parse_size(max_shard_size)  # a bad size fails before anything is created
        out = Path(save_directory)
        config = self.config.to_dict()
        config["architectures"] = [self.hf_architecture]
        # transformers loads with dtype="auto", i.e. in the config's dtype: it must name the
        # dtype of the saved tensors, not the one the config was read with.
        dtype = next((p.dtype for p in self.parameters() if p.is_floating_point()), torch.float32)
        config["dtype"] = str(dtype).removeprefix("torch.")
        if "torch_dtype" in config:  # the pre-v5 name, kept because it was read, kept true
            config["torch_dtype"] = config["dtype"]
        with ckpt.StagedWrite(out) as stage:
            ckpt.stage_weights(stage, self.hf_state_dict(), max_shard_size)
            self._stage_tokenizer(stage, config)
            self._stage_sentence_transformers(stage)
            stage.text(ckpt.CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")
        return out

    def sentence_transformers_files(self) -> tuple[list[str], list[str]]:
        """The sentence-transformers files and module folders `save_pretrained` copies from the
        folder the model was loaded from: none unless the model keeps them
        (`keeps_sentence_transformers_files`) and that folder has a `modules.json`."""
        source = Path(self.source_dir) if self.source_dir is not None else None
        if not self.keeps_sentence_transformers_files or source is None or not (source / ckpt.ST_MODULES).is_file():
            return [], []
        return [n for n in ckpt.ST_FILES if (source / n).is_file()], ckpt.st_module_folders(source)

    def _stage_sentence_transformers(self, stage: ckpt.StagedWrite) -> None:
        """The folder's sentence-transformers files after the save are the model's, as with
        tokenizer files (`_stage_tokenizer`): those of the folder it was loaded from, copied
        (see `sentence_transformers_files`), so that `SentenceTransformer(saved_dir)` pools and
        normalises as the original did; any other there (another model's `modules.json`,
        settings, and the `{index}_{Module}` folders its modules.json names) is removed in the
        same commit, or SentenceTransformer would run that model's pipeline on this one.
        Module folders are written each as a staged write of their own (a staged write holds
        one folder), before the top-level files commit."""
        out = stage.directory
        source = Path(self.source_dir) if self.source_dir is not None else None
        if source is not None and source.resolve() == out.resolve():
            return  # saved over the folder it came from: its files are its own
        files, folders = self.sentence_transformers_files()
        for folder in folders:
            copies = [p for p in (source / folder).iterdir() if p.is_file() and not p.name.startswith(".")]
            with ckpt.StagedWrite(out / folder) as sub:
                for file in copies:
                    sub.copy(file.name, file)
        for name in files:
            stage.copy(name, source / name)
        try:
            present_folders = ckpt.st_module_folders(out) if (out / ckpt.ST_MODULES).is_file() else []
        except ckpt.CheckpointError:
            present_folders = []  # an unreadable modules.json names no folders; it goes itself
        foreign = [n for n in ckpt.ST_FILES if (out / n).is_file() and n not in files]
        foreign += [f for f in present_folders if f not in folders and ckpt.ST_FOLDER.fullmatch(f)]
        if foreign:
            log.warning(
                "%s: removing sentence-transformers files of the model saved there before: %s", out, ", ".join(foreign)
            )
            for name in foreign:
                stage.remove(name)
        left = [f for f in present_folders if f not in folders and not ckpt.ST_FOLDER.fullmatch(f)]
        if left:
            log.warning("%s: left %s in place (not named as sentence-transformers names module folders)", out, left)

    def _stage_tokenizer(self, stage: ckpt.StagedWrite, config: dict) -> None:
        """The folder's tokenizer files after the save are the model's: those of the directory
        it was loaded from, copied; any other tokenizer file there is deleted, since
        `load_tokenizer` would otherwise pick another model's `tokenizer.json` over the copied
        `vocab.txt`. A model that knows no tokenizer files (built in code) keeps those in the
        folder unless the folder's previous config.json is a model of another shape, whose
        tokenizer they are."""
        out = stage.directory
        present = [n for n in ckpt.TOKENIZER_FILES if (out / n).is_file()]
        source = Path(self.source_dir) if self.source_dir is not None else None
        if source is not None and source.resolve() == out.resolve():
            return  # saved over the folder it came from: its tokenizer files are its own
        own = [n for n in ckpt.TOKENIZER_FILES if source is not None and (source / n).is_file()]
        for name in own:
            stage.copy(name, source / name)
        if own:
            foreign = [n for n in present if n not in own]
        elif present and not _same_shape(out / ckpt.CONFIG_NAME, config):
            foreign = present
        else:
            foreign = []
        if foreign:
            log.warning("%s: removing tokenizer files of the model saved there before: %s", out, ", ".join(foreign))
            for name in foreign:
                stage.remove(name)

    @property
    def hf_architecture(self) -> str:
        return type(self).__name__
