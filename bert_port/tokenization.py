"""The tokenizer of a checkpoint directory, built with `tokenizers` (no `transformers`).

`tokenizer.json` is used when present; otherwise a BERT WordPiece pipeline is assembled
from `vocab.txt` and the lower-casing settings in `tokenizer_config.json`, the same
pipeline `BertTokenizerFast` builds. Padding and truncation stored in `tokenizer.json`
are cleared (all-MiniLM-L6-v2 ships a fixed pad-to-128): callers choose them per batch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece

from .checkpoint import CheckpointError

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


class TokenizerError(CheckpointError, ValueError):
    """Tokenizer files that are missing, unreadable or corrupt. A `CheckpointError`, and a
    `ValueError` so that callers catching that (as `bert-port-parity` does) still do."""


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """A `tokenizers.Tokenizer` for the checkpoint in `directory`. Raises `TokenizerError`
    when the folder has no tokenizer files or they cannot be read or parsed."""
    directory = Path(directory)
    settings: dict = {}
    current = directory / "tokenizer_config.json"
    try:
        if current.is_file():
            settings = json.loads(current.read_text(encoding="utf-8"))
            if not isinstance(settings, dict):
                raise ValueError(f"a JSON object is expected, got {type(settings).__name__}")
        current = directory / "tokenizer.json"
        if current.is_file():
            tok = Tokenizer.from_file(str(current))
        elif (directory / "vocab.txt").is_file():
            current = directory / "vocab.txt"
            tok = _wordpiece_from_vocab(current, settings)
        else:
            raise TokenizerError(
                f"{directory} has neither tokenizer.json nor vocab.txt; copy the tokenizer files of the "
                "checkpoint into it"
            )
    except TokenizerError:
        raise
    except OSError as exc:
        raise TokenizerError(f"cannot read {current}: {exc.strerror or exc}; check that you may read it") from None
    except Exception as exc:  # noqa: BLE001 -- the tokenizers library raises bare Exception for a corrupt file
        raise TokenizerError(
            f"{current} is not a valid tokenizer file ({type(exc).__name__}: {str(exc)[:300]}); copy the tokenizer "
            "files of the checkpoint again"
        ) from None
    tok.no_padding()
    tok.no_truncation()
    return tok


def _wordpiece_from_vocab(vocab_file: Path, settings: dict) -> Tokenizer:
    vocab = {}
    with open(vocab_file, encoding="utf-8") as f:
        for index, line in enumerate(f):
            vocab[line.rstrip("\n")] = index
    unk = settings.get("unk_token", "[UNK]")
    cls, sep = settings.get("cls_token", "[CLS]"), settings.get("sep_token", "[SEP]")
    absent = [t for t in (unk, cls, sep) if not isinstance(t, str) or t not in vocab]
    if absent:
        raise ValueError(f"the special tokens {absent} are not in the vocabulary")
    tok = Tokenizer(WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=settings.get("tokenize_chinese_chars", True),
        strip_accents=settings.get("strip_accents"),
        lowercase=settings.get("do_lower_case", True),
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0",
        pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
    )
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([t for t in SPECIAL_TOKENS if t in vocab])
    return tok


def encode(
    tokenizer: Tokenizer,
    texts: list[str],
    pairs: list[str] | None = None,
    max_length: int = 512,
    pad_to: int | None = None,
) -> dict[str, torch.Tensor]:
    """Tokenize a batch: `input_ids`, `token_type_ids`, `attention_mask` as (B, T) long
    tensors, padded on the right to the longest sequence (or `pad_to`), truncated to
    `max_length` (longest-first for pairs)."""
    pad_id = tokenizer.token_to_id("[PAD]") or 0
    tokenizer.enable_truncation(max_length=max_length)
    try:
        inputs = list(zip(texts, pairs)) if pairs is not None else list(texts)
        encodings = tokenizer.encode_batch(inputs)
    finally:
        tokenizer.no_truncation()
    T = max(pad_to or 0, max(len(e.ids) for e in encodings))
    out = {
        name: torch.zeros(len(encodings), T, dtype=torch.long)
        for name in ("input_ids", "token_type_ids", "attention_mask")
    }
    out["input_ids"].fill_(pad_id)
    for i, e in enumerate(encodings):
        n = len(e.ids)
        out["input_ids"][i, :n] = torch.tensor(e.ids)
        out["token_type_ids"][i, :n] = torch.tensor(e.type_ids)
        out["attention_mask"][i, :n] = 1
    return out
