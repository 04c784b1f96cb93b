"""The problem types of the fine-tuning recipe, defined once: the three of transformers'
`BertForSequenceClassification`, and token classification (`BertForTokenClassification`, NER).

The training side of a problem type; its loss, which the heads need too, is in `losses` (the heads
import that module, never this one). `ProblemType` is a `str` enum whose values are transformers' strings, as they stand in
`config.json` and on the command line (`--problem-type`). `token_classification` is bert_port's
own: transformers' token classifier has no `problem_type`, so its `config.json` leaves it unset
and `of_config` tells it by its `architectures`. Each member owns everything that differs
between them:

  - its loss (`loss`: per example, (B,); `batch_loss`: transformers' mean for a batch; both `losses`);
  - how its labels are read (`label_kind`, the reader `bert_port.data.load_texts` applies;
    token classification reads word tags with `bert_port.tagged.load_tagged`),
    named (`label_names`), checked against training (`check_labels`) and turned into
    targets (`targets`);
  - its metrics (`metrics`, the first the default `--metric-for-best`; `headline`; the
    accumulator that computes them, from `bert_port.metrics`);
  - what a prediction holds (`scores`: softmax, sigmoid or the values; `output_columns`,
    `prediction`, `summary` for `bert-port-predict`);
  - the command-line choices (`ProblemType.choices()`) and their help (`help`).
"""

from __future__ import annotations

import enum
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from . import losses
from .data import LABEL_SEPARATOR, DataError, TextDataset, label_names, label_set
from .metrics import ClassCounts, MultiLabelCounts, Predictions, TagSequences
from .tagged import TaggedDataset, entity_types, tag_names


class ProblemType(str, enum.Enum):
    """One row per problem type: (config string, short name, help, label kind, loss name,
    metrics, accumulator). Compare members with the plain strings freely (`str` enum)."""

    REGRESSION = (
        losses.REGRESSION,
        "regression",
        "a number per text, MSE loss",
        "float",
        "MSE",
        ("pearson", "spearman", "loss"),
        Predictions,
    )
    SINGLE_LABEL = (
        losses.SINGLE_LABEL,
        "single-label",
        "one class per text",
        "class",
        "cross-entropy",
        ("accuracy", "macro_f1", "loss"),
        ClassCounts,
    )
    MULTI_LABEL = (
        losses.MULTI_LABEL,
        "multi-label",
        "a set of labels per text, sigmoid + BCE loss",
        "multi",
        "BCE",
        ("micro_f1", "macro_f1", "exact_match", "loss"),
        MultiLabelCounts,
    )
    TOKEN_CLASSIFICATION = (
        losses.TOKEN_CLASSIFICATION,
        "token",
        "a BIO tag per word (NER), cross-entropy on each word's first word piece",
        "tags",
        "cross-entropy",
        ("entity_f1", "token_accuracy", "entity_precision", "entity_recall", "loss"),
        TagSequences,
    )

    def __new__(cls, value: str, short: str, help: str, label_kind: str, loss_name: str, metrics, accumulator):
        member = str.__new__(cls, value)
        member._value_ = value
        member.short, member.help, member.label_kind, member.loss_name = short, help, label_kind, loss_name
        member.metrics, member.accumulator = metrics, accumulator
        return member

    def __str__(self) -> str:  # the config string, in messages and f-strings
        return self.value

    @classmethod
    def _missing_(cls, value: object):
        raise ValueError(f"unknown problem_type {value!r}; use one of {', '.join(cls.choices())}")

    # --- names -----------------------------------------------------------------------------

    @classmethod
    def choices(cls) -> tuple[str, ...]:
        """The strings `--problem-type` accepts."""
        return tuple(p.value for p in cls)

    @classmethod
    def of_config(cls, config) -> ProblemType:
        """A config's problem type: token classification by its architecture, else its
        `problem_type`, or transformers' guess from its number of outputs."""
        if any(str(a).endswith("ForTokenClassification") for a in config.extra.get("architectures") or ()):
            return cls.TOKEN_CLASSIFICATION
        if config.problem_type:
            return cls(config.problem_type)
        return cls.REGRESSION if config.num_labels == 1 else cls.SINGLE_LABEL

    @classmethod
    def infer(cls, num_labels: int, labels: Tensor) -> ProblemType:
        """transformers' guess when `config.problem_type` is unset (`losses.infer_problem_type`)."""
        return cls(losses.infer_problem_type(num_labels, labels))

    @property
    def headline(self) -> tuple[str, str]:
        """The two metrics shown in logs, reports and plots."""
        return self.metrics[0], self.metrics[1]

    # --- loss ------------------------------------------------------------------------------

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """The loss of each example, (B,) (`losses.per_example_loss`)."""
        return losses.per_example_loss(logits, labels, self.value)

    def batch_loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """transformers' loss of a batch, a 0-d tensor (`losses.batch_loss`)."""
        return losses.batch_loss(logits, labels, self.value)

    # --- labels ----------------------------------------------------------------------------

    def label_names(self, dataset: TextDataset, label_column: str) -> list[str]:
        """The label map, id -> name: the classes (single-label), the union of the label sets
        (multi-label), or the one output, named after the label column (regression), or the
        tags (token classification, `tagged.tag_names`)."""
        if self is ProblemType.REGRESSION:
            return [label_column]
        if self is ProblemType.TOKEN_CLASSIFICATION:
            return tag_names(tag for tags in dataset.labels for tag in tags)
        if self is ProblemType.MULTI_LABEL:
            return label_names([name for label in dataset.labels for name in label_set(label)])
        return label_names(dataset.labels)

    def _members(self, label: str | list[str]) -> list[str]:
        if self is ProblemType.TOKEN_CLASSIFICATION:
            return label  # a sentence's tags
        return label_set(label) if self is ProblemType.MULTI_LABEL else [label]

    def check_labels(self, dataset: TextDataset | TaggedDataset, names: Sequence[str], split: str) -> None:
        """Every label of `dataset` must be one the model was trained on (regression: any number)."""
        if self is ProblemType.REGRESSION:
            return
        known = set(names)
        unseen = Counter(name for label in dataset.labels for name in self._members(label) if name not in known)
        if unseen:
            first = {
                name: next(r for r, lab in zip(dataset.rows, dataset.labels) if name in self._members(lab))
                for name in unseen
            }
            tagged = isinstance(dataset, TaggedDataset)
            unit, where = ("word(s)", "in the sentence at line") if tagged else ("row(s)", "at line")
            listed = ", ".join(
                f"{label!r} ({n} {unit}, first {where} {first[label]})" for label, n in unseen.most_common()
            )
            raise DataError(
                f"{dataset.source}: the {split} data has label(s) never seen in training: {listed}. Training labels "
                f"are {list(names)}. Correct those labels, or add training examples of them"
            )

    def check_label_map(self, names: Sequence[str], source: str) -> None:
        """The training labels must make a model: two classes at least (single-label), one
        label at least (multi-label), one entity tag at least (token classification)."""
        if self is ProblemType.TOKEN_CLASSIFICATION and not entity_types(names):
            raise DataError(
                f"{source}: every training word is tagged {names[0]!r}; a tagger needs words tagged B-TYPE "
                "(and I-TYPE) to learn from"
            )
        if self is ProblemType.SINGLE_LABEL and len(names) < 2:
            raise DataError(
                f"{source}: every training example has the label {names[0]!r}; a classifier needs "
                "examples of at least two labels"
            )
        if not names:
            raise DataError(f"{source}: no training example has any label; a multi-label classifier needs some")

    def targets(self, dataset: TextDataset | TaggedDataset, names: Sequence[str]) -> Tensor | list[Tensor]:
        """The training targets of every example, as transformers' losses take them: class
        ids (N,) long; values (N,) float (regression); multi-hot (N, K) float (multi-label);
        for token classification, each sentence's tag ids per word (n_words,) long, which the
        collator puts on word pieces (`training.batching.align_labels`)."""
        if self is ProblemType.TOKEN_CLASSIFICATION:
            index = {name: i for i, name in enumerate(names)}
            return [torch.tensor([index[tag] for tag in tags], dtype=torch.long) for tags in dataset.labels]
        if self is ProblemType.REGRESSION:
            return torch.tensor([float(label) for label in dataset.labels], dtype=torch.float32)
        index = {name: i for i, name in enumerate(names)}
        if self is ProblemType.MULTI_LABEL:
            hot = torch.zeros(len(dataset), len(names), dtype=torch.float32)
            for row, label in enumerate(dataset.labels):
                hot[row, [index[name] for name in label_set(label)]] = 1.0
            return hot
        return torch.tensor([index[label] for label in dataset.labels], dtype=torch.long)

    # --- predictions -----------------------------------------------------------------------

    def scores(self, logits: Tensor) -> Tensor:
        """What a prediction reports, (N, K): class probabilities (softmax), per-label
        probabilities (sigmoid), or the predicted values (regression); (..., K) tag
        probabilities per word piece (softmax) for token classification."""
        if self in (ProblemType.SINGLE_LABEL, ProblemType.TOKEN_CLASSIFICATION):
            return logits.softmax(-1)
        if self is ProblemType.MULTI_LABEL:
            return logits.sigmoid()
        return logits

    def output_columns(self, names: Sequence[str]) -> list[str]:
        """The columns a prediction adds (CSV/TSV and JSONL alike, so either clash is refused)."""
        if self is ProblemType.TOKEN_CLASSIFICATION:
            return ["entities"]
        if self is ProblemType.REGRESSION:
            return ["predicted_value"] if len(names) == 1 else [f"predicted_{n}" for n in names]
        head = "predicted_labels" if self is ProblemType.MULTI_LABEL else "predicted_label"
        return [head, "probabilities"] + [f"prob_{n}" for n in names]

    def prediction(self, names: Sequence[str], scores: list[float], threshold: float) -> dict[str, Any]:
        """One row's prediction as JSON: the value(s), or the label(s) and each probability
        (multi-label: the labels whose probability is at least `threshold`)."""
        if self is ProblemType.REGRESSION:
            return dict(zip(self.output_columns(names), scores))
        probabilities = dict(zip(names, scores))
        if self is ProblemType.MULTI_LABEL:
            return {
                "predicted_labels": [n for n, p in probabilities.items() if p >= threshold],
                "probabilities": probabilities,
            }
        best = max(range(len(scores)), key=scores.__getitem__)
        return {"predicted_label": names[best], "probabilities": probabilities}

    def summary(self, names: Sequence[str], rows: list[dict[str, Any]]) -> str:
        """One line on a file of predictions: the range of values, or the count per label
        (token classification: of the entities found, by type)."""
        if self is ProblemType.TOKEN_CLASSIFICATION:
            found = Counter(e.get("entity_group", e.get("entity")) for r in rows for e in r["entities"])
            listed = ", ".join(f"{kind}: {n}" for kind, n in sorted(found.items()))
            return f"{sum(found.values())} entities" + (f" ({listed})" if listed else "")
        if self is ProblemType.REGRESSION:
            key = next(iter(rows[0])) if rows else "predicted_value"
            values = [r[key] for r in rows]
            return f"{key} from {min(values, default=0):.4g} to {max(values, default=0):.4g}"
        key = self.output_columns(names)[0]
        counts = {n: sum(n in r[key] if isinstance(r[key], list) else n == r[key] for r in rows) for n in names}
        return ", ".join(f"{n}: {c}" for n, c in counts.items())


def flat_prediction(prediction: Mapping[str, Any]) -> dict[str, Any]:
    """A prediction as CSV/TSV columns: `prob_<label>` columns, label lists joined by "|",
    entities as JSON."""
    flat = {k: v for k, v in prediction.items() if k != "probabilities"}
    if "predicted_labels" in flat:
        flat["predicted_labels"] = LABEL_SEPARATOR.join(flat["predicted_labels"])
    if "entities" in flat:  # a token classifier's: a JSON list in one cell
        flat["entities"] = json.dumps(flat["entities"], ensure_ascii=False)
    flat.update({f"prob_{n}": p for n, p in prediction.get("probabilities", {}).items()})
    return flat


def config_label_names(config, where: str) -> list[str]:
    """The label names of a classifier config, id 0 first. Two ids with one name would give
    one probability column for both, so they are refused (`DataError`), saying what to fix."""
    names = [str(config.id2label[i]) for i in range(config.num_labels)]
    repeated = {name: [i for i, n in enumerate(names) if n == name] for name, k in Counter(names).items() if k > 1}
    if repeated:
        listed = "; ".join(f"{name!r} for ids {', '.join(map(str, ids))}" for name, ids in repeated.items())
        raise DataError(
            f"{where}: id2label gives one name to several labels ({listed}), so their predictions could not be "
            "told apart; give every id its own name in id2label (and label2id) of config.json"
        )
    return names
