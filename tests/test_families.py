"""The BERT family: RoBERTa, XLM-RoBERTa, DistilBERT and ELECTRA checkpoints, saved by
transformers from random weights, against transformers' own classes."""

from __future__ import annotations

import pytest
import torch

from bert_port import BertModel
from bert_port.config import ConfigError

# Tiny configs of each family, in the family's own config.json names.
SHAPES = dict(vocab_size=99, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
FAMILIES = {
    "roberta": ("RobertaConfig", "RobertaModel", dict(SHAPES, hidden_size=32, max_position_embeddings=66)),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", dict(SHAPES, hidden_size=32, max_position_embeddings=66)),
    "distilbert": (
        "DistilBertConfig",
        "DistilBertModel",
        dict(vocab_size=99, n_layers=2, n_heads=4, dim=32, hidden_dim=37, max_position_embeddings=64),
    ),
    "electra": ("ElectraConfig", "ElectraModel", dict(SHAPES, hidden_size=64, embedding_size=32)),
}


def save_random(model_type: str, path, cls_name: str | None = None, **fields):
    """A transformers model of the family with random weights (seed 0), saved to `path`."""
    import transformers

    config_cls, model_cls, shape = FAMILIES[model_type]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**shape, **fields})
    model = getattr(transformers, cls_name or model_cls)(config).eval()
    model.save_pretrained(str(path))
    return model


@pytest.mark.parametrize("model_type", ["roberta", "xlm-roberta"])
def test_unsupported_family_is_refused_in_one_line(tmp_path, model_type):
    """Until a family is computed exactly, its checkpoint is refused by model_type, in one line
    naming the reason; never loaded with wrong numbers (RoBERTa's positions)."""
    save_random(model_type, tmp_path)
    with pytest.raises(ConfigError, match="position ids start after the padding index") as err:
        BertModel.from_pretrained(tmp_path)
    assert "\n" not in str(err.value) and repr(model_type) in str(err.value)


def test_unknown_model_type_is_refused(tmp_path):
    from bert_port import BertConfig

    with pytest.raises(ConfigError, match="model_type 'gpt2', which this port cannot compute exactly"):
        BertConfig.from_dict(dict(SHAPES, hidden_size=32, model_type="gpt2"))
