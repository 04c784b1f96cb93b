"""The data of a fine-tuning run: the splits read (files, or a bundled dataset), the label
map built from training, and every other split's labels checked against it, each by the
run's `ProblemType`."""

from __future__ import annotations

from dataclasses import dataclass

from ..data import TextDataset, builtin_splits, load_texts, validation_split
from ..problem import ProblemType
from ..tagged import TaggedDataset, load_tagged
from .settings import FinetuneConfig, FinetuneError


@dataclass
class Splits:
    train: TextDataset | TaggedDataset
    validation: TextDataset | TaggedDataset
    test: TextDataset | TaggedDataset | None
    names: list[str]  # the label map: id -> name


def load_splits(cfg: FinetuneConfig) -> Splits:
    """Read the configured data, check the labels, and build the label map from training."""
    problem = ProblemType(cfg.problem_type)
    if problem is ProblemType.TOKEN_CLASSIFICATION and cfg.text_pair_column is not None:
        raise FinetuneError("--text-pair-column does not apply to token_classification, which tags one text's words")
    if cfg.dataset is not None:
        parts = builtin_splits(cfg.dataset)
        train, validation, test = parts["train"], parts["validation"], parts["test"]
    else:
        read = _reader(cfg, problem)
        train = read(cfg.train)
        if cfg.validation is not None:
            validation = read(cfg.validation)
        else:
            train, validation = validation_split(train, cfg.validation_split, cfg.seed)
        test = read(cfg.test) if cfg.test is not None else None
    if cfg.max_train_examples is not None:
        train = train.subset(range(min(cfg.max_train_examples, len(train))))
    names = problem.label_names(train, "score" if cfg.dataset else cfg.label_column)
    problem.check_label_map(names, train.source)
    problem.check_labels(validation, names, "validation")
    if test is not None:
        problem.check_labels(test, names, "test")
    return Splits(train, validation, test, names)


def _reader(cfg: FinetuneConfig, problem: ProblemType):
    """The reader of the run's files: word tags (CoNLL, JSONL) for token classification, else
    the configured columns of a CSV, TSV or JSONL file."""
    if problem is ProblemType.TOKEN_CLASSIFICATION:
        return load_tagged
    columns = dict(text_column=cfg.text_column, label_column=cfg.label_column, text_pair_column=cfg.text_pair_column)
    return lambda path: load_texts(path, **columns, label_kind=problem.label_kind)
