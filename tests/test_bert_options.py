"""The transformers.BertModel interface, option by option, against transformers in the same run.

A parity matrix on a tiny random config (every hidden_act, eager and sdpa, causal and
bidirectional, 2-D/3-D/4-D masks, left/right padding, all-pad rows, inputs_embeds, custom
position_ids, hidden states and attentions of every layer, no pooler, bf16/fp16, gradients)
and (in test_bert_numerics.py) half precision, gradients, the standalone block and a
representative subset on the bundled real all-MiniLM-L6-v2 checkpoint.

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

import logging

import pytest
import torch
from conftest import ATTNS, EXACT, TINY, additive_mask, assert_same, hf_call, hf_model, hf_pair, max_diff, random_batch

from bert_port import BertConfig, BertModel
from bert_port.config import SUPPORTED_ACTIVATIONS
from bert_port.utils import ACT2FN, get_activation, get_extended_attention_mask

# Tiny tensors: see conftest.single_thread.
pytestmark = pytest.mark.usefixtures("single_thread")


# -- helpers (the pair and the checks are in conftest.py) -------------------------------


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
    hf_mask = keep if attn == "sdpa" else additive_mask(keep, dtype)  # what transformers expects
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
    hf, ours = hf_pair(config, attn)
    batch = random_batch(config["vocab_size"])
    with torch.no_grad():
        expected, actual = hf_call(hf, **batch), ours(**batch)
    assert_same(actual.last_hidden_state, expected.last_hidden_state, attn)
    assert_same(actual.pooler_output, expected.pooler_output, attn)


# -- the mask matrix --------------------------------------------------------------------


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("attn", ATTNS)
def test_mask_matrix(attn, causal, kind):
    config = dict(TINY, is_decoder=causal)
    hf, ours = hf_pair(config, attn)
    batch = random_batch(config["vocab_size"], B=3, T=9)
    del batch["attention_mask"]
    mask, hf_mask = _masks(kind, batch, causal, attn)
    with torch.no_grad():
        expected = hf_call(hf, **batch, attention_mask=hf_mask)
        actual = ours(**batch, attention_mask=mask)
    assert torch.isfinite(actual.last_hidden_state).all()
    assert_same(actual.last_hidden_state, expected.last_hidden_state, attn)  # pad rows included
    assert_same(actual.pooler_output, expected.pooler_output, attn)


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (4, 16)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("attn", ATTNS)
def test_shapes(attn, causal, shape):
    config = dict(TINY, is_decoder=causal)
    hf, ours = hf_pair(config, attn)
    batch = random_batch(config["vocab_size"], *shape)
    with torch.no_grad():
        expected, actual = hf_call(hf, **batch), ours(**batch)
    assert_same(actual.last_hidden_state, expected.last_hidden_state, attn)


@pytest.mark.parametrize("inputs", ["inputs_embeds", "position_ids", "shared_position_ids", "no_token_types"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("attn", ATTNS)
def test_inputs(attn, causal, inputs):
    config = dict(TINY, is_decoder=causal)
    hf, ours = hf_pair(config, attn)
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
        expected, actual = hf_call(hf, **batch), ours(**batch)
    assert_same(actual.last_hidden_state, expected.last_hidden_state, attn)
    assert_same(actual.pooler_output, expected.pooler_output, attn)


def test_custom_positions_change_the_output():
    _, ours = hf_pair(TINY)
    batch = random_batch(TINY["vocab_size"])
    with torch.no_grad():
        default = ours(**batch).last_hidden_state
        shifted = ours(**batch, position_ids=torch.arange(5, 14)[None]).last_hidden_state
        explicit = ours(**batch, position_ids=torch.arange(9)[None]).last_hidden_state
    assert torch.equal(default, explicit)
    assert max_diff(default, shifted) > 1e-3


def test_3d_mask_equals_2d_mask_it_expands():
    _, ours = hf_pair(TINY, "eager")
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
    _, ours = hf_pair(TINY)
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
    hf_eager, ours = hf_pair(config, attn)
    if attn == "sdpa":  # our SDPA model runs eager to expose probabilities
        hf_eager = hf_model(config, attn="eager")
    batch = random_batch(config["vocab_size"])
    with torch.no_grad():
        expected = hf_call(hf_eager, **batch, output_hidden_states=True, output_attentions=True)
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
    assert_same(plain.last_hidden_state, actual.last_hidden_state, attn)
    assert plain.hidden_states is None and plain.attentions is None


def test_output_is_a_mapping_with_attributes_and_positions():
    _, ours = hf_pair(TINY)
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
    ours = BertModel(BertConfig.from_dict(TINY, attn_implementation=attn), add_pooling_layer=False)
    with caplog.at_level(logging.WARNING, logger="bert_port"):
        ours.load_hf_state_dict(hf_full.state_dict())
    assert "not used by BertModel" in caplog.text and "pooler_dense.weight" in caplog.text
    assert not any(name.startswith("pooler") for name, _ in ours.named_parameters())
    batch = random_batch(TINY["vocab_size"])
    with torch.no_grad():
        expected, actual = hf_call(hf_bare, **batch), ours.eval()(**batch)
    assert actual.pooler_output is None and expected.pooler_output is None
    assert_same(actual.last_hidden_state, expected.last_hidden_state, attn)


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
        assert torch.equal(ours.eval()(**batch).last_hidden_state, hf_call(hf_bare, **batch).last_hidden_state)


# -- config options ---------------------------------------------------------------------


def test_layer_norm_eps_and_pad_token_id_honoured():
    config = dict(TINY, layer_norm_eps=1e-2, pad_token_id=5)
    hf, ours = hf_pair(config)
    assert ours.word_embedding.padding_idx == 5
    assert all(m.eps == 1e-2 for m in ours.modules() if isinstance(m, torch.nn.LayerNorm))
    fresh = BertModel(BertConfig.from_dict(config))
    assert torch.count_nonzero(fresh.word_embedding.weight[5]) == 0  # HF's init zeroes the pad row
    batch = random_batch(config["vocab_size"])
    batch["input_ids"][batch["attention_mask"] == 0] = 5
    expected, actual = hf_call(hf, **batch), ours(**batch)
    assert torch.equal(actual.last_hidden_state, expected.last_hidden_state)
    actual.last_hidden_state.sum().backward()
    assert torch.count_nonzero(ours.word_embedding.weight.grad[5]) == 0  # padding_idx gets no gradient
    default_eps = BertModel(BertConfig.from_dict(dict(config, layer_norm_eps=1e-12)))
    default_eps.load_hf_state_dict(hf.state_dict())
    with torch.no_grad():
        assert max_diff(default_eps.eval()(**batch).last_hidden_state, actual.last_hidden_state) > 1e-4


def test_classifier_dropout_carried_by_config():
    import transformers

    config = BertConfig.from_dict(dict(TINY, classifier_dropout=0.3))
    assert config.classifier_dropout == 0.3
    assert config.to_dict()["classifier_dropout"] == 0.3
    assert transformers.BertConfig(**config.to_dict()).classifier_dropout == 0.3
    assert BertConfig.from_dict(TINY).classifier_dropout is None  # the head falls back to hidden_dropout_prob
