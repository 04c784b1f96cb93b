"""`bert-port-serve` on classifiers, as real server processes: a sequence classifier answers
TEI's /predict (and InferenceClient's text_classification) with `Predictor`'s probabilities bit
for bit, a one-label model (a cross-encoder) reranks, and a token classifier answers entities."""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from conftest import REAL_SENTENCES
from serving import ServerProcess

from bert_port import BertForSequenceClassification, BertForTokenClassification
from bert_port.training.prediction import Predictor

pytest.importorskip("fastapi")

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TAGS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}


def _saved(model_class, minilm_path, folder, **config):
    torch.manual_seed(0)
    model = model_class.from_pretrained(minilm_path, **config)
    with torch.no_grad():  # a head that says something: weights larger than the initialiser's
        model.classifier.weight.mul_(20)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, minilm_path):
    return _saved(BertForSequenceClassification, minilm_path, tmp_path_factory.mktemp("cls"), id2label=LABELS)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, minilm_path):
    return _saved(BertForSequenceClassification, minilm_path, tmp_path_factory.mktemp("rerank"), num_labels=1)


@pytest.fixture(scope="module")
def tagger(tmp_path_factory, minilm_path):
    return _saved(BertForTokenClassification, minilm_path, tmp_path_factory.mktemp("ner"), id2label=TAGS)


def test_predict_is_the_predictors_probabilities(classifier, monkeypatch):
    from huggingface_hub import InferenceClient

    predictor = Predictor.load(classifier)
    texts = REAL_SENTENCES[:3]
    with ServerProcess(classifier) as server:
        assert httpx.get(server.url + "/info").json()["model_type"]["classifier"]["id2label"]["2"] == "positive"
        single = httpx.post(server.url + "/predict", json={"inputs": texts[0]}).json()
        batch = httpx.post(server.url + "/predict", json={"inputs": [[t] for t in texts]}).json()
        pair = httpx.post(server.url + "/predict", json={"inputs": [texts[0], texts[1]]}).json()
        raw = httpx.post(server.url + "/predict", json={"inputs": texts[0], "raw_scores": True}).json()
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # InferenceClient refuses every URL offline
        by_client = InferenceClient(base_url=server.url, timeout=60).text_classification(texts[0])
    for text, got in zip(texts, batch):
        expected = predictor([text])[0]["probabilities"]
        assert {p["label"]: p["score"] for p in got} == expected
        assert [p["score"] for p in got] == sorted(expected.values(), reverse=True)
    assert single == batch[0]
    assert {p["label"]: p["score"] for p in pair} == predictor([texts[0]], pairs=[texts[1]])[0]["probabilities"]
    assert {p.label: p.score for p in by_client} == predictor([texts[0]])[0]["probabilities"]
    logits = {p["label"]: p["score"] for p in raw}
    softmax = torch.tensor([logits[n] for n in LABELS.values()]).softmax(-1).tolist()
    assert softmax == pytest.approx(list(predictor([texts[0]])[0]["probabilities"].values()), abs=1e-6)


def test_rerank_orders_by_the_models_scores(reranker):
    predictor = Predictor.load(reranker, activation="none")
    query, texts = "a film review", REAL_SENTENCES[:4]
    with ServerProcess(reranker) as server:
        ranks = httpx.post(server.url + "/rerank", json={"query": query, "texts": texts, "return_text": True}).json()
        raw = httpx.post(server.url + "/rerank", json={"query": query, "texts": texts, "raw_scores": True}).json()
        too_many = httpx.post(server.url + "/rerank", json={"query": query, "texts": ["x"] * 33})
    expected = [next(iter(row.values())) for row in predictor([query] * len(texts), pairs=texts)]
    assert sorted(r["index"] for r in ranks) == [0, 1, 2, 3] and all(r["text"] == texts[r["index"]] for r in ranks)
    assert {r["index"]: r["score"] for r in raw} == dict(enumerate(expected))
    for r in ranks:
        assert r["score"] == pytest.approx(1 / (1 + math.exp(-expected[r["index"]])), rel=1e-6)
    assert [r["score"] for r in ranks] == sorted((r["score"] for r in ranks), reverse=True)
    assert too_many.status_code == 413 and too_many.json()["error_type"] == "Validation"


def test_a_token_classifier_answers_entities(tagger, monkeypatch):
    from huggingface_hub import InferenceClient

    predictor = Predictor.load(tagger)
    text = "My name is Sarah Jessica Parker and I live in Paris"
    with ServerProcess(tagger) as server:
        got = httpx.post(server.url + "/predict", json={"inputs": text}).json()
        pairs = httpx.post(server.url + "/predict", json={"inputs": [text, "second"]})
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        by_client = InferenceClient(base_url=server.url, timeout=60).token_classification(text)
    expected = predictor([text])[0]["entities"]
    assert got == expected and expected, expected
    assert [e.entity_group for e in by_client] == [e["entity_group"] for e in expected]
    assert pairs.status_code == 422 and "single texts" in pairs.json()["error"]
