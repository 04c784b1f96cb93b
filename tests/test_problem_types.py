"""Regression and multi-label classification end to end: the readers for numbers and label
sets, the metrics against scipy and scikit-learn, a run of `bert-port-finetune` on real text
(MR sentences with their ratings; SMS messages with tags), its checkpoint in transformers'
BertForSequenceClassification (num_labels, problem_type, outputs), `bert-port-predict`'s
values and sigmoid probabilities, and clear errors for bad labels."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, TOL, assert_same_step_losses, metrics_of, run_finetune

from bert_port import BertConfig, BertModel
from bert_port.classifier import BertForSequenceClassification
from bert_port.cli import predict as predict_cli
from bert_port.data import DataError, TextDataset, builtin_splits, load_texts, write_texts
from bert_port.training import multi_label_metrics, regression_metrics

REPO = Path(__file__).resolve().parent.parent
TAGS = ("digits", "long", "spam")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, minilm_path) -> Path:
    config = {**TINY, "vocab_size": 30522, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    torch.manual_seed(0)
    model = BertModel(BertConfig.from_dict(config))
    model.source_dir = minilm_path
    return model.save_pretrained(tmp_path_factory.mktemp("tiny"))


def _tags(text: str, label: str) -> list[str]:
    on = (any(c.isdigit() for c in text), len(text) > 60, label == "spam")
    return [t for t, flag in zip(TAGS, on) if flag]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Regression: 37 MR training sentences and 24 validation ones with their rating, as CSV.
    Multi-label: SMS messages tagged from their text, JSONL (lists) for training and CSV
    ("a|b") for validation."""
    root = tmp_path_factory.mktemp("data")
    scores = builtin_splits("mr_scores")
    sms = builtin_splits("sms")
    out = {
        "reg_train": write_texts(scores["train"].subset(range(37)), root / "reg_train.csv"),
        "reg_validation": write_texts(scores["validation"].subset(range(24)), root / "reg_validation.csv"),
    }
    for split, n, suffix in (("train", 37, "jsonl"), ("validation", 24, "csv")):
        ds = sms[split].subset(range(n))
        rows = [{"text": t, "label": _tags(t, y)} for t, y in zip(ds.texts, ds.labels)]
        path = root / f"multi_{split}.{suffix}"
        if suffix == "jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        else:
            write_texts(TextDataset(texts=ds.texts, labels=["|".join(r["label"]) for r in rows]), path)
        out[f"multi_{split}"] = path
    return out


def args_for(files, kind: str, ckpt, out, *extra) -> list:
    problem = {"reg": "regression", "multi": "multi_label_classification"}[kind]
    return [
        "--checkpoint",
        ckpt,
        "--problem-type",
        problem,
        "--train",
        files[f"{kind}_train"],
        "--validation",
        files[f"{kind}_validation"],
        "--output-dir",
        out,
        "--max-length",
        "24",
        "--batch-size",
        "8",
        "--epochs",
        "2",
        "--lr",
        "2e-3",
        "--device",
        "cpu",
        *extra,
    ]


# -----------------------------------------------------------------------------------------
# Readers


def test_readers_for_numbers_and_label_sets(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"text": "a", "y": 1}\n{"text": "b", "y": -2.5}\n{"text": "c", "y": "3e-1"}\n')
    assert load_texts(path, label_column="y", label_kind="float").labels == ["1.0", "-2.5", "0.3"]
    path = tmp_path / "m.jsonl"
    path.write_text('{"text": "a", "y": ["x", "w"]}\n{"text": "b", "y": []}\n{"text": "c", "y": "w|x"}\n')
    assert load_texts(path, label_column="y", label_kind="multi").labels == ["w|x", "", "w|x"]
    path = tmp_path / "m.csv"
    path.write_text('text,y\na,x|w\nb,\nc," w | x "\n')
    assert load_texts(path, label_column="y", label_kind="multi").labels == ["w|x", "", "w|x"]


@pytest.mark.parametrize(
    "name, text, kind, message",
    [
        ("r.csv", "text,label\na,1.5\nb,high\n", "float", "line 3: the label 'high' is not a finite number"),
        ("r.csv", "text,label\na,nan\n", "float", "line 2: the label 'nan' is not a finite number"),
        ("r.jsonl", '{"text": "a", "label": [1]}\n', "float", "holds [1] (list); it must be a number"),
        ("m.jsonl", '{"text": "a", "label": [["x"]]}\n', "multi", 'the labels [["x"]] must be names'),
        ("m.jsonl", '{"text": "a", "label": 3}\n', "multi", "holds 3 (int); it must be a list of labels"),
    ],
)
def test_bad_labels_are_clear_data_errors(tmp_path, name, text, kind, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DataError) as err:
        load_texts(path, label_kind=kind)
    assert message in str(err.value) and str(path) in str(err.value)


def test_an_unseen_validation_tag_is_refused(tmp_path, ckpt, files, capsys):
    validation = tmp_path / "v.csv"
    validation.write_text("text,label\nhello,spam|urgent\n")
    args = args_for({**files, "multi_validation": validation}, "multi", ckpt, tmp_path / "out")
    assert run_finetune(*args) == 2
    assert "never seen in training: 'urgent' (1 row(s), first at line 2)" in capsys.readouterr().err


# -----------------------------------------------------------------------------------------
# Metrics against scipy and scikit-learn


def test_regression_metrics_equal_scipy():
    stats = pytest.importorskip("scipy.stats")
    torch.manual_seed(0)
    targets = torch.randint(-4, 5, (200,)).double()  # many ties, as human ratings have
    predictions = targets + torch.randn(200, dtype=torch.float64) * 2
    predictions[:20] = predictions[20:40]  # ties among the predictions too
    result = regression_metrics(predictions, targets, loss_sum=50.0)
    assert result["pearson"] == pytest.approx(stats.pearsonr(predictions, targets).statistic, rel=1e-12)
    assert result["spearman"] == pytest.approx(stats.spearmanr(predictions, targets).statistic, rel=1e-12)
    assert result["loss"] == 0.25 and result["n"] == 200
    assert regression_metrics(torch.ones(5), torch.arange(5.0), 0.0)["pearson"] == 0.0  # constant: undefined


def test_multi_label_metrics_equal_scikit_learn():
    metrics = pytest.importorskip("sklearn.metrics")
    torch.manual_seed(0)
    truth = torch.rand(300, 5) < 0.3
    guess = truth ^ (torch.rand(300, 5) < 0.2)  # 20% of the decisions flipped
    tp, predicted, actual = (guess & truth).sum(0), guess.sum(0), truth.sum(0)
    exact = float((guess == truth).all(-1).sum())
    result = multi_label_metrics(tp, predicted, actual, exact, 300, 30.0, list("abcde"))
    y, p = truth.numpy(), guess.numpy()
    assert result["micro_f1"] == pytest.approx(metrics.f1_score(y, p, average="micro"), rel=1e-12)
    assert result["macro_f1"] == pytest.approx(metrics.f1_score(y, p, average="macro"), rel=1e-12)
    assert result["exact_match"] == pytest.approx(metrics.accuracy_score(y, p), rel=1e-12)
    assert result["per_class"]["c"]["f1"] == pytest.approx(metrics.f1_score(y[:, 2], p[:, 2]), rel=1e-12)


# -----------------------------------------------------------------------------------------
# Runs, checkpoints in transformers, predictions


@pytest.fixture(scope="module")
def runs(tmp_path_factory, files, ckpt) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for kind in ("reg", "multi"):
        out[kind] = root / kind
        assert run_finetune(*args_for(files, kind, ckpt, out[kind], "--eval-steps", "4")) == 0
    return out


def test_regression_run_reports_pearson_and_spearman(runs):
    m = metrics_of(runs["reg"])
    assert m["problem_type"] == "regression" and m["labels"] == ["label"]
    assert m["config"]["metric_for_best"] == "pearson"
    for e in m["evaluations"]:
        assert set(e["validation"]) == {"loss", "pearson", "spearman", "n"} and e["validation"]["n"] == 24
    assert m["best"]["value"] == max(e["validation"]["pearson"] for e in m["evaluations"])


def test_multi_label_run_reports_micro_and_macro_f1(runs):
    m = metrics_of(runs["multi"])
    assert m["problem_type"] == "multi_label_classification" and m["labels"] == list(TAGS)
    assert m["config"]["metric_for_best"] == "micro_f1"
    v = m["evaluations"][-1]["validation"]
    assert {"loss", "micro_f1", "macro_f1", "exact_match", "per_class"} <= set(v)
    assert sum(c["support"] for c in v["per_class"].values()) > 0


@pytest.mark.parametrize(
    "kind, problem_type, num_labels", [("reg", "regression", 1), ("multi", "multi_label_classification", 3)]
)
def test_checkpoint_loads_in_transformers_with_its_problem_type(runs, kind, problem_type, num_labels):
    import transformers

    ref = transformers.BertForSequenceClassification.from_pretrained(runs[kind]).eval()
    assert ref.config.problem_type == problem_type and ref.config.num_labels == num_labels
    ours = BertForSequenceClassification.from_pretrained(runs[kind], attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(runs[kind])
    batch = tokenizer(builtin_splits("sms")["test"].texts[:8], padding=True, return_tensors="pt")
    labels = torch.rand(8, num_labels).round() if num_labels > 1 else torch.randn(8)
    with torch.no_grad():
        expected, actual = ref(**batch, labels=labels), ours(**batch, labels=labels)
    torch.testing.assert_close(actual.logits, expected.logits, **TOL[torch.float32])
    torch.testing.assert_close(actual.loss, expected.loss, **TOL[torch.float32])


def test_predict_writes_values_for_regression(runs, tmp_path):
    from bert_port.tokenization import load_tokenizer
    from bert_port.training import predict

    texts = ["a wonderful, moving film", "dull and far too long"]
    source = tmp_path / "in.csv"
    write_texts(TextDataset(texts=texts), source)
    out = tmp_path / "pred.csv"
    assert predict_cli.main(["--model", str(runs["reg"]), "--input", str(source), "--output", str(out)]) == 0
    rows = list(csv.DictReader(out.open(encoding="utf-8")))
    assert list(rows[0]) == ["text", "predicted_value"]
    model = BertForSequenceClassification.from_pretrained(runs["reg"])
    expected = predict(model, load_tokenizer(runs["reg"]), TextDataset(texts=texts), max_length=24)
    assert [float(r["predicted_value"]) for r in rows] == expected[:, 0].tolist()


@pytest.mark.parametrize("threshold", ["0.5", "0.3"])
def test_predict_writes_sigmoid_probabilities_and_thresholded_labels(runs, tmp_path, threshold):
    texts = builtin_splits("sms")["test"].texts[:6]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    # The run's length, which predict reads only when told (its default is the model's limit).
    argv = ["--model", str(runs["multi"]), "--input", str(source), "--threshold", threshold, "--max-length", "24"]
    assert predict_cli.main([*argv, "--output", str(tmp_path / "p.jsonl")]) == 0
    assert predict_cli.main([*argv, "--output", str(tmp_path / "p.csv")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    model = BertForSequenceClassification.from_pretrained(runs["multi"]).eval()
    from bert_port.tokenization import encode, load_tokenizer

    with torch.no_grad():
        logits = model(**encode(load_tokenizer(runs["multi"]), texts, max_length=24)).logits
    expected = logits.sigmoid()
    for row, p in zip(rows, expected):
        torch.testing.assert_close(torch.tensor([row["probabilities"][t] for t in TAGS]), p, **TOL[torch.float32])
        assert row["predicted_labels"] == [t for t, x in zip(TAGS, p.tolist()) if x >= float(threshold)]
    flat = list(csv.DictReader((tmp_path / "p.csv").open(encoding="utf-8")))
    assert list(flat[0]) == ["text", "predicted_labels"] + [f"prob_{t}" for t in TAGS]
    assert [r["predicted_labels"] for r in flat] == ["|".join(r["predicted_labels"]) for r in rows]


@pytest.mark.slow
def test_torchrun_regression_two_processes_equal_one(tmp_path, files, ckpt):
    """Regression gathers every prediction across processes for the correlations: 2 gloo
    processes give the same steps and evaluations as one."""
    extra = ("--eval-steps", "3", "--lr-scheduler-type", "cosine")
    assert run_finetune(*args_for(files, "reg", ckpt, tmp_path / "one", *extra)) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    args = args_for(files, "reg", ckpt, tmp_path / "ddp", *extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*cmd, "-m", "bert_port.cli.finetune", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, ddp = metrics_of(tmp_path / "one"), metrics_of(tmp_path / "ddp")
    assert ddp["config"]["world_size"] == 2
    assert_same_step_losses(ddp, one)
    for a, b in zip(ddp["evaluations"], one["evaluations"]):
        assert a["step"] == b["step"] and a["validation"]["n"] == b["validation"]["n"] == 24
        assert a["validation"]["loss"] == pytest.approx(b["validation"]["loss"], abs=1e-5)
        # The tiny model's predictions are nearly constant, and a correlation divides by their
        # spread: float rounding of 1e-7 in a prediction moves it by ~1e-5, not more.
        for name in ("pearson", "spearman"):
            assert a["validation"][name] == pytest.approx(b["validation"][name], abs=1e-3)


def test_one_problem_type_gives_the_cli_choices_and_the_config_strings():
    """`ProblemType` is the one definition: its values are transformers' strings (in
    config.json and on the command line), and `--problem-type` offers exactly them, with
    bert_port's own `token_classification` (which no config.json holds: tests/test_token_classification.py)."""
    from bert_port.cli import finetune as finetune_cli
    from bert_port.problem import ProblemType

    strings = ("regression", "single_label_classification", "multi_label_classification", "token_classification")
    assert ProblemType.choices() == strings and all(ProblemType(s).value == s for s in strings)
    flags = {a.dest: a for a in finetune_cli.build_parser()._actions}
    assert tuple(flags["problem_type"].choices) == strings
    assert json.dumps({"problem_type": ProblemType.MULTI_LABEL}) == '{"problem_type": "multi_label_classification"}'
    assert f"{ProblemType.REGRESSION}" == "regression"
    with pytest.raises(ValueError, match="unknown problem_type 'ranking'; use one of regression, single_label"):
        ProblemType("ranking")
