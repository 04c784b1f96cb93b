"""BERT, written from scratch in the shape of the classic assignment `bert.py`.

`BertSelfAttention` (`transform`, `attention`, `forward`), `BertLayer` (`add_norm`,
`forward`) and `BertModel` (`embed`, `encode`, `forward`) keep that file's structure and
parameter names; the numerics follow `transformers.BertModel` operation for operation, so
the eager path gives the same bits as transformers' eager path on the CPU.

Shapes: B batch, T time (tokens), H hidden size, nh heads, hs head size (H = nh * hs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import fast
from .base_bert import BertPreTrainedModel
from .config import BertConfig
from .utils import additive_mask, get_activation, get_extended_attention_mask


class ModelOutput(dict):
    """A dict whose keys are also attributes: `out["pooler_output"]` or `out.pooler_output`.
    An integer or slice indexes the values that are not None, in order, as transformers'
    `ModelOutput` does, so `model(ids)[0]` is the last hidden state."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, slice)):
            return self.to_tuple()[key]
        return super().__getitem__(key)

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(v for v in self.values() if v is not None)


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.scaling = self.attention_head_size**-0.5  # python float, as HF computes it
        self.is_causal = config.is_decoder

        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.attn_implementation = config.attn_implementation

    def transform(self, x: Tensor, linear_layer: nn.Linear) -> Tensor:
        """Project `x` (B, T, H) and split the heads: (B, nh, T, hs)."""
        B, T = x.shape[:2]
        proj = linear_layer(x)
        return proj.view(B, T, -1, self.attention_head_size).transpose(1, 2)

    def attention(
        self, key: Tensor, query: Tensor, value: Tensor, attention_mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Eager scaled dot-product attention, operation for operation transformers'
        `eager_attention_forward`. `attention_mask` is additive, broadcastable to (B, nh, T, T).
        Returns the context (B, T, H) and the probabilities (B, nh, T, T)."""
        # Scale the raw scores first, then add the mask (finfo.min, never -inf), as HF does.
        scores = torch.matmul(query, key.transpose(2, 3)) * self.scaling  # (B, nh, T, T)
        if attention_mask is not None:
            scores = scores + attention_mask
            if scores.dtype == torch.float16:
                # finfo(fp16).min + a score below -16 rounds to -inf. A row where every entry
                # did is fully masked (all padding) and would softmax to NaN, as it does in
                # transformers; give it finfo.min instead, i.e. the uniform attention that
                # fp32/bf16 give. Rows with any finite entry are left exactly as they are.
                dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
                scores = scores.masked_fill(dead, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1)
        probs = self.dropout(probs)
        context = torch.matmul(probs, value).transpose(1, 2).contiguous()  # (B, T, nh, hs)
        return context.reshape(*context.shape[:2], -1).contiguous(), probs

    def sdpa(self, key: Tensor, query: Tensor, value: Tensor, attention_mask: Tensor | None) -> Tensor:
        """The same function through `F.scaled_dot_product_attention`. `attention_mask` is
        boolean (True = attend) or additive; None with a causal model means plain causal."""
        is_causal = self.is_causal and attention_mask is None and query.shape[2] > 1
        context = F.scaled_dot_product_attention(
            query, key, value,
            attn_mask=attention_mask,
            dropout_p=self.dropout.p if self.training else 0.0,
            scale=self.scaling,
            is_causal=is_causal,
        )  # fmt: skip
        context = context.transpose(1, 2).contiguous()  # (B, T, nh, hs)
        return context.reshape(*context.shape[:2], -1).contiguous()

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor | None = None, output_attentions: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """(B, T, H) -> context (B, T, H), and the attention probabilities when asked for.

        `attention_mask` is prepared (see `get_extended_attention_mask`): boolean or additive.
        SDPA does not expose probabilities, so `output_attentions` runs the eager path even
        when SDPA is configured (transformers' SDPA path instead warns and returns no
        attentions); the outputs then equal transformers' eager outputs."""
        # Query, key, value in transformers' order: the forward does not care, but autograd
        # sums the three gradients into `hidden_states` in reverse order of creation, and this
        # order gives transformers' gradient bits (key-value-query differs by ~1e-5).
        query_layer = self.transform(hidden_states, self.query)
        key_layer = self.transform(hidden_states, self.key)
        value_layer = self.transform(hidden_states, self.value)
        if self.attn_implementation == "sdpa" and not output_attentions:
            return self.sdpa(key_layer, query_layer, value_layer, attention_mask), None
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            attention_mask = additive_mask(attention_mask, query_layer.dtype)
        context, probs = self.attention(key_layer, query_layer, value_layer, attention_mask)
        return context, probs if output_attentions else None


class BertLayer(nn.Module):
    """One transformer block. Runs on its own on (B, T, H) floats with an optional 2-D
    padding mask, or inside `BertModel` with the prepared 4-D mask."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        # Multi-head attention.
        self.self_attention = BertSelfAttention(config)
        # Add-norm after attention.
        self.attention_dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.attention_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention_dropout = nn.Dropout(config.hidden_dropout_prob)
        # Feed forward.
        self.interm_dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.interm_af = get_activation(config.hidden_act)
        # Add-norm after feed forward.
        self.out_dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.out_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.out_dropout = nn.Dropout(config.hidden_dropout_prob)

    def add_norm(
        self, input: Tensor, output: Tensor, dense_layer: nn.Linear, dropout: nn.Dropout, ln_layer: nn.LayerNorm
    ) -> Tensor:
        """Project the sublayer `output`, drop out, add the residual `input`, normalise."""
        return ln_layer(dropout(dense_layer(output)) + input)

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor | None = None, output_attentions: bool = False
    ) -> Tensor | tuple[Tensor, Tensor | None]:
        """(B, T, H) -> (B, T, H); with `output_attentions`, also the (B, nh, T, T) probabilities.

        `attention_mask`: None, a 2-D (B, T) 0/1 padding mask, a 3-D (B, T, T) per-query
        mask, or a 4-D mask already prepared by `get_extended_attention_mask`. A decoder
        (`config.is_decoder`) adds the causal pattern to None, 2-D and 3-D masks.
        """
        if attention_mask is None or attention_mask.dim() < 4:
            attention_mask = self.prepare_mask(attention_mask, hidden_states, output_attentions)
        attn_value, probs = self.self_attention(hidden_states, attention_mask, output_attentions)
        attention_output = self.add_norm(
            hidden_states, attn_value, self.attention_dense, self.attention_dropout, self.attention_layer_norm
        )
        interm = self.interm_af(self.interm_dense(attention_output))
        layer_output = self.add_norm(attention_output, interm, self.out_dense, self.out_dropout, self.out_layer_norm)
        return (layer_output, probs) if output_attentions else layer_output

    def prepare_mask(
        self, attention_mask: Tensor | None, hidden_states: Tensor, output_attentions: bool = False
    ) -> Tensor | None:
        """The 4-D mask for this block's attention path (boolean for SDPA, additive for eager)."""
        return get_extended_attention_mask(
            attention_mask,
            hidden_states.dtype,
            seq_len=hidden_states.shape[1],
            causal=self.config.is_decoder,
            as_bool=self.config.attn_implementation == "sdpa" and not output_attentions,
            device=hidden_states.device,
        )


class BertModel(BertPreTrainedModel):
    """The BERT encoder with embeddings and (optionally) the pooler.

    `forward` returns a `ModelOutput` with `last_hidden_state` (B, T, H), `pooler_output`
    (B, H) or None, `hidden_states` (embeddings plus every layer, when asked for) and
    `attentions` (per-layer probabilities, when asked for).
    """

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.add_pooling_layer = add_pooling_layer
        # Embeddings.
        self.word_embedding = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.pos_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.tk_type_embedding = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.embed_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.embed_dropout = nn.Dropout(config.hidden_dropout_prob)
        # Encoder.
        self.bert_layers = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])
        # Pooler: [CLS] through a dense layer and tanh.
        if add_pooling_layer:
            self.pooler_dense = nn.Linear(config.hidden_size, config.hidden_size)
            self.pooler_af = nn.Tanh()
        self.init_weights()

    def embed(
        self,
        input_ids: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        """Word + token-type + position embeddings, layer-normed: (B, T, H)."""
        if inputs_embeds is None:
            inputs_embeds = self.word_embedding(input_ids)
        B, T = inputs_embeds.shape[:2]
        device = inputs_embeds.device
        if position_ids is None:
            position_ids = torch.arange(T, device=device)[None]  # (1, T)
        if token_type_ids is None:
            token_type_ids = torch.zeros(B, T, dtype=torch.long, device=device)
        # Same additions in the same order as HF: (words + types) + positions.
        embeddings = inputs_embeds + self.tk_type_embedding(token_type_ids)
        embeddings = embeddings + self.pos_embedding(position_ids)
        return self.embed_dropout(self.embed_layer_norm(embeddings))

    def encode(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> tuple[Tensor, tuple[Tensor, ...] | None, tuple[Tensor, ...] | None]:
        """Run every layer. Returns the last hidden state and, when asked for, all hidden
        states (embeddings first) and all attention probabilities.

        With SDPA and a 2-D padding mask (the usual tokenizer batch), the layers run on the
        real tokens only (`fast.encode_unpadded`): dense layers, FFN and LayerNorms on N real
        rows instead of B*T, Q/K/V in one fused matmul. Real-token outputs equal the padded
        path's within fp32 rounding (kernel blocking); padding positions come out as zeros.
        The eager path, decoders, 3-D/4-D masks, `output_attentions`, left-padded batches
        (whose pooler reads a pad position) and `config.unpad_inputs=False` keep the padded
        path, which mirrors transformers operation for operation.
        """
        if self._use_unpadded(attention_mask, output_attentions):
            last, all_hidden = fast.encode_unpadded(
                self.bert_layers,
                hidden_states,
                attention_mask.to(hidden_states.device),  # as the padded path does
                attention=fast.default_attention_kind(hidden_states.device, _compute_dtype(hidden_states), self.training),
                output_hidden_states=output_hidden_states,
            )
            return last, all_hidden, None
        use_bool = self.config.attn_implementation == "sdpa" and not output_attentions
        extended_mask = get_extended_attention_mask(
            attention_mask,
            hidden_states.dtype,
            seq_len=hidden_states.shape[1],
            causal=self.config.is_decoder,
            as_bool=use_bool,
            device=hidden_states.device,
        )
        all_hidden = [hidden_states] if output_hidden_states else None
        all_attn = [] if output_attentions else None
        for layer_module in self.bert_layers:
            if output_attentions:
                hidden_states, probs = layer_module(hidden_states, extended_mask, output_attentions=True)
                all_attn.append(probs)
            else:
                hidden_states = layer_module(hidden_states, extended_mask)
            if output_hidden_states:
                all_hidden.append(hidden_states)
        return (
            hidden_states,
            tuple(all_hidden) if output_hidden_states else None,
            tuple(all_attn) if output_attentions else None,
        )

    def _use_unpadded(self, attention_mask: Tensor | None, output_attentions: bool) -> bool:
        cfg = self.config
        if not cfg.unpad_inputs or cfg.attn_implementation != "sdpa" or attention_mask is None:
            return False
        if not fast.can_use_fast_path(attention_mask, is_decoder=cfg.is_decoder, output_attentions=output_attentions):
            return False
        # Without padding there is nothing to skip, and the padded path is transformers' bit for bit.
        return not bool(attention_mask.bool().all())

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> ModelOutput:
        """`input_ids` (B, T) or `inputs_embeds` (B, T, H), exactly one.

        `attention_mask`: (B, T) 1/0 (int, float or bool), (B, T, T), or a prepared 4-D
        mask. `token_type_ids` default to zeros, `position_ids` to 0..T-1.
        """
        self.check_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        embedding_output = self.embed(input_ids, token_type_ids, position_ids, inputs_embeds)
        sequence_output, hidden_states, attentions = self.encode(
            embedding_output, attention_mask, output_hidden_states, output_attentions
        )
        pooled = None
        if self.add_pooling_layer:
            pooled = self.pooler_af(self.pooler_dense(sequence_output[:, 0]))
        return ModelOutput(
            last_hidden_state=sequence_output,
            pooler_output=pooled,
            hidden_states=hidden_states,
            attentions=attentions,
        )

    def check_inputs(
        self,
        input_ids: Tensor | None,
        attention_mask: Tensor | None,
        token_type_ids: Tensor | None,
        position_ids: Tensor | None,
        inputs_embeds: Tensor | None,
    ) -> None:
        """Reject malformed input with a clear `ValueError` before any kernel runs, so bad
        ids never become a CUDA device-side assert or silent garbage."""
        cfg = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if input_ids is not None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
            if input_ids.is_floating_point():
                raise ValueError("input_ids must be integer token ids, got a floating tensor")
            shape = tuple(input_ids.shape)
        else:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != cfg.hidden_size:
                raise ValueError(
                    f"inputs_embeds must be (batch, seq_len, {cfg.hidden_size}), got {tuple(inputs_embeds.shape)}"
                )
            shape = tuple(inputs_embeds.shape[:2])
        B, T = shape
        if B == 0 or T == 0:
            raise ValueError(f"empty input of shape {shape}: need at least one sequence of at least one token")
        if input_ids is not None:
            _check_range("input_ids", input_ids, cfg.vocab_size, "the vocabulary (vocab_size)")
        if position_ids is None and T > cfg.max_position_embeddings:
            raise ValueError(
                f"sequence length {T} exceeds max_position_embeddings={cfg.max_position_embeddings}; "
                f"truncate the input (e.g. tokenizer truncation to {cfg.max_position_embeddings})"
            )
        if position_ids is not None:
            if position_ids.dim() != 2 or position_ids.shape[-1] != T or position_ids.shape[0] not in (1, B):
                raise ValueError(f"position_ids must be (batch or 1, {T}), got {tuple(position_ids.shape)}")
            _check_range("position_ids", position_ids, cfg.max_position_embeddings, "max_position_embeddings")
        if token_type_ids is not None:
            if tuple(token_type_ids.shape) != shape:
                raise ValueError(f"token_type_ids shape {tuple(token_type_ids.shape)} does not match input {shape}")
            _check_range("token_type_ids", token_type_ids, cfg.type_vocab_size, "type_vocab_size")
        if attention_mask is not None:
            ok = {2: (B, T), 3: (B, T, T)}.get(attention_mask.dim())
            if attention_mask.dim() == 4:
                ok_4d = attention_mask.shape[-2:] == (T, T) and attention_mask.shape[0] in (1, B)
                if not ok_4d:
                    raise ValueError(f"4-D attention_mask must be (batch, 1 or heads, {T}, {T}), got "
                                     f"{tuple(attention_mask.shape)}")  # fmt: skip
            elif tuple(attention_mask.shape) != ok:
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} does not match the input: expected "
                    f"({B}, {T}) (1 = token, 0 = padding) or ({B}, {T}, {T})"
                )


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype matmuls run in: autocast's when it is on for x's device, else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _check_range(name: str, ids: Tensor, upper: int, what: str) -> None:
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be integer ids (torch.long), got {ids.dtype}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= upper:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} contains {bad}, outside [0, {upper}) of {what}; check the tokenizer matches the model")
