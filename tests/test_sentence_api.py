"""SentenceEncoder's sentence-transformers API (prompts, precision, truncate_dim, device,
similarity, encode_query/encode_document, semantic search) against `SentenceTransformer` and
`sentence_transformers.util`, computed in the same run on the bundled all-MiniLM-L6-v2."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from conftest import REAL_SENTENCES, TOL

from bert_port import SentenceEncoder
from bert_port import similarity as sim

TEXTS = [*REAL_SENTENCES, "A man is eating food.", "A man is riding a horse.", "long " * 300]


@pytest.fixture(scope="module")
def st_reference(minilm_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu", local_files_only=True)


@pytest.fixture(scope="module")
def encoder(minilm_path):
    return SentenceEncoder.from_pretrained(minilm_path)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prompt": "query: "},
        {"truncate_dim": 64},
        {"truncate_dim": 64, "normalize_embeddings": True},
        {"device": "cpu", "prompt": "passage: ", "truncate_dim": 100},
    ],
    ids=["prompt", "truncate_dim", "truncate-normalize", "device"],
)
def test_encode_arguments_equal_sentence_transformers(encoder, st_reference, kwargs):
    actual = encoder.encode(TEXTS, batch_size=4, convert_to_tensor=True, **kwargs)
    expected = st_reference.encode(TEXTS, batch_size=4, convert_to_tensor=True, **kwargs)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])


@pytest.mark.parametrize("precision", ["int8", "uint8", "binary", "ubinary"])
def test_encode_precision_equals_sentence_transformers(encoder, st_reference, precision):
    """Quantised codes equal up to values on a bucket or sign boundary: at most 1% of the codes
    (int8, uint8: one step; binary: the packed bytes) may differ."""
    actual = encoder.encode(TEXTS, precision=precision)
    expected = st_reference.encode(TEXTS, precision=precision)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    diff = np.abs(actual.astype(np.int32) - expected.astype(np.int32))
    assert (diff > 0).mean() <= 0.01
    if precision.endswith("int8"):
        assert diff.max() <= 1
    tensor = encoder.encode(TEXTS[:2], precision=precision, convert_to_tensor=True)
    assert isinstance(tensor, torch.Tensor) and tensor.shape == expected[:2].shape


def test_prompt_names_and_query_document(minilm_path, st_reference):
    prompts = {"query": "query: ", "document": "passage: "}
    encoder = SentenceEncoder.from_pretrained(minilm_path)
    encoder.prompts = prompts
    st_reference.prompts = prompts
    try:
        for method in ("encode_query", "encode_document"):
            actual = getattr(encoder, method)(TEXTS, convert_to_tensor=True)
            expected = getattr(st_reference, method)(TEXTS, convert_to_tensor=True)
            torch.testing.assert_close(actual, expected, **TOL[torch.float32])
        torch.testing.assert_close(
            encoder.encode(TEXTS, prompt_name="query", convert_to_tensor=True),
            encoder.encode(TEXTS, prompt="query: ", convert_to_tensor=True),
        )
    finally:
        st_reference.prompts = {}
    with pytest.raises(ValueError, match="prompt_name 'nope' is not one of"):
        encoder.encode(TEXTS, prompt_name="nope")


def test_similarity_and_dimension(encoder, st_reference):
    a, b = encoder.encode(TEXTS[:3]), encoder.encode(TEXTS[3:6])
    torch.testing.assert_close(encoder.similarity(a, b), st_reference.similarity(a, b), **TOL[torch.float32])
    torch.testing.assert_close(
        encoder.similarity_pairwise(a, b), st_reference.similarity_pairwise(a, b), **TOL[torch.float32]
    )
    assert encoder.get_sentence_embedding_dimension() == st_reference.get_embedding_dimension() == 384
    assert encoder.get_embedding_dimension() == 384


@pytest.mark.parametrize("name", ["dot", "euclidean", "manhattan"])
def test_similarity_functions_equal_sentence_transformers(name):
    from sentence_transformers.util import similarity as st_sim

    reference = {
        "dot": (st_sim.dot_score, st_sim.pairwise_dot_score),
        "euclidean": (st_sim.euclidean_sim, st_sim.pairwise_euclidean_sim),
        "manhattan": (st_sim.manhattan_sim, st_sim.pairwise_manhattan_sim),
    }[name]
    a, b = torch.randn(5, 16), torch.randn(5, 16)
    ours = sim.similarity_functions(name)
    torch.testing.assert_close(ours[0](a, b), reference[0](a, b), **TOL[torch.float32])
    torch.testing.assert_close(ours[1](a, b), reference[1](a, b), **TOL[torch.float32])


def test_semantic_search_equals_sentence_transformers(encoder, tmp_path):
    from sentence_transformers.util import semantic_search as st_search

    corpus = encoder.encode(
        TEXTS + [f"item {i}: a {w} story" for i, w in enumerate(("sad", "long", "odd", "good"))]
    )  # no ties
    queries = encoder.encode(["a person eats", "horse riding"])
    expected = st_search(torch.from_numpy(queries), torch.from_numpy(corpus), top_k=4)
    for got in (
        sim.semantic_search(queries, corpus, top_k=4, corpus_chunk_size=5),
        sim.semantic_search(queries, [corpus[:5], corpus[5:]], top_k=4, corpus_chunk_size=3),
    ):
        assert [[h["corpus_id"] for h in q] for q in got] == [[h["corpus_id"] for h in q] for q in expected]
        torch.testing.assert_close(
            torch.tensor([[h["score"] for h in q] for q in got]),
            torch.tensor([[h["score"] for h in q] for q in expected]),
            **TOL[torch.float32],
        )
    # A memory-mapped corpus is read a chunk at a time, with the same result.
    path = tmp_path / "corpus.npy"
    np.save(path, corpus)
    mapped = sim.semantic_search(queries, np.load(path, mmap_mode="r"), top_k=4, corpus_chunk_size=4)
    assert [[h["corpus_id"] for h in q] for q in mapped] == [[h["corpus_id"] for h in q] for q in expected]
    from_texts = encoder.semantic_search(["a person eats", "horse riding"], corpus, top_k=4)
    assert [[h["corpus_id"] for h in q] for q in from_texts] == [[h["corpus_id"] for h in q] for q in expected]


def test_truncation_warning_once_per_encoder(minilm_path, caplog):
    encoder = SentenceEncoder.from_pretrained(minilm_path)
    with caplog.at_level(logging.WARNING, logger="bert_port.sentence"):
        encoder.encode(TEXTS)
        encoder.encode(TEXTS)
    warnings = [r for r in caplog.records if r.name == "bert_port.sentence"]
    assert len(warnings) == 1 and "truncated" in warnings[0].getMessage()


def test_bad_precision_is_refused(encoder):
    with pytest.raises(ValueError, match="precision 'int4' is not supported"):
        encoder.encode(TEXTS, precision="int4")


def test_semantic_search_over_a_bert_port_embed_run(minilm_path, encoder, tmp_path):
    """The shards of a real `bert-port-embed` run (three of 4 texts), one at a time: the same
    hits as the search over the whole array, `corpus_id` indexing the run's ids."""
    from bert_port.cli.embed import main as embed_main
    from bert_port.embed import read_embeddings

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS[:-1] + ["a quiet evening at home", "the horse ran fast"]) + "\n")
    out = tmp_path / "run"
    assert embed_main([str(corpus), str(out), "--model", str(minilm_path), "--shard-size", "4"]) == 0
    ids, whole = read_embeddings(out)
    queries = encoder.encode(["a person eats", "horse riding"])
    expected = sim.semantic_search(queries, whole, top_k=3)
    got = sim.semantic_search(queries, out, top_k=3, corpus_chunk_size=2)
    assert [[h["corpus_id"] for h in q] for q in got] == [[h["corpus_id"] for h in q] for q in expected]
    assert len(list(sim.embedding_shards(out))) == 3 and len(ids) == len(whole) > 8


def test_prompts_and_similarity_function_are_saved(minilm_path, tmp_path):
    """Prompts and `similarity_fn_name` set on an encoder are written to
    config_sentence_transformers.json (its other fields kept): sentence-transformers reads them back."""
    from sentence_transformers import SentenceTransformer

    encoder = SentenceEncoder.from_pretrained(minilm_path)
    encoder.prompts, encoder.default_prompt_name = {"query": "query: ", "document": ""}, "query"
    encoder.similarity_fn_name = "dot"
    out = encoder.save_pretrained(tmp_path / "saved")
    st = SentenceTransformer(str(out), device="cpu", local_files_only=True)
    assert st.prompts == encoder.prompts and st.default_prompt_name == "query" and st.similarity_fn_name == "dot"
    again = SentenceEncoder.from_pretrained(out)
    assert (again.prompts, again.default_prompt_name, again.similarity_fn_name) == (encoder.prompts, "query", "dot")
    torch.testing.assert_close(
        again.encode(TEXTS[:3], convert_to_tensor=True),
        st.encode(TEXTS[:3], convert_to_tensor=True),
        **TOL[torch.float32],
    )
