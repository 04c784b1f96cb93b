"""`bert-port-pretrain`: train a BERT language model on text, masked (BERT's objective) or causal.

    bert-port-pretrain --dataset mr --output-dir runs/mlm_mr               (masked LM from the bundled MiniLM)
    bert-port-pretrain --objective clm --config bert-mini-lm --dataset mr --output-dir runs/clm_mr
    bert-port-pretrain --train corpus.txt --validation held_out.txt --block-size 128 --whole-word-mask
    bert-port-pretrain --train texts.jsonl --text-column body --objective clm --checkpoint path/to/bert
    torchrun --nproc_per_node 2 -m bert_port.cli.pretrain --dataset mr ...   (DDP; same results)
    bert-port-pretrain --dataset mr ... --resume                            (continue an interrupted run)
    bert-port-pretrain --dataset mr ... --reference hf --output-dir runs/hf --compare-to runs/port
    bert-port-finetune --checkpoint runs/mlm_mr --dataset mr                (the masked LM, fine-tuned)

Settings come from the dataclass defaults, then `--recipe FILE`, then the flags given.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """`--recipe FILE`, then one flag per `PretrainConfig` field (`bert_port.cli.settings_parser`)."""
    from bert_port.cli import settings_parser
    from bert_port.training.lm_settings import PretrainConfig

    return settings_parser(
        "bert-port-pretrain",
        __doc__,
        PretrainConfig,
        "--recipe",
        "JSON file of settings (keys as the flags, with underscores), or the name of one bundled in configs/ "
        "(pretrain_...); flags win",
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from bert_port.cli import run_training, settings_from

    def run() -> dict:
        from bert_port.training.lm_settings import PretrainConfig
        from bert_port.training.pretrain import pretrain

        return pretrain(settings_from(args, PretrainConfig, args.recipe))

    return run_training(run, report)


def report(metrics: dict, wall_s: float) -> str:
    cfg = metrics["config"]
    sizes = cfg["sizes"]
    lines = [
        (
            f"{metrics['name']} ({metrics['objective']}): {metrics['status']} after {metrics['global_step']} steps "
            f"({metrics['epochs_completed']:g} epochs of {cfg['steps_per_epoch']} steps, global batch "
            f"{cfg['batch_size']} blocks of {cfg['block_size']} tokens, {cfg['world_size']} process(es) on "
            f"{cfg['device']})"
        ),
        (
            f"  data: {sizes['train']['blocks']} train blocks ({sizes['train']['texts']} texts) / "
            f"{sizes['validation']['blocks']} validation blocks ({sizes['validation']['texts']} texts)"
        ),
        (
            f"  time: {wall_s:.1f} s wall, {metrics['train_time_s']:.1f} s in training steps "
            f"({metrics['train_tokens_per_s']} tokens/s)"
        ),
    ]
    for e in metrics["evaluations"]:
        v = e["validation"]
        train_loss = f"{e['train_loss']:.4f}" if e["train_loss"] is not None else "-"
        lines.append(
            f"  step {e['step']}: train loss {train_loss}  validation loss {v['loss']:.4f}  "
            f"perplexity {v['perplexity']:.2f} ({v['tokens']} tokens)"
        )
    if metrics["best"]:
        b = metrics["best"]
        lines.append(f"  best: step {b['step']}, validation loss {b['value']:.4f} (saved)")
    if metrics.get("comparison"):
        c = metrics["comparison"]
        lines.append(
            f"  vs {c['other']}: per-step train loss |diff| max {c['max_abs_loss_diff']:.3e}, mean "
            f"{c['mean_abs_loss_diff']:.3e} over {c['steps_compared']} steps"
        )
    from bert_port.cli import report_ending

    return "\n".join(lines + report_ending(metrics))


if __name__ == "__main__":
    sys.exit(main())
