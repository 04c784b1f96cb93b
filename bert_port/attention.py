"""The attention functions of the plain model, chosen by name from one table as transformers'
`ALL_ATTENTION_FUNCTIONS[config._attn_implementation]` is: "eager" (transformers' eager path,
operation for operation, which also returns the probabilities) and "sdpa"
(`F.scaled_dot_product_attention`, transformers' `sdpa_attention_forward`). "varlen" runs SDPA
here; the packed path of `bert_port.speed` runs FlashAttention's varlen kernel for it.

Each takes q, k, v (B, nh, T, hs) and a prepared mask and returns the context (B, T, H) and
the probabilities (B, nh, T, T) or None. Shapes: B batch, T time, H hidden, nh heads, hs head
size (H = nh * hs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .utils import additive_mask


def merge_heads(context: Tensor) -> Tensor:
    """(B, nh, T, hs) -> (B, T, H), contiguous, as transformers' reshape after attention."""
    context = context.transpose(1, 2).contiguous()  # (B, T, nh, hs)
    return context.reshape(*context.shape[:2], -1).contiguous()


def eager_attention(
    query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, scaling: float, dropout: Callable
) -> tuple[Tensor, Tensor]:
    """Scaled dot-product attention as transformers' `eager_attention_forward`: `attention_mask`
    additive (a boolean one is made additive), broadcastable to (B, nh, T, T); `dropout` the module."""
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = additive_mask(attention_mask, query.dtype)
    # Scale the raw scores first, then add the mask (finfo.min, never -inf), as HF does.
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, nh, T, T)
    if attention_mask is not None:
        scores = scores + attention_mask
        if scores.dtype == torch.float16:
            # finfo(fp16).min + a score below -16 rounds to -inf. A row where every entry did is
            # fully masked (all padding) and would softmax to NaN, as it does in transformers; give
            # it finfo.min instead, i.e. the uniform attention that fp32/bf16 give. Rows with any
            # finite entry are left exactly as they are.
            dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
            scores = scores.masked_fill(dead, torch.finfo(scores.dtype).min)
    probs = dropout(F.softmax(scores, dim=-1))
    return merge_heads(torch.matmul(probs, value)), probs


def sdpa_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout_p: float = 0.0,
    is_causal: bool = False,
) -> tuple[Tensor, None]:
    """q, k, v (B, nh, T, hs) through `F.scaled_dot_product_attention`; `attention_mask` boolean
    (True = attend) or additive, broadcastable to (B, nh, T, T). No probabilities."""
    context = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout_p, scale=scaling, is_causal=is_causal
    )
    return merge_heads(context), None


# name -> function of (module, q, k, v, mask): what `BertSelfAttention.forward` calls.
ATTENTION_FUNCTIONS: dict[str, Callable] = {
    "eager": lambda module, q, k, v, mask: module.attention(k, q, v, mask),
    "sdpa": lambda module, q, k, v, mask: sdpa_attention(
        q, k, v, mask, module.scaling, module.dropout.p if module.training else 0.0, module.causal_without_mask(q, mask)
    ),
}
ATTENTION_FUNCTIONS["varlen"] = ATTENTION_FUNCTIONS["sdpa"]
