"""Checkpoints: the HF <-> port key table, key normalisation, reading and writing files,
and finding checkpoints in the local Hugging Face cache.

The conversions are pure functions (state dict in, state dict out). File I/O lives in the
`read_*` / `write_*` functions below them, and never in the model.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

# -----------------------------------------------------------------------------------------
# The key table: Hugging Face BertModel name -> port name, "{}" standing for the layer index.
# This is the only place names are spelled out; the inverse is derived from it.

HF_TO_PORT: dict[str, str] = {
    "embeddings.word_embeddings.weight": "word_embedding.weight",
    "embeddings.position_embeddings.weight": "pos_embedding.weight",
    "embeddings.token_type_embeddings.weight": "tk_type_embedding.weight",
    "embeddings.LayerNorm.weight": "embed_layer_norm.weight",
    "embeddings.LayerNorm.bias": "embed_layer_norm.bias",
    "encoder.layer.{}.attention.self.query.weight": "bert_layers.{}.self_attention.query.weight",
    "encoder.layer.{}.attention.self.query.bias": "bert_layers.{}.self_attention.query.bias",
    "encoder.layer.{}.attention.self.key.weight": "bert_layers.{}.self_attention.key.weight",
    "encoder.layer.{}.attention.self.key.bias": "bert_layers.{}.self_attention.key.bias",
    "encoder.layer.{}.attention.self.value.weight": "bert_layers.{}.self_attention.value.weight",
    "encoder.layer.{}.attention.self.value.bias": "bert_layers.{}.self_attention.value.bias",
    "encoder.layer.{}.attention.output.dense.weight": "bert_layers.{}.attention_dense.weight",
    "encoder.layer.{}.attention.output.dense.bias": "bert_layers.{}.attention_dense.bias",
    "encoder.layer.{}.attention.output.LayerNorm.weight": "bert_layers.{}.attention_layer_norm.weight",
    "encoder.layer.{}.attention.output.LayerNorm.bias": "bert_layers.{}.attention_layer_norm.bias",
    "encoder.layer.{}.intermediate.dense.weight": "bert_layers.{}.interm_dense.weight",
    "encoder.layer.{}.intermediate.dense.bias": "bert_layers.{}.interm_dense.bias",
    "encoder.layer.{}.output.dense.weight": "bert_layers.{}.out_dense.weight",
    "encoder.layer.{}.output.dense.bias": "bert_layers.{}.out_dense.bias",
    "encoder.layer.{}.output.LayerNorm.weight": "bert_layers.{}.out_layer_norm.weight",
    "encoder.layer.{}.output.LayerNorm.bias": "bert_layers.{}.out_layer_norm.bias",
    "pooler.dense.weight": "pooler_dense.weight",
    "pooler.dense.bias": "pooler_dense.bias",
}
PORT_TO_HF: dict[str, str] = {v: k for k, v in HF_TO_PORT.items()}
assert len(PORT_TO_HF) == len(HF_TO_PORT), "HF_TO_PORT must be one-to-one"

# Keys that real checkpoints carry and the encoder does not need. Buffers are accepted
# silently; pretraining heads are dropped and reported.
BUFFER_KEYS = ("embeddings.position_ids", "embeddings.token_type_ids")
DROPPED_PREFIXES = ("cls.predictions.", "cls.seq_relationship.")
# Wrappers that training code puts around a model: DDP, torch.compile, HF task models.
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "bert.")
# Keys of task heads that sit beside the encoder and keep their names in both layouts.
HEAD_PREFIXES = ("classifier.",)

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


class CheckpointError(Exception):
    """A checkpoint that cannot be read or does not fit the model. The message says why
    and what to do; nothing has been loaded into the model when this is raised."""


def _map_key(key: str, table: Mapping[str, str]) -> str | None:
    """Look `key` up in a `{}`-templated table; None when it has no entry."""
    match = _LAYER_INDEX.search(key)
    if match is None:
        return table.get(key)
    template = table.get(key[: match.start()] + ".{}." + key[match.end() :])
    return None if template is None else template.format(match.group(1))


# -----------------------------------------------------------------------------------------
# Pure conversions


@dataclass
class Conversion:
    """The result of converting a checkpoint's keys: tensors under port names, plus what
    was dropped on the way and what could not be placed."""

    state_dict: dict[str, Tensor]
    dropped: list[str] = field(default_factory=list)  # pretraining heads, reported at INFO
    unmapped: list[str] = field(default_factory=list)  # keys with no entry in the table


def normalize_hf_key(key: str) -> str:
    """Bring one incoming key to the bare HF BertModel name (`embeddings...`,
    `encoder.layer.N...`, `pooler...`): strip wrapper prefixes, rename the legacy
    TF-era `LayerNorm.gamma/beta` to `weight/bias`."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key, stripped = key[len(prefix) :], True
    if key.endswith("LayerNorm.gamma"):
        key = key[: -len("gamma")] + "weight"
    elif key.endswith("LayerNorm.beta"):
        key = key[: -len("beta")] + "bias"
    return key


def hf_to_port(state_dict: Mapping[str, Tensor]) -> Conversion:
    """Convert any HF BERT state dict (BertModel, BertForPreTraining, BertFor*, bare
    sentence-transformers, legacy gamma/beta) to port names. Task-head keys such as
    `classifier.*` keep their names."""
    out = Conversion(state_dict={})
    for raw_key, tensor in state_dict.items():
        key = normalize_hf_key(raw_key)
        if key in BUFFER_KEYS:
            continue
        if key.startswith(DROPPED_PREFIXES):
            out.dropped.append(raw_key)
            continue
        if key.startswith(HEAD_PREFIXES):
            new_key = key
        else:
            new_key = _map_key(key, HF_TO_PORT)
        if new_key is None:
            out.unmapped.append(raw_key)
            new_key = raw_key  # kept under its own name so the load error can list it
        if new_key in out.state_dict:
            raise CheckpointError(
                f"checkpoint has two tensors for {new_key!r} (one of them {raw_key!r}); "
                "it mixes layouts, so re-export it from its source"
            )
        out.state_dict[new_key] = tensor
    if out.dropped:
        log.info("dropped %d pretraining-head tensors not used by the encoder: %s",
                 len(out.dropped), ", ".join(sorted(out.dropped)))  # fmt: skip
    return out


def port_to_hf(state_dict: Mapping[str, Tensor], encoder_prefix: str = "") -> dict[str, Tensor]:
    """Inverse of `hf_to_port` for a port state dict. Encoder keys get HF names with
    `encoder_prefix` (``""`` for BertModel, ``"bert."`` for task models); head keys keep
    their names."""
    out = {}
    for key, tensor in state_dict.items():
        if key.startswith(HEAD_PREFIXES):
            out[key] = tensor
            continue
        hf_key = _map_key(key, PORT_TO_HF)
        if hf_key is None:
            raise KeyError(f"port key {key!r} has no entry in the key table (checkpoint.HF_TO_PORT)")
        out[encoder_prefix + hf_key] = tensor
    return out


# -----------------------------------------------------------------------------------------
# Locating checkpoints

CONFIG_NAME = "config.json"
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PT_WEIGHTS = "pytorch_model.bin"
PT_INDEX = "pytorch_model.bin.index.json"
WEIGHT_NAMES = (SAFE_WEIGHTS, SAFE_INDEX, PT_WEIGHTS, PT_INDEX)  # in order of preference
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


@dataclass
class CheckpointFiles:
    directory: Path  # where config, tokenizer files and shards live
    config_file: Path
    weights_file: Path  # a weights file or an index


def hf_cache_dirs() -> list[Path]:
    """The hub cache directories, in the order huggingface_hub itself consults them."""
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"]).expanduser()]
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):  # the older name
        return [Path(os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()]
    if os.environ.get("HF_HOME"):
        return [Path(os.environ["HF_HOME"]).expanduser() / "hub"]
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return [base / "huggingface" / "hub"]


def find_in_hf_cache(model_id: str, revision: str = "main") -> Path:
    """The snapshot directory of `model_id` in the local HF cache, without any network.

    Follows the hub cache layout: `models--{org}--{name}/refs/{revision}` holds a commit
    hash, and `snapshots/{hash}/` the files. A revision that is itself a hash is used
    directly. Raises `CheckpointError` naming every directory searched.
    """
    folder = "models--" + model_id.replace("/", "--")
    searched = []
    for cache in hf_cache_dirs():
        repo = cache / folder
        searched.append(str(repo))
        if not repo.is_dir():
            continue
        ref = repo / "refs" / revision
        commit = ref.read_text().strip() if ref.is_file() else revision
        snapshot = repo / "snapshots" / commit
        if snapshot.is_dir():
            return snapshot
        snapshots = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
        if not ref.is_file() and snapshots:
            return snapshots[-1]  # no ref recorded: take the newest snapshot
    raise CheckpointError(
        f"{model_id!r} is not a local path and was not found in the Hugging Face cache "
        f"(searched: {', '.join(searched)}). Pass a checkpoint directory, set HF_HUB_CACHE or "
        f"HF_HOME to the cache that holds it, or download it on a machine with network access "
        f"(`huggingface-cli download {model_id}`) and copy the cache over."
    )


def locate_checkpoint(path: str | os.PathLike, config_file: str | os.PathLike | None = None) -> CheckpointFiles:
    """Resolve a directory, a weights file, or a model id from the HF cache to files."""
    p = Path(path).expanduser()
    if not p.exists():
        if isinstance(path, str) and not path.startswith((".", "/", "~")) and path.count("/") <= 1:
            p = find_in_hf_cache(path)
        else:
            raise CheckpointError(f"no checkpoint at {p}: the path does not exist")
    if p.is_dir():
        weights = next((p / name for name in WEIGHT_NAMES if (p / name).is_file()), None)
        if weights is None:
            present = sorted(x.name for x in p.iterdir())[:20]
            raise CheckpointError(
                f"{p} holds no weights: expected one of {', '.join(WEIGHT_NAMES)}; found {present}"
            )
        directory = p
    else:
        weights, directory = p, p.parent
    config = Path(config_file) if config_file is not None else directory / CONFIG_NAME
    if not config.is_file():
        raise CheckpointError(
            f"no config for checkpoint {weights}: expected {config}. Put the model's config.json "
            "beside the weights or pass config_file="
        )
    return CheckpointFiles(directory=directory, config_file=config, weights_file=weights)


# -----------------------------------------------------------------------------------------
# Reading


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({exc}). It is probably truncated or "
            "corrupt: download or copy it again"
        ) from None


def _read_torch_pickle(path: Path) -> dict[str, Tensor]:
    import pickle

    try:
        # weights_only=True: the unpickler only builds tensors and plain containers, so a
        # pickle that tries to run code fails here instead of running it.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"refused to load {path}: it contains objects other than tensors, and unpickling "
            f"them could run arbitrary code ({str(exc).splitlines()[0]}). If you trust the "
            "file, convert it to safetensors in a trusted environment first"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is not a readable PyTorch checkpoint ({str(exc).splitlines()[0]}). It is "
            "probably truncated or corrupt: download or copy it again"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"{path} does not hold a flat state dict of tensors")
    return state


def _read_index(path: Path) -> dict[str, Tensor]:
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a valid shard index ({exc!r}); it needs a 'weight_map'") from None
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (path.parent / s).is_file()]
    if missing:
        raise CheckpointError(f"shard index {path} names shard(s) that are not there: {', '.join(missing)}")
    state: dict[str, Tensor] = {}
    for shard in shards:
        state.update(read_weights(path.parent / shard))
    absent = sorted(set(weight_map) - set(state))
    if absent:
        raise CheckpointError(f"shard index {path} lists tensors its shards lack: {', '.join(absent[:10])}")
    return state


def read_weights(path: str | os.PathLike) -> dict[str, Tensor]:
    """Read a weights file (`.safetensors`, `.bin`/`.pt`, or a shard index) into a state dict
    with the checkpoint's own key names."""
    path = Path(path)
    if path.name.endswith(".index.json"):
        return _read_index(path)
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    if path.suffix in (".bin", ".pt", ".pth"):
        return _read_torch_pickle(path)
    raise CheckpointError(f"unknown weights format {path.name!r}: use .safetensors, .bin, or a shard index")


# -----------------------------------------------------------------------------------------
# Writing


@contextmanager
def atomic_write(path: Path) -> Iterator[Path]:
    """Yield a temporary path in the same directory; on success it replaces `path` in one
    rename, so a crash mid-write leaves the previous file intact."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def parse_size(size: int | str) -> int:
    """`5GB`, `500MB`, `10KiB` or an int of bytes -> bytes (HF's `max_shard_size` rules)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B\s*", size.upper().replace("IB", "iB"))
    if not match:
        raise ValueError(f"cannot parse size {size!r}; use e.g. '5GB', '500MB' or a byte count")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** " KMGT".index(unit or " "))


def shard_state_dict(state_dict: Mapping[str, Tensor], max_bytes: int) -> list[dict[str, Tensor]]:
    """Split into consecutive shards of at most `max_bytes` (a larger tensor gets its own)."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for key, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards


def write_weights(state_dict: Mapping[str, Tensor], directory: Path, max_shard_size: int | str = "5GB") -> list[Path]:
    """Write `model.safetensors`, or shards plus `model.safetensors.index.json` when the
    weights exceed `max_shard_size`. Every file is written atomically; stale files of a
    previous save in the other layout are removed only after the new files are in place."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    shards = shard_state_dict(tensors, parse_size(max_shard_size))
    metadata = {"format": "pt"}
    written = []
    if len(shards) == 1:
        with atomic_write(directory / SAFE_WEIGHTS) as tmp:
            save_file(shards[0], str(tmp), metadata=metadata)
        written.append(directory / SAFE_WEIGHTS)
    else:
        weight_map = {}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            with atomic_write(directory / name) as tmp:
                save_file(shard, str(tmp), metadata=metadata)
            weight_map.update(dict.fromkeys(shard, name))
            written.append(directory / name)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with atomic_write(directory / SAFE_INDEX) as tmp:
            tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(directory / SAFE_INDEX)
    # The loader prefers model.safetensors over an index (and both over .bin), so a file
    # left over from an older save of another layout would shadow the new one.
    keep = {p.name for p in written}
    for stale in list(directory.glob("model-*-of-*.safetensors")) + [directory / n for n in WEIGHT_NAMES]:
        if stale.name not in keep and stale.exists():
            stale.unlink()
    return written


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_write(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def tensor_summary(tensors: Iterable[tuple[str, Tensor]]) -> str:
    return "\n".join(f"    {k}: {tuple(v.shape)}" for k, v in tensors)


def non_finite(state_dict: Mapping[str, Tensor]) -> list[str]:
    """Names of floating tensors holding NaN or Inf."""
    bad = []
    for key, tensor in state_dict.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            n = int((~torch.isfinite(tensor)).sum())
            bad.append(f"{key} ({n} of {tensor.numel()} values NaN/Inf)")
    return bad


def human_bytes(n: int) -> str:
    if n <= 0:
        return "0 B"
    k = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**k:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][k]}"
