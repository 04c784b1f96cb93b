"""The losses of the task heads, one per problem type, as transformers computes them: what the
heads and the training step need of a problem type, without its labels, metrics and prediction
columns (`problem.ProblemType`, the training side, names the same four types and calls these).

Problem types are transformers' strings, as in `config.json`; `token_classification` is
bert_port's own (transformers' token classifier has no `problem_type`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100  # cross_entropy's default: a label to leave out of the loss

REGRESSION = "regression"
SINGLE_LABEL = "single_label_classification"
MULTI_LABEL = "multi_label_classification"
TOKEN_CLASSIFICATION = "token_classification"
PROBLEM_TYPES = (REGRESSION, SINGLE_LABEL, MULTI_LABEL, TOKEN_CLASSIFICATION)


def check_problem_type(problem_type: str) -> str:
    """`problem_type`, or a one-line `ValueError` naming the choices."""
    if problem_type not in PROBLEM_TYPES:
        raise ValueError(f"unknown problem_type {problem_type!r}; use one of {', '.join(PROBLEM_TYPES)}")
    return problem_type


def infer_problem_type(num_labels: int, labels: Tensor) -> str:
    """transformers' rule when `config.problem_type` is unset: one output is regression,
    integer labels are single-label classification, anything else (float multi-hot) is
    multi-label."""
    if num_labels == 1:
        return REGRESSION
    if labels.dtype in (torch.long, torch.int):
        return SINGLE_LABEL
    return MULTI_LABEL


def per_example_loss(logits: Tensor, labels: Tensor, problem_type: str) -> Tensor:
    """The loss of each example, (B,), such that its mean is transformers' loss for the batch:
    MSE (averaged over outputs), cross-entropy, or BCE-with-logits (averaged over labels). The
    training loop sums these over a global batch, so that gradient accumulation and several
    processes give the same gradient as one large batch.

    Token classification: logits (B, T, K), labels (B, T) with -100 on the positions that carry
    no tag; each sentence's loss is its mean cross-entropy over its tagged positions, so every
    sentence weighs the same in a step whatever its length, and the gradient does not depend on
    how the global batch is split (transformers' mean over a batch's tokens does)."""
    problem_type = check_problem_type(problem_type)
    if problem_type == TOKEN_CLASSIFICATION:
        per_token = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
        ).view(labels.shape)  # (B, T), 0 where ignored
        return per_token.sum(-1) / (labels != IGNORE_INDEX).sum(-1).clamp(min=1)
    if problem_type == REGRESSION:
        if logits.shape[-1] == 1:  # HF squeezes a single output
            return F.mse_loss(logits.squeeze(-1), labels.reshape(-1).to(logits.dtype), reduction="none")
        return F.mse_loss(logits, labels.to(logits.dtype), reduction="none").mean(-1)
    if problem_type == SINGLE_LABEL:
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), reduction="none")
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none").mean(-1)


def batch_loss(logits: Tensor, labels: Tensor, problem_type: str) -> Tensor:
    """transformers' loss of a batch, a 0-d tensor: the mean of `per_example_loss`, except that
    single-label rows labelled -100 count neither in the sum nor the mean, and token
    classification takes the mean over every tagged position of the batch."""
    if check_problem_type(problem_type) == TOKEN_CLASSIFICATION:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    per_example = per_example_loss(logits, labels, problem_type)
    if problem_type == SINGLE_LABEL:
        return per_example.sum() / (labels.view(-1) != IGNORE_INDEX).sum()
    return per_example.mean()
