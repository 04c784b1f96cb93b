"""Fault injection for checkpoints, continued (test_checkpoint_faults.py): odd shard indexes,
huge layer counts, bounded messages, unreadable and corrupt files, random header bit flips,
the folder lock. Each is a typed error (or a load), never a hang or a crash."""

# ruff: noqa: F811  (fixtures imported from checkpoint_fault_files, which pytest passes by name)

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from checkpoint_fault_files import _tiny_vocab, sharded_dir, tiny_dir  # noqa: F401  (fixtures)
from conftest import TINY

from bert_port import BertConfig, BertModel, CheckpointError, ConfigError, load_tokenizer
from bert_port import checkpoint as ckpt
from bert_port.cli.convert import main as convert_main
from bert_port.tokenization import TokenizerError

# -- shard indexes, layer counts, message sizes -------------------------------------------


@pytest.mark.parametrize(
    "shard",
    [
        ckpt.SAFE_INDEX,
        "pytorch_model.bin.index.json",
        "",
        ".",
        "..",
        "sub/x.safetensors",
        "/abs.safetensors",
        "a\x00b.safetensors",
        "config.json",
        "x" * 300 + ".safetensors",
        5,
        ["x"],
        None,
    ],
    ids=[
        "itself",
        "other-index",
        "empty",
        "dot",
        "dotdot",
        "subdir",
        "absolute",
        "nul",
        "config",
        "too-long",
        "int",
        "list",
        "null",
    ],
)
def test_odd_shard_names_are_refused(sharded_dir, shard):
    index = json.loads((sharded_dir / ckpt.SAFE_INDEX).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = shard
    (sharded_dir / ckpt.SAFE_INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shard index"):
        BertModel.from_pretrained(sharded_dir)


def test_index_naming_itself_exits_2_from_convert(sharded_dir, tmp_path, capsys):
    index = json.loads((sharded_dir / ckpt.SAFE_INDEX).read_text())
    index["weight_map"] = dict.fromkeys(index["weight_map"], ckpt.SAFE_INDEX)
    (sharded_dir / ckpt.SAFE_INDEX).write_text(json.dumps(index))
    assert convert_main([str(sharded_dir), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "error: shard index" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_huge_layer_count_is_refused_before_building(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    (tiny_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 100000}))
    start = time.process_time()  # this process's CPU time: other jobs on the machine do not count
    with pytest.raises(
        CheckpointError, match="num_hidden_layers=100000, but the checkpoint has tensors for layers 0, 1"
    ) as err:
        BertModel.from_pretrained(tiny_dir)
    assert time.process_time() - start < 5  # was 87 s and 5.3 GB
    assert len(str(err.value)) < 1000


def test_errors_are_bounded_for_a_file_with_many_layers(tiny_dir):
    from safetensors.torch import load_file, save_file

    state = load_file(tiny_dir / "model.safetensors")
    layer = {k: v for k, v in state.items() if k.startswith("encoder.layer.0.")}
    for i in range(2, 300):
        state.update({k.replace("layer.0.", f"layer.{i}."): v.clone() for k, v in layer.items()})
    save_file(state, str(tiny_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        BertModel.from_pretrained(tiny_dir)
    # Layers beyond the config's cost nothing to build against: the usual listing, bounded.
    msg = str(err.value)
    assert "unexpected (4768)" in msg and "... and 4718 more" in msg and len(msg) < 10_000

    # Fewer layers in the file than the config asks for: refused before building, bounded too.
    config = json.loads((tiny_dir / "config.json").read_text())
    (tiny_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 301}))
    with pytest.raises(CheckpointError, match=r"num_hidden_layers=301, .* 8, 9, \.\.\. and 290 more \(300 in all\)"):
        BertModel.from_pretrained(tiny_dir)


def test_mismatch_error_lists_the_first_few_and_counts_the_rest():
    live = BertModel(BertConfig(**TINY))
    junk = {f"junk.{i}.weight": torch.zeros(1) for i in range(5000)}
    state = {**{k: v.clone() for k, v in BertModel(BertConfig(**TINY)).hf_state_dict().items()}, **junk}
    with pytest.raises(CheckpointError) as err:
        live.load_hf_state_dict(state)
    msg = str(err.value)
    assert "unexpected (5000)" in msg and "... and 4950 more" in msg and len(msg) < 10_000


# -- unreadable and corrupt files ---------------------------------------------------------


def test_unreadable_weights_and_config(tiny_dir, monkeypatch):
    # Run as root here, chmod 000 would not stop a read: the OS's refusal is planted instead.
    import safetensors.torch

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "load_file", denied)
        with pytest.raises(CheckpointError, match="cannot read .*model.safetensors: Permission denied"):
            BertModel.from_pretrained(tiny_dir)
    with monkeypatch.context() as m:
        m.setattr(Path, "read_text", denied)
        with pytest.raises(ConfigError, match="cannot read .*config.json: Permission denied"):
            BertModel.from_pretrained(tiny_dir)
    with monkeypatch.context() as m:
        m.setattr(Path, "is_file", denied)
        with pytest.raises(CheckpointError, match="cannot read checkpoint .*Permission denied"):
            BertModel.from_pretrained(tiny_dir)


def test_config_json_that_is_a_directory(tiny_dir):
    (tiny_dir / "config.json").unlink()
    (tiny_dir / "config.json").mkdir()
    with pytest.raises(CheckpointError, match="no config for checkpoint"):
        BertModel.from_pretrained(tiny_dir)
    with pytest.raises(ConfigError, match="cannot read"):
        BertConfig.from_json_file(tiny_dir / "config.json")


def test_deeply_nested_config_json(tiny_dir):
    (tiny_dir / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError):
        BertModel.from_pretrained(tiny_dir)


def test_weights_file_that_is_a_directory_or_a_shard_that_is(sharded_dir):
    index = json.loads((sharded_dir / ckpt.SAFE_INDEX).read_text())
    shard = min(index["weight_map"].values())
    (sharded_dir / shard).unlink()
    (sharded_dir / shard).mkdir()
    with pytest.raises(CheckpointError, match="names 1 shard file"):
        BertModel.from_pretrained(sharded_dir)


def test_nul_in_a_path():
    with pytest.raises(CheckpointError, match="NUL"):
        BertModel.from_pretrained("some\x00where")


@pytest.mark.parametrize(
    "files, message",
    [
        ({}, "neither tokenizer.json nor vocab.txt"),
        ({"tokenizer.json": "{not json"}, "not a valid tokenizer file"),
        ({"tokenizer.json": ""}, "not a valid tokenizer file"),
        ({"vocab.txt": "a\nb\n"}, "not in the vocabulary"),
        ({"vocab.txt": "[UNK]\n[CLS]\n[SEP]\n", "tokenizer_config.json": "[1]"}, "JSON object"),
        ({"vocab.txt": "[UNK]\n[CLS]\n[SEP]\n", "tokenizer_config.json": "{"}, "not a valid tokenizer file"),
        ({"vocab.txt": b"\xff\xfe\x00"}, "not a valid tokenizer file"),
    ],
    ids=[
        "missing",
        "corrupt-json",
        "empty-json",
        "vocab-without-specials",
        "config-not-object",
        "config-not-json",
        "vocab-not-utf8",
    ],
)
def test_bad_tokenizer_files(tmp_path, files, message):
    for name, content in files.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(TokenizerError, match=message) as err:
        load_tokenizer(tmp_path)
    assert isinstance(err.value, CheckpointError) and isinstance(err.value, ValueError)


def test_unreadable_tokenizer(tmp_path, monkeypatch):
    _tiny_vocab(tmp_path)

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("os.open", denied)  # root reads any file: deny the system call the reader makes
    with pytest.raises(
        TokenizerError, match="refused to read .*vocab.txt: it cannot be opened \\(Permission denied\\)"
    ):
        load_tokenizer(tmp_path)


def test_600_random_header_bit_flips_load_or_raise_checkpoint_error(tiny_dir):
    """Each flip of one bit in the safetensors header either still describes a loadable
    file or is a CheckpointError: never another exception, a crash or a hang."""
    import random

    path = tiny_dir / "model.safetensors"
    original = path.read_bytes()
    header_end = 8 + int.from_bytes(original[:8], "little")
    rng = random.Random(0)
    live = BertModel(BertConfig(**TINY))
    outcomes = {"loaded": 0, "refused": 0}
    for _ in range(600):
        data = bytearray(original)
        bit = rng.randrange(header_end * 8)
        data[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(data))
        try:
            live.load_hf_state_dict(ckpt.read_weights(path).tensors, check_finite="ignore")
            outcomes["loaded"] += 1
        except CheckpointError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 500, outcomes


def test_directory_lock_nests_in_a_process_and_excludes_others(tmp_path):
    """A fine-tuning run holds its output folder's lock and saves into it: the nested save
    must not wait for its own process (two flocks from one process would, forever), while
    another process is still kept out until the outer holder lets go."""
    probe = (
        "import sys; from bert_port.checkpoint import DirectoryLock\n"
        "try:\n    DirectoryLock(sys.argv[1], blocking=False)\nexcept BlockingIOError:\n    sys.exit(3)\n"
    )
    outer = ckpt.DirectoryLock(tmp_path, blocking=False)
    try:
        inner = ckpt.DirectoryLock(tmp_path)  # would hang without re-entrancy
        inner.release()
        with ckpt.StagedWrite(tmp_path) as stage:  # a save inside the held folder
            stage.text("config.json", "{}")
        assert subprocess.run([sys.executable, "-c", probe, str(tmp_path)]).returncode == 3
    finally:
        outer.release()
    assert subprocess.run([sys.executable, "-c", probe, str(tmp_path)]).returncode == 0


def test_unknown_device_is_refused_before_any_file_is_read(tmp_path):
    """No path exists here: a device check that ran after locating or reading the files
    would raise CheckpointError instead."""
    with pytest.raises(ValueError, match="'tpu0' is not a device torch knows"):
        BertModel.from_pretrained(tmp_path / "nothing-here", device="tpu0")
