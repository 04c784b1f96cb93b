"""The bad-input catalogue, continued (test_bad_inputs.py): errors name tensors as the checkpoint
file does, and a command line's hints name its flags."""

# ruff: noqa: F811  (fixtures imported from bad_input_files, which pytest passes by name)

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bad_input_files import (
    _write,
    tiny_state,  # noqa: F401  (fixtures)
)

from bert_port import BertModel, CheckpointError

# -- errors name tensors as the checkpoint file does ----------------------------------------


def _in_layout(state: dict, prefix: str, legacy: bool) -> dict:
    """`state` (bare HF names) as a file with wrapper `prefix` and, if `legacy`, gamma/beta spells it."""

    def spell(key: str) -> str:
        if legacy:
            key = key.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        return prefix + key

    return {spell(k): v.clone() for k, v in state.items()}


def test_bert_base_legacy_file_errors_use_its_names(bert_base_layout, tmp_path):
    """A mis-shaped and a missing tensor in the bert-base-uncased layout are named as that file
    names them (`bert.` prefix, LayerNorm gamma/beta), each followed by the port's name."""
    from safetensors.torch import load_file

    root, _ = bert_base_layout
    state = load_file(str(root / "safetensors" / "model.safetensors"))
    assert "bert.encoder.layer.3.attention.output.LayerNorm.gamma" in state  # the file's own spelling
    state["bert.encoder.layer.3.attention.output.LayerNorm.gamma"] = torch.ones(767)
    del state["bert.encoder.layer.11.output.LayerNorm.beta"], state["bert.embeddings.LayerNorm.beta"]
    _write(tmp_path, state, config=(root / "safetensors" / "config.json").read_text())
    with pytest.raises(CheckpointError) as err:
        BertModel.from_pretrained(tmp_path)
    msg = str(err.value)
    assert (
        "bert.encoder.layer.3.attention.output.LayerNorm.gamma -> bert_layers.3.attention_layer_norm.weight: "
        "checkpoint (767,), model (768,)" in msg
    )
    assert "bert.encoder.layer.11.output.LayerNorm.beta -> bert_layers.11.out_layer_norm.bias: expected (768,)" in msg
    assert "bert.embeddings.LayerNorm.beta -> embed_layer_norm.bias: expected (768,)" in msg
    assert "LayerNorm.weight" not in msg and "LayerNorm.bias" not in msg  # names this file does not use


@pytest.mark.parametrize(
    "prefix, legacy",
    [("", False), ("bert.", False), ("module.", False), ("module.bert.", True), ("_orig_mod.bert.", True)],
)
def test_missing_tensor_named_in_the_files_layout(tmp_path, tiny_state, prefix, legacy):
    state = _in_layout(tiny_state, prefix, legacy)
    norm_bias = prefix + "encoder.layer.1.output.LayerNorm." + ("beta" if legacy else "bias")
    del state[norm_bias], state[prefix + "embeddings.word_embeddings.weight"]
    _write(tmp_path, state)
    with pytest.raises(CheckpointError, match=r"missing \(2\)") as err:
        BertModel.from_pretrained(tmp_path)
    msg = str(err.value)
    assert f"    {norm_bias} -> bert_layers.1.out_layer_norm.bias: expected (32,)" in msg
    assert f"    {prefix}embeddings.word_embeddings.weight -> word_embedding.weight: expected (99, 32)" in msg


def test_task_model_names_missing_encoder_tensor_in_a_bare_file(tmp_path, tiny_state):
    """A bare BertModel file loaded into the classifier: the missing tensor is named without
    `bert.` (as the file would hold it), the port's name with it (as the model holds it)."""
    from bert_port.classifier import BertForSequenceClassification

    state = dict(tiny_state)
    del state["encoder.layer.0.attention.self.query.bias"]
    _write(tmp_path, state)
    with pytest.raises(CheckpointError) as err:
        BertForSequenceClassification.from_pretrained(tmp_path)
    assert (
        "    encoder.layer.0.attention.self.query.bias -> bert.bert_layers.0.self_attention.query.bias: "
        "expected (32,)" in str(err.value)
    )


def test_non_finite_tensor_named_as_in_a_legacy_file(tmp_path, tiny_state):
    state = _in_layout(tiny_state, "bert.", legacy=True)
    state["bert.embeddings.LayerNorm.gamma"][3] = float("nan")
    _write(tmp_path, state)
    with pytest.raises(CheckpointError) as err:
        BertModel.from_pretrained(tmp_path)
    assert (
        "has non-finite weights: bert.embeddings.LayerNorm.gamma -> embed_layer_norm.weight "
        "(1 of 32 values NaN/Inf)" in str(err.value)
    )
    with pytest.warns(RuntimeWarning, match=r"non-finite weights: bert\.embeddings\.LayerNorm\.gamma -> "):
        BertModel.from_pretrained(tmp_path, check_finite="warn")


# -- hints from a command line name its flags ------------------------------------------------


@pytest.fixture
def minilm_with_nan(tmp_path, minilm_path) -> Path:
    """The bundled checkpoint with one NaN in the pooler bias (so only pooler_output sees it)."""
    from safetensors.torch import load_file

    state = load_file(str(minilm_path / "model.safetensors"))
    state["pooler.dense.bias"][5] = float("nan")
    directory = tmp_path / "nan"
    _write(directory, state, config=(minilm_path / "config.json").read_text())
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (minilm_path / name).is_file():
            (directory / name).write_bytes((minilm_path / name).read_bytes())
    return directory


def test_parity_cli_names_its_check_finite_flag(minilm_with_nan, capsys):
    import bert_port.cli.parity as parity_cli

    fast = ["--device", "cpu", "--dtype", "float32", "--max-length", "16", "--no-progress", "--no-adversarial"]
    assert parity_cli.main(fast + ["--checkpoint", str(minilm_with_nan)]) == 2
    err = capsys.readouterr().err
    assert "pooler.dense.bias -> pooler_dense.bias (1 of 384 values NaN/Inf)" in err
    assert err.rstrip().endswith("Pass --check-finite warn to load it anyway")
    assert "check_finite=" not in err  # the Python spelling means nothing on a command line

    with pytest.warns(RuntimeWarning, match=r"non-finite weights: pooler\.dense\.bias -> pooler_dense\.bias"):
        code = parity_cli.main(fast + ["--checkpoint", str(minilm_with_nan), "--check-finite", "warn"])
    out = capsys.readouterr().out
    assert code == 0, out  # loaded as asked; the NaN sits in the same place on both sides
    assert "PASS: 1 of 1" in out


def test_convert_cli_names_its_flags(minilm_with_nan, tmp_path, capsys):
    import bert_port.cli.convert as convert_cli

    assert convert_cli.main([str(minilm_with_nan), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "pooler.dense.bias -> pooler_dense.bias (1 of 384 values NaN/Inf)" in err
    assert "Pass --check-finite warn to load it anyway" in err and "check_finite=" not in err
    with pytest.warns(RuntimeWarning, match="non-finite weights"):
        assert convert_cli.main([str(minilm_with_nan), str(tmp_path / "out"), "--check-finite", "warn"]) == 0

    # A bare weights file without a config: the fix is the command's --config-file flag.
    (minilm_with_nan / "config.json").unlink()
    assert convert_cli.main([str(minilm_with_nan / "model.safetensors"), str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err
    assert "beside the weights or pass --config-file <path>" in err and "config_file=" not in err


def test_config_hint_without_a_flag_leaves_the_argument_out(minilm_with_nan, capsys):
    """bert-port-parity has no --config-file: its message gives only the fix that applies."""
    import bert_port.cli.parity as parity_cli

    (minilm_with_nan / "config.json").unlink()
    assert parity_cli.main(["--checkpoint", str(minilm_with_nan / "model.safetensors"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Put the model's config.json beside the weights" in err and "config_file" not in err
    with pytest.raises(CheckpointError, match=r"beside the weights or pass config_file=<path>$"):
        BertModel.from_pretrained(minilm_with_nan / "model.safetensors")  # from Python, the argument
