"""BertForSequenceClassification: outputs and losses as transformers computes them, loading
base and HF classifier checkpoints, saving back to transformers, the learning-rate
schedules against transformers' get_scheduler, and the training-loss curve of the
production optimiser/schedule/step against transformers' model trained as its Trainer
does, for every schedule and problem type."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import EXACT, TINY, TOL, hf_model, random_batch

from bert_port import BertConfig, BertModel
from bert_port.checkpoint import TOKENIZER_FILES
from bert_port.classifier import BertForSequenceClassification
from bert_port.data import TextDataset, builtin_splits, label_names
from bert_port.problem import ProblemType
from bert_port.reference import hf_twin
from bert_port.tokenization import load_tokenizer
from bert_port.training import (
    SCHEDULERS,
    Collator,
    FinetuneConfig,
    build_optimizer,
    build_scheduler,
    param_groups,
    train_step,
)

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


def _lrs(scheduler, optimizer, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("kind", SCHEDULERS)
@pytest.mark.parametrize("warmup", [0, 1, 4])
def test_schedules_equal_transformers_get_scheduler(kind, warmup):
    import transformers

    runs = []
    for build in (
        lambda opt: build_scheduler(opt, warmup_steps=warmup, total_steps=10, kind=kind),
        lambda opt: transformers.get_scheduler(kind, opt, num_warmup_steps=warmup, num_training_steps=10),
    ):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        runs.append(_lrs(build(optimizer), optimizer, 12))  # 2 past the end: stays at its last value
    print(f"{kind}, warmup {warmup}: {[round(x, 4) for x in runs[0]]}")
    assert runs[0] == runs[1]
    if kind != "constant" and warmup:
        assert runs[0][0] == 0.0 and runs[0][warmup] == 1.0  # warmup from 0 to the peak, as transformers


# The bar for the loss curve; the differences measured (printed by the test) are float rounding.
LOSS_CURVE_ATOL = 1e-4


def _curve_data(problem_type: str):
    """120 real examples of each problem type: SMS spam (single-label), MR sentences with
    their mean rating in [-4, 4] (regression), and SMS messages tagged with spam / has-digits
    / long (multi-label, from the text itself)."""
    if problem_type == "regression":
        train = builtin_splits("mr_scores")["train"].subset(range(160))
        return train, ["score"]
    train = builtin_splits("sms")["train"].subset(range(160))
    if problem_type == "single_label_classification":
        return train, label_names(train.labels)
    tags = [
        "|".join(
            t for t, on in (("digits", any(c.isdigit() for c in x)), ("long", len(x) > 60), ("spam", y == "spam")) if on
        )
        for x, y in zip(train.texts, train.labels)
    ]
    return TextDataset(texts=train.texts, labels=tags), ["digits", "long", "spam"]


def _hf_trainer_curve(model, batches: list[dict], settings: FinetuneConfig, kind: str, warmup: int) -> list[float]:
    """What transformers' Trainer does for one step, written out: the model's own loss,
    torch AdamW with no decay on biases and LayerNorm, `get_scheduler`, clipping at 1.0."""
    import transformers

    no_decay = lambda name: "bias" in name or "LayerNorm" in name
    params = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in params if not no_decay(n)], "weight_decay": settings.weight_decay},
        {"params": [p for n, p in params if no_decay(n)], "weight_decay": 0.0},
    ]
    betas = (settings.adam_beta1, settings.adam_beta2)
    optimizer = torch.optim.AdamW(groups, lr=settings.lr, betas=betas, eps=settings.adam_eps)
    scheduler = transformers.get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=len(batches))
    losses = []
    for batch in batches:
        loss = model(**{k: v for k, v in batch.items() if k != "index"}).loss
        losses.append(loss.item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return losses


# Every schedule (on single-label) and every problem type; the schedules' factors themselves
# are checked against get_scheduler above, for every kind.
CURVE_CASES = [("single_label_classification", kind) for kind in SCHEDULERS] + [
    ("regression", "linear"),
    ("multi_label_classification", "cosine"),
]


@pytest.mark.parametrize("problem_type, kind", CURVE_CASES)
def test_loss_curve_matches_transformers_over_20_steps(minilm_path, problem_type, kind):
    """Same initial weights (head included), dropout off, the same 20 batches of real text:
    ours through the production optimiser, schedule and step; transformers'
    BertForSequenceClassification through its own loss, torch's AdamW and transformers'
    get_scheduler. Per-step loss and final weights agree, for every schedule and problem type."""

    train, names = _curve_data(problem_type)
    config = {**TINY, "vocab_size": 30522, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    torch.manual_seed(0)
    ours = BertForSequenceClassification(
        BertConfig.from_dict(config, id2label=dict(enumerate(names)), problem_type=problem_type)
    )
    ref = hf_twin(ours, "sdpa")
    ours.train(), ref.train()
    initial = {k: v.clone() for k, v in ours.hf_state_dict().items()}
    targets = ProblemType(problem_type).targets(train, names)
    collate = Collator(load_tokenizer(minilm_path), train, max_length=32, targets=targets)
    batches = [collate(range(8 * step, 8 * step + 8)) for step in range(20)]
    settings = FinetuneConfig(train="unused", lr=2e-3, weight_decay=0.01)
    optimizer = build_optimizer(ours, settings)
    scheduler = build_scheduler(optimizer, warmup_steps=2, total_steps=20, kind=kind)
    losses = []
    for batch in batches:
        loss_sum, _ = train_step(ours, optimizer, scheduler, [batch], [torch.ones(8)], 8, problem_type=problem_type)
        losses.append(float(loss_sum) / 8)
    actual = torch.tensor(losses, dtype=torch.float64)
    expected = torch.tensor(_hf_trainer_curve(ref, batches, settings, kind, warmup=2), dtype=torch.float64)
    diff = (actual - expected).abs()
    print(
        f"{problem_type}, {kind}: loss-curve |diff| over 20 steps max {diff.max():.3e}; "
        f"loss {actual[0]:.4f} -> {actual[-1]:.4f}"
    )
    assert ref.config.problem_type == problem_type and ref.config.num_labels == len(names)
    assert diff.max() <= LOSS_CURVE_ATOL
    assert actual[-5:].mean() < actual[:5].mean()  # it did learn something
    # Adam moves every weight by up to lr per step whatever the size of its gradient, so float
    # rounding in a near-zero gradient shows at the scale of one step: the final weights agree
    # to 1% of the largest distance any weight travelled in the 20 steps.
    final, expected_weights = ours.hf_state_dict(), ref.state_dict()
    travelled = max(float((final[k] - initial[k]).abs().max()) for k in final)
    gap = max(float((final[k] - expected_weights[k]).abs().max()) for k in final)
    print(f"final weights: |ours - transformers| max {gap:.2e}, largest distance travelled {travelled:.2e}")
    assert gap <= 0.01 * travelled


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
