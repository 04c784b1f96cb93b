"""Family resolution never guesses: a config.json without `model_type` is read from an
unambiguous `architectures` (and the log says so) or refused in one line, and a RoBERTa whose
`pad_token_id` leaves no position for a token is refused at load."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import TINY, TOL
from test_families import FAMILIES, _batch, save_random

from bert_port import BertConfig, BertModel
from bert_port.config import ConfigError


def _drop_model_type(path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    del config["model_type"]
    (path / "config.json").write_text(json.dumps({**config, **fields}))


@pytest.mark.parametrize("model_type", ["roberta", "distilbert"])
def test_config_without_model_type_is_read_from_its_architectures(tmp_path, caplog, model_type):
    """A RoBERTa whose config.json lost its model_type (architectures still RobertaModel) loads as
    RoBERTa, equal to transformers' RobertaModel, where it loaded as BERT without a word."""
    hf = save_random(model_type, tmp_path)
    _drop_model_type(tmp_path)
    with caplog.at_level(logging.WARNING, logger="bert_port.families"):
        ours = BertModel.from_pretrained(tmp_path, dtype=torch.float32)
    said = [r.getMessage() for r in caplog.records if r.name == "bert_port.families"]
    assert len(said) == 1 and "has no model_type" in said[0] and f"read as model_type {model_type!r}" in said[0]
    assert ours.config.family.model_type == model_type
    batch = _batch(FAMILIES[model_type][2]["vocab_size"], ours.config.pad_token_id)
    with torch.no_grad():
        expected = hf(**batch).last_hidden_state
        actual = ours(**batch).last_hidden_state
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(actual[mask], expected[mask], **TOL[torch.float32])
    ours.save_pretrained(tmp_path / "saved")  # written back with the model_type it was read as
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["model_type"] == model_type


@pytest.mark.parametrize(
    "architectures, why",
    [
        (["RobertaModel", "BertModel"], "classes of several families"),
        (["GPT2LMHeadModel"], "'GPT2LMHeadModel' of no family this port computes"),
        (["RobertaPreLayerNormModel"], "'RobertaPreLayerNormModel' of no family"),
    ],
)
def test_config_without_model_type_and_unclear_architectures_is_refused(tmp_path, architectures, why):
    save_random("roberta", tmp_path)
    _drop_model_type(tmp_path, architectures=architectures)
    with pytest.raises(ConfigError) as caught:
        BertModel.from_pretrained(tmp_path)
    message = str(caught.value)
    assert str(tmp_path / "config.json") in message and "\n" not in message
    assert "has no model_type" in message and why in message and "add the model_type" in message


def test_config_without_model_type_or_architectures_is_bert():
    """Nothing names another family: BERT, as `transformers.BertConfig` reads such a config."""
    assert BertConfig.from_dict(dict(TINY)).family.model_type == "bert"
    assert BertConfig.from_dict(dict(TINY, architectures=["BertForMaskedLM"])).family.model_type == "bert"
    config = BertConfig.from_dict(dict(TINY, architectures=["MegatronBertModel"]))
    assert config.family.model_type == "megatron-bert" and config.pre_norm is True


def test_roberta_pad_token_id_that_leaves_no_position_is_refused_at_load(tmp_path):
    """pad_token_id 65 of 66 positions: RoBERTa's positions start at 66, so no token has one.
    It loaded, and then every forward said to truncate to 0 tokens."""
    save_random("roberta", tmp_path, pad_token_id=65)
    with pytest.raises(ConfigError) as caught:
        BertModel.from_pretrained(tmp_path)
    message = str(caught.value)
    assert str(tmp_path / "config.json") in message and "\n" not in message
    assert "pad_token_id 65 leaves no position for a token" in message and "max_position_embeddings is 66" in message
    save_random("roberta", tmp_path / "last", pad_token_id=64)  # one position left: loads
    assert BertModel.from_pretrained(tmp_path / "last").config.max_sequence_length == 1
