"""The output folder of `bert-port-embed`, read side: file names, the index, which shards a
run has finished, and `read_embeddings`. Nothing here writes (`run.py` does).

    index.json               the run: model, pipeline settings, input digest, dtype, shard list
    shard-00000.safetensors  `embeddings`, (n, D), texts [0, S) in input order
    shard-00000.ids.json     their ids, real-token count, truncated ids, the run's fingerprint
    truncated.json           ids of every text cut to max_seq_length, when the run completes
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .corpus import EmbedError

INDEX = "index.json"
TRUNCATED = "truncated.json"
FORMAT = "bert_port-embeddings/1"


def shard_names(k: int) -> tuple[str, str]:
    """(embeddings file, ids file) of shard `k`."""
    return f"shard-{k:05d}.safetensors", f"shard-{k:05d}.ids.json"


def fingerprint(run: dict) -> str:
    """A short digest of the settings that decide a shard's bits: a shard carrying another
    run's fingerprint is recomputed, never reused."""
    return hashlib.sha256(json.dumps(run, sort_keys=True).encode()).hexdigest()[:16]


def read_index(directory: Path) -> dict | None:
    """The folder's index, or None when it has none. An unreadable one is an `EmbedError`."""
    path = Path(directory) / INDEX
    if not path.is_file():
        return None
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EmbedError(f"{path} is not a readable index ({exc}); pass another output folder") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise EmbedError(f"{path} is not an index bert-port-embed wrote; pass another output folder")
    return index


def read_shard_ids(directory: Path, k: int) -> dict | None:
    """Shard `k`'s ids file, or None when it is absent or unreadable (the shard is then redone)."""
    try:
        data = json.loads((Path(directory) / shard_names(k)[1]).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("ids"), list) else None


def finished(directory: Path, k: int, rows: int, run_id: str) -> dict | None:
    """Shard `k`'s ids file when the shard is complete for the run `run_id`: both files there
    (they are committed together), `rows` ids, the same fingerprint. Else None."""
    data = read_shard_ids(directory, k)
    if data is None or data.get("run") != run_id or len(data["ids"]) != rows:
        return None
    return data if (Path(directory) / shard_names(k)[0]).is_file() else None


def read_embeddings(directory: str | os.PathLike):
    """(ids, embeddings) of a finished run: ids as a list in input order, embeddings as a
    numpy array (N, D) in the run's dtype, row i the embedding of ids[i]."""
    import numpy as np
    from safetensors.numpy import load_file

    directory = Path(directory)
    index = read_index(directory)
    if index is None:
        raise EmbedError(f"{directory} has no {INDEX}; pass the output folder of bert-port-embed")
    if not index.get("complete"):
        raise EmbedError(f"{directory}: the run has not finished; run the same command again to complete it")
    ids: list = []
    arrays = []
    for k, shard in enumerate(index["shards"]):
        data = read_shard_ids(directory, k)
        if data is None or len(data["ids"]) != shard["rows"]:
            raise EmbedError(f"{directory / shard['ids']} is missing or damaged; run the command again to redo it")
        ids.extend(data["ids"])
        arrays.append(load_file(directory / shard["embeddings"])["embeddings"])
    dim = index["dim"]
    return ids, (np.concatenate(arrays) if arrays else np.empty((0, dim), dtype=index["dtype"]))
