"""The BERT family: the model types that run on the one BERT body, and how each differs, as data.

transformers picks a model's classes by the `model_type` of its config.json. Each family is
BERT with other names and a few small differences, and every difference is a field of `Family`:
the config.json names (DistilBERT's `dim`), the values its code fixes instead of reading them
(DistilBERT's LayerNorm epsilon), the key table its checkpoints use (`checkpoint/keys.py`), and
the differences of arithmetic, which `BertModel.__init__` and `BertModel.embed` read: RoBERTa's
positions after the padding index, ELECTRA's embedding projection (the field `embedding_size`),
DistilBERT's missing token types and pooler. docs/model_families.md says where each one is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# DistilBERT's config.json names of BERT's fields (transformers' DistilBertConfig; its
# `attribute_map` aliases only the first three).
_DISTILBERT_NAMES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "hidden_dim": "intermediate_size",
    "dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob",
    "activation": "hidden_act",
}


@dataclass(frozen=True)
class Family:
    """How one `model_type` differs from BERT."""

    model_type: str
    class_prefix: str  # transformers' class names: "Roberta" + "Model", "Roberta" + "ForTokenClassification"
    encoder_prefix: str  # the encoder's attribute in transformers' task models, as a key prefix ("roberta.")
    key_table: str = "bert"  # the key table of its checkpoints (checkpoint.keys.KEY_TABLES)
    config_names: dict[str, str] = field(default_factory=dict)  # config.json name -> BertConfig field
    fixed: dict[str, Any] = field(default_factory=dict)  # fields its code fixes; never in its config.json
    defaults: dict[str, Any] = field(default_factory=dict)  # transformers' defaults where they are not BERT's
    positions_after_padding: bool = False  # RoBERTa: position ids padding_idx + 1 + cumsum of the real tokens
    pooler: bool = True  # whether transformers' bare model has a pooler
    attention_output_dropout: bool = True  # DistilBERT drops out nothing after the attention's output projection
    # The port's task models whose transformers counterpart computes the same (same head, same keys);
    # None: every one (BERT's own). The sequence classifiers and MLM heads of the others differ.
    tasks: tuple[str, ...] | None = ("BertForTokenClassification", "BertForQuestionAnswering")

    def supports(self, port_class: str) -> bool:
        """Whether a port model class computes this family's transformers counterpart."""
        return self.tasks is None or port_class == "BertModel" or port_class in self.tasks

    def architecture(self, port_class: str) -> str:
        """transformers' class of a port class in this family: BertForTokenClassification ->
        RobertaForTokenClassification."""
        return self.class_prefix + port_class.removeprefix("Bert")


FAMILIES: dict[str, Family] = {
    "bert": Family("bert", "Bert", "bert.", tasks=None),
    # Pre-LN BERT; `BertConfig.pre_norm` says it (see config.py).
    "megatron-bert": Family("megatron-bert", "MegatronBert", "bert.", tasks=None),
    "roberta": Family("roberta", "Roberta", "roberta.", defaults={"pad_token_id": 1}, positions_after_padding=True),
    "xlm-roberta": Family(
        "xlm-roberta", "XLMRoberta", "roberta.", defaults={"pad_token_id": 1}, positions_after_padding=True
    ),
    "distilbert": Family(
        "distilbert",
        "DistilBert",
        "distilbert.",
        key_table="distilbert",
        config_names=_DISTILBERT_NAMES,
        fixed={"type_vocab_size": 0, "layer_norm_eps": 1e-12},  # no token types; eps hard-coded
        pooler=False,
        attention_output_dropout=False,
    ),
    "electra": Family("electra", "Electra", "electra.", defaults={"embedding_size": 128}, pooler=False),
}


def family_of(model_type: str | None) -> Family:
    """The family of a `model_type` (None, as old config.json files leave it: BERT)."""
    return FAMILIES[model_type or "bert"]
