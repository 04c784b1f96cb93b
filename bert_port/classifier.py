"""`BertForSequenceClassification`: BERT, dropout on the pooled [CLS] vector, a linear
layer to `num_labels`, and the loss transformers uses for the config's `problem_type`
(`bert_port.losses`). The other families' classifiers read the first token
through a dense layer of their own, `pre_classifier`, as their `families.Heads` say:
RoBERTa's and ELECTRA's `classifier.dense` (tanh, gelu), DistilBERT's `pre_classifier` (relu).

Parameter names are `bert.<port name>` for the encoder and `classifier.{weight,bias}` (and
`pre_classifier.*`) for the head; checkpoints are read and written under the family's HF names
(`bert.<HF name>` / `classifier.*`; RoBERTa's `classifier.out_proj.*`: `checkpoint.HEAD_TABLES`).
"""

from __future__ import annotations

from torch import Tensor, nn

from .bert import BertModel
from .config import BertConfig
from .heads import _BertWithHead
from .losses import IGNORE_INDEX, batch_loss, infer_problem_type, per_example_loss
from .outputs import ModelOutput
from .utils import get_activation

__all__ = ["IGNORE_INDEX", "BertForSequenceClassification", "per_example_loss"]


class BertForSequenceClassification(_BertWithHead):
    """`forward` returns a `ModelOutput` with `logits` (B, num_labels), `loss` (when
    `labels` are given, else None), `hidden_states` and `attentions` (when asked for)."""

    keys_to_init_if_missing = ("classifier.", "pre_classifier.")  # a base checkpoint has no head: initialise it
    head_keys = "sequence"

    def __init__(self, config: BertConfig):
        super().__init__(config)
        heads = config.family.heads
        self.num_labels = config.num_labels
        first_token = heads.sequence_activation is not None  # else BERT's pooler reads [CLS]
        self.bert = BertModel(config, add_pooling_layer=not first_token)
        dropout = config.classifier_dropout
        if dropout is None and heads.sequence_dropout is not None:  # DistilBERT's seq_classif_dropout
            dropout = config.extra.get(*heads.sequence_dropout)
        dropout = dropout if dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.pre_classifier = nn.Linear(config.hidden_size, config.hidden_size) if first_token else None
        self.pre_classifier_af = get_activation(heads.sequence_activation) if first_token else None
        self.first_dropout = nn.Dropout(dropout) if heads.dropout_first else nn.Identity()  # RoBERTa, ELECTRA
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self._init_head(*(m for m in (self.pre_classifier, self.classifier) if m is not None))

    def pool(self, outputs: ModelOutput) -> Tensor:
        """The (B, H) vector the classifier reads: BERT's pooled [CLS], or the family's first token
        through `pre_classifier` and its activation (transformers' `RobertaClassificationHead`)."""
        if self.pre_classifier is None:
            return outputs.pooler_output
        first = self.first_dropout(outputs.last_hidden_state[:, 0])  # (B, H): <s> or [CLS]
        return self.pre_classifier_af(self.pre_classifier(first))

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
        pooled = self.dropout(self.pool(outputs))
        logits = self.classifier(pooled)  # (B, num_labels)
        loss = None
        if labels is not None:
            if self.config.problem_type is None:
                # As transformers does: decided by the first labelled batch and kept in the config.
                self.config.problem_type = infer_problem_type(self.num_labels, labels)
            loss = batch_loss(logits, labels, self.config.problem_type)
        out = ModelOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        return out.returned(return_dict)
