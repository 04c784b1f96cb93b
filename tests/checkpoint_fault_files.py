"""Shared by the checkpoint fault tests (test_checkpoint_faults.py, test_checkpoint_refusals.py,
test_checkpoint_corrupt.py): a tiny saved checkpoint, single-file or sharded, a rewrite of its
safetensors file, a tiny WordPiece vocabulary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY

from bert_port import BertConfig, BertModel


def _tiny_vocab(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(TINY["vocab_size"] - 5)]
    (directory / "vocab.txt").write_text("\n".join(tokens) + "\n")


@pytest.fixture
def tiny_dir(tmp_path) -> Path:
    directory = tmp_path / "tiny"
    BertModel(BertConfig(**TINY)).save_pretrained(directory)
    return directory


def _rewrite(directory: Path, change) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file, save_file

    state = load_file(directory / "model.safetensors")
    change(state)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return state


@pytest.fixture
def sharded_dir(tmp_path) -> Path:
    directory = tmp_path / "sharded"
    BertModel(BertConfig(**TINY)).save_pretrained(directory, max_shard_size="20KB")
    return directory
