"""Round trip through Hugging Face format: save_pretrained -> transformers and back, bit for
bit; sharding; config and tokenizer files; interrupted saves; `bert-port-convert`; model
ids resolved in a local HF cache built here (never the network)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, EXACT, REAL_SENTENCES, TINY, TOL, hf_model, random_batch

from bert_port import BertConfig, BertModel, CheckpointError, encode, load_tokenizer
from bert_port import checkpoint as ckpt
from bert_port.cli.convert import main as convert_main


def _port_from_hf(hf, config: dict, attn: str = "eager") -> BertModel:
    """The port with `hf`'s weights, on the padded path: the same kernels on the same shapes
    as transformers, so outputs can be compared bit for bit."""
    model = BertModel(BertConfig.from_dict(config, attn_implementation=attn, unpad_inputs=False))
    model.load_hf_state_dict(hf.state_dict())
    return model.eval()


def _run(model, batch):
    """Last hidden state on real tokens (pad positions zeroed: the port's unpadded default
    writes zeros there, transformers computes values no consumer reads) and the pooler."""
    with torch.no_grad():
        out = model(**batch)
    hidden = out["last_hidden_state"]
    if isinstance(batch, dict) and "attention_mask" in batch:
        hidden = hidden.masked_fill(~batch["attention_mask"].bool()[..., None], 0)
    return hidden, out["pooler_output"]


def _assert_bitwise(actual, expected):
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert torch.equal(a, e), f"max abs diff {(a - e).abs().max().item():.3e}"


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
    ours = _port_from_hf(hf, TINY, attn)
    ours.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    mode = os.stat(tmp_path / "model.safetensors").st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask  # not mkstemp's 0600

    back_in_hf = _hf_load(tmp_path, attn)
    for key, tensor in hf.state_dict().items():
        assert torch.equal(back_in_hf.state_dict()[key], tensor), key
    back_in_port = BertModel.from_pretrained(tmp_path, attn_implementation=attn, unpad_inputs=False)
    for pad in ("right", "left"):
        batch = random_batch(TINY["vocab_size"], pad=pad)
        expected = _run(ours, batch)
        _assert_bitwise(_run(back_in_hf, batch), expected)
        _assert_bitwise(_run(back_in_port, batch), expected)
        _assert_bitwise(_run(hf, batch), expected)


def test_half_precision_save_loads_in_its_own_dtype(tmp_path):
    """transformers loads with dtype="auto", i.e. the config's dtype: the saved config must
    name the saved tensors' dtype even when the config read said float32."""
    hf = hf_model(TINY)
    ours = _port_from_hf(hf, {**TINY, "torch_dtype": "float32"}).to(torch.bfloat16)
    ours.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["dtype"] == "bfloat16" and written["torch_dtype"] == "bfloat16"
    back = _hf_load(tmp_path)
    assert back.dtype == torch.bfloat16
    batch = random_batch(TINY["vocab_size"])
    _assert_bitwise(_run(back, batch), _run(ours, batch))


def test_bert_base_layout_round_trip(bert_base_layout, tmp_path):
    """Legacy bert-base-uncased layout (bert. prefixes, gamma/beta, cls heads, as a
    pytorch_model.bin): load, save, reload in transformers and in the port, bit for bit.
    (Loading the fixture's safetensors copy is covered in test_foundation.)"""
    root, reference = bert_base_layout
    fmt = "bin"
    ours = BertModel.from_pretrained(root / fmt, **EXACT)
    ours.save_pretrained(tmp_path)
    keys = ckpt.read_weights(tmp_path / "model.safetensors").keys()
    assert not [k for k in keys if k.startswith(("bert.", "cls.")) or k.endswith(("gamma", "beta"))]

    batch = random_batch(30522, B=2, T=12)
    expected = _run(ours, batch)
    _assert_bitwise(_run(reference, batch), expected)  # reference: the same weights in transformers
    back_in_hf = _hf_load(tmp_path)
    _assert_bitwise(_run(back_in_hf, batch), expected)
    del back_in_hf
    back_in_port = BertModel.from_pretrained(tmp_path, **EXACT)
    _assert_bitwise(_run(back_in_port, batch), expected)
    written = json.loads((tmp_path / "config.json").read_text())
    read = json.loads((root / fmt / "config.json").read_text())
    assert {k: v for k, v in written.items() if k in read and k != "architectures"} == {
        k: v for k, v in read.items() if k != "architectures"
    }
    assert written["architectures"] == ["BertModel"]


def test_sharded_save_loads_in_transformers_and_port(tmp_path):
    hf = hf_model(TINY)
    ours = _port_from_hf(hf, TINY)
    ours.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / ckpt.SAFE_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(ours.hf_state_dict())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ours.state_dict().values())
    assert not (tmp_path / ckpt.SAFE_WEIGHTS).exists()

    batch = random_batch(TINY["vocab_size"])
    expected = _run(ours, batch)
    _assert_bitwise(_run(_hf_load(tmp_path), batch), expected)
    _assert_bitwise(_run(BertModel.from_pretrained(tmp_path, **EXACT), batch), expected)

    # Saving again unsharded removes the shards and index (model.safetensors would win anyway,
    # but stale shards must not linger); sharding again removes model.safetensors, which
    # would otherwise shadow the new index in both loaders.
    ours.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    ours.save_pretrained(tmp_path, max_shard_size=30_000)
    assert not (tmp_path / ckpt.SAFE_WEIGHTS).exists() and (tmp_path / ckpt.SAFE_INDEX).exists()
    _assert_bitwise(_run(BertModel.from_pretrained(tmp_path, **EXACT), batch), expected)


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
    _assert_bitwise(_run(BertModel.from_pretrained(tmp_path / "out"), ids), _run(ours, ids))

    # A model loaded from a directory without tokenizer files saves none.
    hf = hf_model(TINY)
    _port_from_hf(hf, TINY).save_pretrained(tmp_path / "bare")
    BertModel.from_pretrained(tmp_path / "bare").save_pretrained(tmp_path / "bare2")
    assert sorted(p.name for p in (tmp_path / "bare2").iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("shard_size", ["5GB", "20KB"], ids=["single", "sharded"])
def test_interrupted_save_leaves_previous_checkpoint(tmp_path, monkeypatch, shard_size):
    import safetensors.torch

    hf = hf_model(TINY)
    ours = _port_from_hf(hf, TINY)
    ours.save_pretrained(tmp_path, max_shard_size=shard_size)
    before = _listing(tmp_path)
    batch = random_batch(TINY["vocab_size"])
    expected = _run(ours, batch)

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
    _assert_bitwise(_run(BertModel.from_pretrained(tmp_path, **EXACT), batch), expected)
    _assert_bitwise(_run(_hf_load(tmp_path), batch), expected)


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
    return pretraining.bert


def test_convert_legacy_bin_to_clean_safetensors(tmp_path, capsys):
    reference = _legacy_tiny(tmp_path / "src")
    assert not __import__("zipfile").is_zipfile(tmp_path / "src" / "pytorch_model.bin")  # the old format
    assert convert_main([str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    report = capsys.readouterr().out
    assert "dropped:   9 pretraining-head tensors" in report and "cls.seq_relationship.weight" in report
    assert "skipped:   1 buffers: bert.embeddings.position_ids" in report
    assert "12 legacy LayerNorm gamma/beta" in report and "verified:" in report

    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == ["config.json", "model.safetensors"]
    keys = set(ckpt.read_weights(tmp_path / "dst" / "model.safetensors"))
    assert keys == {k for k in reference.state_dict() if not k.endswith(("position_ids", "token_type_ids"))}
    batch = random_batch(TINY["vocab_size"])
    expected = _run(reference, batch)
    _assert_bitwise(_run(_hf_load(tmp_path / "dst"), batch), expected)
    _assert_bitwise(_run(BertModel.from_pretrained(tmp_path / "dst", **EXACT), batch), expected)


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


# -- model ids from the local HF cache --------------------------------------------------


def _add_to_cache(cache: Path, repo_id: str, files: dict[str, Path], commit: str, ref: str | None = "main") -> Path:
    """Lay files out as huggingface_hub does: blobs named by content hash, snapshot entries
    as relative symlinks to them, refs/<ref> holding the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, src in files.items():
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no trailing newline, as the hub writes it
    return snapshot


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the network was touched")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def _clear_hf_env(monkeypatch, home: Path):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME", "HOME"])
def test_model_id_found_in_hf_cache(tmp_path, monkeypatch, no_network, variable):
    _clear_hf_env(monkeypatch, tmp_path / "home")
    cache = {
        "HF_HUB_CACHE": tmp_path / "hub",
        "HUGGINGFACE_HUB_CACHE": tmp_path / "hub",
        "HF_HOME": tmp_path / "hf" / "hub",
        "XDG_CACHE_HOME": tmp_path / "xdg" / "huggingface" / "hub",
        "HOME": tmp_path / "home" / ".cache" / "huggingface" / "hub",
    }[variable]
    if variable != "HOME":
        monkeypatch.setenv(
            variable,
            str(
                cache.parent.parent
                if variable == "XDG_CACHE_HOME"
                else cache.parent
                if variable == "HF_HOME"
                else cache
            ),
        )
    monkeypatch.chdir(tmp_path)  # "bert-base-uncased" is no local path here

    old, new = hf_model(TINY), hf_model({**TINY, "initializer_range": 0.5})
    for name, model in (("old", old), ("new", new)):
        _port_from_hf(model, TINY).save_pretrained(tmp_path / name)
    files = lambda d: {n: tmp_path / d / n for n in ("config.json", "model.safetensors")}
    _add_to_cache(cache, "bert-base-uncased", files("old"), "a" * 40, ref=None)  # an older snapshot
    snapshot = _add_to_cache(cache, "bert-base-uncased", files("new"), "b" * 40)

    ours = BertModel.from_pretrained("bert-base-uncased", **EXACT)
    assert ours.source_dir == snapshot
    batch = random_batch(TINY["vocab_size"])
    _assert_bitwise(_run(ours, batch), _run(new, batch))
    assert BertModel.from_pretrained("bert-base-uncased", revision="a" * 40).source_dir.name == "a" * 40


def test_org_name_id_and_transformers_agree_on_the_layout(tmp_path, monkeypatch, no_network, minilm_path):
    """The real all-MiniLM-L6-v2 files, cached under their hub id: the port finds them by id,
    and transformers, pointed at the same cache offline, finds the same snapshot."""
    import transformers

    _clear_hf_env(monkeypatch, tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    files = {p.name: p for p in minilm_path.iterdir() if p.is_file()}
    snapshot = _add_to_cache(tmp_path / "hub", "sentence-transformers/all-MiniLM-L6-v2", files, "c" * 40)
    ours = BertModel.from_pretrained("sentence-transformers/all-MiniLM-L6-v2")
    assert ours.source_dir == snapshot
    ref = transformers.BertModel.from_pretrained(
        "sentence-transformers/all-MiniLM-L6-v2", cache_dir=str(tmp_path / "hub"), local_files_only=True
    ).eval()
    batch = encode(load_tokenizer(ours.source_dir), REAL_SENTENCES)
    actual, expected = _run(ours, batch), _run(ref, batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(actual[0][real], expected[0][real], **TOL[torch.float32])


def test_model_id_absent_names_the_directories_searched(tmp_path, monkeypatch, no_network):
    _clear_hf_env(monkeypatch, tmp_path)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as err:
        BertModel.from_pretrained("bert-base-uncased")
    msg = str(err.value)
    assert str(tmp_path / "hf" / "hub" / "models--bert-base-uncased") in msg and "HF_HOME" in msg
    assert str(tmp_path / "bert-base-uncased") in msg and "HF_HUB_CACHE" in msg  # the local path, and the fix

    # A ref pointing at a snapshot that is not there (an interrupted download).
    repo = tmp_path / "hf" / "hub" / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("d" * 40)
    with pytest.raises(CheckpointError, match="interrupted download") as err:
        BertModel.from_pretrained("org/name")
    assert str(repo / "snapshots" / ("d" * 40)) in str(err.value)


def test_cache_dir_rules_match_huggingface_hub(tmp_path, monkeypatch):
    """hf_cache_dir() against huggingface_hub.constants.HF_HUB_CACHE itself, for each way of
    setting the environment (constants are computed at import, so a fresh process reloads them)."""
    cases = [
        {},
        {"XDG_CACHE_HOME": "/x/cache"},
        {"HF_HOME": "/h/home", "XDG_CACHE_HOME": "/x/cache"},
        {"HF_HOME": "~/hf", "HUGGINGFACE_HUB_CACHE": "$HOME/legacy"},
        {"HF_HUB_CACHE": "$HOME/new", "HUGGINGFACE_HUB_CACHE": "/legacy", "HF_HOME": "/h"},
        {"HF_HUB_CACHE": "~/hub"},
    ]
    code = """
import importlib, json, os, sys
import huggingface_hub.constants as constants
out = []
for case in json.loads(sys.argv[1]):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        os.environ.pop(var, None)
    os.environ.update(case)
    importlib.reload(constants)
    out.append(constants.HF_HUB_CACHE)
print(json.dumps(out))
"""
    env = {**os.environ, "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    theirs = json.loads(result.stdout)
    assert len(theirs) == len(cases)
    for case, expected in zip(cases, theirs):
        _clear_hf_env(monkeypatch, tmp_path)
        for var, value in case.items():
            monkeypatch.setenv(var, value)
        assert str(ckpt.hf_cache_dir()[0]) == os.path.normpath(expected), case


def test_snapshot_files_copied_not_linked(tmp_path, monkeypatch, no_network, minilm_path):
    """Saving a model loaded from the cache writes real files, not symlinks into the cache."""
    _clear_hf_env(monkeypatch, tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    files = {n: minilm_path / n for n in ("config.json", "model.safetensors", "vocab.txt", "tokenizer.json")}
    _add_to_cache(tmp_path / "hub", "org/mini", files, "e" * 40)
    BertModel.from_pretrained("org/mini").save_pretrained(tmp_path / "out")
    for name in ("vocab.txt", "tokenizer.json"):
        assert not (tmp_path / "out" / name).is_symlink()
        assert (tmp_path / "out" / name).read_bytes() == (minilm_path / name).read_bytes()
    shutil.rmtree(tmp_path / "hub")  # the saved checkpoint does not depend on the cache
    assert BertModel.from_pretrained(tmp_path / "out").config.hidden_size == 384
