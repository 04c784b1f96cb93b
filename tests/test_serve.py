"""`bert-port-serve` on the bundled all-MiniLM-L6-v2, as a real server process answering real
clients over HTTP: every response is bitwise what `SentenceEncoder.encode` gives the same text
alone, however requests are batched together; the `openai` package and huggingface_hub's
`InferenceClient` get sentence-transformers' numbers."""

from __future__ import annotations

import asyncio
import base64
import random

import httpx
import numpy as np
import pytest
import torch
from conftest import REAL_SENTENCES, TOL
from serving import ServerProcess

from bert_port import SentenceEncoder
from bert_port.data import load_mr

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def server(minilm_path):
    with ServerProcess(minilm_path, "--max-batch-tokens", "2048") as s:
        yield s


@pytest.fixture(scope="module")
def encoder(minilm_path):
    return SentenceEncoder.from_pretrained(minilm_path)


@pytest.fixture(scope="module")
def texts():
    mr = load_mr().texts[:150]
    return mr + REAL_SENTENCES + ["hi", "no", "a much longer text " * 40]


def alone(encoder, text: str, normalize: bool = False) -> np.ndarray:
    return encoder.encode([text], normalize_embeddings=normalize)[0]


def test_health_info_models_docs(server):
    assert httpx.get(server.url + "/health").status_code == 200
    info = httpx.get(server.url + "/info").json()
    assert info["model_type"] == {"embedding": {"pooling": "mean"}} and info["max_input_length"] == 256
    assert info["max_batch_tokens"] == 2048 and info["max_client_batch_size"] == 32
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == info["model_id"]
    assert httpx.get(server.url + "/docs").status_code == 200
    assert "/v1/embeddings" in httpx.get(server.url + "/openapi.json").json()["paths"]


def test_embed_is_the_library_bit_for_bit(server, encoder):
    texts = REAL_SENTENCES[:4]
    got = httpx.post(server.url + "/embed", json={"inputs": texts, "normalize": False}).json()
    for text, vector in zip(texts, got):
        np.testing.assert_array_equal(np.asarray(vector, dtype=np.float32), alone(encoder, text))
    one = httpx.post(server.url + "/embed", json={"inputs": texts[0], "dimensions": 64}).json()
    expected = encoder.encode([texts[0]], truncate_dim=64, normalize_embeddings=True)[0]
    np.testing.assert_array_equal(np.asarray(one[0], dtype=np.float32), expected)


def test_truncation_is_the_library_cut(server, encoder):
    long = "a much longer text " * 80  # over max_seq_length (256 tokens)
    refused = httpx.post(server.url + "/embed", json={"inputs": long})
    assert refused.status_code == 413 and refused.json()["error_type"] == "Validation"
    assert "256" in refused.json()["error"] and "truncate" in refused.json()["error"]
    got = httpx.post(server.url + "/embed", json={"inputs": long, "truncate": True, "normalize": False}).json()
    np.testing.assert_array_equal(np.asarray(got[0], dtype=np.float32), alone(encoder, long))


def test_64_concurrent_clients_get_the_bits_of_each_text_alone(server, encoder, texts):
    """Random mixes from 64 clients at once: batches mix requests and split them (2048 tokens
    a batch), and not one vector differs from its text encoded alone."""
    rng = random.Random(0)
    requests = [rng.sample(texts, rng.randint(1, 12)) for _ in range(192)]

    async def client(batch_of_requests):
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return [(await c.post("/embed", json={"inputs": r, "normalize": False})).json() for r in batch_of_requests]

    async def everyone():
        return await asyncio.gather(*(client(requests[i::64]) for i in range(64)))

    batches_before = server.metric("bert_port_batch_size_count")
    answers = asyncio.run(everyone())
    reference = {t: alone(encoder, t) for t in {t for r in requests for t in r}}
    differ = 0
    for i in range(64):
        for sent, got in zip(requests[i::64], answers[i]):
            differ += sum(not np.array_equal(np.asarray(v, dtype=np.float32), reference[t]) for t, v in zip(sent, got))
    assert differ == 0
    inputs = sum(len(r) for r in requests)
    batches = server.metric("bert_port_batch_size_count") - batches_before
    assert batches < len(requests), f"{batches} forwards for {len(requests)} requests: nothing was batched together"
    assert inputs > 0


def test_embed_all_is_the_models_hidden_states(server, encoder):
    from bert_port import encode

    got = httpx.post(server.url + "/embed_all", json={"inputs": ["a gripping film"]}).json()
    batch = encode(encoder.tokenizer, ["a gripping film"])
    with torch.inference_mode():
        hidden = encoder.model(**batch).last_hidden_state[0]
    np.testing.assert_array_equal(np.asarray(got[0], dtype=np.float32), hidden.numpy())


def test_tokenize_and_decode(server, encoder):
    tokens = httpx.post(server.url + "/tokenize", json={"inputs": "Hello world"}).json()[0]
    assert [t["text"] for t in tokens] == ["[CLS]", "Hello", "world", "[SEP]"]
    assert [t["special"] for t in tokens] == [True, False, False, True] and tokens[1]["start"] == 0
    ids = [t["id"] for t in tokens]
    assert ids == encoder.tokenizer.encode("Hello world").ids
    assert httpx.post(server.url + "/decode", json={"ids": ids}).json() == ["hello world"]


def test_openai_client_gets_sentence_transformers_numbers(server, encoder, minilm_path):
    openai = pytest.importorskip("openai")
    from sentence_transformers import SentenceTransformer

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    texts = REAL_SENTENCES[:3]
    for encoding_format in ("float", "base64"):
        response = client.embeddings.create(input=texts, model="all-MiniLM-L6-v2", encoding_format=encoding_format)
        got = response.data
        assert [d.index for d in got] == [0, 1, 2] and response.usage.prompt_tokens > 0
        vectors = [
            np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") if isinstance(d.embedding, str) else d.embedding
            for d in got
        ]
        ours = np.asarray(vectors, dtype=np.float32)
        np.testing.assert_array_equal(ours, encoder.encode(texts, normalize_embeddings=True))
    st = SentenceTransformer(str(minilm_path), device="cpu").encode(texts)
    torch.testing.assert_close(torch.from_numpy(ours), torch.from_numpy(st), **TOL[torch.float32])
    ids = encoder.tokenizer.encode(texts[0]).ids
    by_ids = client.embeddings.create(input=ids, model="m", encoding_format="float").data[0].embedding
    np.testing.assert_array_equal(np.asarray(by_ids, dtype=np.float32), ours[0])


def test_inference_client_feature_extraction(server, encoder, minilm_path, monkeypatch):
    from huggingface_hub import InferenceClient
    from sentence_transformers import SentenceTransformer

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # InferenceClient refuses every URL offline
    client = InferenceClient(base_url=server.url, timeout=60)
    text = REAL_SENTENCES[1]
    got = client.feature_extraction(text)
    assert got.shape == (1, 384)
    np.testing.assert_array_equal(got[0], encoder.encode([text], normalize_embeddings=True)[0])
    st = SentenceTransformer(str(minilm_path), device="cpu").encode([text])
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(st), **TOL[torch.float32])


def test_metrics_are_prometheus_histograms(server):
    httpx.post(server.url + "/embed", json={"inputs": ["one", "two"]})
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "bert_port_batch_size_bucket",
        "bert_port_batch_tokens_bucket",
        "bert_port_queue_seconds_bucket",
        "bert_port_inference_seconds_bucket",
        "bert_port_requests_total",
        "bert_port_tokens_total",
    ):
        assert name in text, name
    assert server.metric("bert_port_requests_total") > 0 and server.metric("bert_port_tokens_total") > 0
