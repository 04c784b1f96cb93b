"""The model a server runs and its task: embeddings, classification, or entities.

A task turns request inputs into `Item`s (tokenized, checked against the input limit) on the
event loop, and computes a batch of items in the inference thread with the library's own
calls: `BertModel` and `pool` as `SentenceEncoder.encode` runs them, the classifier's logits as
`Predictor` computes them, `Predictor` itself for entities. The default CPU path gives a text
the same bits in any batch (docs/batch-invariance.md), so a response does not depend on which
other requests shared its batch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor

from ..checkpoint import ST_MODULES
from ..sentence import SentenceEncoder
from ..sentence_folder import pool
from ..threads import governed
from ..tokenization import encode, pad_token_id
from ..training.prediction import Predictor

log = logging.getLogger(__name__)

TASKS = ("embed", "classify", "tag")


class InputError(ValueError):
    """A request input the model cannot take as it is (TEI answers 413): the message says why."""


@dataclasses.dataclass
class Item:
    """One input of a request: token ids (embeddings) or a text and optional pair (classifiers).
    `tokens` is its length in tokens, which the batcher sorts and budgets by."""

    op: str
    tokens: int
    ids: list[int] | None = None
    text: str | list[str] | None = None
    pair: str | None = None


def plain_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """A copy that neither truncates nor pads, for the event loop alone: the library's `encode`
    sets truncation on the tokenizer it is given, so the two must not share one across threads."""
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy


def cut(ids: list[int], special: list[int], limit: int, direction: str) -> list[int]:
    """`ids` (with their special tokens) cut to `limit` tokens, keeping the leading and trailing
    special tokens: what the tokenizer's own truncation gives a single text."""
    head = next((i for i, s in enumerate(special) if not s), len(ids))
    tail = next((i for i, s in enumerate(reversed(special)) if not s), 0)
    body = ids[head : len(ids) - tail]
    keep = max(limit - head - tail, 0)
    body = body[:keep] if direction == "right" else body[len(body) - keep :]
    return ids[:head] + body + ids[len(ids) - tail :]


def too_long(n: int, limit: int) -> InputError:
    return InputError(
        f"an input has {n} tokens, more than the model's limit of {limit}; send shorter texts, or set "
        '"truncate": true (or start the server with --auto-truncate)'
    )


class EmbeddingTask:
    """A `SentenceEncoder`: pooled embeddings (`embed`) and token embeddings (`embed_all`)."""

    kind = "embed"

    def __init__(self, encoder: SentenceEncoder, threads: int | str | None):
        self.encoder = encoder
        self.threads = threads if encoder.model.device.type == "cpu" else None
        self.tokenizer = plain_tokenizer(encoder.tokenizer)
        self.max_input_length = encoder.max_seq_length
        self.pad_id = pad_token_id(encoder.tokenizer)
        self.vocab_size = encoder.model.config.vocab_size

    def prepare(
        self, texts: list[str], op: str, truncate: bool, direction: str = "right", prompt_name: str | None = None
    ) -> list[Item]:
        """Items of `texts` for `op` ("embed" or "embed_all"), with the prompt and lower-casing
        `SentenceEncoder.encode` applies; a text over the limit is cut or refused."""
        prompt = self.encoder.resolve_prompt(None, prompt_name)
        texts = [(prompt or "") + t for t in texts]
        if self.encoder.do_lower_case:
            texts = [t.lower() for t in texts]
        items = []
        for e in self.tokenizer.encode_batch(texts):
            ids = e.ids
            if len(ids) > self.max_input_length:
                if not truncate:
                    raise too_long(len(ids), self.max_input_length)
                ids = cut(ids, e.special_tokens_mask, self.max_input_length, direction)
            items.append(Item(op, len(ids), ids=ids))
        return items

    def prepare_ids(self, sequences: list[list[int]], truncate: bool) -> list[Item]:
        """Items of token-id sequences as given (OpenAI's token input): ids outside the vocabulary
        or an empty sequence are refused."""
        items = []
        for ids in sequences:
            if not ids:
                raise InputError("a token-id input is empty; send at least one id")
            bad = [i for i in ids if not 0 <= i < self.vocab_size]
            if bad:
                raise InputError(
                    f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}); send this model's ids"
                )
            if len(ids) > self.max_input_length:
                if not truncate:
                    raise too_long(len(ids), self.max_input_length)
                ids = ids[: self.max_input_length]
            items.append(Item("embed", len(ids), ids=list(ids)))
        return items

    @torch.inference_mode()
    def run(self, op: str, items: list[Item]) -> list[Tensor]:
        """One forward over `items`: (D,) pooled vectors after the checkpoint's Normalize module
        (`embed`), or each input's (T_i, H) token vectors (`embed_all`)."""
        model = self.encoder.model
        width = max(it.tokens for it in items)
        input_ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, it in enumerate(items):
            input_ids[row, : it.tokens] = torch.tensor(it.ids)
            mask[row, : it.tokens] = 1
        input_ids, mask = input_ids.to(model.device), mask.to(model.device)
        with governed(model, self.threads):
            hidden = model(input_ids, attention_mask=mask, token_type_ids=torch.zeros_like(input_ids)).last_hidden_state
        if op == "embed_all":
            return [hidden[row, : it.tokens].float().cpu() for row, it in enumerate(items)]
        pooled = pool(hidden, mask, self.encoder.pooling)
        return [self._finish(pooled[row : row + 1]) for row in range(len(items))]

    def _finish(self, row: Tensor) -> Tensor:
        return (F.normalize(row, p=2, dim=1) if self.encoder.normalize else row).cpu()

    @staticmethod
    def respond(row: Tensor, dimensions: int | None, normalize: bool) -> list[float]:
        """A pooled (1, D) row as `encode(text, truncate_dim=dimensions, normalize_embeddings=normalize)`
        returns it, as a list of floats."""
        if dimensions is not None:
            row = row[:, :dimensions]
        if normalize:
            row = F.normalize(row, p=2, dim=1)
        return row.float()[0].tolist()


class ClassifierTask:
    """A `Predictor`'s model: label scores for texts and pairs (`predict`, `rerank`), or entities
    for a token classifier (`tag`)."""

    def __init__(self, predictor: Predictor):
        self.predictor = predictor
        self.kind = "tag" if predictor.tagger else "classify"
        self.tokenizer = plain_tokenizer(predictor.tokenizer)
        self.max_input_length = predictor.max_length
        self.names = predictor.names

    def prepare(self, inputs: list[tuple[str, str | None]], truncate: bool) -> list[Item]:
        """Items of (text, pair or None) inputs; one over the limit is refused unless `truncate`
        (the library's longest-first truncation then cuts it)."""
        encodings = self.tokenizer.encode_batch([t if p is None else (t, p) for t, p in inputs])
        items = []
        for (text, pair), e in zip(inputs, encodings):
            n = len(e.ids)
            if n > self.max_input_length and not truncate:
                raise too_long(n, self.max_input_length)
            items.append(Item(self.kind, min(n, self.max_input_length), text=text, pair=pair))
        return items

    @torch.inference_mode()
    def run(self, op: str, items: list[Item]) -> list[Any]:
        """Raw logits, (num_labels,) each, of a batch of texts or of pairs (one kind per call:
        the batcher keys its batches by `op` and whether items are pairs); entity rows for a tagger."""
        p = self.predictor
        if op == "tag":
            return p([it.text for it in items])
        pairs = [it.pair for it in items] if items[0].pair is not None else None
        batch = encode(p.tokenizer, [it.text for it in items], pairs, max_length=p.max_length).to(p.device)
        threads = p.threads if p.device.type == "cpu" else None
        autocast = torch.autocast(device_type=p.device.type, dtype=torch.bfloat16, enabled=p.bf16)
        with governed(p.model, threads), autocast:
            logits = p.model(**batch).logits.float().cpu()
        return list(logits)

    def scores(self, logits: Tensor, raw: bool) -> list[float]:
        """What `Predictor` reports for these logits (the problem's scores, then the model's
        activation), or the logits themselves."""
        if raw:
            return logits.tolist()
        scores = self.predictor.problem.scores(logits[None])[0]
        return (scores.sigmoid() if self.predictor.activation == "sigmoid" else scores).tolist()


def guess_task(model_dir: Path) -> str:
    """The task a checkpoint folder is for: a sentence-transformers folder or a plain encoder
    embeds; a config whose architecture is a sequence or token classifier classifies or tags."""
    if os.path.lexists(model_dir / ST_MODULES):  # present, whatever it is: SentenceEncoder judges it
        return "embed"
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "embed"
    architectures = " ".join(config.get("architectures") or []) if isinstance(config, dict) else ""
    if "TokenClassification" in architectures:
        return "tag"
    if "SequenceClassification" in architectures:
        return "classify"
    return "embed"


def load_task(model: str, task: str | None, *, threads, quantization: str | None, dtype: str | None):
    """The task for `model` (a folder or an HF-cache id), `task` overriding the guess."""
    where = Path(model).expanduser()
    task = task or (guess_task(where) if where.is_dir() else "embed")
    if task not in TASKS:
        raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    if task == "embed":
        kwargs = {"quantization": quantization} if quantization else {}
        if dtype:
            kwargs["dtype"] = dtype
        encoder = SentenceEncoder.from_pretrained(model, **kwargs)
        return EmbeddingTask(encoder, threads)
    predictor = Predictor.load(model, quantization=quantization, bf16=dtype == "bfloat16", threads=threads)
    if (task == "tag") != predictor.tagger:
        raise ValueError(
            f"{model} is a {predictor.problem} model; serve it with --task {ClassifierTask(predictor).kind}"
        )
    return ClassifierTask(predictor)


def one_label(task: Any) -> bool:
    """Whether a classifier scores relevance with one label, as a reranker (a cross-encoder) does."""
    return isinstance(task, ClassifierTask) and task.kind == "classify" and len(task.names) == 1
