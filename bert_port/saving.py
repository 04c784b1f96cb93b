"""Saving a port model as an HF checkpoint: the `config.json` that is written, the weights
under HF names, and the tokenizer and sentence-transformers files that belong with them.

A save is one `checkpoint.StagedWrite`: weights, config, tokenizer files and the
sentence-transformers files and module folders are staged under temporary names and
committed together under a lock on the folder, so an interrupted, killed or concurrent save
leaves the old or the new files, never a mix.
This is also the one place that writes sentence-transformers files: a model's save copies
those of the folder it came from, `SentenceEncoder.save_pretrained` writes its own pipeline,
and both remove another model's in the same commit.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from . import checkpoint as ckpt
from .base_bert import BertPreTrainedModel
from .config import SHAPE_FIELDS
from .speed.quantization import refuse_saving

log = logging.getLogger(__name__)


def hf_state_dict(model: BertPreTrainedModel) -> dict[str, Tensor]:
    """The model's state dict under Hugging Face names (the inverse of the key table). Tied
    targets are left out: they are written once, under the name of what they are tied to."""
    refuse_saving(model)
    state = {
        k.removeprefix(model.port_encoder_prefix): v
        for k, v in model.state_dict().items()
        if k not in model.tied_weights
    }
    family = model.config.family  # a task model's encoder goes under the family's prefix ("roberta.")
    prefix = family.encoder_prefix if model.hf_encoder_prefix else ""
    heads = ckpt.head_table(family.key_table, model.head_keys)  # RoBERTa's classifier.out_proj.* and the like
    return ckpt.port_to_hf(state, encoder_prefix=prefix, table=family.key_table, heads=heads)


def config_to_write(model: BertPreTrainedModel) -> dict:
    """The config.json of a save: every field that was read, plus `architectures` and
    `dtype`, which describe what is saved."""
    config = model.config.to_dict()
    config["architectures"] = [model.hf_architecture]
    # transformers loads with dtype="auto", i.e. in the config's dtype: it must name the
    # dtype of the saved tensors, not the one the config was read with.
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    config["dtype"] = str(dtype).removeprefix("torch.")
    if "torch_dtype" in config:  # the pre-v5 name, kept because it was read, kept true
        config["torch_dtype"] = config["dtype"]
    return config


def save_pretrained(
    model: BertPreTrainedModel,
    save_directory: str | os.PathLike,
    max_shard_size: int | str = "5GB",
    *,
    sentence: SentenceFiles | None = None,
) -> Path:
    """Write an HF-format checkpoint that `transformers` loads: `config.json`
    (`config_to_write`), `model.safetensors` under HF names (or shards and an index above
    `max_shard_size`, e.g. "500MB") and, when the model was loaded from a directory with
    tokenizer files, copies of those (another model's tokenizer files in the folder are
    removed, see `stage_tokenizer`). `sentence` gives the sentence-transformers files to write
    (default: those the model carries from its source, `carried_sentence_files`). The folder
    is one `checkpoint.StagedWrite`: an interrupted, killed or concurrent save leaves one
    whole checkpoint, the old or the new."""
    refuse_saving(model)  # before anything is created
    ckpt.parse_size(max_shard_size)  # a bad size fails before anything is created
    out = Path(save_directory)
    config = config_to_write(model)
    if sentence is None:
        sentence = carried_sentence_files(model, out)
    with ckpt.StagedWrite(out) as stage:
        ckpt.stage_weights(stage, hf_state_dict(model), max_shard_size)
        stage_tokenizer(stage, model.source_dir, config)
        stage_sentence_files(stage, sentence)
        stage.text(ckpt.CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


# -----------------------------------------------------------------------------------------
# Tokenizer files


def _same_shape(config_file: Path, config: dict) -> bool:
    """Whether the config.json already in a folder (if any) describes a model shaped like
    `config`. No config there: nothing says its tokenizer files belong to another model."""
    try:
        previous = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        return False
    return isinstance(previous, dict) and all(previous.get(f) == config.get(f) for f in SHAPE_FIELDS)


def _is_folder(source: str | os.PathLike | None, out: Path) -> bool:
    return source is not None and Path(source).resolve() == out.resolve()


def stage_tokenizer(stage: ckpt.StagedWrite, source: str | os.PathLike | None, config: dict) -> None:
    """The folder's tokenizer files after the save are the model's: those of the directory
    it was loaded from (`source`), copied; any other tokenizer file there is deleted, since
    `load_tokenizer` would otherwise pick another model's `tokenizer.json` over the copied
    `vocab.txt`. A model that knows no tokenizer files (built in code) keeps those in the
    folder unless the folder's previous config.json is a model of another shape, whose
    tokenizer they are."""
    out = stage.directory
    if _is_folder(source, out):
        return  # saved over the folder it came from: its tokenizer files are its own
    present = [n for n in ckpt.TOKENIZER_FILES if (out / n).is_file()]
    own = [n for n in ckpt.TOKENIZER_FILES if source is not None and (Path(source) / n).is_file()]
    for name in own:
        stage.copy(name, Path(source) / name)
    if own:
        foreign = [n for n in present if n not in own]
    elif present and not _same_shape(out / ckpt.CONFIG_NAME, config):
        foreign = present
    else:
        foreign = []
    if foreign:
        log.warning("%s: removing tokenizer files of the model saved there before: %s", out, ", ".join(foreign))
        for name in foreign:
            stage.remove(name)


# -----------------------------------------------------------------------------------------
# Sentence-transformers files


@dataclass(frozen=True)
class SentenceFiles:
    """The sentence-transformers files a save writes beside the model: top-level files
    (`modules.json`, `sentence_bert_config.json`, ...) and module folders (`1_Pooling/`),
    each file a `Path` to copy or a `str` to write. With `remove_others`, any other
    sentence-transformers file in the folder (another model's settings, and the
    `{index}_{Module}` folders its modules.json names) is removed in the same commit, or
    SentenceTransformer would run that model's pipeline on this one; without it (a model saved
    over the folder it came from, whose files are its own) they stay."""

    files: dict[str, Path | str] = field(default_factory=dict)
    folders: dict[str, dict[str, Path | str]] = field(default_factory=dict)
    remove_others: bool = True

    def updated(self, files: dict[str, str], folders: dict[str, dict[str, str]]) -> SentenceFiles:
        """These files with `files` and `folders` written over them (file by file)."""
        merged = {f: dict(self.folders.get(f, {})) for f in dict.fromkeys([*self.folders, *folders])}
        for folder, contents in folders.items():
            merged[folder].update(contents)
        return dataclasses.replace(self, files={**self.files, **files}, folders=merged)


def sentence_transformers_files(model: BertPreTrainedModel) -> tuple[list[str], list[str]]:
    """The sentence-transformers files and module folders a save copies from the folder the
    model was loaded from: none unless the model keeps them (`keeps_sentence_transformers_files`:
    a bare encoder, which is the Transformer module those files describe) and that folder has
    a `modules.json`."""
    source = Path(model.source_dir) if model.source_dir is not None else None
    if not model.keeps_sentence_transformers_files or source is None or not (source / ckpt.ST_MODULES).is_file():
        return [], []
    return [n for n in ckpt.ST_FILES if (source / n).is_file()], ckpt.st_module_folders(source)


def carried_sentence_files(model: BertPreTrainedModel, save_directory: str | os.PathLike) -> SentenceFiles:
    """What a save of `model` into `save_directory` writes by default: the sentence-transformers
    files of the folder it was loaded from (`sentence_transformers_files`), so that
    `SentenceTransformer(saved_dir)` pools and normalises as the original did."""
    if _is_folder(model.source_dir, Path(save_directory)):
        return SentenceFiles(remove_others=False)
    names, folders = sentence_transformers_files(model)
    source = Path(model.source_dir) if names else Path()
    return SentenceFiles(
        files={n: source / n for n in names},
        folders={
            f: {p.name: p for p in sorted((source / f).iterdir()) if p.is_file() and not p.name.startswith(".")}
            for f in folders
        },
    )


def _stage_file(stage: ckpt.StagedWrite, name: str, content: Path | str) -> None:
    if isinstance(content, Path):
        stage.copy(name, content)
    else:
        stage.text(name, content)


def stage_sentence_files(stage: ckpt.StagedWrite, wanted: SentenceFiles) -> None:
    """Stage `wanted` in the folder of `stage`, and with `wanted.remove_others` the removal of every
    other sentence-transformers file there. A module folder's files are staged in the same
    commit as `{folder}/{name}`, and files already in that folder that `wanted` does not name
    are removed with it, so the folder holds exactly the new pipeline's files."""
    out = stage.directory
    for folder, contents in wanted.folders.items():
        for name, content in contents.items():
            _stage_file(stage, f"{folder}/{name}", content)
        present = sorted(p.name for p in (out / folder).iterdir() if p.is_file()) if (out / folder).is_dir() else []
        for name in present:
            if name not in contents and not name.startswith("."):
                stage.remove(f"{folder}/{name}")
    for name, content in wanted.files.items():
        _stage_file(stage, name, content)
    if wanted.remove_others:
        _remove_foreign_sentence_files(stage, wanted)


def _remove_foreign_sentence_files(stage: ckpt.StagedWrite, wanted: SentenceFiles) -> None:
    out = stage.directory
    try:
        present_folders = ckpt.st_module_folders(out) if (out / ckpt.ST_MODULES).is_file() else []
    except ckpt.CheckpointError:
        present_folders = []  # an unreadable modules.json names no folders; it goes itself
    foreign = [n for n in ckpt.ST_FILES if (out / n).is_file() and n not in wanted.files]
    foreign += [f for f in present_folders if f not in wanted.folders and ckpt.ST_FOLDER.fullmatch(f)]
    if foreign:
        log.warning(
            "%s: removing sentence-transformers files of the model saved there before: %s", out, ", ".join(foreign)
        )
        for name in foreign:
            stage.remove(name)
    left = [f for f in present_folders if f not in wanted.folders and not ckpt.ST_FOLDER.fullmatch(f)]
    if left:
        log.warning("%s: left %s in place (not named as sentence-transformers names module folders)", out, left)


# The model's methods (see base_bert): the model layer cannot import this module, so it sets them.
BertPreTrainedModel.save_pretrained = save_pretrained
BertPreTrainedModel.hf_state_dict = hf_state_dict
