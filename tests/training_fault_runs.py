"""Shared by the fine-tuning fault tests (test_training_faults.py, test_training_data_faults.py,
test_training_kills.py): a tiny random BERT with the real MiniLM tokenizer, small CSV data, the
run's temporaries, and the checks that a run was refused (exit 2, one line, no traceback)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import TINY

from bert_port import BertConfig, BertModel
from bert_port.checkpoint import TEMPORARY

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
