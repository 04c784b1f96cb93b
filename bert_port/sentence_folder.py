"""A sentence-transformers folder, read: which modules `modules.json` lists (a Transformer, then
Pooling and optionally Normalize), the pooling modes of `1_Pooling/config.json`, the settings
of `sentence_bert_config.json`, and `pool`, the pooling as sentence-transformers computes it.
`SentenceEncoder` (sentence.py) runs what these return.

Each file is read as the checkpoint's own files are (`storage.bounded`): a FIFO, a device or an
oversized file is refused in one line naming it, and a file that is there, whatever it is, is
never taken for absent. Module paths are checked as sentence-transformers checks them (relative,
no `..`). Links are followed, as for the weights: the hub cache's files are links into its blobs."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path, PureWindowsPath

import torch
from torch import Tensor

from . import checkpoint as ckpt
from .storage import bounded

log = logging.getLogger(__name__)

# sentence-transformers' pooling modes this port computes, in the order it concatenates them.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens")
# The legacy booleans of 1_Pooling/config.json, in sentence-transformers' order.
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
TRANSFORMER, POOLING, NORMALIZE = (
    "sentence_transformers.models.Transformer",
    "sentence_transformers.models.Pooling",
    "sentence_transformers.models.Normalize",
)
POOLING_FOLDER = "1_Pooling"


def _module_type(name) -> str:
    """A modules.json type under its classic name: sentence-transformers 6 writes its modules'
    own paths (`sentence_transformers.base.modules.transformer.Transformer`, ...), older ones and
    the hub's folders `sentence_transformers.models.Transformer`; both read as the latter."""
    if isinstance(name, str) and name.startswith("sentence_transformers."):
        return "sentence_transformers.models." + name.rsplit(".", 1)[1]
    return name


def pool(token_embeddings: Tensor, attention_mask: Tensor, modes: Sequence[str]) -> Tensor:
    """(B, T, H) token vectors and a (B, T) padding mask -> (B, len(modes) * H), each mode's
    vector concatenated in order, computed as sentence-transformers' `Pooling` does."""
    out = []
    mask = attention_mask.unsqueeze(-1).to(token_embeddings.dtype)  # (B, T, 1)
    for mode in modes:
        if mode == "cls":  # the first real token (left padding puts it further right)
            first = attention_mask.to(torch.int).argmax(dim=1)
            out.append(token_embeddings[torch.arange(len(first), device=first.device), first])
        elif mode == "max":
            out.append(token_embeddings.masked_fill(mask == 0, float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            # Sums in fp32 for half-precision inputs, as sentence-transformers accumulates.
            acc = torch.float32 if token_embeddings.dtype in (torch.float16, torch.bfloat16) else token_embeddings.dtype
            total = (token_embeddings * mask).sum(dim=1, dtype=acc)
            count = torch.clamp(mask.sum(dim=1, dtype=acc), min=1e-9)
            vector = total / count if mode == "mean" else total / torch.sqrt(count)
            out.append(vector.to(token_embeddings.dtype))
        else:
            raise ValueError(f"pooling mode {mode!r} is not supported; use one of {', '.join(POOLING_MODES)}")
    return torch.cat(out, dim=-1)


def read_json(path: Path) -> dict | list:
    """A JSON file of a sentence-transformers folder, read with the bound of checkpoint files
    (`storage.bounded`): a FIFO, a device or a file over 16 MiB is refused in one line naming it,
    never waited on or read until memory runs out. Links are followed, as for the weights."""
    try:
        data = json.loads(bounded.read_text(path, bounded.JSON, folder=False))
    except bounded.RefusedFile as exc:
        raise refused(exc) from None
    except (OSError, ValueError, RecursionError) as exc:
        raise ckpt.CheckpointError(
            f"{path} is not readable JSON ({exc}); restore it from the original checkpoint"
        ) from None
    if not isinstance(data, (dict, list)):
        raise ckpt.CheckpointError(f"{path} must hold a JSON object or list; restore it from the original checkpoint")
    return data


def refused(exc: bounded.RefusedFile) -> ckpt.CheckpointError:
    """A refused file of a checkpoint folder, in one line saying where to get it again."""
    return ckpt.CheckpointError(f"refused to read {exc.path}: {exc.why}; restore it from the original checkpoint")


def pooling_modes(pooling: object, source: str, fix: str) -> tuple[str, ...]:
    """`pooling` (a mode's name or a list of them) as a tuple of the modes this port computes;
    anything else is a `ValueError` in one line naming `source`, ending in `fix` for a value of
    the wrong type."""
    modes = (pooling,) if isinstance(pooling, str) else tuple(pooling) if isinstance(pooling, (list, tuple)) else ()
    if not modes or not all(isinstance(m, str) for m in modes):
        raise ValueError(
            f"{source} must be a pooling mode's name or a list of them ({', '.join(POOLING_MODES)}), "
            f"got {pooling!r}; {fix}"
        )
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad:
        raise ValueError(
            f"{source} {', '.join(map(repr, bad))} is not supported by SentenceEncoder (it computes "
            f"{', '.join(POOLING_MODES)}); use sentence-transformers for this model"
        )
    return modes


def _pooling_modes(config: dict, source: Path) -> tuple[str, ...]:
    """The modes of a `1_Pooling/config.json`: sentence-transformers 6's `pooling_mode` (a
    name or a list) or the older `pooling_mode_*` booleans (none set means mean, as there)."""
    if "pooling_mode" in config:
        modes, name = config["pooling_mode"], f"{source}: pooling_mode"
    else:
        modes, name = (
            [mode for key, mode in LEGACY_POOLING_KEYS.items() if config.get(key)] or ["mean"],
            f"{source}: pooling mode",
        )
    try:
        return pooling_modes(modes, name, "restore it from the original checkpoint")
    except ValueError as exc:
        raise ckpt.CheckpointError(str(exc)) from None


def module_path(directory: Path, module: dict, default: str = "") -> str:
    """A module's folder as `modules.json` gives it, checked as sentence-transformers checks it:
    a relative path without `..`, so that nothing is read from outside the checkpoint folder."""
    path = module.get("path", default)
    parts = PureWindowsPath(path).parts if isinstance(path, str) else ()
    if not isinstance(path, str) or PureWindowsPath(path).anchor or ".." in parts or "\0" in path:
        raise ckpt.CheckpointError(
            f"{directory / ckpt.ST_MODULES} gives the {_module_type(module.get('type'))} module the path {path!r}, "
            "which is not a folder inside the checkpoint (sentence-transformers refuses it too); restore modules.json "
            "from the original checkpoint"
        )
    return path


def read_pipeline(directory: Path) -> dict:
    """What a checkpoint folder's sentence-transformers files say: `transformer` (the folder of
    the Transformer module, relative to `directory`: "" for today's layout, `0_BERT` or
    `0_Transformer` in older ones), `pooling` (the modes), `normalize`, `max_seq_length` and
    `do_lower_case` (from the Transformer folder's `sentence_bert_config.json`); defaults of
    sentence-transformers for a plain BERT folder (mean pooling, no normalisation, the
    tokenizer's limit)."""
    settings: dict = {
        "transformer": "",
        "pooling": ("mean",),
        "normalize": False,
        "max_seq_length": None,
        "do_lower_case": False,
        "include_prompt": True,
        **_model_settings(directory),
    }
    if os.path.lexists(directory / ckpt.ST_MODULES):  # present, whatever it is: a FIFO is refused, not absent
        _read_modules(directory, settings)
    else:
        log.info(
            "%s has no %s: mean pooling, no normalisation (sentence-transformers' defaults)",
            directory,
            ckpt.ST_MODULES,
        )
    st_config = directory / settings["transformer"] / ckpt.ST_CONFIG
    if os.path.lexists(st_config):
        config = read_json(st_config)
        settings["max_seq_length"] = config.get("max_seq_length")
        settings["do_lower_case"] = bool(config.get("do_lower_case", False))
    return settings


def _read_modules(directory: Path, settings: dict) -> None:
    """`settings` updated from the folder's `modules.json` and the Pooling module's config."""
    modules = read_json(directory / ckpt.ST_MODULES)
    if not isinstance(modules, list) or not modules or not all(isinstance(m, dict) for m in modules):
        raise ckpt.CheckpointError(
            f"{directory / ckpt.ST_MODULES} must be a JSON list of modules; restore it from the original checkpoint"
        )
    types = [_module_type(m.get("type")) for m in modules]
    unknown = [t for t in types if t not in (TRANSFORMER, POOLING, NORMALIZE)]
    if unknown or types[0] != TRANSFORMER:
        raise ckpt.CheckpointError(
            f"{directory / ckpt.ST_MODULES} lists modules {types}; SentenceEncoder runs a Transformer followed "
            "by Pooling and optionally Normalize. Use sentence-transformers for this model"
        )
    paths = [module_path(directory, m, POOLING_FOLDER if t == POOLING else "") for m, t in zip(modules, types)]
    settings["transformer"] = _transformer_folder(directory, paths[0])
    for path, kind in zip(paths, types):
        if kind == POOLING:
            config_path = directory / path / "config.json"
            pooling = read_json(config_path)
            if not isinstance(pooling, dict):
                raise ckpt.CheckpointError(
                    f"{config_path} must hold a JSON object; restore it from the original checkpoint"
                )
            settings["pooling"] = _pooling_modes(pooling, config_path)
            settings["include_prompt"] = bool(pooling.get("include_prompt", True))
    settings["normalize"] = NORMALIZE in types


def _model_settings(directory: Path) -> dict:
    """`prompts`, `default_prompt_name` and `similarity_fn_name` of a folder's
    `config_sentence_transformers.json` (none, none and cosine without one, as sentence-transformers)."""
    path = directory / ckpt.ST_MODEL_CONFIG
    config = read_json(path) if os.path.lexists(path) else {}
    if not isinstance(config, dict):
        raise ckpt.CheckpointError(f"{path} must hold a JSON object; restore it from the original checkpoint")
    return {
        "prompts": dict(config.get("prompts") or {}),
        "default_prompt_name": config.get("default_prompt_name"),
        "similarity_fn_name": config.get("similarity_fn_name") or "cosine",
    }


def _transformer_folder(directory: Path, path: object) -> str:
    """The Transformer module's folder as modules.json names it, checked to be a folder inside
    `directory` ("" or "." for the directory itself)."""
    if path in ("", ".", "./"):
        return ""
    name = path.rstrip("/") if isinstance(path, str) else ""
    if name in ("", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ckpt.CheckpointError(
            f"{directory / ckpt.ST_MODULES} gives the Transformer module the path {path!r}, which is not a folder "
            "inside the checkpoint; restore modules.json from the original checkpoint"
        )
    path = name
    if not (directory / path).is_dir():
        raise ckpt.CheckpointError(
            f"{directory / ckpt.ST_MODULES} puts the Transformer module (the BERT weights) in {path}/, but "
            f"{directory / path} does not exist; the checkpoint is incomplete: copy that folder from the original"
        )
    return path
