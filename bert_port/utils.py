"""Activations and attention masks, computed exactly as transformers computes them."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def _gelu_new(x: Tensor) -> Tensor:
    # HF's NewGELUActivation, op for op (the original BERT / GPT tanh approximation).
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_python_tanh(x: Tensor) -> Tensor:
    # HF's GELUTanh(use_gelu_tanh_python=True): the same formula, multiplied in another order.
    return x * 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


# Every activation HF's ACT2FN offers to BERT configs, written with the same operations in
# the same order as transformers/activations.py so that results agree bit for bit.
ACT2FN: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_python": lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "gelu_new": _gelu_new,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_python_tanh": _gelu_python_tanh,
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
}


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
    device: torch.device | None = None,
    past_length: int = 0,
) -> Tensor | None:
    """Turn a user mask into the 4-D mask the attention adds (eager) or selects with (SDPA),
    following transformers 5 (`masking_utils.create_bidirectional_mask` / `create_causal_mask`).

    `attention_mask` may be
      - 2-D `(B, T)`: 1/True for tokens to attend to, 0/False for padding. Any dtype; like
        transformers, nonzero means "attend" (`.bool()`).
      - 3-D `(B, T, T)`: per query row, same convention. transformers 5 rejects 3-D masks (its
        mask builder indexes them as 2-D and fails); ours gives exactly what transformers gives
        for the equivalent 4-D mask (`mask[:, None]` as bool, or 0/finfo.min additive), with the
        causal pattern still applied for decoders.
      - 4-D `(B or 1, 1 or nh, T, T)`: already prepared, used as given (transformers does not
        add padding or causality to it either). Boolean (True = attend) or additive in the
        model's dtype; the eager path turns a boolean one into 0/finfo.min, where transformers'
        eager path would add the 0/1 values and silently ignore the mask.

    Returns None when nothing needs masking: no mask and bidirectional, a 2-D mask with no
    padding, or (`as_bool`, i.e. SDPA) a causal model without padding, which SDPA handles with
    `is_causal=True`, as transformers does. Otherwise `(B, 1, T, T)` (or `(B, 1, 1, T)` for
    bidirectional padding; broadcasting gives the same sums): boolean when `as_bool`, else
    additive, 0 where attended and `finfo(dtype).min` where not, never -inf, so a fully masked
    row stays finite (uniform attention, as transformers' eager path gives).

    `past_length` P (a decoder on a `KVCache`): the keys are P + T long (a 2-D mask (B, P + T)),
    the causal pattern shifted by P, which SDPA's `is_causal` cannot do: T > 1 gets a mask.
    """
    if attention_mask is not None and device is not None:
        attention_mask = attention_mask.to(device)
    if attention_mask is not None and attention_mask.dim() == 4:
        return _check_prepared_mask(attention_mask, dtype)
    sdpa_causal = as_bool and (past_length == 0 or seq_len == 1)  # is_causal, or one query on a past
    if attention_mask is None:
        if not causal or sdpa_causal:
            return None  # nothing to mask, or plain causal, which SDPA does with is_causal=True
        keep = None
    elif attention_mask.dim() == 2:
        keep = attention_mask.bool()
        # No padding: transformers skips the mask too (but always builds its eager causal one).
        # Not while tracing (torch.export, torch.compile): the test is a data-dependent branch,
        # and an all-True mask gives the same attention.
        if (not causal or sdpa_causal) and not torch.compiler.is_compiling() and bool(keep.all()):
            return None
        keep = keep[:, None, None, :]  # (B, 1, 1, P + T)
    else:
        keep = attention_mask.bool()[:, None, :, :]  # (B, 1, T, P + T)

    keep = _with_causal(keep, seq_len, past_length, device) if causal else keep  # (B or 1, 1, T, P + T)
    if as_bool:
        # A view with transformers' (B, 1, T, P + T) shape, so SDPA sees the same mask layout.
        return keep.expand(keep.shape[0], 1, seq_len, past_length + seq_len)
    return additive_mask(keep, dtype)


def _with_causal(keep: Tensor | None, seq_len: int, past_length: int, device: torch.device | None) -> Tensor:
    """`keep` (B, 1, 1 or T, P + T) and the causal pattern: new query i sees the P cached
    positions and the new ones up to itself."""
    tri = torch.ones(seq_len, past_length + seq_len, dtype=torch.bool, device=device if keep is None else keep.device)
    tri = tri.tril(diagonal=past_length)
    return tri[None, None] if keep is None else keep & tri


def additive_mask(keep: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean mask (True = attend) -> additive: 0 where attended, `finfo(dtype).min` where
    not (never -inf, so a fully masked row stays finite), as transformers builds it."""
    return torch.where(keep, torch.zeros((), dtype=dtype, device=keep.device), torch.finfo(dtype).min)


def _check_prepared_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A user's 4-D mask is used as given; reject the kinds that would silently mean
    something else (0/1 integers added to the scores) or fail deep inside a kernel."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise ValueError(
            f"a 4-D attention_mask is used as given, so it must be boolean (True = attend) or additive "
            f"float (0 = attend, torch.finfo(dtype).min = masked); got {mask.dtype}. For a 0/1 padding "
            "mask pass it 2-D (batch, seq_len), or 3-D (batch, seq_len, seq_len) per query"
        )
    if mask.dtype != dtype:
        raise ValueError(
            f"a 4-D additive attention_mask must be in the model's dtype {dtype}, got {mask.dtype}; "
            f"build it in {dtype} with torch.finfo({dtype}).min for masked positions (a cast can turn "
            "a float32 minimum into -inf), or pass a boolean mask (True = attend)"
        )
    return mask


def roberta_position_ids(
    input_ids: Tensor | None, inputs_embeds: Tensor | None, padding_idx: int, past_length: int = 0
) -> Tensor:
    """RoBERTa's positions (fairseq's `make_positions`, transformers'
    `create_position_ids_from_input_ids`): padding_idx + 1 + the count of non-padding tokens up
    to and including each one, after `past_length` cached ones; padding stays at padding_idx.
    From `inputs_embeds`, where padding cannot be seen, padding_idx + 1 .. padding_idx + T.
    The same operations and dtypes as transformers: (B, T) long, or (B, T) from embeddings."""
    if input_ids is None:
        B, T = inputs_embeds.shape[:2]
        positions = torch.arange(padding_idx + 1, T + padding_idx + 1, dtype=torch.long, device=inputs_embeds.device)
        return positions.unsqueeze(0).expand(B, T)
    mask = input_ids.ne(padding_idx).int()
    return ((torch.cumsum(mask, dim=1).type_as(mask) + past_length) * mask).long() + padding_idx
