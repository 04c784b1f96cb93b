"""bert-port-finetune / bert-port-predict end to end on the real all-MiniLM-L6-v2 and SMS spam:
the run well above chance, the saved checkpoint in transformers, predictions as CSV and JSONL,
the model folder (the model, its card, the resume state apart in checkpoints/), and the Python
API (`training.api.finetune` and `predict`) that the commands wrap."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from conftest import metrics_of, run_finetune, tiny_args

from bert_port.cli import predict as predict_cli
from bert_port.data import TextDataset, builtin_splits, write_texts
from bert_port.training import FinetuneError, api

# -----------------------------------------------------------------------------------------
# A real run: all-MiniLM-L6-v2 on SMS spam


@pytest.fixture(scope="module")
def sms_run(tmp_path_factory, minilm_path) -> Path:
    """Fine-tune the bundled all-MiniLM-L6-v2 on a slice of SMS spam: 192 training
    messages, 96 ham and 96 spam (so that a few steps see enough spam), 24 steps of 8
    messages cut to 16 tokens; validation on 48 ham and 48 spam. With balanced classes,
    chance and the majority-class rate are both 0.5."""
    root = tmp_path_factory.mktemp("sms_run")
    splits = builtin_splits("sms")

    def balanced(ds, n):
        ham = [i for i, label in enumerate(ds.labels) if label == "ham"][:n]
        return ds.subset(sorted(ham + [i for i, label in enumerate(ds.labels) if label == "spam"][:n]))

    write_texts(balanced(splits["train"], 96), root / "train.csv")
    write_texts(balanced(splits["validation"], 48), root / "validation.csv")
    out = root / "run"
    assert (
        run_finetune(
            "--checkpoint",
            minilm_path,
            "--train",
            root / "train.csv",
            "--validation",
            root / "validation.csv",
            "--output-dir",
            out,
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--max-length",
            "16",
            "--lr",
            "1.5e-4",
            "--warmup-steps",
            "2",
            "--eval-batch-size",
            "96",
            "--metric-for-best",
            "macro_f1",
        )
        == 0
    )
    return out


@pytest.mark.slow
def test_real_run_on_sms_spam_is_well_above_chance(sms_run):
    m = metrics_of(sms_run)
    validation = m["evaluations"][-1]["validation"]
    supports = [c["support"] for c in validation["per_class"].values()]
    print(
        f"SMS validation: accuracy {validation['accuracy']:.4f}, macro-F1 {validation['macro_f1']:.4f}, "
        f"confusion {m['best']['confusion']}"
    )  # one evaluation: it is the best
    assert supports == [48, 48]  # balanced: chance, and always answering one label, score 0.5
    # An untrained head stays near 0.5 (the accuracy reached is printed above); 0.8 is far
    # above chance while leaving room for other BLAS libraries' rounding.
    assert validation["accuracy"] >= 0.8
    assert validation["macro_f1"] >= 0.8
    assert m["status"] == "completed" and m["global_step"] == 24
    assert sum(s["loss"] for s in m["steps"][-6:]) < sum(s["loss"] for s in m["steps"][:6])
    # The model folder: the model, its card and the run's reports; the resume state apart.
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "vocab.txt",
        "README.md",
        "metrics.json",
        "training_curves.png",
        "training_config.json",
        "checkpoints/last-checkpoint.pt",
    ):
        assert (sms_run / name).is_file(), name
    assert not list(sms_run.glob("*.pt")), "the resume state belongs in checkpoints/, not beside the model"
    assert (sms_run / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    resolved = json.loads((sms_run / "training_config.json").read_text())
    assert resolved["batch_size"] == 8 and resolved["labels"] == ["ham", "spam"] and resolved["total_steps"] == 24
    assert len(m["steps"]) == 24 and all(s["loss"] > 0 for s in m["steps"])


@pytest.mark.slow
def test_saved_checkpoint_predicts_the_same_in_transformers(sms_run):
    import transformers

    from bert_port.classifier import BertForSequenceClassification
    from bert_port.data import TextDataset
    from bert_port.tokenization import load_tokenizer
    from bert_port.training import predict

    ref = transformers.BertForSequenceClassification.from_pretrained(sms_run).eval()
    assert ref.config.id2label == {0: "ham", 1: "spam"} and ref.config.label2id == {"ham": 0, "spam": 1}
    assert ref.config.num_labels == 2 and ref.config.problem_type == "single_label_classification"
    tokenizer = transformers.AutoTokenizer.from_pretrained(sms_run)  # the tokenizer files beside the weights
    texts = builtin_splits("sms")["test"].texts[:48]
    batch = tokenizer(texts, padding=True, truncation=True, max_length=24, return_tensors="pt")
    with torch.no_grad():
        expected = ref(**batch).logits.softmax(-1)
    ours = BertForSequenceClassification.from_pretrained(sms_run)
    actual = predict(ours, load_tokenizer(sms_run), TextDataset(texts=texts), batch_size=16, max_length=24)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    assert {0, 1} <= set(expected.argmax(-1).tolist())  # both labels occur: the check is not vacuous


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_predict_cli_writes_labels_and_probabilities(sms_run, tmp_path, suffix, capsys):
    texts = ["WINNER!! You have won a £1000 prize. Call 09061701461 to claim now", "ok see you at home later"]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    out = tmp_path / f"pred{suffix}"
    assert predict_cli.main(["--model", str(sms_run), "--input", str(source), "--output", str(out)]) == 0
    if suffix == ".csv":
        rows = list(csv.DictReader(out.open(encoding="utf-8")))
        assert list(rows[0]) == ["id", "text", "predicted_label", "prob_ham", "prob_spam"]
        probs = [(float(r["prob_ham"]), float(r["prob_spam"])) for r in rows]
    else:
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        probs = [(r["probabilities"]["ham"], r["probabilities"]["spam"]) for r in rows]
    assert [r["text"] for r in rows] == texts
    assert [r["predicted_label"] for r in rows] == ["spam", "ham"]
    for p in probs:
        assert abs(sum(p) - 1) < 1e-5
    assert "wrote 2 predictions" in capsys.readouterr().out
    # The command is a wrapper over the Python API: the same rows, without a file.
    api_rows = api.predict(sms_run, texts)
    assert [r["predicted_label"] for r in api_rows] == [r["predicted_label"] for r in rows]
    torch.testing.assert_close(
        torch.tensor([[r["probabilities"]["ham"], r["probabilities"]["spam"]] for r in api_rows]),
        torch.tensor(probs, dtype=torch.float32),
        atol=1e-6,
        rtol=0,
    )


@pytest.mark.slow
def test_model_card_describes_the_run(sms_run, minilm_path):
    """README.md as transformers' Trainer writes one: metadata the Hub reads, then the base model,
    the data, the settings and every evaluation, each figure the one in metrics.json."""
    card = (sms_run / "README.md").read_text(encoding="utf-8")
    m = metrics_of(sms_run)
    front, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    assert "library_name: transformers" in front and "pipeline_tag: text-classification" in front
    assert "base_model: sentence-transformers/all-MiniLM-L6-v2" in front  # the bundled checkpoint, by its Hub id
    assert "- train: 192" in body and "- validation: 96" in body and "- labels: ham, spam" in body
    assert f"- learning_rate: {m['config']['lr']}" in body and "- train_batch_size: 8" in body
    for e in m["evaluations"]:
        v = e["validation"]
        assert f"| {e['step']} | {e['epoch']} | {e['train_loss']:.4f} | {v['loss']:.4f} |" in body
        assert f"macro_f1 {v['macro_f1']:.4f}" in body
    assert f"macro_f1 {m['best']['value']:.4f}" in body


def test_python_api_trains_and_predicts_as_the_commands(tmp_path, sms_files, tiny_checkpoints, capsys):
    """`api.finetune(settings, **overrides)` is `bert-port-finetune` with the same settings (the
    same step losses, bit for bit), and `api.predict` writes what `bert-port-predict` writes."""
    args = tiny_args(sms_files, tiny_checkpoints["dropout"], tmp_path / "cli", "--epochs", "1")
    assert run_finetune(*args) == 0
    flags = dict(zip(args[::2], args[1::2]))
    settings = {k.removeprefix("--").replace("-", "_"): str(v) for k, v in flags.items()}
    typed = {"max_length": 32, "batch_size": 8, "epochs": 1, "lr": 1e-3, "warmup_steps": 2}
    metrics = api.finetune({**settings, **typed}, output_dir=str(tmp_path / "api"))
    cli = metrics_of(tmp_path / "cli")
    assert metrics["status"] == "completed" and [s["loss"] for s in metrics["steps"]] == [
        s["loss"] for s in cli["steps"]
    ]
    assert metrics["evaluations"][-1]["validation"] == cli["evaluations"][-1]["validation"]
    texts = ["free entry to win cash", "call me later"]
    source = tmp_path / "in.csv"
    write_texts(TextDataset(texts=texts), source)
    assert (
        predict_cli.main(
            ["--model", str(tmp_path / "api"), "--input", str(source), "--output", str(tmp_path / "p.jsonl")]
        )
        == 0
    )
    written = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    predictor = api.Predictor.load(tmp_path / "api")
    rows = api.predict(predictor, texts)
    assert [{k: r[k] for k in ("predicted_label", "probabilities")} for r in written] == rows
    with pytest.raises(FinetuneError, match="unknown setting"):
        api.finetune(settings, learning_rate=1e-3)  # a typo is refused, not ignored
