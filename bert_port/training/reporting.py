"""What a run writes besides the model: the resolved settings, metrics.json, the PNG of the
curves (matplotlib, the `plot` extra; skipped with a note when it is missing), TensorBoard
scalars (`--report-to tensorboard`, the `tensorboard` extra), and the comparison of two runs.
Every file is written through `checkpoint.atomic_write` (a temporary name, renamed into place)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .. import checkpoint as ckpt
from ..extras import MissingExtra, install_hint, require
from ..problem import ProblemType
from ..tagged import write_split
from .resume import state_file
from .run_folder import DATA_DIR, METRICS_FILE, RESOLVED_CONFIG
from .settings import FinetuneError

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"


@contextlib.contextmanager
def full_disk_said(out: Path, step: Callable[[], int]) -> Iterator[None]:
    """A full disk (ENOSPC, EDQUOT) inside the block as a `FinetuneError` of one line that names
    only what exists to go on from: the checkpoint a `--resume` reads when there is one, else that
    there is none yet (a run stopped before its first checkpoint starts again). `step()` is the
    step the run had reached. Every write is staged, so nothing is half-written."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f"no space left on the device of {out} ({exc.strerror}{f': {exc.filename}' if exc.filename else ''})"
        state = state_file(out)
        if state is not None:
            then = f"{state} holds the last checkpoint. Free some space, then continue with --resume"
        else:
            again = " with --overwrite" if (out / METRICS_FILE).is_file() else ""
            then = f"no checkpoint was written yet, so there is nothing to resume. Free some space, then run it again{again}"
        raise FinetuneError(f"{where} at step {step()}; nothing was half-written, and {then}") from None


def write_json(obj: Any, path: Path) -> None:
    with ckpt.atomic_write(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")


class TensorBoardLog:
    """Scalars for TensorBoard under `directory`: train/loss, train/learning_rate,
    train/grad_norm per step, eval/<metric> per evaluation. A resumed run passes
    `purge_step`, so that steps logged after the checkpoint by the interrupted run are
    dropped instead of drawn twice."""

    def __init__(self, directory: Path, purge_step: int | None = None):
        require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory), purge_step=purge_step)

    def step(self, record: dict[str, Any]) -> None:
        step = record["step"]
        self.writer.add_scalar("train/loss", record["loss"], step)
        self.writer.add_scalar("train/learning_rate", record["lr"], step)
        if record.get("grad_norm") is not None:
            self.writer.add_scalar("train/grad_norm", record["grad_norm"], step)

    def evaluation(self, record: dict[str, Any]) -> None:
        for name, value in record["validation"].items():
            if isinstance(value, (int, float)) and name != "n":
                self.writer.add_scalar(f"eval/{name}", value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def plot_curves(metrics: dict[str, Any], path: Path, other: dict[str, Any] | None = None) -> Path | None:
    """Training loss per step (and its running mean), validation loss at each evaluation,
    and the validation metrics of the problem type; `other` (another run's metrics) is
    overlaid. Without matplotlib the plot is skipped, with a note saying how to get it."""
    try:
        matplotlib = require("matplotlib", "the plot of the training curves")
    except MissingExtra:
        log.warning(
            "matplotlib is not installed: %s not drawn (install it with: %s)", path.name, install_hint("matplotlib")
        )
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problem = ProblemType(metrics.get("config", {}).get("problem_type") or ProblemType.SINGLE_LABEL)
    # A language model's run names its own (perplexity; the token cross-entropy).
    headline = tuple(metrics.get("headline") or problem.headline)
    loss_name = metrics.get("loss_name") or problem.loss_name
    fig, (ax_loss, ax_metric) = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    # The other run is drawn dashed on top, so identical curves show as one line with dashes.
    runs = [(metrics, "", "C0", "-")] + ([(other, f" ({other.get('name', 'other')})", "C3", "--")] if other else [])
    for run, suffix, color, style in runs:
        _plot_run(ax_loss, ax_metric, run, headline, suffix, color, style)
    ax_lr = ax_loss.twinx()  # the schedule, for reading the loss against it
    ax_lr.plot(
        [s["step"] for s in metrics["steps"]],
        [s["lr"] for s in metrics["steps"]],
        color="0.6",
        lw=0.8,
        ls=":",
        label="learning rate (right axis)",
    )
    ax_lr.set_ylabel("learning rate", color="0.4")
    ax_lr.set_ylim(bottom=0)
    ax_loss.set(xlabel="optimiser step", ylabel=loss_name, title="loss")
    ax_metric.set(xlabel="optimiser step", ylabel="validation", title="validation metrics")
    _scale_metric_axis(ax_metric, [e["validation"][m] for e in metrics["evaluations"] for m in headline])
    best = metrics.get("best")
    if best and best.get("metric") in headline:
        ax_metric.plot([best["step"]], [best["value"]], "*", ms=12, color="C2", label=f"best {best['metric']}")
    stop = (metrics.get("early_stopping") or {}).get("stopped_at_step")
    if stop:
        ax_metric.axvline(stop, color="0.5", ls="--", lw=0.8, label="early stop")
    ax_loss.grid(alpha=0.3)
    ax_metric.grid(alpha=0.3)
    handles = [h for ax in (ax_loss, ax_lr) for h in ax.get_legend_handles_labels()[0]]
    # On the twin axes, the top layer, so that the lr line does not run over the legend.
    ax_lr.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="upper right")
    if ax_metric.get_legend_handles_labels()[0]:
        ax_metric.legend(fontsize=7, loc="lower right")
    title = metrics.get("name", "")
    if other:
        c = compare_runs(metrics, other)
        title += f"  vs  {other.get('name', 'other')}: per-step train loss |diff| max {c['max_abs_loss_diff']:.2e}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with ckpt.atomic_write(path) as tmp:
        fig.savefig(tmp, dpi=80, format="png")
    plt.close(fig)
    return path


def _scale_metric_axis(ax, values: list[float]) -> None:
    if max(values, default=0.0) <= 1.0:  # scores in [0, 1] (or below, for correlations)
        ax.set_ylim(min([0.0, *values]) - 0.05, 1.05)
    else:  # perplexity: from the vocabulary's size down
        ax.set_yscale("log")


def _plot_run(ax_loss, ax_metric, run: dict[str, Any], headline: tuple[str, ...], suffix: str, color: str, style: str):
    steps = [s["step"] for s in run["steps"]]
    losses = [s["loss"] for s in run["steps"]]
    ax_loss.plot(steps, losses, color=color, alpha=0.3, lw=0.8, ls=style)
    ax_loss.plot(
        steps, _running_mean(losses, 20), color=color, lw=1.5, ls=style, label=f"train loss{suffix} (mean of 20)"
    )
    evals = run["evaluations"]
    if not evals:
        return
    at = [e["step"] for e in evals]
    ax_loss.plot(
        at, [e["validation"]["loss"] for e in evals], "o", ls=style, color=color, label=f"validation loss{suffix}"
    )
    for name, marker in zip(headline, ("o", "s")):
        values = [e["validation"][name] for e in evals]
        ax_metric.plot(
            at, values, marker, ls=style, color=color, mfc=None if marker == "o" else "none", label=f"{name}{suffix}"
        )


def _running_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def compare_runs(metrics: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Per-step training-loss difference between two runs over their common steps, and
    their test results side by side."""
    a = {s["step"]: s["loss"] for s in metrics["steps"]}
    b = {s["step"]: s["loss"] for s in other["steps"]}
    common = sorted(set(a) & set(b))
    diffs = [abs(a[s] - b[s]) for s in common]
    return {
        "other": other.get("output_dir"),
        "steps_compared": len(common),
        "max_abs_loss_diff": max(diffs, default=float("nan")),
        "mean_abs_loss_diff": sum(diffs) / len(diffs) if diffs else float("nan"),
        "max_abs_loss_diff_first_20": max(diffs[:20], default=float("nan")),
        "first_step_above_1e-4": min((s for s, x in zip(common, diffs) if x > 1e-4), default=None),
        "test": {"this": metrics.get("test"), "other": other.get("test")},
    }


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What a run's settings came to on its data and machine: handed by the recipe to the
    reports, so that they read values, not the recipe."""

    world_size: int
    micro_batch_size: int
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    device: str
    model: str  # the trained class, module.Name
    tokenizer_dir: str

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "torch": torch.__version__}


def resolved_config(cfg: Any, shape: RunShape, **task: Any) -> dict[str, Any]:
    """The settings as run: the options (`cfg`, a dataclass), what the task adds (its labels
    and split sizes), and what they came to (`shape`)."""
    return {**dataclasses.asdict(cfg), **task, **shape.as_dict()}


def write_run_files(out: Path, cfg: Any, resolved: dict[str, Any], splits: Any) -> None:
    """The resolved settings, and a bundled dataset's split as CSV (or CoNLL) files, into the run's folder."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(resolved, out / RESOLVED_CONFIG)
    if cfg.dataset is not None and not cfg.resume:  # the bundled split as files, to inspect or reuse with --train
        for split in ("train", "validation", "test"):
            if getattr(splits, split) is not None:
                write_split(getattr(splits, split), out / DATA_DIR, split)
    labels, sizes = resolved["labels"], resolved["sizes"]
    log.info(
        "%s: %d train / %d validation / %d test examples, labels %s; %d step(s) per epoch of %d examples "
        "(%d per micro-batch x %d accumulation x %d process(es)), %d steps, %s schedule with %d warmup, on %s",
        cfg.problem_type,
        sizes["train"],
        sizes["validation"],
        sizes["test"],
        labels if len(labels) <= 20 else f"({len(labels)})",
        resolved["steps_per_epoch"],
        cfg.batch_size,
        resolved["micro_batch_size"],
        cfg.grad_accum_steps,
        resolved["world_size"],
        resolved["total_steps"],
        cfg.lr_scheduler_type,
        resolved["warmup_steps"],
        resolved["device"],
    )


def metrics_document(header: dict[str, Any], resolved: dict[str, Any], history: dict[str, Any], global_step: int):
    """The document written to metrics.json: `header` (name, output_dir, status and the task's
    summary), the resolved settings, and the history of the run up to `global_step`."""
    train_time = history["train_time_s"]
    return {
        **header,
        "config": resolved,
        "global_step": global_step,
        "epochs_completed": round(global_step / resolved["steps_per_epoch"], 4),
        "train_time_s": round(train_time, 2),
        "train_examples_per_s": round(history["examples"] / train_time, 2) if train_time else None,
        "best": history["best"],
        "early_stopping": history["early_stopping"],
        "evaluations": history["evaluations"],
        "steps": history["steps"],
    }


def compare_with(metrics: dict[str, Any], other_path: Path, out: Path) -> None:
    """Add the comparison with the run whose metrics.json is `other_path` to `metrics`, and
    plot both into `out`; a run that cannot be read is a warning, never a lost run."""
    try:
        other = json.loads(ckpt.bounded.read_text(other_path, ckpt.bounded.JSON, folder=False))
        metrics["comparison"] = compare_runs(metrics, other)
        plot_curves(metrics, out / "comparison_curves.png", other)
    except (OSError, ValueError, KeyError, TypeError, ckpt.CheckpointError) as exc:  # never lose a finished run
        log.warning(
            "compare_to: cannot compare with %s (%s: %s); the run itself is complete",
            other_path,
            type(exc).__name__,
            exc,
        )
