"""bert-port-predict on a classifier that transformers 5 saved with its default labels (no
id2label written): the labels and probabilities of transformers' own pipeline, computed in the
same run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import REAL_SENTENCES, TINY, TOL

from bert_port.cli.predict import main as predict_main


@pytest.fixture(scope="module")
def default_label_classifier(tmp_path_factory, minilm_path):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("default_labels") / "model"
    config = BertConfig(
        **{**TINY, "vocab_size": 30522, "max_position_embeddings": 512}
    )  # num_labels 2, the default: no id2label is written
    BertForSequenceClassification(config).eval().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_path / name, folder / name)
    assert "id2label" not in json.loads((folder / "config.json").read_text())
    return folder


def test_default_labels_predict_as_the_pipeline(default_label_classifier, tmp_path):
    from transformers import pipeline

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"text": t}) + "\n" for t in REAL_SENTENCES))
    assert predict_main(["--model", str(default_label_classifier), "--input", str(inp), "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    reference = pipeline("text-classification", model=str(default_label_classifier), device="cpu", top_k=None)
    expected = reference(REAL_SENTENCES)
    for row, theirs in zip(rows, expected):
        best = max(theirs, key=lambda d: d["score"])
        assert row["predicted_label"] == best["label"]
        assert set(row["probabilities"]) == {"LABEL_0", "LABEL_1"}
        torch.testing.assert_close(
            torch.tensor([row["probabilities"][d["label"]] for d in theirs]),
            torch.tensor([d["score"] for d in theirs]),
            **TOL[torch.float32],
        )
