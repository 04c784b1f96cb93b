"""Finding a checkpoint's files: a directory, a weights file, or a model id in the local
Hugging Face cache, found through huggingface_hub and never over the network.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..storage import bounded
from ..storage.errors import CheckpointError, link_loop
from ..storage.names import CONFIG_NAME, WEIGHT_NAMES


@dataclass
class CheckpointFiles:
    directory: Path  # where config, tokenizer files and shards live
    config_file: Path
    weights_file: Path  # a weights file or an index


def hf_cache_dir() -> tuple[Path, str]:
    """The hub cache directory, and the rule that chose it, computed as
    `huggingface_hub.constants.HF_HUB_CACHE` is: `HF_HUB_CACHE`, else the legacy
    `HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`,
    else `~/.cache/huggingface/hub`, with `~` and `$VARS` expanded.

    Computed here rather than read from huggingface_hub, for two reasons: its constant is
    fixed when huggingface_hub is first imported (a later change of the environment would
    not count), and an error must say which variable chose the folder. One difference: a
    variable set to the empty string counts as unset here (huggingface_hub would take ""
    and search the working directory)."""
    env = os.environ.get
    if env("HF_HUB_CACHE"):
        raw, rule = env("HF_HUB_CACHE"), "HF_HUB_CACHE"
    elif env("HUGGINGFACE_HUB_CACHE"):
        raw, rule = env("HUGGINGFACE_HUB_CACHE"), "HUGGINGFACE_HUB_CACHE"
    elif env("HF_HOME"):
        raw, rule = os.path.join(env("HF_HOME"), "hub"), "HF_HOME"
    elif env("XDG_CACHE_HOME"):
        raw, rule = os.path.join(env("XDG_CACHE_HOME"), "huggingface", "hub"), "XDG_CACHE_HOME"
    else:
        raw, rule = os.path.join("~", ".cache", "huggingface", "hub"), "the default, no HF_* variable set"
    return Path(os.path.expandvars(os.path.expanduser(raw))), rule


def is_repo_id(name: str) -> bool:
    """Whether `name` is a valid hub id (`name` or `org/name`), by huggingface_hub's own rule."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _is_ref_name(revision: str) -> bool:
    """A ref name or commit that stays inside `refs/` and `snapshots/`: relative, no `..`
    or empty parts, no backslash or NUL."""
    if not isinstance(revision, str) or not revision or "\\" in revision or "\0" in revision:
        return False
    parts = revision.split("/")
    return not revision.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def find_in_hf_cache(model_id: str, revision: str = "main", cache_dir: str | os.PathLike | None = None) -> Path:
    """The snapshot directory of `model_id` in the local HF cache, without any network.

    The lookup is huggingface_hub's `try_to_load_from_cache` (a ref names a commit, the
    commit must be a listed snapshot), asked for `config.json` and each weights name. Not
    `snapshot_download(local_files_only=True)`: it joins a ref's content to the snapshots
    folder unchecked, so a ref holding `../../..` would lead out of the cache. When nothing
    is found, the cache is inspected only to say why: `CheckpointError` names the folders
    searched, the variable that chose the cache, and the refs and snapshots there.
    `cache_dir` (transformers' argument of that name) replaces the cache the environment names."""
    from huggingface_hub import try_to_load_from_cache

    if cache_dir is not None:
        cache, rule = Path(cache_dir).expanduser(), "the cache_dir argument"
    else:
        cache, rule = hf_cache_dir()
    # A revision is a ref name (`main`, `refs/pr/1`) or a commit hash: neither may lead out of
    # the repo's folder (huggingface_hub would look for it, harmlessly, but say nothing).
    if not _is_ref_name(revision):
        raise CheckpointError(
            f"revision {revision!r} is not a ref name or commit hash (it is empty, absolute, or has a '..' part); "
            "use a branch such as 'main' or a commit hash",
            hint="Pass {}",
            argument="revision",
            value="main",
        )
    for name in (CONFIG_NAME, *WEIGHT_NAMES):
        found = try_to_load_from_cache(model_id, name, cache_dir=str(cache), revision=revision)
        if isinstance(found, str):  # not None, nor the "known not to exist" marker
            return Path(found).parent
    raise _why_not_in_cache(model_id, revision, cache, rule)


def _why_not_in_cache(model_id: str, revision: str, cache: Path, rule: str) -> CheckpointError:
    """The error for a model id the cache lookup did not find, saying what the cache holds."""
    repo = cache / ("models--" + model_id.replace("/", "--"))
    not_local = f"{model_id!r} is not a local path ({Path(model_id).absolute()} does not exist)"
    fix = (
        f"Pass a checkpoint directory, point HF_HUB_CACHE or HF_HOME at the cache that holds the model, or "
        f"download it on a machine with network access (`hf download {model_id}`) and copy the cache over."
    )
    if not repo.is_dir():
        return CheckpointError(
            f"{not_local} and the Hugging Face cache has no copy of it: searched {repo} "
            f"(cache {cache}, chosen by {rule}). {fix}"
        )
    ref = repo / "refs" / revision
    try:
        commit = bounded.read_text(ref, bounded.SMALL, repo) if ref.is_file() else revision
    except (OSError, UnicodeDecodeError) as exc:
        return CheckpointError(f"cannot read the cache ref {ref} ({exc}); download the model again")
    if ref.is_file() and not (_is_ref_name(commit) and "/" not in commit and commit == commit.strip()):
        return CheckpointError(
            f"the cache ref {ref} holds {commit[:80]!r}, not a commit hash; the cache is damaged: download the "
            f"model again (`hf download {model_id}`)"
        )
    snapshots_dir, snapshot = repo / "snapshots", repo / "snapshots" / commit
    try:
        snapshots = sorted(os.listdir(snapshots_dir)) if snapshots_dir.is_dir() else []
    except OSError as exc:
        return CheckpointError(f"cannot list {snapshots_dir} ({exc})")
    if commit in snapshots and snapshot.is_dir():
        present = sorted(p.name for p in snapshot.iterdir())[:20]
        return CheckpointError(
            f"the cached snapshot {snapshot} of {model_id!r} holds no weights: expected one of "
            f"{', '.join(WEIGHT_NAMES)}; found {present}. The download is incomplete: download the model again"
        )
    refs = sorted(p.name for p in (repo / "refs").glob("*")) if (repo / "refs").is_dir() else []
    where = (
        f"{ref} points at {commit}, but {snapshot} does not exist (an interrupted download?)"
        if ref.is_file()
        else f"there is no {ref} and no snapshot named {revision!r}"
    )
    return CheckpointError(
        f"{not_local} and the Hugging Face cache at {repo} (cache chosen by {rule}) has no snapshot for revision "
        f"{revision!r}: {where}. Refs there: {refs or 'none'}; snapshots: {snapshots or 'none'}. {fix}"
    )


def locate_checkpoint(
    path: str | os.PathLike,
    config_file: str | os.PathLike | None = None,
    revision: str = "main",
    cache_dir: str | os.PathLike | None = None,
) -> CheckpointFiles:
    """Resolve a directory, a weights file, or a model id from the HF cache to files.
    A string that is not an existing path and looks like a hub id (`name` or `org/name`)
    is looked up in the cache (`cache_dir`, else the one the environment names); `revision`
    picks the ref (or commit) there."""
    try:
        return _locate_checkpoint(path, config_file, revision, cache_dir)
    except OSError as exc:  # a folder or file we may not read (permissions), a name too long, ...
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None


def _weights_in(folder: Path, asked: str, cached: bool) -> Path:
    """The folder's weights file, in `WEIGHT_NAMES`' order of preference. A preferred name
    that is there but is no readable file (a dangling link, a folder) is an error, not a
    reason to fall back to a stale file of a lower preference."""
    where = f"the cached snapshot {folder} of {asked!r}" if cached else str(folder)
    # A cache snapshot is what a download left: without its weights it is an incomplete one.
    fix = "The download is incomplete: download the model again" if cached else "Copy the weights file again"
    for name in WEIGHT_NAMES:
        candidate = folder / name
        # One stat per name: a save renaming files meanwhile (loads locate once outside the
        # folder's lock, to find it) must not make a file look like something else.
        try:
            if stat.S_ISREG(os.stat(candidate).st_mode):
                return candidate
            what = "not a regular file"
        except FileNotFoundError:
            if not candidate.is_symlink():
                continue
            what = "a link to a file that does not exist"
        except OSError as exc:
            if link_loop(candidate) is None:
                raise
            what = f"a symbolic link loop ({exc.strerror})"
        raise CheckpointError(f"{where}: {name} is {what}, so the weights cannot be read. {fix}")
    present = sorted(x.name for x in folder.iterdir())[:20]
    raise CheckpointError(
        f"{where} holds no weights: expected one of {', '.join(WEIGHT_NAMES)}; found {present}."
        + (f" {fix}" if cached else "")
    )


def checkpoint_folder(
    path: str | os.PathLike, revision: str = "main", cache_dir: str | os.PathLike | None = None
) -> Path:
    """The folder a checkpoint's files live in, without looking at which weights it holds:
    a directory, a weights file's parent, or the snapshot of a model id in the HF cache.
    Loads take this folder's shared lock first and only then `locate_checkpoint` the files,
    so a save renaming one layout's weights over another's is never seen half done."""
    try:
        p, _ = _resolve(path, revision, cache_dir)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None
    return p if p.is_dir() else p.parent


def _resolve(path: str | os.PathLike, revision: str, cache_dir: str | os.PathLike | None) -> tuple[Path, bool]:
    """An existing path, or a model id's cache snapshot; and whether it came from the cache."""
    if isinstance(path, str) and "\0" in path:
        raise CheckpointError(f"no checkpoint at {path!r}: a path cannot hold a NUL character")
    p = Path(path).expanduser()
    if p.exists():
        return p, False
    loop = link_loop(p)
    if loop is not None:
        raise loop
    if isinstance(path, str) and is_repo_id(path):
        return find_in_hf_cache(path, revision, cache_dir), True
    raise CheckpointError(f"no checkpoint at {p}: the path does not exist")


def _locate_checkpoint(
    path: str | os.PathLike, config_file: str | os.PathLike | None, revision: str, cache_dir: str | os.PathLike | None
) -> CheckpointFiles:
    p, cached = _resolve(path, revision, cache_dir)
    if p.is_dir():
        weights, directory = _weights_in(p, str(path), cached), p
    else:
        weights, directory = p, p.parent
    config = Path(config_file) if config_file is not None else directory / CONFIG_NAME
    loop = link_loop(config)
    if loop is not None:
        raise loop
    if not config.is_file():
        raise CheckpointError(
            f"no config for checkpoint {weights}: expected {config}. Put the model's config.json beside the weights",
            hint="or pass {}",
            argument="config_file",
        )
    return CheckpointFiles(directory=directory, config_file=config, weights_file=weights)
