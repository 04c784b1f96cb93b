"""No training from nothing: a run's data, once tokenized, must give a training signal.

A tokenizer that maps every word of a corpus to `[UNK]` (another language, another script,
the wrong vocabulary) still yields blocks and batches; a masked LM then masks nothing
(`[UNK]` is never masked, as in transformers' collator), and a mean over zero targets used to
be reported as a loss of 0 and a perplexity of 1. These checks run before the model is built
and refuse such data, naming the cause.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .settings import FinetuneError

# Above this share of [UNK] among a split's text tokens the tokenizer does not cover the
# text: a model would learn to predict [UNK]. Real English text with BERT's vocabulary is
# well under 1%.
UNK_SHARE_LIMIT = 0.5


def _ids(tokenizer, names: tuple[str, ...]) -> list[int]:
    return [i for t in names if (i := tokenizer.token_to_id(t)) is not None]


def check_unknown_share(unknown: int, text_tokens: int, split: str, source: str) -> None:
    """Refuse a split with no text tokens, or one whose tokens are mostly `[UNK]`."""
    if text_tokens == 0:
        raise FinetuneError(
            f"{source}: the {split} texts give no tokens once tokenized (only special tokens); give it real text"
        )
    share = unknown / text_tokens
    if share > UNK_SHARE_LIMIT:
        raise FinetuneError(
            f"{source}: {share:.0%} of the {split} tokens ({unknown} of {text_tokens}) are [UNK]: the tokenizer "
            f"does not cover this text (the limit is {UNK_SHARE_LIMIT:.0%}); use a tokenizer of its language "
            "(--tokenizer) or other data"
        )


def check_blocks(tokenizer, input_ids: Tensor, split: str, source: str, masked: bool) -> None:
    """A language model's blocks (N, T): text tokens, mostly known, and (masked LM) some that
    can be masked."""
    unk = _ids(tokenizer, ("[UNK]",))
    special = torch.tensor(_ids(tokenizer, ("[PAD]", "[CLS]", "[SEP]", "[MASK]")), dtype=input_ids.dtype)
    text = ~torch.isin(input_ids, special)
    unknown = int(torch.isin(input_ids, torch.tensor(unk, dtype=input_ids.dtype)).sum()) if unk else 0
    check_unknown_share(unknown, int(text.sum()), split, source)
    if masked and int(text.sum()) - unknown == 0:
        raise FinetuneError(
            f"{source}: the {split} blocks hold no token the masked LM can mask (every one is special or [UNK]); "
            "give it real text"
        )


def check_texts(tokenizer, texts: list[str], split: str, source: str) -> None:
    """A fine-tuning split's texts, tokenized as the model will see them: not empty, mostly known."""
    if not texts:
        raise FinetuneError(f"{source}: the {split} split is empty; give it examples")
    unk_id = tokenizer.token_to_id("[UNK]")
    special = set(_ids(tokenizer, ("[PAD]", "[CLS]", "[SEP]", "[MASK]")))
    unknown = total = 0
    for start in range(0, len(texts), 1024):
        for encoding in tokenizer.encode_batch(texts[start : start + 1024], add_special_tokens=False):
            ids = [i for i in encoding.ids if i not in special]
            total += len(ids)
            unknown += sum(i == unk_id for i in ids)
    check_unknown_share(unknown, total, split, source)
