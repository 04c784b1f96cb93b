"""sentence-transformers' call names on `SentenceEncoder`, each against `SentenceTransformer`
in the same run on the bundled all-MiniLM-L6-v2: `encode`'s first parameter as `sentences=`
and `inputs=`, `output_value="token_embeddings"`, int8/uint8 of one text, `tokenize`, `save`,
`get_max_seq_length` and `device`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import REAL_SENTENCES, TOL

from bert_port import SentenceEncoder

TEXTS = [*REAL_SENTENCES[:4], "A man is eating food.", "long " * 300]


@pytest.fixture(scope="module")
def st_reference(minilm_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu", local_files_only=True)


@pytest.fixture(scope="module")
def encoder(minilm_path):
    return SentenceEncoder.from_pretrained(minilm_path)


@pytest.mark.parametrize("name", ["sentences", "inputs", "texts"])
def test_encode_takes_the_first_parameter_by_each_name(encoder, st_reference, name):
    actual = encoder.encode(**{name: TEXTS}, convert_to_tensor=True)
    expected = st_reference.encode(TEXTS, convert_to_tensor=True)
    if name != "texts":  # sentence-transformers' own names of the parameter
        torch.testing.assert_close(st_reference.encode(**{name: TEXTS}, convert_to_tensor=True), expected)
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])
    torch.testing.assert_close(actual, encoder.encode(TEXTS, convert_to_tensor=True), atol=0, rtol=0)
    query = encoder.encode_query(**{name: TEXTS[:2]}, convert_to_tensor=True)
    torch.testing.assert_close(
        query, st_reference.encode_query(TEXTS[:2], convert_to_tensor=True), **TOL[torch.float32]
    )


def test_encode_takes_the_texts_once(encoder):
    with pytest.raises(TypeError, match=r"got them 2 times \(texts, inputs\)"):
        encoder.encode(TEXTS, inputs=TEXTS)
    with pytest.raises(TypeError, match="takes the texts once, as its first argument.*got none"):
        encoder.encode(batch_size=4)


def test_token_embeddings_equal_sentence_transformers(encoder, st_reference):
    """Each text's vectors of its real tokens, in the input's order (the texts are sorted by
    length inside), the truncated one cut to max_seq_length; one text gives one matrix."""
    actual = encoder.encode(TEXTS, output_value="token_embeddings", batch_size=2)
    expected = st_reference.encode(TEXTS, output_value="token_embeddings", batch_size=2)
    assert isinstance(actual, list) and len(actual) == len(expected) == len(TEXTS)
    assert actual[-1].shape == (256, 384)
    for a, e in zip(actual, expected, strict=True):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, **TOL[torch.float32])
    one = encoder.encode(TEXTS[0], output_value="token_embeddings", convert_to_tensor=True)
    torch.testing.assert_close(
        one, st_reference.encode(TEXTS[0], output_value="token_embeddings"), **TOL[torch.float32]
    )
    with pytest.raises(ValueError, match="output_value 'pooled' is not supported"):
        encoder.encode(TEXTS, output_value="pooled")


@pytest.mark.parametrize("precision", ["int8", "uint8"])
def test_int8_of_one_text_without_ranges_raises_as_sentence_transformers(encoder, st_reference, precision):
    with pytest.raises(ValueError, match="single embedding"):
        st_reference.encode(TEXTS[0], precision=precision)
    with pytest.raises(ValueError, match=f"cannot compute {precision} ranges from a single embedding"):
        encoder.encode(TEXTS[0], precision=precision)
    with pytest.raises(ValueError, match="single embedding"):
        encoder.encode(TEXTS[:1], precision=precision)
    assert encoder.encode(TEXTS[:2], precision=precision).dtype == np.dtype(precision)
    assert encoder.encode(TEXTS[0], precision="binary").shape == st_reference.encode(TEXTS[0], precision="binary").shape


@pytest.mark.parametrize("kind", ["texts", "pairs"])
def test_tokenize_equals_sentence_transformers(encoder, st_reference, kind):
    batch = TEXTS if kind == "texts" else [(TEXTS[0], TEXTS[-1]), (TEXTS[1], TEXTS[2])]
    actual = encoder.tokenize(batch)
    expected = st_reference.tokenize(batch)
    assert set(actual) == {"input_ids", "token_type_ids", "attention_mask"}
    for name, tensor in actual.items():
        assert torch.equal(tensor, expected[name]), name
    with pytest.raises(TypeError, match=r"put one text in a list: tokenize\(\[text\]\)"):
        encoder.tokenize(TEXTS[0])


def test_save_gives_a_folder_sentence_transformers_loads(encoder, st_reference, tmp_path):
    from sentence_transformers import SentenceTransformer

    assert encoder.save(str(tmp_path / "m")) is None
    loaded = SentenceTransformer(str(tmp_path / "m"), device="cpu", local_files_only=True)
    torch.testing.assert_close(
        loaded.encode(TEXTS, convert_to_tensor=True), st_reference.encode(TEXTS, convert_to_tensor=True), atol=0, rtol=0
    )
    again = SentenceEncoder.from_pretrained(tmp_path / "m")
    torch.testing.assert_close(again.encode(TEXTS), encoder.encode(TEXTS), atol=0, rtol=0)
    with pytest.raises(ValueError, match="safetensors only"):
        encoder.save(tmp_path / "n", safe_serialization=False)


def test_max_seq_length_and_device_equal_sentence_transformers(encoder, st_reference):
    assert encoder.get_max_seq_length() == st_reference.get_max_seq_length() == 256
    assert encoder.device == st_reference.device == torch.device("cpu")
    assert isinstance(encoder.device, torch.device)
