"""Activations and attention masks, computed exactly as transformers computes them."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def _gelu_tanh_python(x: Tensor) -> Tensor:
    # HF's NewGELUActivation, op for op (the original BERT / GPT tanh approximation).
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


# Every activation HF's ACT2FN offers to BERT configs, written with the same operations in
# the same order as transformers/activations.py so that results agree bit for bit.
ACT2FN: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_python": lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "gelu_new": _gelu_tanh_python,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_python_tanh": lambda x: x * 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))),
    "gelu_fast": lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
    "gelu_accurate": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3)))),
    "gelu_10": lambda x: torch.clip(F.gelu(x), -10, 10),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "relu2": lambda x: torch.square(F.relu(x)),
    "relu6": F.relu6,
    "leaky_relu": F.leaky_relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "mish": F.mish,
    "linear": lambda x: x,
    "hardswish": F.hardswish,
    "laplace": lambda x: 0.5 * (1.0 + torch.erf((x - 0.707107).div(0.282095 * math.sqrt(2.0)))),
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
}  # fmt: skip


def get_activation(name: str) -> Callable[[Tensor], Tensor]:
    try:
        return ACT2FN[name]
    except KeyError:
        raise ValueError(f"unknown hidden_act {name!r}; use one of {', '.join(ACT2FN)}") from None


def get_extended_attention_mask(
    attention_mask: Tensor | None,
    dtype: torch.dtype,
    *,
    seq_len: int,
    causal: bool = False,
    as_bool: bool = False,
) -> Tensor | None:
    """Turn a user mask into the 4-D mask the attention adds (or selects with).

    `attention_mask` may be
      - 2-D `(B, T)`, 1 (or True) for tokens to attend to and 0 for padding;
      - 3-D `(B, T, T)`, per query row, same convention;
      - 4-D, already prepared: used as given, as transformers does.
    Returns `(B, 1, T, T)` (or `(B, 1, 1, T)`): additive, 0 where attended and
    `finfo(dtype).min` where not (so the sum never overflows to -inf and a fully masked
    row stays finite), or boolean, True where attended, when `as_bool` (the SDPA form).
    None when nothing is masked, again as transformers returns it.
    """
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    if attention_mask is None and not causal:
        return None

    if attention_mask is None:
        keep = None
    elif attention_mask.dim() == 2:
        keep = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T)
    else:
        keep = attention_mask.bool()[:, None, :, :]  # (B, 1, T, T)

    if causal:
        device = attention_mask.device if attention_mask is not None else None
        tri = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()  # (T, T)
        keep = tri[None, None] if keep is None else keep & tri
    elif attention_mask.dim() == 2 and bool(keep.all()):
        return None  # no padding: HF skips the mask so SDPA can use its fastest kernel

    if as_bool:
        return keep
    zero = torch.zeros((), dtype=dtype, device=keep.device)
    return torch.where(keep, zero, torch.finfo(dtype).min)
