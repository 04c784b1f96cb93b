"""The AVX2 fp32 GEMM (csrc/f32_linear.c, through `gemm.row_stable_linear` in fp32 inference
where the AVX2 variant runs): F.linear's values with each epilogue on the model's shapes, a row's
bits independent of its batch, its place in it, the thread count and the input's row stride, a
planted packing bug caught, and oneDNN where it cannot run. The AVX2 build is called directly, so
these run on every x86 CPU with AVX2, whichever variant the CPU would pick."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from conftest import TOL, call

from bert_port.speed import gemm, kernels
from bert_port.speed.gemm import RowStableLinear

SHAPES = [(384, 1152), (384, 1536), (1536, 384), (768, 3072), (32, 16)]
EPILOGUES = {"none": {}, "gelu": {"activation": F.gelu}, "relu": {"activation": F.relu}, "residual": {}}


@pytest.fixture
def avx2(monkeypatch):
    """The AVX2 variant's kernels in place of this CPU's, fp32 GEMMs on f32_linear.c, and a count
    of the kernel's calls."""
    if not {"avx2", "fma"} <= kernels.cpu_flags():
        pytest.skip("no AVX2 and FMA on this CPU")
    try:
        library = importlib.import_module("bert_port.speed._kernels_avx2")
    except ImportError:
        pytest.skip("the AVX2 variant of the kernels is not built")
    monkeypatch.setattr(kernels, "_library", lambda: library)
    kernels.f32_linear_ready.cache_clear()
    count = [0]
    real = kernels.f32_linear

    def counted(*args):
        count[0] += 1
        return real(*args)

    monkeypatch.setattr(kernels, "f32_linear", counted)
    yield count
    kernels.f32_linear_ready.cache_clear()


def layer_and_input(shape, rows: int, seed: int = 0):
    torch.manual_seed(seed)
    return RowStableLinear(*shape, batch_invariant=True).eval(), torch.randn(rows, shape[0])


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@torch.no_grad()
def test_kernel_gives_f_linear_values(shape, epilogue, avx2):
    """101 rows: 16 blocks of 6 and one of 5, in two row blocks of the threads' tasks."""
    layer, x = layer_and_input(shape, 101)
    kwargs = dict(EPILOGUES[epilogue])
    if epilogue == "residual":
        kwargs["residual"] = torch.randn(101, shape[1])
    expected = F.linear(x, layer.weight, layer.bias)
    expected = kwargs["activation"](expected) if "activation" in kwargs else expected
    expected = expected + kwargs["residual"] if "residual" in kwargs else expected
    torch.testing.assert_close(call(layer, x, **kwargs), expected, **TOL[torch.float32])
    assert avx2[0] == 1


@torch.no_grad()
def test_a_rows_bits_do_not_depend_on_its_batch_place_threads_or_stride(avx2):
    layer, x = layer_and_input((384, 1536), 200)
    residual = torch.randn(200, 1536)
    whole = layer(x, residual)
    for start, n in [(0, 1), (0, 6), (7, 5), (13, 97), (150, 50)]:
        assert torch.equal(layer(x[start : start + n], residual[start : start + n]), whole[start : start + n])
    wide = torch.randn(200, 512)
    wide[:, :384] = x
    assert torch.equal(layer(wide[:, :384], residual), whole)  # a row stride of 512
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x, residual), whole)
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def test_a_planted_packing_bug_is_caught(avx2, monkeypatch):
    """Panels of 16 outputs laid out by input first, as a careless permute would: the values test fails."""
    layer, x = layer_and_input((384, 384), 30)

    def wrong_pack(weight):
        m, k = weight.shape
        return weight.reshape(m // 16, k, 16).contiguous()  # no transpose

    monkeypatch.setattr(gemm, "_f32_pack", wrong_pack)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), **TOL[torch.float32])


@torch.no_grad()
def test_shapes_it_cannot_take_go_to_onednn_or_are_refused(avx2):
    layer, x = layer_and_input((384, 10), 20)  # 10 outputs: not in 16s
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), **TOL[torch.float32])
    assert avx2[0] == 0
    packed = gemm._f32_pack(torch.randn(32, 64))
    with pytest.raises(ValueError, match="do not fit"):
        kernels.f32_linear(torch.randn(4, 64), packed, 48, None, None)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.f32_linear(torch.randn(4, 64), packed, 32, None, torch.randn(3, 32))


def test_training_and_autograd_take_f_linear(avx2):
    layer, x = layer_and_input((384, 384), 20)
    y = layer(x)  # grad enabled, weight requires grad: F.linear, which records the graph
    assert y.requires_grad and avx2[0] == 0


def test_the_model_on_the_kernel_matches_transformers_and_keeps_a_texts_bits(avx2, minilm_path, hf_reference):
    """The bundled MiniLM with its fp32 GEMMs on the kernel: transformers' outputs within the fp32
    tolerance on real text, and each text's bits the same alone as in a padded batch."""
    from conftest import outputs_on_real_tokens

    from bert_port import BertModel, encode, load_tokenizer

    texts = ["a gripping, funny film.", "the plot is thin and the jokes fall flat, which is a pity", "ok"]
    batch = encode(load_tokenizer(minilm_path), texts)
    model = BertModel.from_pretrained(minilm_path)
    ours = outputs_on_real_tokens(model, batch)
    assert avx2[0] > 0
    expected = outputs_on_real_tokens(hf_reference, batch)
    for a, e in zip(ours, expected):
        torch.testing.assert_close(a, e, **TOL[torch.float32])
    for i, text in enumerate(texts):
        alone = outputs_on_real_tokens(model, encode(load_tokenizer(minilm_path), [text]))
        n = alone[0].shape[1]
        assert torch.equal(alone[0][0], ours[0][i, :n]) and torch.equal(alone[1][0], ours[1][i])
