"""The jobs on the BERT family: bert-port-finetune on a tiny random RoBERTa and DistilBERT
classifier (tokenizers trained here with `tokenizers`, the bundled SMS messages), then
bert-port-predict on the result against transformers' pipeline on the same folder."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TOL, assert_same_step_losses, metrics_of, run_finetune
from test_families import save_random

from bert_port.cli.predict import main as predict_main
from bert_port.data import builtin_splits, write_texts

TEXTS = ["WINNER! claim your free prize now: call 09061701461", "see you at lunch tomorrow?"]


@pytest.fixture(scope="module")
def sms(tmp_path_factory) -> dict:
    """24 training and 12 validation messages of the bundled SMS split, ham and spam in each."""
    root = tmp_path_factory.mktemp("sms")
    splits = builtin_splits("sms")

    def mixed(ds, n_ham, n_spam):
        ham = [i for i, label in enumerate(ds.labels) if label == "ham"][:n_ham]
        return ds.subset(sorted(ham + [i for i, label in enumerate(ds.labels) if label == "spam"][:n_spam]))

    train = mixed(splits["train"], 16, 8)
    return {
        "train": write_texts(train, root / "train.csv"),
        "validation": write_texts(mixed(splits["validation"], 8, 4), root / "validation.csv"),
        "texts": train.texts,
    }


def _wordpiece(path, texts) -> None:
    """A WordPiece tokenizer.json of at most 400 pieces trained here on `texts` (DistilBERT's kind),
    with its tokenizer_config.json, in place of the tokenizer files in `path`."""
    from tokenizers import BertWordPieceTokenizer, processors

    for name in ("vocab.txt", "special_tokens_map.json"):  # the bundled WordPiece's, which save_random copied
        (path / name).unlink(missing_ok=True)
    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(texts, vocab_size=400, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    # [CLS] ... [SEP] as a real DistilBERT tokenizer.json says (transformers' class adds them even without)
    tok._tokenizer.post_processor = processors.BertProcessing(*((t, tok.token_to_id(t)) for t in ("[SEP]", "[CLS]")))
    tok.save(str(path / "tokenizer.json"))
    settings = dict(tokenizer_class="DistilBertTokenizer", do_lower_case=True, model_max_length=64)
    settings.update(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    (path / "tokenizer_config.json").write_text(json.dumps(settings))


def _classifier(family: str, path, texts) -> None:
    """A random transformers classifier of the family (ham/spam) and its tokenizer in `path`; no
    dropout, so that the port's run and transformers' twin's are the same sums."""
    labels = dict(id2label={0: "ham", 1: "spam"}, label2id={"ham": 0, "spam": 1})
    if family == "roberta":
        no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        save_random("roberta", path, cls_name="RobertaForSequenceClassification", **labels, **no_dropout)
        return
    no_dropout = dict(dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0)
    save_random(
        "distilbert", path, cls_name="DistilBertForSequenceClassification", vocab_size=400, **labels, **no_dropout
    )
    _wordpiece(path, texts)


@pytest.mark.parametrize("family", ["roberta", "distilbert"])
def test_finetune_then_predict_on_the_family(tmp_path, sms, family):
    """A few fine-tuning steps train the family's classifier (the weights move, the step losses are
    those of the same run on transformers' twin, `--reference hf`), the run saves a folder
    transformers reads with the family's class, and bert-port-predict on it gives the labels and
    probabilities of transformers' own pipeline."""
    import transformers
    from transformers import pipeline

    _classifier(family, tmp_path / "start", sms["texts"])
    out = tmp_path / "run"
    args = ["--checkpoint", tmp_path / "start", "--train", sms["train"], "--validation", sms["validation"]]
    args += ["--max-length", "24", "--batch-size", "8", "--max-steps", "3", "--eval-steps", "3"]
    args += ["--lr", "1e-3", "--warmup-steps", "1", "--device", "cpu"]
    assert run_finetune(*args, "--output-dir", out) == 0
    assert run_finetune(*args, "--output-dir", tmp_path / "hf", "--reference", "hf") == 0
    assert len(metrics_of(out)["steps"]) == 3
    assert_same_step_losses(metrics_of(out), metrics_of(tmp_path / "hf"))
    config = json.loads((out / "config.json").read_text())
    cls_name = {"roberta": "RobertaForSequenceClassification", "distilbert": "DistilBertForSequenceClassification"}
    assert config["model_type"] == family and config["architectures"] == [cls_name[family]]
    start = getattr(transformers, cls_name[family]).from_pretrained(str(tmp_path / "start"))
    tuned = getattr(transformers, cls_name[family]).from_pretrained(str(out))
    moved = [k for k, v in start.state_dict().items() if not torch.equal(v, tuned.state_dict()[k])]
    assert any(k.startswith("classifier.") for k in moved) and any(k.startswith(family) for k in moved)

    inp, predictions = tmp_path / "texts.jsonl", tmp_path / "predictions.jsonl"
    inp.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    assert predict_main(["--model", str(out), "--input", str(inp), "--output", str(predictions)]) == 0
    rows = [json.loads(line) for line in predictions.read_text().splitlines()]
    expected = pipeline("text-classification", model=str(out), device="cpu", top_k=None)(TEXTS)
    for row, theirs in zip(rows, expected, strict=True):
        assert row["predicted_label"] == max(theirs, key=lambda d: d["score"])["label"]
        torch.testing.assert_close(
            torch.tensor([row["probabilities"][d["label"]] for d in theirs]),
            torch.tensor([d["score"] for d in theirs]),
            **TOL[torch.float32],
        )
