"""Fault injection for checkpoints: signals and SIGKILL at each rename of a save, two
processes saving into one folder, tokenizer files of another model. Each test plants the fault
and checks the promise: the folder holds the old checkpoint whole or the new one whole (loaded
and compared tensor by tensor with what each save wrote), nothing is lost. Hostile cache refs,
configs and odd dtypes: test_checkpoint_refusals.py; shard indexes, unreadable and corrupt
files: test_checkpoint_corrupt.py.

Signals and kills run in a child process (`_CHILD` below), so the test process is safe; it
imports torch once and forks per round."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_fault_files import _tiny_vocab
from conftest import TINY

from bert_port import BertConfig, BertModel, CheckpointError, load_tokenizer
from bert_port import checkpoint as ckpt

# Two saves that differ in every tensor and in config.json (same shapes, another eps), so
# that a folder mixing them is caught by its tensors or by its config.
OLD_CONFIG = {**TINY, "layer_norm_eps": 1e-12}
NEW_CONFIG = {**TINY, "layer_norm_eps": 1e-5}
LAYOUTS = {"single": ("5GB", "5GB"), "sharded": ("20KB", "20KB"), "single-to-sharded": ("5GB", "20KB")}

_CHILD = r"""
import json, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's background job inherits SIGINT ignored
from pathlib import Path
import torch
torch.set_num_threads(1)
from bert_port import BertConfig, BertModel

job = json.loads(sys.argv[1])
root = Path(job["root"])
hook = {"count": 0, "at": 0, "signal": 0}

def on_audit(event, args):
    if event == "os.rename" and hook["at"]:  # os.rename and os.replace both raise this event
        hook["count"] += 1
        if hook["count"] == hook["at"]:
            os.kill(os.getpid(), hook["signal"])

sys.addaudithook(on_audit)

def model(config, seed):
    torch.manual_seed(seed)
    return BertModel(BertConfig(**config))

old, new = model(job["old_config"], 1), model(job["new_config"], 2)
torch.save(old.hf_state_dict(), root / "old.pt")
torch.save(new.hf_state_dict(), root / "new.pt")
results = {}

if job["kind"] == "signal":
    for name, old_size, new_size, at in job["rounds"]:
        directory = root / name
        old.save_pretrained(directory, max_shard_size=old_size)
        hook.update(count=0, at=at, signal=signal.SIGINT)
        try:
            new.save_pretrained(directory, max_shard_size=new_size)
            results[name] = "completed"
        except KeyboardInterrupt:
            results[name] = "interrupted"
        hook["at"] = 0
elif job["kind"] == "kill":
    for name, old_size, new_size, at in job["rounds"]:
        directory = root / name
        old.save_pretrained(directory, max_shard_size=old_size)
        pid = os.fork()
        if pid == 0:
            hook.update(count=0, at=at, signal=signal.SIGKILL)
            new.save_pretrained(directory, max_shard_size=new_size)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        results[name] = "killed" if os.WIFSIGNALED(status) else "completed"
elif job["kind"] == "race":
    import multiprocessing

    barrier = multiprocessing.get_context("fork").Barrier(2)
    pids = []
    for writer, size in (("old", "5GB"), ("new", "20KB")):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                for r in range(job["rounds"]):
                    barrier.wait(timeout=60)
                    (old if writer == "old" else new).save_pretrained(root / f"round{r}", max_shard_size=size)
            except BaseException as exc:
                print(f"{writer}: {type(exc).__name__}: {exc}", file=sys.stderr)
                code = 1
            os._exit(code)
        pids.append(pid)
    results = {str(pid): os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids}

(root / "results.json").write_text(json.dumps(results))
"""


def _run_child(root: Path, job: dict) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    job = {"root": str(root), "old_config": OLD_CONFIG, "new_config": NEW_CONFIG, **job}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(job)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((root / "results.json").read_text())


def _which_save(directory: Path, root: Path) -> str:
    """'old' or 'new': the save the folder holds whole, tensors and config together. Fails
    on a mix, a half-written folder or one that does not load."""
    model = BertModel.from_pretrained(directory)
    got = model.hf_state_dict()
    matches = []
    for name, config in (("old", OLD_CONFIG), ("new", NEW_CONFIG)):
        wrote = torch.load(root / f"{name}.pt", weights_only=True)
        if got.keys() == wrote.keys() and all(torch.equal(got[k], wrote[k]) for k in wrote):
            matches.append(name)
            assert model.config.layer_norm_eps == config["layer_norm_eps"], f"{name} weights beside the other config"
    assert len(matches) == 1, f"{directory} holds a mix of the two saves"
    return matches[0]


def _temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# -- interrupts ---------------------------------------------------------------------------

# Renames in a save: the journal, then each staged file (shards, index or model.safetensors,
# config): 3 for a single file, 8 for the tiny model in 5 shards. One past the last lands
# on nothing (the save completes).
_RENAMES = {"single": 3, "sharded": 8, "single-to-sharded": 8}


def _rounds() -> list[list]:
    return [[f"{layout}-{at}", *LAYOUTS[layout], at] for layout in LAYOUTS for at in range(1, _RENAMES[layout] + 2)]


def test_ctrl_c_at_every_rename_leaves_one_whole_checkpoint(tmp_path):
    """SIGINT at the Nth rename, for every N: the commit finishes (signals are deferred
    during it) or never started, and the KeyboardInterrupt still reaches the caller."""
    results = _run_child(tmp_path, {"kind": "signal", "rounds": _rounds()})
    for name, outcome in results.items():
        layout, at = name.rsplit("-", 1)
        held = _which_save(tmp_path / name, tmp_path)
        assert _temporaries(tmp_path / name) == [], name
        if int(at) <= _RENAMES[layout]:
            # The interrupt is delivered, and only once the commit is done: the new save whole.
            assert (outcome, held) == ("interrupted", "new"), name
        else:
            assert (outcome, held) == ("completed", "new"), name


def test_kill_9_at_every_rename_then_repair_or_the_next_save_finishes_it(tmp_path):
    """SIGKILL at the Nth rename cannot be deferred. Before the journal lands the folder is the
    old save; after, it is half old, half new: a load refuses it, names the repair command and
    leaves every byte as it was, and `repair` (or the next save) finishes the new save. The next
    save removes every temporary the killed one left."""
    results = _run_child(tmp_path, {"kind": "kill", "rounds": _rounds()})
    saw_leftovers = saw_refusals = False
    for name, outcome in results.items():
        layout, at = name.rsplit("-", 1)
        directory = tmp_path / name
        assert outcome == ("killed" if int(at) <= _RENAMES[layout] else "completed"), name
        saw_leftovers |= bool(_temporaries(directory))
        if (directory / ckpt.JOURNAL).is_file():
            before = _snapshot(directory)
            with pytest.raises(CheckpointError, match=f"interrupted after its commit point.*{ckpt.REPAIR_COMMAND}"):
                BertModel.from_pretrained(directory)
            assert _snapshot(directory) == before, f"{name}: a load wrote into the folder"
            assert "finished a save" in ckpt.repair(directory)
            saw_refusals = True
        held = _which_save(directory, tmp_path)
        assert held == ("old" if int(at) == 1 else "new"), f"{name}: the journal's rename is the commit point"
        # The next save cleans up what the killed one left.
        ckpt.write_weights(torch.load(tmp_path / "old.pt", weights_only=True), directory)
        assert _temporaries(directory) == [], name
    assert saw_leftovers and saw_refusals  # the kills did leave work for repair and the next save


def _snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (names relative to it) and its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _killed_after_the_commit_point(monkeypatch, directory: Path, model: BertModel) -> None:
    """Save `model` into `directory`, stopping right after the journal lands (as SIGKILL would)."""

    def stop(*args, **kwargs):
        raise SystemExit("killed")

    monkeypatch.setattr(ckpt.staging, "_apply_journal", stop)
    with pytest.raises(SystemExit):
        model.save_pretrained(directory)
    monkeypatch.undo()
    assert (directory / ckpt.JOURNAL).is_file()


def test_repair_needs_write_access_and_says_so(tmp_path, monkeypatch):
    """A folder with a pending journal is a CheckpointError on load, not a silent load of the
    mix; a repair that cannot write says it needs write access."""
    directory = tmp_path / "ckpt"
    BertModel(BertConfig(**OLD_CONFIG)).save_pretrained(directory)
    _killed_after_the_commit_point(monkeypatch, directory, BertModel(BertConfig(**NEW_CONFIG)))
    with pytest.raises(CheckpointError, match="--repair"):
        BertModel.from_pretrained(directory)

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(ckpt.staging, "_apply_journal", refuse)
    with pytest.raises(CheckpointError, match="needs write access"):
        ckpt.repair(directory)
    monkeypatch.undo()
    ckpt.repair(directory)
    assert BertModel.from_pretrained(directory).config.layer_norm_eps == NEW_CONFIG["layer_norm_eps"]


@pytest.mark.parametrize(
    "plan",
    [
        {"rename": [], "remove": ["../outside.txt"]},
        {"rename": [], "remove": ["notes.txt"]},
        {"rename": [[".x.abcdefgh.tmp", "../../escape"]], "remove": []},
        {"rename": [["config.json", "model.safetensors"]], "remove": []},
        {"format": 3, "rename": [[".x.abcdefgh.tmp", "1_Pooling/../../x", [1, 2, 3], None, "0" * 64]], "remove": []},
        "not json",
    ],
    ids=["remove-escape", "remove-user-file", "rename-escape", "rename-non-temporary", "folder-escape", "garbage"],
)
def test_hostile_journal_is_never_obeyed_and_nothing_touched(tmp_path, plan):
    """A load ignores a journal this package did not write and changes nothing; `repair`
    removes that one file, unread, and touches nothing else."""
    directory = tmp_path / "ckpt"
    BertModel(BertConfig(**TINY)).save_pretrained(directory)
    (tmp_path / "outside.txt").write_text("keep")
    (directory / "notes.txt").write_text("keep")
    (directory / ckpt.JOURNAL).write_text(plan if isinstance(plan, str) else json.dumps(plan))
    before = _snapshot(directory)
    BertModel.from_pretrained(directory)
    assert _snapshot(directory) == before
    assert "did not write (not obeyed)" in ckpt.repair(directory)
    del before[ckpt.JOURNAL]
    assert _snapshot(directory) == before
    assert (tmp_path / "outside.txt").read_text() == "keep"


# -- concurrent writers -------------------------------------------------------------------


def test_two_processes_saving_into_one_folder_lose_nothing(tmp_path):
    """One process saves a single file, the other shards, into the same folder at the same
    moment, 25 times: both succeed, and each folder holds one of the two saves whole."""
    rounds = 25
    exit_codes = _run_child(tmp_path, {"kind": "race", "rounds": rounds})
    assert list(exit_codes.values()) == [0, 0]
    held = [_which_save(tmp_path / f"round{r}", tmp_path) for r in range(rounds)]
    assert set(held) <= {"old", "new"}
    for r in range(rounds):
        assert _temporaries(tmp_path / f"round{r}") == []
        names = {p.name for p in (tmp_path / f"round{r}").iterdir()}
        # The loser's layout is gone entirely: no stale model.safetensors beside an index.
        assert not ({ckpt.SAFE_WEIGHTS, ckpt.SAFE_INDEX} <= names)


# -- tokenizer files ----------------------------------------------------------------------


def test_save_replaces_another_models_tokenizer(tmp_path, minilm_path):
    """A folder that held MiniLM (tokenizer.json + vocab.txt) gets a model whose source has
    only vocab.txt: MiniLM's tokenizer.json must go, or load_tokenizer would prefer it."""
    folder = tmp_path / "folder"
    BertModel.from_pretrained(minilm_path).save_pretrained(folder)
    assert (folder / "tokenizer.json").is_file()

    src = tmp_path / "src"
    BertModel(BertConfig(**TINY)).save_pretrained(src)
    _tiny_vocab(src)
    BertModel.from_pretrained(src).save_pretrained(folder)
    assert sorted(n for n in ckpt.TOKENIZER_FILES if (folder / n).is_file()) == ["vocab.txt"]
    assert (folder / "vocab.txt").read_bytes() == (src / "vocab.txt").read_bytes()
    assert load_tokenizer(folder).get_vocab_size() == TINY["vocab_size"]


def test_model_without_tokenizer_files_keeps_or_removes_by_previous_config(tmp_path, minilm_path):
    # Another model saved there before (another shape): its tokenizer files go.
    folder = tmp_path / "other"
    BertModel.from_pretrained(minilm_path).save_pretrained(folder)
    BertModel(BertConfig(**TINY)).save_pretrained(folder)
    assert not any((folder / n).is_file() for n in ckpt.TOKENIZER_FILES)

    # Tokenizer files the user put in a fresh folder, or beside an earlier save of this
    # model, are this model's: kept.
    fresh = tmp_path / "fresh"
    _tiny_vocab(fresh)
    model = BertModel(BertConfig(**TINY))
    model.save_pretrained(fresh)
    model.save_pretrained(fresh)
    assert (fresh / "vocab.txt").is_file()

    # Saved over the folder it was loaded from: its own files stay.
    loaded = BertModel.from_pretrained(fresh)
    loaded.save_pretrained(fresh)
    assert (fresh / "vocab.txt").is_file()
