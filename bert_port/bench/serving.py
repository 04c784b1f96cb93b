"""The serving bench: `bert-port-serve` against infinity-emb and `SentenceTransformer` behind a
minimal FastAPI app, each in a process of its own with the same thread budget, under a load
of 1, 8 and 64 concurrent clients sending 1 to 32 real texts per request.

Servers run one at a time, each started on a free port, warmed up, measured at every
concurrency and stopped; the order rotates from one repetition to the next, so that load
from other processes falls on every server alike. Rows are medians over repetitions and
ratios are medians of the per-repetition ratios (port / peer). Run as
`python -m bert_port.bench.serving --markdown PATH`; `--setup-infinity` first builds the
venv infinity-emb needs (`.venv-infinity`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from .serving_load import RunResult, make_requests, measure, text_pool, warm_up
from .serving_procs import (
    INFINITY_VERSION,
    ServerSpec,
    cpu_seconds,
    infinity_ready,
    infinity_spec,
    port_spec,
    running,
    setup_infinity,
    st_spec,
)

log = logging.getLogger(__name__)

SERVERS = ("port", "port-int8", "infinity", "st")
WARMUP_REQUESTS = 8
PORT_FP32, INFINITY = "bert-port-serve fp32", "infinity-emb"

Results = dict[str, dict[int, list[RunResult | None]]]  # server -> concurrency -> one per repetition


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bert_port.bench.serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder every server serves (default: the bundled MiniLM)")
    p.add_argument("--threads", type=int, default=2, help="thread budget of every server (default 2)")
    p.add_argument("--reps", type=int, default=3, help="repetitions, the server order rotated each time (default 3)")
    p.add_argument("--concurrency", default="1,8,64", help="comma-separated client counts (default 1,8,64)")
    p.add_argument(
        "--requests", type=int, default=None, help="requests per concurrency (default: 32 + 4 x concurrency)"
    )
    p.add_argument("--max-seconds", type=float, default=60.0, help="no request starts after this, per run (60)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a request fails (default 60)")
    p.add_argument("--start-deadline", type=float, default=300.0, help="seconds a server may take to be ready")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated subset of {', '.join(SERVERS)}")
    p.add_argument("--infinity-venv", type=Path, default=Path(".venv-infinity"), help="infinity-emb's own venv")
    p.add_argument("--setup-infinity", action="store_true", help="create --infinity-venv first (pip, CPU torch)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (default 0)")
    p.add_argument("--markdown", default=None, help="also write the report to this markdown file")
    return p.parse_args(argv)


def build_specs(args: argparse.Namespace, model_dir: Path) -> tuple[list[ServerSpec], list[str]]:
    """The servers asked for, and a note for each one left out."""
    chosen = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SERVERS))
    if unknown:
        raise SystemExit(f"unknown --servers {unknown}; choose among {', '.join(SERVERS)}")
    specs, notes = [], []
    for name in chosen:
        if name == "port":
            specs.append(port_spec(model_dir, args.threads))
        elif name == "port-int8":
            specs.append(port_spec(model_dir, args.threads, "int8"))
        elif name == "st":
            specs.append(st_spec(model_dir, args.threads))
        elif infinity_ready(args.infinity_venv):
            specs.append(infinity_spec(model_dir, args.infinity_venv.resolve()))
        else:
            notes.append(f"infinity-emb left out: no {args.infinity_venv}/bin/infinity_emb (run with --setup-infinity)")
    return specs, notes


def n_requests(args: argparse.Namespace, concurrency: int) -> int:
    return args.requests if args.requests is not None else 32 + 4 * concurrency


def run_server(spec: ServerSpec, args, workloads: dict[int, list], pools, loads: list[float]) -> dict[int, RunResult]:
    """Start `spec`, warm it up (checking its answers), measure every concurrency, stop it."""
    out = {}
    with running(spec, args.threads, args.start_deadline) as (base, pid):
        url = base + spec.route
        asyncio.run(warm_up(url, make_requests(WARMUP_REQUESTS, args.seed - 1, pools), args.timeout))
        for c, requests in workloads.items():
            loads.append(os.getloadavg()[0])
            cpu = cpu_seconds(pid)
            out[c] = measure(url, requests, c, args.max_seconds, args.timeout)
            out[c].server_cpu_s = cpu_seconds(pid) - cpu
            log.info("%s c=%d: %.1f texts/s, p99 %.0f ms", spec.name, c, out[c].texts_per_s, out[c].latency_ms(99))
    return out


def run_all(specs: list[ServerSpec], args, concurrencies: list[int], notes: list[str], loads: list[float]) -> Results:
    """Every repetition: the same requests for every server, the servers in rotated order."""
    pools = text_pool()
    results: Results = {s.name: {c: [] for c in concurrencies} for s in specs}
    for rep in range(args.reps):
        workloads = {c: make_requests(n_requests(args, c), args.seed + 1000 * rep + c, pools) for c in concurrencies}
        shift = rep % len(specs)
        for spec in specs[shift:] + specs[:shift]:
            try:
                got = run_server(spec, args, workloads, pools, loads)
            except RuntimeError as e:
                log.error("%s failed in repetition %d: %s", spec.name, rep + 1, e)
                notes.append(f"{spec.name} failed in repetition {rep + 1}: {str(e).splitlines()[0]}")
                got = {}
            for c in concurrencies:
                results[spec.name][c].append(got.get(c))
    return results


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summary_rows(results: Results) -> list[list]:
    rows = []
    for name, per_c in results.items():
        for c, runs in per_c.items():
            done = [r for r in runs if r is not None and r.latencies]
            failed = sum(r.failed for r in runs if r is not None)
            rows.append(
                [
                    name,
                    c,
                    f"{_median([r.texts_per_s for r in done]):.1f}",
                    f"{_median([r.latency_ms(50) for r in done]):.0f}",
                    f"{_median([r.latency_ms(99) for r in done]):.0f}",
                    f"{_median([r.cpu_share for r in done]):.2f}",
                    f"{_median([r.texts / r.server_cpu_s for r in done if r.server_cpu_s > 0]):.0f}",
                    f"{sum(len(r.latencies) for r in done)}",
                    f"{failed}",
                    f"{len(done)}/{len(runs)}",
                ]
            )
    return rows


def ratio(results: Results, port: str, peer: str, c: int, stat: str) -> float:
    """Median over repetitions of port / peer for `stat` (texts_per_s, p50 or p99)."""

    def value(r: RunResult) -> float:
        return r.texts_per_s if stat == "texts_per_s" else r.latency_ms(float(stat[1:]))

    pairs = zip(results[port][c], results[peer][c])
    return _median([value(a) / value(b) for a, b in pairs if a and b and a.latencies and b.latencies])


def ratio_rows(results: Results) -> list[list]:
    ports = [n for n in results if n.startswith("bert-port-serve")]
    peers = [n for n in results if n not in ports]
    rows = []
    for port in ports:
        for peer in peers:
            for c in results[port]:
                stats = [ratio(results, port, peer, c, s) for s in ("texts_per_s", "p50", "p99")]
                rows.append([port, peer, c, *(f"{x:.2f}" for x in stats)])
    return rows


def goal_lines(results: Results) -> list[str]:
    """The issue's two targets at this thread budget, where both rows were measured."""
    if PORT_FP32 not in results or INFINITY not in results:
        return []
    lines = []
    if 64 in results[PORT_FP32]:
        x = ratio(results, PORT_FP32, INFINITY, 64, "texts_per_s")
        lines.append(f"- fp32 throughput / infinity-emb at concurrency 64: {x:.2f}x (target >= 1.5x)")
    if 8 in results[PORT_FP32]:
        x = ratio(results, PORT_FP32, INFINITY, 8, "p99")
        lines.append(f"- fp32 p99 latency / infinity-emb's at concurrency 8: {x:.2f} (target <= 1.0)")
    return lines


def cpu_line(info: dict) -> str:
    """The CPU as the bench names it, with its family and model numbers (which tell an AMD
    EPYC's generation where the model name does not: family 25 is Zen 3 and 4, 26 Zen 5)."""
    numbers = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("cpu family", "model") and key.strip() not in numbers:
                numbers[key.strip()] = value.strip()
    family = f", family {numbers['cpu family']} model {numbers['model']}" if len(numbers) == 2 else ""
    return f"CPU: {info['cpu']}{family} ({info['logical_cpus']} logical CPUs; {', '.join(info['cpu_flags'])})"


def provenance(argv: list[str] | None) -> str:
    """The command that made the report, the checkout's commit and the versions served."""
    from importlib.metadata import PackageNotFoundError, version

    commit = "unknown"
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        here = Path(__file__).resolve().parent
        commit = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    versions = []
    for name in ("torch", "sentence-transformers"):
        with contextlib.suppress(PackageNotFoundError):
            versions.append(f"{name} {version(name)}")
    argv = sys.argv[1:] if argv is None else argv
    return (
        f"Made by `python -m bert_port.bench.serving {' '.join(argv)}` at commit {commit}; "
        + ", ".join(versions)
        + f"; infinity-emb {INFINITY_VERSION} in its own venv."
    )


def report(results: Results, args, concurrencies: list[int], notes: list[str], loads: list[float], argv=None):
    import torch

    from .harness import Report, machine_info

    rep = Report()
    info = machine_info(torch.device("cpu"))
    rep.section("Serving: texts/s and latency per server")
    rep.line(cpu_line(info))
    rep.line(provenance(argv))
    rep.line(
        f"Thread budget {args.threads} per server; {args.reps} repetitions, medians; clients: "
        + ", ".join(f"{c} ({n_requests(args, c)} requests)" for c in concurrencies)
        + "; 1-32 texts per request (MR sentences, 30% short messages). Server CPU: cores' worth the"
        + " server process used while measured (the budget on a quiet machine, less where others took the cores);"
        + " texts/CPU-s: texts per CPU second of the server process."
    )
    rep.line(f"Load average (1 min) at the runs' starts: median {_median(loads):.2f}, max {max(loads, default=0):.2f}")
    rep.line()
    header = [
        "server",
        "concurrency",
        "texts/s",
        "p50 ms",
        "p99 ms",
        "server CPU",
        "texts/CPU-s",
        "requests",
        "failed",
        "reps",
    ]
    rep.table(header, summary_rows(results))
    rep.section("Serving: port / peer (texts/s above 1 and latency below 1 favour the port)")
    rep.table(["port", "peer", "concurrency", "texts/s", "p50", "p99"], ratio_rows(results))
    for line in goal_lines(results) + [f"- {n}" for n in notes]:
        rep.line(line)
    return rep


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    if args.setup_infinity:
        setup_infinity(args.infinity_venv)
    from bert_port.assets import minilm_dir

    model_dir = Path(args.model).resolve() if args.model else minilm_dir()
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    specs, notes = build_specs(args, model_dir)
    if not specs:
        print("no server to measure:", *notes, sep="\n")
        return 1
    loads = [os.getloadavg()[0]]
    results = run_all(specs, args, concurrencies, notes, loads)
    loads.append(os.getloadavg()[0])
    rep = report(results, args, concurrencies, notes, loads, argv)
    if args.markdown:
        rep.write(args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
