"""bert-port-finetune's run machinery on a tiny random model with the real tokenizer: torchrun
with 2 CPU processes against 1 and gradient accumulation, interrupt and resume (the state in
checkpoints/, and an older run's state beside the model), frozen encoder and bf16, staged
writes, refused resumes, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_same_step_losses, assert_same_weights, load_last, metrics_of, run_finetune, tiny_args

from bert_port import BertModel
from bert_port.training import StopRequest
from bert_port.training.run_folder import RUN_LOCK

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_torchrun_two_processes_equal_one(tmp_path, sms_files, tiny_checkpoints):
    """Same global batch of 8: one process, one process accumulating 2 micro-batches, and
    torchrun with 2 gloo processes of 4 each give the same losses, weights and metrics.
    37 examples: the last step holds 5, and process 1 gets a padding repeat of weight 0.
    With the recipe's options: evaluations every 4 steps, a cosine schedule, early stopping."""
    ckpt = tiny_checkpoints["no_dropout"]
    options = ("--eval-steps", "4", "--lr-scheduler-type", "cosine", "--early-stopping-patience", "5")
    assert run_finetune(*tiny_args(sms_files, ckpt, tmp_path / "one", *options)) == 0
    assert run_finetune(*tiny_args(sms_files, ckpt, tmp_path / "accum", "--grad-accum-steps", "2", *options)) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    args = tiny_args(sms_files, ckpt, tmp_path / "ddp", "--device", "cpu", *options)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "bert_port.cli.finetune",
        *map(str, args),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = metrics_of(tmp_path / "one")
    assert one["config"]["steps_per_epoch"] == 5 and one["global_step"] == 10
    assert [e["step"] for e in one["evaluations"]] == [4, 8, 10]
    for other in ("accum", "ddp"):
        m = metrics_of(tmp_path / other)
        weights, reference = load_last(tmp_path / other)["model"], load_last(tmp_path / "one")["model"]
        print(
            f"{other} vs one process: step-loss |diff| max "
            f"{max(abs(a['loss'] - b['loss']) for a, b in zip(m['steps'], one['steps'])):.2e}, weight |diff| max "
            f"{max(float((weights[k] - reference[k]).abs().max()) for k in reference):.2e}"
        )
        assert m["config"]["world_size"] == (2 if other == "ddp" else 1)
        assert_same_step_losses(m, one)
        assert len(m["evaluations"]) == len(one["evaluations"]) and m["early_stopping"] == one["early_stopping"]
        for a, b in zip(m["evaluations"], one["evaluations"]):
            assert a["validation"]["per_class"] == b["validation"]["per_class"]
            assert abs(a["validation"]["loss"] - b["validation"]["loss"]) < 1e-5
        assert m["best"]["confusion"] == one["best"]["confusion"]
        assert m["test"]["confusion"] == one["test"]["confusion"]
        assert_same_weights(weights, reference, atol=1e-5, rtol=1e-4)


# 3: mid-epoch; 5: at the end of epoch 1, before its evaluation
@pytest.mark.parametrize("stop_after", [3, 5], ids=["3", "5"])
def test_interrupt_and_resume_equals_uninterrupted(tmp_path, sms_files, tiny_checkpoints, stop_after):
    """With dropout on, so the restored RNG matters: stop after N steps, resume, and get
    the same weights, per-step losses and evaluations as a run that never stopped. The state
    lives in checkpoints/."""
    ckpt = tiny_checkpoints["dropout"]
    assert run_finetune(*tiny_args(sms_files, ckpt, tmp_path / "full")) == 0
    args = tiny_args(sms_files, ckpt, tmp_path / "split")
    assert run_finetune(*args, "--stop-after-steps", stop_after) == 0
    stopped = metrics_of(tmp_path / "split")
    assert stopped["status"] == "stopped" and stopped["global_step"] == stop_after
    assert load_last(tmp_path / "split")["progress"]["global_step"] == stop_after
    assert run_finetune(*args, "--resume") == 0
    full, resumed = metrics_of(tmp_path / "full"), metrics_of(tmp_path / "split")
    assert resumed["status"] == "completed"
    assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in full["steps"]]
    assert [e["validation"] for e in resumed["evaluations"]] == [e["validation"] for e in full["evaluations"]]
    assert resumed["test"] == full["test"]
    assert_same_weights(load_last(tmp_path / "split")["model"], load_last(tmp_path / "full")["model"], atol=0, rtol=0)


def test_freeze_encoder_and_bf16_train_only_the_head(tmp_path, sms_files, tiny_checkpoints):
    from bert_port.classifier import BertForSequenceClassification

    out = tmp_path / "frozen"
    assert (
        run_finetune(
            *tiny_args(sms_files, tiny_checkpoints["dropout"], out, "--epochs", "1", "--freeze-encoder", "--bf16")
        )
        == 0
    )
    trained = BertForSequenceClassification.from_pretrained(out).state_dict()
    base = BertModel.from_pretrained(tiny_checkpoints["dropout"]).state_dict()
    assert_same_weights({k: trained["bert." + k] for k in base}, base, atol=0, rtol=0)
    state = load_last(out)["optimizer"]
    assert [n for g in state["param_groups"] for n in g["names"]] == ["classifier.weight", "classifier.bias"]
    assert all(float(s["exp_avg"].abs().sum()) > 0 for s in state["state"].values())  # the head was trained
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in metrics_of(out)["steps"])


def test_checkpoint_writes_leave_no_temporary_files(tmp_path, sms_files, tiny_checkpoints):
    out = tmp_path / "run"
    args = tiny_args(sms_files, tiny_checkpoints["no_dropout"], out, "--epochs", "1", "--save-steps", "2")
    assert run_finetune(*args) == 0
    hidden = [p.name for p in out.iterdir() if p.name.startswith(".") or p.suffix == ".tmp"]
    assert hidden == [RUN_LOCK]  # the run's lock file, and no temporary
    assert load_last(out)["progress"] == {"epoch": 1, "step_in_epoch": 0, "global_step": 5}


def test_resume_refuses_changed_settings(tmp_path, sms_files, tiny_checkpoints, capsys):
    args = tiny_args(sms_files, tiny_checkpoints["no_dropout"], tmp_path / "run")
    assert run_finetune(*args, "--stop-after-steps", "1") == 0
    assert run_finetune(*args, "--resume", "--batch-size", "4") == 2
    err = capsys.readouterr().err
    assert "batch_size: checkpoint 8, now 4" in err and "start a new --output-dir" in err
    assert run_finetune(*args) == 2  # neither --resume nor --overwrite: the run is not clobbered
    assert "already holds a fine-tuning run" in capsys.readouterr().err


def test_ctrl_c_requests_a_stop_instead_of_killing():
    before = signal.getsignal(signal.SIGINT)
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)  # handled: no KeyboardInterrupt
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C aborts
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.gpu
def test_tiny_run_on_cuda_with_bf16(tmp_path, sms_files, tiny_checkpoints):
    out = tmp_path / "cuda"
    assert run_finetune(*tiny_args(sms_files, tiny_checkpoints["dropout"], out, "--device", "cuda", "--bf16")) == 0
    m = metrics_of(out)
    assert m["config"]["device"].startswith("cuda") and m["status"] == "completed"
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in m["steps"])
