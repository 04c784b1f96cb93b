"""BERT, written from scratch in the shape of the classic assignment `bert.py`.

`BertSelfAttention` (`transform`, `attention`, `forward`), `BertLayer` (`add_norm`,
`forward`) and `BertModel` (`embed`, `encode`, `forward`) keep that file's structure and
parameter names. This file is plain PyTorch: `nn.Linear` and one attention table
(`attention.py`). It is what runs when nothing is swapped in, and then it follows
`transformers.BertModel` operation for operation; with `attn_implementation="eager"` that is
transformers' eager path itself, bit for bit. With `config.pre_norm` the same modules run in
Megatron-BERT's pre-LN arrangement, following `transformers.MegatronBertModel` the same way.

Speed lives beside the model: `bert_port.speed.optimize(model)` (which `from_pretrained` applies)
swaps in modules that run the layers on the real tokens only, with row-stable GEMMs and C kernels.

Shapes: B batch, T time (tokens), H hidden size, nh heads, hs head size (H = nh * hs).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .attention import ATTENTION_FUNCTIONS, eager_attention
from .base_bert import BertPreTrainedModel
from .cache import KVCache, LayerCache
from .config import BertConfig
from .outputs import ModelOutput
from .utils import get_activation, get_extended_attention_mask, roberta_position_ids
from .validation import check_inputs


def prepare_mask(
    config: BertConfig,
    attention_mask: Tensor | None,
    hidden_states: Tensor,
    output_attentions: bool = False,
    past_length: int = 0,
) -> Tensor | None:
    """The 4-D mask the attention of (B, T, H) `hidden_states` uses: boolean for SDPA,
    additive for eager (which `output_attentions` runs), causal for a decoder, over the
    `past_length` cached positions and the T new ones. A swapped-in attention's own mask
    (`bert_port.speed`'s packing) passes through."""
    if attention_mask is not None and not isinstance(attention_mask, Tensor):
        return attention_mask
    return get_extended_attention_mask(
        attention_mask,
        hidden_states.dtype,
        seq_len=hidden_states.shape[1],
        causal=config.is_decoder,
        as_bool=config.attn_implementation != "eager" and not output_attentions,
        device=hidden_states.device,
        past_length=past_length,
    )


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
        # Read at every call, as transformers does: `config.attn_implementation` names the
        # attention function (attention.py's table).
        self.config = config

    def transform(self, x: Tensor, linear_layer: nn.Linear) -> Tensor:
        """Project `x` (B, T, H) and split the heads: (B, nh, T, hs)."""
        B, T = x.shape[:2]
        proj = linear_layer(x)
        return proj.view(B, T, -1, self.attention_head_size).transpose(1, 2)

    def attention(
        self, key: Tensor, query: Tensor, value: Tensor, attention_mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Eager scaled dot-product attention, operation for operation transformers'
        `eager_attention_forward`. `attention_mask` is additive (or boolean), broadcastable to
        (B, nh, T, T). Returns the context (B, T, H) and the probabilities (B, nh, T, T)."""
        return eager_attention(query, key, value, attention_mask, self.scaling, self.dropout)

    def causal_without_mask(self, query: Tensor, attention_mask: Tensor | None) -> bool:
        """Whether SDPA applies the causal pattern itself: a decoder given no mask, on more than one query."""
        return self.is_causal and attention_mask is None and query.shape[2] > 1

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        output_attentions: bool = False,
        cache: LayerCache | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """(B, T, H) -> context (B, T, H), and the probabilities (B, nh, T, T) when asked for.
        With `cache` (a decoder generating), the T new queries attend to the P cached keys and
        values and their own, which the cache keeps: probabilities (B, nh, T, P + T).

        `attention_mask` is prepared (see `get_extended_attention_mask`), boolean or additive.
        SDPA does not expose probabilities, so `output_attentions` runs the eager path even
        when SDPA is configured (transformers' SDPA path instead warns and returns none)."""
        # Query, key, value in transformers' order: the forward does not care, but autograd
        # sums the three gradients into `hidden_states` in reverse order of creation, and this
        # order gives transformers' gradient bits (key-value-query differs by ~1e-5).
        query_layer = self.transform(hidden_states, self.query)  # (B, nh, T, hs)
        key_layer = self.transform(hidden_states, self.key)
        value_layer = self.transform(hidden_states, self.value)
        if cache is not None:
            key_layer, value_layer = cache.update(key_layer, value_layer)  # (B, nh, P + T, hs)
        implementation = "eager" if output_attentions else self.config.attn_implementation
        context, probs = ATTENTION_FUNCTIONS[implementation](self, query_layer, key_layer, value_layer, attention_mask)
        return context, probs if output_attentions else None


def _layer_norm(config: BertConfig) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


def _norm(layer_norm: nn.LayerNorm | None, x: Tensor) -> Tensor:
    """`layer_norm(x)`, or `x` where the arrangement has no LayerNorm at this place."""
    return x if layer_norm is None else layer_norm(x)


class BertLayer(nn.Module):
    """One transformer block, post-LN as in BERT or pre-LN as in Megatron-BERT
    (`config.pre_norm`). Runs on its own on (B, T, H) floats with an optional 2-D padding
    mask, or inside `BertModel` with the prepared 4-D mask."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        # Each sublayer has one LayerNorm: after the residual addition in BERT (post-LN), or on
        # the sublayer's input in Megatron-BERT (`config.pre_norm`), whose residual stream
        # x + f(LayerNorm(x)) is never normalised. The other one of each pair is None.
        pre_norm = config.pre_norm
        # Multi-head attention.
        self.pre_attention_layer_norm = _layer_norm(config) if pre_norm else None
        self.self_attention = BertSelfAttention(config)
        # Add-norm after attention.
        self.attention_dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.attention_layer_norm = None if pre_norm else _layer_norm(config)
        self.attention_dropout = nn.Dropout(config.hidden_dropout_prob)
        # Feed forward.
        self.pre_ffn_layer_norm = _layer_norm(config) if pre_norm else None
        self.interm_dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.interm_af = get_activation(config.hidden_act)
        # Add-norm after feed forward.
        self.out_dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.out_layer_norm = None if pre_norm else _layer_norm(config)
        self.out_dropout = nn.Dropout(config.hidden_dropout_prob)

    def add_norm(
        self, input: Tensor, output: Tensor, dense_layer: nn.Linear, dropout: nn.Dropout, ln_layer: nn.LayerNorm | None
    ) -> Tensor:
        """Project the sublayer `output`, drop out, add the residual `input`, normalise (post-LN;
        a pre-LN layer passes `ln_layer` None: it normalised the sublayer's input instead)."""
        return _norm(ln_layer, dropout(dense_layer(output)) + input)

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        output_attentions: bool = False,
        cache: LayerCache | None = None,
    ) -> Tensor | tuple[Tensor, Tensor | None]:
        """(B, T, H) -> (B, T, H); with `output_attentions`, also the (B, nh, T, T) probabilities. `cache`: this
        layer's keys and values of earlier steps (decoder generation), extended in place.

        `attention_mask`: None, a 2-D (B, T) 0/1 padding mask, a 3-D (B, T, T) per-query
        mask, or a 4-D mask already prepared by `get_extended_attention_mask`. A decoder
        (`config.is_decoder`) adds the causal pattern to None, 2-D and 3-D masks.
        """
        if attention_mask is None or (isinstance(attention_mask, Tensor) and attention_mask.dim() < 4):
            past = cache.length if cache is not None else 0
            attention_mask = prepare_mask(self.config, attention_mask, hidden_states, output_attentions, past)
        attn_input = _norm(self.pre_attention_layer_norm, hidden_states)  # pre-LN; else hidden_states itself
        attn_value, probs = self.self_attention(attn_input, attention_mask, output_attentions, cache)
        attention_output = self.add_norm(
            hidden_states, attn_value, self.attention_dense, self.attention_dropout, self.attention_layer_norm
        )
        interm = self.interm_af(self.interm_dense(_norm(self.pre_ffn_layer_norm, attention_output)))
        layer_output = self.add_norm(attention_output, interm, self.out_dense, self.out_dropout, self.out_layer_norm)
        return (layer_output, probs) if output_attentions else layer_output


class BertModel(BertPreTrainedModel):
    """The BERT encoder with embeddings and (optionally) the pooler.

    `forward` returns a `ModelOutput` with `last_hidden_state` (B, T, H), `pooler_output`
    (B, H) or None, `hidden_states` (embeddings plus every layer, when asked for) and
    `attentions` (per-layer probabilities, when asked for).
    """

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        family = config.family  # how this model type differs from BERT (families.FAMILIES)
        self.add_pooling_layer = add_pooling_layer and family.pooler
        # Embeddings, of embedding_width E (ELECTRA's embedding_size; else H). RoBERTa's position
        # table has a padding row too; DistilBERT (type_vocab_size 0) has no token types.
        E, pad = config.embedding_width, config.pad_token_id
        self.word_embedding = nn.Embedding(config.vocab_size, E, padding_idx=pad)
        self.pos_embedding = nn.Embedding(
            config.max_position_embeddings, E, padding_idx=pad if family.positions_after_padding else None
        )
        self.tk_type_embedding = nn.Embedding(config.type_vocab_size, E) if config.type_vocab_size else None
        # Pre-LN (Megatron-BERT) leaves the embeddings to the first layer's LayerNorm.
        self.embed_layer_norm = None if config.pre_norm else nn.LayerNorm(E, eps=config.layer_norm_eps)
        self.embed_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.embed_project = nn.Linear(E, config.hidden_size) if E != config.hidden_size else None  # ELECTRA
        # Encoder. Pre-LN normalises the residual stream once, at the end.
        self.bert_layers = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])
        if not family.attention_output_dropout:  # DistilBERT: no dropout after the attention's projection
            for layer in self.bert_layers:
                layer.attention_dropout.p = 0.0
        self.final_layer_norm = _layer_norm(config) if config.pre_norm else None
        # Pooler: [CLS] through a dense layer and tanh.
        if self.add_pooling_layer:  # none in DistilBERT and ELECTRA
            self.pooler_dense = nn.Linear(config.hidden_size, config.hidden_size)
            self.pooler_af = nn.Tanh()
        self.init_weights()

    def embed(
        self,
        input_ids: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        past_length: int = 0,
    ) -> Tensor:
        """Word + token-type + position embeddings, layer-normed (post-LN only), projected to H
        (ELECTRA): (B, T, H). Positions default to P..P+T-1 after `past_length` (P) cached ones;
        RoBERTa's to padding_idx + 1 + the count of real tokens so far (`roberta_position_ids`)."""
        if position_ids is None and self.config.family.positions_after_padding:
            position_ids = roberta_position_ids(input_ids, inputs_embeds, self.config.pad_token_id, past_length)
        if inputs_embeds is None:
            inputs_embeds = self.word_embedding(input_ids)
        B, T = inputs_embeds.shape[:2]
        device = inputs_embeds.device
        if position_ids is None:
            position_ids = torch.arange(past_length, past_length + T, device=device)[None]  # (1, T)
        if token_type_ids is None:
            token_type_ids = torch.zeros(B, T, dtype=torch.long, device=device)
        # Same additions in the same order as HF: (words + types) + positions; DistilBERT has no types.
        embeddings = inputs_embeds
        if self.tk_type_embedding is not None:
            embeddings = embeddings + self.tk_type_embedding(token_type_ids)
        embeddings = embeddings + self.pos_embedding(position_ids)
        embeddings = self.embed_dropout(_norm(self.embed_layer_norm, embeddings))
        return embeddings if self.embed_project is None else self.embed_project(embeddings)  # ELECTRA: E -> H

    def encode(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        cache: KVCache | None = None,
    ) -> tuple[Tensor, tuple[Tensor, ...] | None, tuple[Tensor, ...] | None]:
        """Run every layer (and, pre-LN, the final LayerNorm): (B, T, H) -> (B, T, H). Also
        returns, when asked for, all hidden states (embeddings first; pre-LN, the last one
        normalised, as in Megatron-BERT) and all attention probabilities. A decoder's `cache`
        gives each layer the keys and values of the earlier steps and takes this step's."""
        if isinstance(attention_mask, Tensor):
            attention_mask = attention_mask.to(hidden_states.device)
        past = cache.get_seq_length() if cache is not None else 0
        extended_mask = prepare_mask(self.config, attention_mask, hidden_states, output_attentions, past)
        all_hidden = [hidden_states] if output_hidden_states else None
        all_attn = [] if output_attentions else None
        for i, layer in enumerate(self.bert_layers):
            layer_cache = cache.layers[i] if cache is not None else None
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                # gradient_checkpointing_enable(): keep only the layer's input, recompute the rest
                # in backward (non-reentrant: restores the RNG, so dropout masks are the same).
                layer = functools.partial(checkpoint, layer, use_reentrant=False)
            if output_attentions:
                hidden_states, probs = layer(hidden_states, extended_mask, output_attentions=True, cache=layer_cache)
                all_attn.append(probs)
            else:
                hidden_states = layer(hidden_states, extended_mask, cache=layer_cache)
            if output_hidden_states:
                all_hidden.append(hidden_states)
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
            all_hidden = all_hidden[:-1] + [hidden_states] if output_hidden_states else None
        return (
            hidden_states,
            tuple(all_hidden) if output_hidden_states else None,
            tuple(all_attn) if output_attentions else None,
        )

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        return_dict: bool | None = None,
        use_cache: bool | None = None,
        cache: KVCache | None = None,
    ) -> ModelOutput | tuple[Tensor, ...]:
        """`input_ids` (B, T) or `inputs_embeds` (B, T, H), exactly one.

        `attention_mask`: (B, T) 1/0 (int, float or bool), (B, T, T), or a prepared 4-D
        mask. `token_type_ids` default to zeros, `position_ids` to 0..T-1.
        `return_dict=False` returns the outputs that are not None as a tuple, as transformers
        does. A decoder (`config.is_decoder`) given `cache` (a `KVCache`), or `use_cache=True`
        for a new one, runs only the T new tokens after the P cached ones (positions P..P+T-1,
        a 2-D mask covering all P + T) and returns the extended cache as `cache`. An encoder
        ignores `use_cache`, as transformers does; without either, nothing is cached.
        """
        cache = self._cache_for(cache, use_cache)
        past = cache.get_seq_length() if cache is not None else 0
        check_inputs(self.config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, past)
        embedding_output = self.embed(input_ids, token_type_ids, position_ids, inputs_embeds, past)
        sequence_output, hidden_states, attentions = self.encode(
            embedding_output, attention_mask, output_hidden_states, output_attentions, cache
        )
        pooled = None
        if self.add_pooling_layer:
            pooled = self.pooler_af(self.pooler_dense(sequence_output[:, 0]))  # [CLS]
        out = ModelOutput(
            last_hidden_state=sequence_output,
            pooler_output=pooled,
            hidden_states=hidden_states,
            attentions=attentions,
        )
        if cache is not None:
            out["cache"] = cache
        return out.returned(return_dict)

    def _cache_for(self, cache: KVCache | None, use_cache: bool | None) -> KVCache | None:
        """The cache a forward fills: the one given, a new one for `use_cache=True` on a decoder."""
        if cache is not None and not self.config.is_decoder:
            raise ValueError(
                "a KV cache needs causal self-attention: this model's config has is_decoder=False, so every "
                "token attends to later ones and cached keys would be stale; set is_decoder=True"
            )
        if cache is not None and len(cache) != self.config.num_hidden_layers:
            raise ValueError(
                f"the KV cache has {len(cache)} layers, the model {self.config.num_hidden_layers}; "
                "pass KVCache(model.config.num_hidden_layers), or use_cache=True for a new one"
            )
        recomputing = self.gradient_checkpointing and self.training  # a recomputed layer would append twice
        if cache is not None and recomputing:
            raise ValueError("a KV cache cannot be filled under gradient checkpointing in training; call model.eval()")
        if cache is None and use_cache and self.config.is_decoder and not recomputing:  # transformers drops it too
            cache = KVCache(self.config.num_hidden_layers)
        return cache
