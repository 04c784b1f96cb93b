"""Device strings, parsed in one place: `--device` flags, `device=` and `device_map=` arguments."""

from __future__ import annotations

import torch

DEVICE_CHOICES = "'auto' (the accelerator when there is one, else the CPU), 'cpu', 'cuda' or 'cuda:N'"


def resolve_device(spec: str | torch.device | None, *, what: str = "device") -> torch.device | None:
    """`spec` as a `torch.device` that exists here: "auto", "cpu", "cuda", "cuda:N" or a
    `torch.device`; None passes through (the caller's default). A string torch does not know,
    or a CUDA device this machine lacks, is a `ValueError` naming `what` (the flag or argument)
    and the choices, raised before any work starts."""
    if spec is None:
        return None
    if isinstance(spec, str) and spec == "auto":
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return accelerator if accelerator is not None else torch.device("cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{what} {spec!r} is not a device torch knows ({exc}); use {DEVICE_CHOICES}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{what} {spec!r}: torch sees no CUDA device on this machine; use 'cpu'")
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"{what} {spec!r}: this machine has {count} CUDA device(s); use cuda:0 to cuda:{count - 1}"
            )
    return device
