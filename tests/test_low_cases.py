"""Low cases that each end in one clear line instead of a raw error: token ids of a dtype the
embedding cannot index and inputs on the meta device, a save or convert into a path that is a
file, an `id2label` with gaps, and checkpoint files that are symbolic link loops."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY, random_batch

from bert_port import BertConfig, BertModel, CheckpointError, ConfigError
from bert_port.cli.convert import main as convert


@pytest.fixture(scope="module")
def tiny_model() -> BertModel:
    return BertModel(BertConfig(**TINY)).eval()


@pytest.fixture
def saved(tmp_path, tiny_model):
    return tiny_model.save_pretrained(tmp_path / "model")


def _one_line(message: str) -> str:
    assert "\n" not in message.strip(), message
    return message


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.uint32, torch.uint64])
@pytest.mark.parametrize("name", ["input_ids", "token_type_ids", "position_ids"])
def test_ids_of_a_dtype_the_embedding_cannot_index_are_one_line(tiny_model, dtype, name):
    batch = random_batch(TINY["vocab_size"], B=2, T=5)
    batch["position_ids"] = torch.arange(5)[None]
    batch[name] = batch[name].to(torch.uint8).to(dtype)  # values fit every dtype here
    with pytest.raises(ValueError, match=rf"{name} must be torch.long \(or torch.int32\) ids, got {dtype}") as error:
        tiny_model(**batch)
    _one_line(str(error.value))


def test_int32_ids_still_run_as_long_ids_do(tiny_model):
    batch = random_batch(TINY["vocab_size"], B=2, T=5)
    with torch.no_grad():
        want = tiny_model(**batch).last_hidden_state
        got = tiny_model(**{k: v.to(torch.int32) for k, v in batch.items()}).last_hidden_state
    torch.testing.assert_close(got, want, atol=0.0, rtol=0.0)


@pytest.mark.parametrize("name", ["input_ids", "attention_mask", "token_type_ids", "inputs_embeds"])
def test_inputs_on_the_meta_device_are_one_line(tiny_model, name):
    batch = random_batch(TINY["vocab_size"], B=2, T=5)
    if name == "inputs_embeds":
        batch = {"inputs_embeds": torch.randn(2, 5, TINY["hidden_size"])}
    batch[name] = batch[name].to("meta")
    with pytest.raises(ValueError, match=f"{name} is on the meta device") as error:
        tiny_model(**batch)
    _one_line(str(error.value))


@pytest.mark.parametrize("below", ["", "sub"])
def test_save_pretrained_into_a_file_is_one_line(tmp_path, tiny_model, below):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'taken'} is a file, not a folder") as error:
        tiny_model.save_pretrained(tmp_path / "taken" / below)
    _one_line(str(error.value))
    assert (tmp_path / "taken").read_text() == "a file"


def test_convert_into_a_file_is_one_line(tmp_path, saved, capsys):
    (tmp_path / "taken").write_text("a file")
    assert convert([str(saved), str(tmp_path / "taken")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "is a file" in _one_line(err)
    assert (tmp_path / "taken").read_text() == "a file"


@pytest.mark.parametrize(
    "id2label, ids", [({"0": "neg", "2": "pos"}, "0, 2"), ({"1": "a", "2": "b"}, "1, 2"), ({"x": "a"}, "x")]
)
def test_an_id2label_with_gaps_is_one_line(tmp_path, id2label, ids):
    with pytest.raises(ConfigError, match=f"id2label must number its labels .* got ids {ids}; renumber") as error:
        BertConfig(**TINY, id2label=id2label)
    _one_line(str(error.value))
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "id2label": id2label}))
    with pytest.raises(ConfigError, match="without gaps"):
        BertConfig.from_json_file(tmp_path / "config.json")


def test_an_id2label_without_gaps_still_reads(tmp_path):
    config = BertConfig(**TINY, id2label={"1": "pos", "0": "neg"})
    assert config.id2label == {0: "neg", 1: "pos"} and config.num_labels == 2


def _loop(path):
    """Make `path` one end of a two-link loop."""
    other = path.with_name(path.name + ".other")
    path.unlink(missing_ok=True)
    path.symlink_to(other.name)
    other.symlink_to(path.name)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_checkpoint_file_that_is_a_link_loop_is_one_line(saved, name):
    _loop(saved / name)
    with pytest.raises(CheckpointError, match="symbolic link loop") as error:
        BertModel.from_pretrained(saved)
    assert name in _one_line(str(error.value))
    with pytest.raises(CheckpointError, match="symbolic link loop"):
        BertModel.from_pretrained(saved / "model.safetensors" if name == "config.json" else saved / name)


def test_a_shard_that_is_a_link_loop_is_one_line(tmp_path, tiny_model):
    folder = tiny_model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shard = min(folder.glob("model-*.safetensors"))
    _loop(shard)
    with pytest.raises(CheckpointError, match=f"{shard.name} is a symbolic link loop") as error:
        BertModel.from_pretrained(folder)
    _one_line(str(error.value))
