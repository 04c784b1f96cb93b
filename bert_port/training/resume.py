"""The resumable training state, `checkpoints/last-checkpoint.pt`: what it holds, every
process's RNG state, the identity of the data files, and the checks a `--resume` makes before
it trusts it. It lives in the run folder's `checkpoints/`, apart from the finished model; a
run of an older version, with the file beside the model, resumes from there (`state_file`).

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
from typing import Any

import torch
from torch import nn

from .. import checkpoint as ckpt
from .settings import FinetuneError, TrainingSettings, resume_mismatches

log = logging.getLogger(__name__)

LAST_CHECKPOINT = "last-checkpoint.pt"
CHECKPOINTS_DIR = "checkpoints"  # the resume state, kept apart from the model folder's own files
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


def state_path(out: Path) -> Path:
    """Where a run in `out` writes its resumable state."""
    return Path(out) / CHECKPOINTS_DIR / LAST_CHECKPOINT


def state_file(out: Path) -> Path | None:
    """The state a `--resume` in `out` reads, `checkpoints/last-checkpoint.pt`; None when there is none."""
    path = state_path(out)
    return path if path.is_file() else None


@dataclasses.dataclass
class TrainingParts:
    """What a run steps and a resumable state saves and restores: the recipe hands these,
    not itself, so that this module does not depend on the recipe."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any | None = None


def training_state(parts: TrainingParts, rngs: list[dict[str, Any]], **run: Any) -> dict[str, Any]:
    """The state to resume from; `rngs` holds every process's `rng_state()`, `run` the
    recipe's `progress`, `history`, `labels`, `config` (a dict) and `data` (`data_identity`)."""
    missing = {"progress", "history", "labels", "config", "data"} - set(run)
    if missing:
        raise TypeError(f"training_state needs {', '.join(sorted(missing))}")
    return {
        "format": STATE_FORMAT,
        "model": parts.model.state_dict(),
        "optimizer": parts.optimizer.state_dict(),
        "scheduler": parts.scheduler.state_dict(),
        "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
        "rng": rngs,
        **run,
    }


def restore(parts: TrainingParts, state: dict[str, Any], rank: int, world_size: int) -> tuple[int, dict[str, Any]]:
    """Put `state` (checked by `check_resumable`) back into `parts` and this process's RNG;
    returns the optimiser step reached and the history, for the recipe to carry on."""
    parts.model.load_state_dict(state["model"])
    parts.optimizer.load_state_dict(state["optimizer"])
    parts.scheduler.load_state_dict(state["scheduler"])
    if parts.scaler is not None and state.get("scaler"):
        parts.scaler.load_state_dict(state["scaler"])
    rngs = state["rng"]
    if len(rngs) != world_size:
        log.warning(
            "resuming with %d process(es) after %d: data order and schedule continue exactly, dropout masks do not",
            world_size,
            len(rngs),
        )
    set_rng_state(rngs[rank % len(rngs)])
    return state["progress"]["global_step"], state["history"]


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
