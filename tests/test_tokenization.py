"""`encode` against transformers' tokenizer of the same checkpoint (BertTokenizerFast from
the bundled all-MiniLM-L6-v2 files): a bare string, pairs, truncation to the checkpoint's
`model_max_length`, offsets and word ids."""

from __future__ import annotations

import pytest
import torch
from conftest import REAL_SENTENCES

from bert_port import encode, load_tokenizer

LONG = "lorem ipsum dolor sit amet " * 150  # about 750 tokens


@pytest.fixture(scope="module")
def tokenizers(minilm_path):
    import transformers

    return load_tokenizer(minilm_path), transformers.AutoTokenizer.from_pretrained(str(minilm_path))


def assert_same_batch(ours: dict, ref) -> None:
    for name in ("input_ids", "token_type_ids", "attention_mask"):
        assert torch.equal(ours[name], ref[name]), name


def test_bare_string_is_one_text(tokenizers):
    ours, ref = tokenizers
    batch = encode(ours, "one whole sentence")
    assert batch["input_ids"].shape[0] == 1
    assert_same_batch(batch, ref(["one whole sentence"], return_tensors="pt"))


def test_pairs_match_transformers(tokenizers):
    ours, ref = tokenizers
    firsts, seconds = REAL_SENTENCES[:4], REAL_SENTENCES[2:6]
    assert_same_batch(encode(ours, firsts, seconds), ref(firsts, seconds, padding=True, return_tensors="pt"))
    assert_same_batch(
        encode(ours, "a question?", "a context."), ref(["a question?"], ["a context."], return_tensors="pt")
    )
    # Longest-first truncation of pairs, as transformers' truncation=True.
    expected = ref([LONG], [REAL_SENTENCES[0]], truncation=True, max_length=40, return_tensors="pt")
    assert_same_batch(encode(ours, LONG, REAL_SENTENCES[0], max_length=40), expected)


def test_truncation_honours_the_checkpoint_model_max_length(tokenizers, minilm_path):
    ours, ref = tokenizers
    assert ref.model_max_length == 512
    batch = encode(ours, [LONG, "short"])
    assert batch["input_ids"].shape == (2, 512)
    assert_same_batch(batch, ref([LONG, "short"], padding=True, truncation=True, return_tensors="pt"))
    # An explicit max_length wins, and encode leaves the tokenizer as it found it.
    assert encode(ours, LONG, max_length=300)["input_ids"].shape == (1, 300)
    assert ours.truncation["max_length"] == 512
    assert load_tokenizer(minilm_path, max_length=128).truncation["max_length"] == 128


def test_offsets_and_word_ids_match_transformers(tokenizers):
    ours, ref = tokenizers
    texts = ["naïve café owners: Ünïcödé", "unbelievably tokenized words"]
    batch = encode(ours, texts, return_offsets_mapping=True)
    expected = ref(texts, padding=True, return_offsets_mapping=True, return_tensors="pt")
    assert torch.equal(batch["offset_mapping"], expected["offset_mapping"])
    assert not batch["attention_mask"].all()  # a padded row: tokens(i) has its length T too
    for i in range(len(texts)):
        assert batch.word_ids(i) == expected.word_ids(i)
        assert batch.tokens(i) == expected.tokens(i)  # padded, as word_ids: position t is input_ids[i, t]
    pair = encode(ours, "first words", "second ones", return_offsets_mapping=True)
    assert pair.word_ids(0) == ref(["first words"], ["second ones"]).word_ids(0)


def test_bad_texts_are_refused(tokenizers):
    ours, _ = tokenizers
    with pytest.raises(ValueError, match="one pair per text"):
        encode(ours, ["a", "b"], ["c"])
    with pytest.raises(ValueError, match="item 1 is int"):
        encode(ours, ["a", 3])
    with pytest.raises(ValueError, match="no texts"):
        encode(ours, [])


# is_split_into_words: words as given (token classification), against transformers' fast tokenizer
SPLIT = [
    ["Isn't", "it", "naïve", "to", "call", "0800", "169", "6031", "at", "8am", "?"],
    ["unbelievably", "tokenized", "words", "", "£1.50", "☃", "Ünïcödé", "中文"],
    ["ok"],
]


def test_split_into_words_matches_transformers(tokenizers):
    ours, ref = tokenizers
    batch = encode(ours, SPLIT, is_split_into_words=True, return_offsets_mapping=True)
    expected = ref(SPLIT, is_split_into_words=True, padding=True, return_offsets_mapping=True, return_tensors="pt")
    assert_same_batch(batch, expected)
    # Offsets are spans within each word, as transformers gives them for pre-split input.
    assert torch.equal(batch["offset_mapping"], expected["offset_mapping"])
    for i in range(len(SPLIT)):
        assert batch.word_ids(i) == expected.word_ids(i)
        assert batch.tokens(i) == expected.tokens(i)
    # The given words, not the pre-tokenizer's: "Isn't" is word 0 for its 3 pieces, "it" word 1.
    assert batch.tokens(0)[1:5] == ["isn", "'", "t", "it"] and batch.word_ids(0)[1:5] == [0, 0, 0, 1]
    assert encode(ours, "Isn't it").word_ids(0)[1:5] == [0, 1, 2, 3]  # plain text: the pre-tokenizer's words
    assert 3 not in batch.word_ids(1)  # the empty word has no piece


def test_split_into_words_one_list_pairs_and_truncation(tokenizers):
    ours, ref = tokenizers
    one = encode(ours, SPLIT[0], is_split_into_words=True)  # one list of words is one text
    assert_same_batch(one, ref(SPLIT[0], is_split_into_words=True, return_tensors="pt"))
    pairs = encode(ours, SPLIT[:2], SPLIT[1:], is_split_into_words=True, max_length=12)
    expected = ref(
        SPLIT[:2],
        SPLIT[1:],
        is_split_into_words=True,
        padding=True,
        truncation=True,
        max_length=12,
        return_tensors="pt",
    )
    assert_same_batch(pairs, expected)
    assert [pairs.word_ids(i) for i in range(2)] == [expected.word_ids(i) for i in range(2)]


@pytest.mark.parametrize(
    "texts, message",
    [
        ("a text", "must be a list of words or a list of word lists, not str"),
        ([["a", 1]], "item 0, word 1 is int; words are strings"),
        ([["a"], "b"], "item 1 is str; give every text as a list of words"),
        ([], "no texts"),
    ],
)
def test_split_into_words_refuses_other_shapes(tokenizers, texts, message):
    with pytest.raises(ValueError, match=message):
        encode(tokenizers[0], texts, is_split_into_words=True)
