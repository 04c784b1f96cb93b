"""Every file of a sentence-transformers folder is read as the checkpoint's own files are: a
FIFO, a device or an oversized file is refused in one line naming it, never waited on, read
until memory runs out, or taken for absent; module paths stay inside the folder, as
sentence-transformers requires; a pooling mode of the wrong type is one line too."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from bert_port import SentenceEncoder
from bert_port import checkpoint as ckpt
from bert_port.sentence_folder import read_pipeline
from bert_port.storage import bounded
from bert_port.tokenization import TokenizerError


def _in_thread(fn, *args):
    """What `fn(*args)` returned or raised, run in a daemon thread so that a call that blocks
    (the failure under test) fails the test instead of hanging the suite."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 -- handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), f"{fn.__name__} blocked"
    return box


def _folder(minilm_path: Path, directory: Path) -> Path:
    """A copy of the bundled all-MiniLM-L6-v2 folder, its weights a link (links are followed,
    as the Hugging Face cache's links into its blobs are)."""
    shutil.copytree(minilm_path, directory, ignore=shutil.ignore_patterns("model.safetensors"))
    (directory / "model.safetensors").symlink_to(minilm_path / "model.safetensors")
    return directory


def _plant(path: Path, kind: str) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    else:  # sparse: no disk used
        with open(path, "wb") as f:
            f.truncate(bounded.TOKENIZER + 1 if path.name in ("tokenizer.json", "vocab.txt") else bounded.JSON + 1)


def _one_line_naming(box: dict, path: Path, error_type: type = ckpt.CheckpointError) -> str:
    error = box.get("error")
    assert isinstance(error, error_type), box
    message = str(error)
    assert str(path) in message and "\n" not in message, message
    return message


PIPELINE_FILES = [
    "modules.json",
    "1_Pooling/config.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
]


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "oversized"])
@pytest.mark.parametrize("name", PIPELINE_FILES)
def test_odd_pipeline_file_is_refused_without_hanging(minilm_path, tmp_path, name, kind):
    """A FIFO or /dev/zero modules.json is refused, not taken for absent (which would encode
    without the Normalize module); the same for every file of the pipeline."""
    folder = _folder(minilm_path, tmp_path / "m")
    _plant(folder / name, kind)
    message = _one_line_naming(_in_thread(SentenceEncoder.from_pretrained, folder), folder / name)
    assert "refused to read" in message and "restore it from the original checkpoint" in message
    assert {"fifo": "FIFO", "dev-zero": "character device", "oversized": "more than"}[kind] in message


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "oversized"])
@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "vocab.txt"])
def test_odd_tokenizer_file_is_refused_without_hanging(minilm_path, tmp_path, name, kind):
    """A FIFO tokenizer.json is refused, not passed over for vocab.txt."""
    folder = _folder(minilm_path, tmp_path / "m")
    if name == "vocab.txt":
        (folder / "tokenizer.json").unlink()  # vocab.txt is read when there is no tokenizer.json
    _plant(folder / name, kind)
    message = _one_line_naming(_in_thread(SentenceEncoder.from_pretrained, folder), folder / name, TokenizerError)
    assert "refused to read" in message and "tokenizer files" in message


def test_a_link_to_a_regular_file_is_followed_as_for_the_weights(minilm_path, tmp_path):
    """Links are followed, as the weights' are (the hub cache's files are links into its blobs),
    when they lead to a regular file of bounded size: what is refused is what the file is."""
    folder = _folder(minilm_path, tmp_path / "m")
    (folder / "1_Pooling" / "config.json").unlink()
    (folder / "1_Pooling" / "config.json").symlink_to(minilm_path / "1_Pooling" / "config.json")
    assert read_pipeline(folder)["pooling"] == ("mean",)


def _modules(folder: Path) -> list[dict]:
    return json.loads((folder / "modules.json").read_text())


@pytest.mark.parametrize("path", ["../outside", "/etc", "1_Pooling/../../outside", "C:\\Pooling"])
def test_module_path_out_of_the_folder_is_refused_as_sentence_transformers_refuses_it(minilm_path, tmp_path, path):
    from sentence_transformers import SentenceTransformer

    folder = _folder(minilm_path, tmp_path / "m")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text(json.dumps({"word_embedding_dimension": 384, "pooling_mode_cls_token": True}))
    modules = _modules(folder)
    modules[1]["path"] = path
    (folder / "modules.json").write_text(json.dumps(modules))
    box = _in_thread(SentenceEncoder.from_pretrained, folder)
    message = _one_line_naming(box, folder / "modules.json")
    assert repr(path) in message and "not a folder inside the checkpoint" in message
    with pytest.raises(ValueError, match="relative path"):
        SentenceTransformer(str(folder), device="cpu", local_files_only=True)


def test_module_path_inside_the_folder_is_read(minilm_path, tmp_path):
    """A Pooling module in a nested folder, as sentence-transformers allows: read from there."""
    folder = _folder(minilm_path, tmp_path / "m")
    (folder / "modules").mkdir()
    shutil.move(folder / "1_Pooling", folder / "modules" / "pool")
    config = json.loads((folder / "modules" / "pool" / "config.json").read_text())
    config["pooling_mode_mean_tokens"], config["pooling_mode_cls_token"] = False, True
    (folder / "modules" / "pool" / "config.json").write_text(json.dumps(config))
    modules = _modules(folder)
    modules[1]["path"] = "modules/pool"
    (folder / "modules.json").write_text(json.dumps(modules))
    assert read_pipeline(folder)["pooling"] == ("cls",)


@pytest.mark.parametrize("mode", [1, [1, "mean"], {"mean": True}, []])
def test_pooling_mode_of_the_wrong_type_is_one_line(minilm_path, tmp_path, mode):
    folder = _folder(minilm_path, tmp_path / "m")
    config_path = folder / "1_Pooling" / "config.json"
    config_path.write_text(json.dumps({"word_embedding_dimension": 384, "pooling_mode": mode}))
    with pytest.raises(ckpt.CheckpointError) as caught:
        read_pipeline(folder)
    message = str(caught.value)
    assert str(config_path) in message and "pooling_mode must be a pooling mode's name" in message
    assert "\n" not in message and repr(mode) in message


@pytest.mark.parametrize("pooling", [1, None, ["mean", 2]])
def test_encoder_pooling_of_the_wrong_type_is_one_line(minilm_path, pooling):
    encoder = SentenceEncoder.from_pretrained(minilm_path)
    with pytest.raises(ValueError, match=r"^pooling must be a pooling mode's name or a list of them \(cls, max"):
        SentenceEncoder(encoder.model, encoder.tokenizer, pooling=pooling)
