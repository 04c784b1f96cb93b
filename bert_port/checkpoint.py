"""Checkpoints: the HF <-> port key table, key normalisation, reading and writing files,
and finding checkpoints in the local Hugging Face cache.

The conversions are pure functions (state dict in, state dict out). File I/O lives in the
`read_*` / `write_*` functions below them, and never in the model.
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
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

try:
    import fcntl
except ImportError:  # Windows: saves run unlocked there
    fcntl = None

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

log = logging.getLogger(__name__)

# -----------------------------------------------------------------------------------------
# The key table: Hugging Face BertModel name -> port name, "{}" standing for the layer index.
# This is the only place names are spelled out; the inverse is derived from it.

HF_TO_PORT: dict[str, str] = {
    "embeddings.word_embeddings.weight": "word_embedding.weight",
    "embeddings.position_embeddings.weight": "pos_embedding.weight",
    "embeddings.token_type_embeddings.weight": "tk_type_embedding.weight",
    "embeddings.LayerNorm.weight": "embed_layer_norm.weight",
    "embeddings.LayerNorm.bias": "embed_layer_norm.bias",
    "encoder.layer.{}.attention.self.query.weight": "bert_layers.{}.self_attention.query.weight",
    "encoder.layer.{}.attention.self.query.bias": "bert_layers.{}.self_attention.query.bias",
    "encoder.layer.{}.attention.self.key.weight": "bert_layers.{}.self_attention.key.weight",
    "encoder.layer.{}.attention.self.key.bias": "bert_layers.{}.self_attention.key.bias",
    "encoder.layer.{}.attention.self.value.weight": "bert_layers.{}.self_attention.value.weight",
    "encoder.layer.{}.attention.self.value.bias": "bert_layers.{}.self_attention.value.bias",
    "encoder.layer.{}.attention.output.dense.weight": "bert_layers.{}.attention_dense.weight",
    "encoder.layer.{}.attention.output.dense.bias": "bert_layers.{}.attention_dense.bias",
    "encoder.layer.{}.attention.output.LayerNorm.weight": "bert_layers.{}.attention_layer_norm.weight",
    "encoder.layer.{}.attention.output.LayerNorm.bias": "bert_layers.{}.attention_layer_norm.bias",
    "encoder.layer.{}.intermediate.dense.weight": "bert_layers.{}.interm_dense.weight",
    "encoder.layer.{}.intermediate.dense.bias": "bert_layers.{}.interm_dense.bias",
    "encoder.layer.{}.output.dense.weight": "bert_layers.{}.out_dense.weight",
    "encoder.layer.{}.output.dense.bias": "bert_layers.{}.out_dense.bias",
    "encoder.layer.{}.output.LayerNorm.weight": "bert_layers.{}.out_layer_norm.weight",
    "encoder.layer.{}.output.LayerNorm.bias": "bert_layers.{}.out_layer_norm.bias",
    "pooler.dense.weight": "pooler_dense.weight",
    "pooler.dense.bias": "pooler_dense.bias",
}
PORT_TO_HF: dict[str, str] = {v: k for k, v in HF_TO_PORT.items()}
if len(PORT_TO_HF) != len(HF_TO_PORT):
    raise ImportError("checkpoint.HF_TO_PORT must be one-to-one: two HF names map to the same port name")

# Keys that real checkpoints carry and the encoder does not need. Buffers are accepted
# silently; pretraining heads are dropped and reported.
BUFFER_KEYS = ("embeddings.position_ids", "embeddings.token_type_ids")
DROPPED_PREFIXES = ("cls.predictions.", "cls.seq_relationship.")
# Wrappers that training code puts around a model: DDP, torch.compile, HF task models.
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "bert.")
# Keys of task heads that sit beside the encoder and keep their names in both layouts
# (issue 13: the MLM / NSP heads `cls.*` and the QA head `qa_outputs.*` joined `classifier.*`;
# which model owns which head is said by the model classes in heads.py / classifier.py).
HEAD_PREFIXES = ("classifier.", "qa_outputs.", "cls.")

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


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


def _map_key(key: str, table: Mapping[str, str]) -> str | None:
    """Look `key` up in a `{}`-templated table; None when it has no entry."""
    match = _LAYER_INDEX.search(key)
    if match is None:
        return table.get(key)
    template = table.get(key[: match.start()] + ".{}." + key[match.end() :])
    return None if template is None else template.format(match.group(1))


# -----------------------------------------------------------------------------------------
# Pure conversions


@dataclass(frozen=True)
class Layout:
    """How a checkpoint file spells HF names: the wrapper prefix before the encoder's keys
    (`bert.` in bert-base-uncased, `module.` from DDP, ...) and whether its LayerNorms use
    the TF-era `gamma`/`beta`. Sniffed from the file's keys, to name in an error a tensor
    the file lacks as the file would have named it."""

    prefix: str = ""
    legacy_layer_norm: bool = False

    def spell(self, port_key: str) -> str:
        """The name a port key (without a task model's `bert.`) has in a file of this layout."""
        if port_key.startswith(HEAD_PREFIXES):  # heads sit beside the encoder, not under its `bert.`
            return self.prefix.removesuffix("bert.") + port_key
        hf_key = _map_key(port_key, PORT_TO_HF) or port_key
        if self.legacy_layer_norm and hf_key.endswith(("LayerNorm.weight", "LayerNorm.bias")):
            hf_key = hf_key.rsplit(".", 1)[0] + (".gamma" if hf_key.endswith("weight") else ".beta")
        return self.prefix + hf_key


@dataclass
class Conversion:
    """The result of converting a checkpoint's keys: tensors under port names, plus what
    was dropped on the way and what could not be placed."""

    state_dict: dict[str, Tensor]
    dropped: list[str] = field(default_factory=list)  # pretraining heads, reported at INFO
    unmapped: list[str] = field(default_factory=list)  # keys with no entry in the table
    buffers: list[str] = field(default_factory=list)  # position_ids / token_type_ids buffers, skipped
    renamed: dict[str, str] = field(default_factory=dict)  # raw key -> HF name, where they differ
    sources: dict[str, str] = field(default_factory=dict)  # key in state_dict -> the key in the file
    layout: Layout = field(default_factory=Layout)  # how the file spells names, for messages


def _split_prefix(key: str) -> tuple[str, str]:
    """(wrapper prefixes, the rest): `module.bert.encoder...` -> (`module.bert.`, `encoder...`)."""
    prefix, stripped = "", True
    while stripped:
        stripped = False
        for wrapper in WRAPPER_PREFIXES:
            if key.startswith(wrapper):
                prefix, key, stripped = prefix + wrapper, key[len(wrapper) :], True
    return prefix, key


def detect_layout(keys: Iterable[str]) -> Layout:
    """The layout of a file from its keys: the wrapper prefix most of its encoder keys carry,
    and gamma/beta when most of its LayerNorm keys use them."""
    prefixes: Counter[str] = Counter()
    legacy = modern = 0
    for raw in keys:
        prefix, rest = _split_prefix(raw)
        if _map_key(normalize_hf_key(rest), HF_TO_PORT) is not None:
            prefixes[prefix] += 1
        if rest.endswith(("LayerNorm.gamma", "LayerNorm.beta")):
            legacy += 1
        elif rest.endswith(("LayerNorm.weight", "LayerNorm.bias")):
            modern += 1
    return Layout(prefix=prefixes.most_common(1)[0][0] if prefixes else "", legacy_layer_norm=legacy > modern)


def normalize_hf_key(key: str) -> str:
    """Bring one incoming key to the bare HF BertModel name (`embeddings...`,
    `encoder.layer.N...`, `pooler...`): strip wrapper prefixes, rename the legacy
    TF-era `LayerNorm.gamma/beta` to `weight/bias`."""
    key = _split_prefix(key)[1]
    if key.endswith("LayerNorm.gamma"):
        key = key[: -len("gamma")] + "weight"
    elif key.endswith("LayerNorm.beta"):
        key = key[: -len("beta")] + "bias"
    return key


def hf_to_port(state_dict: Mapping[str, Tensor], keep_heads: tuple[str, ...] = ()) -> Conversion:
    """Convert any HF BERT state dict (BertModel, BertForPreTraining, BertFor*, bare
    sentence-transformers, legacy gamma/beta) to port names. Task-head keys such as
    `classifier.*` keep their names. Pretraining-head keys (`cls.*`) are dropped unless
    they start with one of `keep_heads`, the heads of the model being loaded (issue 13)."""
    out = Conversion(state_dict={}, layout=detect_layout(state_dict))
    for raw_key, tensor in state_dict.items():
        key = normalize_hf_key(raw_key)
        if key != raw_key:
            out.renamed[raw_key] = key
        if key in BUFFER_KEYS:
            out.buffers.append(raw_key)
            continue
        if key.startswith(DROPPED_PREFIXES) and not key.startswith(keep_heads):
            out.dropped.append(raw_key)
            continue
        if key.startswith(HEAD_PREFIXES):
            new_key = key
        else:
            new_key = _map_key(key, HF_TO_PORT)
        if new_key is None:
            out.unmapped.append(raw_key)
            new_key = raw_key  # kept under its own name so the load error can list it
        if new_key in out.state_dict:
            raise CheckpointError(
                f"checkpoint has two tensors for {new_key!r} (one of them {raw_key!r}); "
                "it mixes layouts, so re-export it from its source"
            )
        out.state_dict[new_key] = tensor
        out.sources[new_key] = raw_key
    if out.dropped:
        log.info(
            "dropped %d pretraining-head tensors not used by the encoder: %s",
            len(out.dropped),
            ", ".join(sorted(out.dropped)),
        )
    return out


def layer_indices(state_dict: Iterable[str]) -> set[int]:
    """The encoder layer indices a state dict (any layout) has tensors for."""
    out = set()
    for raw in state_dict:
        match = re.match(r"encoder\.layer\.(\d+)\.", normalize_hf_key(raw))
        if match:
            out.add(int(match.group(1)))
    return out


def check_layer_count(state_dict: Iterable[str], num_hidden_layers: int, source: str) -> None:
    """Raise `CheckpointError` when the config asks for layers the checkpoint lacks, before any
    module is built: a config claiming 100000 layers would otherwise build them all
    (minutes, gigabytes) only to report every one missing. Layers the file has beyond the
    config's cost nothing to build against and are listed by the load's usual error."""
    have = layer_indices(state_dict)
    if set(range(num_hidden_layers)) <= have:
        return
    found = sorted(have)
    shown = (
        f"layers {short_list([str(i) for i in found], 10)}"
        if found
        else "no encoder layers (no key like encoder.layer.0.*)"
    )
    raise CheckpointError(
        f"cannot load {source}: config.json gives num_hidden_layers={num_hidden_layers}, but the checkpoint has "
        f"tensors for {shown} ({len(found)} in all). Check that the config belongs to these weights. "
        "Nothing was loaded"
    )


def port_to_hf(state_dict: Mapping[str, Tensor], encoder_prefix: str = "") -> dict[str, Tensor]:
    """Inverse of `hf_to_port` for a port state dict. Encoder keys get HF names with
    `encoder_prefix` (``""`` for BertModel, ``"bert."`` for task models); head keys keep
    their names."""
    out = {}
    for key, tensor in state_dict.items():
        if key.startswith(HEAD_PREFIXES):
            out[key] = tensor
            continue
        hf_key = _map_key(key, PORT_TO_HF)
        if hf_key is None:
            raise KeyError(f"port key {key!r} has no entry in the key table (checkpoint.HF_TO_PORT)")
        out[encoder_prefix + hf_key] = tensor
    return out


# -----------------------------------------------------------------------------------------
# Locating checkpoints

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


@dataclass
class CheckpointFiles:
    directory: Path  # where config, tokenizer files and shards live
    config_file: Path
    weights_file: Path  # a weights file or an index


def hf_cache_dir() -> tuple[Path, str]:
    """The hub cache directory, and the rule that chose it, computed as
    `huggingface_hub.constants.HF_HUB_CACHE` is: `HF_HUB_CACHE`, else the legacy
    `HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`,
    else `~/.cache/huggingface/hub`, with `~` and `$VARS` expanded. One difference: a
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


# A hub repo id: `name` or `org/name` of word characters, `-` and `.` (huggingface_hub's
# validate_repo_id also rejects `--` and `..`, which would break the cache folder name).
_REPO_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def is_repo_id(name: str) -> bool:
    return bool(_REPO_ID.fullmatch(name)) and "--" not in name and ".." not in name and not name.startswith(".")


def _is_ref_name(revision: str) -> bool:
    """A ref name or commit that stays inside `refs/` and `snapshots/`: relative, no `..`
    or empty parts, no backslash or NUL."""
    if not isinstance(revision, str) or not revision or "\\" in revision or "\0" in revision:
        return False
    parts = revision.split("/")
    return not revision.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def find_in_hf_cache(model_id: str, revision: str = "main") -> Path:
    """The snapshot directory of `model_id` in the local HF cache, without any network.

    Follows the hub cache layout (huggingface_hub's `try_to_load_from_cache`):
    `models--{org}--{name}/refs/{revision}` holds a commit hash and
    `snapshots/{hash}/` the files; a revision with no ref file is taken as a commit hash.
    Raises `CheckpointError` naming the directories searched and what was found there.
    """
    cache, rule = hf_cache_dir()
    repo = cache / ("models--" + model_id.replace("/", "--"))
    not_local = f"{model_id!r} is not a local path ({Path(model_id).absolute()} does not exist)"
    fix = (
        f"Pass a checkpoint directory, point HF_HUB_CACHE or HF_HOME at the cache that holds the model, or "
        f"download it on a machine with network access (`hf download {model_id}`) and copy the cache over."
    )
    if not repo.is_dir():
        raise CheckpointError(
            f"{not_local} and the Hugging Face cache has no copy of it: searched {repo} "
            f"(cache {cache}, chosen by {rule}). {fix}"
        )
    # A revision is a ref name (`main`, `refs/pr/1`) or a commit hash, and a ref file holds a
    # commit hash: neither may lead out of the repo's folder. As huggingface_hub's
    # try_to_load_from_cache does, the commit is used only if it names an existing snapshot.
    if not _is_ref_name(revision):
        raise CheckpointError(
            f"revision {revision!r} is not a ref name or commit hash (it is empty, absolute, or has a '..' part); "
            "use a branch such as 'main' or a commit hash",
            hint="Pass {}",
            argument="revision",
            value="main",
        )
    ref = repo / "refs" / revision
    try:
        commit = ref.read_text(encoding="utf-8").strip() if ref.is_file() else revision
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read the cache ref {ref} ({exc}); download the model again") from None
    if ref.is_file() and not (_is_ref_name(commit) and "/" not in commit):
        raise CheckpointError(
            f"the cache ref {ref} holds {commit[:80]!r}, not a commit hash; the cache is damaged: download the "
            f"model again (`hf download {model_id}`)"
        )
    snapshots_dir = repo / "snapshots"
    try:
        listed = set(os.listdir(snapshots_dir)) if snapshots_dir.is_dir() else set()
    except OSError as exc:
        raise CheckpointError(f"cannot list {snapshots_dir} ({exc})") from None
    snapshot = snapshots_dir / commit
    if commit in listed and snapshot.is_dir():
        return snapshot
    snapshots = sorted(p.name for p in (repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
    refs = sorted(p.name for p in (repo / "refs").glob("*")) if (repo / "refs").is_dir() else []
    where = (
        f"{ref} points at {commit}, but {snapshot} does not exist (an interrupted download?)"
        if ref.is_file()
        else f"there is no {ref} and no snapshot named {revision!r}"
    )
    raise CheckpointError(
        f"{not_local} and the Hugging Face cache at {repo} (cache chosen by {rule}) has no snapshot for revision "
        f"{revision!r}: {where}. Refs there: {refs or 'none'}; snapshots: {snapshots or 'none'}. {fix}"
    )


def locate_checkpoint(
    path: str | os.PathLike, config_file: str | os.PathLike | None = None, revision: str = "main"
) -> CheckpointFiles:
    """Resolve a directory, a weights file, or a model id from the HF cache to files.
    A string that is not an existing path and looks like a hub id (`name` or `org/name`)
    is looked up in the cache; `revision` picks the ref (or commit) there."""
    try:
        return _locate_checkpoint(path, config_file, revision)
    except OSError as exc:  # a folder or file we may not read (permissions), a name too long, ...
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None


def _locate_checkpoint(
    path: str | os.PathLike, config_file: str | os.PathLike | None, revision: str
) -> CheckpointFiles:
    if isinstance(path, str) and "\0" in path:
        raise CheckpointError(f"no checkpoint at {path!r}: a path cannot hold a NUL character")
    p = Path(path).expanduser()
    if not p.exists():
        if isinstance(path, str) and is_repo_id(path):
            p = find_in_hf_cache(path, revision)
        else:
            raise CheckpointError(f"no checkpoint at {p}: the path does not exist")
    recover(p if p.is_dir() else p.parent)  # a save killed mid-commit is finished first
    if p.is_dir():
        weights = next((p / name for name in WEIGHT_NAMES if (p / name).is_file()), None)
        if weights is None:
            present = sorted(x.name for x in p.iterdir())[:20]
            raise CheckpointError(f"{p} holds no weights: expected one of {', '.join(WEIGHT_NAMES)}; found {present}")
        directory = p
    else:
        weights, directory = p, p.parent
    config = Path(config_file) if config_file is not None else directory / CONFIG_NAME
    if not config.is_file():
        raise CheckpointError(
            f"no config for checkpoint {weights}: expected {config}. Put the model's config.json beside the weights",
            hint="or pass {}",
            argument="config_file",
        )
    return CheckpointFiles(directory=directory, config_file=config, weights_file=weights)


# -----------------------------------------------------------------------------------------
# Reading


def _unreadable(path: Path, exc: OSError) -> CheckpointError:
    """A file the OS will not give us (permissions, a directory, an I/O error), as opposed
    to one whose bytes are wrong."""
    return CheckpointError(
        f"cannot read {path}: {exc.strerror or exc}. Check that the file exists and that you may read it"
    )


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except OSError as exc:
        raise _unreadable(path, exc) from None
    except (SafetensorError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({exc}). It is probably truncated or "
            "corrupt: download or copy it again"
        ) from None


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


def short_list(names: list[str], limit: int = 20) -> str:
    """The first `limit` names, and how many more: an error stays readable however many."""
    shown = ", ".join(names[:limit])
    return shown + (f", ... and {len(names) - limit} more" if len(names) > limit else "")


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


def _removable(name: str) -> bool:
    """Names a save may delete: safetensors weights of another layout and tokenizer files.
    A journal naming anything else is not ours, and is refused rather than obeyed."""
    return name in (SAFE_WEIGHTS, SAFE_INDEX, *TOKENIZER_FILES) or bool(_SHARD_NAME.fullmatch(name))


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
        (directory / name).unlink(missing_ok=True)
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
        save that the new one does not replace)."""
        if not _removable(name):
            raise ValueError(f"{name} is not a weights or tokenizer file; a save does not delete it")
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


def shard_state_dict(state_dict: Mapping[str, Tensor], max_bytes: int) -> list[dict[str, Tensor]]:
    """Split into consecutive shards of at most `max_bytes` (a larger tensor gets its own)."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for key, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards


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
    index format). Returns the file names staged, the index last."""
    from safetensors.torch import save_file

    tensors = _own_storage(state_dict)
    shards = shard_state_dict(tensors, parse_size(max_shard_size))
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        save_file(shards[0], str(stage.path(SAFE_WEIGHTS)), metadata=metadata)
        names = [SAFE_WEIGHTS]
        for stale in stale_weights(stage.directory, names):
            stage.remove(stale)
        return names
    names, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(stage.path(name)), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
        names.append(name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
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
        if entry.name not in keep and entry.is_file() and _removable(entry.name) and entry.name not in TOKENIZER_FILES
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


def non_finite(state_dict: Mapping[str, Tensor]) -> list[str]:
    """Names of floating tensors holding NaN or Inf."""
    bad = []
    for key, tensor in state_dict.items():
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        # aminmax propagates NaN and exposes +-Inf without materialising a mask the size of
        # the tensor: ~10x faster than isfinite(t).all() on bert-base; the count is only
        # computed for a tensor that fails.
        lo, hi = torch.aminmax(tensor)
        if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
            n = int((~torch.isfinite(tensor)).sum())
            bad.append(f"{key} ({n} of {tensor.numel()} values NaN/Inf)")
    return bad


def human_bytes(n: int) -> str:
    if n <= 0:
        return "0 B"
    k = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**k:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][k]}"
