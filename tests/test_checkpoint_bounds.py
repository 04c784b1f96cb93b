"""Run and checkpoint files are read as what they claim to be, and a copied folder is judged
as its original.

- A journal, staging list or shard index that is a FIFO, a device, a link out of the folder
  or an oversized file is refused in one line naming it: nothing hangs, nothing grows.
- A port save killed after its commit point, then the folder copied (`cp -a`, or `cp -r`
  without mtimes): the copy loads one save whole or refuses, and `repair` finishes it.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from conftest import TINY

from bert_port import BertConfig, BertModel
from bert_port import checkpoint as ckpt
from bert_port.checkpoint import bounded

OLD_CONFIG = {**TINY, "layer_norm_eps": 1e-12}
NEW_CONFIG = {**TINY, "layer_norm_eps": 1e-5}


def _in_thread(fn, *args):
    """Run `fn` in a daemon thread and return what it returned or raised. A call that blocks
    (the failure under test) fails the test instead of hanging the suite; the bound is a
    last resort, not a measurement: the calls under test return in milliseconds."""
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


# -- the helper ---------------------------------------------------------------------------


def test_bounded_read_of_a_regular_file_and_a_link_inside(tmp_path):
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "b.json").symlink_to("a.json")
    assert bounded.read_text(tmp_path / "a.json", 10) == "{}"
    assert bounded.read_text(tmp_path / "b.json", 10) == "{}"
    with pytest.raises(FileNotFoundError):
        bounded.read_text(tmp_path / "absent.json", 10)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "outside", "oversized", "directory"])
def test_bounded_read_refuses_what_is_not_a_small_regular_file(tmp_path, kind):
    path = tmp_path / "f.json"
    outside = tmp_path.parent / f"{tmp_path.name}-outside.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "outside":
        outside.write_text("{}")
        path.symlink_to(outside)
    elif kind == "oversized":
        with open(path, "wb") as f:
            f.truncate(bounded.JSON + 1)  # sparse: no disk used
    else:
        path.mkdir()
    box = _in_thread(bounded.read_bytes, path, bounded.JSON)
    error = box.get("error")
    assert isinstance(error, bounded.RefusedFile), box
    assert str(path) in str(error) and "\n" not in str(error)


# -- journals, staging lists, indexes -------------------------------------------------------


def _plant(path: Path, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    else:  # a 17 MiB journal-shaped file: larger than any save writes
        with open(path, "wb") as f:
            f.truncate(bounded.JSON + 1)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "oversized"])
def test_odd_journal_is_refused_by_load_repair_and_save_without_hanging(tmp_path, kind, caplog):
    model = BertModel(BertConfig(**TINY))
    model.save_pretrained(tmp_path)
    _plant(tmp_path / ckpt.JOURNAL, kind)
    box = _in_thread(BertModel.from_pretrained, tmp_path)
    assert "error" not in box, box
    assert f"refused to read {tmp_path / ckpt.JOURNAL}" in caplog.text
    box = _in_thread(ckpt.repair, tmp_path)
    assert "error" not in box, box
    assert "which this package did not write" in box["value"]
    assert not os.path.lexists(tmp_path / ckpt.JOURNAL)
    assert os.path.exists("/dev/zero")  # the link went, not what it pointed to
    _plant(tmp_path / ckpt.JOURNAL, kind)
    box = _in_thread(model.save_pretrained, tmp_path)  # the next save drops it too
    assert "error" not in box, box


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "oversized"])
def test_odd_staging_list_is_left_alone_and_nothing_hangs(tmp_path, kind, caplog):
    model = BertModel(BertConfig(**TINY))
    model.save_pretrained(tmp_path)
    planted = tmp_path / f"{ckpt.names.STAGING}.abcdefgh"
    _plant(planted, kind)
    for call in (ckpt.repair, model.save_pretrained):
        box = _in_thread(call, tmp_path)
        assert "error" not in box, box
    assert f"refused to read {planted}" in caplog.text
    assert os.path.lexists(planted)  # not provably ours: kept


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "oversized"])
def test_odd_shard_index_is_a_one_line_error(tmp_path, kind):
    BertModel(BertConfig(**TINY)).save_pretrained(tmp_path, max_shard_size="20KB")
    index = tmp_path / ckpt.SAFE_INDEX
    index.unlink()
    _plant(index, kind)
    box = _in_thread(BertModel.from_pretrained, tmp_path)
    error = box.get("error")
    assert isinstance(error, ckpt.CheckpointError), box
    assert index.name in str(error) and "\n" not in str(error)


def test_journal_linked_out_of_the_folder_is_not_read(tmp_path, caplog):
    folder, outside = tmp_path / "model", tmp_path / "journal.json"
    BertModel(BertConfig(**TINY)).save_pretrained(folder)
    outside.write_text(json.dumps({"format": 3, "rename": [], "remove": []}))
    (folder / ckpt.JOURNAL).symlink_to(outside)
    BertModel.from_pretrained(folder)
    assert "outside" in caplog.text and str(folder / ckpt.JOURNAL) in caplog.text
    ckpt.repair(folder)
    assert outside.is_file() and not os.path.lexists(folder / ckpt.JOURNAL)


# -- copies of a folder with a killed save ----------------------------------------------------


def _model(config: dict, seed: int) -> BertModel:
    torch.manual_seed(seed)
    return BertModel(BertConfig(**config))


def _kill_after(folder: Path, monkeypatch, renamed: int) -> dict:
    """The old save in `folder`, then the new one stopped (as SIGKILL would stop it) after
    its commit point and `renamed` of its files' renames. Returns both saves' tensors."""
    old, new = _model(OLD_CONFIG, 1), _model(NEW_CONFIG, 2)
    old.save_pretrained(folder, max_shard_size="20KB")
    real, calls = os.replace, []

    def replace(src, dst, *args, **kwargs):
        calls.append(dst)
        if len(calls) > 1 + renamed:  # the journal's own rename, then `renamed` files
            raise SystemExit("killed")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(ckpt.staging.os, "replace", replace)
    with pytest.raises(SystemExit):
        new.save_pretrained(folder, max_shard_size="20KB")
    monkeypatch.undo()
    return {"old": old.state_dict(), "new": new.state_dict()}


def _which(folder: Path, saves: dict) -> str:
    got = BertModel.from_pretrained(folder)
    whole = [n for n, sd in saves.items() if all(torch.equal(got.state_dict()[k], v) for k, v in sd.items())]
    assert len(whole) == 1, f"{folder} loads as a mix of two saves"
    assert got.config.layer_norm_eps == {"old": OLD_CONFIG, "new": NEW_CONFIG}[whole[0]]["layer_norm_eps"]
    return whole[0]


def _copy(src: Path, dst: Path, how: str) -> None:
    # cp -a keeps mtimes (copy2), cp -r does not (copyfile): new inodes either way
    shutil.copytree(src, dst, symlinks=True, copy_function=shutil.copy2 if how == "cp -a" else shutil.copyfile)


@pytest.mark.parametrize("how", ["cp -a", "cp -r"])
@pytest.mark.parametrize("renamed", [0, 2])
def test_a_copied_folder_with_a_killed_save_loads_whole_or_refuses(tmp_path, monkeypatch, how, renamed):
    """The folder half old, half new after a kill, then copied: the copy loads one save whole
    or refuses with the repair command; `repair` on the copy finishes the new save (it never
    deletes the staged files it can prove are the save's), and the original is untouched."""
    original, copy = tmp_path / "original", tmp_path / "copy"
    saves = _kill_after(original, monkeypatch, renamed)
    _copy(original, copy, how)
    try:
        seen = _which(copy, saves)
        assert renamed == 0 and how == "cp -r" and seen == "old"  # nothing of the new save in place yet
    except ckpt.CheckpointError as exc:
        assert f"{ckpt.REPAIR_COMMAND} {copy}" in str(exc)
        assert "finished a save" in ckpt.repair(copy)
        assert _which(copy, saves) == "new"
    with pytest.raises(ckpt.CheckpointError, match="interrupted after its commit point"):
        BertModel.from_pretrained(original)
    assert "finished a save" in ckpt.repair(original)
    assert _which(original, saves) == "new"


def test_moved_folder_keeps_its_journal_live(tmp_path, monkeypatch):
    """`mv` within a filesystem keeps inodes: the moved folder refuses and repairs as the original."""
    original, moved = tmp_path / "original", tmp_path / "moved"
    saves = _kill_after(original, monkeypatch, 1)
    original.rename(moved)
    with pytest.raises(ckpt.CheckpointError, match="interrupted after its commit point"):
        BertModel.from_pretrained(moved)
    ckpt.repair(moved)
    assert _which(moved, saves) == "new"


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_odd_training_state_is_refused_without_hanging(tmp_path, kind):
    from bert_port.training.resume import LAST_CHECKPOINT, load_state
    from bert_port.training.settings import FinetuneError

    _plant(tmp_path / LAST_CHECKPOINT, kind)
    box = _in_thread(load_state, tmp_path / LAST_CHECKPOINT)
    error = box.get("error")
    assert isinstance(error, FinetuneError), box
    assert f"refused to read {tmp_path / LAST_CHECKPOINT}" in str(error) and "\n" not in str(error)
