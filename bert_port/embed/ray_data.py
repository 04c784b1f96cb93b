"""The embedding pipeline as a Ray Data callable class, for users who already run Ray:

    import ray
    from bert_port.embed.ray_data import RayEmbedder

    ds = ray.data.read_json("corpus.jsonl")
    ds = ds.map_batches(RayEmbedder, fn_constructor_kwargs={"model": "path/to/checkpoint"},
                        batch_size=256, batch_format="numpy", concurrency=4)
    ds.write_parquet("embeddings/")

Each actor loads the checkpoint once; each batch is tokenized once, sorted by length, cut
into `batch_tokens` batches and run through the same `ShardEmbedder` as `bert-port-embed`,
so a row's embedding is the command's (within the float32 tolerance: batches differ). Ray is
imported only by the caller; this module needs nothing from it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..devices import resolve_device
from ..sentence import SentenceEncoder
from .corpus import Record
from .run import Options, ShardEmbedder, check_prompt_pooling, resolve_prompt


class RayEmbedder:
    """A batch (dict of numpy columns, `batch_format="numpy"`) -> the same batch plus
    `embedding` (n, D) float32 and `truncated` (n,) bool (cut to `max_seq_length`)."""

    def __init__(
        self,
        model: str | os.PathLike,
        text_column: str = "text",
        pair_column: str | None = None,
        prompt: str | None = None,
        prompt_name: str | None = None,
        batch_tokens: int = Options.batch_tokens,
        device: str | None = None,
    ):
        encoder = SentenceEncoder.from_pretrained(model, device=resolve_device(device or "cpu"))
        root = Path(model) if Path(model).is_dir() else Path(encoder.model.source_dir)
        chosen = resolve_prompt(root, prompt, prompt_name)
        check_prompt_pooling(root, chosen)
        if batch_tokens < encoder.max_seq_length:
            raise ValueError(f"batch_tokens {batch_tokens} is below max_seq_length ({encoder.max_seq_length})")
        # One window per Ray batch: the whole batch is sorted by length together.
        opts = Options(batch_tokens=batch_tokens, sort_window=2**62, progress=False)
        self.embedder = ShardEmbedder(encoder, chosen, opts)
        self.text_column, self.pair_column = text_column, pair_column

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        texts = batch[self.text_column]
        pairs = batch[self.pair_column] if self.pair_column else [None] * len(texts)
        records = [
            Record(i + 1, i, str(t), None if p is None else str(p)) for i, (t, p) in enumerate(zip(texts, pairs))
        ]
        if not records:
            return {**batch, "embedding": np.empty((0, 0), np.float32), "truncated": np.empty(0, bool)}
        embeddings, _, truncated = self.embedder(records)
        flags = np.zeros(len(records), dtype=bool)
        flags[truncated] = True  # the records' ids are their positions
        return {**batch, "embedding": embeddings.numpy(), "truncated": flags}
