"""The AMX bf16 GEMM (csrc/amx_linear.c, through `gemm.row_stable_linear` in batch-invariant
bf16 inference): the float32 maths' values on the model's shapes with each epilogue, a planted
layout bug caught, GELU on every bf16 value, a row's bits independent of its batch, its place in
it and the thread count, NaN kept in its row, strided inputs, and oneDNN where it cannot run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TOL, call

from bert_port.speed import gemm
from bert_port.speed.gemm import RowStableLinear

ONEDNN_BF16 = gemm._native_bf16()  # before the fixture below says yes everywhere


@pytest.fixture(autouse=True)
def amx_kernel(monkeypatch):
    """The AMX kernel on AMX tiles where the CPU has them; elsewhere the same C code on tiles
    emulated in C (csrc/amx_emulated.h), which gemm.py never runs but these tests do, so that
    the kernel's blocking, layout and epilogue are tested on every CPU, AVX2-only ones included
    (where oneDNN has no bf16 kernels, gemm.py is told it has, to reach the kernel)."""
    if gemm.kernels.amx_ready():
        return "hardware"
    library = gemm.kernels._library()
    if library is None or not library.amx_emulated():
        pytest.skip("no AMX here, and no kernels to test the emulated tiles beside")
    monkeypatch.setattr(gemm.kernels, "amx_ready", lambda: True)
    monkeypatch.setattr(gemm, "_native_bf16", lambda: True)
    return "emulated"


# (in, out): MiniLM's QKV, FFN up and down; bert-base's FFN up and down.
SHAPES = [(384, 1152), (384, 1536), (1536, 384), (768, 3072), (3072, 768)]
EPILOGUES = {"none": {}, "gelu": {"activation": F.gelu}, "relu": {"activation": F.relu}, "residual": {}}


def layer_and_input(shape, rows: int, seed: int = 0):
    torch.manual_seed(seed)
    layer = RowStableLinear(*shape, batch_invariant=True).to(torch.bfloat16)
    return layer, torch.randn(rows, shape[0]).bfloat16()


def float32_maths(layer, x, activation=None, residual=None):
    """What the kernel computes, in float32 on the same bf16 values, rounded once to bf16."""
    y = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    y = y if activation is None else activation(y)
    return (y if residual is None else y + residual.float()).bfloat16()


@pytest.fixture
def calls(monkeypatch, amx_kernel):
    """How many times the AMX kernel ran."""
    count = [0]
    real = gemm._amx_linear

    def counted(*args):
        count[0] += 1
        return real(*args)

    monkeypatch.setattr(gemm, "_amx_linear", counted)
    return count


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernel_gives_the_float32_maths_values(shape, epilogue, calls):
    """100 rows, not a multiple of the kernel's 32: zero rows made up and dropped."""
    layer, x = layer_and_input(shape, 100)
    kwargs = dict(EPILOGUES[epilogue])
    if epilogue == "residual":
        kwargs["residual"] = torch.randn(100, shape[1]).bfloat16()
    with torch.inference_mode():
        got = call(layer, x, **kwargs)
    assert calls[0] == 1 and got.dtype == torch.bfloat16 and got.shape == (100, shape[1])
    torch.testing.assert_close(got, float32_maths(layer, x, **kwargs), **TOL[torch.bfloat16])


def test_a_plant_in_the_weight_layout_is_caught(monkeypatch):
    """The comparison above can fail: the weight's last 32 inputs left out of its tiles (a K loop
    that stops one step short) move MiniLM's FFN-down output past the bf16 tolerance."""
    real = gemm._amx_pack

    def short(weight):
        packed = real(weight).clone()
        packed[:, -1] = 0
        return packed

    monkeypatch.setattr(gemm, "_amx_pack", short)
    layer, x = layer_and_input((1536, 384), 64)
    with torch.inference_mode(), pytest.raises(AssertionError):
        torch.testing.assert_close(layer(x), float32_maths(layer, x), **TOL[torch.bfloat16])


def ordered(t: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns as integers in the order of their values: b - a counts bf16 steps."""
    bits = t.view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def test_gelu_of_every_bf16_value(calls):
    """GELU in the kernel's epilogue (erf from a rational approximation) against torch's on every
    bf16 value, through an identity weight: the same bits on 99.5%, one bf16 step apart at most
    down to x = -4, and below, where GELU is under 4e-5 and its 1 + erf a cancellation, within
    5e-7 (1.5e-6 on the generic build, without FMA). NaN where torch gives NaN. Left out:
    subnormal inputs (AMX reads them as zero, as oneDNN's bf16 GEMMs do) and |x| > 1e38 (torch's
    x (1 + erf) overflows to inf)."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(-1, 32)
    layer = RowStableLinear(32, 32, batch_invariant=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(32))
        layer.bias.zero_()
    with torch.inference_mode():
        got = call(layer, x, F.gelu).flatten()
    assert calls[0] == 1
    x, want = x.flatten().float(), F.gelu(x.float()).bfloat16().flatten()
    # +-inf share their rows with NaNs, which the identity's zeros carry into their columns
    # (inf * 1 + NaN * 0 in the emulated tiles); the other values' NaN must match torch's.
    finite_or_nan = ~x.isinf()
    assert torch.equal(got.isnan()[finite_or_nan], want.isnan()[finite_or_nan])
    kept = ~want.isnan() & (x.abs() >= 2**-126) & (x.abs() <= 1e38)
    x, got, want = x[kept], got[kept], want[kept]
    steps = (ordered(got) - ordered(want)).abs()
    assert float((steps == 0).float().mean()) >= 0.995
    assert int(steps[x >= -4].max()) <= 1
    # The generic build (no FMA: ATEN_CPU_CAPABILITY=default) rounds the polynomial otherwise: 1.0e-6 seen.
    below = 1.5e-6 if gemm.kernels.variant() == "generic" else 5e-7
    assert float((got.float() - want.float())[x < -4].abs().max()) <= below


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_row_gets_the_same_bits_wherever_it_sits(threads, calls):
    """Rows of MiniLM's FFN (GELU) at places 0, 5, 31, 32 and 77 of batches of 1 to 1,000 rows,
    at 1, 2 and 3 threads: the bits of the row alone at 1 thread."""
    layer, rows = layer_and_input((384, 1536), 5, seed=1)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.inference_mode():
            alone = [call(layer, row[None], F.gelu) for row in rows]
        torch.set_num_threads(threads)
        for n, places in ((1, [0]), (33, [0, 5, 31, 32]), (100, [77, 5]), (1000, [0, 32, 77, 999])):
            torch.manual_seed(n)
            batch = torch.randn(n, 384).bfloat16()
            batch[places] = rows[: len(places)]
            with torch.inference_mode():
                out = call(layer, batch, F.gelu)
            for i, place in enumerate(places):
                assert torch.equal(out[place], alone[i][0]), (n, place, threads)
        assert calls[0] == 9
    finally:
        torch.set_num_threads(previous)


def test_a_nan_stays_in_its_row(calls):
    layer, x = layer_and_input((384, 384), 64)
    x[7, 3] = float("nan")
    with torch.inference_mode():
        out = layer(x, residual=torch.zeros(64, 384).bfloat16())
    assert bool(out[7].isnan().all()) and not bool(out[torch.arange(64) != 7].isnan().any())
    assert calls[0] == 1


def test_strided_and_expanded_rows(calls):
    """x and the residual as column slices of wider tensors (row stride past the row's end), and
    as expanded views (row stride 0): the bits of contiguous copies."""
    layer, x = layer_and_input((384, 1152), 64)
    wide_x, wide_r = torch.randn(64, 500).bfloat16(), torch.randn(64, 1200).bfloat16()
    wide_x[:, :384] = x
    with torch.inference_mode():
        got = layer(wide_x[:, :384], residual=wide_r[:, :1152])
        assert torch.equal(got, layer(x, residual=wide_r[:, :1152].contiguous()))
        same = x[:1].expand(64, 384), wide_r[:1, :1152].expand(64, 1152)
        assert torch.equal(
            layer(*same[:1], residual=same[1]), layer(same[0].contiguous(), residual=same[1].contiguous())
        )
    assert calls[0] == 4


def test_shapes_it_cannot_take_run_on_onednn_blocks(calls):
    """In or out not a multiple of 32 (the tiles' step): oneDNN in blocks of BF16_ROW_BLOCK rows,
    which is then the packed rows' multiple; the AMX kernel's shapes pack rows in 32s."""
    if not ONEDNN_BF16:
        pytest.skip("oneDNN has no bf16 kernels on this CPU: bf16 takes F.linear here, not oneDNN's blocks")
    layer, x = layer_and_input((100, 64), 40)
    wide, _ = layer_and_input((384, 1536), 1)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), float32_maths(layer, x), **TOL[torch.bfloat16])
        assert calls[0] == 0 and layer.row_multiple(x) == gemm.BF16_ROW_BLOCK
        assert wide.row_multiple(torch.zeros(1, 384).bfloat16()) == gemm.AMX_ROW_STEP


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # nn.Linear(0, 64)'s
@pytest.mark.parametrize(
    "case", ["input wider than the weight", "residual of one row", "weight on meta", "no inputs (in = 0)", "jit.trace"]
)
def test_what_the_kernel_does_not_take_goes_to_onednn(case, calls):
    """Calls whose shapes, devices or context the kernel cannot check itself take oneDNN's path,
    with its errors (a wrong width, a meta weight, no inputs, tracing), never a read past a buffer;
    a residual broadcast over the rows is expanded first (it was reshaped into garbage until the
    emulated tiles ran this test off AMX) (found in review: the first two crashed
    the process, tracing recorded an unwritten output)."""
    layer, x = layer_and_input((384, 384), 64)
    with torch.inference_mode():
        if case == "input wider than the weight":
            with pytest.raises(RuntimeError):
                layer(torch.randn(64, 768).bfloat16())
        elif case == "residual of one row":
            residual = torch.randn(1, 384).bfloat16()
            expected = float32_maths(layer, x, residual=residual.expand(64, 384))
            torch.testing.assert_close(layer(x, residual=residual), expected, **TOL[torch.bfloat16])
        elif case == "weight on meta":
            with pytest.raises((NotImplementedError, RuntimeError)):
                layer.to("meta")(x)
        elif case == "no inputs (in = 0)":
            empty, _ = layer_and_input((0, 64), 1)
            with pytest.raises(RuntimeError):  # oneDNN's, as before the kernel
                empty(torch.zeros(8, 0).bfloat16())
    if case == "jit.trace":  # oneDNN's packed weight cannot be a traced constant: an error, not a wrong graph
        with torch.no_grad(), pytest.raises(RuntimeError, match="constant"):
            torch.jit.trace(lambda t: layer(t), (x,))
    assert calls[0] == (case == "residual of one row")  # expanded to one row per input row, then the kernel's
