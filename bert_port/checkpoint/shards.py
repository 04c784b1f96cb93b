"""Model weights as safetensors files: one `model.safetensors`, or shards and an index when
they exceed `max_shard_size` (HF's names and index format, split by huggingface_hub as
transformers splits them), staged into a `StagedWrite`."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from torch import Tensor

from ..storage.names import PT_INDEX, PT_WEIGHTS, SAFE_INDEX, weights_name
from ..storage.staging import StagedWrite

log = logging.getLogger(__name__)


def parse_size(size: int | str) -> int:
    """`5GB`, `500MB`, `10KiB` or an int of bytes -> bytes. Decimal units as huggingface_hub's
    `parse_size_to_int` (`KB` = 1000), binary ones (`KiB` = 1024) as transformers also accepts."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B\s*", str(size).upper())
    if not match:
        raise ValueError(f"cannot parse size {size!r}; use e.g. '5GB', '500MB', '10KiB' or a byte count")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    return max(1, int(float(number) * base ** " KMGT".index(unit or " ")))


def _own_storage(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Contiguous CPU tensors, each with storage of its own: safetensors refuses tensors
    that share memory (tied weights, views into a fused buffer), so those are cloned."""
    out, seen = {}, set()
    for key, tensor in state_dict.items():
        tensor = tensor.detach().contiguous().cpu()
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
            storage = tensor.untyped_storage()
        seen.add(storage.data_ptr())
        out[key] = tensor
    return out


def _as_os_error(exc: Exception, path: Path) -> Exception:
    """safetensors reports a failed write (a full disk) as `SafetensorError: ... (os error 28)`:
    the `OSError` it is, so that callers tell the machine's faults from the input's."""
    found = re.search(r"os error (\d+)", str(exc))
    if found is None:
        return exc
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(path))


def stage_weights(stage: StagedWrite, state_dict: Mapping[str, Tensor], max_shard_size: int | str = "5GB") -> list[str]:
    """Stage `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` plus
    `model.safetensors.index.json` when the weights exceed `max_shard_size` (HF's names and
    index format, split by huggingface_hub as transformers splits them). Returns the file
    names staged, the index last."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tensors = _own_storage(state_dict)
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=parse_size(max_shard_size))
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    names = []
    for name, keys in split.filename_to_tensors.items():
        path = stage.path(name)
        try:
            save_file({k: tensors[k] for k in keys}, str(path), metadata=metadata)
        except SafetensorError as exc:
            raise _as_os_error(exc, path) from None
        names.append(name)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        stage.text(SAFE_INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")
        names.append(SAFE_INDEX)
    for stale in stale_weights(stage.directory, names):
        stage.remove(stale)
    return names


def stale_weights(directory: Path, keep: Iterable[str]) -> list[str]:
    """The safetensors files of an earlier save in the other layout, which a save of `keep`
    must delete: the loaders (ours and transformers') prefer `model.safetensors` over an
    index, so a stale one would shadow the new shards, and stale shards would only waste
    space. PyTorch `.bin` files are left alone (they may be the user's original, with heads
    the new save dropped); safetensors takes precedence over them on load."""
    keep = set(keep)
    stale = [
        entry.name
        for entry in os.scandir(directory)
        if entry.name not in keep and entry.is_file() and weights_name(entry.name)
    ]
    leftovers = [n for n in (PT_WEIGHTS, PT_INDEX) if (Path(directory) / n).is_file()]
    if leftovers:
        log.warning(
            "%s still holds %s from an earlier save; the new safetensors files take precedence on load",
            directory,
            ", ".join(leftovers),
        )
    return sorted(stale)


def write_weights(state_dict: Mapping[str, Tensor], directory: Path, max_shard_size: int | str = "5GB") -> list[Path]:
    """Write `model.safetensors`, or shards plus `model.safetensors.index.json` when the
    weights exceed `max_shard_size`, as one staged write that also deletes stale
    safetensors files of a previous save in the other layout."""
    directory = Path(directory)
    with StagedWrite(directory) as stage:
        names = stage_weights(stage, state_dict, max_shard_size)
    return [directory / n for n in names]
