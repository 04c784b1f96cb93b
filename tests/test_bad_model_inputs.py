"""The bad-input catalogue, continued (test_bad_inputs.py): bad model inputs fail before any
kernel with a clear error; good ones still run."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import TINY, random_batch

from bert_port import BertConfig, BertModel, CheckpointError

# -- model inputs ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model() -> BertModel:
    return BertModel(BertConfig(**TINY)).eval()


def _case(name: str) -> tuple[dict, str]:
    """(inputs, message) for one catalogue case, on the tiny config (vocab 99, 64 positions,
    2 token types) with a (3, 9) batch."""
    batch = random_batch(TINY["vocab_size"], B=3, T=9)
    ids, mask, types = batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
    cases = {
        "id-too-large": (
            {**batch, "input_ids": ids.index_put((torch.tensor([1]), torch.tensor([2])), torch.tensor(99))},
            r"input_ids contains 99, outside \[0, 99\)",
        ),
        "negative-id": ({**batch, "input_ids": ids.index_fill(1, torch.tensor([4]), -1)}, "input_ids contains -1"),
        "too-long": ({"input_ids": torch.ones(1, 65, dtype=torch.long)}, "sequence length 65 exceeds max_position"),
        "type-too-large": ({**batch, "token_type_ids": types + 2}, r"token_type_ids contains 3, outside \[0, 2\)"),
        "negative-type": ({**batch, "token_type_ids": types - 1}, "token_type_ids contains -1"),
        "float-types": ({**batch, "token_type_ids": types.float()}, "token_type_ids must be integer"),
        "mask-short": ({**batch, "attention_mask": mask[:, :8]}, r"attention_mask shape \(3, 8\) does not match"),
        "mask-batch": ({**batch, "attention_mask": mask[:2]}, r"attention_mask shape \(2, 9\) does not match"),
        "mask-4d": ({**batch, "attention_mask": torch.ones(3, 1, 9, 8)}, "4-D attention_mask must be"),
        "types-shape": ({**batch, "token_type_ids": types[:, :5]}, r"token_type_ids shape \(3, 5\) does not match"),
        "empty-batch": ({"input_ids": torch.ones(0, 9, dtype=torch.long)}, r"empty input of shape \(0, 9\)"),
        "zero-length": ({"input_ids": torch.ones(3, 0, dtype=torch.long)}, r"empty input of shape \(3, 0\)"),
        "1-d-ids": ({"input_ids": ids[0]}, r"input_ids must be \(batch, seq_len\)"),
        "float-ids": ({"input_ids": ids.float()}, "input_ids must be integer token ids"),
        "position-too-large": ({**batch, "position_ids": torch.arange(9)[None] + 60}, "position_ids contains 68"),
        "no-input": ({"attention_mask": mask}, "pass exactly one of input_ids or inputs_embeds"),
    }
    return cases[name]


INPUT_CASES = [
    "id-too-large",
    "negative-id",
    "too-long",
    "type-too-large",
    "negative-type",
    "float-types",
    "mask-short",
    "mask-batch",
    "mask-4d",
    "types-shape",
    "empty-batch",
    "zero-length",
    "1-d-ids",
    "float-ids",
    "position-too-large",
    "no-input",
]


@pytest.mark.parametrize("case", INPUT_CASES)
def test_bad_model_inputs_fail_before_any_kernel(tiny_model, monkeypatch, case):
    inputs, message = _case(case)
    kernels = []
    for module in (torch.nn.Embedding, torch.nn.Linear, torch.nn.LayerNorm):
        original = module.forward

        def spy(self, *args, _forward=original, **kwargs):
            kernels.append(type(self).__name__)
            return _forward(self, *args, **kwargs)

        monkeypatch.setattr(module, "forward", spy)
    with pytest.raises(ValueError, match=message), torch.no_grad():
        tiny_model(**inputs)
    assert kernels == [], "a kernel ran before the input was rejected"


def test_good_inputs_still_run(tiny_model):
    """The checks reject only what is wrong: the edges of every range are accepted."""
    ids = torch.tensor([[0, 98] + [5] * 62])  # smallest and largest id, exactly 64 positions
    types = torch.zeros_like(ids)
    types[:, 32:] = 1
    with torch.no_grad():
        out = tiny_model(ids, attention_mask=torch.ones_like(ids, dtype=torch.bool), token_type_ids=types)
    assert out.last_hidden_state.shape == (1, 64, 32) and bool(torch.isfinite(out.last_hidden_state).all())


def test_bad_max_shard_size(tmp_path, tiny_model):
    for size in ("5 parsecs", "-3GB", 0):
        with pytest.raises(ValueError, match="max_shard_size must be positive|cannot parse size"):
            tiny_model.save_pretrained(tmp_path / "out", max_shard_size=size)
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_cache_lookup_is_only_for_hub_ids(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for path in ("./missing", "/no/such/dir", "a/b/c", "../up", str(tmp_path / "nothing")):
        with pytest.raises(CheckpointError, match="the path does not exist"):
            BertModel.from_pretrained(path)
    with pytest.raises(CheckpointError, match="searched"):
        BertModel.from_pretrained(os.path.join("org", "model"))


@pytest.mark.gpu
def test_bad_ids_on_cuda_are_value_errors_not_device_asserts():
    """On CUDA an out-of-range id reaching the embedding is a device-side assert that poisons
    the process; the checks must stop every case first, and a good batch must still run."""
    model = BertModel(BertConfig(**TINY)).cuda().eval()
    for case in INPUT_CASES:
        inputs, message = _case(case)
        with pytest.raises(ValueError, match=message), torch.no_grad():
            model(**{k: v.cuda() for k, v in inputs.items()})
    batch = {k: v.cuda() for k, v in random_batch(TINY["vocab_size"]).items()}
    with torch.no_grad():
        out = model(**batch)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(out.last_hidden_state).all())
