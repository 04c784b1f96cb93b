"""Token classification (NER) end to end: the rule-tagged `sms_ner` data, the alignment of word
tags to word pieces against transformers' token-classification example, seqeval's metrics on a
known case and on a planted bug, a `bert-port-finetune` run whose entity F1 rises above a bar,
resume and accumulation as for sequence classification (torchrun too, slow), the checkpoint in
transformers, `bert-port-predict` against transformers' pipeline for every aggregation
strategy, and the bad inputs, each an exit 2 with one line."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, TOL, assert_same_step_losses, load_last, metrics_of, run_finetune, tiny_checkpoint

from bert_port import BertConfig
from bert_port.cli import predict as predict_cli
from bert_port.data import builtin_splits, load_sms
from bert_port.metrics import TagSequences, tagging_metrics
from bert_port.rule_ner import split_words, tag_words
from bert_port.tagged import TaggedDataset, check_bio, write_conll
from bert_port.tokenization import load_tokenizer
from bert_port.training import Collator, Dist

REPO = Path(__file__).resolve().parent.parent
STRATEGIES = ("none", "simple", "first", "average", "max")


def first(ds: TaggedDataset, n: int) -> TaggedDataset:
    return ds.subset(range(min(n, len(ds))))


def write_jsonl(ds: TaggedDataset, path: Path) -> Path:
    path.write_text("".join(json.dumps({"tokens": w, "tags": t}) + "\n" for w, t in zip(ds.words, ds.labels)))
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, minilm_path) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), minilm_path)  # TINY, dropout 0.1


@pytest.fixture(scope="module")
def splits() -> dict[str, TaggedDataset]:
    return builtin_splits("sms_ner")


@pytest.fixture(scope="module")
def files(tmp_path_factory, splits) -> dict[str, Path]:
    """256 training messages as CoNLL, 48 validation ones as JSONL (both readers); for the short
    runs, 40 training messages and 16 validation ones whose tags those 40 hold."""
    root = tmp_path_factory.mktemp("ner")
    small = first(splits["train"], 40)
    seen = {tag for tags in small.labels for tag in tags}
    validation = splits["validation"]
    fits = validation.subset([i for i, tags in enumerate(validation.labels) if set(tags) <= seen][:16])
    return {
        "train": write_conll(first(splits["train"], 256), root / "train.conll"),
        "validation": write_jsonl(first(validation, 48), root / "validation.jsonl"),
        "small": write_conll(small, root / "small.conll"),
        "small_validation": write_conll(fits, root / "small_validation.conll"),
    }


def ner_args(files, ckpt, out, *extra) -> list:
    return [
        *("--checkpoint", ckpt, "--problem-type", "token_classification", "--device", "cpu"),
        *("--train", files["train"], "--validation", files["validation"], "--output-dir", out),
        *("--max-length", "32", "--batch-size", "8", "--lr", "5e-3", "--warmup-steps", "4"),
        *extra,
    ]


@pytest.fixture(scope="module")
def ner_run(tmp_path_factory, files, ckpt) -> Path:
    """The tiny model (random weights, the real vocabulary) trained on the rule tags: 3 epochs
    of 32 steps, an evaluation after each."""
    out = tmp_path_factory.mktemp("ner_run") / "run"
    torch.set_num_threads(1)  # a shared machine: one thread waits on no other
    assert run_finetune(*ner_args(files, ckpt, out, "--epochs", "3")) == 0
    return out


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


# -----------------------------------------------------------------------------------------
# Fine-tuning


def test_finetuned_tagger_learns_the_rules(ner_run):
    m = metrics_of(ner_run)
    f1 = [e["validation"]["entity_f1"] for e in m["evaluations"]]
    print(f"sms_ner validation entity F1 by epoch: {[round(x, 3) for x in f1]}")
    # A tagger that tags nothing scores 0, and so does this model after one epoch (it has
    # learnt only that most words are O); the run ends near 0.78 (printed above): 0.5 is
    # well above what no learning gives and leaves room for another BLAS library's rounding.
    assert f1[0] < 0.2 and max(f1) >= 0.5
    assert m["best"]["metric"] == "entity_f1" and m["best"]["value"] == max(f1)
    best = m["evaluations"][f1.index(max(f1))]["validation"]
    assert best["token_accuracy"] > 0.9 and set(best["per_type"]) <= {"DATE", "MONEY", "NUM", "PHONE", "TIME"}
    config = json.loads((ner_run / "config.json").read_text())
    assert config["architectures"] == ["BertForTokenClassification"] and "problem_type" not in config
    assert config["id2label"]["0"] == "O" and config["label2id"] == {v: int(k) for k, v in config["id2label"].items()}
    assert m["config"]["metric_for_best"] == "entity_f1"


def test_saved_tagger_gives_transformers_logits(ner_run, files):
    import transformers

    from bert_port.heads import BertForTokenClassification
    from bert_port.tagged import read_conll

    ref = transformers.BertForTokenClassification.from_pretrained(str(ner_run)).eval()
    ours = BertForTokenClassification.from_pretrained(ner_run, attn_implementation="eager", optimize=False)
    ds = read_conll(files["small"])
    batch = Collator(load_tokenizer(ner_run), ds, 32)(range(len(ds)))
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    with torch.no_grad():
        torch.testing.assert_close(ours(**inputs).logits, ref(**inputs).logits, **TOL[torch.float32])


def test_tagger_resume_is_bitwise_under_bf16(tmp_path, files, ckpt):
    """With dropout on and bf16 autocast: stop mid-epoch 2, between evaluations, resume, and
    get the uninterrupted run's losses, evaluations and weights bit for bit."""
    small = {"train": files["small"], "validation": files["small_validation"]}
    options = ("--epochs", "2", "--eval-steps", "4", "--bf16")
    assert run_finetune(*ner_args(small, ckpt, tmp_path / "full", *options)) == 0
    args = ner_args(small, ckpt, tmp_path / "split", *options)
    assert run_finetune(*args, "--stop-after-steps", "7") == 0
    assert metrics_of(tmp_path / "split")["status"] == "stopped"
    assert run_finetune(*args, "--resume") == 0
    full, resumed = metrics_of(tmp_path / "full"), metrics_of(tmp_path / "split")
    assert resumed["status"] == "completed" and len(full["steps"]) == 10 and len(full["evaluations"]) == 3
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in full["steps"])
    assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in full["steps"]]
    assert [e["validation"] for e in resumed["evaluations"]] == [e["validation"] for e in full["evaluations"]]
    a, b = load_last(tmp_path / "split")["model"], load_last(tmp_path / "full")["model"]
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.slow
def test_tagger_accumulation_and_torchrun_equal_one_process(tmp_path, files, tiny_checkpoint_no_dropout):
    """Each sentence's loss is its own mean, so the step of a global batch of 8 is the same in
    one process, in two accumulated micro-batches of 4, and in two torchrun processes of 4
    (40 sentences: 5 steps of 8, evaluations every 2 steps and at the end)."""
    small, ckpt = {"train": files["small"], "validation": files["small_validation"]}, tiny_checkpoint_no_dropout
    options = ("--epochs", "1", "--eval-steps", "2")
    assert run_finetune(*ner_args(small, ckpt, tmp_path / "one", *options)) == 0
    assert run_finetune(*ner_args(small, ckpt, tmp_path / "accum", *options, "--grad-accum-steps", "2")) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    args = map(str, ner_args(small, ckpt, tmp_path / "ddp", *options))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run([*cmd, "-m", "bert_port.cli.finetune", *args], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = metrics_of(tmp_path / "one")
    assert len(one["steps"]) == 5 and [e["step"] for e in one["evaluations"]] == [2, 4, 5]
    for other in ("accum", "ddp"):
        m = metrics_of(tmp_path / other)
        assert m["config"]["world_size"] == (2 if other == "ddp" else 1)
        assert_same_step_losses(m, one)
        for a, b in zip(m["evaluations"], one["evaluations"]):
            assert a["validation"]["per_type"] == b["validation"]["per_type"]  # each sentence counted once
            assert abs(a["validation"]["loss"] - b["validation"]["loss"]) < 1e-5
        weights, reference = load_last(tmp_path / other)["model"], load_last(tmp_path / "one")["model"]
        for k in reference:
            torch.testing.assert_close(weights[k], reference[k], atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def tiny_checkpoint_no_dropout(tmp_path_factory, minilm_path) -> Path:
    from bert_port import BertModel

    torch.manual_seed(0)
    model = BertModel(
        BertConfig.from_dict(
            {**TINY, "vocab_size": 30522, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
        )
    )
    model.source_dir = minilm_path
    return model.save_pretrained(tmp_path_factory.mktemp("tiny_d0"))


# -----------------------------------------------------------------------------------------
# Prediction: transformers' pipeline on the same saved folder


@pytest.fixture(scope="module")
def predict_inputs(tmp_path_factory, splits) -> dict[str, Path]:
    """Real test messages: as plain text, and pre-split (CoNLL words with their tags, and JSONL `tokens`)."""
    root = tmp_path_factory.mktemp("predict")
    texts = [t for t in builtin_splits("sms")["test"].texts if len(t) < 120][:24]
    texts.append("naïve café: £1.50 at 8am ☃ isn't it")  # accents, [UNK], a split word
    (root / "texts.txt").write_text("\n".join(texts) + "\n\n", encoding="utf-8")
    words = first(splits["test"], 24)
    words = words.subset([i for i, w in enumerate(words.words) if len(w) < 30])
    return {"texts": root / "texts.txt", "words": write_conll(words, root / "words.conll")}


@pytest.fixture(scope="module")
def pipeline(ner_run):
    import transformers

    return transformers.pipeline("token-classification", model=str(ner_run), device="cpu")


def _pipeline_entities(pipeline, inputs, strategy):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = pipeline(
            inputs,
            aggregation_strategy=strategy,
            **({} if isinstance(inputs[0], str) else {"is_split_into_words": True}),
        )
    return [[{**e, "score": float(e["score"])} for e in entities] for entities in found]


def assert_same_entities(ours: list[list[dict]], theirs: list[list[dict]]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert [{k: v for k, v in e.items() if k != "score"} for e in a] == [
            {k: v for k, v in e.items() if k != "score"} for e in b
        ]
        torch.testing.assert_close(
            torch.tensor([e["score"] for e in a]), torch.tensor([e["score"] for e in b]), **TOL[torch.float32]
        )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_predict_equals_transformers_pipeline(ner_run, predict_inputs, pipeline, tmp_path, strategy, capsys):
    from bert_port.tagged import read_conll

    found = 0
    for kind, source in predict_inputs.items():
        out = tmp_path / f"{kind}.jsonl"
        args = ["--model", str(ner_run), "--input", str(source), "--output", str(out)]
        assert predict_cli.main([*args, "--aggregation-strategy", strategy, "--batch-size", "8"]) == 0
        assert "wrote" in capsys.readouterr().out
        rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
        if kind == "texts":
            inputs = [line for line in source.read_text(encoding="utf-8").split("\n") if line.strip()]
            assert [r["text"] for r in rows] == inputs
        else:
            inputs = read_conll(source, tags=False).words
            assert [r["tokens"] for r in rows] == inputs and [r["text"] for r in rows] == [" ".join(w) for w in inputs]
        ours = [r["entities"] for r in rows]
        assert_same_entities(ours, _pipeline_entities(pipeline, inputs, strategy))
        found += sum(map(len, ours))
    assert found > 10  # the model finds entities: the comparison is not of empty lists


def test_predict_reads_jsonl_tokens_and_csv(ner_run, predict_inputs, pipeline, tmp_path, capsys):
    from bert_port.tagged import read_conll

    words = read_conll(predict_inputs["words"], tags=False).words[:6]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": i, "tokens": w}) + "\n" for i, w in enumerate(words)))
    out = tmp_path / "out.csv"
    assert predict_cli.main(["--model", str(ner_run), "--input", str(source), "--output", str(out)]) == 0
    rows = list(csv.DictReader(out.open(encoding="utf-8")))
    assert list(rows[0]) == ["id", "tokens", "text", "entities"]
    assert_same_entities([json.loads(r["entities"]) for r in rows], _pipeline_entities(pipeline, words, "first"))
    assert "entities" in capsys.readouterr().out
    clash = tmp_path / "clash.jsonl"
    clash.write_text(json.dumps({"tokens": ["hi"], "entities": []}) + "\n")
    assert (
        predict_cli.main(["--model", str(ner_run), "--input", str(clash), "--output", str(tmp_path / "c.jsonl")]) == 2
    )
    err = capsys.readouterr().err
    assert "already has a column 'entities'" in err and err.count("\n") == 1


# -----------------------------------------------------------------------------------------
# Bad input: exit 2, one line


@pytest.mark.parametrize(
    "train, validation, extra, message",
    [
        ("call\tO\n0800\n", None, [], "line 2: '0800' has no tag column; each line holds a word and its tag"),
        ("call O\n0800 PHONE\n", None, [], "the tag 'PHONE' is not in BIO form"),
        ("", None, [], "holds no sentences"),
        ("-DOCSTART- O\n\n", None, [], "holds no sentences"),
        ("a O\nb B-X\n", "a O\nb B-Y\n\nc B-Y\n", [], "'B-Y' (2 word(s), first in the sentence at line 1)"),
        ("a O\nb O\n", "c O\n", [], "every training word is tagged 'O'"),
        ('{"tokens": ["a", "b"], "tags": ["O"]}\n', None, [], "line 1: 2 tokens but 1 tags"),
        ('{"tokens": "a b", "tags": ["O"]}\n', None, [], "'tokens' must be a non-empty list of non-empty strings"),
        ("text,label\nhi,O\n", None, [], "token classification reads CoNLL files"),
        ("a B-X\n", None, ["--text-pair-column", "b"], "--text-pair-column does not apply to token_classification"),
    ],
    ids=[
        "no-tag-column",
        "not-bio",
        "empty",
        "docstart-only",
        "unseen-validation-tag",
        "only-O",
        "jsonl-lengths",
        "jsonl-tokens-not-list",
        "csv",
        "pairs",
    ],
)
def test_bad_tagged_data_is_one_line_and_exit_2(tmp_path, capsys, ckpt, train, validation, extra, message):
    suffix = ".jsonl" if train.startswith("{") else ".csv" if train.startswith("text,") else ".conll"
    (tmp_path / f"train{suffix}").write_text(train)
    data = ["--train", tmp_path / f"train{suffix}"]
    if validation is not None:
        (tmp_path / "validation.conll").write_text(validation)
        data += ["--validation", tmp_path / "validation.conll"]
    args = [
        "--checkpoint",
        ckpt,
        "--problem-type",
        "token_classification",
        "--output-dir",
        tmp_path / "out",
        "--max-length",
        16,
    ]
    assert run_finetune(*args, *data, *extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "out" / "checkpoints" / "last-checkpoint.pt").exists()


def test_aggregation_strategy_on_a_sequence_classifier_is_refused(tmp_path, capsys, minilm_path, predict_inputs):
    from bert_port.classifier import BertForSequenceClassification

    config = BertConfig.from_dict({**TINY, "vocab_size": 30522, "id2label": {0: "ham", 1: "spam"}})
    model = BertForSequenceClassification(config)
    model.source_dir = minilm_path
    folder = model.save_pretrained(tmp_path / "classifier")
    texts = tmp_path / "in.csv"
    texts.write_text("text\nhello\n")
    args = ["--model", str(folder), "--input", str(texts), "--output", str(tmp_path / "o.csv"), "--max-length", "16"]
    assert predict_cli.main([*args, "--aggregation-strategy", "first"]) == 2
    err = capsys.readouterr().err
    assert "--aggregation-strategy applies to token-classification models" in err and err.count("\n") == 1
    assert predict_cli.main(args) == 0  # without the flag it predicts as before


def test_token_classification_without_seqeval_stops_before_any_work(tmp_path, capsys, ckpt, files, monkeypatch):
    monkeypatch.setitem(sys.modules, "seqeval", None)  # as if not installed: importing it raises ImportError
    assert run_finetune(*ner_args(files, ckpt, tmp_path / "out", "--epochs", "1")) == 2
    err = capsys.readouterr().err
    assert "needs the Python package 'seqeval'" in err and "pip install 'bert-port[ner]'" in err
    assert not (tmp_path / "out" / "checkpoints" / "last-checkpoint.pt").exists()
