"""The C attention kernel (csrc/attention.c, the op `kernels.packed_attention`, through
`speed.attention.packed_attention` in inference):
the values of the PyTorch path it replaces, a sequence's bits independent of its neighbours and
of the thread count, long sequences left to the flash kernel, filler rows zero, a NaN kept in
its own sequence, and the PyTorch path whenever the kernel is not there or does not apply."""

from __future__ import annotations

import pytest
import torch
from conftest import TOL

from bert_port.packing import pack, with_filler
from bert_port.speed import attention, kernels

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="the C kernels are not installed")


def packed_qkv(lengths: list[int], heads: int, head_size: int, dtype: torch.dtype, seed: int = 0):
    """Random (N, 3H) rows of right-padded sequences of `lengths`, and their packing."""
    torch.manual_seed(seed)
    T = max(lengths)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    packing = pack(mask)
    qkv = (torch.randn(packing.num_tokens, 3 * heads * head_size) * 2).to(dtype)
    return qkv, packing


def pytorch_path(qkv, packing, heads, scale, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(kernels, "available", lambda: False)
        return attention.packed_attention(qkv, packing, heads, scale)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [4, 32, 40, 64])  # under, at, past and twice a vector of 16 floats
def test_kernel_gives_the_pytorch_paths_values(dtype, head_size, monkeypatch):
    """Lengths 1 to 60 (every remainder of the kernel's blocks of 4 and 16) and one of 130, which
    takes the flash kernel on both paths."""
    lengths = [1, 2, 3, 5, 16, 17, 31, 33, 60, 130]
    qkv, packing = packed_qkv(lengths, 3, head_size, dtype)
    with torch.inference_mode():
        got = attention.packed_attention(qkv, packing, 3, head_size**-0.5)
        expected = pytorch_path(qkv, packing, 3, head_size**-0.5, monkeypatch)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, **TOL[dtype])
    long = slice(sum(lengths[:-1]), None)
    assert torch.equal(got[long], expected[long])  # the same flash call on both paths


@needs_kernel
def test_a_plant_in_the_softmax_is_caught(monkeypatch):
    """The comparison above can fail: a scale off by 1% (as a wrong head size would give) moves
    the context past the fp32 tolerance."""
    qkv, packing = packed_qkv([7, 19, 33], 2, 32, torch.float32)
    with torch.inference_mode():
        got = attention.packed_attention(qkv, packing, 2, 1.01 * 32**-0.5)
        expected = pytorch_path(qkv, packing, 2, 32**-0.5, monkeypatch)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, expected, **TOL[torch.float32])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_gets_the_same_bits_alone_in_any_batch_and_at_any_thread_count(dtype):
    qkv, packing = packed_qkv([23, 5, 41, 23, 64, 9], 4, 32, dtype)
    alone, alone_packing = qkv[28:69], pack(torch.ones(1, 41))  # the third sequence on its own
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            results = []
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                results.append(attention.packed_attention(qkv, packing, 4, 0.2)[28:69])
                results.append(attention.packed_attention(alone.clone(), alone_packing, 4, 0.2))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert torch.equal(other, results[0])


@needs_kernel
def test_filler_rows_are_zero_and_a_nan_stays_in_its_sequence():
    qkv, packing = with_filler(*packed_qkv([6, 9, 4], 2, 8, torch.float32), multiple=32)
    qkv[19:] = 7.0  # filler rows may hold anything
    qkv[8, 3] = float("nan")  # a query of the second sequence (rows 6 to 14)
    with torch.inference_mode():
        out = attention.packed_attention(qkv, packing, 2, 0.3)
    assert packing.filler == 13 and torch.equal(out[19:], torch.zeros(13, 16))
    assert out[8, :8].isnan().all() and not out[8, 8:].isnan().any()  # its head, its row
    assert not out[:6].isnan().any() and not out[15:19].isnan().any()


@needs_kernel
def test_rows_with_a_stride_of_their_own(monkeypatch):
    """qkv as columns of a wider tensor (row stride past 3H), and as a transposed copy (column
    stride past 1, made contiguous first), give what contiguous rows give."""
    qkv, packing = packed_qkv([11, 3, 20], 2, 16, torch.float32)
    with torch.inference_mode():
        expected = attention.packed_attention(qkv, packing, 2, 0.25)
        wide = torch.cat([qkv, torch.randn(qkv.shape[0], 5)], 1)[:, : qkv.shape[1]]
        transposed = qkv.T.contiguous().T
        for view in (wide, transposed):
            assert torch.equal(attention.packed_attention(view, packing, 2, 0.25), expected)


def test_the_pytorch_path_runs_where_the_kernel_does_not_apply(monkeypatch):
    """Gradients, dropout, fp64 and fp16 never reach the kernel; nor does anything when it cannot
    be had (`BERT_PORT_KERNELS=0`, not installed)."""
    calls = []
    real = kernels.packed_attention
    monkeypatch.setattr(kernels, "packed_attention", lambda *args: calls.append(1) or real(*args))
    qkv, packing = packed_qkv([5, 12], 2, 8, torch.float32)
    attention.packed_attention(qkv.requires_grad_(), packing, 2, 0.3)
    with torch.no_grad():
        attention.packed_attention(qkv, packing, 2, 0.3, dropout_p=0.1)
        for dtype in (torch.float64, torch.float16):
            attention.packed_attention(qkv.to(dtype), packing, 2, 0.3)
    assert not calls
    monkeypatch.setattr(kernels, "available", lambda: False)
    with torch.no_grad():
        out = attention.packed_attention(qkv, packing, 2, 0.3)
    assert out.shape == (17, 16) and out.isfinite().all()


@pytest.mark.parametrize("capability", ["DEFAULT", "AVX2", "AVX512"])
def test_long_bf16_sequences_take_the_flash_kernel_only_with_avx512_kernels(capability, monkeypatch):
    """torch 2.13's bf16 flash kernel fails on a CPU with AMX under ATEN_CPU_CAPABILITY=default
    and avx2 ("pack_vnni2 is only supported when avx512 is supported"): there, as on CPUs without
    AVX-512, long bf16 sequences take the fp32 math path. fp32 keeps the flash kernel everywhere."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    bf16, fp32 = torch.empty(0, 6, dtype=torch.bfloat16), torch.empty(0, 6)
    assert attention._flash_runs(bf16, training=False) == (capability == "AVX512")
    assert attention._flash_runs(fp32, training=False)
    assert not attention._flash_runs(fp32, training=True)


@pytest.mark.parametrize(
    "rows, heads, hidden, device",
    [(10, 2, 48, "cpu"), (17, 3, 30, "cpu"), (17, 2, 48, "meta")],
    ids=["fewer rows than the packing", "3H not a multiple of the heads", "meta tensor"],
)
def test_rows_that_do_not_fit_get_the_pytorch_paths_error_not_a_crash(rows, heads, hidden, device):
    """The C kernel trusts its arguments: rows that do not fit the packing or the heads, and
    tensors without memory, never reach it (before this check, such calls corrupted the heap or
    crashed the process); the PyTorch path raises."""
    packing = pack((torch.arange(12)[None] < torch.tensor([5, 12])[:, None]).long())  # 17 rows
    qkv = torch.randn(rows, hidden, device=device)
    with torch.no_grad(), pytest.raises(RuntimeError):
        attention.packed_attention(qkv, packing, heads, 0.3)


@needs_kernel
def test_sharply_peaked_scores_give_the_pytorch_paths_values(monkeypatch):
    """Scores far below their row's maximum (here by up to hundreds), where the kernel's exp
    returns zero (below -80, rather than subnormals, which are slow to compute with), give the
    PyTorch path's values.

    Queries and keys are small integers and the scale 1/2, so that every score is exact in
    float32 in any summation order: scores this large are otherwise rounded by up to 1e-4,
    and softmax passes that on to the context, past the fp32 tolerance: a kernel built without
    FMA (`BERT_PORT_MARCH=x86-64`) and the PyTorch path were then each right and neither within
    the tolerance of the other (docs/parity.md, "The tolerance policy")."""
    heads, head_size = 6, 32
    qkv, packing = packed_qkv([120, 37, 64], heads, head_size, torch.float32, seed=3)
    qk = 2 * heads * head_size
    qkv[:, :qk] = torch.randint(-8, 9, (qkv.shape[0], qk)).float()
    with torch.inference_mode():
        got = attention.packed_attention(qkv, packing, heads, 0.5)
        expected = pytorch_path(qkv, packing, heads, 0.5, monkeypatch)
    torch.testing.assert_close(got, expected, **TOL[torch.float32])


@needs_kernel
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
def test_a_jit_trace_records_the_pytorch_path():
    """torch.jit.trace cannot see a ctypes call: traced, the attention must still compute from
    its input (the kernel's call would leave the traced output's memory unwritten)."""
    qkv, packing = packed_qkv([9, 4], 2, 8, torch.float32)
    other = torch.randn_like(qkv)
    with torch.no_grad():
        traced = torch.jit.trace(lambda x: attention.packed_attention(x, packing, 2, 0.3), qkv, check_trace=False)
        torch.testing.assert_close(traced(other), attention.packed_attention(other, packing, 2, 0.3))


@needs_kernel
@pytest.mark.skipif(
    not {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx2", "fma"} <= kernels.cpu_flags(),
    reason="needs what x86-64-v4 and x86-64-v3 build for (AVX-512 F/BW/VL/DQ/CD, AVX2, FMA)",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_avx2_build_gives_the_avx512_builds_bits(dtype, tmp_path, monkeypatch):
    """csrc/vector.h sizes its vectors to the instruction set (16 floats with AVX-512, 8 with AVX2):
    the sums run in the same order at either width, so both builds (both with FMA) give the same
    bits, head sizes of whole vectors (the transposing path) and others alike."""
    results = []
    with monkeypatch.context() as m:
        m.delenv("ATEN_CPU_CAPABILITY", raising=False)  # (which caps our variant too)
        for variant in ("avx512", "avx2"):
            m.setenv("BERT_PORT_ISA", variant)
            kernels._library.cache_clear()
            assert kernels.variant() == variant
            results.append([])
            for head_size in (32, 40):
                qkv, packing = packed_qkv([1, 5, 17, 33, 60], 3, head_size, dtype)
                with torch.inference_mode():
                    results[-1].append(attention.packed_attention(qkv, packing, 3, head_size**-0.5))
    kernels._library.cache_clear()  # the environment is back: the variant it chooses again
    for wide, narrow in zip(*results):
        assert torch.equal(wide, narrow)
