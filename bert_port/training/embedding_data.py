"""The rows an embedding-training run reads, and how it evaluates on them.

Files are read by the fine-tuning readers (`records.read_records`: CSV and TSV with a header,
JSONL; strict quoting, UTF-8, line numbers in every message), or by pyarrow for Parquet
(numbers are then row numbers, from 1). A row is a tuple of texts in the loss's column order
(anchor, positive, negatives...) with, for scored pairs, the score last as a float. Every
score must be a finite float32: a NaN or infinite score would train every weight to NaN.

Evaluation follows what a sentence-transformers user writes for the same rows: scored pairs
go to `EmbeddingSimilarityEvaluator` (`retrieval.similarity_metrics`), other rows to
`InformationRetrievalEvaluator` (`retrieval.retrieval_metrics`), each distinct anchor a query
whose relevant documents are its positives, the corpus every distinct positive and negative.
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

from ..records import FORMATS, DataError, _Column, read_records
from .retrieval import retrieval_metrics, similarity_metrics

PARQUET = (".parquet", ".pq")
RETRIEVAL_HEADLINE = ("cosine_mrr@10", "cosine_ndcg@10", "cosine_recall@1", "cosine_recall@10")
SIMILARITY_HEADLINE = ("spearman_cosine", "pearson_cosine")


def read_rows(path: str | os.PathLike) -> tuple[list[dict], list[int]]:
    """The rows of a data file as dicts, with each one's line (row, for Parquet) number."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in PARQUET:
        return _read_parquet(path)
    if suffix not in FORMATS:
        raise DataError(
            f"{path}: unknown data format {suffix or '(no extension)'!r}; name the file .csv, .tsv, .jsonl or .parquet"
        )
    return read_records(path)


def _read_parquet(path: Path) -> tuple[list[dict], list[int]]:
    if path.is_dir() or not path.is_file():
        what = "is a directory, not a data file" if path.is_dir() else "does not exist"
        raise DataError(f"data file {path} {what}; check the path given to --train/--validation/--test")
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading Parquet needs pyarrow (pip install pyarrow); or save it as .csv or .jsonl"
        ) from None
    try:  # one file, read on this thread: `read_table`'s dataset layer can stall in its thread pool
        with open(path, "rb") as f:
            rows = pq.ParquetFile(f).read(use_threads=False).to_pylist()
    except (pyarrow.ArrowException, OSError) as exc:
        raise DataError(f"cannot read {path} as Parquet ({str(exc)[:200]}); check that it is a Parquet file") from None
    if not rows:
        raise DataError(f"{path} has no data rows; it needs at least one")
    return rows, list(range(1, len(rows) + 1))


def load_rows(path: str | os.PathLike, columns: list[str], score_column: str | None) -> list[tuple]:
    """The rows of `path`: the texts of `columns` (anchor, positive, negatives), then the
    score of `score_column` when given. One `DataError` names the file, the rows and the fix."""
    records, lines = read_rows(path)
    present = list(dict.fromkeys(name for record in records for name in record))
    flags = ["--anchor-column", "--positive-column"] + ["--negative-column"] * (len(columns) - 2)
    for flag, name in [*zip(flags, columns), ("--score-column", score_column)]:
        if name is not None and name not in present:
            raise DataError(
                f"{path} has no column {name!r} (its columns: {', '.join(map(repr, present))}); "
                f"pass the right name with {flag}"
            )
    read = _Column(path, records, lines)
    texts = [read.values(name, "text") for name in columns]
    rows = list(zip(*texts))
    if score_column is None:
        return rows
    scores = read_scores(path, records, lines, score_column)
    return [(*row, score) for row, score in zip(rows, scores)]


def read_scores(path, records: list[dict], lines: list[int], name: str) -> list[float]:
    """Each row's score as a float; every row that is empty, not a number or not finite (in
    float32, the precision the loss computes in) is named in one `DataError`."""
    scores, bad = [], []
    for record, line in zip(records, lines):
        value = record.get(name)
        try:
            score = float(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else math.nan
        except ValueError:
            score = math.nan
        if not finite_float32(score):
            bad.append(f"line {line} ({value!r})")
        scores.append(score)
    if bad:
        raise DataError(
            f"{path}: {len(bad)} row(s) hold a score in column {name!r} that is not a finite number: "
            f"{', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}; give every pair a finite score (e.g. 0.75)"
        )
    return scores


def finite_float32(x: float) -> bool:
    """A finite number that float32 holds (3.4e38 and beyond become inf there)."""
    return math.isfinite(x) and abs(x) <= 3.4028234663852886e38


def dialog_rows() -> list[tuple]:
    """The bundled movie-dialog (statement, reply) pairs (`embedding.load_dialog_pairs`)."""
    from .embedding import load_dialog_pairs

    return load_dialog_pairs()


def split_pairs(pairs: list, test_pairs: int, seed: int, max_train: int | None) -> tuple[list, list]:
    """(train, held out): one seeded shuffle, the first `test_pairs` held out."""
    if len(pairs) <= test_pairs:
        raise DataError(
            f"{len(pairs)} rows leave nothing to train on after {test_pairs} held-out rows; lower --test-pairs"
        )
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    test = [pairs[i] for i in order[:test_pairs]]
    train = [pairs[i] for i in order[test_pairs:]]
    return (train if max_train is None else train[:max_train]), test


def retrieval_task(rows: list[tuple]) -> tuple[dict, dict, dict]:
    """(queries, corpus, relevant_docs) for `InformationRetrievalEvaluator`: each distinct anchor
    must find its positives among every distinct positive and hard negative of `rows`."""
    corpus_ids: dict[str, str] = {}
    for row in rows:
        for text in row[1:]:
            corpus_ids.setdefault(text, f"d{len(corpus_ids)}")
    query_ids: dict[str, str] = {}
    relevant: dict[str, set[str]] = {}
    for anchor, positive, *_ in rows:
        qid = query_ids.setdefault(anchor, f"q{len(query_ids)}")
        relevant.setdefault(qid, set()).add(corpus_ids[positive])
    queries = {qid: text for text, qid in query_ids.items()}
    corpus = {cid: text for text, cid in corpus_ids.items()}
    return queries, corpus, relevant


def evaluate_rows(encoder, rows: list[tuple], scored: bool) -> dict[str, float]:
    """Similarity of scored pairs, or retrieval of each anchor's positives (see the docstring)."""
    if scored:
        return similarity_metrics(encoder, [r[0] for r in rows], [r[1] for r in rows], [r[-1] for r in rows])
    return retrieval_metrics(encoder, *retrieval_task(rows), batch_size=128)
