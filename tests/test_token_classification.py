"""Token classification (NER): the rule-tagged `sms_ner` data, the alignment of word tags to word
pieces against transformers' token-classification example, seqeval's metrics on a known case
and on a planted bug. The fine-tuning run and `bert-port-predict` against transformers'
pipeline: test_token_classification_runs.py; bad inputs: test_token_classification_inputs.py."""

# ruff: noqa: F811  (fixtures imported from ner_data, which pytest passes by name)

from __future__ import annotations

import pytest
import torch
from ner_data import (
    first,
    splits,  # noqa: F401  (fixtures)
)

from bert_port.data import builtin_splits, load_sms
from bert_port.metrics import TagSequences, tagging_metrics
from bert_port.rule_ner import split_words, tag_words
from bert_port.tagged import check_bio
from bert_port.tokenization import load_tokenizer
from bert_port.training import Collator, Dist

# -----------------------------------------------------------------------------------------
# The data


def test_sms_ner_is_built_by_rules_on_the_sms_split(splits):
    """The messages of the sms split in which the rules find an entity, each in its split."""
    sms = builtin_splits("sms")
    assert {k: len(v) for k, v in splits.items()} == {"train": 1001, "validation": 123, "test": 144}
    for split, ds in splits.items():
        by_row = dict(zip(sms[split].rows, sms[split].texts))
        assert ds.words == [split_words(by_row[r]) for r in ds.rows]  # sms rows, split into words
        kept = sum(set(tag_words(split_words(t))) != {"O"} for t in sms[split].texts)
        assert kept == len(ds) and all(set(tags) != {"O"} for tags in ds.labels)
        assert all(ds.words) and all(len(w) == len(t) for w, t in zip(ds.words, ds.labels))
        for tags, line in zip(ds.labels, ds.rows):
            check_bio(tags, ds.source, line)
    words = split_words("Call 0800 169 6031 by 8am on 21st May 2005 for £1.50 or 20,000 pounds. May I? 3 times")
    assert list(zip(words, tag_words(words))) == [
        ("Call", "O"),
        ("0800", "B-PHONE"),
        ("169", "I-PHONE"),
        ("6031", "I-PHONE"),
        ("by", "O"),
        ("8am", "B-TIME"),
        ("on", "O"),
        ("21st", "B-DATE"),
        ("May", "I-DATE"),
        ("2005", "I-DATE"),
        ("for", "O"),
        ("£1.50", "B-MONEY"),
        ("or", "O"),
        ("20,000", "B-MONEY"),
        ("pounds", "I-MONEY"),
        (".", "O"),
        ("May", "O"),  # the verb: no day or year beside it
        ("I", "O"),
        ("?", "O"),
        ("3", "B-NUM"),
        ("times", "O"),
    ]
    assert len(load_sms()) == sum(map(len, sms.values()))


# -----------------------------------------------------------------------------------------
# Alignment: transformers' example, on the same tokenizer


def tokenize_and_align_labels(tokenizer, words, tags, label_to_id, max_length, label_all_tokens=False):
    """transformers' examples/pytorch/token-classification/run_ner.py, `tokenize_and_align_labels`
    (padding to the longest, as our collator; `b_to_i_label` as the example builds it)."""
    b_to_i_label = []
    for idx, label in enumerate(label_to_id):
        if label.startswith("B-") and label.replace("B-", "I-") in label_to_id:
            b_to_i_label.append(label_to_id[label.replace("B-", "I-")])
        else:
            b_to_i_label.append(idx)
    tokenized = tokenizer(words, padding=True, truncation=True, max_length=max_length, is_split_into_words=True)
    labels = []
    for i, label in enumerate(tags):
        word_ids = tokenized.word_ids(batch_index=i)
        previous_word_idx = None
        label_ids = []
        for word_idx in word_ids:
            if word_idx is None:
                label_ids.append(-100)
            elif word_idx != previous_word_idx:
                label_ids.append(label_to_id[label[word_idx]])
            elif label_all_tokens:
                label_ids.append(b_to_i_label[label_to_id[label[word_idx]]])
            else:
                label_ids.append(-100)
            previous_word_idx = word_idx
        labels.append(label_ids)
    return tokenized, torch.tensor(labels)


def test_labels_align_as_transformers_token_classification_example(splits, minilm_path):
    import transformers

    from bert_port.problem import ProblemType

    ds = first(splits["train"], 64)
    problem = ProblemType.TOKEN_CLASSIFICATION
    names = problem.label_names(ds, "tags")
    ours = Collator(load_tokenizer(minilm_path), ds, 24, problem.targets(ds, names))(range(len(ds)))
    ref = transformers.AutoTokenizer.from_pretrained(str(minilm_path))
    label_to_id = {n: i for i, n in enumerate(names)}
    tokenized, expected = tokenize_and_align_labels(ref, ds.words, ds.labels, label_to_id, 24)
    assert torch.equal(ours["input_ids"], torch.tensor(tokenized["input_ids"]))
    assert torch.equal(ours["labels"], expected)
    # Not vacuous: words of several pieces, and truncation, both occur in these sentences.
    _, every_piece = tokenize_and_align_labels(ref, ds.words, ds.labels, label_to_id, 24, label_all_tokens=True)
    assert not torch.equal(every_piece, expected)
    assert (ours["labels"] >= 0).sum() < sum(map(len, ds.words))


# -----------------------------------------------------------------------------------------
# Metrics: seqeval


def test_tagging_metrics_on_a_known_case():
    true = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "O"], ["B-ORG", "B-ORG"]]
    m = tagging_metrics(true, pred, loss_sum=1.0)
    # By hand: true entities PER, LOC, ORG; predicted PER, ORG, ORG; PER and the first ORG right.
    assert m["entity_precision"] == pytest.approx(2 / 3) and m["entity_recall"] == pytest.approx(2 / 3)
    assert m["entity_f1"] == pytest.approx(2 / 3) and m["token_accuracy"] == pytest.approx(4 / 6)
    assert m["per_type"]["PER"] == {"precision": 1.0, "recall": 1.0, "f1": 1.0, "support": 1}
    assert m["per_type"]["LOC"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 1}
    assert m["per_type"]["ORG"]["precision"] == 0.5 and m["per_type"]["ORG"]["f1"] == pytest.approx(2 / 3)
    assert m["loss"] == 0.5 and m["n"] == 2 and m["entities"] == 3


def test_metrics_count_words_not_pieces_a_planted_bug_is_caught(splits, minilm_path):
    """Perfect predictions on the collator's targets score F1 1 over exactly the words'
    entities. The planted bug, the word's tag on every piece (label_all_tokens without the
    example's B- to I- rewrite), splits multi-piece entities and changes the count, which the
    same check catches."""
    from seqeval.metrics.sequence_labeling import get_entities

    from bert_port.problem import ProblemType

    ds = first(splits["validation"], 48)
    problem = ProblemType.TOKEN_CLASSIFICATION
    names = problem.label_names(ds, "tags")
    collate = Collator(load_tokenizer(minilm_path), ds, 128, problem.targets(ds, names))
    word_entities = sum(len(get_entities(tags)) for tags in ds.labels)

    def perfect_run(labels: torch.Tensor) -> dict:
        acc = TagSequences(len(names), torch.device("cpu"))
        logits = torch.nn.functional.one_hot(labels.clamp(min=0), len(names)).float()
        acc.add(logits, labels)
        return acc.finish(0.0, names, Dist())

    batch = collate(range(len(ds)))
    good = perfect_run(batch["labels"])
    assert good["entity_f1"] == 1.0 and good["entities"] == word_entities
    every_piece = batch["labels"].clone()
    for i in range(len(ds)):
        word_ids = batch.word_ids(i)
        for t, w in enumerate(word_ids):
            if w is not None:
                every_piece[i, t] = names.index(ds.labels[i][w])
    assert perfect_run(every_piece)["entities"] != word_entities
