"""The Ray Serve deployment of the app, with 2 replicas on this machine behind Ray's HTTP proxy:
both replicas answer, and each answer is bitwise what `SentenceEncoder` gives a text alone."""

from __future__ import annotations

import asyncio
import os

import httpx
import numpy as np
import pytest
from conftest import REAL_SENTENCES
from serving import free_port

from bert_port import SentenceEncoder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_url(minilm_path):
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from bert_port.serve.ray_app import deployment

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(str(minilm_path), replicas=2, threads=1), name="bert-port", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_answer_with_the_librarys_bits(ray_url, minilm_path):
    encoder = SentenceEncoder.from_pretrained(minilm_path)
    texts = REAL_SENTENCES * 4

    async def everyone():
        async with httpx.AsyncClient(base_url=ray_url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/embed", json={"inputs": [t], "normalize": False}) for t in texts))

    answers = asyncio.run(everyone())
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200][:2]
    assert len({a.headers["x-bert-port-replica"] for a in answers}) == 2
    for text, answer in zip(texts, answers):
        np.testing.assert_array_equal(np.asarray(answer.json()[0], dtype=np.float32), encoder.encode([text])[0])
    over = httpx.post(ray_url + "/embed", json={"inputs": ["a"] * 33}, timeout=60)
    assert over.status_code == 413 and over.json()["error_type"] == "Validation"
