"""Embedding a whole corpus with a checkpoint's sentence-transformers pipeline
(`bert-port-embed`): streaming input (`corpus`), per-shard batching and the model (`run`),
the run from checks to final index (`job`), and the output folder's read side (`store`)."""

from __future__ import annotations

from .corpus import Columns, EmbedError, Record, records, scan
from .job import embed_corpus, execute, prepare
from .run import Options, Summary
from .store import read_embeddings, read_index

__all__ = [
    "Columns",
    "EmbedError",
    "Options",
    "Record",
    "Summary",
    "embed_corpus",
    "execute",
    "prepare",
    "read_embeddings",
    "read_index",
    "records",
    "scan",
]
