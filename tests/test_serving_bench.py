"""The serving bench end to end on its cheapest server: the minimal SentenceTransformer app in a
real uvicorn process on a free port, a handful of requests at two concurrencies, and the
markdown table it writes. No timed assertions: only that every row is there and sane."""

from __future__ import annotations

import pytest

from bert_port.bench import serving
from bert_port.bench.serving_load import MAX_TEXTS, make_requests

ST = "sentence-transformers (FastAPI)"


def _table(markdown: str, first_header: str) -> list[list[str]]:
    """The rows of the markdown table whose header starts with `first_header`."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_requests_are_seeded_and_realistic():
    pools = (["a sentence of a movie review", "another one"], ["ok", "thanks"])
    first = make_requests(50, seed=3, pools=pools)
    assert first == make_requests(50, seed=3, pools=pools)
    assert all(1 <= len(r) <= MAX_TEXTS for r in first)
    assert {t for r in first for t in r} <= {*pools[0], *pools[1]}


@pytest.mark.slow  # a server process importing sentence-transformers: 20 s to a minute on 2 shared cores
def test_bench_against_the_sentence_transformers_app(tmp_path):
    for module in ("sentence_transformers", "httpx", "uvicorn", "fastapi"):
        pytest.importorskip(module)
    out = tmp_path / "serving.md"
    argv = ["--servers", "st", "--concurrency", "1,3", "--requests", "4", "--reps", "1", "--markdown", str(out)]
    argv += ["--threads", "1", "--start-deadline", "240"]
    assert serving.main(argv) == 0
    text = out.read_text(encoding="utf-8")
    assert "CPU: " in text
    rows = _table(text, "server")
    assert [(r[0], r[1]) for r in rows] == [(ST, "1"), (ST, "3")]
    for row in rows:
        texts_per_s, p50, p99, requests, failed = float(row[2]), float(row[3]), float(row[4]), int(row[6]), int(row[7])
        assert texts_per_s > 0 and p50 > 0
        assert p99 >= p50
        assert (requests, failed, row[8]) == (4, 0, "1/1")
