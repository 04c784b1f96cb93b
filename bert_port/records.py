"""Labelled text records: CSV/TSV/JSONL readers and one writer (`write_records`), label maps,
and seeded splits of a `TextDataset`.

Every problem with a data file raises `DataError`: the file, what is wrong, what to do.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .storage.staging import atomic_write

log = logging.getLogger(__name__)

# How a label cell is read (`ProblemType.label_kind`): a class name, a number, a set of class names.
LABEL_KINDS = {
    "class": ((str, int), "a string or an integer"),
    "float": ((str, int, float), "a number"),
    "multi": ((str, list), "a list of labels or a string of labels separated by '|'"),
}
LABEL_SEPARATOR = "|"  # between the labels of one multi-label example in a CSV/TSV cell
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)  # train, validation, test
FORMATS = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl"}


class DataError(ValueError):
    """A data file or column that cannot be used; the message says what to do."""


def parse_json_line(line: str, where: str, error: type[ValueError] = DataError) -> dict:
    """One .jsonl line as the JSON object it must be, else `error` naming `where` and the fault."""
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as exc:
        why = f"not valid JSON ({exc.msg})" if isinstance(exc, json.JSONDecodeError) else "JSON nested too deeply"
        raise error(f"{where}: {why}; a .jsonl file holds one JSON object per line") from None
    if not isinstance(obj, dict):
        raise error(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


@dataclass
class TextDataset:
    """Texts (and optional second segments) with their labels as strings (a number's
    `repr` for regression; the sorted labels joined by "|" for multi-label). `rows` keeps the
    1-based line (CSV/TSV: data row + 1 for the header) or JSONL line of each example, for
    error messages; `records` the full input rows (for `bert-port-predict` to pass through)."""

    texts: list[str]
    labels: list[str] | None = None
    pairs: list[str] | None = None
    source: str = ""
    rows: list[int] = field(default_factory=list)
    records: list[dict] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.texts)

    def subset(self, indices: Sequence[int], source: str | None = None) -> TextDataset:
        pick = lambda xs: None if xs is None else [xs[i] for i in indices]
        return TextDataset(
            texts=pick(self.texts),
            labels=pick(self.labels),
            pairs=pick(self.pairs),
            source=source or self.source,
            rows=[self.rows[i] for i in indices] if self.rows else [],
            records=pick(self.records),
        )


# -----------------------------------------------------------------------------------------
# Reading files


def file_format(path: str | os.PathLike) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise DataError(
            f"{path}: unknown data format {suffix or '(no extension)'!r}; name the file .csv, .tsv or .jsonl "
            "(one JSON object per line)"
        )
    return FORMATS[suffix]


def read_text(path: Path) -> str:
    """The text of a data file, or `DataError` when it is missing, a folder, unreadable or not UTF-8."""
    if path.is_dir():
        raise DataError(f"{path} is a directory, not a data file; pass the path of a data file")
    if not path.is_file():
        raise DataError(f"data file {path} does not exist; check the path given to --train/--validation/--test")
    try:
        return path.read_text(encoding="utf-8-sig")  # -sig: tolerate the BOM that spreadsheet exports add
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 ({exc}); re-save it as UTF-8") from None
    except OSError as exc:
        raise DataError(f"cannot read {path} ({exc.strerror}); check its permissions") from None


def read_records(path: str | os.PathLike) -> tuple[list[dict], list[int]]:
    """Rows of a CSV (header row), TSV (header row) or JSONL file as dicts, with the line
    number of each. Raises `DataError` for a missing, unreadable, empty or malformed file.

    CSV/TSV are parsed strictly: an unterminated quote is an error rather than a field
    that silently runs to the end of the file, and a field may be as long as the file."""
    path = Path(path)
    fmt = file_format(path)
    text = read_text(path)
    records: list[dict] = []
    lines: list[int] = []
    if fmt == "jsonl":
        # split("\n"), not splitlines(): U+2028 and friends may sit unescaped inside JSON strings.
        for lineno, line in enumerate(text.split("\n"), start=1):
            line = line.removesuffix("\r")
            if not line.strip():
                continue
            records.append(parse_json_line(line, f"{path}, line {lineno}", DataError))
            lines.append(lineno)
    else:
        records, lines = _read_delimited(path, text, "," if fmt == "csv" else "\t")
    if not records:
        raise DataError(f"{path} has no data rows; it needs at least one example below the header")
    return records, lines


def _read_delimited(path: Path, text: str, delimiter: str) -> tuple[list[dict], list[int]]:
    # newline="": the csv module does its own line handling (quoted fields may hold newlines).
    # strict=True: a quote left open is an error, not a field that swallows the rest of the file.
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
    records: list[dict] = []
    lines: list[int] = []
    # The limit is process-wide (csv has no per-reader one); no field can be longer than the text.
    limit = csv.field_size_limit()
    csv.field_size_limit(max(limit, len(text) + 1))
    start = 1  # the line the row being read starts on
    try:
        if reader.fieldnames is None:
            raise DataError(f"{path} is empty; it needs a header row naming the columns and at least one data row")
        repeated = sorted(name for name, n in Counter(reader.fieldnames).items() if n > 1)
        if repeated:
            raise DataError(
                f"{path}: the header names column(s) {', '.join(map(repr, repeated))} more than once; "
                "give every column its own name"
            )
        start = reader.line_num + 1
        for record in reader:
            if None in record:  # more fields than header names
                raise DataError(
                    f"{path}, line {reader.line_num}: {len(record) - 1 + len(record[None])} fields but the header "
                    f"has {len(reader.fieldnames)}; quote fields that contain the delimiter"
                )
            records.append(record)
            lines.append(reader.line_num)
            start = reader.line_num + 1
    except csv.Error as exc:
        if "end of data" in str(exc):
            raise DataError(
                f"{path}, line {start}: a quoted field opened in the row starting on this line is never "
                "closed (it would run to the end of the file); close the quote, or double quotes that "
                'are part of the text ("")'
            ) from None
        raise DataError(
            f"{path}, line {start}: malformed {'CSV' if delimiter == ',' else 'TSV'} ({exc}); "
            'a field that holds quotes must be quoted as a whole, with inner quotes doubled ("")'
        ) from None
    finally:
        csv.field_size_limit(limit)
    return records, lines


def _columns(records: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for record in records:
        seen.update(dict.fromkeys(record))
    return list(seen)


def load_texts(
    path: str | os.PathLike,
    text_column: str = "text",
    label_column: str | None = "label",
    text_pair_column: str | None = None,
    keep_records: bool = False,
    label_kind: str = "class",
) -> TextDataset:
    """Read a labelled (or, with `label_column=None`, unlabelled) file. Labels are kept as
    strings without the whitespace around them (`1`, `"1"` and `" 1"` are the same label).
    `label_kind` "float" reads a number per row (regression), "multi" a set of labels per row
    (multi-label: a JSON list, or labels separated by "|"; empty for none). Raises
    `DataError` for a missing column or a row without text or label."""
    records, lines = read_records(path)
    columns = _columns(records)
    wanted = {"--text-column": text_column, "--text-pair-column": text_pair_column, "--label-column": label_column}
    for flag, name in wanted.items():
        if name is not None and name not in columns:
            raise DataError(
                f"{path} has no column {name!r} (its columns: {', '.join(map(repr, columns))}); "
                f"pass the right name with {flag}"
            )
    read = _Column(path, records, lines)
    return TextDataset(
        texts=read.values(text_column, "text"),
        labels=read.labels(label_column, label_kind) if label_column is not None else None,
        pairs=read.values(text_pair_column, "text-pair") if text_pair_column is not None else None,
        source=str(path),
        rows=lines,
        records=records if keep_records else None,
    )


@dataclass
class _Column:
    """Reads one column of the records of `path`, each row's value checked."""

    path: str | os.PathLike
    records: list[dict]
    lines: list[int]

    def values(self, name: str, what: str, label_kind: str | None = None) -> list:
        allowed, kinds = LABEL_KINDS[label_kind] if label_kind else ((str, int, float), "a string")
        values, bad = [], []
        for record, line in zip(self.records, self.lines):
            value = record.get(name)
            empty = value is None or (isinstance(value, str) and not value.strip())
            # An empty set of labels is a valid multi-label example; a missing column is not.
            if empty and not (label_kind == "multi" and value is not None):
                bad.append(line)
            elif not isinstance(value, str) and (isinstance(value, bool) or not isinstance(value, allowed)):
                # JSONL: 1.0 would become a label "1.0" distinct from "1", a list its repr.
                raise DataError(
                    f"{self.path}, line {line}: the {what} column {name!r} holds {json.dumps(value)[:80]} "
                    f"({type(value).__name__}); it must be {kinds}"
                )
            values.append(value if isinstance(value, list) else "" if value is None else str(value))
        if bad:
            raise DataError(
                f"{self.path}: {len(bad)} row(s) have an empty {what} column {name!r} (line(s) "
                f"{', '.join(map(str, bad[:10]))}{', ...' if len(bad) > 10 else ''}); fill them in or "
                "remove those rows"
            )
        return values

    def labels(self, name: str, label_kind: str) -> list[str]:
        values = self.values(name, "label", label_kind)
        for value, line in zip(values, self.lines):
            if isinstance(value, str) and ("\n" in value or "\r" in value):
                # Almost always a quote left open in the file, not a real label.
                shown = f"{value[:60]!r}{'...' if len(value) > 60 else ''}"
                raise DataError(
                    f"{self.path}, line {line}: the label {shown} spans several lines; labels are one line "
                    "each. Look for an unbalanced quote on or before that line"
                )
        if label_kind == "float":
            return [_number_label(value, self.path, line) for value, line in zip(values, self.lines)]
        if label_kind == "multi":
            return [_label_set(value, self.path, line) for value, line in zip(values, self.lines)]
        # " 1" and "1" are one class: spreadsheets and hand-edited CSVs pad cells.
        return [value.strip() for value in values]


def _number_label(value: str, path, line: int) -> str:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise DataError(
            f"{path}, line {line}: the label {value[:60]!r} is not a finite number; --problem-type regression "
            "needs a number in every row"
        )
    return repr(number)


def _label_set(value: str | list, path, line: int) -> str:
    """The canonical form of one multi-label example: its sorted labels joined by "|"."""
    parts = value if isinstance(value, list) else value.split(LABEL_SEPARATOR)
    if any(not isinstance(p, (str, int)) or isinstance(p, bool) or LABEL_SEPARATOR in str(p) for p in parts):
        raise DataError(
            f"{path}, line {line}: the labels {json.dumps(value)[:80]} must be names (strings or integers) "
            f"without '{LABEL_SEPARATOR}'"
        )
    return LABEL_SEPARATOR.join(sorted({str(p).strip() for p in parts} - {""}))


def label_set(label: str) -> list[str]:
    """The labels of one multi-label example (the inverse of the canonical form)."""
    return label.split(LABEL_SEPARATOR) if label else []


def write_texts(dataset: TextDataset, path: str | os.PathLike) -> Path:
    """Write `text`, (`text_pair`,) `label` columns as CSV, TSV or JSONL (by extension)."""
    columns = {"text": dataset.texts}
    if dataset.pairs is not None:
        columns["text_pair"] = dataset.pairs
    if dataset.labels is not None:
        columns["label"] = dataset.labels
    return write_records([dict(zip(columns, values)) for values in zip(*columns.values())], path, list(columns))


def write_records(records: Sequence[dict], path: str | os.PathLike, columns: Sequence[str] | None = None) -> Path:
    """Write `records` as CSV or TSV (a header of `columns`, default every key in order of
    first appearance; a missing value is an empty cell) or as JSONL (each record whole), by
    the extension of `path`. The file is written under a temporary name and renamed into
    place (`storage.staging.atomic_write`): a killed or failed write leaves the previous file."""
    path = Path(path)
    fmt = file_format(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp, open(tmp, "w", encoding="utf-8", newline="") as f:
        if fmt == "jsonl":
            f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
        else:
            names = list(columns) if columns is not None else _columns(list(records))
            writer = csv.DictWriter(f, fieldnames=names, delimiter="," if fmt == "csv" else "\t")
            writer.writeheader()
            writer.writerows(records)
    return path


# -----------------------------------------------------------------------------------------
# Labels


def label_names(labels: Sequence[str]) -> list[str]:
    """The label map, as id -> name order: numeric order when every label is an integer
    (so `0`/`1` files keep their ids), else sorted by name."""
    distinct = set(labels)
    try:
        return sorted(distinct, key=int)
    except ValueError:
        return sorted(distinct)


# -----------------------------------------------------------------------------------------
# Splits


def split_sizes(n: int, fractions: Sequence[float] = SPLIT_FRACTIONS) -> list[int]:
    """Sizes of consecutive parts of `n` rows: every part but the last rounds down."""
    sizes = [int(n * f) for f in fractions[:-1]]
    return sizes + [n - sum(sizes)]


def shuffled_split(dataset: TextDataset, fractions: Sequence[float], seed: int, names: Sequence[str]) -> dict:
    """Shuffle with `random.Random(seed)` (stable across Python versions) and cut into
    consecutive parts named `names`."""
    order = list(range(len(dataset)))
    random.Random(seed).shuffle(order)
    parts, start = {}, 0
    for name, size in zip(names, split_sizes(len(order), fractions)):
        parts[name] = dataset.subset(order[start : start + size], source=f"{dataset.source} [{name} split]")
        start += size
    return parts


def validation_split(train: TextDataset, fraction: float, seed: int) -> tuple[TextDataset, TextDataset]:
    """Hold out `fraction` of `train` (seeded) when no validation file is given."""
    if not 0.0 < fraction < 1.0:
        raise DataError(f"--validation-split must be between 0 and 1, got {fraction}")
    parts = shuffled_split(train, (1.0 - fraction, fraction), seed, ("train", "validation"))
    if len(parts["validation"]) == 0 or len(parts["train"]) == 0:
        raise DataError(
            f"{train.source} has {len(train)} example(s): too few to hold out {fraction:.0%} for "
            "validation; pass a --validation file or more data"
        )
    return parts["train"], parts["validation"]
