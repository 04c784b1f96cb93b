"""Fault injection for `bert-port-finetune` and `bert-port-predict` (nothing lost,
nothing half-written, nothing silently wrong). Each test plants one failure a careless or
hostile user (or `kill -9`) could cause and checks the promise: the run is refused before
it does work, or stops without saving anything from a broken state, with a typed error
(`DataError`, `FinetuneError`, or an argparse usage error), exit status 2 and no traceback;
a killed run resumes to the bit-identical result and its temporaries are cleaned up.

Here: bert-port-predict's checks, 10,000 classes, outputs that touch only their own files.
Data files and settings: test_training_data_faults.py; non-finite losses and kill -9:
test_training_kills.py. Runs use a tiny random BERT with the real MiniLM tokenizer (as
tests/test_finetune.py)."""

# ruff: noqa: F811  (fixtures imported from training_fault_runs, which pytest passes by name)

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import finetune_args, load_last, metrics_of, run_finetune
from training_fault_runs import (  # noqa: F401  (fixtures)
    ENV,
    REPO,
    _checkpoint,
    _csv,
    _rows,
    assert_refused,
    assert_usage_error,
    ckpt,
    data,
    temporaries,
)

from bert_port.cli import predict as predict_cli
from bert_port.data import load_texts
from bert_port.training import DETAIL_MAX_CLASSES, WORST_CLASSES


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data, ckpt) -> Path:
    """A fine-tuned output directory, for bert-port-predict."""
    out = tmp_path_factory.mktemp("trained") / "run"
    assert run_finetune(*finetune_args(data, ckpt, out, "--epochs", "1")) == 0
    return out


# -----------------------------------------------------------------------------------------
# 3. bert-port-predict: batch size and length checked before any work


@pytest.mark.parametrize("value", ["-1", "0", "abc"])
def test_predict_refuses_a_batch_size_that_is_not_positive(trained, data, tmp_path, capsys, value):
    out = tmp_path / "pred.csv"
    assert_usage_error(
        predict_cli.main,
        ["--model", trained, "--input", data["validation"], "--output", out, "--batch-size", value],
        capsys,
        "--batch-size",
    )
    assert not out.exists()


def test_predict_function_refuses_a_batch_size_that_would_leave_rows_unwritten(trained):
    from bert_port.classifier import BertForSequenceClassification
    from bert_port.data import TextDataset
    from bert_port.tokenization import load_tokenizer
    from bert_port.training import predict

    model = BertForSequenceClassification.from_pretrained(trained)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got -1"):
        predict(model, load_tokenizer(trained), TextDataset(texts=["a", "b"]), batch_size=-1)


@pytest.mark.parametrize(
    "case",
    [
        "max-length-1024",
        "max-length-2",
        "missing-input",
        "empty-input",
        "directory-input",
        "output-is-input",
        "bad-device",
        "column-clash",
        "bad-output-format",
    ],
)
def test_predict_refuses_bad_input_with_exit_2(trained, data, tmp_path, capsys, case):
    src, out, extra = data["validation"], tmp_path / "pred.csv", []
    message = {
        "max-length-1024": "exceeds the longest sequence the model encodes (64 tokens",
        "max-length-2": "leaves no room for text beside [CLS] and [SEP]",
        "missing-input": "does not exist",
        "empty-input": "is empty",
        "directory-input": "is a directory",
        "output-is-input": "is the --input file",
        "bad-device": "--device 'tpu' is not a device torch knows",
        "column-clash": "which the predictions would overwrite",
        "bad-output-format": "unknown data format '.xlsx'",
    }[case]
    if case == "max-length-1024":
        extra = ["--max-length", "1024"]
    elif case == "max-length-2":
        extra = ["--max-length", "2"]
    elif case == "missing-input":
        src = tmp_path / "nowhere.csv"
    elif case == "empty-input":
        src = tmp_path / "empty.csv"
        src.write_text("")
    elif case == "directory-input":
        src = tmp_path / "dir.csv"
        src.mkdir()
    elif case == "output-is-input":
        src = out = Path(_csv(tmp_path / "in.csv", _rows(3)))
    elif case == "bad-device":
        extra = ["--device", "tpu"]
    elif case == "column-clash":
        src = tmp_path / "clash.csv"
        src.write_text("text,predicted_label\nhello,x\n")
    elif case == "bad-output-format":
        out = tmp_path / "pred.xlsx"
    before = src.read_bytes() if src.is_file() else None
    code = predict_cli.main(["--model", str(trained), "--input", str(src), "--output", str(out), *extra])
    assert_refused(code, capsys, message)
    if before is not None:
        assert src.read_bytes() == before  # the input is never touched
    assert case == "output-is-input" or not out.exists()


def test_predict_writes_every_row_with_finite_probabilities(trained, data, tmp_path):
    out = tmp_path / "pred.jsonl"
    assert (
        predict_cli.main(
            ["--model", str(trained), "--input", str(data["validation"]), "--output", str(out), "--batch-size", "5"]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 12 and not temporaries(tmp_path)
    for row in rows:
        probs = list(row["probabilities"].values())
        assert all(0.0 <= p <= 1.0 for p in probs) and abs(sum(probs) - 1) < 1e-5


# -----------------------------------------------------------------------------------------
# 5. 10,000 classes: memory, metrics.json and the training state stay bounded


# Runs `bert-port-finetune` in a fresh process and writes that process's own peak RSS (VmHWM,
# the high-water mark of the address space exec created). Neither `RUSAGE_CHILDREN` (the maximum
# over every child this test session ever ran) nor a child's `ru_maxrss` (which starts from the
# parent's size at the fork, and pytest's is large by then) measures the run alone.
PEAK_PROBE = """
import sys
from bert_port.cli.finetune import main
code = main(sys.argv[2:])
with open("/proc/self/status") as status:
    kib = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
with open(sys.argv[1], "w") as out:
    out.write(kib)
sys.exit(code)
"""


def run_finetune_measuring_peak_rss(args: list[str], tmp_path: Path) -> tuple[int, str, int]:
    """Exit code, stderr and peak RSS in bytes of one `bert-port-finetune` process."""
    peak_file = tmp_path / "peak_kib.txt"
    cmd = [sys.executable, "-c", PEAK_PROBE, str(peak_file), *map(str, args)]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd=REPO, check=False)
    peak = int(peak_file.read_text()) * 1024 if peak_file.exists() else 0
    return proc.returncode, proc.stderr, peak


def test_ten_thousand_classes_stay_bounded(tmp_path, minilm_path):
    """One training example per class, 200 validation examples; a model with hidden size 8.
    Before the fix every evaluation kept a K x K confusion matrix in the history, so memory,
    metrics.json and the training state grew as K^2; now they grow as K. The test prints
    the peak memory and file sizes it measures (docs/loading.md records them)."""
    K = 10_000
    ckpt = _checkpoint(
        tmp_path / "ckpt",
        minilm_path,
        0.0,
        hidden_size=8,
        num_attention_heads=2,
        intermediate_size=16,
        num_hidden_layers=1,
    )
    train = _csv(tmp_path / "train.csv", [(f"item {i}", f"c{i}") for i in range(K)])
    validation = _csv(tmp_path / "validation.csv", [(f"item {i}", f"c{i}") for i in range(0, K, 50)])
    out = tmp_path / "out"
    args = [
        "--checkpoint",
        ckpt,
        "--train",
        train,
        "--validation",
        validation,
        "--output-dir",
        out,
        "--max-length",
        "8",
        "--batch-size",
        "2500",
        "--epochs",
        "2",
        "--eval-batch-size",
        "200",
        "--lr",
        "1e-3",
        "--device",
        "cpu",
    ]
    returncode, stderr, peak = run_finetune_measuring_peak_rss(args, tmp_path)
    assert returncode == 0, stderr[-3000:]
    m = metrics_of(out)
    assert len(m["labels"]) == K and len(m["evaluations"]) == 2
    for e in m["evaluations"]:
        v = e["validation"]
        assert "confusion" not in v and "per_class" not in v
        assert v["per_class_summary"]["classes"] == K and len(v["per_class_summary"]["worst_f1"]) == WORST_CLASSES
    assert "confusion" not in m["best"]
    state = load_last(out)
    history_bytes = len(pickle.dumps(state["history"]))
    sizes = {name: (out / name).stat().st_size for name in ("metrics.json", "checkpoints/last-checkpoint.pt")}
    print(f"10,000 classes: peak RSS {peak / 2**30:.2f} GiB, {sizes}, history {history_bytes} bytes")
    # The label names alone are ~90 KB, written twice (labels and the resolved config).
    assert sizes["metrics.json"] < 1_000_000
    assert history_bytes < 100_000
    weights = sum(t.numel() * t.element_size() for t in state["model"].values())
    assert sizes["checkpoints/last-checkpoint.pt"] < 3 * weights + 1_000_000  # weights, two Adam moments, a little more
    assert peak < 2.5 * 2**30


def test_per_class_detail_is_kept_for_few_classes(trained):
    m = metrics_of(trained)
    v = m["evaluations"][-1]["validation"]
    assert set(v["per_class"]) == {"neg", "pos"} and "confusion" not in v
    assert sum(map(sum, m["best"]["confusion"])) == 12 and len(m["labels"]) <= DETAIL_MAX_CLASSES


# -----------------------------------------------------------------------------------------
# Outputs touch only their own files; labels; resume on changed data; a full disk


def test_predict_leaves_unrelated_files_in_the_output_folder(trained, data, tmp_path):
    """A hidden file that merely looks like a temporary (`.NAME.XXXXXXXX.tmp`) is not predict's
    to delete: it removes only the temporaries it created itself."""
    folder = tmp_path / "d"
    folder.mkdir()
    other, notes = folder / ".other.abcdefgh.tmp", folder / "notes.txt"
    other.write_text("someone else's")
    notes.write_text("mine")
    argv = ["--model", str(trained), "--input", str(data["validation"]), "--output", str(folder / "preds.csv")]
    assert predict_cli.main(argv) == 0
    assert other.read_text() == "someone else's" and notes.read_text() == "mine"
    assert sorted(p.name for p in folder.iterdir()) == [".other.abcdefgh.tmp", "notes.txt", "preds.csv"]


def test_labels_differing_only_in_surrounding_whitespace_are_one_class(tmp_path):
    from bert_port.problem import ProblemType

    csv_file = _csv(tmp_path / "t.csv", [("a", "1"), ("b", " 1"), ("c", "0 "), ("d", " pos ")])
    assert load_texts(csv_file).labels == ["1", "1", "0", "pos"]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"text": "a", "label": "1"}\n{"text": "b", "label": " 1"}\n{"text": "c", "label": 0}\n')
    dataset = load_texts(jsonl)
    assert ProblemType.SINGLE_LABEL.label_names(dataset, "label") == ["0", "1"]


def test_predict_refuses_a_model_whose_labels_share_a_name(trained, data, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(trained, model)
    config = json.loads((model / "config.json").read_text())
    config["id2label"] = {"0": "pos", "1": "pos"}
    config["label2id"] = {"pos": 1}
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "pred.csv"
    code = predict_cli.main(["--model", str(model), "--input", str(data["validation"]), "--output", str(out)])
    assert_refused(code, capsys, "id2label gives one name to several labels ('pos' for ids 0, 1)", "own name")
    assert not out.exists()


def test_resume_refuses_a_data_file_that_changed(tmp_path, ckpt, data, capsys):
    train = tmp_path / "train.csv"
    train.write_bytes(data["train"].read_bytes())
    args = finetune_args({**data, "train": train}, ckpt, tmp_path / "out")
    assert run_finetune(*args, "--stop-after-steps", "1") == 0
    assert load_last(tmp_path / "out")["data"]["train"]["size"] == train.stat().st_size
    train.write_text(train.read_text().replace("good", "fine"))  # same labels, other texts
    assert_refused(
        run_finetune(*args, "--resume"), capsys, "the data changed since the run started", f"--train {train}"
    )
    assert load_last(tmp_path / "out")["progress"]["global_step"] == 1  # nothing trained on the new data


def test_a_full_disk_during_training_is_one_clear_line_and_keeps_the_last_checkpoint(
    tmp_path, ckpt, data, capsys, monkeypatch
):
    """The second training state hits ENOSPC half-way through its temporary: exit 2 with one
    line, no traceback, and `last-checkpoint.pt` still the first state, whole."""
    import errno

    real_save, calls = torch.save, [0]

    def save(obj, f, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            f.write(b"half a state")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    out = tmp_path / "out"
    code = run_finetune(*finetune_args(data, ckpt, out, "--save-steps", "1"))
    err = assert_refused(code, capsys, "no space left on the device", "--resume")
    line = next(line for line in err.splitlines() if "error: " in line)  # among the progress bars
    assert line[line.index("error: ") :].endswith("then continue with --resume"), err
    monkeypatch.setattr(torch, "save", real_save)
    assert load_last(out)["progress"]["global_step"] == 1
    assert not temporaries(out)
