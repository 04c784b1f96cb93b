"""The tolerance policy (bert_port/tolerance.py): one table, read by the parity tool and the
tests, loose enough to hold on every CPU and still tight enough to catch the classic port
bugs. Each bug is planted in the port, loaded through the production loader, and compared
with transformers on the real all-MiniLM-L6-v2 in the same run: the check must FAIL, name
the first site the bug can reach, and miss the tolerance by a wide margin."""

from __future__ import annotations

import pytest
import torch
from conftest import EXACT, TOL

import bert_port.checkpoint as ckpt
import bert_port.cli.parity as parity_cli
from bert_port import BertModel, load_tokenizer, parity
from bert_port.tolerance import TOLERANCES, Tolerance, tolerance_for

# A planted bug must miss the float32 tolerance by at least this factor: the policy's
# margin for bugs, as the reference spread staying below 1 is its margin for honest rounding.
MARGIN = 10


@pytest.fixture(scope="module")
def batches(minilm_path):
    examples = [(t, None) for t in parity.DEFAULT_TEXTS[:8]] + list(parity.DEFAULT_PAIRS[:2])
    return parity.build_batches(load_tokenizer(minilm_path), examples, batch_size=8, max_length=32)


def _check(ours, reference, batches) -> parity.Row:
    (row,) = parity.check_matrix(ours, reference, batches, devices=["cpu"], dtypes=[torch.float32])
    return row


def _assert_caught(row: parity.Row, first_bad: str) -> None:
    assert row.status == "FAIL"
    assert row.first_failure.name == first_bad, parity.describe_failure(row)
    sites = [s.name for s in row.sites if s.gated]
    for site in row.sites[: sites.index(first_bad)]:  # everything before the bug is untouched
        assert site.passed, site.name
    assert row.first_failure.ours.worst_ratio >= MARGIN, parity.describe_failure(row)
    assert f"first failing site: {first_bad}" in parity.format_report(parity.Report([row]))


def test_one_policy_everywhere():
    """The CLI's defaults, the tests' table and the policy are the same numbers, and float32
    is torch.testing's own default (what `assert_close` uses with no atol/rtol)."""
    assert tolerance_for(torch.float32) == Tolerance(atol=1e-5, rtol=1.3e-6)
    assert parity.TOLERANCES is TOLERANCES
    assert TOL == {dtype: {"atol": t.atol, "rtol": t.rtol} for dtype, t in TOLERANCES.items()}
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(torch.tensor(1.0), torch.tensor(1.0 + 10 * eps))  # default rtol: 1.3e-6
    with pytest.raises(AssertionError):
        torch.testing.assert_close(torch.tensor(1.0), torch.tensor(1.0 + 10 * eps), atol=0, rtol=1e-6)
    with pytest.raises(ValueError, match="no parity tolerance for torch.float64"):
        tolerance_for(torch.float64)


def test_honest_port_passes(minilm_path, hf_reference, batches):
    row = _check(BertModel.from_pretrained(minilm_path), hf_reference, batches)
    assert row.status == "PASS", parity.describe_failure(row)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_exact_mode_is_bitwise(minilm_path, batches, dtype):
    """Exact mode (eager, padded) against transformers' eager path on the real checkpoint,
    edge cases included: zero difference at every site, so a zero tolerance passes. This
    holds under every kernel family (`make test-kernels` runs it under each): both sides run
    the same operations in the same order on the same shapes."""
    import transformers

    ours = BertModel.from_pretrained(minilm_path, **EXACT)
    eager = transformers.BertModel.from_pretrained(str(minilm_path), attn_implementation="eager").eval()
    (row,) = parity.check_matrix(
        ours, eager, batches, devices=["cpu"], dtypes=[dtype], tolerances={dtype: Tolerance(atol=0, rtol=0)}
    )
    assert row.status == "PASS", parity.describe_failure(row)
    assert all(site.ours.max_abs == 0 for site in row.sites if site.gated)


def test_layer_norm_eps_1e_6_is_caught(minilm_path, hf_reference, batches):
    """eps 1e-6 instead of 1e-12: the embedding LayerNorm is the first to see it."""
    ours = BertModel.from_pretrained(minilm_path, layer_norm_eps=1e-6)
    _assert_caught(_check(ours, hf_reference, batches), "embeddings")


@pytest.mark.parametrize("act", ["gelu_new", "gelu_pytorch_tanh"])
def test_tanh_gelu_is_caught(minilm_path, hf_reference, batches, act):
    """The tanh approximation instead of exact (erf) GELU: layer 0's FFN is the first to see it."""
    ours = BertModel.from_pretrained(minilm_path, hidden_act=act)
    _assert_caught(_check(ours, hf_reference, batches), "layer 0")


def test_query_key_swapped_by_the_key_table_is_caught(minilm_path, hf_reference, batches, monkeypatch):
    """A key table that maps HF's query onto our key and back: attention scores transposed."""
    table = dict(ckpt.HF_TO_PORT)
    for part in ("weight", "bias"):
        q, k = (f"encoder.layer.{{}}.attention.self.{n}.{part}" for n in ("query", "key"))
        table[q], table[k] = table[k], table[q]
    monkeypatch.setitem(ckpt.keys.KEY_TABLES, "bert", table)  # the layer that looks the table up
    monkeypatch.setitem(ckpt.keys.INVERSE_TABLES, "bert", {v: k for k, v in table.items()})
    ours = BertModel.from_pretrained(minilm_path)
    hf_key = hf_reference.encoder.layer[0].attention.self.key.weight
    assert torch.equal(ours.bert_layers[0].self_attention.query.weight, hf_key)
    _assert_caught(_check(ours, hf_reference, batches), "layer 0")


@pytest.mark.parametrize(
    "tensor, first_bad",
    [
        ("word_embedding.weight", "embeddings"),
        ("bert_layers.2.self_attention.value.weight", "layer 2"),
        ("bert_layers.4.out_dense.weight", "layer 4"),
        ("bert_layers.5.out_layer_norm.weight", "layer 5"),
        ("pooler_dense.weight", "pooler_output"),
    ],
)
def test_one_weight_off_by_1e_3_relative_is_caught(minilm_path, hf_reference, batches, tensor, first_bad):
    """One weight tensor scaled by 1 + 1e-3 (a wrong dtype round trip, a bad merge of a
    fine-tuned delta): caught at the site that reads it, wherever it sits."""
    ours = BertModel.from_pretrained(minilm_path)
    with torch.no_grad():
        ours.get_parameter(tensor).mul_(1 + 1e-3)
    _assert_caught(_check(ours, hf_reference, batches), first_bad)


def test_cli_exits_1_on_a_planted_bug(minilm_path, monkeypatch, capsys):
    """End to end: `bert-port-parity` with the default policy reports the planted eps bug."""
    original = parity_cli.load_port

    def eps_bug(path, attn, *args, **kwargs):
        model, note = original(path, attn, *args, **kwargs)
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.eps = 1e-6
        return model, note

    monkeypatch.setattr(parity_cli, "load_port", eps_bug)
    argv = ["--device", "cpu", "--dtype", "float32", "--max-length", "16", "--no-progress"]
    assert parity_cli.main(argv) == 1
    out = capsys.readouterr().out
    assert "cpu  float32   FAIL     first failing site: embeddings" in out


def test_blas_thread_count_moves_the_pooler_within_the_policy(minilm_path, batches):
    """What moved the pooler between identical runs on a busy machine: MKL splits the
    reduction of a skinny GEMM (the pooler's (B, 384) x (384, 384)) across threads, so the
    same call rounds differently with one thread than with two, and a loaded machine can
    change how many threads a call gets. Such a difference is real rounding, not a port bug:
    the policy must absorb it, and the bitwise exact mode is unaffected because both models
    run the same call under the same threading."""
    model = BertModel.from_pretrained(minilm_path)
    inputs = batches[0].inputs
    before = torch.get_num_threads()
    outs = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.no_grad():
                outs[threads] = model(**inputs).pooler_output
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(outs[1], outs[2], **TOL[torch.float32])
