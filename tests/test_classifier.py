"""BertForSequenceClassification: outputs and losses as transformers computes them, loading
base and HF classifier checkpoints, saving back to transformers, and the training-loss
curve of the production optimiser/schedule/step against transformers' model."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import EXACT, TINY, TOL, hf_model, random_batch

from bert_port import BertConfig, BertModel
from bert_port.checkpoint import TOKENIZER_FILES
from bert_port.classifier import BertForSequenceClassification
from bert_port.data import Collator, builtin_splits, label_names
from bert_port.tokenization import load_tokenizer
from bert_port.training import FinetuneConfig, build_optimizer, build_scheduler, param_groups, to_hf_model, train_step

LABELS = {"id2label": {0: "negative", 1: "neutral", 2: "positive"}}


def _pair(config: dict):
    """transformers' classifier with random weights, and ours loaded from its state dict."""
    hf = hf_model(config, "BertForSequenceClassification")
    ours = BertForSequenceClassification(BertConfig.from_dict(config))
    ours.load_hf_state_dict(hf.state_dict())
    return hf.eval(), ours.eval()


@pytest.mark.parametrize(
    "num_labels, labels, problem_type",
    [
        (3, torch.tensor([0, 2, 1]), "single_label_classification"),
        (1, torch.tensor([0.5, -1.0, 2.0]), "regression"),
        (3, torch.tensor([[0.1, 1.0, -0.5], [1.0, 0.0, 0.0], [0.0, 2.0, 1.0]]), "regression"),
        (3, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]), "multi_label_classification"),
        (3, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]), None),  # inferred: multi-label
        (1, torch.tensor([0.5, -1.0, 2.0]), None),  # inferred: regression
        (3, torch.tensor([2, 0, 0]), None),  # inferred: single-label
    ],
)
def test_logits_and_loss_match_transformers(tiny_config, num_labels, labels, problem_type):
    config = {**tiny_config, "num_labels": num_labels, "problem_type": problem_type}
    hf, ours = _pair(config)
    batch = random_batch(tiny_config["vocab_size"])
    with torch.no_grad():
        expected, actual = hf(**batch, labels=labels), ours(**batch, labels=labels)
    torch.testing.assert_close(actual.logits, expected.logits, **TOL[torch.float32])
    torch.testing.assert_close(actual.loss, expected.loss, **TOL[torch.float32])
    assert ours.config.problem_type == hf.config.problem_type  # both decide (and remember) it the same way
    assert actual.logits.shape == (3, num_labels)


def test_ignored_labels_leave_the_loss_as_in_transformers(tiny_config):
    hf, ours = _pair({**tiny_config, "num_labels": 3})
    batch, labels = random_batch(tiny_config["vocab_size"]), torch.tensor([2, -100, 0])
    with torch.no_grad():
        actual, expected = ours(**batch, labels=labels).loss, hf(**batch, labels=labels).loss
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])


def test_classifier_dropout_falls_back_to_hidden_dropout(tiny_config):
    model = BertForSequenceClassification(BertConfig.from_dict(tiny_config))
    assert model.dropout.p == tiny_config["hidden_dropout_prob"]
    model = BertForSequenceClassification(BertConfig.from_dict({**tiny_config, "classifier_dropout": 0.3}))
    assert model.dropout.p == 0.3


def test_base_checkpoint_initialises_exactly_the_head(minilm_path, caplog):
    with caplog.at_level(logging.WARNING, logger="bert_port"):
        model = BertForSequenceClassification.from_pretrained(minilm_path, **LABELS)
    assert "newly initialised (not in the checkpoint): classifier.weight, classifier.bias" in caplog.text
    assert model.loading_info["newly_initialized"] == ["classifier.weight", "classifier.bias"]
    assert model.classifier.weight.shape == (3, 384)
    assert model.classifier.bias.abs().max() == 0 and 0.01 < model.classifier.weight.std() < 0.03  # HF's N(0, 0.02)
    encoder = BertModel.from_pretrained(minilm_path)
    for name, tensor in encoder.state_dict().items():
        assert torch.equal(model.bert.state_dict()[name], tensor), name


def test_hf_classifier_checkpoint_maps_every_key(tmp_path, tiny_config, caplog):
    hf = hf_model({**tiny_config, **LABELS}, "BertForSequenceClassification")
    hf.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="bert_port"):
        ours = BertForSequenceClassification.from_pretrained(tmp_path)
    assert ours.loading_info["newly_initialized"] == [] and "newly initialised" not in caplog.text
    assert ours.config.id2label == LABELS["id2label"]
    batch = random_batch(tiny_config["vocab_size"])
    with torch.no_grad():
        torch.testing.assert_close(ours(**batch).logits, hf(**batch).logits, **TOL[torch.float32])


def test_save_pretrained_loads_in_transformers(tmp_path, minilm_path):
    import transformers

    ours = BertForSequenceClassification.from_pretrained(minilm_path, **LABELS)
    ours.save_pretrained(tmp_path)
    ref, info = transformers.BertForSequenceClassification.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]
    assert config["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}
    assert config["label2id"] == {"negative": 0, "neutral": 1, "positive": 2}
    assert ref.config.id2label == LABELS["id2label"]
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json"):
        assert name in TOKENIZER_FILES and (tmp_path / name).is_file(), name
    batch = random_batch(30522, B=2, T=12)
    with torch.no_grad():
        torch.testing.assert_close(ours(**batch).logits, ref.eval()(**batch).logits, **TOL[torch.float32])


def test_no_weight_decay_on_biases_and_layernorm(tiny_config):
    model = BertForSequenceClassification(BertConfig.from_dict(tiny_config))
    decay, no_decay = param_groups(model, 0.01)
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert "bert.embed_layer_norm.weight" in no_decay["names"] and "classifier.bias" in no_decay["names"]
    assert "bert.bert_layers.1.out_layer_norm.weight" in no_decay["names"]
    assert "classifier.weight" in decay["names"] and "bert.word_embedding.weight" in decay["names"]
    assert all(n.endswith("bias") or "layer_norm" in n for n in no_decay["names"])
    assert all(not n.endswith("bias") and "layer_norm" not in n for n in decay["names"])
    assert len(decay["names"]) + len(no_decay["names"]) == len(list(model.parameters()))
    for param in model.bert.parameters():  # frozen parameters are left out
        param.requires_grad_(False)
    assert sum(len(g["names"]) for g in param_groups(model, 0.01)) == 2


def test_schedule_is_linear_warmup_then_linear_decay():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1.0)
    scheduler = build_scheduler(optimizer, warmup_steps=4, total_steps=10)
    lrs = []
    for _ in range(10):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [(s + 1) / 4 for s in range(4)] + [(10 - s) / 6 for s in range(4, 10)]
    torch.testing.assert_close(torch.tensor(lrs), torch.tensor(expected), atol=1e-12, rtol=0)


# The bar for the loss curve; measured differences are ~1e-7 (float rounding only).
LOSS_CURVE_ATOL = 1e-4


def test_loss_curve_matches_transformers_over_20_steps(minilm_path):
    """Same initial weights (head included), dropout off, the same 20 batches of real SMS
    messages through the production optimiser, schedule and step: per-step loss and final
    weights of ours and transformers' BertForSequenceClassification agree."""
    import transformers

    splits = builtin_splits("sms")
    names = label_names(splits["train"].labels)
    config = {**TINY, "vocab_size": 30522, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    torch.manual_seed(0)
    ours = BertForSequenceClassification(
        BertConfig.from_dict(config, id2label=dict(enumerate(names)), problem_type="single_label_classification")
    )
    ref = to_hf_model(ours, transformers)
    ours.train(), ref.train()
    collate = Collator(load_tokenizer(minilm_path), splits["train"], max_length=32, names=names)
    settings = FinetuneConfig(train="unused", lr=2e-3, weight_decay=0.01)
    runs = {}
    for name, model in (("ours", ours), ("hf", ref)):
        optimizer = build_optimizer(model, settings)
        scheduler = build_scheduler(optimizer, warmup_steps=2, total_steps=20)
        losses = []
        for step in range(20):
            batch = collate(range(8 * step, 8 * step + 8))
            loss_sum, _ = train_step(model, optimizer, scheduler, [batch], [torch.ones(8)], 8)
            losses.append(float(loss_sum) / 8)
        runs[name] = torch.tensor(losses, dtype=torch.float64)
    diff = (runs["ours"] - runs["hf"]).abs()
    print(
        f"loss-curve |diff| over 20 steps: max {diff.max():.3e}, mean {diff.mean():.3e}; "
        f"loss {runs['ours'][0]:.4f} -> {runs['ours'][-1]:.4f}"
    )
    assert diff.max() <= LOSS_CURVE_ATOL
    assert runs["ours"][-5:].mean() < runs["ours"][:5].mean() - 0.05  # it did learn something
    expected = ref.state_dict()
    for key, tensor in ours.hf_state_dict().items():
        torch.testing.assert_close(tensor, expected[key], atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


def test_base_model_loads_a_fine_tuned_checkpoint_and_reports_the_head(tmp_path, tiny_config, caplog):
    """As transformers does: a BertModel built from a BertForSequenceClassification
    checkpoint ignores (and names) the classifier keys, and equals the classifier's encoder."""
    hf = hf_model(dict(tiny_config, num_labels=3), "BertForSequenceClassification")
    hf.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="bert_port"):
        ours = BertModel.from_pretrained(tmp_path, **EXACT)
    assert "classifier.weight" in caplog.text and "classifier.bias" in caplog.text
    batch = random_batch(tiny_config["vocab_size"])
    with torch.no_grad():
        expected = hf.bert(**batch).last_hidden_state
        actual = ours(**batch).last_hidden_state
    assert torch.equal(actual, expected)
