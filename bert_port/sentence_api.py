"""The methods sentence-transformers users call on a `SentenceTransformer` beyond `encode`:
prompts, `similarity`, `encode_query`/`encode_document`, `get_sentence_embedding_dimension`,
`semantic_search`, and the output conversions of `encode` (precision, numpy or tensor).

`SentenceEncoder` takes them as a mixin; they need of it only `encode`, `prompts`,
`default_prompt_name`, `similarity_fn_name`, `truncate_dim` and `embedding_dimension()`.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from . import similarity as sim

log = logging.getLogger(__name__)


def finish_output(embeddings: Tensor, precision: str, convert_to_numpy: bool, convert_to_tensor: bool, single: bool):
    """(N, D) float embeddings, in the input's order -> what `SentenceTransformer.encode` returns
    for these flags: quantised to `precision` (numpy, then a tensor of it for `convert_to_tensor`),
    a float32 numpy array, one tensor, or a list of (D,) rows; one row for a single text."""
    if precision != "float32" and len(embeddings):
        embeddings = torch.from_numpy(sim.quantize_embeddings(embeddings, precision))
    if convert_to_tensor:
        return embeddings[0] if single else embeddings
    if convert_to_numpy:
        array = embeddings.cpu().numpy() if not embeddings.is_floating_point() else embeddings.float().cpu().numpy()
        return array[0] if single else array
    return embeddings[0] if single else list(embeddings)


def check_precision(precision: str) -> None:
    if precision not in sim.PRECISIONS:
        raise ValueError(f"precision {precision!r} is not supported; use one of {', '.join(sim.PRECISIONS)}")


class SentenceTransformerAPI:
    """sentence-transformers' helper methods, on top of `encode`."""

    def resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str | None:
        """The prompt text to put before each text: `prompt`, else `prompts[prompt_name]`, else the
        default prompt's text, as sentence-transformers resolves them."""
        if prompt is not None:
            if prompt_name is not None:
                log.warning("both prompt and prompt_name given; prompt_name %r is ignored", prompt_name)
            return prompt
        if prompt_name is not None:
            if prompt_name not in self.prompts:
                raise ValueError(
                    f"prompt_name {prompt_name!r} is not one of this model's prompts {sorted(self.prompts)}; pass "
                    "prompt= with the text, or set encoder.prompts"
                )
            return self.prompts[prompt_name]
        if self.default_prompt_name is not None:
            return self.prompts.get(self.default_prompt_name)
        return None

    def encode_query(self, texts, prompt_name: str | None = None, prompt: str | None = None, **kwargs):
        """`encode` with the model's "query" prompt when it has one (as `SentenceTransformer.encode_query`)."""
        if prompt_name is None and prompt is None and "query" in self.prompts:
            prompt_name = "query"
        return self.encode(texts, prompt_name=prompt_name, prompt=prompt, **kwargs)

    def encode_document(self, texts, prompt_name: str | None = None, prompt: str | None = None, **kwargs):
        """`encode` with the model's "document", "passage" or "corpus" prompt, the first it has
        (as `SentenceTransformer.encode_document`)."""
        if prompt_name is None and prompt is None:
            prompt_name = next((name for name in ("document", "passage", "corpus") if name in self.prompts), None)
        return self.encode(texts, prompt_name=prompt_name, prompt=prompt, **kwargs)

    def get_sentence_embedding_dimension(self) -> int:
        """The length of `encode`'s vectors: the pooled width, or `truncate_dim` when smaller."""
        width = self.embedding_dimension()
        return width if self.truncate_dim is None else min(width, self.truncate_dim)

    get_embedding_dimension = get_sentence_embedding_dimension  # sentence-transformers 6's name

    def similarity(self, a, b) -> Tensor:
        """(N, D), (M, D) embeddings -> (N, M) scores by the model's `similarity_fn_name` (cosine by default)."""
        return sim.similarity_functions(self.similarity_fn_name)[0](a, b)

    def similarity_pairwise(self, a, b) -> Tensor:
        """(N, D), (N, D) embeddings -> (N,) scores of row i with row i, by `similarity_fn_name`."""
        return sim.similarity_functions(self.similarity_fn_name)[1](a, b)

    def semantic_search(self, queries, corpus_embeddings, top_k: int = 10) -> list[list[dict]]:
        """Top-k corpus rows for each query (texts, encoded with `encode_query`, or embeddings),
        scored by `similarity_fn_name`; see `bert_port.similarity.semantic_search`. The corpus
        is an array (memory-mapped or not), a tensor, or a sequence of shards."""
        if isinstance(queries, str) or (isinstance(queries, (list, tuple)) and queries and isinstance(queries[0], str)):
            queries = self.encode_query(queries, convert_to_tensor=True)
        return sim.semantic_search(queries, corpus_embeddings, top_k=top_k, score_function=self.similarity_fn_name)
