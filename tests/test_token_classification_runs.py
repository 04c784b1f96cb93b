"""Token classification end to end: a `bert-port-finetune` run whose entity F1 rises above a bar,
resume and accumulation as for sequence classification (torchrun too, slow), the checkpoint in
transformers, `bert-port-predict` against transformers' pipeline for every aggregation
strategy."""

# ruff: noqa: F811  (fixtures imported from ner_data, which pytest passes by name)

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, TOL, assert_same_step_losses, load_last, metrics_of, run_finetune
from ner_data import REPO, STRATEGIES, ckpt, files, ner_args, predict_inputs, splits  # noqa: F401  (fixtures)

from bert_port import BertConfig
from bert_port.cli import predict as predict_cli
from bert_port.tokenization import load_tokenizer
from bert_port.training import Collator


@pytest.fixture(scope="module")
def ner_run(tmp_path_factory, files, ckpt) -> Path:
    """The tiny model (random weights, the real vocabulary) trained on the rule tags: 3 epochs
    of 32 steps, an evaluation after each."""
    out = tmp_path_factory.mktemp("ner_run") / "run"
    torch.set_num_threads(1)  # a shared machine: one thread waits on no other
    assert run_finetune(*ner_args(files, ckpt, out, "--epochs", "3")) == 0
    return out


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
