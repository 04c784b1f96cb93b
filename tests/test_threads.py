"""`bert_port.threads.ThreadGovernor` (`--threads auto`): the thread count drops to the
cores a real neighbour leaves free, and comes back when it leaves."""

from __future__ import annotations

import os
import time

import pytest
import torch

from bert_port.bench.busy import busy_cpu
from bert_port.threads import ThreadGovernor

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) < 2, reason="needs /proc/stat and 2 CPUs"
)


def _settle(governor: ThreadGovernor, want: int, within_s: float = 5.0) -> int:
    """Step `governor` (as a batch loop would, with a little work between) until it sets
    `want` threads or `within_s` pass; the last count."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if governor.step() == want:
            return want
        time.sleep(0.05)
    return governor.threads


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back():
    before = torch.get_num_threads()
    n = len(os.sched_getaffinity(0))
    with ThreadGovernor(interval=0.2) as governor:
        assert _settle(governor, n) == n  # the suite runs alone: the cores are free
        with busy_cpu():
            assert _settle(governor, n - 1) == n - 1
            assert torch.get_num_threads() == n - 1
        assert _settle(governor, n) == n
    assert torch.get_num_threads() == before  # put back on exit


def test_the_own_threads_are_not_a_neighbour():
    """The process's own busy threads do not count against it: a governor stepped between
    2-thread matmuls keeps every CPU."""
    n = len(os.sched_getaffinity(0))
    a = torch.randn(512, 512)
    with ThreadGovernor(interval=0.2) as governor:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            governor.step()
            for _ in range(20):
                a @ a
        assert governor.threads == n


def test_embed_cli_takes_threads_auto(tmp_path, minilm_path):
    from bert_port.cli.embed import main

    (tmp_path / "in.txt").write_text("a first text\nand a second one\n", encoding="utf-8")
    before = torch.get_num_threads()
    code = main(
        [
            str(tmp_path / "in.txt"),
            str(tmp_path / "out"),
            "--model",
            str(minilm_path),
            "--threads",
            "auto",
            "--no-progress",
            "--device",
            "cpu",
        ]
    )
    torch.set_num_threads(before)
    assert code == 0 and any((tmp_path / "out").iterdir())


def test_threads_flag_rejects_a_bad_value(capsys):
    from bert_port.cli.embed import main

    with pytest.raises(SystemExit):
        main(["in.txt", "out", "--threads", "0"])
    assert "--threads" in capsys.readouterr().err
