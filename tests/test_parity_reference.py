"""`bert-port-parity --reference-checkpoint`: transformers reads a known-good checkpoint while
the port reads `--checkpoint`. A faithful copy (converted, or in the legacy layout) passes; a
copy with one weight off by 1e-3 fails at the layer that holds it, though the default check,
where both sides read the same file, passes it; a copy whose config gives another LayerNorm eps
is compared and fails, naming the field; checkpoints of different shapes are refused. Inputs are short and float32 only, to keep the file fast on two cores."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import TINY, hf_model
from safetensors.torch import load_file, save_file

import bert_port.cli.convert as convert_cli
import bert_port.cli.parity as parity_cli

FAST = ["--device", "cpu", "--dtype", "float32", "--max-length", "16", "--batch-size", "16", "--no-progress"]
PERTURBED = "encoder.layer.3.output.dense.weight"


def _copy(minilm_path, directory, state):
    """A checkpoint directory with the bundled config and tokenizer and `state` as its weights."""
    directory.mkdir()
    for f in minilm_path.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copyfile(f, directory / f.name)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def perturbed(minilm_path, tmp_path_factory):
    """The bundled checkpoint with one weight matrix scaled by 1 + 1e-3."""
    state = load_file(str(minilm_path / "model.safetensors"))
    state[PERTURBED] = state[PERTURBED] * (1 + 1e-3)
    return _copy(minilm_path, tmp_path_factory.mktemp("perturbed") / "ckpt", state)


def _run(argv, tmp_path, capsys):
    out = tmp_path / "r.json"
    code = parity_cli.main(FAST + argv + ["--json", str(out)])
    captured = capsys.readouterr()
    report = json.loads(out.read_text()) if out.exists() else None
    return code, captured.out + captured.err, report


def test_converted_copy_passes_against_the_original(minilm_path, tmp_path, capsys):
    dst = tmp_path / "converted"
    assert convert_cli.main([str(minilm_path), str(dst)]) == 0
    code, text, report = _run(["--checkpoint", str(dst), "--reference-checkpoint", str(minilm_path)], tmp_path, capsys)
    assert code == 0, text
    meta = report["meta"]
    assert meta["checkpoint"] == f"{dst} (model.safetensors), read by the port"
    assert meta["reference_checkpoint"].startswith(f"{minilm_path} (model.safetensors), read by transformers")
    assert f"from_pretrained read {minilm_path / 'model.safetensors'} itself" in meta["reference"]


def test_legacy_layout_copy_passes_against_the_original(minilm_path, tmp_path, capsys):
    """The port reads `bert.`-prefixed gamma/beta names; transformers reads the original: this
    checks the key mapping against a file transformers never saw in that layout."""
    state = {
        "bert." + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
        for k, v in load_file(str(minilm_path / "model.safetensors")).items()
    }
    legacy = _copy(minilm_path, tmp_path / "legacy", state)
    code, text, _ = _run(["--checkpoint", str(legacy), "--reference-checkpoint", str(minilm_path)], tmp_path, capsys)
    assert code == 0, text


@pytest.mark.parametrize("side", ["checkpoint", "reference"])
def test_perturbed_weight_fails_at_its_layer(minilm_path, perturbed, tmp_path, capsys, side):
    pair = [str(perturbed), str(minilm_path)] if side == "checkpoint" else [str(minilm_path), str(perturbed)]
    code, text, report = _run(["--checkpoint", pair[0], "--reference-checkpoint", pair[1]], tmp_path, capsys)
    assert code == 1, text
    assert "first failing site: layer 3" in text
    row = report["rows"][0]
    assert row["first_failing_site"] == "layer 3"
    sites = {s["name"]: s for s in row["sites"]}
    for earlier in ["embeddings", "layer 0", "layer 1", "layer 2"]:
        assert sites[earlier]["passed"], earlier


def test_default_check_cannot_see_wrong_weights(perturbed, minilm_path, tmp_path, capsys):
    """Without a reference both sides read the perturbed file, so they agree: this is what
    --reference-checkpoint is for."""
    code, text, report = _run(["--checkpoint", str(perturbed)], tmp_path, capsys)
    assert code == 0, text
    assert report["meta"]["checkpoint"].endswith("read by both the port and transformers")
    assert "reference_checkpoint" not in report["meta"]


def test_reference_transformers_cannot_read_gets_its_own_weights(minilm_path, perturbed, tmp_path, capsys):
    """A reference in the DDP `module.` layout is read by the port's loader and handed to
    transformers; the weights must be the reference's, not --checkpoint's."""
    state = {f"module.{k}": v for k, v in load_file(str(perturbed / "model.safetensors")).items()}
    ddp = _copy(minilm_path, tmp_path / "ddp", state)
    code, text, report = _run(["--checkpoint", str(minilm_path), "--reference-checkpoint", str(ddp)], tmp_path, capsys)
    assert code == 1, text
    assert f"the weights of {ddp / 'model.safetensors'} as the port's loader reads them" in report["meta"]["reference"]
    assert report["rows"][0]["first_failing_site"] == "layer 3"


def test_architecture_mismatch_exits_2(minilm_path, tmp_path, capsys):
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps(TINY))
    save_file({k: v.contiguous() for k, v in hf_model(TINY).state_dict().items()}, str(tiny / "model.safetensors"))
    code, text, report = _run(["--checkpoint", str(minilm_path), "--reference-checkpoint", str(tiny)], tmp_path, capsys)
    assert code == 2 and report is None
    assert "describe different architectures" in text
    for difference in [
        "vocab_size 30522 vs 99",
        "hidden_size 384 vs 32",
        "num_hidden_layers 6 vs 2",
        "num_attention_heads 12 vs 4",
        "intermediate_size 1536 vs 37",
        "max_position_embeddings 512 vs 64",
    ]:
        assert difference in text, difference
    assert "type_vocab_size" not in text  # equal fields are not listed


def test_other_config_fields_are_compared_and_named(minilm_path, tmp_path, capsys):
    """A wrong eps is the conversion bug this check is for: the run goes ahead, fails at the
    first site (the embeddings' LayerNorm), and lists the field as the likely cause."""
    state = load_file(str(minilm_path / "model.safetensors"))
    bad_eps = _copy(minilm_path, tmp_path / "eps", state)
    config = json.loads((bad_eps / "config.json").read_text())
    (bad_eps / "config.json").write_text(json.dumps({**config, "layer_norm_eps": 1e-6}))
    code, text, report = _run(
        ["--checkpoint", str(bad_eps), "--reference-checkpoint", str(minilm_path)], tmp_path, capsys
    )
    assert code == 1, text
    assert report["rows"][0]["first_failing_site"] == "embeddings"
    assert (
        report["meta"]["config_differences"] == "layer_norm_eps 1e-06 vs 1e-12 (--checkpoint vs --reference-checkpoint)"
    )
    assert "likely causes: the two checkpoints' configs differ in layer_norm_eps 1e-06 vs 1e-12" in text


def test_unreadable_reference_exits_2(minilm_path, tmp_path, capsys):
    code, text, _ = _run(["--reference-checkpoint", str(tmp_path / "nowhere")], tmp_path, capsys)
    assert code == 2
    assert f"cannot load reference checkpoint {tmp_path / 'nowhere'}" in text and "the path does not exist" in text


@pytest.mark.parametrize("form", ["weights-file", "model-id"])
def test_reference_in_any_form_checkpoint_accepts(minilm_path, perturbed, tmp_path, capsys, monkeypatch, form):
    """A weights file under another name, or a model id in the local HF cache: transformers
    reads that reference (the perturbed one), so the run fails at layer 3."""
    if form == "weights-file":
        (tmp_path / "config.json").write_text((perturbed / "config.json").read_text())
        shutil.copyfile(perturbed / "model.safetensors", tmp_path / "step-100.safetensors")
        reference = str(tmp_path / "step-100.safetensors")
    else:
        snapshot = tmp_path / "hub" / "models--org--suspect" / "snapshots" / "abc123"
        snapshot.mkdir(parents=True)
        (snapshot.parent.parent / "refs").mkdir()
        (snapshot.parent.parent / "refs" / "main").write_text("abc123")
        for f in perturbed.iterdir():
            (snapshot / f.name).symlink_to(f)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        reference = "org/suspect"
    code, text, report = _run(["--reference-checkpoint", reference], tmp_path, capsys)
    assert code == 1, text
    assert report["rows"][0]["first_failing_site"] == "layer 3"
    assert report["meta"]["reference_checkpoint"].startswith(reference)
    assert "from_pretrained read" in report["meta"]["reference"]


def test_reference_without_pooler_asks_to_swap(minilm_path, tmp_path, capsys):
    state = {k: v for k, v in load_file(str(minilm_path / "model.safetensors")).items() if not k.startswith("pooler.")}
    bare = _copy(minilm_path, tmp_path / "bare", state)
    code, text, _ = _run(["--reference-checkpoint", str(bare)], tmp_path, capsys)
    assert code == 2 and "has no pooler" in text and "Swap the two" in text
    code, text, report = _run(["--checkpoint", str(bare), "--reference-checkpoint", str(minilm_path)], tmp_path, capsys)
    assert code == 0, text
    assert "pooler_output" not in [s["name"] for s in report["rows"][0]["sites"]]
