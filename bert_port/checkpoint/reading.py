"""Reading checkpoint files: safetensors (memory-mapped), PyTorch pickles (weights only),
shard indexes, and sentence-transformers' `modules.json`; and the snapshot a load reads under.

A reader returns `Weights`: the tensors under the checkpoint's own names, and for each
memory-mapped safetensors tensor the span of the file it lies in (`FileSpan`), which the
NaN/Inf check (`finite.py`) reads instead of touching the mapping.

This is the read side: it never writes, and it does not import the write side (`staging`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..storage.bounded import JSON, read_text
from ..storage.errors import CheckpointError, link_loop, short_list
from ..storage.journal import InvalidJournal, State, read_journal
from ..storage.locking import shared_lock
from ..storage.names import JOURNAL, ST_MODULES, plain_name

log = logging.getLogger(__name__)

REPAIR_COMMAND = "bert-port-convert --repair"


@dataclass(frozen=True)
class FileSpan:
    """Where a memory-mapped tensor's bytes lie: the file, its identity when mapped (device,
    inode, size, mtime), the offset of the first byte, and the tensor's version counter then
    (an in-place change bumps it, and the file no longer holds the tensor's values)."""

    path: str
    identity: tuple[int, int, int, int]
    offset: int
    version: int


@dataclass
class Weights:
    """A checkpoint's tensors under its own key names, and the file spans of those that are
    memory-mapped safetensors (`FileSpan`, by the same key)."""

    tensors: dict[str, Tensor]
    spans: dict[str, FileSpan] = field(default_factory=dict)


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@contextmanager
def read_snapshot(directory: str | os.PathLike) -> Iterator[None]:
    """Read a checkpoint folder as one save: hold it shared (a save holds it exclusively, so
    none commits while the files are read), and refuse a folder whose last save was killed
    halfway through its commit, naming the command that finishes it. A stale or foreign
    journal (another tool wrote the folder since) is ignored. Nothing is written."""
    directory = Path(directory)
    with shared_lock(directory):
        try:
            journal = read_journal(directory)
        except InvalidJournal as exc:
            log.warning(
                "%s: ignoring %s, which is not a commit journal this package wrote (%s)", directory, JOURNAL, exc
            )
            journal = None
        if journal is not None and journal.state(directory) is State.LIVE:
            raise CheckpointError(
                f"{directory} holds a save that was interrupted after its commit point ({JOURNAL}): its files are "
                f"part old, part new, and a load would mix two models. Finish that save with "
                f"`{REPAIR_COMMAND} {directory}` (or save a model there again), then load"
            )
        yield


def read_st_modules(directory: str | os.PathLike) -> list[dict]:
    """The modules a folder's `modules.json` lists (dicts with `type` and `path`), checked to
    be a JSON list of objects; `CheckpointError` saying to restore it otherwise."""
    path = Path(directory) / ST_MODULES
    try:
        modules = json.loads(read_text(path, JSON, folder=False))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not readable JSON ({exc}); restore it from the original checkpoint") from None
    if not isinstance(modules, list) or not modules or not all(isinstance(m, dict) for m in modules):
        raise CheckpointError(f"{path} must be a JSON list of modules; restore it from the original checkpoint")
    return modules


def st_module_folders(directory: str | os.PathLike) -> list[str]:
    """The module folders `modules.json` in `directory` names (`1_Pooling`, ...) that exist:
    plain relative names only, never a path out of the directory."""
    directory = Path(directory)
    folders = (m.get("path") for m in read_st_modules(directory))
    return [f for f in folders if plain_name(f) and (directory / f).is_dir()]


def _unreadable(path: Path, exc: OSError) -> CheckpointError:
    """A file the OS will not give us (permissions, a directory, an I/O error), as opposed
    to one whose bytes are wrong."""
    loop = link_loop(path)
    if loop is not None:
        return loop
    return CheckpointError(
        f"cannot read {path}: {exc.strerror or exc}. Check that the file exists and that you may read it"
    )


def _read_safetensors(path: Path) -> Weights:
    """The tensors of a safetensors file, memory-mapped (no page is read until used), each
    with its span of the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        before = file_identity(os.stat(path))
        tensors = load_file(str(path))
        offsets = _data_offsets(path)
        same_file = file_identity(os.stat(path)) == before  # not replaced while it was being mapped
    except OSError as exc:
        raise _unreadable(path, exc) from None
    except (SafetensorError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({exc}). It is probably truncated or "
            "corrupt: download or copy it again"
        ) from None
    spans = {}
    if same_file:
        for key, tensor in tensors.items():
            span = offsets.get(key)
            if span is not None and span[1] - span[0] == tensor.numel() * tensor.element_size():
                spans[key] = FileSpan(str(path), before, span[0], tensor._version)
    return Weights(tensors, spans)


def _data_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Where each tensor's bytes lie in a safetensors file: an 8-byte little-endian header
    length, the JSON header (`data_offsets` relative to its end), then the data."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    start = 8 + length
    return {
        k: (start + v["data_offsets"][0], start + v["data_offsets"][1])
        for k, v in header.items()
        if k != "__metadata__"
    }


def _read_torch_pickle(path: Path) -> Weights:
    import pickle
    import zipfile

    try:
        # weights_only=True: the unpickler only builds tensors and plain containers, so a
        # pickle that tries to run code fails here instead of running it. mmap needs the
        # zip format of torch>=1.6; older checkpoints (bert-base-uncased's own
        # pytorch_model.bin among them) are read whole.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as exc:
        # torch's message suggests allowlisting the culprit; name it, without that advice.
        culprit = re.search(r"GLOBAL ([\w.]+)", str(exc))
        lines = [line.strip() for line in str(exc).splitlines() if "Unsupported" in line or "unsupported" in line]
        reason = f"it calls {culprit.group(1)}" if culprit else (lines[0] if lines else "not plain tensors")
        raise CheckpointError(
            f"refused to load {path}: unpickling it would run code, not just build tensors ({reason}). "
            "Nothing in it was executed. If you trust the file, convert it to safetensors in a trusted, "
            "isolated environment first"
        ) from None
    except (PermissionError, IsADirectoryError) as exc:
        raise _unreadable(path, exc) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(
            f"{path} is not a readable PyTorch checkpoint ({reason}). It is probably truncated or corrupt: "
            "download or copy it again"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        what = f"a dict with keys {sorted(map(str, state))[:5]}" if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"{path} does not hold a flat state dict of tensors (found {what}); save `model.state_dict()` itself"
        )
    return Weights(state)


_SHARD_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _read_index(path: Path) -> Weights:
    try:
        weight_map = json.loads(read_text(path, JSON, folder=False))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except OSError as exc:
        raise _unreadable(path, exc) from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"{path} is not a valid shard index ({type(exc).__name__}: {str(exc)[:200]}); it must be a JSON object "
            "whose 'weight_map' maps each tensor name to a shard file name. Restore it from the original checkpoint"
        ) from None
    # Shards live beside the index and are weights files: a name that leaves the directory,
    # or names an index (this one, which would recurse forever, or another), is not a shard.
    bad = [
        s
        for s in shards
        if not isinstance(s, str)
        or not plain_name(s)
        or Path(s).name != s
        or s.endswith(".index.json")
        or not s.endswith(_SHARD_SUFFIXES)
    ]
    if bad:
        raise CheckpointError(
            f"shard index {path} names {len(bad)} shard(s) outside its directory or not weights files: "
            f"{short_list([repr(b)[:100] for b in bad])}. A shard is a .safetensors or .bin file beside the index: "
            "restore the index from the original checkpoint"
        )
    loop = next((e for e in (link_loop(path.parent / s) for s in shards) if e is not None), None)
    if loop is not None:
        raise loop
    missing = [s for s in shards if not _is_file(path.parent / s)]
    if missing:
        raise CheckpointError(
            f"shard index {path} names {len(missing)} shard file(s) that are not in {path.parent}: "
            f"{short_list(missing)}. The download or copy is incomplete: fetch the missing shards"
        )
    return _read_shards(path, weight_map, shards)


def _read_shards(index: Path, weight_map: dict[str, str], shards: list[str]) -> Weights:
    state = Weights({})
    for shard in shards:
        shard_path = index.parent / shard
        read = _read_safetensors(shard_path) if shard.endswith(".safetensors") else _read_torch_pickle(shard_path)
        # Each tensor comes from the shard the index names for it (as transformers reads
        # them); a copy in another shard is ignored rather than silently winning.
        keep = [k for k in read.tensors if weight_map.get(k, shard) == shard]
        state.tensors.update((k, read.tensors[k]) for k in keep)
        state.spans.update((k, read.spans[k]) for k in keep if k in read.spans)
    absent = sorted(set(weight_map) - set(state.tensors))
    if absent:
        raise CheckpointError(
            f"shard index {index} lists {len(absent)} tensor(s) its shards lack: {short_list(absent, 10)}. "
            "The index and shards come from different saves: fetch them again together"
        )
    return state


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long, a permission denied on the way: not a file we can read
        return False


def read_weights(path: str | os.PathLike) -> Weights:
    """Read a weights file (`.safetensors`, `.bin`/`.pt`, or a shard index): its tensors
    under the checkpoint's own key names, and the file spans of the memory-mapped ones."""
    path = Path(path)
    if path.name.endswith(".index.json"):
        return _read_index(path)
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    if path.suffix in (".bin", ".pt", ".pth"):
        return _read_torch_pickle(path)
    raise CheckpointError(f"unknown weights format {path.name!r}: use .safetensors, .bin, or a shard index")
