"""The C kernels of `bert_port.native` (csrc/int8_rows.c): the same per-row int8 scheme as the
PyTorch path they replace, rows independent of each other and of the thread count, and a
build that fails, is interrupted or finds a corrupt cached library leaves the model running
on the PyTorch path with a warning, never a partial library in the cache."""

from __future__ import annotations

import os
import shutil
import stat
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import TOL

from bert_port import native
from bert_port.quantization import Int8Linear

needs_kernels = pytest.mark.skipif(native.int8_rows() is None, reason="no C compiler: the PyTorch path only")


@pytest.fixture
def fresh_kernels(tmp_path, monkeypatch):
    """`native.kernels` forgets what it loaded and builds into an empty cache under tmp_path."""
    monkeypatch.setenv("BERT_PORT_CACHE", str(tmp_path))
    native.kernels.cache_clear()
    yield tmp_path / "native"
    native.kernels.cache_clear()


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
    monkeypatch.setattr(native, "int8_rows", lambda: None)
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
        for kernels in (native.int8_rows(), None):
            monkeypatch.setattr(native, "int8_rows", lambda kernels=kernels: kernels)
            for args in ((), (None, residual), (F.gelu, residual)):
                out = layer(x, *args)
                if kernels is not None:
                    expected[len(args), args[0] if args else None] = out
                else:  # PyTorch's path
                    torch.testing.assert_close(expected[len(args), args[0] if args else None], out, **TOL[torch.int8])


@pytest.mark.parametrize("kernels", [pytest.param("C", marks=needs_kernels), "PyTorch"])
def test_int8_rows_do_not_depend_on_the_batch_or_the_threads(kernels, monkeypatch):
    """Each row quantized by its own range, and the float32 outlier channels summed in a fixed
    order (a float32 addmm's order changes with the row count)."""
    if kernels == "PyTorch":
        monkeypatch.setattr(native, "int8_rows", lambda: None)
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


@needs_kernels
def test_a_build_lands_in_the_cache_whole(fresh_kernels):
    assert native.int8_rows() is not None
    built = list(fresh_kernels.iterdir())
    assert len(built) == 1 and built[0].name.startswith("int8_rows-") and built[0].suffix == ".so"
    assert built[0].stem.rsplit("-", 1)[1] == native._digest(built[0])


@needs_kernels
def test_a_changed_header_builds_again(fresh_kernels, tmp_path, monkeypatch):
    """The sources' headers (csrc/*.h, which `#include` reaches) are part of a build's key: an
    edit to one gives a new library, not the cached build of the old header."""
    sources = tmp_path / "csrc"
    shutil.copytree(native.SOURCES, sources)
    monkeypatch.setattr(native, "SOURCES", sources)
    first = native._build("attention", native.compiler())
    with open(sources / "vector.h", "a") as header:
        header.write("/* edited */\n")
    second = native._build("attention", native.compiler())
    assert first != second and first.exists() and second.exists()


@needs_kernels
@pytest.mark.skipif(native.platform.machine() != "x86_64", reason="x86-64 instruction sets")
def test_another_instruction_set_builds_its_own_library(fresh_kernels, monkeypatch):
    """`BERT_PORT_MARCH` (make test-kernels' AVX2 and SSE2 builds) is part of the key: a
    library of its own beside the native one, never the native one under its name."""
    monkeypatch.delenv("BERT_PORT_MARCH", raising=False)
    native_build = native._build("int8_rows", native.compiler())
    assert "-march=native" in native._flags("int8_rows")
    monkeypatch.setenv("BERT_PORT_MARCH", "x86-64")
    other = native._build("int8_rows", native.compiler())
    assert "-march=x86-64" in native._flags("int8_rows")
    assert other != native_build and native_build.exists()


@needs_kernels
def test_a_corrupt_cached_library_is_built_again(fresh_kernels):
    """Truncated, as by a copy onto a full disk: dlopen would crash on it, not refuse it."""
    library = native._build("int8_rows", native.compiler())
    whole = library.read_bytes()
    library.unlink()
    library.write_bytes(whole[:1000])
    assert native.int8_rows() is not None
    (rebuilt,) = fresh_kernels.iterdir()
    assert rebuilt.read_bytes() == whole


def failing_compiler(folder, partial: bool) -> str:
    """A `cc` that fails, after writing half a library to its output when `partial`."""
    script = folder / "cc"
    write = 'out=; while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done; printf "\\177ELF" > "$out"; '
    script.write_text("#!/bin/sh\n" + (write if partial else "") + "echo 'error: interrupted' >&2; exit 1\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


@pytest.mark.parametrize("partial", [False, True])
def test_a_failed_build_warns_and_runs_pytorch(fresh_kernels, tmp_path, monkeypatch, partial):
    monkeypatch.setenv("CC", failing_compiler(tmp_path, partial))
    with pytest.warns(RuntimeWarning, match="could not build its int8_rows kernels.*interrupted"):
        assert native.int8_rows() is None
    assert not fresh_kernels.exists() or not os.listdir(fresh_kernels)  # nothing half-written left behind
    layer = layers()["signed"]
    with torch.inference_mode():
        assert layer(inputs("signed")).isfinite().all()


def test_no_compiler_warns_and_native_off_is_quiet(fresh_kernels, monkeypatch):
    monkeypatch.setattr(native, "compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert native.int8_rows() is None
    native.kernels.cache_clear()
    monkeypatch.setenv("BERT_PORT_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.int8_rows() is None


@pytest.mark.parametrize("kernels", [pytest.param("C", marks=needs_kernels), "PyTorch"])
def test_int8_runs_with_gradients_on_and_records_none(kernels, monkeypatch):
    """Outside inference_mode, with an input that requires grad (an embedding's output does): the
    same values as under inference_mode, and no autograd graph."""
    if kernels == "PyTorch":
        monkeypatch.setattr(native, "int8_rows", lambda: None)
    for name, layer in layers().items():
        x = inputs(name)
        with torch.inference_mode():
            expected = layer(x, None, torch.ones(x.shape[0], layer.out_features))
        out = layer(x.clone().requires_grad_(), None, torch.ones(x.shape[0], layer.out_features, requires_grad=True))
        assert not out.requires_grad, name
        assert torch.equal(out, expected), name


@pytest.mark.parametrize("kernels", [pytest.param("C", marks=needs_kernels), "PyTorch"])
def test_a_nan_in_a_row_makes_that_row_nan(kernels, monkeypatch):
    """As float32 would: the NaN is not hidden behind a finite step (C's max skips NaN, and a NaN
    converts to no integer), and the other rows are untouched."""
    if kernels == "PyTorch":
        monkeypatch.setattr(native, "int8_rows", lambda: None)
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
@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_a_cxx_compiler_or_a_command_with_arguments_builds_c(fresh_kernels, monkeypatch):
    """$CC may be a C++ compiler (whose mangled names ctypes would not find) or carry arguments."""
    monkeypatch.setenv("CC", f"{shutil.which('g++')} -O2")
    assert native.int8_rows() is not None


@needs_kernels
def test_a_library_without_its_functions_warns_and_runs_pytorch(fresh_kernels, monkeypatch):
    monkeypatch.setitem(native.SIGNATURES, "int8_rows", {**native.SIGNATURES["int8_rows"], "missing_rows": []})
    with pytest.warns(RuntimeWarning, match="has no function missing_rows"):
        assert native.int8_rows() is None
