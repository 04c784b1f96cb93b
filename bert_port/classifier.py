"""`BertForSequenceClassification`: BERT, dropout on the pooled [CLS] vector, a linear
layer to `num_labels`, and the loss transformers uses for the config's `problem_type`.

Parameter names are `bert.<port name>` for the encoder and `classifier.{weight,bias}` for
the head; checkpoints are read and written under HF's `bert.<HF name>` / `classifier.*`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base_bert import BertPreTrainedModel
from .bert import BertModel
from .config import BertConfig
from .outputs import ModelOutput

IGNORE_INDEX = -100  # cross_entropy's default: a label to leave out of the loss
PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def infer_problem_type(num_labels: int, labels: Tensor) -> str:
    """transformers' rule when `config.problem_type` is unset: one output is regression,
    integer labels are single-label classification, anything else (float multi-hot) is
    multi-label."""
    if num_labels == 1:
        return "regression"
    if labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def per_example_loss(logits: Tensor, labels: Tensor, problem_type: str) -> Tensor:
    """The loss of each example, (B,), such that its mean is transformers' loss for the batch:
    MSE (averaged over outputs), cross-entropy, or BCE-with-logits (averaged over labels).
    The training loop sums these over a global batch, so that gradient accumulation and
    several processes give the same gradient as one large batch."""
    if problem_type == "regression":
        if logits.shape[-1] == 1:  # HF squeezes a single output
            return F.mse_loss(logits.squeeze(-1), labels.reshape(-1).to(logits.dtype), reduction="none")
        return F.mse_loss(logits, labels.to(logits.dtype), reduction="none").mean(-1)
    if problem_type == "single_label_classification":
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), reduction="none")
    if problem_type == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none").mean(-1)
    raise ValueError(f"unknown problem_type {problem_type!r}; use one of {', '.join(PROBLEM_TYPES)}")


class BertForSequenceClassification(BertPreTrainedModel):
    """`forward` returns a `ModelOutput` with `logits` (B, num_labels), `loss` (when
    `labels` are given, else None), `hidden_states` and `attentions` (when asked for)."""

    keys_to_init_if_missing = ("classifier.",)  # a base checkpoint has no head: initialise it and say so
    hf_encoder_prefix = "bert."
    port_encoder_prefix = "bert."
    keeps_sentence_transformers_files = False  # the encoder under a head is no sentence encoder

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=True)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        if not self.classifier.weight.is_meta:  # the encoder initialised itself; only the head is new
            self._init_weights(self.classifier)

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
    ) -> ModelOutput | tuple[Tensor, ...]:
        """Inputs as for `BertModel.forward`. `labels`: (B,) class ids for single-label
        classification, (B,) or (B, num_labels) floats for regression, (B, num_labels)
        multi-hot floats for multi-label classification. `return_dict=False` returns the
        outputs that are not None as a tuple, as transformers does."""
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
        )
        logits = self.classifier(self.dropout(outputs.pooler_output))  # (B, num_labels)
        loss = None
        if labels is not None:
            if self.config.problem_type is None:
                # As transformers does: decided by the first labelled batch and kept in the config.
                self.config.problem_type = infer_problem_type(self.num_labels, labels)
            per_example = per_example_loss(logits, labels, self.config.problem_type)
            if self.config.problem_type == "single_label_classification":
                # cross_entropy's ignore_index (-100) rows count neither in the sum nor the mean.
                loss = per_example.sum() / (labels.view(-1) != IGNORE_INDEX).sum()
            else:
                loss = per_example.mean()
        out = ModelOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        return out.returned(return_dict)
