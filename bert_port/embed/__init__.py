"""Embedding a whole corpus with a checkpoint's sentence-transformers pipeline
(`bert-port-embed`): streaming input (`corpus`), per-shard batching and the model (`run`),
the run from checks to final index (`job`); the output folder's read side lives below, in
`bert_port.embedding_store` (re-exported here)."""

from __future__ import annotations

from ..embedding_store import read_embeddings, read_index
from .corpus import Columns, EmbedError, Record, records, scan
from .job import embed_corpus, execute, prepare
from .run import Options, Summary

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
