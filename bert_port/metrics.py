"""The validation metrics of each problem type, from counts that add up across batches and
processes (so memory stays O(labels), never O(examples x labels) except for regression and
token classification, whose metrics need every prediction):

  - single-label classification: accuracy, macro-F1, per-class precision / recall / F1 and
    the confusion matrix (`metrics_from_counts`, accumulated by `ClassCounts`);
  - regression: Pearson and Spearman correlation of the predictions with the targets
    (`regression_metrics`, from every prediction: `Predictions`);
  - multi-label classification: a label is predicted when its sigmoid is >= 0.5 (logit >= 0);
    micro-F1, macro-F1, exact match (every label of the example right) and per-class figures
    (`multi_label_metrics`, accumulated by `MultiLabelCounts`);
  - token classification: entity-level precision / recall / F1 and token accuracy, by seqeval
    (`tagging_metrics`, from every sentence's tags: `TagSequences`).

`bert_port.problem.ProblemType` picks the accumulator of a problem type. An accumulator's
`finish(loss_sum, names, reduce)` sums its counts over processes with `reduce.sum` and
`reduce.gather` (`training.steps.Dist`, or anything with those two methods).
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import torch
from torch import Tensor


class Reduce(Protocol):
    """Sums and gathers across the processes of a job (one process: the identity)."""

    def sum(self, tensor: Tensor) -> Tensor: ...

    def gather(self, obj: Any) -> list[Any]: ...


MULTI_LABEL_THRESHOLD = 0.5  # on the sigmoid: transformers' pipelines and the Trainer examples use it too


# Per-class figures and the confusion matrix are stored only up to this many labels; above
# it an evaluation keeps a fixed-size summary, so metrics.json and the training state stay
# bounded however many classes there are (a K x K float64 confusion matrix is 8 K^2 bytes).
DETAIL_MAX_CLASSES = 50
WORST_CLASSES = 10  # listed in the summary of a many-class evaluation


class MetricError(ValueError):
    """A metric asked of nothing: over zero examples (or zero scored tokens) it is undefined,
    never 0 or 1."""


def require_items(count: float, what: str, metric: str) -> None:
    """Refuse a metric over zero `what` (examples, tagged words, target tokens)."""
    if count <= 0:
        raise MetricError(
            f"cannot compute {metric} over zero {what}: the split evaluated has none; give it data that has "
            f"{what}, or leave the split out"
        )


def _f1(tp: Tensor, predicted: Tensor, actual: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    precision = torch.where(predicted > 0, tp / predicted.clamp(min=1), torch.zeros_like(tp))
    recall = torch.where(actual > 0, tp / actual.clamp(min=1), torch.zeros_like(tp))
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp(min=1e-300), 0.0)
    return precision, recall, f1


def metrics_from_counts(
    tp: Tensor, predicted: Tensor, actual: Tensor, loss_sum: float, names: list[str], confusion: Tensor | None = None
) -> dict[str, Any]:
    """Accuracy, macro-F1 and per-class precision/recall/F1 from per-class counts (K,):
    true positives, predictions and true labels. Macro-F1 averages over the classes that
    occur as a true label or a prediction (scikit-learn's default). Up to
    `DETAIL_MAX_CLASSES` classes the result holds `per_class` and the `confusion` matrix
    (rows: true label, columns: prediction) if given; above it `per_class_summary`."""
    tp, predicted, actual = (x.double().cpu() for x in (tp, predicted, actual))
    total = float(actual.sum())
    require_items(total, "examples", "accuracy")
    precision, recall, f1 = _f1(tp, predicted, actual)
    present = (predicted + actual) > 0
    result: dict[str, Any] = {
        "loss": loss_sum / total,
        "accuracy": float(tp.sum()) / total,
        "macro_f1": float(f1[present].mean()) if bool(present.any()) else 0.0,
        "n": int(total),
    }
    if len(names) <= DETAIL_MAX_CLASSES:
        result["per_class"] = _per_class(names, precision, recall, f1, actual)
        if confusion is not None:
            result["confusion"] = confusion.long().cpu().tolist()
    else:
        supported = (actual > 0).nonzero().flatten()
        worst = supported[f1[supported].argsort(stable=True)[:WORST_CLASSES]].tolist()
        q = (
            f1[present].quantile(torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=f1.dtype)).tolist()
            if bool(present.any())
            else [0.0] * 5
        )
        result["per_class_summary"] = {
            "classes": len(names),
            "classes_present": int(present.sum()),
            "f1_quantiles": dict(zip(("min", "p25", "median", "p75", "max"), q)),
            "worst_f1": [{"label": names[i], "f1": float(f1[i]), "support": int(actual[i])} for i in worst],
        }
    return result


def _per_class(names: list[str], precision: Tensor, recall: Tensor, f1: Tensor, actual: Tensor) -> dict:
    """Each label's precision, recall, F1 and support (its number of target examples)."""
    return {
        name: {"precision": float(p), "recall": float(r), "f1": float(f), "support": int(n)}
        for name, p, r, f, n in zip(names, precision, recall, f1, actual)
    }


def multi_label_metrics(
    tp: Tensor, predicted: Tensor, actual: Tensor, exact: float, n: int, loss_sum: float, names: list[str]
) -> dict[str, Any]:
    """Micro-F1 (over every example-label decision), macro-F1 (mean over the labels that
    occur as a target or a prediction, as for single-label), exact match, and per-label
    figures up to `DETAIL_MAX_CLASSES` labels. `loss_sum` is summed per-example BCE."""
    require_items(n, "examples", "micro-F1")
    tp, predicted, actual = (x.double().cpu() for x in (tp, predicted, actual))
    precision, recall, f1 = _f1(tp, predicted, actual)
    present = (predicted + actual) > 0
    denominator = float(predicted.sum() + actual.sum())
    result: dict[str, Any] = {
        "loss": loss_sum / n,
        "micro_f1": 2 * float(tp.sum()) / denominator if denominator else 0.0,
        "macro_f1": float(f1[present].mean()) if bool(present.any()) else 0.0,
        "exact_match": exact / n,
        "n": n,
    }
    if len(names) <= DETAIL_MAX_CLASSES:
        result["per_class"] = _per_class(names, precision, recall, f1, actual)
    return result


def _ranks(x: Tensor) -> Tensor:
    """0-based ranks, ties given their average rank (as scipy.stats.rankdata)."""
    order = x.argsort(stable=True)
    _, inverse, counts = torch.unique_consecutive(x[order], return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    ranks = torch.empty(len(x), dtype=torch.float64)
    ranks[order] = ((2 * ends - counts - 1) / 2)[inverse]
    return ranks


def pearson(a: Tensor, b: Tensor) -> float:
    """Pearson's r; 0.0 when either side is constant (r is undefined there, and 0 keeps a
    run that predicts one value from being chosen as the best)."""
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    denominator = float(a.norm() * b.norm())
    return float((a * b).sum()) / denominator if denominator > 0 else 0.0


def regression_metrics(predictions: Tensor, targets: Tensor, loss_sum: float) -> dict[str, Any]:
    """Pearson and Spearman correlation (Pearson of the ranks) over all examples."""
    n = len(targets)
    require_items(n, "examples", "Pearson and Spearman correlation")
    return {
        "loss": loss_sum / n,
        "pearson": pearson(predictions, targets),
        "spearman": pearson(_ranks(predictions), _ranks(targets)),
        "n": n,
    }


class ClassCounts:
    """Single-label: per-class counts (true positives, predictions, labels), and the
    confusion matrix when the classes are few enough to store it: memory O(K) otherwise."""

    def __init__(self, k: int, device: torch.device):
        self.k = k
        self.counts = torch.zeros(3, k, dtype=torch.float64, device=device)
        self.confusion = torch.zeros(k * k if k <= DETAIL_MAX_CLASSES else 0, dtype=torch.float64, device=device)

    def add(self, logits: Tensor, labels: Tensor) -> None:
        guess, k = logits.argmax(-1), self.k
        self.counts[0] += torch.bincount(labels[labels == guess], minlength=k).double()
        self.counts[1] += torch.bincount(guess, minlength=k).double()
        self.counts[2] += torch.bincount(labels, minlength=k).double()
        if self.confusion.numel():
            self.confusion += torch.bincount(labels * k + guess, minlength=k * k).double()

    def finish(self, loss_sum: float, names: list[str], d: Reduce) -> dict[str, Any]:
        counts, confusion = d.sum(self.counts), d.sum(self.confusion)
        matrix = confusion.view(self.k, self.k) if confusion.numel() else None
        return metrics_from_counts(*counts, loss_sum, names, matrix)


class MultiLabelCounts:
    """Multi-label: per-label counts (true positives, predictions, targets) and exact matches."""

    def __init__(self, k: int, device: torch.device):
        self.counts = torch.zeros(3, k, dtype=torch.float64, device=device)
        self.exact = torch.zeros(2, dtype=torch.float64, device=device)  # exact matches, examples

    def add(self, logits: Tensor, labels: Tensor) -> None:
        guess, truth = logits >= 0, labels > 0.5  # sigmoid >= MULTI_LABEL_THRESHOLD
        self.counts[0] += (guess & truth).sum(0).double()
        self.counts[1] += guess.sum(0).double()
        self.counts[2] += truth.sum(0).double()
        self.exact += torch.stack([(guess == truth).all(-1).sum(), torch.tensor(len(labels))]).double()

    def finish(self, loss_sum: float, names: list[str], d: Reduce) -> dict[str, Any]:
        counts, exact = d.sum(self.counts), d.sum(self.exact)
        return multi_label_metrics(*counts, float(exact[0]), int(exact[1]), loss_sum, names)


class Predictions:
    """Regression: every prediction and target, since rank correlation needs them all."""

    def __init__(self, k: int, device: torch.device):
        self.predictions: list[Tensor] = []
        self.targets: list[Tensor] = []

    def add(self, logits: Tensor, labels: Tensor) -> None:
        self.predictions.append(logits.reshape(-1).cpu())
        self.targets.append(labels.reshape(-1).float().cpu())

    def finish(self, loss_sum: float, names: list[str], d: Reduce) -> dict[str, Any]:
        gathered = d.gather((torch.cat(self.predictions).tolist(), torch.cat(self.targets).tolist()))
        predictions = torch.tensor([x for p, _ in gathered for x in p], dtype=torch.float64)
        targets = torch.tensor([x for _, t in gathered for x in t], dtype=torch.float64)
        return regression_metrics(predictions, targets, loss_sum)


def tagging_metrics(true: list[list[str]], predicted: list[list[str]], loss_sum: float) -> dict[str, Any]:
    """Entity-level precision, recall and F1 (micro over entities, and per type) and token
    accuracy, as seqeval computes them in its default (conlleval) mode, which is what
    transformers' token-classification example reports (`evaluate`'s seqeval metric):
    `true` and `predicted` hold each sentence's tags at its tagged positions. Per-type
    figures are kept up to `DETAIL_MAX_CLASSES` types."""
    from .extras import require

    require("seqeval", "the entity-level metrics of token classification")
    from seqeval.metrics import accuracy_score, classification_report

    n, words = len(true), sum(map(len, true))
    require_items(words, "tagged words", "entity F1")
    with warnings.catch_warnings():  # its macro average of no entity type is NaN with a warning; dropped below
        warnings.simplefilter("ignore", RuntimeWarning)
        report = classification_report(true, predicted, output_dict=True, zero_division=0) if words else {}
    micro = report.get("micro avg", {"precision": 0.0, "recall": 0.0, "f1-score": 0.0, "support": 0})
    types = {k: v for k, v in report.items() if not k.endswith(" avg")}
    result: dict[str, Any] = {
        "loss": loss_sum / n,
        "entity_f1": float(micro["f1-score"]),
        "token_accuracy": float(accuracy_score(true, predicted)) if words else 0.0,
        "entity_precision": float(micro["precision"]),
        "entity_recall": float(micro["recall"]),
        "n": n,
        "entities": int(micro["support"]),
    }
    if len(types) <= DETAIL_MAX_CLASSES:
        result["per_type"] = {
            name: {key: float(v[key]) for key in ("precision", "recall")}
            | {"f1": float(v["f1-score"]), "support": int(v["support"])}
            for name, v in sorted(types.items())
        }
    return result


class TagSequences:
    """Token classification: each sentence's true and predicted tag ids at its tagged positions
    (labels >= 0: -100 marks word pieces that carry no word's tag), since entity-level scores
    need whole sequences; memory O(words). The tags of every process are gathered, then scored."""

    def __init__(self, k: int, device: torch.device):
        self.true: list[list[int]] = []
        self.predicted: list[list[int]] = []

    def add(self, logits: Tensor, labels: Tensor) -> None:
        guess, labels = logits.argmax(-1).cpu(), labels.cpu()  # (B, T)
        for g, y in zip(guess, labels):
            keep = y >= 0
            self.true.append(y[keep].tolist())
            self.predicted.append(g[keep].tolist())

    def finish(self, loss_sum: float, names: list[str], d: Reduce) -> dict[str, Any]:
        gathered = d.gather((self.true, self.predicted))
        true = [[names[i] for i in s] for t, _ in gathered for s in t]
        predicted = [[names[i] for i in s] for _, p in gathered for s in p]
        return tagging_metrics(true, predicted, loss_sum)
