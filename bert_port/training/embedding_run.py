"""The recipe behind `bert-port-train-embedding`: fine-tune a sentence-embedding model on the
user's rows (or the bundled movie-dialog pairs), in the fine-tuning recipe's shape (`setup`,
`train`, `after_step`, `save_checkpoint`, `resume`, `finish`) and on its pieces:

- the output folder (`run_folder.lock_output_dir`): refused in one line before any work when
  it is a file, not writable or held by another run; temporaries of killed saves removed;
- AdamW from `steps.build_optimizer` (no weight decay on biases and LayerNorm) and the
  schedules of `steps.build_scheduler`;
- the resumable state (`resume.training_state`, `save_state`, `check_resumable`, `restore`)
  in `checkpoints/last-checkpoint.pt`, written every `save_steps`, at `stop_after_steps` and
  on Ctrl-C (`steps.StopRequest`): a killed run resumed with `resume` ends with the same
  weights, bit for bit, as one that never stopped;
- a NaN or infinite loss stops the run before its step (`steps.DivergedError`), and no
  checkpoint is written from non-finite weights (`steps.check_finite_weights`);
- torchrun (`steps.setup_distributed`, gloo on the CPU): each process takes its slice of every
  global batch, gradients averaged; rank 0 alone evaluates and writes.

Evaluation (`embedding_data.evaluate_rows`, as sentence-transformers' evaluators) runs on the
validation rows (`validation`, or `test_pairs` rows held out of the training data) before
training, every `eval_steps` and after; on the `test` rows once at the end. The model is saved
as a sentence-transformers folder with `metrics.json` and a model card.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import checkpoint as ckpt
from ..config import ConfigError
from . import embedding_losses as el
from .embedding import batches, embedding_step, split_over
from .embedding_data import (
    RETRIEVAL_HEADLINE,
    SIMILARITY_HEADLINE,
    dialog_rows,
    evaluate_rows,
    load_rows,
    split_pairs,
)
from .embedding_settings import BUNDLED_MODEL, EmbeddingRunConfig
from .model_card import embedding_card, write_model_card
from .reporting import write_json
from .resume import (
    TrainingParts,
    check_resumable,
    data_identity,
    load_state,
    restore,
    rng_state,
    save_state,
    state_path,
    training_state,
)
from .run_folder import METRICS_FILE, lock_output_dir
from .settings import FinetuneError
from .steps import (
    Dist,
    DivergedError,
    StopRequest,
    build_optimizer,
    build_scheduler,
    check_finite_weights,
    resolve_warmup,
    setup_distributed,
)

log = logging.getLogger(__name__)

__all__ = ["EmbeddingRecipe", "EmbeddingRunConfig", "run"]

LOSSES = {
    "mnrl": el.MultipleNegativesRankingLoss,
    "cached-mnrl": el.CachedMultipleNegativesRankingLoss,
    "cosent": el.CoSENTLoss,
    "cosine": el.CosineSimilarityLoss,
    "triplet": el.TripletLoss,
}
DIVERGED_ADVICE = (
    "lower --lr or drop --bf16, check the scores in the data, and start again with --overwrite or in "
    "another --output-dir"
)


def model_path(name: str) -> str:
    """The folder or model id of `checkpoint` (`bundled:all-MiniLM-L6-v2` is the bundled one)."""
    if name == BUNDLED_MODEL:
        from ..assets import minilm_dir

        return str(minilm_dir())
    return name


def check_output_dir(cfg: EmbeddingRunConfig, out: Path) -> None:
    """Refuse, before any work, an output folder this run cannot use: a file, a `resume`
    without a state, or a folder holding a run that neither `resume` nor `overwrite` names."""
    if out.exists() and not out.is_dir():
        raise FinetuneError(f"--output-dir {out} is a file, not a directory; choose another --output-dir")
    has_state = state_path(out).is_file()
    if cfg.resume and not has_state:
        raise FinetuneError(
            f"--resume: no {state_path(out)} (the run stopped before its first checkpoint, or never ran there); "
            "start it again without --resume (with --overwrite if the folder holds a metrics.json)"
        )
    if not cfg.resume and not cfg.overwrite and (has_state or (out / METRICS_FILE).is_file()):
        raise FinetuneError(
            f"{out} already holds a {cfg.command} run; pass --resume to continue it, --overwrite to start it "
            "again, or choose another --output-dir"
        )


class EmbeddingRecipe:
    """One embedding-training run, as one process of a torchrun job (rank 0 of 1 without it):
    `setup`, then `train` (each step followed by `after_step`), then `cleanup`. `run(cfg)` does all three."""

    def __init__(self, cfg: EmbeddingRunConfig, d: Dist):
        self.cfg, self.d = cfg, d
        self.out = Path(cfg.output_dir)
        self.global_step, self.status = 0, "running"
        self.history: dict[str, Any] = {"step_losses": [], "evaluations": [], "train_seconds": 0.0}

    @property
    def scored(self) -> bool:
        return self.cfg.score_column is not None

    @property
    def headline(self) -> tuple[str, ...]:
        return SIMILARITY_HEADLINE if self.scored else RETRIEVAL_HEADLINE

    # --- setup ---------------------------------------------------------------------------

    def setup(self, stack: contextlib.ExitStack) -> None:
        """Each refusal before the work it would waste: the output folder, the data, then the
        folder taken (lock, leftovers tidied), the model, the optimiser and a resumed state."""
        cfg = self.cfg
        check_output_dir(cfg, self.out)
        try:
            split_over(cfg.batch_size, self.d.world_size)
        except ValueError as exc:
            raise FinetuneError(str(exc)) from None
        self._read_data()
        lock_output_dir(cfg, self.out, self.d, stack)
        self.data = data_identity(cfg)
        self._build_model()
        self.optimizer = build_optimizer(self.encoder, cfg)
        warmup = resolve_warmup(cfg.warmup_steps, cfg.warmup_ratio, cfg.max_steps)
        self.scheduler = build_scheduler(self.optimizer, warmup, cfg.max_steps, cfg.lr_scheduler_type)
        if cfg.resume:
            self.resume()

    def _read_data(self) -> None:
        """The training, validation and test rows, every file read in full and checked."""
        cfg = self.cfg
        rows = dialog_rows() if cfg.dataset else self._rows(cfg.train)
        self.validation = self._rows(cfg.validation) if cfg.validation else None
        if self.validation is None and cfg.test_pairs:
            rows, self.validation = split_pairs(rows, cfg.test_pairs, cfg.seed, None)
        self.train_rows = rows[: cfg.max_train_pairs] if cfg.max_train_pairs else rows
        self.test = self._rows(cfg.test) if cfg.test else None
        if len(self.train_rows) < cfg.batch_size:
            raise FinetuneError(
                f"{len(self.train_rows)} training rows are fewer than one batch of {cfg.batch_size}; "
                "lower --batch-size or give more rows"
            )

    def _rows(self, path: str) -> list[tuple]:
        return load_rows(path, self.cfg.columns, self.cfg.score_column)

    def _build_model(self) -> None:
        """The encoder to train, from `checkpoint`, and its loss."""
        from ..sentence import SentenceEncoder

        cfg = self.cfg
        try:
            self.encoder = SentenceEncoder.from_pretrained(
                model_path(cfg.checkpoint), max_seq_length=cfg.max_seq_length
            )
        except (ckpt.CheckpointError, ConfigError):
            raise
        except ValueError as exc:  # an argument the model refuses (max_seq_length beyond its positions)
            raise FinetuneError(f"cannot train {cfg.checkpoint}: {exc}") from None
        options: dict[str, Any] = {}
        if cfg.loss in ("mnrl", "cached-mnrl"):
            options = {"scale": cfg.scale, "symmetric": cfg.symmetric}
        if cfg.loss == "cached-mnrl":
            options["mini_batch_size"] = cfg.mini_batch_size
        if cfg.loss == "cosent":
            options["scale"] = cfg.scale
        self.loss = LOSSES[cfg.loss](self.encoder, **options)

    # --- checkpoints ---------------------------------------------------------------------

    def parts(self) -> TrainingParts:
        return TrainingParts(self.encoder, self.optimizer, self.scheduler)

    def save_checkpoint(self) -> None:
        """The resumable state, from finite weights only, written atomically by rank 0."""
        check_finite_weights(self.encoder, f"step {self.global_step}")
        rngs = self.d.gather(rng_state())
        if self.d.is_main:
            path = state_path(self.out)
            path.parent.mkdir(exist_ok=True)
            run = dict(progress={"global_step": self.global_step}, history=self.history, labels=[], data=self.data)
            save_state(training_state(self.parts(), rngs, config=dataclasses.asdict(self.cfg), **run), path)
        self.d.barrier()

    def resume(self) -> None:
        """Continue from the last checkpoint, refusing settings or data files that changed."""
        path = state_path(self.out)
        state = load_state(path)
        check_resumable(state, self.cfg, [], path)
        self.global_step, self.history = restore(self.parts(), state, self.d.rank, self.d.world_size)
        if self.d.is_main:
            log.info("resumed from %s at step %d", path, self.global_step)

    # --- training ------------------------------------------------------------------------

    def evaluate(self, rows: list[tuple]) -> dict[str, float]:
        return evaluate_rows(self.encoder, rows, self.scored)

    def train(self) -> dict[str, Any]:
        """Evaluate before (a new run), train to `max_steps` or a stop, finish; the metrics."""
        cfg, d = self.cfg, self.d
        if self.global_step == 0:
            torch.manual_seed(cfg.seed)
            if self.validation is not None and d.is_main:
                self.history["before"] = self.evaluate(self.validation)
        if "before" in self.history and d.is_main:
            log.info("before: %s", self._headline(self.history["before"]))
        local = split_over(cfg.batch_size, d.world_size)
        self.encoder.train()
        with StopRequest() as stop:
            for step, rows in enumerate(batches(self.train_rows, cfg.batch_size, cfg.seed, cfg.max_steps)):
                if step < self.global_step:  # a resumed run: the batches it took
                    continue
                self.train_step(rows[d.rank * local : (d.rank + 1) * local])
                if self.after_step(stop):
                    break
        self.encoder.eval()
        if self.status != "stopped":
            self.status = "completed"
        return self.finish()

    def train_step(self, rows: list[tuple]) -> None:
        t0 = time.perf_counter()
        cfg, where = self.cfg, f"step {self.global_step + 1}"
        try:
            value = embedding_step(self.encoder, self.loss, rows, self.scored, self.optimizer, self.scheduler,
                                   self.d, cfg.bf16)  # fmt: skip
        except DivergedError as exc:
            raise DivergedError(f"{where} diverged: {exc} and nothing was saved from it; {DIVERGED_ADVICE}") from None
        self.global_step += 1
        self.history["step_losses"].append(value)
        self.history["train_seconds"] += time.perf_counter() - t0
        log.info("step %d: loss %.4f", self.global_step, value)

    def after_step(self, stop: StopRequest) -> bool:
        """Evaluate when due, then checkpoint: on a stop request (ending the run there), at
        `stop_after_steps`, every `save_steps`. True: leave the loop."""
        cfg, d, step = self.cfg, self.d, self.global_step
        due = cfg.eval_steps and step % cfg.eval_steps == 0 and step < cfg.max_steps
        if due and self.validation is not None and d.is_main:
            self.history["evaluations"].append({"step": step, **self.evaluate(self.validation)})
        finished = step >= cfg.max_steps
        stop_now = stop.requested or (cfg.stop_after_steps is not None and step >= cfg.stop_after_steps)
        if d.enabled:  # every process stops at the same step
            stop_now = bool(d.sum(torch.tensor(float(stop_now))) > 0)
        if stop_now and not finished:
            self.save_checkpoint()
            self.status = "stopped"
            return True
        if finished or (cfg.save_steps and step % cfg.save_steps == 0):
            self.save_checkpoint()
        return finished

    # --- the end -------------------------------------------------------------------------

    def _headline(self, metrics: dict[str, float]) -> dict[str, float]:
        return {k: round(metrics[k], 4) for k in self.headline}

    def finish(self) -> dict[str, Any]:
        """Rank 0: the evaluations after training, the model, `metrics.json` and the model card."""
        if not self.d.is_main:
            return {"status": self.status, "rank": self.d.rank}
        if self.status == "completed":
            check_finite_weights(self.encoder, "the end of training")
            if self.validation is not None:
                self.history["after"] = self.evaluate(self.validation)
                log.info("after: %s", self._headline(self.history["after"]))
            if self.test is not None:
                self.history["test"] = self.evaluate(self.test)
            self.encoder.save_pretrained(self.out)
        metrics = self.metrics()
        write_json(metrics, self.out / METRICS_FILE)
        if self.status == "completed":
            write_model_card(embedding_card(self.card_document(metrics)), self.out)
        return metrics

    def metrics(self) -> dict[str, Any]:
        """The document written to metrics.json."""
        history = {k: v for k, v in self.history.items() if k != "train_seconds"}
        return {
            "status": self.status,
            "output_dir": str(self.out),
            "config": dataclasses.asdict(self.cfg),
            "headline": list(self.headline),
            "train_pairs": len(self.train_rows),
            "test_pairs": len(self.validation or ()),
            "test_rows": len(self.test or ()),
            "world_size": self.d.world_size,
            **history,
            "train_seconds": round(self.history["train_seconds"], 1),
        }

    def card_document(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """What `model_card.embedding_card` reads, for a run on files as for the bundled pairs."""
        cfg = dict(metrics["config"])
        cfg["dataset"] = cfg["dataset"] or Path(cfg["train"]).name
        return {**metrics, "config": cfg, "before": metrics.get("before", {}), "after": metrics.get("after", {})}

    def cleanup(self) -> None:
        if self.d.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def run(cfg: EmbeddingRunConfig) -> dict[str, Any]:
    """Check `cfg`, then set up and train an `EmbeddingRecipe` as this process of the job; the
    metrics (`status` "stopped" at `stop_after_steps` or Ctrl-C, with no model saved yet)."""
    cfg.validate()
    recipe = EmbeddingRecipe(cfg, setup_distributed("cpu"))
    try:
        with contextlib.ExitStack() as stack:
            recipe.setup(stack)
            return recipe.train()
    finally:
        recipe.cleanup()
