"""The key table and the plan of a load (`bert_port.checkpoint.keys`): pure functions of
names, no files and no model."""

from __future__ import annotations

import torch
from conftest import TINY

from bert_port import BertConfig, BertModel
from bert_port.checkpoint import HF_TO_PORT, PORT_TO_HF, hf_to_port, plan_load, port_to_hf


def test_key_table_is_one_to_one_and_inverts():
    assert len(PORT_TO_HF) == len(HF_TO_PORT)
    state = {f"encoder.layer.{i}.attention.self.query.weight": torch.zeros(1) for i in range(3)}
    state["pooler.dense.bias"] = torch.zeros(1)
    assert port_to_hf(hf_to_port(state).state_dict).keys() == state.keys()


def test_key_normalisation_layouts():
    t = torch.zeros(1)
    state = {
        "module.bert.embeddings.LayerNorm.gamma": t,
        "_orig_mod.embeddings.LayerNorm.beta": t,
        "bert.embeddings.position_ids": t,
        "cls.predictions.bias": t,
        "encoder.layer.11.output.LayerNorm.weight": t,
    }
    conv = hf_to_port(state)
    assert sorted(conv.state_dict) == [
        "bert_layers.11.out_layer_norm.weight",
        "embed_layer_norm.bias",
        "embed_layer_norm.weight",
    ]
    assert conv.dropped == ["cls.predictions.bias"]


def test_the_plan_of_a_load_describes_itself():
    """From a file's names alone: what is kept under which port name, renamed, dropped,
    skipped; against a model's keys, what is missing, initialised afresh and unexpected."""
    keys = [
        "bert.embeddings.word_embeddings.weight",
        "bert.encoder.layer.0.output.LayerNorm.gamma",
        "bert.embeddings.position_ids",
        "cls.predictions.bias",
        "bert.encoder.layer.0.attention.self.frobnicate",
    ]
    plan = plan_load(keys)
    assert plan.sources["word_embedding.weight"] == "bert.embeddings.word_embeddings.weight"
    assert plan.sources["bert_layers.0.out_layer_norm.weight"] == "bert.encoder.layer.0.output.LayerNorm.gamma"
    assert plan.renamed["bert.encoder.layer.0.output.LayerNorm.gamma"] == "encoder.layer.0.output.LayerNorm.weight"
    assert plan.dropped == ["cls.predictions.bias"] and plan.buffers == ["bert.embeddings.position_ids"]
    assert plan.unmapped == ["bert.encoder.layer.0.attention.self.frobnicate"]
    assert plan.layout.prefix == "bert." and plan.layout.legacy_layer_norm

    expected = list(BertModel(BertConfig(**TINY)).state_dict())
    text = plan.describe(expected, init_if_missing=("pooler_dense.",))
    lines = dict(line.split(":", 1) for line in text.splitlines())
    assert lines["kept"].split()[0] == "2" and "prefix 'bert.'" in lines["kept"]
    assert lines["dropped"].strip().startswith("1 ") and "cls.predictions.bias" in lines["dropped"]
    assert lines["initialised"].strip() == "2: pooler_dense.weight, pooler_dense.bias"
    assert lines["missing"].split()[0] == f"{len(expected) - 2 - 2}:"  # all but the two kept and the pooler
    assert "bert.encoder.layer.0.attention.self.frobnicate" in lines["unexpected"]
    assert plan.missing(expected) == [k for k in expected if k not in plan.sources]


def test_account_keys_is_the_one_accounting():
    """The plan's missing/initialised/unexpected and the loader's (with what a model may
    ignore) come from one function; lists keep the model's order and the file's."""
    from bert_port.checkpoint.keys import account_keys

    account = account_keys(
        ["extra", "a.weight", "pooler_dense.weight", "classifier.bias"],
        ["a.weight", "b.weight", "classifier.weight", "classifier.bias"],
        init_if_missing=("classifier.",),
        unused_ok=("pooler_dense.",),
    )
    assert account.missing == ["b.weight"] and account.initialised == ["classifier.weight"]
    assert account.unexpected == ["extra"] and account.unused == ["pooler_dense.weight"]
    plan = plan_load(["pooler.dense.bias"])
    assert plan.missing(["pooler_dense.weight", "pooler_dense.bias"]) == ["pooler_dense.weight"]
