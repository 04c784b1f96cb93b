"""No metric from nothing: data that gives no training signal is refused
with its cause, a metric over zero items is an error, and a new model's vocabulary must be
its tokenizer's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY

from bert_port.cli import pretrain as pretrain_cli
from bert_port.data import builtin_splits
from bert_port.metrics import MetricError, metrics_from_counts, multi_label_metrics, regression_metrics, tagging_metrics
from bert_port.tokenization import load_tokenizer
from bert_port.training.data_signal import check_texts
from bert_port.training.settings import FinetuneError


def _unk_tokenizer(folder: Path) -> Path:
    """A WordPiece vocabulary of special tokens and one word no MR sentence holds: every
    word of real text becomes [UNK]."""
    folder.mkdir()
    (folder / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nzzzq\n")
    return folder


@pytest.fixture(scope="module")
def lm_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nosignal")
    texts = builtin_splits("mr")["train"].texts
    (root / "train.txt").write_text("\n".join(texts[:48]) + "\n", encoding="utf-8")
    (root / "validation.txt").write_text("\n".join(texts[48:68]) + "\n", encoding="utf-8")
    (root / "six.json").write_text(json.dumps({**TINY, "vocab_size": 6}))
    (root / "big.json").write_text(json.dumps({**TINY, "vocab_size": 30522}))
    return {"root": root, "tokenizer": _unk_tokenizer(root / "unk")}


def _pretrain(lm_files, out, *extra) -> int:
    root = lm_files["root"]
    args = [
        *("--train", root / "train.txt", "--validation", root / "validation.txt", "--output-dir", out),
        *("--block-size", "32", "--batch-size", "8", "--device", "cpu", "--max-steps", "2"),
        *extra,
    ]
    return pretrain_cli.main([str(a) for a in args])


@pytest.mark.parametrize("objective", ["mlm", "clm"])
def test_pretraining_on_all_unk_text_is_refused(lm_files, tmp_path, capsys, objective):
    """A tokenizer that maps every word to [UNK]: exit 2 naming the cause, before any step
    (it used to report loss 0.0000, perplexity 1.0000 and save a "best" checkpoint)."""
    out = tmp_path / "out"
    code = _pretrain(
        lm_files,
        out,
        *("--config", lm_files["root"] / "six.json", "--tokenizer", lm_files["tokenizer"], "--objective", objective),
    )
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and "are [UNK]" in err and "\n" not in err
    assert not (out / "metrics.json").exists()


def test_config_vocabulary_larger_than_the_tokenizer_is_refused(lm_files, tmp_path, capsys):
    code = _pretrain(
        lm_files, tmp_path / "out", "--config", lm_files["root"] / "big.json", "--tokenizer", lm_files["tokenizer"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "the tokenizer has 6 tokens" in err and "set vocab_size to 6" in err, err


def test_fine_tuning_texts_must_be_mostly_known(lm_files, minilm_path):
    texts = builtin_splits("mr")["train"].texts[:50]
    with pytest.raises(FinetuneError, match="of the train tokens .* are \\[UNK\\]"):
        check_texts(load_tokenizer(lm_files["tokenizer"]), texts, "train", "mr")
    with pytest.raises(FinetuneError, match="the validation split is empty"):
        check_texts(load_tokenizer(minilm_path), [], "validation", "mr")
    with pytest.raises(FinetuneError, match="no tokens once tokenized"):
        check_texts(load_tokenizer(minilm_path), ["", " "], "train", "mr")
    check_texts(load_tokenizer(minilm_path), texts, "train", "mr")  # real text, its own vocabulary


def test_metrics_over_zero_items_raise():
    zero = torch.zeros(3)
    with pytest.raises(MetricError, match="zero examples"):
        metrics_from_counts(zero, zero, zero, 0.0, ["a", "b", "c"])
    with pytest.raises(MetricError, match="zero examples"):
        multi_label_metrics(zero, zero, zero, 0.0, 0, 0.0, ["a", "b", "c"])
    with pytest.raises(MetricError, match="zero examples"):
        regression_metrics(torch.zeros(0), torch.zeros(0), 0.0)
    with pytest.raises(MetricError, match="zero tagged words"):
        tagging_metrics([[]], [[]], 0.0)
