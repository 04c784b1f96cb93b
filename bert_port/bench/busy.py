"""The busy-neighbour section: the MR batches of the real-text table timed twice, on a quiet
machine and with one CPU held by a shell loop (`sh -c 'while :; do :; done'`, pinned to the
last CPU this process may use), as a noisy neighbour or a second worker would hold it.

Each system reports the share of its quiet throughput it keeps, and the port its ratio to
CTranslate2 fp32 (in its own process, with the same thread count) under load. A thread
count above the free cores makes every intra-op parallel region wait for the thread the
loop displaces, so the systems with fewer, larger regions keep more.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..threads import ThreadGovernor, child_pids
from .harness import REFERENCE, Row, interleave, mr_batches, ratio
from .peers import peer_rows
from .throughput import model_forward

PORT, PORT_BF16, HF_BF16 = "port, fp32", "port, bf16 weights", "transformers, bf16 weights"
AUTO = ", --threads auto"
# Between two timed calls: CTranslate2's OpenMP threads spin for up to 200 ms after a call
# (KMP_BLOCKTIME), on the one free core too, and would slow whichever row came next.
PAUSE_S = 0.25


def governed(forward, governor: ThreadGovernor):
    """`forward` at the thread count `governor` picks (`--threads auto`), the process's count
    put back afterwards for the rows timed beside it."""

    def run(batch):
        governor.step()
        try:
            return forward(batch)
        finally:
            torch.set_num_threads(governor.saved)

    return run


@contextlib.contextmanager
def busy_cpu():
    """A shell loop spinning on the last CPU of this process's affinity set, for the duration;
    yields that CPU."""
    cpu = max(os.sched_getaffinity(0))
    loop = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    os.sched_setaffinity(loop.pid, {cpu})  # from here: a preexec_fn is unsafe with threads
    try:
        yield cpu
    finally:
        loop.kill()
        loop.wait()


def section_busy(args, device: torch.device, bf16: bool, report) -> dict[str, Any]:
    from bert_port import BertModel, load_tokenizer
    from bert_port.assets import minilm_dir
    from bert_port.extras import require

    if device.type != "cpu" or len(os.sched_getaffinity(0)) < 2:
        report.line("busy neighbour: skipped (it needs the CPU and at least 2 usable cores)")
        return {}
    transformers = require("transformers")
    path = minilm_dir()
    threads = torch.get_num_threads()
    batches = mr_batches(load_tokenizer(path), 2 if args.quick else args.batches, args.batch_size, args.seed, device)
    ref = transformers.BertModel.from_pretrained(str(path), attn_implementation="sdpa").eval()
    port = model_forward(BertModel.from_pretrained(path))
    governor = ThreadGovernor(max_threads=threads)  # one for both dtypes: one process, one thread pool
    rows = {REFERENCE: Row(model_forward(ref)), PORT: Row(port), PORT + AUTO: Row(governed(port, governor))}
    if bf16:
        port_bf16 = model_forward(BertModel.from_pretrained(path, dtype=torch.bfloat16))
        rows[PORT_BF16] = Row(port_bf16)
        rows[PORT_BF16 + AUTO] = Row(governed(port_bf16, governor))
        hf_bf16 = transformers.BertModel.from_pretrained(str(path), attn_implementation="sdpa", dtype=torch.bfloat16)
        rows[HF_BF16] = Row(model_forward(hf_bf16.eval()))
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bert-port-busy-"))
        peers = peer_rows(
            ["ctranslate2"] if "ctranslate2" in args.peers else [], path, ref, Path(tmp), device, threads, report, stack
        )
        rows.update({name: row for name, row in peers.items() if "fp32" in name})
        governor.exclude = child_pids()  # the peers' processes, timed in turn with the port: not neighbours
        timed = {name: row.timed or row.forward for name, row in rows.items()}
        quiet = interleave(timed, batches, args.reps, device, "busy neighbour: quiet", seed=args.seed, pause=PAUSE_S)
        with busy_cpu() as cpu:
            busy = interleave(timed, batches, args.reps, device, "busy: one CPU held", seed=args.seed, pause=PAUSE_S)
    return _report(quiet, busy, cpu, threads, report)


def _report(quiet: dict[str, list[float]], busy: dict[str, list[float]], cpu: int, threads: int, report):
    ct2 = next((name for name in busy if name.startswith("CTranslate2")), None)
    report.section(
        f"busy neighbour: MR batches at {threads} thread(s), quiet and with CPU {cpu} held by "
        "`sh -c 'while :; do :; done'`; each system's kept share of its quiet throughput"
    )
    figures = {}
    for name, times in quiet.items():
        figures[name] = {
            "quiet_median_s": statistics.median(times),
            "busy_median_s": statistics.median(busy[name]),
            "kept": statistics.median(times) / statistics.median(busy[name]),
            "busy_vs_ctranslate2_fp32": ratio(busy[ct2], busy[name]) if ct2 else None,
            "quiet_seconds": times,
            "busy_seconds": busy[name],
        }
    report.table(
        ("system", "ms/pass quiet", "ms/pass busy", "kept share", "x CTranslate2 fp32, busy"),
        (
            (
                name,
                f"{f['quiet_median_s'] * 1e3:.0f}",
                f"{f['busy_median_s'] * 1e3:.0f}",
                f"{100 * f['kept']:.0f}%",
                "" if f["busy_vs_ctranslate2_fp32"] is None else f"{f['busy_vs_ctranslate2_fp32']:.2f}",
            )
            for name, f in figures.items()
        ),
    )
    return {"threads": threads, "busy_cpu": cpu, "rows": figures}
