"""Checkpoint files (`bert_port.checkpoint`'s reading, staging and shards): the round trip through Hugging Face format
(save_pretrained -> transformers and back, bit for bit), sharding, config and tokenizer
files, interrupted saves, `bert-port-convert`, and the NaN/Inf check of mapped weights."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    CONFIGS,
    EXACT,
    REAL_SENTENCES,
    TINY,
    assert_bitwise,
    hf_model,
    outputs_on_real_tokens,
    port_from_hf,
    random_batch,
)

from bert_port import BertModel, encode, load_tokenizer
from bert_port import checkpoint as ckpt
from bert_port.cli.convert import main as convert_main


def _hf_load(directory, attn: str = "eager"):
    """transformers' own loader, with its loading report: nothing may be missing or left over."""
    import transformers

    model, info = transformers.BertModel.from_pretrained(
        str(directory), output_loading_info=True, attn_implementation=attn
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set() and info["error_msgs"] == [], info
    return model.eval()


def _listing(directory: Path) -> dict[str, str]:
    """Every file in `directory` (hidden ones too) with the hash of its bytes."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


# -- save_pretrained -> transformers -> port --------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tiny_round_trip_is_bitwise(tmp_path, attn):
    hf = hf_model(TINY, attn=attn)
    ours = port_from_hf(hf, TINY, attn_implementation=attn, optimize=False)
    ours.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    mode = os.stat(tmp_path / "model.safetensors").st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask  # not mkstemp's 0600

    back_in_hf = _hf_load(tmp_path, attn)
    for key, tensor in hf.state_dict().items():
        assert torch.equal(back_in_hf.state_dict()[key], tensor), key
    back_in_port = BertModel.from_pretrained(tmp_path, attn_implementation=attn, optimize=False)
    for pad in ("right", "left"):
        batch = random_batch(TINY["vocab_size"], pad=pad)
        expected = outputs_on_real_tokens(ours, batch)
        assert_bitwise(outputs_on_real_tokens(back_in_hf, batch), expected)
        assert_bitwise(outputs_on_real_tokens(back_in_port, batch), expected)
        assert_bitwise(outputs_on_real_tokens(hf, batch), expected)


def test_half_precision_save_loads_in_its_own_dtype(tmp_path):
    """transformers loads with dtype="auto", i.e. the config's dtype: the saved config must
    name the saved tensors' dtype even when the config read said float32."""
    hf = hf_model(TINY)
    ours = port_from_hf(hf, {**TINY, "torch_dtype": "float32"}, **EXACT).to(torch.bfloat16)
    ours.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["dtype"] == "bfloat16" and written["torch_dtype"] == "bfloat16"
    back = _hf_load(tmp_path)
    assert back.dtype == torch.bfloat16
    batch = random_batch(TINY["vocab_size"])
    assert_bitwise(outputs_on_real_tokens(back, batch), outputs_on_real_tokens(ours, batch))


def test_bert_base_layout_round_trip(bert_base_layout, tmp_path):
    """Legacy bert-base-uncased layout (bert. prefixes, gamma/beta, cls heads, as a
    pytorch_model.bin): load, save, reload in transformers and in the port, bit for bit.
    (Loading the fixture's safetensors copy is covered in test_bert.)"""
    root, reference = bert_base_layout
    fmt = "bin"
    ours = BertModel.from_pretrained(root / fmt, **EXACT)
    ours.save_pretrained(tmp_path)
    keys = ckpt.read_weights(tmp_path / "model.safetensors").tensors.keys()
    assert not [k for k in keys if k.startswith(("bert.", "cls.")) or k.endswith(("gamma", "beta"))]

    batch = random_batch(30522, B=2, T=12)
    expected = outputs_on_real_tokens(ours, batch)
    assert_bitwise(outputs_on_real_tokens(reference, batch), expected)  # reference: the same weights in transformers
    back_in_hf = _hf_load(tmp_path)
    assert_bitwise(outputs_on_real_tokens(back_in_hf, batch), expected)
    del back_in_hf
    back_in_port = BertModel.from_pretrained(tmp_path, **EXACT)
    assert_bitwise(outputs_on_real_tokens(back_in_port, batch), expected)
    written = json.loads((tmp_path / "config.json").read_text())
    read = json.loads((root / fmt / "config.json").read_text())
    assert {k: v for k, v in written.items() if k in read and k != "architectures"} == {
        k: v for k, v in read.items() if k != "architectures"
    }
    assert written["architectures"] == ["BertModel"]


def test_sharded_save_loads_in_transformers_and_port(tmp_path):
    hf = hf_model(TINY)
    ours = port_from_hf(hf, TINY, **EXACT)
    ours.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / ckpt.SAFE_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(ours.hf_state_dict())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ours.state_dict().values())
    assert not (tmp_path / ckpt.SAFE_WEIGHTS).exists()

    batch = random_batch(TINY["vocab_size"])
    expected = outputs_on_real_tokens(ours, batch)
    assert_bitwise(outputs_on_real_tokens(_hf_load(tmp_path), batch), expected)
    assert_bitwise(outputs_on_real_tokens(BertModel.from_pretrained(tmp_path, **EXACT), batch), expected)

    # Saving again unsharded removes the shards and index (model.safetensors would win anyway,
    # but stale shards must not linger); sharding again removes model.safetensors, which
    # would otherwise shadow the new index in both loaders.
    ours.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    ours.save_pretrained(tmp_path, max_shard_size=30_000)
    assert not (tmp_path / ckpt.SAFE_WEIGHTS).exists() and (tmp_path / ckpt.SAFE_INDEX).exists()
    assert_bitwise(outputs_on_real_tokens(BertModel.from_pretrained(tmp_path, **EXACT), batch), expected)


def test_config_keeps_every_field_it_read(tmp_path):
    raw = json.loads((CONFIGS / "bert-base-uncased.json").read_text())
    raw.update(TINY)  # tiny sizes, every other field of the real config
    raw.update(
        {
            "_name_or_path": "someone/tiny",
            "torch_dtype": "float32",
            "num_labels": 3,
            "problem_type": None,
            "custom_field": {"nested": [1, 2.5, None]},
            "id2label": {"0": "a", "1": "b", "2": "c"},
        }
    )
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(raw))
    hf = hf_model(TINY)
    ckpt.write_weights(hf.state_dict(), src)
    BertModel.from_pretrained(src).save_pretrained(tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    owned = {"architectures": ["BertModel"], "dtype": "float32"}  # what the saved files are
    for key, value in raw.items():
        assert written[key] == owned.get(key, value), key
    assert written["dtype"] == "float32" and "attn_implementation" not in written
    import transformers

    assert transformers.BertConfig.from_pretrained(str(tmp_path / "out")).num_labels == 3


def test_tokenizer_files_copied_when_loaded_with_them(minilm_path, tmp_path):
    ours = BertModel.from_pretrained(minilm_path)
    ours.save_pretrained(tmp_path / "out")
    copied = [n for n in ckpt.TOKENIZER_FILES if (minilm_path / n).is_file()]
    assert "tokenizer.json" in copied and "vocab.txt" in copied
    for name in copied:
        assert (tmp_path / "out" / name).read_bytes() == (minilm_path / name).read_bytes(), name
    ids = encode(load_tokenizer(tmp_path / "out"), REAL_SENTENCES[:3])
    assert torch.equal(ids["input_ids"], encode(load_tokenizer(minilm_path), REAL_SENTENCES[:3])["input_ids"])
    assert_bitwise(
        outputs_on_real_tokens(BertModel.from_pretrained(tmp_path / "out"), ids), outputs_on_real_tokens(ours, ids)
    )

    # A model loaded from a directory without tokenizer files saves none.
    hf = hf_model(TINY)
    port_from_hf(hf, TINY, **EXACT).save_pretrained(tmp_path / "bare")
    BertModel.from_pretrained(tmp_path / "bare").save_pretrained(tmp_path / "bare2")
    assert sorted(p.name for p in (tmp_path / "bare2").iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("shard_size", ["5GB", "20KB"], ids=["single", "sharded"])
def test_interrupted_save_leaves_previous_checkpoint(tmp_path, monkeypatch, shard_size):
    import safetensors.torch

    hf = hf_model(TINY)
    ours = port_from_hf(hf, TINY, **EXACT)
    ours.save_pretrained(tmp_path, max_shard_size=shard_size)
    before = _listing(tmp_path)
    batch = random_batch(TINY["vocab_size"])
    expected = outputs_on_real_tokens(ours, batch)

    with torch.no_grad():  # a different model, same names and shapes: shards would mix silently
        for p in ours.parameters():
            p.add_(1.0)
    real_save_file = safetensors.torch.save_file
    calls = []

    def dies_midway(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2 or shard_size == "5GB":
            Path(filename).write_bytes(b"\x00" * 100)  # a partial file, then the crash
            raise OSError("No space left on device")
        real_save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", dies_midway)
    with pytest.raises(OSError, match="No space left"):
        ours.save_pretrained(tmp_path, max_shard_size=shard_size)
    monkeypatch.undo()

    assert _listing(tmp_path) == before  # same names, same bytes, no temporaries left
    assert all(not Path(c).exists() for c in calls)
    assert_bitwise(outputs_on_real_tokens(BertModel.from_pretrained(tmp_path, **EXACT), batch), expected)
    assert_bitwise(outputs_on_real_tokens(_hf_load(tmp_path), batch), expected)


# -- bert-port-convert ------------------------------------------------------------------


def _legacy_tiny(directory: Path, legacy_pickle: bool = True):
    """A tiny checkpoint in the old bert-base-uncased layout: BertForPreTraining keys under
    `bert.`, LayerNorm gamma/beta, cls.* heads, the position_ids buffer, written by
    torch.save in the pre-1.6 (non-zip) format. Returns transformers' BertModel of it."""
    pretraining = hf_model(TINY, "BertForPreTraining")
    state = {}
    for key, tensor in pretraining.state_dict().items():
        key = key.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        state[key] = tensor.clone()
    state["bert.embeddings.position_ids"] = torch.arange(TINY["max_position_embeddings"])[None]
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(state, directory / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy_pickle)
    (directory / "config.json").write_text(json.dumps({**TINY, "architectures": ["BertForPreTraining"]}))
    return pretraining


def test_convert_legacy_bin_to_clean_safetensors(tmp_path, capsys):
    reference = _legacy_tiny(tmp_path / "src").bert
    assert not __import__("zipfile").is_zipfile(tmp_path / "src" / "pytorch_model.bin")  # the old format
    assert convert_main([str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    report = capsys.readouterr().out
    assert "dropped:   9 pretraining-head tensors" in report and "cls.seq_relationship.weight" in report
    assert "skipped:   1 buffers: bert.embeddings.position_ids" in report
    assert "12 legacy LayerNorm gamma/beta" in report and "verified:" in report

    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == ["config.json", "model.safetensors"]
    keys = set(ckpt.read_weights(tmp_path / "dst" / "model.safetensors").tensors)
    assert keys == {k for k in reference.state_dict() if not k.endswith(("position_ids", "token_type_ids"))}
    batch = random_batch(TINY["vocab_size"])
    expected = outputs_on_real_tokens(reference, batch)
    assert_bitwise(outputs_on_real_tokens(_hf_load(tmp_path / "dst"), batch), expected)
    assert_bitwise(outputs_on_real_tokens(BertModel.from_pretrained(tmp_path / "dst", **EXACT), batch), expected)


def _hf_load_as(cls_name: str, directory: Path):
    """transformers' `cls_name` from `directory`, with nothing missing, left over or mismatched."""
    import transformers

    model, info = getattr(transformers, cls_name).from_pretrained(
        str(directory), output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.eval()


def test_convert_keeps_the_pretraining_heads_with_keep_heads(tmp_path, capsys):
    reference = _legacy_tiny(tmp_path / "src", legacy_pickle=False).eval()
    assert convert_main([str(tmp_path / "src"), str(tmp_path / "dst"), "--keep-heads"]) == 0
    report = capsys.readouterr().out
    assert "model:     BertForPreTraining" in report and "dropped:   0 pretraining-head tensors" in report
    assert "verified:" in report
    converted = _hf_load_as("BertForPreTraining", tmp_path / "dst")
    batch = random_batch(TINY["vocab_size"])
    with torch.no_grad():
        got, expected = converted(**batch), reference(**batch)
    assert_bitwise(
        (got.prediction_logits, got.seq_relationship_logits),
        (expected.prediction_logits, expected.seq_relationship_logits),
    )


def test_convert_without_keep_heads_says_how_to_keep_them(tmp_path, capsys):
    _legacy_tiny(tmp_path / "src", legacy_pickle=False)
    assert convert_main([str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    assert "(--keep-heads keeps them)" in capsys.readouterr().out
    # An NSP head alone is not kept by the flag either, and the report does not offer it.
    source = hf_model(TINY, "BertForNextSentencePrediction")
    source.save_pretrained(tmp_path / "nsp")
    assert convert_main([str(tmp_path / "nsp"), str(tmp_path / "nsp-dst"), "--keep-heads"]) == 0
    report = capsys.readouterr().out
    assert "model:     BertModel" in report and "dropped:   2 pretraining-head tensors" in report
    assert "--keep-heads keeps them" not in report


def test_convert_tells_a_token_classifier_by_its_missing_pooler(tmp_path, capsys):
    """Without `architectures` in config.json, a classifier without a pooler is a token
    classifier (transformers' sequence classifier always has one); a multiple-choice head,
    which the port lacks, is refused by name."""
    source = hf_model({**TINY, "num_labels": 3}, "BertForTokenClassification")
    source.save_pretrained(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    assert convert_main([str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    assert "model:     BertForTokenClassification" in capsys.readouterr().out
    _hf_load_as("BertForTokenClassification", tmp_path / "dst")

    hf_model(TINY, "BertForMultipleChoice").save_pretrained(tmp_path / "mc")
    assert convert_main([str(tmp_path / "mc"), str(tmp_path / "mc-dst")]) == 2
    assert "BertForMultipleChoice checkpoint, whose head the port does not have" in capsys.readouterr().err
    assert not (tmp_path / "mc-dst").exists()


@pytest.mark.parametrize("cls_name", ["BertForTokenClassification", "BertForQuestionAnswering", "BertForMaskedLM"])
def test_convert_keeps_what_the_checkpoint_is(tmp_path, capsys, cls_name):
    """A task model stays that model: a token classifier does not become a sequence
    classifier (config.json's `architectures` tells them apart), a QA head is not lost, and
    an MLM-only checkpoint with --keep-heads is a BertForMaskedLM."""
    source = hf_model({**TINY, "num_labels": 2 if cls_name == "BertForQuestionAnswering" else 3}, cls_name)
    source.save_pretrained(tmp_path / "src")
    assert convert_main([str(tmp_path / "src"), str(tmp_path / "dst"), "--keep-heads"]) == 0
    assert f"model:     {cls_name}" in capsys.readouterr().out
    converted = _hf_load_as(cls_name, tmp_path / "dst")
    batch = random_batch(TINY["vocab_size"])
    with torch.no_grad():
        assert_bitwise(tuple(converted(**batch).values()), tuple(source.eval()(**batch).values()))


def test_convert_sharded_dtype_and_overwrite(tmp_path, capsys):
    _legacy_tiny(tmp_path / "src", legacy_pickle=False)
    dst = tmp_path / "dst"
    args = [str(tmp_path / "src"), str(dst), "--max-shard-size", "20KB", "--dtype", "bfloat16"]
    assert convert_main(args) == 0
    assert (dst / ckpt.SAFE_INDEX).is_file() and BertModel.from_pretrained(dst).dtype == torch.bfloat16
    capsys.readouterr()
    before = _listing(dst)
    assert convert_main(args) == 2  # DST holds a checkpoint: refuse without --overwrite
    assert "--overwrite" in capsys.readouterr().err and _listing(dst) == before
    assert convert_main(args[:2] + ["--overwrite"]) == 0
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]
    assert convert_main([str(tmp_path / "src"), str(tmp_path / "src")]) == 2  # never in place


def test_convert_bad_input_exits_2_and_writes_nothing(tmp_path, capsys):
    _legacy_tiny(tmp_path / "src", legacy_pickle=False)
    path = tmp_path / "src" / "pytorch_model.bin"
    path.write_bytes(path.read_bytes()[:2000])
    assert convert_main([str(tmp_path / "src"), str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err
    assert "truncated or corrupt" in err and str(path) in err
    assert not (tmp_path / "dst").exists()
    assert convert_main([str(tmp_path / "nowhere"), str(tmp_path / "dst")]) == 2


def test_convert_keeps_a_classification_head(tmp_path, capsys):
    """A DDP-wrapped (`module.`) BertForSequenceClassification .bin becomes HF's own layout,
    head included: transformers' BertForSequenceClassification loads it with nothing missing."""
    import transformers

    config = {**TINY, "id2label": {"0": "neg", "1": "neutral", "2": "pos"}}
    hf = hf_model(config, "BertForSequenceClassification")
    (tmp_path / "src").mkdir()
    torch.save({"module." + k: v for k, v in hf.state_dict().items()}, tmp_path / "src" / "pytorch_model.bin")
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    assert convert_main([str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    assert "BertForSequenceClassification" in capsys.readouterr().out
    back, info = transformers.BertForSequenceClassification.from_pretrained(
        str(tmp_path / "dst"), output_loading_info=True, attn_implementation="eager"
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert back.config.id2label == {0: "neg", 1: "neutral", 2: "pos"}
    batch = random_batch(TINY["vocab_size"])
    with torch.no_grad():
        assert torch.equal(back.eval()(**batch).logits, hf(**batch).logits)


def test_convert_script_shim_runs(tmp_path, monkeypatch, capsys):
    import runpy

    _legacy_tiny(tmp_path / "src", legacy_pickle=False)
    script = Path(__file__).resolve().parent.parent / "scripts" / "convert.py"
    monkeypatch.setattr(sys, "argv", [str(script), str(tmp_path / "src"), str(tmp_path / "dst")])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code == 0 and "verified:" in capsys.readouterr().out
    assert (tmp_path / "dst" / "model.safetensors").is_file()


# -- the NaN/Inf check of mapped weights -------------------------------------------------


def test_finite_check_of_mapped_weights_sees_in_place_changes_and_replaced_files(tmp_path):
    """The check reads a memory-mapped tensor from its file only while the file still holds
    its values: a NaN written into the tensor in place, or a file replaced after the load,
    is checked in the tensor itself."""
    state = {"a": torch.randn(1000, 50), "b": torch.randn(7)}
    ckpt.write_weights(state, tmp_path)
    loaded = ckpt.read_weights(tmp_path / "model.safetensors")
    assert set(loaded.spans) == {"a", "b"}  # the reader says where each mapped tensor lies
    assert ckpt.non_finite(loaded.tensors, loaded.spans) == []
    loaded.tensors["a"][3, 4] = float("nan")  # a private mapping: the file keeps its finite value
    assert ckpt.non_finite(loaded.tensors, loaded.spans) == ["a (1 of 50000 values NaN/Inf)"]

    loaded = ckpt.read_weights(tmp_path / "model.safetensors")
    ckpt.write_weights({**state, "b": torch.full((7,), float("inf"))}, tmp_path)  # renamed over it
    assert ckpt.non_finite(loaded.tensors, loaded.spans) == []  # the mapped (old) values are finite
    fresh = ckpt.read_weights(tmp_path / "model.safetensors")
    assert ckpt.non_finite(fresh.tensors, fresh.spans) == ["b (7 of 7 values NaN/Inf)"]
