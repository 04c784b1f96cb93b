"""The BERT family: RoBERTa, XLM-RoBERTa, DistilBERT and ELECTRA checkpoints, saved by
transformers from random weights, against transformers' own classes."""

from __future__ import annotations

import pytest
import torch
from conftest import EXACT, TOL, assert_bitwise, outputs_on_real_tokens

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


def test_unknown_model_type_is_refused(tmp_path):
    from bert_port import BertConfig

    with pytest.raises(ConfigError, match="model_type 'gpt2', which this port cannot compute exactly"):
        BertConfig.from_dict(dict(SHAPES, hidden_size=32, model_type="gpt2"))


def _batch(vocab_size: int, pad: int) -> dict:
    """Ids avoiding `pad` with ragged right padding of `pad` (row i has i pads)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_size, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    for i in range(1, 3):
        mask[i, 9 - i :] = 0
    return {"input_ids": ids.masked_fill(mask == 0, pad), "attention_mask": mask}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_loads_strictly_and_matches_transformers(tmp_path, model_type):
    """A checkpoint of each family, saved by transformers, loads with nothing missing or
    unexpected and matches transformers' own class in fp32 (default path) and bit for bit in
    exact mode."""
    hf = save_random(model_type, tmp_path)
    pad = hf.config.pad_token_id
    batch = _batch(hf.config.vocab_size, pad)
    with torch.no_grad():
        expected = hf(**batch).last_hidden_state.masked_fill(batch["attention_mask"][..., None] == 0, 0)
    port = BertModel.from_pretrained(tmp_path)
    assert port.loading_info["newly_initialized"] == [] and port.loading_info["unused"] == []
    hidden, _ = outputs_on_real_tokens(port, batch)
    torch.testing.assert_close(hidden, expected, **TOL[torch.float32])
    exact = BertModel.from_pretrained(tmp_path, **EXACT)
    hf.set_attn_implementation("eager")  # exact mode is transformers' eager path, operation for operation
    with torch.no_grad():
        out = exact(**batch)
        ref = hf(**batch)
    assert_bitwise([out.last_hidden_state], [ref.last_hidden_state])
    if getattr(ref, "pooler_output", None) is not None:
        assert_bitwise([out.pooler_output], [ref.pooler_output])
    else:
        assert out.pooler_output is None
