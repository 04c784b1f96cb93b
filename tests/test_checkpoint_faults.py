"""Fault injection for checkpoints: signals and SIGKILL at each rename of a save, two
processes saving into one folder, hostile cache refs, shard indexes and configs, odd
dtypes, unreadable and corrupt files. Each test plants the fault and checks the promise:
the folder holds the old checkpoint whole or the new one whole (loaded and compared tensor
by tensor with what each save wrote), nothing is lost, and a bad input is a typed error.

Signals and kills run in a child process (`_CHILD` below), so the test process is safe; it
imports torch once and forks per round."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY

from bert_port import BertConfig, BertModel, CheckpointError, ConfigError, load_tokenizer
from bert_port import checkpoint as ckpt
from bert_port.cli.convert import main as convert_main
from bert_port.tokenization import TokenizerError

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
        {"format": 2, "rename": [[".x.abcdefgh.tmp", "1_Pooling/../../x", [1, 2, 3], None]], "remove": []},
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


def _tiny_vocab(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(TINY["vocab_size"] - 5)]
    (directory / "vocab.txt").write_text("\n".join(tokens) + "\n")


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


# -- the HF cache -------------------------------------------------------------------------


def _cache_with_outside_checkpoint(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots" / ("a" * 40)).mkdir(parents=True)
    outside = tmp_path / "dir"
    BertModel(BertConfig(**TINY)).save_pretrained(outside)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return repo, outside


@pytest.mark.parametrize(
    "ref", ["../../../dir", "ABSOLUTE", "../snapshots/../../../dir"], ids=["relative", "absolute", "via-snapshots"]
)
def test_cache_ref_cannot_leave_the_cache(tmp_path, monkeypatch, ref):
    repo, outside = _cache_with_outside_checkpoint(tmp_path, monkeypatch)
    (repo / "refs" / "main").write_text(str(outside) if ref == "ABSOLUTE" else ref)
    with pytest.raises(CheckpointError, match="not a commit hash"):
        BertModel.from_pretrained("org/tiny")


@pytest.mark.parametrize("revision", ["../..", "../../../dir", "/abs", "", "a/../..", "x\\..\\.."])
def test_revision_cannot_leave_the_cache(tmp_path, monkeypatch, revision):
    repo, _ = _cache_with_outside_checkpoint(tmp_path, monkeypatch)
    (repo / "refs" / "main").write_text("a" * 40)
    with pytest.raises(CheckpointError, match="not a ref name or commit hash"):
        BertModel.from_pretrained("org/tiny", revision=revision)


def test_convert_with_an_escaping_revision_exits_2(tmp_path, monkeypatch, capsys):
    repo, _ = _cache_with_outside_checkpoint(tmp_path, monkeypatch)
    (repo / "refs" / "main").write_text("a" * 40)
    assert convert_main(["org/tiny", str(tmp_path / "out"), "--revision", "../../../dir"]) == 2
    err = capsys.readouterr().err
    assert "not a ref name or commit hash" in err and "--revision main" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_revision_must_name_a_listed_snapshot(tmp_path, monkeypatch):
    repo, _ = _cache_with_outside_checkpoint(tmp_path, monkeypatch)
    (repo / "refs" / "main").write_text("b" * 40)  # a plain name, but no such snapshot
    with pytest.raises(CheckpointError, match="has no snapshot for revision"):
        BertModel.from_pretrained("org/tiny")
    BertModel(BertConfig(**TINY)).save_pretrained(repo / "snapshots" / ("b" * 40))
    BertModel.from_pretrained("org/tiny")  # once it is there, it loads


# -- configs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("is_decoder", "false", "is_decoder must be true or false"),
        ("is_decoder", 0, "is_decoder must be true or false"),
        ("add_cross_attention", "no", "add_cross_attention must be true or false"),
        ("layer_norm_eps", float("inf"), "layer_norm_eps must be a positive finite number"),
        ("layer_norm_eps", True, "layer_norm_eps must be a positive finite number"),
        ("layer_norm_eps", float("nan"), "layer_norm_eps must be a positive finite number"),
        ("hidden_dropout_prob", True, "hidden_dropout_prob must be a number"),
        ("hidden_dropout_prob", float("nan"), "hidden_dropout_prob must be a number"),
        ("initializer_range", float("-inf"), "initializer_range must be a finite number"),
        ("pad_token_id", True, "pad_token_id must be an integer"),
        ("pad_token_id", "0", "pad_token_id must be an integer"),
        ("hidden_act", ["gelu"], "hidden_act must be a string"),
        ("position_embedding_type", None, "position_embedding_type must be a string"),
    ],
)
def test_config_values_of_the_wrong_type(tmp_path, field, value, message):
    directory = tmp_path / "ckpt"
    BertModel(BertConfig(**TINY)).save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(
        json.dumps({**config, field: value})
    )  # Infinity, NaN as Python's json writes them
    with pytest.raises(ConfigError, match=message):
        BertModel.from_pretrained(directory)


def test_config_lists_every_wrong_field_at_once():
    with pytest.raises(ConfigError) as err:
        BertConfig(**{**TINY, "is_decoder": "true", "layer_norm_eps": True, "hidden_act": 3, "pad_token_id": "x"})
    for field in ("is_decoder", "layer_norm_eps", "hidden_act", "pad_token_id"):
        assert field in str(err.value)


# -- dtypes -------------------------------------------------------------------------------


@pytest.fixture
def tiny_dir(tmp_path) -> Path:
    directory = tmp_path / "tiny"
    BertModel(BertConfig(**TINY)).save_pretrained(directory)
    return directory


def _rewrite(directory: Path, change) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file, save_file

    state = load_file(directory / "model.safetensors")
    change(state)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return state


def test_one_half_precision_tensor_in_a_float32_file_is_cast(tiny_dir, caplog):
    key = "encoder.layer.1.attention.self.key.weight"
    state = _rewrite(tiny_dir, lambda s: s.update({key: s[key].half()}))
    model = BertModel.from_pretrained(tiny_dir)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert "cast 1 tensor(s) to float32" in caplog.text and key in caplog.text
    torch.testing.assert_close(model.hf_state_dict()[key], state[key].float(), atol=0, rtol=0)
    ids = torch.tensor([[2, 7, 9, 3]])
    assert torch.isfinite(model(ids)["last_hidden_state"]).all()  # runs, instead of failing inside forward


def test_integer_weight_is_refused_and_a_live_model_untouched(tiny_dir):
    key = "encoder.layer.0.output.dense.weight"
    _rewrite(tiny_dir, lambda s: s.update({key: s[key].to(torch.int64)}))
    with pytest.raises(
        CheckpointError, match=r"(?s)wrong dtype \(1\).*output.dense.weight -> .*: checkpoint torch.int64"
    ):
        BertModel.from_pretrained(tiny_dir)

    live = BertModel(BertConfig(**TINY))
    before = {k: v.clone() for k, v in live.state_dict().items()}
    from safetensors.torch import load_file

    with pytest.raises(CheckpointError, match="wrong dtype"):
        live.load_hf_state_dict(load_file(tiny_dir / "model.safetensors"))
    assert all(torch.equal(live.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, "int8", "float17", "complex64", 3])
def test_dtype_argument_that_is_not_floating_leaves_a_live_model_untouched(tiny_dir, dtype):
    from safetensors.torch import load_file

    live = BertModel(BertConfig(**TINY))
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(ValueError, match="dtype must be a floating torch dtype"):
        live.load_hf_state_dict(load_file(tiny_dir / "model.safetensors"), dtype=dtype)
    assert all(
        torch.equal(live.state_dict()[k], v) and live.state_dict()[k].dtype == v.dtype for k, v in before.items()
    )
    with pytest.raises(ValueError, match="dtype must be a floating torch dtype"):
        BertModel.from_pretrained(tiny_dir, dtype=dtype)


def test_unknown_device_leaves_a_live_model_untouched(tiny_dir):
    from safetensors.torch import load_file

    live = BertModel(BertConfig(**TINY))
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(ValueError, match="not a device torch knows"):
        live.load_hf_state_dict(load_file(tiny_dir / "model.safetensors"), device="gpu7")
    assert all(torch.equal(live.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("dtype", ["float16", "torch.bfloat16", "auto", torch.float16])
def test_dtype_given_as_a_string_as_transformers_accepts(tiny_dir, dtype):
    model = BertModel.from_pretrained(tiny_dir, dtype=dtype)
    want = {"float16": torch.float16, "torch.bfloat16": torch.bfloat16, "auto": torch.float32}.get(dtype, dtype)
    assert model.dtype == want


# -- shard indexes, layer counts, message sizes -------------------------------------------


@pytest.fixture
def sharded_dir(tmp_path) -> Path:
    directory = tmp_path / "sharded"
    BertModel(BertConfig(**TINY)).save_pretrained(directory, max_shard_size="20KB")
    return directory


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

    monkeypatch.setattr("builtins.open", denied)
    with pytest.raises(TokenizerError, match="cannot read .*vocab.txt: Permission denied"):
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
