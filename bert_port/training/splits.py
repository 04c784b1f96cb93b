"""The data of a fine-tuning run: the splits read (files, or a bundled dataset), the label
map built from training, and every other split's labels checked against it, each by the
run's `ProblemType`."""

from __future__ import annotations

from dataclasses import dataclass

from ..data import TextDataset, builtin_splits, load_texts, validation_split
from ..problem import ProblemType
from .settings import FinetuneConfig


@dataclass
class Splits:
    train: TextDataset
    validation: TextDataset
    test: TextDataset | None
    names: list[str]  # the label map: id -> name


def load_splits(cfg: FinetuneConfig) -> Splits:
    """Read the configured data, check the labels, and build the label map from training."""
    problem = ProblemType(cfg.problem_type)
    if cfg.dataset is not None:
        parts = builtin_splits(cfg.dataset)
        train, validation, test = parts["train"], parts["validation"], parts["test"]
    else:
        read = dict(
            text_column=cfg.text_column,
            label_column=cfg.label_column,
            text_pair_column=cfg.text_pair_column,
            label_kind=problem.label_kind,
        )
        train = load_texts(cfg.train, **read)
        if cfg.validation is not None:
            validation = load_texts(cfg.validation, **read)
        else:
            train, validation = validation_split(train, cfg.validation_split, cfg.seed)
        test = load_texts(cfg.test, **read) if cfg.test is not None else None
    if cfg.max_train_examples is not None:
        train = train.subset(range(min(cfg.max_train_examples, len(train))))
    names = problem.label_names(train, "score" if cfg.dataset else cfg.label_column)
    problem.check_label_map(names, train.source)
    problem.check_labels(validation, names, "validation")
    if test is not None:
        problem.check_labels(test, names, "test")
    return Splits(train, validation, test, names)
