"""The benchmark's harness: the report (stdout and a markdown file), interleaved timing,
the machine, FLOP counts, inputs, and running a section in a fresh process.

Every timed section interleaves its variants call by call, in a shuffled order, for several
repetitions; rows report the median time of a repetition and the median of the
per-repetition ratios, so that load from other processes hits every variant alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import speed
from ..assets import config_dir
from ..speed.kernels import cpu_flags
from ..speed.layers import PackedBertModel

CONFIGS = config_dir()  # the real HF configs: configs/ in a checkout, package data in a wheel


class Report:
    """What the bench prints, kept as markdown too, so that `--markdown PATH` writes the
    same tables the terminal showed."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def section(self, title: str) -> None:
        self.line()
        self.line(f"## {title}")

    def table(self, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        self.line("| " + " | ".join(header) + " |")
        self.line("|" + "---|" * len(header))
        for row in rows:
            self.line("| " + " | ".join(str(c) for c in row) + " |")

    def write(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(self.lines) + "\n", encoding="utf-8")
        return path


Forward = Callable[[dict[str, Tensor]], Tensor]
REFERENCE = "transformers (sdpa), fp32"


@dataclass
class Row:
    """A timed variant: `forward` gives the last hidden state; `baseline` names the row
    it is compared with at the same precision; `timed`, when set, is what the timing loop
    calls instead of `forward` (a peer in its own process need not send its output back)."""

    forward: Forward
    baseline: str = REFERENCE
    timed: Callable[[dict[str, Tensor]], object] | None = None


class RowFailed(RuntimeError):
    """A row that cannot go on (a peer whose process stopped answering, died or failed the
    call: `peers.PeerProcess`). `interleave` reports it and times the other rows without it."""


def progress(iterable: Iterable, desc: str, total: int | None = None):
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False, file=sys.stderr, dynamic_ncols=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleave(
    variants: dict[str, Callable[[Any], Any]],
    inputs: list,
    reps: int,
    device: torch.device,
    desc: str,
    seed: int = 0,
    warmup: int = 1,
    pause: float = 0.0,
    report: Report | None = None,
) -> dict[str, list[float]]:
    """Seconds per repetition (one pass over `inputs`) of every variant. Within a
    repetition the variants take turns on each input, in a shuffled order, `pause` seconds
    apart (untimed: the threads a variant leaves spinning stop before the next one starts).
    A variant that raises `RowFailed` is reported (in `report`, else on stderr) and left out
    from then on, its times NaN; the others go on."""
    rng = random.Random(seed)
    failed: set[str] = set()

    def call(name: str, batch) -> bool:
        try:
            variants[name](batch)
        except RowFailed as exc:
            failed.add(name)
            reason = str(exc).splitlines()[0].removeprefix(f"{name}: ")
            line = f"{name}: failed, its figures are NaN: {reason}"
            if report is not None:
                report.line(line)
            else:
                print(line, file=sys.stderr, flush=True)
            return False
        return True

    for _ in range(warmup):
        for name in variants:
            if name not in failed:
                call(name, inputs[0])
    times = {name: [0.0] * reps for name in variants}
    for step in progress(range(reps * len(inputs)), desc):
        rep, item = divmod(step, len(inputs))
        order = [name for name in variants if name not in failed]
        rng.shuffle(order)
        for name in order:
            if pause:
                time.sleep(pause)
            sync(device)
            t = time.perf_counter()
            ran = call(name, inputs[item])
            sync(device)
            times[name][rep] += time.perf_counter() - t if ran else 0.0
    return {name: [float("nan")] * reps if name in failed else ts for name, ts in times.items()}


def ratio(reference: list[float], times: list[float]) -> float:
    """Median over repetitions of reference time / time (> 1: faster than the reference)."""
    return statistics.median(r / t for r, t in zip(reference, times))


@contextlib.contextmanager
def config_override(model, **fields):
    """The model with some settings changed for the duration: config fields (e.g.
    `attn_implementation="varlen"`), and two of the speed layer's: `batch_invariant`
    (`speed.optimize`'s) and `unpad_inputs=False` (the plain model of bert.py, `speed.restore`)."""
    config = model.config  # shared by every module, which reads it at each call
    old = {name: getattr(config, name) for name in fields if name not in ("batch_invariant", "unpad_inputs")}
    for name in old:
        setattr(config, name, fields[name])
    invariant = next((m.batch_invariant for m in model.modules() if isinstance(m, PackedBertModel)), None)
    if fields.get("unpad_inputs") is False and invariant is not None:
        speed.restore(model)
    elif "batch_invariant" in fields and invariant is not None:
        speed.optimize(model, batch_invariant=fields["batch_invariant"])
    try:
        yield model
    finally:
        for name, value in old.items():
            setattr(config, name, value)
        if invariant is not None:
            speed.optimize(model, batch_invariant=invariant)


# -- the machine --------------------------------------------------------------------------


NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def native_bf16(device: torch.device, flags: set[str] | None = None) -> str | None:
    """What gives this device native bf16 matmuls (a CPU flag, or the GPU), None if nothing:
    without them torch emulates bf16 far slower than fp32, and bf16 rows mean nothing."""
    if device.type == "cuda":
        return "CUDA bf16" if torch.cuda.is_bf16_supported() else None
    flags = cpu_flags() if flags is None else flags
    found = [f for f in NATIVE_BF16_FLAGS if f in flags]
    return ", ".join(found) or None


def machine_info(device: torch.device) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    flags = cpu_flags()
    info = {
        "cpu": cpu,
        "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "amx"))),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": native_bf16(device, flags),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "loadavg_start": os.getloadavg(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


# -- FLOPs --------------------------------------------------------------------------------


def model_flops(config, attention_mask: Tensor, pooler: bool = True) -> float:
    """Multiply-adds x 2 of the encoder (and pooler) on the real tokens of one batch:
    the dense layers per token, attention per pair of real tokens in a sequence."""
    H, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    lens = attention_mask.bool().sum(1).double()
    n = float(lens.sum())
    per_layer = n * 2 * (4 * H * H + 2 * H * inter) + 4 * H * float((lens**2).sum())
    return layers * per_layer + (2 * H * H * attention_mask.shape[0] if pooler else 0.0)


def matmul_gflops(dtype: torch.dtype, device: torch.device, n: int, reps: int = 3) -> float:
    """Best of `reps` GFLOP/s of an n x n x n matmul."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


# -- inputs -------------------------------------------------------------------------------


def mr_texts() -> list[str]:
    """The MR movie-review sentences, through the project's reader (`bert_port.data`)."""
    from bert_port.data import load_mr

    return load_mr().texts


def mr_batches(
    tokenizer, n: int, batch_size: int, seed: int, device: torch.device, sort_lengths: bool = False
) -> list[dict[str, Tensor]]:
    """`n` batches of `batch_size` MR sentences drawn at random, padded to each batch's longest;
    with `sort_lengths`, the same sentences batched by token length (as an embedding job sorts
    them: little padding left)."""
    from bert_port import encode

    texts = mr_texts()
    rng = random.Random(seed)
    drawn = [rng.sample(texts, batch_size) for _ in range(n)]
    if sort_lengths:
        flat = sorted((t for batch in drawn for t in batch), key=lambda t: len(tokenizer.encode(t).ids))
        drawn = [flat[i : i + batch_size] for i in range(0, len(flat), batch_size)]
    return [{k: v.to(device) for k, v in encode(tokenizer, batch).items()} for batch in drawn]


# -- fresh processes ----------------------------------------------------------------------


def run_module(module: str, *args: str) -> dict[str, Any]:
    """Run `python -m bert_port.bench.<module> args...` in a fresh process and return the
    JSON object it prints last."""
    out = subprocess.run(
        [sys.executable, "-m", f"bert_port.bench.{module}", *args], capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise RuntimeError(f"python -m bert_port.bench.{module} {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
