"""The transformers.BertModel interface, option by option, against transformers in the same run.

A parity matrix on a tiny random config (every hidden_act, eager and sdpa, causal and
bidirectional, 2-D/3-D/4-D masks, left/right padding, all-pad rows, inputs_embeds, custom
position_ids, hidden states and attentions of every layer, no pooler, bf16/fp16, gradients)
and a representative subset on the bundled real all-MiniLM-L6-v2 checkpoint.

Conventions, from transformers 5 (modeling_bert.py, masking_utils.py, sdpa_attention.py):
- fp32 CPU eager on the padded path (exact mode, conftest.EXACT) is compared bitwise
  (`torch.equal`): same operations, same order, same shapes as transformers' eager path,
  so the same kernels under every kernel family. SDPA and the unpadded default are compared
  with the fp32 tolerance policy (bert_port/tolerance.py): their kernels and shapes differ.
- Decoders: transformers' BertModel builds a KV cache by default (`use_cache=True`) even for a
  single forward; the cache concatenates K and V into contiguous copies, so its matmuls see a
  different memory layout and differ by ~1 ulp. The matrix calls it with `use_cache=False`;
  `test_decoder_default_kv_cache_differs_by_an_ulp` measures the default.
- transformers 5 cannot take a 3-D mask (its mask builder fails on it), so our 3-D masks are
  compared with transformers given the equivalent 4-D mask.
- transformers' SDPA path ignores `output_attentions` (warns, returns none); ours runs the eager
  path then, so its outputs are compared with transformers' eager ones.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import EXACT, REAL_SENTENCES, TINY, TOL, hf_model, random_batch

from bert_port import BertConfig, BertLayer, BertModel, encode, load_tokenizer
from bert_port.checkpoint import hf_to_port
from bert_port.config import SUPPORTED_ACTIVATIONS
from bert_port.utils import ACT2FN, get_activation, get_extended_attention_mask

ATTNS = ["eager", "sdpa"]
HALF = [torch.bfloat16, torch.float16]


# -- helpers ----------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: with one intra-op thread no op waits at an OpenMP barrier for
    a core that other work on a shared machine holds (that made each op many times slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _pair(config: dict, attn: str = "eager", add_pooling_layer: bool = True):
    """transformers' BertModel and ours with the same (random) weights, loaded through the
    production loader. The matrix checks the padded path, which mirrors transformers
    everywhere including pad positions; `test_unpadded_default_matches_transformers` and
    tests/test_packing.py check the unpadded default on real tokens."""
    hf = hf_model(config, attn=attn, add_pooling_layer=add_pooling_layer)
    config = BertConfig.from_dict(config, attn_implementation=attn, unpad_inputs=False)
    ours = BertModel(config, add_pooling_layer=add_pooling_layer)
    ours.load_hf_state_dict(hf.state_dict())
    return hf, ours.eval()


def _hf(hf, **kwargs):
    return hf(**{"use_cache": False, **kwargs})  # see the module docstring: no KV cache layout change


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _assert_same(actual: torch.Tensor, expected: torch.Tensor, attn: str) -> None:
    """Bitwise for fp32 eager (the issue's exactness bar), the fp32 table for SDPA."""
    if attn == "eager":
        assert torch.equal(actual, expected), f"eager not bitwise: max abs diff {_max_diff(actual, expected):.3e}"
    else:
        torch.testing.assert_close(actual, expected, **TOL[torch.float32])


def _segment_keep(B: int, T: int, causal: bool) -> torch.Tensor:
    """A (B, T, T) per-query mask: each row packs two segments that attend only within
    themselves, row i ends with i pads (so pad query rows are fully masked)."""
    pos = torch.arange(T)
    keep = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        valid = T - b
        seg = (pos >= (valid + 1) // 2).long()
        real = pos < valid
        keep[b] = (seg[:, None] == seg[None, :]) & real[None, :] & real[:, None]
    if causal:
        keep &= torch.ones(T, T, dtype=torch.bool).tril()
    return keep


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.where(keep, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)


MASK_KINDS = ["none", "right", "left", "bool", "float", "all_pad_row", "3d", "4d", "4d_bool"]


def _masks(kind: str, batch: dict, causal: bool, attn: str, dtype=torch.float32):
    """(ours, transformers') attention_mask for a mask kind; equal in meaning."""
    B, T = batch["input_ids"].shape
    right = random_batch(TINY["vocab_size"], B, T, pad="right")["attention_mask"]
    if kind == "none":
        return None, None
    if kind == "right":
        return right, right
    if kind == "left":
        left = random_batch(TINY["vocab_size"], B, T, pad="left")["attention_mask"]
        return left, left
    if kind == "bool":
        return right.bool(), right.bool()
    if kind == "float":
        return right.float(), right.float()
    if kind == "all_pad_row":
        mask = right.clone()
        mask[1] = 0
        return mask, mask
    keep = _segment_keep(B, T, causal)[:, None]  # (B, 1, T, T), causal pattern included
    hf_mask = keep if attn == "sdpa" else _additive(keep, dtype)  # what transformers expects
    if kind == "3d":
        return _segment_keep(B, T, False).long(), hf_mask  # ours adds the causal pattern itself
    if kind == "4d":
        return hf_mask, hf_mask
    if kind == "4d_bool":
        return keep, hf_mask  # our eager path turns True/False into 0/finfo.min
    raise ValueError(kind)


# -- activations ------------------------------------------------------------------------


def test_activation_table_covers_transformers():
    """Every parameter-free activation transformers offers is in our table (prelu and xielu
    carry learnable weights, which no BERT checkpoint has)."""
    from transformers.activations import ACT2CLS

    assert set(ACT2FN) == set(ACT2CLS) - {"prelu", "xielu"}
    assert set(SUPPORTED_ACTIVATIONS) == set(ACT2FN)  # the config validates against the same list
    with pytest.raises(ValueError, match="unknown hidden_act 'gelu_foo'; use one of gelu"):
        get_activation("gelu_foo")


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("act", sorted(ACT2FN))
def test_every_activation(act, attn):
    config = dict(TINY, hidden_act=act)
    hf, ours = _pair(config, attn)
    batch = random_batch(config["vocab_size"])
    with torch.no_grad():
        expected, actual = _hf(hf, **batch), ours(**batch)
    _assert_same(actual.last_hidden_state, expected.last_hidden_state, attn)
    _assert_same(actual.pooler_output, expected.pooler_output, attn)


# -- the mask matrix --------------------------------------------------------------------


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("attn", ATTNS)
def test_mask_matrix(attn, causal, kind):
    config = dict(TINY, is_decoder=causal)
    hf, ours = _pair(config, attn)
    batch = random_batch(config["vocab_size"], B=3, T=9)
    del batch["attention_mask"]
    mask, hf_mask = _masks(kind, batch, causal, attn)
    with torch.no_grad():
        expected = _hf(hf, **batch, attention_mask=hf_mask)
        actual = ours(**batch, attention_mask=mask)
    assert torch.isfinite(actual.last_hidden_state).all()
    _assert_same(actual.last_hidden_state, expected.last_hidden_state, attn)  # pad rows included
    _assert_same(actual.pooler_output, expected.pooler_output, attn)


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (4, 16)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("attn", ATTNS)
def test_shapes(attn, causal, shape):
    config = dict(TINY, is_decoder=causal)
    hf, ours = _pair(config, attn)
    batch = random_batch(config["vocab_size"], *shape)
    with torch.no_grad():
        expected, actual = _hf(hf, **batch), ours(**batch)
    _assert_same(actual.last_hidden_state, expected.last_hidden_state, attn)


@pytest.mark.parametrize("inputs", ["inputs_embeds", "position_ids", "shared_position_ids", "no_token_types"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("attn", ATTNS)
def test_inputs(attn, causal, inputs):
    config = dict(TINY, is_decoder=causal)
    hf, ours = _pair(config, attn)
    batch = random_batch(config["vocab_size"], pad="left")
    B, T = batch["input_ids"].shape
    if inputs == "inputs_embeds":
        g = torch.Generator().manual_seed(1)
        batch["inputs_embeds"] = torch.randn(B, T, config["hidden_size"], generator=g)
        del batch["input_ids"]
    elif inputs == "position_ids":
        # Left padding with positions counted from the first real token, per row.
        batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    elif inputs == "shared_position_ids":
        batch["position_ids"] = torch.arange(3, 3 + T)[None]  # (1, T), broadcast over the batch
    else:
        del batch["token_type_ids"]
    with torch.no_grad():
        expected, actual = _hf(hf, **batch), ours(**batch)
    _assert_same(actual.last_hidden_state, expected.last_hidden_state, attn)
    _assert_same(actual.pooler_output, expected.pooler_output, attn)


def test_custom_positions_change_the_output():
    _, ours = _pair(TINY)
    batch = random_batch(TINY["vocab_size"])
    with torch.no_grad():
        default = ours(**batch).last_hidden_state
        shifted = ours(**batch, position_ids=torch.arange(5, 14)[None]).last_hidden_state
        explicit = ours(**batch, position_ids=torch.arange(9)[None]).last_hidden_state
    assert torch.equal(default, explicit)
    assert _max_diff(default, shifted) > 1e-3


def test_3d_mask_equals_2d_mask_it_expands():
    _, ours = _pair(TINY, "eager")
    batch = random_batch(TINY["vocab_size"])
    mask2 = batch.pop("attention_mask")
    mask3 = mask2[:, None, :].expand(-1, mask2.shape[1], -1)
    with torch.no_grad():
        two, three = ours(**batch, attention_mask=mask2), ours(**batch, attention_mask=mask3)
    assert torch.equal(two.last_hidden_state, three.last_hidden_state)


@pytest.mark.parametrize(
    "mask, message",
    [
        (torch.ones(3, 1, 9, 9, dtype=torch.long), "must be boolean .True = attend. or additive float"),
        (torch.zeros(3, 1, 9, 9, dtype=torch.float64), "must be in the model's dtype torch.float32"),
    ],
    ids=["int", "wrong_dtype"],
)
def test_bad_4d_mask_is_a_clear_error(mask, message):
    _, ours = _pair(TINY)
    with pytest.raises(ValueError, match=message):
        ours(**random_batch(TINY["vocab_size"]) | {"attention_mask": mask})


def test_mask_forms_follow_transformers():
    """None where transformers skips the mask; SDPA gets booleans, eager 0/finfo.min."""
    pad = torch.tensor([[1, 1, 0]])
    full = torch.ones(1, 3, dtype=torch.long)
    kw = dict(seq_len=3)
    assert get_extended_attention_mask(None, torch.float32, **kw) is None
    assert get_extended_attention_mask(full, torch.float32, **kw) is None
    assert get_extended_attention_mask(full, torch.float32, causal=True, as_bool=True, **kw) is None  # is_causal
    eager_causal = get_extended_attention_mask(None, torch.float16, causal=True, **kw)
    assert eager_causal.dtype == torch.float16 and eager_causal[0, 0, 0, 1] == torch.finfo(torch.float16).min
    sdpa = get_extended_attention_mask(pad, torch.bfloat16, causal=True, as_bool=True, **kw)
    expected = torch.tensor([[True, False, False], [True, True, False], [True, True, False]])
    assert sdpa.dtype == torch.bool and sdpa.shape == (1, 1, 3, 3) and torch.equal(sdpa[0, 0], expected)


# -- hidden states, attentions, pooler --------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("attn", ATTNS)
def test_hidden_states_and_attentions_every_layer(attn, causal):
    config = dict(TINY, is_decoder=causal)
    hf_eager, ours = _pair(config, attn)
    if attn == "sdpa":  # our SDPA model runs eager to expose probabilities
        hf_eager = hf_model(config, attn="eager")
    batch = random_batch(config["vocab_size"])
    with torch.no_grad():
        expected = _hf(hf_eager, **batch, output_hidden_states=True, output_attentions=True)
        actual = ours(**batch, output_hidden_states=True, output_attentions=True)
        plain = ours(**batch)
    n = config["num_hidden_layers"]
    assert len(actual.hidden_states) == n + 1 and len(actual.attentions) == n
    for got, want in zip(actual.hidden_states, expected.hidden_states, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(actual.attentions, expected.attentions, strict=True):
        assert got.shape == (3, config["num_attention_heads"], 9, 9)
        assert torch.equal(got, want)
    assert torch.equal(actual.hidden_states[-1], actual.last_hidden_state)
    # Asking for the extras does not change the result beyond the backend difference.
    _assert_same(plain.last_hidden_state, actual.last_hidden_state, attn)
    assert plain.hidden_states is None and plain.attentions is None


def test_output_is_a_mapping_with_attributes_and_positions():
    _, ours = _pair(TINY)
    with torch.no_grad():
        out = ours(**random_batch(TINY["vocab_size"]))
    assert set(out) == {"last_hidden_state", "pooler_output", "hidden_states", "attentions"}
    assert out["pooler_output"] is out.pooler_output
    assert out[0] is out.last_hidden_state and out[1] is out.pooler_output and len(out.to_tuple()) == 2
    with pytest.raises(AttributeError):
        _ = out.logits


@pytest.mark.parametrize("attn", ATTNS)
def test_no_pooler_tiny(attn, caplog):
    """A checkpoint with a pooler loads into add_pooling_layer=False, reporting the pooler
    keys as unused; the rest equals transformers' model without a pooler."""
    hf_full = hf_model(TINY, attn=attn)
    hf_bare = hf_model(TINY, attn=attn, add_pooling_layer=False)
    hf_bare.load_state_dict({k: v for k, v in hf_full.state_dict().items() if not k.startswith("pooler.")})
    ours = BertModel(BertConfig.from_dict(TINY, attn_implementation=attn, unpad_inputs=False), add_pooling_layer=False)
    with caplog.at_level(logging.WARNING, logger="bert_port"):
        ours.load_hf_state_dict(hf_full.state_dict())
    assert "not used by BertModel" in caplog.text and "pooler_dense.weight" in caplog.text
    assert not any(name.startswith("pooler") for name, _ in ours.named_parameters())
    batch = random_batch(TINY["vocab_size"])
    with torch.no_grad():
        expected, actual = _hf(hf_bare, **batch), ours.eval()(**batch)
    assert actual.pooler_output is None and expected.pooler_output is None
    _assert_same(actual.last_hidden_state, expected.last_hidden_state, attn)


def test_pooler_missing_from_checkpoint_is_initialised():
    """A state dict without a pooler (BertModel(add_pooling_layer=False)'s) loads into a model
    with one: the pooler is initialised and reported, the rest is the checkpoint's, as
    transformers loads such a file (tests/test_heads.py compares the report with its own)."""
    hf_bare = hf_model(TINY, add_pooling_layer=False)
    ours = BertModel(BertConfig.from_dict(TINY, **EXACT))
    assert ours.load_hf_state_dict(hf_bare.state_dict()) == ["pooler_dense.weight", "pooler_dense.bias"]
    assert ours.pooler_dense.weight.std() > 0
    batch = random_batch(TINY["vocab_size"])
    with torch.no_grad():
        assert torch.equal(ours.eval()(**batch).last_hidden_state, _hf(hf_bare, **batch).last_hidden_state)


# -- config options ---------------------------------------------------------------------


def test_layer_norm_eps_and_pad_token_id_honoured():
    config = dict(TINY, layer_norm_eps=1e-2, pad_token_id=5)
    hf, ours = _pair(config)
    assert ours.word_embedding.padding_idx == 5
    assert all(m.eps == 1e-2 for m in ours.modules() if isinstance(m, torch.nn.LayerNorm))
    fresh = BertModel(BertConfig.from_dict(config))
    assert torch.count_nonzero(fresh.word_embedding.weight[5]) == 0  # HF's init zeroes the pad row
    batch = random_batch(config["vocab_size"])
    batch["input_ids"][batch["attention_mask"] == 0] = 5
    expected, actual = _hf(hf, **batch), ours(**batch)
    assert torch.equal(actual.last_hidden_state, expected.last_hidden_state)
    actual.last_hidden_state.sum().backward()
    assert torch.count_nonzero(ours.word_embedding.weight.grad[5]) == 0  # padding_idx gets no gradient
    default_eps = BertModel(BertConfig.from_dict(dict(config, layer_norm_eps=1e-12)))
    default_eps.load_hf_state_dict(hf.state_dict())
    with torch.no_grad():
        assert _max_diff(default_eps.eval()(**batch).last_hidden_state, actual.last_hidden_state) > 1e-4


def test_classifier_dropout_carried_by_config():
    import transformers

    config = BertConfig.from_dict(dict(TINY, classifier_dropout=0.3))
    assert config.classifier_dropout == 0.3
    assert config.to_dict()["classifier_dropout"] == 0.3
    assert transformers.BertConfig(**config.to_dict()).classifier_dropout == 0.3
    assert BertConfig.from_dict(TINY).classifier_dropout is None  # the head falls back to hidden_dropout_prob


# -- numerics ---------------------------------------------------------------------------


def _hf_backend_spread(config: dict, batch: dict, dtype: torch.dtype) -> float:
    """transformers' own eager-vs-SDPA max abs difference in `dtype` on this batch, over rows
    that are not all padding (there eager gives uniform attention and SDPA zeros)."""
    outs = []
    for attn in ATTNS:
        model = hf_model(config, attn=attn).to(dtype)
        with torch.no_grad():
            outs.append(_hf(model, **batch).last_hidden_state)
    real_rows = batch["attention_mask"].bool().any(-1)
    return _max_diff(outs[0][real_rows], outs[1][real_rows])


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_precision(dtype, attn, causal):
    config = dict(TINY, is_decoder=causal)
    hf, ours = _pair(config, attn)
    hf.to(dtype)
    ours.to(dtype)
    batch = random_batch(config["vocab_size"], B=4, T=9, pad="left")
    batch["attention_mask"][2] = 0  # an all-pad row
    tol = max(_hf_backend_spread(config, batch, dtype), torch.finfo(dtype).eps)
    with torch.no_grad():
        expected, actual = _hf(hf, **batch), ours(**batch)
    assert actual.last_hidden_state.dtype == dtype
    assert torch.isfinite(actual.last_hidden_state).all() and torch.isfinite(actual.pooler_output).all()
    torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state, atol=tol, rtol=0)
    torch.testing.assert_close(actual.pooler_output, expected.pooler_output, atol=tol, rtol=0)


@pytest.mark.parametrize("attn", ATTNS)
def test_fp16_all_pad_row_never_nan(attn):
    """Scores of -20 everywhere: finfo(fp16).min - 20 rounds to -inf, so transformers' eager
    path turns the all-pad row into NaN. Ours gives that row the uniform attention that fp32
    gives and leaves every other row exactly as transformers computes it."""
    hf, ours = _pair(TINY, attn)
    for model, prefix in ((hf, "encoder.layer.0.attention.self."), (ours, "bert_layers.0.self_attention.")):
        with torch.no_grad():
            model.get_submodule(prefix + "query").weight.zero_()
            model.get_submodule(prefix + "key").weight.zero_()
            model.get_submodule(prefix + "query").bias.fill_(4.0)
            model.get_submodule(prefix + "key").bias.fill_(-(20.0 * 8**0.5) / (4.0 * 8))  # q.k * 8^-0.5 = -20
    batch = random_batch(TINY["vocab_size"])
    batch["attention_mask"][1] = 0
    with torch.no_grad():
        reference32 = ours(**batch).last_hidden_state
        hf.half()
        ours.half()
        expected, actual = _hf(hf, **batch).last_hidden_state, ours(**batch).last_hidden_state
    assert torch.isfinite(actual).all()
    others = torch.tensor([True, False, True])
    assert torch.equal(actual[others], expected[others])
    if attn == "eager":
        # Outside the policy's table: the fully masked fp16 row against our own fp32 row, so fp16's
        # rounding of values of order 1 (about 1e-3 each, summed over the layers) sets the bar.
        torch.testing.assert_close(actual[1].float(), reference32[1], atol=1e-2, rtol=0)
    else:  # SDPA gives a fully masked row zero attention output, in both models
        assert torch.equal(actual[1], expected[1])


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("attn", ATTNS)
def test_gradient_parity(attn, causal):
    config = dict(TINY, is_decoder=causal)
    hf, ours = _pair(config, attn)
    batch = random_batch(config["vocab_size"])
    g = torch.Generator().manual_seed(2)
    embeds = torch.randn(3, 9, config["hidden_size"], generator=g)
    del batch["input_ids"]
    weight = torch.randn(3, 9, config["hidden_size"], generator=g)
    grads = []
    for model, call in ((hf, lambda **kw: _hf(hf, **kw)), (ours, ours)):
        x = embeds.clone().requires_grad_()
        out = call(**batch, inputs_embeds=x)
        ((out.last_hidden_state * weight).sum() + out.pooler_output.square().sum()).backward()
        grads.append({**{k: p.grad for k, p in model.named_parameters()}, "inputs_embeds": x.grad})
    expected = hf_to_port({k: v for k, v in grads[0].items() if k != "inputs_embeds"}).state_dict
    expected["inputs_embeds"] = grads[0]["inputs_embeds"]
    assert expected.keys() == grads[1].keys()
    for name, grad in grads[1].items():
        if name == "word_embedding.weight":  # inputs_embeds bypass the word embeddings
            assert grad is None and expected[name] is None
            continue
        assert grad.abs().sum() > 0, name
        # Gradients, not forward outputs (the policy's table): sums in another order over the
        # batch leave relative differences of about 1e-6; atol covers gradients near zero.
        torch.testing.assert_close(grad, expected[name], atol=1e-7, rtol=1e-5, msg=name)


@pytest.mark.parametrize("attn", ATTNS)
def test_dropout_only_in_train(attn):
    """Dropout sits where transformers puts it: the same seed gives the same bits in train
    mode; eval is deterministic; train mode is not."""
    hf, ours = _pair(TINY, attn)
    batch = random_batch(TINY["vocab_size"])
    with torch.no_grad():
        first, second = ours(**batch).last_hidden_state, ours(**batch).last_hidden_state
        assert torch.equal(first, second)
        hf.train()
        ours.train()
        torch.manual_seed(7)
        expected = _hf(hf, **batch).last_hidden_state
        torch.manual_seed(7)
        actual = ours(**batch).last_hidden_state
        again = ours(**batch).last_hidden_state
    assert torch.equal(actual, expected)
    assert _max_diff(actual, again) > 1e-3 and _max_diff(actual, first) > 1e-3


def test_decoder_default_kv_cache_differs_by_an_ulp():
    """transformers' decoder builds a KV cache by default; the concatenated (contiguous) K and
    V change the matmul layout, not the maths. Ours matches use_cache=False bitwise."""
    config = dict(TINY, is_decoder=True)
    hf, ours = _pair(config, "eager")
    batch = random_batch(config["vocab_size"])
    with torch.no_grad():
        cached, uncached, actual = hf(**batch), _hf(hf, **batch), ours(**batch)
    assert torch.equal(actual.last_hidden_state, uncached.last_hidden_state)
    # transformers' KV-cache layout against itself without the cache differs by an ulp or so of
    # values of order 1; 1e-6 is a few of those ulps, far below the policy's 1e-5.
    torch.testing.assert_close(actual.last_hidden_state, cached.last_hidden_state, atol=1e-6, rtol=0)


# -- the standalone block ---------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("attn", ATTNS)
def test_bert_layer_standalone_matches_hf(attn, causal):
    from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

    config = dict(TINY, is_decoder=causal)
    # transformers' layer and the config it reads its attention implementation from, out of the
    # twin builder's model (which sets that implementation through the public API).
    hf = hf_model(config, attn=attn)
    hf_layer, hf_config = hf.encoder.layer[0], hf.config
    layer = BertLayer(BertConfig.from_dict(config, attn_implementation=attn)).eval()
    state = hf_to_port({f"encoder.layer.0.{k}": v for k, v in hf_layer.state_dict().items()}).state_dict
    layer.load_state_dict({k.removeprefix("bert_layers.0."): v for k, v in state.items()})
    x = torch.randn(3, 9, config["hidden_size"])
    mask = random_batch(config["vocab_size"])["attention_mask"]
    make = create_causal_mask if causal else create_bidirectional_mask
    kwargs = {"cache": None} if causal else {}
    with torch.no_grad():
        for m in (None, mask):
            hf_mask = make(config=hf_config, inputs_embeds=x, attention_mask=m, **kwargs)
            _assert_same(layer(x, m), hf_layer(x, hf_mask), attn)
        out, probs = layer(x, mask, output_attentions=True)
    assert probs.shape == (3, 4, 9, 9) and torch.isfinite(out).all()


def test_bert_layer_stack_learns_a_toy_task():
    """Two BertLayers learn to output, at position 0, the mean of feature 0 over the real
    tokens, with noisy padding that the mask must hide."""
    torch.manual_seed(0)
    config = BertConfig.from_dict(
        dict(
            TINY,
            hidden_size=16,
            num_attention_heads=2,
            intermediate_size=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )
    stack = torch.nn.ModuleList([BertLayer(config) for _ in range(2)])
    head = torch.nn.Linear(16, 1)
    params = [*stack.parameters(), *head.parameters()]
    opt = torch.optim.Adam(params, lr=3e-3)

    def sample(B=64, T=8):
        x = torch.randn(B, T, 16)
        lengths = torch.randint(2, T + 1, (B,))
        mask = (torch.arange(T)[None] < lengths[:, None]).long()
        x = torch.where(mask[..., None].bool(), x, 5 * torch.randn(B, T, 16))  # loud padding
        target = (x[..., 0] * mask).sum(1) / mask.sum(1)
        return x, mask, target

    def loss_of(x, mask, target):
        h = x
        for layer in stack:
            h = layer(h, mask)
        return torch.nn.functional.mse_loss(head(h[:, 0]).squeeze(-1), target)

    test_batch = sample(256)
    with torch.no_grad():
        before = loss_of(*test_batch).item()
    for _ in range(60):
        opt.zero_grad()
        loss_of(*sample()).backward()
        opt.step()
    with torch.no_grad():
        after = loss_of(*test_batch).item()
        x, mask, _ = test_batch
        noisy = torch.where(mask[..., None].bool(), x, torch.randn_like(x))
        h1, h2 = x, noisy
        for layer in stack:
            h1, h2 = layer(h1, mask), layer(h2, mask)
    print(f"toy task MSE: {before:.3f} -> {after:.3f}")
    assert after < 0.5 * before
    real = mask.bool()
    torch.testing.assert_close(h1[real], h2[real], **TOL[torch.float32])  # padding is invisible


# -- the real checkpoint ----------------------------------------------------------------


@pytest.fixture(scope="module")
def real(minilm_path):
    """Our and transformers' all-MiniLM-L6-v2, per attention implementation, and a batch."""
    import transformers

    models = {}
    for attn in ATTNS:
        # The padded path, compared everywhere (pad positions too); the unpadded default is
        # compared on real tokens in tests/test_packing.py.
        ours = BertModel.from_pretrained(minilm_path, attn_implementation=attn, unpad_inputs=False)
        ref = transformers.BertModel.from_pretrained(str(minilm_path), attn_implementation=attn).eval()
        models[attn] = (ref, ours)
    batch = encode(load_tokenizer(minilm_path), REAL_SENTENCES)
    return models, batch


@pytest.mark.parametrize("attn", ATTNS)
def test_real_every_layer(real, attn):
    models, batch = real
    ref, ours = models[attn]
    eager_ref = models["eager"][0]
    with torch.no_grad():
        expected = ref(**batch, output_hidden_states=True)
        actual = ours(**batch, output_hidden_states=True, output_attentions=True)
        plain = ours(**batch, output_hidden_states=True)
        expected_attn = eager_ref(**batch, output_attentions=True).attentions
    assert len(actual.hidden_states) == 7 and len(actual.attentions) == 6
    for got, want in zip(plain.hidden_states, expected.hidden_states, strict=True):
        if attn == "eager":
            assert torch.equal(got, want)
        torch.testing.assert_close(got, want, **TOL[torch.float32])
    for got, want in zip(actual.attentions, expected_attn, strict=True):
        assert torch.equal(got, want)
    _assert_same(plain.pooler_output, expected.pooler_output, attn)


@pytest.mark.parametrize("attn", ATTNS)
def test_real_causal_left_padding_positions(real, attn, minilm_path):
    """Decoder mode on the real weights, left padding, per-row position ids, 3-D mask."""
    import transformers

    ours = BertModel.from_pretrained(minilm_path, attn_implementation=attn, is_decoder=True, unpad_inputs=False)
    ref = transformers.BertModel.from_pretrained(str(minilm_path), attn_implementation=attn, is_decoder=True).eval()
    batch = encode(load_tokenizer(minilm_path), REAL_SENTENCES)
    mask = batch["attention_mask"].flip(-1)  # left padding: move the pads to the front
    ids = torch.where(mask.bool(), batch["input_ids"].gather(1, (mask.cumsum(-1) - 1).clamp(min=0)), 0)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    T = ids.shape[1]
    keep = mask.bool()[:, None, :] & torch.ones(T, T, dtype=torch.bool).tril()
    hf_mask = keep[:, None] if attn == "sdpa" else _additive(keep[:, None], torch.float32)
    with torch.no_grad():
        expected = _hf(ref, input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        actual = ours(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        actual3 = ours(input_ids=ids, attention_mask=mask[:, None, :].expand(-1, T, -1), position_ids=positions)
        expected4 = _hf(ref, input_ids=ids, attention_mask=hf_mask, position_ids=positions).last_hidden_state
    _assert_same(actual, expected, attn)
    _assert_same(actual3.last_hidden_state, expected4, attn)


def test_real_no_pooler(minilm_path, caplog):
    import transformers

    with caplog.at_level(logging.WARNING, logger="bert_port"):
        ours = BertModel.from_pretrained(minilm_path, add_pooling_layer=False, **EXACT)
    assert "not used by BertModel" in caplog.text and "pooler_dense.bias" in caplog.text
    ref = transformers.BertModel.from_pretrained(
        str(minilm_path), add_pooling_layer=False, attn_implementation="eager"
    ).eval()
    batch = encode(load_tokenizer(minilm_path), REAL_SENTENCES)
    with torch.no_grad():
        actual, expected = ours(**batch), ref(**batch)
    assert actual.pooler_output is None
    assert torch.equal(actual.last_hidden_state, expected.last_hidden_state)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_real_half_precision(real, dtype):
    models, batch = real
    batch = {k: v[:3] for k, v in batch.items()}
    outs = {}
    with torch.no_grad():
        for attn, (ref, ours) in models.items():
            ref_h, ours_h = copy.deepcopy(ref).to(dtype), copy.deepcopy(ours).to(dtype)
            outs[attn] = (ref_h(**batch).last_hidden_state, ours_h(**batch).last_hidden_state)
    real_tokens = batch["attention_mask"].bool()
    tol = max(_max_diff(outs["eager"][0][real_tokens], outs["sdpa"][0][real_tokens]), torch.finfo(dtype).eps)
    for attn, (expected, actual) in outs.items():
        assert torch.isfinite(actual).all()
        torch.testing.assert_close(actual, expected, atol=tol, rtol=0, msg=f"{attn} {dtype}")


def test_real_gradient_parity(real):
    models, batch = real
    batch = {k: v[:3] for k, v in batch.items()}
    ref, ours = models["eager"]
    grads = []
    for model in (ref, ours):
        model.zero_grad()
        out = model(**batch)
        (out.last_hidden_state.square().mean() + out.pooler_output.sum()).backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        model.zero_grad()
    expected = hf_to_port(grads[0]).state_dict
    assert expected.keys() == grads[1].keys()
    for name, grad in grads[1].items():
        # Gradients, not forward outputs (the policy's table): sums in another order over the
        # batch leave relative differences of about 1e-6; atol covers gradients near zero.
        torch.testing.assert_close(grad, expected[name], atol=1e-7, rtol=1e-5, msg=name)


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu", "silu"])
@pytest.mark.parametrize("pad", ["right", "holes"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpadded_default_matches_transformers(act, pad, dtype):
    """The default model (SDPA, unpadded execution) against transformers' SDPA on real
    tokens and the pooler, within the tolerance policy: the dense layers run on N real rows
    instead of B*T padded ones, so the kernels may block the sums differently (bitwise on
    some CPUs at this size, not promised). Padding positions are zeros by design."""
    config = dict(TINY, hidden_act=act)
    hf = hf_model(config, attn="sdpa").to(dtype)
    ours = BertModel(BertConfig.from_dict(config)).to(dtype)
    ours.load_hf_state_dict(hf.state_dict())
    ours.eval()
    assert ours.config.unpad_inputs and ours.config.attn_implementation == "sdpa"
    batch = random_batch(TINY["vocab_size"], B=4, T=11)
    if pad == "holes":  # a 0 inside a row: still a 2-D padding mask, still unpadded
        batch["attention_mask"][0, 4] = 0
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected, actual = _hf(hf, **batch), ours(**batch)
    torch.testing.assert_close(actual.last_hidden_state[real], expected.last_hidden_state[real], **TOL[dtype])
    torch.testing.assert_close(actual.pooler_output, expected.pooler_output, **TOL[dtype])
    assert not actual.last_hidden_state[~real].any()
