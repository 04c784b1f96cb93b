"""Export: `torch.export.export` of the default `BertModel` with dynamic batch and sequence
dimensions, and `torch.onnx.export(..., dynamo=True)` run by onnxruntime, each checked on a
new batch of another shape than the one traced.

While tracing, the model takes the padded path (packing needs the sequence lengths on the
host) and skips the id-range checks (they need the ids on the host); the exported program
therefore computes what the eager model computes with `unpad_inputs=False`."""

from __future__ import annotations

import pytest
import torch
from conftest import REAL_SENTENCES, TOL, random_batch

from bert_port import BertConfig, BertModel, encode, load_tokenizer
from bert_port.bench.harness import config_override

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# The bar for the exported program against the eager model on the same (padded) path.
EXPORT_ATOL = 1e-6


def _dynamic_shapes(max_len: int) -> dict:
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=max_len)
    return {name: {0: batch, 1: seq} for name in INPUTS}


def _args(batch: dict) -> tuple:
    return tuple(batch[name] for name in INPUTS)


def _eager(model: BertModel, batch: dict) -> tuple[dict, dict]:
    """The model's default output, and its output on the padded path."""
    with torch.no_grad():
        default = model(**batch)
        with config_override(model, unpad_inputs=False):
            padded = model(**batch)
    return default, padded


def _assert_matches_eager(got: dict, model: BertModel, batch: dict, exact_atol: float | None) -> float:
    """Compare exported outputs with eager ones; returns the real-token max abs difference
    against the default (unpadded) model."""
    default, padded = _eager(model, batch)
    real = batch["attention_mask"].bool()
    if exact_atol is not None:  # the same operations as the padded path
        for name in ("last_hidden_state", "pooler_output"):
            torch.testing.assert_close(got[name], padded[name], atol=exact_atol, rtol=0)
    torch.testing.assert_close(got["last_hidden_state"][real], default.last_hidden_state[real], **TOL[torch.float32])
    torch.testing.assert_close(got["pooler_output"], default.pooler_output, **TOL[torch.float32])
    return (got["last_hidden_state"] - default.last_hidden_state).abs()[real].max().item()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_torch_export_with_dynamic_batch_and_sequence(tiny_config, attn):
    model = BertModel(BertConfig.from_dict(tiny_config, attn_implementation=attn)).eval()
    traced = random_batch(tiny_config["vocab_size"], B=3, T=9)
    program = torch.export.export(
        model, _args(traced), dynamic_shapes=_dynamic_shapes(tiny_config["max_position_embeddings"])
    )
    new = random_batch(tiny_config["vocab_size"], B=5, T=13, seed=1)
    with torch.no_grad():
        got = program.module()(*_args(new))
    _assert_matches_eager(got, model, new, EXPORT_ATOL)


def test_torch_export_of_the_real_checkpoint(minilm_path):
    model = BertModel.from_pretrained(minilm_path)
    tokenizer = load_tokenizer(minilm_path)
    traced, new = encode(tokenizer, REAL_SENTENCES[:3]), encode(tokenizer, REAL_SENTENCES[2:] + ["ok", "fine"])
    assert traced["input_ids"].shape != new["input_ids"].shape
    program = torch.export.export(model, _args(traced), dynamic_shapes=_dynamic_shapes(512))
    with torch.no_grad():
        got = program.module()(*_args(new))
    diff = _assert_matches_eager(got, model, new, EXPORT_ATOL)
    print(f"all-MiniLM-L6-v2 exported vs eager default, real tokens: max abs {diff:.2e}")


def _onnx_round_trip(model: BertModel, traced: dict, new: dict, max_len: int, path) -> dict:
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    program = torch.onnx.export(
        model,
        _args(traced),
        dynamic_shapes=_dynamic_shapes(max_len),
        input_names=list(INPUTS),
        output_names=["last_hidden_state", "pooler_output"],
        dynamo=True,
        verbose=False,
    )
    program.save(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    outputs = session.run(None, {name: new[name].numpy() for name in INPUTS})
    return {o.name: torch.from_numpy(v) for o, v in zip(session.get_outputs(), outputs)}


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
def test_onnx_export_runs_in_onnxruntime(tiny_config, tmp_path):
    """onnxruntime's kernels are not torch's, so real tokens and the pooler are held to the
    fp32 policy against the eager model (pad positions are values nothing reads)."""
    model = BertModel(BertConfig.from_dict(tiny_config)).eval()
    traced = random_batch(tiny_config["vocab_size"], B=3, T=9)
    new = random_batch(tiny_config["vocab_size"], B=5, T=13, seed=1)
    got = _onnx_round_trip(model, traced, new, tiny_config["max_position_embeddings"], tmp_path / "tiny.onnx")
    _assert_matches_eager(got, model, new, exact_atol=None)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
def test_onnx_export_of_the_real_checkpoint(minilm_path, tmp_path):
    model = BertModel.from_pretrained(minilm_path)
    tokenizer = load_tokenizer(minilm_path)
    traced, new = encode(tokenizer, REAL_SENTENCES[:3]), encode(tokenizer, REAL_SENTENCES[2:] + ["ok", "fine"])
    got = _onnx_round_trip(model, traced, new, 512, tmp_path / "minilm.onnx")
    diff = _assert_matches_eager(got, model, new, exact_atol=None)
    print(f"all-MiniLM-L6-v2 onnxruntime vs eager default, real tokens: max abs {diff:.2e}")


@pytest.mark.slow
def test_torch_compile_of_the_whole_model_has_no_graph_break(tiny_config):
    """`fullgraph=True` fails on any graph break, such as a host sync in the forward. The
    aot_eager backend captures the graph as inductor would, without compiling C++ (which
    inductor fails to do under ATEN_CPU_CAPABILITY=default)."""
    model = BertModel(BertConfig.from_dict(tiny_config)).eval()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch.no_grad():
        for T in (9, 14):
            batch = random_batch(tiny_config["vocab_size"], T=T)
            _assert_matches_eager(compiled(**batch), model, batch, exact_atol=None)
