"""`bert-port-train-embedding`: fine-tune a sentence-embedding model on (query, document)
pairs with in-batch negatives, and report retrieval on held-out pairs before and after.

    bert-port-train-embedding --config configs/train_embedding_dialog_minilm.json
    bert-port-train-embedding --config ... --eval-steps 50 --stop-after-steps 50   (then the same plus --resume)
    bert-port-train-embedding --config ... --bf16 --lr-scheduler-type linear --warmup-ratio 0.1
    torchrun --nproc_per_node 2 -m bert_port.cli.train_embedding --config ...   (batch_size split over 2)

The output folder is a sentence-transformers folder (`SentenceTransformer(folder)` and
`SentenceEncoder.from_pretrained(folder)` load it) with `metrics.json`. The recipe is
`bert_port.training.embedding_run.run`; the Python API is `bert_port.training.embedding`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    from bert_port.training.settings import SCHEDULERS

    p = argparse.ArgumentParser(
        prog="bert-port-train-embedding", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", required=True, help="JSON file of the run's settings (see configs/)")
    p.add_argument("--max-steps", type=int, default=None, help="override the config's max_steps")
    p.add_argument("--output-dir", default=None, help="override the config's output_dir")
    p.add_argument("--eval-steps", type=int, default=None, help="retrieval on the held-out pairs every N steps too")
    p.add_argument("--stop-after-steps", type=int, default=None, help="stop there, resumable (as if interrupted)")
    p.add_argument("--resume", action="store_true", help="continue the stopped run in --output-dir, same settings")
    p.add_argument("--bf16", action="store_true", help="the encoder under bf16 autocast (weights and loss stay fp32)")
    p.add_argument(
        "--lr-scheduler-type",
        default=None,
        choices=SCHEDULERS,
        help="override the config's schedule (default constant): transformers' get_scheduler names",
    )
    p.add_argument("--warmup-steps", type=int, default=None, help="override the config's warmup_steps")
    p.add_argument("--warmup-ratio", type=float, default=None, help="warmup as a share of max_steps (if no steps)")
    return p


def main(argv: list[str] | None = None) -> int:
    from bert_port.training.embedding_run import REPORTED, EmbeddingRunConfig, run
    from bert_port.training.settings import FinetuneError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        config = EmbeddingRunConfig.from_json(args.config)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    overrides = {"max_steps": args.max_steps, "output_dir": args.output_dir, "eval_steps": args.eval_steps}
    overrides.update(stop_after_steps=args.stop_after_steps, resume=args.resume or None, bf16=args.bf16 or None)
    overrides.update(lr_scheduler_type=args.lr_scheduler_type, warmup_steps=args.warmup_steps)
    overrides.update(warmup_ratio=args.warmup_ratio)
    config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
    try:
        metrics = run(config)
    except (FinetuneError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if metrics.get("rank", 0):  # another process of a torchrun job: rank 0 reports
        return 0
    if metrics["status"] == "stopped":
        print(f"stopped after step {config.stop_after_steps}: continue with the same command plus --resume")
        return 0
    table = {name: {"before": metrics["before"][name], "after": metrics["after"][name]} for name in REPORTED}
    print(json.dumps({"output_dir": config.output_dir, "train_seconds": metrics["train_seconds"], **table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
