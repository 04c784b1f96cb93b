"""Token classification's bad inputs (test_token_classification.py): each an exit 2 with one
line, before any work."""

# ruff: noqa: F811  (fixtures imported from ner_data, which pytest passes by name)

from __future__ import annotations

import sys

import pytest
from conftest import TINY, run_finetune
from ner_data import ckpt, files, ner_args, predict_inputs, splits  # noqa: F401  (fixtures)

from bert_port import BertConfig
from bert_port.cli import predict as predict_cli

# -----------------------------------------------------------------------------------------
# Bad input: exit 2, one line


@pytest.mark.parametrize(
    "train, validation, extra, message",
    [
        ("call\tO\n0800\n", None, [], "line 2: '0800' has no tag column; each line holds a word and its tag"),
        ("call O\n0800 PHONE\n", None, [], "the tag 'PHONE' is not in BIO form"),
        ("", None, [], "holds no sentences"),
        ("-DOCSTART- O\n\n", None, [], "holds no sentences"),
        ("a O\nb B-X\n", "a O\nb B-Y\n\nc B-Y\n", [], "'B-Y' (2 word(s), first in the sentence at line 1)"),
        ("a O\nb O\n", "c O\n", [], "every training word is tagged 'O'"),
        ('{"tokens": ["a", "b"], "tags": ["O"]}\n', None, [], "line 1: 2 tokens but 1 tags"),
        ('{"tokens": "a b", "tags": ["O"]}\n', None, [], "'tokens' must be a non-empty list of non-empty strings"),
        ("text,label\nhi,O\n", None, [], "token classification reads CoNLL files"),
        ("a B-X\n", None, ["--text-pair-column", "b"], "--text-pair-column does not apply to token_classification"),
    ],
    ids=[
        "no-tag-column",
        "not-bio",
        "empty",
        "docstart-only",
        "unseen-validation-tag",
        "only-O",
        "jsonl-lengths",
        "jsonl-tokens-not-list",
        "csv",
        "pairs",
    ],
)
def test_bad_tagged_data_is_one_line_and_exit_2(tmp_path, capsys, ckpt, train, validation, extra, message):
    suffix = ".jsonl" if train.startswith("{") else ".csv" if train.startswith("text,") else ".conll"
    (tmp_path / f"train{suffix}").write_text(train)
    data = ["--train", tmp_path / f"train{suffix}"]
    if validation is not None:
        (tmp_path / "validation.conll").write_text(validation)
        data += ["--validation", tmp_path / "validation.conll"]
    args = [
        "--checkpoint",
        ckpt,
        "--problem-type",
        "token_classification",
        "--output-dir",
        tmp_path / "out",
        "--max-length",
        16,
    ]
    assert run_finetune(*args, *data, *extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "out" / "checkpoints" / "last-checkpoint.pt").exists()


def test_aggregation_strategy_on_a_sequence_classifier_is_refused(tmp_path, capsys, minilm_path, predict_inputs):
    from bert_port.classifier import BertForSequenceClassification

    config = BertConfig.from_dict({**TINY, "vocab_size": 30522, "id2label": {0: "ham", 1: "spam"}})
    model = BertForSequenceClassification(config)
    model.source_dir = minilm_path
    folder = model.save_pretrained(tmp_path / "classifier")
    texts = tmp_path / "in.csv"
    texts.write_text("text\nhello\n")
    args = ["--model", str(folder), "--input", str(texts), "--output", str(tmp_path / "o.csv"), "--max-length", "16"]
    assert predict_cli.main([*args, "--aggregation-strategy", "first"]) == 2
    err = capsys.readouterr().err
    assert "--aggregation-strategy applies to token-classification models" in err and err.count("\n") == 1
    assert predict_cli.main(args) == 0  # without the flag it predicts as before


def test_token_classification_without_seqeval_stops_before_any_work(tmp_path, capsys, ckpt, files, monkeypatch):
    monkeypatch.setitem(sys.modules, "seqeval", None)  # as if not installed: importing it raises ImportError
    assert run_finetune(*ner_args(files, ckpt, tmp_path / "out", "--epochs", "1")) == 2
    err = capsys.readouterr().err
    assert "needs the Python package 'seqeval'" in err and "pip install 'bert-port[ner]'" in err
    assert not (tmp_path / "out" / "checkpoints" / "last-checkpoint.pt").exists()
