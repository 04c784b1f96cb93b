"""Where the time goes: torch.profiler self time by category, per batch, for the port and
transformers on the same batches (`--profile`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .harness import sync

CATEGORIES = [
    ("matmul", ("addmm", "aten::mm", "bmm", "matmul", "linear", "_mkl")),
    ("attention kernel", ("scaled_dot_product", "flash_attention", "softmax", "_efficient_attention")),
    ("layernorm", ("layer_norm",)),
    ("gelu/tanh", ("gelu", "tanh")),
    ("elementwise (add/mul/where)", ("aten::add", "aten::mul", "aten::where", "masked_fill", "aten::div")),
    (
        "gather/scatter/copies",
        (
            "index_select",
            "index_copy",
            "index_put",
            "copy_",
            "aten::cat",
            "clone",
            "zeros",
            "fill_",
            "contiguous",
            "nonzero",
            "embedding",
            "_to_copy",
        ),
    ),
]


def category(name: str) -> str:
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other"


def section_profile(
    variants: dict[str, Callable], batches: list, device: torch.device, profile_dir: str | None, report
) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    report.section("profile: self time by category (torch.profiler), ms per batch")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    result = {}
    for name, fn in variants.items():
        fn(batches[0])
        with profile(activities=activities) as prof:
            for batch in batches:
                fn(batch)
            sync(device)
        if profile_dir:
            Path(profile_dir).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(profile_dir) / f"{name.replace(' ', '_').replace(',', '')}.json"))
        per_cat: dict[str, float] = {}
        ops = []
        for e in prof.key_averages():
            us = e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total
            if us <= 0:
                continue
            ms = us / 1e3 / len(batches)
            per_cat[category(e.key)] = per_cat.get(category(e.key), 0.0) + ms
            ops.append((e.key, ms, e.count // len(batches)))
        ops.sort(key=lambda x: -x[1])
        result[name] = {"categories_ms_per_batch": per_cat, "top_ops": ops[:12]}
    cats = [c for c, _ in CATEGORIES] + ["other"]
    report.table(
        ("category", *result),
        [(c, *(f"{result[v]['categories_ms_per_batch'].get(c, 0.0):.1f}" for v in result)) for c in cats]
        + [("total", *(f"{sum(result[v]['categories_ms_per_batch'].values()):.1f}" for v in result))],
    )
    for name, r in result.items():
        report.line()
        report.line(f"top ops, {name}: " + ", ".join(f"{k} {ms:.1f} ms x{n}" for k, ms, n in r["top_ops"][:8]))
    return result
