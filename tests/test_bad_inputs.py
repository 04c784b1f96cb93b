"""The bad-input catalogue (docs/loading.md, "Bad input"): every case raises a clear error of the
documented type, and nothing is half-loaded or half-written. Here: files, pickles, checkpoint
against config, NaN/Inf; error names in test_bad_input_names.py, model inputs in
test_bad_model_inputs.py."""

# ruff: noqa: F811  (fixtures imported from bad_input_files, which pytest passes by name)

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from bad_input_files import (
    _assert_unchanged,
    _port_state,
    _write,
    tiny_state,  # noqa: F401  (fixtures)
)
from conftest import TINY

from bert_port import BertConfig, BertModel, CheckpointError, ConfigError
from bert_port import checkpoint as ckpt

# -- files ----------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [0, 5, 100, -1000], ids=["empty", "inside-length", "inside-header", "inside-data"])
def test_truncated_safetensors(tmp_path, tiny_state, cut):
    path = _write(tmp_path, tiny_state) / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as err:
        BertModel.from_pretrained(tmp_path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("damage", ["json", "length"], ids=["invalid-json", "huge-length"])
def test_corrupt_safetensors_header(tmp_path, tiny_state, damage):
    path = _write(tmp_path, tiny_state) / "model.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "json":
        data[8:16] = b"{garbage"
    else:
        data[:8] = (10**12).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="not a readable safetensors file") as err:
        BertModel.from_pretrained(tmp_path)
    assert "header" in str(err.value)


def test_truncated_pytorch_bin(tmp_path, tiny_state):
    path = _write(tmp_path, tiny_state, fmt="bin") / "pytorch_model.bin"
    path.write_bytes(path.read_bytes()[:3000])
    with pytest.raises(CheckpointError, match="not a readable PyTorch checkpoint.*truncated or corrupt"):
        BertModel.from_pretrained(tmp_path)


def test_sharded_index_naming_a_missing_shard(tmp_path, tiny_state):
    _write(tmp_path, tiny_state, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    with pytest.raises(CheckpointError, match="names 1 shard file") as err:
        BertModel.from_pretrained(tmp_path)
    assert shards[1].name in str(err.value) and "fetch the missing shards" in str(err.value)


@pytest.mark.parametrize(
    "index, message",
    [
        ("{not json", "not a valid shard index"),
        ('{"metadata": {}}', "not a valid shard index"),
        ('{"weight_map": {"a": "../elsewhere/model.safetensors"}}', "outside its directory"),
    ],
    ids=["not-json", "no-weight-map", "path-escape"],
)
def test_broken_shard_index(tmp_path, tiny_state, index, message):
    _write(tmp_path, tiny_state, max_shard_size="20KB")
    (tmp_path / ckpt.SAFE_INDEX).write_text(index)
    with pytest.raises(CheckpointError, match=message):
        BertModel.from_pretrained(tmp_path)


def test_index_listing_tensors_its_shards_lack(tmp_path, tiny_state):
    _write(tmp_path, tiny_state, max_shard_size="20KB")
    index = json.loads((tmp_path / ckpt.SAFE_INDEX).read_text())
    index["weight_map"]["encoder.layer.9.output.dense.bias"] = next(iter(index["weight_map"].values()))
    (tmp_path / ckpt.SAFE_INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="lists 1 tensor.*encoder.layer.9.output.dense.bias"):
        BertModel.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "config, message",
    [
        ('{"vocab_size": 99, "hidden_size": 32,', "is not valid JSON"),
        ("", "is not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({k: v for k, v in TINY.items() if k not in ("hidden_size", "vocab_size")}, "missing required field"),
        ({**TINY, "hidden_size": "32"}, "hidden_size must be a positive integer"),
        ({**TINY, "id2label": ["a", "b"]}, "id2label must be a JSON object"),
    ],
    ids=["truncated-json", "empty", "not-an-object", "missing-fields", "wrong-type", "bad-id2label"],
)
def test_bad_config_json(tmp_path, tiny_state, config, message):
    _write(tmp_path, tiny_state, config=config)
    with pytest.raises(ConfigError, match=message) as err:
        BertModel.from_pretrained(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)
    if message == "missing required field":
        assert "hidden_size" in str(err.value) and "vocab_size" in str(err.value)


def test_missing_config_and_missing_weights(tmp_path, tiny_state):
    _write(tmp_path, tiny_state)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config for checkpoint"):
        BertModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="holds no weights"):
        BertModel.from_pretrained(tmp_path)


# -- pickles that run code --------------------------------------------------------------


class _Payload:
    """Unpickling this calls exec(), which writes the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("container", ["torch-zip", "plain-pickle", "in-shard"])
def test_pickle_that_runs_code_is_refused(tmp_path, tiny_state, container):
    marker = tmp_path / "marker"
    state = {"embeddings.payload": _Payload(marker), **tiny_state}  # first, so it is what gets refused
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(TINY))
    if container == "torch-zip":
        torch.save(state, directory / "pytorch_model.bin")
    elif container == "plain-pickle":
        with open(directory / "pytorch_model.bin", "wb") as f:
            pickle.dump(state, f, protocol=2)  # a protocol the weights-only unpickler reads
    else:  # a .bin shard behind a pytorch_model.bin.index.json
        torch.save(tiny_state, directory / "pytorch_model-00001-of-00002.bin")
        torch.save({"embeddings.payload": _Payload(marker)}, directory / "pytorch_model-00002-of-00002.bin")
        weight_map = dict.fromkeys(tiny_state, "pytorch_model-00001-of-00002.bin")
        weight_map["embeddings.payload"] = "pytorch_model-00002-of-00002.bin"
        (directory / ckpt.PT_INDEX).write_text(json.dumps({"weight_map": weight_map}))

    with pytest.raises(CheckpointError, match="refused to load") as err:
        BertModel.from_pretrained(directory)
    assert "(it calls exec)" in str(err.value) and "Nothing in it was executed" in str(err.value)
    assert "add_safe_globals" not in str(err.value)  # torch's allowlisting advice is not passed on
    assert not marker.exists()

    # The payload is live: an unsafe load does run it. This proves the refusal mattered.
    live = directory / ("pytorch_model.bin" if container != "in-shard" else "pytorch_model-00002-of-00002.bin")
    if container == "plain-pickle":
        with open(live, "rb") as f:
            pickle.load(f)
    else:
        torch.load(live, weights_only=False)
    assert marker.read_text() == "code ran"


def test_pickle_that_is_not_a_state_dict(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    torch.save({"model": {"w": torch.zeros(2)}, "epoch": 3}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="not hold a flat state dict.*'epoch', 'model'"):
        BertModel.from_pretrained(tmp_path)


# -- checkpoint vs config -----------------------------------------------------------------


def test_config_disagrees_with_tensors(tmp_path, tiny_state):
    _write(tmp_path, tiny_state, config={**TINY, "hidden_size": 64, "intermediate_size": 37})
    with pytest.raises(CheckpointError) as err:
        BertModel.from_pretrained(tmp_path)
    msg = str(err.value)
    assert "wrong shape" in msg and "word_embedding.weight: checkpoint (99, 32), model (99, 64)" in msg
    assert "hidden_size" in msg and "Nothing was loaded" in msg

    _write(tmp_path, tiny_state, config={**TINY, "num_hidden_layers": 3})
    with pytest.raises(CheckpointError, match=r"num_hidden_layers=3, but the checkpoint has tensors for layers 0, 1"):
        BertModel.from_pretrained(tmp_path)


def test_failed_load_leaves_the_model_untouched(tiny_state):
    model = BertModel(BertConfig(**TINY))
    before = _port_state(model)
    bad_shape = {**tiny_state, "pooler.dense.weight": torch.zeros(5, 5)}
    with pytest.raises(CheckpointError, match="wrong shape"):
        model.load_hf_state_dict(bad_shape)
    _assert_unchanged(model, before)
    nan = {**tiny_state, "pooler.dense.weight": torch.full((32, 32), float("nan"))}
    with pytest.raises(CheckpointError, match="non-finite"):
        model.load_hf_state_dict(nan)
    _assert_unchanged(model, before)


# -- NaN / Inf ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_weights(tmp_path, tiny_state, value):
    state = dict(tiny_state)
    bad = state["encoder.layer.1.attention.self.key.weight"].clone()
    bad[3, 4] = value
    bad[7, 0] = value
    state["encoder.layer.1.attention.self.key.weight"] = bad
    _write(tmp_path, state)

    with pytest.raises(CheckpointError, match="non-finite") as err:
        BertModel.from_pretrained(tmp_path)  # default: error
    # Named as in the file first, then the port's name.
    named = "encoder.layer.1.attention.self.key.weight -> bert_layers.1.self_attention.key.weight (2 of 1024 values"
    assert named in str(err.value)
    assert str(err.value).endswith("Pass check_finite='warn' to load it anyway")

    with pytest.warns(RuntimeWarning, match=r"non-finite weights: encoder\.layer\.1\.attention\.self\.key\.weight"):
        model = BertModel.from_pretrained(tmp_path, check_finite="warn")
    loaded = model.bert_layers[1].self_attention.key.weight
    assert torch.equal(torch.isfinite(loaded), torch.isfinite(bad))  # loaded as it is, as asked

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BertModel.from_pretrained(tmp_path, check_finite="ignore")

    with pytest.raises(ValueError, match="check_finite must be one of"):
        BertModel.from_pretrained(tmp_path, check_finite="loud")


def test_non_finite_half_precision(tmp_path, tiny_state):
    state = {k: v.to(torch.bfloat16) for k, v in tiny_state.items() if v.is_floating_point()}
    state["embeddings.LayerNorm.weight"][5] = float("inf")
    _write(tmp_path, state)
    named = r"embeddings\.LayerNorm\.weight -> embed_layer_norm\.weight \(1 of 32 values"
    with pytest.raises(CheckpointError, match=named):
        BertModel.from_pretrained(tmp_path)
