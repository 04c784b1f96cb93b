"""Embedding a corpus with a checkpoint's sentence-transformers pipeline, shard by shard.

The input is cut into shards of `shard_size` texts in input order. Each shard is computed on
its own: its texts are tokenized once (the checkpoint's tokenizer, truncated to
`max_seq_length`, the prompt prepended), sorted by token count within windows of
`sort_window` texts, grouped into batches of at most `batch_tokens` padded tokens, run through
`SentenceEncoder.forward` (BERT, pooling, Normalize) and put back in input order. Because a
shard's bits depend only on its own texts and these settings, a resumed run and a run split
over torchrun ranks (rank r takes shards r, r + W, ...) write the same files as one
uninterrupted process. (Between runs with different thread counts this holds only as far as
the matmul kernels split their work the same way; the tests compare runs with equal counts.)

Shards are committed with their ids file in one `StagedWrite`, so a shard is there whole or
not at all; a rerun skips the shards whose ids file carries this run's fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from .. import checkpoint as ckpt
from .. import embedding_store as store
from ..sentence import SentenceEncoder
from ..speed import kernels
from ..threads import ThreadGovernor, capped
from ..tokenization import pad_token_id
from .corpus import Columns, EmbedError, Record, Scan, describe

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16}
ST_PROMPTS = "config_sentence_transformers.json"


@dataclass(frozen=True)
class Options:
    """How to run: batching, sharding, output dtype, prompt, device, and what to do with a
    folder holding another run (`overwrite`)."""

    batch_tokens: int = 4096  # padded tokens per forward pass; larger batches spill the CPU caches
    sort_window: int = 4096  # texts sorted by length together (within a shard)
    shard_size: int = 10000  # texts per output file
    dtype: str = "float32"
    prompt: str | None = None  # prepended to every text
    prompt_name: str | None = None  # a key of config_sentence_transformers.json's "prompts"
    overwrite: bool = False
    progress: bool = True
    device: str | None = None
    quantization: str | None = None  # "int8": SentenceEncoder.from_pretrained(quantization="int8")
    threads: int | str | None = None  # CPU threads; "auto": a `ThreadGovernor` between batches


@dataclass
class Summary:
    """What a run did, for the command's last lines."""

    texts: int
    dim: int
    dtype: str
    shards: int
    reused: int  # shards a previous run had finished
    tokens: int  # real tokens computed in this run
    truncated: int
    truncated_file: Path
    seconds: float


def resolve_prompt(root: Path, prompt: str | None, prompt_name: str | None) -> str:
    """The text prepended to each input, as sentence-transformers chooses it: `prompt`, else
    the `prompts[prompt_name]` of `config_sentence_transformers.json`, else its
    `default_prompt_name`'s, else none."""
    if prompt is not None and prompt_name is not None:
        raise EmbedError("give either --prompt or --prompt-name, not both")
    if prompt is not None:
        return prompt
    config: dict = {}
    if (root / ST_PROMPTS).is_file():
        try:
            config = json.loads((root / ST_PROMPTS).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise EmbedError(f"{root / ST_PROMPTS} is not readable JSON ({exc}); restore it") from None
    prompts = config.get("prompts") or {}
    name = prompt_name if prompt_name is not None else config.get("default_prompt_name")
    if name is None:
        return ""
    if name not in prompts:
        raise EmbedError(
            f"--prompt-name {name!r}: {root / ST_PROMPTS} has prompts {sorted(prompts) or 'none'}; "
            "use one of them, or give the text with --prompt"
        )
    return prompts[name] or ""


def check_prompt_pooling(root: Path, prompt: str) -> None:
    """sentence-transformers can leave the prompt's tokens out of the mean (`include_prompt`
    false); SentenceEncoder pools every token, so such a checkpoint with a prompt is refused."""
    path = root / "1_Pooling" / "config.json"
    if prompt and path.is_file() and json.loads(path.read_text(encoding="utf-8")).get("include_prompt") is False:
        raise EmbedError(f"{path} excludes the prompt from pooling, which SentenceEncoder does not do; use no prompt")


def run_settings(encoder: SentenceEncoder, root: Path, found: Scan, columns: Columns, prompt: str, opts: Options):
    """The settings that decide the output's bits, as the index records them."""
    return {
        "model": str(root.resolve()),
        "pooling": list(encoder.pooling),
        "normalize": encoder.normalize,
        "max_seq_length": encoder.max_seq_length,
        "do_lower_case": encoder.do_lower_case,
        "prompt": prompt,
        "input": {"sha256": found.digest, "format": found.format, "texts": found.count},
        "columns": describe(columns, found.format),
        "dtype": opts.dtype,
        "shard_size": opts.shard_size,
        "batch_tokens": opts.batch_tokens,
        "sort_window": opts.sort_window,
        **({"quantization": opts.quantization} if opts.quantization else {}),  # float runs keep their old index
    }


def _collate(ids: list[list[int]], types: list[list[int]] | None, pad_id: int) -> dict[str, torch.Tensor]:
    """Token id lists (and segment ids, for pairs) -> (B, T) input_ids, token_type_ids,
    attention_mask, padded on the right."""
    T = max(len(row) for row in ids)
    input_ids = torch.full((len(ids), T), pad_id, dtype=torch.long)
    token_types = torch.zeros(len(ids), T, dtype=torch.long)
    mask = torch.zeros(len(ids), T, dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
        if types is not None:
            token_types[i, : len(row)] = torch.tensor(types[i])
    return {"input_ids": input_ids, "token_type_ids": token_types, "attention_mask": mask}


def tokenize(
    tokenizer: Tokenizer, inputs: list, pairs: bool
) -> tuple[list[list[int]], list[list[int]] | None, list[bool]]:
    """A window's token ids, segment ids (pairs only) and which texts were cut. Only the id
    lists are kept: a `tokenizers.Encoding` also holds the tokens' strings, offsets and masks,
    about ten times the ids' memory, for a whole sort window at a time."""
    encodings = tokenizer.encode_batch(inputs)
    ids = [e.ids for e in encodings]
    types = [e.type_ids for e in encodings] if pairs else None
    cut = [bool(e.overflowing) for e in encodings]
    return ids, types, cut


def batches(lengths: list[int], budget: int) -> Iterator[list[int]]:
    """Positions into `lengths`, longest first, grouped so that each group's padded size
    (count * its longest) stays within `budget` tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    group: list[int] = []
    for i in order:
        if group and (len(group) + 1) * lengths[group[0]] > budget:
            yield group
            group = []
        group.append(i)
    if group:
        yield group


class ShardEmbedder:
    """Computes one shard: (records) -> (n, D) embeddings in input order, the real-token
    count and the ids of the texts cut to `max_seq_length`."""

    def __init__(self, encoder: SentenceEncoder, prompt: str, opts: Options, bar=None):
        self.encoder = encoder.eval()
        # A copy: truncation is set once here and the encoder's own tokenizer is left as it was.
        self.tokenizer = Tokenizer.from_str(encoder.tokenizer.to_str())
        self.tokenizer.enable_truncation(max_length=encoder.max_seq_length)
        self.pad_id = pad_token_id(self.tokenizer)
        self.prompt, self.opts, self.bar = prompt, opts, bar
        self.governor = ThreadGovernor() if opts.threads == "auto" else None
        if isinstance(opts.threads, int):
            torch.set_num_threads(capped(opts.threads))

    def _inputs(self, window: list[Record]) -> list:
        texts = [self.prompt + r.text for r in window]
        if self.encoder.do_lower_case:
            texts = [t.lower() for t in texts]
        if window[0].pair is None:
            return texts
        pairs = [r.pair.lower() if self.encoder.do_lower_case else r.pair for r in window]
        return list(zip(texts, pairs))

    @torch.inference_mode()
    def __call__(self, shard: list[Record]) -> tuple[torch.Tensor, int, list]:
        device = self.encoder.model.device
        dim = len(self.encoder.pooling) * self.encoder.model.config.hidden_size
        out = torch.empty(len(shard), dim, dtype=torch.float32)
        tokens, truncated = 0, []
        for start in range(0, len(shard), self.opts.sort_window):
            window = shard[start : start + self.opts.sort_window]
            ids, types, cut = tokenize(self.tokenizer, self._inputs(window), window[0].pair is not None)
            truncated += [r.id for r, c in zip(window, cut) if c]
            for group in batches([len(row) for row in ids], self.opts.batch_tokens):
                if self.governor is not None:
                    self.governor.step()
                rows = [ids[i] for i in group]
                batch = _collate(rows, None if types is None else [types[i] for i in group], self.pad_id)
                batch = {k: v.to(device) for k, v in batch.items()}
                out[[start + i for i in group]] = self.encoder(**batch).float().cpu()
                del batch
                # Batches of changing shapes free activations of every size, which glibc keeps in
                # its heap: a long run's peak RSS grew with the corpus while little was in use.
                kernels.trim_heap()
                n_tokens = sum(len(row) for row in rows)
                tokens += n_tokens
                if self.bar is not None:
                    self.bar.add(len(group), n_tokens)
        return out, tokens, truncated


class Progress:
    """A tqdm bar over texts whose postfix gives texts/s and real tokens/s."""

    def __init__(self, total: int, enabled: bool, desc: str):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, unit="text", disable=not enabled, desc=desc, dynamic_ncols=True)
        self.start, self.texts, self.tokens = time.perf_counter(), 0, 0

    def add(self, texts: int, tokens: int) -> None:
        self.texts, self.tokens = self.texts + texts, self.tokens + tokens
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"{self.texts / elapsed:.0f} texts/s, {self.tokens / elapsed:.0f} tokens/s", refresh=False
        )
        self.bar.update(texts)

    def close(self) -> None:
        self.bar.close()


def shards(stream: Iterable[Record], size: int) -> Iterator[tuple[int, list[Record]]]:
    """(k, records of shard k), consecutive runs of `size` records."""
    chunk: list[Record] = []
    k = 0
    for record in stream:
        chunk.append(record)
        if len(chunk) == size:
            yield k, chunk
            chunk, k = [], k + 1
    if chunk:
        yield k, chunk


def write_shard(directory: Path, k: int, embeddings: torch.Tensor, ids: list, meta: dict) -> None:
    """Shard `k`'s embeddings and ids file, committed together (all or nothing). The ids file
    records the embeddings file's size and SHA-256 and the ids' SHA-256, which a resume and
    `read_embeddings` check."""
    from safetensors.torch import save

    emb_name, ids_name = store.shard_names(k)
    blob = save({"embeddings": embeddings.contiguous()})
    written = {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    record = {**meta, "embeddings": written, "ids_sha256": store.ids_digest(ids), "ids": ids}
    with ckpt.StagedWrite(directory) as stage:
        stage.path(emb_name).write_bytes(blob)
        stage.text(ids_name, json.dumps(record, ensure_ascii=False) + "\n")


def world() -> tuple[int, int]:
    """(rank, world size) as torchrun sets them; (0, 1) for a plain process."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
