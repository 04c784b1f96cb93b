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
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

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
# Keys of task heads that sit beside the encoder and keep their names in both layouts.
HEAD_PREFIXES = ("classifier.",)

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


def hf_to_port(state_dict: Mapping[str, Tensor]) -> Conversion:
    """Convert any HF BERT state dict (BertModel, BertForPreTraining, BertFor*, bare
    sentence-transformers, legacy gamma/beta) to port names. Task-head keys such as
    `classifier.*` keep their names."""
    out = Conversion(state_dict={}, layout=detect_layout(state_dict))
    for raw_key, tensor in state_dict.items():
        key = normalize_hf_key(raw_key)
        if key != raw_key:
            out.renamed[raw_key] = key
        if key in BUFFER_KEYS:
            out.buffers.append(raw_key)
            continue
        if key.startswith(DROPPED_PREFIXES):
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
        log.info("dropped %d pretraining-head tensors not used by the encoder: %s",
                 len(out.dropped), ", ".join(sorted(out.dropped)))  # fmt: skip
    return out


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
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "added_tokens.json",
)  # fmt: skip


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
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo / "snapshots" / commit
    if snapshot.is_dir():
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
    p = Path(path).expanduser()
    if not p.exists():
        if isinstance(path, str) and is_repo_id(path):
            p = find_in_hf_cache(path, revision)
        else:
            raise CheckpointError(f"no checkpoint at {p}: the path does not exist")
    if p.is_dir():
        weights = next((p / name for name in WEIGHT_NAMES if (p / name).is_file()), None)
        if weights is None:
            present = sorted(x.name for x in p.iterdir())[:20]
            raise CheckpointError(
                f"{p} holds no weights: expected one of {', '.join(WEIGHT_NAMES)}; found {present}"
            )
        directory = p
    else:
        weights, directory = p, p.parent
    config = Path(config_file) if config_file is not None else directory / CONFIG_NAME
    if not config.is_file():
        raise CheckpointError(
            f"no config for checkpoint {weights}: expected {config}. Put the model's config.json beside the weights",
            hint="or pass {}", argument="config_file",
        )  # fmt: skip
    return CheckpointFiles(directory=directory, config_file=config, weights_file=weights)


# -----------------------------------------------------------------------------------------
# Reading


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
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


def _read_index(path: Path) -> dict[str, Tensor]:
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"{path} is not a valid shard index ({type(exc).__name__}: {exc}); it must be a JSON object whose "
            "'weight_map' maps each tensor name to a shard file name. Restore it from the original checkpoint"
        ) from None
    # Shards live beside the index; a name that leaves the directory is not a shard.
    bad = [s for s in shards if not isinstance(s, str) or Path(s).name != s or s in ("", ".", "..")]
    if bad:
        raise CheckpointError(f"shard index {path} names shards outside its directory: {bad[:5]}")
    missing = [s for s in shards if not (path.parent / s).is_file()]
    if missing:
        raise CheckpointError(
            f"shard index {path} names {len(missing)} shard file(s) that are not in {path.parent}: "
            f"{', '.join(missing)}. The download or copy is incomplete: fetch the missing shards"
        )
    state: dict[str, Tensor] = {}
    for shard in shards:
        state.update(read_weights(path.parent / shard))
    absent = sorted(set(weight_map) - set(state))
    if absent:
        raise CheckpointError(
            f"shard index {path} lists {len(absent)} tensor(s) its shards lack: {', '.join(absent[:10])}. "
            "The index and shards come from different saves: fetch them again together"
        )
    return state


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
        umask = int(re.search(r"^Umask:\s*([0-7]+)", status, re.M).group(1), 8)
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


class StagedWrite:
    """Write several files into `directory` as one unit: each is first written to a hidden
    temporary name beside its target (`.{name}.XXXX.tmp`), flushed to disk, and only when
    every one is complete are they renamed into place, in the order they were staged (so
    shards land before the index that names them). If anything fails before that, the
    temporaries are deleted and the files in the directory are exactly as they were. Use
    as a context manager: leaving the block normally commits."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._staged: dict[Path, Path] = {}  # target -> temporary
        self.committed: list[Path] = []

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

    def commit(self) -> list[Path]:
        mode = _default_file_mode()
        for tmp in self._staged.values():
            _fsync(tmp)
            os.chmod(tmp, mode)
        for target, tmp in self._staged.items():
            os.replace(tmp, target)
            self.committed.append(target)
        self._staged.clear()
        try:
            _fsync(self.directory)  # make the renames durable too
        except OSError:  # some filesystems cannot fsync a directory
            pass
        return self.committed

    def discard(self) -> None:
        for tmp in self._staged.values():
            tmp.unlink(missing_ok=True)
        self._staged.clear()

    def __enter__(self) -> StagedWrite:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.commit()
            finally:
                self.discard()
        else:
            self.discard()


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


def stage_weights(
    stage: StagedWrite, state_dict: Mapping[str, Tensor], max_shard_size: int | str = "5GB"
) -> list[str]:
    """Stage `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` plus
    `model.safetensors.index.json` when the weights exceed `max_shard_size` (HF's names and
    index format). Returns the file names staged, the index last."""
    from safetensors.torch import save_file

    tensors = _own_storage(state_dict)
    shards = shard_state_dict(tensors, parse_size(max_shard_size))
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        save_file(shards[0], str(stage.path(SAFE_WEIGHTS)), metadata=metadata)
        return [SAFE_WEIGHTS]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(stage.path(name)), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
        names.append(name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    stage.text(SAFE_INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names + [SAFE_INDEX]


_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def remove_stale_weights(directory: Path, keep: Iterable[str]) -> list[Path]:
    """After a save, delete the safetensors files of an earlier save in the other layout:
    the loaders (ours and transformers') prefer `model.safetensors` over an index, so a
    stale one would shadow the new shards, and stale shards would only waste space.
    PyTorch `.bin` files are left alone (they may be the user's original, with heads the
    new save dropped); safetensors takes precedence over them on load."""
    keep = set(keep)
    removed = []
    for path in sorted(directory.iterdir()):
        name = path.name
        if name in keep or not path.is_file():
            continue
        if name in (SAFE_WEIGHTS, SAFE_INDEX) or _SHARD_NAME.fullmatch(name):
            path.unlink()
            removed.append(path)
    leftovers = [n for n in (PT_WEIGHTS, PT_INDEX) if (directory / n).is_file()]
    if leftovers:
        log.warning("%s still holds %s from an earlier save; the new safetensors files take precedence on load",
                    directory, ", ".join(leftovers))  # fmt: skip
    return removed


def write_weights(state_dict: Mapping[str, Tensor], directory: Path, max_shard_size: int | str = "5GB") -> list[Path]:
    """Write `model.safetensors`, or shards plus `model.safetensors.index.json` when the
    weights exceed `max_shard_size`, as one staged write (see `StagedWrite`); then remove
    stale safetensors files of a previous save in the other layout."""
    directory = Path(directory)
    with StagedWrite(directory) as stage:
        names = stage_weights(stage, state_dict, max_shard_size)
    remove_stale_weights(directory, names)
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
