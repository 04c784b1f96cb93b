"""`bert-port-embed` against `SentenceTransformer(path).encode` on the same texts and thread
count, each run as a whole command in a fresh process, start-up included (imports, loading the
checkpoint, reading the texts, writing the result), alternating which goes first.

    python -m bert_port.bench.embed --texts 2000 --repeats 3 --threads 2

The port's process is the command itself (`python -m bert_port.cli.embed`, which also scans
the input and writes shards); sentence-transformers' is a worker of this module
(`--worker st INPUT OUT.npy`) that reads the same JSONL, encodes it (batch size 32, its
default) and saves the array. Both get OMP_NUM_THREADS (and the worker `torch.set_num_threads`).
It prints each run's wall time, the median of the per-repetition ratios, and the largest
difference between the two outputs against the float32 tolerance.

    python -m bert_port.bench.embed --memory 2000,20000 [--memory-repeats 3] [--before DIR]

prints instead the peak RSS (the process's own VmHWM) of `bert-port-embed` on each number of
MR texts, the median of `--memory-repeats` runs, and with `--before` the same runs of the
`bert_port` package under DIR (another checkout), interleaved, with each run's wall time: what
a change did to memory and speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _st_worker(src: str, out: str) -> None:
    """In a fresh process: sentence-transformers' whole job on the JSONL `src`."""
    import numpy as np
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from sentence_transformers import SentenceTransformer

    from bert_port.assets import minilm_dir

    with open(src, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    model = SentenceTransformer(str(minilm_dir()), device="cpu", local_files_only=True)
    np.save(out, model.encode(texts, batch_size=32, convert_to_numpy=True))


def _timed(command: list[str], threads: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed: {done.stderr.strip()[-500:]}")
    return seconds


def _write_texts(path: Path, n: int) -> None:
    from bert_port.data import load_mr

    texts = load_mr().texts
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": i, "text": texts[i % len(texts)]}) + "\n" for i in range(n))


def measure(n: int, repeats: int, threads: int, extra: list[str]) -> dict:
    """Wall times of both commands, `repeats` times each, alternating; the outputs compared."""
    import numpy as np
    import torch

    from bert_port.assets import minilm_dir
    from bert_port.embed import read_embeddings
    from bert_port.tolerance import tolerance_for

    with tempfile.TemporaryDirectory(prefix="bench-embed-") as tmp:
        src, st_out = Path(tmp) / "texts.jsonl", Path(tmp) / "st.npy"
        _write_texts(src, n)
        port_cmd = [sys.executable, "-m", "bert_port.cli.embed", "--model", str(minilm_dir()), "--no-progress"]
        st_cmd = [sys.executable, "-m", "bert_port.bench.embed", "--worker", "st", str(src), str(st_out)]
        times: dict[str, list[float]] = {"port": [], "st": []}
        for r in range(repeats):
            order = ("port", "st") if r % 2 == 0 else ("st", "port")
            for kind in order:
                out = Path(tmp) / f"port{r}"
                command = [*port_cmd, *extra, str(src), str(out)] if kind == "port" else st_cmd
                times[kind].append(_timed(command, threads))
        _, ours = read_embeddings(Path(tmp) / "port0")
        theirs = np.load(st_out)
    tol = tolerance_for(torch.float32)
    diff = np.abs(ours - theirs)
    share = float((diff / (tol.atol + tol.rtol * np.abs(theirs))).max())
    ratios = [s / p for s, p in zip(times["st"], times["port"])]
    return {"times": times, "ratio": statistics.median(ratios), "max_abs_diff": float(diff.max()), "tol_share": share}


# The command in a child that prints its own peak RSS (KiB) last (`main` in checkouts before `command`).
PEAK = (
    "import sys\nimport bert_port.cli.embed as cli\nrc = getattr(cli, 'command', cli.main)()\n"
    "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])\nsys.exit(rc)\n"
)


def peak_rss(n: int, threads: int, extra: list[str], code: str | None = None) -> tuple[float, float]:
    """Peak RSS (MiB) and wall seconds of `bert-port-embed` on `n` MR texts, in a fresh process;
    with `code`, the `bert_port` package found under that folder."""
    from bert_port.assets import minilm_dir

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    if code:
        env["PYTHONPATH"] = code
    with tempfile.TemporaryDirectory(prefix="bench-embed-memory-") as tmp:
        src = Path(tmp) / "texts.jsonl"
        _write_texts(src, n)
        command = [sys.executable, "-c", PEAK, "--model", str(minilm_dir()), "--no-progress", *extra, str(src)]
        start = time.perf_counter()
        # cwd: `python -c` puts the working folder first on sys.path, ahead of PYTHONPATH.
        done = subprocess.run([*command, str(Path(tmp) / "out")], env=env, capture_output=True, text=True, cwd=tmp)
        seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"bert-port-embed failed: {done.stderr.strip()[-500:]}")
    return int(done.stdout.split()[-1]) / 1024, seconds


def memory(sizes: list[int], threads: int, extra: list[str], before: str | None, repeats: int = 3) -> int:
    """The `--memory` table: each size `repeats` times, this code and (with `before`) the other,
    interleaved; the ratio of the medians."""
    variants = {"this checkout": None, **({f"before ({before})": before} if before else {})}
    print(f"peak RSS of bert-port-embed, all-MiniLM-L6-v2, MR texts, {threads} threads, one process per run")
    print("| code | texts | peak RSS MiB (median) | runs MiB | wall s (median) |")
    print("|---|---|---|---|---|")
    peaks: dict[str, dict[int, float]] = {name: {} for name in variants}
    for n in sizes:
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        for r in range(repeats):
            for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
                runs[name].append(peak_rss(n, threads, extra, variants[name]))
        for name, got in runs.items():
            peaks[name][n] = statistics.median(p for p, _ in got)
            each = ", ".join(f"{p:.1f}" for p, _ in got)
            wall = statistics.median(s for _, s in got)
            print(f"| {name} | {n} | {peaks[name][n]:.1f} | {each} | {wall:.1f} |", flush=True)
    for name, by_size in peaks.items():
        low, high = by_size[min(sizes)], by_size[max(sizes)]
        print(f"{name}: {max(sizes)} texts peak at {high / low:.3f}x that at {min(sizes)} ({high - low:+.1f} MiB)")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average at end {load:.2f} (the machine's other work moves the wall times, not the peaks)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bert_port.bench.embed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=2000, help="MR sentences to embed (repeated past 10,566)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each command, alternating")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS for both")
    parser.add_argument("--embed-args", default="", help="extra flags for bert-port-embed, e.g. '--batch-tokens 4096'")
    parser.add_argument(
        "--memory", default=None, help="peak RSS of bert-port-embed at these text counts, e.g. 2000,20000"
    )
    parser.add_argument(
        "--before", default=None, help="with --memory: also run the bert_port package under this folder"
    )
    parser.add_argument("--memory-repeats", type=int, default=3, help="with --memory: runs per size (median)")
    parser.add_argument("--worker", nargs=3, metavar=("KIND", "INPUT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _st_worker(args.worker[1], args.worker[2])
        return 0
    if args.memory:
        return memory(
            [int(n) for n in args.memory.split(",")],
            args.threads,
            args.embed_args.split(),
            args.before,
            args.memory_repeats,
        )
    from bert_port.extras import MissingExtra, require

    try:
        require("sentence_transformers")
    except MissingExtra as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = measure(args.texts, args.repeats, args.threads, args.embed_args.split())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"embedding {args.texts} MR sentences with all-MiniLM-L6-v2, {args.threads} threads, start-up included")
    print("| command | wall s (median) | runs |")
    print("|---|---|---|")
    for name, kind in (("bert-port-embed", "port"), ("SentenceTransformer.encode", "st")):
        runs = ", ".join(f"{t:.1f}" for t in result["times"][kind])
        print(f"| {name} | {statistics.median(result['times'][kind]):.2f} | {runs} |")
    print(f"speed-up (median of per-repetition ratios): {result['ratio']:.2f}x")
    print(
        f"max abs diff vs sentence-transformers: {result['max_abs_diff']:.1e} "
        f"({result['tol_share']:.2f} of the float32 tolerance); load average at end {load:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
