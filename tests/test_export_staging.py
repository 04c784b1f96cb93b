"""`bert-port-convert --to onnx` writes DST as a save does: a random temporary created
exclusively in DST and never written through a link, then one commit; DST is locked while it
is written, so exports into one folder take turns and each checks, and reports, its own file."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys

import pytest
import torch
from conftest import TINY, TOL

from bert_port import BertConfig, BertModel, load_tokenizer
from bert_port import checkpoint as ckpt
from bert_port.cli.convert import main as convert
from bert_port.onnx_export import INPUTS
from bert_port.tokenization import encode

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
TEXTS = ["a quiet , funny film", "ok"]


def _tiny(directory, minilm_path, seed: int):
    torch.manual_seed(seed)
    model = BertModel(BertConfig.from_dict({**TINY, "vocab_size": 30522}))
    model.source_dir = minilm_path
    return model.save_pretrained(directory)


@pytest.fixture(scope="module")
def sources(tmp_path_factory, minilm_path):
    root = tmp_path_factory.mktemp("sources")
    return [_tiny(root / f"m{seed}", minilm_path, seed) for seed in (1, 2)]


def _onnx_matches(onnx_file, folder) -> bool:
    batch = {k: v for k, v in encode(load_tokenizer(folder), TEXTS).items() if k in INPUTS}
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(["last_hidden_state"], {n: batch[n].numpy() for n in INPUTS})[0])
    with torch.no_grad():
        expected = BertModel.from_pretrained(folder).eval()(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    return torch.allclose(got[real], expected[real], **TOL[torch.float32])


def test_a_link_planted_at_a_temporary_name_is_never_written_through(sources, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours to overwrite")
    dst = tmp_path / "onnx"
    dst.mkdir()
    planted = dst / ".model.onnx.tmp"  # the fixed name an export once staged to
    planted.symlink_to(victim)
    assert convert([str(sources[0]), str(dst), "--to", "onnx"]) == 0
    out = capsys.readouterr().out
    assert victim.read_bytes() == b"not yours to overwrite"
    onnx_file = dst / "model.onnx"
    assert onnx_file.is_file() and not onnx_file.is_symlink()
    assert planted.is_symlink()  # not this command's file: left alone
    assert f"sha256 {hashlib.sha256(onnx_file.read_bytes()).hexdigest()}" in out
    assert _onnx_matches(onnx_file, sources[0])
    assert not [p.name for p in dst.iterdir() if ckpt.TEMPORARY.fullmatch(p.name)]


def test_two_exports_into_one_folder_each_check_their_own_file(sources, tmp_path):
    dst = tmp_path / "onnx"
    command = [sys.executable, "-m", "bert_port.cli.convert"]
    runs = [
        subprocess.Popen(
            [*command, str(src), str(dst), "--to", "onnx", "--overwrite"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for src in sources
    ]
    done = [run.communicate(timeout=600) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err for _, err in done]
    digests = [re.search(r"model\.onnx \([^)]*sha256 ([0-9a-f]{64})\)", out).group(1) for out, _ in done]
    assert digests[0] != digests[1]  # two models, two files: neither run checked the other's
    final = hashlib.sha256((dst / "model.onnx").read_bytes()).hexdigest()
    assert final in digests
    assert _onnx_matches(dst / "model.onnx", sources[digests.index(final)])
    assert not [p.name for p in dst.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]


def test_an_export_into_a_file_is_one_line(sources, tmp_path, capsys):
    (tmp_path / "taken").write_text("a file")
    assert convert([str(sources[0]), str(tmp_path / "taken"), "--to", "onnx"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a file" in err and "Traceback" not in err
    assert (tmp_path / "taken").read_text() == "a file"
