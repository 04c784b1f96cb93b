"""`ElectraForPreTraining`: ELECTRA's discriminator on the one body, as transformers defines it.

ELECTRA is pretrained by replaced-token detection: the discriminator scores every token as original
(logit < 0) or replaced by the generator (> 0). Its head, `discriminator_predictions`, is dense,
`hidden_act`, then a dense layer to one logit per token; its names are transformers' own, so they
read and write unchanged. Only ELECTRA checkpoints build it (`families.FAMILIES["electra"].tasks`).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .bert import BertModel
from .config import BertConfig
from .heads import _BertWithHead
from .outputs import ModelOutput
from .utils import get_activation


class ElectraDiscriminatorPredictions(nn.Module):
    """(B, T, H) -> (B, T): dense, activation, one logit per token."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = get_activation(config.hidden_act)
        self.dense_prediction = nn.Linear(config.hidden_size, 1)

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.dense_prediction(self.activation(self.dense(hidden_states))).squeeze(-1)


class ElectraForPreTraining(_BertWithHead):
    """`forward` returns `logits` (B, T), one replaced-token score per token, and, given `labels`
    (B, T) 1 for replaced and 0 for original, `loss`: the binary cross-entropy over the tokens the
    attention mask keeps (all when there is none), as transformers computes it."""

    keys_to_init_if_missing = ("discriminator_predictions.",)

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.discriminator_predictions = ElectraDiscriminatorPredictions(config)
        self._init_head(self.discriminator_predictions)

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
        """Inputs as for `BertModel.forward`; `labels` (B, T) 0/1."""
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
        )
        logits = self.discriminator_predictions(outputs.last_hidden_state)  # (B, T)
        loss = None
        if labels is not None:
            active = attention_mask == 1 if attention_mask is not None and attention_mask.dim() == 2 else None
            scored, targets = (logits[active], labels[active]) if active is not None else (logits, labels)
            loss = F.binary_cross_entropy_with_logits(scored, targets.float())
        out = ModelOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        return out.returned(return_dict)
