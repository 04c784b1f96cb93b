"""The parity-check tool (`bert_port.parity`, `bert-port-parity`): a passing run on the real
checkpoint whose figures match an independent computation, a broken port caught at the
right layer, unloadable checkpoints and bad usage (exit 2), the plot, pairs from a file,
and the checkpoint layouts transformers cannot read itself. Inputs are kept short and
mostly float32 so the file runs in well under a minute on two cores."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import sys

import pytest
import torch
from conftest import TOL
from safetensors.torch import load_file, save_file

import bert_port.cli.parity as parity_cli
from bert_port import BertModel, load_tokenizer, parity
from bert_port.assets import minilm_dir

# Short inputs: max length 16 keeps every forward small; the edge cases stay in.
FAST = ["--device", "cpu", "--max-length", "16", "--batch-size", "16", "--no-progress"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def small_batches(minilm_path):
    examples = [(t, None) for t in parity.DEFAULT_TEXTS[:6]] + list(parity.DEFAULT_PAIRS[:2])
    return parity.build_batches(load_tokenizer(minilm_path), examples, batch_size=8, max_length=24)


@pytest.fixture(scope="module")
def passing_run(minilm_path, tmp_path_factory):
    """One CLI run on the bundled checkpoint, float32 and bfloat16, with --json and --plot."""
    out = tmp_path_factory.mktemp("parity")
    argv = FAST + ["--dtype", "float32,bfloat16", "--json", str(out / "r.json"), "--plot", str(out / "r.png")]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = parity_cli.main(argv)
    return code, stdout.getvalue(), json.loads((out / "r.json").read_text()), out / "r.png"


def _site(row: dict, name: str) -> dict:
    return next(s for s in row["sites"] if s["name"] == name)


def test_main_passes_on_bundled_checkpoint(passing_run, minilm_path, hf_reference):
    code, text, report, _ = passing_run
    assert code == 0, text
    assert "PASS: 2 of 2 device x dtype rows" in text
    assert "transformers.BertModel.from_pretrained read" in report["meta"]["reference"]
    assert report["passed"] is True
    assert [(r["device"], r["dtype"], r["status"]) for r in report["rows"]] == [
        ("cpu", "float32", "PASS"),
        ("cpu", "bfloat16", "PASS"),
    ]
    fp32 = report["rows"][0]
    names = [s["name"] for s in fp32["sites"]]
    assert names == ["embeddings"] + [f"layer {i}" for i in range(6)] + [
        "last_hidden_state",
        "pooler_output",
        "pad positions",
    ]
    assert fp32["tolerance"] == TOL[torch.float32]  # the policy, not a number of the CLI's own
    for site in fp32["sites"]:
        assert site["passed"] and site["spread"] is not None and site["ours"]["elements"] > 0, site
        if site["gated"]:  # pad positions are informational: the unpadded default writes zeros there
            assert site["ours"]["tolerance_used"] <= 1, site
    batch_names = [b["name"] for b in report["batches"]]
    assert "max-length row (T=16)" in batch_names and "all-pad row + [CLS]-only row" in batch_names

    # The reported figures are the ones an independent computation gives, on the same batches.
    examples = [(t, None) for t in parity.DEFAULT_TEXTS] + list(parity.DEFAULT_PAIRS)
    batches = parity.build_batches(load_tokenizer(minilm_path), examples, batch_size=16, max_length=16)
    ours = BertModel.from_pretrained(minilm_path)
    eager = copy.deepcopy(hf_reference)
    eager.set_attn_implementation("eager")
    diffs, spreads = [], []
    for batch in batches:
        real = batch.inputs["attention_mask"].bool()
        with torch.no_grad():
            a, b, c = (m(**batch.inputs).last_hidden_state[real] for m in (ours, hf_reference, eager))
        torch.testing.assert_close(a, b, **TOL[torch.float32])
        diffs.append((a.double() - b.double()).abs().max())
        spreads.append((c.double() - b.double()).abs().max())
    last = _site(fp32, "last_hidden_state")
    assert last["ours"]["max_abs"] == pytest.approx(float(max(diffs)), abs=1e-12)
    assert last["spread"]["max_abs"] == pytest.approx(float(max(spreads)), rel=1e-9, abs=1e-12)
    assert last["ours"]["elements"] == sum(b.real_tokens for b in batches) * 384


def test_plot_is_a_png(passing_run):
    *_, png = passing_run
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000


@pytest.mark.parametrize("layer", [1, 4])
def test_broken_port_fails_at_the_perturbed_layer(minilm_path, hf_reference, small_batches, layer):
    ours = BertModel.from_pretrained(minilm_path)
    with torch.no_grad():
        ours.bert_layers[layer].out_dense.bias[7] += 1e-3  # one weight, after loading
    (row,) = parity.check_matrix(ours, hf_reference, small_batches, devices=["cpu"], dtypes=[torch.float32])
    assert row.status == "FAIL"
    assert row.first_failure.name == f"layer {layer}"
    sites = {s.name: s for s in row.sites}
    # Within the policy before the perturbed layer (not bitwise: the default path packs the
    # batch and runs attention per sequence, other kernels than transformers' padded SDPA).
    for earlier in ["embeddings"] + [f"layer {i}" for i in range(layer)]:
        assert sites[earlier].passed and sites[earlier].ours.worst_ratio < 1
    assert sites[f"layer {layer}"].ours.worst_ratio > 1
    assert "first failing site: layer" in parity.format_report(parity.Report([row]))


def test_main_exits_1_on_broken_port(monkeypatch, tmp_path, capsys):
    original = parity_cli.load_port

    def broken(path, attn):
        model, note = original(path, attn)
        with torch.no_grad():
            model.bert_layers[2].attention_dense.weight[0, 0] += 1e-2
        return model, note

    monkeypatch.setattr(parity_cli, "load_port", broken)
    code = parity_cli.main(FAST + ["--dtype", "float32", "--no-adversarial", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 1
    assert "first failing site: layer 2" in out and "FAIL: 1 of 1" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] is False and report["rows"][0]["first_failing_site"] == "layer 2"


def _corrupt(tmp_path):
    (tmp_path / "config.json").write_text((minilm_dir() / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    return tmp_path


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p / "does-not-exist", "no checkpoint at"),
        (lambda p: p, "holds no weights"),
        (_corrupt, "is not a readable safetensors file"),
    ],
    ids=["missing-path", "no-weights", "corrupt-weights"],
)
def test_bad_checkpoint_exits_2_with_the_loaders_message(tmp_path, capsys, make, message):
    path = make(tmp_path)
    assert parity_cli.main(["--checkpoint", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"cannot load checkpoint {path}" in err and message in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtype", "float8"], "unknown dtype(s) float8"),
        (["--batch-size", "0"], "must be a positive integer (at least 1)"),
        (["--atol", "-1"], "must be a number >= 0"),
        (["--json", "/nonexistent-dir/r.json"], "does not exist"),
    ],
)
def test_bad_usage_exits_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        parity_cli.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-length", "4096"], "--max-length must be between 4 and the model's max_position_embeddings (512)"),
        (["--texts-file", "/nonexistent.tsv"], "does not exist"),
    ],
)
def test_bad_inputs_exit_2(capsys, argv, message):
    assert parity_cli.main(argv + ["--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_texts_file_with_pairs(tmp_path, minilm_path, capsys):
    lines = [
        "A gripping, beautifully shot film that never lets go.",
        "A man is playing a guitar.\tSomeone is making music.",
        "",
        "simplistic , silly and tedious .",
        "Is it raining?\tTake an umbrella, just in case.",
        "The cat sat on the mat.\tA dog barked.",
    ]
    texts = tmp_path / "texts.tsv"
    texts.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert parity.read_texts_file(texts)[1] == ("A man is playing a guitar.", "Someone is making music.")
    batches = parity.build_batches(
        load_tokenizer(minilm_path), parity.read_texts_file(texts), batch_size=2, max_length=32, adversarial=False
    )
    assert [(b.name, b.rows) for b in batches] == [("texts 1-2", 2), ("pairs 1-2", 2), ("pairs 3-3", 1)]
    assert int(batches[1].inputs["token_type_ids"].max()) == 1  # second segments are type 1

    out = tmp_path / "r.json"
    code = parity_cli.main(
        FAST
        + [
            "--dtype",
            "float32",
            "--texts-file",
            str(texts),
            "--batch-size",
            "2",
            "--no-adversarial",
            "--attn",
            "eager",
            "--json",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    assert [(b["name"], b["rows"]) for b in report["batches"]] == [("texts 1-2", 2), ("pairs 1-2", 2), ("pairs 3-3", 1)]
    assert "5 examples from" in report["meta"]["inputs"] and "(3 pairs)" in report["meta"]["inputs"]
    assert report["meta"]["attention"].startswith("eager on both sides")


def test_texts_file_with_extra_columns_is_refused(tmp_path, capsys):
    texts = tmp_path / "labelled.tsv"
    texts.write_text("fine text\nsome text\tother text\t1\n", encoding="utf-8")
    assert parity_cli.main(["--texts-file", str(texts), "--no-progress"]) == 2
    assert "line 2: 3 tab-separated fields" in capsys.readouterr().err


def test_weights_file_and_ddp_layout(tmp_path, minilm_path, capsys):
    """A weights file under any name is read by transformers itself (through links); a DDP
    `module.` layout transformers cannot read gets the port's weights, strictly, and says so."""
    state = load_file(str(minilm_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((minilm_path / "config.json").read_text())
    save_file(state, str(tmp_path / "step-100.safetensors"))
    save_file({f"module.{k}": v for k, v in state.items()}, str(tmp_path / "ddp.safetensors"))
    base = ["--dtype", "float32", "--no-adversarial", "--max-length", "16", "--no-progress", "--device", "cpu"]

    for checkpoint, expected in [
        (tmp_path / "step-100.safetensors", "from_pretrained read"),
        (tmp_path / "ddp.safetensors", "given the port's weights via hf_state_dict() (strict)"),
    ]:
        out = tmp_path / "r.json"
        code = parity_cli.main(
            base + ["--checkpoint", str(checkpoint), "--tokenizer", str(minilm_path), "--json", str(out)]
        )
        assert code == 0, capsys.readouterr().out
        assert expected in json.loads(out.read_text())["meta"]["reference"]


def test_model_id_from_local_hf_cache(tmp_path, minilm_path, monkeypatch, capsys):
    snapshot = tmp_path / "models--sentence-transformers--all-MiniLM-L6-v2" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abc")
    for f in minilm_path.iterdir():
        if f.is_file():
            (snapshot / f.name).symlink_to(f)  # the hub cache links snapshot files to blobs, too
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    out = tmp_path / "r.json"
    argv = ["--dtype", "float32", "--no-adversarial", "--max-length", "16", "--no-progress", "--device", "cpu"]
    assert parity_cli.main(argv + ["--checkpoint", "sentence-transformers/all-MiniLM-L6-v2", "--json", str(out)]) == 0
    meta = json.loads(out.read_text())["meta"]
    assert meta["checkpoint"].startswith("sentence-transformers/all-MiniLM-L6-v2 (") and "0123abc" in meta["checkpoint"]

    capsys.readouterr()
    assert parity_cli.main(["--checkpoint", "sentence-transformers/not-there", "--no-progress"]) == 2
    assert "the Hugging Face cache has no copy of it" in capsys.readouterr().err


def test_checkpoint_without_pooler(tmp_path, minilm_path, capsys):
    state = load_file(str(minilm_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((minilm_path / "config.json").read_text())
    save_file({k: v for k, v in state.items() if not k.startswith("pooler.")}, str(tmp_path / "model.safetensors"))
    out = tmp_path / "r.json"
    code = parity_cli.main(
        [
            "--checkpoint",
            str(tmp_path),
            "--tokenizer",
            str(minilm_path),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--max-length",
            "16",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    assert "pooler_output is not compared" in report["meta"]["note"]
    assert "pooler_output" not in [s["name"] for s in report["rows"][0]["sites"]]


def test_cuda_only_without_gpu_exits_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert parity_cli.main(["--device", "cuda", "--dtype", "float32", "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert "cuda (float32): SKIPPED, no CUDA device" in captured.out
    assert "nothing was compared" in captured.err


def test_exact_float32_restores_matmul_precision():
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        with parity.exact_float32():
            assert torch.get_float32_matmul_precision() == "highest"
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(saved)


# -- GPU: the same comparisons on CUDA (skipped without one; see conftest) ----------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gpu_parity_per_dtype(minilm_path, hf_reference, dtype):
    examples = [(t, None) for t in parity.DEFAULT_TEXTS] + list(parity.DEFAULT_PAIRS)
    batches = parity.build_batches(load_tokenizer(minilm_path), examples, batch_size=8, max_length=512)
    for impl in ("sdpa", "eager"):
        ours = BertModel.from_pretrained(minilm_path, attn_implementation=impl)
        ref = copy.deepcopy(hf_reference)
        ref.set_attn_implementation(impl)
        (row,) = parity.check_matrix(ours, ref, batches, devices=["cuda"], dtypes=[dtype])
        report = parity.format_report(parity.Report([row]))
        print(report)
        assert row.status == "PASS", report


@pytest.mark.gpu
def test_gpu_cli_matrix_and_broken_port(monkeypatch, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert parity_cli.main(["--device", "cuda", "--no-progress", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["dtype"], r["status"]) for r in report["rows"]] == [
        ("float32", "PASS"),
        ("bfloat16", "PASS"),
        ("float16", "PASS"),
    ]
    print(capsys.readouterr().out)

    original = parity_cli.load_port

    def broken(path, attn):
        model, note = original(path, attn)
        with torch.no_grad():
            model.bert_layers[3].out_dense.bias[7] += 1e-3
        return model, note

    monkeypatch.setattr(parity_cli, "load_port", broken)
    assert parity_cli.main(["--device", "cuda", "--dtype", "float32", "--no-progress"]) == 1
    assert "first failing site: layer 3" in capsys.readouterr().out


@pytest.mark.parametrize(
    "missing, extra, args",
    [("transformers", "parity", []), ("matplotlib", "plot", ["--plot", "r.png"])],
    ids=["transformers", "matplotlib-for-plot"],
)
def test_a_missing_extra_names_its_pip_install_and_exits_2(monkeypatch, capsys, tmp_path, missing, extra, args):
    """Installed without the `parity` extra (or `plot` for --plot), the command says which
    `pip install` brings it and exits 2, before any work and without a traceback."""
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` raises ImportError
    monkeypatch.chdir(tmp_path)
    assert parity_cli.main(FAST + ["--dtype", "float32", *args]) == 2
    captured = capsys.readouterr()
    assert f"pip install 'bert-port[{extra}]'" in captured.err and "Traceback" not in captured.err
    assert captured.out == "" and list(tmp_path.iterdir()) == []
