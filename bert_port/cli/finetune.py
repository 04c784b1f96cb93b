"""`bert-port-finetune`: fine-tune a BERT checkpoint as a text classifier or a word tagger (NER).

    bert-port-finetune --config finetune_mr_minilm          (a bundled recipe, by name; or any JSON file)
    bert-port-finetune --config finetune_mr_minilm --eval-steps 10 --early-stopping-patience 3 \\
        --lr-scheduler-type cosine --report-to tensorboard
    bert-port-finetune --dataset mr_scores --problem-type regression --output-dir runs/scores
    bert-port-finetune --train tags.jsonl --problem-type multi_label_classification --output-dir runs/tags
    bert-port-finetune --train train.csv --validation dev.csv --label-column sentiment --output-dir runs/x
    bert-port-finetune --train ner.conll --problem-type token_classification --output-dir runs/ner
    bert-port-finetune --config finetune_ner_sms_minilm     (NER on SMS messages tagged by rules)
    torchrun --nproc_per_node 2 -m bert_port.cli.finetune --config ...     (DDP; same results)
    bert-port-finetune --config ... --resume                                (continue an interrupted run)
    bert-port-finetune --config ... --reference hf --output-dir runs/hf --compare-to runs/port
    bert-port-finetune --dataset mr --export-dataset data/mr               (write the bundled split as CSV)

Settings come from the dataclass defaults, then `--config FILE`, then the flags given. The same
from Python, without a subprocess: `bert_port.training.api.finetune(config, **flags)`.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """`--config FILE`, then one flag per `FinetuneConfig` field (`bert_port.cli.settings_parser`)."""
    from bert_port.cli import settings_parser
    from bert_port.training.settings import FinetuneConfig

    parser = settings_parser(
        "bert-port-finetune",
        __doc__,
        FinetuneConfig,
        "--config",
        "JSON file of settings (keys as the flags, with underscores), or the name of a bundled recipe "
        "(finetune_mr_minilm, finetune_sms_minilm, ...); flags win",
    )
    parser.add_argument(
        "--export-dataset",
        metavar="DIR",
        help="with --dataset: write its train/validation/test split as CSV (CoNLL for sms_ner) into DIR",
    )
    return parser


def resolve_config(args: argparse.Namespace):
    """Dataclass defaults < --config file (or bundled recipe) < flags."""
    from bert_port.cli import settings_from
    from bert_port.training import FinetuneConfig

    return settings_from(args, FinetuneConfig, args.config)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from bert_port.cli import run_training

    def run() -> dict | None:
        from bert_port.data import BUILTIN_DATASETS, export_builtin
        from bert_port.training import FinetuneError, finetune

        cfg = resolve_config(args)
        if not args.export_dataset:
            return finetune(cfg)
        if not cfg.dataset:
            raise FinetuneError(f"--export-dataset needs --dataset {'|'.join(BUILTIN_DATASETS)}")
        for split, path in export_builtin(cfg.dataset, args.export_dataset).items():
            print(f"{split}: {path}")
        return None

    return run_training(run, report)


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
    from bert_port.problem import ProblemType

    headline = ProblemType(metrics.get("problem_type") or ProblemType.SINGLE_LABEL).headline
    for e in metrics["evaluations"]:
        v = e["validation"]
        train_loss = f"{e['train_loss']:.4f}" if e["train_loss"] is not None else "-"
        lines.append(
            f"  epoch {e['epoch']} (step {e['step']}): train loss {train_loss}  validation loss {v['loss']:.4f}  {_figures(v, headline)}"
        )
    if metrics["best"]:
        b = metrics["best"]
        lines.append(f"  best: epoch {b['epoch']} (step {b['step']}), validation {b['metric']} {b['value']:.4f}")
    stopping = metrics.get("early_stopping") or {}
    if stopping.get("stopped_early"):
        lines.append(
            f"  early stopping: {stopping['patience']} evaluation(s) without improvement, stopped at step "
            f"{stopping['stopped_at_step']} of {cfg['total_steps']}"
        )
    if metrics.get("test"):
        t = metrics["test"]
        lines.append(f"  test (best checkpoint, n={t['n']}): loss {t['loss']:.4f}  {_figures(t, headline)}")
    if metrics.get("comparison"):
        c = metrics["comparison"]
        other_test = (c["test"]["other"] or {}).get(headline[0])
        lines.append(
            f"  vs {c['other']}: per-step train loss |diff| max {c['max_abs_loss_diff']:.3e}, mean "
            f"{c['mean_abs_loss_diff']:.3e} over {c['steps_compared']} steps (max over the first 20: "
            f"{c['max_abs_loss_diff_first_20']:.3e}); other run's test {headline[0]} "
            f"{other_test if other_test is None else f'{other_test:.4f}'}"
        )
    from bert_port.cli import report_ending

    return "\n".join(lines + report_ending(metrics))


def _figures(values: dict, names: tuple[str, ...]) -> str:
    return "  ".join(f"{m} {values[m]:.4f}" for m in names)


if __name__ == "__main__":
    sys.exit(main())
