"""Evaluation and prediction for the three problem types of transformers'
`BertForSequenceClassification` (`bert_port.problem.ProblemType`; the metrics themselves are
in `bert_port.metrics`).

Evaluation is split over the processes of a torchrun job (each takes every W-th example of
a length-sorted order; no padding, so every example counts once) and its counts summed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..data import TextDataset
from ..metrics import (
    DETAIL_MAX_CLASSES,
    MULTI_LABEL_THRESHOLD,
    WORST_CLASSES,
    metrics_from_counts,
    multi_label_metrics,
    regression_metrics,
)
from ..problem import ProblemType
from .batching import Collator, chunks, length_sorted
from .settings import _is_int, check_max_length
from .steps import Dist, autocast

__all__ = [
    "DETAIL_MAX_CLASSES",
    "HEADLINE",
    "MULTI_LABEL_THRESHOLD",
    "WORST_CLASSES",
    "evaluate",
    "metrics_from_counts",
    "multi_label_metrics",
    "predict",
    "regression_metrics",
]

# The metrics shown in logs, reports and plots, by problem type.
HEADLINE = {p.value: p.headline for p in ProblemType}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    collate: Collator,
    names: list[str],
    dist_info: Dist,
    batch_size: int,
    bf16: bool = False,
    desc: str = "eval",
    problem_type: str = ProblemType.SINGLE_LABEL,
    fp16: bool = False,
) -> dict[str, Any]:
    """The loss and the metrics of `problem_type` (see the module docstring) on
    `collate.dataset`, split over the processes."""
    was_training = model.training
    model.eval()
    device = dist_info.device
    order = length_sorted(collate.dataset)[dist_info.rank :: dist_info.world_size]
    problem = ProblemType(problem_type)
    accumulator = problem.accumulator(len(names), device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for indices in tqdm(
        list(chunks(order, batch_size)), desc=desc, leave=False, disable=not dist_info.is_main, dynamic_ncols=True
    ):
        batch = {k: v.to(device) for k, v in collate(indices).items()}
        with autocast(device, bf16=bf16, fp16=fp16):
            inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
            logits = model(**inputs).logits.float()
        loss_sum += problem.loss(logits, batch["labels"]).sum().double()
        accumulator.add(logits, batch["labels"])
    loss_sum = dist_info.sum(loss_sum)
    model.train(was_training)
    return accumulator.finish(float(loss_sum), names, dist_info)


@torch.no_grad()
def predict(
    model: nn.Module,
    tokenizer,
    dataset: TextDataset,
    batch_size: int = 64,
    max_length: int = 128,
    device: str | torch.device = "cpu",
    bf16: bool = False,
) -> Tensor:
    """Scores (N, num_labels) for every text of `dataset`, in its order: class
    probabilities (softmax) for single-label classification, per-label probabilities
    (sigmoid) for multi-label, the predicted values for regression."""
    if not _is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    check_max_length(max_length, model.config.max_position_embeddings, pairs=dataset.pairs is not None)
    device = torch.device(device)
    problem = ProblemType.of_config(model.config)
    model.eval()
    collate = Collator(tokenizer, dataset, max_length)
    scores = torch.full((len(dataset), model.config.num_labels), math.nan)  # NaN until written: a gap shows
    for indices in tqdm(list(chunks(length_sorted(dataset), batch_size)), desc="predict", dynamic_ncols=True):
        batch = {k: v.to(device) for k, v in collate(indices).items() if k != "index"}
        with autocast(device, bf16=bf16):
            logits = model(**batch).logits.float()
        scores[torch.tensor(indices)] = problem.scores(logits).cpu()
    return scores
