"""Scores between embeddings, their quantisation and a top-k search, as sentence-transformers
computes them (`sentence_transformers.util`: `cos_sim`, `dot_score`, `euclidean_sim`,
`manhattan_sim`, their pairwise forms, `quantize_embeddings`, `semantic_search`).

The search reads the corpus a chunk at a time, so a memory-mapped array (or the shards of a
`bert-port-embed` run, one array each) is never read into memory whole.
"""

from __future__ import annotations

import heapq
import logging
import os
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .embedding_store import verified_shards

log = logging.getLogger(__name__)

PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")


def _matrix(x) -> Tensor:
    """A (N, D) float tensor of an array, tensor or list of vectors; a (D,) vector becomes (1, D)."""
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    elif not isinstance(x, Tensor):
        x = torch.as_tensor(np.asarray(x))
    if not x.is_floating_point():
        x = x.float()
    return x.unsqueeze(0) if x.dim() == 1 else x


def _float(x) -> Tensor:
    """A float tensor of `x`, any shape (for the pairwise scores)."""
    x = torch.from_numpy(np.asarray(x)) if not isinstance(x, Tensor) else x
    return x if x.is_floating_point() else x.float()


def cos_sim(a, b) -> Tensor:
    """(N, D), (M, D) -> (N, M) cosine similarities."""
    a, b = _matrix(a), _matrix(b)
    return F.normalize(a, p=2, dim=1) @ F.normalize(b, p=2, dim=1).T


def dot_score(a, b) -> Tensor:
    """(N, D), (M, D) -> (N, M) dot products."""
    a, b = _matrix(a), _matrix(b)
    return a @ b.T


def euclidean_sim(a, b) -> Tensor:
    """(N, D), (M, D) -> (N, M) negative euclidean distances."""
    return -torch.cdist(_matrix(a), _matrix(b), p=2.0)


def manhattan_sim(a, b) -> Tensor:
    """(N, D), (M, D) -> (N, M) negative manhattan distances."""
    return -torch.cdist(_matrix(a), _matrix(b), p=1.0)


def pairwise_cos_sim(a, b) -> Tensor:
    """(N, D), (N, D) -> (N,) cosine similarity of row i with row i."""
    return pairwise_dot_score(F.normalize(_float(a), p=2, dim=-1), F.normalize(_float(b), p=2, dim=-1))


def pairwise_dot_score(a, b) -> Tensor:
    """(N, D), (N, D) -> (N,) dot product of row i with row i."""
    return (_float(a) * _float(b)).sum(dim=-1)


def pairwise_euclidean_sim(a, b) -> Tensor:
    """(N, D), (N, D) -> (N,) negative euclidean distance of row i to row i."""
    return -torch.linalg.vector_norm(_float(a) - _float(b), dim=-1)


def pairwise_manhattan_sim(a, b) -> Tensor:
    """(N, D), (N, D) -> (N,) negative manhattan distance of row i to row i."""
    return -torch.sum(torch.abs(_float(a) - _float(b)), dim=-1)


# sentence-transformers' `similarity_fn_name` values -> (all pairs, row by row).
SIMILARITY_FUNCTIONS: dict[str, tuple[Callable, Callable]] = {
    "cosine": (cos_sim, pairwise_cos_sim),
    "dot": (dot_score, pairwise_dot_score),
    "euclidean": (euclidean_sim, pairwise_euclidean_sim),
    "manhattan": (manhattan_sim, pairwise_manhattan_sim),
}


def similarity_functions(name: str) -> tuple[Callable, Callable]:
    """The (all pairs, pairwise) functions of a `similarity_fn_name`; a loud error for others."""
    if name not in SIMILARITY_FUNCTIONS:
        raise ValueError(f"similarity_fn_name {name!r} is not known; use one of {', '.join(SIMILARITY_FUNCTIONS)}")
    return SIMILARITY_FUNCTIONS[name]


def quantize_embeddings(
    embeddings, precision: str, ranges: np.ndarray | None = None, calibration_embeddings: np.ndarray | None = None
) -> np.ndarray:
    """(N, D) float embeddings -> numpy in `precision`, as `sentence_transformers.quantize_embeddings`:
    int8/uint8 bucket each dimension into 256 steps between its min and max (from `ranges` (2, D),
    else `calibration_embeddings`, else `embeddings` themselves); binary/ubinary pack the signs
    into (N, ceil(D / 8)) bytes (binary shifted by -128 into int8). int8/uint8 of a single
    embedding without `ranges` or `calibration_embeddings` is refused, as there."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not supported; use one of {', '.join(PRECISIONS)}")
    if isinstance(embeddings, Tensor):
        embeddings = embeddings.detach().float().cpu().numpy()
    embeddings = np.asarray(embeddings)
    if embeddings.dtype in (np.int8, np.uint8):
        raise ValueError("embeddings to quantize must be float, not int8 or uint8; quantize the float embeddings")
    if precision == "float32":
        return embeddings.astype(np.float32)
    if precision.endswith("binary"):
        packed = np.packbits(embeddings > 0, axis=-1)
        return packed if precision == "ubinary" else (packed - 128).astype(np.int8)
    if ranges is None:
        source = embeddings if calibration_embeddings is None else np.asarray(calibration_embeddings)
        if calibration_embeddings is None and (source.ndim == 1 or len(source) == 1):
            raise ValueError(
                f"cannot compute {precision} ranges from a single embedding; quantise its float32 embedding with "
                "bert_port.similarity.quantize_embeddings(..., ranges= or calibration_embeddings= from a representative "
                "set), as sentence-transformers asks"
            )
        if len(source) < 100:
            log.warning(
                "%s buckets computed from %d embeddings; pass ranges or calibration_embeddings from more for "
                "stable buckets",
                precision,
                len(source),
            )
        ranges = np.vstack((source.min(axis=0), source.max(axis=0)))
    ranges = ranges.astype(np.float32, copy=False)
    steps = (ranges[1] - ranges[0]) / 255
    steps = np.where(steps == 0, 1, steps)
    buckets = np.clip(np.floor((embeddings - ranges[0]) / steps), 0, 255)
    return buckets.astype(np.uint8) if precision == "uint8" else (buckets - 128).astype(np.int8)


def embedding_shards(directory: str | os.PathLike) -> Iterator[np.ndarray]:
    """The (n, D) embeddings of a finished `bert-port-embed` run, one memory-mapped shard at a
    time, in the order of its ids (`read_embeddings(directory)[0]`). Each is checked as
    `read_embeddings` checks it (row count, dimension, checksum) before it is given out: a
    damaged shard is an `EmbedError` naming it, never rows under the wrong ids."""
    for _, array in verified_shards(directory, mmap=True):
        yield array


def _corpus_chunks(corpus, chunk_size: int):
    """(start, (n, D) tensor) over a corpus given as one array/tensor, an iterable of them
    (shards, taken one at a time, row ids running on across them) or a `bert-port-embed` folder."""
    if isinstance(corpus, (str, os.PathLike)):
        corpus = embedding_shards(corpus)
    parts = [corpus] if isinstance(corpus, (np.ndarray, Tensor)) else corpus
    start = 0
    for part in parts:
        for i in range(0, len(part), chunk_size):
            chunk = part[i : i + chunk_size]
            yield start + i, _matrix(np.array(chunk) if isinstance(chunk, np.ndarray) else chunk)
        start += len(part)


def semantic_search(
    query_embeddings,
    corpus_embeddings: np.ndarray | Tensor | Iterable[np.ndarray | Tensor] | str | os.PathLike,
    top_k: int = 10,
    score_function: str | Callable[[Tensor, Tensor], Tensor] = "cosine",
    query_chunk_size: int = 100,
    corpus_chunk_size: int = 100_000,
) -> list[list[dict[str, int | float]]]:
    """For each query, the `top_k` corpus rows of highest score, best first, as
    `sentence_transformers.util.semantic_search` returns them: `[[{"corpus_id": i, "score": s}, ...], ...]`.

    `corpus_embeddings` is an (M, D) array or tensor, memory-mapped or not, an iterable of them
    (shards, ids numbered on across them, taken one at a time), or the output folder of a
    `bert-port-embed` run (its shards, one in memory at a time, each verified as `read_embeddings`
    verifies it; `corpus_id` indexes `read_embeddings(folder)[0]`); it is read `corpus_chunk_size` rows at a time. `score_function` is a `similarity_fn_name` or a function
    of two matrices."""
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    score = similarity_functions(score_function)[0] if isinstance(score_function, str) else score_function
    cosine = score is cos_sim
    queries = _matrix(query_embeddings)
    if cosine:  # normalised once here, not once per corpus chunk; the same scores
        queries, score = F.normalize(queries, p=2, dim=1), dot_score
    heaps: list[list[tuple[float, int]]] = [[] for _ in range(len(queries))]
    for start, chunk in _corpus_chunks(corpus_embeddings, corpus_chunk_size):
        chunk = F.normalize(chunk, p=2, dim=1) if cosine else chunk
        for q in range(0, len(queries), query_chunk_size):
            scores = score(queries[q : q + query_chunk_size], chunk.to(queries.dtype))  # (nq, n)
            values, idx = torch.topk(scores, min(top_k, scores.shape[1]), dim=1)
            for heap, row_values, row_idx in zip(heaps[q:], values.tolist(), (idx + start).tolist()):
                for candidate in zip(row_values, row_idx):
                    if len(heap) < top_k:
                        heapq.heappush(heap, candidate)
                    else:
                        heapq.heappushpop(heap, candidate)
    return [[{"corpus_id": i, "score": s} for s, i in sorted(heap, key=lambda c: c[0], reverse=True)] for heap in heaps]
