"""Evaluation and prediction for the problem types of `bert_port.problem.ProblemType` (the
metrics themselves are in `bert_port.metrics`): `predict` for a sequence classifier,
`predict_tokens` for a token classifier (the pieces `bert_port.entities` makes entities of).

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
from ..entities import ScoredTokens, scored_tokens
from ..metrics import (
    DETAIL_MAX_CLASSES,
    MULTI_LABEL_THRESHOLD,
    WORST_CLASSES,
    metrics_from_counts,
    multi_label_metrics,
    regression_metrics,
)
from ..problem import ProblemType
from ..tokenization import encode
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
    "predict_tokens",
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
    check_max_length(max_length, model.config.max_sequence_length, pairs=dataset.pairs is not None)
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


@torch.no_grad()
def predict_tokens(
    model: nn.Module,
    tokenizer,
    inputs: list[str | list[str]],
    batch_size: int = 64,
    max_length: int = 512,
    device: str | torch.device = "cpu",
    bf16: bool = False,
) -> list[ScoredTokens]:
    """Each input's word pieces with their tag probabilities (softmax), in input order: a
    string is tokenized as a text, a list of strings as its words (`is_split_into_words`)."""
    if not _is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    check_max_length(max_length, model.config.max_sequence_length)
    device = torch.device(device)
    model.eval()
    out: list[ScoredTokens | None] = [None] * len(inputs)
    split = [i for i, x in enumerate(inputs) if not isinstance(x, str)]
    texts = [i for i, x in enumerate(inputs) if isinstance(x, str)]
    length = lambda i: len(inputs[i]) if isinstance(inputs[i], str) else sum(map(len, inputs[i])) + len(inputs[i])
    for group, words in ((texts, False), (split, True)):
        order = sorted(group, key=length, reverse=True)  # longest first, as `length_sorted`
        for indices in tqdm(list(chunks(order, batch_size)), desc="predict", dynamic_ncols=True):
            batch = encode(tokenizer, [inputs[i] for i in indices], max_length=max_length, is_split_into_words=words)
            with autocast(device, bf16=bf16):
                logits = model(**{k: v.to(device) for k, v in batch.items()}).logits.float()
            probabilities = ProblemType.TOKEN_CLASSIFICATION.scores(logits).cpu()  # (B, T, K)
            for row, i in enumerate(indices):
                out[i] = scored_tokens(tokenizer, batch.encodings[row], probabilities[row], inputs[i])
    return out
