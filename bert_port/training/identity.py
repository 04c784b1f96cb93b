"""The identity task: one `BertLayer` trained to return its input, which a pre-LN layer learns
and a post-LN one cannot.

A pre-LN layer computes x + f(LayerNorm(x)) + g(...): the input reaches the output on a path
that nothing normalises, so the identity is the layer with its two output projections at zero,
and Adam finds it. A post-LN layer ends in a LayerNorm, so each output token has the mean and
spread its LayerNorm's weight and bias give it, whatever the input's: the best it can do is
about LayerNorm(x), whose L1 distance from x (`layer_norm_loss`, about 0.21 for hidden size 20)
is where it stalls. `scripts/identity_task.py` prints both curves.

Shapes: B batch, T time (tokens), H hidden size; inputs are (B, T, H) = `SHAPE`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..bert import BertLayer
from ..config import BertConfig

SHAPE = (128, 10, 20)  # (B, T, H) of every batch


def identity_config(pre_norm: bool = True) -> BertConfig:
    """One layer of hidden size 20 (4 heads of 5), tanh GELU, no dropout: nothing random but
    the inputs and the initial weights."""
    return BertConfig(
        vocab_size=1,  # the layer reads hidden states, never tokens
        hidden_size=SHAPE[2],
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=4 * SHAPE[2],
        hidden_act="gelu_pytorch_tanh",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=SHAPE[1],
        pre_norm=pre_norm,
    )


@dataclass(frozen=True)
class IdentityRun:
    """A run's L1 loss before each step (each on a batch it has not seen yet), and the two
    levels to read it against, measured on one more fresh batch: `zeros_loss`, predicting zeros
    (mean |x|, about 0.80), and `layer_norm_loss`, predicting LayerNorm(x), where post-LN stalls."""

    losses: list[float]
    zeros_loss: float
    layer_norm_loss: float

    def final_loss(self, last: int = 10) -> float:
        """The mean loss of the last `last` steps: one step's batch is noisy."""
        tail = self.losses[-last:]
        return sum(tail) / len(tail)


def train_identity(pre_norm: bool = True, steps: int = 200, lr: float = 1e-3, seed: int = 0) -> IdentityRun:
    """Train a fresh `BertLayer` (PyTorch's default init, seeded) to map each (B, T, H) batch of
    standard normal inputs to itself: L1 loss, Adam at `lr`, a new batch every step, on the CPU.
    The same `seed` gives the same run."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    torch.manual_seed(seed)
    layer = BertLayer(identity_config(pre_norm))
    inputs = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(layer.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        x = torch.randn(SHAPE, generator=inputs)  # (B, T, H)
        loss = F.l1_loss(layer(x), x)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    x = torch.randn(SHAPE, generator=inputs)
    return IdentityRun(
        losses=losses,
        zeros_loss=x.abs().mean().item(),
        layer_norm_loss=F.l1_loss(F.layer_norm(x, x.shape[-1:]), x).item(),
    )
