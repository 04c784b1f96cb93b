"""Folder locks: a save holds its folder exclusively, a load holds it shared, so that a load
sees one whole save and never the files of two.

The lock is a `flock` on the folder itself (no lock file is left behind). Filesystems
without flock (some network mounts) run unlocked. flock locks belong to an open file, so two
opens of one folder in one process exclude each other like two processes would: the process
therefore keeps one exclusive lock per folder, re-entrant for the thread holding it (a
fine-tuning run holds its `--output-dir` for the whole run and saves into it), and a load by
the thread that holds the exclusive lock needs no lock of its own.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

try:
    import fcntl
except ImportError:  # Windows: saves and loads run unlocked there
    fcntl = None

log = logging.getLogger(__name__)


def _flock(directory: str | os.PathLike, mode: int, blocking: bool) -> int | None:
    """An open descriptor of `directory` holding a flock in `mode`, or None where the
    filesystem has no flock. `BlockingIOError` when `blocking` is False and it is held."""
    if fcntl is None:
        return None
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, mode | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        raise
    except OSError as exc:
        log.debug("cannot lock %s (%s); going on without a lock", directory, exc)
    return fd


class DirectoryLock:
    """The exclusive lock of a folder, for saves. Re-entrant within a thread; other threads
    of the process wait on a `threading.RLock`, other processes on the flock, which is taken
    once per folder and dropped when the outermost holder releases. `blocking=False` raises
    `BlockingIOError` instead of waiting."""

    _held: ClassVar[dict[tuple[int, int], list]] = {}  # (st_dev, st_ino) -> [RLock, fd, depth, owner thread]
    _mutex = threading.Lock()

    def __init__(self, directory: str | os.PathLike, *, blocking: bool = True):
        st = os.stat(directory)
        self._key: tuple[int, int] | None = (st.st_dev, st.st_ino)
        with self._mutex:
            entry = self._held.setdefault(self._key, [threading.RLock(), None, 0, None])
        if not entry[0].acquire(blocking=blocking):
            self._key = None
            raise BlockingIOError(f"{directory} is locked by another thread of this process")
        try:
            if entry[2] == 0:
                entry[1] = _flock(directory, fcntl.LOCK_EX if fcntl else 0, blocking)
            entry[2] += 1
            entry[3] = threading.get_ident()
        except BaseException:
            entry[0].release()
            self._key = None
            raise

    @classmethod
    def held_here(cls, directory: str | os.PathLike) -> bool:
        """Whether this thread holds `directory`'s exclusive lock."""
        st = os.stat(directory)
        entry = cls._held.get((st.st_dev, st.st_ino))
        return entry is not None and entry[2] > 0 and entry[3] == threading.get_ident()

    def release(self) -> None:
        if self._key is None:
            return
        entry = self._held[self._key]
        entry[2] -= 1
        if entry[2] == 0:
            entry[3] = None
            if entry[1] is not None:
                os.close(entry[1])  # closing the only descriptor drops the flock
                entry[1] = None
        entry[0].release()
        self._key = None


@contextmanager
def shared_lock(directory: str | os.PathLike) -> Iterator[None]:
    """Hold `directory` shared while a load reads it: saves (which hold it exclusively from
    their first staged byte to their last rename) wait, other loads do not."""
    if DirectoryLock.held_here(directory):
        yield  # this thread is saving here: what it reads is what it wrote
        return
    fd = _flock(directory, fcntl.LOCK_SH if fcntl else 0, True)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)
