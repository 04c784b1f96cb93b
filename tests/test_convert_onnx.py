"""`bert-port-convert --to onnx`: any head of a saved folder to DST/model.onnx, checked at
export by ONNX Runtime. Here the written file is run again in ONNX Runtime and compared with
transformers' model of the same folder, in the same run, within the float32 tolerance (real
tokens only for per-token outputs: the file computes the padded path, transformers' too, but
pad positions are values nothing reads). A file that no longer matches its model fails the
export's own check; bad flags and a DST that holds an export are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TOL, tiny_checkpoint

from bert_port import load_tokenizer
from bert_port.classifier import BertForSequenceClassification
from bert_port.cli.convert import main as convert
from bert_port.heads import BertForMaskedLM, BertForTokenClassification
from bert_port.onnx_export import CHECK_TEXTS, INPUTS, ExportError, check_onnx, export_onnx
from bert_port.tokenization import encode

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
TEXTS = ["a quiet , funny film", "ok", "the committee will publish its report on the railway next spring ."]


def run_onnx(path, batch: dict) -> dict[str, torch.Tensor]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    values = session.run(None, {name: batch[name].numpy() for name in INPUTS})
    return {o.name: torch.from_numpy(v) for o, v in zip(session.get_outputs(), values)}


def batch_of(folder) -> dict:
    return {k: v for k, v in encode(load_tokenizer(folder), TEXTS).items() if k in INPUTS}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, minilm_path):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), minilm_path)


def head_folder(cls, tiny_folder, directory, **kwargs):
    model = cls.from_pretrained(tiny_folder, **kwargs)
    torch.manual_seed(1)
    for p in model.parameters():  # a head that is not all initial values: the test sees it
        p.data.add_(torch.randn_like(p) * 0.02)
    return model.save_pretrained(directory)


@pytest.mark.slow
def test_bare_real_model_exports_and_matches_transformers(minilm_path, hf_reference, tmp_path, capsys):
    assert convert([str(minilm_path), str(tmp_path / "onnx"), "--to", "onnx"]) == 0
    out = capsys.readouterr().out
    assert "verified:  ONNX Runtime" in out and "last_hidden_state" in out
    assert {"model.onnx", "config.json", "tokenizer.json", "vocab.txt"} <= {
        p.name for p in (tmp_path / "onnx").iterdir()
    }
    batch = batch_of(tmp_path / "onnx")
    got = run_onnx(tmp_path / "onnx" / "model.onnx", batch)
    with torch.no_grad():
        expected = hf_reference(**batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got["last_hidden_state"][real], expected.last_hidden_state[real], **TOL[torch.float32])
    torch.testing.assert_close(got["pooler_output"], expected.pooler_output, **TOL[torch.float32])


@pytest.mark.parametrize(
    "cls, hf_name, kwargs, output",
    [
        (BertForSequenceClassification, "BertForSequenceClassification", {"num_labels": 3}, "logits"),
        (BertForTokenClassification, "BertForTokenClassification", {"num_labels": 5}, "logits"),
        (BertForMaskedLM, "BertForMaskedLM", {}, "logits"),
    ],
)
def test_head_exports_and_matches_transformers(tiny_folder, tmp_path, capsys, cls, hf_name, kwargs, output):
    folder = head_folder(cls, tiny_folder, tmp_path / "model", **kwargs)
    assert convert([str(folder), str(tmp_path / "onnx"), "--to", "onnx"]) == 0
    assert f"model:     {cls.__name__}" in capsys.readouterr().out  # the MLM head kept: config.json names it
    batch = batch_of(folder)
    got = run_onnx(tmp_path / "onnx" / "model.onnx", batch)
    assert list(got) == [output]
    hf = getattr(transformers, hf_name).from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(**batch).logits
    real = batch["attention_mask"].bool()
    ours, theirs = (got[output][real], expected[real]) if expected.dim() == 3 else (got[output], expected)
    torch.testing.assert_close(ours, theirs, **TOL[torch.float32])


def test_a_file_that_is_not_its_model_fails_the_check(tiny_folder, tmp_path):
    folder = head_folder(BertForSequenceClassification, tiny_folder, tmp_path / "model", num_labels=2)
    model = BertForSequenceClassification.from_pretrained(folder)
    result = export_onnx(model, tmp_path / "model.onnx", load_tokenizer(folder))
    assert result.outputs == ["logits"] and result.worst["logits"] <= TOL[torch.float32]["atol"]
    with torch.no_grad():
        model.classifier.bias.add_(1e-3)  # the file now computes another model
    batch = {k: v for k, v in encode(load_tokenizer(folder), list(CHECK_TEXTS)).items() if k in INPUTS}
    with pytest.raises(ExportError, match="logits differs from the model's by up to 0.001"):
        check_onnx(tmp_path / "model.onnx", model, batch, ["logits"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dtype", "bfloat16"], "--to onnx exports float32; drop --dtype bfloat16"),
        ([], "already holds model.onnx"),
    ],
)
def test_bad_requests_are_refused_in_one_line(tiny_folder, tmp_path, capsys, flags, message):
    (tmp_path / "onnx").mkdir()
    (tmp_path / "onnx" / "model.onnx").write_bytes(b"an earlier export")
    assert convert([str(tiny_folder), str(tmp_path / "onnx"), "--to", "onnx", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "onnx" / "model.onnx").read_bytes() == b"an earlier export"
    assert json.loads((tiny_folder / "config.json").read_text())  # the source untouched
