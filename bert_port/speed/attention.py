"""Attention on packed real tokens (`Packing`): sequence by sequence on the CPU (every short
sequence in one call of the C kernel in inference), varlen FlashAttention on CUDA.

Shapes: B batch, T time, N real tokens, H hidden, nh heads, hs head size (H = nh * hs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention import sdpa_attention
from ..packing import Packing, pad, unpad
from . import kernels

# Sequences at least this long take the CPU flash kernel in inference: there it beats two `bmm`
# and a softmax (docs/speed.md).
FLASH_MIN_LEN = 128


def packed_attention(qkv: Tensor, packing: Packing, num_heads: int, scale: float, dropout_p: float = 0.0) -> Tensor:
    """Self-attention within each packed sequence on its real tokens only: qkv (N, 3H), the
    fused query, key and value of the real tokens -> context (N, H).

    The CPU has no varlen kernel, so each sequence gets its own attention on views of `qkv`
    (no copies in, one concatenation out). Against the padded layout this skips the
    (T^2 - L^2) masked scores of every sequence and the pad and unpad copies of q, k, v and
    the context in every layer. Which kernel, chosen by measuring each on MR batches (about
    half padding) with MiniLM on CPU (the timings are in docs/speed.md):

    - fp32 and bf16 inference, where the C kernels are installed: the sequences shorter than
      `FLASH_MIN_LEN` all in one call of a C kernel (`csrc/attention.c`, the op
      `kernels.packed_attention`), which reads `qkv` in its own dtype, computes in fp32 and writes
      the context in that dtype; one parallel region for the whole batch, where the calls below
      make three small ones per sequence, and in bf16 no fp32 copy of `qkv` and no cast of
      the context. The longer sequences run as below.
    - otherwise fp32 (and fp64): two `bmm` and a softmax per sequence (`_math_attention`), in
      inference and in training. The CPU flash kernel is slower on sequences this short
      (L of a few tens), and fp32 scores lose nothing; its backward is two more `bmm`, so a
      fine-tuning step is faster than with the padded call below. In inference a sequence of
      `FLASH_MIN_LEN` tokens or more takes the flash kernel, which wins there (it never
      materialises the (nh, L, L) scores). The choice depends on the sequence's own length,
      never on its neighbours, so a text gets the same kernel alone as in any batch.
    - otherwise bf16/fp16 inference: the same, the short sequences on an fp32 copy of `qkv`
      (one cast in per layer; faster than the flash kernel in bf16 there, and as accurate:
      the flash kernel keeps its scores and softmax in fp32 too), the long ones on the flash
      kernel in bf16/fp16.
    - bf16/fp16 training, and CUDA: one padded SDPA call over the packed rows, where a call
      per sequence costs more than the padding saves (the backward of one small flash call
      per sequence made a fine-tuning step slower than transformers'; on CUDA, a kernel
      launch per sequence).

    Filler rows (`packing.with_filler`) get no attention: their context is zeros.
    """
    half = qkv.dtype in (torch.float16, torch.bfloat16)
    training = torch.is_grad_enabled() and qkv.requires_grad
    if qkv.is_cuda or (half and training):
        return _padded_sdpa_of_packed(qkv, packing, num_heads, scale, dropout_p)
    N, three_h = qkv.shape
    head_size = three_h // (3 * num_heads)
    seqlens = packing.seqlens[:-1] if packing.filler else packing.seqlens
    flash_runs = _flash_runs(qkv, training)
    if _native_runs(qkv, packing, num_heads, training, dropout_p):
        return _native_attention(qkv, packing, seqlens, flash_runs, num_heads, scale)
    flash = [flash_runs and L >= FLASH_MIN_LEN for L in seqlens]
    native_views = _per_sequence(qkv, seqlens, num_heads)
    wide = _per_sequence(qkv.float(), seqlens, num_heads) if half and not all(flash) else native_views  # fp64 stays
    with torch.autocast(qkv.device.type, enabled=False):  # (autocast would cast the fp32 copy back)
        contexts = [
            (_flash_attention(*n, scale, dropout_p) if f else _math_attention(*w, scale, dropout_p)).transpose(0, 1)
            for f, n, w in zip(flash, native_views, wide)
        ]  # (L, nh, hs) each
    if packing.filler:
        contexts.append(qkv.new_zeros(packing.filler, num_heads, head_size))
    # One copy straight into the (N, H) rows, and in bf16/fp16 the cast back with it (autograd takes no out=).
    out = None if training else qkv.new_empty(N, num_heads, head_size)
    return torch.cat(contexts, out=out).view(N, three_h // 3)


def _native_runs(qkv: Tensor, packing: Packing, num_heads: int, training: bool, dropout_p: float) -> bool:
    """Whether the C kernel takes the short sequences: CPU inference without dropout, in fp32 or
    bf16 (what it reads and writes), on rows that fit the packing and the heads (else the PyTorch
    path says what is wrong), where the kernels are installed."""
    return (
        not training
        and not dropout_p
        and qkv.device.type == "cpu"
        and qkv.dtype in (torch.float32, torch.bfloat16)
        and qkv.dim() == 2
        and qkv.shape[0] == packing.num_tokens
        and qkv.shape[1] % (3 * num_heads) == 0
        and kernels.available()
    )


def _native_attention(
    qkv: Tensor, packing: Packing, seqlens: tuple[int, ...], flash_runs: bool, num_heads: int, scale: float
) -> Tensor:
    """`packed_attention` in CPU inference with the C kernel: qkv (N, 3H) -> (N, H), the sequences
    under `FLASH_MIN_LEN` tokens in one call (its scratch grows with L^2), each longer one as the
    PyTorch path runs it (the flash kernel where `flash_runs`, else the math path in fp32), the
    filler rows zero."""
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    N, three_h = qkv.shape
    short = [(start, L) for start, L in zip(packing.starts, seqlens) if L < FLASH_MIN_LEN]
    if short:
        starts, lens = torch.tensor(short, dtype=torch.int64).T.contiguous()
        out = kernels.packed_attention(qkv, starts, lens, num_heads, scale)  # (N, H), zero elsewhere
    else:
        out = qkv.new_zeros(N, three_h // 3)
    with torch.autocast(qkv.device.type, enabled=False):
        for start, L in zip(packing.starts, seqlens):
            if L >= FLASH_MIN_LEN:
                rows = qkv[start : start + L]
                ((q, k, v),) = _per_sequence(rows if flash_runs else rows.float(), (L,), num_heads)
                context = _flash_attention(q, k, v, scale, 0.0) if flash_runs else _math_attention(q, k, v, scale, 0.0)
                out[start : start + L] = context.transpose(0, 1).reshape(L, -1)
    return out


def _per_sequence(qkv: Tensor, seqlens: tuple[int, ...], num_heads: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Views (nh, L, hs) of each sequence's query, key and value in the fused (N, 3H) rows
    (filler rows, after the sequences, left out)."""
    N = qkv.shape[0]
    q, k, v = qkv.view(N, 3, num_heads, -1).permute(1, 2, 0, 3).unbind(0)  # each (nh, N, hs)
    return list(zip(*(t[:, : sum(seqlens)].split(seqlens, dim=1) for t in (q, k, v))))


def _flash_runs(qkv: Tensor, training: bool) -> bool:
    """Whether the CPU flash kernel may take the long sequences of `qkv`: in inference, not in
    float64 (the math path is its reference), and in bf16/fp16 only with ATen's AVX-512 kernels:
    under ATEN_CPU_CAPABILITY=default or avx2, torch 2.13's kernel fails on a CPU with AMX
    ("pack_vnni2 is only supported when avx512 is supported"; the math path takes those
    sequences there, on an fp32 copy, as on CPUs without AVX-512, where bf16 is emulated anyway)."""
    half = qkv.dtype in (torch.float16, torch.bfloat16)
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return not training and qkv.dtype != torch.float64 and (avx512 or not half)


def _math_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, dropout_p: float) -> Tensor:
    """Attention of one unmasked sequence: q, k, v (nh, L, hs) -> (nh, L, hs). The raw
    scores are scaled after the product (as transformers' eager path does), inside the
    matmul: `baddbmm` with beta=0 ignores its first argument's values."""
    nh, L = q.shape[:2]
    scores = torch.baddbmm(q.new_empty(nh, L, L), q, k.transpose(1, 2), beta=0.0, alpha=scale)
    probs = scores.softmax(-1)  # (nh, L, L)
    return torch.bmm(F.dropout(probs, dropout_p) if dropout_p else probs, v)


def _flash_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, dropout_p: float) -> Tensor:
    """The same through SDPA (4-D, as the CPU flash kernel wants: 3-D inputs fall back to
    the slower math path)."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], dropout_p=dropout_p, scale=scale)[0]


def _padded_sdpa_of_packed(qkv: Tensor, packing: Packing, num_heads: int, scale: float, dropout_p: float) -> Tensor:
    """qkv (N, 3H) -> (N, H) through one SDPA call on the padded layout (pad rows zero,
    masked as keys; their outputs are dropped)."""
    B, T = packing.batch_size, packing.seq_len
    qkv = pad(qkv, packing).view(B, T, 3, num_heads, -1)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # each (B, nh, T, hs)
    context = unpad(sdpa_attention(q, k, v, packing.key_mask, scale, dropout_p)[0], packing)  # (N, H)
    return F.pad(context, (0, 0, 0, packing.filler))  # (N + F, H): filler rows stay zero


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
