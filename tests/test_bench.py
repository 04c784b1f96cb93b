"""The benchmark's pieces (not its timings): FLOP counting, the MR reader, native-bf16
detection, argument checks, a peer that is not installed, the fresh-process sections, and
that `--quick` runs and writes its markdown table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_bitwise

from bert_port import BertConfig
from bert_port.bench.harness import Report, config_override, model_flops, mr_texts, native_bf16, run_module
from bert_port.cli.bench import main

REPO = Path(__file__).resolve().parents[1]


def test_model_and_bench_do_not_import_transformers():
    code = (
        "import sys, bert_port, bert_port.cli.bench, bert_port.bench.throughput, bert_port.bench.peers, "
        "bert_port.bench.load, bert_port.bench.import_time, bert_port.bench.finetune, bert_port.bench.profiling, "
        "bert_port.bench.generate, bert_port.generation; "
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_model_flops_counts_real_tokens(tiny_config):
    config = BertConfig.from_dict(tiny_config)
    H, inter, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    dense = 2 * (4 * H * H + 2 * H * inter)
    expected = L * (5 * dense + 4 * H * (9 + 4)) + 2 * 2 * H * H
    assert model_flops(config, mask) == expected
    assert model_flops(config, torch.ones(2, 4)) > expected


def test_mr_texts_come_from_the_project_reader():
    from bert_port.data import load_mr

    texts = mr_texts()
    assert texts == load_mr().texts and len(texts) == 10566
    assert texts[0].startswith("The Rock is destined")
    assert any("Almodóvar" in t for t in texts)


def test_native_bf16_is_read_from_the_cpu_flags():
    cpu = torch.device("cpu")
    assert native_bf16(cpu, {"avx2", "avx512f", "avx512_bf16"}) == "avx512_bf16"
    assert native_bf16(cpu, {"amx_bf16", "amx_tile", "avx512_bf16"}) == "amx_bf16, avx512_bf16"
    assert native_bf16(cpu, {"avx2", "fma"}) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--skip", "real,nope"], "unknown section(s) ['nope']"),
        (["--peers", "ctranslate2,tensorrt"], "unknown peer(s) ['tensorrt']"),
        (["--reps", "0"], "--reps must be at least 1"),
        (["--device", "tpu"], "--device must be cpu or cuda"),
    ],
)
def test_bench_refuses_bad_arguments(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_refuses_cuda_without_a_gpu(capsys):
    assert main(["--device", "cuda"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err


def test_config_override_restores_the_config(tiny_config):
    from bert_port import BertModel
    from bert_port.speed import optimize
    from bert_port.speed.layers import PackedBertModel

    model = optimize(BertModel(BertConfig.from_dict(tiny_config)))
    with config_override(model, unpad_inputs=False, attn_implementation="varlen"):
        assert type(model) is BertModel and model.bert_layers[0].config.attn_implementation == "varlen"
        assert type(model.bert_layers[0].interm_dense) is torch.nn.Linear  # the plain model
    with config_override(model, batch_invariant=False):
        assert not model.batch_invariant and not model.bert_layers[0].interm_dense.batch_invariant
    assert type(model) is PackedBertModel and model.config.attn_implementation == "sdpa"
    assert model.batch_invariant and model.bert_layers[0].interm_dense.batch_invariant


def test_report_writes_what_it_printed(tmp_path, capsys):
    report = Report()
    report.section("title")
    report.table(("a", "b"), [(1, "x")])
    path = report.write(tmp_path / "out" / "bench.md")
    assert path.read_text() == capsys.readouterr().out == "\n## title\n| a | b |\n|---|---|\n| 1 | x |\n"


@pytest.mark.slow
def test_generate_section_times_both_ways_and_checks_the_tokens(minilm_path, capsys, single_thread):
    import argparse

    from bert_port.bench.generate import section_generate

    args = argparse.Namespace(quick=True, reps=1, seed=0)
    result = section_generate(args, torch.device("cpu"), Report())
    rows = result["batch 1"]
    assert set(rows["rows"]) == {
        "port, KV cache",
        "port, no cache",
        "transformers (sdpa), KV cache",
        "transformers (sdpa), no cache",
    }
    assert rows["greedy_tokens_equal_transformers"] is True and rows["cache_speedup_port"] > 0
    assert "KV cache speed-up: port " in capsys.readouterr().out


def test_load_section_measures_in_a_fresh_process(minilm_path):
    row = run_module("load", "port", str(minilm_path))
    assert row["params"] == 22713216 and row["peak_rss_kib"] >= row["rss_before_kib"] > 0 and row["load_s"] > 0


def test_import_probe_keeps_transformers_out():
    from bert_port.bench.import_time import probe

    row = probe("port")
    assert row["transformers_imported"] is False and row["torch_s"] > 0


def test_quick_runs_writes_its_table_and_reports_a_missing_peer(tmp_path):
    # A ctranslate2 that fails to import, as a broken or absent install does: the bench
    # reports it with the pip install that brings it and goes on with the other rows.
    shim = tmp_path / "shim" / "ctranslate2"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('no ctranslate2 in this test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim.parent), str(REPO), os.environ.get("PYTHONPATH", "")])}
    md, js = tmp_path / "bench.md", tmp_path / "bench.json"
    argv = [
        "--quick",
        "--skip",
        "import,roofline,int8,int8-classifier,fixed,load,finetune",
        "--peers",
        "ctranslate2",
        "--bf16",
        "off",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "bert_port.cli.bench", *argv, "--markdown", str(md), "--json", str(js)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    table = md.read_text()
    assert "ctranslate2: not installed (ctranslate2): pip install 'bert-port[bench]'" in table
    assert "| port |" in table and "| transformers (sdpa), fp32 |" in table and "Machine:" in table
    results = json.loads(js.read_text())
    rows = results["real"]["fp32"]["rows"]
    invariance_off = "port, batch_invariant=False"  # what batch invariance costs, timed in the same run
    assert set(rows) == {"transformers (sdpa), fp32", "port", "port padded (unpad_inputs=False)", invariance_off}
    assert rows["port padded (unpad_inputs=False)"]["max_abs_diff_vs_transformers_fp32"] == 0.0
    assert "port vs port, batch_invariant=False: " in table
    if results["machine"]["torch_threads"] > 1:  # real text again at 1 thread: the same rows
        assert set(results["real1"]["fp32"]["rows"]) == set(rows)
        assert "repetitions at 1 thread(s); real tokens/s" in table
    else:
        assert "real text at 1 thread: skipped" in table
    busy = results["busy"]["rows"]  # the busy-neighbour section, with its loop
    assert set(busy) == {"transformers (sdpa), fp32", "port, fp32", "port, fp32, --threads auto"}
    assert all(0 < r["kept"] for r in busy.values()) and "kept share" in table


@pytest.mark.skipif(sys.platform != "linux", reason="reads the child's /proc/PID/maps")
def test_cpu_peers_run_in_a_process_of_their_own(minilm_path, tmp_path):
    """CTranslate2 runs in `peer_worker.py`, a child without torch (in torch's process it
    would bind torch's libgomp and slow the torch rows down), returns the hidden state for
    the parity pass (the very values CTranslate2 gives in this process) and nothing for the
    timed calls, reports its failures, and exits with the bench; a child that dies fails its
    row with its exit code."""
    ct2 = pytest.importorskip("ctranslate2")
    import contextlib
    import signal

    import numpy as np

    from bert_port import encode, load_tokenizer
    from bert_port.bench.peers import PeerProcess, ctranslate2_rows

    batch = encode(load_tokenizer(minilm_path), ["a short one", "and a rather longer sentence, with more tokens"])
    cpu = torch.device("cpu")
    with contextlib.ExitStack() as stack:
        worker = PeerProcess(stack)
        rows = ctranslate2_rows(minilm_path, tmp_path, cpu, 1, worker)
        fp32 = next(row for name, row in rows.items() if name.endswith("fp32"))
        got = fp32.forward(batch)
        assert fp32.timed(batch) is None
        maps = Path(f"/proc/{worker.process.pid}/maps").read_text()
        assert "libctranslate2" in maps and "libtorch" not in maps
        options = {"path": str(tmp_path / "nothing"), "compute_type": "float32", "threads": 1}
        with pytest.raises(RuntimeError, match="in the peer process"):
            worker.build("broken", "ctranslate2", options)
        assert fp32.timed(batch) is None  # a failed build leaves the process serving
    assert worker.process.returncode == 0
    # What comes back is CTranslate2's hidden state, bit for bit (one thread: deterministic).
    encoder = ct2.Encoder(str(tmp_path / "ctranslate2"), device="cpu", compute_type="float32", intra_threads=1)
    lengths = batch["attention_mask"].sum(1).tolist()
    ids = [row[:n] for row, n in zip(batch["input_ids"].tolist(), lengths)]
    types = [row[:n] for row, n in zip(batch["token_type_ids"].tolist(), lengths)]
    expected = torch.from_numpy(np.asarray(encoder.forward_batch(ids, token_type_ids=types).last_hidden_state))
    assert_bitwise(got, expected)

    with contextlib.ExitStack() as stack:  # a child that dies: its row fails, cleanly
        worker = PeerProcess(stack)
        row = ctranslate2_rows(minilm_path, tmp_path, cpu, 1, worker)[next(iter(rows))]
        worker.process.send_signal(signal.SIGKILL)
        with pytest.raises(RuntimeError, match=f"exited with code {-signal.SIGKILL}"):
            row.forward(batch)
    assert worker.process.stdout.closed


def test_configs_are_found_in_the_checkout():
    """The real configs live in the top-level configs/ (a wheel ships them as bert_port/configs/,
    which `make wheel-check` checks); the bench, the tests and the recipes read them from there."""
    from bert_port.assets import config_dir, config_path
    from bert_port.bench.harness import CONFIGS

    repo = Path(__file__).resolve().parents[1]
    assert config_dir() == CONFIGS == repo / "configs"
    assert (
        config_path("finetune_mr_minilm")
        == config_path("finetune_mr_minilm.json")
        == CONFIGS / "finetune_mr_minilm.json"
    )
    for name in (
        "bert-base-uncased",
        "bert-base-cased",
        "bert-large-uncased",
        "all-MiniLM-L6-v2",
        "finetune_sms_minilm",
    ):
        assert config_path(name).is_file(), name


def test_int8_accuracy_columns_compare_embeddings_with_float32():
    import torch.nn.functional as F

    from bert_port.bench.int8 import accuracy

    torch.manual_seed(0)
    expected = F.normalize(torch.randn(120, 16), dim=1)
    same = accuracy(expected, expected)
    assert same["cos_mean"] == pytest.approx(1.0) and same["neighbours_kept"] == 1.0
    noisy = accuracy(expected, F.normalize(expected + 0.3 * torch.randn(120, 16), dim=1))
    assert noisy["cos_min"] < noisy["cos_mean"] < 1.0 and noisy["neighbours_kept"] < 1.0


@pytest.mark.slow
def test_int8_classifier_section_fine_tunes_then_compares_the_predictions(capsys):
    """`--quick` size: 64 training sentences, 128 test sentences. The figures are the bench's;
    here, that both models predicted every test sentence and the line reports the bar."""
    import argparse

    from bert_port.bench.int8 import PORT_FP32, PORT_INT8, section_int8_classifier
    from bert_port.tolerance import INT8_ACCURACY

    result = section_int8_classifier(argparse.Namespace(quick=True), torch.device("cpu"), Report())
    assert result["train_sentences"] == 64 and result["test_sentences"] == 128
    accuracy = result["accuracy"]
    assert set(accuracy) == {PORT_FP32, PORT_INT8} and all(0.0 <= a <= 1.0 for a in accuracy.values())
    assert result["drop_points"] == pytest.approx(100 * (accuracy[PORT_FP32] - accuracy[PORT_INT8]))
    assert 0.0 < result["predictions_kept"] <= 1.0
    out = capsys.readouterr().out
    assert f"points lost (bar <= {INT8_ACCURACY.accuracy_drop_points})" in out and "| port, int8 |" in out


def test_openvino_not_importable_is_reported_and_left_out(monkeypatch, tmp_path, capsys):
    """Without openvino (a None in sys.modules makes its import fail, as a broken or absent
    install does), the real-text and int8 peers say which pip install brings it and build
    nothing: no ONNX export, no process."""
    import argparse
    import contextlib

    from bert_port.bench import int8, peers

    monkeypatch.setitem(sys.modules, "openvino", None)
    cpu = torch.device("cpu")
    with contextlib.ExitStack() as stack:
        rows = peers.peer_rows(["openvino"], tmp_path, None, tmp_path, cpu, 1, Report(), stack, bf16=True)
        args = argparse.Namespace(peers=["openvino"])
        int8_rows = int8.peer_rows(args, tmp_path, tmp_path, Report(), stack, calibration=None)
    assert rows == {} and int8_rows == {} and not list(tmp_path.iterdir())
    out = capsys.readouterr().out
    assert "openvino: not installed (openvino): pip install 'bert-port[bench]'" in out
    assert "OpenVINO int8 (NNCF): not installed (openvino); pip install 'bert-port[bench]'" in out


def test_openvino_calibration_leaves_out_the_timed_and_checked_sentences(minilm_path):
    """NNCF's calibration feeds: one MR sentence each, none of them a sentence of the batches
    to avoid (there: the timed and the checked ones)."""
    from torch.nn.utils.rnn import pad_sequence

    from bert_port import load_tokenizer
    from bert_port.bench.int8 import calibration_feeds

    tokenizer = load_tokenizer(minilm_path)
    first = calibration_feeds(tokenizer, [], 8, seed=0)
    assert len(first) == 8 and all(set(f) == {"input_ids", "attention_mask", "token_type_ids"} for f in first)
    ids = [torch.from_numpy(f["input_ids"][0]) for f in first]
    avoid = {"input_ids": pad_sequence(ids, batch_first=True)}
    avoid["attention_mask"] = pad_sequence([torch.ones_like(i) for i in ids], batch_first=True)
    again = calibration_feeds(tokenizer, [avoid], 8, seed=0)
    assert len(again) == 8 and not {tuple(i.tolist()) for i in ids} & {tuple(f["input_ids"][0]) for f in again}


@pytest.mark.slow
def test_openvino_rows_appear_in_the_real_text_tables_at_quick_size(tmp_path):
    """`--quick --peers openvino`: OpenVINO's fp32 row with its parity beside it, the port's
    ratio to it, and its bf16 row where the CPU has native bf16."""
    pytest.importorskip("openvino")
    md, js = tmp_path / "bench.md", tmp_path / "bench.json"
    skip = "import,roofline,real1,sorted,int8,int8-classifier,busy,fixed,load,finetune"
    argv = ["--quick", "--skip", skip, "--peers", "openvino", "--markdown", str(md), "--json", str(js)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-m", "bert_port.cli.bench", *argv], capture_output=True, text=True, env=env, timeout=900
    )
    assert out.returncode == 0, out.stderr[-2000:]
    results, table = json.loads(js.read_text()), md.read_text()
    rows = results["real"]["fp32"]["rows"]
    (fp32,) = [name for name in rows if name.startswith("OpenVINO ")]
    assert ", fp32" in fp32 and f"port vs {fp32}: " in table
    assert rows[fp32]["max_abs_diff_vs_transformers_fp32"] < 1e-4 and rows[fp32]["tolerance_use"] <= 1.0
    if results["machine"]["native_bf16"]:
        (bf16,) = [name for name in results["real"]["bf16"]["rows"] if name.startswith("OpenVINO ")]
        assert ", bf16" in bf16 and f"port, bf16 weights vs {bf16}: " in table
    else:
        assert "bf16" not in results["real"]


@pytest.mark.slow
def test_openvino_int8_rows_build_in_their_process_with_accuracy_columns(minilm_path, tmp_path, monkeypatch):
    """The int8 table's OpenVINO rows at `--quick` size: NNCF's quantization calibrated on MR
    sentences, one row per thread count, in a process without torch, and its accuracy against
    the port's fp32 as the section computes it for every int8 peer. That process never phones
    home (OpenVINO's telemetry forked from its sender threads while NNCF's backend
    probe imported torch, and the worker deadlocked): after the build it holds no thread but its
    main one, has forked nothing, imported no torch, and wrote nothing under ~/intel."""
    from bert_port.bench import peers as peer_module

    if not (peer_module.importable("openvino") and peer_module.importable("nncf")):
        pytest.skip("needs openvino and nncf (pip install 'bert-port[bench]')")
    import argparse
    import contextlib
    import functools

    from bert_port import BertModel, load_tokenizer
    from bert_port.bench import int8
    from bert_port.bench.harness import mr_batches
    from bert_port.bench.throughput import model_forward

    workers = []

    class Recorded(peer_module.PeerProcess):
        def __init__(self, stack):
            super().__init__(stack)
            workers.append(self)

    monkeypatch.setattr(int8, "PeerProcess", Recorded)
    tokenizer = load_tokenizer(minilm_path)
    batches = mr_batches(tokenizer, 2, 16, 0, torch.device("cpu"))
    calibration = functools.partial(int8.calibration_feeds, tokenizer, batches, int8.QUICK_CALIBRATION, 0)
    args = argparse.Namespace(peers=["openvino"], quick=True)
    with contextlib.ExitStack() as stack:
        monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the worker's, where telemetry keeps its files
        (tmp_path / "home").mkdir()
        peers = int8.peer_rows(args, minilm_path, tmp_path, Report(), stack, calibration)
        assert list(peers) == ["OpenVINO int8 (NNCF)"] and set(peers["OpenVINO int8 (NNCF)"]) == set(int8.THREADS)
        rows = peers["OpenVINO int8 (NNCF)"]
        assert rows[2].timed(batches[0]) is None
        (worker,) = workers
        state = worker.state()
        assert state["peers"] == ["nncf", "openvino"]  # it did build there
        assert state["threads"] == ["MainThread"] and state["forks"] == 0 and state["imported"] == []
        assert not list((tmp_path / "home").iterdir())
        expected = int8.embeddings(model_forward(BertModel.from_pretrained(minilm_path)), batches)
        scores = int8.accuracy(expected, int8.embeddings(rows[1].forward, batches))
    assert 0.9 < scores["cos_min"] <= scores["cos_mean"] < 1.0 and 0.0 < scores["neighbours_kept"] <= 1.0
