"""The methods sentence-transformers users call on a `SentenceTransformer` beyond `encode`:
prompts, `similarity`, `encode_query`/`encode_document`, `get_sentence_embedding_dimension`,
`semantic_search`, `tokenize`, `save`, `get_max_seq_length`, `device`, the names `encode`'s
first parameter goes by, and the output conversions of `encode` (precision, numpy or tensor).

`SentenceEncoder` takes them as a mixin; they need of it only `encode`, `prompts`,
`default_prompt_name`, `similarity_fn_name`, `truncate_dim`, `max_seq_length`, `do_lower_case`,
`model`, `tokenizer`, `save_pretrained` and `embedding_dimension()`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch
from torch import Tensor

from . import similarity as sim
from .tokenization import encode as tokenize_batch

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


OUTPUT_VALUES = ("sentence_embedding", "token_embeddings")


def check_output_value(output_value: str, precision: str) -> None:
    """`encode`'s `output_value`: the pooled vectors, or each text's token vectors (float only)."""
    if output_value not in OUTPUT_VALUES:
        raise ValueError(f"output_value {output_value!r} is not supported; use one of {', '.join(OUTPUT_VALUES)}")
    if output_value == "token_embeddings" and precision != "float32":
        raise ValueError(
            f"precision {precision!r} with output_value='token_embeddings' is not supported by SentenceEncoder; "
            "encode in float32 and quantise the token vectors with bert_port.similarity.quantize_embeddings"
        )


def first_argument(texts, sentences, inputs):
    """The texts given to `encode` under any name of its first parameter: the port's `texts`,
    sentence-transformers 6's `inputs` or its earlier `sentences`."""
    given = {name: v for name, v in (("texts", texts), ("sentences", sentences), ("inputs", inputs)) if v is not None}
    if len(given) != 1:
        problem = f"got them {len(given)} times ({', '.join(given)})" if given else "got none"
        raise TypeError(
            f"encode takes the texts once, as its first argument (or texts=, sentences= or inputs=); {problem}"
        )
    return next(iter(given.values()))


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

    def encode_query(
        self,
        texts=None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        *,
        sentences=None,
        inputs=None,
        **kw,
    ):
        """`encode` with the model's "query" prompt when it has one (as `SentenceTransformer.encode_query`)."""
        if prompt_name is None and prompt is None and "query" in self.prompts:
            prompt_name = "query"
        return self.encode(first_argument(texts, sentences, inputs), prompt_name=prompt_name, prompt=prompt, **kw)

    def encode_document(
        self,
        texts=None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        *,
        sentences=None,
        inputs=None,
        **kw,
    ):
        """`encode` with the model's "document", "passage" or "corpus" prompt, the first it has
        (as `SentenceTransformer.encode_document`)."""
        if prompt_name is None and prompt is None:
            prompt_name = next((name for name in ("document", "passage", "corpus") if name in self.prompts), None)
        return self.encode(first_argument(texts, sentences, inputs), prompt_name=prompt_name, prompt=prompt, **kw)

    def tokenize(self, texts: Sequence[str] | Sequence[tuple[str, str]]) -> dict[str, Tensor]:
        """`input_ids`, `token_type_ids` and `attention_mask`, (B, T) long tensors, of a list of
        texts or of (text, text) pairs, as `SentenceTransformer.tokenize` gives them: lower-cased
        when the folder says `do_lower_case`, cut to `max_seq_length`, padded to the longest.
        One bare string is refused (sentence-transformers would tokenize each of its characters)."""
        if isinstance(texts, str):
            raise TypeError("tokenize takes a list of texts; put one text in a list: tokenize([text])")
        texts = list(texts)
        pairs = [p for p in texts if isinstance(p, (tuple, list))]
        if pairs and len(pairs) != len(texts) or any(len(p) != 2 for p in pairs):
            raise ValueError("tokenize takes a list of texts or a list of (text, text) pairs, not a mix")
        lower = (lambda t: t.lower()) if self.do_lower_case else (lambda t: t)
        firsts = [lower(p[0] if pairs else p) for p in texts]
        seconds = [lower(p[1]) for p in texts] if pairs else None
        batch = tokenize_batch(self.tokenizer, firsts, seconds, max_length=self.max_seq_length)
        return {name: batch[name] for name in ("input_ids", "token_type_ids", "attention_mask")}

    def save(
        self,
        path: str | os.PathLike,
        model_name: str | None = None,
        create_model_card: bool = True,
        train_datasets: list[str] | None = None,
        safe_serialization: bool = True,
    ) -> None:
        """`save_pretrained(path)` under sentence-transformers' name: a folder both
        `SentenceTransformer(path)` and `SentenceEncoder.from_pretrained(path)` load. No model
        card is written (`model_name`, `create_model_card` and `train_datasets` describe one);
        the weights are always safetensors."""
        if not safe_serialization:
            raise ValueError("SentenceEncoder.save writes safetensors only; leave safe_serialization=True")
        self.save_pretrained(path)

    def get_max_seq_length(self) -> int:
        """The number of tokens a text is cut to (`max_seq_length`)."""
        return self.max_seq_length

    @property
    def device(self) -> torch.device:
        """The device the encoder's weights are on, where `encode` runs."""
        return self.model.device

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
