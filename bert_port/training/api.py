"""The Python API of fine-tuning and prediction: what `bert-port-finetune` and
`bert-port-predict` do, called from a notebook without a subprocess. The commands are thin
wrappers over these two functions.

    metrics = finetune("finetune_sms_minilm", max_steps=2, output_dir="runs/sms")
    rows = predict("runs/sms", ["WINNER! claim your prize", "see you at lunch"])
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .prediction import Predictor
from .recipe import FinetuneRecipe
from .reference import require_reference
from .reporting import full_disk_said
from .settings import FinetuneConfig, FinetuneError, TrainingSettings, load_config_file
from .steps import setup_distributed

__all__ = ["Predictor", "finetune", "predict", "run_recipe", "settings_of"]


def settings_of(
    settings: TrainingSettings | dict | str | os.PathLike | None = None,
    cls: type[TrainingSettings] = FinetuneConfig,
    **overrides: Any,
) -> TrainingSettings:
    """Settings from the dataclass defaults, then `settings` (a settings object, a dict, a JSON
    file or the name of a bundled recipe such as "finetune_sms_minilm"), then `overrides`,
    exactly as the command line layers `--config` and its flags."""
    if isinstance(settings, TrainingSettings):
        values = dataclasses.asdict(settings)
    elif isinstance(settings, dict):
        values = dict(settings)
    elif settings is not None:
        values = load_config_file(settings, cls)
    else:
        values = {}
    values.update(overrides)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise FinetuneError(f"unknown setting(s) {', '.join(unknown)}; the settings are the fields of {cls.__name__}")
    return cls(**values)


def finetune(settings: FinetuneConfig | dict | str | os.PathLike | None = None, **overrides: Any) -> dict[str, Any]:
    """Fine-tune as `bert-port-finetune` does (`settings_of` reads `settings` and `overrides`),
    in this process or as one process of a torchrun job. Returns the metrics written to
    `metrics.json`: `status` "completed" (early stopping included) or "stopped" (interrupted,
    or `stop_after_steps`: continue with `resume=True`), `evaluations`, `best`, `test`."""
    return run_recipe(FinetuneRecipe, settings_of(settings, FinetuneConfig, **overrides))


def run_recipe(recipe_class: type[FinetuneRecipe], cfg: TrainingSettings) -> dict[str, Any]:
    """Check `cfg`, then set up and train `recipe_class(cfg)` in this process of the job;
    a full disk is a `FinetuneError`, since every write is staged and the last checkpoint intact."""
    cfg.validate()
    require_reference(cfg.reference)
    recipe = recipe_class(cfg, setup_distributed(cfg.device))
    try:
        with contextlib.ExitStack() as stack, full_disk_said(Path(cfg.output_dir), lambda: recipe.global_step):
            recipe.setup(stack)
            return recipe.train()
    finally:
        recipe.cleanup()


def predict(
    model: str | os.PathLike | Predictor,
    texts: Sequence[str] | Sequence[Sequence[str]],
    pairs: Sequence[str] | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """One prediction row per text, as `bert-port-predict` writes them beside each input row:
    `predicted_label` and `probabilities` (single-label), `predicted_labels` (multi-label),
    `predicted_value` (regression), `entities` (token classification; `texts` may be lists of
    words). `model` is a fine-tuned output folder, any classifier checkpoint, or a `Predictor`
    (load once, predict many times); `options` are `Predictor.load`'s."""
    if isinstance(model, Predictor) and options:
        raise TypeError(f"options {', '.join(sorted(options))} are Predictor.load's; pass them when loading it")
    predictor = model if isinstance(model, Predictor) else Predictor.load(Path(model), **options)
    return predictor(texts, pairs)
