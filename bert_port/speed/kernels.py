"""The C kernels (csrc/), built at install (setup.py), as torch ops.

setup.py builds one extension per instruction set; `variant()` picks the one this CPU runs, at
import, as CTranslate2 and ggml pick theirs. Each kernel is registered with
`torch.library.custom_op` and `register_fake`, so `torch.compile` and `torch.export` see an op
with a known output, and the checks on its tensors live here, not in the callers:

- `bert_port::packed_attention`: every short sequence of a packed batch in one call (attention.c);
- `bert_port::quantize_rows`, `bert_port::dequantize_rows`: the per-row glue of int8 (int8_rows.c);
- `bert_port::amx_linear`: bf16 GEMMs on AMX tiles (amx_linear.c), where the CPU has AMX;
- `bert_port::f32_linear`: fp32 GEMMs on AVX2 (f32_linear.c), in the variants `F32_VARIANTS` names.

Beside them, not ops: `trim_heap` and `map_large_blocks`, glibc's heap settings (heap.c).

Nothing is compiled or loaded from outside the installed package. Where no variant is installed
(a pure-Python install, `BERT_PORT_KERNELS=0`), `available()` is False, a warning says so once,
and the callers run PyTorch equivalents, which give other bits (docs/architecture.md).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import platform
from pathlib import Path

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

# Best first: the instruction-set flags (as /proc/cpuinfo spells them) each variant is built for.
VARIANTS: dict[str, set[str]] = {
    "amx": {"amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx2", "fma"},
    "avx2": {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"},
    "generic": set(),
}
# ATEN_CPU_CAPABILITY caps ATen's kernels; it caps ours alike, so one variable emulates a smaller CPU.
ATEN_CAPS = {"default": "generic", "avx2": "avx2", "avx512": "avx512"}


def enabled() -> bool:
    return os.environ.get("BERT_PORT_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def cpu_flags() -> set[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (x86 `flags`, Arm `Features`); empty where unknown."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    for line in lines:
        if line.split(":")[0].strip() in ("flags", "Features"):
            return set(line.split(":", 1)[1].split())
    return set()


def choose_variant(flags: set[str], wanted: str | None = None, aten_cap: str | None = None) -> str:
    """The best variant whose instruction sets `flags` has, no better than `wanted` ($BERT_PORT_ISA)
    and than ATen's capability cap ($ATEN_CPU_CAPABILITY)."""
    order = list(VARIANTS)
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic"
    start = 0
    for cap in (wanted, ATEN_CAPS.get((aten_cap or "").lower())):
        if cap:
            if cap not in VARIANTS:
                raise ValueError(f"BERT_PORT_ISA={cap!r} is not a kernel variant; use one of {order}")
            start = max(start, order.index(cap))
    return next(v for v in order[start:] if VARIANTS[v] <= flags)


@functools.cache
def _library():
    """The installed extension of this CPU's variant, or None (warned once)."""
    if not enabled():
        return None
    wanted = os.environ.get("BERT_PORT_ISA", "").strip().lower() or None
    name = choose_variant(cpu_flags(), wanted, os.environ.get("ATEN_CPU_CAPABILITY"))
    try:
        return importlib.import_module(f"bert_port.speed._kernels_{name}")
    except ImportError as exc:
        logger.warning(
            "bert_port: its C kernels (%s variant) are not installed (%s); running PyTorch equivalents, "
            "slower, and with other bits in packed attention and int8 (docs/architecture.md). Reinstall "
            "with a C compiler (pip install .) to build them, or set BERT_PORT_KERNELS=0 to silence this",
            name,
            exc,
        )
        return None


def available() -> bool:
    return _library() is not None


def variant() -> str | None:
    """The variant running ('generic', 'avx2', 'avx512', 'amx'), or None."""
    library = _library()
    return None if library is None else library.variant


@functools.cache
def amx_ready() -> bool:
    """Whether the AMX GEMM runs here: the AMX variant, and the kernel allowed its tile state."""
    library = _library()
    return library is not None and library.variant == "amx" and library.amx_ready()


# The variants whose fp32 dense layers run on f32_linear.c instead of oneDNN: where it measured
# faster (docs/architecture.md). The AVX-512 and AMX variants keep oneDNN's AVX-512 GEMMs.
F32_VARIANTS = {"avx2"}


@functools.cache
def f32_linear_ready() -> bool:
    """Whether fp32 dense layers run on the AVX2 kernel here."""
    library = _library()
    return library is not None and library.variant in F32_VARIANTS and library.f32_linear_ready()


def trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc `malloc_trim`; nothing elsewhere or
    without the extension)."""
    library = _library()
    if library is not None:
        library.heap_trim()


def map_large_blocks(threshold: int = 1 << 20) -> None:
    """Serve blocks of `threshold` bytes or more from mappings of their own (glibc `mallopt`
    M_MMAP_THRESHOLD), so that freeing an activation returns its pages at once: glibc raises its
    own threshold as large blocks are freed (up to 32 MiB), after which activations land in the
    heap, where a trim cannot return what lies below a live block. Process-wide, so only a
    command sets it in its own process (`bert-port-embed`), never the library in a user's."""
    library = _library()
    if library is not None:
        library.heap_map_above(threshold)


def _address(t: Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _check_rows(name: str, t: Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.device.type != "cpu" or t.dim() != 2 or t.dtype not in dtypes or t.stride(1) != 1 or t.stride(0) < t.shape[1]:
        raise ValueError(
            f"{name}: needs CPU rows (N, C) of {dtypes} with unit column stride, got {t.dtype} {tuple(t.shape)} "
            f"strides {t.stride()} on {t.device}"
        )


@torch.library.custom_op("bert_port::packed_attention", mutates_args=())
def packed_attention(qkv: Tensor, starts: Tensor, lens: Tensor, num_heads: int, scale: float) -> Tensor:
    """Self-attention of the sequences at rows `starts` (S,) of lengths `lens` (S,) (int64) of the
    fused qkv (N, 3H), fp32 or bf16 -> context (N, H) in qkv's dtype; other rows are zero."""
    _check_rows("packed_attention", qkv, (torch.float32, torch.bfloat16))
    N, three_h = qkv.shape
    starts, lens = starts.to(torch.int64).contiguous(), lens.to(torch.int64).contiguous()
    if three_h % (3 * num_heads) or bool(((starts < 0) | (lens < 1) | (starts + lens > N)).any()):
        raise ValueError(
            f"packed_attention: sequences outside the {N} rows, or {three_h} columns not 3 x {num_heads} heads"
        )
    out = qkv.new_zeros(N, three_h // 3)
    failed = _library().packed_attention(
        qkv.data_ptr(), qkv.dtype == torch.bfloat16, qkv.stride(0), starts.data_ptr(), lens.data_ptr(), len(starts),
        N, num_heads, three_h // (3 * num_heads), scale, out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("packed_attention: no thread could allocate its scratch (no memory)")
    return out


@packed_attention.register_fake
def _(qkv: Tensor, starts: Tensor, lens: Tensor, num_heads: int, scale: float) -> Tensor:
    return qkv.new_empty(qkv.shape[0], qkv.shape[1] // 3)


@torch.library.custom_op("bert_port::quantize_rows", mutates_args=())
def quantize_rows(
    rows: Tensor, scale: Tensor | None, offset: Tensor | None, floor: float | None
) -> tuple[Tensor, Tensor]:
    """float32 rows (N, K) -> uint8 (N, K) and each row's step (N, 1): `Int8Linear`'s scheme."""
    _check_rows("quantize_rows", rows, (torch.float32,))
    n, k = rows.shape
    q, step = torch.empty(n, k, dtype=torch.uint8), torch.empty(n, 1)
    _library().quantize_rows(
        rows.data_ptr(), n, k, rows.stride(0), _address(scale), _address(offset), floor is not None, floor or 0.0,
        q.data_ptr(), step.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return q, step


@quantize_rows.register_fake
def _(rows: Tensor, scale: Tensor | None, offset: Tensor | None, floor: float | None) -> tuple[Tensor, Tensor]:
    return rows.new_empty(rows.shape, dtype=torch.uint8), rows.new_empty(rows.shape[0], 1)


@torch.library.custom_op("bert_port::dequantize_rows", mutates_args=("acc",))
def dequantize_rows(
    acc: Tensor, steps: Tensor, bias: Tensor, kept: Tensor, float_weight: Tensor, residual: Tensor | None
) -> None:
    """In place on the int8 products acc (N, M): bias + acc * step, + kept (N, F) x float_weight
    (F, M) channel by channel, + residual (N, M)."""
    _check_rows("dequantize_rows", acc, (torch.float32,))
    if not acc.is_contiguous() or (residual is not None and residual.shape != acc.shape):
        raise ValueError(f"dequantize_rows: needs contiguous products and a residual of {tuple(acc.shape)}")
    residual = None if residual is None else residual.contiguous()
    _library().dequantize_rows(
        acc.data_ptr(), *acc.shape, steps.data_ptr(), bias.data_ptr(), kept.data_ptr(), kept.stride(0),
        float_weight.data_ptr(), float_weight.shape[0], _address(residual), torch.get_num_threads(),
    )  # fmt: skip


@torch.library.custom_op("bert_port::amx_linear", mutates_args=())
def amx_linear(
    x: Tensor, packed: Tensor, m: int, bias: Tensor | None, activation: int, residual: Tensor | None, columns: int
) -> Tensor:
    """bf16 rows x (N, K) (N, K, m multiples of 32) times the AMX-packed weight, + bias (float32),
    activation (csrc's ACT_*), + residual (N, m) bf16 -> (N, m) bf16."""
    _check_rows("amx_linear", x, (torch.bfloat16,))
    n, k = x.shape
    out = torch.empty(n, m, dtype=torch.bfloat16)
    failed = _library().amx_linear(
        x.data_ptr(), n, k, x.stride(0), packed.data_ptr(), m, _address(bias), activation, _address(residual),
        0 if residual is None else residual.stride(0), out.data_ptr(), m, columns, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise ValueError(f"the AMX kernel does not take rows ({n}, {k}) x weight ({m}, {k})")
    return out


@amx_linear.register_fake
def _(x, packed, m, bias, activation, residual, columns) -> Tensor:
    return x.new_empty(x.shape[0], m)


@torch.library.custom_op("bert_port::f32_linear", mutates_args=())
def f32_linear(x: Tensor, packed: Tensor, m: int, bias: Tensor | None, residual: Tensor | None) -> Tensor:
    """float32 rows x (N, K) times the packed weight of m outputs (m a multiple of 16), + bias (m),
    + residual (N, m) -> (N, m) float32."""
    _check_rows("f32_linear", x, (torch.float32,))
    if residual is not None:
        _check_rows("f32_linear", residual, (torch.float32,))
    n, k = x.shape
    fits = packed.is_contiguous() and packed.dtype == torch.float32 and packed.numel() == m * k
    fits = fits and (bias is None or (bias.is_contiguous() and bias.dtype == torch.float32 and bias.numel() == m))
    if not fits or (residual is not None and residual.shape != (n, m)):
        raise ValueError(
            f"f32_linear: rows ({n}, {k}) do not fit a packed weight of {m} outputs, its bias and residual"
        )
    out = torch.empty(n, m)
    failed = _library().f32_linear(
        x.data_ptr(), n, k, x.stride(0), packed.data_ptr(), m, _address(bias), _address(residual),
        0 if residual is None else residual.stride(0), out.data_ptr(), m, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise ValueError(f"the fp32 kernel does not take rows ({n}, {k}) x weight ({m}, {k})")
    return out


@f32_linear.register_fake
def _(x, packed, m, bias, residual) -> Tensor:
    return x.new_empty(x.shape[0], m)
