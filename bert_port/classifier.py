"""`BertForSequenceClassification`: BERT, dropout on the pooled [CLS] vector, a linear
layer to `num_labels`, and the loss transformers uses for the config's `problem_type`
(`bert_port.losses`).

Parameter names are `bert.<port name>` for the encoder and `classifier.{weight,bias}` for
the head; checkpoints are read and written under HF's `bert.<HF name>` / `classifier.*`.
"""

from __future__ import annotations

from torch import Tensor, nn

from .bert import BertModel
from .config import BertConfig
from .heads import _BertWithHead
from .losses import IGNORE_INDEX, batch_loss, infer_problem_type, per_example_loss
from .outputs import ModelOutput

__all__ = ["IGNORE_INDEX", "BertForSequenceClassification", "per_example_loss"]


class BertForSequenceClassification(_BertWithHead):
    """`forward` returns a `ModelOutput` with `logits` (B, num_labels), `loss` (when
    `labels` are given, else None), `hidden_states` and `attentions` (when asked for)."""

    keys_to_init_if_missing = ("classifier.",)  # a base checkpoint has no head: initialise it and say so

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=True)
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
        pooled = self.dropout(outputs.pooler_output)
        logits = self.classifier(pooled)  # (B, num_labels)
        loss = None
        if labels is not None:
            if self.config.problem_type is None:
                # As transformers does: decided by the first labelled batch and kept in the config.
                self.config.problem_type = infer_problem_type(self.num_labels, labels)
            loss = batch_loss(logits, labels, self.config.problem_type)
        out = ModelOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        return out.returned(return_dict)
