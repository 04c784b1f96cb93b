"""Throughput sections: the matmul roofline, real text (all-MiniLM-L6-v2 on MR batches,
with the peers) and fixed length (the bert-base-uncased shape, random weights).

Every row of a table runs the same batches in the same interleaved loop; each has its
real-token parity against transformers in fp32, computed in the same run. A matmul of the
model's own FFN shape is timed as one more row, so the roofline fraction of each repetition
divides by the matmul speed of that same moment.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bert_port.tolerance import Tolerance, tolerance_for

from .harness import (
    CONFIGS,
    REFERENCE,
    Forward,
    Row,
    config_override,
    interleave,
    matmul_gflops,
    model_flops,
    mr_batches,
    ratio,
    sync,
)
from .peers import peer_rows

# The port without batch invariance (`batch_invariant=False`): what the guarantee costs is the
# port row's time against this one's, in the same run.
INVARIANCE_OFF = "port, batch_invariant=False"


def model_forward(model, autocast: torch.dtype | None = None, **config) -> Forward:
    """`model`'s last hidden state under inference mode, optionally under autocast and with
    some config fields changed for the call (the port's `unpad_inputs`, `attn_implementation`)."""

    def forward(batch: dict[str, Tensor]) -> Tensor:
        device_type = batch["input_ids"].device.type
        with (
            torch.inference_mode(),
            torch.autocast(device_type, dtype=autocast or torch.float32, enabled=autocast is not None),
            config_override(model, **config) if config else contextlib.nullcontext(),
        ):
            return model(**batch).last_hidden_state

    return forward


def real_token_diff(
    rows: dict[str, Row], reference: Forward, batches: list[dict[str, Tensor]], tolerance: Tolerance
) -> dict[str, tuple[float, float]]:
    """Per row, over all batches, on the real tokens of the last hidden state against
    `reference`: the max abs difference, and the largest share of `tolerance` an element
    uses, |d| / (atol + rtol |ref|) (at most 1 passes). Rows may return fewer positions than
    the batch has (CTranslate2)."""
    worst = dict.fromkeys(rows, (0.0, 0.0))
    for batch in batches:
        expected = reference(batch).float().cpu()
        real = batch["attention_mask"].bool().cpu()
        for name, row in rows.items():
            got = row.forward(batch).float().cpu()
            T = got.shape[1]
            ref = expected[:, :T][real[:, :T]]
            diff = (got[real[:, :T]] - ref).abs()
            use = diff / (tolerance.atol + tolerance.rtol * ref.abs())
            worst[name] = (max(worst[name][0], diff.max().item()), max(worst[name][1], use.max().item()))
    return worst


def roofline_probe(
    device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int], call: Callable, batch
) -> tuple[Callable, float, str]:
    """The model's largest matmul, (real tokens, H) x (H, intermediate), repeated so that it
    lasts about as long as one model call: a row that samples the machine's speed in the same
    moments as the models. The faster of torch's matmul and the port's own GEMM
    (`RowStableLinear`, e.g. the AVX2 kernel) at that shape, so that the ceiling is the best GEMM
    the machine runs. Returns the row's function, its FLOPs per call and which GEMM it is."""
    from bert_port.speed.gemm import RowStableLinear

    m, n_in, n_out = shape
    a = torch.randn(m, n_in, device=device).to(dtype)
    b = torch.randn(n_in, n_out, device=device).to(dtype)
    linear = RowStableLinear(n_in, n_out, bias=False, device=device, dtype=dtype).eval().requires_grad_(False)
    gemms = {"torch matmul": lambda: a @ b, "port GEMM": lambda: linear(a)}
    name = min(gemms, key=lambda g: _best_time(gemms[g], device))
    gemm = gemms[name]
    call(batch)
    sync(device)
    t = time.perf_counter()
    call(batch)
    sync(device)
    t_model = time.perf_counter() - t
    k = max(1, round(t_model / _best_time(gemm, device)))

    def probe(_batch):
        with torch.inference_mode():
            for _ in range(k):
                gemm()

    return probe, 2.0 * m * n_in * n_out * k, name


def _best_time(fn: Callable, device: torch.device, reps: int = 5) -> float:
    with torch.inference_mode():
        fn()
        best = float("inf")
        for _ in range(reps):
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            best = min(best, time.perf_counter() - t)
    return best


def time_rows(
    title: str,
    rows: dict[str, Row],
    reference: Forward,
    batches: list[dict[str, Tensor]],
    config,
    args,
    device: torch.device,
    report,
    matmul_dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Interleave `rows` over `batches`, print the table, return every figure."""
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    flops = sum(model_flops(config, b["attention_mask"]) for b in batches)
    tolerance = tolerance_for(matmul_dtype)
    diffs = real_token_diff(rows, reference, batches, tolerance)
    timed = {name: row.timed or row.forward for name, row in rows.items()}
    shape = (max(256, int(batches[0]["attention_mask"].sum())), config.hidden_size, config.intermediate_size)
    timed["matmul"], probe_flops, probe_gemm = roofline_probe(device, matmul_dtype, shape, reference, batches[0])
    times = interleave(timed, batches, args.reps, device, title, seed=args.seed)
    matmul = [probe_flops * len(batches) / t / 1e9 for t in times.pop("matmul")]
    figures = _figures(times, rows, tokens, flops, matmul, diffs)
    report.line()
    report.line(
        f"**{title}** ({probe_gemm} {shape[0]}x{shape[1]}x{shape[2]} in {str(matmul_dtype)[6:]} during the run: "
        f"{statistics.median(matmul):.0f} GFLOP/s)"
    )
    _table(figures, matmul_dtype, report)
    return {
        "real_tokens_per_pass": tokens,
        "padded_tokens_per_pass": sum(b["attention_mask"].numel() for b in batches),
        "model_gflop_per_pass": flops / 1e9,
        "matmul_gflops_during_run": statistics.median(matmul),
        "matmul_probe": probe_gemm,
        "rows": figures,
    }


def _figures(times, rows, tokens: int, flops: float, matmul: list[float], diffs) -> dict[str, Any]:
    """Per row: its times, tokens/s, ratios to its baseline and to transformers fp32, the
    share of the matmul roofline it reached, and its difference from transformers fp32."""
    base = times.get(REFERENCE)
    figures = {}
    for name, ts in times.items():
        achieved = [flops / t / 1e9 for t in ts]
        figures[name] = {
            "seconds_per_pass": ts,
            "median_s": statistics.median(ts),
            "tokens_per_s": tokens / statistics.median(ts),
            "baseline": rows[name].baseline,
            "vs_baseline": ratio(times[rows[name].baseline], ts),
            "vs_transformers_fp32": ratio(base, ts) if base else None,
            "roofline_fraction": statistics.median(a / m for a, m in zip(achieved, matmul)),
            "max_abs_diff_vs_transformers_fp32": diffs[name][0],
            "tolerance_use": diffs[name][1],
        }
    return figures


def _table(figures: dict[str, Any], matmul_dtype: torch.dtype, report) -> None:
    report.table(
        (
            "variant",
            "real tokens/s",
            "ms/pass",
            "x baseline (baseline)",
            "x transformers fp32",
            "% matmul roofline",
            "max abs diff vs transformers fp32, real tokens",
            f"share of the {str(matmul_dtype)[6:]} tolerance used",
        ),
        (
            (
                name,
                f"{r['tokens_per_s']:.0f}",
                f"{r['median_s'] * 1e3:.0f}",
                "1.00" if r["baseline"] == name else f"{r['vs_baseline']:.2f} ({r['baseline']})",
                "" if r["vs_transformers_fp32"] is None else f"{r['vs_transformers_fp32']:.2f}",
                f"{100 * r['roofline_fraction']:.0f}%",
                f"{r['max_abs_diff_vs_transformers_fp32']:.1e}",
                f"{r['tolerance_use']:.2f}",
            )
            for name, r in figures.items()
        ),
    )


def port_vs(figures: dict[str, Any], port: str, others: list[str]) -> list[str]:
    """'port / X: r' lines: the median of per-repetition time ratios."""
    rows = figures["rows"]
    return [
        f"{port} vs {o}: {ratio(rows[o]['seconds_per_pass'], rows[port]['seconds_per_pass']):.2f}x"
        for o in others
        if o in rows
    ]


# -- sections -----------------------------------------------------------------------------


def section_roofline(device: torch.device, quick: bool, bf16: bool, report) -> dict[str, float]:
    report.section("matmul speed (best of 3, square n x n x n)")
    n = 512 if quick else (1024 if device.type == "cpu" else 8192)
    result = {"fp32": matmul_gflops(torch.float32, device, n)}
    # Emulated bf16 (no native bf16 on the CPU) is many times slower than fp32: a smaller
    # matrix keeps it short.
    result["bf16"] = matmul_gflops(torch.bfloat16, device, n if bf16 else min(n, 512))
    report.table(("dtype", "GFLOP/s"), ((k, f"{v:.1f}") for k, v in result.items()))
    return result


def section_real_text(args, device: torch.device, bf16: bool, report) -> dict[str, Any]:
    from bert_port import BertModel, load_tokenizer
    from bert_port.assets import minilm_dir
    from bert_port.extras import require

    transformers = require("transformers")
    path = minilm_dir()
    n = 2 if args.quick else args.batches
    sort_lengths = getattr(args, "sort_lengths", False)
    batches = mr_batches(load_tokenizer(path), n, args.batch_size, args.seed, device, sort_lengths)
    lens = torch.cat([b["attention_mask"].sum(1) for b in batches]).float()
    real = float(lens.sum()) / sum(b["attention_mask"].numel() for b in batches)
    kind = "length-sorted" if sort_lengths else "random"
    report.section(
        f"real text: all-MiniLM-L6-v2 on {n} {kind} batches of {args.batch_size} MR sentences (real length mean "
        f"{lens.mean():.1f}, max {lens.max():.0f}; {100 * (1 - real):.0f}% padding), {args.reps} interleaved "
        f"repetitions at {torch.get_num_threads()} thread(s); real tokens/s"
    )
    ours = BertModel.from_pretrained(path, device=device)
    ref = transformers.BertModel.from_pretrained(str(path), attn_implementation="sdpa").to(device).eval()
    reference = model_forward(ref)
    rows = {
        REFERENCE: Row(reference),
        "port": Row(model_forward(ours)),
        "port padded (unpad_inputs=False)": Row(model_forward(ours, unpad_inputs=False)),
        INVARIANCE_OFF: Row(model_forward(ours, batch_invariant=False)),
    }
    compiled = compiled_layers(args, ours, batches, report)
    if compiled is not None:
        rows["port + torch.compile (layers)"] = Row(model_forward(compiled))
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bert-port-bench-"))
        threads = torch.get_num_threads()
        peers = peer_rows(args.peers, path, ref, Path(tmp), device, threads, report, stack, bf16)
        bf16_peers = {name: row for name, row in peers.items() if ", bf16" in name}
        rows.update({name: row for name, row in peers.items() if name not in bf16_peers})
        result = {"real_length_mean": float(lens.mean()), "padding_fraction": 1 - real}
        result["fp32"] = time_rows("MiniLM / MR, fp32", rows, reference, batches, ours.config, args, device, report)
        for line in port_vs(result["fp32"], "port", [name for name in peers if "fp32" in name] + [INVARIANCE_OFF]):
            report.line(line)
        if bf16:
            result["bf16"] = bf16_rows(
                "MiniLM / MR", ours, ref, reference, batches, args, device, report, path, bf16_peers
            )
            for port in ("port, bf16 weights", "port, bf16 weights, batch_invariant=False", "port, bf16 autocast"):
                for line in port_vs(result["bf16"], port, list(bf16_peers)):
                    report.line(line)
    if args.profile:
        from .profiling import section_profile

        result["profile"] = section_profile(
            {n: r.forward for n, r in rows.items() if n in (REFERENCE, "port")},
            batches,
            device,
            args.profile_dir,
            report,
        )
    return result


def section_real_text_one_thread(args, device: torch.device, bf16: bool, report) -> dict[str, Any]:
    """The real-text section again at 1 thread, peers included (the goals hold at 1 and
    at 2 threads), where the bench runs on the CPU at more; the thread count is put back."""
    saved = torch.get_num_threads()
    if device.type != "cpu" or saved == 1:
        report.line("real text at 1 thread: skipped (the bench runs at 1 thread, or on the GPU)")
        return {}
    torch.set_num_threads(1)
    try:
        return section_real_text(args, device, bf16, report)
    finally:
        torch.set_num_threads(saved)


def section_sorted(args, device: torch.device, bf16: bool, report) -> dict[str, Any]:
    """The real-text section on the same sentences batched by length, at the bench's thread
    count and at 1 thread: where padding is small, the port's lead must come from its compute."""
    args.sort_lengths = True
    try:
        return {
            "threads": section_real_text(args, device, bf16, report),
            "1": section_real_text_one_thread(args, device, bf16, report),
        }
    finally:
        args.sort_lengths = False


def bf16_rows(title, ours, ref, reference, batches, args, device, report, path=None, peers=None) -> dict[str, Any]:
    """transformers and the port in bf16: weights loaded in bf16 (`dtype=torch.bfloat16`),
    and fp32 weights under autocast; `peers`' bf16 rows beside them, against transformers'
    bf16 weights. The parity column against transformers fp32 shows transformers' own bf16
    error beside the port's."""
    ours_bf16, ref_bf16 = _bf16_copies(ours, ref, path, device)
    bf16 = torch.bfloat16
    hf_weights, hf_autocast = "transformers, bf16 weights", "transformers, bf16 autocast"
    rows = {
        REFERENCE: Row(reference),
        hf_weights: Row(model_forward(ref_bf16), hf_weights),
        "port, bf16 weights": Row(model_forward(ours_bf16), hf_weights),
        "port, bf16 weights, batch_invariant=False": Row(model_forward(ours_bf16, batch_invariant=False), hf_weights),
        hf_autocast: Row(model_forward(ref, autocast=bf16), hf_autocast),
        "port, bf16 autocast": Row(model_forward(ours, autocast=bf16), hf_autocast),
    }
    rows.update({name: Row(row.forward, hf_weights, row.timed) for name, row in (peers or {}).items()})
    if device.type == "cuda":
        rows["port, bf16 weights, varlen attention"] = Row(
            model_forward(ours_bf16, attn_implementation="varlen"), hf_weights
        )
    return time_rows(f"{title}, bf16", rows, reference, batches, ours.config, args, device, report, bf16)


def _bf16_copies(ours, ref, path, device):
    """The two models in bf16: loaded so from the checkpoint when there is one (as a user
    would), else cast."""
    import copy

    from bert_port import BertModel
    from bert_port.extras import require

    if path is None:
        return copy.deepcopy(ours).to(torch.bfloat16), copy.deepcopy(ref).to(torch.bfloat16)
    transformers = require("transformers")
    ours_bf16 = BertModel.from_pretrained(path, dtype=torch.bfloat16, device=device)
    ref_bf16 = transformers.BertModel.from_pretrained(str(path), dtype=torch.bfloat16, attn_implementation="sdpa")
    return ours_bf16, ref_bf16.to(device).eval()


def compiled_layers(args, ours, batches, report):
    """With `--compile`, a copy of `ours` whose every `BertLayer` runs under
    torch.compile(dynamic=True): N changes with every batch. Packing stays outside the
    compiled region (it syncs)."""
    if not args.compile:
        return None
    import copy

    compiled = copy.deepcopy(ours)
    for layer in compiled.bert_layers:
        layer.compile(dynamic=True)
    t = time.perf_counter()
    with torch.inference_mode():
        for batch in batches[:2]:  # two different N: the dynamic graph and its recompile
            compiled(**batch)
    report.line(f"torch.compile of each layer: {time.perf_counter() - t:.1f} s (first two batches, not timed)")
    return compiled


def section_fixed(args, device: torch.device, bf16: bool, report) -> dict[str, Any]:
    from bert_port import BertConfig, BertModel
    from bert_port.reference import random_hf_model

    config = json.loads((CONFIGS / "bert-base-uncased.json").read_text())
    if args.quick:
        config["num_hidden_layers"] = 2
    shapes = [(8, 128), (1, 512)] if not args.quick else [(2, 128)]
    report.section(
        f"fixed length: bert-base-uncased shape ({config['num_hidden_layers']} layers), random weights, "
        f"no padding, {args.reps} interleaved repetitions; tokens/s"
    )
    ref = random_hf_model(config, "BertModel", "sdpa", seed=args.seed).to(device)
    ours = BertModel(BertConfig.from_dict(config))
    ours.load_hf_state_dict(ref.state_dict())
    ours = ours.to(device).eval()
    reference = model_forward(ref)
    result: dict[str, Any] = {"num_hidden_layers": config["num_hidden_layers"]}
    g = torch.Generator().manual_seed(args.seed)
    for B, T in shapes:
        batch = {
            "input_ids": torch.randint(1000, config["vocab_size"], (B, T), generator=g).to(device),
            "attention_mask": torch.ones(B, T, dtype=torch.long, device=device),
            "token_type_ids": torch.zeros(B, T, dtype=torch.long, device=device),
        }
        rows = {
            REFERENCE: Row(reference),
            "port": Row(model_forward(ours)),
            INVARIANCE_OFF: Row(model_forward(ours, batch_invariant=False)),
        }
        title = f"bert-base {B}x{T}"
        result[f"{B}x{T}"] = {
            "fp32": time_rows(f"{title}, fp32", rows, reference, [batch], ours.config, args, device, report)
        }
        for line in port_vs(result[f"{B}x{T}"]["fp32"], "port", [INVARIANCE_OFF]):
            report.line(line)
        if bf16:
            result[f"{B}x{T}"]["bf16"] = bf16_rows(title, ours, ref, reference, [batch], args, device, report)
    return result
