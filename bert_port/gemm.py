"""The dense layers of the packed path in inference: oneDNN GEMMs whose result for a row does
not depend on how many rows the batch has.

Batch invariance (`packing.py`) needs a GEMM that gives a row the same bits for every row
count M. torch's own CPU kernels do not on every CPU. Measured on a 2-core Xeon with
AVX-512 and AMX (README, "Same text, same bits"):

- fp32 `F.linear` runs MKL, which at 2 threads splits the reduction for some M and not for
  others: (M, 1536) x (1536, 384) gives other bits for M in 57..192 than for M = 1024, and
  bert-base's (3072 -> 768) for M in 16..384. oneDNN's inner product on a prepacked weight
  gives the same bits for every M >= 2, at 1 and 2 threads, and runs at least as fast.
- bf16 goes to oneDNN either way, whose AMX kernels pick the reduction's blocking by M when
  K is large (K = 1536: M <= 32 agree with M = 1024, most larger M do not). So bf16 GEMMs run
  in blocks of exactly `BF16_ROW_BLOCK` rows, the last one padded with zero rows: every call
  has one shape, hence one kernel, whatever the batch (a row's place in the block does not
  change its bits). That costs bf16 about a fifth of its speed on MR batches;
  `batch_invariant=False` gives it back (README, "Speed").

The prepacked weight is cached on the module, keyed on the weight's storage, version
counter, dtype and the thread count, and dropped when a gradient is accumulated into the
weight: fused optimisers update weights in place without bumping the version counter.
`clear_packed_weights` drops every cache of a model (`BertPreTrainedModel.train` calls it).
Under bf16 autocast the GEMMs run in bf16 here, as `F.linear` would. Training, autograd,
other dtypes, other devices and a torch without oneDNN take `F.linear`.

One more source of other bits is not a GEMM: MKL's vector math (VML), behind torch.tanh and
torch.erf on CPU float tensors (the pooler's tanh, the python GELUs). A process's first call
split over 2 threads raced MKL's lazy set-up on this Xeon and gave the second thread's half
other bits in half the `bert-port-predict` runs at batch 64; `settle_vector_math` makes that
first call on one thread, at import.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# oneDNN (through torch's ideep) keeps a compiled kernel per GEMM shape, up to 1024 of them
# (LRU_CACHE_CAPACITY): a corpus of unpadded batches, one row count each, grew the embedding
# command's memory by 200 MiB over 20,000 texts. Row counts in steps of FP32_ROW_STEP (and
# bf16's one block shape) keep those kernels few; zero rows cost at most a step a call.
FP32_ROW_STEP = 64
BF16_ROW_BLOCK = 128  # of 32, 64, 128 and 256, the fastest on MR batches (about 900 rows)
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
        and not torch.compiler.is_compiling()
        and torch.backends.mkldnn.is_available()
        and (dtype == torch.float32 or _native_bf16())
    )
    return dtype if stable else None


@functools.cache
def _native_bf16() -> bool:
    """Whether oneDNN has native bf16 kernels here (AVX512-BF16 or AMX, not capped by
    ONEDNN_MAX_CPU_ISA); without them bf16 takes `F.linear`, whose emulation is row-stable."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def row_stable_linear(x: Tensor, weight: Tensor, bias: Tensor | None, owner: nn.Module) -> Tensor:
    """`F.linear(x, weight, bias)` for packed rows x (N, K), with bits per row independent of
    N where `row_stable_dtype` allows; the packed copy of `weight` is cached on `owner`."""
    dtype = row_stable_dtype(x, weight)
    if dtype is None:
        return F.linear(x, weight, bias)
    sources = (weight,) if bias is None else (weight, bias)
    packed, bias = _cached(owner, sources, lambda: (_pack(weight.to(dtype)), _cast(bias, dtype)), dtype)
    return _onednn_linear(x.to(dtype), packed, bias)


def stack_linears(linears: tuple[nn.Linear, ...]) -> tuple[Tensor, Tensor]:
    """The weights (sum of outs, in) and biases of `linears`, stacked in that order: one GEMM
    for all of them (the fused QKV)."""
    return torch.cat([m.weight for m in linears]), torch.cat([m.bias for m in linears])


def fused_row_stable_linear(x: Tensor, linears: tuple[nn.Linear, ...], owner: nn.Module) -> Tensor:
    """`linears` stacked into one GEMM (`stack_linears`) on packed rows x (N, K), as
    `row_stable_linear`; the stacked, packed weight and the stacked bias are cached on `owner`
    (built once, not concatenated on every call)."""
    dtype = row_stable_dtype(x, linears[0].weight)
    if dtype is None:
        return F.linear(x, *stack_linears(linears))

    def build() -> tuple[Tensor, Tensor]:
        weight, bias = stack_linears(linears)
        return _pack(weight.to(dtype)), _cast(bias, dtype)

    packed, bias = _cached(owner, tuple(t for m in linears for t in (m.weight, m.bias)), build, dtype)
    return _onednn_linear(x.to(dtype), packed, bias)


def _cast(bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if bias is None else bias.detach().to(dtype)


def _onednn_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """fp32: one call on the rows made up to a multiple of `FP32_ROW_STEP`; bf16: calls of
    `BF16_ROW_BLOCK` rows each. Zero rows pad the last block; they are dropped."""
    n = x.shape[0]
    step = BF16_ROW_BLOCK if x.dtype == torch.bfloat16 else FP32_ROW_STEP
    rows = -(-n // step) * step
    if rows != n:
        x = torch.cat([x, x.new_zeros(rows - n, x.shape[1])])
    blocks = x.split(BF16_ROW_BLOCK) if x.dtype == torch.bfloat16 else (x,)
    out = [torch.ops.mkldnn._linear_pointwise(b, packed, bias, "none", [], "") for b in blocks]
    return (out[0] if len(out) == 1 else torch.cat(out))[:n]


def _pack(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


class _Cache:
    """What `_cached` keeps on a module. Copies and pickles of the module start empty: the
    packed weight is an opaque oneDNN tensor, which neither `copy.deepcopy` nor `pickle` take."""

    def __init__(self) -> None:
        self.entry: tuple | None = None  # (key, value, gradient hooks)

    def __deepcopy__(self, memo) -> _Cache:
        return _Cache()

    def __reduce__(self):
        return _Cache, ()


def _cached(owner: nn.Module, sources: tuple[Tensor, ...], build, dtype: torch.dtype):
    """`build()`, kept on `owner` until a tensor of `sources` changes: its storage or version
    counter, or a gradient accumulated into it (the step that follows may be a fused
    optimiser's, which leaves the version counter alone); or the dtype (the sources' or the
    one computed in, autocast's) or the thread count."""
    versions = tuple((t.data_ptr(), -1 if t.is_inference() else t._version) for t in sources)  # inference: none
    key = (versions, sources[0].dtype, dtype, torch.get_num_threads())
    cache = owner.__dict__.setdefault(_CACHE, _Cache())
    if cache.entry is None or cache.entry[0] != key:
        _drop(owner)
        ref = weakref.ref(owner)
        hooks = [
            t.register_post_accumulate_grad_hook(lambda _, ref=ref: _drop(ref()))
            for t in sources
            if t.requires_grad and t.is_leaf
        ]
        cache.entry = (key, build(), hooks)
    return cache.entry[1]


def _drop(owner: nn.Module | None) -> None:
    cache = owner.__dict__.get(_CACHE) if owner is not None else None
    if cache is not None and cache.entry is not None:
        for hook in cache.entry[2]:
            hook.remove()
        cache.entry = None


def clear_packed_weights(model: nn.Module) -> None:
    """Drop the prepacked weights cached on every module of `model`."""
    for module in model.modules():
        _drop(module)


class RowStableLinear(nn.Linear):
    """`nn.Linear` whose 2-D inputs (the packed rows of `BertModel.encode`) go through
    `row_stable_linear` while `config.batch_invariant` holds; the padded path's 3-D inputs,
    and every input of a model with `batch_invariant=False`, run `F.linear`."""

    def __init__(self, in_features: int, out_features: int, config) -> None:
        super().__init__(in_features, out_features)
        self.__dict__["config"] = config  # shared with the model, read at each call; not a submodule

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 2 or not self.config.batch_invariant:
            return F.linear(x, self.weight, self.bias)
        return row_stable_linear(x, self.weight, self.bias, self)
