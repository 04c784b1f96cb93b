"""Pair models end to end on real MR sentences: a cross-encoder-style scorer (one output)
fine-tuned on sentence pairs, then `bert-port-predict`, which reuses the run's text columns
and gives sentence-transformers' `CrossEncoder.predict` scores, raw and with sigmoid,
computed in the same run on the same saved model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TOL

from bert_port.cli.finetune import main as finetune_main
from bert_port.cli.predict import main as predict_main
from bert_port.data import load_mr


def sentiment_pairs(n: int, offset: int = 0) -> list[dict]:
    """`n` pairs of MR sentences scored by how alike their human ratings are: 1 - |a - b| / 8,
    in [0, 1] (ratings lie in [-4, 4]): a real-text pair regression, as an STS set is."""
    mr = load_mr(scores=True)
    texts, scores = mr.texts, [float(x) for x in mr.labels]
    out = []
    for i in range(offset, offset + n):
        a, b = 2 * i, 2 * i + 1
        out.append({"text": texts[a], "text_pair": texts[b], "label": 1 - abs(scores[a] - scores[b]) / 8})
    return out


def _jsonl(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def scorer(tmp_path_factory, minilm_path) -> Path:
    """The bundled MiniLM fine-tuned for one step as a one-output pair scorer: a real model,
    so its scores depend on the texts (a tiny random one scores every pair alike)."""
    tmp = tmp_path_factory.mktemp("pairs")
    train = _jsonl(sentiment_pairs(20), tmp / "train.jsonl")
    out = tmp / "run"
    argv = ["--checkpoint", str(minilm_path), "--train", str(train), "--text-pair-column", "text_pair"]
    argv += ["--problem-type", "regression", "--max-steps", "1", "--batch-size", "8", "--max-length", "64"]
    argv += ["--eval-batch-size", "32", "--output-dir", str(out)]
    assert finetune_main(argv) == 0
    return out


def _predict(model: Path, rows: list[dict], tmp: Path, *flags: str) -> list[float]:
    inp, out = _jsonl(rows, tmp / "in.jsonl"), tmp / "out.jsonl"
    assert predict_main(["--model", str(model), "--input", str(inp), "--output", str(out), *flags]) == 0
    return [json.loads(line)["predicted_value"] for line in out.read_text().splitlines()]


def _cross_encoder(model: Path):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(model), device="cpu", local_files_only=True, max_length=64)


def test_predict_gives_cross_encoder_scores_raw_and_sigmoid(scorer, tmp_path):
    """No column flags: predict reads the pair from the columns the run trained on, and its
    raw scores and their sigmoid equal CrossEncoder.predict's with Identity and Sigmoid."""
    rows = [{k: v for k, v in r.items() if k != "label"} for r in sentiment_pairs(12, offset=500)]
    pairs = [(r["text"], r["text_pair"]) for r in rows]
    ce = _cross_encoder(scorer)
    raw = torch.as_tensor(ce.predict(pairs, activation_fn=torch.nn.Identity(), batch_size=5))
    sig = torch.as_tensor(ce.predict(pairs, activation_fn=torch.nn.Sigmoid(), batch_size=5))
    # CrossEncoder here reads 64 tokens (the run's length); predict reads its limit unless told.
    ours_raw = torch.tensor(_predict(scorer, rows, tmp_path, "--max-length", "64"))
    ours_sig = torch.tensor(_predict(scorer, rows, tmp_path, "--activation", "sigmoid", "--max-length", "64"))
    torch.testing.assert_close(ours_raw, raw, **TOL[torch.float32])
    torch.testing.assert_close(ours_sig, sig, **TOL[torch.float32])
    # The pair counts: scoring the first texts alone gives other numbers.
    alone = torch.as_tensor(ce.model(**ce.tokenizer([a for a, _ in pairs], padding=True, return_tensors="pt")).logits)
    assert (alone.flatten() - ours_raw).abs().max() > 1e-3


def test_auto_follows_a_cross_encoder_checkpoints_activation(scorer, tmp_path):
    """A checkpoint CrossEncoder saved names its activation (Sigmoid for one output; in
    config_sentence_transformers.json from 6.x on); `--activation auto` applies it, as
    CrossEncoder.predict does by default."""
    saved = tmp_path / "ce"
    _cross_encoder(scorer).save_pretrained(str(saved))
    assert "Sigmoid" in json.loads((saved / "config_sentence_transformers.json").read_text())["activation_fn"]
    rows = [{k: v for k, v in r.items() if k != "label"} for r in sentiment_pairs(6, offset=600)]
    expected = torch.as_tensor(_cross_encoder(saved).predict([(r["text"], r["text_pair"]) for r in rows]))
    ours = _predict(saved, rows, tmp_path, "--text-pair-column", "text_pair", "--max-length", "64")
    torch.testing.assert_close(torch.tensor(ours), expected, **TOL[torch.float32])
    assert all(0 < x < 1 for x in ours)


def test_the_trained_pair_column_must_be_in_the_input(scorer, tmp_path, capsys):
    rows = [{"text": "a fine film"}]
    inp, out = _jsonl(rows, tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    assert predict_main(["--model", str(scorer), "--input", str(inp), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "text_pair" in err and "Traceback" not in err and not out.exists()


def test_activation_is_refused_for_a_classifier(tmp_path, minilm_path, capsys):
    from bert_port import BertForSequenceClassification

    BertForSequenceClassification.from_pretrained(minilm_path, num_labels=2).save_pretrained(tmp_path / "clf")
    inp = _jsonl([{"text": "a fine film"}], tmp_path / "in.jsonl")
    argv = ["--model", str(tmp_path / "clf"), "--input", str(inp), "--output", str(tmp_path / "o.jsonl")]
    assert predict_main([*argv, "--activation", "sigmoid"]) == 2
    err = capsys.readouterr().err
    assert "--activation sigmoid is for regression" in err and "Traceback" not in err


def test_long_pairs_read_to_the_model_limit_as_cross_encoder(scorer, tmp_path, capsys):
    """Pairs far longer than the run's max_length (64): predict reads up to the tokenizer's and
    model's limit (512) unless told otherwise, as CrossEncoder(folder).predict does by default;
    a pair past 512 tokens is cut there (longest first, as transformers), and the summary says so."""
    from sentence_transformers import CrossEncoder

    mr = load_mr(scores=True)
    context = " ".join(mr.texts[:10])  # ~250 tokens
    rows = [{"text": t, "text_pair": context} for t in mr.texts[20:24]]
    rows.append({"text": mr.texts[30], "text_pair": " ".join(mr.texts[:40])})  # ~1,000 tokens
    ce = CrossEncoder(str(scorer), device="cpu", local_files_only=True)
    expected = torch.as_tensor(
        ce.predict([(r["text"], r["text_pair"]) for r in rows], activation_fn=torch.nn.Identity(), batch_size=2)
    )
    capsys.readouterr()
    ours = torch.tensor(_predict(scorer, rows, tmp_path))
    torch.testing.assert_close(ours, expected, **TOL[torch.float32])
    assert "1 row(s) longer than 512 tokens" in capsys.readouterr().out
    # Told a max_length, predict reads that far: other scores for the long pairs.
    short = torch.tensor(_predict(scorer, rows, tmp_path, "--max-length", "64"))
    assert (short - ours).abs().max() > 1e-4
