"""The inputs of a parity run: built-in real text and sentence pairs, a texts file, and the
edge cases (a max-length row, an all-pad row, a [CLS]-only row, a one-token batch), tokenized
into named (B, T) batches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..tokenization import encode, pad_token_id

# Built-in real text: movie-review sentences (MR), SMS messages, news and technical prose,
# accents, CJK, numbers and punctuation, of varied lengths, and sentence pairs.
DEFAULT_TEXTS: tuple[str, ...] = (
    (
        "the rock is destined to be the 21st century's new \" conan \" and that he's going to make a splash even "
        "greater than arnold schwarzenegger , jean-claud van damme or steven segal ."
    ),
    (
        'the gorgeously elaborate continuation of " the lord of the rings " trilogy is so huge that a column of words '
        "cannot adequately describe co-writer/director peter jackson's expanded vision of j . r . r . tolkien's "
        "middle-earth ."
    ),
    "simplistic , silly and tedious .",
    "A gripping, beautifully shot film that never lets go.",
    "I wouldn't recommend this restaurant to anyone.",
    "Go until jurong point, crazy.. Available only in bugis n great world la e buffet... Cine there got amore wat...",
    "WINNER!! As a valued network customer you have been selected to receive a £900 prize reward! Call 09061701461.",
    "Ok lar... Joking wif u oni...",
    "naïve café owners' résumé: Ünïcödé and 中文 characters, too!",
    "The Federal Reserve held interest rates steady on Wednesday, citing a slowing labour market.",
    "BERT encodes each token in the context of the whole sentence, left and right.",
    "ok",
)
DEFAULT_PAIRS: tuple[tuple[str, str], ...] = (
    ("A man is playing a guitar on stage.", "Someone performs music in front of an audience."),
    ("The cat sat on the mat.", "A dog barked at the mailman all morning long."),
    ("How do I reset my password?", "Click 'Forgot password' on the sign-in page and follow the e-mail link."),
    ("Paris is the capital of France.", "Paris est la capitale de la France."),
)


# -----------------------------------------------------------------------------------------
# Inputs


@dataclass
class Batch:
    """One batch of model inputs ((B, T) long tensors) with a name for the report."""

    name: str
    inputs: dict[str, Tensor]

    @property
    def rows(self) -> int:
        return int(self.inputs["input_ids"].shape[0])

    @property
    def real_tokens(self) -> int:
        return int(self.inputs["attention_mask"].sum())

    @property
    def pad_tokens(self) -> int:
        return int(self.inputs["attention_mask"].numel()) - self.real_tokens


def read_texts_file(path: str | Path) -> list[tuple[str, str | None]]:
    """Read one example per line: a text, or a sentence pair as two tab-separated segments.
    Blank lines are skipped. Raises `ValueError` naming the offending line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ValueError(f"--texts-file {path} does not exist") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--texts-file {path} is not UTF-8 text ({exc}); re-save it as UTF-8") from None
    examples: list[tuple[str, str | None]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) > 2:
            raise ValueError(
                f"{path}, line {number}: {len(fields)} tab-separated fields; expected one (a text) or two "
                "(a sentence pair). Remove label or id columns first"
            )
        first = fields[0].strip()
        second = fields[1].strip() if len(fields) == 2 else ""
        if not first:
            raise ValueError(f"{path}, line {number}: the first segment is empty")
        examples.append((first, second or None))
    if not examples:
        raise ValueError(f"--texts-file {path} holds no text: write one text (or tab-separated pair) per line")
    return examples


def build_batches(
    tokenizer,
    examples: Sequence[tuple[str, str | None]],
    *,
    batch_size: int,
    max_length: int,
    adversarial: bool = True,
) -> list[Batch]:
    """Tokenize `examples` ((text, second segment or None)) into batches of `batch_size`,
    single texts and pairs batched apart; then, with `adversarial`, the edge cases:
    a row of exactly `max_length` real tokens, a batch holding an all-padding row and a
    row whose only real token is [CLS], and a batch of one one-token sequence (T = 1)."""
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    batches = []
    singles = [a for a, b in examples if b is None]
    pairs = [(a, b) for a, b in examples if b is not None]
    for start in range(0, len(singles), batch_size):
        chunk = singles[start : start + batch_size]
        inputs = encode(tokenizer, chunk, max_length=max_length)
        batches.append(Batch(f"texts {start + 1}-{start + len(chunk)}", inputs))
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        inputs = encode(tokenizer, [a for a, _ in chunk], [b for _, b in chunk], max_length=max_length)
        batches.append(Batch(f"pairs {start + 1}-{start + len(chunk)}", inputs))
    if adversarial:
        batches += adversarial_batches(tokenizer, max_length)
    return batches


def adversarial_batches(tokenizer, max_length: int) -> list[Batch]:
    """The built-in edge cases (see `build_batches`)."""
    text = " ".join(DEFAULT_TEXTS)
    previous, count = -1, len(tokenizer.encode(text).ids)
    while previous < count < max_length:  # stops too where the tokenizer's truncation caps the count
        text = f"{text} {text}"
        previous, count = count, len(tokenizer.encode(text).ids)
    longest = encode(tokenizer, [text], max_length=max_length)  # (1, max_length)

    edge = encode(tokenizer, [DEFAULT_TEXTS[3], "", ""])  # real row + two rows to overwrite, (3, T)
    pad_id = pad_token_id(tokenizer)
    cls_id = int(edge["input_ids"][0, 0])
    edge["input_ids"][1:] = pad_id
    edge["attention_mask"][1:] = 0
    edge["token_type_ids"][1:] = 0
    edge["input_ids"][2, 0] = cls_id  # row 2: [CLS] alone, the rest padding
    edge["attention_mask"][2, 0] = 1

    one = {
        "input_ids": torch.tensor([[cls_id]]),
        "token_type_ids": torch.zeros(1, 1, dtype=torch.long),
        "attention_mask": torch.ones(1, 1, dtype=torch.long),
    }
    return [
        Batch(f"max-length row (T={longest['input_ids'].shape[1]})", longest),
        Batch("all-pad row + [CLS]-only row", edge),
        Batch("one token (T=1)", one),
    ]
