"""Reading the small files of a checkpoint, run or output folder (journals, staging lists,
shard indexes, ids files, run state) as what they claim to be: a regular file of bounded
size, read with a bound.

Anything else is refused with a one-line `RefusedFile` naming the file: a FIFO (whose open
or read would block forever), a device (`/dev/zero` never ends), a link out of the folder, a
file larger than any this package writes. The file is opened non-blocking and checked with
`fstat` on the open descriptor, so what is read is what was checked.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import CheckpointError, human_bytes

# Bounds, each far above what this package writes (a journal of a 1,000-shard save is ~200 KiB).
SMALL = 1 << 20  # staging lists, cache refs, run settings
JSON = 16 << 20  # journals, shard indexes, modules.json, an embedding run's index
IDS = 256 << 20  # an embedding shard's ids file
TOKENIZER = 256 << 20  # tokenizer.json or vocab.txt (a multilingual tokenizer.json runs to tens of MiB)


class RefusedFile(CheckpointError):
    """A file of a run or checkpoint folder that is not a regular file of bounded size inside it.
    `path` is the file and `why` what it is instead, for callers that advise otherwise."""

    path: Path | None = None
    why: str = ""


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _refuse(path: Path, why: str) -> RefusedFile:
    error = RefusedFile(f"refused to read {path}: {why}. Delete it or restore the file this package wrote")
    error.path, error.why = path, why
    return error


def check_inside(path: Path, folder: Path | bool | None = None) -> None:
    """Refuse `path` when it is a link that leads out of `folder` (None: its own folder;
    False: links anywhere are followed, as the Hugging Face cache's links into its blobs)."""
    if folder is False or not path.is_symlink():
        return
    base = os.path.realpath(folder if isinstance(folder, (str, os.PathLike)) else path.parent)
    real = os.path.realpath(path)
    if os.path.commonpath([base, real]) != base:
        raise _refuse(path, f"it is a link to {real}, outside {base}")


def open_regular(path: str | os.PathLike, limit: int, folder: Path | bool | None = None) -> int:
    """A read-only descriptor of `path`, checked to be a regular file of at most `limit`
    bytes inside `folder` (see `check_inside`); `FileNotFoundError` when absent, `RefusedFile`
    otherwise."""
    path = Path(path)
    check_inside(path, folder)
    st = os.stat(path)  # never open a device or FIFO: opening one may block or have effects
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, f"it is {_kind(st.st_mode)}, not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _refuse(path, f"it cannot be opened ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)  # the file opened, not the one stat saw: it may have been swapped since
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, f"it is {_kind(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise _refuse(path, f"it holds {human_bytes(st.st_size)}, more than such a file can ({human_bytes(limit)})")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: str | os.PathLike, limit: int, folder: Path | bool | None = None) -> bytes:
    """The bytes of `path` (see `open_regular`), read with the bound: a file that grows past
    `limit` while being read is refused too."""
    fd = open_regular(path, limit, folder)
    chunks, total = [], 0
    try:
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise _refuse(Path(path), f"reading it failed ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if total > limit:
        raise _refuse(Path(path), f"it grew past {human_bytes(limit)} while being read")
    return b"".join(chunks)


def read_text(path: str | os.PathLike, limit: int, folder: Path | bool | None = None, errors: str = "strict") -> str:
    """`read_bytes` decoded as UTF-8; `UnicodeDecodeError` (a `ValueError`) for other bytes."""
    return read_bytes(path, limit, folder).decode("utf-8", errors=errors)
