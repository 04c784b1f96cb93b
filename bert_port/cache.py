"""`KVCache`: the keys and values a causal BERT (`config.is_decoder`) has already computed,
so that each generation step runs only its new tokens.

One `LayerCache` per layer holds that layer's keys and values, (B, nh, L, hs) each, L the
tokens seen so far (the prompt's pads included: the attention mask keeps them out). As
transformers' `DynamicCache`, an update concatenates: the cached tensors are contiguous
copies, the layout transformers' cached matmuls see, so the eager path agrees with
transformers' cached forward bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor


class LayerCache:
    """The keys and values one attention layer has seen: (B, nh, L, hs) each, or None."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    @property
    def length(self) -> int:
        """L: how many positions are cached."""
        return 0 if self.keys is None else self.keys.shape[2]

    def update(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Append this step's (B, nh, T, hs) keys and values; return all of them, (B, nh, L + T, hs)."""
        if self.keys is None:
            # A copy even on the first step (the projections are transposed views): the same
            # contiguous layout as every later step and as transformers' cache.
            self.keys, self.values = keys.contiguous(), values.contiguous()
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        return self.keys, self.values


class KVCache:
    """Every layer's `LayerCache`, created empty for a model of `num_layers` layers and filled
    by the forward passes it is given to (`BertModel.forward(..., cache=...)`)."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [LayerCache() for _ in range(num_layers)]

    def get_seq_length(self) -> int:
        """The number of positions cached (transformers' name): where the next tokens start."""
        return self.layers[0].length if self.layers else 0

    def __len__(self) -> int:
        return len(self.layers)
