"""The classes `optimize` gives the model's modules: each subclasses the plain one, adds no
parameter, and changes one thing.

- `PackedBertModel.encode` packs the real tokens of a right-padded batch into (N, H) rows
  (`packing.py`), runs the plain layer loop on them with the `Packing` as the mask, and pads
  the outputs back. Only attention needs the sequences, and it takes them from the packing.
- `PackedSelfAttention` computes query, key and value in one GEMM on packed rows and runs the
  packed attention (`speed/attention.py`); on anything else, the plain path.
- `FusedBertLayer.add_norm` adds the residual in the dense layer's GEMM (`RowStableLinear`,
  `Int8Linear`) where no dropout runs between them.

Shapes: B batch, T time, N real tokens (plus filler rows), H hidden, nh heads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..bert import BertLayer, BertModel, BertSelfAttention, _norm
from ..packing import Packing, pack, pad, unpad, with_filler
from .attention import packed_attention, varlen_attention, varlen_supported
from .gemm import fused_row_stable_linear, row_bucket_multiple, tracing


class PackedSelfAttention(BertSelfAttention):
    batch_invariant: bool = True
    # `qkv`: a submodule `optimize` registers as None; int8 (`quantization.py`) puts query, key and
    # value in one layer there.

    def forward(self, hidden_states, attention_mask=None, output_attentions=False, cache=None):
        """Packed rows (N, H) with their `Packing` as `attention_mask` -> context (N, H), no
        probabilities; anything else as `BertSelfAttention.forward`."""
        if not isinstance(attention_mask, Packing):
            return super().forward(hidden_states, attention_mask, output_attentions, cache)
        packing = attention_mask
        dropout_p = self.dropout.p if self.training else 0.0
        if self.qkv is not None:
            qkv = self.qkv(hidden_states)
        else:  # (N, 3H); oneDNN on a packed weight in inference, F.linear on the stacked weights else
            qkv = fused_row_stable_linear(hidden_states, (self.query, self.key, self.value), self, self.batch_invariant)
        if self.config.attn_implementation == "varlen" and varlen_supported(qkv, dropout_p):
            return varlen_attention(qkv, packing, self.num_attention_heads, self.scaling), None  # (N, H)
        return packed_attention(qkv, packing, self.num_attention_heads, self.scaling, dropout_p), None


class FusedBertLayer(BertLayer):
    def add_norm(self, input, output, dense_layer, dropout, ln_layer):
        """`BertLayer.add_norm`, with the residual added in the dense layer's GEMM epilogue."""
        if not getattr(dense_layer, "fuses_epilogue", False) or (dropout.training and dropout.p > 0):
            return super().add_norm(input, output, dense_layer, dropout, ln_layer)
        return _norm(ln_layer, dense_layer(output, residual=input))


class PackedBertModel(BertModel):
    plain_class = BertModel  # transformers' twin, config.json's architectures
    batch_invariant: bool = True

    def encode(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        cache=None,
    ):
        """`BertModel.encode`, on the N real tokens only where `packing_for` allows it (with
        filler rows up to `MIN_GEMM_ROWS`, which makes every row's result independent of the
        batch, and up to the row counts the GEMMs run on); padding positions of every output
        are zeros."""
        if isinstance(attention_mask, Tensor):
            attention_mask = attention_mask.to(hidden_states.device)
        packing = self.packing_for(attention_mask, output_attentions, hidden_states, cache)
        if packing is None:
            return super().encode(hidden_states, attention_mask, output_hidden_states, output_attentions, cache)
        rows = unpad(hidden_states, packing)  # (N, H)
        rows, packing = with_filler(rows, packing, self._row_multiple(rows))  # (N + F, H)
        rows, all_hidden, _ = super().encode(rows, packing, output_hidden_states)
        all_hidden = tuple(pad(h, packing) for h in all_hidden) if output_hidden_states else None
        return pad(rows, packing), all_hidden, None  # (B, T, H)

    def _row_multiple(self, rows: Tensor) -> int:
        """The packed rows' count is best a multiple of this: the row counts the dense layers run
        their GEMMs on, so that no GEMM pads rows of its own, in buckets that grow with the count
        (`gemm.row_bucket_multiple`), so that a corpus of batches reuses a bounded set of compiled kernels."""
        dense = self.bert_layers[0].interm_dense if len(self.bert_layers) else None
        return row_bucket_multiple(rows.shape[0], dense.row_multiple(rows)) if hasattr(dense, "row_multiple") else 1

    def packing_for(
        self,
        attention_mask: Tensor | None,
        output_attentions: bool = False,
        hidden_states: Tensor | None = None,
        cache=None,
    ) -> Packing | None:
        """The packing of the real tokens when this batch can run unpadded, else None.

        Unpadded execution needs SDPA or varlen (eager is transformers' maths on the padded
        batch), an encoder (no causal mask, no cache), no attention probabilities, and a 2-D
        padding mask, or none (every token of `hidden_states` (B, T, H) real). A batch without padding is packed too when batch-invariant: a
        text then runs the same kernels alone as in any batch. A left-padded batch keeps the
        padded path, because the pooler reads position 0 even where it is padding. Tracing
        keeps it too: packing needs the sequence lengths on the host.
        """
        cfg = self.config
        if cfg.attn_implementation == "eager" or cfg.is_decoder or output_attentions or cache is not None:
            return None
        if tracing() or (attention_mask is None and hidden_states is None):
            return None
        if attention_mask is None and self.batch_invariant:
            attention_mask = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
        if attention_mask is None or attention_mask.dim() != 2 or not bool(attention_mask[:, 0].bool().all()):
            return None
        packing = pack(attention_mask)
        return packing if self.batch_invariant or packing.indices is not None else None
