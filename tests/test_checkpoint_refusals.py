"""Fault injection for checkpoints, continued (test_checkpoint_faults.py): hostile HF cache refs
and revisions, config values of the wrong type, odd dtypes and devices. Each bad input is a
typed error, and a live model it was loaded into is left untouched."""

# ruff: noqa: F811  (fixtures imported from checkpoint_fault_files, which pytest passes by name)

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoint_fault_files import (
    _rewrite,
    tiny_dir,  # noqa: F401  (fixtures)
)
from conftest import TINY

from bert_port import BertConfig, BertModel, CheckpointError, ConfigError
from bert_port.cli.convert import main as convert_main

# -- the HF cache -------------------------------------------------------------------------


def _cache_with_outside_checkpoint(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots" / ("a" * 40)).mkdir(parents=True)
    outside = tmp_path / "dir"
    BertModel(BertConfig(**TINY)).save_pretrained(outside)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return repo, outside


@pytest.mark.parametrize(
    "ref", ["../../../dir", "ABSOLUTE", "../snapshots/../../../dir"], ids=["relative", "absolute", "via-snapshots"]
)
def test_cache_ref_cannot_leave_the_cache(tmp_path, monkeypatch, ref):
    repo, outside = _cache_with_outside_checkpoint(tmp_path, monkeypatch)
    (repo / "refs" / "main").write_text(str(outside) if ref == "ABSOLUTE" else ref)
    with pytest.raises(CheckpointError, match="not a commit hash"):
        BertModel.from_pretrained("org/tiny")


@pytest.mark.parametrize("revision", ["../..", "../../../dir", "/abs", "", "a/../..", "x\\..\\.."])
def test_revision_cannot_leave_the_cache(tmp_path, monkeypatch, revision):
    repo, _ = _cache_with_outside_checkpoint(tmp_path, monkeypatch)
    (repo / "refs" / "main").write_text("a" * 40)
    with pytest.raises(CheckpointError, match="not a ref name or commit hash"):
        BertModel.from_pretrained("org/tiny", revision=revision)


def test_convert_with_an_escaping_revision_exits_2(tmp_path, monkeypatch, capsys):
    repo, _ = _cache_with_outside_checkpoint(tmp_path, monkeypatch)
    (repo / "refs" / "main").write_text("a" * 40)
    assert convert_main(["org/tiny", str(tmp_path / "out"), "--revision", "../../../dir"]) == 2
    err = capsys.readouterr().err
    assert "not a ref name or commit hash" in err and "--revision main" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_revision_must_name_a_listed_snapshot(tmp_path, monkeypatch):
    repo, _ = _cache_with_outside_checkpoint(tmp_path, monkeypatch)
    (repo / "refs" / "main").write_text("b" * 40)  # a plain name, but no such snapshot
    with pytest.raises(CheckpointError, match="has no snapshot for revision"):
        BertModel.from_pretrained("org/tiny")
    BertModel(BertConfig(**TINY)).save_pretrained(repo / "snapshots" / ("b" * 40))
    BertModel.from_pretrained("org/tiny")  # once it is there, it loads


# -- configs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("is_decoder", "false", "is_decoder must be true or false"),
        ("is_decoder", 0, "is_decoder must be true or false"),
        ("add_cross_attention", "no", "add_cross_attention must be true or false"),
        ("layer_norm_eps", float("inf"), "layer_norm_eps must be a positive finite number"),
        ("layer_norm_eps", True, "layer_norm_eps must be a positive finite number"),
        ("layer_norm_eps", float("nan"), "layer_norm_eps must be a positive finite number"),
        ("hidden_dropout_prob", True, "hidden_dropout_prob must be a number"),
        ("hidden_dropout_prob", float("nan"), "hidden_dropout_prob must be a number"),
        ("initializer_range", float("-inf"), "initializer_range must be a finite number"),
        ("pad_token_id", True, "pad_token_id must be an integer"),
        ("pad_token_id", "0", "pad_token_id must be an integer"),
        ("hidden_act", ["gelu"], "hidden_act must be a string"),
        ("position_embedding_type", None, "position_embedding_type must be a string"),
    ],
)
def test_config_values_of_the_wrong_type(tmp_path, field, value, message):
    directory = tmp_path / "ckpt"
    BertModel(BertConfig(**TINY)).save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(
        json.dumps({**config, field: value})
    )  # Infinity, NaN as Python's json writes them
    with pytest.raises(ConfigError, match=message):
        BertModel.from_pretrained(directory)


def test_config_lists_every_wrong_field_at_once():
    with pytest.raises(ConfigError) as err:
        BertConfig(**{**TINY, "is_decoder": "true", "layer_norm_eps": True, "hidden_act": 3, "pad_token_id": "x"})
    for field in ("is_decoder", "layer_norm_eps", "hidden_act", "pad_token_id"):
        assert field in str(err.value)


def test_one_half_precision_tensor_in_a_float32_file_is_cast(tiny_dir, caplog):
    key = "encoder.layer.1.attention.self.key.weight"
    state = _rewrite(tiny_dir, lambda s: s.update({key: s[key].half()}))
    model = BertModel.from_pretrained(tiny_dir)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert "cast 1 tensor(s) to float32" in caplog.text and key in caplog.text
    torch.testing.assert_close(model.hf_state_dict()[key], state[key].float(), atol=0, rtol=0)
    ids = torch.tensor([[2, 7, 9, 3]])
    assert torch.isfinite(model(ids)["last_hidden_state"]).all()  # runs, instead of failing inside forward


def test_integer_weight_is_refused_and_a_live_model_untouched(tiny_dir):
    key = "encoder.layer.0.output.dense.weight"
    _rewrite(tiny_dir, lambda s: s.update({key: s[key].to(torch.int64)}))
    with pytest.raises(
        CheckpointError, match=r"(?s)wrong dtype \(1\).*output.dense.weight -> .*: checkpoint torch.int64"
    ):
        BertModel.from_pretrained(tiny_dir)

    live = BertModel(BertConfig(**TINY))
    before = {k: v.clone() for k, v in live.state_dict().items()}
    from safetensors.torch import load_file

    with pytest.raises(CheckpointError, match="wrong dtype"):
        live.load_hf_state_dict(load_file(tiny_dir / "model.safetensors"))
    assert all(torch.equal(live.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, "int8", "float17", "complex64", 3])
def test_dtype_argument_that_is_not_floating_leaves_a_live_model_untouched(tiny_dir, dtype):
    from safetensors.torch import load_file

    live = BertModel(BertConfig(**TINY))
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(ValueError, match="dtype must be a floating torch dtype"):
        live.load_hf_state_dict(load_file(tiny_dir / "model.safetensors"), dtype=dtype)
    assert all(
        torch.equal(live.state_dict()[k], v) and live.state_dict()[k].dtype == v.dtype for k, v in before.items()
    )
    with pytest.raises(ValueError, match="dtype must be a floating torch dtype"):
        BertModel.from_pretrained(tiny_dir, dtype=dtype)


def test_unknown_device_leaves_a_live_model_untouched(tiny_dir):
    from safetensors.torch import load_file

    live = BertModel(BertConfig(**TINY))
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(ValueError, match="not a device torch knows"):
        live.load_hf_state_dict(load_file(tiny_dir / "model.safetensors"), device="gpu7")
    assert all(torch.equal(live.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("dtype", ["float16", "torch.bfloat16", "auto", torch.float16])
def test_dtype_given_as_a_string_as_transformers_accepts(tiny_dir, dtype):
    model = BertModel.from_pretrained(tiny_dir, dtype=dtype)
    want = {"float16": torch.float16, "torch.bfloat16": torch.bfloat16, "auto": torch.float32}.get(dtype, dtype)
    assert model.dtype == want
