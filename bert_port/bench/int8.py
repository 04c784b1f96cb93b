"""The int8 section: the port with `quantization="int8"` against CTranslate2 int8 (and ONNX
Runtime int8, dynamically quantized from an ONNX export of transformers' model, and OpenVINO
int8, that export quantized by NNCF's post-training quantization calibrated on MR sentences
that are neither timed nor checked), each peer in a process of its own, at 1 and 2 threads,
on the MR batches of the real-text table.

Every row has accuracy columns against the port in float32 of the same run: sentence
embeddings (mean pooling over real tokens, as all-MiniLM-L6-v2 pools), their cosine to
float32 (mean, worst) and the share of the top-10 neighbours of 100 queries kept, on 2,000 MR
sentences (`--quick`: on the timed batches' sentences), beside the bar of
`tolerance.INT8_ACCURACY`. A section of its own (`section_int8_classifier`) fine-tunes an MR
classifier in float32 and measures the test accuracy int8 loses, the bar's last line.
"""

from __future__ import annotations

import contextlib
import functools
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from bert_port.tolerance import INT8_ACCURACY

from .harness import Row, interleave, mr_batches, mr_texts, ratio
from .peers import NAMES, PeerProcess, importable, onnx_file
from .throughput import model_forward

THREADS = (1, 2)
ACCURACY_TEXTS, QUERIES, NEIGHBOURS = 2000, 100, 10
CALIBRATION, QUICK_CALIBRATION = 300, 64  # NNCF's default subset size; --quick: the path, not the figure
CLASSIFIER_RECIPE, CLASSIFIER_TRAIN = "finetune_mr_minilm", 1536  # the shipped recipe, on its first 1,536 sentences
PORT_FP32, PORT_INT8 = "port, fp32", "port, int8"


def _ctranslate2_int8(model_dir: Path, workdir: Path, worker: PeerProcess) -> dict[int, Row]:
    import ctranslate2 as ct2

    out = workdir / "ctranslate2"
    ct2.converters.TransformersConverter(str(model_dir)).convert(str(out), force=True)
    name = f"CTranslate2 {ct2.__version__}, int8"
    return {
        t: worker.build(
            f"{name}, {t} thread(s)", "ctranslate2", {"path": str(out), "compute_type": "int8", "threads": t}
        )
        for t in THREADS
    }


def _onnxruntime_int8(reference, workdir: Path, worker: PeerProcess) -> dict[int, Row]:
    """transformers' model exported (`peers.onnx_export`), its MatMul weights quantized to int8
    by `onnxruntime.quantization.quantize_dynamic` (uint8 activations, one scale per tensor)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    fp32 = onnx_file(reference, workdir)
    int8 = workdir / "transformers.int8.onnx"
    quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8)
    return {
        t: worker.build(f"ONNX Runtime int8, {t} thread(s)", "onnxruntime", {"path": str(int8), "threads": t})
        for t in THREADS
    }


def _openvino_int8(reference, workdir: Path, calibration: list[dict], worker: PeerProcess) -> dict[int, Row]:
    """transformers' model exported (`peers.onnx_file`), converted by OpenVINO and quantized by
    `nncf.quantize` (transformer preset: int8 MatMuls, SmoothQuant) on the `calibration` feeds,
    once in `worker`; the layers left unquantized run in f32 (peer_worker.openvino_forward)."""
    from importlib.metadata import version

    path = onnx_file(reference, workdir)
    name = f"OpenVINO {version('openvino')} + NNCF {version('nncf')}, int8"
    options = {"path": str(path), "precision": "int8", "calibration": calibration}
    return {t: worker.build(f"{name}, {t} thread(s)", "openvino", {**options, "threads": t}) for t in THREADS}


def calibration_feeds(tokenizer, avoid: list[dict[str, Tensor]], n: int, seed: int) -> list[dict]:
    """`n` MR sentences (the bench's reader), one per feed as numpy arrays, none of them a
    sentence of `avoid` (the timed and the checked batches): NNCF's calibration set."""
    from bert_port import encode

    seen = {
        tuple(ids[mask.bool()].tolist())
        for batch in avoid
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"])
    }
    texts = mr_texts()
    feeds = []
    for i in random.Random(seed + 1).sample(range(len(texts)), len(texts)):
        encoded = encode(tokenizer, [texts[i]])
        if tuple(encoded["input_ids"][0].tolist()) not in seen:
            feeds.append({name: encoded[name].numpy() for name in NAMES})
            if len(feeds) == n:
                break
    return feeds


def peer_rows(
    args, model_dir: Path, workdir: Path, report, stack: contextlib.ExitStack, calibration=None
) -> dict[str, dict[int, Row]]:
    """{peer name: {threads: row}} for each int8 peer asked for (`--peers`) that builds;
    `calibration()` gives OpenVINO's calibration feeds (`calibration_feeds`)."""
    from bert_port.extras import require

    def reference():  # transformers' model, for the ONNX export that ONNX Runtime and OpenVINO share
        return require("transformers").BertModel.from_pretrained(str(model_dir), attn_implementation="sdpa").eval()

    onnx = ("onnx", "onnxscript")
    builders = {
        "CTranslate2 int8": ("ctranslate2", ("ctranslate2",), lambda w: _ctranslate2_int8(model_dir, workdir, w)),
        "ONNX Runtime int8": (
            "onnxruntime",
            ("onnxruntime", *onnx),
            lambda w: _onnxruntime_int8(reference(), workdir, w),
        ),
        "OpenVINO int8 (NNCF)": (
            "openvino",
            ("openvino", "nncf", *onnx),
            lambda w: _openvino_int8(reference(), workdir, calibration(), w),
        ),
    }
    rows = {}
    for label, (peer, modules, build) in builders.items():
        if peer not in args.peers:
            continue
        missing = [m for m in modules if not importable(m)]
        if missing:
            report.line(f"{label}: not installed ({', '.join(missing)}); pip install 'bert-port[bench]'")
            continue
        try:
            rows[label] = build(PeerProcess(stack))
        except Exception as exc:  # noqa: BLE001  a peer that fails to build is a missing row
            report.line(f"{label}: left out, it failed to build ({type(exc).__name__}: {str(exc)[:300]})")
    return rows


def embeddings(forward, batches: list[dict[str, Tensor]]) -> Tensor:
    """Mean-pooled, unit-length sentence embeddings of every batch, from a row's hidden states."""
    out = []
    with torch.inference_mode():
        for batch in batches:
            hidden = forward(batch).float().cpu()  # (B, T', H), T' <= T (CTranslate2)
            mask = batch["attention_mask"][:, : hidden.shape[1]].cpu().unsqueeze(-1).float()
            out.append(F.normalize((hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9), dim=1))
    return torch.cat(out)


def accuracy(expected: Tensor, actual: Tensor) -> dict[str, float]:
    """Cosine of each embedding to float32's (mean, worst) and the top-10 neighbours kept."""
    cos = F.cosine_similarity(actual, expected, dim=1)
    queries = min(QUERIES, len(expected))

    def top(e: Tensor) -> Tensor:
        sim = e[:queries] @ e.T
        sim[torch.arange(queries), torch.arange(queries)] = -2.0
        return sim.topk(min(NEIGHBOURS, len(e) - 1), dim=1).indices

    kept = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top(expected), top(actual)))
    return {"cos_mean": float(cos.mean()), "cos_min": float(cos.min()), "neighbours_kept": kept / top(expected).numel()}


def accuracy_batches(args, tokenizer, timed: list[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
    """2,000 MR sentences in batches of 64 of similar length; `--quick`: the timed batches."""
    from bert_port import encode

    if args.quick:
        return timed
    texts = sorted(random.Random(args.seed).sample(mr_texts(), ACCURACY_TEXTS), key=len)
    return [dict(encode(tokenizer, texts[i : i + 64])) for i in range(0, len(texts), 64)]


def section_int8(args, device: torch.device, report) -> dict[str, Any]:
    from bert_port import BertModel, load_tokenizer
    from bert_port.assets import minilm_dir

    if device.type != "cpu":
        report.line("int8: CPU only (bert_port.speed); skipped on this device")
        return {}
    path = minilm_dir()
    tokenizer = load_tokenizer(path)
    n = 2 if args.quick else args.batches
    batches = mr_batches(tokenizer, n, args.batch_size, args.seed, device)
    checked = accuracy_batches(args, tokenizer, batches)
    report.section(
        f"int8: all-MiniLM-L6-v2 on the {n} MR batches of {args.batch_size} above, {args.reps} interleaved repetitions "
        f"at {' and '.join(map(str, THREADS))} threads; accuracy against the port's fp32 on "
        f"{sum(len(b['input_ids']) for b in checked)} MR sentences (bar: cosine mean >= "
        f"{INT8_ACCURACY.embedding_cosine_mean}, worst >= {INT8_ACCURACY.embedding_cosine_min}, top-10 kept >= "
        f"{INT8_ACCURACY.neighbours_agree})"
    )
    fp32 = model_forward(BertModel.from_pretrained(path, device=device))
    int8 = model_forward(BertModel.from_pretrained(path, quantization="int8"))
    saved = torch.get_num_threads()
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bert-port-int8-")))
        size = QUICK_CALIBRATION if args.quick else CALIBRATION
        calibration = functools.partial(calibration_feeds, tokenizer, batches + checked, size, args.seed)
        peers = peer_rows(args, path, workdir, report, stack, calibration)
        if any(name.startswith("OpenVINO") for name in peers):
            report.line(
                f"OpenVINO int8: nncf.quantize calibrated on {size} MR sentences, none of them timed or checked"
            )
        expected = embeddings(fp32, checked)
        scores = {PORT_FP32: accuracy(expected, expected), PORT_INT8: accuracy(expected, embeddings(int8, checked))}
        scores.update({name: accuracy(expected, embeddings(rows[1].forward, checked)) for name, rows in peers.items()})
        result: dict[str, Any] = {"accuracy": scores}
        try:
            for threads in THREADS:
                torch.set_num_threads(threads)
                timed = {
                    PORT_FP32: fp32,
                    PORT_INT8: int8,
                    **{name: rows[threads].timed for name, rows in peers.items()},
                }
                result[f"{threads}_threads"] = interleave(
                    timed, batches, args.reps, device, f"int8, {threads} thread(s)", args.seed
                )
        finally:
            torch.set_num_threads(saved)
    _table(result, scores, sum(int(b["attention_mask"].sum()) for b in batches), report)
    return result


def _table(result: dict[str, Any], scores: dict[str, dict[str, float]], tokens: int, report) -> None:
    ct2 = next((name for name in scores if name.startswith("CTranslate2")), None)
    rows = []
    for threads in THREADS:
        times = result[f"{threads}_threads"]
        for name, ts in times.items():
            s = scores[name]
            rows.append(
                (
                    name,
                    threads,
                    f"{tokens / statistics.median(ts):.0f}",
                    f"{ratio(times[PORT_FP32], ts):.2f}",
                    f"{ratio(times[ct2], ts):.2f}" if ct2 else "",
                    f"{s['cos_mean']:.4f}",
                    f"{s['cos_min']:.4f}",
                    f"{s['neighbours_kept']:.3f}",
                )
            )
    report.table(
        (
            "variant",
            "threads",
            "real tokens/s",
            "x port fp32",
            "x CTranslate2 int8",
            "embedding cos mean",
            "worst",
            "top-10 kept",
        ),
        rows,
    )
    for peer in (name for name in scores if name not in (PORT_FP32, PORT_INT8)):
        for threads in THREADS:
            times = result[f"{threads}_threads"]
            report.line(f"port int8 vs {peer}, {threads} thread(s): {ratio(times[peer], times[PORT_INT8]):.2f}x")


def section_int8_classifier(args, device: torch.device, report) -> dict[str, Any]:
    """An MR classifier fine-tuned in float32 by the shipped recipe (`configs/finetune_mr_minilm.json`
    on its first 1,536 training sentences: about half a minute on 2 cores), then loaded again with
    `quantization="int8"`: both models' accuracy on MR's 1,058 test sentences, the points int8
    loses (bar: `INT8_ACCURACY.accuracy_drop_points`) and the share of predictions it keeps.
    Predictions run at the recipe's max_length, so float32's accuracy is the recipe's own test
    figure. `--quick`: 64 training sentences and 128 test sentences (the path, not the figure)."""
    from bert_port.data import builtin_splits

    if device.type != "cpu":
        report.line("int8 classifier: CPU only (bert_port.speed); skipped on this device")
        return {}
    train = 64 if args.quick else CLASSIFIER_TRAIN
    test = builtin_splits("mr")["test"]
    test = test.subset(range(128)) if args.quick else test
    report.section(
        f"int8 classifier: all-MiniLM-L6-v2 fine-tuned in fp32 on {train} MR sentences (configs/"
        f"{CLASSIFIER_RECIPE}.json), then loaded in int8; accuracy on {len(test)} MR test sentences (bar: int8 "
        f"loses <= {INT8_ACCURACY.accuracy_drop_points} points)"
    )
    predicted, truth = _classifier_predictions(train, test)
    accuracy = {name: float((p == truth).float().mean()) for name, p in predicted.items()}
    result = {
        "train_sentences": train,
        "test_sentences": len(test),
        "accuracy": accuracy,
        "drop_points": 100 * (accuracy[PORT_FP32] - accuracy[PORT_INT8]),
        "predictions_kept": float((predicted[PORT_FP32] == predicted[PORT_INT8]).float().mean()),
    }
    _classifier_table(result, report)
    return result


def _classifier_predictions(train: int, test) -> tuple[dict[str, Tensor], Tensor]:
    """The recipe fine-tuned on `train` sentences in a temporary folder; the predicted label ids of
    `test` in float32 and in int8 ({PORT_FP32, PORT_INT8}), and its true ones."""
    from bert_port import BertForSequenceClassification, load_tokenizer
    from bert_port.assets import minilm_dir
    from bert_port.training import FinetuneConfig, finetune, load_config_file, predict

    with tempfile.TemporaryDirectory(prefix="bert-port-int8-classifier-") as out:
        settings = load_config_file(CLASSIFIER_RECIPE)
        settings.update(checkpoint=str(minilm_dir()), output_dir=out, max_train_examples=train, device="cpu")
        cfg = FinetuneConfig(**settings)
        finetune(cfg)
        tokenizer = load_tokenizer(out)
        models = {
            PORT_FP32: BertForSequenceClassification.from_pretrained(out),
            PORT_INT8: BertForSequenceClassification.from_pretrained(out, quantization="int8"),
        }
        predicted = {
            name: predict(model, tokenizer, test, batch_size=cfg.eval_batch_size, max_length=cfg.max_length).argmax(1)
            for name, model in models.items()
        }
    label_ids = {label: i for i, label in models[PORT_FP32].config.id2label.items()}
    return predicted, torch.tensor([label_ids[label] for label in test.labels])


def _classifier_table(result: dict[str, Any], report) -> None:
    accuracy, bar = result["accuracy"], INT8_ACCURACY.accuracy_drop_points
    report.table(
        ("model", "test accuracy", "points lost", "predictions kept"),
        [
            (PORT_FP32, f"{100 * accuracy[PORT_FP32]:.2f}%", "", ""),
            (
                PORT_INT8,
                f"{100 * accuracy[PORT_INT8]:.2f}%",
                f"{result['drop_points']:.2f}",
                f"{100 * result['predictions_kept']:.2f}%",
            ),
        ],
    )
    met = "met" if result["drop_points"] <= bar else "NOT met"
    report.line(f"int8 classifier: {result['drop_points']:.2f} points lost (bar <= {bar}): {met}")
