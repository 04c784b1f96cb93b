"""Word-tagged text for token classification (NER): the CoNLL and JSONL readers, a CoNLL
writer, the BIO check, the tag map, and the inputs of `bert-port-predict` for a tagger (the
alignment of word tags to word pieces is `training.batching.align_labels`).

Training files, by extension (every problem raises `data.DataError`: the file, the line, what to do):
  - CoNLL (`.conll`, `.iob`, `.iob2`, `.bio`): one word per line, the word in the first column and
    its tag in the last (tab-separated when the line holds a tab, so words may hold spaces, else
    whitespace-separated; middle columns, such as CoNLL-2003's POS and chunk tags, are
    ignored), a blank line between sentences, `-DOCSTART-` lines skipped.
  - JSONL (`.jsonl`, `.ndjson`): one object per sentence, `tokens` (its words) and `tags` (one per word).
Tags are BIO: `O`, `B-TYPE` or `I-TYPE` (IOB2, or IOB1 where `I-` may open an entity), as
seqeval's default mode and transformers' pipeline read them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from .records import FORMATS, DataError, load_texts, read_records, read_text, write_texts
from .storage.staging import atomic_write

CONLL_SUFFIXES = (".conll", ".iob", ".iob2", ".bio")
TEXT_SUFFIXES = (".txt",)  # bert-port-predict: plain text, one text per line
DOCSTART = "-DOCSTART-"
WORDS_KEY, TAGS_KEY = "tokens", "tags"  # the JSONL keys, as in the HF datasets of CoNLL-2003
_BIO = re.compile(r"O|[BI]-\S+")


@dataclass
class TaggedDataset:
    """Sentences as lists of words, with one tag per word (`labels`; None when read without
    tags). `rows` holds the line each sentence starts on, for error messages."""

    words: list[list[str]]
    labels: list[list[str]] | None = None
    source: str = ""
    rows: list[int] = field(default_factory=list)
    pairs = None  # no second segment: the batching and length sorting of TextDataset apply as they are

    def __len__(self) -> int:
        return len(self.words)

    @cached_property
    def texts(self) -> list[str]:
        """Each sentence's words joined by spaces, as transformers' pipeline shows a pre-split text."""
        return [" ".join(words) for words in self.words]

    def subset(self, indices: Sequence[int], source: str | None = None) -> TaggedDataset:
        pick = lambda xs: None if xs is None else [xs[i] for i in indices]
        return TaggedDataset(
            words=pick(self.words),
            labels=pick(self.labels),
            source=source or self.source,
            rows=[self.rows[i] for i in indices] if self.rows else [],
        )


# -----------------------------------------------------------------------------------------
# Reading


def load_tagged(path: str | os.PathLike) -> TaggedDataset:
    """A tagged training file, CoNLL or JSONL by its extension, every tag checked (`check_bio`)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in CONLL_SUFFIXES:
        dataset = read_conll(path)
    elif FORMATS.get(suffix) == "jsonl":
        dataset = read_tagged_jsonl(path)
    else:
        raise DataError(
            f"{path}: token classification reads CoNLL files ({', '.join(CONLL_SUFFIXES)}: a word and its tag "
            f"per line) or JSONL ({WORDS_KEY!r} and {TAGS_KEY!r} per line); rename or convert the file"
        )
    for tags, line in zip(dataset.labels, dataset.rows):
        check_bio(tags, path, line)
    return dataset


def read_conll(path: Path, tags: bool = True) -> TaggedDataset:
    """The sentences of a CoNLL file; with `tags` every word line must hold a tag column."""
    sentences: list[tuple[list[str], list[str], int]] = []
    words, labels, start = [], [], 0
    for lineno, raw in enumerate(read_text(path).split("\n"), start=1):
        line = raw.removesuffix("\r")
        columns = [c.strip() for c in line.split("\t")] if "\t" in line else line.split()
        if not line.strip() or columns[0] == DOCSTART:
            if words:
                sentences.append((words, labels, start))
            words, labels = [], []
            continue
        if tags and (len(columns) < 2 or not columns[-1]):
            raise DataError(
                f"{path}, line {lineno}: {line[:80]!r} has no tag column; each line holds a word and its tag "
                "(whitespace- or tab-separated), with a blank line between sentences"
            )
        if not columns[0]:
            raise DataError(f"{path}, line {lineno}: the word column is empty; remove the line or fill in the word")
        start = start if words else lineno
        words.append(columns[0])
        labels.append(columns[-1])
    if words:
        sentences.append((words, labels, start))
    if not sentences:
        raise DataError(
            f"{path} holds no sentences; it needs lines of a word and its tag, a blank line between sentences"
        )
    return TaggedDataset(
        words=[s[0] for s in sentences],
        labels=[s[1] for s in sentences] if tags else None,
        source=str(path),
        rows=[s[2] for s in sentences],
    )


def read_tagged_jsonl(path: Path) -> TaggedDataset:
    """The sentences of a JSONL file of `tokens` and `tags` lists, one tag per word."""
    records, lines = read_records(path)
    words = [_strings(record, WORDS_KEY, path, line) for record, line in zip(records, lines)]
    labels = [_strings(record, TAGS_KEY, path, line) for record, line in zip(records, lines)]
    for w, t, line in zip(words, labels, lines):
        if len(w) != len(t):
            raise DataError(
                f"{path}, line {line}: {len(w)} {WORDS_KEY} but {len(t)} {TAGS_KEY}; give exactly one tag per word"
            )
    return TaggedDataset(words=words, labels=labels, source=str(path), rows=lines)


def _strings(record: dict, key: str, path: Path, line: int) -> list[str]:
    value = record.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        shown = "nothing" if value is None else repr(value)[:80]
        raise DataError(
            f"{path}, line {line}: {key!r} must be a non-empty list of non-empty strings, got {shown}; a tagged "
            f'JSONL line looks like {{"{WORDS_KEY}": ["Call", "0800"], "{TAGS_KEY}": ["O", "B-PHONE"]}}'
        )
    return value


def check_bio(tags: Iterable[str], path, line: int) -> None:
    """Every tag is `O`, `B-TYPE` or `I-TYPE`, else `DataError` naming the sentence's line."""
    bad = next((t for t in tags if not _BIO.fullmatch(t)), None)
    if bad is not None:
        raise DataError(
            f"{path}, sentence at line {line}: the tag {bad!r} is not in BIO form; tags are O, B-TYPE or I-TYPE "
            "(e.g. B-PER, I-PER). Convert other schemes (IOBES, bare types) to BIO"
        )


def tag_names(tags: Iterable[str]) -> list[str]:
    """The tag map, id -> tag: `O` first, then by entity type, `B-` before `I-`."""
    distinct = set(tags)
    return sorted(distinct, key=lambda t: (t != "O", t[2:], t[:1]))


def entity_types(names: Iterable[str]) -> list[str]:
    return sorted({name[2:] for name in names if name != "O"})


def read_tagging_inputs(path: str | os.PathLike, text_column: str = "text") -> tuple[list, list[dict]]:
    """What `bert-port-predict` tags, as (inputs, records): plain text (`.txt`, one text per
    non-blank line); CoNLL (words; a tag column is ignored); JSONL records with `tokens`
    (pre-split) or the text column; CSV/TSV with the text column. Each input is a `str` or a
    list of words; `records` holds what the output passes through."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        texts = [line.removesuffix("\r") for line in read_text(path).split("\n")]
        texts = [t for t in texts if t.strip()]
        if not texts:
            raise DataError(f"{path} holds no text; write one text per line")
        return texts, [{"text": t} for t in texts]
    if suffix in CONLL_SUFFIXES:
        words = read_conll(path, tags=False).words
        return words, [{WORDS_KEY: w} for w in words]
    if FORMATS.get(suffix) == "jsonl":
        records, lines = read_records(path)
        if all(WORDS_KEY in r for r in records):
            return [_strings(r, WORDS_KEY, path, line) for r, line in zip(records, lines)], records
    texts = load_texts(path, text_column, None, keep_records=True)
    return texts.texts, texts.records


# -----------------------------------------------------------------------------------------
# Writing


def write_conll(dataset: TaggedDataset, path: str | os.PathLike) -> Path:
    """`word<TAB>tag` lines, a blank line after each sentence, written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for words, tags in zip(dataset.words, dataset.labels):
            f.writelines(f"{w}\t{t}\n" for w, t in zip(words, tags))
            f.write("\n")
    return path


def write_split(dataset, directory: Path, split: str) -> Path:
    """A split as a file in `directory`: `split.conll` for tagged data, else `split.csv`."""
    if isinstance(dataset, TaggedDataset):
        return write_conll(dataset, Path(directory) / f"{split}.conll")
    return write_texts(dataset, Path(directory) / f"{split}.csv")
