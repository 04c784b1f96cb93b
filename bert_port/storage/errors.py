"""`CheckpointError`, the error of `bert_port.storage` and `bert_port.checkpoint` (and the base of
`TokenizerError`), and helpers for its messages."""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Mapping


class CheckpointError(Exception):
    """A checkpoint that cannot be read or does not fit the model. The message says why
    and what to do; nothing has been loaded into the model when this is raised.

    When an argument of the loader gets past the problem, the error names it as data
    (`argument`, `value`) and `hint` says what it does, with `{}` where the argument goes:
    `str(error)` spells it for Python (`check_finite='warn'`), `for_command_line` with the
    flag of a command line (`--check-finite warn`)."""

    def __init__(self, message: str, *, hint: str = "", argument: str = "", value: str | None = None):
        self.message, self.hint, self.argument, self.value = message, hint, argument, value
        python = f"{argument}={'<path>' if value is None else repr(value)}"
        super().__init__(self._with_hint(python))

    def _with_hint(self, spelling: str | None) -> str:
        if not self.hint or spelling is None:
            return self.message
        return f"{self.message} {self.hint.format(spelling)}"

    def for_command_line(self, flags: Mapping[str, str]) -> str:
        """The message with its hint naming a command-line flag: `flags` maps loader
        arguments to the flags of the command (`{"check_finite": "--check-finite"}`). An
        argument the command has no flag for is left out of the message."""
        if not self.argument:
            return str(self)
        flag = flags.get(self.argument)
        if flag is None:
            return self._with_hint(None)
        return self._with_hint(f"{flag} {'<path>' if self.value is None else self.value}")


def link_loop(path: str | os.PathLike) -> CheckpointError | None:
    """The error to raise when `path` is a symbolic link loop (following it only ever reaches
    another link), else None: a loop is not a missing or unreadable file, and says so."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return CheckpointError(
                f"{path} is a symbolic link loop: following it leads back to a link, never to a file. "
                "Replace it with the file (or a link to the file) it should be"
            )
    return None


def short_list(names: list[str], limit: int = 20) -> str:
    """The first `limit` names, and how many more: an error stays readable however many."""
    shown = ", ".join(names[:limit])
    return shown + (f", ... and {len(names) - limit} more" if len(names) > limit else "")


def human_bytes(n: int) -> str:
    """`n` bytes as `1.5 MiB`."""
    if n <= 0:
        return "0 B"
    k = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**k:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][k]}"
