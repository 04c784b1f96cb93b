"""Task heads on the one `BertModel` body: masked LM, pretraining (MLM + next sentence),
causal LM, token classification and extractive question answering, as transformers
defines them.

Each model holds its encoder as `self.bert` (port names below it, HF's `bert.<name>` in
checkpoints) and its head under transformers' own module names (`cls.predictions.*`,
`cls.seq_relationship.*`, `classifier.*`, `qa_outputs.*`), so head keys read and write
unchanged. The MLM decoder is tied to the word embedding, as in transformers: it is neither
read from nor written to checkpoints, only tied. With `config.tie_word_embeddings=False`
nothing is tied (transformers 5 then ties neither the weight nor the decoder's bias): the
decoder has its own weight and bias, and checkpoints hold them beside `cls.predictions.bias`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import generation
from .base_bert import BertPreTrainedModel
from .bert import BertModel
from .cache import KVCache
from .config import BertConfig
from .losses import IGNORE_INDEX
from .outputs import ModelOutput
from .utils import get_activation

log = logging.getLogger(__name__)

# The tied MLM decoder, in port names: target -> source (see BertPreTrainedModel.tied_weights).
MLM_TIED = {
    "cls.predictions.decoder.weight": "bert.word_embedding.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}


class BertPredictionHeadTransform(nn.Module):
    """Dense, activation, LayerNorm: the hidden states the MLM decoder reads, as wide as the word
    embedding it is tied to (ELECTRA's generator: H -> embedding_size). The activation is the
    family's (`families.Heads.mlm_activation`: RoBERTa's `lm_head` fixes gelu), else `hidden_act`."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        width = config.embedding_width
        self.dense = nn.Linear(config.hidden_size, width)
        self.transform_act_fn = get_activation(config.family.heads.mlm_activation or config.hidden_act)
        self.LayerNorm = nn.LayerNorm(width, eps=config.layer_norm_eps)

    def forward(self, hidden_states: Tensor) -> Tensor:
        dense = self.dense(hidden_states)
        return self.LayerNorm(self.transform_act_fn(dense))


class BertLMPredictionHead(nn.Module):
    """Transform, then the decoder (H -> vocab), whose weight is the word embedding and whose
    bias is `bias`: one output bias per token."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.embedding_width, config.vocab_size, bias=True)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.decoder(self.transform(hidden_states))  # (B, T, vocab)


class BertOnlyMLMHead(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)

    def forward(self, sequence_output: Tensor) -> Tensor:
        return self.predictions(sequence_output)


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, sequence_output: Tensor, pooled_output: Tensor) -> tuple[Tensor, Tensor]:
        return self.predictions(sequence_output), self.seq_relationship(pooled_output)


def _token_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy over every position, -100 left out, as transformers' heads compute it."""
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=IGNORE_INDEX)


class _BertWithHead(BertPreTrainedModel):
    """What the task models share: the encoder as `self.bert` and the head's init."""

    hf_encoder_prefix = "bert."
    port_encoder_prefix = "bert."
    keeps_sentence_transformers_files = False  # the encoder under a head is no sentence encoder

    def _init_head(self, *modules: nn.Module) -> None:
        # The encoder initialised itself; a head built on the meta device (from_pretrained)
        # is filled by the load, or by `loading.materialize_new` when the checkpoint lacks it.
        for module in modules:
            if not any(p.is_meta for p in module.parameters()):
                module.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, BertLMPredictionHead):  # the output bias starts at zero, as in transformers
            with torch.no_grad():
                module.bias.zero_()


class _TiedMLM(_BertWithHead):
    """The MLM decoder (BertForMaskedLM, BertForPreTraining, BertLMHeadModel), tied to the word
    embedding unless `config.tie_word_embeddings` is False."""

    @property
    def tied_weights(self) -> dict[str, str]:
        # Read from the config at each use, as transformers recomputes its mapping from it.
        return MLM_TIED if self.config.tie_word_embeddings else {}

    def get_output_embeddings(self) -> nn.Linear:
        return self.cls.predictions.decoder

    def _resize_output_embeddings(self, new_num: int, mean_resizing: bool) -> None:
        predictions = self.cls.predictions
        with torch.no_grad():
            # New tokens' output bias is zero, whatever `mean_resizing` says: what transformers 5
            # gives its tied decoder (its bias follows the resized decoder, not the mean).
            bias = self._resized(predictions.bias, new_num, mean_resizing=False)
        predictions.bias = nn.Parameter(bias, requires_grad=predictions.bias.requires_grad)
        decoder = predictions.decoder
        decoder.out_features = new_num
        if self.tied_weights:
            return  # the weight is the embedding's, the bias `predictions.bias`: tie_weights() follows
        # Untied, the decoder's own rows are resized as transformers resizes an lm_head: new rows
        # and new bias entries the old ones' mean (transformers draws them around it, with a
        # spread of 1e-9 of the old ones': see BertPreTrainedModel.resize_token_embeddings).
        with torch.no_grad():
            weight = self._resized(decoder.weight, new_num, mean_resizing)
            decoder_bias = self._resized(decoder.bias, new_num, mean_resizing)
        decoder.weight = nn.Parameter(weight, requires_grad=decoder.weight.requires_grad)
        decoder.bias = nn.Parameter(decoder_bias, requires_grad=decoder.bias.requires_grad)


class BertForMaskedLM(_TiedMLM):
    """`forward` returns `logits` (B, T, vocab) and `loss` (cross-entropy over positions whose
    label is not -100, when `labels` are given). No pooler, as in transformers."""

    hf_head_prefixes = ("cls.predictions.",)
    keys_to_init_if_missing = ("cls.predictions.",)  # e.g. a sentence-transformers checkpoint
    head_keys = "masked_lm"  # RoBERTa's lm_head, DistilBERT's vocab_*, ELECTRA's generator: checkpoint.HEAD_TABLES

    def __init__(self, config: BertConfig):
        super().__init__(config)
        if not (config.tie_word_embeddings or config.family.heads.untied_mlm):
            raise ValueError(
                f"an untied {config.family.model_type} MLM head (tie_word_embeddings=false) is not supported: its "
                "output bias is its decoder's own, which the port's head does not hold; load it with transformers"
            )
        self.bert = BertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self._init_head(self.cls)
        self.tie_weights()

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        return_dict: bool | None = None,
    ) -> ModelOutput | tuple:
        """Inputs as for `BertModel.forward`; `labels` (B, T) token ids, -100 where no loss."""
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
        )
        logits = self.cls(outputs.last_hidden_state)  # (B, T, vocab)
        loss = _token_loss(logits, labels) if labels is not None else None
        out = ModelOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        return out.returned(return_dict)


class BertForPreTraining(_TiedMLM):
    """`forward` returns `prediction_logits` (B, T, vocab), `seq_relationship_logits` (B, 2)
    and, given `labels` and `next_sentence_label`, `loss` = MLM loss + next-sentence loss."""

    hf_head_prefixes = ("cls.predictions.", "cls.seq_relationship.")
    keys_to_init_if_missing = ("cls.",)

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=True)
        self.cls = BertPreTrainingHeads(config)
        self._init_head(self.cls)
        self.tie_weights()

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        next_sentence_label: Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        return_dict: bool | None = None,
    ) -> ModelOutput | tuple:
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
        )
        prediction_logits, seq_relationship_logits = self.cls(outputs.last_hidden_state, outputs.pooler_output)
        loss = None
        if labels is not None and next_sentence_label is not None:
            loss = _token_loss(prediction_logits, labels) + _token_loss(seq_relationship_logits, next_sentence_label)
        out = ModelOutput(
            loss=loss,
            prediction_logits=prediction_logits,
            seq_relationship_logits=seq_relationship_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return out.returned(return_dict)


def _causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Next-token cross-entropy as transformers' `ForCausalLMLoss` computes it: in fp32, the
    labels shifted one to the left (the logits at t are scored against `labels[t + 1]`, the
    last position against nothing), -100 left out, the mean over the rest."""
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
    return F.cross_entropy(
        logits.float().view(-1, logits.shape[-1]), shifted.view(-1).to(logits.device), ignore_index=IGNORE_INDEX
    )


class BertLMHeadModel(_TiedMLM):
    """BERT as a causal language model, as transformers' `BertLMHeadModel`: the body with
    `config.is_decoder=True` (each token attends to itself and those before it) under the MLM
    prediction head. `forward` returns `logits` (B, T, vocab) and, given `labels` (B, T),
    `loss`, the next-token cross-entropy (`labels` are the inputs themselves, not shifted;
    -100 where no loss). `generate` continues prompts on a `KVCache` (generation.py)."""

    hf_head_prefixes = ("cls.predictions.",)
    keys_to_init_if_missing = ("cls.predictions.",)  # e.g. an encoder checkpoint turned decoder
    generate = generation.generate

    def __init__(self, config: BertConfig):
        super().__init__(config)
        if not config.is_decoder:
            log.warning(
                "BertLMHeadModel with is_decoder=False attends both ways; set is_decoder=True to use it as a LM"
            )
        self.bert = BertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self._init_head(self.cls)
        self.tie_weights()

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        cache: KVCache | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        return_dict: bool | None = None,
    ) -> ModelOutput | tuple:
        """Inputs as for `BertModel.forward`, `cache` and `use_cache` included (the extended
        cache comes back as `cache`; with `labels`, `use_cache` is off, as in transformers).
        `logits_to_keep` N > 0 runs the head on the last N positions only (generation needs
        one); 0 keeps all."""
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            use_cache=use_cache if labels is None else False,
            cache=cache,
        )
        hidden = outputs.last_hidden_state
        logits = self.cls(hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden)  # (B, T or N, vocab)
        loss = _causal_lm_loss(logits, labels) if labels is not None else None
        out = ModelOutput(
            loss=loss,
            logits=logits,
            cache=outputs.get("cache"),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return out.returned(return_dict)


class BertForTokenClassification(_BertWithHead):
    """`forward` returns `logits` (B, T, num_labels) and, given `labels` (B, T) with -100 on
    positions to leave out (special tokens, continuation word pieces), `loss`."""

    keys_to_init_if_missing = ("classifier.",)

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=False)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self._init_head(self.classifier)

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        return_dict: bool | None = None,
    ) -> ModelOutput | tuple:
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
        )
        hidden = self.dropout(outputs.last_hidden_state)
        logits = self.classifier(hidden)  # (B, T, num_labels)
        loss = _token_loss(logits, labels) if labels is not None else None
        out = ModelOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        return out.returned(return_dict)


class BertForQuestionAnswering(_BertWithHead):
    """`forward` returns `start_logits` and `end_logits` (B, T) of the answer span and, given
    `start_positions` and `end_positions` (B,), `loss`: the mean of the two cross-entropies,
    positions outside the sequence clamped to T and left out, as transformers does."""

    keys_to_init_if_missing = ("qa_outputs.",)

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=False)
        qa_dropout = config.family.heads.qa_dropout  # DistilBERT's; BERT's QA head drops nothing out
        self.dropout = nn.Dropout(config.extra.get(*qa_dropout)) if qa_dropout else nn.Identity()
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self._init_head(self.qa_outputs)

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        start_positions: Tensor | None = None,
        end_positions: Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        return_dict: bool | None = None,
    ) -> ModelOutput | tuple:
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
        )
        logits = self.qa_outputs(self.dropout(outputs.last_hidden_state))  # (B, T, 2)
        start_logits, end_logits = logits.split(1, dim=-1)
        start_logits = start_logits.squeeze(-1).contiguous()  # (B, T)
        end_logits = end_logits.squeeze(-1).contiguous()
        loss = None
        if start_positions is not None and end_positions is not None:
            ignored = start_logits.shape[1]  # answers outside the sequence: clamped here, then ignored
            start = start_positions.view(-1).clamp(0, ignored)
            end = end_positions.view(-1).clamp(0, ignored)
            loss = (
                F.cross_entropy(start_logits, start, ignore_index=ignored)
                + F.cross_entropy(end_logits, end, ignore_index=ignored)
            ) / 2
        out = ModelOutput(
            loss=loss,
            start_logits=start_logits,
            end_logits=end_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return out.returned(return_dict)
