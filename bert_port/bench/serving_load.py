"""The serving bench's load generator: closed-loop clients (asyncio and `httpx.AsyncClient`)
sending OpenAI embedding requests of 1 to 32 real texts, and what one run of them measured.

A run is bounded three ways: a number of requests, a total time after which no new request
starts, and a timeout on every request. Each of `concurrency` clients takes the next request
of a shared list as soon as its previous one is answered, so the server always has
`concurrency` requests in flight, as behind a busy application.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

MAX_TEXTS = 32  # texts per request: TEI's default --max-client-batch-size
SHORT_SHARE = 0.3  # share of the texts that are one- or two-word messages (queries, chat) rather than sentences


def text_pool() -> tuple[list[str], list[str]]:
    """The MR movie-review sentences and the short messages, from the bundled readers."""
    from bert_port.data import SHORT_TEXTS, load_mr

    return load_mr().texts, list(SHORT_TEXTS)


def make_requests(n: int, seed: int, pools: tuple[list[str], list[str]] | None = None) -> list[list[str]]:
    """`n` requests, each of 1 to `MAX_TEXTS` texts (uniform), each text an MR sentence or,
    with probability `SHORT_SHARE`, a short message; the same `seed` gives the same list."""
    sentences, short = pools or text_pool()
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        size = rng.randint(1, MAX_TEXTS)
        requests.append(
            [rng.choice(short) if rng.random() < SHORT_SHARE else rng.choice(sentences) for _ in range(size)]
        )
    return requests


@dataclass
class RunResult:
    """What one run at one concurrency measured: every answered request's latency and size,
    and the failures (status codes, timeouts, refused connections) by kind."""

    concurrency: int
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    texts: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    server_cpu_s: float = 0.0  # CPU seconds the server process used during the run

    @property
    def cpu_share(self) -> float:
        """Cores' worth of CPU the server got during the run (at most the thread budget when the
        machine is quiet; less when other processes take the cores)."""
        return self.server_cpu_s / self.seconds if self.seconds > 0 else 0.0

    @property
    def texts_per_s(self) -> float:
        return self.texts / self.seconds if self.seconds > 0 else 0.0

    def latency_ms(self, q: float) -> float:
        """The `q`-th percentile of the answered requests' latency, in milliseconds (NaN if none)."""
        return float(np.percentile(self.latencies, q)) * 1e3 if self.latencies else float("nan")

    @property
    def failed(self) -> int:
        return sum(self.errors.values())


def body(texts: Sequence[str], model: str) -> dict:
    return {"input": list(texts), "model": model}


def check_response(payload: object, n_texts: int) -> None:
    """Raise if `payload` is not an OpenAI embeddings list of `n_texts` non-empty vectors:
    a server that answers 200 with the wrong thing must not be timed."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list) or len(data) != n_texts:
        got = len(data) if isinstance(data, list) else type(payload).__name__
        raise RuntimeError(f"expected {n_texts} embeddings, got {got}")
    if not all(isinstance(d.get("embedding"), list) and d["embedding"] for d in data):
        raise RuntimeError("an embedding in the response is empty or not a list of floats")


async def _client(http, url: str, model: str, queue: list, deadline: float, result: RunResult) -> None:
    import httpx

    while queue and time.perf_counter() < deadline:
        texts = queue.pop()
        start = time.perf_counter()
        try:
            response = await http.post(url, json=body(texts, model))
        except httpx.TimeoutException:
            result.errors["timeout"] = result.errors.get("timeout", 0) + 1
            continue
        except httpx.TransportError as e:
            key = type(e).__name__
            result.errors[key] = result.errors.get(key, 0) + 1
            continue
        if response.status_code != 200:
            key = str(response.status_code)
            result.errors[key] = result.errors.get(key, 0) + 1
            continue
        result.latencies.append(time.perf_counter() - start)
        result.texts += len(texts)


async def run_load(
    url: str, requests: list[list[str]], concurrency: int, max_seconds: float, timeout_s: float, model: str = "minilm"
) -> RunResult:
    """Send `requests` to `url` from `concurrency` clients; no request starts after
    `max_seconds`, and each one fails after `timeout_s`. Only answered (200) requests count
    towards texts/s and latency; the response bodies are read but not parsed, so the client
    spends little CPU beside the server (`warm_up` checks what the server returns)."""
    import httpx

    result = RunResult(concurrency)
    queue = list(reversed(requests))  # pop() from the end takes them in order
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) as http:
        start = time.perf_counter()
        deadline = start + max_seconds
        await asyncio.gather(*(_client(http, url, model, queue, deadline, result) for _ in range(concurrency)))
        result.seconds = time.perf_counter() - start
    return result


async def warm_up(url: str, requests: list[list[str]], timeout_s: float, model: str = "minilm") -> None:
    """Send `requests` one by one and check every answer (status and shape): the first calls
    of a fresh server are slow, and a wrong answer stops the bench before it times anything."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as http:
        for texts in requests:
            response = await http.post(url, json=body(texts, model))
            if response.status_code != 200:
                raise RuntimeError(f"POST {url} answered {response.status_code}: {response.text[:500]}")
            check_response(response.json(), len(texts))


def measure(url: str, requests: list[list[str]], concurrency: int, max_seconds: float, timeout_s: float) -> RunResult:
    """`run_load` from synchronous code."""
    return asyncio.run(run_load(url, requests, concurrency, max_seconds, timeout_s))
