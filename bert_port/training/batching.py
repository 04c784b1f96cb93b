"""Batches of a `TextDataset` for training, evaluation and prediction: the `Collator`
(tokenised, padded inputs and their targets), fixed-size chunks of indices, and a
longest-first order for evaluation."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..data import TextDataset
from ..tokenization import encode


class Collator:
    """Turns a list of example indices into a model batch: `input_ids`, `token_type_ids`,
    `attention_mask` (B, T) padded to the longest example, `labels` (B,) or (B, K) when
    `targets` (every example's, from `ProblemType.targets`) are given, and `index` (B,),
    the example indices."""

    def __init__(self, tokenizer, dataset: TextDataset, max_length: int, targets: torch.Tensor | None = None):
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.max_length = max_length
        self.targets = targets

    def __call__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        texts = [self.dataset.texts[i] for i in indices]
        pairs = [self.dataset.pairs[i] for i in indices] if self.dataset.pairs is not None else None
        batch = encode(self.tokenizer, texts, pairs, max_length=self.max_length)
        if self.targets is not None:
            batch["labels"] = self.targets[list(indices)]
        batch["index"] = torch.tensor(list(indices), dtype=torch.long)
        return batch


def chunks(indices: Sequence[int], size: int) -> Iterator[list[int]]:
    indices = list(indices)
    for start in range(0, len(indices), size):
        yield indices[start : start + size]


def length_sorted(dataset: TextDataset) -> list[int]:
    """Example indices from longest to shortest text (characters): evaluation batches of
    similar lengths waste less time on padding, and the longest batch comes first so an
    out-of-memory error shows at once."""
    pairs = dataset.pairs or [""] * len(dataset)
    return sorted(range(len(dataset)), key=lambda i: len(dataset.texts[i]) + len(pairs[i]), reverse=True)
