"""The dense layers of the fast path in inference: oneDNN GEMMs on prepacked weights whose
result for a row does not depend on how many rows the batch has (batch invariance), with the
FFN's activation and the residual addition in the GEMM's epilogue. bf16 GEMMs run on the AMX
kernel (`kernels.amx_linear`) where the CPU has AMX. Training, autograd, other dtypes and other
devices take `F.linear`. docs/architecture.md says why each choice, with the measurements.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..packing import MIN_GEMM_ROWS
from . import kernels

# oneDNN (through torch's ideep) keeps a compiled kernel per GEMM shape, up to 1024 of them
# (LRU_CACHE_CAPACITY): a corpus of unpadded batches, one row count each, grew the embedding
# command's memory over a corpus (docs/speed.md). Row counts in steps of FP32_ROW_STEP (and
# bf16's one block shape) keep those kernels few; zero rows cost at most a step a call. 32: the
# fastest of 64, 32, 16 and 8 on the bench's MR batches (docs/speed.md).
FP32_ROW_STEP = 32
BF16_ROW_BLOCK = 128  # of 32, 64, 128 and 256, the fastest on MR batches (about 900 rows)
AMX_ROW_STEP = 32  # rows of the AMX kernel's blocks (csrc/amx_linear.c)
AMX_COLUMNS = 128  # output columns per task of its threads (of 64, 128 and 256, the fastest on MiniLM)
_CACHE = "_row_stable_weight"
PACK_ROWS_HINT = 1024  # the batch size oneDNN is told to expect when it lays the weight out


def settle_vector_math() -> None:
    """Call each VML function the model can reach once, on one thread (8 elements are far
    below torch's parallel grain), so that no later call is a process's first. Microseconds."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((8,), 0.5, dtype=dtype)
        for op in (torch.tanh, torch.erf, torch.exp, torch.log):
            op(x)


settle_vector_math()


def tracing() -> bool:
    """Under torch.compile, torch.export or torch.jit.trace: shapes may be symbolic, so the fast
    path's row padding and packing (host-side decisions on sizes) step aside for plain ops."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.jit.is_tracing()


def row_stable_dtype(x: Tensor, weight: Tensor) -> torch.dtype | None:
    """The dtype `row_stable_linear` runs x (N, K) through oneDNN in, or None for `F.linear`:
    CPU inference in fp32, or in bf16 (bf16 weights, or fp32 or bf16 ones under bf16 autocast)
    where oneDNN has native bf16. oneDNN's op is outside autocast, so autocast's dtype is the
    one `F.linear` would compute in, and the casts are made here."""
    floats = (torch.float32, torch.bfloat16)
    if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):  # F.linear would cast all three
        dtype = torch.get_autocast_dtype("cpu")
        dtypes_ok = dtype == torch.bfloat16 and {x.dtype, weight.dtype} <= set(floats)
    else:
        dtype = x.dtype
        dtypes_ok = x.dtype == weight.dtype and x.dtype in floats
    stable = (
        dtypes_ok
        and x.dim() == 2
        and x.device.type == "cpu"
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and not tracing()
        and torch.backends.mkldnn.is_available()
        and (dtype == torch.float32 or _native_bf16())
    )
    return dtype if stable else None


@functools.cache
def _native_bf16() -> bool:
    """Whether oneDNN has native bf16 kernels here (AVX512-BF16 or AMX, not capped by
    ONEDNN_MAX_CPU_ISA); without them bf16 takes `F.linear`, whose emulation is row-stable."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def row_multiple(x: Tensor, weight: Tensor, batch_invariant: bool = True) -> int:
    """The row counts `row_stable_linear` runs x (N, K) on are multiples of this: N itself
    where it takes `F.linear`."""
    dtype = row_stable_dtype(x, weight)
    if dtype is None:
        return 1
    if dtype == torch.bfloat16 and _amx_runs(x.shape[1], weight.shape[0]):
        return AMX_ROW_STEP
    if dtype == torch.float32 and _f32_runs(weight.shape[0]):
        return 1  # any row count: the kernel keeps no per-shape state
    return BF16_ROW_BLOCK if dtype == torch.bfloat16 and batch_invariant else FP32_ROW_STEP


# The step alone still let a corpus meet a new row count in most batches (a 4096-token batch
# has 2,000-4,096 real tokens: 64 row counts in steps of 32, each with its kernels, 162 MiB more
# at 20,000 texts than at 2,000 with all-MiniLM-L6-v2). Above 1024 rows the counts are made
# multiples of a step that grows with N too: ROW_BUCKETS_PER_OCTAVE of them in every octave,
# so the kernels a corpus needs are bounded whatever its size, at most 1/16 more rows.
ROW_BUCKETS_PER_OCTAVE = 16


def row_bucket_multiple(n: int, multiple: int) -> int:
    """The multiple the packed rows' count n is rounded up to: `multiple` (the GEMMs' row step),
    or a larger power of two where n is large, so that one octave of n holds at most
    `ROW_BUCKETS_PER_OCTAVE` row counts. `multiple` 1 (GEMMs on `F.linear`) stays 1."""
    if multiple <= 1 or n <= 0:
        return multiple
    octave_step = 1 << max(0, n.bit_length() - 1 - (ROW_BUCKETS_PER_OCTAVE.bit_length() - 1))
    return max(multiple, octave_step) if multiple & (multiple - 1) == 0 else multiple


def _amx_runs(k: int, m: int) -> bool:
    """Whether (N, k) x (k, m) bf16 GEMMs run on the AMX kernel: its tiles take k and m in 32s."""
    return k > 0 and m > 0 and k % 32 == 0 and m % 32 == 0 and kernels.amx_ready()


def _f32_runs(m: int) -> bool:
    """Whether fp32 GEMMs of m outputs run on the AVX2 kernel: it takes m in 16s."""
    return m > 0 and m % 16 == 0 and kernels.f32_linear_ready()


def _on_cpu(x: Tensor, sources: tuple[Tensor | None, ...], m: int, residual: Tensor | None) -> bool:
    """Whether a call can run on one of our kernels: x (N, k) matching the weight, every tensor
    on the CPU, a residual of exactly (N, m); anything else goes to oneDNN, whose checks and
    errors then apply."""
    return (
        x.shape[1] == sources[0].shape[1]
        and all(t.device.type == "cpu" for t in sources if t is not None)
        and (residual is None or (residual.shape == (x.shape[0], m) and residual.device.type == "cpu"))
    )


def _amx_takes(x: Tensor, sources: tuple[Tensor | None, ...], m: int, residual: Tensor | None) -> bool:
    """Whether this call runs on the AMX kernel (`_on_cpu`, and k and m in its tiles' 32s)."""
    return _on_cpu(x, sources, m, residual) and _amx_runs(sources[0].shape[1], m)


# Activations oneDNN computes in a GEMM's epilogue: (post-op, algorithm). In fp32 the GELU gives
# ATen's bits on the AVX-512 Xeon (docs/architecture.md); other activations run after the GEMM, and so
# does the GELU where oneDNN runs AVX2 kernels (`_onednn_gelu_fused`).
POST_OPS: dict[Callable, tuple[str, str]] = {F.gelu: ("gelu", "none"), F.relu: ("relu", "")}


@functools.cache
def _onednn_gelu_fused() -> bool:
    """Whether oneDNN's GEMMs take the GELU into their epilogue: where its kernels are AVX-512
    ones (the CPU has oneDNN's avx512_core, AVX-512 F, BW, VL and DQ, and ONEDNN_MAX_CPU_ISA, read
    once as oneDNN reads it, does not cap it below). Its AVX2 erf post-op is slower than the GEMM
    followed by ATen's in-place GELU, which gives the same bits in fp32 (in bf16 the output is
    rounded before the GELU, as `F.linear` and `F.gelu` do); the measurements are in docs/speed.md."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    avx512_core = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= kernels.cpu_flags()
    return avx512_core and (cap == "ALL" or cap.startswith(("AVX512", "AVX10")))


# The activations after our fp32 kernel, in place: ATen's, so the bits are F.gelu's and F.relu's.
INPLACE: dict[Callable, Callable] = {F.gelu: torch.ops.aten.gelu_, F.relu: torch.ops.aten.relu_}


def epilogue(y: Tensor, activation: Callable | None, residual: Tensor | None) -> Tensor:
    """`activation(y) + residual`, each where given: what a fused GEMM computes, unfused."""
    y = y if activation is None else activation(y)
    return y if residual is None else y + residual


def row_stable_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    owner: nn.Module,
    activation: Callable | None = None,
    residual: Tensor | None = None,
    batch_invariant: bool = True,
) -> Tensor:
    """`epilogue(F.linear(x, weight, bias), activation, residual)` for packed rows x (N, K),
    through oneDNN (bf16 where the CPU has AMX: our AMX kernel) where `row_stable_dtype`
    allows, with the packed copy of `weight` cached on `owner`; the activation (one of
    `POST_OPS`) or the residual (N, M) run in the GEMM's epilogue there. A row's bits do not
    depend on N, except in bf16 on oneDNN without `batch_invariant`, which runs all N rows in
    one call instead of blocks."""
    return _linear(x, (weight, bias), owner, activation, residual, batch_invariant)


def stack_linears(linears: tuple[nn.Linear, ...]) -> tuple[Tensor, Tensor]:
    """The weights (sum of outs, in) and biases of `linears`, stacked in that order: one GEMM
    for all of them (the fused QKV)."""
    return torch.cat([m.weight for m in linears]), torch.cat([m.bias for m in linears])


def fused_row_stable_linear(
    x: Tensor, linears: tuple[nn.Linear, ...], owner: nn.Module, batch_invariant: bool = True
) -> Tensor:
    """`linears` stacked into one GEMM (`stack_linears`) on packed rows x (N, K), as
    `row_stable_linear`; the stacked, packed weight and the stacked bias are cached on `owner`
    (built once, not concatenated on every call)."""
    return _linear(x, linears, owner, None, None, batch_invariant)


def _linear(x, layers, owner, activation, residual, batch_invariant) -> Tensor:
    """`row_stable_linear` of a (weight, bias) pair, or of the `nn.Linear`s `layers` stacked."""
    stacked = isinstance(layers[0], nn.Module)
    sources = tuple(t for m in layers for t in (m.weight, m.bias)) if stacked else layers
    dtype = row_stable_dtype(x, sources[0])
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*sources, residual)):
        dtype = None  # autograd (a trainable bias alone, BitFit, or key and value): F.linear, which records it
    fusable = activation is None or activation in POST_OPS
    if residual is not None:  # (autocast's fp32 residual stays an addition after the GEMM, as F.linear + add)
        fusable = fusable and activation is None and residual.dtype == dtype
    if dtype is None or not fusable:
        weight_bias = stack_linears(layers) if stacked else layers
        y = F.linear(x, *weight_bias) if dtype is None else _linear(x, layers, owner, None, None, batch_invariant)
        return epilogue(y, activation, residual)

    m = sum(layer.weight.shape[0] for layer in layers) if stacked else sources[0].shape[0]
    amx = dtype == torch.bfloat16 and _amx_takes(x, sources, m, residual)
    f32 = dtype == torch.float32 and _on_cpu(x, sources, m, residual) and _f32_runs(m)
    kernel = "amx" if amx else "f32" if f32 else "onednn"
    build = functools.partial(_packed, layers, stacked, dtype, kernel)
    packed, bias = _cached(owner, tuple(t for t in sources if t is not None), build, dtype, kernel)
    post_op = POST_OPS.get(activation, ("none", ""))
    if amx:
        return _amx_linear(x.to(dtype), packed, m, bias, post_op[0], residual)
    if f32:
        y = kernels.f32_linear(_rows(x), packed, m, bias, None if residual is None else _rows(residual))
        return y if activation is None else INPLACE[activation](y)
    block = BF16_ROW_BLOCK if dtype == torch.bfloat16 and batch_invariant else None
    if activation is F.gelu and not _onednn_gelu_fused():
        return torch.ops.aten.gelu_(_onednn_linear(x.to(dtype), packed, bias, ("none", ""), None, block))
    return _onednn_linear(x.to(dtype), packed, bias, post_op, residual, block)


def _packed(layers, stacked: bool, dtype: torch.dtype, kernel: str) -> tuple[Tensor, Tensor | None]:
    """The weight of `layers` (stacked where `stacked`) packed for `kernel` in `dtype`, and the
    bias in `dtype` (the AMX kernel reads it as float32, exactly)."""
    weight, bias = stack_linears(layers) if stacked else layers
    bias = None if bias is None else bias.detach().to(dtype)
    if kernel == "amx":
        return _amx_pack(weight.detach().to(dtype)), None if bias is None else bias.float()
    if kernel == "f32":
        return _f32_pack(weight.detach()), None if bias is None else bias.contiguous()
    return _pack(weight.to(dtype)), bias


def _pad_rows(x: Tensor, residual: Tensor | None, step: int) -> tuple[Tensor, Tensor | None]:
    """x (N, K) and the residual (N, M), if any, made up to a multiple of `step` rows by zero rows
    (which the callers drop from the output)."""
    extra = -x.shape[0] % step
    if not extra:
        return x, residual
    return F.pad(x, (0, 0, 0, extra)), None if residual is None else F.pad(residual, (0, 0, 0, extra))


def _rows(t: Tensor) -> Tensor:
    """t (N, C) with rows the kernel can step through: unit column stride, rows apart by at least C
    (not an expanded view)."""
    return t if t.stride(1) == 1 and t.stride(0) >= t.shape[1] else t.contiguous()


AMX_ACTIVATIONS = {"none": 0, "gelu": 1, "relu": 2}  # post-op -> csrc/amx_linear.c's ACT_*


def _amx_pack(weight: Tensor) -> Tensor:
    """A (m, k) bf16 weight as the AMX kernel's tiles: for every 16 outputs, for every 32 inputs,
    16 rows of 16 (output, pair of consecutive inputs), as TDPBF16PS reads them."""
    m, k = weight.shape
    return weight.reshape(m // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def _f32_pack(weight: Tensor) -> Tensor:
    """A (m, k) fp32 weight as the AVX2 kernel reads it: for every 16 outputs, for every input,
    their 16 weights."""
    m, k = weight.shape
    return weight.reshape(m // 16, 16, k).permute(0, 2, 1).contiguous()


def _amx_linear(
    x: Tensor, packed: Tensor, m: int, bias: Tensor | None, post_op: str, residual: Tensor | None
) -> Tensor:
    """bf16 rows x (N, k) through the AMX kernel, in one call: rows made up to a multiple of
    `AMX_ROW_STEP` by zero rows (none on the packed path), which are dropped."""
    n = x.shape[0]
    x, residual = _pad_rows(x, residual, AMX_ROW_STEP)
    rows = x.shape[0]
    x, residual = _rows(x), None if residual is None else _rows(residual)
    out = kernels.amx_linear(x, packed, m, bias, AMX_ACTIVATIONS[post_op], residual, AMX_COLUMNS)
    return out if rows == n else out[:n]


def _onednn_linear(
    x: Tensor, packed: Tensor, bias: Tensor | None, post_op: tuple[str, str], residual: Tensor | None, block: int | None
) -> Tensor:
    """Calls of `block` rows each (bf16's batch invariance), or one call, on the rows made up to
    a multiple of `block` or `FP32_ROW_STEP` by zero rows (none on the packed path, whose rows
    are a multiple already), which are dropped. `post_op` is an activation of `POST_OPS` or
    ("none", ""); `residual` (N, M) is added in the epilogue instead."""
    n = x.shape[0]
    x, residual = _pad_rows(x, residual, block or FP32_ROW_STEP)
    rows = x.shape[0]
    blocks = x.split(block) if block else (x,)
    if residual is None:
        out = [torch.ops.mkldnn._linear_pointwise(b, packed, bias, post_op[0], [], post_op[1]) for b in blocks]
    else:
        others = residual.split(block) if block else (residual,)
        out = [torch.ops.mkldnn._linear_pointwise.binary(b, r, packed, bias, "add") for b, r in zip(blocks, others)]
    out = out[0] if len(out) == 1 else torch.cat(out)
    return out if rows == n else out[:n]


def _pack(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


class _Cache:
    """What `_cached` keeps on a module: one entry per kernel ("onednn", "amx"), so that a model
    run both batch-invariant and not in bf16 (the bench's two rows, a user switching) does not
    pack its weights again at every switch. Copies and pickles of the module start empty: a
    packed weight may be an opaque oneDNN tensor, which neither `copy.deepcopy` nor `pickle` take."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple] = {}  # kernel -> (key, value, gradient hooks)

    def __deepcopy__(self, memo) -> _Cache:
        return _Cache()

    def __reduce__(self):
        return _Cache, ()


def _cached(owner: nn.Module, sources: tuple[Tensor, ...], build, dtype: torch.dtype, kernel: str):
    """`build()`, kept on `owner` for `kernel` until a tensor of `sources` changes: its storage
    or version counter, or a gradient accumulated into it (the step that follows may be a fused
    optimiser's, which leaves the version counter alone); or the dtype (the sources' or the
    one computed in, autocast's); not the thread count (module docstring)."""
    versions = tuple((t.data_ptr(), -1 if t.is_inference() else t._version) for t in sources)  # inference: none
    key = (versions, sources[0].dtype, dtype)
    cache = owner.__dict__.setdefault(_CACHE, _Cache())
    entry = cache.entries.get(kernel)
    if entry is None or entry[0] != key:
        _drop(owner, kernel)
        ref = weakref.ref(owner)
        hooks = [
            t.register_post_accumulate_grad_hook(lambda _, ref=ref: _drop(ref()))
            for t in sources
            if t.requires_grad and t.is_leaf
        ]
        entry = cache.entries[kernel] = (key, build(), hooks)
    return entry[1]


def _drop(owner: nn.Module | None, kernel: str | None = None) -> None:
    """Drop `owner`'s packed weight for `kernel`, or for every kernel."""
    cache = owner.__dict__.get(_CACHE) if owner is not None else None
    if cache is None:
        return
    for name in [kernel] if kernel else list(cache.entries):
        entry = cache.entries.pop(name, None)
        for hook in entry[2] if entry else ():
            hook.remove()


def clear_packed_weights(model: nn.Module) -> None:
    """Drop the prepacked weights cached on every module of `model`."""
    for module in model.modules():
        _drop(module)


class RowStableLinear(nn.Linear):
    """The `nn.Linear` that `optimize` swaps in (same parameters): in CPU inference its rows go
    through `row_stable_linear`, so that a row's result does not depend on the others. Inputs of
    any shape (..., K) are taken as rows; fewer than `MIN_GEMM_ROWS` are made up to that many by
    zero rows while `batch_invariant` (the pooler's and the heads' few rows).

    `activation` is the FFN's activation, taken in by `optimize`, and `forward(x, residual)` adds
    the residual: both in the GEMM's epilogue where it can (`fuses_epilogue`)."""

    fuses_epilogue = True
    batch_invariant: bool = True
    activation: Callable | None = None

    def __init__(self, *args, batch_invariant: bool = True, activation: Callable | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)  # nn.Linear's (in_features, out_features, bias, ...)
        self.batch_invariant, self.activation = batch_invariant, activation

    @classmethod
    def swap(cls, linear: nn.Linear, batch_invariant: bool) -> RowStableLinear:
        """`linear` itself, now of this class (its parameters, hooks and place in the model kept)."""
        if type(linear) not in (nn.Linear, cls):
            raise TypeError(f"RowStableLinear replaces an nn.Linear, not a {type(linear).__name__}")
        linear.__class__ = cls
        linear.batch_invariant = batch_invariant
        return linear

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        if tracing():
            return epilogue(F.linear(x, self.weight, self.bias), self.activation, residual)
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        if residual is not None:  # one residual row per input row (a broadcast one expanded first)
            residual = residual.expand(*x.shape[:-1], residual.shape[-1]).reshape(n, -1)
        if self.batch_invariant and n < MIN_GEMM_ROWS:
            rows = F.pad(rows, (0, 0, 0, MIN_GEMM_ROWS - n))
            residual = None if residual is None else F.pad(residual, (0, 0, 0, MIN_GEMM_ROWS - n))
        out = _linear(rows, (self.weight, self.bias), self, self.activation, residual, self.batch_invariant)
        return out[:n].reshape(*x.shape[:-1], -1)

    def row_multiple(self, x: Tensor) -> int:
        """Packed rows x (N, K) are best a multiple of this many (`row_multiple`)."""
        return row_multiple(x, self.weight, self.batch_invariant)

    def train(self, mode: bool = True) -> RowStableLinear:
        """Also drops the prepacked weight: a fused optimiser updates the weight in place without
        bumping the version counter that keys it."""
        _drop(self)
        return super().train(mode)

    def extra_repr(self) -> str:
        act = getattr(self.activation, "__name__", self.activation)
        return f"{super().extra_repr()}, batch_invariant={self.batch_invariant}, activation={act}"
