"""The fine-tuning recipe behind `bert-port-finetune` and `training.api.finetune`, in the
manner of torchtune's recipes: `FinetuneRecipe` with `setup` (output folder, data, model,
optimiser, schedule, resume), `train_epoch`, `evaluate`, `save_checkpoint`, `resume` and
`cleanup`. The pieces it calls live beside it (`settings`, `steps`, `batching`, `evaluation`,
`reporting`, `run_folder`, `resume`, `reference`), and it hands them values, not itself.

It evaluates every epoch or every `eval_steps`, keeps the best by `metric_for_best` in HF
format with a model card, stops early after `early_stopping_patience` evaluations without
improvement, and writes its resumable state to `checkpoints/` (every epoch, `save_steps`,
`stop_after_steps`, the end, Ctrl-C), from which `resume=True` ends bit-identical to the
uninterrupted run. A NaN step stops the run before the optimiser takes it; every file is
staged, so a full disk leaves the last checkpoint whole. How each is tested and why:
docs/fine-tuning.md. `pretrain.PretrainRecipe` is this class with a language model's task.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from .. import checkpoint as ckpt
from ..assets import minilm_dir
from ..config import BertConfig
from ..data import TextDataset
from ..extras import require
from ..problem import ProblemType
from ..tokenization import load_tokenizer
from .batching import Collator, chunks
from .data_signal import check_texts
from .evaluation import evaluate
from .history import new_history, record_evaluation, update_best
from .model_card import finetune_card, write_model_card
from .reference import build_model, load_trained, save_model
from .reporting import (
    TENSORBOARD_DIR,
    RunShape,
    TensorBoardLog,
    compare_with,
    full_disk_said,
    metrics_document,
    plot_curves,
    resolved_config,
    write_json,
    write_run_files,
)
from .resume import (
    TrainingParts,
    check_resumable,
    data_identity,
    load_state,
    restore,
    rng_state,
    save_state,
    state_file,
    state_path,
    training_state,
)
from .run_folder import CURVES_FILE, METRICS_FILE, check_output_dir, lock_output_dir
from .settings import FinetuneConfig, FinetuneError, check_max_length
from .splits import load_splits
from .steps import (
    DIVERGED_ADVICE,
    Dist,
    DivergedError,
    ResumableSampler,
    StopRequest,
    build_optimizer,
    build_scheduler,
    check_finite_weights,
    resolve_warmup,
    train_step,
)

log = logging.getLogger(__name__)

__all__ = ["FinetuneRecipe"]


class FinetuneRecipe:
    """One fine-tuning run, as one process of a torchrun job (rank 0 of 1 without it):
    `setup`, then `train` (which calls `train_epoch`, `evaluate` and `save_checkpoint`),
    then `cleanup`. `finetune(cfg)` does all three."""

    def __init__(self, cfg: FinetuneConfig, dist_info: Dist):
        self.cfg, self.d = cfg, dist_info
        self.out = Path(cfg.output_dir)
        self.last_path = state_path(self.out)  # where it writes, and a resume reads
        self.t_start = time.perf_counter()
        self.global_step = 0
        self.status = "running"
        self.tensorboard: TensorBoardLog | None = None
        self.history: dict[str, Any] = new_history(cfg.early_stopping_patience)

    @property
    def problem(self) -> ProblemType:
        return ProblemType(self.cfg.problem_type)

    @property
    def headline(self) -> tuple[str, ...]:
        """The validation metrics each evaluation's log line shows."""
        return self.problem.headline

    # --- setup ---------------------------------------------------------------------------

    def setup(self, stack: contextlib.ExitStack) -> None:
        """Everything before the first step, each refusal before any work it would waste:
        the output directory, the data, the model, optimiser, schedule, and the resumed state."""
        cfg, d = self.cfg, self.d
        check_output_dir(cfg, self.out)
        self._check_extras_and_device()
        self._read_data()
        lock_output_dir(cfg, self.out, d, stack)
        self.data = data_identity(cfg)  # after reading: the files the run reads are the files it records
        self.micro = cfg.batch_size // (cfg.grad_accum_steps * d.world_size)
        if self.micro * cfg.grad_accum_steps * d.world_size != cfg.batch_size:
            raise FinetuneError(
                f"batch_size {cfg.batch_size} must be a multiple of grad_accum_steps x processes = "
                f"{cfg.grad_accum_steps} x {d.world_size}"
            )
        self._build_model_and_data()
        self._build_optimisation()
        if cfg.resume:
            self.resume()
        if d.is_main:
            with full_disk_said(self.out, lambda: self.global_step):
                self._write_run_files()
            if cfg.report_to == "tensorboard":
                # A resumed run drops what the interrupted one logged after its checkpoint.
                purge = self.global_step + 1 if cfg.resume else None
                self.tensorboard = TensorBoardLog(self.out / TENSORBOARD_DIR, purge_step=purge)

    def _read_data(self) -> None:
        """The checks that need the model's config, then the data read in full (`self.splits`)."""
        cfg = self.cfg
        model_config = BertConfig.from_json_file(ckpt.locate_checkpoint(cfg.checkpoint or minilm_dir()).config_file)
        check_max_length(cfg.max_length, model_config.max_sequence_length, pairs=cfg.text_pair_column is not None)
        self.splits = load_splits(cfg)

    def _write_run_files(self) -> None:
        write_run_files(self.out, self.cfg, self.resolved_config(), self.splits)

    def _check_extras_and_device(self) -> None:
        if self.cfg.report_to == "tensorboard":
            require("tensorboard")  # before any work: a clear error naming the package
        self._check_task_extras()
        if self.cfg.fp16 and self.d.device.type != "cuda":
            raise FinetuneError(
                f"--fp16 needs a CUDA device (its gradient scaler is for GPUs), and this run is on {self.d.device}; "
                "on the CPU use --bf16, or drop --fp16"
            )

    def _check_task_extras(self) -> None:
        """The packages this task's metrics need, before any work: seqeval for token classification."""
        if self.problem is ProblemType.TOKEN_CLASSIFICATION:
            require("seqeval", "the entity-level metrics of token classification")

    def _build_model_and_data(self) -> None:
        cfg, d, splits = self.cfg, self.d, self.splits
        self.model, self.source_dir = build_model(cfg, splits.names)
        self.model.to(d.device)
        tokenizer = load_tokenizer(self.source_dir)
        for split in ("train", "validation"):  # no run, and no metric, from data the tokenizer cannot read
            check_texts(tokenizer, getattr(splits, split).texts, split, getattr(splits, split).source)
        self.train_collate = self._collator(tokenizer, splits.train)
        self.val_collate = self._collator(tokenizer, splits.validation)
        self.test_collate = self._collator(tokenizer, splits.test) if splits.test is not None else None
        self.n_train = len(splits.train)
        self.sampler = ResumableSampler(
            splits.train, num_replicas=d.world_size, rank=d.rank, shuffle=True, seed=cfg.seed
        )

    def _build_optimisation(self) -> None:
        """Steps, AdamW, the schedule, the fp16 scaler, and the DDP wrapper."""
        cfg, d = self.cfg, self.d
        self.steps_per_epoch = math.ceil(self.n_train / cfg.batch_size)  # = ceil(ceil(n / W) / (micro * accum))
        self.total_steps = cfg.max_steps if cfg.max_steps is not None else cfg.epochs * self.steps_per_epoch
        self.warmup_steps = resolve_warmup(cfg.warmup_steps, cfg.warmup_ratio, self.total_steps)
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = build_scheduler(self.optimizer, self.warmup_steps, self.total_steps, cfg.lr_scheduler_type)
        self.scaler = torch.amp.GradScaler("cuda") if cfg.fp16 else None
        self.ddp_model: nn.Module = self.model
        if d.enabled:
            device_ids = [d.device.index] if d.device.type == "cuda" else None
            self.ddp_model = nn.parallel.DistributedDataParallel(self.model, device_ids=device_ids)

    def _collator(self, tokenizer, dataset: TextDataset) -> Collator:
        targets = self.problem.targets(dataset, self.splits.names)
        return Collator(tokenizer, dataset, self.cfg.max_length, targets)

    def shape(self) -> RunShape:
        """What the settings came to on this data and machine."""
        model = type(self.model).__module__ + "." + type(self.model).__name__
        return RunShape(self.d.world_size, self.micro, self.steps_per_epoch, self.total_steps, self.warmup_steps,
                        str(self.d.device), model, str(self.source_dir))  # fmt: skip

    def resolved_config(self) -> dict[str, Any]:
        """The settings as run: the options, and what they came to on this data and machine."""
        splits = self.splits
        sizes = {"train": self.n_train, "validation": len(splits.validation), "test": len(splits.test or ())}
        return resolved_config(
            self.cfg, self.shape(), metric_for_best=self.cfg.metric, labels=splits.names, sizes=sizes
        )

    def task_summary(self) -> dict[str, Any]:
        """What metrics.json says of the task, beside the run: the problem type and labels."""
        return {"problem_type": self.cfg.problem_type, "labels": self.splits.names}

    def metrics(self, status: str) -> dict[str, Any]:
        """The document written to metrics.json."""
        name = f"{type(self.model).__module__.split('.')[0]} {type(self.model).__name__} on {self.cfg.dataset or self.cfg.train}"
        header = {"name": name, "output_dir": str(self.out), "status": status, **self.task_summary()}
        return metrics_document(header, self.resolved_config(), self.history, self.global_step)

    # --- checkpoints ---------------------------------------------------------------------

    def progress(self) -> dict[str, int]:
        epoch, step_in_epoch = divmod(self.global_step, self.steps_per_epoch)
        return {"epoch": epoch, "step_in_epoch": step_in_epoch, "global_step": self.global_step}

    def save_checkpoint(self) -> None:
        """The resumable state (`resume.py`), from finite weights only, written atomically by rank 0."""
        check_finite_weights(self.model, f"step {self.global_step}")
        rngs = self.d.gather(rng_state())
        if self.d.is_main:
            self.last_path.parent.mkdir(exist_ok=True)
            run = dict(progress=self.progress(), history=self.history, labels=self.splits.names, data=self.data)
            save_state(training_state(self.parts(), rngs, config=dataclasses.asdict(self.cfg), **run), self.last_path)
        self.d.barrier()

    def parts(self) -> TrainingParts:
        return TrainingParts(self.model, self.optimizer, self.scheduler, self.scaler)

    def resume(self) -> None:
        """Continue from the last checkpoint, refusing settings, labels or data that changed."""
        path = state_file(self.out) or self.last_path
        state = load_state(path)
        check_resumable(state, self.cfg, self.splits.names, path)
        self.global_step, self.history = restore(self.parts(), state, self.d.rank, self.d.world_size)
        if self.d.is_main:
            log.info("resumed from %s at step %d", path, self.global_step)

    # --- training ------------------------------------------------------------------------

    def done(self) -> bool:
        return self.global_step >= self.total_steps or self.history["early_stopping"]["stopped_early"]

    def train(self) -> dict[str, Any]:
        """Train to the end (or an interruption, or an early stop); returns the metrics. A full
        disk is one line naming what there is to go on from (`reporting.full_disk_said`)."""
        with full_disk_said(self.out, lambda: self.global_step):
            with StopRequest() as stop:
                while not self.done() and self.status != "stopped":
                    self.train_epoch(stop)
            if self.status != "stopped":
                self.status = "completed"
            return self.finish()

    def train_epoch(self, stop: StopRequest) -> None:
        """The steps of the epoch that `global_step` lies in, from there on, each followed by
        `after_step` (evaluation, checkpoints, stop requests)."""
        cfg, spe = self.cfg, self.steps_per_epoch
        epoch, start = divmod(self.global_step, spe)
        self.sampler.set_epoch(epoch)
        self.sampler.start = start * cfg.grad_accum_steps * self.micro
        micro_batches = list(chunks(list(self.sampler), self.micro))
        end = min(spe, start + self.total_steps - self.global_step)
        bar = tqdm(
            total=end,
            initial=start,
            desc=f"epoch {epoch + 1}/{math.ceil(self.total_steps / spe)}",
            unit="step",
            disable=not self.d.is_main,
            dynamic_ncols=True,
        )
        for k in range(start, end):
            first = (k - start) * cfg.grad_accum_steps
            record = self.train_step(epoch, k, micro_batches[first : first + cfg.grad_accum_steps])
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
            if self.after_step(stop):
                break
        bar.close()

    def train_step(self, epoch: int, k: int, group: list[list[int]]) -> dict[str, Any]:
        """Optimiser step k of `epoch` over the micro-batches `group` of this process."""
        cfg, d = self.cfg, self.d
        t0 = time.perf_counter()
        n_examples = min(cfg.batch_size, self.n_train - k * cfg.batch_size)
        batches, weights = [], []
        for j, indices in enumerate(group):
            # Positions in this process's list; global position = rank + local * world size.
            local = torch.arange(len(indices)) + (k * cfg.grad_accum_steps + j) * self.micro
            weights.append(((d.rank + local * d.world_size) < self.n_train).float().to(d.device))
            batches.append({key: v.to(d.device) for key, v in self.collate_train(epoch, indices).items()})
        n_real = self.loss_count(batches, weights, n_examples)
        lr = self.optimizer.param_groups[0]["lr"]
        where = f"step {self.global_step + 1} (epoch {epoch + 1}, lr {lr:.3g})"
        try:
            loss_sum, grad_norm = train_step(
                self.ddp_model,
                self.optimizer,
                self.scheduler,
                batches,
                weights,
                n_real,
                **self.loss_options(),
                world_size=d.world_size,
                max_grad_norm=cfg.max_grad_norm,
                bf16=cfg.bf16,
                scaler=self.scaler,
            )
        except DivergedError as exc:
            raise DivergedError(
                f"{where} diverged: {exc}. The step was not taken and nothing was saved from it; {DIVERGED_ADVICE}"
            ) from None
        loss = float(d.sum(loss_sum)) / n_real
        if not math.isfinite(loss):  # the same on every process: it was summed over them
            raise DivergedError(f"the training loss at {where} is {loss}; nothing was saved from it; {DIVERGED_ADVICE}")
        self.global_step += 1
        self.history["train_time_s"] += time.perf_counter() - t0
        self.history["examples"] += n_examples
        record = {"step": self.global_step, "epoch": epoch + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm}
        self.history["steps"].append(record)
        if self.tensorboard is not None:
            self.tensorboard.step(record)
        return record

    def collate_train(self, epoch: int, indices: list[int]) -> dict[str, torch.Tensor]:
        """The training batch of the examples `indices` (in `epoch`: the same in every epoch here)."""
        return self.train_collate(indices)

    def loss_count(self, batches: list[dict[str, torch.Tensor]], weights: list[torch.Tensor], n_examples: int) -> float:
        """What a step's summed loss is divided by: here its number of real examples."""
        return n_examples

    def loss_options(self) -> dict[str, Any]:
        """How `steps.train_step` scores each example: here by the problem type's loss."""
        return {"problem_type": self.cfg.problem_type}

    def evaluation_due(self) -> bool:
        every = self.cfg.eval_steps or self.steps_per_epoch
        return self.global_step % every == 0 or self.global_step >= self.total_steps

    def after_step(self, stop: StopRequest) -> bool:
        """Evaluate when due, then checkpoint: on a stop request (and end the run there), at
        the end of an epoch or of the run, and every `save_steps`. True: leave the epoch."""
        cfg, d = self.cfg, self.d
        if self.evaluation_due():
            self.evaluate()
        finished = self.done()
        stop_now = stop.requested or (cfg.stop_after_steps is not None and self.global_step >= cfg.stop_after_steps)
        if d.enabled:  # every process must agree to stop at the same step
            stop_now = bool(d.sum(torch.tensor(float(stop_now))) > 0)
        if stop_now and not finished:
            self.save_checkpoint()
            self.status = "stopped"
            return True
        epoch_end = self.global_step % self.steps_per_epoch == 0
        if finished or epoch_end or (cfg.save_steps and self.global_step % cfg.save_steps == 0):
            self.save_checkpoint()
        return finished

    # --- evaluation ----------------------------------------------------------------------

    def _metrics_on(self, model: nn.Module, collate, split: str) -> dict[str, Any]:
        """`model`'s loss and metrics on one split, with this run's batch size, precision and
        problem type."""
        cfg, options = self.cfg, {"desc": split, "problem_type": self.cfg.problem_type, "fp16": self.cfg.fp16}
        return evaluate(model, collate, self.splits.names, self.d, cfg.eval_batch_size, cfg.bf16, **options)

    def evaluate(self) -> dict[str, Any]:
        """Evaluate on the validation data, record it, keep the best checkpoint, and count
        towards early stopping."""
        d, step = self.d, self.global_step
        result = self._metrics_on(self.model, self.val_collate, "validation")
        epoch, rest = divmod(step, self.steps_per_epoch)
        when = f"after epoch {epoch}" if rest == 0 else f"in epoch {epoch + 1}"
        if not math.isfinite(result["loss"]):  # the metrics would be those of NaN scores: meaningless
            raise DivergedError(
                f"the validation loss {when} (step {step}) is {result['loss']}: the weights are broken. "
                f"Nothing was saved from them; {DIVERGED_ADVICE}"
            )
        record = record_evaluation(self.history, result, step, self.steps_per_epoch)
        better = self._update_best(result, record)
        if d.is_main:
            headline = ", ".join(f"{m} {result[m]:.4f}" for m in self.headline)
            log.info("step %d: validation loss %.4f, %s%s", step, result["loss"], headline, " (best so far)" * better)
            if self.tensorboard is not None:
                self.tensorboard.evaluation(record)
            write_json(self.metrics("running"), self.out / METRICS_FILE)
        return record

    def _update_best(self, result: dict[str, Any], record: dict[str, Any]) -> bool:
        """Record the evaluation as the best (and save the model) or count it towards early stopping."""
        if not update_best(self.history, result, record, self.cfg.metric):
            if self.history["early_stopping"]["stopped_early"] and self.d.is_main:
                log.info("early stopping: %d evaluation(s) without a better %s", self.cfg.early_stopping_patience,
                         self.cfg.metric)  # fmt: skip
            return False
        check_finite_weights(self.model, f"step {record['step']}")
        if self.d.is_main:
            save_model(self.model, self.out, self.source_dir)
        self.d.barrier()
        return True

    # --- the end -------------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """metrics.json and the plot; when complete, the best checkpoint on the test data and
        the comparison with another run."""
        cfg, d = self.cfg, self.d
        metrics = self.metrics(self.status)
        if self.status == "completed":
            if self.test_collate is not None:
                best = load_trained(self.out, cfg.reference, cfg.attn_implementation).to(d.device)
                metrics["test"] = self._metrics_on(best, self.test_collate, "test")
            if cfg.compare_to and d.is_main:
                compare_with(metrics, Path(cfg.compare_to) / METRICS_FILE, self.out)
        metrics["wall_time_s"] = round(time.perf_counter() - self.t_start, 2)  # this invocation, data to test
        if d.is_main:
            write_json(metrics, self.out / METRICS_FILE)
            if metrics["steps"]:
                plot_curves(metrics, self.out / CURVES_FILE)
            if self.history["best"]:  # a card beside the weights it describes
                write_model_card(finetune_card(metrics), self.out)
        d.barrier()
        return metrics

    def cleanup(self) -> None:
        """Close the TensorBoard log and leave the process group this run started."""
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.d.owns_group and dist.is_initialized():
            dist.destroy_process_group()
