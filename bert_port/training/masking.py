"""Masked-LM masking, as transformers' `DataCollatorForLanguageModeling` draws it, and the
seeds that make every block's masks a function of the run's seed, the epoch and the block.

`mask_tokens` is `DataCollatorForLanguageModeling.torch_mask_tokens` (transformers 5), draw
for draw: given a `torch.Generator` in the same state it returns the same inputs and labels.
Each token that is not special is chosen with probability `probability` (15%); labels are
the chosen tokens' ids and -100 elsewhere; of the chosen, 80% become [MASK], 10% a token
drawn uniformly from the vocabulary, 10% stay as they are. Special tokens are those the
collator finds when given no `special_tokens_mask`: every id of the tokenizer's special
tokens ([PAD], [UNK], [CLS], [SEP], [MASK]); run_mlm.py's own mask marks only the [CLS] and
[SEP] it added, so it would mask an [UNK] of the text, which we do not.

Whole-word masking (`whole_word=True`) is the collator's `whole_word_mask=True`: a word
starts at a token that is not special and either does not touch the previous token's end
(character offsets: a gap) or follows a special token, so a ## continuation piece, and a
piece written against its word ("don" "'" "t"), belong to the word before. Only a word's
first token is drawn, with `probability`; a drawn word is masked whole, every token of it
[MASK] (transformers then turns random replacement off, and so do we).

Seeds. A block's masks come from a generator of its own, seeded by `block_seed(seed,
stream, epoch, index)`: the same in every process, accumulation and resumed run, and
independent of the model, so the port and transformers' twin see the same masks. Training
draws new masks every epoch, as the collator would; validation (`stream` "validation",
epoch 0) keeps one set for the whole run, so evaluations compare.

Shapes: B blocks, T tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from ..losses import IGNORE_INDEX

MLM_PROBABILITY = 0.15  # transformers' default, BERT's rate
MASK_REPLACE_PROB = 0.8  # of the chosen tokens: [MASK]
RANDOM_REPLACE_PROB = 0.1  # a random token; the rest (10%) stay as they are


def block_seed(seed: int, stream: str, epoch: int, index: int) -> int:
    """A 64-bit seed for block `index` of `stream` ("train", "validation") in `epoch`: a hash,
    so that nearby blocks' generators are unrelated."""
    digest = hashlib.blake2b(f"{seed}/{stream}/{epoch}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def word_ids(offsets: Tensor, special: Tensor) -> tuple[Tensor, Tensor]:
    """(word id of each token, -1 for special tokens; whether a token starts a word), both
    (B, T), from the tokens' character `offsets` (B, T, 2): the collator's
    `_calc_word_ids_and_prob_mask`."""
    starts, ends = offsets[..., 0], offsets[..., 1]
    previous_end = ends.roll(1, dims=1)
    previous_end[:, 0] = -1  # the first token has none before it
    previous_special = special.roll(1, dims=1)
    previous_special[:, 0] = False
    starts_word = ~special & ((starts != previous_end) | previous_special)
    ids = starts_word.long().cumsum(1).masked_fill(special, -1)
    return ids, starts_word


def _whole_words(ids: Tensor, chosen: Tensor) -> Tensor:
    """Every token of a word any of whose tokens is chosen: (B, T) bool."""
    valid = ids >= 0
    same_word = (ids[:, :, None] == ids[:, None, :]) & valid[:, :, None] & valid[:, None, :]  # (B, T, T)
    return (same_word & chosen[:, None, :]).any(-1)


@dataclass(frozen=True)
class Masking:
    """The masking of one run: the tokenizer's [MASK] id, its size (random tokens are drawn
    from [0, vocab_size)) and special ids, the rate, and whole words or single tokens."""

    mask_id: int
    vocab_size: int
    special_ids: tuple[int, ...]
    probability: float = MLM_PROBABILITY
    whole_word: bool = False

    def special(self, input_ids: Tensor) -> Tensor:
        """(B, T) bool: the tokens never masked."""
        return torch.isin(input_ids, torch.tensor(self.special_ids, dtype=input_ids.dtype))

    def __call__(
        self, input_ids: Tensor, generator: torch.Generator, offsets: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(masked inputs, labels), both (B, T), from `input_ids` (B, T), left unchanged;
        `offsets` (B, T, 2) are needed for whole words."""
        return mask_tokens(input_ids, self.special(input_ids), generator, self, offsets)


def mask_tokens(
    input_ids: Tensor, special: Tensor, generator: torch.Generator, masking: Masking, offsets: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """`DataCollatorForLanguageModeling.torch_mask_tokens`, draw for draw (see the module
    docstring): (masked inputs, labels), (B, T) each."""
    inputs, labels = input_ids.clone(), input_ids.clone()
    probabilities = torch.full(labels.shape, masking.probability)
    if masking.whole_word:
        if offsets is None:
            raise ValueError("whole-word masking needs the tokens' character offsets")
        ids, starts_word = word_ids(offsets, special)
        probabilities.masked_fill_(~starts_word, 0.0)  # only a word's first token is drawn
    else:
        probabilities.masked_fill_(special, 0.0)
    chosen = torch.bernoulli(probabilities, generator=generator).bool()
    if masking.whole_word:
        chosen = _whole_words(ids, chosen)
    labels[~chosen] = IGNORE_INDEX
    replace = MASK_REPLACE_PROB if not masking.whole_word else 1.0
    replaced = torch.bernoulli(torch.full(labels.shape, replace), generator=generator).bool() & chosen
    inputs[replaced] = masking.mask_id
    if masking.whole_word:
        return inputs, labels
    # Half of what is left (0.1 of the chosen tokens) becomes a random token.
    random_share = RANDOM_REPLACE_PROB / (1 - MASK_REPLACE_PROB)
    randomised = (
        torch.bernoulli(torch.full(labels.shape, random_share), generator=generator).bool() & chosen & ~replaced
    )
    words = torch.randint(masking.vocab_size, labels.shape, dtype=torch.long, generator=generator)
    inputs[randomised] = words[randomised]
    return inputs, labels
