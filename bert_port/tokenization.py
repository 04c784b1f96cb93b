"""The tokenizer of a checkpoint directory, built with `tokenizers` (no `transformers`).

`tokenizer.json` is used when present; otherwise a BERT WordPiece pipeline is assembled
from `vocab.txt` and the lower-casing settings in `tokenizer_config.json`, the same
pipeline `BertTokenizerFast` builds. Padding stored in `tokenizer.json` is cleared
(all-MiniLM-L6-v2 ships a fixed pad-to-128): `encode` pads each batch to its longest. Its
truncation is replaced by the checkpoint's limit, `model_max_length` from
`tokenizer_config.json` (what transformers' `truncation=True` cuts to), so that `encode`
never returns more tokens than the model takes; `SentenceEncoder` uses sentence-transformers'
`max_seq_length` instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Encoding, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece

from .storage import bounded
from .storage.errors import CheckpointError

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# The padding token of BERT's WordPiece, then of RoBERTa's BPE and XLM-R's SentencePiece (id 1 in both).
PAD_TOKENS = ("[PAD]", "<pad>")
DEFAULT_MAX_LENGTH = 512  # BERT's position table, when the tokenizer files name no limit
# transformers writes int(1e30) as model_max_length when a tokenizer has no limit of its own.
_NO_LIMIT = 10**9


class TokenizerError(CheckpointError, ValueError):
    """Tokenizer files that are missing, unreadable or corrupt. A `CheckpointError`, and a
    `ValueError` so that callers catching that (as `bert-port-parity` does) still do."""


def load_tokenizer(directory: str | os.PathLike, max_length: int | None = None) -> Tokenizer:
    """A `tokenizers.Tokenizer` for the checkpoint in `directory`, truncating to `max_length`
    (default: the checkpoint's `model_max_length`, else 512). Raises `TokenizerError` when
    the folder has no tokenizer files or they cannot be read or parsed. Each file is read as
    the checkpoint's other files are (`storage.bounded`): a FIFO, a device or an oversized file
    is refused in one line naming it, and one that is there is never taken for absent."""
    directory = Path(directory)
    settings: dict = {}
    current = directory / "tokenizer_config.json"
    try:
        if os.path.lexists(current):
            settings = json.loads(_read(current, bounded.JSON))
            if not isinstance(settings, dict):
                raise ValueError(f"a JSON object is expected, got {type(settings).__name__}")
        current = directory / "tokenizer.json"
        if os.path.lexists(current):
            tok = Tokenizer.from_str(_read(current, bounded.TOKENIZER))
        elif os.path.lexists(directory / "vocab.txt"):
            current = directory / "vocab.txt"
            tok = _wordpiece_from_vocab(_read(current, bounded.TOKENIZER), settings)
        else:
            raise TokenizerError(
                f"{directory} has neither tokenizer.json nor vocab.txt; copy the tokenizer files of the "
                "checkpoint into it"
            )
    except TokenizerError:
        raise
    except bounded.RefusedFile as exc:
        raise TokenizerError(f"refused to read {exc.path}: {exc.why}; copy the tokenizer files of the checkpoint again")
    except OSError as exc:
        raise TokenizerError(f"cannot read {current}: {exc.strerror or exc}; check that you may read it") from None
    except Exception as exc:  # noqa: BLE001 -- the tokenizers library raises bare Exception for a corrupt file
        raise TokenizerError(
            f"{current} is not a valid tokenizer file ({type(exc).__name__}: {str(exc)[:300]}); copy the tokenizer "
            "files of the checkpoint again"
        ) from None
    tok.no_padding()
    limit = settings.get("model_max_length")
    if max_length is None:
        usable = isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < _NO_LIMIT
        max_length = limit if usable else DEFAULT_MAX_LENGTH
    tok.enable_truncation(max_length=max_length)
    return tok


def _read(path: Path, limit: int) -> str:
    """A tokenizer file's text, read with a bound; links are followed, as the HF cache's are."""
    return bounded.read_text(path, limit, folder=False)


def _wordpiece_from_vocab(text: str, settings: dict) -> Tokenizer:
    # One token a line, the line ends read as a file in text mode reads them (\n, \r\n or \r).
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    vocab = {line: index for index, line in enumerate(lines[:-1] if lines[-1] == "" else lines)}
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


class BatchEncoding(dict):
    """What `encode` returns: a dict of (B, T) tensors to call a model with (`model(**batch)`),
    plus transformers' `word_ids(i)` and `tokens(i)`, read from the tokenizer's encodings."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], encodings: list[Encoding] | None = None, pad_token: str = "[PAD]"
    ):
        # `encodings` optional: torch's collate and pin_memory rebuild a mapping from its items.
        super().__init__(tensors)
        self.encodings = encodings if encodings is not None else []
        self.pad_token = pad_token

    def word_ids(self, batch_index: int = 0) -> list[int | None]:
        """The word of the text each token of row `batch_index` comes from; None for special
        tokens and padding. With pairs, words are counted in each text separately."""
        ids = self.encodings[batch_index].word_ids
        return ids + [None] * (self["input_ids"].shape[1] - len(ids))

    def tokens(self, batch_index: int = 0) -> list[str]:
        """The tokens of row `batch_index`, padding included (`pad_token`), so that position t
        is the token of `input_ids[batch_index, t]`, as `word_ids` and transformers give them."""
        tokens = list(self.encodings[batch_index].tokens)
        return tokens + [self.pad_token] * (self["input_ids"].shape[1] - len(tokens))

    def to(self, device: str | torch.device) -> BatchEncoding:
        return BatchEncoding({k: v.to(device) for k, v in self.items()}, self.encodings, self.pad_token)


def _as_texts(texts: str | Sequence[str], name: str) -> list[str]:
    if isinstance(texts, str):  # one text, not a sequence of characters
        return [texts]
    texts = list(texts)
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise ValueError(
            f"{name} must be a string or a list of strings; item {bad[0]} is {type(texts[bad[0]]).__name__}"
        )
    return texts


def _as_word_lists(texts: Sequence[str] | Sequence[Sequence[str]], name: str) -> list[list[str]]:
    """A list of words is one pre-split text; a list of such lists, a batch (as transformers)."""
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        problem = f"must be a list of words or a list of word lists, not {type(texts).__name__}"
    else:
        texts = list(texts)
        if texts and all(isinstance(t, str) for t in texts):
            return [texts]
        problem = _word_lists_problem(texts)
    if problem:
        raise ValueError(f"with is_split_into_words=True, {name} {problem}")
    return [list(words) for words in texts]


def _word_lists_problem(texts: list) -> str | None:
    for i, words in enumerate(texts):
        if isinstance(words, str) or not isinstance(words, Sequence):
            return f"item {i} is {type(words).__name__}; give every text as a list of words"
        bad = next((j for j, w in enumerate(words) if not isinstance(w, str)), None)
        if bad is not None:
            return f"item {i}, word {bad} is {type(words[bad]).__name__}; words are strings"
    return None


def pad_token_id(tokenizer: Tokenizer) -> int:
    """The id a batch is padded with: the tokenizer's padding token (`PAD_TOKENS`), else 0. RoBERTa's
    positions count the tokens that are not this one, so it must be the model's pad_token_id."""
    return next((i for i in map(tokenizer.token_to_id, PAD_TOKENS) if i is not None), 0)


def encode(
    tokenizer: Tokenizer,
    texts: str | Sequence[str],
    pairs: str | Sequence[str] | None = None,
    max_length: int | None = None,
    pad_to: int | None = None,
    return_offsets_mapping: bool = False,
    is_split_into_words: bool = False,
) -> BatchEncoding:
    """Tokenize a batch: `input_ids`, `token_type_ids`, `attention_mask` as (B, T) long
    tensors, padded on the right to the longest sequence (or `pad_to`), truncated to
    `max_length` (default: the tokenizer's, see `load_tokenizer`; longest-first for pairs).

    A bare string is one text (and one pair). `return_offsets_mapping` adds
    `offset_mapping`, (B, T, 2) character spans into the text (0, 0 for special tokens and
    padding), as transformers does; take it out before `model(**batch)`. `word_ids(i)` of
    the result gives the word of each token, for token classification.

    `is_split_into_words=True`: each text is a list of words (one list: one text), as
    transformers' fast tokenizer takes it: each word is still split by the pre-tokenizer
    ("isn't" -> isn ' t), but `word_ids` index the given words, and offsets are character
    spans within each word."""
    as_texts = _as_word_lists if is_split_into_words else _as_texts
    texts = as_texts(texts, "texts")
    if pairs is not None:
        pairs = as_texts(pairs, "pairs")
        if len(pairs) != len(texts):
            raise ValueError(f"pairs has {len(pairs)} texts and texts {len(texts)}; give one pair per text")
    if not texts:
        raise ValueError("encode got no texts; pass at least one string")
    pad_id = pad_token_id(tokenizer)
    previous = tokenizer.truncation
    if max_length is None:
        max_length = previous["max_length"] if previous else DEFAULT_MAX_LENGTH
    tokenizer.enable_truncation(max_length=max_length)
    try:
        inputs = list(zip(texts, pairs)) if pairs is not None else texts
        encodings = tokenizer.encode_batch(inputs, is_pretokenized=is_split_into_words)
    finally:
        if previous:
            tokenizer.enable_truncation(**previous)
        else:
            tokenizer.no_truncation()
    T = max(pad_to or 0, max(len(e.ids) for e in encodings))
    out = {
        name: torch.zeros(len(encodings), T, dtype=torch.long)
        for name in ("input_ids", "token_type_ids", "attention_mask")
    }
    out["input_ids"].fill_(pad_id)
    if return_offsets_mapping:
        out["offset_mapping"] = torch.zeros(len(encodings), T, 2, dtype=torch.long)
    for i, e in enumerate(encodings):
        n = len(e.ids)
        out["input_ids"][i, :n] = torch.tensor(e.ids)
        out["token_type_ids"][i, :n] = torch.tensor(e.type_ids)
        out["attention_mask"][i, :n] = 1
        if return_offsets_mapping:
            out["offset_mapping"][i, :n] = torch.tensor(e.offsets).view(n, 2)
    return BatchEncoding(out, encodings, pad_token=tokenizer.id_to_token(pad_id) or "[PAD]")
