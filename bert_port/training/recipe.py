"""The fine-tuning recipe behind `bert-port-finetune`, in the manner of torchtune's recipes:
`FinetuneRecipe` with `setup` (output directory, data, model, optimiser, schedule, resume),
`train_epoch`, `evaluate`, `save_checkpoint`, `resume` and `cleanup`; `finetune(cfg)` runs
it. The pieces it calls live beside it: `settings` (the options), `steps` (AdamW, the
schedules, one optimiser step, processes), `evaluation` (metrics per problem type,
`predict`) and `reporting` (metrics.json, the plot, TensorBoard).

Evaluation. After every epoch, or with `eval_steps` every N optimiser steps (and at the
last step); each one is appended to `metrics.json`'s `evaluations`, and the best by
`metric_for_best` is saved in HF format. With `early_stopping_patience` K, the run ends
after K evaluations in a row without improvement (recorded under `early_stopping`).

Resume. `last-checkpoint.pt` in the output directory holds the model, optimiser, scheduler,
gradient scaler, every process's RNG state, the optimiser step reached and the history
(evaluations, best, early-stopping count); it is written to a temporary file and renamed
into place (`checkpoint.atomic_write`) at the end of every epoch, every `save_steps` steps,
at `stop_after_steps`, when the run ends, and when it is interrupted (Ctrl-C / SIGTERM stop
after the current step). Every step has the same number of examples' worth of positions in
the seeded order, so the step reached fixes the data position. `resume=True` continues from
it and ends bit-identical to the uninterrupted run, evaluations and early stopping included.

Faults. Every setting is checked before any work (types too, for a config file; numbers
finite and in range; `max_length` against the model's position table), and the data files
are read in full before the model is built. A step whose gradient or loss is NaN or
infinite stops the run with `DivergedError` before the optimiser takes it (under fp16 the
gradient scaler skips such a step instead, as it should), and no weights are ever saved
unless every tensor is finite. The output directory is locked for the run (an flock, which
dies with its process), and the hidden temporaries a `kill -9` left there are deleted by
the next run or `--resume`.

The loop runs `bert_port.BertForSequenceClassification`, or with `reference="hf"`
transformers' model of the same name (passed in by the command line, since this package
never imports transformers), started from the very same weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data.distributed import DistributedSampler
from tqdm.auto import tqdm

from .. import checkpoint as ckpt
from ..assets import minilm_dir
from ..classifier import BertForSequenceClassification
from ..config import BertConfig
from ..data import (
    LABEL_KINDS,
    Collator,
    DataError,
    TextDataset,
    builtin_splits,
    check_labels,
    chunks,
    load_texts,
    problem_label_names,
    validation_split,
    write_texts,
)
from ..tokenization import load_tokenizer
from .evaluation import HEADLINE, evaluate
from .reporting import TENSORBOARD_DIR, TensorBoardLog, compare_runs, plot_curves, torch_save_atomic, write_json
from .settings import FinetuneConfig, FinetuneError, check_max_length, resume_mismatches
from .steps import (
    Dist,
    DivergedError,
    build_optimizer,
    build_scheduler,
    rng_state,
    set_rng_state,
    set_seed,
    setup_distributed,
    train_step,
)

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

log = logging.getLogger(__name__)

LAST_CHECKPOINT = "last-checkpoint.pt"
METRICS_FILE = "metrics.json"
CURVES_FILE = "training_curves.png"
RESOLVED_CONFIG = "training_config.json"
STATE_FORMAT = 2  # of last-checkpoint.pt; 2: schedules as transformers', progress by optimiser step


# -----------------------------------------------------------------------------------------
# Data and model


@dataclass
class Splits:
    train: TextDataset
    validation: TextDataset
    test: TextDataset | None
    names: list[str]  # the label map: id -> name


def load_splits(cfg: FinetuneConfig) -> Splits:
    """Read the configured data, check the labels, and build the label map from training."""
    if cfg.dataset is not None:
        parts = builtin_splits(cfg.dataset)
        train, validation, test = parts["train"], parts["validation"], parts["test"]
    else:
        read = dict(
            text_column=cfg.text_column,
            label_column=cfg.label_column,
            text_pair_column=cfg.text_pair_column,
            label_kind=LABEL_KINDS[cfg.problem_type],
        )
        train = load_texts(cfg.train, **read)
        if cfg.validation is not None:
            validation = load_texts(cfg.validation, **read)
        else:
            train, validation = validation_split(train, cfg.validation_split, cfg.seed)
        test = load_texts(cfg.test, **read) if cfg.test is not None else None
    if cfg.max_train_examples is not None:
        train = train.subset(range(min(cfg.max_train_examples, len(train))))
    names = problem_label_names(train, cfg.problem_type, "score" if cfg.dataset else cfg.label_column)
    if cfg.problem_type == "single_label_classification" and len(names) < 2:
        raise DataError(
            f"{train.source}: every training example has the label {names[0]!r}; a classifier needs "
            "examples of at least two labels"
        )
    if not names:
        raise DataError(f"{train.source}: no training example has any label; a multi-label classifier needs some")
    if cfg.problem_type != "regression":
        multi = cfg.problem_type == "multi_label_classification"
        check_labels(validation, names, "validation", multi=multi)
        if test is not None:
            check_labels(test, names, "test", multi=multi)
    return Splits(train, validation, test, names)


def build_model(cfg: FinetuneConfig, names: list[str], hf_module=None) -> tuple[nn.Module, Path]:
    """The classifier to train, in train mode, and the directory of its tokenizer. The head
    is initialised from the seeded RNG. With `hf_module` (the `transformers` module) the
    reference model is built and given exactly the port model's initial weights."""

    overrides: dict[str, Any] = {
        "id2label": dict(enumerate(names)),
        "label2id": {name: i for i, name in enumerate(names)},
        "problem_type": cfg.problem_type,
        "attn_implementation": cfg.attn_implementation,
    }
    if cfg.classifier_dropout is not None:
        overrides["classifier_dropout"] = cfg.classifier_dropout
    set_seed(cfg.seed)
    model = BertForSequenceClassification.from_pretrained(cfg.checkpoint or minilm_dir(), **overrides)
    source_dir = Path(model.source_dir)
    if hf_module is not None:
        with torch.random.fork_rng(devices=[]):  # HF's own random init must not move the RNG dropout will use
            model = to_hf_model(model, hf_module, cfg.attn_implementation)
    if cfg.freeze_encoder:
        for param in model.bert.parameters():
            param.requires_grad_(False)
    return model.train(), source_dir


def to_hf_model(model: BertForSequenceClassification, hf_module, attn_implementation: str = "sdpa") -> nn.Module:
    """transformers' BertForSequenceClassification holding `model`'s weights (strict)."""
    hf_config = hf_module.BertConfig(**model.config.to_dict())
    hf_config._attn_implementation = attn_implementation
    reference = hf_module.BertForSequenceClassification(hf_config)
    reference.load_state_dict(model.hf_state_dict(), strict=True)
    return reference


def load_trained(output_dir: str | os.PathLike, hf_module=None, attn_implementation: str = "sdpa") -> nn.Module:
    """Load the saved best checkpoint with the same implementation that trained it."""
    if hf_module is not None:
        return hf_module.BertForSequenceClassification.from_pretrained(
            str(output_dir), attn_implementation=attn_implementation
        ).eval()
    return BertForSequenceClassification.from_pretrained(output_dir, attn_implementation=attn_implementation)


def save_model(model: nn.Module, output_dir: Path, source_dir: Path) -> None:
    """HF-format checkpoint of `model` with the tokenizer files beside it."""
    if isinstance(model, BertForSequenceClassification):
        model.source_dir = source_dir
        model.save_pretrained(output_dir)
        return
    model.save_pretrained(str(output_dir))  # transformers' model: copy its tokenizer ourselves
    for name in ckpt.TOKENIZER_FILES:
        if (source_dir / name).is_file():
            with ckpt.atomic_write(output_dir / name) as tmp:
                tmp.write_bytes((source_dir / name).read_bytes())


# -----------------------------------------------------------------------------------------
# The run's surroundings: signals, the sampler, the output directory


class _StopRequest:
    """Turns Ctrl-C / SIGTERM into "stop after this step and save"; a second Ctrl-C aborts."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("interrupted: stopping after the current step and saving a checkpoint (again to abort)")

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class _Sampler(DistributedSampler):
    """`DistributedSampler` that can start part-way into an epoch (resume)."""

    start = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.start :])

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start)


# Not --resume: it must keep the settings, so it would diverge again at the same step.
_DIVERGED_ADVICE = (
    "lower --lr, keep --max-grad-norm on (e.g. 1.0), or drop --bf16, and start again with "
    "--overwrite or in another --output-dir"
)


@contextlib.contextmanager
def _own_output_dir(out: Path):
    """Create `out`, lock it for this run (a second run into it is refused), and delete the
    temporaries a killed run left behind (`kill -9` cannot clean up after itself). The lock
    is an flock on the directory: the kernel drops it when its process dies, so a killed
    run never blocks the next."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out, os.O_RDONLY)
    except OSError as exc:
        raise FinetuneError(
            f"cannot create or open --output-dir {out} ({exc.strerror}); choose a directory you can write to"
        ) from None
    os.close(fd)
    if not os.access(out, os.W_OK):
        raise FinetuneError(f"--output-dir {out} is not writable; choose a directory you can write to")
    try:
        # The same lock as checkpoint saves take, re-entrant, so this run's own saves into
        # `out` nest inside it; another run is refused at once, and a save from another
        # process waits for this run to end.
        lock = ckpt.DirectoryLock(out, blocking=False)
    except BlockingIOError:
        raise FinetuneError(
            f"another bert-port-finetune is writing into {out} right now; wait for it to end or "
            "choose another --output-dir"
        ) from None
    try:
        # What killed saves left (`checkpoint.StagedWrite` and `data.write_texts` stage files
        # as hidden temporaries): a save killed after its commit is finished, the rest deleted.
        removed = size = 0
        for folder in (out, out / "data"):
            if folder.is_dir():
                count, nbytes = ckpt.tidy(folder)
                removed, size = removed + count, size + nbytes
        if removed:
            log.warning(
                "removed %d temporary file(s) (%.1f MiB) left in %s by an interrupted run", removed, size / 2**20, out
            )
        yield out
    finally:
        lock.release()


def _load_last(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 (torch raises many types for a damaged file)
        raise FinetuneError(
            f"cannot read {path} ({type(exc).__name__}: {str(exc)[:200]}); it is damaged. Start "
            "the run again with --overwrite, or in another --output-dir"
        ) from None


def _check_finite_weights(model: nn.Module, when: str) -> None:
    """No checkpoint is ever written from NaN or infinite weights."""
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise DivergedError(
            f"{len(bad)} weight tensor(s) hold NaN or Inf at {when} (e.g. {', '.join(bad[:3])}); "
            f"nothing was saved from them; {_DIVERGED_ADVICE}"
        )


# -----------------------------------------------------------------------------------------
# The recipe


class FinetuneRecipe:
    """One fine-tuning run, as one process of a torchrun job (rank 0 of 1 without it):
    `setup`, then `train` (which calls `train_epoch`, `evaluate` and `save_checkpoint`),
    then `cleanup`. `finetune(cfg)` does all three."""

    def __init__(self, cfg: FinetuneConfig, dist_info: Dist, hf_module=None):
        self.cfg, self.d, self.hf_module = cfg, dist_info, hf_module
        self.out = Path(cfg.output_dir)
        self.last_path = self.out / LAST_CHECKPOINT
        self.t_start = time.perf_counter()
        self.global_step = 0
        self.status = "running"
        self.tensorboard: TensorBoardLog | None = None
        self.history: dict[str, Any] = {
            "steps": [],
            "evaluations": [],
            "best": None,
            "early_stopping": {
                "patience": cfg.early_stopping_patience,
                "evaluations_without_improvement": 0,
                "stopped_early": False,
                "stopped_at_step": None,
            },
            "train_time_s": 0.0,
            "examples": 0,
        }

    # --- setup ---------------------------------------------------------------------------

    def setup(self, stack: contextlib.ExitStack) -> None:
        """Everything before the first step, each refusal before any work it would waste:
        the output directory, the data, the model, optimiser, schedule, and the resumed state."""
        cfg, d = self.cfg, self.d
        self._check_output_dir()
        self._check_extras_and_device()
        model_config = BertConfig.from_json_file(ckpt.locate_checkpoint(cfg.checkpoint or minilm_dir()).config_file)
        check_max_length(cfg.max_length, model_config.max_position_embeddings, pairs=cfg.text_pair_column is not None)
        self.splits = load_splits(cfg)
        self._lock_output_dir(stack)
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
            self._write_run_files()
            if cfg.report_to == "tensorboard":
                # A resumed run drops what the interrupted one logged after its checkpoint.
                purge = self.global_step + 1 if cfg.resume else None
                self.tensorboard = TensorBoardLog(self.out / TENSORBOARD_DIR, purge_step=purge)

    def _check_extras_and_device(self) -> None:
        if self.cfg.report_to == "tensorboard":
            from ..extras import require

            require("tensorboard")  # before any work: a clear error naming the package
        if self.cfg.fp16 and self.d.device.type != "cuda":
            raise FinetuneError(
                f"--fp16 needs a CUDA device (its gradient scaler is for GPUs), and this run is on {self.d.device}; "
                "on the CPU use --bf16, or drop --fp16"
            )

    def _build_model_and_data(self) -> None:
        cfg, d, splits = self.cfg, self.d, self.splits
        self.model, self.source_dir = build_model(cfg, splits.names, self.hf_module)
        self.model.to(d.device)
        tokenizer = load_tokenizer(self.source_dir)
        self.train_collate = self._collator(tokenizer, splits.train)
        self.val_collate = self._collator(tokenizer, splits.validation)
        self.test_collate = self._collator(tokenizer, splits.test) if splits.test is not None else None
        self.n_train = len(splits.train)
        self.sampler = _Sampler(splits.train, num_replicas=d.world_size, rank=d.rank, shuffle=True, seed=cfg.seed)

    def _build_optimisation(self) -> None:
        """Steps, AdamW, the schedule, the fp16 scaler, and the DDP wrapper."""
        cfg, d = self.cfg, self.d
        self.steps_per_epoch = math.ceil(self.n_train / cfg.batch_size)  # = ceil(ceil(n / W) / (micro * accum))
        self.total_steps = cfg.max_steps if cfg.max_steps is not None else cfg.epochs * self.steps_per_epoch
        warmup = cfg.warmup_steps if cfg.warmup_steps is not None else math.ceil(cfg.warmup_ratio * self.total_steps)
        self.warmup_steps = min(warmup, self.total_steps)
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = build_scheduler(self.optimizer, self.warmup_steps, self.total_steps, cfg.lr_scheduler_type)
        self.scaler = torch.amp.GradScaler("cuda") if cfg.fp16 else None
        self.ddp_model: nn.Module = self.model
        if d.enabled:
            device_ids = [d.device.index] if d.device.type == "cuda" else None
            self.ddp_model = nn.parallel.DistributedDataParallel(self.model, device_ids=device_ids)

    def _collator(self, tokenizer, dataset: TextDataset) -> Collator:
        return Collator(tokenizer, dataset, self.cfg.max_length, self.splits.names, self.cfg.problem_type)

    def _check_output_dir(self) -> None:
        cfg, out, last_path = self.cfg, self.out, self.last_path
        if out.exists() and not out.is_dir():
            raise FinetuneError(f"--output-dir {out} is a file, not a directory; choose another --output-dir")
        if cfg.resume and not last_path.is_file():
            raise FinetuneError(
                f"--resume: no {LAST_CHECKPOINT} in {out} (the run stopped before its first checkpoint, "
                "or never ran there); start it again without --resume (with --overwrite if the "
                "directory holds a metrics.json)"
            )
        if not cfg.resume and not cfg.overwrite and (last_path.is_file() or (out / METRICS_FILE).is_file()):
            raise FinetuneError(
                f"{out} already holds a fine-tuning run; pass --resume to continue it, --overwrite to "
                "start it again, or choose another --output-dir"
            )
        if cfg.compare_to is not None and not Path(cfg.compare_to).is_dir():
            raise FinetuneError(
                f"--compare-to {cfg.compare_to} is not a directory; pass the --output-dir of another run"
            )

    def _lock_output_dir(self, stack: contextlib.ExitStack) -> None:
        refusal = None
        if self.d.is_main:  # held to the end of the run; a killed run's lock goes with its process
            try:
                stack.enter_context(_own_output_dir(self.out))
            except FinetuneError as exc:
                refusal = str(exc)
        refusal = self.d.gather(refusal)[0]  # every process learns rank 0's answer: none waits in a collective
        if refusal is not None:
            raise FinetuneError(refusal)
        if self.cfg.overwrite and not self.cfg.resume and self.d.is_main:
            for name in (LAST_CHECKPOINT, METRICS_FILE):
                (self.out / name).unlink(missing_ok=True)

    def resolved_config(self) -> dict[str, Any]:
        """The settings as run: the options, and what they came to on this data and machine."""
        splits, model = self.splits, self.model
        return {
            **dataclasses.asdict(self.cfg),
            "metric_for_best": self.cfg.metric,
            "labels": splits.names,
            "sizes": {
                "train": self.n_train,
                "validation": len(splits.validation),
                "test": len(splits.test) if splits.test else 0,
            },
            "world_size": self.d.world_size,
            "micro_batch_size": self.micro,
            "steps_per_epoch": self.steps_per_epoch,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
            "device": str(self.d.device),
            "model": type(model).__module__ + "." + type(model).__name__,
            "tokenizer_dir": str(self.source_dir),
            "torch": torch.__version__,
        }

    def _write_run_files(self) -> None:
        cfg, resolved = self.cfg, self.resolved_config()
        self.out.mkdir(parents=True, exist_ok=True)
        write_json(resolved, self.out / RESOLVED_CONFIG)
        if cfg.dataset is not None and not cfg.resume:  # the bundled split as files, to inspect or reuse with --train
            for split in ("train", "validation", "test"):
                if getattr(self.splits, split) is not None:
                    write_texts(getattr(self.splits, split), self.out / "data" / f"{split}.csv")
        log.info(
            "%s: %d train / %d validation / %d test examples, labels %s; %d step(s) per epoch of %d examples "
            "(%d per micro-batch x %d accumulation x %d process(es)), %d steps, %s schedule with %d warmup, on %s",
            cfg.problem_type,
            self.n_train,
            resolved["sizes"]["validation"],
            resolved["sizes"]["test"],
            self.splits.names if len(self.splits.names) <= 20 else f"({len(self.splits.names)})",
            self.steps_per_epoch,
            cfg.batch_size,
            self.micro,
            cfg.grad_accum_steps,
            self.d.world_size,
            self.total_steps,
            cfg.lr_scheduler_type,
            self.warmup_steps,
            self.d.device,
        )

    # --- checkpoints ---------------------------------------------------------------------

    def progress(self) -> dict[str, int]:
        epoch, step_in_epoch = divmod(self.global_step, self.steps_per_epoch)
        return {"epoch": epoch, "step_in_epoch": step_in_epoch, "global_step": self.global_step}

    def save_checkpoint(self) -> None:
        """The resumable state, from finite weights only, written atomically by rank 0."""
        _check_finite_weights(self.model, f"step {self.global_step}")
        rngs = self.d.gather(rng_state())
        if self.d.is_main:
            state = {
                "format": STATE_FORMAT,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "rng": rngs,
                "progress": self.progress(),
                "history": self.history,
                "labels": self.splits.names,
                "config": dataclasses.asdict(self.cfg),
            }
            torch_save_atomic(state, self.last_path)
        self.d.barrier()

    def resume(self) -> None:
        """Continue from `last-checkpoint.pt`, refusing settings that changed."""
        d = self.d
        state = _load_last(self.last_path)
        _check_resumable(state, self.cfg, self.splits.names, self.last_path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.global_step = state["progress"]["global_step"]
        self.history = state["history"]
        rngs = state["rng"]
        if len(rngs) != d.world_size:
            log.warning(
                "resuming with %d process(es) after %d: data order and schedule continue exactly, dropout masks do not",
                d.world_size,
                len(rngs),
            )
        set_rng_state(rngs[d.rank % len(rngs)])
        if d.is_main:
            log.info("resumed from %s at step %d", self.last_path, self.global_step)

    # --- training ------------------------------------------------------------------------

    def done(self) -> bool:
        return self.global_step >= self.total_steps or self.history["early_stopping"]["stopped_early"]

    def train(self) -> dict[str, Any]:
        """Train to the end (or an interruption, or an early stop); returns the metrics."""
        with _StopRequest() as stop:
            while not self.done() and self.status != "stopped":
                self.train_epoch(stop)
        if self.status != "stopped":
            self.status = "completed"
        return self.finish()

    def train_epoch(self, stop: _StopRequest) -> None:
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
        n_real = min(cfg.batch_size, self.n_train - k * cfg.batch_size)
        batches, weights = [], []
        for j, indices in enumerate(group):
            # Positions in this process's list; global position = rank + local * world size.
            local = torch.arange(len(indices)) + (k * cfg.grad_accum_steps + j) * self.micro
            weights.append(((d.rank + local * d.world_size) < self.n_train).float().to(d.device))
            batches.append({key: v.to(d.device) for key, v in self.train_collate(indices).items()})
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
                problem_type=cfg.problem_type,
                world_size=d.world_size,
                max_grad_norm=cfg.max_grad_norm,
                bf16=cfg.bf16,
                scaler=self.scaler,
            )
        except DivergedError as exc:
            raise DivergedError(
                f"{where} diverged: {exc}. The step was not taken and nothing was saved from it; {_DIVERGED_ADVICE}"
            ) from None
        loss = float(d.sum(loss_sum)) / n_real
        if not math.isfinite(loss):  # the same on every process: it was summed over them
            raise DivergedError(
                f"the training loss at {where} is {loss}; nothing was saved from it; {_DIVERGED_ADVICE}"
            )
        self.global_step += 1
        self.history["train_time_s"] += time.perf_counter() - t0
        self.history["examples"] += n_real
        record = {"step": self.global_step, "epoch": epoch + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm}
        self.history["steps"].append(record)
        if self.tensorboard is not None:
            self.tensorboard.step(record)
        return record

    def evaluation_due(self) -> bool:
        every = self.cfg.eval_steps or self.steps_per_epoch
        return self.global_step % every == 0 or self.global_step >= self.total_steps

    def after_step(self, stop: _StopRequest) -> bool:
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
        cfg = self.cfg
        return evaluate(
            model,
            collate,
            self.splits.names,
            self.d,
            cfg.eval_batch_size,
            cfg.bf16,
            desc=split,
            problem_type=cfg.problem_type,
            fp16=cfg.fp16,
        )

    def evaluate(self) -> dict[str, Any]:
        """Evaluate on the validation data, record it, keep the best checkpoint, and count
        towards early stopping."""
        cfg, d, step = self.cfg, self.d, self.global_step
        result = self._metrics_on(self.model, self.val_collate, "validation")
        epoch, rest = divmod(step, self.steps_per_epoch)
        when = f"after epoch {epoch}" if rest == 0 else f"in epoch {epoch + 1}"
        if not math.isfinite(result["loss"]):  # the metrics would be those of NaN scores: meaningless
            raise DivergedError(
                f"the validation loss {when} (step {step}) is {result['loss']}: the weights are broken. "
                f"Nothing was saved from them; {_DIVERGED_ADVICE}"
            )
        history = self.history
        previous = history["evaluations"][-1]["step"] if history["evaluations"] else 0
        losses = [s["loss"] for s in history["steps"] if s["step"] > previous]
        record = {
            "epoch": epoch + (rest > 0),
            "step": step,
            "train_loss": sum(losses) / len(losses) if losses else None,  # since the previous evaluation
            # The confusion matrix is kept for the best evaluation only (below), not every one.
            "validation": {k: v for k, v in result.items() if k != "confusion"},
        }
        history["evaluations"].append(record)
        better = self._update_best(result, record)
        if d.is_main:
            headline = ", ".join(f"{m} {result[m]:.4f}" for m in HEADLINE[cfg.problem_type])
            log.info(
                "step %d: validation loss %.4f, %s%s",
                step,
                result["loss"],
                headline,
                " (best so far)" if better else "",
            )
            if self.tensorboard is not None:
                self.tensorboard.evaluation(record)
            write_json(self.metrics("running"), self.out / METRICS_FILE)
        return record

    def _update_best(self, result: dict[str, Any], record: dict[str, Any]) -> bool:
        metric, best, stopping = self.cfg.metric, self.history["best"], self.history["early_stopping"]
        value = result[metric]
        better = best is None or (value < best["value"] if metric == "loss" else value > best["value"])
        if not better:
            stopping["evaluations_without_improvement"] += 1
            patience = self.cfg.early_stopping_patience
            if patience is not None and stopping["evaluations_without_improvement"] >= patience:
                stopping.update(stopped_early=True, stopped_at_step=record["step"])
                if self.d.is_main:
                    log.info("early stopping: %d evaluation(s) without a better %s", patience, metric)
            return False
        stopping["evaluations_without_improvement"] = 0
        self.history["best"] = {"epoch": record["epoch"], "step": record["step"], "metric": metric, "value": value}
        if "confusion" in result:
            self.history["best"]["confusion"] = result["confusion"]
        _check_finite_weights(self.model, f"step {record['step']}")
        if self.d.is_main:
            save_model(self.model, self.out, self.source_dir)
        self.d.barrier()
        return True

    # --- the end -------------------------------------------------------------------------

    def metrics(self, status: str) -> dict[str, Any]:
        """The document written to metrics.json."""
        model, history = self.model, self.history
        train_time = history["train_time_s"]
        return {
            "name": f"{type(model).__module__.split('.')[0]} {type(model).__name__} on {self.cfg.dataset or self.cfg.train}",
            "output_dir": str(self.out),
            "status": status,
            "problem_type": self.cfg.problem_type,
            "labels": self.splits.names,
            "config": self.resolved_config(),
            "global_step": self.global_step,
            "epochs_completed": round(self.global_step / self.steps_per_epoch, 4),
            "train_time_s": round(train_time, 2),
            "train_examples_per_s": round(history["examples"] / train_time, 2) if train_time else None,
            "best": history["best"],
            "early_stopping": history["early_stopping"],
            "evaluations": history["evaluations"],
            "steps": history["steps"],
        }

    def finish(self) -> dict[str, Any]:
        """metrics.json and the plot; when complete, the best checkpoint on the test data and
        the comparison with another run."""
        cfg, d = self.cfg, self.d
        metrics = self.metrics(self.status)
        if self.status == "completed":
            if self.test_collate is not None:
                best = load_trained(self.out, self.hf_module, cfg.attn_implementation).to(d.device)
                metrics["test"] = self._metrics_on(best, self.test_collate, "test")
            if cfg.compare_to and d.is_main:
                self._compare(metrics)
        metrics["wall_time_s"] = round(time.perf_counter() - self.t_start, 2)  # this invocation, data to test
        if d.is_main:
            write_json(metrics, self.out / METRICS_FILE)
            if metrics["steps"]:
                plot_curves(metrics, self.out / CURVES_FILE)
        d.barrier()
        return metrics

    def _compare(self, metrics: dict[str, Any]) -> None:
        other_path = Path(self.cfg.compare_to) / METRICS_FILE
        try:
            other = json.loads(other_path.read_text(encoding="utf-8"))
            metrics["comparison"] = compare_runs(metrics, other)
            plot_curves(metrics, self.out / "comparison_curves.png", other)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # never lose a finished run over it
            log.warning(
                "compare_to: cannot compare with %s (%s: %s); the run itself is complete",
                other_path,
                type(exc).__name__,
                exc,
            )

    def cleanup(self) -> None:
        """Close the TensorBoard log and leave the process group this run started."""
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.d.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def finetune(cfg: FinetuneConfig, hf_module=None) -> dict[str, Any]:
    """Run the fine-tuning job `cfg` (under torchrun, as one of its processes). Returns the
    metrics written to `metrics.json`; `status` is "completed" (early stopping included) or
    "stopped" (interrupted or `stop_after_steps`; continue with `resume=True`)."""
    cfg.validate()
    if cfg.reference == "hf" and hf_module is None:
        raise FinetuneError("reference='hf' needs the transformers module: run it through `bert-port-finetune`")
    recipe = FinetuneRecipe(cfg, setup_distributed(cfg.device), hf_module if cfg.reference == "hf" else None)
    try:
        with contextlib.ExitStack() as stack:
            recipe.setup(stack)
            return recipe.train()
    finally:
        recipe.cleanup()


def _check_resumable(state: dict[str, Any], cfg: FinetuneConfig, names: list[str], path: Path) -> None:
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise FinetuneError(
            f"{path} is not a checkpoint this version can resume from (written by another version); start a new run"
        )
    if state["labels"] != names:
        raise FinetuneError(
            f"{path} was trained with labels {state['labels']}, the data now gives {names}; resume "
            "with the same data or start a new --output-dir"
        )
    differ = resume_mismatches(state["config"], cfg)
    if differ:
        raise FinetuneError(
            f"cannot resume from {path}: these settings differ from the run that wrote it:\n  - "
            + "\n  - ".join(differ)
            + "\nResume with the same settings, or start a new --output-dir"
        )
