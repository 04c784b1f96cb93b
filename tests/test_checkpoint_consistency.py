"""A load sees one whole save or fails clearly, and never writes.

- Loads in other processes race a writer that alternates two saves and two layouts: every
  load returns one save whole.
- A journal planted in a folder is never obeyed by a load, which leaves every byte as it was.
- A port save killed after its commit point, then transformers' `save_pretrained` into the
  same folder: the newer files win, for our loads, `repair` and transformers alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY

from bert_port import BertConfig, BertModel
from bert_port import checkpoint as ckpt

OLD_CONFIG = {**TINY, "layer_norm_eps": 1e-12}
NEW_CONFIG = {**TINY, "layer_norm_eps": 1e-5}
# 30 s: thousands of loads against a writer; the one race it caught (1 load in ~6,000, a folder
# with no weights file mid-save) has a deterministic test of its own below.
RACE_SECONDS = float(os.environ.get("BERT_PORT_RACE_SECONDS", "30"))

# A save is told apart by its config (layer_norm_eps) and by every tensor: the seed fills
# each weight with one value, so a load holding tensors of two saves is caught.
_RACE = textwrap.dedent(
    r"""
    import json, sys, time
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    from bert_port import BertConfig, BertModel, CheckpointError

    role, folder, seconds = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    configs = json.loads(sys.argv[4])

    def model(i):
        m = BertModel(BertConfig(**configs[i]))
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(float(i + 1))
        return m

    end, counts = time.monotonic() + seconds, {"loads": 0, "mixed": 0, "saves": 0, "errors": 0}
    if role == "writer":
        models = [model(0), model(1)]
        while time.monotonic() < end:
            i = counts["saves"] % 2
            models[i].save_pretrained(folder, max_shard_size="20KB" if counts["saves"] % 3 else "5GB")
            counts["saves"] += 1
    else:
        while time.monotonic() < end:
            try:
                m = BertModel.from_pretrained(folder)
            except CheckpointError as exc:
                counts["errors"] += 1
                print(exc, file=sys.stderr)
                continue
            values = {p.detach().flatten()[0].item() for p in m.parameters()}
            expected = {1.0: configs[0]["layer_norm_eps"], 2.0: configs[1]["layer_norm_eps"]}
            whole = len(values) == 1 and expected.get(values.pop()) == m.config.layer_norm_eps
            counts["loads"] += 1
            counts["mixed"] += not whole
    print(json.dumps(counts))
    """
)


def _start(role: str, folder: Path, seconds: float) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    args = [sys.executable, "-c", _RACE, role, str(folder), str(seconds), json.dumps([OLD_CONFIG, NEW_CONFIG])]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
def test_loads_in_other_processes_never_see_two_saves(tmp_path):
    """Two reader processes load while a writer saves two models in turn (single file and
    shards), for RACE_SECONDS: not one load mixes them, and none fails."""
    BertModel(BertConfig(**OLD_CONFIG)).save_pretrained(tmp_path)
    writer = _start("writer", tmp_path, RACE_SECONDS)
    time.sleep(1.0)  # let the writer's first save start
    readers = [_start("reader", tmp_path, RACE_SECONDS - 1.0) for _ in range(2)]
    results, errors = [], []
    for proc in [writer, *readers]:
        out, err = proc.communicate(timeout=RACE_SECONDS + 120)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.splitlines()[-1]))
        errors += [line for line in err.splitlines() if "Warning" not in line][-3:]
    saves, loads = results[0]["saves"], [r for r in results[1:]]
    assert saves > 10, results
    assert all(r["loads"] > 10 for r in loads), results
    assert [r["mixed"] for r in loads] == [0, 0], results
    assert [r["errors"] for r in loads] == [0, 0], (results, errors)


def test_a_load_waits_out_a_save_that_has_no_weights_file_in_place(tmp_path):
    """A save between removing one layout's weights and renaming in the other's leaves the
    folder with no weights file for a moment, under its exclusive lock. A load that starts
    then waits for the lock and reads the finished save; it does not fail on the empty
    moment (the race test above hit this once in about 6,000 loads when loads looked for
    the weights file before taking the lock)."""
    import threading

    BertModel(BertConfig(**OLD_CONFIG)).save_pretrained(tmp_path)
    weights, aside = tmp_path / "model.safetensors", tmp_path / "aside"
    BertModel(BertConfig(**NEW_CONFIG)).save_pretrained(aside)
    loaded, failed = [], []

    def load():
        try:
            loaded.append(BertModel.from_pretrained(tmp_path))
        except Exception as exc:  # noqa: BLE001 -- the assertion below names it
            failed.append(exc)

    lock = ckpt.DirectoryLock(tmp_path)  # as a save holds it, from its first byte to its last rename
    try:
        weights.unlink()
        loader = threading.Thread(target=load)
        loader.start()
        loader.join(timeout=1.0)
        assert loader.is_alive() and not failed, f"the load did not wait for the save: {failed}"
        (aside / "model.safetensors").rename(weights)
        (aside / "config.json").replace(tmp_path / "config.json")
    finally:
        lock.release()
    loader.join(timeout=60)
    assert not failed and len(loaded) == 1, failed
    assert loaded[0].config.layer_norm_eps == NEW_CONFIG["layer_norm_eps"]


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_planted_journal_is_not_obeyed_by_a_load(tmp_path):
    """A journal that would rename a planted temporary over model.safetensors: the load
    returns the folder's own weights, and the folder is byte-identical afterwards."""
    real = BertModel(BertConfig(**TINY))
    real.save_pretrained(tmp_path)
    torch.manual_seed(1)
    planted = BertModel(BertConfig(**TINY))
    ckpt.write_weights(planted.hf_state_dict(), tmp_path / "elsewhere")
    tmp = ".model.safetensors.abcdefgh.tmp"
    (tmp_path / tmp).write_bytes((tmp_path / "elsewhere" / "model.safetensors").read_bytes())
    rename = [tmp, "model.safetensors", [1, 2, 3], None, "0" * 64]
    plan = {"format": 3, "rename": [rename], "remove": [["vocab.txt", [4, 5, 6]]]}
    (tmp_path / ckpt.JOURNAL).write_text(json.dumps(plan))
    before = _snapshot(tmp_path)
    loaded = BertModel.from_pretrained(tmp_path)
    assert _snapshot(tmp_path) == before
    for (k, v), (_, w) in zip(loaded.state_dict().items(), real.state_dict().items(), strict=True):
        torch.testing.assert_close(v, w, atol=0, rtol=0, msg=k)
    # Repair drops the journal but not the planted file: no save of ours staged it.
    assert "written by another tool since" in ckpt.repair(tmp_path)
    assert (tmp_path / tmp).is_file() and not (tmp_path / ckpt.JOURNAL).exists()


def _old_then_new_killed_after_the_commit_point(folder: Path, monkeypatch) -> None:
    """The old save in `folder`, then the new one stopped right after its journal lands (as
    SIGKILL would stop it): the folder is half old, half new, with a live journal."""
    BertModel(BertConfig(**OLD_CONFIG)).save_pretrained(folder)

    def stop(*args, **kwargs):
        raise SystemExit("killed")

    monkeypatch.setattr(ckpt.staging, "_apply_journal", stop)
    with pytest.raises(SystemExit):
        BertModel(BertConfig(**NEW_CONFIG)).save_pretrained(folder)
    monkeypatch.undo()


def test_a_foreign_save_after_a_killed_port_save_is_kept(tmp_path, monkeypatch):
    """Port save killed after its commit point, then transformers saves into the folder: our
    load reads transformers' save and writes nothing; repair keeps its files (removing only our
    own temporaries); transformers still loads the folder."""
    import transformers

    from bert_port.reference import random_hf_model

    _old_then_new_killed_after_the_commit_point(tmp_path, monkeypatch)
    ours = sorted(p.name for p in tmp_path.iterdir() if ckpt.TEMPORARY.fullmatch(p.name))
    assert ours, "the killed save left its staged files"

    foreign = random_hf_model({**TINY, "layer_norm_eps": 1e-7}, seed=3)
    time.sleep(0.01)  # a later mtime even on coarse-clocked filesystems
    foreign.save_pretrained(tmp_path)
    before = {n: b for n, b in _snapshot(tmp_path).items() if n in ("config.json", "model.safetensors")}

    loaded = BertModel.from_pretrained(tmp_path)
    assert loaded.config.layer_norm_eps == 1e-7
    torch.testing.assert_close(
        loaded.hf_state_dict()["embeddings.word_embeddings.weight"],
        foreign.state_dict()["embeddings.word_embeddings.weight"],
        atol=0,
        rtol=0,
    )
    assert "written by another tool since" in ckpt.repair(tmp_path)
    after = _snapshot(tmp_path)
    assert {n: after[n] for n in before} == before
    assert not [n for n in ours if (tmp_path / n).exists()]
    assert transformers.BertModel.from_pretrained(str(tmp_path)).config.layer_norm_eps == 1e-7


def test_staged_writes_delete_only_their_own_temporaries(tmp_path):
    """A hidden file that looks like a temporary is someone else's: a save beside it, and a
    save after a killed one, leave it alone; the killed save's own temporaries go."""
    theirs = tmp_path / ".notes.abcdefgh.tmp"
    theirs.write_text("mine")
    with ckpt.atomic_write(tmp_path / "preds.csv") as tmp:
        tmp.write_text("a,b\n")
    stage = ckpt.StagedWrite(tmp_path)
    staged = stage.path("config.json")  # then the process "dies": no commit, no discard
    ckpt.StagedWrite.active.clear()
    stage._lock.release()
    with ckpt.atomic_write(tmp_path / "preds.csv") as tmp:
        tmp.write_text("c,d\n")
    assert theirs.read_text() == "mine"
    assert not staged.exists()
    assert (tmp_path / "preds.csv").read_text() == "c,d\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".notes.abcdefgh.tmp", "preds.csv"]


def test_convert_repair_finishes_a_killed_save_and_needs_dir_alone(tmp_path, monkeypatch, capsys):
    """`bert-port-convert --repair DIR`: the command a refused load names. It finishes the save,
    after which the folder loads; with SRC/DST as well, or with nothing, it is a usage error."""
    from bert_port.cli.convert import main as convert_main

    _old_then_new_killed_after_the_commit_point(tmp_path, monkeypatch)
    with pytest.raises(ckpt.CheckpointError, match=f"{ckpt.REPAIR_COMMAND} {tmp_path}"):
        BertModel.from_pretrained(tmp_path)
    assert convert_main(["--repair", str(tmp_path)]) == 0
    assert "finished a save that was interrupted" in capsys.readouterr().out
    assert BertModel.from_pretrained(tmp_path).config.layer_norm_eps == NEW_CONFIG["layer_norm_eps"]
    for argv in (["--repair", str(tmp_path), "a", "b"], [], ["only-src"]):
        with pytest.raises(SystemExit) as exit_:
            convert_main(argv)
        assert exit_.value.code == 2


_ST_CHILD = textwrap.dedent(
    r"""
    import json, os, signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's background job inherits SIGINT ignored
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    from bert_port import SentenceEncoder

    src, root, rounds = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    hook = {"count": 0, "at": 0}

    def on_audit(event, args):
        if event == "os.rename" and hook["at"]:
            hook["count"] += 1
            if hook["count"] == hook["at"]:
                os.kill(os.getpid(), signal.SIGINT)

    sys.addaudithook(on_audit)
    old = SentenceEncoder.from_pretrained(src)  # mean pooling, Normalize
    new = SentenceEncoder.from_pretrained(src, pooling="cls", normalize=False)
    results = {}
    for at in range(1, rounds + 1):
        out = root / f"at{at}"
        old.save_pretrained(out)
        hook.update(count=0, at=at)
        try:
            new.save_pretrained(out)
            results[at] = "completed"
        except KeyboardInterrupt:
            results[at] = "interrupted"
        hook["at"] = 0
    print(json.dumps(results))
    """
)


@pytest.mark.slow
def test_ctrl_c_in_a_sentence_encoder_save_leaves_one_pipeline(tmp_path, minilm_path):
    """SIGINT at every rename of `SentenceEncoder.save_pretrained` over a folder holding another
    pipeline (mean + Normalize -> cls, no Normalize): model, tokenizer, modules.json and
    1_Pooling/ commit at once, so the folder loads as the new encoder whole, never the new
    weights with the old pooling."""
    from bert_port import SentenceEncoder

    rounds = 14
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _ST_CHILD, str(minilm_path), str(tmp_path), str(rounds)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    texts = ["a gripping, funny film", "the plot never comes together"]
    expected = SentenceEncoder.from_pretrained(minilm_path, pooling="cls", normalize=False).encode(
        texts, convert_to_tensor=True
    )
    assert "interrupted" in results.values() and "completed" in results.values(), results
    for at in results:
        folder = tmp_path / f"at{at}"
        assert not [p.name for p in folder.iterdir() if ckpt.TEMPORARY.fullmatch(p.name)], at
        loaded = SentenceEncoder.from_pretrained(folder)
        assert (loaded.pooling, loaded.normalize) == (("cls",), False), f"rename {at}: the old pipeline survived"
        torch.testing.assert_close(loaded.encode(texts, convert_to_tensor=True), expected, atol=0, rtol=0)
