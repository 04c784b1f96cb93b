"""`bert_port.threads.ThreadGovernor` (`--threads auto`): the thread count drops to the
cores a neighbour leaves free, and comes back when it leaves; the process's own threads are
never a neighbour.

The tests control what the governor measures instead of reading the whole machine: the
machine's busy CPU time (`threads._cpu_seconds`, /proc/stat) is this process's own CPU time,
read as the governor reads it, plus a neighbour's on a clock the test sets. Another job on
the same cores (a second `make test`, other users) then changes nothing, and no assertion
waits for the machine to be quiet."""

from __future__ import annotations

import os
import time

import pytest
import torch

from bert_port import threads
from bert_port.threads import ThreadGovernor

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs"
)


class Neighbour:
    """The machine as the governor sees it: our own CPU time plus a neighbour that uses
    `cores` cores' worth of CPU for as long as it is set (advanced by the governor's clock,
    time.monotonic, so the load it reports is exactly `cores`)."""

    def __init__(self) -> None:
        self.cores, self.used, self.since = 0.0, 0.0, time.monotonic()

    def set(self, cores: float) -> None:
        now = time.monotonic()
        self.used += self.cores * (now - self.since)
        self.cores, self.since = cores, now

    def busy_seconds(self, cpus) -> float:
        own = os.times()
        now = time.monotonic()
        return own.user + own.system + self.used + self.cores * (now - self.since)


@pytest.fixture
def neighbour(monkeypatch) -> Neighbour:
    machine = Neighbour()
    monkeypatch.setattr(threads, "_cpu_seconds", machine.busy_seconds)
    return machine


def _settle(governor: ThreadGovernor, want: int, steps: int = 8) -> int:
    """Step `governor` past `steps` of its intervals (as a batch loop would); the count it
    sets once it reaches `want`, else the last. The bound is in steps, not in seconds: each
    waits out the governor's interval, however loaded the machine."""
    for _ in range(steps):
        if governor.step() == want:
            return want
        time.sleep(governor.interval)
    return governor.threads


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back(neighbour):
    before = torch.get_num_threads()
    n = len(os.sched_getaffinity(0))
    with ThreadGovernor(interval=0.05) as governor:
        assert _settle(governor, n) == n  # no neighbour: every core
        neighbour.set(1.0)  # one core held, as `while :; do :; done` would hold it
        assert _settle(governor, n - 1) == n - 1
        assert torch.get_num_threads() == n - 1
        neighbour.set(0.1)  # a light neighbour (under TAKEN) takes nothing
        assert _settle(governor, n) == n
        neighbour.set(0.0)
        assert _settle(governor, n) == n
    assert torch.get_num_threads() == before  # put back on exit


def test_the_own_threads_are_not_a_neighbour(neighbour):
    """The process's own busy threads are in the machine's busy time but do not count
    against it: a governor stepped between 2-thread matmuls keeps every CPU."""
    n = len(os.sched_getaffinity(0))
    a = torch.randn(256, 256)
    torch.set_num_threads(n)
    with ThreadGovernor(interval=0.05) as governor:
        for _ in range(10):
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_thread_count_does_not_change_the_bits(minilm_path, dtype):
    """What makes `auto` the default: MiniLM's outputs on real text are the same bits at 1 and
    2 threads (every GEMM of the fast path, the attention kernel and the row-wise ops). A CPU
    whose kernels split a reduction by thread count fails here: fix a thread count there."""
    from bert_port import BertModel, encode, load_tokenizer
    from bert_port.bench.harness import mr_texts

    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no native bf16 here: F.linear emulates it")
    model = BertModel.from_pretrained(minilm_path, dtype=dtype)
    batch = encode(load_tokenizer(minilm_path), mr_texts()[:48], max_length=128)
    before, outputs = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with torch.inference_mode():
                outputs.append(model(**batch).last_hidden_state)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outputs[0], outputs[1])


def test_governed_steps_before_each_forward_and_puts_the_count_back(minilm_path, neighbour):
    from bert_port import SentenceEncoder

    encoder = SentenceEncoder.from_pretrained(minilm_path)
    assert encoder.threads == "auto"  # the default
    before, seen = torch.get_num_threads(), []
    # Each batch waits out the governor's interval first (this pre-hook runs before the governor's),
    # so that every step reads the load again; the forward hook records the count the batch ran at.
    encoder.model.register_forward_pre_hook(lambda *_: time.sleep(threads.INTERVAL_S * 1.2))
    encoder.model.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
    neighbour.set(1.0)  # a neighbour holds one of our two cores
    encoder.encode(["one text", "another text", "a third"], batch_size=1)
    assert seen[-1] == 1, seen  # the governor stepped down before the later forwards
    assert torch.get_num_threads() == before  # and put torch's count back
    encoder.threads = 1
    seen.clear()
    encoder.encode(["one text"])
    assert seen == [1] and torch.get_num_threads() == before


def test_predict_takes_threads(capsys):
    from bert_port.cli.predict import build_parser

    args = ["--model", "m", "--input", "in.csv", "--output", "o.csv"]
    assert build_parser().parse_args(args).threads == "auto"
    assert build_parser().parse_args([*args, "--threads", "1"]).threads == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args([*args, "--threads", "0"])
    assert "--threads" in capsys.readouterr().err
