"""The bench's peer process (`bert_port/bench/peer_worker.py`, driven by `peers.PeerProcess`):
what it keeps out (torch, the peers' telemetry), and that no step waits on it forever (`make test`
once hung on a worker deadlocked in OpenVINO's telemetry, read without a deadline)."""

from __future__ import annotations

import contextlib
import math
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from bert_port.bench import peers
from bert_port.bench.harness import Report, RowFailed, interleave
from bert_port.bench.peers import PeerProcess

BATCH = {name: torch.zeros(1, 4, dtype=torch.long) for name in peers.NAMES}
SLACK_S = 10.0  # a loaded 2-core machine: killing and reaping the child, starting Python


def test_a_fresh_worker_holds_no_thread_no_fork_and_neither_torch_nor_telemetry():
    with contextlib.ExitStack() as stack:
        worker = PeerProcess(stack)
        worker.build("quiet", "stall", {})
        state = worker.state()
    assert state == {"threads": ["MainThread"], "forks": 0, "imported": [], "peers": []}
    assert worker.process.returncode == 0


def test_keep_out_refuses_torch_and_telemetry_as_if_not_installed():
    """In the worker, `import torch` fails as where torch is not installed (find_spec finds no
    origin, which NNCF reads as absent), and so does `openvino_telemetry`: OpenVINO's converter
    falls back to its own telemetry stub."""
    code = f"""
import importlib.util, sys
sys.path.insert(0, {str(peers.WORKER.parent)!r})
import peer_worker
peer_worker.keep_out()
for name in ("torch", "torch.fx", "openvino_telemetry"):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        assert "keeps it out" in str(exc), exc
    else:
        raise AssertionError(name + " imported")
assert importlib.util.find_spec("torch").origin is None
import os
assert os.environ["NNCF_CI"] == "1"
try:
    from openvino.tools.ovc import telemetry_utils
except ImportError:
    pass
else:
    assert telemetry_utils.tm.__name__ == "openvino.tools.ovc.telemetry_stub", telemetry_utils.tm
assert not [m for m in sys.modules if m.split(".")[0] in ("torch", "openvino_telemetry") and sys.modules[m]]
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_peer_that_stops_answering_fails_its_row_within_the_deadline():
    """A real worker whose row sleeps in its call: the call fails within the run deadline with
    one line naming the row and the step, the worker is killed, and the other rows of that
    process fail at once."""
    with contextlib.ExitStack() as stack:
        worker = PeerProcess(stack, deadlines={"run": 2.0})
        stalled = worker.build("stalled peer", "stall", {"run_s": 600})
        other = worker.build("other peer", "stall", {})
        assert other.timed(BATCH) is None
        start = time.monotonic()
        with pytest.raises(RowFailed) as failure:
            stalled.timed(BATCH)
        assert time.monotonic() - start < 2.0 + SLACK_S
        assert worker.process.returncode == -signal.SIGKILL
        pid = worker.process.pid
        assert str(failure.value) == f"stalled peer: no answer to 'run' within 2 s; its process ({pid}) was killed"
        start = time.monotonic()
        with pytest.raises(
            RowFailed, match=r"^other peer: not run \(run\), its peer process failed earlier: no answer"
        ):
            other.forward(BATCH)
        assert time.monotonic() - start < 1.0
    assert worker.process.stdout.closed and worker.process.stdin.closed


def test_a_worker_that_reads_nothing_fails_the_build_within_the_deadline(monkeypatch, tmp_path):
    """A child that never reads its input (stuck before it serves): the request, larger than a
    pipe holds, cannot be written, and the build fails within its deadline instead of blocking."""
    stuck = tmp_path / "stuck.py"
    stuck.write_text("import time\ntime.sleep(600)\n")
    monkeypatch.setattr(peers, "WORKER", stuck)
    with contextlib.ExitStack() as stack:
        worker = PeerProcess(stack, deadlines={"build": 2.0})
        start = time.monotonic()
        with pytest.raises(
            RowFailed, match=r"^big peer: no answer to 'build' within 2 s; its process \(\d+\) was killed$"
        ):
            worker.build("big peer", "stall", {"payload": np.zeros(1 << 20, dtype=np.uint8)})
        assert time.monotonic() - start < 2.0 + SLACK_S
        assert worker.process.returncode == -signal.SIGKILL


def test_interleave_reports_a_failed_row_and_times_the_others():
    """The bench goes on without a row that fails: its times are NaN and a line names it; the
    other rows are timed in full. One row of a real worker that stops answering (it fails at the
    warm-up), one that fails on its third call."""
    calls = {"flaky": 0}

    def flaky(batch):
        calls["flaky"] += 1
        if calls["flaky"] == 3:
            raise RowFailed("flaky: no answer to 'run' within 1 s; its process (0) was killed")

    report = Report()
    with contextlib.ExitStack() as stack:
        worker = PeerProcess(stack, deadlines={"run": 1.0})
        stalled = worker.build("stalled peer", "stall", {"run_s": 600})
        variants = {"here": lambda batch: sum(range(1000)), "stalled peer": stalled.timed, "flaky": flaky}
        times = interleave(variants, [BATCH] * 3, 2, torch.device("cpu"), "test", report=report)
    assert all(t > 0 for t in times["here"]) and len(times["here"]) == 2
    assert all(math.isnan(t) for t in times["stalled peer"] + times["flaky"])
    assert calls["flaky"] == 3  # left out once it failed
    stalled_line = (
        "stalled peer: failed, its figures are NaN: no answer to 'run' within 1 s; "
        f"its process ({worker.process.pid}) was killed"
    )
    assert report.lines == [
        stalled_line,
        "flaky: failed, its figures are NaN: no answer to 'run' within 1 s; its process (0) was killed",
    ]


def test_the_bench_reports_a_peer_whose_build_hangs_and_goes_on(monkeypatch, tmp_path, capsys):
    """`peers.peer_rows` with a worker stuck before it serves: the peer is left out with the
    line that says why, within the build deadline, and the bench goes on with its other rows."""
    if not peers.importable("onnxruntime"):
        pytest.skip("needs onnxruntime (pip install 'bert-port[bench]')")
    stuck = tmp_path / "stuck.py"
    stuck.write_text("import time\ntime.sleep(600)\n")
    monkeypatch.setattr(peers, "WORKER", stuck)
    monkeypatch.setitem(peers.DEADLINES, "build", 2.0)
    (tmp_path / "transformers.onnx").write_bytes(b"")  # "already exported": the worker never reads it
    with contextlib.ExitStack() as stack:
        rows = peers.peer_rows(["onnxruntime"], None, None, tmp_path, torch.device("cpu"), 1, Report(), stack)
    assert rows == {}
    out = capsys.readouterr().out
    assert "onnxruntime: left out, it failed to build (RowFailed: ONNX Runtime " in out
    assert "(exported from transformers): no answer to 'build' within 2 s; its process (" in out
