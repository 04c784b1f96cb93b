"""The commit journal of a staged write: what it is, and whether it still describes the folder.

A save commits by renaming its journal into place. The journal names every staged
temporary and the file it replaces, and every file the save deletes. A save killed after
that point (SIGKILL, power loss) leaves the folder half old, half new, with the journal
saying how to finish it.

Each entry records the identity (inode, mtime, size) of the files it expected. A folder
that another tool wrote after the kill (transformers' `save_pretrained`, a copy) no longer
matches, and such a journal is *stale*: it is never replayed over newer files. Reading a
journal and judging it only stats files; finishing one is the write side's job
(`staging.finish_journal`). Loading never writes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from .names import JOURNAL, TEMPORARY, removable, staged_name

FORMAT = 2
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


@dataclass(frozen=True)
class Rename:
    tmp: str  # the staged temporary, in the top folder
    target: str  # a name in the folder, or `{module folder}/{name}`
    new: Identity  # the temporary's identity, which the target has once renamed
    old: Identity | None  # the target's identity when the save committed (None: absent)


@dataclass(frozen=True)
class Removal:
    name: str
    old: Identity  # what the save meant to delete


class State(Enum):
    LIVE = "live"  # the save is half done and nothing else has written since: finish it
    DONE = "done"  # every rename and removal happened; only the journal is left
    STALE = "stale"  # another writer changed the folder since: never replay it
    LEGACY = "legacy"  # an older bert_port's journal (no identities): cannot be judged, so never replayed


@dataclass(frozen=True)
class Journal:
    renames: tuple[Rename, ...]
    removals: tuple[Removal, ...]
    legacy: bool = False

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "rename": [[r.tmp, r.target, list(r.new), r.old and list(r.old)] for r in self.renames],
                "remove": [[r.name, list(r.old)] for r in self.removals],
            }
        )

    def state(self, directory: Path) -> State:
        """LIVE, DONE or STALE, from the files present now (stat only; nothing is changed)."""
        if self.legacy:  # only existence can be judged
            left = any((directory / r.tmp).exists() for r in self.renames)
            left |= any((directory / r.name).exists() for r in self.removals)
            return State.LEGACY if left else State.DONE
        pending = False
        for r in self.renames:
            tmp, target = identity(directory / r.tmp), identity(directory / r.target)
            if tmp is None and target == r.new:
                continue  # renamed
            if tmp != r.new or target != r.old:
                return State.STALE  # the temporary or its target is no longer what the save saw
            pending = True
        for r in self.removals:
            now = identity(directory / r.name)
            if now is None:
                continue
            if now != r.old:
                return State.STALE
            pending = True
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
    if plan.get("format") != FORMAT:  # format 1: [[tmp, target]], [name]
        legacy = Journal(
            tuple(Rename(tmp, target, (0, 0, 0), None) for tmp, target in renames),
            tuple(Removal(n, (0, 0, 0)) for n in removals),
            legacy=True,
        )
        return legacy
    return Journal(
        tuple(Rename(t, g, _identity_of(n), None if o is None else _identity_of(o)) for t, g, n, o in renames),
        tuple(Removal(n, _identity_of(o)) for n, o in removals),
    )


def read_journal(directory: str | os.PathLike) -> Journal | None:
    """The folder's journal, None when there is none; `InvalidJournal` when the file there is
    not one this package wrote."""
    path = Path(directory) / JOURNAL
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
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
