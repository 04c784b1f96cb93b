"""Checkpoint load time and peak RSS, the port's `from_pretrained` against transformers',
each load in a fresh process (`python -m bert_port.bench.load port|transformers PATH`,
which prints one JSON line).

VmHWM is the peak of the loading process image alone; `ru_maxrss` would also count the
parent's peak, which a forked child inherits on Linux.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from .harness import CONFIGS, progress, run_module


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def measure(kind: str, path: str) -> dict[str, Any]:
    """In this (fresh) process: load `path` with the port or transformers, then one forward
    (which touches every layer's weights, paging in memory-mapped ones)."""
    import resource
    import time

    import torch

    if kind == "port":
        from bert_port import BertModel

        def load():
            return BertModel.from_pretrained(path)
    else:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        cls = transformers.BertModel  # resolved before the clock starts: transformers imports it lazily

        def load():
            return cls.from_pretrained(path, attn_implementation="sdpa").eval()

    before = _status_kib("VmRSS")
    t = time.perf_counter()
    model = load()
    seconds = time.perf_counter() - t
    peak = _status_kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.no_grad():
        model(torch.full((1, 8), 100))
    return {
        "load_s": seconds,
        "rss_before_kib": before,
        "peak_rss_kib": peak,
        "rss_after_forward_kib": _status_kib("VmRSS"),
        "params": sum(p.numel() for p in model.parameters()),
    }


def section_load(quick: bool, reps: int, report) -> dict[str, Any]:
    from bert_port.assets import minilm_dir

    reps = 1 if quick else reps
    report.section(
        f"checkpoint load (fresh process per load, {reps} alternating repetitions"
        + ("" if quick else " after one warm-up each; page cache warm")
        + ")"
    )
    checkpoints = {"all-MiniLM-L6-v2": str(minilm_dir())}
    result = {}
    with tempfile.TemporaryDirectory(prefix="bert-port-bench-") as tmp:
        if not quick:
            checkpoints["bert-base-uncased (random, safetensors)"] = _write_bert_base(Path(tmp))
        for name, path in checkpoints.items():
            runs: dict[str, list[dict]] = {"port": [], "transformers": []}
            warmup = 0 if quick else 1  # a round that warms the page cache, not counted
            for i in progress(range(warmup + reps), f"load {name}"):
                for kind, rows in runs.items():
                    row = run_module("load", kind, path)
                    if i >= warmup:
                        rows.append(row)
            result[name] = {kind: _summary(rows) for kind, rows in runs.items()}
    report.table(
        (
            "checkpoint",
            "loader",
            "load s (median)",
            "peak RSS during load MiB (VmHWM)",
            "of which the load MiB",
            "RSS after one forward MiB",
        ),
        (
            (
                name,
                kind,
                f"{s['load_s']:.3f}",
                f"{s['peak_rss_mib']:.0f}",
                f"{s['peak_minus_before_mib']:.0f}",
                f"{s['rss_after_forward_mib']:.0f}",
            )
            for name, r in result.items()
            for kind, s in r.items()
        ),
    )
    return result


def _summary(rows: list[dict]) -> dict[str, Any]:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {
        "load_s": med("load_s"),
        "peak_rss_mib": med("peak_rss_kib") / 1024,
        "peak_minus_before_mib": statistics.median((r["peak_rss_kib"] - r["rss_before_kib"]) / 1024 for r in rows),
        "rss_after_forward_mib": med("rss_after_forward_kib") / 1024,
        "params": rows[0]["params"],
        "runs": rows,
    }


def _write_bert_base(directory: Path) -> str:
    from bert_port.reference import random_hf_model

    config = json.loads((CONFIGS / "bert-base-uncased.json").read_text())
    out = directory / "bert-base-uncased"
    random_hf_model(config, "BertModel").save_pretrained(out)  # HF's own layout and safetensors
    return str(out)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("port", "transformers"):
        sys.exit("usage: python -m bert_port.bench.load port|transformers CHECKPOINT")
    print(json.dumps(measure(sys.argv[1], sys.argv[2])))
