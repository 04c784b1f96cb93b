"""Losses for training sentence-embedding models, as sentence-transformers defines them.

Each loss is an `nn.Module` over a `SentenceEncoder`, called as sentence-transformers' losses
are: `loss(features, labels)`, `features` one tokenized batch per text column (anchor,
positive, negatives...), `labels` a (B,) tensor or None. The math of each lives in a function
of the embeddings, so a test or another loop can call it directly.

- `MultipleNegativesRankingLoss`: (anchor, positive[, negative...]) rows; each anchor's
  positive must score above every other row's positive and every hard negative in the batch
  (in-batch negatives), cross-entropy over `scale * cos`. `symmetric=True` adds the positive ->
  anchors direction, the two averaged (sentence-transformers' `directions=("query_to_doc",
  "doc_to_query"), partition_mode="per_direction"`).
- `CachedMultipleNegativesRankingLoss`: the same loss over a large batch at the memory of a
  `mini_batch_size` batch (GradCache, Gao et al. 2021): embed without a graph, take the loss's
  gradient with respect to the embeddings, then re-run each mini-batch with a graph (the same
  dropout, its RNG state replayed) and back-propagate that cached gradient through it.
- `CoSENTLoss`, `CosineSimilarityLoss`: scored pairs (anchor, other) with a float label.
- `TripletLoss`: (anchor, positive, negative), hinge on euclidean distances, margin 5.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..similarity import cos_sim, pairwise_cos_sim, similarity_functions

Features = dict[str, Tensor]


def mnrl_loss(anchors: Tensor, candidates: Sequence[Tensor], scale: float, score=cos_sim, symmetric=False) -> Tensor:
    """(B, D) anchors and C (B, D) candidate columns (positives first, then hard negatives) -> the
    mean cross-entropy of each anchor's own positive among all B * C candidates."""
    positives, pool = candidates[0], torch.cat(list(candidates), dim=0)  # (B * C, D)
    rows = torch.arange(len(anchors), device=anchors.device)
    forward = score(anchors, pool) * scale  # (B, B * C)
    loss = torch.logsumexp(forward, dim=1) - forward[rows, rows]
    if symmetric:  # each positive against every anchor; one softmax per direction, averaged
        backward = score(anchors, positives).T * scale  # (B, B)
        loss = loss + (torch.logsumexp(backward, dim=1) - forward[rows, rows])
        loss = loss / 2
    return loss.mean()


def cosent_loss(a: Tensor, b: Tensor, labels: Tensor, scale: float = 20.0) -> Tensor:
    """log(1 + sum over pairs (i, j) with label_i > label_j of exp(scale * (cos_j - cos_i)))."""
    scores = pairwise_cos_sim(a, b).float() * scale  # (B,)
    labels = labels.view(-1).to(scores.dtype)
    diff = scores[None, :] - scores[:, None]  # [i, j] = s_j - s_i
    diff = diff.masked_fill(labels[:, None] <= labels[None, :], float("-inf"))  # keep label_i > label_j
    return torch.logsumexp(torch.cat([diff.new_zeros(1), diff.flatten()]), dim=0)


def cosine_similarity_loss(a: Tensor, b: Tensor, labels: Tensor) -> Tensor:
    """Mean squared error between the cosine of each pair and its label."""
    return F.mse_loss(torch.cosine_similarity(a, b), labels.float().view(-1))


def triplet_loss(anchor: Tensor, positive: Tensor, negative: Tensor, margin: float = 5.0) -> Tensor:
    """mean(relu(|a - p| - |a - n| + margin)), euclidean distances (sentence-transformers' default)."""
    return F.relu(F.pairwise_distance(anchor, positive) - F.pairwise_distance(anchor, negative) + margin).mean()


class EmbeddingLoss(nn.Module):
    """A loss over a `SentenceEncoder`: `forward(features, labels)` embeds each column and
    calls `from_embeddings`."""

    columns: tuple[int, int | None] = (2, None)  # the fewest and most text columns it takes
    needs_labels = False

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def check(self, features: Sequence[Features], labels: Tensor | None) -> None:
        low, high = self.columns
        if not low <= len(features) <= (high or len(features)):
            wanted = f"{low}" if low == high else f"{low} or more" if high is None else f"{low} to {high}"
            raise ValueError(f"{type(self).__name__} takes {wanted} text columns, got {len(features)}")
        if self.needs_labels and labels is None:
            raise ValueError(f"{type(self).__name__} needs a score per row (a label column); none was given")

    def forward(self, features: Sequence[Features], labels: Tensor | None = None) -> Tensor:
        self.check(features, labels)
        return self.float_loss([self.encoder(**f) for f in features], labels)

    def float_loss(self, embeddings: list[Tensor], labels: Tensor | None) -> Tensor:
        """`from_embeddings` in float32, outside any autocast: under bf16 only the encoder runs in
        bf16, as the fine-tuning recipe takes its loss on float32 logits (a cosine rounded to bf16,
        times the scale of 20, would move a logit by up to 0.08). A no-op in float32."""
        with torch.autocast(embeddings[0].device.type, enabled=False):
            return self.from_embeddings([e.float() for e in embeddings], labels)

    def from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None) -> Tensor:
        raise NotImplementedError


class MultipleNegativesRankingLoss(EmbeddingLoss):
    """In-batch negatives over (anchor, positive[, negatives...]) rows; see the module docstring."""

    def __init__(self, encoder: nn.Module, scale: float = 20.0, similarity: str = "cosine", symmetric: bool = False):
        super().__init__(encoder)
        if not scale > 0:
            raise ValueError(f"scale must be positive, got {scale!r}")
        self.scale, self.score, self.symmetric = scale, similarity_functions(similarity)[0], symmetric

    def from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None = None) -> Tensor:
        return mnrl_loss(embeddings[0], embeddings[1:], self.scale, self.score, self.symmetric)


class CoSENTLoss(EmbeddingLoss):
    columns, needs_labels = (2, 2), True

    def __init__(self, encoder: nn.Module, scale: float = 20.0):
        super().__init__(encoder)
        self.scale = scale

    def from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None) -> Tensor:
        return cosent_loss(embeddings[0], embeddings[1], labels, self.scale)


class CosineSimilarityLoss(EmbeddingLoss):
    columns, needs_labels = (2, 2), True

    def from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None) -> Tensor:
        return cosine_similarity_loss(embeddings[0], embeddings[1], labels)


class TripletLoss(EmbeddingLoss):
    columns = (3, 3)

    def __init__(self, encoder: nn.Module, margin: float = 5.0):
        super().__init__(encoder)
        self.margin = margin

    def from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None = None) -> Tensor:
        return triplet_loss(*embeddings, margin=self.margin)


def _chunks(features: Features, size: int) -> list[Features]:
    """One tokenized batch as mini-batches of `size` rows, each cut to its own longest row."""
    rows = len(features["input_ids"])
    out = []
    for start in range(0, rows, size):
        part = {k: v[start : start + size] for k, v in features.items()}
        width = int(part["attention_mask"].sum(dim=1).max()) if len(part["attention_mask"]) else 0
        out.append({k: v[:, :width] if v.dim() == 2 else v for k, v in part.items()})
    return out


@contextlib.contextmanager
def _replayed_rng(state: tuple[Tensor, list[Tensor]]):
    """Run the block with the CPU (and CUDA) generators set to `state`, then put them back."""
    devices = list(range(torch.cuda.device_count())) if state[1] else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1]:
            torch.cuda.set_rng_state_all(state[1])
        yield


def _autocast_now(device_type: str) -> dict:
    """The autocast in force, to enter again in the second pass (it runs in `backward`, outside it)."""
    enabled = torch.is_autocast_enabled(device_type)
    return {"device_type": device_type, "dtype": torch.get_autocast_dtype(device_type), "enabled": enabled}


def _rng_state() -> tuple[Tensor, list[Tensor]]:
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [])


class CachedMultipleNegativesRankingLoss(MultipleNegativesRankingLoss):
    """`MultipleNegativesRankingLoss` with GradCache: activations of only `mini_batch_size` rows
    are held at once, whatever the batch. `loss.backward()` runs the second pass (a hook on the
    returned loss), so it drops into the same loop as any other loss."""

    def __init__(self, encoder: nn.Module, scale: float = 20.0, similarity: str = "cosine", symmetric: bool = False,
                 mini_batch_size: int = 32):  # fmt: skip
        super().__init__(encoder, scale, similarity, symmetric)
        if not isinstance(mini_batch_size, int) or mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be a positive integer, got {mini_batch_size!r}")
        self.mini_batch_size = mini_batch_size

    def forward(self, features: Sequence[Features], labels: Tensor | None = None) -> Tensor:
        self.check(features, labels)
        chunks = [_chunks(column, self.mini_batch_size) for column in features]
        states, reps = [[] for _ in chunks], [[] for _ in chunks]
        cast = _autocast_now(features[0]["input_ids"].device.type)
        # First pass: embeddings only, the RNG state before each mini-batch kept. With dropout on it
        # runs with autograd on (each graph freed at once by the detach), since the model picks its
        # attention kernel by whether autograd is on and kernels draw dropout masks differently.
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.encoder.training):
            for column, column_states, column_reps in zip(chunks, states, reps):
                for chunk in column:
                    column_states.append(_rng_state())
                    column_reps.append(self.encoder(**chunk).detach().float())
        if not torch.is_grad_enabled():
            return self.float_loss([torch.cat(r) for r in reps], None)
        leaves = [[r.detach().requires_grad_() for r in column] for column in reps]
        with torch.enable_grad():
            loss = self.float_loss([torch.cat(column) for column in leaves], None)
            loss.backward()  # d loss / d embeddings, into the leaves' .grad
        grads = [[leaf.grad for leaf in column] for column in leaves]
        out = loss.detach().requires_grad_()
        out.register_hook(lambda grad: self._second_pass(chunks, states, grads, grad, cast))
        return out

    def _second_pass(self, chunks, states, grads, upstream: Tensor, cast: dict) -> None:
        """Each mini-batch again with a graph, its first pass's dropout and autocast, back-propagating
        the cached d loss / d embedding (times the loss's own upstream gradient) into the encoder."""
        for column, column_states, column_grads in zip(chunks, states, grads):
            for chunk, state, grad in zip(column, column_states, column_grads):
                with torch.enable_grad(), _replayed_rng(state), torch.autocast(**cast):
                    self.encoder(**chunk).float().backward(grad * upstream)
