"""`bert-port-bench`: the port's speed against transformers.BertModel (sdpa) and the peers
(CTranslate2, ONNX Runtime, OpenVINO, sentence-transformers), side by side in one process,
with the parity of every speed row beside it.

Sections (`bert_port/bench/`): import time, matmul roofline, real text (all-MiniLM-L6-v2 on
MR batches: fp32 with the peers, bf16 where the CPU has native bf16; `real1`: the same again
at 1 thread, where the bench runs at more), int8 (the port's against CTranslate2's, ONNX
Runtime's and OpenVINO's (NNCF), at 1 and 2 threads, with accuracy columns), busy neighbour
(the kept share of each system's throughput with one CPU held by a shell loop), fixed length
(bert-base shape), checkpoint load time and peak RSS, the fine-tuning step; with
`--generate`, text generation with and without the KV cache; with `--profile`, where the
time goes. `--markdown PATH` writes the printed tables to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from bert_port.extras import MissingExtra

SECTIONS = (
    "import",
    "roofline",
    "real",
    "real1",
    "sorted",
    "int8",
    "int8-classifier",
    "busy",
    "fixed",
    "load",
    "finetune",
)
PEERS = ("ctranslate2", "onnxruntime", "openvino", "sentence-transformers")
QUICK_PEERS = ("ctranslate2", "sentence-transformers")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bert-port-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: 2 MR batches, 1 repetition, 2-layer bert-base, one load"
    )
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions per timed section (default 5)")
    parser.add_argument("--batches", type=int, default=8, help="MR batches per repetition (default 8)")
    parser.add_argument("--batch-size", type=int, default=32, help="MR sentences per batch (default 32)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument(
        "--bf16",
        choices=("auto", "on", "off"),
        default="auto",
        help="bf16 rows: auto runs them only where bf16 matmuls are native (CPU flag amx_bf16 or avx512_bf16)",
    )
    parser.add_argument(
        "--peers",
        default=None,
        help=f"comma-separated peers to time beside the port, or 'none' (default {','.join(PEERS)}; "
        f"with --quick {','.join(QUICK_PEERS)}: exporting to ONNX, which ONNX Runtime and OpenVINO read, "
        "takes longer than the rest)",
    )
    parser.add_argument("--compile", action="store_true", help="also time the port with its layers under torch.compile")
    parser.add_argument(
        "--generate",
        action="store_true",
        help="also time greedy generation (MiniLM as a decoder): tokens/s with and without the KV cache",
    )
    parser.add_argument("--profile", action="store_true", help="profile port vs transformers on the MR batches")
    parser.add_argument("--profile-dir", default=None, help="write chrome traces of the profile here")
    parser.add_argument("--load-reps", type=int, default=3, help="repetitions of each checkpoint load (default 3)")
    parser.add_argument("--skip", default="", help=f"comma-separated sections to skip: {','.join(SECTIONS)}")
    parser.add_argument("--seed", type=int, default=0, help="seed for batch sampling and random weights")
    parser.add_argument("--json", default=None, help="write every figure (and raw timings) to this JSON file")
    parser.add_argument("--markdown", default=None, help="write the tables printed to this markdown file")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps = 1
    if args.peers is None:
        args.peers = ",".join(QUICK_PEERS if args.quick else PEERS)
    return args


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, or None."""
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - set(SECTIONS):
        return f"--skip got unknown section(s) {sorted(skip - set(SECTIONS))}; the sections are {', '.join(SECTIONS)}"
    peers = [p.strip() for p in args.peers.split(",") if p.strip() and p.strip() != "none"]
    if set(peers) - set(PEERS):
        return f"--peers got unknown peer(s) {sorted(set(peers) - set(PEERS))}; the peers are {', '.join(PEERS)}"
    for name in ("reps", "batches", "batch_size", "load_reps"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    if args.threads is not None and args.threads < 1:
        return f"--threads must be at least 1, got {args.threads}"
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        return f"--device must be cpu or cuda, got {args.device!r}"
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        return "--device cuda but torch sees no CUDA device; run on a GPU machine or use --device cpu"
    args.skip, args.peers = skip, peers
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        run(args)
    except MissingExtra as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bert_port.bench.harness import Report, machine_info
    from bert_port.extras import require

    transformers = require("transformers")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = Report()
    results: dict[str, Any] = {"machine": machine_info(device), "settings": {**vars(args), "skip": sorted(args.skip)}}
    m = results["machine"]
    report.line("# bert_port benchmark")
    report.line()
    report.line(
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs (flags: {' '.join(m['cpu_flags']) or 'none'}); "
        f"torch {m['torch']} ({m['cpu_capability']} kernels, {m['torch_threads']} threads), device {m['device']}"
        + (f" ({m['gpu']})" if "gpu" in m else "")
        + f"; load average at start {m['loadavg_start'][0]:.2f}. Ratios are measured interleaved in one run: "
        "compare them, not the absolute figures, which move with the machine's load."
    )
    bf16 = args.bf16 == "on" or (args.bf16 == "auto" and m["native_bf16"] is not None)
    if m["native_bf16"]:
        report.line(f"Native bf16 matmuls: yes ({m['native_bf16']}).")
    else:
        report.line(
            "Native bf16 matmuls: no (no amx_bf16 or avx512_bf16 flag): torch emulates bf16 far slower than fp32"
            + (
                ", bf16 rows timed anyway (--bf16 on)."
                if bf16
                else ", so the bf16 rows are skipped (--bf16 on times them)."
            )
        )
    sections = _sections(args, device, bf16, report)
    for name, section in sections.items():
        if name not in args.skip:
            results[name] = section()
    if args.generate:
        from bert_port.bench.generate import section_generate

        results["generate"] = section_generate(args, device, report)
    results["machine"]["loadavg_end"] = os.getloadavg()
    report.line()
    report.line(f"Load average at end {results['machine']['loadavg_end'][0]:.2f}.")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    if args.markdown:
        print(f"wrote {report.write(args.markdown)}")
    return results


def _sections(args, device, bf16, report) -> dict[str, Any]:
    from bert_port.bench import busy, finetune, import_time, int8, load, throughput

    return {
        "import": lambda: import_time.section_import(1 if args.quick else 3, report),
        "roofline": lambda: throughput.section_roofline(device, args.quick, bf16, report),
        "real": lambda: throughput.section_real_text(args, device, bf16, report),
        "real1": lambda: throughput.section_real_text_one_thread(args, device, bf16, report),
        "sorted": lambda: throughput.section_sorted(args, device, bf16, report),
        "int8": lambda: int8.section_int8(args, device, report),
        "int8-classifier": lambda: int8.section_int8_classifier(args, device, report),
        "busy": lambda: busy.section_busy(args, device, bf16, report),
        "fixed": lambda: throughput.section_fixed(args, device, bf16, report),
        "load": lambda: load.section_load(args.quick, args.load_reps, report),
        "finetune": lambda: finetune.section_finetune(args, device, report),
    }


if __name__ == "__main__":
    sys.exit(main())
