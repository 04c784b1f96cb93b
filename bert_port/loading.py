"""Loading an HF checkpoint into a port model: `from_pretrained` and `load_hf_state_dict`,
the last as a row of named steps. What `from_pretrained` accepts is decided in
`loader_arguments`. Both become methods of every port model: this module sets them on
`BertPreTrainedModel` (at its end), since the model layer below cannot import it.

`from_pretrained` builds the model on the meta device and assigns the checkpoint's tensors
in place, so no random initialisation is computed and thrown away and no second copy of the
weights is held. Every missing, unexpected or mis-shaped tensor is reported in one error,
before anything is written into the model.

Read side only: it imports neither `saving` nor the staged writes, so loading cannot write.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from . import checkpoint as ckpt
from . import speed
from .base_bert import BertPreTrainedModel, meta_init
from .config import BertConfig, ConfigError
from .devices import resolve_device
from .loader_arguments import (
    check_finite_mode,
    init_kwarg_names,
    refuse_unsupported,
    resolve_config,
    resolve_device_map,
    resolve_dtype,
    resolve_dtypes,
    resolve_quantization,
)

log = logging.getLogger(__name__)

# -----------------------------------------------------------------------------------------
# Building and loading a model


def from_pretrained(
    cls: type[BertPreTrainedModel],
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
    quantization: str | None = None,
    optimize: bool | None = None,
    batch_invariant: bool = True,
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
    check_finite: for NaN/Inf weights, "error" (default: `CheckpointError`), "warn" or "ignore".
    revision: the cache ref or commit hash to use for a model id.
    cache_dir: the HF cache to look a model id up in, instead of the one the environment
        names (HF_HUB_CACHE, HF_HOME, ...), as in transformers.
    local_files_only: accepted for transformers' calls and ignored (every load is local).
    output_loading_info: also return `model.loading_info` (what was renamed, dropped,
        skipped or newly initialised), as transformers' flag of the same name does.
    quantization: "int8" makes the encoder's dense layers int8 for CPU inference (`speed.quantize`,
        calibrated with the checkpoint's tokenizer); None (default) keeps floating point.
    optimize, batch_invariant: swap in the fast modules (`speed.optimize`), batch-invariant or not;
        `optimize=False`, and by default eager attention, give the plain model of bert.py.
    Other keyword arguments override config fields (e.g. `attn_implementation="eager"`,
    `num_labels=3`, or any field the checkpoint's config.json has) or go to the
    constructor (e.g. `add_pooling_layer=False`); anything else is a `TypeError`
    (`LoaderArgumentError`) naming it, as in transformers, and saying why for transformers
    loader arguments the port does not support (`token`, `trust_remote_code`, ...). Runtime
    choices (`attn_implementation`, `optimize`, dtype, device) are never written to
    config.json by `save_pretrained`. Returns the model in eval mode.
    """
    refuse_unsupported(cls, kwargs)
    check_finite_mode(check_finite)
    dtype = resolve_dtypes(dtype, torch_dtype)
    device = resolve_device_map(device, device_map)  # before any file is read
    if resolve_quantization(quantization, dtype, device):
        dtype = torch.float32  # int8 quantizes the float32 weights, whatever the checkpoint holds
    files, config, weights, init_kwargs = _read_snapshot(cls, path, config_file, revision, cache_dir, config, kwargs)
    model = build_and_load(
        cls, config, weights, files, init_kwargs=init_kwargs, dtype=dtype, device=device, check_finite=check_finite
    )
    _apply_speed(model, optimize, batch_invariant, quantization)
    return (model, model.loading_info) if output_loading_info else model


def _apply_speed(model: BertPreTrainedModel, optimize: bool | None, batch_invariant: bool, quantization) -> None:
    """`from_pretrained`'s speed layer: `speed.optimize` unless the plain model is asked for
    (`optimize=False`, or by default eager attention, transformers' exact path), then int8."""
    if optimize is None:
        optimize = model.config.attn_implementation != "eager"
    if optimize or quantization is not None:
        speed.optimize(model, batch_invariant=batch_invariant)
        if quantization is not None:
            speed.quantization.quantize_for_loading(model)


def _read_snapshot(cls, path, config_file, revision, cache_dir, config, kwargs):
    """The checkpoint's files, config, weights and constructor arguments (popped from
    `kwargs`). The folder is found first and its files are read only under its lock: config
    and weights of one save, however saves race."""
    with ckpt.read_snapshot(ckpt.checkpoint_folder(path, revision, cache_dir)):
        files = ckpt.locate_checkpoint(path, config_file, revision, cache_dir)
        init_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in init_kwarg_names(cls)}
        config = resolve_config(cls, files, config, kwargs)
        return files, config, read_checkpoint(files, config), init_kwargs


def read_checkpoint(files: ckpt.CheckpointFiles, config: BertConfig) -> ckpt.Weights:
    """The checkpoint's tensors (memory-mapped for safetensors) and their file spans, refused
    before any module is built when the config leaves no position for a token or asks for layers
    the file lacks. Call it inside `ckpt.read_snapshot(files.directory)`, so that config and
    weights come from one save."""
    problem = config.family.positions_problem(config.pad_token_id, config.max_position_embeddings)
    if problem:
        raise ConfigError(f"{files.config_file}: {problem}")
    weights = ckpt.read_weights(files.weights_file)
    ckpt.check_layer_count(weights.tensors, config.num_hidden_layers, str(files.weights_file))
    return weights


def build_and_load(
    cls: type[BertPreTrainedModel],
    config: BertConfig,
    weights: ckpt.Weights,
    files: ckpt.CheckpointFiles,
    *,
    init_kwargs: dict | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    check_finite: str = "error",
) -> BertPreTrainedModel:
    """`cls` built on the meta device and given the checkpoint's tensors (`load_hf_state_dict`),
    remembering the checkpoint's folder for its tokenizer and sentence-transformers files;
    in eval mode. `from_pretrained` and `bert-port-convert` both load through here."""
    with meta_init():
        model = cls(config, **(init_kwargs or {}))
    load_hf_state_dict(
        model,
        weights.tensors,
        dtype=dtype,
        device=device,
        check_finite=check_finite,
        source=str(files.weights_file),
        spans=weights.spans,
    )
    model.source_dir = files.directory
    return model.eval()


# -----------------------------------------------------------------------------------------
# load_hf_state_dict and its steps


@dataclass
class Incoming:
    """A checkpoint's tensors on their way into a model, under the model's state-dict names."""

    tensors: dict[str, Tensor]
    sources: dict[str, str]  # model key -> the key in the file
    conversion: ckpt.Conversion  # what the key table did: renamed, dropped, buffers, the file's layout
    encoder_prefix: str  # "bert." for a task model
    tied: list[str] = field(default_factory=list)  # tied copies the file holds, equal to their sources

    def name(self, key: str) -> str:
        """A tensor as the file names it (or, for one it lacks, would), since that is what the
        user can look up; then the port's name, where it differs."""
        in_file = self.sources.get(key) or self.conversion.layout.spell(key.removeprefix(self.encoder_prefix))
        return in_file if in_file == key else f"{in_file} -> {key}"


def load_hf_state_dict(
    model: BertPreTrainedModel,
    state_dict: dict[str, Tensor],
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    check_finite: str = "error",
    source: str = "state dict",
    spans: dict[str, ckpt.FileSpan] | None = None,
) -> list[str]:
    """Load an HF-named state dict into `model` strictly. Returns the keys initialised afresh.
    `spans` (by the file's key names, from `ckpt.read_weights`) lets the NaN/Inf check read
    memory-mapped tensors from their files.

    Raises `CheckpointError` listing every missing, unexpected and mis-shaped key
    before anything is written into the model.
    """
    check_finite_mode(check_finite)
    dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    incoming = place_under_encoder(model, convert_keys(model, state_dict))
    resolve_tied(model, incoming, source)
    expected = {k: v for k, v in model.state_dict().items() if k not in model.tied_weights}
    account = ckpt.keys.account_keys(
        incoming.tensors, expected, init_if_missing_prefixes(model), unused_ok_prefixes(model)
    )
    check_kinds_and_shapes(incoming, expected, account, source)
    check_finite_values(incoming, check_finite, source, spans or {})
    if account.unused:
        log.warning(
            "%s: not used by %s (ignored): %s",
            source,
            type(model).__name__,
            ", ".join(map(incoming.name, account.unused)),
        )
    target = pick_dtype(incoming, account.unused, dtype, source)
    assign(model, cast(incoming, account.unused, target, device), dtype, device)
    model.loading_info = {
        "renamed": dict(incoming.conversion.renamed),  # checkpoint key -> HF name (prefixes, gamma/beta)
        "dropped": list(incoming.conversion.dropped),  # pretraining heads
        "buffers": list(incoming.conversion.buffers),  # position_ids / token_type_ids, recomputed
        "unused": account.unused,
        "newly_initialized": account.initialised,
        "tied": incoming.tied,  # tied copies in the file, equal to what they are tied to
    }
    if account.initialised:
        materialize_new(model, account.initialised, dtype, device)
        log.warning(
            "%s: newly initialised (not in the checkpoint): %s", type(model).__name__, ", ".join(account.initialised)
        )
    model.tie_weights()  # an assigning load replaced the tied parameters' sources
    return account.initialised


def convert_keys(model: BertPreTrainedModel, state_dict: dict[str, Tensor]) -> ckpt.Conversion:
    """The file's tensors under port names (the key tables of the model's family, its head's among
    them); the pretraining heads this model owns (`hf_head_prefixes`) are kept, the others dropped."""
    table = model.config.family.key_table
    heads = ckpt.head_table(table, model.head_keys)  # RoBERTa's lm_head.* and the like, under the port's names
    return ckpt.hf_to_port(state_dict, keep_heads=model.hf_head_prefixes, table=table, heads=heads)


def place_under_encoder(model: BertPreTrainedModel, conversion: ckpt.Conversion) -> Incoming:
    """Encoder keys move under the encoder's attribute (`bert.` in a task model); heads and
    keys the table does not know stay where they are."""
    prefix = model.port_encoder_prefix
    keep = set(conversion.unmapped)

    def place(k: str) -> str:
        return k if not prefix or k in keep or k.startswith(ckpt.HEAD_PREFIXES) else prefix + k

    return Incoming(
        tensors={place(k): v for k, v in conversion.state_dict.items()},
        sources={place(k): raw for k, raw in conversion.sources.items()},
        conversion=conversion,
        encoder_prefix=prefix,
    )


def resolve_tied(model: BertPreTrainedModel, incoming: Incoming, source: str) -> None:
    """Take the tied copies out of `incoming`. A tied copy in the file (`.bin` checkpoints hold
    the MLM decoder beside the embedding it is tied to) must equal what it is tied to; it is
    then not loaded, only tied. A tied copy without what it is tied to (a file holding
    `cls.predictions.decoder.bias` but no `cls.predictions.bias`) is that tensor: it loads under
    the source's name, as transformers 5 loads it."""
    tensors, sources, ties = incoming.tensors, incoming.sources, model.tied_weights
    tied = [k for k in tensors if k in ties]
    untied = [
        k for k in tied if ties[k] in tensors and not torch.equal(tensors[k], tensors[ties[k]].to(tensors[k].dtype))
    ]
    if untied:
        raise ckpt.CheckpointError(
            f"cannot load {source}: "
            + ", ".join(f"{incoming.name(k)} differs from {incoming.name(ties[k])}" for k in untied)
            + f", which {type(model).__name__} ties together because its config says tie_word_embeddings=true; "
            "this checkpoint's head is untied: load it with tie_word_embeddings=False (from_pretrained(path, "
            "tie_word_embeddings=False)) and its decoder is read as a tensor of its own. Nothing was loaded"
        )
    for k in tied:
        if ties[k] not in tensors:
            tensors[ties[k]], sources[ties[k]] = tensors[k], sources[k]
    for k in tied:
        del tensors[k]
    incoming.tied = tied


def init_if_missing_prefixes(model: BertPreTrainedModel) -> tuple[str, ...]:
    """Prefixes of the port keys a checkpoint may lack: `keys_to_init_if_missing` and, when
    the model has a pooling layer, the pooler, which transformers initialises (with a
    warning) when a BertModel loads a checkpoint saved without one (BertForMaskedLM's)."""
    pooler = (model.port_encoder_prefix + "pooler_dense.",) if model.encoder.add_pooling_layer else ()
    return model.keys_to_init_if_missing + pooler


def unused_ok_prefixes(model: BertPreTrainedModel) -> tuple[str, ...]:
    """Prefixes of file keys fine to ignore: a task head (a fine-tuned classifier's
    `classifier.*`) for a model without that head, and a pooler for a model built without one
    (MLM, token and QA models), as transformers does."""
    pooler = ("pooler_dense.", "bert.pooler_dense.") if not model.encoder.add_pooling_layer else ()
    return ckpt.HEAD_PREFIXES + pooler


def _wrong_kind(incoming: Tensor, expected: Tensor) -> bool:
    # A tensor the model holds as floating point must be floating in the file (an int64 or
    # bool weight is a broken export, not something to cast); integer buffers keep theirs.
    if incoming.is_floating_point() != expected.is_floating_point():
        return True
    return not expected.is_floating_point() and incoming.dtype != expected.dtype


def check_kinds_and_shapes(
    incoming: Incoming, expected: dict[str, Tensor], account: ckpt.keys.KeyAccount, source: str
) -> None:
    """One `CheckpointError` listing every missing, unexpected, mis-shaped and wrongly typed
    tensor, or nothing."""
    tensors = incoming.tensors
    mismatched = [k for k in tensors if k in expected and tensors[k].shape != expected[k].shape]
    wrong_kind = [
        k for k in tensors if k in expected and k not in set(mismatched) and _wrong_kind(tensors[k], expected[k])
    ]
    if account.missing or account.unexpected or mismatched or wrong_kind:
        missing, unexpected = account.missing, account.unexpected
        message = ckpt.mismatch_message(
            source, incoming.name, tensors, expected, missing, unexpected, mismatched, wrong_kind
        )
        raise ckpt.CheckpointError(message)


def _stacklevel_outside_package() -> int:
    """The `stacklevel` that points a warning at the first caller outside bert_port (the
    user's line), however many of the loader's steps lie between."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("bert_port"):
        frame, level = frame.f_back, level + 1
    return level


def check_finite_values(incoming: Incoming, mode: str, source: str, spans: dict[str, ckpt.FileSpan]) -> None:
    """NaN/Inf weights: a `CheckpointError` ("error"), a `RuntimeWarning` ("warn"), or nothing
    ("ignore")."""
    if mode == "ignore":
        return
    named = {incoming.name(k): incoming.sources.get(k) for k in incoming.tensors}
    bad = ckpt.non_finite(
        {incoming.name(k): v for k, v in incoming.tensors.items()},
        {name: spans[key] for name, key in named.items() if key in spans},
    )
    if not bad:
        return
    msg = f"{source} has non-finite weights: " + "; ".join(bad) + "."
    if mode == "error":
        raise ckpt.CheckpointError(msg, hint="Pass {} to load it anyway", argument="check_finite", value="warn")
    warnings.warn(msg, RuntimeWarning, stacklevel=_stacklevel_outside_package())


def pick_dtype(incoming: Incoming, skip: Iterable[str], dtype: torch.dtype | None, source: str) -> torch.dtype | None:
    """One floating dtype for the whole model: the one asked for, else the one most of the
    file's tensors have (transformers casts every tensor to the model's dtype too). An odd
    tensor kept as it is would load, then fail inside forward (fp16 meeting fp32)."""
    skip = set(skip)
    floating = {k: t.dtype for k, t in incoming.tensors.items() if k not in skip and t.is_floating_point()}
    target = dtype or (Counter(floating.values()).most_common(1)[0][0] if floating else None)
    odd = sorted(incoming.name(k) for k, d in floating.items() if d != target)
    if dtype is None and odd:
        log.warning(
            "%s: cast %d tensor(s) to %s, the dtype of the others: %s",
            source,
            len(odd),
            str(target).removeprefix("torch."),
            ckpt.short_list(odd),
        )
    return target


def cast(
    incoming: Incoming, skip: Iterable[str], target: torch.dtype | None, device: torch.device | None
) -> dict[str, Tensor]:
    """The tensors to load (all but `skip`), floating ones in `target`, on `device`."""
    skip = set(skip)
    prepared = {}
    for key, tensor in incoming.tensors.items():
        if key in skip:
            continue
        if target is not None and tensor.is_floating_point():
            tensor = tensor.to(target)
        prepared[key] = tensor.to(device) if device is not None else tensor
    return prepared


def assign(
    model: BertPreTrainedModel, prepared: dict[str, Tensor], dtype: torch.dtype | None, device: torch.device | None
) -> None:
    """A model built on the meta device (from_pretrained) adopts the tensors, no copy made. A
    live model copies them into its parameters, as torch does, so that the caller's tensors
    are not shared and an optimiser built earlier still holds the weights. Everything that can
    fail (names, shapes, dtypes, values, the dtype and device arguments) was checked before,
    so the copies do not stop halfway."""
    if any(p.is_meta for p in model.parameters()):
        model.load_state_dict(prepared, strict=False, assign=True)
        return
    model.load_state_dict(prepared, strict=False)
    if dtype is not None or device is not None:
        model.to(device=device, dtype=dtype)


def materialize_new(
    model: BertPreTrainedModel, keys: list[str], dtype: torch.dtype | None, device: torch.device | None
) -> None:
    """Give the keys the checkpoint lacks (still on the meta device) memory and the model's
    initialisation, in the dtype and on the device of the loaded weights."""
    owners = {k.rsplit(".", 1)[0] for k in keys}
    reference = next(p for p in model.parameters() if not p.is_meta)
    for name in owners:
        module = model.get_submodule(name)
        # Only the missing tensors are new: a loaded one beside them (a file with the pooler's
        # weight but not its bias) is put back after the module is initialised.
        # (to_empty may swap a parameter's data in place, hence the detached reference.)
        loaded = {
            n: p.detach()
            for n, p in module.named_parameters(recurse=False)
            if not p.is_meta and f"{name}.{n}" not in keys
        }
        module.to_empty(device=device or reference.device, recurse=False)
        model._init_weights(module)
        module.to(dtype or reference.dtype)
        for attr, tensor in loaded.items():
            getattr(module, attr).data = tensor


# The model's methods (see base_bert): the model layer cannot import this module, so it sets them.
BertPreTrainedModel.from_pretrained = classmethod(from_pretrained)
BertPreTrainedModel.load_hf_state_dict = load_hf_state_dict
