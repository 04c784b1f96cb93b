"""Fault injection for `bert-port-finetune`, continued (test_training_faults.py): data files
(strict CSV, nothing swallowed, long fields, typed errors) and settings (every nonsense value
refused up front), each refused before any work with exit status 2 and one line."""

# ruff: noqa: F811  (fixtures imported from training_fault_runs, which pytest passes by name)

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import finetune_args, metrics_of, run_finetune
from training_fault_runs import WORDS, _csv, _rows, assert_refused, assert_usage_error, ckpt, data  # noqa: F401  (fixtures)

from bert_port.cli import finetune as finetune_cli
from bert_port.data import DataError, load_texts

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
        "--max-length 1024 exceeds the longest sequence the model encodes (64 tokens",
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
