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

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

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
class Heads:
    """How a family's task heads compute, where it is not BERT's: what `classifier.py` and
    `heads.py` read. Their key names are data too, in `checkpoint.keys.HEAD_TABLES`."""

    # Sequence classification. None: BERT's pooled [CLS] -> dropout -> classifier. Else transformers'
    # first token -> dropout (when `dropout_first`) -> pre_classifier -> this activation -> dropout ->
    # classifier: RoBERTa's tanh, ELECTRA's gelu, DistilBERT's relu (its `pre_classifier`).
    sequence_activation: str | None = None
    dropout_first: bool = False
    # The config.json field of the classifier's dropout, and its default, where not BERT's
    # `classifier_dropout` or `hidden_dropout_prob` (DistilBERT's `seq_classif_dropout`).
    sequence_dropout: tuple[str, float] | None = None
    # The question-answering head's dropout on the hidden states, as (config.json field, default);
    # None: none, as BERT's. DistilBERT's `qa_dropout`.
    qa_dropout: tuple[str, float] | None = None
    # The MLM transform's activation; None: `hidden_act` (BERT, DistilBERT). RoBERTa's `lm_head` and
    # ELECTRA's generator fix gelu.
    mlm_activation: str | None = None
    # Whether the port computes the family's MLM decoder untied (`tie_word_embeddings` false): RoBERTa's
    # decoder keeps a bias of its own as BERT's does; DistilBERT's and ELECTRA's bias is the decoder's.
    untied_mlm: bool = True


# The port's task models, beside BertModel, that every family of the table computes as transformers does.
TASKS = ("BertForSequenceClassification", "BertForTokenClassification", "BertForQuestionAnswering", "BertForMaskedLM")


@dataclass(frozen=True)
class Family:
    """How one `model_type` differs from BERT."""

    model_type: str
    class_prefix: str  # transformers' class names: "Roberta" + "Model", "Roberta" + "ForTokenClassification"
    encoder_prefix: str  # the encoder's attribute in transformers' task models, as a key prefix ("roberta.")
    key_table: str = "bert"  # the key table of its checkpoints (checkpoint.keys.KEY_TABLES, HEAD_TABLES)
    config_names: dict[str, str] = field(default_factory=dict)  # config.json name -> BertConfig field
    fixed: dict[str, Any] = field(default_factory=dict)  # fields its code fixes; never in its config.json
    defaults: dict[str, Any] = field(default_factory=dict)  # transformers' defaults where they are not BERT's
    positions_after_padding: bool = False  # RoBERTa: position ids padding_idx + 1 + cumsum of the real tokens
    pooler: bool = True  # whether transformers' bare model has a pooler
    attention_output_dropout: bool = True  # DistilBERT drops out nothing after the attention's output projection
    heads: Heads = Heads()  # how its task heads compute
    # The port's task models whose transformers counterpart computes the same; None: every `Bert*` one
    # (BERT's own). The others' BertForPreTraining (no next-sentence head) and BertLMHeadModel are refused.
    tasks: tuple[str, ...] | None = TASKS

    def supports(self, port_class: str) -> bool:
        """Whether a port model class computes this family's transformers counterpart."""
        if self.tasks is None:
            return port_class.startswith("Bert")
        return port_class == "BertModel" or port_class in self.tasks

    def positions_problem(self, pad_token_id: object, max_position_embeddings: object) -> str | None:
        """What is wrong when the family's positions start after the padding index (RoBERTa's
        pad_token_id + 1) and that leaves no position for a token; None otherwise."""
        if not self.positions_after_padding or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in (pad_token_id, max_position_embeddings)
        ):
            return None
        if max_position_embeddings - pad_token_id - 1 >= 1:
            return None
        return (
            f"pad_token_id {pad_token_id} leaves no position for a token: {self.model_type} positions start after the "
            f"padding index, at {pad_token_id + 1}, and max_position_embeddings is {max_position_embeddings}. Restore "
            "pad_token_id (RoBERTa's is 1) or max_position_embeddings from the original checkpoint"
        )

    def architecture(self, port_class: str) -> str:
        """transformers' class of a port class in this family: BertForTokenClassification ->
        RobertaForTokenClassification; a port class named after its family (ElectraForPreTraining) itself."""
        if port_class.startswith(self.class_prefix):
            return port_class
        return self.class_prefix + port_class.removeprefix("Bert")


# RoBERTa's and XLM-R's heads: the classifier's dense + tanh on <s>, the MLM transform's fixed gelu.
_ROBERTA_HEADS = Heads(sequence_activation="tanh", dropout_first=True, mlm_activation="gelu")

FAMILIES: dict[str, Family] = {
    "bert": Family("bert", "Bert", "bert.", tasks=None),
    # Pre-LN BERT; `BertConfig.pre_norm` says it (see config.py).
    "megatron-bert": Family("megatron-bert", "MegatronBert", "bert.", tasks=None),
    "roberta": Family(
        "roberta",
        "Roberta",
        "roberta.",
        key_table="roberta",
        defaults={"pad_token_id": 1},
        positions_after_padding=True,
        heads=_ROBERTA_HEADS,
    ),
    "xlm-roberta": Family(
        "xlm-roberta",
        "XLMRoberta",
        "roberta.",
        key_table="roberta",
        defaults={"pad_token_id": 1},
        positions_after_padding=True,
        heads=_ROBERTA_HEADS,
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
        heads=Heads(
            sequence_activation="relu",
            sequence_dropout=("seq_classif_dropout", 0.2),
            qa_dropout=("qa_dropout", 0.1),
            untied_mlm=False,
        ),
    ),
    "electra": Family(
        "electra",
        "Electra",
        "electra.",
        key_table="electra",
        defaults={"embedding_size": 128},
        pooler=False,
        heads=Heads(sequence_activation="gelu", dropout_first=True, mlm_activation="gelu", untied_mlm=False),
        tasks=(*TASKS, "ElectraForPreTraining"),  # the discriminator (discriminator.py)
    ),
}


def family_of(model_type: str | None, architectures: object = None) -> Family:
    """The family of a `model_type`. A config.json without one (as old ones are) is read from
    its `architectures` when every class there is one family's, and the log says so; classes of
    several families, or of none this port computes, are a `ValueError` (transformers' AutoConfig
    refuses every config.json without a `model_type`). Neither: BERT, as `transformers.BertConfig` reads it."""
    if model_type or not architectures:
        return FAMILIES[model_type or "bert"]
    names = list(architectures) if isinstance(architectures, (list, tuple)) else [architectures]
    found = {name: _family_of_class(name) for name in names}
    families = {f.model_type for f in found.values() if f is not None}
    if len(families) != 1 or None in found.values():
        unknown = [repr(n) for n, f in found.items() if f is None]
        why = f"{', '.join(unknown)} of no family this port computes" if unknown else "classes of several families"
        raise ValueError(
            f"config.json has no model_type, and its architectures {names} name {why}; add the model_type of the "
            f"model (one of {', '.join(map(repr, FAMILIES))}) to config.json, or load it with transformers"
        )
    family = FAMILIES[families.pop()]
    log.warning(
        "config.json has no model_type; its architectures %s are %s classes, so it is read as model_type %r. "
        "Add that model_type to config.json to say so",
        names,
        family.class_prefix,
        family.model_type,
    )
    return family


def _family_of_class(name: object) -> Family | None:
    """The family of a transformers class name (`RobertaForMaskedLM`: RoBERTa), or None."""
    if not isinstance(name, str):
        return None
    for family in FAMILIES.values():
        rest = name.removeprefix(family.class_prefix)
        if rest != name and (rest in ("Model", "LMHeadModel") or rest.startswith("For")):
            return family
    return None
