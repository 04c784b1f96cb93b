"""Evaluation of sentence-embedding models, computed as sentence-transformers' evaluators do.

- `retrieval_metrics`: as `InformationRetrievalEvaluator` (cosine): queries ranked against a
  corpus, ties broken by corpus order; accuracy@k, precision@k, recall@k, MRR@10, nDCG@10
  (binary relevance), MAP@100; keys named as that evaluator names them (`cosine_ndcg@10`).
- `similarity_metrics`: as `EmbeddingSimilarityEvaluator`: Pearson and Spearman correlation
  of the cosine of each pair with its gold score (`pearson_cosine`, `spearman_cosine`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy.stats import pearsonr, spearmanr

from ..similarity import pairwise_cos_sim, semantic_search

ACCURACY_AT_K = (1, 3, 5, 10)
MRR_AT_K, NDCG_AT_K, MAP_AT_K = (10,), (10,), (100,)


def _dcg(relevances: Sequence[int], k: int) -> float:
    return sum(r / math.log2(i + 2) for i, r in enumerate(relevances[:k]))


def _query_metrics(hits: list[int], relevant: set) -> dict[str, float]:
    """The metrics of one query: `hits` are corpus ids, best first."""
    found = [1 if h in relevant else 0 for h in hits]
    out: dict[str, float] = {}
    for k in ACCURACY_AT_K:
        out[f"accuracy@{k}"] = float(any(found[:k]))
        out[f"precision@{k}"] = sum(found[:k]) / k
        out[f"recall@{k}"] = sum(found[:k]) / len(relevant)
    for k in MRR_AT_K:
        out[f"mrr@{k}"] = next((1 / (rank + 1) for rank, f in enumerate(found[:k]) if f), 0.0)
    for k in NDCG_AT_K:
        out[f"ndcg@{k}"] = _dcg(found, k) / _dcg([1] * len(relevant), k)
    for k in MAP_AT_K:
        correct, total = 0, 0.0
        for rank, f in enumerate(found[:k]):
            if f:
                correct += 1
                total += correct / (rank + 1)
        out[f"map@{k}"] = total / min(k, len(relevant))
    return out


def rank_metrics(results: list[list[dict]], relevant: list[set]) -> dict[str, float]:
    """Mean metrics over queries from `semantic_search` results (corpus ids as positions) and each
    query's set of relevant positions; ties in score go to the earlier corpus row."""
    per_query = []
    for hits, wanted in zip(results, relevant):
        ordered = sorted(hits, key=lambda h: (-h["score"], h["corpus_id"]))
        per_query.append(_query_metrics([h["corpus_id"] for h in ordered], wanted))
    return {f"cosine_{name}": float(np.mean([q[name] for q in per_query])) for name in per_query[0]}


def retrieval_metrics(
    encoder,
    queries: Mapping[str, str],
    corpus: Mapping[str, str],
    relevant_docs: Mapping[str, set[str]],
    batch_size: int = 32,
) -> dict[str, float]:
    """`InformationRetrievalEvaluator(queries, corpus, relevant_docs)(model)` for a `SentenceEncoder`:
    queries with no relevant document are left out, as there; queries encoded with
    `encode_query`, the corpus with `encode_document`."""
    query_ids = [q for q in queries if relevant_docs.get(q)]
    if not query_ids:
        raise ValueError("no query has a relevant document in relevant_docs; give each query the ids it should find")
    corpus_ids = list(corpus)
    position = {cid: i for i, cid in enumerate(corpus_ids)}
    unknown = sorted({d for q in query_ids for d in relevant_docs[q]} - set(position))
    if unknown:
        raise ValueError(f"relevant_docs names {len(unknown)} id(s) not in the corpus, e.g. {unknown[:3]}")
    q = encoder.encode_query(
        [queries[i] for i in query_ids], batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False
    )
    c = encoder.encode_document(
        [corpus[i] for i in corpus_ids], batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False
    )
    k = max(*ACCURACY_AT_K, *MRR_AT_K, *NDCG_AT_K, *MAP_AT_K)
    results = semantic_search(q, c, top_k=k, score_function="cosine")
    return rank_metrics(results, [{position[d] for d in relevant_docs[i]} for i in query_ids])


def similarity_metrics(
    encoder, sentences1: Sequence[str], sentences2: Sequence[str], scores: Sequence[float], batch_size: int = 16
) -> dict[str, float]:
    """`EmbeddingSimilarityEvaluator(sentences1, sentences2, scores)(model)` for a `SentenceEncoder`
    (cosine): Pearson and Spearman correlation of each pair's cosine with its gold score."""
    if not len(sentences1) == len(sentences2) == len(scores) or len(scores) < 2:
        raise ValueError("sentences1, sentences2 and scores must be of one length, at least 2")
    a = encoder.encode(list(sentences1), batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False)
    b = encoder.encode(list(sentences2), batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False)
    cosine = pairwise_cos_sim(a, b).cpu().numpy()
    return {
        "pearson_cosine": float(pearsonr(scores, cosine)[0]),
        "spearman_cosine": float(spearmanr(scores, cosine)[0]),
    }
