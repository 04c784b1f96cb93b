"""Checkpoints, in three layers (each imports only the ones above it in this list):

- `keys`: the HF <-> port key table, key normalisation and the plan of a load (pure);
- `files`: reading weights, staged all-or-nothing writes, sharding (huggingface_hub), the
  NaN/Inf check;
- `locate`: a directory, a weights file, or a model id in the local HF cache
  (huggingface_hub, never the network) -> the files to read.

`from bert_port import checkpoint as ckpt; ckpt.X` reaches every public name of the three.
"""

from __future__ import annotations

from . import files, keys, locate
from .errors import CheckpointError, short_list
from .files import (
    CONFIG_NAME,
    JOURNAL,
    PT_INDEX,
    PT_WEIGHTS,
    SAFE_INDEX,
    SAFE_WEIGHTS,
    ST_CONFIG,
    ST_FILES,
    ST_FOLDER,
    ST_MODULES,
    TEMPORARY,
    TOKENIZER_FILES,
    WEIGHT_NAMES,
    DirectoryLock,
    StagedWrite,
    atomic_write,
    human_bytes,
    non_finite,
    parse_size,
    read_st_modules,
    read_weights,
    recover,
    st_module_folders,
    stage_weights,
    stale_weights,
    tidy,
    write_weights,
)
from .keys import (
    BUFFER_KEYS,
    DROPPED_PREFIXES,
    HEAD_PREFIXES,
    HF_TO_PORT,
    PORT_TO_HF,
    WRAPPER_PREFIXES,
    Conversion,
    Layout,
    LoadPlan,
    check_layer_count,
    detect_layout,
    hf_to_port,
    layer_indices,
    normalize_hf_key,
    plan_load,
    port_to_hf,
)
from .locate import CheckpointFiles, find_in_hf_cache, hf_cache_dir, is_repo_id, locate_checkpoint

__all__ = [
    "BUFFER_KEYS",
    "CONFIG_NAME",
    "DROPPED_PREFIXES",
    "HEAD_PREFIXES",
    "HF_TO_PORT",
    "JOURNAL",
    "PORT_TO_HF",
    "PT_INDEX",
    "PT_WEIGHTS",
    "SAFE_INDEX",
    "SAFE_WEIGHTS",
    "ST_CONFIG",
    "ST_FILES",
    "ST_FOLDER",
    "ST_MODULES",
    "TEMPORARY",
    "TOKENIZER_FILES",
    "WEIGHT_NAMES",
    "WRAPPER_PREFIXES",
    "CheckpointError",
    "CheckpointFiles",
    "Conversion",
    "DirectoryLock",
    "Layout",
    "LoadPlan",
    "StagedWrite",
    "atomic_write",
    "check_layer_count",
    "detect_layout",
    "files",
    "find_in_hf_cache",
    "hf_cache_dir",
    "hf_to_port",
    "human_bytes",
    "is_repo_id",
    "keys",
    "layer_indices",
    "locate",
    "locate_checkpoint",
    "non_finite",
    "normalize_hf_key",
    "parse_size",
    "plan_load",
    "port_to_hf",
    "read_st_modules",
    "read_weights",
    "recover",
    "short_list",
    "st_module_folders",
    "stage_weights",
    "stale_weights",
    "tidy",
    "write_weights",
]
