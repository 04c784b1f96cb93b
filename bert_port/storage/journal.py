"""The commit journal of a staged write: what it is, and whether it still describes the folder.

A save commits by renaming its journal into place. The journal names every staged
temporary and the file it replaces, and every file the save deletes. A save killed after
that point (SIGKILL, power loss) leaves the folder half old, half new, with the journal
saying how to finish it.

Each entry records the identity (inode, mtime, size) of the files it expected, and the
SHA-256 of each staged file. A folder that another tool wrote after the kill (transformers'
`save_pretrained`) no longer matches, and such a journal is *stale*: it is never replayed
over newer files. A copy or move of the folder (`cp -a`, `mv` to another disk) has new
inodes: its files are then matched by content (staged files by their digest, the files they
replace by size and mtime), so the copy is judged as its original is. Where the copy's
mtimes differ too (`cp -r`) but some staged files are provably in place by content while
others wait, the folder is half one save, half another: LIVE, never stale. Reading a journal
and judging it reads only the folder's own files; finishing one is the write side's job
(`staging._apply_journal`). Loading never writes.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from .bounded import JSON, RefusedFile, read_text
from .names import JOURNAL, TEMPORARY, removable, staged_name

FORMAT = 3  # each rename carries the staged file's identity and SHA-256
Identity = tuple[int, int, int]  # (st_ino, st_mtime_ns, st_size); a folder's is (st_ino, 0, 0)


def identity(path: Path) -> Identity | None:
    """What a journal remembers of a file or folder, or None where there is none."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if path.is_dir() and not path.is_symlink():
        return (st.st_ino, 0, 0)
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def digest(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _same_old(now: Identity | None, old: Identity | None) -> bool:
    """`now` is the file the save saw: the same inode, or (a copy, a move) the same mtime and size."""
    if now is None or old is None:
        return now == old
    return now == old or now[1:] == old[1:]


@dataclass(frozen=True)
class Rename:
    tmp: str  # the staged temporary, in the top folder
    target: str  # a name in the folder, or `{module folder}/{name}`
    new: Identity  # the temporary's identity, which the target has once renamed
    old: Identity | None  # the target's identity when the save committed (None: absent)
    sha256: str  # the staged file's content

    def holds_new(self, path: Path) -> bool:
        """`path` holds the staged file: the same inode, or (a copy) the same bytes."""
        now = identity(path)
        if now is None or now == self.new:
            return now is not None
        if now[2] != self.new[2] or not path.is_file() or path.is_symlink():
            return False
        return digest(path) == self.sha256


@dataclass(frozen=True)
class Removal:
    name: str
    old: Identity  # what the save meant to delete


class State(Enum):
    LIVE = "live"  # the save is half done and nothing else has written since: finish it
    DONE = "done"  # every rename and removal happened; only the journal is left
    STALE = "stale"  # another writer changed the folder since: never replay it


@dataclass(frozen=True)
class Journal:
    renames: tuple[Rename, ...]
    removals: tuple[Removal, ...]

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "rename": [[r.tmp, r.target, list(r.new), r.old and list(r.old), r.sha256] for r in self.renames],
                "remove": [[r.name, list(r.old)] for r in self.removals],
            }
        )

    def state(self, directory: Path) -> State:
        """LIVE, DONE or STALE, from the files present now (stat only; nothing is changed)."""
        pending = done = changed = False
        for r in self.renames:
            tmp = directory / r.tmp
            if identity(tmp) is None and r.holds_new(directory / r.target):
                done = True  # renamed
                continue
            if not r.holds_new(tmp):
                return State.STALE  # the temporary is no longer what the save staged
            pending = True
            changed |= not _same_old(identity(directory / r.target), r.old)
        for r in self.removals:
            now = identity(directory / r.name)
            if now is not None:
                pending = True
                changed |= not _same_old(now, r.old)
        if changed:
            # Written since, or copied without mtimes: stale, unless part of this save is
            # provably in place and part still staged, and the folder is a mix either way.
            return State.LIVE if done and pending else State.STALE
        return State.LIVE if pending else State.DONE


class InvalidJournal(ValueError):
    """A file named as the journal that this package did not write (garbage, or naming files
    outside the folder or files a save never deletes). It is never obeyed."""


def _identity_of(value: object) -> Identity:
    if not (isinstance(value, list) and len(value) == 3 and all(isinstance(v, int) for v in value)):
        raise InvalidJournal(f"bad identity {value!r}")
    return (value[0], value[1], value[2])


def _parse(plan: object) -> Journal:
    renames, removals = plan["rename"], plan["remove"]
    if not isinstance(renames, list) or not isinstance(removals, list):
        raise InvalidJournal("rename and remove must be lists")
    if plan.get("format") != FORMAT:
        raise InvalidJournal(f"unknown format {plan.get('format')!r}")
    return Journal(tuple(_rename(entry) for entry in renames), tuple(Removal(n, _identity_of(o)) for n, o in removals))


def _rename(entry: list) -> Rename:
    tmp, target, new, old, sha256 = entry
    if not isinstance(sha256, str) or len(sha256) != 64:
        raise InvalidJournal(f"bad rename entry {entry!r:.200}")
    return Rename(tmp, target, _identity_of(new), None if old is None else _identity_of(old), sha256)


def read_journal(directory: str | os.PathLike) -> Journal | None:
    """The folder's journal, None when there is none; `InvalidJournal` when the file there is
    not one this package wrote."""
    path = Path(directory) / JOURNAL
    try:
        text = read_text(path, JSON, Path(directory))
    except FileNotFoundError:
        return None
    except RefusedFile as exc:
        raise InvalidJournal(str(exc)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidJournal(f"unreadable ({exc})") from None
    try:
        journal = _parse(json.loads(text))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidJournal(str(exc)) from None
    valid = all(
        isinstance(r.tmp, str) and TEMPORARY.fullmatch(r.tmp) and "/" not in r.tmp and staged_name(r.target)
        for r in journal.renames
    )
    if not valid or not all(removable(r.name) for r in journal.removals):
        raise InvalidJournal("it names files outside its folder, or files a save never deletes")
    return journal
