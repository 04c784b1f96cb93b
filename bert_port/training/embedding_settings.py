"""The settings of `bert-port-train-embedding`: one dataclass, each option written once.

Each field is declared with the fine-tuning settings' `option(...)` (help, choices, range,
whether a resumed run must keep it), so the same helpers give its flags, its checks and the
settings a `--resume` refuses to change (`settings.resume_mismatches`), and a JSON file or a
bundled recipe (`configs/train_embedding_*.json`) is read by `settings.load_config_file`.
The only field those helpers do not know is `negative_column`, a list (the flag repeats).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from .settings import SCHEDULERS, FinetuneError, _check_field, option

LOSS_NAMES = ("mnrl", "cached-mnrl", "cosent", "cosine", "triplet")
SCORED_LOSSES = ("cosent", "cosine")  # (a, b, score) rows
PAIR_LOSSES = ("mnrl", "cached-mnrl")  # (anchor, positive[, negatives...]) rows, in-batch negatives
DATASETS = ("dialog",)
BUNDLED_MODEL = "bundled:all-MiniLM-L6-v2"
LIST_FIELDS = ("negative_column",)  # flags that repeat; not checked by `settings._check_field`


@dataclass
class EmbeddingRunConfig:
    """What an embedding-training run reads from its flags or JSON file; defaults as shown."""

    command: ClassVar[str] = "bert-port-train-embedding"  # in messages: "another ... is writing"
    kind: ClassVar[str] = "embedding-training"
    data_formats: ClassVar[str] = "CSV, TSV, JSONL or Parquet"
    recipe_prefix: ClassVar[str] = "train_embedding_"

    checkpoint: str = option(
        BUNDLED_MODEL,
        "model to train: a checkpoint or sentence-transformers folder, or a model id in the HF cache",
        resume=True,
    )
    dataset: str | None = option(
        None, "bundled pairs instead of files: dialog (movie-dialog statement -> reply)", choices=DATASETS, resume=True
    )
    train: str | None = option(None, "training rows: .csv, .tsv, .jsonl or .parquet", resume=True)
    validation: str | None = option(
        None, "rows evaluated before, during (--eval-steps) and after training", resume=True
    )
    test: str | None = option(None, "rows evaluated once, after training")
    anchor_column: str = option("anchor", "column holding the anchor (query) text", resume=True)
    positive_column: str = option("positive", "column holding the positive (or second) text", resume=True)
    negative_column: list[str] = dataclasses.field(
        default_factory=list,
        metadata={
            "help": "column holding a hard negative; repeat the flag for several (triplet: exactly one)",
            "choices": None,
            "resume": True,
            "check": {},
        },
    )
    score_column: str | None = option(
        None, "column holding each pair's score, for --loss cosent or cosine", resume=True
    )
    test_pairs: int = option(
        0, "without --validation: hold out N rows of the training data (seeded) to evaluate on", resume=True, least=0
    )
    max_train_pairs: int | None = option(None, "use only the first N training rows", resume=True, least=1)
    max_seq_length: int | None = option(
        None, "tokens per text; longer texts are truncated (default: the model's)", resume=True, least=1
    )
    loss: str = option("mnrl", "the loss, as sentence-transformers names it", choices=LOSS_NAMES, resume=True)
    scale: float = option(
        20.0, "mnrl, cached-mnrl, cosent: the similarity scale", resume=True, lo=0.0, lo_open=True, want="> 0"
    )
    symmetric: bool = option(False, "mnrl, cached-mnrl: add the positive -> anchor direction", resume=True)
    mini_batch_size: int = option(32, "cached-mnrl: rows embedded at once", resume=True, least=1)
    batch_size: int = option(
        32, "global batch: rows per optimiser step, split over torchrun's processes", resume=True, least=1
    )
    max_steps: int = option(100, "optimiser steps", resume=True, least=1)
    lr: float = option(2e-5, "peak learning rate", resume=True, lo=0.0, lo_open=True, want="a finite number > 0")
    lr_scheduler_type: str = option(
        "constant", "learning-rate schedule, as transformers' get_scheduler", choices=SCHEDULERS, resume=True
    )
    warmup_steps: int | None = option(None, "warmup steps (overrides --warmup-ratio)", resume=True, least=0)
    warmup_ratio: float = option(0.0, "fraction of the steps spent warming up", resume=True, lo=0.0, hi=1.0,
                                 want="in [0, 1)")  # fmt: skip
    weight_decay: float = option(
        0.01, "AdamW weight decay, not applied to biases and LayerNorm", resume=True, lo=0.0, want=">= 0"
    )
    adam_beta1: float = option(0.9, "AdamW beta1", resume=True, lo=0.0, hi=1.0, want="in [0, 1)")
    adam_beta2: float = option(0.999, "AdamW beta2", resume=True, lo=0.0, hi=1.0, want="in [0, 1)")
    adam_eps: float = option(1e-8, "AdamW epsilon", resume=True, lo=0.0, lo_open=True, want="> 0")
    bf16: bool = option(False, "the encoder under bf16 autocast (weights, optimiser and the loss stay fp32)",
                        resume=True)  # fmt: skip
    seed: int = option(42, "seed of the data order, dropout and the held-out rows", resume=True, least=0)
    output_dir: str = option("runs/train_embedding", "where the model, metrics.json and checkpoints/ go")
    eval_steps: int | None = option(None, "also evaluate every N steps", resume=True, least=1)
    save_steps: int | None = option(
        None, "write the resumable checkpoint every N steps (always on Ctrl-C and --stop-after-steps)", least=1
    )
    stop_after_steps: int | None = option(None, "stop after N steps as if interrupted; --resume later", least=1)
    resume: bool = option(False, "continue from checkpoints/last-checkpoint.pt in --output-dir (same settings)")
    overwrite: bool = option(False, "start afresh in an --output-dir that already holds a run")

    @property
    def columns(self) -> list[str]:
        """The text columns a row holds, in the loss's order (anchor, positive, negatives)."""
        return [self.anchor_column, self.positive_column, *self.negative_column]

    def validate(self) -> None:
        """Every problem with these settings at once, in one `FinetuneError`, before any work."""
        problems = [
            p
            for f in dataclasses.fields(self)
            if f.name not in LIST_FIELDS and (p := _check_field(f, getattr(self, f.name)))
        ]
        problems += self._data_problems() + self._loss_problems()
        if problems:
            raise FinetuneError(f"invalid {self.kind} configuration:\n  - " + "\n  - ".join(problems))

    def _data_problems(self) -> list[str]:
        problems = []
        if (self.dataset is None) == (self.train is None):
            problems.append(
                f"give one of --train FILE ({self.data_formats}) or --dataset {'|'.join(DATASETS)}"
                if self.dataset is None
                else "give either a bundled --dataset or a --train file, not both"
            )
        if self.validation is not None and self.test_pairs:
            problems.append("give --validation or --test-pairs (rows held out of --train), not both")
        negatives = self.negative_column
        if not isinstance(negatives, list) or not all(isinstance(c, str) and c for c in negatives):
            problems.append(f"--negative-column must name columns (a list of strings), got {negatives!r}")
        elif self.score_column is not None:
            names = [*self.columns, self.score_column]
            if len(set(names)) < len(names):
                problems.append(f"the anchor, positive, negative and score columns must differ, got {names}")
        return problems

    def _loss_problems(self) -> list[str]:
        problems, loss, negatives = [], self.loss, self.negative_column
        if not isinstance(negatives, list):
            return problems
        if loss in SCORED_LOSSES and self.score_column is None and self.dataset is None:
            problems.append(f"--loss {loss} trains on scored pairs: name the score column with --score-column")
        if loss not in SCORED_LOSSES and self.score_column is not None:
            problems.append(f"--score-column is read by --loss cosent or cosine only, not {loss}")
        if loss in SCORED_LOSSES and negatives:
            problems.append(f"--loss {loss} takes two text columns; drop --negative-column")
        if loss == "triplet" and len(negatives) != 1:
            problems.append("--loss triplet takes (anchor, positive, negative): give one --negative-column")
        if self.dataset is not None and loss not in PAIR_LOSSES:
            problems.append(f"--dataset {self.dataset} holds unscored pairs: use --loss mnrl or cached-mnrl")
        return problems
