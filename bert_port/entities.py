"""Entities from a token classifier's word-piece probabilities, as transformers'
`TokenClassificationPipeline` makes them (`postprocess`, `gather_pre_entities`, `aggregate`,
`group_entities`), for `bert-port-predict`.

`scored_tokens` gathers a text's word pieces without the special tokens: the piece (`[UNK]` is
replaced by the text it covers), its character span in the text (a pre-split text is its words
joined by spaces, and each piece's span within its word is moved there), whether it continues
a word (a WordPiece tokenizer: the piece's length differs from its span's, `##ing` against
`ing`), and its tag probabilities. `aggregate(tokens, strategy, names, decode)` then gives:

  - `none`: every piece whose best tag is not `O`: `entity`, `score`, `index`, `word`, `start`, `end`;
  - `simple`: pieces grouped into entities by their best tag: a piece joins the group before it
    when its tag has the same type and is not `B-`;
  - `first`, `max`, `average`: the pieces of a word first agree on one tag (the first piece's
    best tag; the tag of the piece with the highest probability; the best tag of the mean of the
    pieces' probabilities), then words are grouped as `simple` groups pieces;
each entity group with `entity_group` (the type), `score` (the mean of its members'), `word`
(the members' pieces decoded), `start`, `end`; groups of type `O` are left out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Encoding, Tokenizer
from torch import Tensor

AGGREGATION_STRATEGIES = ("none", "simple", "first", "average", "max")
IGNORE_LABELS = ("O",)  # the pipeline's default ignore_labels


@dataclass
class ScoredTokens:
    """One text's word pieces, special tokens left out (the pipeline's pre-entities)."""

    text: str  # the text the spans index: the input, or a pre-split input's words joined by " "
    words: list[str]  # each piece as the vocabulary writes it (`##ing`); [UNK] as the text it covers
    starts: list[int]
    ends: list[int]
    subword: list[bool]  # the piece continues the word of the piece before it
    index: list[int]  # its position in the encoded sequence
    scores: Tensor  # (n, K) float32 tag probabilities
    truncated: bool  # the encoding was cut at the maximum length


def scored_tokens(
    tokenizer: Tokenizer, encoding: Encoding, probabilities: Tensor, text: str | Sequence[str]
) -> ScoredTokens:
    """The pre-entities of one encoded text; `probabilities` (T, K) covers the encoding's
    tokens (padding beyond them is ignored); `text` is a string, or the list of words it was
    encoded from (`is_split_into_words`)."""
    word_starts = None
    if not isinstance(text, str):
        word_starts, at = [], 0
        for word in text:
            word_starts.append(at)
            at += len(word) + 1
        text = " ".join(text)
    word_aware = bool(getattr(tokenizer.model, "continuing_subword_prefix", None))
    unk = tokenizer.token_to_id(getattr(tokenizer.model, "unk_token", "[UNK]"))
    out = ScoredTokens(text, [], [], [], [], [], probabilities, truncated=bool(encoding.overflowing))
    kept = []
    for t, (token_id, token, (start, end), special) in enumerate(
        zip(encoding.ids, encoding.tokens, encoding.offsets, encoding.special_tokens_mask)
    ):
        if special:
            continue
        word = encoding.word_ids[t]
        if word_starts is not None and word is not None:
            start, end = start + word_starts[word], end + word_starts[word]
        covered = text[start:end]
        # The pipeline's test: a WordPiece continuation is longer than its span by its "##".
        subword = len(token) != len(covered) if word_aware else start > 0 and " " not in text[start - 1 : start + 1]
        if token_id == unk:
            token, subword = covered, False
        out.words.append(token)
        out.starts.append(start)
        out.ends.append(end)
        out.subword.append(subword)
        out.index.append(t)
        kept.append(t)
    out.scores = probabilities[kept].float()
    return out


def aggregate(
    tokens: ScoredTokens, strategy: str, names: Sequence[str], decode: Callable[[list[str]], str]
) -> list[dict[str, Any]]:
    """The entities of one text by `strategy` (see the module docstring). `names` maps tag
    ids to tags; `decode` joins pieces into a string (the tokenizer's decoder)."""
    if strategy not in AGGREGATION_STRATEGIES:
        raise ValueError(f"unknown aggregation strategy {strategy!r}; use one of {', '.join(AGGREGATION_STRATEGIES)}")
    if strategy in ("none", "simple"):
        best, ids = tokens.scores.max(-1)  # the first best tag, as numpy's argmax
        entities = [
            {"entity": names[i], "score": float(p), "index": tokens.index[k], "word": tokens.words[k]}
            | {"start": tokens.starts[k], "end": tokens.ends[k]}
            for k, (p, i) in enumerate(zip(best.tolist(), ids.tolist()))
        ]
    else:
        entities = [_word_entity(tokens, group, strategy, names, decode) for group in _word_groups(tokens)]
    if strategy != "none":
        entities = group_entities(entities, decode)
    return [e for e in entities if e.get("entity", e.get("entity_group")) not in IGNORE_LABELS]


def _word_groups(tokens: ScoredTokens) -> list[list[int]]:
    """Pieces gathered into words: a piece that is no continuation opens a new word."""
    groups: list[list[int]] = []
    for k, subword in enumerate(tokens.subword):
        if groups and subword:
            groups[-1].append(k)
        else:
            groups.append([k])
    return groups


def _word_entity(tokens: ScoredTokens, group: list[int], strategy: str, names: Sequence[str], decode) -> dict[str, Any]:
    scores = tokens.scores[group]  # (pieces, K)
    if strategy == "first":
        chosen = scores[0]
    elif strategy == "max":
        chosen = scores[int(scores.max(-1).values.argmax())]  # the first piece holding the highest probability
    else:  # average
        chosen = scores.mean(0)
    best = int(chosen.argmax())
    return {
        "entity": names[best],
        "score": float(chosen[best]),
        "word": decode([tokens.words[k] for k in group]),
        "start": tokens.starts[group[0]],
        "end": tokens.ends[group[-1]],
    }


def _tag(name: str) -> tuple[str, str]:
    """(B or I, type): a tag without a B-/I- prefix continues, as the pipeline's `get_tag`."""
    if name.startswith(("B-", "I-")):
        return name[0], name[2:]
    return "I", name


def group_entities(entities: list[dict[str, Any]], decode) -> list[dict[str, Any]]:
    """Adjacent pieces (or words) whose tags share a type, each but the first not `B-`, as one entity."""
    groups: list[list[dict[str, Any]]] = []
    for entity in entities:
        bi, kind = _tag(entity["entity"])
        if groups and kind == _tag(groups[-1][-1]["entity"])[1] and bi != "B":
            groups[-1].append(entity)
        else:
            groups.append([entity])
    return [
        {
            "entity_group": group[0]["entity"].split("-", 1)[-1],
            "score": sum(e["score"] for e in group) / len(group),
            "word": decode([e["word"] for e in group]),
            "start": group[0]["start"],
            "end": group[-1]["end"],
        }
        for group in groups
    ]


def decoder_of(tokenizer: Tokenizer) -> Callable[[list[str]], str]:
    """How pieces become a string, as transformers' `convert_tokens_to_string` for a fast
    tokenizer: the tokenizer's decoder, else the pieces joined by spaces."""
    if tokenizer.decoder is None:
        return " ".join
    return tokenizer.decoder.decode
