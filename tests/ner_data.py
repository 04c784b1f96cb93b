"""Shared by the token-classification tests (test_token_classification*.py): the rule-tagged
`sms_ner` splits written as CoNLL and JSONL, the tiny checkpoint, the fine-tuning arguments, the
prediction inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_checkpoint

from bert_port.data import builtin_splits
from bert_port.tagged import TaggedDataset, write_conll

REPO = Path(__file__).resolve().parent.parent
STRATEGIES = ("none", "simple", "first", "average", "max")


def first(ds: TaggedDataset, n: int) -> TaggedDataset:
    return ds.subset(range(min(n, len(ds))))


def write_jsonl(ds: TaggedDataset, path: Path) -> Path:
    path.write_text("".join(json.dumps({"tokens": w, "tags": t}) + "\n" for w, t in zip(ds.words, ds.labels)))
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, minilm_path) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), minilm_path)  # TINY, dropout 0.1


@pytest.fixture(scope="module")
def splits() -> dict[str, TaggedDataset]:
    return builtin_splits("sms_ner")


@pytest.fixture(scope="module")
def files(tmp_path_factory, splits) -> dict[str, Path]:
    """256 training messages as CoNLL, 48 validation ones as JSONL (both readers); for the short
    runs, 40 training messages and 16 validation ones whose tags those 40 hold."""
    root = tmp_path_factory.mktemp("ner")
    small = first(splits["train"], 40)
    seen = {tag for tags in small.labels for tag in tags}
    validation = splits["validation"]
    fits = validation.subset([i for i, tags in enumerate(validation.labels) if set(tags) <= seen][:16])
    return {
        "train": write_conll(first(splits["train"], 256), root / "train.conll"),
        "validation": write_jsonl(first(validation, 48), root / "validation.jsonl"),
        "small": write_conll(small, root / "small.conll"),
        "small_validation": write_conll(fits, root / "small_validation.conll"),
    }


def ner_args(files, ckpt, out, *extra) -> list:
    return [
        *("--checkpoint", ckpt, "--problem-type", "token_classification", "--device", "cpu"),
        *("--train", files["train"], "--validation", files["validation"], "--output-dir", out),
        *("--max-length", "32", "--batch-size", "8", "--lr", "5e-3", "--warmup-steps", "4"),
        *extra,
    ]


@pytest.fixture(scope="module")
def predict_inputs(tmp_path_factory, splits) -> dict[str, Path]:
    """Real test messages: as plain text, and pre-split (CoNLL words with their tags, and JSONL `tokens`)."""
    root = tmp_path_factory.mktemp("predict")
    texts = [t for t in builtin_splits("sms")["test"].texts if len(t) < 120][:24]
    texts.append("naïve café: £1.50 at 8am ☃ isn't it")  # accents, [UNK], a split word
    (root / "texts.txt").write_text("\n".join(texts) + "\n\n", encoding="utf-8")
    words = first(splits["test"], 24)
    words = words.subset([i for i, w in enumerate(words.words) if len(w) < 30])
    return {"texts": root / "texts.txt", "words": write_conll(words, root / "words.conll")}
