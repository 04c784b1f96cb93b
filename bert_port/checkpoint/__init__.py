"""Hugging Face checkpoints, one job per module. Imports go one way, down this list, and the
read side (`reading`, `finite`, `locate`) never imports the write side (`shards`, and
`storage.staging` below): loading never writes.

- `keys`: the HF <-> port key table, key normalisation and the plan of a load (pure);
- `reading`: safetensors, pickles and shard indexes, and the snapshot a load reads under;
- `finite`: the NaN/Inf check, reading memory-mapped tensors from their files;
- `locate`: a directory, a weights file, or a model id in the local HF cache -> the files;
- `shards`: model weights as `model.safetensors` or shards and an index, staged.

They build on `bert_port.storage` (file names, locks, journals, staged writes, `CheckpointError`),
which sits below the model so that the data readers and the tokenizer can use it too.
`from bert_port import checkpoint as ckpt; ckpt.X` reaches every public name of both.
"""

from __future__ import annotations

from ..storage import bounded, journal, locking, names, staging
from ..storage.errors import CheckpointError, human_bytes, short_list
from ..storage.locking import DirectoryLock, shared_lock
from ..storage.names import (
    CONFIG_NAME,
    JOURNAL,
    PT_INDEX,
    PT_WEIGHTS,
    SAFE_INDEX,
    SAFE_WEIGHTS,
    ST_CONFIG,
    ST_FILES,
    ST_FOLDER,
    ST_MODEL_CONFIG,
    ST_MODULES,
    TEMPORARY,
    TOKENIZER_FILES,
    WEIGHT_NAMES,
)
from ..storage.staging import StagedWrite, atomic_write, repair, tidy
from . import finite, keys, locate, reading, shards
from .family_keys import HEAD_TABLES, head_table
from .finite import non_finite
from .keys import (
    BUFFER_KEYS,
    DROPPED_PREFIXES,
    HEAD_PREFIXES,
    HF_TO_PORT,
    KEY_TABLES,
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
from .locate import CheckpointFiles, checkpoint_folder, find_in_hf_cache, hf_cache_dir, is_repo_id, locate_checkpoint
from .mismatch import mismatch_message
from .reading import REPAIR_COMMAND, FileSpan, Weights, read_snapshot, read_st_modules, read_weights, st_module_folders
from .shards import parse_size, stage_weights, stale_weights, write_weights

__all__ = [
    "BUFFER_KEYS",
    "CONFIG_NAME",
    "DROPPED_PREFIXES",
    "HEAD_PREFIXES",
    "HEAD_TABLES",
    "HF_TO_PORT",
    "JOURNAL",
    "KEY_TABLES",
    "PORT_TO_HF",
    "PT_INDEX",
    "PT_WEIGHTS",
    "REPAIR_COMMAND",
    "SAFE_INDEX",
    "SAFE_WEIGHTS",
    "ST_CONFIG",
    "ST_FILES",
    "ST_FOLDER",
    "ST_MODEL_CONFIG",
    "ST_MODULES",
    "TEMPORARY",
    "TOKENIZER_FILES",
    "WEIGHT_NAMES",
    "WRAPPER_PREFIXES",
    "CheckpointError",
    "CheckpointFiles",
    "Conversion",
    "DirectoryLock",
    "FileSpan",
    "Layout",
    "LoadPlan",
    "StagedWrite",
    "Weights",
    "atomic_write",
    "bounded",
    "check_layer_count",
    "checkpoint_folder",
    "detect_layout",
    "find_in_hf_cache",
    "finite",
    "head_table",
    "hf_cache_dir",
    "hf_to_port",
    "human_bytes",
    "is_repo_id",
    "journal",
    "keys",
    "layer_indices",
    "locate",
    "locate_checkpoint",
    "locking",
    "mismatch_message",
    "names",
    "non_finite",
    "normalize_hf_key",
    "parse_size",
    "plan_load",
    "port_to_hf",
    "read_snapshot",
    "read_st_modules",
    "read_weights",
    "reading",
    "repair",
    "shards",
    "shared_lock",
    "short_list",
    "st_module_folders",
    "stage_weights",
    "staging",
    "stale_weights",
    "tidy",
    "write_weights",
]
