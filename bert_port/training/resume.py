"""The resumable training state, `last-checkpoint.pt`: what it holds, every process's RNG
state, the identity of the data files, and the checks a `--resume` makes before it trusts it.

The state holds the model, optimiser, scheduler, gradient scaler, every process's RNG state
(Python's and torch's, CPU and this process's GPU), the optimiser step reached, the history
(evaluations, best, early-stopping count), the label map, the settings, and the size and
SHA-256 of each data file that decides the run (`--train`, `--validation`). A resumed run
must find the same settings (`settings.resume_mismatches`), the same labels and the same
bytes in those files; anything else is refused with what to do, since the run would
otherwise continue silently on other data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import checkpoint as ckpt
from .settings import FinetuneError, TrainingSettings, resume_mismatches

if TYPE_CHECKING:
    from .recipe import FinetuneRecipe

log = logging.getLogger(__name__)

LAST_CHECKPOINT = "last-checkpoint.pt"
STATE_FORMAT = 2  # of last-checkpoint.pt; 2: schedules as transformers', progress by optimiser step
STATE_LIMIT = 1 << 40  # bytes: a state is about 3x its model; a larger file is not one
DATA_SETTINGS = ("train", "validation")  # the files whose bytes decide the run (not --test)


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,  # this process's device
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def data_identity(cfg: TrainingSettings) -> dict[str, dict[str, Any]]:
    """{setting: {"path", "size", "sha256"}} for each data file in `DATA_SETTINGS` that the
    run reads (a bundled dataset has none: it is fixed by the package)."""
    identity = {}
    for name in DATA_SETTINGS:
        path = getattr(cfg, name)
        if path is None:
            continue
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        identity[name] = {"path": str(path), "size": os.path.getsize(path), "sha256": digest.hexdigest()}
    return identity


def new_history(patience: int | None) -> dict[str, Any]:
    """The history of a run that has not taken a step: what `training_state` carries on."""
    return {
        "steps": [],  # one record per optimiser step
        "evaluations": [],
        "best": None,
        "early_stopping": {
            "patience": patience,
            "evaluations_without_improvement": 0,
            "stopped_early": False,
            "stopped_at_step": None,
        },
        "train_time_s": 0.0,
        "examples": 0,
    }


def training_state(recipe: FinetuneRecipe, rngs: list[dict[str, Any]]) -> dict[str, Any]:
    """The state of `recipe` to resume from; `rngs` holds every process's `rng_state()`."""
    return {
        "format": STATE_FORMAT,
        "model": recipe.model.state_dict(),
        "optimizer": recipe.optimizer.state_dict(),
        "scheduler": recipe.scheduler.state_dict(),
        "scaler": recipe.scaler.state_dict() if recipe.scaler is not None else None,
        "rng": rngs,
        "progress": recipe.progress(),
        "history": recipe.history,
        "labels": recipe.splits.names,
        "config": dataclasses.asdict(recipe.cfg),
        "data": recipe.data,
    }


def restore(recipe: FinetuneRecipe, state: dict[str, Any]) -> None:
    """Put `state` (checked by `check_resumable`) back into `recipe`: weights, optimiser,
    schedule, scaler, progress, history, and this process's RNG state."""
    recipe.model.load_state_dict(state["model"])
    recipe.optimizer.load_state_dict(state["optimizer"])
    recipe.scheduler.load_state_dict(state["scheduler"])
    if recipe.scaler is not None and state.get("scaler"):
        recipe.scaler.load_state_dict(state["scaler"])
    recipe.global_step = state["progress"]["global_step"]
    recipe.history = state["history"]
    rngs, d = state["rng"], recipe.d
    if len(rngs) != d.world_size:
        log.warning(
            "resuming with %d process(es) after %d: data order and schedule continue exactly, dropout masks do not",
            d.world_size,
            len(rngs),
        )
    set_rng_state(rngs[d.rank % len(rngs)])


def save_state(state: dict[str, Any], path: Path) -> None:
    """Write `state` with `torch.save` under a temporary name and rename it into place
    (`checkpoint.atomic_write`). Through an open file, so that a full disk is the `OSError`
    (ENOSPC) it is, not torch's "unexpected pos" RuntimeError: torch's zip writer raises that
    while unwinding from the file's `OSError`, which is raised again here."""
    with ckpt.atomic_write(path) as tmp, open(tmp, "wb") as f:
        try:
            torch.save(state, f)
        except RuntimeError as exc:
            if isinstance(exc.__context__, OSError):
                raise exc.__context__ from None
            raise


def load_state(path: Path) -> dict[str, Any]:
    """The state in `path`, on the CPU; a damaged file is a `FinetuneError` that says what to do.
    It must be a regular file in the run folder (`storage.bounded`): a FIFO or a link to a
    device would block or never end."""
    try:
        fd = ckpt.bounded.open_regular(path, STATE_LIMIT, Path(path).parent)
    except ckpt.CheckpointError as exc:
        raise FinetuneError(f"{exc}; or start the run again with --overwrite, or in another --output-dir") from None
    try:
        with os.fdopen(fd, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 (torch raises many types for a damaged file)
        raise FinetuneError(
            f"cannot read {path} ({type(exc).__name__}: {str(exc)[:200]}); it is damaged. Start "
            "the run again with --overwrite, or in another --output-dir"
        ) from None


def check_resumable(state: Any, cfg: TrainingSettings, names: list[str], path: Path) -> None:
    """Refuse a state this version cannot continue, or one whose labels, settings or data
    files differ from this run's."""
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
    _check_data(state.get("data"), cfg, path)


def _check_data(saved: dict[str, Any] | None, cfg: TrainingSettings, path: Path) -> None:
    if saved is None:  # written before the data was recorded: nothing to compare with
        log.warning("%s does not record its data files; resuming without checking that they are unchanged", path)
        return
    now = data_identity(cfg)
    changed = [
        f"--{name} {now[name]['path']}: {saved[name]['size']} bytes (sha256 {saved[name]['sha256'][:12]}...) "
        f"when the run started, now {now[name]['size']} bytes (sha256 {now[name]['sha256'][:12]}...)"
        for name in saved
        if name in now and (saved[name]["size"], saved[name]["sha256"]) != (now[name]["size"], now[name]["sha256"])
    ]
    if changed:
        raise FinetuneError(
            f"cannot resume from {path}: the data changed since the run started:\n  - "
            + "\n  - ".join(changed)
            + "\nResume with the data it was trained on, or start again with --overwrite or in another --output-dir"
        )
