"""Checkpoint files: reading weights (safetensors, PyTorch pickles, shard indexes), and
writing them as one staged unit (temporaries, a commit journal, a directory lock), sharded
by huggingface_hub. Also the NaN/Inf check of loaded weights, which reads memory-mapped
safetensors from the file rather than through the mapping, so that loading keeps no page
of the weights resident.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from .errors import CheckpointError, short_list

try:
    import fcntl
except ImportError:  # Windows: saves run unlocked there
    fcntl = None

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

log = logging.getLogger(__name__)

# -----------------------------------------------------------------------------------------
# File names

CONFIG_NAME = "config.json"
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PT_WEIGHTS = "pytorch_model.bin"
PT_INDEX = "pytorch_model.bin.index.json"
WEIGHT_NAMES = (SAFE_WEIGHTS, SAFE_INDEX, PT_WEIGHTS, PT_INDEX)  # in order of preference
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "added_tokens.json",
)
# sentence-transformers' files beside a checkpoint: the pipeline (`modules.json`), its
# settings, and module folders named `{index}_{Module}` (`1_Pooling`, `2_Normalize`).
ST_MODULES = "modules.json"
ST_CONFIG = "sentence_bert_config.json"
ST_FILES = (ST_MODULES, ST_CONFIG, "config_sentence_transformers.json")
ST_FOLDER = re.compile(r"\d+_\w+")


def read_st_modules(directory: str | os.PathLike) -> list[dict]:
    """The modules a folder's `modules.json` lists (dicts with `type` and `path`), checked to
    be a JSON list of objects; `CheckpointError` saying to restore it otherwise."""
    path = Path(directory) / ST_MODULES
    try:
        modules = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not readable JSON ({exc}); restore it from the original checkpoint") from None
    if not isinstance(modules, list) or not modules or not all(isinstance(m, dict) for m in modules):
        raise CheckpointError(f"{path} must be a JSON list of modules; restore it from the original checkpoint")
    return modules


def st_module_folders(directory: str | os.PathLike) -> list[str]:
    """The module folders `modules.json` in `directory` names (`1_Pooling`, ...) that exist:
    plain relative names only, never a path out of the directory."""
    directory = Path(directory)
    folders = (m.get("path") for m in read_st_modules(directory))
    return [f for f in folders if _plain_name(f) and "\\" not in f and (directory / f).is_dir()]


# -----------------------------------------------------------------------------------------
# Reading


def _unreadable(path: Path, exc: OSError) -> CheckpointError:
    """A file the OS will not give us (permissions, a directory, an I/O error), as opposed
    to one whose bytes are wrong."""
    return CheckpointError(
        f"cannot read {path}: {exc.strerror or exc}. Check that the file exists and that you may read it"
    )


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    """The tensors of a safetensors file, memory-mapped (no page is read until used), each
    remembered with its place in the file for `non_finite`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        before = _identity(os.stat(path))
        tensors = load_file(str(path))
        offsets = _data_offsets(path)
        same_file = _identity(os.stat(path)) == before  # not replaced while it was being mapped
    except OSError as exc:
        raise _unreadable(path, exc) from None
    except (SafetensorError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({exc}). It is probably truncated or "
            "corrupt: download or copy it again"
        ) from None
    if same_file:
        for key, tensor in tensors.items():
            span = offsets.get(key)
            if span is not None and span[1] - span[0] == tensor.numel() * tensor.element_size():
                _origins()[tensor] = _FileSpan(str(path), before, span[0], tensor._version)
    return tensors


def _data_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Where each tensor's bytes lie in a safetensors file: an 8-byte little-endian header
    length, the JSON header (`data_offsets` relative to its end), then the data."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    start = 8 + length
    return {
        k: (start + v["data_offsets"][0], start + v["data_offsets"][1])
        for k, v in header.items()
        if k != "__metadata__"
    }


def _read_torch_pickle(path: Path) -> dict[str, Tensor]:
    import pickle
    import zipfile

    try:
        # weights_only=True: the unpickler only builds tensors and plain containers, so a
        # pickle that tries to run code fails here instead of running it. mmap needs the
        # zip format of torch>=1.6; older checkpoints (bert-base-uncased's own
        # pytorch_model.bin among them) are read whole.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as exc:
        # torch's message suggests allowlisting the culprit; name it, without that advice.
        culprit = re.search(r"GLOBAL ([\w.]+)", str(exc))
        lines = [line.strip() for line in str(exc).splitlines() if "Unsupported" in line or "unsupported" in line]
        reason = f"it calls {culprit.group(1)}" if culprit else (lines[0] if lines else "not plain tensors")
        raise CheckpointError(
            f"refused to load {path}: unpickling it would run code, not just build tensors ({reason}). "
            "Nothing in it was executed. If you trust the file, convert it to safetensors in a trusted, "
            "isolated environment first"
        ) from None
    except (PermissionError, IsADirectoryError) as exc:
        raise _unreadable(path, exc) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(
            f"{path} is not a readable PyTorch checkpoint ({reason}). It is probably truncated or corrupt: "
            "download or copy it again"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        what = f"a dict with keys {sorted(map(str, state))[:5]}" if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"{path} does not hold a flat state dict of tensors (found {what}); save `model.state_dict()` itself"
        )
    return state


_SHARD_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _read_index(path: Path) -> dict[str, Tensor]:
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except OSError as exc:
        raise _unreadable(path, exc) from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"{path} is not a valid shard index ({type(exc).__name__}: {str(exc)[:200]}); it must be a JSON object "
            "whose 'weight_map' maps each tensor name to a shard file name. Restore it from the original checkpoint"
        ) from None
    # Shards live beside the index and are weights files: a name that leaves the directory,
    # or names an index (this one, which would recurse forever, or another), is not a shard.
    bad = [
        s
        for s in shards
        if not isinstance(s, str)
        or not _plain_name(s)
        or Path(s).name != s
        or s.endswith(".index.json")
        or not s.endswith(_SHARD_SUFFIXES)
    ]
    if bad:
        raise CheckpointError(
            f"shard index {path} names {len(bad)} shard(s) outside its directory or not weights files: "
            f"{short_list([repr(b)[:100] for b in bad])}. A shard is a .safetensors or .bin file beside the index: "
            "restore the index from the original checkpoint"
        )
    missing = [s for s in shards if not _is_file(path.parent / s)]
    if missing:
        raise CheckpointError(
            f"shard index {path} names {len(missing)} shard file(s) that are not in {path.parent}: "
            f"{short_list(missing)}. The download or copy is incomplete: fetch the missing shards"
        )
    state: dict[str, Tensor] = {}
    for shard in shards:
        shard_path = path.parent / shard
        tensors = _read_safetensors(shard_path) if shard.endswith(".safetensors") else _read_torch_pickle(shard_path)
        # Each tensor comes from the shard the index names for it (as transformers reads
        # them); a copy in another shard is ignored rather than silently winning.
        state.update({k: v for k, v in tensors.items() if weight_map.get(k, shard) == shard})
    absent = sorted(set(weight_map) - set(state))
    if absent:
        raise CheckpointError(
            f"shard index {path} lists {len(absent)} tensor(s) its shards lack: {short_list(absent, 10)}. "
            "The index and shards come from different saves: fetch them again together"
        )
    return state


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long, a permission denied on the way: not a file we can read
        return False


def read_weights(path: str | os.PathLike) -> dict[str, Tensor]:
    """Read a weights file (`.safetensors`, `.bin`/`.pt`, or a shard index) into a state dict
    with the checkpoint's own key names."""
    path = Path(path)
    if path.name.endswith(".index.json"):
        return _read_index(path)
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    if path.suffix in (".bin", ".pt", ".pth"):
        return _read_torch_pickle(path)
    raise CheckpointError(f"unknown weights format {path.name!r}: use .safetensors, .bin, or a shard index")


# -----------------------------------------------------------------------------------------
# Writing


def _default_file_mode() -> int:
    # mkstemp creates 0600 files; a saved checkpoint should get the mode any other new file
    # gets (0666 minus the umask), so that others sharing the directory can read it. The
    # umask is read from /proc where it can be: setting it to read it races other threads.
    try:
        status = Path("/proc/self/status").read_text()
        umask = int(re.search(r"^Umask:\s*([0-7]+)", status, re.MULTILINE).group(1), 8)
    except (OSError, AttributeError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


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


# Hidden files of a save in progress: temporaries `.{name}.XXXXXXXX.tmp` (mkstemp's eight
# random characters) and the commit journal. Only a save holding the directory's lock has
# any, so whatever matches when the lock is taken was left by a killed save.
TEMPORARY = re.compile(r"\..+\.[A-Za-z0-9_]{8}\.tmp")
JOURNAL = ".bert_port-commit.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _weights_name(name: str) -> bool:
    return name in (SAFE_WEIGHTS, SAFE_INDEX) or bool(_SHARD_NAME.fullmatch(name))


def _removable(name: str) -> bool:
    """Names a save may delete: safetensors weights of another layout, tokenizer files, and
    another model's sentence-transformers files and module folders. A journal naming
    anything else is not ours, and is refused rather than obeyed."""
    return _weights_name(name) or name in (*TOKENIZER_FILES, *ST_FILES) or bool(ST_FOLDER.fullmatch(name))


def _plain_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


class DirectoryLock:
    """An exclusive `flock` on the directory itself (no lock file is left behind), so that
    two processes or threads saving into one folder take turns instead of deleting each
    other's files. Filesystems without flock (some network mounts) save unlocked.

    Re-entrant within a thread: a fine-tuning run holds its `--output-dir` for the whole run
    and saves into it, and two `flock`s on one folder from one process would wait for each
    other forever (each `open` is its own lock owner). So the process takes the `flock`
    once per directory, other threads of the process wait on a `threading.RLock`, and the
    `flock` is dropped when the outermost holder releases. `blocking=False` raises
    `BlockingIOError` instead of waiting for another process."""

    _held: ClassVar[dict[tuple[int, int], list]] = {}  # (st_dev, st_ino) -> [RLock, fd or None, depth]
    _mutex = threading.Lock()

    def __init__(self, directory: str | os.PathLike, *, blocking: bool = True):
        st = os.stat(directory)
        self._key: tuple[int, int] | None = (st.st_dev, st.st_ino)
        with self._mutex:
            entry = self._held.setdefault(self._key, [threading.RLock(), None, 0])
        if not entry[0].acquire(blocking=blocking):
            self._key = None
            raise BlockingIOError(f"{directory} is locked by another thread of this process")
        try:
            if entry[2] == 0 and fcntl is not None:
                fd = os.open(directory, os.O_RDONLY)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
                except BlockingIOError:
                    os.close(fd)
                    raise
                except OSError as exc:
                    log.debug("cannot lock %s (%s); saving without a lock", directory, exc)
                entry[1] = fd
            entry[2] += 1
        except BaseException:
            entry[0].release()
            self._key = None
            raise

    def release(self) -> None:
        if self._key is None:
            return
        entry = self._held[self._key]
        entry[2] -= 1
        if entry[2] == 0 and entry[1] is not None:
            os.close(entry[1])  # closing the only descriptor drops the flock
            entry[1] = None
        entry[0].release()
        self._key = None


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP while the renames of a commit run, and deliver them
    after: a Ctrl-C then lands before the commit or after it, never halfway. Python runs
    signal handlers in the main thread only, so other threads have nothing to defer.
    SIGKILL cannot be deferred: the journal (see `StagedWrite.commit`) covers it."""
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


def _apply_journal(directory: Path) -> bool:
    """Carry out the journal's renames and deletions (idempotent), then delete it. Call with
    the directory's lock held."""
    journal = directory / JOURNAL
    if not journal.is_file():
        return False
    try:
        plan = json.loads(journal.read_text(encoding="utf-8"))
        renames, removals = plan["rename"], plan["remove"]
        valid = (
            isinstance(renames, list)
            and isinstance(removals, list)
            and all(isinstance(r, list) and len(r) == 2 and all(map(_plain_name, r)) for r in renames)
            and all(TEMPORARY.fullmatch(tmp) for tmp, _ in renames)
            and all(_plain_name(n) and _removable(n) for n in removals)
        )
    except (OSError, ValueError, KeyError, TypeError):
        valid = False
    if not valid:
        raise CheckpointError(
            f"{journal} is not a commit journal this package wrote (unreadable, or naming files outside its folder "
            "or files a save never deletes); nothing was changed. Delete it, then check the checkpoint files"
        )
    for tmp, target in renames:
        if (directory / tmp).is_file():
            os.replace(directory / tmp, directory / target)
    for name in removals:
        target = directory / name
        if target.is_dir() and not target.is_symlink():  # a sentence-transformers module folder
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
    _fsync_dir(directory)
    journal.unlink()
    return True


def recover(directory: str | os.PathLike) -> bool:
    """Finish a save that was killed (SIGKILL, power loss) after its commit point: the
    journal names the staged files still to rename and the old files still to delete, so
    the folder then holds the new checkpoint whole. Returns whether there was one. The
    loader calls it (as SQLite's readers roll back a hot journal), so that it never reads a
    mix of two saves; it needs write access only when there is something to finish."""
    directory = Path(directory)
    if not (directory / JOURNAL).is_file():
        return False
    try:
        lock = DirectoryLock(directory)
        try:
            done = _apply_journal(directory)  # False: the save we waited for finished it
        finally:
            lock.release()
    except OSError as exc:
        raise CheckpointError(
            f"{directory} holds a save that was interrupted after it committed ({JOURNAL}), and finishing it "
            f"failed ({exc}). Run the load again with write access to the folder, or save the model again"
        ) from None
    if done:
        log.warning("%s: finished a save that was interrupted after it committed", directory)
    return done


def tidy(directory: str | os.PathLike) -> tuple[int, int]:
    """Clean up after killed saves in `directory`: finish a save killed after its commit
    point (its staged files are the new checkpoint), then delete the temporaries of saves
    killed before theirs. Takes the directory's lock (re-entrant). Returns how many files
    it deleted and their total size in bytes."""
    directory = Path(directory)
    lock = DirectoryLock(directory)
    try:
        if _apply_journal(directory):
            log.warning("%s: finished a save that was interrupted after it committed", directory)
        count = size = 0
        for entry in os.scandir(directory):
            if TEMPORARY.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                size += entry.stat(follow_symlinks=False).st_size
                os.unlink(entry.path)
                count += 1
    finally:
        lock.release()
    if count:
        log.info("%s: removed %d temporaries of an interrupted save", directory, count)
    return count, size


class StagedWrite:
    """Write several files into `directory` as one unit, all or nothing.

    Each file is written to a hidden temporary beside its target (`.{name}.XXXXXXXX.tmp`)
    and flushed to disk. Leaving the block normally commits: a journal naming every rename
    and deletion is renamed into place (the commit point), then the staged files are renamed
    over their targets (shards before the index that names them, config last), the files
    scheduled with `remove` are deleted, and the journal goes. Signals are deferred during
    the commit, and a save killed after the commit point is finished by the next save or
    load (`recover`), so the folder never holds a mix of two saves. Before the commit point,
    failure deletes the temporaries and leaves the folder as it was.

    The directory is locked (`flock`) from construction to the end, so concurrent saves into
    one folder take turns; temporaries left by a killed save are deleted on entry."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._staged: dict[Path, Path] = {}  # target -> temporary
        self._remove: list[str] = []
        self.committed: list[Path] = []
        self._lock: DirectoryLock | None = DirectoryLock(self.directory)
        try:
            tidy(self.directory)
        except BaseException:
            self.close()
            raise

    def path(self, name: str) -> Path:
        """A fresh temporary path to write the file `name` to."""
        target = self.directory / name
        if target in self._staged:
            raise ValueError(f"{name} is staged twice")
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{name}.", suffix=".tmp")
        os.close(fd)
        self._staged[target] = Path(tmp)
        return Path(tmp)

    def text(self, name: str, text: str) -> None:
        self.path(name).write_text(text, encoding="utf-8")

    def copy(self, name: str, source: str | os.PathLike) -> None:
        shutil.copyfile(source, self.path(name))

    def remove(self, name: str) -> None:
        """Delete `name` from the directory as part of the commit (a file of the previous
        save that the new one does not replace, or a sentence-transformers module folder)."""
        if not _removable(name):
            raise ValueError(
                f"{name} is not a weights, tokenizer or sentence-transformers file; a save does not delete it"
            )
        if (self.directory / name) not in self._staged and name not in self._remove:
            self._remove.append(name)

    def commit(self) -> list[Path]:
        mode = _default_file_mode()
        for tmp in self._staged.values():
            _fsync(tmp)
            os.chmod(tmp, mode)
        # Config last: a reader that sees the new config sees the new weights.
        order = sorted(self._staged.items(), key=lambda item: item[0].name == CONFIG_NAME)
        plan = {
            "rename": [[tmp.name, target.name] for target, tmp in order],
            "remove": [n for n in self._remove if (self.directory / n).exists()],
        }
        fd, journal_tmp = tempfile.mkstemp(dir=self.directory, prefix=f"{JOURNAL}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(plan, f)
                f.flush()
                os.fsync(f.fileno())
            with _signals_deferred():
                os.replace(journal_tmp, self.directory / JOURNAL)  # the commit point
                # From here the temporaries belong to the journal: a failure below leaves them
                # for `recover` to rename, never for `discard` to delete.
                self.committed = [target for target, _ in order]
                self._staged.clear()
                _fsync_dir(self.directory)
                _apply_journal(self.directory)
        finally:
            Path(journal_tmp).unlink(missing_ok=True)
        return self.committed

    def discard(self) -> None:
        for tmp in self._staged.values():
            tmp.unlink(missing_ok=True)
        self._staged.clear()

    def close(self) -> None:
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


def parse_size(size: int | str) -> int:
    """`5GB`, `500MB`, `10KiB` or an int of bytes -> bytes. Decimal units as huggingface_hub's
    `parse_size_to_int` (`KB` = 1000), binary ones (`KiB` = 1024) as transformers also accepts."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B\s*", str(size).upper())
    if not match:
        raise ValueError(f"cannot parse size {size!r}; use e.g. '5GB', '500MB', '10KiB' or a byte count")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    return max(1, int(float(number) * base ** " KMGT".index(unit or " ")))


def _own_storage(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Contiguous CPU tensors, each with storage of its own: safetensors refuses tensors
    that share memory (tied weights, views into a fused buffer), so those are cloned."""
    out, seen = {}, set()
    for key, tensor in state_dict.items():
        tensor = tensor.detach().contiguous().cpu()
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
            storage = tensor.untyped_storage()
        seen.add(storage.data_ptr())
        out[key] = tensor
    return out


def stage_weights(stage: StagedWrite, state_dict: Mapping[str, Tensor], max_shard_size: int | str = "5GB") -> list[str]:
    """Stage `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` plus
    `model.safetensors.index.json` when the weights exceed `max_shard_size` (HF's names and
    index format, split by huggingface_hub as transformers splits them). Returns the file
    names staged, the index last."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    tensors = _own_storage(state_dict)
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=parse_size(max_shard_size))
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    names = []
    for name, keys in split.filename_to_tensors.items():
        save_file({k: tensors[k] for k in keys}, str(stage.path(name)), metadata=metadata)
        names.append(name)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        stage.text(SAFE_INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")
        names.append(SAFE_INDEX)
    for stale in stale_weights(stage.directory, names):
        stage.remove(stale)
    return names


def stale_weights(directory: Path, keep: Iterable[str]) -> list[str]:
    """The safetensors files of an earlier save in the other layout, which a save of `keep`
    must delete: the loaders (ours and transformers') prefer `model.safetensors` over an
    index, so a stale one would shadow the new shards, and stale shards would only waste
    space. PyTorch `.bin` files are left alone (they may be the user's original, with heads
    the new save dropped); safetensors takes precedence over them on load."""
    keep = set(keep)
    stale = [
        entry.name
        for entry in os.scandir(directory)
        if entry.name not in keep and entry.is_file() and _weights_name(entry.name)
    ]
    leftovers = [n for n in (PT_WEIGHTS, PT_INDEX) if (Path(directory) / n).is_file()]
    if leftovers:
        log.warning(
            "%s still holds %s from an earlier save; the new safetensors files take precedence on load",
            directory,
            ", ".join(leftovers),
        )
    return sorted(stale)


def write_weights(state_dict: Mapping[str, Tensor], directory: Path, max_shard_size: int | str = "5GB") -> list[Path]:
    """Write `model.safetensors`, or shards plus `model.safetensors.index.json` when the
    weights exceed `max_shard_size`, as one staged write (see `StagedWrite`) that also
    deletes stale safetensors files of a previous save in the other layout."""
    directory = Path(directory)
    with StagedWrite(directory) as stage:
        names = stage_weights(stage, state_dict, max_shard_size)
    return [directory / n for n in names]


# -----------------------------------------------------------------------------------------
# The NaN/Inf check
#
# Safetensors weights are memory-mapped, and a check that reads them through the mapping
# makes every page resident: loading bert-base then peaks at the whole file above what
# transformers needs (which touches the pages only at the first forward). So a tensor that
# `_read_safetensors` mapped, and that nothing has changed since, is checked from the file
# in chunks through one small buffer: the OS page cache serves them, and none stays in the
# process. Any other tensor is checked where it lies.

_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class _FileSpan:
    """Where a memory-mapped tensor's bytes lie: the file (and its identity when mapped),
    the offset of its first byte, and the tensor's version counter then (an in-place change
    bumps it, and the file no longer holds the tensor's values)."""

    path: str
    identity: tuple[int, int, int, int]
    offset: int
    version: int


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_ORIGINS = None


def _origins():
    """Tensor -> _FileSpan, holding no tensor alive (torch's dictionary keyed by tensor identity)."""
    global _ORIGINS
    if _ORIGINS is None:
        from torch.utils.weak import WeakTensorKeyDictionary

        _ORIGINS = WeakTensorKeyDictionary()
    return _ORIGINS


def _count_non_finite(tensor: Tensor) -> int:
    # aminmax propagates NaN and exposes +-Inf without materialising a mask the size of the
    # tensor (~10x faster than isfinite(t).all() on bert-base); the count only on failure.
    lo, hi = torch.aminmax(tensor)
    if bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return 0
    return int((~torch.isfinite(tensor)).sum())


def _count_in_file(tensor: Tensor, span: _FileSpan, buffer: bytearray) -> int | None:
    """Non-finite values of a mapped tensor, read from its file chunk by chunk; None when
    the file is not what was mapped any more (then the caller checks the tensor itself)."""
    try:
        with open(span.path, "rb", buffering=0) as f:
            if _identity(os.fstat(f.fileno())) != span.identity:
                return None
            size = tensor.element_size()
            nbytes, step = tensor.numel() * size, len(buffer) - len(buffer) % size
            bad = 0
            for start in range(0, nbytes, step):
                n = min(step, nbytes - start)
                f.seek(span.offset + start)
                if f.readinto(memoryview(buffer)[:n]) != n:
                    return None
                bad += _count_non_finite(torch.frombuffer(buffer, dtype=tensor.dtype, count=n // size))
            return bad
    except OSError:
        return None


def non_finite(state_dict: Mapping[str, Tensor]) -> list[str]:
    """Names of floating tensors holding NaN or Inf, each with how many values."""
    bad, buffer = [], None
    for key, tensor in state_dict.items():
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        span = _origins().get(tensor) if tensor.device.type == "cpu" else None
        count = None
        if span is not None and span.version == tensor._version and tensor.is_contiguous():
            buffer = buffer or bytearray(_CHUNK_BYTES)
            count = _count_in_file(tensor, span, buffer)
        if count is None:
            count = _count_non_finite(tensor)
        if count:
            bad.append(f"{key} ({count} of {tensor.numel()} values NaN/Inf)")
    return bad


def human_bytes(n: int) -> str:
    if n <= 0:
        return "0 B"
    k = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**k:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][k]}"
