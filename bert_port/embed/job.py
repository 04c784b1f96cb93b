"""`embed_corpus`: one run of `bert-port-embed`, from the checks to the final index.

Every check runs before anything is written (flags, the checkpoint, the whole input, an
output folder holding another run), so a refused run leaves no file behind. Then rank 0
writes the index (`complete: false`), each rank computes its shards that are not already
finished, and rank 0, once every rank is done, writes the truncation file and the index with
`complete: true` in one commit.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .. import checkpoint as ckpt
from .. import embedding_store as store
from ..devices import resolve_device
from ..sentence import SentenceEncoder
from ..speed.quantization import QUANTIZATIONS
from .corpus import Columns, EmbedError, Scan, input_format, records, scan
from .run import (
    DTYPES,
    Options,
    Progress,
    ShardEmbedder,
    Summary,
    check_prompt_pooling,
    resolve_prompt,
    run_settings,
    shards,
    world,
    write_shard,
)

log = logging.getLogger(__name__)


@dataclass
class Job:
    """A checked run: what to compute and where."""

    encoder: SentenceEncoder
    found: Scan
    columns: Columns
    output: Path
    prompt: str
    opts: Options
    settings: dict
    previous: dict | None  # the folder's index before this run

    @property
    def run_id(self) -> str:
        return store.fingerprint(self.settings)

    @property
    def n_shards(self) -> int:
        return math.ceil(self.found.count / self.opts.shard_size)

    def rows(self, k: int) -> int:
        return min(self.opts.shard_size, self.found.count - k * self.opts.shard_size)


def _check_options(opts: Options, output: Path) -> None:
    sizes = {"batch_tokens": opts.batch_tokens, "sort_window": opts.sort_window, "shard_size": opts.shard_size}
    bad = [
        f"--{n.replace('_', '-')} must be at least 1, got {v}"
        for n, v in sizes.items()
        if not isinstance(v, int) or v < 1
    ]
    if opts.quantization not in (None, *QUANTIZATIONS):
        bad.append(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {opts.quantization!r}")
    if opts.dtype not in DTYPES:
        bad.append(f"--dtype must be one of {', '.join(DTYPES)}, got {opts.dtype!r}")
    if output.exists() and not output.is_dir():
        bad.append(f"output {output} is a file; pass a folder (it is created if missing)")
    if bad:
        raise EmbedError("; ".join(bad))


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    keys = sorted(set(old) | set(new))
    out = []
    for key in keys:
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} {a!r} -> {b!r}")
    return out


def prepare(
    model: str | os.PathLike,
    input_path: str | os.PathLike,
    output: str | os.PathLike,
    columns: Columns | None = None,
    opts: Options | None = None,
) -> Job:
    """Check everything and load the encoder; nothing is written. Raises `EmbedError` (or the
    checkpoint's `CheckpointError`) with a one-line message."""
    columns, opts = columns or Columns(), opts or Options()
    output = Path(output)
    _check_options(opts, output)
    input_format(Path(input_path))
    found = scan(input_path, columns)
    try:
        device = resolve_device(opts.device or "cpu", what="--device")
    except ValueError as exc:
        raise EmbedError(str(exc)) from None
    if opts.quantization and device.type != "cpu":
        raise EmbedError(f"--quantization {opts.quantization} runs on the CPU, not on {device}: pass --device cpu")
    encoder = SentenceEncoder.from_pretrained(model, device=device, quantization=opts.quantization)
    if opts.batch_tokens < encoder.max_seq_length:
        raise EmbedError(
            f"--batch-tokens {opts.batch_tokens} is smaller than the model's max_seq_length "
            f"({encoder.max_seq_length}): a text of that length would not fit; use --batch-tokens "
            f"{encoder.max_seq_length} or more"
        )
    root = Path(model) if Path(model).is_dir() else Path(encoder.model.source_dir)
    prompt = resolve_prompt(root, opts.prompt, opts.prompt_name)
    check_prompt_pooling(root, prompt)
    settings = run_settings(encoder, root, found, columns, prompt, opts)
    previous = store.read_index(output) if output.is_dir() else None
    if previous is not None and previous.get("run") != settings and not opts.overwrite:
        changed = _differences(previous.get("run") or {}, settings)
        raise EmbedError(
            f"{output} holds another run's embeddings ({'; '.join(changed[:4])}); pass --overwrite to replace "
            "them, or choose another output folder"
        )
    return Job(encoder, found, columns, output, prompt, opts, settings, previous)


def _index(job: Job, complete: bool, truncated: int | None = None, written: list | None = None) -> dict:
    """The run's index; `written` holds each shard's ids-file record once all are finished,
    whose embeddings size and SHA-256 the completed index keeps."""
    shards = [dict(zip(("embeddings", "ids"), store.shard_names(k)), rows=job.rows(k)) for k in range(job.n_shards)]
    for shard, data in zip(shards, written or (), strict=False):
        shard.update(data.get("embeddings") or {})
    dim = len(job.encoder.pooling) * job.encoder.model.config.hidden_size
    return {
        "format": store.FORMAT,
        "run": job.settings,
        "texts": job.found.count,
        "dim": dim,
        "dtype": job.opts.dtype,
        "shards": shards,
        "complete": complete,
        "truncated": truncated,
        "truncated_file": store.TRUNCATED if complete else None,
    }


def _write_json(path: Path, data: dict) -> None:
    with ckpt.atomic_write(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def _compute(job: Job, rank: int, size: int) -> tuple[int, int]:
    """This rank's unfinished shards, computed and written. Returns (shards reused, tokens)."""
    mine = [k for k in range(job.n_shards) if k % size == rank]
    todo = {k for k in mine if store.finished(job.output, k, job.rows(k), job.run_id) is None}
    if not todo:
        return len(mine), 0
    bar = Progress(sum(job.rows(k) for k in todo), job.opts.progress and rank == 0, f"rank {rank}/{size}")
    embedder = ShardEmbedder(job.encoder, job.prompt, job.opts, bar)
    dtype = DTYPES[job.opts.dtype]
    tokens = 0
    try:
        for k, chunk in shards(records(job.found.path, job.columns), job.opts.shard_size):
            if k in todo:
                embeddings, n_tokens, truncated = embedder(chunk)
                meta = {"run": job.run_id, "tokens": n_tokens, "truncated": truncated}
                write_shard(job.output, k, embeddings.to(dtype), [r.id for r in chunk], meta)
                del embeddings, chunk  # freed before the next shard is read, not after it
                tokens += n_tokens
            if k >= max(todo):
                break
    finally:
        bar.close()
    return len(mine) - len(todo), tokens


def _finish(job: Job) -> tuple[int, int]:
    """Rank 0, after every shard: the truncation file and the completed index, one commit.
    Returns (truncated texts, tokens recorded in all shards)."""
    truncated, tokens, written = [], 0, []
    for k in range(job.n_shards):
        data = store.finished(job.output, k, job.rows(k), job.run_id)
        if data is None:
            raise EmbedError(f"shard {k} is missing after the run; run the command again to compute it")
        truncated += data["truncated"]
        tokens += data["tokens"]
        written.append(data)
    index = _index(job, True, len(truncated), written)
    if store.read_index(job.output) != index:
        report = {"max_seq_length": job.encoder.max_seq_length, "count": len(truncated), "ids": truncated}
        with ckpt.StagedWrite(job.output) as stage:
            stage.text(store.TRUNCATED, json.dumps(report, ensure_ascii=False) + "\n")
            stage.text(store.INDEX, json.dumps(index, indent=1, ensure_ascii=False) + "\n")
    return len(truncated), tokens


def execute(job: Job) -> Summary:
    """Run a prepared job on this process's rank; returns what was done (on rank 0, the
    whole run's truncation count)."""
    start = time.perf_counter()
    rank, size = world()
    job.output.mkdir(parents=True, exist_ok=True)
    ckpt.tidy(job.output)  # a shard commit killed after its commit point is finished, not redone
    if rank == 0 and (job.previous is None or job.previous.get("run") != job.settings):
        _write_json(job.output / store.INDEX, _index(job, False))
    group = _init_group(size)
    reused, tokens = _compute(job, rank, size)
    truncated = 0
    if group:
        group.barrier()
    if rank == 0:
        truncated, _ = _finish(job)
        if truncated:
            log.info("%d texts were cut to %d tokens", truncated, job.encoder.max_seq_length)
    if group:
        group.barrier()
        group.destroy_process_group()
    dim = len(job.encoder.pooling) * job.encoder.model.config.hidden_size
    return Summary(
        job.found.count,
        dim,
        job.opts.dtype,
        job.n_shards,
        reused,
        tokens,
        truncated,
        job.output / store.TRUNCATED,
        time.perf_counter() - start,
    )


def _init_group(size: int):
    """torch.distributed (gloo) when torchrun started several processes, for the barriers."""
    if size == 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    return dist


def embed_corpus(
    model: str | os.PathLike,
    input_path: str | os.PathLike,
    output: str | os.PathLike,
    columns: Columns | None = None,
    opts: Options | None = None,
) -> Summary:
    """Embed every text of `input_path` with the checkpoint `model`'s pipeline into the folder
    `output` (sharded safetensors, ids, index); resumes a run killed in the same folder."""
    return execute(prepare(model, input_path, output, columns, opts))
