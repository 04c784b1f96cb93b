"""The transformers.BertModel interface against transformers in the same run, continued from
test_bert_options.py (whose docstring gives the conventions): half precision, gradients,
dropout, the decoder's KV cache, the standalone `BertLayer`, and a representative subset on
the bundled real all-MiniLM-L6-v2 checkpoint."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import (
    ATTNS,
    EXACT,
    HALF,
    REAL_SENTENCES,
    TINY,
    TOL,
    additive_mask,
    assert_same,
    hf_call,
    hf_model,
    hf_pair,
    max_diff,
    random_batch,
)

from bert_port import BertConfig, BertLayer, BertModel, encode, load_tokenizer, speed
from bert_port.checkpoint import hf_to_port

# Tiny tensors: see conftest.single_thread.
pytestmark = pytest.mark.usefixtures("single_thread")


# -- numerics ---------------------------------------------------------------------------


def _hf_backend_spread(config: dict, batch: dict, dtype: torch.dtype) -> float:
    """transformers' own eager-vs-SDPA max abs difference in `dtype` on this batch, over rows
    that are not all padding (there eager gives uniform attention and SDPA zeros)."""
    outs = []
    for attn in ATTNS:
        model = hf_model(config, attn=attn).to(dtype)
        with torch.no_grad():
            outs.append(hf_call(model, **batch).last_hidden_state)
    real_rows = batch["attention_mask"].bool().any(-1)
    return max_diff(outs[0][real_rows], outs[1][real_rows])


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_precision(dtype, attn, causal):
    config = dict(TINY, is_decoder=causal)
    hf, ours = hf_pair(config, attn)
    hf.to(dtype)
    ours.to(dtype)
    batch = random_batch(config["vocab_size"], B=4, T=9, pad="left")
    batch["attention_mask"][2] = 0  # an all-pad row
    tol = max(_hf_backend_spread(config, batch, dtype), torch.finfo(dtype).eps)
    with torch.no_grad():
        expected, actual = hf_call(hf, **batch), ours(**batch)
    assert actual.last_hidden_state.dtype == dtype
    assert torch.isfinite(actual.last_hidden_state).all() and torch.isfinite(actual.pooler_output).all()
    torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state, atol=tol, rtol=0)
    torch.testing.assert_close(actual.pooler_output, expected.pooler_output, atol=tol, rtol=0)


@pytest.mark.parametrize("attn", ATTNS)
def test_fp16_all_pad_row_never_nan(attn):
    """Scores of -20 everywhere: finfo(fp16).min - 20 rounds to -inf, so transformers' eager
    path turns the all-pad row into NaN. Ours gives that row the uniform attention that fp32
    gives and leaves every other row exactly as transformers computes it without that row."""
    hf, ours = hf_pair(TINY, attn)
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
        expected, actual = hf_call(hf, **batch).last_hidden_state, ours(**batch).last_hidden_state
        # transformers on the other rows alone: on a CPU with AVX512-FP16 (Xeon, Sapphire
        # Rapids and later) its NaN row leaks into row 0 of the same batch, which ours does not.
        others = torch.tensor([True, False, True])
        expected_others = hf_call(hf, **{k: v[others] for k, v in batch.items()}).last_hidden_state
    assert torch.isfinite(actual).all()
    assert torch.equal(actual[others], expected_others)
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
    hf, ours = hf_pair(config, attn)
    batch = random_batch(config["vocab_size"])
    g = torch.Generator().manual_seed(2)
    embeds = torch.randn(3, 9, config["hidden_size"], generator=g)
    del batch["input_ids"]
    weight = torch.randn(3, 9, config["hidden_size"], generator=g)
    grads = []
    for model, call in ((hf, lambda **kw: hf_call(hf, **kw)), (ours, ours)):
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
    hf, ours = hf_pair(TINY, attn)
    batch = random_batch(TINY["vocab_size"])
    with torch.no_grad():
        first, second = ours(**batch).last_hidden_state, ours(**batch).last_hidden_state
        assert torch.equal(first, second)
        hf.train()
        ours.train()
        torch.manual_seed(7)
        expected = hf_call(hf, **batch).last_hidden_state
        torch.manual_seed(7)
        actual = ours(**batch).last_hidden_state
        again = ours(**batch).last_hidden_state
    assert torch.equal(actual, expected)
    assert max_diff(actual, again) > 1e-3 and max_diff(actual, first) > 1e-3


def test_decoder_default_kv_cache_differs_by_an_ulp():
    """transformers' decoder builds a KV cache by default; the concatenated (contiguous) K and
    V change the matmul layout, not the maths. Ours matches use_cache=False bitwise."""
    config = dict(TINY, is_decoder=True)
    hf, ours = hf_pair(config, "eager")
    batch = random_batch(config["vocab_size"])
    with torch.no_grad():
        cached, uncached, actual = hf(**batch), hf_call(hf, **batch), ours(**batch)
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
            assert_same(layer(x, m), hf_layer(x, hf_mask), attn)
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
        ours = BertModel.from_pretrained(minilm_path, attn_implementation=attn, optimize=False)
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
    assert_same(plain.pooler_output, expected.pooler_output, attn)


@pytest.mark.parametrize("attn", ATTNS)
def test_real_causal_left_padding_positions(real, attn, minilm_path):
    """Decoder mode on the real weights, left padding, per-row position ids, 3-D mask."""
    import transformers

    ours = BertModel.from_pretrained(minilm_path, attn_implementation=attn, is_decoder=True, optimize=False)
    ref = transformers.BertModel.from_pretrained(str(minilm_path), attn_implementation=attn, is_decoder=True).eval()
    batch = encode(load_tokenizer(minilm_path), REAL_SENTENCES)
    mask = batch["attention_mask"].flip(-1)  # left padding: move the pads to the front
    ids = torch.where(mask.bool(), batch["input_ids"].gather(1, (mask.cumsum(-1) - 1).clamp(min=0)), 0)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    T = ids.shape[1]
    keep = mask.bool()[:, None, :] & torch.ones(T, T, dtype=torch.bool).tril()
    hf_mask = keep[:, None] if attn == "sdpa" else additive_mask(keep[:, None], torch.float32)
    with torch.no_grad():
        expected = hf_call(ref, input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        actual = ours(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        actual3 = ours(input_ids=ids, attention_mask=mask[:, None, :].expand(-1, T, -1), position_ids=positions)
        expected4 = hf_call(ref, input_ids=ids, attention_mask=hf_mask, position_ids=positions).last_hidden_state
    assert_same(actual, expected, attn)
    assert_same(actual3.last_hidden_state, expected4, attn)


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
            try:
                expected = ref_h(**batch).last_hidden_state
            except RuntimeError as exc:  # the reference cannot run: nothing to compare with
                if "pack_vnni2" not in str(exc):
                    raise
                pytest.skip(
                    "torch 2.13's CPU flash kernel fails in fp16 under ATEN_CPU_CAPABILITY=default or avx2 on a CPU "
                    f"with AMX, transformers' SDPA included ({exc}); the native run covers this test"
                )
            outs[attn] = (expected, ours_h(**batch).last_hidden_state)
    real_tokens = batch["attention_mask"].bool()
    tol = max(max_diff(outs["eager"][0][real_tokens], outs["sdpa"][0][real_tokens]), torch.finfo(dtype).eps)
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
    ours = speed.optimize(ours).eval()
    assert ours.config.attn_implementation == "sdpa"
    batch = random_batch(TINY["vocab_size"], B=4, T=11)
    if pad == "holes":  # a 0 inside a row: still a 2-D padding mask, still unpadded
        batch["attention_mask"][0, 4] = 0
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected, actual = hf_call(hf, **batch), ours(**batch)
    torch.testing.assert_close(actual.last_hidden_state[real], expected.last_hidden_state[real], **TOL[dtype])
    torch.testing.assert_close(actual.pooler_output, expected.pooler_output, **TOL[dtype])
    assert not actual.last_hidden_state[~real].any()
