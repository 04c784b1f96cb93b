"""Every limit of `bert-port-serve` has a status code, in TEI's error body, and the server keeps
serving after each: 401 without the key, 413 over the client batch, the input length or the
body size, 422 for a malformed body, 429 at 4x the concurrency limit, 408 for a body that never
arrives; a client that leaves has its queued work dropped; SIGTERM drains and exits 0; a model
that cannot load ends the process with one line and exit 2."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serving import ServerProcess

pytest.importorskip("fastapi")

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = "a much longer text about films " * 40  # about 240 tokens


@pytest.fixture(scope="module")
def server(minilm_path):
    flags = ("--max-client-batch-size", "4", "--payload-limit", "20000", "--body-timeout", "2")
    flags += ("--max-concurrent-requests", "2", "--max-batch-tokens", "256")
    with ServerProcess(minilm_path, *flags, env={"BERT_PORT_API_KEY": KEY}) as s:
        yield s


def post(server, path, body=None, key=KEY, timeout=60.0):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=timeout)


def assert_error(response, status: int, error_type: str, *words: str):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error_type"] == error_type and all(w in body["error"] for w in words), body


def test_401_without_the_key(server):
    assert_error(post(server, "/embed", {"inputs": "hi"}, key=None), 401, "Unauthorized", "API key")
    assert_error(post(server, "/embed", {"inputs": "hi"}, key="wrong"), 401, "Unauthorized")
    assert_error(httpx.get(server.url + "/metrics"), 401, "Unauthorized")
    assert httpx.get(server.url + "/health").status_code == 200  # the probe needs no key
    assert post(server, "/embed", {"inputs": "hi"}).status_code == 200


def test_413_over_the_limits(server):
    assert_error(
        post(server, "/embed", {"inputs": ["a"] * 5}), 413, "Validation", "5 inputs", "--max-client-batch-size"
    )
    assert_error(post(server, "/embed", {"inputs": LONG * 2}), 413, "Validation", "256")
    big = httpx.post(
        server.url + "/embed",
        content=b'{"inputs": "' + b"x" * 30000 + b'"}',
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert_error(big, 413, "Validation", "--payload-limit")
    assert post(server, "/embed", {"inputs": ["a"] * 4}).status_code == 200


def test_422_for_malformed_bodies(server):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    bad_json = httpx.post(server.url + "/embed", content=b'{"inputs": ', headers=headers)
    assert_error(bad_json, 422, "Validation", "malformed")
    assert_error(post(server, "/embed", {"inputs": 5}), 422, "Validation", "inputs")
    assert_error(post(server, "/embed", {"text": "hi"}), 422, "Validation", "inputs")
    assert_error(post(server, "/embed", {"inputs": []}), 422, "Validation", "empty")
    assert_error(post(server, "/embed", {"inputs": "hi", "prompt_name": "nope"}), 422, "Validation", "nope")
    assert_error(post(server, "/embed", {"inputs": "hi", "dimensions": 999}), 422, "Validation", "dimensions")
    assert_error(post(server, "/v1/embeddings", {"input": [[1, 99999999]]}), 413, "Validation", "vocabulary")
    assert_error(post(server, "/predict", {"inputs": "hi"}), 400, "Validation", "embed")


def test_429_at_four_times_the_limit_then_recovers(server):
    """8 concurrent requests against a limit of 2: some are refused with 429, none fails with
    5xx or a dropped connection, and the next request is served."""

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
            return await asyncio.gather(*(c.post("/embed", json={"inputs": [LONG] * 4}) for _ in range(8)))

    codes = [r.status_code for r in asyncio.run(burst())]
    assert codes.count(429) >= 1 and codes.count(200) >= 2 and set(codes) <= {200, 429}, codes
    refused = next(r for r in asyncio.run(burst()) if r.status_code == 429)
    assert_error(refused, 429, "Overloaded", "--max-concurrent-requests")
    assert post(server, "/embed", {"inputs": "after the burst"}).status_code == 200


def test_408_for_a_body_that_never_arrives(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        head = f"POST /embed HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        s.sendall((head + "Content-Length: 100\r\n\r\n{").encode())
        start = time.monotonic()
        answer = s.recv(4096).decode()
    assert answer.startswith("HTTP/1.1 408") and "Timeout" in answer, answer
    assert time.monotonic() - start < 20
    assert post(server, "/embed", {"inputs": "still serving"}).status_code == 200


def test_a_client_that_leaves_has_its_queued_work_dropped(server):
    """A request of 4 long texts, one forward each (256 tokens a batch), behind a busy queue:
    the client gives up at once, and what was still queued is never computed."""
    computed = server.metric("bert_port_inputs_total", AUTH)
    dropped = server.metric("bert_port_dropped_inputs_total", AUTH)
    busy = threading.Thread(target=post, args=(server, "/embed", {"inputs": [LONG] * 4}))
    busy.start()
    with pytest.raises(httpx.TimeoutException):
        post(server, "/embed", {"inputs": [LONG + " leaving"] * 4}, timeout=0.05)
    busy.join(60)
    time.sleep(1.0)
    assert server.metric("bert_port_dropped_inputs_total", AUTH) > dropped
    assert server.metric("bert_port_inputs_total", AUTH) - computed < 8


def test_sigterm_drains_in_flight_requests_and_exits_0(minilm_path):
    with ServerProcess(minilm_path, "--max-batch-tokens", "256", "--drain-timeout", "60") as s:
        answers = []
        worker = threading.Thread(target=lambda: answers.append(post(s, "/embed", {"inputs": [LONG] * 16}, key=None)))
        worker.start()
        time.sleep(0.5)  # the request is in flight: 16 forwards of one text
        s.proc.send_signal(signal.SIGTERM)
        worker.join(120)
        assert s.proc.wait(120) == 0
        assert answers and answers[0].status_code == 200 and len(answers[0].json()) == 16
        with pytest.raises(httpx.TransportError):
            httpx.get(s.url + "/health", timeout=5)


def test_health_is_503_until_the_model_is_warm(minilm_path):
    with ServerProcess(minilm_path, wait=False) as s:
        seen = s.wait_ready()
    assert seen[-1] == 200 and 503 in seen, seen


def test_a_model_that_cannot_load_exits_2_with_one_line(tmp_path):
    command = [sys.executable, "-m", "bert_port.cli.serve", str(tmp_path / "missing"), "--port", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("bert-port-serve: the model failed to load") and "missing" in last, done.stderr
