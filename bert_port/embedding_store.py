"""The output folder of `bert-port-embed`, read side: file names, the index, which shards a
run has finished, `read_embeddings` and `EmbedError`. Nothing here writes (`embed/run.py` does).

    index.json               the run: model, pipeline settings, input digest, dtype, shard list
    shard-00000.safetensors  `embeddings`, (n, D), texts [0, S) in input order
    shard-00000.ids.json     their ids, real-token count, truncated ids, the run's fingerprint,
                             the embeddings file's size and SHA-256, the ids' SHA-256
    truncated.json           ids of every text cut to max_seq_length, when the run completes

A shard is trusted only when its files match the checksums its ids file records (and, once
the run is complete, the index): a resume redoes a damaged shard, and `read_embeddings`
names it in one line. It sits below `embed/` (which writes the folder) and `similarity` (which
searches it), so both import it downwards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from .storage import bounded
from .storage.journal import digest

log = logging.getLogger(__name__)

INDEX = "index.json"
TRUNCATED = "truncated.json"
FORMAT = "bert_port-embeddings/1"


class EmbedError(ValueError):
    """An input, flag or output folder that `bert-port-embed` cannot use; the message says
    what is wrong and what to do. The command prints it and exits 2."""


def shard_names(k: int) -> tuple[str, str]:
    """(embeddings file, ids file) of shard `k`."""
    return f"shard-{k:05d}.safetensors", f"shard-{k:05d}.ids.json"


def fingerprint(run: dict) -> str:
    """A short digest of the settings that decide a shard's bits: a shard carrying another
    run's fingerprint is recomputed, never reused."""
    return hashlib.sha256(json.dumps(run, sort_keys=True).encode()).hexdigest()[:16]


def ids_digest(ids: list) -> str:
    """The SHA-256 of a shard's ids, as its ids file records it."""
    return hashlib.sha256(json.dumps(ids, ensure_ascii=False).encode()).hexdigest()


def read_index(directory: Path) -> dict | None:
    """The folder's index, or None when it has none. An unreadable one is an `EmbedError`."""
    path = Path(directory) / INDEX
    if not os.path.lexists(path):
        return None
    try:
        index = json.loads(bounded.read_text(path, bounded.JSON))
    except (OSError, ValueError, bounded.RefusedFile) as exc:
        raise EmbedError(f"{path} is not a readable index ({exc}); pass another output folder") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise EmbedError(f"{path} is not an index bert-port-embed wrote; pass another output folder")
    return index


def read_shard_ids(directory: Path, k: int) -> dict | None:
    """Shard `k`'s ids file, or None when it is absent or unreadable (the shard is then redone)."""
    try:
        data = json.loads(bounded.read_text(Path(directory) / shard_names(k)[1], bounded.IDS))
    except (OSError, ValueError, bounded.RefusedFile):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("ids"), list) else None


def shard_problem(directory: Path, k: int, data: dict | None, rows: int, checksum: bool = True) -> str | None:
    """What is wrong with shard `k` whose ids file holds `data` and should hold `rows` ids:
    None when its ids and embeddings file match the sizes and checksums recorded with them
    (`checksum=False`: sizes only, without reading the embeddings)."""
    emb_name, ids_name = shard_names(k)
    if data is None:
        return f"{ids_name} is missing or unreadable"
    if len(data["ids"]) != rows:
        return f"{ids_name} holds {len(data['ids'])} ids, not {rows}"
    if data.get("ids_sha256") not in (None, ids_digest(data["ids"])):
        return f"{ids_name}: its ids do not match their checksum"
    path = Path(directory) / emb_name
    try:
        size = os.stat(path).st_size if path.is_file() and not path.is_symlink() else None
    except OSError:
        size = None
    if size is None:
        return f"{emb_name} is missing or not a regular file"
    recorded = data.get("embeddings")
    if isinstance(recorded, dict):
        if size != recorded.get("size"):
            return f"{emb_name} holds {size} bytes, not the {recorded.get('size')} written"
        if checksum and digest(path) != recorded.get("sha256"):
            return f"{emb_name}: its bytes do not match their checksum"
    return None


def finished(directory: Path, k: int, rows: int, run_id: str) -> dict | None:
    """Shard `k`'s ids file when the shard is complete for the run `run_id`: both files there
    (they are committed together), `rows` ids, the same fingerprint, both files matching
    their checksums. A damaged shard of this run is logged and redone. Else None."""
    data = read_shard_ids(directory, k)
    if data is not None and data.get("run") != run_id:
        return None
    problem = shard_problem(directory, k, data, rows)
    if problem is None:
        return data
    if data is not None or (Path(directory) / shard_names(k)[0]).exists():  # written, then damaged
        log.warning("shard %d in %s is damaged (%s); computing it again", k, directory, problem)
    return None


def read_embeddings(directory: str | os.PathLike, mmap: bool = False, verify: bool = True):
    """(ids, embeddings) of a finished run: ids as a list in input order, embeddings as a
    numpy array (N, D) in the run's dtype, row i the embedding of ids[i].

    `mmap=True`: embeddings as a list of read-only memory-mapped arrays, one per shard, in
    order (their rows concatenated are the array above): no shard is read into memory.
    `verify`: check each shard against the sizes and SHA-256 recorded when it was written
    (reads every byte once); without it only sizes and headers are checked. A damaged shard
    is an `EmbedError` naming it."""
    import numpy as np

    ids: list = []
    arrays = []
    index = finished_index(directory)
    for shard_ids, array in verified_shards(directory, mmap=mmap, verify=verify, index=index):
        ids.extend(shard_ids)
        arrays.append(array)
    if mmap:
        return ids, arrays
    return ids, (np.concatenate(arrays) if arrays else np.empty((0, index["dim"]), dtype=index["dtype"]))


def finished_index(directory: str | os.PathLike) -> dict:
    """The index of a finished run; an `EmbedError` saying what to do for any other folder."""
    directory = Path(directory)
    index = read_index(directory)
    if index is None:
        raise EmbedError(f"{directory} has no {INDEX}; pass the output folder of bert-port-embed")
    if not index.get("complete"):
        raise EmbedError(f"{directory}: the run has not finished; run the same command again to complete it")
    return index


def verified_shards(directory: str | os.PathLike, mmap: bool = True, verify: bool = True, index: dict | None = None):
    """(ids, (n, D) array) of each shard of a finished run, in order, each checked as it comes
    (see `read_embeddings`: row counts, dimensions, and with `verify` the checksums): a damaged
    shard is an `EmbedError` naming it, before any of its rows is given out."""
    directory = Path(directory)
    index = finished_index(directory) if index is None else index
    for k, shard in enumerate(index["shards"]):
        data = read_shard_ids(directory, k)
        problem = shard_problem(directory, k, data, shard["rows"], checksum=verify)
        if problem is None and "sha256" in shard and shard["sha256"] != data["embeddings"]["sha256"]:
            problem = f"{shard['embeddings']} is not the file the index recorded"
        if problem is None:
            problem, array = _shard_array(directory / shard["embeddings"], shard["rows"], index["dim"], mmap)
        if problem is not None:
            raise EmbedError(f"{directory}: shard {k} is damaged ({problem}); run the same command again to redo it")
        yield data["ids"], array


_NUMPY_DTYPES = {"F32": "float32", "F16": "float16"}


def _shard_array(path: Path, rows: int, dim: int, mmap: bool):
    """(None, the (rows, dim) array in the safetensors file `path`), memory-mapped or read;
    (what is wrong, None) when the header does not describe that array within the file."""
    import numpy as np

    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            size = os.fstat(f.fileno()).st_size
            if not 2 <= length <= min(size - 8, bounded.SMALL):
                return f"{path.name} has no safetensors header", None
            entry = json.loads(f.read(length))["embeddings"]
        dtype = np.dtype(_NUMPY_DTYPES[entry["dtype"]])
        start, end = (8 + length + o for o in entry["data_offsets"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{path.name} has no readable embeddings header ({type(exc).__name__})", None
    if entry.get("shape") != [rows, dim] or end - start != rows * dim * dtype.itemsize or end > size:
        return f"{path.name} does not hold {rows} x {dim} embeddings within its {size} bytes", None
    if mmap:
        return None, np.memmap(path, dtype=dtype, mode="r", offset=start, shape=(rows, dim))
    return None, np.fromfile(path, dtype=dtype, count=rows * dim, offset=start).reshape(rows, dim)
