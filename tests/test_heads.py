"""Task heads against transformers' own, computed in the same run: BertForMaskedLM (decoder
tied to the word embeddings), BertForPreTraining, BertForTokenClassification,
BertForQuestionAnswering. Each loads transformers' checkpoints through the production loader
(tiny random models, and the bert-base-uncased layout with its `cls.*` heads), matches its
outputs bitwise in exact mode and within the tolerance policy otherwise, and saves files
transformers loads with nothing missing or unexpected."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import EXACT, TINY, TOL, hf_model, random_batch

from bert_port import BertConfig, BertModel, CheckpointError, checkpoint
from bert_port.heads import BertForMaskedLM, BertForPreTraining, BertForQuestionAnswering, BertForTokenClassification

HEADS = {
    "BertForMaskedLM": (BertForMaskedLM, {}),
    "BertForPreTraining": (BertForPreTraining, {}),
    "BertForTokenClassification": (BertForTokenClassification, {"num_labels": 5}),
    "BertForQuestionAnswering": (BertForQuestionAnswering, {}),
}


def _reference(name: str, config: dict):
    """transformers' model with every parameter random (its init leaves biases at zero)."""
    hf = hf_model(config, name)
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return hf


def _labels(name: str, batch: dict, vocab_size: int) -> dict:
    B, T = batch["input_ids"].shape
    g = torch.Generator().manual_seed(1)
    if name == "BertForQuestionAnswering":
        return {"start_positions": torch.tensor([1, 3, 99]), "end_positions": torch.tensor([2, 5, 0])}
    classes = vocab_size if name in ("BertForMaskedLM", "BertForPreTraining") else 5
    labels = torch.randint(0, classes, (B, T), generator=g).masked_fill(batch["attention_mask"] == 0, -100)
    labels[:, 0] = -100
    out = {"labels": labels}
    if name == "BertForPreTraining":
        out["next_sentence_label"] = torch.tensor([0, 1, 1])
    return out


def assert_outputs_equal(actual, expected, mask=None, exact=True):
    """Every output transformers gives (loss and logits), bitwise or within fp32 tolerance;
    token-level outputs on real tokens only when `mask` is given (the default port leaves pad
    positions at zero)."""
    assert len(actual) == len(expected)
    for ours, ref in zip(actual, expected):
        if mask is not None and ours.dim() >= 2 and ours.shape[:2] == mask.shape:
            ours, ref = ours[mask], ref[mask]
        if exact:
            assert torch.equal(ours, ref)
        else:
            torch.testing.assert_close(ours, ref, **TOL[torch.float32])


@pytest.mark.parametrize("name", list(HEADS))
def test_head_loads_transformers_checkpoint_and_matches(tmp_path, name):
    cls, extra = HEADS[name]
    config = dict(TINY, **extra)
    hf = _reference(name, config)
    hf.save_pretrained(tmp_path / "hf")
    batch = random_batch(TINY["vocab_size"])
    labels = _labels(name, batch, TINY["vocab_size"])
    with torch.no_grad():
        expected = hf(**batch, **labels, return_dict=False)

    exact = cls.from_pretrained(tmp_path / "hf", **EXACT)
    assert exact.loading_info["newly_initialized"] == [] and exact.loading_info["dropped"] == []
    with torch.no_grad():
        assert_outputs_equal(exact(**batch, **labels, return_dict=False), expected)
        as_dict = exact(**batch, **labels)
    assert torch.equal(as_dict[1], expected[1]) and as_dict.loss is not None

    default = cls.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        actual = default(**batch, return_dict=False)
        reference = hf(**batch, return_dict=False)
    assert_outputs_equal(actual, reference, mask=batch["attention_mask"].bool(), exact=False)

    # Saved by the port, read by transformers with nothing missing, unexpected or mismatched.
    exact.save_pretrained(tmp_path / "ours")
    back, info = type(hf).from_pretrained(str(tmp_path / "ours"), output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    back.set_attn_implementation("eager")
    with torch.no_grad():
        assert_outputs_equal(back.eval()(**batch, **labels, return_dict=False), expected)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["architectures"] == [name]


def test_masked_lm_decoder_is_tied_to_the_word_embeddings(tmp_path):
    model = BertForMaskedLM(BertConfig.from_dict(TINY))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.cls.predictions.decoder.bias is model.cls.predictions.bias
    assert torch.equal(model.cls.predictions.bias, torch.zeros(TINY["vocab_size"]))
    # Written once, under the embedding's name, as transformers writes it.
    keys = set(model.hf_state_dict())
    assert "cls.predictions.decoder.weight" not in keys and "cls.predictions.bias" in keys
    # A training step moves both together.
    batch = random_batch(TINY["vocab_size"])
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()(**batch, labels=labels).loss.backward()
    optimizer.step()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.save_pretrained(tmp_path)
    loaded = BertForMaskedLM.from_pretrained(tmp_path)
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    assert torch.equal(loaded.get_output_embeddings().weight, model.get_input_embeddings().weight)


def test_untied_decoder_in_a_checkpoint_is_refused(tmp_path):
    from safetensors.torch import save_file

    hf = _reference("BertForMaskedLM", TINY)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    state["cls.predictions.decoder.weight"] += 1.0
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(CheckpointError, match=r"cls\.predictions\.decoder\.weight differs from"):
        BertForMaskedLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["BertForMaskedLM", "BertForPreTraining"])
def test_output_bias_stored_only_as_the_decoder_bias_loads(tmp_path, name):
    """A file with the tied copy `cls.predictions.decoder.bias` but not `cls.predictions.bias`:
    the bias is read from the copy, as transformers reads it (not left at zero)."""
    import transformers
    from safetensors.torch import save_file

    hf = _reference(name, TINY)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    del state["cls.predictions.bias"], state["cls.predictions.decoder.weight"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY, architectures=[name])))
    reference = getattr(transformers, name).from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    ours = HEADS[name][0].from_pretrained(tmp_path, **EXACT)
    assert ours.loading_info["newly_initialized"] == []
    assert torch.equal(ours.cls.predictions.bias, reference.cls.predictions.bias)
    assert ours.cls.predictions.decoder.bias is ours.cls.predictions.bias
    batch = random_batch(TINY["vocab_size"])
    with torch.no_grad():
        assert torch.equal(ours(**batch)[0], reference(**batch)[0])


def test_bert_base_layout_heads_load_into_each_model(bert_base_layout):
    """The bert-base-uncased layout: `bert.` prefixes, LayerNorm.gamma/beta, `cls.*` heads and
    the decoder written beside the embedding. transformers reads the same file as reference."""
    import transformers

    root, _ = bert_base_layout
    batch = random_batch(30522, T=7)
    reference = transformers.BertForPreTraining.from_pretrained(
        str(root / "safetensors"), attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        expected = reference(**batch)

    for fmt in ("safetensors", "bin"):
        pretraining = BertForPreTraining.from_pretrained(root / fmt, **EXACT)
        assert sorted(pretraining.loading_info["tied"]) == [
            "cls.predictions.decoder.bias",
            "cls.predictions.decoder.weight",
        ]
        with torch.no_grad():
            actual = pretraining(**batch)
        assert torch.equal(actual.prediction_logits, expected.prediction_logits)
        assert torch.equal(actual.seq_relationship_logits, expected.seq_relationship_logits)

    mlm = BertForMaskedLM.from_pretrained(root / "safetensors", **EXACT)
    assert sorted(mlm.loading_info["dropped"]) == ["cls.seq_relationship.bias", "cls.seq_relationship.weight"]
    assert sorted(mlm.loading_info["unused"]) == ["bert.pooler_dense.bias", "bert.pooler_dense.weight"]  # no pooler
    with torch.no_grad():
        assert torch.equal(mlm(**batch).logits, expected.prediction_logits)

    # The encoder alone still drops and reports every head tensor.
    encoder = BertModel.from_pretrained(root / "safetensors")
    assert {k.rsplit(".", 1)[0] for k in encoder.loading_info["dropped"]} >= {
        "cls.predictions.transform.dense",
        "cls.seq_relationship",
    }


def test_checkpoint_without_the_head_initialises_it_and_says_so(minilm_path, caplog):
    """all-MiniLM-L6-v2 has no MLM head: it is initialised as transformers does (bias zero)."""
    with caplog.at_level(logging.WARNING):
        model = BertForMaskedLM.from_pretrained(minilm_path)
    assert "cls.predictions.transform.dense.weight" in model.loading_info["newly_initialized"]
    assert "newly initialised" in caplog.text
    assert torch.equal(model.cls.predictions.bias, torch.zeros_like(model.cls.predictions.bias))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.cls.predictions.transform.dense.weight.std() > 0
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("cls_name", ["BertModel", "BertForSequenceClassification", "BertForPreTraining"])
def test_checkpoint_without_a_pooler_loads_with_the_pooler_initialised(tmp_path, caplog, cls_name):
    """A BertForMaskedLM save has no pooler; a model with one initialises it and says so, as
    transformers does for the same file (its missing keys are ours, in HF names), and the rest
    of the model computes what transformers' does."""
    import transformers

    import bert_port

    _reference("BertForMaskedLM", TINY).save_pretrained(tmp_path)
    hf, info = getattr(transformers, cls_name).from_pretrained(
        str(tmp_path), output_loading_info=True, attn_implementation="eager"
    )
    with caplog.at_level(logging.WARNING):
        ours = getattr(bert_port, cls_name).from_pretrained(tmp_path, **EXACT)
    new = ours.loading_info["newly_initialized"]
    encoder = ours.encoder
    in_hf_names = checkpoint.port_to_hf(
        {k.removeprefix(ours.port_encoder_prefix): None for k in new}, encoder_prefix=ours.hf_encoder_prefix
    )
    assert set(in_hf_names) == set(info["missing_keys"])
    assert {"pooler_dense.weight", "pooler_dense.bias"} <= {k.removeprefix("bert.") for k in new}
    assert "newly initialised" in caplog.text and "pooler_dense" in caplog.text
    assert not any(p.is_meta for p in ours.parameters())
    assert encoder.pooler_dense.weight.std() > 0 and torch.equal(
        encoder.pooler_dense.bias.abs().sum(), torch.tensor(0.0)
    )
    batch = random_batch(TINY["vocab_size"])
    with torch.no_grad():
        expected = (hf.bert if cls_name != "BertModel" else hf).eval()(**batch).last_hidden_state
        assert torch.equal(encoder(**batch).last_hidden_state, expected)


def test_a_pooler_half_in_the_file_keeps_the_half_it_has(tmp_path):
    """Only the missing tensor is initialised: the pooler weight in the file stays as read."""
    from safetensors.torch import save_file

    hf = _reference("BertModel", TINY)
    state = {k: v.clone() for k, v in hf.state_dict().items() if k != "pooler.dense.bias"}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    ours = BertModel.from_pretrained(tmp_path)
    assert ours.loading_info["newly_initialized"] == ["pooler_dense.bias"]
    assert torch.equal(ours.pooler_dense.weight, hf.pooler.dense.weight)
    assert torch.equal(ours.pooler_dense.bias, torch.zeros_like(ours.pooler_dense.bias))


def test_heads_keep_their_names_in_the_key_table():
    """hf_to_port keeps a head's keys for a model that owns it and drops `cls.*` otherwise."""
    state = {"cls.predictions.bias": torch.zeros(3), "cls.seq_relationship.weight": torch.zeros(2, 3)}
    kept = checkpoint.hf_to_port(state, keep_heads=BertForMaskedLM.hf_head_prefixes)
    assert list(kept.state_dict) == ["cls.predictions.bias"] and kept.dropped == ["cls.seq_relationship.weight"]
    assert checkpoint.hf_to_port(state).dropped == list(state)


def test_real_bert_base_uncased_fill_mask_if_cached():
    """With the real bert-base-uncased in the local HF cache, fill-mask predicts what
    transformers predicts (skipped where it is not cached: no network here)."""
    import transformers

    from bert_port import encode, load_tokenizer

    try:
        path = checkpoint.find_in_hf_cache("bert-base-uncased")
    except CheckpointError:
        pytest.skip("bert-base-uncased is not in the local HF cache")
    model = BertForMaskedLM.from_pretrained("bert-base-uncased")
    batch = encode(load_tokenizer(model.source_dir), "The capital of France is [MASK].")
    reference = transformers.BertForMaskedLM.from_pretrained(str(path)).eval()
    with torch.no_grad():
        ours, ref = model(**batch).logits, reference(**batch).logits
    position = batch["input_ids"][0].tolist().index(103)
    assert ours[0, position].argmax() == ref[0, position].argmax()
    torch.testing.assert_close(ours, ref, **TOL[torch.float32])
