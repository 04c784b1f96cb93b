"""Shared by the bad-input catalogue's files (test_bad_inputs*.py, test_bad_model_inputs.py): a
tiny HF state dict and a folder written from it; a model's state before a failed load, and the
check that it is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY, hf_model

from bert_port import BertModel
from bert_port import checkpoint as ckpt


@pytest.fixture(scope="module")
def tiny_state() -> dict[str, torch.Tensor]:
    """A tiny HF BertModel state dict (random weights), HF names."""
    return {k: v.clone() for k, v in hf_model(TINY).state_dict().items()}


def _write(directory: Path, state: dict, config: dict | str | None = None, fmt: str = "safetensors", **save) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = TINY if config is None else config
    (directory / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if fmt == "safetensors":
        ckpt.write_weights(state, directory, **save)
    else:
        torch.save(state, directory / "pytorch_model.bin")
    return directory


def _port_state(model: BertModel) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model: BertModel, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), f"{key} was modified by a failed load"
