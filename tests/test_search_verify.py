"""`semantic_search` over a `bert-port-embed` folder verifies each shard as `read_embeddings`
does (row count, dimension, checksum) and names a damaged one in one line, instead of
returning hits under the wrong ids."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from bert_port import similarity as sim
from bert_port.cli.embed import main as embed_main
from bert_port.embedding_store import EmbedError, read_embeddings, shard_names

TEXTS = [f"text number {i}: {w} of the day" for i, w in enumerate(["news", "weather", "sport", "music"] * 10)]


@pytest.fixture(scope="module")
def run_folder(minilm_path, tmp_path_factory):
    """A finished run of 40 texts in two shards of 20."""
    root = tmp_path_factory.mktemp("search-verify")
    (root / "corpus.txt").write_text("\n".join(TEXTS) + "\n")
    out = root / "run"
    assert embed_main([str(root / "corpus.txt"), str(out), "--model", str(minilm_path), "--shard-size", "20"]) == 0
    return out


def _copy(run_folder, tmp_path):
    shutil.copytree(run_folder, tmp_path / "run")
    return tmp_path / "run"


def _queries(folder):
    _, whole = read_embeddings(folder)
    return whole[[3, 27]], whole


def test_intact_folder_gives_the_hits_of_the_whole_array(run_folder):
    queries, whole = _queries(run_folder)
    got = sim.semantic_search(queries, run_folder, top_k=5, corpus_chunk_size=7)
    expected = sim.semantic_search(queries, whole, top_k=5)
    assert [[h["corpus_id"] for h in q] for q in got] == [[h["corpus_id"] for h in q] for q in expected]
    scores = [[h["score"] for h in q] for q in got]
    torch.testing.assert_close(torch.tensor(scores), torch.tensor([[h["score"] for h in q] for q in expected]))
    assert [q[0]["corpus_id"] for q in got] == [3, 27]


def test_shard_cut_to_fewer_rows_is_named(run_folder, tmp_path):
    """Shard 1 rewritten with 5 of its 20 rows (a valid safetensors file): its ids would run on
    from the wrong place, so the search refuses it in one line."""
    from safetensors.numpy import load_file, save_file

    folder = _copy(run_folder, tmp_path)
    queries, _ = _queries(folder)
    path = folder / shard_names(1)[0]
    save_file({"embeddings": load_file(path)["embeddings"][:5]}, str(path))
    for call in (lambda: sim.semantic_search(queries, folder, top_k=5), lambda: list(sim.embedding_shards(folder))):
        with pytest.raises(EmbedError) as caught:
            call()
        message = str(caught.value)
        assert "shard 1 is damaged" in message and shard_names(1)[0] in message and "\n" not in message
    with pytest.raises(EmbedError, match="shard 1 is damaged"):
        read_embeddings(folder)


def test_shard_with_changed_bytes_is_named(run_folder, tmp_path):
    """Same size, other bytes: only the checksum tells, and the search checks it."""
    folder = _copy(run_folder, tmp_path)
    queries, _ = _queries(folder)
    path = folder / shard_names(0)[0]
    data = bytearray(path.read_bytes())
    data[-8:] = np.full(2, 9.0, dtype=np.float32).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(EmbedError, match=r"shard 0 is damaged \(shard-00000.safetensors: its bytes do not match"):
        sim.semantic_search(queries, folder, top_k=5)
