"""Pre-LN BERT (`BertConfig.pre_norm`), proven through transformers' MegatronBertModel computed
in the same run: a random Megatron-BERT checkpoint saved by transformers loads with nothing
missing or unexpected, matches bit for bit in exact mode and within the float32 policy on the
default packed, batch-invariant path, and saves files transformers loads back. Planted bugs
(post-LN arithmetic, a missing final LayerNorm, ...) miss the tolerance by a wide margin. The
identity task shows what the pre-LN residual path buys.

The heads are 16 wide: Megatron divides the scores by sqrt(16) where BERT multiplies by
16**-0.5, the same bits when the root is a power of two (real Megatron-BERT heads are 64 wide).
"""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import EXACT, TINY, TOL, assert_bitwise, hf_model, random_batch
from test_tolerance import _assert_caught  # the margin a planted bug must miss the policy by

import bert_port.checkpoint as ckpt
from bert_port import BertConfig, BertModel, CheckpointError, ConfigError, encode, load_tokenizer, parity
from bert_port.data import load_mr
from bert_port.heads import BertForMaskedLM
from bert_port.training.identity import train_identity

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors: see conftest
# MiniLM's vocabulary, so that the model reads real text through the real tokenizer.
MEGATRON = dict(TINY, vocab_size=30522, num_attention_heads=2, model_type="megatron-bert")


def _randomised(hf):
    """transformers' model with every parameter moved off its init (LayerNorms off identity,
    biases off zero), so that a LayerNorm in the wrong place or under the wrong name shows."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 0.1)
    return hf


@pytest.fixture(scope="module")
def megatron(tmp_path_factory, minilm_path):
    """(directory, reference): a random MegatronBertModel saved by transformers, with MiniLM's
    tokenizer files beside it, and transformers' MegatronBertModel read back from it. Read back,
    not the model that was saved: a one-row GEMM (a batch of one text, the pooler) takes a GEMV
    kernel whose bits depend on how the weights are aligned in memory, and both loaders map
    the file the same way."""
    import transformers

    directory = tmp_path_factory.mktemp("megatron")
    _randomised(hf_model(MEGATRON, "MegatronBertModel")).save_pretrained(directory)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (minilm_path / name).is_file():
            shutil.copy(minilm_path / name, directory / name)
    return directory, transformers.MegatronBertModel.from_pretrained(str(directory)).eval()


@pytest.fixture(scope="module")
def batches(megatron):
    examples = [(t, None) for t in parity.DEFAULT_TEXTS[:8]] + list(parity.DEFAULT_PAIRS[:2])
    return parity.build_batches(load_tokenizer(megatron[0]), examples, batch_size=8, max_length=32)


def _check(ours, reference, batches) -> parity.Row:
    (row,) = parity.check_matrix(ours, reference, batches, devices=["cpu"], dtypes=[torch.float32])
    return row


# -- transformers' MegatronBertModel ---------------------------------------------------------


def test_megatron_checkpoint_loads_and_matches_bitwise_in_exact_mode(megatron, batches):
    directory, hf = megatron
    ours = BertModel.from_pretrained(directory, **EXACT)
    assert ours.config.pre_norm is True
    info = ours.loading_info
    assert info["newly_initialized"] == [] and info["dropped"] == [] and info["unused"] == []
    assert ours.embed_layer_norm is None and ours.bert_layers[0].attention_layer_norm is None
    for batch in batches:
        with torch.no_grad():
            mine = ours(**batch.inputs, output_hidden_states=True, output_attentions=True)
            ref = hf(**batch.inputs, output_hidden_states=True, output_attentions=True)
        assert_bitwise([mine.last_hidden_state, mine.pooler_output], [ref.last_hidden_state, ref.pooler_output])
        assert_bitwise(mine.hidden_states, ref.hidden_states)  # the last one after the final LayerNorm
        assert_bitwise(mine.attentions, ref.attentions)


@pytest.mark.parametrize(
    "options",
    [{}, {"batch_invariant": False}, {"optimize": False}],
    ids=["packed, batch-invariant (default)", "packed, batch_invariant=False", "padded sdpa"],
)
def test_default_paths_match_megatron_within_the_policy(megatron, batches, options):
    directory, hf = megatron
    ours = BertModel.from_pretrained(directory, **options)
    mask = batches[0].inputs["attention_mask"]
    assert (ours.packing_for(mask) is not None) if "optimize" not in options else not hasattr(ours, "packing_for")
    row = _check(ours, hf, batches)
    assert row.status == "PASS", parity.describe_failure(row)


def test_saved_checkpoint_is_megatron_for_transformers(megatron, batches, tmp_path):
    import transformers

    directory, hf = megatron
    ours = BertModel.from_pretrained(directory, **EXACT)
    ours.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "megatron-bert" and config["pre_norm"] is True
    assert config["architectures"] == ["MegatronBertModel"]
    back, info = transformers.MegatronBertModel.from_pretrained(str(tmp_path), output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    again = BertModel.from_pretrained(tmp_path, **EXACT)
    for batch in batches[:2]:
        with torch.no_grad():
            expected = hf(**batch.inputs)
            for model in (back.eval(), again):
                out = model(**batch.inputs)
                assert_bitwise([out.last_hidden_state, out.pooler_output], [expected[0], expected[1]])


def test_parity_cli_compares_with_megatron_read_by_transformers(megatron, capsys):
    """`bert-port-parity` on a Megatron-BERT folder: transformers' MegatronBertModel reads the
    file itself (eager: it has no SDPA), and exact mode is bitwise."""
    import bert_port.cli.parity as parity_cli

    argv = ["--checkpoint", str(megatron[0]), "--device", "cpu", "--dtype", "float32", "--max-length", "16"]
    assert parity_cli.main([*argv, "--attn", "eager", "--atol", "0", "--rtol", "0", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "transformers.MegatronBertModel.from_pretrained read" in out and "cpu float32: PASS" in out


def test_megatron_masked_lm_loads_matches_and_saves_back(tmp_path):
    import transformers

    config = dict(TINY, num_attention_heads=2, model_type="megatron-bert")
    _randomised(hf_model(config, "MegatronBertForMaskedLM")).save_pretrained(tmp_path / "hf")
    hf = transformers.MegatronBertForMaskedLM.from_pretrained(str(tmp_path / "hf")).eval()  # see `megatron`
    batch = random_batch(TINY["vocab_size"])
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        expected = hf(**batch, labels=labels)
    ours = BertForMaskedLM.from_pretrained(tmp_path / "hf", **EXACT)
    assert ours.loading_info["newly_initialized"] == [] and ours.loading_info["dropped"] == []
    with torch.no_grad():
        out = ours(**batch, labels=labels)
    assert_bitwise([out.logits, out.loss], [expected.logits, expected.loss])

    ours.save_pretrained(tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["architectures"] == ["MegatronBertForMaskedLM"]
    back, info = transformers.MegatronBertForMaskedLM.from_pretrained(str(tmp_path / "ours"), output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    with torch.no_grad():
        assert torch.equal(back.eval()(**batch).logits, expected.logits)


def test_gradients_match_megatron(megatron):
    """Every parameter's gradient of a mean loss, as in training (gradients up to about 1),
    through the pre-LN layers: bitwise in exact mode, within the float32 policy on the packed
    default path (as tests/test_packing.py holds it for post-LN)."""
    directory, hf = megatron
    batch = random_batch(MEGATRON["vocab_size"])
    mask = batch["attention_mask"].bool()
    target = torch.randn(*mask.shape, MEGATRON["hidden_size"])

    def loss(out):
        return F.mse_loss(out.last_hidden_state[mask], target[mask]) + F.mse_loss(out.pooler_output, target[:, 0])

    hf.zero_grad()
    loss(hf(**batch)).backward()
    expected = {name: p.grad for name, p in hf.named_parameters()}
    for options in (EXACT, {}):
        ours = BertModel.from_pretrained(directory, **options)
        loss(ours(**batch)).backward()
        grads = ckpt.port_to_hf({name: p.grad for name, p in ours.named_parameters()})
        assert grads.keys() == expected.keys()
        for name, grad in grads.items():
            if options is EXACT:
                assert torch.equal(grad, expected[name]), name
            else:
                torch.testing.assert_close(grad, expected[name], **TOL[torch.float32], msg=name)
    hf.zero_grad(set_to_none=True)  # the reference is shared by the module's tests


def test_a_text_gets_the_same_bits_alone_and_in_any_batch(megatron):
    """Batch invariance on the pre-LN default path: the final LayerNorm runs on packed rows too."""
    directory, _ = megatron
    model = BertModel.from_pretrained(directory)
    tok = load_tokenizer(directory)
    texts = load_mr().texts[:12] + ["ok", "a b"]

    def hidden(group: list[str]) -> list[torch.Tensor]:
        batch = encode(tok, group)
        with torch.inference_mode():
            out = model(**batch)
        rows = zip(out.last_hidden_state, batch["attention_mask"].sum(1).tolist(), out.pooler_output)
        return [torch.cat([h[:n].flatten(), p]) for h, n, p in rows]

    alone = [hidden([t])[0] for t in texts]
    for group in (list(range(len(texts))), list(range(len(texts)))[::-1], [0, 13], [5, 12, 1]):
        for i, got in zip(group, hidden([texts[i] for i in group]), strict=True):
            assert torch.equal(got, alone[i]), f"text {i} differs in batch {group}"


# -- planted bugs ----------------------------------------------------------------------------


def _post_ln_arithmetic(model):
    """Megatron's LayerNorms run where BERT's sit: after each residual addition."""
    for layer in model.bert_layers:
        layer.attention_layer_norm, layer.pre_attention_layer_norm = layer.pre_attention_layer_norm, None
        layer.out_layer_norm, layer.pre_ffn_layer_norm = layer.pre_ffn_layer_norm, None


def _no_final_layer_norm(model):
    model.final_layer_norm = None


def _embedding_layer_norm_kept(model):
    """BERT's habit: normalise the embeddings (Megatron leaves that to layer 0's LayerNorm)."""
    model.embed_layer_norm = torch.nn.LayerNorm(model.config.hidden_size, eps=model.config.layer_norm_eps)


@pytest.mark.parametrize(
    "plant, first_bad",
    [(_post_ln_arithmetic, "layer 0"), (_no_final_layer_norm, "layer 1"), (_embedding_layer_norm_kept, "embeddings")],
    ids=["post-LN arithmetic", "no final LayerNorm", "embedding LayerNorm kept"],
)
def test_planted_bug_is_caught(megatron, batches, plant, first_bad):
    directory, hf = megatron
    honest = BertModel.from_pretrained(directory)
    assert _check(honest, hf, batches).status == "PASS"
    plant(honest)
    _assert_caught(_check(honest, hf, batches), first_bad)


def test_attention_and_ffn_layer_norms_swapped_by_the_key_table_are_caught(megatron, batches, monkeypatch):
    table = dict(ckpt.HF_TO_PORT)
    for part in ("weight", "bias"):
        a, b = f"encoder.layer.{{}}.attention.ln.{part}", f"encoder.layer.{{}}.ln.{part}"
        table[a], table[b] = table[b], table[a]
    monkeypatch.setitem(ckpt.keys.KEY_TABLES, "bert", table)
    monkeypatch.setitem(ckpt.keys.INVERSE_TABLES, "bert", {v: k for k, v in table.items()})
    directory, hf = megatron
    _assert_caught(_check(BertModel.from_pretrained(directory), hf, batches), "layer 0")


# -- config.json ------------------------------------------------------------------------------


def test_pre_norm_round_trips_through_config_json(megatron, minilm_path):
    megatron_json = json.loads((megatron[0] / "config.json").read_text())
    assert "pre_norm" not in megatron_json  # transformers' Megatron config says it by model_type alone
    config = BertConfig.from_dict(megatron_json)
    assert config.pre_norm is True
    written = config.to_dict()
    assert written["model_type"] == "megatron-bert" and written["pre_norm"] is True
    assert BertConfig.from_dict(written) == config

    bert_json = json.loads((minilm_path / "config.json").read_text())
    bert = BertConfig.from_dict(bert_json)
    assert bert.pre_norm is False and "pre_norm" not in bert.to_dict() and bert.to_dict()["model_type"] == "bert"
    # An override changes the architecture, and model_type follows it.
    assert BertConfig.from_dict(bert_json, pre_norm=True).to_dict()["model_type"] == "megatron-bert"
    assert BertConfig.from_dict(megatron_json, pre_norm=False).to_dict()["model_type"] == "bert"
    assert BertConfig(pre_norm=True).to_dict()["model_type"] == "megatron-bert"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"model_type": "megatron-bert", "pre_norm": False}, "set model_type to 'bert'"),
        ({"model_type": "bert", "pre_norm": True}, "set model_type to 'megatron-bert'"),
        ({"pre_norm": "true"}, "pre_norm must be true or false, got 'true'"),
    ],
)
def test_bad_pre_norm_in_config_json_is_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        BertConfig.from_dict({**TINY, **fields})


def test_checkpoint_of_the_other_arrangement_says_which_config_to_fix(megatron, minilm_path, tmp_path):
    shutil.copytree(megatron[0], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(CheckpointError, match=r'are pre-LN \(Megatron-BERT\).*"model_type": "megatron-bert"') as err:
        BertModel.from_pretrained(tmp_path / "m")
    assert "encoder.ln.weight -> final_layer_norm.weight" in str(err.value)
    with pytest.raises(CheckpointError, match=r'are post-LN \(BERT\).*"model_type": "bert"'):
        BertModel.from_pretrained(minilm_path, pre_norm=True)


# -- the identity task ------------------------------------------------------------------------

# The bar, as a share of the L1 loss of predicting zeros (mean |x|, about 0.80): 5%. A post-LN
# layer cannot go below about the L1 distance between x and LayerNorm(x), a quarter of that
# for hidden size 20 (its output is a LayerNorm's); a pre-LN layer's residual path carries x
# through, and the identity is its output projections at zero. Measured at 200 steps, seed 0:
# pre-LN 0.6%, post-LN 26%.
BAR = 0.05


def test_pre_ln_layer_learns_the_identity_and_post_ln_cannot():
    pre = train_identity(pre_norm=True, steps=200, seed=0)
    post = train_identity(pre_norm=False, steps=200, seed=0)
    assert pre.layer_norm_loss > 4 * BAR * pre.zeros_loss  # the bar lies far below post-LN's floor
    assert pre.final_loss() < BAR * pre.zeros_loss, pre.losses[-10:]
    assert post.final_loss() > BAR * post.zeros_loss, post.losses[-10:]
    assert train_identity(pre_norm=True, steps=5, seed=0).losses == pre.losses[:5]  # seeded: the same run


def test_identity_script_prints_the_curve(capsys):
    main = runpy.run_path(str(ROOT / "scripts" / "identity_task.py"))["main"]
    assert main(["--steps", "30", "--points", "3"]) == 0
    out = capsys.readouterr().out
    assert "pre-LN (Megatron-BERT)" in out and "step    30" in out and "predicting zeros" in out
    assert main(["--steps", "3", "--post-ln"]) == 0
    assert "post-LN (BERT)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["--steps", "0"])
    assert exit_info.value.code == 2
    assert "--steps: must be a positive integer" in capsys.readouterr().err
