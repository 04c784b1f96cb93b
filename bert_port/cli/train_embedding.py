"""`bert-port-train-embedding`: fine-tune a sentence-embedding model on your own rows, and
report retrieval (or, for scored pairs, similarity) on the validation rows before and after.

    bert-port-train-embedding --train pairs.csv --validation dev.csv --output-dir runs/emb
    bert-port-train-embedding --train pairs.jsonl --anchor-column question --positive-column answer \\
        --negative-column wrong1 --negative-column wrong2 --loss cached-mnrl --batch-size 256
    bert-port-train-embedding --train sts.parquet --score-column score --loss cosent --model runs/emb
    bert-port-train-embedding --train pairs.csv --save-steps 50 ...   (then the same plus --resume)
    bert-port-train-embedding --config train_embedding_dialog_minilm  (the bundled movie-dialog recipe)
    torchrun --nproc_per_node 2 -m bert_port.cli.train_embedding ...  (batch_size split over 2)

Settings come from the defaults, then `--config FILE` (JSON, keys as the flags with
underscores; or a bundled recipe's name), then the flags given. The output folder is a
sentence-transformers folder (`SentenceTransformer(folder)` loads it) with `metrics.json`, a
model card and `checkpoints/` to resume from. The recipe is `bert_port.training.embedding_run`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def build_parser() -> argparse.ArgumentParser:
    """`--config FILE`, then one flag per `EmbeddingRunConfig` field, taken from the field."""
    from bert_port.cli import positive_int
    from bert_port.training.embedding_settings import LIST_FIELDS, EmbeddingRunConfig
    from bert_port.training.settings import field_kind, flag

    parser = argparse.ArgumentParser(
        prog="bert-port-train-embedding", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", help="JSON file of settings, or a bundled recipe's name (train_embedding_dialog_minilm); flags win"
    )
    for f in dataclasses.fields(EmbeddingRunConfig):
        names = ["--model", flag(f.name)] if f.name == "checkpoint" else [flag(f.name)]
        text = f.metadata["help"] + ("" if f.default in (None, dataclasses.MISSING) else f" (default: {f.default})")
        if f.name in LIST_FIELDS:
            parser.add_argument(*names, dest=f.name, action="append", default=argparse.SUPPRESS, help=text)
            continue
        kind, _ = field_kind(f)
        if kind is bool:
            action = argparse.BooleanOptionalAction
            parser.add_argument(*names, dest=f.name, action=action, default=argparse.SUPPRESS, help=text)
            continue
        kind = positive_int if kind is int and f.metadata["check"].get("least", 1) == 1 else kind
        choices = f.metadata["choices"]
        parser.add_argument(*names, dest=f.name, type=kind, choices=choices, default=argparse.SUPPRESS, help=text)
    return parser


def resolve_config(args: argparse.Namespace):
    """Defaults < --config file (or bundled recipe) < flags."""
    from bert_port.training.embedding_settings import EmbeddingRunConfig
    from bert_port.training.settings import load_config_file

    values = load_config_file(args.config, EmbeddingRunConfig) if args.config else {}
    values.update(
        {f.name: getattr(args, f.name) for f in dataclasses.fields(EmbeddingRunConfig) if hasattr(args, f.name)}
    )
    return EmbeddingRunConfig(**values)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from bert_port.cli import run_training

    def run() -> dict:
        from bert_port.training.embedding_run import run as run_recipe

        return run_recipe(resolve_config(args))

    return run_training(run, report)


def report(metrics: dict, wall_s: float) -> str:
    """What the run did, in a few lines: its status, the headline figures before and after."""
    from bert_port.cli import report_ending

    if metrics.get("rank", 0):
        return ""
    cfg, steps = metrics["config"], len(metrics["step_losses"])
    head = f"{cfg['loss']} on {metrics['train_pairs']} training rows: {metrics['status']} after {steps} of "
    head += (
        f"{cfg['max_steps']} steps (batch {cfg['batch_size']}, {metrics['train_seconds']} s training, {wall_s:.0f} s)"
    )
    lines = [head]
    before, after = metrics.get("before"), metrics.get("after")
    if before or after:
        lines.append(f"  validation ({metrics['test_pairs']} rows):")
        for name in metrics["headline"]:
            was = f"{before[name]:.4f}" if before else "-"
            now = f"{after[name]:.4f}" if after else "-"
            lines.append(f"    {name}: {was} -> {now}")
    if metrics.get("test"):
        test = metrics["test"]
        lines.append(
            f"  test ({metrics['test_rows']} rows): " + "  ".join(f"{m} {test[m]:.4f}" for m in metrics["headline"])
        )
    ending = report_ending(metrics)
    ending[-1] = (
        f"  output: {metrics['output_dir']} (sentence-transformers folder, metrics.json, README.md; checkpoints/ to resume)"
    )
    return "\n".join(lines + ending)


if __name__ == "__main__":
    sys.exit(main())
