"""Same text, same bits: a text's real-token hidden states, pooler output, head
logits and sentence embedding are bitwise equal alone and in any batch, in any order, with
any padding, on the default path; `bert-port-predict` and `SentenceEncoder.encode` give the
same bits for every batch size; two fine-tuning runs with one seed give the same bits.

These are bitwise claims about one machine, dtype, thread count and kernel family: the
same kernels run on the same shapes per sequence (see `bert_port/packing.py`). `make
test-kernels` runs this file under each kernel family; `tests/test_parity.py` compares
with transformers.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import finetune_args, run_finetune, tiny_checkpoint

from bert_port import BertModel, SentenceEncoder, encode, load_tokenizer
from bert_port.classifier import BertForSequenceClassification
from bert_port.data import builtin_splits, load_mr, write_texts
from bert_port.heads import BertForMaskedLM, BertForTokenClassification
from bert_port.speed.layers import PackedBertModel

# Real MR sentences, and short ones: a text of 3 tokens runs GEMMs of 3 rows alone.
SHORT = ["ok", "no", "a b", "fine.", "x"]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    mr = load_mr().texts
    return mr[:27] + SHORT + [" ".join(mr[100:106])]


def _batchings(n: int) -> dict[str, list[list[int]]]:
    order = list(range(n))
    random.Random(0).shuffle(order)
    return {
        "in sevens": [list(range(i, min(i + 7, n))) for i in range(0, n, 7)],
        "all, shuffled": [order],
        "pairs, reversed": [[i, n - 1 - i] for i in range(n // 2)],
    }


def _outputs(model, tokenizer, texts: list[str]) -> list[tuple[torch.Tensor, ...]]:
    """Per text: the real-token rows of every output of `model` that has a token axis, and the
    row of every output that has none."""
    batch = encode(tokenizer, texts)
    with torch.inference_mode():
        out = model(**batch)
    lengths = batch["attention_mask"].sum(1).tolist()
    per_text = []
    for i, n in enumerate(lengths):
        values = []
        for key in ("last_hidden_state", "pooler_output", "logits"):
            value = out.get(key) if hasattr(out, "get") else None
            if value is not None:
                values.append(value[i, :n] if value.dim() == 3 else value[i])
        per_text.append(tuple(values))
    return per_text


def _differing(model, tokenizer, texts: list[str]) -> list[str]:
    """Every (batching, text) whose outputs are not the bits of that text alone."""
    alone = [_outputs(model, tokenizer, [t])[0] for t in texts]
    bad = []
    for name, groups in _batchings(len(texts)).items():
        for group in groups:
            for i, got in zip(group, _outputs(model, tokenizer, [texts[i] for i in group]), strict=True):
                if not all(torch.equal(a, b) for a, b in zip(got, alone[i], strict=True)):
                    bad.append(f"{name}: text {i} ({texts[i][:20]!r})")
    return bad


@pytest.fixture(scope="module")
def tokenizer(minilm_path):
    return load_tokenizer(minilm_path)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_encoder_outputs_do_not_depend_on_the_batch(minilm_path, tokenizer, texts, dtype, threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = BertModel.from_pretrained(minilm_path, dtype=dtype)
        assert _differing(model, tokenizer, texts) == []
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("cls", [BertForSequenceClassification, BertForTokenClassification, BertForMaskedLM])
def test_head_logits_do_not_depend_on_the_batch(minilm_path, tokenizer, texts, cls):
    torch.manual_seed(0)  # the heads MiniLM lacks are initialised from the seeded RNG
    model = cls.from_pretrained(minilm_path, num_labels=3) if cls is not BertForMaskedLM else None
    model = model or cls.from_pretrained(minilm_path)
    assert _differing(model, tokenizer, texts[::3]) == []


def test_the_check_catches_the_old_default(minilm_path, tokenizer, texts, monkeypatch):
    """Planted: a batch without padding on the padded SDPA path again, as before this change.
    A text alone then runs another attention kernel than in a padded batch, and the check fails."""
    model = BertModel.from_pretrained(minilm_path)
    original = PackedBertModel.packing_for

    def old_rule(self, attention_mask, output_attentions=False, hidden_states=None, cache=None):
        packing = original(self, attention_mask, output_attentions, hidden_states, cache)
        return packing if packing is not None and packing.indices is not None else None

    monkeypatch.setattr(PackedBertModel, "packing_for", old_rule)
    assert len(_differing(model, tokenizer, texts)) > 0


def test_sentence_embeddings_do_not_depend_on_batch_size(minilm_path, texts):
    encoder = SentenceEncoder.from_pretrained(minilm_path)
    by_size = [encoder.encode(texts, batch_size=size, convert_to_tensor=True) for size in (1, 7, 32)]
    for other in by_size[1:]:
        assert torch.equal(other, by_size[0])


def test_predict_writes_the_same_bytes_for_every_batch_size(tmp_path, minilm_path, texts):
    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(minilm_path, num_labels=2)
    model.save_pretrained(tmp_path / "model")
    (tmp_path / "in.csv").write_text("text\n" + "".join(f'"{t}"\n' for t in texts), encoding="utf-8")
    outputs = []
    for size in (1, 5, 64):
        out = tmp_path / f"pred{size}.csv"
        argv = ["--model", tmp_path / "model", "--input", tmp_path / "in.csv", "--output", out, "--batch-size", size]
        proc = subprocess.run(
            [sys.executable, "-m", "bert_port.cli.predict", *map(str, argv), "--device", "cpu"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent.parent,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        outputs.append(out.read_bytes())
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]


FIRST_CALL = """
import sys, torch
from bert_port import BertModel, encode, load_tokenizer
from bert_port.data import load_mr
model, tokenizer = BertModel.from_pretrained(sys.argv[1]), load_tokenizer(sys.argv[1])
batch = encode(tokenizer, load_mr().texts[:32])
with torch.inference_mode():
    first, second = ((out.last_hidden_state, out.pooler_output) for out in (model(**batch), model(**batch)))
print(all(map(torch.equal, first, second)))
"""


def test_a_fresh_process_gives_the_bits_of_a_warm_one(minilm_path):
    """A process's first forward equals its second, hidden states and pooler output. The pooler's tanh is MKL's vector math,
    whose first call split over 2 threads raced MKL's set-up (gemm.settle_vector_math): without
    the warm-up a third of these processes failed on the AMX Xeon, so five miss it 1 time in 8."""
    runs = [
        subprocess.run([sys.executable, "-c", FIRST_CALL, str(minilm_path)], capture_output=True, text=True)
        for _ in range(5)
    ]
    assert [r.stdout.strip() for r in runs] == ["True"] * 5, [r.stderr[-500:] for r in runs]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, minilm_path) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), minilm_path)


@pytest.mark.parametrize("threads", [1, 2])
def test_two_fine_tuning_runs_with_one_seed_give_the_same_bits(tmp_path, tiny_ckpt, threads):
    """Dropout, shuffling and initialisation come from the seed; every kernel is deterministic
    on the CPU: the saved model and the metrics of two runs are identical."""
    splits = builtin_splits("sms")
    data = {
        "train": write_texts(splits["train"].subset(range(24)), tmp_path / "train.csv"),
        "validation": write_texts(splits["validation"].subset(range(16)), tmp_path / "validation.csv"),
    }
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for run in ("a", "b"):
            assert run_finetune(*finetune_args(data, tiny_ckpt, tmp_path / run, "--seed", "7")) == 0
    finally:
        torch.set_num_threads(previous)
    weights = [(tmp_path / run / "model.safetensors").read_bytes() for run in ("a", "b")]
    assert weights[0] == weights[1]
    metrics = [(tmp_path / run / "metrics.json").read_text() for run in ("a", "b")]
    strip = [m.replace(str(tmp_path / "a"), "").replace(str(tmp_path / "b"), "") for m in metrics]
    assert [line for line in strip[0].splitlines() if "seconds" not in line and '_s"' not in line] == [
        line for line in strip[1].splitlines() if "seconds" not in line and '_s"' not in line
    ]
