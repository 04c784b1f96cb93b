"""`bert-port-embed` on the bundled all-MiniLM-L6-v2 and MR sentences: equal to
`SentenceEncoder.encode` within the float32 tolerance, prompts, input formats, fp16, the
bad-input catalogue, kill -9 and resume, torchrun, and peak memory flat in the corpus size."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TOL

from bert_port import BertConfig, BertModel, SentenceEncoder
from bert_port.bench.embed import PEAK  # the command in a child, printing its peak RSS
from bert_port.cli.embed import main
from bert_port.data import load_mr
from bert_port.embed import read_embeddings, read_index
from bert_port.embed.corpus import EmbedError

ROOT = Path(__file__).resolve().parent.parent
MR = load_mr().texts
LONG = [" ".join(MR[:12]), " ".join(MR[12:40])]  # over 256 tokens: truncated
TEXTS = MR[:150] + LONG + ["", "ok"]
IDS = [f"mr-{i}" for i in range(len(TEXTS))]
FAST = ["--no-progress", "--shard-size", "64", "--sort-window", "40", "--batch-tokens", "1024"]
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


def _jsonl(path: Path, texts=TEXTS, ids=IDS, **extra) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": i, "text": t, **extra}) + "\n" for i, t in zip(ids, texts))
    return path


def _env(threads: int = 1) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
    env.pop("RANK", None)
    return env


def _command(model, src, out, *flags) -> list[str]:
    return [sys.executable, "-m", "bert_port.cli.embed", "--model", str(model), str(src), str(out), *flags]


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return _jsonl(tmp_path_factory.mktemp("corpus") / "mr.jsonl")


@pytest.fixture(scope="module")
def embedded(corpus, minilm_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "out"
    assert main(["--model", str(minilm_path), str(corpus), str(out), *FAST]) == 0
    return out


@pytest.fixture(scope="module")
def encoder(minilm_path) -> SentenceEncoder:
    return SentenceEncoder.from_pretrained(minilm_path)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, minilm_path) -> Path:
    """A small random BERT with all-MiniLM-L6-v2's tokenizer (a plain folder: mean pooling),
    for the runs where the model's cost does not matter (memory, many texts)."""
    path = tmp_path_factory.mktemp("tiny")
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_path / name, path / name)
    return path


def test_equals_sentence_encoder(embedded, encoder):
    """Bit for bit, though the command's token-budget batches are not encode's batches of 16:
    on the default (batch-invariant) path a text's embedding does not depend on its batch."""
    ids, array = read_embeddings(embedded)
    assert ids == IDS and array.dtype == np.float32 and array.shape == (len(TEXTS), 384)
    expected = encoder.encode(TEXTS, batch_size=16, convert_to_tensor=True)
    torch.testing.assert_close(torch.from_numpy(array), expected, atol=0, rtol=0)
    index = read_index(embedded)
    assert index["complete"] and [s["rows"] for s in index["shards"]] == [64, 64, len(TEXTS) - 128]
    assert index["run"]["max_seq_length"] == 256 and index["run"]["normalize"] and index["dtype"] == "float32"


def test_truncation_report(embedded, capsys, corpus, minilm_path, tmp_path):
    report = json.loads((embedded / "truncated.json").read_text())
    assert report["ids"] == IDS[150:152] and report["count"] == 2
    assert read_index(embedded)["truncated"] == 2
    # A rerun finds every shard finished and reports the same count.
    out = tmp_path / "out"
    shutil.copytree(embedded, out)
    assert main(["--model", str(minilm_path), str(corpus), str(out), *FAST]) == 0
    printed = capsys.readouterr().out
    assert "3 shards kept" in printed and "256 tokens: 2 texts" in printed


def test_prompts(minilm_path, encoder, tmp_path):
    """`--prompt-name` reads config_sentence_transformers.json's prompts and prepends the text,
    as sentence-transformers does for e5 and bge; `--prompt` gives it directly."""
    model = tmp_path / "model"
    model.mkdir()
    for item in minilm_path.iterdir():
        (model / item.name).symlink_to(item)
    (model / "config_sentence_transformers.json").unlink()
    (model / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": "query: "}}))
    src = _jsonl(tmp_path / "q.jsonl", TEXTS[:20], IDS[:20])
    assert main(["--model", str(model), str(src), str(tmp_path / "a"), "--prompt-name", "query", *FAST]) == 0
    assert main(["--model", str(model), str(src), str(tmp_path / "b"), "--prompt", "query: ", *FAST]) == 0
    _, a = read_embeddings(tmp_path / "a")
    expected = encoder.encode(["query: " + t for t in TEXTS[:20]], convert_to_tensor=True)
    torch.testing.assert_close(torch.from_numpy(a), expected, **TOL[torch.float32])
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert main(["--model", str(model), str(src), str(tmp_path / "c"), "--prompt-name", "passage"]) == 2
    assert not (tmp_path / "c").exists()


def test_formats_and_dtype(tiny_model, tmp_path):
    """CSV, TSV and plain text (ids: line numbers, blank lines skipped) give the bits of the
    same texts in JSONL; float16 is the float32 result rounded."""
    texts = [t for t in MR[:40] if "\t" not in t]
    ids = [str(i) for i in range(len(texts))]
    _jsonl(tmp_path / "in.jsonl", texts, ids)
    for name, sep in (("in.csv", ","), ("in.tsv", "\t")):
        import csv

        with open(tmp_path / name, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, delimiter=sep)
            writer.writerow(["key", "body"])
            writer.writerows(zip(ids, texts))
    (tmp_path / "in.txt").write_text("\n".join(texts[:10]) + "\n\n" + "\n".join(texts[10:]) + "\n")
    flags = ["--model", str(tiny_model), *FAST]
    assert main([str(tmp_path / "in.jsonl"), str(tmp_path / "j"), *flags]) == 0
    assert main([str(tmp_path / "in.jsonl"), str(tmp_path / "h"), *flags, "--dtype", "float16"]) == 0
    for name in ("in.csv", "in.tsv"):
        assert (
            main(
                [str(tmp_path / name), str(tmp_path / name[3:]), *flags, "--id-column", "key", "--text-column", "body"]
            )
            == 0
        )
    assert main([str(tmp_path / "in.txt"), str(tmp_path / "t"), *flags]) == 0
    _, j = read_embeddings(tmp_path / "j")
    for out in ("csv", "tsv", "t"):
        got_ids, got = read_embeddings(tmp_path / out)
        np.testing.assert_array_equal(got, j)
    assert got_ids == [*range(1, 11), *range(12, len(texts) + 2)]  # line 11 is blank
    _, half = read_embeddings(tmp_path / "h")
    assert half.dtype == np.float16
    np.testing.assert_array_equal(half, j.astype(np.float16))


def test_pairs(tiny_model, tmp_path):
    """A pair field is tokenized as the second segment (longest-first truncation)."""
    from bert_port import encode

    src = _jsonl(tmp_path / "p.jsonl", MR[:10], IDS[:10], other="a second segment")
    assert main([str(src), str(tmp_path / "o"), "--model", str(tiny_model), "--pair-column", "other", *FAST]) == 0
    _, got = read_embeddings(tmp_path / "o")
    enc = SentenceEncoder.from_pretrained(tiny_model)
    batch = encode(enc.tokenizer, MR[:10], ["a second segment"] * 10, max_length=enc.max_seq_length)
    with torch.no_grad():
        expected = enc(**batch)
    torch.testing.assert_close(torch.from_numpy(got), expected, **TOL[torch.float32])


BAD = {
    "missing file": (None, "does not exist"),
    "empty": ("", "holds no texts"),
    "not json": ('{"id": 1, "text": "a"}\n{"id": 2, "text": \n', "line 2: not valid JSON"),
    "no text field": ('{"id": 1, "text": "a"}\n{"id": 2, "body": "b"}\n', "line 2: no text field 'text'"),
    "duplicate ids": (
        '{"id": 1, "text": "a"}\n{"id": 2, "text": "b"}\n{"id": 1, "text": "c"}\n',
        "id 1 appears on lines 1, 3",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input(case, tiny_model, tmp_path, capsys):
    content, message = BAD[case]
    src = tmp_path / "in.jsonl"
    if content is not None:
        src.write_text(content)
    out = tmp_path / "out"
    assert main([str(src), str(out), "--model", str(tiny_model), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not out.exists()  # nothing written, not even the folder


def test_batch_tokens_below_max_seq_length(minilm_path, corpus, tmp_path, capsys):
    assert main([str(corpus), str(tmp_path / "o"), "--model", str(minilm_path), "--batch-tokens", "128"]) == 2
    err = capsys.readouterr().err
    assert "--batch-tokens 128 is smaller than the model's max_seq_length (256)" in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_other_run_refused_unless_overwrite(tiny_model, tmp_path, capsys):
    src = _jsonl(tmp_path / "in.jsonl", MR[:30], IDS[:30])
    out = tmp_path / "out"
    assert main([str(src), str(out), "--model", str(tiny_model), *FAST]) == 0
    before = _files(out)
    assert main([str(src), str(out), "--model", str(tiny_model), *FAST, "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert "holds another run's embeddings (dtype 'float32' -> 'float16')" in err and "--overwrite" in err
    assert _files(out) == before
    assert main([str(src), str(out), "--model", str(tiny_model), *FAST, "--dtype", "float16", "--overwrite"]) == 0
    assert read_embeddings(out)[1].dtype == np.float16


def test_kill_and_resume(minilm_path, corpus, embedded, tmp_path):
    """SIGKILL after the first shard; the rerun keeps the finished shards (same mtimes, not
    recomputed) and ends with the files of an uninterrupted run, byte for byte."""
    out = tmp_path / "out"
    child = subprocess.Popen(_command(minilm_path, corpus, out, *FAST), env=_env(2), stderr=subprocess.DEVNULL)
    first = out / "shard-00000.ids.json"
    deadline = time.monotonic() + 300
    while not first.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert first.exists() and not read_index(out)["complete"]
    pairs = [p.name.removesuffix(".ids.json") for p in out.glob("shard-*.ids.json")]
    kept = {n: (out / n).stat().st_mtime_ns for p in pairs for n in (f"{p}.ids.json", f"{p}.safetensors")}
    done = subprocess.run(_command(minilm_path, corpus, out, *FAST), env=_env(2), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    reused = int(done.stdout.split(" shards kept")[0].rsplit("(", 1)[1])
    assert len(pairs) <= reused < 3  # one more when the kill fell inside a commit, which the rerun finishes
    assert {n: (out / n).stat().st_mtime_ns for n in kept} == kept
    assert _files(out) == _files(embedded)


@pytest.mark.slow
def test_torchrun_equals_one_process(minilm_path, corpus, tmp_path):
    """Two ranks (shards 0, 2 and 1) write the files one process writes, bit for bit."""
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run(_command(minilm_path, corpus, one, *FAST), env=_env(1), check=True, capture_output=True)
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "-m", "bert_port.cli.embed"]
    done = subprocess.run(
        [*torchrun, "--model", str(minilm_path), str(corpus), str(two), *FAST],
        env=_env(1),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert _files(one) == _files(two)


def _peak_kib(model, src, out) -> int:
    flags = ["--no-progress", "--shard-size", "500", "--sort-window", "250", "--batch-tokens", "2048"]
    done = subprocess.run(
        [sys.executable, "-c", PEAK, "--model", str(model), str(src), str(out), *flags],
        env={**_env(1), "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "LRU_CACHE_CAPACITY": "16"},
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout.split()[-1])


@pytest.mark.slow
def test_peak_memory_flat(tiny_model, tmp_path):
    """Peak RSS (the child's own VmHWM) at N and at 10 N short MR texts stays flat: the run
    holds one shard at a time, plus one 64-bit hash per text for the duplicate-id check."""
    # Why the margin. Holding the 18,000 extra texts as Records costs 3.4 MiB and their
    # tokenizer encodings 60 MiB (measured in one process on this machine); the hashes cost
    # 140 KiB. 8 MiB is far below the encodings and covers allocator noise (5.7 MiB seen once, in
    # a CI run on a 2-core Xeon with other work on the machine; 0.8 MiB alone).
    # oneDNN keeps a compiled kernel per matmul shape (up to ONEDNN_PRIMITIVE_CACHE_CAPACITY,
    # 1024 by default) and unpadded batches have many shapes: that cache grows until it is
    # full whatever the corpus (about 10 MiB over 40 shards of the tiny model), so it is
    # switched off in the child, which then measures the corpus's share. torch's ideep keeps
    # its own such cache for the packed path's GEMMs (bert_port/gemm.py, LRU_CACHE_CAPACITY,
    # 1024 by default; 0 crashes it): 16 here.
    sizes = {}
    for n in (2000, 20000):
        texts = [" ".join(MR[i % len(MR)].split()[:12]) for i in range(n)]
        src = _jsonl(tmp_path / f"{n}.jsonl", texts, [f"t{i}" for i in range(n)])
        sizes[n] = _peak_kib(tiny_model, src, tmp_path / f"out{n}")
    print("peak RSS KiB", sizes)
    assert sizes[20000] - sizes[2000] < 8 * 1024, sizes


@pytest.mark.slow
def test_ray_data_map_batches(minilm_path, encoder):
    """`RayEmbedder` in `Dataset.map_batches` on a local Ray instance gives each row the
    embedding `SentenceEncoder.encode` gives its text."""
    ray = pytest.importorskip("ray")
    from bert_port.embed.ray_data import RayEmbedder

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        items = [{"id": i, "text": t} for i, t in enumerate(TEXTS[:60])]
        ds = ray.data.from_items(items).map_batches(
            RayEmbedder,
            fn_constructor_kwargs={"model": str(minilm_path), "batch_tokens": 1024},
            batch_size=16,
            batch_format="numpy",
            concurrency=1,
        )
        rows = sorted(ds.take_all(), key=lambda row: row["id"])
    finally:
        ray.shutdown()
    assert [r["id"] for r in rows] == list(range(60))
    got = torch.from_numpy(np.stack([r["embedding"] for r in rows]))
    torch.testing.assert_close(got, encoder.encode(TEXTS[:60], convert_to_tensor=True), **TOL[torch.float32])
    assert not any(r["truncated"] for r in rows)


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "emptied":
        path.write_bytes(b"")
    elif how == "values":  # one byte of the last embedding flipped: the file still parses
        data[-1] ^= 0x40
        path.write_bytes(bytes(data))
    else:  # "ids": another id, valid JSON of the same length
        record = json.loads(data)
        record["ids"][0] = "forged"
        path.write_text(json.dumps(record, ensure_ascii=False) + "\n")


@pytest.mark.parametrize("how", ["truncated", "emptied", "values", "ids"])
def test_damaged_shard_is_named_and_redone_on_resume(tiny_model, tmp_path, how, caplog):
    """A finished shard damaged afterwards: `read_embeddings` names it in one line; the same
    command again recomputes it (and says so), and the run reads back as it was written."""
    src, out = _jsonl(tmp_path / "in.jsonl", TEXTS[:150], IDS[:150]), tmp_path / "out"
    flags = ["--model", str(tiny_model), *FAST]
    assert main([str(src), str(out), *flags]) == 0
    ids, written = read_embeddings(out)
    index = read_index(out)
    assert all(len(s["sha256"]) == 64 and s["size"] > 0 for s in index["shards"])
    name = "shard-00001.ids.json" if how == "ids" else "shard-00001.safetensors"
    _damage(out / name, how)
    with pytest.raises(EmbedError, match="shard 1 is damaged") as error:
        read_embeddings(out)
    assert "\n" not in str(error.value)
    caplog.clear()
    assert main([str(src), str(out), *flags]) == 0
    assert "shard 1 in" in caplog.text and "computing it again" in caplog.text
    again_ids, again = read_embeddings(out)
    assert again_ids == ids
    np.testing.assert_array_equal(again, written)


def test_read_embeddings_memory_mapped(tiny_model, tmp_path):
    """`mmap=True`: one read-only memory-mapped array per shard, whose rows are the array."""
    src, out = _jsonl(tmp_path / "in.jsonl", TEXTS[:150], IDS[:150]), tmp_path / "out"
    assert main([str(src), str(out), "--model", str(tiny_model), *FAST]) == 0
    ids, whole = read_embeddings(out)
    mapped_ids, mapped = read_embeddings(out, mmap=True)
    assert mapped_ids == ids and len(mapped) == 3
    assert all(isinstance(a, np.memmap) and not a.flags.writeable for a in mapped)
    np.testing.assert_array_equal(np.concatenate(mapped), whole)


def test_odd_index_or_ids_file_is_refused_without_hanging(tiny_model, tmp_path):
    """An index that is a FIFO or links to /dev/zero is a one-line error, read with a bound."""
    src, out = _jsonl(tmp_path / "in.jsonl", TEXTS[:70], IDS[:70]), tmp_path / "out"
    assert main([str(src), str(out), "--model", str(tiny_model), *FAST]) == 0
    (out / "index.json").unlink()
    (out / "index.json").symlink_to("/dev/zero")
    with pytest.raises(EmbedError, match="refused to read"):
        read_embeddings(out)
    (out / "index.json").unlink()
    os.mkfifo(out / "index.json")
    with pytest.raises(EmbedError, match="refused to read"):
        read_embeddings(out)
