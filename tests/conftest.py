"""Shared fixtures and helpers: a tiny config, seeded RNG, the bundled real checkpoint, a
rebuilt bert-base-uncased-layout checkpoint, the tolerance table (the package's policy), the
port built from a transformers model through the production loader, and bitwise checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bert_port.assets import config_dir, minilm_dir
from bert_port.tolerance import TOLERANCES

CONFIGS = config_dir()  # the real HF configs (top-level configs/)

# Every comparison with transformers uses the project's one tolerance policy
# (bert_port/tolerance.py), as keyword arguments of torch.testing.assert_close.
TOL = {dtype: tol.kwargs() for dtype, tol in TOLERANCES.items()}

# Exact mode: the padded eager path runs transformers' eager operations, in the same order,
# on the same shapes, so it is bitwise equal to transformers' eager path under every kernel
# family. Tests that compare with transformers bit for bit load the port this way.
EXACT = dict(attn_implementation="eager", optimize=False)

REAL_SENTENCES = [
    "the rock is destined to be the 21st century's new \" conan \" and that he's going to make a splash even greater than arnold schwarzenegger.",
    "A gripping, beautifully shot film that never lets go.",
    "I wouldn't recommend this restaurant to anyone.",
    "Go until jurong point, crazy.. Available only in bugis n great world la e buffet...",
    "naïve café owners résumé: Ünïcödé and 中文 characters too!",
    "ok",
]

TINY = dict(
    vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    hidden_act="gelu",
    hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1,
    max_position_embeddings=64,
    type_vocab_size=2,
    initializer_range=0.02,
    layer_norm_eps=1e-12,
    pad_token_id=0,
)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def tiny_config() -> dict:
    return dict(TINY)


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    return minilm_dir()


@pytest.fixture(scope="module")
def hf_reference(minilm_path):
    """transformers' BertModel on the bundled real checkpoint, fp32: the parity reference."""
    import transformers

    return transformers.BertModel.from_pretrained(str(minilm_path), dtype=torch.float32).eval()


def hf_model(config: dict, cls_name: str = "BertModel", attn: str = "eager", **kwargs):
    """A randomly initialised transformers model for `config` (a config.json dict), seed 0,
    built by the package's one twin builder (`bert_port.reference`)."""
    from bert_port.reference import random_hf_model

    return random_hf_model(config, cls_name, attn, seed=0, **kwargs)


def port_from_hf(hf, config: dict, optimize: bool = True, batch_invariant: bool = True, **overrides):
    """The port holding `hf`'s weights, loaded by the production loader (`load_hf_state_dict`),
    in eval mode, with the speed layer swapped in as `from_pretrained` does unless `optimize` is
    False; `overrides` set config fields (`**EXACT` for the plain eager path that is bitwise
    equal to transformers' eager path)."""
    from bert_port import BertConfig, BertModel, speed

    model = BertModel(BertConfig.from_dict(config, **overrides))
    model.load_hf_state_dict(hf.state_dict())
    if optimize:
        speed.optimize(model, batch_invariant=batch_invariant)
    return model.eval()


def outputs_on_real_tokens(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(last hidden state, pooler output) of either model, pad positions zeroed: the port's
    unpadded default writes zeros there, transformers computes values no consumer reads."""
    with torch.no_grad():
        out = model(**batch)
    hidden = out["last_hidden_state"]
    if isinstance(batch, dict) and "attention_mask" in batch:
        hidden = hidden.masked_fill(~batch["attention_mask"].bool()[..., None], 0)
    return hidden, out["pooler_output"]


def assert_bitwise(actual, expected) -> None:
    """Each tensor of `actual` equals the one of `expected` bit for bit, dtype and shape too."""
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert torch.equal(a, e), f"max abs diff {(a - e).abs().max().item():.3e}"


def random_batch(vocab_size: int, B: int = 3, T: int = 9, pad: str = "right", seed: int = 0) -> dict:
    """Token ids with a ragged padding pattern: row i has i pads (on `pad` side)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for i in range(B):
        if i:
            if pad == "right":
                mask[i, T - i :] = 0
            else:
                mask[i, :i] = 0
    ids = ids.masked_fill(mask == 0, 0)
    types = torch.zeros(B, T, dtype=torch.long)
    types[:, T // 2 :] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types * mask}


def write_legacy_bert_base(root: Path, formats=("safetensors", "bin")) -> torch.nn.Module:
    """Write a checkpoint in the exact bert-base-uncased layout (real config.json,
    `bert.` prefixes, LayerNorm.gamma/beta, cls.* pretraining heads, random weights) once
    per format, as `root/safetensors/model.safetensors` and `root/bin/pytorch_model.bin`.
    Returns the transformers BertModel holding the same weights, as the reference."""
    from safetensors.torch import save_file

    config = json.loads((CONFIGS / "bert-base-uncased.json").read_text())
    pretraining = hf_model(config, "BertForPreTraining")
    state = {}
    for key, tensor in pretraining.state_dict().items():
        if key.endswith(("position_ids", "token_type_ids")):
            continue
        key = key.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        state[key] = tensor.clone()  # clone: the MLM decoder weight is tied to the embeddings
    for fmt in formats:
        directory = root / fmt
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        if fmt == "safetensors":
            save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        else:
            torch.save(state, directory / "pytorch_model.bin")
    return pretraining.bert


@pytest.fixture(scope="session")
def bert_base_layout(tmp_path_factory):
    """(root, reference): root/safetensors and root/bin hold the same legacy-layout
    bert-base-uncased checkpoint; reference is transformers' BertModel with its weights."""
    root = tmp_path_factory.mktemp("bert-base-uncased")
    return root, write_legacy_bert_base(root)


# -- fine-tuning runs -----------------------------------------------------------------------


def run_finetune(*args) -> int:
    """`bert-port-finetune` in this process (its `main`), every argument as a string."""
    from bert_port.cli import finetune

    return finetune.main([str(a) for a in args])


def finetune_args(data: dict, ckpt, out, *extra) -> list:
    """A short CPU run: `data["train"]`/`data["validation"]` into `out`, two epochs of batches
    of 8 at 16 tokens, then `extra`."""
    return [
        *("--checkpoint", ckpt, "--train", data["train"], "--validation", data["validation"]),
        *("--output-dir", out, "--max-length", "16", "--batch-size", "8", "--epochs", "2"),
        *("--lr", "1e-3", "--warmup-steps", "2", "--device", "cpu"),
        *extra,
    ]


def metrics_of(out: Path) -> dict:
    """A run's `metrics.json`."""
    return json.loads((out / "metrics.json").read_text())


def load_last(out: Path) -> dict:
    """A run's resumable training state, `checkpoints/last-checkpoint.pt`."""
    return torch.load(out / "checkpoints" / "last-checkpoint.pt", map_location="cpu", weights_only=True)


# -- the fine-tuning tests' data, tiny models and flags (test_finetune*.py) ---------------


@pytest.fixture(scope="module")
def sms_files(tmp_path_factory) -> dict[str, Path]:
    """Slices of the bundled SMS split as files: 37 training messages (not a multiple of
    the batch or of 2 processes, so padding and the short last batch are exercised);
    validation and test of 16 ham and 8 spam each. One file per format."""
    root = tmp_path_factory.mktemp("sms")
    from bert_port.data import builtin_splits, write_texts

    splits = builtin_splits("sms")

    def mixed(ds):
        ham = [i for i, label in enumerate(ds.labels) if label == "ham"][:16]
        return ds.subset(sorted(ham + [i for i, label in enumerate(ds.labels) if label == "spam"][:8]))

    return {
        "train": write_texts(splits["train"].subset(range(37)), root / "train.csv"),
        "validation": write_texts(mixed(splits["validation"]), root / "validation.jsonl"),
        "test": write_texts(mixed(splits["test"]), root / "test.tsv"),
    }


def _tiny_checkpoint(root: Path, minilm_path: Path, dropout: float) -> Path:
    """A randomly initialised small BERT with the real MiniLM vocabulary and tokenizer."""
    from bert_port import BertConfig, BertModel

    config = {**TINY, "vocab_size": 30522, "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    torch.manual_seed(0)
    model = BertModel(BertConfig.from_dict(config))
    model.source_dir = minilm_path
    return model.save_pretrained(root)


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory, minilm_path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "no_dropout": _tiny_checkpoint(root / "d0", minilm_path, 0.0),
        "dropout": _tiny_checkpoint(root / "d1", minilm_path, 0.1),
    }


def tiny_args(sms_files, checkpoint, output_dir, *extra) -> list[str]:
    return [
        "--checkpoint",
        checkpoint,
        "--train",
        sms_files["train"],
        "--validation",
        sms_files["validation"],
        "--test",
        sms_files["test"],
        "--output-dir",
        output_dir,
        "--max-length",
        "32",
        "--batch-size",
        "8",
        "--epochs",
        "2",
        "--lr",
        "1e-3",
        "--warmup-steps",
        "2",
        *extra,
    ]


def assert_same_weights(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        torch.testing.assert_close(value, b[key], **tol, msg=lambda m, k=key: f"{k}: {m}")


def assert_same_step_losses(run: dict, reference: dict) -> None:
    """The per-step training losses of two runs' `metrics.json` (two processes, or gradient
    accumulation, against one: the same sums in another order) within the policy's
    training-curve bar, over at most its `TRAINING_CURVE_STEPS` steps."""
    from bert_port.tolerance import TRAINING_CURVE, TRAINING_CURVE_STEPS

    assert len(run["steps"]) == len(reference["steps"]) <= TRAINING_CURVE_STEPS
    torch.testing.assert_close(
        torch.tensor([s["loss"] for s in run["steps"]]),
        torch.tensor([s["loss"] for s in reference["steps"]]),
        **TRAINING_CURVE.kwargs(),
    )


# -- the option matrix's pair and checks (test_bert_options.py, test_bert_numerics.py) ---

ATTNS = ["eager", "sdpa"]
HALF = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def single_thread():
    """These tensors are tiny: with one intra-op thread no op waits at an OpenMP barrier for
    a core that other work on a shared machine holds (that made each op many times slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hf_pair(config: dict, attn: str = "eager", add_pooling_layer: bool = True):
    """transformers' BertModel and ours with the same (random) weights, loaded through the
    production loader. The matrix checks the padded path, which mirrors transformers
    everywhere including pad positions; `test_unpadded_default_matches_transformers` and
    tests/test_packing.py check the unpadded default on real tokens."""
    from bert_port import BertConfig, BertModel

    hf = hf_model(config, attn=attn, add_pooling_layer=add_pooling_layer)
    config = BertConfig.from_dict(config, attn_implementation=attn)
    ours = BertModel(config, add_pooling_layer=add_pooling_layer)
    ours.load_hf_state_dict(hf.state_dict())
    return hf, ours.eval()


def call(layer, x, activation=None, residual=None):
    """`layer(x, residual)` with `activation` in its epilogue for this call (as `optimize` sets it)."""
    layer.activation = activation
    try:
        return layer(x, residual)
    finally:
        layer.activation = None


def hf_call(hf, **kwargs):
    """Call a transformers model without its KV cache: a decoder builds one by default, whose
    contiguous K/V copies change the matmuls' memory layout by about an ulp
    (test_bert_options.py's docstring)."""
    return hf(**{"use_cache": False, **kwargs})


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def assert_same(actual: torch.Tensor, expected: torch.Tensor, attn: str) -> None:
    """Bitwise for fp32 eager (the issue's exactness bar), the fp32 table for SDPA."""
    if attn == "eager":
        assert torch.equal(actual, expected), f"eager not bitwise: max abs diff {max_diff(actual, expected):.3e}"
    else:
        torch.testing.assert_close(actual, expected, **TOL[torch.float32])


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.where(keep, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)


def tiny_checkpoint(directory: Path, tokenizer_dir: Path) -> Path:
    """A tiny random BERT (TINY with the real 30522-token vocabulary, seed 0, dropout on) saved
    into `directory` with the tokenizer files of `tokenizer_dir`: the fine-tuning tests' model."""
    from bert_port import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig.from_dict({**TINY, "vocab_size": 30522}))
    model.source_dir = tokenizer_dir
    return model.save_pretrained(directory)
