"""The serving bench end to end on its cheapest server: the minimal SentenceTransformer app in a
real uvicorn process on a free port, a handful of requests at two concurrencies, and the
markdown table it writes. No timed assertions: only that every row is there and sane."""

from __future__ import annotations

import pytest

from bert_port.bench import serving
from bert_port.bench.serving_load import MAX_TEXTS, make_requests

ST = "sentence-transformers (FastAPI)"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _table(markdown: str, first_header: str) -> list[dict[str, str]]:
    """The rows, by column name, of the markdown table whose header starts with `first_header`."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    header = _cells(lines[start])
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, _cells(line))))
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
    assert [(r["server"], r["concurrency"]) for r in rows] == [(ST, "1"), (ST, "3")]
    for row in rows:
        assert float(row["texts/s"]) > 0 and float(row["p50 ms"]) > 0
        assert float(row["p99 ms"]) >= float(row["p50 ms"])
        assert (row["requests"], row["failed"], row["reps"]) == ("4", "0", "1/1")
