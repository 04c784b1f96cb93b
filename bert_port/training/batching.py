"""Batches of a `TextDataset` (or a word-tagged `TaggedDataset`) for training, evaluation and
prediction: the `Collator` (tokenised, padded inputs and their targets), the alignment of word
tags to word pieces, fixed-size chunks of indices, and a longest-first order for evaluation."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..data import TextDataset
from ..losses import IGNORE_INDEX
from ..tagged import TaggedDataset
from ..tokenization import BatchEncoding, encode


class Collator:
    """Turns a list of example indices into a model batch: `input_ids`, `token_type_ids`,
    `attention_mask` (B, T) padded to the longest example, `labels` (B,) or (B, K) when
    `targets` (every example's, from `ProblemType.targets`) are given, and `index` (B,),
    the example indices. A `TaggedDataset`'s words are encoded as given
    (`is_split_into_words`), and its labels (B, T) put on the word pieces (`align_labels`)."""

    def __init__(
        self,
        tokenizer,
        dataset: TextDataset | TaggedDataset,
        max_length: int,
        targets: torch.Tensor | list[torch.Tensor] | None = None,
    ):
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.max_length = max_length
        self.targets = targets

    def __call__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        if isinstance(self.dataset, TaggedDataset):
            words = [self.dataset.words[i] for i in indices]
            batch = encode(self.tokenizer, words, max_length=self.max_length, is_split_into_words=True)
            if self.targets is not None:
                batch["labels"] = align_labels(batch, [self.targets[i] for i in indices])
        else:
            texts = [self.dataset.texts[i] for i in indices]
            pairs = [self.dataset.pairs[i] for i in indices] if self.dataset.pairs is not None else None
            batch = encode(self.tokenizer, texts, pairs, max_length=self.max_length)
            if self.targets is not None:
                batch["labels"] = self.targets[list(indices)]
        batch["index"] = torch.tensor(list(indices), dtype=torch.long)
        return batch


def align_labels(batch: BatchEncoding, word_labels: Sequence[Sequence[int]]) -> torch.Tensor:
    """(B, T) long targets of a batch `encode`d with `is_split_into_words=True`: each word's
    tag id on its first word piece, -100 on its other pieces, the special tokens and the
    padding, as transformers' token-classification example (`tokenize_and_align_labels`,
    `label_all_tokens=False`). A word that truncation cut off gets no target."""
    labels = torch.full(batch["input_ids"].shape, IGNORE_INDEX, dtype=torch.long)
    for i, tags in enumerate(word_labels):
        previous = None
        for t, word in enumerate(batch.word_ids(i)):
            if word is not None and word != previous:
                labels[i, t] = int(tags[word])
            previous = word
    return labels


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
