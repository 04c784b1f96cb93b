"""Staged writes: several files written into a folder as one unit, all or nothing.

Each file is written to a hidden temporary in the folder (`.{name}.XXXXXXXX.tmp`, a random
name), which the write records by name in its staging list before creating it exclusively;
it is opened for writing without following links, so a link planted in its place is refused. Leaving the block normally
commits: a journal naming every rename and deletion is renamed into place (the commit
point), then the temporaries are renamed over their targets (shards before the index that
names them, config last), the files scheduled with `remove` are deleted, and the journal
goes. Signals are deferred during the commit. Before the commit point a failure deletes the
temporaries and leaves the folder as it was.

The folder is locked exclusively (`locking.DirectoryLock`) from construction to the end, so
saves take turns and loads (which hold it shared) never see half a save. Killed saves are
cleaned up by the next save into the folder or by `repair` (`bert-port-convert --repair`),
never by a load: a save killed after its commit point is finished, unless another tool has
written the folder since (the journal is then stale, and only our own temporaries go); the
temporaries of saves killed before theirs are deleted by the names their staging lists
recorded. No other file is touched, whatever its name looks like.
"""

from __future__ import annotations

import io
import logging
import os
import re
import secrets
import shutil
import signal
import string
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from .bounded import SMALL, RefusedFile, read_text
from .errors import CheckpointError, human_bytes
from .journal import InvalidJournal, Journal, Removal, Rename, State, digest, identity, read_journal
from .locking import DirectoryLock
from .names import CONFIG_NAME, JOURNAL, STAGING, TEMPORARY, removable, staged_name

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

log = logging.getLogger(__name__)

_STAGING_LIST = re.compile(re.escape(STAGING) + r"\.[A-Za-z0-9]{8}")
_ALPHABET = string.ascii_letters + string.digits


def _token() -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(8))


def _default_file_mode() -> int:
    # Temporaries are created 0600; a saved checkpoint should get the mode any other new file
    # gets (0666 minus the umask), so that others sharing the directory can read it. The
    # umask is read from /proc where it can be: setting it to read it races other threads.
    try:
        status = Path("/proc/self/status").read_text()
        umask = int(re.search(r"^Umask:\s*([0-7]+)", status, re.MULTILINE).group(1), 8)
    except (OSError, AttributeError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # absent on Windows, which has no such links to plant


@contextmanager
def _staged_file(tmp: Path) -> Iterator[io.BufferedWriter]:
    """The temporary `tmp` (just created by this write) opened for writing, never through a
    link: a link planted in its place fails the open instead of sending the bytes elsewhere."""
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_TRUNC | _NOFOLLOW), "wb") as f:
        yield f


def _make_folder(directory: Path) -> None:
    """Create `directory` (and its parents) to save into; `CheckpointError` in one line when it,
    or a folder above it, is a file."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), directory)
        raise CheckpointError(
            f"cannot save into {directory}: {blocker} is a file, not a folder. Give the path of a folder "
            "(it is created if missing), or move the file away"
        ) from None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    try:
        _fsync(directory)
    except OSError:  # some filesystems cannot fsync a directory
        pass


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP while the renames of a commit run, and deliver them
    after: a Ctrl-C then lands before the commit or after it, never halfway. Python runs
    signal handlers in the main thread only, so other threads have nothing to defer.
    SIGKILL cannot be deferred: the journal covers it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])):
        handler = signal.getsignal(sig)
        if handler is None or handler == signal.SIG_IGN:  # installed outside Python, or ignored
            continue
        previous[sig] = signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in received:
            signal.raise_signal(signum)


def _apply_journal(directory: Path, journal: Journal) -> None:
    """Carry out the journal's pending renames and deletions (idempotent), then delete it.
    Call with the folder's lock held, for a LIVE journal only."""
    for r in journal.renames:
        if (directory / r.tmp).is_file():
            (directory / r.target).parent.mkdir(exist_ok=True)  # a module folder new in this save
            os.replace(directory / r.tmp, directory / r.target)
    for r in journal.removals:
        target = directory / r.name
        if target.is_dir() and not target.is_symlink():  # a sentence-transformers module folder
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
    for folder in {(directory / r.target).parent for r in journal.renames}:
        _fsync_dir(folder)
    (directory / JOURNAL).unlink()


def _abandon_journal(directory: Path, journal: Journal) -> tuple[int, int]:
    """Drop a journal that must not be replayed (stale, done or not ours), deleting only the
    temporaries it staged that are still exactly as staged. Returns (files, bytes) deleted."""
    count = size = 0
    for r in journal.renames:
        tmp = directory / r.tmp
        if r.holds_new(tmp):  # the very file the save staged, or a copy of it
            size += r.new[2]
            tmp.unlink(missing_ok=True)
            count += 1
    (directory / JOURNAL).unlink(missing_ok=True)
    return count, size


@dataclass
class Cleanup:
    """What cleaning a folder after killed saves did."""

    journal: str = ""  # "finished", "stale", "done", "invalid" or "" (none)
    files: int = 0  # temporaries deleted
    nbytes: int = 0

    def describe(self, directory: Path) -> str:
        said = {
            "finished": "finished a save that was interrupted after its commit point",
            "stale": "dropped the journal of an interrupted save: the folder was written by another tool since, "
            "and its files were kept",
            "done": "removed the journal of a save that had finished",
            "invalid": f"removed {JOURNAL}, which this package did not write (not obeyed)",
        }
        parts = [said[self.journal]] if self.journal else []
        if self.files:
            parts.append(f"deleted {self.files} temporaries ({human_bytes(self.nbytes)}) of interrupted saves")
        return f"{directory}: " + ("; ".join(parts) if parts else "nothing to repair")


def _clean_journal(directory: Path, cleanup: Cleanup) -> None:
    try:
        journal = read_journal(directory)
    except InvalidJournal as exc:
        if (directory / JOURNAL).is_dir() and not (directory / JOURNAL).is_symlink():
            raise CheckpointError(f"{directory / JOURNAL} is a folder, not a commit journal; move it away") from None
        log.warning("%s: removing %s, not a commit journal this package wrote (%s)", directory, JOURNAL, exc)
        (directory / JOURNAL).unlink()
        cleanup.journal = "invalid"
        return
    if journal is None:
        return
    state = journal.state(directory)
    if state is State.LIVE:
        _apply_journal(directory, journal)
        cleanup.journal = "finished"
        log.warning("%s: finished a save that was interrupted after it committed", directory)
    else:
        count, size = _abandon_journal(directory, journal)
        cleanup.journal, cleanup.files, cleanup.nbytes = state.value, count, size
        if state is State.STALE:
            log.warning(
                "%s: another tool wrote this folder after an interrupted save; its journal was dropped", directory
            )


def _clean_up(directory: Path) -> Cleanup:
    """Clean up after killed saves in `directory`, its lock held: finish or drop the journal,
    then delete the temporaries named by staging lists that no live write of this process
    owns (another process's live write would hold the lock)."""
    cleanup = Cleanup()
    _clean_journal(directory, cleanup)
    for entry in os.scandir(directory):
        if not _STAGING_LIST.fullmatch(entry.name) or entry.path in StagedWrite.active:
            continue
        try:
            names = read_text(entry.path, SMALL, directory, errors="replace").splitlines()
        except (RefusedFile, OSError) as exc:  # not a list a save of ours wrote: leave it, and its names, alone
            log.warning("%s", exc)
            continue
        for name in names:
            tmp = directory / name
            if TEMPORARY.fullmatch(name) and "/" not in name and tmp.is_file() and not tmp.is_symlink():
                cleanup.nbytes += tmp.stat().st_size
                tmp.unlink()
                cleanup.files += 1
        os.unlink(entry.path)
    if cleanup.files:
        log.info("%s: removed %d temporaries of an interrupted save", directory, cleanup.files)
    return cleanup


def tidy(directory: str | os.PathLike) -> tuple[int, int]:
    """Clean up after killed saves in `directory` (see `_clean_up`), under its lock
    (re-entrant). Returns how many temporaries were deleted and their total size in bytes."""
    directory = Path(directory)
    lock = DirectoryLock(directory)
    try:
        cleanup = _clean_up(directory)
    finally:
        lock.release()
    return cleanup.files, cleanup.nbytes


def repair(directory: str | os.PathLike) -> str:
    """Finish or drop what killed saves left in a checkpoint folder (the one thing that does
    so besides the next save); returns a one-line report. `CheckpointError` when the folder
    cannot be written."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"cannot repair {directory}: not a folder")
    try:
        lock = DirectoryLock(directory)
        try:
            return _clean_up(directory).describe(directory)
        finally:
            lock.release()
    except OSError as exc:
        raise CheckpointError(f"cannot repair {directory}: {exc}. It needs write access to the folder") from None


class StagedWrite:
    """Write several files into `directory` as one unit, all or nothing (see the module's
    docstring). Names are plain file names, or `{module folder}/{name}` for a file in a
    sentence-transformers module folder (`1_Pooling/config.json`), so that a model, its
    tokenizer and its sentence-transformers files commit together."""

    active: ClassVar[set[str]] = set()  # staging lists of this process's live writes

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        _make_folder(self.directory)
        self._staged: dict[str, Path] = {}  # target name -> temporary
        self._remove: list[str] = []
        self.committed: list[Path] = []
        self._lock: DirectoryLock | None = DirectoryLock(self.directory)
        self._list = self.directory / f"{STAGING}.{_token()}"
        try:
            _clean_up(self.directory)
            self._list.touch(exist_ok=False)
            StagedWrite.active.add(str(self._list))
        except BaseException:
            self.close()
            raise

    def _temporary(self, name: str) -> Path:
        """A new empty temporary for `name`, recorded in the staging list before it exists."""
        tmp = self.directory / f".{name.replace('/', '__')}.{_token()}.tmp"
        with open(self._list, "a", encoding="utf-8") as f:
            f.write(tmp.name + "\n")
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600))
        return tmp

    def path(self, name: str) -> Path:
        """A fresh temporary path to write the file `name` to."""
        if not staged_name(name):
            raise ValueError(f"{name!r} is not a file name in the folder or in a module folder of it")
        if name in self._staged:
            raise ValueError(f"{name} is staged twice")
        self._staged[name] = self._temporary(name)
        return self._staged[name]

    def text(self, name: str, text: str) -> None:
        self.data(name, text.encode("utf-8"))

    def data(self, name: str, data: bytes) -> Path:
        """Stage `data` as the file `name`; returns its temporary."""
        tmp = self.path(name)
        with _staged_file(tmp) as f:
            f.write(data)
        return tmp

    def copy(self, name: str, source: str | os.PathLike) -> None:
        with open(source, "rb") as src, _staged_file(self.path(name)) as f:
            shutil.copyfileobj(src, f)

    def remove(self, name: str) -> None:
        """Delete `name` from the directory as part of the commit (a file of the previous
        save that the new one does not replace, a module folder, or a file in one)."""
        if not removable(name):
            raise ValueError(
                f"{name} is not a weights, tokenizer or sentence-transformers file; a save does not delete it"
            )
        if name not in self._staged and name not in self._remove:
            self._remove.append(name)

    def _journal(self) -> Journal:
        # Config last: a reader that sees the new config sees the new weights.
        order = sorted(self._staged.items(), key=lambda item: item[0] == CONFIG_NAME)
        # The digest makes the staged files recognisable in a copy of the folder (new inodes).
        renames = tuple(
            Rename(tmp.name, name, identity(tmp), identity(self.directory / name), digest(tmp)) for name, tmp in order
        )
        present = [(n, identity(self.directory / n)) for n in self._remove]
        return Journal(renames, tuple(Removal(n, old) for n, old in present if old is not None))

    def commit(self) -> list[Path]:
        mode = _default_file_mode()
        for tmp in self._staged.values():
            _fsync(tmp)
            os.chmod(tmp, mode)
        journal = self._journal()
        journal_tmp = self._temporary(JOURNAL)
        try:
            with _staged_file(journal_tmp) as f:
                f.write(journal.to_json().encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
        except BaseException:  # a full disk before the commit point: the journal's temporary goes too
            journal_tmp.unlink(missing_ok=True)
            raise
        with _signals_deferred():
            os.replace(journal_tmp, self.directory / JOURNAL)  # the commit point
            # From here the temporaries belong to the journal: a failure below leaves them
            # for the next save or `repair` to rename, never for `discard` to delete.
            self.committed = [self.directory / r.target for r in journal.renames]
            self._staged.clear()
            _fsync_dir(self.directory)
            _apply_journal(self.directory, journal)
        return self.committed

    def discard(self) -> None:
        for tmp in self._staged.values():
            tmp.unlink(missing_ok=True)
        self._staged.clear()

    def close(self) -> None:
        if str(self._list) in StagedWrite.active:
            StagedWrite.active.discard(str(self._list))
            self._list.unlink(missing_ok=True)
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                try:
                    self.commit()
                finally:
                    self.discard()
            else:
                self.discard()
        finally:
            self.close()


@contextmanager
def atomic_write(path: Path) -> Iterator[Path]:
    """Yield a temporary path in the same directory; on success it replaces `path` in one
    rename, so a crash mid-write leaves the previous file intact."""
    path = Path(path)
    with StagedWrite(path.parent) as stage:
        yield stage.path(path.name)
