"""`bert-port-serve --quantization int8` and `--dtype bf16`: a request's vectors are bitwise what
`SentenceEncoder`, loaded the same way, gives each text alone, while concurrent requests share
forwards (docs/batch-invariance.md promises invariance in int8 and bf16 too)."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
import torch
from conftest import REAL_SENTENCES
from serving import ServerProcess

from bert_port import SentenceEncoder

pytest.importorskip("fastapi")


@pytest.mark.parametrize(
    "flags, load",
    [(("--quantization", "int8"), {"quantization": "int8"}), (("--dtype", "bf16"), {"dtype": torch.bfloat16})],
    ids=["int8", "bf16"],
)
def test_int8_and_bf16_servers_give_the_bits_of_each_text_alone(minilm_path, flags, load):
    encoder = SentenceEncoder.from_pretrained(minilm_path, **load)
    requests = [REAL_SENTENCES[i : i + 3] for i in range(len(REAL_SENTENCES) - 2)] * 2

    async def everyone(url):
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/embed", json={"inputs": r, "normalize": False}) for r in requests))

    with ServerProcess(minilm_path, *flags) as server:
        dtype = httpx.get(server.url + "/info").json()["model_dtype"]
        answers = asyncio.run(everyone(server.url))
    assert dtype == ("bfloat16" if "bf16" in flags else "float32")
    for sent, answer in zip(requests, answers):
        for text, vector in zip(sent, answer.json()):
            np.testing.assert_array_equal(np.asarray(vector, dtype=np.float32), encoder.encode([text])[0])
