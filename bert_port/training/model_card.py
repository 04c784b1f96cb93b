"""The model card (`README.md`) of a finished run's model folder, as transformers' Trainer
(`create_model_card`) and sentence-transformers write one: YAML metadata the Hub reads
(base model, library, pipeline, tags), then what the model was trained from, on which data,
with which settings, and how it scored. Built from the run's metrics document alone, so a
card can be written again from `metrics.json`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import checkpoint as ckpt

MODEL_CARD = "README.md"
BUNDLED_BASE = "sentence-transformers/all-MiniLM-L6-v2"  # what `assets.minilm_dir()` holds
PIPELINES = {
    "single_label_classification": "text-classification",
    "multi_label_classification": "text-classification",
    "regression": "text-classification",
    "token_classification": "token-classification",
}
# The settings a card lists, as Trainer's card names them.
HYPERPARAMETERS = {
    "lr": "learning_rate",
    "batch_size": "train_batch_size",
    "eval_batch_size": "eval_batch_size",
    "grad_accum_steps": "gradient_accumulation_steps",
    "seed": "seed",
    "weight_decay": "weight_decay",
    "lr_scheduler_type": "lr_scheduler_type",
    "warmup_steps": "warmup_steps",
    "epochs": "num_epochs",
    "max_steps": "max_steps",
    "total_steps": "training_steps",
    "max_length": "max_length",
    "bf16": "bf16",
    "world_size": "processes",
}


def base_model(checkpoint: str | None) -> str:
    """The base model as a card names it: the bundled checkpoint by its Hub id, else as given."""
    if checkpoint in (None, "bundled:all-MiniLM-L6-v2"):
        return BUNDLED_BASE
    from ..assets import minilm_dir

    return BUNDLED_BASE if Path(checkpoint).resolve() == minilm_dir().resolve() else str(checkpoint)


def _front_matter(fields: dict[str, Any]) -> list[str]:
    lines = ["---"]
    for key, value in fields.items():
        if isinstance(value, list):
            lines += [f"{key}:"] + [f"- {v}" for v in value]
        elif value is not None:
            lines.append(f"{key}: {value}")
    return lines + ["---", ""]


def _figures(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in values.items() if isinstance(v, float))


def finetune_card(metrics: dict[str, Any]) -> str:
    """The card of a fine-tuning (or language-model) run, from its metrics.json document."""
    cfg = metrics["config"]
    base = base_model(cfg.get("checkpoint") or cfg.get("config"))
    data = cfg.get("dataset") or cfg.get("train") or "the files given"
    problem = cfg.get("problem_type") or cfg.get("objective")
    lines = _front_matter(
        {
            "library_name": "transformers",
            "base_model": base,
            "pipeline_tag": PIPELINES.get(problem, "fill-mask" if problem == "mlm" else "text-generation"),
            "tags": ["bert_port", "generated_from_trainer", str(problem)],
        }
    )
    best = metrics.get("best") or {}
    lines += [
        f"# {Path(metrics['output_dir']).name}",
        "",
        (
            f"This model is a fine-tuned version of `{base}` on {data}, trained by bert_port's "
            f"fine-tuning recipe ({problem})."
        ),
    ]
    if best:
        lines.append(
            f"The saved weights are the best evaluation's: step {best['step']}, {best['metric']} {best['value']:.4f}."
        )
    sizes = cfg.get("sizes") or {}
    lines += ["", "## Training data", "", f"- data: {data}"]
    lines += [f"- {split}: {size}" for split, size in sizes.items()]
    if metrics.get("labels"):
        lines.append(f"- labels: {', '.join(map(str, metrics['labels']))}")
    lines += ["", "## Training procedure", "", "### Training hyperparameters", ""]
    lines += [f"- {name}: {cfg[key]}" for key, name in HYPERPARAMETERS.items() if cfg.get(key) is not None]
    lines += [
        "",
        "### Training results",
        "",
        "| step | epoch | training loss | validation loss | metrics |",
        "|---|---|---|---|---|",
    ]
    for e in metrics.get("evaluations", []):
        v, train_loss = e["validation"], e.get("train_loss")
        shown = "-" if train_loss is None else f"{train_loss:.4f}"
        metric_names = {k: v[k] for k in (metrics.get("headline") or v) if k != "loss"}
        lines.append(f"| {e['step']} | {e['epoch']} | {shown} | {v['loss']:.4f} | {_figures(metric_names)} |")
    if metrics.get("test"):
        lines += ["", f"On the test data (n={metrics['test'].get('n')}): {_figures(metrics['test'])}."]
    return "\n".join(lines + _versions()) + "\n"


def embedding_card(metrics: dict[str, Any]) -> str:
    """The card of a sentence-embedding run (`embedding_run`), from its metrics.json document."""
    cfg = metrics["config"]
    base = base_model(cfg.get("checkpoint"))
    lines = _front_matter(
        {
            "library_name": "sentence-transformers",
            "base_model": base,
            "pipeline_tag": "sentence-similarity",
            "tags": ["bert_port", "sentence-transformers", "sentence-similarity", "feature-extraction", cfg["loss"]],
        }
    )
    lines += [
        f"# {Path(cfg['output_dir']).name}",
        "",
        (
            f"A sentence-transformers model fine-tuned from `{base}` on the `{cfg['dataset']}` pairs with the "
            f"`{cfg['loss']}` loss by bert_port. `SentenceTransformer(folder)` and "
            "`bert_port.SentenceEncoder.from_pretrained(folder)` load it."
        ),
        "",
        "## Training data",
        "",
        f"- {metrics['train_pairs']} training pairs, {metrics['test_pairs']} held-out test pairs",
        "",
        "## Training hyperparameters",
        "",
    ]
    shown = ("batch_size", "max_steps", "lr", "lr_scheduler_type", "warmup_steps", "warmup_ratio", "weight_decay")
    shown += ("scale", "symmetric", "bf16", "seed")
    lines += [f"- {k}: {cfg[k]}" for k in shown if k in cfg]  # an older run's metrics lack the newer settings
    lines += ["", "## Evaluation on the validation rows", "", "| metric | before | after |", "|---|---|---|"]
    for name in sorted(metrics["after"]):
        lines.append(f"| {name} | {metrics['before'][name]:.4f} | {metrics['after'][name]:.4f} |")
    return "\n".join(lines + _versions()) + "\n"


def _versions() -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        ours = version("bert_port")
    except PackageNotFoundError:
        ours = "source"
    return ["", "## Framework versions", "", f"- bert_port {ours}", f"- torch {torch.__version__}"]


def write_model_card(text: str, folder: Path) -> Path:
    """`text` as `folder`'s README.md, staged and renamed into place."""
    path = Path(folder) / MODEL_CARD
    with ckpt.atomic_write(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return path
