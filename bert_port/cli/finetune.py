"""`bert-port-finetune`: fine-tune a BERT checkpoint as a text classifier.

    bert-port-finetune --config bert_port/configs/finetune_mr_minilm.json
    bert-port-finetune --train train.csv --validation dev.csv --label-column sentiment --output-dir runs/x
    torchrun --nproc_per_node 2 -m bert_port.cli.finetune --config ...     (DDP; same results)
    bert-port-finetune --config ... --resume                                (continue an interrupted run)
    bert-port-finetune --config ... --reference hf --output-dir runs/hf --compare-to runs/port
    bert-port-finetune --dataset mr --export-dataset data/mr               (write the bundled split as CSV)

Settings come from the dataclass defaults, then `--config FILE`, then the flags given.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

# (flag, type, help): one line per FinetuneConfig field. bool fields get --flag/--no-flag.
OPTIONS = [
    ("checkpoint", str, "checkpoint directory or model id in the local HF cache (default: bundled all-MiniLM-L6-v2)"),
    (
        "reference",
        str,
        (
            "'port' (bert_port, default) or 'hf' (transformers' BertForSequenceClassification, same "
            "loop and initial weights)"
        ),
    ),
    ("attn_implementation", str, "'sdpa' (default) or 'eager' attention"),
    ("classifier_dropout", float, "dropout before the classifier head (default: the config's, else hidden dropout)"),
    ("dataset", str, "bundled dataset instead of files: 'mr' (movie-review sentences) or 'sms' (SMS spam)"),
    ("train", str, "training data: .csv, .tsv or .jsonl"),
    ("validation", str, "validation data (default: hold out --validation-split of --train)"),
    ("test", str, "test data, evaluated once with the best checkpoint"),
    ("text_column", str, "column holding the text (default 'text')"),
    ("text_pair_column", str, "column holding a second text segment, for sentence-pair tasks"),
    ("label_column", str, "column holding the label, string or integer (default 'label')"),
    ("validation_split", float, "fraction of --train held out (seeded) when no --validation file (default 0.1)"),
    ("max_train_examples", int, "use only the first N training examples"),
    ("max_length", int, "tokens per example; longer ones are truncated (default 128)"),
    ("epochs", int, "passes over the training data (default 3)"),
    ("max_steps", int, "stop after N optimiser steps; the schedule ends there too"),
    (
        "batch_size",
        int,
        "global batch: examples per optimiser step, summed over accumulation and processes (default 32)",
    ),
    ("grad_accum_steps", int, "micro-batches per optimiser step (default 1)"),
    ("eval_batch_size", int, "evaluation batch per process (default 64)"),
    ("lr", float, "peak learning rate (default 5e-5)"),
    ("weight_decay", float, "AdamW weight decay, not applied to biases and LayerNorm (default 0.01)"),
    ("adam_beta1", float, "AdamW beta1 (default 0.9)"),
    ("adam_beta2", float, "AdamW beta2 (default 0.999)"),
    ("adam_eps", float, "AdamW epsilon (default 1e-8)"),
    ("warmup_ratio", float, "fraction of the steps spent warming up linearly (default 0.1)"),
    ("warmup_steps", int, "warmup steps (overrides --warmup-ratio)"),
    ("max_grad_norm", float, "clip the gradient norm to this; 0 turns clipping off (default 1.0)"),
    ("seed", int, "seed for the head's initialisation, data order and dropout (default 42)"),
    ("bf16", bool, "bf16 autocast for the forward passes (weights and optimiser stay fp32)"),
    ("freeze_encoder", bool, "train only the classifier head; the encoder stays as loaded"),
    ("metric_for_best", str, "validation metric choosing the saved checkpoint: accuracy (default), macro_f1, loss"),
    ("output_dir", str, "where the best checkpoint (HF format), metrics.json, curves and resume state go"),
    ("overwrite", bool, "start afresh in an output dir that already holds a run (ignored with --resume)"),
    ("resume", bool, "continue from last-checkpoint.pt in --output-dir (same settings)"),
    ("save_steps", int, "also write the resumable checkpoint every N steps (always: every epoch, on Ctrl-C)"),
    ("stop_after_steps", int, "stop after N steps as if interrupted, keeping the full schedule; --resume later"),
    ("device", str, "'auto' (default: CUDA if present), 'cpu', 'cuda' or 'cuda:N'"),
    ("compare_to", str, "another run's output dir: report the per-step loss difference and plot both"),
]


CHOICES = {
    "reference": ("port", "hf"),
    "attn_implementation": ("sdpa", "eager"),
    "dataset": ("mr", "sms"),
    "metric_for_best": ("accuracy", "macro_f1", "loss"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bert-port-finetune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="JSON file of settings (keys as the flags, with underscores); flags win")
    parser.add_argument(
        "--export-dataset", metavar="DIR", help="with --dataset: write its train/validation/test split as CSV into DIR"
    )
    for name, kind, text in OPTIONS:
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text)
        else:
            parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, choices=CHOICES.get(name), help=text)
    return parser


def resolve_config(args: argparse.Namespace):
    """Dataclass defaults < --config file < flags."""
    from bert_port.training import FinetuneConfig, load_config_file

    settings = load_config_file(args.config) if args.config else {}
    settings.update({name: getattr(args, name) for name, _, _ in OPTIONS if hasattr(args, name)})
    return FinetuneConfig(**settings)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tqdm.contrib.logging import logging_redirect_tqdm

    from bert_port.checkpoint import CheckpointError
    from bert_port.config import ConfigError
    from bert_port.data import DataError, export_builtin
    from bert_port.training import FinetuneError, finetune

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    t0 = time.perf_counter()
    try:
        cfg = resolve_config(args)
        if args.export_dataset:
            if not cfg.dataset:
                raise FinetuneError("--export-dataset needs --dataset mr|sms")
            for split, path in export_builtin(cfg.dataset, args.export_dataset).items():
                print(f"{split}: {path}")
            return 0
        hf_module = None
        if cfg.reference == "hf":
            import transformers as hf_module
        with logging_redirect_tqdm():
            metrics = finetune(cfg, hf_module=hf_module)
    except (DataError, FinetuneError, CheckpointError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the machine, not the input: a full disk, a vanished mount
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if rank == 0:
        print(report(metrics, time.perf_counter() - t0))
    return 0


def report(metrics: dict, wall_s: float) -> str:
    cfg = metrics["config"]
    lines = [
        (
            f"{metrics['name']}: {metrics['status']} after {metrics['global_step']} steps "
            f"({metrics['epochs_completed']:g} epochs of {cfg['steps_per_epoch']} steps, global batch {cfg['batch_size']}, "
            f"{cfg['world_size']} process(es) on {cfg['device']})"
        ),
        "  data: {train} train / {validation} validation / {test} test, ".format(**cfg["sizes"])
        + f"labels {metrics['labels']}",
        (
            f"  time: {wall_s:.1f} s wall, {metrics['train_time_s']:.1f} s in training steps "
            f"({metrics['train_examples_per_s']} examples/s)"
        ),
    ]
    for e in metrics["evaluations"]:
        v = e["validation"]
        train_loss = f"{e['train_loss']:.4f}" if e["train_loss"] is not None else "-"
        lines.append(
            f"  epoch {e['epoch']} (step {e['step']}): train loss {train_loss}  validation loss "
            f"{v['loss']:.4f}  accuracy {v['accuracy']:.4f}  macro-F1 {v['macro_f1']:.4f}"
        )
    if metrics["best"]:
        b = metrics["best"]
        lines.append(f"  best: epoch {b['epoch']} (step {b['step']}), validation {b['metric']} {b['value']:.4f}")
    if metrics.get("test"):
        t = metrics["test"]
        lines.append(
            f"  test (best checkpoint, n={t['n']}): loss {t['loss']:.4f}  accuracy {t['accuracy']:.4f}  "
            f"macro-F1 {t['macro_f1']:.4f}"
        )
    if metrics.get("comparison"):
        c = metrics["comparison"]
        other_test = (c["test"]["other"] or {}).get("accuracy")
        lines.append(
            f"  vs {c['other']}: per-step train loss |diff| max {c['max_abs_loss_diff']:.3e}, mean "
            f"{c['mean_abs_loss_diff']:.3e} over {c['steps_compared']} steps (max over the first 20: "
            f"{c['max_abs_loss_diff_first_20']:.3e}); other run's test accuracy "
            f"{other_test if other_test is None else f'{other_test:.4f}'}"
        )
    if metrics["status"] == "stopped":
        lines.append("  stopped early: continue with the same command plus --resume")
    lines.append(
        f"  output: {metrics['output_dir']} (HF checkpoint, metrics.json, training_curves.png, "
        "training_config.json, last-checkpoint.pt)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
