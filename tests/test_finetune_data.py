"""bert-port-finetune's data: the bundled splits, files in every format, the exported split,
the shipped recipes, flags over a config file, and a clear error for each kind of bad data
(and for bert-port-predict's bad input)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import run_finetune

from bert_port.assets import config_dir
from bert_port.cli import finetune as finetune_cli
from bert_port.cli import predict as predict_cli
from bert_port.data import builtin_splits, load_mr, load_sms, write_texts
from bert_port.training import FinetuneConfig, load_config_file

CONFIGS = config_dir()


def test_bundled_splits_are_fixed_documented_and_disjoint():
    mr = builtin_splits("mr")
    assert {k: len(v) for k, v in mr.items()} == {"train": 8452, "validation": 1056, "test": 1058}
    assert len(load_mr()) == 10566 and set(mr["train"].labels) == {"negative", "positive"}
    assert mr["train"].texts[:3] == builtin_splits("mr")["train"].texts[:3]  # seeded, not random
    sms = builtin_splits("sms")
    assert {k: len(v) for k, v in sms.items()} == {"train": 3616, "validation": 452, "test": 453}
    assert len(load_sms()) == 4521 and set(sms["test"].labels) == {"ham", "spam"}
    for splits in (mr, sms):
        train, val, test = (set(splits[k].texts) for k in ("train", "validation", "test"))
        assert not (train & val) and not (train & test) and not (val & test)
    texts = load_sms().texts  # Windows-1252 punctuation decoded, no C1 control characters left
    assert any("that’s" in t for t in texts) and not any("\x80" <= c <= "\x9f" for t in texts for c in t)
    # The MR file: label = sign of the score; the first sentence is positive (2.27).
    assert load_mr().texts[0].startswith("The Rock is destined") and load_mr().labels[0] == "positive"


def test_files_round_trip_in_every_format(tmp_path):
    from bert_port.data import TextDataset, load_texts

    texts = ['quotes "inside", a comma', "a newline\nand a\ttab", "unicode \u2028 separator, café"]
    dataset = TextDataset(texts=texts, labels=["1", "0", "1"], pairs=["x", "y", "z"])
    for suffix in (".csv", ".tsv", ".jsonl"):
        back = load_texts(write_texts(dataset, tmp_path / f"d{suffix}"), text_pair_column="text_pair")
        assert (back.texts, back.pairs, back.labels) == (dataset.texts, dataset.pairs, dataset.labels), suffix


def test_export_dataset_writes_the_split(tmp_path, capsys):
    assert run_finetune("--dataset", "sms", "--export-dataset", tmp_path) == 0
    rows = list(csv.DictReader((tmp_path / "test.csv").open(encoding="utf-8")))
    assert len(rows) == 453 and rows[0]["text"] == builtin_splits("sms")["test"].texts[0]


def test_shipped_configs_are_valid():
    shipped = sorted(CONFIGS.glob("finetune_*.json"))
    assert len(shipped) >= 3
    for path in shipped:
        settings = load_config_file(path)
        cfg = FinetuneConfig(**settings)
        cfg.validate()
        assert cfg.dataset in ("mr", "mr_scores", "sms", "sms_ner") and cfg.output_dir.startswith("runs/")


def test_flags_override_the_config_file(tmp_path):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"dataset": "sms", "lr": 1e-4, "epochs": 2}))
    cfg = finetune_cli.resolve_config(finetune_cli.build_parser().parse_args(["--config", str(config), "--lr", "3e-5"]))
    assert (cfg.dataset, cfg.lr, cfg.epochs) == ("sms", 3e-5, 2)


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "files, extra, message",
    [
        (
            {"train": "text,sentiment\nhello,1\nbye,0\n"},
            [],
            "has no column 'label' (its columns: 'text', 'sentiment'); pass the right name with --label-column",
        ),
        ({"train": "message,label\nhello,1\nbye,0\n"}, [], "has no column 'text'"),
        ({"train": ""}, [], "is empty; it needs a header row"),
        ({"train": "text,label\n"}, [], "has no data rows"),
        (
            {"train": "text,label\nhi,a\nyo,b\n", "validation": "text,label\nhey,a\nsup,c\nnah,c\n"},
            [],
            "the validation data has label(s) never seen in training: 'c' (2 row(s), first at line 3)",
        ),
        ({"train": "text,label\nhi,a\nyo,\n"}, [], "1 row(s) have an empty label column 'label' (line(s) 3)"),
        ({"train": "text,label\nhi,a\nyo,a\n"}, [], "every training example has the label 'a'"),
        ({"train.jsonl": '{"text": "hi", "label": 1}\nnot json\n'}, [], "line 2: not valid JSON"),
        ({"train.txt": "text,label\nhi,a\n"}, [], "unknown data format '.txt'"),
        ({}, ["--train", "nowhere.csv"], "does not exist"),
        ({}, [], "no training data: pass --train FILE"),
        (
            {"train": "text,label\nhi,a\nyo,b\n", "validation": "text,label\nhey,a\n"},
            ["--batch-size", "3", "--grad-accum-steps", "2"],
            "batch_size 3 must be a multiple of grad_accum_steps x processes = 2 x 1",
        ),
    ],
    ids=[
        "missing-label-column",
        "missing-text-column",
        "empty-file",
        "header-only",
        "unseen-validation-label",
        "empty-label",
        "one-label",
        "bad-jsonl",
        "bad-extension",
        "missing-file",
        "no-data",
        "indivisible-batch",
    ],
)
def test_bad_data_gives_a_clear_error(tmp_path, capsys, tiny_checkpoints, files, extra, message):
    args = ["--checkpoint", tiny_checkpoints["no_dropout"], "--output-dir", tmp_path / "out", "--max-length", "16"]
    for key, text in files.items():
        name = key if "." in key else f"{key}.csv"
        args += [f"--{name.split('.')[0]}", _write(tmp_path / name, text)]
    assert run_finetune(*args, *extra) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "out" / "checkpoints" / "last-checkpoint.pt").exists()


def test_predict_cli_errors(tmp_path, capsys, tiny_checkpoints):
    base = str(tiny_checkpoints["no_dropout"])  # a base checkpoint: no label map
    texts = str(_write(tmp_path / "in.csv", "message\nhello\n"))
    assert predict_cli.main(["--model", base, "--input", texts, "--output", str(tmp_path / "o.csv")]) == 2
    assert "has no column 'text'" in capsys.readouterr().err
    assert predict_cli.main(["--model", base, "--input", texts, "--output", str(tmp_path / "o.xlsx")]) == 2
    assert "unknown data format '.xlsx'" in capsys.readouterr().err
    good = str(_write(tmp_path / "ok.csv", "text\nhello\n"))
    assert predict_cli.main(["--model", base, "--input", good, "--output", str(tmp_path / "o.csv")]) == 2
    assert "not a fine-tuned classifier" in capsys.readouterr().err
