"""Finding checkpoints (`bert_port.checkpoint.locate`): model ids resolved in a local HF
cache built here, laid out as huggingface_hub lays it out, never over the network; the cache
folder chosen by the same environment variables as huggingface_hub."""

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
from conftest import (
    EXACT,
    REAL_SENTENCES,
    TINY,
    TOL,
    assert_bitwise,
    hf_model,
    outputs_on_real_tokens,
    port_from_hf,
    random_batch,
)

from bert_port import BertConfig, BertModel, CheckpointError, encode, load_tokenizer
from bert_port import checkpoint as ckpt

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
        port_from_hf(model, TINY, **EXACT).save_pretrained(tmp_path / name)
    files = lambda d: {n: tmp_path / d / n for n in ("config.json", "model.safetensors")}
    _add_to_cache(cache, "bert-base-uncased", files("old"), "a" * 40, ref=None)  # an older snapshot
    snapshot = _add_to_cache(cache, "bert-base-uncased", files("new"), "b" * 40)

    ours = BertModel.from_pretrained("bert-base-uncased", **EXACT)
    assert ours.source_dir == snapshot
    batch = random_batch(TINY["vocab_size"])
    assert_bitwise(outputs_on_real_tokens(ours, batch), outputs_on_real_tokens(new, batch))
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
    actual, expected = outputs_on_real_tokens(ours, batch), outputs_on_real_tokens(ref, batch)
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


def test_cached_snapshot_without_weights_says_the_download_is_incomplete(tmp_path, monkeypatch, no_network):
    """A snapshot with config.json but no weights is what an interrupted download leaves."""
    _clear_hf_env(monkeypatch, tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    snapshot = _add_to_cache(tmp_path / "hub", "org/partial", {"config.json": tmp_path / "config.json"}, "f" * 40)
    with pytest.raises(CheckpointError) as err:
        BertModel.from_pretrained("org/partial")
    msg = str(err.value)
    assert f"the cached snapshot {snapshot} of 'org/partial' holds no weights" in msg
    assert "download is incomplete: download the model again" in msg


def test_transformers_cache_keywords_are_accepted(tmp_path, monkeypatch, no_network, minilm_path):
    """`cache_dir` and `local_files_only`, as transformers takes them: the model is found in
    that cache (no variable names it), and is the one transformers finds there."""
    import transformers

    _clear_hf_env(monkeypatch, tmp_path / "home")
    monkeypatch.chdir(tmp_path)
    files = {n: minilm_path / n for n in ("config.json", "model.safetensors")}
    _add_to_cache(tmp_path / "elsewhere", "org/mini", files, "e" * 40)
    kwargs = dict(cache_dir=str(tmp_path / "elsewhere"), local_files_only=True)
    ours = BertModel.from_pretrained("org/mini", **kwargs, **EXACT)
    ref = transformers.BertModel.from_pretrained("org/mini", **kwargs, attn_implementation="eager").eval()
    batch = random_batch(ours.config.vocab_size)
    assert_bitwise(outputs_on_real_tokens(ours, batch), outputs_on_real_tokens(ref, batch))
    with pytest.raises(CheckpointError, match="the cache_dir argument"):
        BertModel.from_pretrained("org/other", **kwargs)


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


def test_a_dangling_safetensors_link_is_an_incomplete_download_not_a_fallback(tmp_path, monkeypatch, no_network):
    """A snapshot whose model.safetensors links to a blob that is gone, beside an older
    pytorch_model.bin: the load says the download is incomplete instead of quietly reading
    the stale .bin."""
    _clear_hf_env(monkeypatch, tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    torch.save(BertModel(BertConfig(**TINY)).hf_state_dict(), tmp_path / "pytorch_model.bin")
    files = {"config.json": tmp_path / "config.json", "pytorch_model.bin": tmp_path / "pytorch_model.bin"}
    snapshot = _add_to_cache(tmp_path / "hub", "org/dangling", files, "e" * 40)
    (snapshot / "model.safetensors").symlink_to("../../blobs/" + "0" * 64)  # the blob never arrived
    with pytest.raises(CheckpointError, match=r"model.safetensors is a link to a file that does not exist.*incomplete"):
        BertModel.from_pretrained("org/dangling")


def test_a_weights_name_that_is_a_folder_is_named_as_such(tmp_path):
    """model.safetensors that is a folder: the error says so, not "holds no weights ... found
    ['config.json', 'model.safetensors']"."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="model.safetensors is not a regular file") as err:
        BertModel.from_pretrained(tmp_path)
    assert "holds no weights" not in str(err.value)
