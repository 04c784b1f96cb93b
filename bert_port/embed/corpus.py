"""The corpus of `bert-port-embed`, read as a stream of `Record`s: JSONL (one object per line),
CSV/TSV (a header row) or plain text (one text per line, its id the 1-based line number; blank
lines are skipped).

`scan` reads the whole file once before any work starts, so that every bad line is refused
before anything is written: it counts the texts, checks each record, fingerprints the bytes
(resume must not mix two versions of a file) and finds repeated ids. Its memory is one 64-bit
hash per text (duplicate ids need every id seen; a hash is an eighth of a short string's
cost), everything else streams. `records` then streams the texts for the run.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..data import parse_json_line
from ..embedding_store import EmbedError

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".txt": "text"}
_LINE_IDS = "line"  # the id column of plain text: ids are line numbers


@dataclass(frozen=True)
class Columns:
    """Where a record's id, text and optional second segment are (JSON fields or CSV columns)."""

    id: str = "id"
    text: str = "text"
    pair: str | None = None


@dataclass(frozen=True)
class Record:
    line: int  # 1-based line the record starts on, for messages
    id: str | int
    text: str
    pair: str | None = None


@dataclass(frozen=True)
class Scan:
    """What one pass over the input found: its format, how many texts, a digest of its bytes."""

    path: Path
    format: str
    count: int
    digest: str


def input_format(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise EmbedError(
            f"{path}: unknown input format {path.suffix or '(no extension)'!r}; name it .jsonl, .csv, .tsv or .txt"
        )
    return fmt


def _lines(path: Path, digest) -> Iterator[tuple[int, str]]:
    """(1-based line number, decoded line without its end), hashing the raw bytes as they pass."""
    try:
        f = open(path, "rb")  # noqa: SIM115 -- closed in finally; a generator holds it open
    except FileNotFoundError:
        raise EmbedError(f"input file {path} does not exist; check the path given as INPUT") from None
    except OSError as exc:
        raise EmbedError(f"cannot read {path} ({exc.strerror}); check its permissions") from None
    try:
        for number, raw in enumerate(f, start=1):
            if digest is not None:
                digest.update(raw)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise EmbedError(
                    f"{path}, line {number}: not UTF-8 ({exc.reason}); re-save the file as UTF-8"
                ) from None
            if number == 1:
                text = text.removeprefix("\ufeff")  # the BOM spreadsheet exports add
            yield number, text.removesuffix("\n").removesuffix("\r")
    finally:
        f.close()


def _field(obj: dict, name: str, what: str, where: str, optional: bool = False):
    value = obj.get(name)
    if value is None and optional:
        return None
    if value is None:
        raise EmbedError(
            f"{where}: no {what} field {name!r} (fields: {', '.join(map(repr, obj)) or 'none'}); "
            f"add it, or name the field with --{what}-column"
        )
    if what == "id" and not (isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))):
        raise EmbedError(f"{where}: id {value!r} is a {type(value).__name__}; ids must be strings or integers")
    if what != "id" and not isinstance(value, str):
        raise EmbedError(f"{where}: the {what} field {name!r} holds a {type(value).__name__}, not a string")
    return value


def _jsonl(path: Path, columns: Columns, digest) -> Iterator[Record]:
    for number, line in _lines(path, digest):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        obj = parse_json_line(line, where, EmbedError)
        pair = _field(obj, columns.pair, "pair", where) if columns.pair else None
        yield Record(number, _field(obj, columns.id, "id", where), _field(obj, columns.text, "text", where), pair)


def _delimited(path: Path, columns: Columns, digest, delimiter: str) -> Iterator[Record]:
    lines = (line + "\n" for _, line in _lines(path, digest))
    reader = csv.DictReader(lines, delimiter=delimiter, strict=True)
    limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)  # process-wide; restored below. A text may be long.
    try:
        if reader.fieldnames is None:
            return
        wanted = [c for c in (columns.id, columns.text, columns.pair) if c]
        missing = [c for c in wanted if c not in reader.fieldnames]
        if missing:
            raise EmbedError(
                f"{path}: no column {', '.join(map(repr, missing))} in the header ({', '.join(reader.fieldnames)}); "
                "name the columns with --id-column, --text-column and --pair-column"
            )
        start = 2
        for row in reader:
            if None in row:
                raise EmbedError(
                    f"{path}, line {start}: more fields than the header; quote fields holding the delimiter"
                )
            pair = row[columns.pair] if columns.pair else None
            yield Record(start, row[columns.id], row[columns.text] or "", pair)
            start = reader.line_num + 1
    except csv.Error as exc:
        raise EmbedError(f"{path}, line {reader.line_num}: malformed {delimiter!r}-separated row ({exc})") from None
    finally:
        csv.field_size_limit(limit)


def _text(path: Path, digest) -> Iterator[Record]:
    for number, line in _lines(path, digest):
        if line.strip():
            yield Record(number, number, line)


def records(path: str | os.PathLike, columns: Columns = Columns(), digest=None) -> Iterator[Record]:
    """The records of `path` in file order; `digest` (a hashlib object) is fed every raw byte."""
    path = Path(path)
    fmt = input_format(path)
    if path.is_dir():
        raise EmbedError(f"{path} is a directory; pass a .jsonl, .csv, .tsv or .txt file as INPUT")
    if fmt == "jsonl":
        return _jsonl(path, columns, digest)
    if fmt == "text":
        return _text(path, digest)
    return _delimited(path, columns, digest, "," if fmt == "csv" else "\t")


def _id_hash(value: str | int) -> int:
    key = json.dumps(value).encode("utf-8")  # 1 and "1" are different ids
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little", signed=True)


def scan(path: str | os.PathLike, columns: Columns = Columns()) -> Scan:
    """Read the whole input once: every record checked, texts counted, bytes hashed (sha256),
    repeated ids refused with their line numbers. Raises `EmbedError` for a missing, empty or
    malformed file."""
    path = Path(path)
    digest = hashlib.sha256()
    hashes = array("q")
    for record in records(path, columns, digest):
        hashes.append(_id_hash(record.id))
    if not hashes:
        raise EmbedError(f"{path} holds no texts; give a file with at least one")
    if input_format(path) != "text":
        _refuse_duplicates(path, columns, hashes)
    return Scan(path, input_format(path), len(hashes), digest.hexdigest())


def _refuse_duplicates(path: Path, columns: Columns, hashes: array) -> None:
    """Raise naming the first repeated id and its lines; hashes only flag candidates, which a
    second pass confirms on the ids themselves."""
    import numpy as np

    values = np.frombuffer(hashes, dtype=np.int64)
    ordered = np.sort(values)
    repeated = set(ordered[1:][ordered[1:] == ordered[:-1]].tolist())
    if not repeated:
        return
    seen: dict = {}
    for record in records(path, columns):
        if _id_hash(record.id) in repeated:
            seen.setdefault(json.dumps(record.id), []).append(record.line)
    clashes = {key: lines for key, lines in seen.items() if len(lines) > 1}
    if clashes:
        key, lines = next(iter(clashes.items()))
        more = f" ({len(clashes) - 1} more repeated ids)" if len(clashes) > 1 else ""
        raise EmbedError(
            f"{path}: id {key} appears on lines {', '.join(map(str, lines[:10]))}{more}; ids must be unique, "
            "so that each embedding can be found by its id. Remove or rename the repeats"
        )


def describe(columns: Columns, fmt: str) -> dict:
    """The columns as the index records them (plain text has line-number ids)."""
    if fmt == "text":
        return {"id": _LINE_IDS, "text": None, "pair": None}
    return {"id": columns.id, "text": columns.text, "pair": columns.pair}
