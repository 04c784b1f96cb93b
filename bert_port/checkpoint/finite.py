"""The NaN/Inf check of loaded weights.

Safetensors weights are memory-mapped, and a check that reads them through the mapping
makes every page resident: a load would then peak at the whole file above what
transformers needs (it touches the pages only at the first forward). So a tensor with a
file span (`reading.FileSpan`, returned by the reader), and that nothing has changed since
it was mapped, is checked from the file in chunks through one small buffer: the OS page
cache serves them, and none stays in the process. Any other tensor is checked where it lies.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import Tensor

from .reading import FileSpan, file_identity

_CHUNK_BYTES = 4 << 20


def _count_non_finite(tensor: Tensor) -> int:
    # aminmax propagates NaN and exposes +-Inf without materialising a mask the size of the
    # tensor; the count is taken only on failure.
    lo, hi = torch.aminmax(tensor)
    if bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return 0
    return int((~torch.isfinite(tensor)).sum())


def _count_in_file(tensor: Tensor, span: FileSpan, buffer: bytearray) -> int | None:
    """Non-finite values of a mapped tensor, read from its file chunk by chunk; None when
    the file is not what was mapped any more (then the caller checks the tensor itself)."""
    try:
        with open(span.path, "rb", buffering=0) as f:
            if file_identity(os.fstat(f.fileno())) != span.identity:
                return None
            size = tensor.element_size()
            nbytes, step = tensor.numel() * size, len(buffer) - len(buffer) % size
            bad = 0
            for start in range(0, nbytes, step):
                n = min(step, nbytes - start)
                f.seek(span.offset + start)
                if f.readinto(memoryview(buffer)[:n]) != n:
                    return None
                bad += _count_non_finite(torch.frombuffer(buffer, dtype=tensor.dtype, count=n // size))
            return bad
    except OSError:
        return None


def non_finite(tensors: Mapping[str, Tensor], spans: Mapping[str, FileSpan] | None = None) -> list[str]:
    """Names of floating tensors holding NaN or Inf, each with how many values. `spans`
    (by the same names) says where memory-mapped ones lie in their files."""
    bad, buffer, spans = [], None, spans or {}
    for key, tensor in tensors.items():
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        span = spans.get(key) if tensor.device.type == "cpu" else None
        count = None
        if span is not None and span.version == tensor._version and tensor.is_contiguous():
            buffer = buffer or bytearray(_CHUNK_BYTES)
            count = _count_in_file(tensor, span, buffer)
        if count is None:
            count = _count_non_finite(tensor)
        if count:
            bad.append(f"{key} ({count} of {tensor.numel()} values NaN/Inf)")
    return bad
