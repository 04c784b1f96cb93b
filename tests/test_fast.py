"""fast.py: the unpadded encoder and the fused QKV projection compute what the padded port
and transformers compute (tiny config and the real all-MiniLM-L6-v2), gradients flow
through them, and bad input is refused clearly. No timing here: see scripts/benchmark.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REAL_SENTENCES, TOL, hf_model, random_batch

from bert_port import BertConfig, BertModel, encode, fast, load_tokenizer

KINDS = [k for k in fast.ATTENTION_KINDS if k != "nested"]  # nested: prototype API, tested alone below


def _port_from_hf(hf, config: dict) -> BertModel:
    model = BertModel(BertConfig.from_dict(config))
    model.load_hf_state_dict(hf.state_dict())
    return model.eval()


def _fast_hidden(model: BertModel, batch: dict, **kwargs) -> torch.Tensor:
    hidden = model.embed(batch["input_ids"], batch.get("token_type_ids"))
    return fast.encode_unpadded(model.bert_layers, hidden, batch.get("attention_mask"), **kwargs)[0]


def _holes_batch(vocab_size: int) -> dict:
    """Position 0 real everywhere, padding in the middle of a row as well as at the end."""
    batch = random_batch(vocab_size, B=3, T=9)
    batch["attention_mask"][1, 3:5] = 0
    return batch


# -- packing ------------------------------------------------------------------------------


def test_pack_indexes_real_tokens_and_round_trips():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    packing = fast.pack(mask)
    assert packing.seqlens == (3, 1, 4) and packing.num_tokens == 8
    assert packing.cu_seqlens.tolist() == [0, 3, 4, 8]
    assert packing.indices.tolist() == [0, 1, 2, 4, 8, 9, 10, 11]
    assert packing.right_padded
    x = torch.randn(3, 4, 5)
    packed = fast.unpad(x, packing)
    assert packed.shape == (8, 5)
    torch.testing.assert_close(fast.pad(packed, packing), x * mask[..., None], atol=0, rtol=0)


def test_pack_without_padding_is_a_reshape():
    x = torch.randn(2, 3, 4)
    for packing in (fast.pack(None, 2, 3), fast.pack(torch.ones(2, 3))):
        assert packing.indices is None and packing.key_mask is None and packing.seqlens == (3, 3)
        assert fast.unpad(x, packing).data_ptr() == x.data_ptr()
        torch.testing.assert_close(fast.pad(fast.unpad(x, packing), packing), x, atol=0, rtol=0)


def test_pack_notices_holes():
    assert not fast.pack(torch.tensor([[1, 0, 1], [1, 1, 0]])).right_padded


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: fast.pack(torch.ones(2, 3, 3)), r"needs a \(batch, seq_len\) padding mask, got shape \(2, 3, 3\)"),
        (lambda: fast.pack(None), "pack\\(None\\) needs batch_size and seq_len"),
        (lambda: fast.varlen_attention(torch.zeros(4, 12), fast.pack(torch.ones(1, 4)), 2, 1.0, kind="flash"),
         "unknown attention kind 'flash'; use one of padded_sdpa"),
    ],
    ids=["3d-mask", "no-sizes", "unknown-kind"],
)  # fmt: skip
def test_bad_input_is_refused_clearly(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_can_use_fast_path():
    right = torch.tensor([[1, 1, 0], [1, 1, 1]])
    left = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert fast.can_use_fast_path(None) and fast.can_use_fast_path(right)
    assert not fast.can_use_fast_path(left)  # the pooler reads position 0, padding or not
    assert not fast.can_use_fast_path(torch.ones(2, 3, 3))
    assert not fast.can_use_fast_path(right, is_decoder=True)
    assert not fast.can_use_fast_path(right, output_attentions=True)


# -- parity -------------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False], ids=["fused-qkv", "separate-qkv"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("holes", [False, True], ids=["right-padded", "holes"])
def test_tiny_unpadded_matches_padded_and_transformers(tiny_config, kind, fused, holes):
    hf = hf_model(tiny_config, attn="sdpa")
    ours = _port_from_hf(hf, tiny_config)
    batch = _holes_batch(tiny_config["vocab_size"]) if holes else random_batch(tiny_config["vocab_size"])
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = hf(**batch).last_hidden_state
        padded = ours(**batch).last_hidden_state
        actual = _fast_hidden(ours, batch, attention=kind, fused_qkv=fused)
    torch.testing.assert_close(actual[real], expected[real], **TOL[torch.float32])
    torch.testing.assert_close(actual[real], padded[real], **TOL[torch.float32])
    assert not actual[~real].any(), "padding positions of the unpadded path are zeros"


def test_tiny_without_mask_matches_transformers(tiny_config):
    hf = hf_model(tiny_config, attn="sdpa")
    ours = _port_from_hf(hf, tiny_config)
    ids = random_batch(tiny_config["vocab_size"])["input_ids"]
    with torch.no_grad():
        actual = _fast_hidden(ours, {"input_ids": ids})
        torch.testing.assert_close(actual, hf(ids).last_hidden_state, **TOL[torch.float32])


@pytest.mark.filterwarnings("ignore:.*nested tensors is in prototype stage")
def test_tiny_nested_attention(tiny_config):
    hf = hf_model(tiny_config, attn="sdpa")
    ours = _port_from_hf(hf, tiny_config)
    batch = random_batch(tiny_config["vocab_size"])
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        actual = _fast_hidden(ours, batch, attention="nested")
        torch.testing.assert_close(actual[real], hf(**batch).last_hidden_state[real], **TOL[torch.float32])


def test_tiny_hidden_states_match_transformers(tiny_config):
    hf = hf_model(tiny_config, attn="sdpa")
    ours = _port_from_hf(hf, tiny_config)
    batch = random_batch(tiny_config["vocab_size"])
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = hf(**batch, output_hidden_states=True).hidden_states
        hidden = ours.embed(batch["input_ids"], batch["token_type_ids"])
        _, actual = fast.encode_unpadded(ours.bert_layers, hidden, batch["attention_mask"], output_hidden_states=True)
    assert len(actual) == len(expected) == tiny_config["num_hidden_layers"] + 1
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a[real], e[real], **TOL[torch.float32])


@pytest.mark.parametrize("kind", ["padded_sdpa", "per_sequence"])
def test_minilm_unpadded_parity(minilm_path, kind):
    """The real checkpoint on real sentences: within the fp32 tolerance policy on real tokens."""
    import transformers

    ours = BertModel.from_pretrained(minilm_path)
    ref = transformers.BertModel.from_pretrained(str(minilm_path), attn_implementation="sdpa").eval()
    batch = encode(load_tokenizer(minilm_path), REAL_SENTENCES)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = ref(**batch).last_hidden_state
        padded = ours(**batch).last_hidden_state
        actual = _fast_hidden(ours, batch, attention=kind)
    diff = (actual - expected).abs()[real].max().item()
    print(f"all-MiniLM-L6-v2 unpadded ({kind}) real-token max abs diff: {diff:.3e}")
    torch.testing.assert_close(actual[real], expected[real], **TOL[torch.float32])
    torch.testing.assert_close(actual[real], padded[real], **TOL[torch.float32])


def test_bf16_autocast_stays_within_transformers_own_bf16_error(tiny_config):
    """Under CPU bf16 autocast the fast path is no further from fp32 transformers than
    transformers' own bf16 autocast is (with slack for a different rounding pattern)."""
    hf = hf_model(tiny_config, attn="sdpa")
    ours = _port_from_hf(hf, tiny_config)
    batch = random_batch(tiny_config["vocab_size"])
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        exact = hf(**batch).last_hidden_state
        with fast.autocast("cpu"):
            hf_bf16 = hf(**batch).last_hidden_state.float()
            ours_bf16 = _fast_hidden(ours, batch).float()
    hf_err = (hf_bf16 - exact).abs()[real].max().item()
    ours_err = (ours_bf16 - exact).abs()[real].max().item()
    assert 0 < hf_err < 0.1, "autocast changed nothing: the test would prove nothing"
    assert ours_err <= 2 * hf_err


# -- fused QKV ----------------------------------------------------------------------------


def test_fused_qkv_equals_separate_projections(tiny_config):
    attn = BertModel(BertConfig.from_dict(tiny_config)).eval().bert_layers[0].self_attention
    x = torch.randn(2, 5, tiny_config["hidden_size"])
    with torch.no_grad():
        expected = torch.cat([attn.query(x), attn.key(x), attn.value(x)], dim=-1)
        torch.testing.assert_close(fast.qkv_projection(attn, x), expected, **TOL[torch.float32])


def test_fused_qkv_follows_fused_optimizer_steps(tiny_config):
    """Regression: fused AdamW updates parameters in place without bumping their version
    counters, which once left a cached QKV weight stale for the next no-grad evaluation."""
    model = BertModel(BertConfig.from_dict(tiny_config)).eval()
    batch = random_batch(tiny_config["vocab_size"], B=3, T=9)
    reference = BertModel(BertConfig.from_dict(tiny_config, unpad_inputs=False)).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for _ in range(2):
        with torch.no_grad():
            model(**batch)  # an evaluation between steps
        model(**batch).last_hidden_state.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    reference.load_state_dict(model.state_dict())
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        actual, expected = model(**batch).last_hidden_state, reference(**batch).last_hidden_state
    torch.testing.assert_close(actual[real], expected[real], **TOL[torch.float32])


def test_fused_qkv_gradients_reach_the_three_linears(tiny_config):
    attn = BertModel(BertConfig.from_dict(tiny_config)).bert_layers[0].self_attention
    x = torch.randn(4, tiny_config["hidden_size"])
    params = [attn.query.weight, attn.key.weight, attn.value.weight, attn.query.bias, attn.key.bias, attn.value.bias]
    fast.qkv_projection(attn, x).square().sum().backward()
    fused = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    torch.cat([attn.query(x), attn.key(x), attn.value(x)], -1).square().sum().backward()
    for got, p in zip(fused, params):
        torch.testing.assert_close(got, p.grad, **TOL[torch.float32])


# -- gradients through the unpadded encoder ---------------------------------------------------


@pytest.mark.parametrize("kind", ["padded_sdpa", "per_sequence"])
def test_gradients_match_the_padded_path(tiny_config, kind):
    config = {**tiny_config, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    hf = hf_model(config)
    model = _port_from_hf(hf, config).train()
    batch = random_batch(config["vocab_size"])
    real = batch["attention_mask"].bool()
    target = torch.randn(*real.shape, config["hidden_size"])

    def grads(hidden):
        model.zero_grad(set_to_none=True)
        ((hidden - target)[real] ** 2).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    padded = grads(model(**batch).last_hidden_state)
    unpadded = grads(_fast_hidden(model, batch, attention=kind))
    assert "bert_layers.0.self_attention.query.weight" in unpadded
    assert padded.keys() - {"pooler_dense.weight", "pooler_dense.bias"} == unpadded.keys()
    for name, g in unpadded.items():
        torch.testing.assert_close(g, padded[name], atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_training_dropout_is_applied(tiny_config):
    """In training mode the fast path drops out (two calls differ), in eval it does not."""
    model = BertModel(BertConfig.from_dict(tiny_config)).train()
    batch = random_batch(tiny_config["vocab_size"])
    a, b = _fast_hidden(model, batch), _fast_hidden(model, batch)
    assert not torch.equal(a, b)
    model.eval()
    torch.testing.assert_close(_fast_hidden(model, batch), _fast_hidden(model, batch), atol=0, rtol=0)


@pytest.mark.slow
def test_compiled_layer_matches_eager(tiny_config):
    pytest.importorskip("torch._inductor")
    model = BertModel(BertConfig.from_dict(tiny_config)).eval()
    batch = random_batch(tiny_config["vocab_size"])
    compiled = fast.compile_layer_fn()
    with torch.no_grad():
        torch.testing.assert_close(
            _fast_hidden(model, batch, layer_fn=compiled), _fast_hidden(model, batch), **TOL[torch.float32]
        )


# -- the benchmark's pieces -------------------------------------------------------------------


def test_fast_and_bench_do_not_import_transformers():
    code = "import sys, bert_port.fast, bert_port.cli.bench; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_model_flops_counts_real_tokens(tiny_config):
    from bert_port.cli.bench import model_flops

    config = BertConfig.from_dict(tiny_config)
    H, inter, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    dense = 2 * (4 * H * H + 2 * H * inter)
    expected = L * (5 * dense + 4 * H * (9 + 4)) + 2 * 2 * H * H
    assert model_flops(config, mask) == expected
    assert model_flops(config, torch.ones(2, 4)) > expected


def test_mr_texts_are_read_as_utf8():
    from bert_port.cli.bench import read_mr_labelled, read_mr_texts

    texts = read_mr_texts()
    assert len(texts) == 10605
    assert texts[0].startswith("The Rock is destined")
    assert any("Almodóvar" in t for t in texts)
    labelled, labels = read_mr_labelled()
    assert labelled == texts and set(labels) == {0, 1}


def test_bench_refuses_unknown_section(capsys):
    from bert_port.cli.bench import main

    assert main(["--skip", "real,nope"]) == 2
    assert "unknown section(s) ['nope']" in capsys.readouterr().err


@pytest.mark.gpu
def test_varlen_attention_matches_padded_sdpa_on_cuda(tiny_config):
    model = BertModel(BertConfig.from_dict({**tiny_config, "hidden_size": 64})).eval().cuda()
    batch = {k: v.cuda() for k, v in random_batch(tiny_config["vocab_size"]).items()}
    real = batch["attention_mask"].bool()
    with torch.no_grad(), fast.autocast("cuda"):
        assert fast.default_attention_kind("cuda", torch.bfloat16, training=False) == "varlen"
        varlen = _fast_hidden(model, batch, attention="varlen").float()
        padded = _fast_hidden(model, batch, attention="padded_sdpa").float()
    torch.testing.assert_close(varlen[real], padded[real], **TOL[torch.bfloat16])
