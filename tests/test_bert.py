"""Foundation: the port computes what transformers.BertModel computes, loaded through the
production loader, on a tiny random config, the real all-MiniLM-L6-v2 checkpoint and the
bert-base-uncased layout."""

from __future__ import annotations

import json
import logging
import sys

import pytest
import torch
from conftest import REAL_SENTENCES, TOL, hf_model, port_from_hf, random_batch
from safetensors.torch import save_file

from bert_port import BertConfig, BertModel, CheckpointError, ConfigError, encode, load_tokenizer


@pytest.mark.parametrize("pad", ["right", "left"])
@pytest.mark.parametrize("with_types", [True, False])
def test_tiny_parity(tiny_config, pad, with_types):
    hf = hf_model(tiny_config)
    ours = port_from_hf(hf, tiny_config)
    batch = random_batch(tiny_config["vocab_size"], pad=pad)
    if not with_types:
        batch.pop("token_type_ids")
    with torch.no_grad():
        expected, actual = hf(**batch), ours(**batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(actual.last_hidden_state[real], expected.last_hidden_state[real], **TOL[torch.float32])
    torch.testing.assert_close(actual.pooler_output, expected.pooler_output, **TOL[torch.float32])


def test_tiny_parity_without_mask(tiny_config):
    hf = hf_model(tiny_config)
    ours = port_from_hf(hf, tiny_config)
    ids = random_batch(tiny_config["vocab_size"])["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).last_hidden_state, hf(ids).last_hidden_state, **TOL[torch.float32])


def test_real_checkpoint_parity(minilm_path):
    import transformers

    ours = BertModel.from_pretrained(minilm_path)
    ref = transformers.BertModel.from_pretrained(str(minilm_path)).eval()
    batch = encode(load_tokenizer(minilm_path), REAL_SENTENCES)
    with torch.no_grad():
        actual, expected = ours(**batch), ref(**batch)
    real = batch["attention_mask"].bool()
    diff = (actual.last_hidden_state - expected.last_hidden_state).abs()[real].max().item()
    print(f"all-MiniLM-L6-v2 real-token max abs diff: {diff:.3e}")
    torch.testing.assert_close(actual.last_hidden_state[real], expected.last_hidden_state[real], **TOL[torch.float32])
    torch.testing.assert_close(actual.pooler_output, expected.pooler_output, **TOL[torch.float32])


def test_tokenizer_matches_bert_tokenizer_fast(minilm_path, tmp_path):
    """Both of our routes (tokenizer.json, and vocab.txt alone) give BertTokenizerFast's ids."""
    import shutil

    import transformers

    ref = transformers.BertTokenizerFast.from_pretrained(str(minilm_path))
    pairs = REAL_SENTENCES[::-1]
    expected = ref(REAL_SENTENCES, pairs, padding=True, truncation=True, max_length=40, return_tensors="pt")
    vocab_only = tmp_path / "vocab_only"
    vocab_only.mkdir()
    for name in ("vocab.txt", "tokenizer_config.json"):
        shutil.copy(minilm_path / name, vocab_only / name)
    for directory in (minilm_path, vocab_only):
        got = encode(load_tokenizer(directory), REAL_SENTENCES, pairs, max_length=40)
        for key in ("input_ids", "token_type_ids", "attention_mask"):
            assert torch.equal(got[key], expected[key]), (directory, key)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_bert_base_uncased_layout(bert_base_layout, fmt, caplog):
    root, ref = bert_base_layout
    with caplog.at_level(logging.INFO, logger="bert_port"):
        ours = BertModel.from_pretrained(root / fmt)
    assert "cls.predictions" in caplog.text and "cls.seq_relationship" in caplog.text
    assert ours.config.num_hidden_layers == 12 and ours.config.hidden_size == 768
    batch = random_batch(30522, B=2, T=16)
    with torch.no_grad():
        actual, expected = ours(**batch), ref(**batch)
    real = batch["attention_mask"].bool()
    diff = (actual.last_hidden_state - expected.last_hidden_state).abs()[real].max().item()
    print(f"bert-base-uncased layout ({fmt}) max abs diff: {diff:.3e}")
    torch.testing.assert_close(actual.last_hidden_state[real], expected.last_hidden_state[real], **TOL[torch.float32])
    torch.testing.assert_close(actual.pooler_output, expected.pooler_output, **TOL[torch.float32])


def _tiny_checkpoint(tmp_path, tiny_config, mutate):
    hf = hf_model(tiny_config)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    mutate(state)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config))
    save_file(state, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_missing_unexpected_and_wrong_shape_listed_together(tmp_path, tiny_config):
    def mutate(state):
        del state["encoder.layer.1.output.dense.bias"]
        state["encoder.layer.0.attention.self.extra.weight"] = torch.zeros(3)
        state["pooler.dense.weight"] = torch.zeros(5, 5)

    path = _tiny_checkpoint(tmp_path, tiny_config, mutate)
    with pytest.raises(CheckpointError) as err:
        BertModel.from_pretrained(path)
    msg = str(err.value)
    assert "missing (1)" in msg and "bert_layers.1.out_dense.bias: expected (32,)" in msg
    assert "unexpected (1)" in msg and "encoder.layer.0.attention.self.extra.weight: (3,)" in msg
    assert "wrong shape (1)" in msg and "pooler_dense.weight: checkpoint (5, 5), model (32, 32)" in msg


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda s: s.pop("embeddings.word_embeddings.weight"), "missing (1)"),
        (lambda s: s.update({"encoder.layer.5.output.dense.bias": torch.zeros(32)}), "unexpected (1)"),
        (lambda s: s.update({"embeddings.LayerNorm.bias": torch.zeros(31)}), "wrong shape (1)"),
    ],
    ids=["missing", "unexpected", "wrong-shape"],
)
def test_each_key_error_alone(tmp_path, tiny_config, mutate, expected):
    path = _tiny_checkpoint(tmp_path, tiny_config, mutate)
    with pytest.raises(CheckpointError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        BertModel.from_pretrained(path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": 30}, "not a multiple of num_attention_heads"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
        ({"hidden_act": "nope"}, "hidden_act 'nope' is unknown"),
        ({"add_cross_attention": True}, "not supported"),
    ],
)
def test_bad_config_values(tiny_config, change, message):
    with pytest.raises(ConfigError, match=message):
        BertConfig.from_dict({**tiny_config, **change})


def test_config_round_trips_unknown_fields(minilm_path):
    raw = json.loads((minilm_path / "config.json").read_text())
    written = BertConfig.from_dict(raw).to_dict()
    for key, value in raw.items():
        assert written[key] == value, key


def test_from_pretrained_is_eval_and_typed(minilm_path):
    model = BertModel.from_pretrained(minilm_path, dtype=torch.bfloat16)
    assert not model.training
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_package_does_not_import_transformers():
    import subprocess

    code = "import sys, bert_port, bert_port.cli.parity; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_parity_script_passes(minilm_path, capsys):
    from bert_port.cli.parity import main

    argv = ["--checkpoint", str(minilm_path), "--device", "cpu", "--dtype", "float32", "--max-length", "32"]
    assert main(argv + ["--no-progress"]) == 0
    assert "PASS: 1 of 1 device x dtype rows" in capsys.readouterr().out


@pytest.mark.gpu
def test_gpu_parity_real_checkpoint(minilm_path):
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ours = BertModel.from_pretrained(minilm_path, device="cuda")
    ref = transformers.BertModel.from_pretrained(str(minilm_path)).cuda().eval()
    batch = {k: v.cuda() for k, v in encode(load_tokenizer(minilm_path), REAL_SENTENCES).items()}
    with torch.no_grad():
        actual, expected = ours(**batch), ref(**batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(actual.last_hidden_state[real], expected.last_hidden_state[real], **TOL[torch.float32])
    torch.testing.assert_close(actual.pooler_output, expected.pooler_output, **TOL[torch.float32])


def test_loading_into_a_live_model_copies(tiny_config):
    """Loading into a built model copies, as torch's load_state_dict does: the source's
    tensors are not shared and the model's Parameters (which an optimiser may hold) stay."""
    hf = hf_model(tiny_config)
    model = BertModel(BertConfig.from_dict(tiny_config))
    before = model.word_embedding.weight
    model.load_hf_state_dict(hf.state_dict())
    assert model.word_embedding.weight is before
    assert model.word_embedding.weight.data_ptr() != hf.embeddings.word_embeddings.weight.data_ptr()
    torch.testing.assert_close(model.word_embedding.weight, hf.embeddings.word_embeddings.weight, atol=0, rtol=0)


@pytest.mark.parametrize("layers", [10**30, 1e30, 2**21], ids=["huge-int", "float-1e30", "above-bound"])
def test_huge_shape_fields_fail_fast(tiny_config, tmp_path, layers):
    # A damaged config.json must be refused when read, before the loader counts (set(range(n)))
    # or builds anything of that size.
    (tmp_path / "config.json").write_text(json.dumps({**tiny_config, "num_hidden_layers": layers}))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        BertConfig.from_json_file(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="vocab_size"):
        BertConfig.from_dict({**tiny_config, "vocab_size": 10**30})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_inputs_embeds_are_refused(tiny_config, bad):
    model = BertModel(BertConfig.from_dict(tiny_config)).eval()
    embeds = torch.randn(2, 5, tiny_config["hidden_size"])
    model(inputs_embeds=embeds)  # finite: runs
    embeds[1, 3, 0] = bad
    with pytest.raises(ValueError, match=r"inputs_embeds holds NaN or Inf \(first at batch 1, token 3, feature 0\)"):
        model(inputs_embeds=embeds)


def test_runtime_options_are_not_checkpoint_data(tiny_config, tmp_path):
    # Set from keywords, read and assigned as attributes; never data: to_dict, the saved
    # config.json and config equality know nothing of them.
    config = BertConfig.from_dict(tiny_config, attn_implementation="eager")
    assert config.attn_implementation == "eager"
    assert "attn_implementation" not in config.to_dict()
    assert config == BertConfig.from_dict(tiny_config)
    config.attn_implementation = "sdpa"
    assert config.attn_implementation == "sdpa"
    with pytest.raises(ConfigError, match="attn_implementation 'flash' is unknown"):
        config.attn_implementation = "flash"
    BertModel(BertConfig.from_dict(tiny_config, attn_implementation="eager")).save_pretrained(tmp_path)
    with pytest.raises(TypeError, match="unpad_inputs.*optimize=False"):  # speed is not the config's
        BertModel.from_pretrained(tmp_path, unpad_inputs=False)
    assert "attn_implementation" not in set(json.loads((tmp_path / "config.json").read_text()))
    read = BertConfig.from_json_file(tmp_path / "config.json", attn_implementation="eager")
    assert read.attn_implementation == "eager"
    built = BertConfig(**tiny_config, attn_implementation="eager")  # transformers' constructor keyword
    assert built.attn_implementation == "eager" and "attn_implementation" not in built.to_dict()
