"""The C kernels (bert_port/speed/csrc/), built at install and called as torch ops
(`bert_port.speed.kernels`): the variant chosen for the CPU, the ops as torch sees them, the same
per-row int8 scheme as the PyTorch path they replace, rows independent of each other and of the
thread count, and a forward with no compiler and a read-only home, the same bits."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from conftest import TOL

from bert_port.speed import kernels
from bert_port.speed.quantization import Int8Linear

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the C kernels are not installed")
AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx2", "fma"}
AVX2 = {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"}


@pytest.mark.skipif(kernels.platform.machine() != "x86_64", reason="x86-64 variants")
def test_the_variant_is_the_best_the_cpu_and_the_caps_allow():
    choose = kernels.choose_variant
    assert choose(set()) == "generic"
    assert choose(AVX2) == "avx2"
    assert choose(AVX2 | AVX512) == "avx512"
    assert choose(AVX2 | AVX512 | {"amx_tile", "amx_bf16", "avx512_bf16"}) == "amx"
    assert choose(AVX2 | AVX512, wanted="avx2") == "avx2"
    assert choose(AVX2 | AVX512, aten_cap="default") == "generic"  # ATEN_CPU_CAPABILITY caps ours too
    assert choose(AVX2, wanted="avx512") == "avx2"  # never a variant the CPU cannot run
    with pytest.raises(ValueError, match="not a kernel variant"):
        choose(AVX2, wanted="avx1024")


@needs_kernels
def test_the_kernels_are_torch_ops_with_fake_kernels():
    """torch.compile and torch.export see an op: its schema and fake kernel agree with the real one
    (opcheck raises where they do not), and a fake tensor gets the real output's shape and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    qkv = torch.randn(20, 3 * 32)
    starts, lens = torch.tensor([0, 7]), torch.tensor([7, 13])
    args = (qkv, starts, lens, 2, 0.25)
    torch.library.opcheck(torch.ops.bert_port.packed_attention.default, args)
    torch.library.opcheck(torch.ops.bert_port.quantize_rows.default, (torch.randn(9, 40), None, None, None))
    real = torch.ops.bert_port.packed_attention(*args)
    with FakeTensorMode() as mode:
        fake = torch.ops.bert_port.packed_attention(*(mode.from_tensor(t) for t in args[:3]), *args[3:])
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype) == ((20, 32), torch.float32)


@needs_kernels
def test_packed_attention_refuses_sequences_outside_its_rows():
    qkv = torch.randn(10, 96)
    with pytest.raises(ValueError, match="outside the 10 rows"):
        kernels.packed_attention(qkv, torch.tensor([4]), torch.tensor([7]), 2, 0.25)


FORWARD = textwrap.dedent(
    """
    import sys, torch
    from bert_port import BertModel
    from bert_port.assets import minilm_dir
    from bert_port.speed import kernels
    model = BertModel.from_pretrained(minilm_dir())
    ids = torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 102], [101, 2748, 102, 0, 0, 0, 0]])
    with torch.inference_mode():
        out = model(ids, (ids != 0).long()).last_hidden_state
    torch.save(out, sys.argv[1])
    print("variant", kernels.variant())
    """
)


@needs_kernels
def test_a_forward_needs_no_compiler_and_writes_nothing_home(tmp_path):
    """No compiler on PATH, a home nobody can write, no cache folder: the same bits as here."""
    home = tmp_path / "home"
    home.mkdir(mode=0o555)
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "BERT_PORT_CACHE", "XDG_CACHE_HOME")}
    env.update(PATH="/nonexistent", HOME=str(home))
    runs = []
    for name, environment in (("bare", env), ("here", os.environ)):
        done = subprocess.run(
            [sys.executable, "-c", FORWARD, str(tmp_path / f"{name}.pt")],
            env=environment,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(done.stdout)
    assert runs[0] == runs[1] == f"variant {kernels.variant()}\n"
    assert torch.equal(torch.load(tmp_path / "bare.pt"), torch.load(tmp_path / "here.pt"))
    assert list(home.iterdir()) == []


def test_a_missing_extension_warns_once_and_runs_pytorch(tmp_path):
    script = textwrap.dedent(
        """
        import importlib, logging, sys, torch
        logging.basicConfig(level=logging.WARNING)
        class Refuse:  # as if the package had been installed without its extension
            def find_spec(self, name, path=None, target=None):
                if name.startswith("bert_port.speed._kernels_"):
                    raise ImportError(f"no module named {name}")
        sys.meta_path.insert(0, Refuse())
        from bert_port.speed import kernels
        from bert_port.speed.quantization import Int8Linear
        layer = Int8Linear(torch.randn(8, 16), None)
        for _ in range(3):
            layer(torch.randn(4, 16))
        print("available", kernels.available())
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "BERT_PORT_KERNELS"}  # (make test-kernels' nokernels sets it)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "available False" in done.stdout
    assert done.stderr.count("C kernels") == 1, done.stderr
    off = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={**env, "BERT_PORT_KERNELS": "0"}
    )
    assert "C kernels" not in off.stderr  # turned off on purpose: nothing to say


def layers() -> dict[str, Int8Linear]:
    """The three kinds of rows: signed, signed with shift and smoothing, unsigned with float outliers."""
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 40), torch.randn(48)
    return {
        "signed": Int8Linear(weight, bias),
        "shifted": Int8Linear(weight, bias, shift=torch.randn(40), smooth=torch.rand(40) + 0.5),
        "unsigned": Int8Linear(weight, bias, floor=-0.17, float_inputs=4),
    }


def inputs(name: str, rows: int = 37) -> torch.Tensor:
    x = torch.randn(rows, 40) * torch.logspace(-2, 1, rows)[:, None]  # rows of very different ranges
    return F.gelu(x) if name == "unsigned" else x


@needs_kernels
@pytest.mark.parametrize("name", ["signed", "shifted", "unsigned"])
def test_kernels_quantize_as_the_pytorch_path(name, monkeypatch):
    """The same steps (bit for bit, but where torch's addcmul fuses the shift's multiply-add, which
    the C code rounds twice), and the same int8 values but where a value sits on a rounding boundary."""
    layer, x = layers()[name], inputs(name)
    rows = x[:, : layer.in_features - layer.float_inputs]
    q, step = layer._quantize(rows)
    monkeypatch.setattr(kernels, "available", lambda: False)
    q_torch, step_torch = layer._quantize(rows)
    torch.testing.assert_close(step, step_torch, **({} if name == "shifted" else {"rtol": 0, "atol": 0}))
    differ = q.int() - q_torch.int()
    assert differ.abs().max() <= 1 and (differ != 0).float().mean() <= 1e-3
    assert q.int().max() <= 127 + (name == "unsigned")  # 7 bits (the top of a row may round up to 128 unsigned)


@needs_kernels
@pytest.mark.parametrize("name", ["signed", "shifted", "unsigned"])
def test_kernels_dequantize_as_the_pytorch_path(name, monkeypatch):
    layer, x = layers()[name], inputs(name)
    residual = torch.randn(x.shape[0], layer.out_features)
    with torch.inference_mode():
        expected = {}
        for native in (True, False):
            monkeypatch.setattr(kernels, "available", lambda native=native: native)
            for activation, extra in ((None, ()), (None, (residual,)), (F.gelu, (residual,))):
                layer.activation = activation
                out = layer(x, *extra)
                if native:
                    expected[len(extra), activation] = out
                else:  # PyTorch's path
                    torch.testing.assert_close(expected[len(extra), activation], out, **TOL[torch.int8])


@pytest.mark.parametrize("path", [pytest.param("C", marks=needs_kernels), "PyTorch"])
def test_int8_rows_do_not_depend_on_the_batch_or_the_threads(path, monkeypatch):
    """Each row quantized by its own range, and the float32 outlier channels summed in a fixed
    order (a float32 addmm's order changes with the row count)."""
    if path == "PyTorch":
        monkeypatch.setattr(kernels, "available", lambda: False)
    layer, x = layers()["unsigned"], inputs("unsigned", rows=300)
    saved = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            alone = torch.cat([layer(x[i : i + 1]) for i in range(0, 300, 37)])
            torch.set_num_threads(max(2, saved))
            together = layer(x)[::37]
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(alone, together)


@pytest.mark.parametrize("path", [pytest.param("C", marks=needs_kernels), "PyTorch"])
def test_int8_runs_with_gradients_on_and_records_none(path, monkeypatch):
    """Outside inference_mode, with an input that requires grad (an embedding's output does): the
    same values as under inference_mode, and no autograd graph."""
    if path == "PyTorch":
        monkeypatch.setattr(kernels, "available", lambda: False)
    for name, layer in layers().items():
        x = inputs(name)
        with torch.inference_mode():
            expected = layer(x, torch.ones(x.shape[0], layer.out_features))
        out = layer(x.clone().requires_grad_(), torch.ones(x.shape[0], layer.out_features, requires_grad=True))
        assert not out.requires_grad, name
        assert torch.equal(out, expected), name


@pytest.mark.parametrize("path", [pytest.param("C", marks=needs_kernels), "PyTorch"])
def test_a_nan_in_a_row_makes_that_row_nan(path, monkeypatch):
    """As float32 would: the NaN is not hidden behind a finite step (C's max skips NaN, and a NaN
    converts to no integer), and the other rows are untouched."""
    if path == "PyTorch":
        monkeypatch.setattr(kernels, "available", lambda: False)
    for name, layer in layers().items():
        x = inputs(name)
        with torch.inference_mode():
            clean = layer(x)
            x[3, 5] = float("nan")
            out = layer(x)
        assert out[3].isnan().all(), name
        rest = torch.arange(x.shape[0]) != 3
        assert torch.equal(out[rest], clean[rest]), name


@needs_kernels
@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the heap settings are glibc's; elsewhere they do nothing"
)
def test_the_heap_settings_take_effect_on_glibc():
    """`map_large_blocks` and `trim_heap` (heap.c, for bert-port-embed's process) reach glibc: mallopt
    and malloc_trim say they did. In a child, since the setting is process-wide."""
    code = (
        "from bert_port.speed import kernels; l = kernels._library(); print(l.heap_map_above(1 << 20), l.heap_trim())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split()[0] == "1", done.stdout  # mallopt returns 1 on success; heap_trim 0 or 1
