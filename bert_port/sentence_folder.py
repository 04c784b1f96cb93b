"""A sentence-transformers folder, read: which modules `modules.json` lists (a Transformer, then
Pooling and optionally Normalize), the pooling modes of `1_Pooling/config.json`, the settings
of `sentence_bert_config.json`, and `pool`, the pooling as sentence-transformers computes it.
`SentenceEncoder` (sentence.py) runs what these return."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from . import checkpoint as ckpt

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


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ckpt.CheckpointError(
            f"{path} is not readable JSON ({exc}); restore it from the original checkpoint"
        ) from None
    if not isinstance(data, (dict, list)):
        raise ckpt.CheckpointError(f"{path} must hold a JSON object or list; restore it from the original checkpoint")
    return data


def _pooling_modes(config: dict, source: Path) -> tuple[str, ...]:
    """The modes of a `1_Pooling/config.json`: sentence-transformers 6's `pooling_mode` (a
    name or a list) or the older `pooling_mode_*` booleans (none set means mean, as there)."""
    if "pooling_mode" in config:
        modes = config["pooling_mode"]
        modes = (modes,) if isinstance(modes, str) else tuple(modes)
    else:
        modes = tuple(mode for key, mode in LEGACY_POOLING_KEYS.items() if config.get(key)) or ("mean",)
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad:
        raise ckpt.CheckpointError(
            f"{source}: pooling mode {', '.join(bad)} is not supported by SentenceEncoder (it computes "
            f"{', '.join(POOLING_MODES)}); use sentence-transformers for this model"
        )
    return modes


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
    if (directory / ckpt.ST_MODULES).is_file():
        modules = ckpt.read_st_modules(directory)
        types = [_module_type(m.get("type")) for m in modules]
        unknown = [t for t in types if t not in (TRANSFORMER, POOLING, NORMALIZE)]
        if unknown or types[0] != TRANSFORMER:
            raise ckpt.CheckpointError(
                f"{directory / ckpt.ST_MODULES} lists modules {types}; SentenceEncoder runs a Transformer followed "
                "by Pooling and optionally Normalize. Use sentence-transformers for this model"
            )
        settings["transformer"] = _transformer_folder(directory, modules[0].get("path", ""))
        for module in modules:
            if _module_type(module["type"]) == POOLING:
                path = directory / module.get("path", POOLING_FOLDER) / "config.json"
                pooling = read_json(path)
                settings["pooling"] = _pooling_modes(pooling, path)
                settings["include_prompt"] = bool(pooling.get("include_prompt", True))
        settings["normalize"] = NORMALIZE in types
    else:
        log.info(
            "%s has no %s: mean pooling, no normalisation (sentence-transformers' defaults)",
            directory,
            ckpt.ST_MODULES,
        )
    st_config = directory / settings["transformer"] / ckpt.ST_CONFIG
    if st_config.is_file():
        config = read_json(st_config)
        settings["max_seq_length"] = config.get("max_seq_length")
        settings["do_lower_case"] = bool(config.get("do_lower_case", False))
    return settings


def _model_settings(directory: Path) -> dict:
    """`prompts`, `default_prompt_name` and `similarity_fn_name` of a folder's
    `config_sentence_transformers.json` (none, none and cosine without one, as sentence-transformers)."""
    path = directory / ckpt.ST_MODEL_CONFIG
    config = read_json(path) if path.is_file() else {}
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
