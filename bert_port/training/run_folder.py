"""The output folder of a training run (fine-tuning or language model): its file names, the checks before a run starts
there, and the lock that keeps a second run out. The folder is the model (weights, config,
tokenizer files, README.md) with the run's reports; the resume state is kept apart in
`checkpoints/`, so that the folder is what a user copies or uploads.

A run holds an `flock` on its run-lock file (`.bert_port-run.lock` in the folder) for the
whole run: a second run is refused at once, and the kernel drops the lock when its process
dies, so a killed run never blocks the next. It is not the folder's own lock
(`checkpoint.DirectoryLock`), which each save takes only while it writes: loads of the
folder (the other ranks' load of the best checkpoint, a user's look mid-run) then wait for a
save in progress, not for the whole run. On taking it, what killed saves left is tidied
(`checkpoint.tidy`: a save killed after its commit is finished, recorded temporaries deleted).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from .. import checkpoint as ckpt
from .resume import CHECKPOINTS_DIR, LAST_CHECKPOINT, state_file, state_path
from .settings import FinetuneError, TrainingSettings
from .steps import Dist

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"
CURVES_FILE = "training_curves.png"
RESOLVED_CONFIG = "training_config.json"
DATA_DIR = "data"  # a bundled dataset's split, written as CSV files
RUN_LOCK = ".bert_port-run.lock"


@contextlib.contextmanager
def _run_lock(out: Path, command: str) -> Iterator[None]:
    """Hold `out`'s run lock, or raise `FinetuneError` when another run holds it."""
    try:
        import fcntl
    except ImportError:  # Windows: runs go unlocked
        yield
        return
    fd = os.open(out / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FinetuneError(
            f"another {command} is writing into {out} right now; wait for it to end or choose another --output-dir"
        ) from None
    try:
        yield
    finally:
        os.close(fd)  # drops the flock


def check_output_dir(cfg: TrainingSettings, out: Path) -> None:
    """Refuse, before any work, an output folder this run cannot use: a file, a `--resume`
    without a state to resume, a finished run that neither `--resume` nor `--overwrite`
    names, and a `--compare-to` that is no folder."""
    if out.exists() and not out.is_dir():
        raise FinetuneError(f"--output-dir {out} is a file, not a directory; choose another --output-dir")
    found = state_file(out)
    if cfg.resume and found is None:
        raise FinetuneError(
            f"--resume: no {CHECKPOINTS_DIR}/{LAST_CHECKPOINT} in {out} (the run stopped before its first checkpoint, "
            "or never ran there); start it again without --resume (with --overwrite if the "
            "directory holds a metrics.json)"
        )
    if not cfg.resume and not cfg.overwrite and (found is not None or (out / METRICS_FILE).is_file()):
        raise FinetuneError(
            f"{out} already holds a {cfg.kind} run; pass --resume to continue it, --overwrite to "
            "start it again, or choose another --output-dir"
        )
    if cfg.compare_to is not None and not Path(cfg.compare_to).is_dir():
        raise FinetuneError(f"--compare-to {cfg.compare_to} is not a directory; pass the --output-dir of another run")


@contextlib.contextmanager
def own_output_dir(out: Path, command: str = "bert-port-finetune") -> Iterator[Path]:
    """Create `out`, lock it for this run (a second run into it is refused), and tidy what
    a killed run left behind (`kill -9` cannot clean up after itself)."""
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
    with _run_lock(out, command):
        # `checkpoint.StagedWrite` and `data.write_records` stage files as hidden temporaries.
        removed = size = 0
        for folder in (out, out / DATA_DIR, out / CHECKPOINTS_DIR):
            if folder.is_dir():
                count, nbytes = ckpt.tidy(folder)
                removed, size = removed + count, size + nbytes
        if removed:
            log.warning(
                "removed %d temporary file(s) (%.1f MiB) left in %s by an interrupted run", removed, size / 2**20, out
            )
        yield out


def lock_output_dir(cfg: TrainingSettings, out: Path, d: Dist, stack: contextlib.ExitStack) -> None:
    """Rank 0 takes the folder for the rest of the run (`stack` releases it); every process
    learns its answer, so none waits in a collective after a refusal. `--overwrite` then
    removes the previous run's state and metrics."""
    refusal = None
    if d.is_main:
        try:
            stack.enter_context(own_output_dir(out, cfg.command))
        except FinetuneError as exc:
            refusal = str(exc)
    refusal = d.gather(refusal)[0]
    if refusal is not None:
        raise FinetuneError(refusal)
    if cfg.overwrite and not cfg.resume and d.is_main:
        for path in (state_path(out), out / LAST_CHECKPOINT, out / METRICS_FILE):
            path.unlink(missing_ok=True)
