"""The settings of a training run: one dataclass per recipe, each option written once.

Each field carries its help text, its choices, its range and whether a resumed run must
share it (`option(...)`). From that one declaration come the command-line flags and their
help (`bert_port.cli.finetune`), the checks on a config file or the flags
(`FinetuneConfig.validate`), and the settings a `--resume` refuses to change
(`resume_mismatches`). Names follow transformers' `TrainingArguments` where it has one.
`TrainingSettings` holds the options every recipe shares; `FinetuneConfig` adds the
classifier's, `lm_settings.PretrainConfig` the language model's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..assets import config_dir, config_path
from ..data import BUILTIN_DATASETS
from ..devices import resolve_device
from ..problem import ProblemType

# Validation metrics for each problem type (the first is the default); loss is minimised.
METRICS = {p.value: p.metrics for p in ProblemType}
# The problem type of each bundled dataset's labels.
DATASET_PROBLEM = {
    "mr": ProblemType.SINGLE_LABEL,
    "sms": ProblemType.SINGLE_LABEL,
    "mr_scores": ProblemType.REGRESSION,
    "sms_ner": ProblemType.TOKEN_CLASSIFICATION,
}
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")  # transformers' get_scheduler names
REPORT_TO = ("none", "tensorboard")


class FinetuneError(ValueError):
    """A configuration or run state that cannot be used; the message says what to do."""


def option(default: Any, help: str, *, choices: tuple | None = None, resume: bool = False, **check: Any):
    """A settings field. `resume`: a resumed run must keep it (it decides the data order, the
    schedule, the model or when the run ends). `check`: `least` (integers), or `lo`, `hi`,
    `lo_open`, `want` (floats: finite, in [lo, hi) or (lo, hi))."""
    return dataclasses.field(
        default=default, metadata={"help": help, "choices": choices, "resume": resume, "check": check}
    )


@dataclass
class TrainingSettings:
    """The options every training recipe shares: the starting checkpoint, held-out data,
    optimisation, evaluation, checkpoints and logs. A recipe's settings add their own
    (`FinetuneConfig` below; `PretrainConfig` in `lm_settings`), and the class variables
    name the recipe in messages and its bundled recipes in `configs/`."""

    command: ClassVar[str] = "bert-port run"  # in messages: "another bert-port-finetune is writing"
    kind: ClassVar[str] = "training"  # "invalid fine-tuning configuration"
    data_formats: ClassVar[str] = "CSV, TSV or JSONL"  # what --train takes
    recipe_prefix: ClassVar[str] = ""  # of the bundled settings files in configs/

    # Model.
    checkpoint: str | None = option(
        None, "checkpoint directory or model id in the local HF cache (default: bundled all-MiniLM-L6-v2)", resume=True
    )
    attn_implementation: str = option("sdpa", "attention implementation", choices=("sdpa", "eager"))
    # Data.
    validation: str | None = option(
        None, "validation data (default: hold out --validation-split of --train)", resume=True
    )
    text_column: str = option("text", "column holding the text", resume=True)
    validation_split: float = option(
        0.1,
        "fraction of --train held out (seeded) when no --validation file",
        resume=True,
        lo=0.0,
        hi=1.0,
        lo_open=True,
        want="strictly between 0 and 1",
    )
    max_train_examples: int | None = option(None, "use only the first N training examples", resume=True, least=1)
    # Optimisation.
    epochs: int = option(3, "passes over the training data", resume=True, least=1)
    max_steps: int | None = option(
        None, "stop after N optimiser steps; the schedule ends there too", resume=True, least=1
    )
    batch_size: int = option(
        32, "global batch: examples per optimiser step, summed over accumulation and processes", resume=True, least=1
    )
    grad_accum_steps: int = option(1, "micro-batches per optimiser step", least=1)
    eval_batch_size: int = option(64, "evaluation batch per process", least=1)
    lr: float = option(
        5e-5, "peak learning rate", resume=True, lo=0.0, lo_open=True, want="a finite number > 0 (e.g. 5e-5)"
    )
    lr_scheduler_type: str = option(
        "linear",
        "learning-rate schedule after warmup, as transformers' get_scheduler: linear decay to 0, cosine "
        "(half a cosine to 0), constant (no warmup either), constant_with_warmup",
        choices=SCHEDULERS,
        resume=True,
    )
    weight_decay: float = option(
        0.01,
        "AdamW weight decay, not applied to biases and LayerNorm",
        resume=True,
        lo=0.0,
        want="a finite number >= 0",
    )
    adam_beta1: float = option(0.9, "AdamW beta1", lo=0.0, hi=1.0, want="in [0, 1)")
    adam_beta2: float = option(0.999, "AdamW beta2", lo=0.0, hi=1.0, want="in [0, 1)")
    adam_eps: float = option(1e-8, "AdamW epsilon", lo=0.0, lo_open=True, want="a finite number > 0 (e.g. 1e-8)")
    warmup_ratio: float = option(
        0.1, "fraction of the steps spent warming up linearly from 0", resume=True, lo=0.0, hi=1.0, want="in [0, 1)"
    )
    warmup_steps: int | None = option(None, "warmup steps (overrides --warmup-ratio)", resume=True, least=0)
    max_grad_norm: float = option(
        1.0,
        "clip the gradient norm to this; 0 turns clipping off",
        lo=0.0,
        want="a finite number >= 0 (0 turns clipping off)",
    )
    seed: int = option(
        42, "seed for new weights' initialisation, data order, dropout (and MLM masks)", resume=True, least=0
    )
    bf16: bool = option(False, "bf16 autocast for the forward passes (weights and optimiser stay fp32)")
    fp16: bool = option(
        False, "fp16 autocast with a gradient scaler, on CUDA only (on the CPU use --bf16); weights stay fp32"
    )
    # Evaluation, checkpoints, logs.
    eval_steps: int | None = option(
        None,
        "evaluate (and keep the best checkpoint) every N optimiser steps and at the end; default: after every epoch",
        resume=True,
        least=1,
    )
    early_stopping_patience: int | None = option(
        None, "stop after K evaluations in a row without a better validation metric", resume=True, least=1
    )
    report_to: str = option(
        "none", "also log the curves for TensorBoard (in OUTPUT_DIR/tensorboard)", choices=REPORT_TO
    )
    overwrite: bool = option(False, "start afresh in an output dir that already holds a run (ignored with --resume)")
    resume: bool = option(False, "continue from checkpoints/last-checkpoint.pt in --output-dir (same settings)")
    save_steps: int | None = option(
        None, "also write the resumable checkpoint every N steps (always: every epoch, on Ctrl-C)", least=1
    )
    stop_after_steps: int | None = option(
        None, "stop after N steps as if interrupted, keeping the full schedule; --resume later", least=1
    )
    device: str = option("auto", "'auto' (CUDA if present), 'cpu', 'cuda' or 'cuda:N'")
    compare_to: str | None = option(None, "another run's output dir: report the per-step loss difference and plot both")

    @property
    def metric(self) -> str:
        """The validation metric that picks the best checkpoint (and drives early stopping)."""
        return "loss"

    def validate(self) -> None:
        """Refuse settings that mean nothing before any work is done (a config file can hold
        any JSON type, so types are checked too). Every problem is listed at once."""
        problems = self.problems()
        if problems:
            raise FinetuneError(f"invalid {self.kind} configuration:\n  - " + "\n  - ".join(problems))

    def problems(self) -> list[str]:
        """What is wrong with these settings; a recipe's settings add their own checks."""
        problems = [p for f in dataclasses.fields(self) if (p := _check_field(f, getattr(self, f.name)))]
        data = (getattr(self, "dataset", None), getattr(self, "train", None))
        if data[0] is not None and data[1] is not None:
            problems.append("give either a bundled dataset (--dataset) or a training file (--train), not both")
        if data == (None, None):
            choices = next(f for f in dataclasses.fields(self) if f.name == "dataset").metadata["choices"]
            problems.append(
                f"no training data: pass --train FILE ({self.data_formats}) or --dataset {'|'.join(choices)}"
            )
        if self.bf16 is True and self.fp16 is True:
            problems.append("--bf16 and --fp16 exclude each other; choose one")
        if isinstance(self.device, str):
            try:
                resolve_device(self.device, what="--device")
            except ValueError as exc:
                problems.append(str(exc))
        return problems


@dataclass
class FinetuneConfig(TrainingSettings):
    """The settings of `bert-port-finetune`: the shared options, and the classifier's."""

    command: ClassVar[str] = "bert-port-finetune"
    kind: ClassVar[str] = "fine-tuning"
    recipe_prefix: ClassVar[str] = "finetune_"

    # The classifier: its model, labels and data.
    reference: str = option(
        "port",
        "'port': bert_port's model; 'hf': transformers' BertForSequenceClassification, same loop and initial weights",
        choices=("port", "hf"),
        resume=True,
    )
    classifier_dropout: float | None = option(
        None,
        "dropout before the classifier head (default: the config's, else hidden dropout)",
        resume=True,
        lo=0.0,
        hi=1.0,
        want="in [0, 1)",
    )
    problem_type: str = option(
        ProblemType.SINGLE_LABEL.value,
        ", ".join(f"{p.value} ({p.help})" for p in ProblemType),
        choices=ProblemType.choices(),
        resume=True,
    )
    dataset: str | None = option(
        None,
        "bundled data instead of files: mr (movie-review sentiment), mr_scores (the same sentences with their "
        "mean human rating in [-4, 4], for regression), sms (SMS spam), sms_ner (the SMS messages with "
        "entities tagged by rules, for token_classification)",
        choices=BUILTIN_DATASETS,
        resume=True,
    )
    train: str | None = option(
        None, "training data: .csv, .tsv or .jsonl; for token_classification .conll (word, tag) or .jsonl", resume=True
    )
    test: str | None = option(None, "test data, evaluated once with the best checkpoint")
    text_pair_column: str | None = option(
        None, "column holding a second text segment, for sentence-pair tasks", resume=True
    )
    label_column: str = option(
        "label",
        "column holding the label: a class (string or integer); a number for regression; for multi-label, "
        "the labels separated by '|' (CSV/TSV) or a JSON list (JSONL)",
        resume=True,
    )
    max_length: int = option(128, "tokens per example; longer ones are truncated", resume=True, least=1)
    freeze_encoder: bool = option(False, "train only the classifier head; the encoder stays as loaded", resume=True)
    metric_for_best: str | None = option(
        None,
        "validation metric choosing the saved checkpoint: "
        + "; ".join(f"{', '.join(p.metrics[:-1])} ({p.short}; default {p.metrics[0]})" for p in ProblemType)
        + "; or loss",
        choices=tuple(dict.fromkeys(m for ms in METRICS.values() for m in ms)),
        resume=True,
    )
    output_dir: str = option(
        "runs/finetune", "where the best checkpoint (HF format), metrics.json, curves and resume state go"
    )

    @property
    def metric(self) -> str:
        """The validation metric that picks the best checkpoint (and drives early stopping)."""
        return self.metric_for_best or METRICS.get(self.problem_type, ("loss",))[0]

    def problems(self) -> list[str]:
        problems = super().problems()
        wanted = DATASET_PROBLEM.get(self.dataset) if isinstance(self.dataset, str) else None
        if wanted is not None and self.problem_type != wanted:
            problems.append(f"--dataset {self.dataset} holds {wanted.help.split(',')[0]}: use --problem-type {wanted}")
        allowed = METRICS.get(self.problem_type)
        if allowed and self.metric_for_best is not None and self.metric_for_best not in allowed:
            problems.append(
                f"--metric-for-best {self.metric_for_best!r} does not apply to {self.problem_type}; "
                f"choose one of {', '.join(allowed)}"
            )
        columns = [c for c in (self.text_column, self.text_pair_column, self.label_column) if c is not None]
        if len(set(map(str, columns))) < len(columns):
            problems.append(
                f"--text-column, --text-pair-column and --label-column must name different columns, got {columns}"
            )
        if _is_int(self.max_length) and self.max_length >= 1:
            try:
                check_max_length(self.max_length, None, pairs=self.text_pair_column is not None)
            except FinetuneError as exc:
                problems.append(str(exc))
        return problems


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def field_kind(f: dataclasses.Field) -> tuple[type, bool]:
    """(str | int | float | bool, whether None is allowed), from the annotation's text."""
    text = str(f.type)
    kind = next(k for k in (bool, int, float, str) if k.__name__ in text.split(" | "))
    return kind, "None" in text


def _check_field(f: dataclasses.Field, value: Any) -> str | None:
    """What is wrong with `value` for field `f`, or None."""
    kind, optional = field_kind(f)
    if value is None and optional:
        return None
    meta, check = f.metadata, f.metadata["check"]
    if kind is bool:
        ok, want = isinstance(value, bool), "true or false"
    elif kind is str:
        ok, want = isinstance(value, str) and bool(value), "a non-empty string"
        if ok and meta["choices"] and value not in meta["choices"]:
            ok, want = False, "one of " + ", ".join(meta["choices"])
    elif kind is int:
        least = check.get("least", 1)
        if f.name == "seed":
            ok, want = _is_int(value) and 0 <= value < 2**63, "an integer in [0, 2**63)"
        else:
            ok = _is_int(value) and value >= least
            want = "a positive integer" if least == 1 else f"an integer >= {least}"
    else:
        lo, hi = check.get("lo", -math.inf), check.get("hi", math.inf)
        # `not lo < x` also catches NaN, which compares false.
        ok = (
            _is_number(value)
            and math.isfinite(value)
            and (lo < value if check.get("lo_open") else lo <= value)
            and value < hi
        )
        want = check.get("want", "a finite number")
    return None if ok else f"{flag(f.name)} must be {want}, got {value!r}"


def resume_mismatches(saved: dict[str, Any], cfg: TrainingSettings) -> list[str]:
    """The settings a resumed run changed among those it must keep."""
    return [
        f"{f.name}: checkpoint {saved.get(f.name)!r}, now {getattr(cfg, f.name)!r}"
        for f in dataclasses.fields(cfg)
        if f.metadata["resume"] and saved.get(f.name) != getattr(cfg, f.name)
    ]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_max_length(max_length: int, max_positions: int | None, pairs: bool = False, flag: str = "--max-length"):
    """`max_length` must leave room for text beside [CLS]/[SEP] (below that the tokenizer
    silently stops truncating) and fit the model's position table (beyond it the first long
    batch fails mid-run)."""
    least = 5 if pairs else 3  # [CLS] a [SEP] (b [SEP])
    if max_length < least:
        raise FinetuneError(
            f"{flag} {max_length} leaves no room for text beside [CLS] and [SEP]; use at least "
            f"{least}{' with a text pair' if pairs else ''} (typically 128)"
        )
    if max_positions is not None and max_length > max_positions:
        raise FinetuneError(
            f"{flag} {max_length} exceeds the longest sequence the model encodes ({max_positions} tokens: "
            "its max_position_embeddings, less the padding offset in RoBERTa's family): "
            f"sequences that long cannot be encoded; use {flag} {max_positions} or less"
        )


def bundled_config(name: str) -> Path | None:
    """The recipe `name` (e.g. `finetune_mr_minilm`) shipped in `configs/`, if any."""
    candidate = config_path(name)
    return candidate if candidate.is_file() else None


def bundled_recipes(prefix: str = "finetune_") -> list[str]:
    return sorted(p.name.removesuffix(".json") for p in config_dir().iterdir() if p.name.startswith(prefix))


def load_config_file(path: str | os.PathLike, settings: type[TrainingSettings] | None = None) -> dict[str, Any]:
    """Read a run's settings: a JSON file, or the name of a recipe bundled in `configs/`
    (`finetune_mr_minilm`), which a wheel ships too. Keys are fields of `settings`
    (default `FinetuneConfig`); unknown keys are an error (a typo would do nothing)."""
    settings = settings or FinetuneConfig
    path = Path(path)
    if not path.exists() and path.parent == Path(".") and bundled_config(path.name) is not None:
        path = bundled_config(path.name)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FinetuneError(
            f"no configuration file at {path}, and no bundled recipe of that name (bundled: "
            f"{', '.join(bundled_recipes(settings.recipe_prefix))})"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FinetuneError(f"{path} is not valid JSON ({exc})") from None
    except OSError as exc:
        raise FinetuneError(f"cannot read the configuration file {path} ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise FinetuneError(f"{path} must hold a JSON object of settings")
    known = {f.name for f in dataclasses.fields(settings)}
    data = {k.replace("-", "_"): v for k, v in data.items() if not k.startswith("_")}  # "_comment" keys allowed
    unknown = sorted(set(data) - known)
    if unknown:
        raise FinetuneError(
            f"{path}: unknown setting(s) {', '.join(unknown)}; valid ones are {', '.join(sorted(known))}"
        )
    return data
