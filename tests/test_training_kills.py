"""Fault injection for `bert-port-finetune`, continued (test_training_faults.py): a non-finite loss
stops the run and nothing is saved from it; `kill -9` during fine-tuning, then `--resume`, cleans
up and ends bit-identical; a save killed after its commit is finished by the next run."""

# ruff: noqa: F811  (fixtures imported from training_fault_runs, which pytest passes by name)

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import TINY, finetune_args, load_last, metrics_of, run_finetune
from training_fault_runs import ENV, REPO, assert_refused, ckpt, data, temporaries  # noqa: F401  (fixtures)

# -----------------------------------------------------------------------------------------
# 6. A non-finite loss stops the run; nothing is saved from it


def _nan_from_step(monkeypatch, first_bad: int) -> None:
    """From the `first_bad`-th training step on, every example's loss is NaN."""
    from bert_port.training import recipe
    from bert_port.training import steps as step_module

    real_loss, real_step, steps = step_module.per_example_loss, recipe.train_step, [0]

    def step(*args, **kwargs):
        steps[0] += 1
        return real_step(*args, **kwargs)

    def loss(logits, labels, problem_type):
        losses = real_loss(logits, labels, problem_type)
        return losses * float("nan") if steps[0] >= first_bad else losses

    monkeypatch.setattr(recipe, "train_step", step)
    monkeypatch.setattr(step_module, "per_example_loss", loss)


def test_nan_loss_mid_run_stops_with_an_error_and_saves_nothing_from_it(tmp_path, ckpt, data, capsys, monkeypatch):
    out = tmp_path / "out"
    _nan_from_step(monkeypatch, 4)  # steps 1-3 are fine; save every 2 steps: step 2 is the last good state
    code = run_finetune(*finetune_args(data, ckpt, out, "--save-steps", "2"))
    assert_refused(code, capsys, "step 4 (epoch 1", "diverged", "nothing was saved from it", "lower --lr")
    state = load_last(out)
    assert state["progress"]["global_step"] == 2
    assert all(bool(torch.isfinite(t).all()) for t in state["model"].values())
    assert not (out / "model.safetensors").exists() and not (out / "metrics.json").exists()
    assert not temporaries(out)


def test_weights_broken_by_the_last_step_of_an_epoch_are_never_saved(tmp_path, ckpt, data, capsys, monkeypatch):
    """The loss of step 5 is finite, but its update leaves NaN weights (planted); the
    evaluation that follows must not pick them as the best (an argmax of NaN) nor save them."""
    from bert_port.training import recipe

    real_step, steps = recipe.train_step, [0]

    def step(model, *args, **kwargs):
        result = real_step(model, *args, **kwargs)
        steps[0] += 1
        if steps[0] == 5:  # the last step of epoch 1
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))
        return result

    monkeypatch.setattr(recipe, "train_step", step)
    out = tmp_path / "out"
    code = run_finetune(*finetune_args(data, ckpt, out, "--save-steps", "4"))
    assert_refused(code, capsys, "the validation loss after epoch 1 (step 5) is nan", "Nothing was saved")
    assert load_last(out)["progress"]["global_step"] == 4
    assert not (out / "model.safetensors").exists() and not (out / "metrics.json").exists()


def test_a_learning_rate_that_blows_up_the_weights_is_caught(tmp_path, ckpt, data, capsys):
    """A finite but absurd lr with clipping off: AdamW moves every weight by ~1e30, the
    LayerNorm variance overflows, and the next loss is NaN. Before the fix such a run
    reported an accuracy (the argmax of NaN) and saved NaN weights."""
    out = tmp_path / "out"
    code = run_finetune(*finetune_args(data, ckpt, out, "--lr", "1e30", "--max-grad-norm", "0", "--warmup-steps", "0"))
    assert_refused(code, capsys, "diverged", "nothing was saved")
    assert not (out / "model.safetensors").exists() and not (out / "checkpoints" / "last-checkpoint.pt").exists()


# -----------------------------------------------------------------------------------------
# 11. kill -9 during fine-tuning: the next --resume cleans up and ends bit-identical

# The child dies by SIGKILL half-way through writing the `kill_at`-th training state to its
# temporary file, the worst moment: a half-written hidden temporary is left behind.
CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    from bert_port import training
    kill_at, calls, real_save = int(os.environ["KILL_AT_SAVE"]), [0], torch.save
    def save(obj, f, *a, **k):  # f: the open temporary file the state is written to
        calls[0] += 1
        real_save(obj, f, *a, **k)
        if calls[0] == kill_at:
            f.flush()
            os.truncate(f.name, os.path.getsize(f.name) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save = save
    from bert_port.cli.finetune import main
    sys.exit(main(sys.argv[1:]))
""")


def _child(args: list, kill_at: int | None) -> subprocess.CompletedProcess:
    env = {**ENV, "KILL_AT_SAVE": str(kill_at or 0)}
    return subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        check=False,
    )


@pytest.mark.parametrize("kills", [3, pytest.param(8, marks=pytest.mark.slow)])
def test_kill_9_then_resume_cleans_up_and_ends_bit_identical(tmp_path, ckpt, data, kills):
    full = tmp_path / "full"
    assert _child(finetune_args(data, ckpt, full, "--save-steps", "1"), None).returncode == 0
    out = tmp_path / "killed"
    args = finetune_args(data, ckpt, out, "--save-steps", "1")
    for attempt in range(kills):
        resume = ["--resume"] if (out / "checkpoints" / "last-checkpoint.pt").is_file() else ["--overwrite"]
        proc = _child(args + resume, kill_at=2)  # each attempt saves one state, then dies writing the next
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        found = temporaries(out)
        assert found, "the kill left no temporary: the test did not plant the fault"
        if attempt:
            assert "removed 1 temporary file(s)" in proc.stderr  # the previous kill's leftover
    assert 1 <= load_last(out)["progress"]["global_step"] < 10
    proc = _child(args + ["--resume"], None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "removed 1 temporary file(s)" in proc.stderr and not temporaries(out)
    a, b = metrics_of(out), metrics_of(full)
    assert a["status"] == "completed" and [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]]
    assert [e["validation"] for e in a["evaluations"]] == [e["validation"] for e in b["evaluations"]]
    wa, wb = load_last(out)["model"], load_last(full)["model"]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    from safetensors.torch import load_file

    sa, sb = load_file(out / "model.safetensors"), load_file(full / "model.safetensors")
    assert all(torch.equal(sa[k], sb[k]) for k in sb)


def test_external_kill_9_at_any_moment_then_resume(tmp_path, ckpt, data):
    """kill -9 from outside, as soon as the first training state is on disk (wherever the
    child then is), then a resume: same weights as the run that was never killed."""
    full = tmp_path / "full"
    assert _child(finetune_args(data, ckpt, full, "--save-steps", "1"), None).returncode == 0
    out = tmp_path / "killed"
    args = [
        sys.executable,
        "-m",
        "bert_port.cli.finetune",
        *map(str, finetune_args(data, ckpt, out, "--save-steps", "1")),
    ]
    child = subprocess.Popen(args, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        import time

        deadline = time.monotonic() + 300
        while (
            not (out / "checkpoints" / "last-checkpoint.pt").exists()
            and child.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    proc = _child(finetune_args(data, ckpt, out, "--save-steps", "1", "--resume"), None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not temporaries(out)
    wa, wb = load_last(out)["model"], load_last(full)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wb)


def test_a_new_run_finishes_a_save_killed_after_its_commit(tmp_path, monkeypatch):
    """A save killed after its commit point leaves a journal whose staged temporaries are
    the new files. A run starting in that folder must finish the save (as the next save or
    `repair` would), not delete the new files as leftovers and roll back to the old ones."""
    import bert_port.checkpoint as ckpt
    from bert_port.training import own_output_dir
    from bert_port.training.run_folder import RUN_LOCK

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("old")

    def killed_after_the_commit_point(directory, journal):
        raise SystemExit("killed")  # the process dies with the journal in place

    monkeypatch.setattr(ckpt.staging, "_apply_journal", killed_after_the_commit_point)
    with pytest.raises(SystemExit), ckpt.StagedWrite(out) as stage:
        stage.text("config.json", "new")
    monkeypatch.undo()
    assert (out / ckpt.JOURNAL).is_file() and (out / "config.json").read_text() == "old"

    with own_output_dir(out):
        assert (out / "config.json").read_text() == "new"
    assert sorted(p.name for p in out.iterdir()) == [RUN_LOCK, "config.json"]  # the run's lock file stays


def test_predict_with_no_tokenizer_files_is_an_error_not_a_traceback(tmp_path, capsys):
    from bert_port import BertConfig, BertForSequenceClassification
    from bert_port.cli.predict import main

    BertForSequenceClassification(BertConfig.from_dict(dict(TINY, num_labels=2))).save_pretrained(tmp_path / "m")
    (tmp_path / "in.csv").write_text("text\nhello there\n")
    argv = ["--model", str(tmp_path / "m"), "--input", str(tmp_path / "in.csv"), "--output", str(tmp_path / "o.csv")]
    assert main([*argv, "--max-length", "16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "vocab.txt" in err and not (tmp_path / "o.csv").exists()
