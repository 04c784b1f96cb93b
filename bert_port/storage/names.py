"""The names of a checkpoint folder's files: weights, config, tokenizer, sentence-transformers
files and module folders, and the names this package's own staged writes use. Pure: no I/O."""

from __future__ import annotations

import re

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
ST_MODEL_CONFIG = "config_sentence_transformers.json"  # prompts; a CrossEncoder's activation_fn
ST_FILES = (ST_MODULES, ST_CONFIG, ST_MODEL_CONFIG)
ST_FOLDER = re.compile(r"\d+_\w+")

# A staged write's files: its temporaries (`.{name}.XXXXXXXX.tmp`, the name's "/" spelt "__"
# for a file in a module folder), the list of them it keeps while it runs, and its commit
# journal. Only the temporaries a staging list names are ever deleted: a hidden file that
# merely looks like one is someone else's.
TEMPORARY = re.compile(r"\..+\.[A-Za-z0-9_]{8}\.tmp")
JOURNAL = ".bert_port-commit.json"
STAGING = ".bert_port-staging"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def plain_name(name: object) -> bool:
    """A single name inside a folder: no separator, never `.` or `..`."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def staged_name(name: object) -> bool:
    """A name a staged write may write or delete: a plain name, or `{module folder}/{plain
    name}` for a file inside a sentence-transformers module folder (`1_Pooling/config.json`)."""
    if not isinstance(name, str):
        return False
    folder, sep, file = name.partition("/")
    return plain_name(name) or (bool(sep) and bool(ST_FOLDER.fullmatch(folder)) and plain_name(file))


def weights_name(name: str) -> bool:
    """safetensors weights this package writes: `model.safetensors`, shards and their index."""
    return name in (SAFE_WEIGHTS, SAFE_INDEX) or bool(_SHARD_NAME.fullmatch(name))


def removable(name: str) -> bool:
    """Names a save may delete: safetensors weights of another layout, tokenizer files,
    another model's sentence-transformers files, module folders and the files in them. A
    journal naming anything else is not ours, and is refused rather than obeyed."""
    if not staged_name(name):
        return False
    if "/" in name:
        return True  # a file inside a module folder (checked by staged_name)
    return weights_name(name) or name in (*TOKENIZER_FILES, *ST_FILES) or bool(ST_FOLDER.fullmatch(name))
