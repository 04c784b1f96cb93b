"""The key names of the BERT family's other members, as data: DistilBERT's encoder, and the task
heads of RoBERTa, XLM-R, DistilBERT and ELECTRA whose names are not BERT's. `keys.py` holds BERT's
table and reads these through `KEY_TABLES` and `head_table`; the inverses are derived there."""

from __future__ import annotations

# DistilBERT's names (transformers' DistilBertModel): no token types, no pooler, no pre-LN.
DISTILBERT_TO_PORT: dict[str, str] = {
    "embeddings.word_embeddings.weight": "word_embedding.weight",
    "embeddings.position_embeddings.weight": "pos_embedding.weight",
    "embeddings.LayerNorm.weight": "embed_layer_norm.weight",
    "embeddings.LayerNorm.bias": "embed_layer_norm.bias",
    "transformer.layer.{}.attention.q_lin.weight": "bert_layers.{}.self_attention.query.weight",
    "transformer.layer.{}.attention.q_lin.bias": "bert_layers.{}.self_attention.query.bias",
    "transformer.layer.{}.attention.k_lin.weight": "bert_layers.{}.self_attention.key.weight",
    "transformer.layer.{}.attention.k_lin.bias": "bert_layers.{}.self_attention.key.bias",
    "transformer.layer.{}.attention.v_lin.weight": "bert_layers.{}.self_attention.value.weight",
    "transformer.layer.{}.attention.v_lin.bias": "bert_layers.{}.self_attention.value.bias",
    "transformer.layer.{}.attention.out_lin.weight": "bert_layers.{}.attention_dense.weight",
    "transformer.layer.{}.attention.out_lin.bias": "bert_layers.{}.attention_dense.bias",
    "transformer.layer.{}.sa_layer_norm.weight": "bert_layers.{}.attention_layer_norm.weight",
    "transformer.layer.{}.sa_layer_norm.bias": "bert_layers.{}.attention_layer_norm.bias",
    "transformer.layer.{}.ffn.lin1.weight": "bert_layers.{}.interm_dense.weight",
    "transformer.layer.{}.ffn.lin1.bias": "bert_layers.{}.interm_dense.bias",
    "transformer.layer.{}.ffn.lin2.weight": "bert_layers.{}.out_dense.weight",
    "transformer.layer.{}.ffn.lin2.bias": "bert_layers.{}.out_dense.bias",
    "transformer.layer.{}.output_layer_norm.weight": "bert_layers.{}.out_layer_norm.weight",
    "transformer.layer.{}.output_layer_norm.bias": "bert_layers.{}.out_layer_norm.bias",
}

# The task heads whose names are not BERT's, per key table and per head (a model's `head_keys`):
# HF name -> port name. The port's head modules are BERT's (`classifier.py`, `heads.py`), plus
# `pre_classifier`, the dense layer before the classifier that transformers' other families have.
# A head not listed keeps its names (`HEAD_PREFIXES`); a tied copy (`lm_head.decoder.weight`) is listed
# so that a file holding it is checked against what it is tied to, as BERT's `cls.predictions.decoder`.
_FIRST_TOKEN_CLASSIFIER = {
    "classifier.dense.weight": "pre_classifier.weight",
    "classifier.dense.bias": "pre_classifier.bias",
    "classifier.out_proj.weight": "classifier.weight",
    "classifier.out_proj.bias": "classifier.bias",
}
HEAD_TABLES: dict[str, dict[str, dict[str, str]]] = {
    "roberta": {
        "sequence": _FIRST_TOKEN_CLASSIFIER,
        "masked_lm": {
            "lm_head.dense.weight": "cls.predictions.transform.dense.weight",
            "lm_head.dense.bias": "cls.predictions.transform.dense.bias",
            "lm_head.layer_norm.weight": "cls.predictions.transform.LayerNorm.weight",
            "lm_head.layer_norm.bias": "cls.predictions.transform.LayerNorm.bias",
            "lm_head.bias": "cls.predictions.bias",
            "lm_head.decoder.weight": "cls.predictions.decoder.weight",
            "lm_head.decoder.bias": "cls.predictions.decoder.bias",
        },
    },
    "distilbert": {  # its sequence classifier's names are the port's (`pre_classifier`, `classifier`)
        "masked_lm": {
            "vocab_transform.weight": "cls.predictions.transform.dense.weight",
            "vocab_transform.bias": "cls.predictions.transform.dense.bias",
            "vocab_layer_norm.weight": "cls.predictions.transform.LayerNorm.weight",
            "vocab_layer_norm.bias": "cls.predictions.transform.LayerNorm.bias",
            "vocab_projector.bias": "cls.predictions.bias",
            "vocab_projector.weight": "cls.predictions.decoder.weight",
        },
    },
    "electra": {
        "sequence": _FIRST_TOKEN_CLASSIFIER,
        "masked_lm": {
            "generator_predictions.dense.weight": "cls.predictions.transform.dense.weight",
            "generator_predictions.dense.bias": "cls.predictions.transform.dense.bias",
            "generator_predictions.LayerNorm.weight": "cls.predictions.transform.LayerNorm.weight",
            "generator_predictions.LayerNorm.bias": "cls.predictions.transform.LayerNorm.bias",
            "generator_lm_head.bias": "cls.predictions.bias",
            "generator_lm_head.weight": "cls.predictions.decoder.weight",
        },
    },
}


def head_table(table: str, head: str | None) -> dict[str, str]:
    """The HF -> port names of a model's head (`head`: its `head_keys`) in a family's key `table`."""
    return HEAD_TABLES.get(table, {}).get(head or "", {})
