"""A full disk in any writer is one line and exit 2, with the last good state intact, and the
line names only files that exist: save, convert, fine-tune, pretrain, embed and predict, each
against a real full filesystem (a small tmpfs mounted for the test; where the test may not
mount one, it is skipped, and `test_training_faults.py` injects ENOSPC at the write instead)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import TINY, finetune_args, run_finetune

from bert_port import BertConfig, BertModel
from bert_port import checkpoint as ckpt
from bert_port.data import builtin_splits
from bert_port.embed import read_index
from bert_port.embedding_store import finished

WORDS = ["good", "great", "fine", "bad", "awful", "poor", "movie", "plot", "acting", "song"]


@pytest.fixture
def small_disk(tmp_path):
    """`mount(size)`: a fresh tmpfs of `size` ("20m") under `tmp_path`, unmounted after."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode})")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(disk: Path, leave: int = 0) -> None:
    """Fill `disk` to the last byte, then free `leave` bytes of it."""
    filler = disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    if leave:
        os.truncate(filler, max(filler.stat().st_size - leave, 0))


def _model(seed: int, **config) -> BertModel:
    torch.manual_seed(seed)
    return BertModel(BertConfig.from_dict({**TINY, **config}))


def _same(folder: Path, model: BertModel) -> bool:
    got = BertModel.from_pretrained(folder).state_dict()
    return all(torch.equal(got[k], v) for k, v in model.state_dict().items())


def _one_error_line(err: str, *messages: str) -> str:
    assert "Traceback" not in err, err
    lines = [line[line.index("error: ") :] for line in err.splitlines() if "error: " in line]
    assert len(lines) == 1, err
    for message in messages:
        assert message in lines[0], err
    return lines[0]


def _temporaries(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ckpt.TEMPORARY.fullmatch(p.name)]


def test_save_pretrained_on_a_full_disk_raises_enospc_and_keeps_the_old_save(small_disk):
    disk = small_disk("256k")
    old, new = _model(1), _model(2)
    old.save_pretrained(disk / "m")
    _fill(disk, leave=8192)
    with pytest.raises(OSError) as error:  # safetensors' SafetensorError, as the OSError it is
        new.save_pretrained(disk / "m")
    assert error.value.errno == errno.ENOSPC
    assert _same(disk / "m", old) and not _temporaries(disk / "m")


def test_convert_on_a_full_disk_is_one_line_and_exit_2(small_disk, tmp_path, capsys):
    from bert_port.cli.convert import main as convert_main

    disk = small_disk("256k")
    old, new = _model(1), _model(2)
    old.save_pretrained(disk / "dst")
    new.save_pretrained(tmp_path / "src")
    _fill(disk, leave=8192)
    assert convert_main([str(tmp_path / "src"), str(disk / "dst"), "--overwrite"]) == 2
    _one_error_line(capsys.readouterr().err, "no space left", "intact")
    assert _same(disk / "dst", old)


def _rows(n: int, offset: int = 0) -> str:
    return "text,label\n" + "".join(
        f"{WORDS[i % 10]} {WORDS[(3 * i) % 10]} number {i},{'pos' if i % 2 else 'neg'}\n"
        for i in range(offset, offset + n)
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, minilm_path) -> dict[str, Path]:
    """A tiny checkpoint (MiniLM's vocabulary, 3.9 MB of weights) and a little labelled data."""
    root = tmp_path_factory.mktemp("tiny")
    model = _model(0, vocab_size=30522)
    model.source_dir = minilm_path
    model.save_pretrained(root / "ckpt")
    (root / "train.csv").write_text(_rows(40))
    (root / "validation.csv").write_text(_rows(12, 100))
    return {"ckpt": root / "ckpt", "train": root / "train.csv", "validation": root / "validation.csv"}


def test_fine_tuning_onto_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(small_disk, tiny, capsys):
    """20 MB: the first checkpoint (16 MB) fits, the second's temporaries do not."""
    out = small_disk("20m") / "run"
    code = run_finetune(*finetune_args(tiny, tiny["ckpt"], out, "--save-steps", "1", "--epochs", "1"))
    err = capsys.readouterr().err
    assert code == 2, err
    _one_error_line(err, "no space left", "--resume")
    state = torch.load(out / "checkpoints" / "last-checkpoint.pt", map_location="cpu", weights_only=True)
    assert state["progress"]["global_step"] >= 1  # the last good state, whole
    assert not _temporaries(out)


def test_fine_tuning_out_of_space_before_its_first_checkpoint_offers_no_resume(small_disk, tiny, capsys):
    """8 MB: the run's own files fit, its first checkpoint (16 MB) does not. The line names no
    checkpoint and no --resume, and the run it says to start again is not refused."""
    out = small_disk("8m") / "run"
    args = finetune_args(tiny, tiny["ckpt"], out, "--save-steps", "1", "--epochs", "1")
    assert run_finetune(*args) == 2
    line = _one_error_line(capsys.readouterr().err, "no space left", "no checkpoint was written yet", "run it again")
    assert "--resume" not in line and "last-checkpoint" not in line and "--overwrite" not in line
    assert not (out / "checkpoints" / "last-checkpoint.pt").exists() and not _temporaries(out)
    assert run_finetune(*args) == 2  # started again as said: not refused, out of space again
    _one_error_line(capsys.readouterr().err, "no space left", "no checkpoint was written yet")


def test_pretraining_onto_a_full_disk_is_one_line_not_a_safetensors_traceback(small_disk, tiny, tmp_path, capsys):
    """6 MB: the first model (3.9 MB) and metrics.json fit, the first training state does not:
    the line offers a fresh start with --overwrite (metrics.json is there), not a --resume."""
    from bert_port.cli import pretrain as pretrain_cli

    texts = builtin_splits("mr")["train"].texts
    (tmp_path / "train.txt").write_text("\n".join(texts[:48]) + "\n")
    (tmp_path / "validation.txt").write_text("\n".join(texts[48:68]) + "\n")
    (tmp_path / "tiny.json").write_text(json.dumps({**TINY, "vocab_size": 30522}))
    out = small_disk("6m") / "run"
    args = [
        *("--config", tmp_path / "tiny.json", "--train", tmp_path / "train.txt"),
        *("--validation", tmp_path / "validation.txt", "--output-dir", out, "--block-size", "32"),
        *("--batch-size", "8", "--device", "cpu", "--max-steps", "2", "--save-steps", "1", "--eval-steps", "1"),
    ]
    assert pretrain_cli.main([str(a) for a in args]) == 2
    line = _one_error_line(capsys.readouterr().err, "no space left", "no checkpoint was written yet")
    assert "--resume" not in line and "last-checkpoint" not in line and "run it again with --overwrite" in line
    assert not (out / "checkpoints" / "last-checkpoint.pt").exists() and (out / "metrics.json").is_file()
    assert not _temporaries(out)
    assert pretrain_cli.main([str(a) for a in [*args, "--overwrite"]]) == 2  # not refused: out of space again
    _one_error_line(capsys.readouterr().err, "no space left")


def test_embedding_onto_a_full_disk_keeps_the_finished_shards(small_disk, tiny, tmp_path, minilm_path, capsys):
    from bert_port.cli.embed import main as embed_main

    model = tmp_path / "model"  # a plain BERT folder (mean pooling) with MiniLM's tokenizer
    _model(0, vocab_size=30522).save_pretrained(model)
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        (model / name).write_bytes((minilm_path / name).read_bytes())
    src = tmp_path / "in.jsonl"
    texts = builtin_splits("mr")["train"].texts[:300]
    src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    out = small_disk("96k") / "out"
    flags = ["--model", str(model), "--no-progress", "--shard-size", "20", "--batch-tokens", "1024"]
    assert embed_main([str(src), str(out), *flags]) == 2
    _one_error_line(capsys.readouterr().err, "no space left", "finished shard")
    index = read_index(out)
    kept = [k for k in range(len(index["shards"])) if (out / f"shard-{k:05d}.ids.json").exists()]
    assert kept, "no shard fitted: make the disk larger"
    run_id = json.loads((out / f"shard-{kept[0]:05d}.ids.json").read_text())["run"]
    assert all(finished(out, k, index["shards"][k]["rows"], run_id) is not None for k in kept)
    assert not _temporaries(out)


def test_predicting_onto_a_full_disk_is_one_line_and_writes_nothing(small_disk, tiny, tmp_path, capsys):
    from bert_port.cli import predict as predict_cli

    trained = tmp_path / "trained"
    assert run_finetune(*finetune_args(tiny, tiny["ckpt"], trained, "--epochs", "1")) == 0
    capsys.readouterr()
    disk = small_disk("64k")
    out = disk / "predictions.csv"
    _fill(disk)
    code = predict_cli.main(["--model", str(trained), "--input", str(tiny["validation"]), "--output", str(out)])
    assert code == 2
    _one_error_line(capsys.readouterr().err, "no space left", "left as it was")
    assert not out.exists() and not _temporaries(disk)
