"""The packed path's GEMMs (`bert_port/gemm.py`): a row's bits do not depend on the row count,
on the shapes of MiniLM's and bert-base's layers, and the cached packed weight follows the
weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TOL, call

from bert_port.speed import gemm
from bert_port.speed.gemm import RowStableLinear, fused_row_stable_linear, row_stable_linear

# (in, out) of the packed path's layers: MiniLM's QKV, FFN up and down; bert-base's FFN down.
SHAPES = [(384, 1152), (384, 1536), (1536, 384), (3072, 768)]
ROW_COUNTS = [16, 17, 33, 57, 64, 100, 129, 192, 385, 433, 700]


def _rows_differing(linear, x: torch.Tensor) -> list[int]:
    """Row counts M for which the first 16 rows of linear(x[:M]) differ from those at M = 1024."""
    with torch.inference_mode():
        reference = linear(x[:1024])[:16]
        return [m for m in ROW_COUNTS if not torch.equal(linear(x[:m])[:16], reference)]


@pytest.fixture(params=["default", "oneDNN blocks"])
def bf16_kernel(request, monkeypatch):
    """bf16's kernel where the CPU has AMX (csrc/amx_linear.c), and oneDNN's blocks of rows, which
    other CPUs run: both on every CPU that has both."""
    if request.param != "default":
        monkeypatch.setattr(gemm, "_amx_runs", lambda k, m: False)
    return request.param


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_row_gets_the_same_bits_for_every_row_count(shape, dtype, threads, bf16_kernel):
    if dtype == torch.float32 and bf16_kernel != "default":
        pytest.skip("fp32 has one kernel")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        layer = RowStableLinear(*shape, batch_invariant=True).to(dtype)
        x = torch.randn(1024, shape[0]).to(dtype)
        assert _rows_differing(layer, x) == []
    finally:
        torch.set_num_threads(previous)


def test_the_row_count_check_catches_a_gemm_that_is_not_row_stable():
    """The check above fails for a GEMM whose rows depend on M: each row scaled by 1 + M * 2^-20."""
    torch.manual_seed(0)
    weight, x = torch.randn(64, 32), torch.randn(1024, 32)
    assert _rows_differing(lambda t: F.linear(t, weight) * (1 + t.shape[0] * 2.0**-20), x) == ROW_COUNTS


def test_the_packed_weight_follows_the_weight():
    """Edits in place (version counter), a new tensor, a dtype change and a gradient step each
    reach the cached packed weight."""
    torch.manual_seed(0)
    layer = RowStableLinear(32, 48, batch_invariant=True)
    x = torch.randn(20, 32)

    def check():
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))

    check()
    with torch.no_grad():
        layer.weight.mul_(2.0)
    check()
    layer.weight = torch.nn.Parameter(torch.randn(48, 32))
    check()
    layer.to(torch.bfloat16)
    x = x.bfloat16()
    check()
    layer.float()
    x = x.float()
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.5, fused=True)
    check()
    layer(x).square().sum().backward()
    optimizer.step()  # in place, version counters unchanged: the gradient hook drops the cache
    check()


def test_a_weight_is_packed_once_per_kernel(monkeypatch):
    """A bf16 module switched between batch-invariant and not (the bench's two rows), and between
    a full residual and one row broadcast (which only oneDNN takes, where the CPU has the AMX
    kernel), packs its weight once for each kernel it runs, not again at every switch."""
    packs = []
    real = gemm._packed
    monkeypatch.setattr(gemm, "_packed", lambda *args: packs.append(args[-1]) or real(*args))
    torch.manual_seed(0)
    layer, x = RowStableLinear(384, 384, batch_invariant=True).bfloat16(), torch.randn(64, 384).bfloat16()
    full, one_row = torch.randn(64, 384).bfloat16(), torch.randn(1, 384).bfloat16()
    with torch.inference_mode():
        for invariant in (True, False, True, False):
            layer.batch_invariant = invariant
            layer(x, residual=full)
            layer(x, residual=one_row)
    assert len(packs) == len(set(packs)) and set(packs) <= {"amx", "onednn"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_thread_count_change_does_not_pack_again(dtype, monkeypatch):
    """`--threads auto` moves the thread count between batches: the weight packed at one count
    serves the others (where a count would lay it out otherwise, oneDNN runs a kernel for the
    packed layout), and computes the same linear at each."""
    packs = []
    real = gemm._packed
    monkeypatch.setattr(gemm, "_packed", lambda *args: packs.append(args[-1]) or real(*args))
    torch.manual_seed(0)
    layer = RowStableLinear(384, 1536, batch_invariant=True).to(dtype)
    x = torch.randn(96, 384).to(dtype)
    with torch.inference_mode():
        if gemm.row_stable_dtype(x, layer.weight) is None:
            pytest.skip(f"{dtype} takes F.linear here (no native bf16 in oneDNN): nothing is packed")
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    previous = torch.get_num_threads()
    try:
        for threads in (2, 1, 2, 1):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                torch.testing.assert_close(layer(x).float(), expected, **TOL[dtype])
    finally:
        torch.set_num_threads(previous)
    assert len(packs) == 1


def test_a_model_that_ran_copies_and_pickles():
    """The cached packed weight is an opaque oneDNN tensor: copies and pickles leave it out."""
    import copy
    import pickle

    layer = RowStableLinear(16, 8, batch_invariant=True)
    x = torch.randn(20, 16)
    with torch.inference_mode():
        expected = layer(x)
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        with torch.inference_mode():
            assert torch.equal(twin(x), expected)


def test_fused_qkv_equals_three_linears():
    torch.manual_seed(0)
    linears = tuple(torch.nn.Linear(32, 32) for _ in range(3))
    owner = torch.nn.Module()
    x = torch.randn(40, 32)
    with torch.inference_mode():
        fused = fused_row_stable_linear(x, linears, owner)
        torch.testing.assert_close(fused, torch.cat([m(x) for m in linears], dim=1))
        assert torch.equal(fused, fused_row_stable_linear(x, linears, owner))  # from the cache
    with torch.no_grad():
        linears[1].bias.add_(1.0)
    with torch.inference_mode():
        torch.testing.assert_close(fused_row_stable_linear(x, linears, owner), torch.cat([m(x) for m in linears], 1))


def test_training_takes_the_autograd_path():
    layer = RowStableLinear(8, 4, batch_invariant=True)
    x = torch.randn(5, 8, requires_grad=True)
    row_stable_linear(x, layer.weight, layer.bias, layer).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


@pytest.mark.parametrize("shape", SHAPES[1:3], ids=lambda s: f"{s[0]}x{s[1]}")
def test_bf16_autocast_computes_in_bf16_with_row_stable_bits(shape):
    """fp32 weights under bf16 autocast: the GEMM runs in bf16 as `F.linear` would under
    autocast (it once stayed in fp32, oneDNN's op being outside autocast: autocast sped the
    port up 1.35x where bf16 weights gave 3.2x), within bf16's tolerance of it, and a row's
    bits do not depend on the row count."""
    torch.manual_seed(0)
    layer = RowStableLinear(*shape, batch_invariant=True)
    x = torch.randn(1024, shape[0])
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = layer(x[:300]), F.linear(x[:300], layer.weight, layer.bias)
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got, want)  # torch.testing's bf16 defaults
        assert _rows_differing(layer, x) == []


@pytest.mark.parametrize("gelu_fused", [True, False], ids=["GELU post-op", "GELU after"])
@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "batch_invariant=False"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_epilogue_computes_what_the_unfused_ops_do(dtype, invariant, gelu_fused, bf16_kernel, monkeypatch):
    """The FFN's GELU and the residual addition inside oneDNN's GEMM (`BertLayer` passes them),
    and an activation oneDNN has no post-op for (after the GEMM): each within the dtype's
    tolerance of `F.linear` and the op, and, batch-invariant, with a row's bits independent of
    the row count. The GELU both ways oneDNN runs it: as its post-op (AVX-512 kernels) and after
    the GEMM (AVX2 ones)."""
    if bf16_kernel != "default" and dtype != torch.bfloat16:
        pytest.skip("one kernel")
    monkeypatch.setattr(gemm, "_onednn_gelu_fused", lambda: gelu_fused)
    torch.manual_seed(0)
    layer = RowStableLinear(384, 1536, batch_invariant=invariant).to(dtype)
    x, residual = torch.randn(1024, 384).to(dtype), torch.randn(1024, 1536).to(dtype)
    tol = TOL[dtype]
    with torch.inference_mode():
        linear = F.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(call(layer, x, F.gelu), F.gelu(linear), **tol)
        torch.testing.assert_close(layer(x, residual=residual), linear + residual, **tol)
        torch.testing.assert_close(call(layer, x, torch.tanh), torch.tanh(linear), **tol)
        assert not torch.equal(layer(x, residual=residual), layer(x))  # the residual is not dropped
    if invariant:
        assert _rows_differing(lambda t: call(layer, t, F.gelu), x) == []
        assert _rows_differing(lambda t: layer(t, residual=residual[: t.shape[0]]), x) == []


@pytest.mark.parametrize("trainable", ["bias", "key and value", "residual"])
def test_a_trainable_bias_key_value_or_residual_gets_its_gradient(trainable):
    """With the input and the (first) weight frozen, a tensor that still needs a gradient (a
    bias alone, as BitFit trains; the stacked QKV's key and value; the residual) takes the
    autograd path: the packed oneDNN copies are detached and would drop its gradient."""
    torch.manual_seed(0)
    linears = tuple(torch.nn.Linear(16, 16) for _ in range(3))
    for m in linears:
        m.requires_grad_(False)
    x = torch.randn(20, 16)
    residual = torch.randn(20, 16, requires_grad=trainable == "residual")
    if trainable == "bias":
        linears[0].bias.requires_grad_(True)
        out = row_stable_linear(x, linears[0].weight, linears[0].bias, linears[0], residual=residual)
    elif trainable == "key and value":
        for m in linears[1:]:
            m.weight.requires_grad_(True)
        out = fused_row_stable_linear(x, linears, torch.nn.Module())
    else:
        out = row_stable_linear(x, linears[0].weight, linears[0].bias, linears[0], residual=residual)
    out.square().sum().backward()
    grads = {
        "bias": [linears[0].bias.grad],
        "key and value": [m.weight.grad for m in linears[1:]],
        "residual": [residual.grad],
    }[trainable]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


AVX512_CORE = {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize(
    ("flags", "cap", "fused"),
    [
        (AVX512_CORE, None, True),
        (AVX512_CORE, "avx512_core_amx", True),
        (AVX512_CORE, "AVX10_1_512", True),
        (AVX512_CORE, "AVX2", False),  # make test-kernels' oneDNN family
        ({"avx2", "avx512f"}, None, False),  # AVX-512 F alone (Knights Landing): no avx512_core
        ({"avx2"}, None, False),  # an AMD EPYC of Zen 2 or 3
        (set(), None, False),  # Arm: no /proc/cpuinfo flags of these names
    ],
)
def test_the_gelu_is_fused_where_onednn_runs_avx512_kernels(flags, cap, fused, monkeypatch):
    monkeypatch.setattr(gemm.kernels, "cpu_flags", lambda: flags)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert gemm._onednn_gelu_fused.__wrapped__() is fused
