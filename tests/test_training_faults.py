"""Fault injection for `bert-port-finetune` and `bert-port-predict` (issue 16: nothing lost,
nothing half-written, nothing silently wrong). Each test plants one failure a careless or
hostile user (or `kill -9`) could cause and checks the promise: the run is refused before
it does work, or stops without saving anything from a broken state, with a typed error
(`DataError`, `FinetuneError`, or an argparse usage error), exit status 2 and no traceback;
a killed run resumes to the bit-identical result and its temporaries are cleaned up.

Runs use a tiny random BERT with the real MiniLM tokenizer (as tests/test_finetune.py)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import TINY, finetune_args, load_last, metrics_of, run_finetune

from bert_port import BertConfig, BertModel
from bert_port.checkpoint import TEMPORARY
from bert_port.cli import finetune as finetune_cli
from bert_port.cli import predict as predict_cli
from bert_port.data import DataError, load_texts
from bert_port.training import DETAIL_MAX_CLASSES, WORST_CLASSES

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def temporaries(out: Path) -> list[Path]:
    return [
        p
        for d in (out, out / "data", out / "checkpoints")
        if d.is_dir()
        for p in d.iterdir()
        if TEMPORARY.fullmatch(p.name)
    ]


def _checkpoint(root: Path, minilm_path: Path, dropout: float, **config) -> Path:
    config = {
        **TINY,
        "vocab_size": 30522,
        "hidden_dropout_prob": dropout,
        "attention_probs_dropout_prob": dropout,
        **config,
    }
    torch.manual_seed(0)
    model = BertModel(BertConfig.from_dict(config))
    model.source_dir = minilm_path
    return model.save_pretrained(root)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, minilm_path) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("tiny"), minilm_path, 0.1)  # dropout on: the RNG state matters


WORDS = ["good", "great", "fine", "bad", "awful", "poor", "movie", "plot", "acting", "song"]


def _rows(n: int, offset: int = 0) -> list[tuple[str, str]]:
    rows = []
    for i in range(offset, offset + n):
        label = "pos" if i % 2 else "neg"
        rows.append((f"{WORDS[i % 10]} {WORDS[(3 * i) % 10]} {WORDS[(7 * i + 1) % 10]} number {i}", label))
    return rows


def _csv(path: Path, rows, header: str = "text,label") -> Path:
    path.write_text(header + "\n" + "".join(f"{t},{lab}\n" for t, lab in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    return {"train": _csv(root / "train.csv", _rows(40)), "validation": _csv(root / "validation.csv", _rows(12, 100))}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data, ckpt) -> Path:
    """A fine-tuned output directory, for bert-port-predict."""
    out = tmp_path_factory.mktemp("trained") / "run"
    assert run_finetune(*finetune_args(data, ckpt, out, "--epochs", "1")) == 0
    return out


def assert_refused(code: int, capsys, *messages: str) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    for message in messages:
        assert message in err, err
    return err


def assert_usage_error(main, argv, capsys, *messages: str) -> None:
    """argparse's usage error: SystemExit(2) with the flag named on stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    for message in messages:
        assert message in err, err


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
        "max-length-1024": "exceeds the model's max_position_embeddings (64)",
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
# 4, 14, 15. Data files: strict CSV, nothing swallowed, long fields, typed errors


def test_unterminated_quote_is_refused_not_swallowed(tmp_path, ckpt, data, capsys):
    rows = _rows(40)
    lines = ["text,label"] + [f"{t},{lab}" for t, lab in rows]
    lines[5] = lines[5].replace(",pos", ',"pos').replace(",neg", ',"neg')  # row 5 (line 6): quote never closed
    train = tmp_path / "train.csv"
    train.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    code = run_finetune(*finetune_args({**data, "train": train}, ckpt, out))
    assert_refused(
        code, capsys, f"{train}, line 6: a quoted field opened in the row starting on this line is never closed"
    )
    assert not out.exists()


def test_label_spanning_lines_is_refused(tmp_path, capsys, ckpt, data):
    # The quote opened in line 4's label closes on line 6: without the check the label would
    # be a three-line string, a class of its own, and lines 5-6 would vanish as rows.
    train = tmp_path / "train.csv"
    train.write_text('text,label\na,pos\nb,neg\nc,"pos\nd,neg\ne,pos"\nf,neg\ng,pos\n')
    with pytest.raises(DataError, match=r"line 6: the label .* spans several lines.*unbalanced quote"):
        load_texts(train)
    assert_refused(
        run_finetune(*finetune_args({**data, "train": train}, ckpt, tmp_path / "out")), capsys, "spans several lines"
    )


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("stray-quote.csv", 'text,label\n"good"movie,pos\nbad,neg\n', "line 2: malformed CSV"),
        ("dup.csv", "text,text,label\na,b,pos\nc,d,neg\n", "names column(s) 'text' more than once"),
        (
            "float-label.jsonl",
            '{"text": "a", "label": 1}\n{"text": "b", "label": 1.0}\n',
            "line 2: the label column 'label' holds 1.0 (float); it must be a string or an integer",
        ),
        ("list-text.jsonl", '{"text": ["a"], "label": 1}\n', "the text column 'text' holds [\"a\"] (list)"),
        ("bool-label.jsonl", '{"text": "a", "label": true}\n', "holds true (bool)"),
        ("deep.jsonl", "[" * 100000 + "\n", "line 1:"),
    ],
    ids=["stray-quote", "duplicate-header", "float-label", "list-text", "bool-label", "deep-json"],
)
def test_malformed_files_raise_data_error(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DataError) as err:
        load_texts(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_unreadable_file_is_a_data_error(tmp_path, monkeypatch):
    path = _csv(tmp_path / "t.csv", _rows(2))
    real = Path.read_text

    def denied(self, *a, **k):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", denied)  # chmod 000 would not stop root
    with pytest.raises(DataError, match="cannot read .*Permission denied.*check its permissions"):
        load_texts(path)


def test_field_over_128_kib_is_read_and_truncated_to_max_length(tmp_path, ckpt, data):
    big = " ".join(WORDS * 4000)  # ~170 KB: over csv's default field limit of 131072
    assert len(big) > 131072
    train = _csv(tmp_path / "train.csv", [(big, "pos")] + _rows(20))
    assert load_texts(train).texts[0] == big
    out = tmp_path / "out"
    assert run_finetune(*finetune_args({**data, "train": train}, ckpt, out, "--epochs", "1")) == 0
    assert metrics_of(out)["status"] == "completed"


def test_max_length_beyond_the_position_table_is_refused_before_training(tmp_path, ckpt, data, capsys):
    out = tmp_path / "out"
    code = run_finetune(*finetune_args(data, ckpt, out, "--max-length", "1024"))
    assert_refused(
        code,
        capsys,
        "--max-length 1024 exceeds the model's max_position_embeddings (64)",
        "use --max-length 64 or less",
    )
    assert not out.exists()


# -----------------------------------------------------------------------------------------
# 6, 15. Settings: every nonsense value refused up front


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--lr", "inf"], "--lr must be a finite number > 0"),
        (["--lr", "nan"], "--lr must be a finite number > 0"),
        (["--lr=-1e-3"], "--lr must be a finite number > 0"),  # argparse takes "-1e-3" alone for a flag
        (["--lr", "0"], "--lr must be a finite number > 0"),
        (["--adam-eps", "0"], "--adam-eps must be a finite number > 0"),
        (["--weight-decay", "inf"], "--weight-decay must be a finite number >= 0"),
        (["--max-grad-norm", "nan"], "--max-grad-norm must be a finite number >= 0"),
        (["--adam-beta2", "1"], "--adam-beta2 must be in [0, 1)"),
        (["--warmup-ratio", "-0.5"], "--warmup-ratio must be in [0, 1)"),
        (["--validation-split", "1.5"], "--validation-split must be strictly between 0 and 1"),
        (["--classifier-dropout", "1"], "--classifier-dropout must be in [0, 1)"),
        (["--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
        (["--eval-batch-size", "-1"], "--eval-batch-size must be a positive integer"),
        (["--epochs", "0"], "--epochs must be a positive integer"),
        (["--max-length", "0"], "--max-length must be a positive integer"),
        (["--max-length", "2"], "leaves no room for text beside [CLS] and [SEP]"),
        (["--warmup-steps", "-1"], "--warmup-steps must be an integer >= 0"),
        (["--seed", "-1"], "--seed must be an integer in [0, 2**63)"),
        (["--device", "tpu"], "--device 'tpu' is not a device torch knows"),
        (["--label-column", "text"], "must name different columns"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else None,
)
def test_nonsense_flags_are_refused_before_any_work(tmp_path, ckpt, data, capsys, extra, message):
    out = tmp_path / "out"
    assert_refused(
        run_finetune(*finetune_args(data, ckpt, out), *extra), capsys, "invalid fine-tuning configuration", message
    )
    assert not out.exists()  # refused before anything was created


@pytest.mark.parametrize("value", ["abc", "1e-3x", ""])
def test_a_string_lr_on_the_command_line_is_a_usage_error(tmp_path, ckpt, data, capsys, value):
    assert_usage_error(
        finetune_cli.main,
        finetune_args(data, ckpt, tmp_path / "out", "--lr", value),
        capsys,
        "argument --lr: invalid float value",
    )


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"lr": "abc"}, "--lr must be a finite number > 0 (e.g. 5e-5), got 'abc'"),
        ({"epochs": "3"}, "--epochs must be a positive integer, got '3'"),
        ({"batch_size": 8.0}, "--batch-size must be a positive integer, got 8.0"),
        ({"bf16": "yes"}, "--bf16 must be true or false, got 'yes'"),
        ({"train": 5}, "--train must be a non-empty string, got 5"),
        ({"lr": True}, "--lr must be a finite number > 0"),
    ],
)
def test_wrong_types_in_a_config_file_are_refused(tmp_path, ckpt, data, capsys, settings, message):
    config = tmp_path / "c.json"
    config.write_text(json.dumps(settings))
    args = finetune_args(data, ckpt, tmp_path / "out")
    for key in settings:  # a flag would win over the file
        flag = "--" + key.replace("_", "-")
        if flag in args:
            del args[args.index(flag) : args.index(flag) + 2]
    assert_refused(run_finetune("--config", config, *args), capsys, message)


def test_config_file_that_is_a_directory_is_refused(tmp_path, capsys):
    assert_refused(run_finetune("--config", tmp_path), capsys, "cannot read the configuration file")


def test_output_dir_that_is_a_file_is_refused(tmp_path, ckpt, data, capsys):
    out = tmp_path / "out"
    out.write_text("precious")
    assert_refused(run_finetune(*finetune_args(data, ckpt, out)), capsys, "is a file, not a directory")
    assert out.read_text() == "precious"


def test_missing_label_column_and_directory_as_data(tmp_path, ckpt, data, capsys):
    train = tmp_path / "t.csv"
    train.write_text("text,sentiment\na,1\nb,0\n")
    assert_refused(
        run_finetune(*finetune_args({**data, "train": train}, ckpt, tmp_path / "o")), capsys, "has no column 'label'"
    )
    folder = tmp_path / "folder.csv"
    folder.mkdir()
    assert_refused(
        run_finetune(*finetune_args({**data, "train": folder}, ckpt, tmp_path / "o")), capsys, "is a directory"
    )


def test_a_second_run_into_a_busy_output_dir_is_refused(tmp_path, ckpt, data, capsys):
    import fcntl

    from bert_port.training.run_folder import RUN_LOCK

    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out / RUN_LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running bert-port-finetune holds it
        assert_refused(
            run_finetune(*finetune_args(data, ckpt, out)), capsys, "another bert-port-finetune is writing into"
        )
    finally:
        os.close(fd)
    assert not (out / "checkpoints" / "last-checkpoint.pt").exists()


def test_damaged_training_state_is_refused_on_resume(tmp_path, ckpt, data, capsys):
    out = tmp_path / "out"
    assert run_finetune(*finetune_args(data, ckpt, out, "--stop-after-steps", "1")) == 0
    state = out / "checkpoints" / "last-checkpoint.pt"
    state.write_bytes(state.read_bytes()[:1000])
    assert_refused(run_finetune(*finetune_args(data, ckpt, out, "--resume")), capsys, "it is damaged", "--overwrite")


# -----------------------------------------------------------------------------------------
# 6. A non-finite loss stops the run; nothing is saved from it


def _nan_from_step(monkeypatch, first_bad: int) -> None:
    """From the `first_bad`-th training step on, every example's loss is NaN."""
    from bert_port.training import recipe
    from bert_port.training import steps as step_module

    real_loss, real_step, steps = step_module.per_example_loss, recipe.train_step, [0]

    def step(*args, **kwargs):
        steps[0] += 1
        return real_step(*args, **kwargs)

    def loss(logits, labels, problem_type):
        losses = real_loss(logits, labels, problem_type)
        return losses * float("nan") if steps[0] >= first_bad else losses

    monkeypatch.setattr(recipe, "train_step", step)
    monkeypatch.setattr(step_module, "per_example_loss", loss)


def test_nan_loss_mid_run_stops_with_an_error_and_saves_nothing_from_it(tmp_path, ckpt, data, capsys, monkeypatch):
    out = tmp_path / "out"
    _nan_from_step(monkeypatch, 4)  # steps 1-3 are fine; save every 2 steps: step 2 is the last good state
    code = run_finetune(*finetune_args(data, ckpt, out, "--save-steps", "2"))
    assert_refused(code, capsys, "step 4 (epoch 1", "diverged", "nothing was saved from it", "lower --lr")
    state = load_last(out)
    assert state["progress"]["global_step"] == 2
    assert all(bool(torch.isfinite(t).all()) for t in state["model"].values())
    assert not (out / "model.safetensors").exists() and not (out / "metrics.json").exists()
    assert not temporaries(out)


def test_weights_broken_by_the_last_step_of_an_epoch_are_never_saved(tmp_path, ckpt, data, capsys, monkeypatch):
    """The loss of step 5 is finite, but its update leaves NaN weights (planted); the
    evaluation that follows must not pick them as the best (an argmax of NaN) nor save them."""
    from bert_port.training import recipe

    real_step, steps = recipe.train_step, [0]

    def step(model, *args, **kwargs):
        result = real_step(model, *args, **kwargs)
        steps[0] += 1
        if steps[0] == 5:  # the last step of epoch 1
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))
        return result

    monkeypatch.setattr(recipe, "train_step", step)
    out = tmp_path / "out"
    code = run_finetune(*finetune_args(data, ckpt, out, "--save-steps", "4"))
    assert_refused(code, capsys, "the validation loss after epoch 1 (step 5) is nan", "Nothing was saved")
    assert load_last(out)["progress"]["global_step"] == 4
    assert not (out / "model.safetensors").exists() and not (out / "metrics.json").exists()


def test_a_learning_rate_that_blows_up_the_weights_is_caught(tmp_path, ckpt, data, capsys):
    """A finite but absurd lr with clipping off: AdamW moves every weight by ~1e30, the
    LayerNorm variance overflows, and the next loss is NaN. Before the fix such a run
    reported an accuracy (the argmax of NaN) and saved NaN weights."""
    out = tmp_path / "out"
    code = run_finetune(*finetune_args(data, ckpt, out, "--lr", "1e30", "--max-grad-norm", "0", "--warmup-steps", "0"))
    assert_refused(code, capsys, "diverged", "nothing was saved")
    assert not (out / "model.safetensors").exists() and not (out / "checkpoints" / "last-checkpoint.pt").exists()


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
# 11. kill -9 during fine-tuning: the next --resume cleans up and ends bit-identical

# The child dies by SIGKILL half-way through writing the `kill_at`-th training state to its
# temporary file, the worst moment: a half-written hidden temporary is left behind.
CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    from bert_port import training
    kill_at, calls, real_save = int(os.environ["KILL_AT_SAVE"]), [0], torch.save
    def save(obj, f, *a, **k):  # f: the open temporary file the state is written to
        calls[0] += 1
        real_save(obj, f, *a, **k)
        if calls[0] == kill_at:
            f.flush()
            os.truncate(f.name, os.path.getsize(f.name) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save = save
    from bert_port.cli.finetune import main
    sys.exit(main(sys.argv[1:]))
""")


def _child(args: list, kill_at: int | None) -> subprocess.CompletedProcess:
    env = {**ENV, "KILL_AT_SAVE": str(kill_at or 0)}
    return subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        check=False,
    )


@pytest.mark.parametrize("kills", [3, pytest.param(8, marks=pytest.mark.slow)])
def test_kill_9_then_resume_cleans_up_and_ends_bit_identical(tmp_path, ckpt, data, kills):
    full = tmp_path / "full"
    assert _child(finetune_args(data, ckpt, full, "--save-steps", "1"), None).returncode == 0
    out = tmp_path / "killed"
    args = finetune_args(data, ckpt, out, "--save-steps", "1")
    for attempt in range(kills):
        resume = ["--resume"] if (out / "checkpoints" / "last-checkpoint.pt").is_file() else ["--overwrite"]
        proc = _child(args + resume, kill_at=2)  # each attempt saves one state, then dies writing the next
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        found = temporaries(out)
        assert found, "the kill left no temporary: the test did not plant the fault"
        if attempt:
            assert "removed 1 temporary file(s)" in proc.stderr  # the previous kill's leftover
    assert 1 <= load_last(out)["progress"]["global_step"] < 10
    proc = _child(args + ["--resume"], None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "removed 1 temporary file(s)" in proc.stderr and not temporaries(out)
    a, b = metrics_of(out), metrics_of(full)
    assert a["status"] == "completed" and [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]]
    assert [e["validation"] for e in a["evaluations"]] == [e["validation"] for e in b["evaluations"]]
    wa, wb = load_last(out)["model"], load_last(full)["model"]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    from safetensors.torch import load_file

    sa, sb = load_file(out / "model.safetensors"), load_file(full / "model.safetensors")
    assert all(torch.equal(sa[k], sb[k]) for k in sb)


def test_external_kill_9_at_any_moment_then_resume(tmp_path, ckpt, data):
    """kill -9 from outside, as soon as the first training state is on disk (wherever the
    child then is), then a resume: same weights as the run that was never killed."""
    full = tmp_path / "full"
    assert _child(finetune_args(data, ckpt, full, "--save-steps", "1"), None).returncode == 0
    out = tmp_path / "killed"
    args = [
        sys.executable,
        "-m",
        "bert_port.cli.finetune",
        *map(str, finetune_args(data, ckpt, out, "--save-steps", "1")),
    ]
    child = subprocess.Popen(args, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        import time

        deadline = time.monotonic() + 300
        while (
            not (out / "checkpoints" / "last-checkpoint.pt").exists()
            and child.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    proc = _child(finetune_args(data, ckpt, out, "--save-steps", "1", "--resume"), None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not temporaries(out)
    wa, wb = load_last(out)["model"], load_last(full)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wb)


def test_a_new_run_finishes_a_save_killed_after_its_commit(tmp_path, monkeypatch):
    """A save killed after its commit point leaves a journal whose staged temporaries are
    the new files. A run starting in that folder must finish the save (as the next save or
    `repair` would), not delete the new files as leftovers and roll back to the old ones."""
    import bert_port.checkpoint as ckpt
    from bert_port.training import own_output_dir
    from bert_port.training.run_folder import RUN_LOCK

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("old")

    def killed_after_the_commit_point(directory, journal):
        raise SystemExit("killed")  # the process dies with the journal in place

    monkeypatch.setattr(ckpt.staging, "_apply_journal", killed_after_the_commit_point)
    with pytest.raises(SystemExit), ckpt.StagedWrite(out) as stage:
        stage.text("config.json", "new")
    monkeypatch.undo()
    assert (out / ckpt.JOURNAL).is_file() and (out / "config.json").read_text() == "old"

    with own_output_dir(out):
        assert (out / "config.json").read_text() == "new"
    assert sorted(p.name for p in out.iterdir()) == [RUN_LOCK, "config.json"]  # the run's lock file stays


def test_predict_with_no_tokenizer_files_is_an_error_not_a_traceback(tmp_path, capsys):
    from bert_port import BertConfig, BertForSequenceClassification
    from bert_port.cli.predict import main

    BertForSequenceClassification(BertConfig.from_dict(dict(TINY, num_labels=2))).save_pretrained(tmp_path / "m")
    (tmp_path / "in.csv").write_text("text\nhello there\n")
    argv = ["--model", str(tmp_path / "m"), "--input", str(tmp_path / "in.csv"), "--output", str(tmp_path / "o.csv")]
    assert main([*argv, "--max-length", "16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "vocab.txt" in err and not (tmp_path / "o.csv").exists()


# -----------------------------------------------------------------------------------------
# Issue 22: outputs touch only their own files; labels; resume on changed data; a full disk


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
