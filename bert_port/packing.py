"""Packing: the real tokens of a padded batch as one (N, ...) tensor, and back.

A padded batch (B, T, H) with a (B, T) padding mask holds N real tokens. The dense layers,
the FFN and the LayerNorms act on each token on its own, so they can run on the (N, H) real
rows only; attention is the one place where tokens meet, and it needs to know where each
sequence starts and ends, which `Packing` records.

Shapes: B batch, T padded length, N real tokens, F filler rows.

Batch invariance: a text's outputs are the same bits alone or in any batch. Packing gives each
sequence the same attention call whatever its neighbours, and every other op of a layer works
row by row; what is left is the matrix multiply, whose kernels (MKL, oneDNN) pick their
blocking by the number of rows M and give a row the same bits for every M from some size on
(M >= 4 for fp32 on AVX2, M >= 16 on AVX-512). So a packed batch of fewer than `MIN_GEMM_ROWS`
rows gets filler rows, a sequence of their own that gets no attention (a zero context) and is
dropped by `pad`, and the small GEMMs outside the layers (pooler, heads) are made up to as
many rows (`speed.gemm.RowStableLinear`). The filler also makes the rows a multiple of the
GEMMs' row step (`speed.gemm.row_multiple`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Packing:
    """Where the N real tokens of a (B, T) padded batch sit.

    `indices` (N,) are flat positions in B*T, None when nothing is padded (then N = B*T and
    packing is a reshape); `cu_seqlens` (B+1,) int32 are the offsets of each sequence in the
    packed (N, ...) tensor (FlashAttention's varlen convention); `seqlens` the lengths on the
    host. The real tokens of a row stay consecutive in the packed order even when the mask
    has holes, and their positions were already added by the embeddings. `key_mask`
    (B, 1, 1, T) is True at real tokens: the boolean SDPA mask of the padded layout. It stays
    unexpanded: SDPA turns a boolean mask into a float one of the mask's own shape, and
    the CPU kernel is markedly slower with a (B, 1, T, T) one.
    """

    indices: Tensor | None
    cu_seqlens: Tensor
    seqlens: tuple[int, ...]
    batch_size: int
    seq_len: int
    key_mask: Tensor
    filler: int = 0  # F zero rows after the N real ones, a sequence of their own (`with_filler`)

    @property
    def num_tokens(self) -> int:
        """Rows of the packed tensor: the N real tokens and the F filler rows."""
        return sum(self.seqlens)

    @property
    def max_seqlen(self) -> int:
        return max(self.seqlens)

    @property
    def starts(self) -> tuple[int, ...]:
        """The row where each sequence starts in the packed (N, ...) tensor, on the host."""
        return tuple(itertools.accumulate(self.seqlens[:-1], initial=0))


def pack(attention_mask: Tensor) -> Packing:
    """Index the real tokens of a (B, T) 0/1 (int, float or bool) padding mask. One host
    sync (the lengths), so call it outside `torch.export` and `torch.compile`."""
    if attention_mask.dim() != 2:
        raise ValueError(f"pack needs a (batch, seq_len) padding mask, got shape {tuple(attention_mask.shape)}")
    keep = attention_mask.bool()  # (B, T)
    B, T = keep.shape
    lens = keep.sum(1)  # (B,)
    cu_seqlens = F.pad(lens.cumsum(0), (1, 0)).to(torch.int32)  # (B+1,)
    seqlens = tuple(lens.tolist())
    indices = None if all(n == T for n in seqlens) else keep.flatten().nonzero().squeeze(1)  # (N,)
    return Packing(indices, cu_seqlens, seqlens, B, T, key_mask=keep[:, None, None, :])


MIN_GEMM_ROWS = 16


def with_filler(x: Tensor, packing: Packing, multiple: int = 1) -> tuple[Tensor, Packing]:
    """Packed rows x (N, ...) with zero rows appended up to at least `MIN_GEMM_ROWS` and a
    multiple of `multiple` (the row counts the GEMMs run on, `speed.gemm.row_multiple`: no GEMM pads
    rows of its own), as one more sequence, and the packing that says so; unchanged when N is
    such a count already."""
    n = x.shape[0]
    filler = max(MIN_GEMM_ROWS, -(-n // multiple) * multiple) - n
    if filler <= 0:
        return x, packing
    x = F.pad(x, (0, 0) * (x.dim() - 1) + (0, filler))
    cu_seqlens = torch.cat([packing.cu_seqlens, packing.cu_seqlens[-1:] + filler])
    return x, dataclasses.replace(packing, cu_seqlens=cu_seqlens, seqlens=(*packing.seqlens, filler), filler=filler)


def unpad(x: Tensor, packing: Packing) -> Tensor:
    """(B, T, ...) -> (N, ...): the real tokens, in row-major order."""
    flat = x.reshape(packing.batch_size * packing.seq_len, *x.shape[2:])
    return flat if packing.indices is None else flat.index_select(0, packing.indices)


def pad(x: Tensor, packing: Packing) -> Tensor:
    """(N + F, ...) -> (B, T, ...), zeros at padding positions, filler rows dropped.
    Differentiable (out of place)."""
    if packing.filler:
        x = x[: x.shape[0] - packing.filler]
    if packing.indices is not None:
        flat = x.new_zeros(packing.batch_size * packing.seq_len, *x.shape[1:])
        x = flat.index_copy_(0, packing.indices, x)  # in place on a fresh buffer: autograd handles it
    return x.view(packing.batch_size, packing.seq_len, *x.shape[1:])
