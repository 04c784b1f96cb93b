"""The attention functions `BertSelfAttention.forward` calls besides its own eager
`attention`: SDPA (transformers' `sdpa_attention_forward`, the default) and varlen
FlashAttention on packed real tokens, where the hardware has it.

Shapes: B batch, T time, N real tokens, H hidden, nh heads, hs head size (H = nh * hs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .packing import Packing


def sdpa_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
    is_causal: bool = False,
) -> Tensor:
    """q, k, v (B, nh, T, hs) -> context (B, T, H) through `F.scaled_dot_product_attention`.
    `attention_mask` is boolean (True = attend) or additive, broadcastable to (B, nh, T, T)."""
    context = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout_p, scale=scale, is_causal=is_causal
    )
    context = context.transpose(1, 2).contiguous()  # (B, T, nh, hs)
    return context.reshape(*context.shape[:2], -1).contiguous()


def varlen_supported(x: Tensor, dropout_p: float) -> bool:
    """Whether `varlen_attention` runs on `x`: CUDA, fp16 or bf16 (autocast included: `x` is
    a projection's output), no attention dropout, and torch >= 2.9."""
    if not (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and dropout_p == 0.0):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_attention(qkv: Tensor, packing: Packing, num_heads: int, scale: float) -> Tensor:
    """Self-attention within each packed sequence, with no padding anywhere: qkv (N, 3H)
    -> context (N, H), through `torch.nn.attention.varlen.varlen_attn` (FlashAttention /
    cuDNN). Check `varlen_supported` first."""
    from torch.nn.attention.varlen import varlen_attn

    N, three_h = qkv.shape
    q, k, v = (t.contiguous() for t in qkv.view(N, 3, num_heads, -1).unbind(1))  # each (N, nh, hs)
    cu = packing.cu_seqlens.to(qkv.device)
    L = packing.max_seqlen
    return varlen_attn(q, k, v, cu, cu, L, L, scale=scale).reshape(N, three_h // 3)
