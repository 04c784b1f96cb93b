"""Fast paths for the BERT encoder: unpadded (variable-length) execution, a fused QKV
projection and bf16 autocast, plus an optional `torch.compile` wrapper.

These are plain functions over the modules of `bert.py`: they read a `BertLayer`'s
parameters and never own any, so the state dict, the key table and the assignment-style
structure of `bert.py` stay as they are. `BertModel.encode` calls `encode_unpadded` when
`can_use_fast_path` says the batch allows it; `BertSelfAttention.forward` may call
`qkv_projection`.

Unpadded execution: a padded batch (B, T, H) with a (B, T) padding mask holds N real
tokens. The dense layers, the FFN and the LayerNorms act on each token on its own, so they
run on the (N, H) real rows only; attention is the one place where tokens meet, and it
runs within each sequence (by default through the same SDPA kernel and padded layout that
transformers uses, on the (N, 3H) projections scattered back; see `varlen_attention`).
On the MR movie-review batches about half of a padded batch is padding.

Parity: every row of every matmul, GELU and LayerNorm is computed from the same numbers
as in the padded path. On the CPU the default path gave bit-identical real tokens to
transformers' sdpa path on 40 MR batches of all-MiniLM-L6-v2; the other attention kinds
round differently (up to 3e-6). Padding positions of the output are zeros rather than the
values the padded path computes from pad tokens (which no consumer of a BERT should read:
they are masked out of every attention and of mean pooling).

Shapes: B batch, T padded length, N real tokens, H hidden, nh heads, hs head size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:  # imported for annotations only: bert.py will import this module
    from .bert import BertLayer, BertSelfAttention

ATTENTION_KINDS = ("padded_sdpa", "padded_eager", "per_sequence", "nested", "block_diagonal", "varlen")


# -- packing ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Packing:
    """Where the N real tokens of a (B, T) padded batch sit.

    `indices` (N,) are flat positions in B*T, None when nothing is padded (then N = B*T
    and packing is a reshape); `cu_seqlens` (B+1,) are the offsets of each sequence in the
    packed (N, ...) tensor (FlashAttention's varlen convention); `key_mask` (B, 1, 1, T) is
    the boolean SDPA mask of the padded layout (True = attend), None without padding;
    `right_padded` says each row is one run of real tokens from position 0. Every kind
    of attention here works either way: the real tokens of a row are consecutive in the
    packed order even when the mask has holes, and positions were added by the embeddings.
    """

    indices: Tensor | None
    cu_seqlens: Tensor
    seqlens: tuple[int, ...]
    batch_size: int
    seq_len: int
    key_mask: Tensor | None
    right_padded: bool

    @property
    def num_tokens(self) -> int:
        return sum(self.seqlens)


def pack(attention_mask: Tensor | None, batch_size: int | None = None, seq_len: int | None = None) -> Packing:
    """Index the real tokens of a (B, T) 0/1 (int, float or bool) padding mask; with no
    mask, every one of `batch_size` x `seq_len` tokens is real."""
    if attention_mask is None:
        if batch_size is None or seq_len is None:
            raise ValueError("pack(None) needs batch_size and seq_len")
        lens = torch.full((batch_size,), seq_len, dtype=torch.long)
        cu = F.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
        return Packing(None, cu, (seq_len,) * batch_size, batch_size, seq_len, None, True)
    if attention_mask.dim() != 2:
        raise ValueError(f"pack needs a (batch, seq_len) padding mask, got shape {tuple(attention_mask.shape)}")
    keep = attention_mask.bool()  # (B, T)
    B, T = keep.shape
    lens = keep.sum(1)  # (B,)
    cu = F.pad(lens.cumsum(0), (1, 0)).to(torch.int32)  # (B+1,)
    seqlens = tuple(lens.tolist())
    if all(n == T for n in seqlens):
        return Packing(None, cu, seqlens, B, T, None, True)
    prefix = torch.arange(T, device=keep.device)[None] < lens[:, None]  # (B, T)
    return Packing(
        indices=keep.flatten().nonzero().squeeze(1),  # (N,)
        cu_seqlens=cu,
        seqlens=seqlens,
        batch_size=B,
        seq_len=T,
        key_mask=keep[:, None, None, :],
        right_padded=bool(torch.equal(prefix, keep)),
    )


def unpad(hidden_states: Tensor, packing: Packing) -> Tensor:
    """(B, T, ...) -> (N, ...): the real tokens, in row-major order."""
    flat = hidden_states.reshape(packing.batch_size * packing.seq_len, *hidden_states.shape[2:])
    return flat if packing.indices is None else flat.index_select(0, packing.indices)


def pad(x: Tensor, packing: Packing) -> Tensor:
    """(N, ...) -> (B, T, ...), zeros at padding positions. Differentiable (out of place)."""
    if packing.indices is not None:
        flat = x.new_zeros(packing.batch_size * packing.seq_len, *x.shape[1:])
        x = flat.index_copy_(0, packing.indices, x)  # in place on a fresh buffer: autograd handles it
    return x.view(packing.batch_size, packing.seq_len, *x.shape[1:])


def can_use_fast_path(
    attention_mask: Tensor | None, *, is_decoder: bool = False, output_attentions: bool = False
) -> bool:
    """Whether `encode_unpadded` computes what the padded path computes on this batch.

    It needs no mask or a 2-D padding mask (3-D and prepared 4-D masks can mix tokens in
    ways a packing does not describe), an encoder (no causal mask), no attention
    probabilities (no kernel here returns them), and position 0 real in every row: the
    pooler reads position 0 even when it is padding, so a left-padded batch keeps the
    padded path.
    """
    if is_decoder or output_attentions:
        return False
    if attention_mask is None:
        return True
    return attention_mask.dim() == 2 and bool(attention_mask[:, 0].bool().all())


# -- fused QKV ----------------------------------------------------------------------------


def qkv_weight(attn: BertSelfAttention) -> tuple[Tensor, Tensor]:
    """The (3H, H) weight and (3H,) bias of query, key and value stacked, in that order.

    Concatenated afresh on every call (a 3H x H copy per layer, small next to the matmul
    it feeds): gradients flow back to the three `nn.Linear`s, and no cache can go stale.
    A cache keyed on the autograd version counter did go stale, because fused optimisers
    (`AdamW(fused=True)`) update parameters in place without bumping it.
    """
    linears = (attn.query, attn.key, attn.value)
    weight = torch.cat([lin.weight for lin in linears])
    bias = torch.cat([lin.bias for lin in linears])
    return weight, bias


def qkv_projection(attn: BertSelfAttention, x: Tensor) -> Tensor:
    """x (..., H) -> (..., 3H): query, key and value projections in one matmul."""
    weight, bias = qkv_weight(attn)
    return F.linear(x, weight, bias)


# -- attention on packed sequences ----------------------------------------------------------


def varlen_attention(
    qkv: Tensor,
    packing: Packing,
    num_heads: int,
    scale: float,
    dropout_p: float = 0.0,
    kind: str = "padded_sdpa",
) -> Tensor:
    """Self-attention within each sequence of a packed batch: qkv (N, 3H) -> context (N, H).

    kind:
      padded_sdpa    scatter to (B, T) and run SDPA with the key mask (one kernel call);
      padded_eager   the same layout through matmul, softmax, matmul (HF's eager maths);
      per_sequence   one SDPA call per sequence, no mask and no padding;
      nested         torch.nested jagged tensors through SDPA;
      block_diagonal one SDPA call over all N tokens with a block-diagonal mask;
      varlen         torch.nn.attention.varlen.varlen_attn (FlashAttention / cuDNN on CUDA,
                     fp16/bf16, no dropout); falls back to padded_sdpa elsewhere.
    On the CPU with MR-like batches (32 sentences, 5 to 60 tokens), per sequence is the
    fastest (about 1.8x padded_sdpa for the attention alone) but rounds differently from
    transformers (up to 3e-6 on all-MiniLM-L6-v2); padded_sdpa runs transformers' own
    kernel on the same numbers and matches it bit for bit. See `default_attention_kind`.
    """
    N, three_h = qkv.shape
    H = three_h // 3
    hs = H // num_heads
    if kind == "varlen" and not _varlen_ok(qkv, dropout_p):
        kind = "padded_sdpa"
    if kind == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        q, k, v = (t.contiguous() for t in qkv.view(N, 3, num_heads, hs).unbind(1))  # each (N, nh, hs)
        cu = packing.cu_seqlens.to(qkv.device)
        L = max(packing.seqlens)
        return varlen_attn(q, k, v, cu, cu, L, L, scale=scale).reshape(N, H)
    if kind == "padded_sdpa" or kind == "padded_eager":
        B, T = packing.batch_size, packing.seq_len
        qkv_p = pad(qkv, packing).view(B, T, 3, num_heads, hs)
        q, k, v = (t.transpose(1, 2) for t in qkv_p.unbind(2))  # each (B, nh, T, hs)
        if kind == "padded_sdpa":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=packing.key_mask, dropout_p=dropout_p, scale=scale)
        else:
            scores = torch.matmul(q, k.transpose(2, 3)) * scale  # (B, nh, T, T)
            if packing.key_mask is not None:
                scores = scores.masked_fill(~packing.key_mask, torch.finfo(scores.dtype).min)
            probs = F.softmax(scores, dim=-1)
            if dropout_p:
                probs = F.dropout(probs, dropout_p)
            ctx = torch.matmul(probs, v)
        ctx = ctx.transpose(1, 2).reshape(B, T, H)  # (B, T, H)
        return unpad(ctx, packing)
    if kind == "per_sequence":
        outs = []
        for chunk in qkv.split(list(packing.seqlens)):
            L = chunk.shape[0]
            q, k, v = chunk.view(1, L, 3, num_heads, hs).permute(2, 0, 3, 1, 4)  # each (1, nh, L, hs)
            ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)
            outs.append(ctx.transpose(1, 2).reshape(L, H))
        return torch.cat(outs)
    if kind == "nested":
        offsets = packing.cu_seqlens.to(torch.int64)
        parts = qkv.view(N, 3, num_heads, hs).unbind(1)  # each (N, nh, hs)
        q, k, v = (
            torch.nested.nested_tensor_from_jagged(p.contiguous(), offsets).transpose(1, 2) for p in parts
        )  # each (B, nh, j, hs)
        ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)
        return ctx.transpose(1, 2).values().reshape(N, H)
    if kind == "block_diagonal":
        seq_id = torch.repeat_interleave(
            torch.arange(packing.batch_size, device=qkv.device),
            torch.tensor(packing.seqlens, device=qkv.device),
        )  # (N,)
        mask = seq_id[:, None] == seq_id[None, :]  # (N, N)
        q, k, v = qkv.view(N, 3, num_heads, hs).permute(1, 2, 0, 3)[:, None]  # each (1, nh, N, hs)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
        return ctx[0].transpose(0, 1).reshape(N, H)
    raise ValueError(f"unknown attention kind {kind!r}; use one of {', '.join(ATTENTION_KINDS)}")


def _varlen_ok(qkv: Tensor, dropout_p: float) -> bool:
    if not (qkv.is_cuda and qkv.dtype in (torch.float16, torch.bfloat16) and dropout_p == 0.0):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  (torch >= 2.9)
    except ImportError:
        return False
    return True


def default_attention_kind(device: torch.device | str, dtype: torch.dtype, training: bool) -> str:
    """The attention kind `encode_unpadded` should use when the caller has no preference:
    varlen FlashAttention for half precision inference on CUDA, otherwise padded SDPA
    (bit-identical to transformers' sdpa path on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and not training:
        return "varlen"
    return "padded_sdpa"


# -- the unpadded encoder -------------------------------------------------------------------


def layer_forward_unpadded(
    layer: BertLayer, x: Tensor, packing: Packing, attention: str = "padded_sdpa", fused_qkv: bool = True
) -> Tensor:
    """One `BertLayer` on the real tokens: x (N, H) -> (N, H). Same operations in the same
    order as `BertLayer.forward` (so the same dropout modules in training), on N rows."""
    attn = layer.self_attention
    if fused_qkv:
        qkv = qkv_projection(attn, x)  # (N, 3H)
    else:
        qkv = torch.cat([attn.query(x), attn.key(x), attn.value(x)], dim=-1)
    dropout_p = attn.dropout.p if attn.training else 0.0
    ctx = varlen_attention(qkv, packing, attn.num_attention_heads, attn.scaling, dropout_p, attention)
    h = layer.add_norm(x, ctx, layer.attention_dense, layer.attention_dropout, layer.attention_layer_norm)
    interm = layer.interm_af(layer.interm_dense(h))
    return layer.add_norm(h, interm, layer.out_dense, layer.out_dropout, layer.out_layer_norm)


def encode_unpadded(
    layers: torch.nn.ModuleList | list[BertLayer],
    hidden_states: Tensor,
    attention_mask: Tensor | None,
    *,
    attention: str = "padded_sdpa",
    fused_qkv: bool = True,
    output_hidden_states: bool = False,
    layer_fn: Callable | None = None,
) -> tuple[Tensor, tuple[Tensor, ...] | None]:
    """Run `layers` on the real tokens of `hidden_states` (B, T, H) only.

    Returns the last hidden state (B, T, H), zeros at padding, and with
    `output_hidden_states` the input and every layer's output, padded the same way.
    `layer_fn` replaces `layer_forward_unpadded` (e.g. its `torch.compile`d form).
    """
    packing = pack(attention_mask, *hidden_states.shape[:2])
    fn = layer_fn or layer_forward_unpadded
    x = unpad(hidden_states, packing)  # (N, H)
    all_hidden = [pad(x, packing)] if output_hidden_states else None
    for layer in layers:
        x = fn(layer, x, packing, attention, fused_qkv)
        if output_hidden_states:
            all_hidden.append(pad(x, packing))
    return pad(x, packing), tuple(all_hidden) if output_hidden_states else None


# -- bf16 autocast and torch.compile --------------------------------------------------------


def autocast(device_type: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> torch.autocast:
    """Mixed precision for inference or training: matmuls in `dtype`, LayerNorm and softmax
    in fp32 (torch's autocast op lists). Weights stay fp32, so the checkpoint is unchanged."""
    return torch.autocast(device_type=device_type, dtype=dtype)


def bf16_matmul_is_fast(device: str | torch.device = "cpu") -> bool:
    """Whether this device has native bf16 matmuls. CPUs without AVX512-BF16 or AMX emulate
    them about 25x slower than fp32 (measured on an AVX2 EPYC), so bf16 is no speedup there."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def compile_layer_fn(**compile_kwargs) -> Callable:
    """`layer_forward_unpadded` through `torch.compile` (dynamic shapes: N changes with
    every batch). Off by default: compiling costs tens of seconds per new shape bucket."""
    compile_kwargs.setdefault("dynamic", True)
    return torch.compile(layer_forward_unpadded, **compile_kwargs)
