"""The bad-input catalogue (docs/loading.md, "Bad input"): every case raises a clear error of the
documented type, and nothing is half-loaded or half-written."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from conftest import TINY, hf_model, random_batch

from bert_port import BertConfig, BertModel, CheckpointError, ConfigError
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


# -- files ----------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [0, 5, 100, -1000], ids=["empty", "inside-length", "inside-header", "inside-data"])
def test_truncated_safetensors(tmp_path, tiny_state, cut):
    path = _write(tmp_path, tiny_state) / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as err:
        BertModel.from_pretrained(tmp_path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("damage", ["json", "length"], ids=["invalid-json", "huge-length"])
def test_corrupt_safetensors_header(tmp_path, tiny_state, damage):
    path = _write(tmp_path, tiny_state) / "model.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "json":
        data[8:16] = b"{garbage"
    else:
        data[:8] = (10**12).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="not a readable safetensors file") as err:
        BertModel.from_pretrained(tmp_path)
    assert "header" in str(err.value)


def test_truncated_pytorch_bin(tmp_path, tiny_state):
    path = _write(tmp_path, tiny_state, fmt="bin") / "pytorch_model.bin"
    path.write_bytes(path.read_bytes()[:3000])
    with pytest.raises(CheckpointError, match="not a readable PyTorch checkpoint.*truncated or corrupt"):
        BertModel.from_pretrained(tmp_path)


def test_sharded_index_naming_a_missing_shard(tmp_path, tiny_state):
    _write(tmp_path, tiny_state, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    with pytest.raises(CheckpointError, match="names 1 shard file") as err:
        BertModel.from_pretrained(tmp_path)
    assert shards[1].name in str(err.value) and "fetch the missing shards" in str(err.value)


@pytest.mark.parametrize(
    "index, message",
    [
        ("{not json", "not a valid shard index"),
        ('{"metadata": {}}', "not a valid shard index"),
        ('{"weight_map": {"a": "../elsewhere/model.safetensors"}}', "outside its directory"),
    ],
    ids=["not-json", "no-weight-map", "path-escape"],
)
def test_broken_shard_index(tmp_path, tiny_state, index, message):
    _write(tmp_path, tiny_state, max_shard_size="20KB")
    (tmp_path / ckpt.SAFE_INDEX).write_text(index)
    with pytest.raises(CheckpointError, match=message):
        BertModel.from_pretrained(tmp_path)


def test_index_listing_tensors_its_shards_lack(tmp_path, tiny_state):
    _write(tmp_path, tiny_state, max_shard_size="20KB")
    index = json.loads((tmp_path / ckpt.SAFE_INDEX).read_text())
    index["weight_map"]["encoder.layer.9.output.dense.bias"] = next(iter(index["weight_map"].values()))
    (tmp_path / ckpt.SAFE_INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="lists 1 tensor.*encoder.layer.9.output.dense.bias"):
        BertModel.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "config, message",
    [
        ('{"vocab_size": 99, "hidden_size": 32,', "is not valid JSON"),
        ("", "is not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({k: v for k, v in TINY.items() if k not in ("hidden_size", "vocab_size")}, "missing required field"),
        ({**TINY, "hidden_size": "32"}, "hidden_size must be a positive integer"),
        ({**TINY, "id2label": ["a", "b"]}, "id2label must be a JSON object"),
    ],
    ids=["truncated-json", "empty", "not-an-object", "missing-fields", "wrong-type", "bad-id2label"],
)
def test_bad_config_json(tmp_path, tiny_state, config, message):
    _write(tmp_path, tiny_state, config=config)
    with pytest.raises(ConfigError, match=message) as err:
        BertModel.from_pretrained(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)
    if message == "missing required field":
        assert "hidden_size" in str(err.value) and "vocab_size" in str(err.value)


def test_missing_config_and_missing_weights(tmp_path, tiny_state):
    _write(tmp_path, tiny_state)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config for checkpoint"):
        BertModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="holds no weights"):
        BertModel.from_pretrained(tmp_path)


# -- pickles that run code --------------------------------------------------------------


class _Payload:
    """Unpickling this calls exec(), which writes the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("container", ["torch-zip", "plain-pickle", "in-shard"])
def test_pickle_that_runs_code_is_refused(tmp_path, tiny_state, container):
    marker = tmp_path / "marker"
    state = {"embeddings.payload": _Payload(marker), **tiny_state}  # first, so it is what gets refused
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(TINY))
    if container == "torch-zip":
        torch.save(state, directory / "pytorch_model.bin")
    elif container == "plain-pickle":
        with open(directory / "pytorch_model.bin", "wb") as f:
            pickle.dump(state, f, protocol=2)  # a protocol the weights-only unpickler reads
    else:  # a .bin shard behind a pytorch_model.bin.index.json
        torch.save(tiny_state, directory / "pytorch_model-00001-of-00002.bin")
        torch.save({"embeddings.payload": _Payload(marker)}, directory / "pytorch_model-00002-of-00002.bin")
        weight_map = dict.fromkeys(tiny_state, "pytorch_model-00001-of-00002.bin")
        weight_map["embeddings.payload"] = "pytorch_model-00002-of-00002.bin"
        (directory / ckpt.PT_INDEX).write_text(json.dumps({"weight_map": weight_map}))

    with pytest.raises(CheckpointError, match="refused to load") as err:
        BertModel.from_pretrained(directory)
    assert "(it calls exec)" in str(err.value) and "Nothing in it was executed" in str(err.value)
    assert "add_safe_globals" not in str(err.value)  # torch's allowlisting advice is not passed on
    assert not marker.exists()

    # The payload is live: an unsafe load does run it. This proves the refusal mattered.
    live = directory / ("pytorch_model.bin" if container != "in-shard" else "pytorch_model-00002-of-00002.bin")
    if container == "plain-pickle":
        with open(live, "rb") as f:
            pickle.load(f)
    else:
        torch.load(live, weights_only=False)
    assert marker.read_text() == "code ran"


def test_pickle_that_is_not_a_state_dict(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    torch.save({"model": {"w": torch.zeros(2)}, "epoch": 3}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="not hold a flat state dict.*'epoch', 'model'"):
        BertModel.from_pretrained(tmp_path)


# -- checkpoint vs config -----------------------------------------------------------------


def test_config_disagrees_with_tensors(tmp_path, tiny_state):
    _write(tmp_path, tiny_state, config={**TINY, "hidden_size": 64, "intermediate_size": 37})
    with pytest.raises(CheckpointError) as err:
        BertModel.from_pretrained(tmp_path)
    msg = str(err.value)
    assert "wrong shape" in msg and "word_embedding.weight: checkpoint (99, 32), model (99, 64)" in msg
    assert "hidden_size" in msg and "Nothing was loaded" in msg

    _write(tmp_path, tiny_state, config={**TINY, "num_hidden_layers": 3})
    with pytest.raises(CheckpointError, match=r"num_hidden_layers=3, but the checkpoint has tensors for layers 0, 1"):
        BertModel.from_pretrained(tmp_path)


def test_failed_load_leaves_the_model_untouched(tiny_state):
    model = BertModel(BertConfig(**TINY))
    before = _port_state(model)
    bad_shape = {**tiny_state, "pooler.dense.weight": torch.zeros(5, 5)}
    with pytest.raises(CheckpointError, match="wrong shape"):
        model.load_hf_state_dict(bad_shape)
    _assert_unchanged(model, before)
    nan = {**tiny_state, "pooler.dense.weight": torch.full((32, 32), float("nan"))}
    with pytest.raises(CheckpointError, match="non-finite"):
        model.load_hf_state_dict(nan)
    _assert_unchanged(model, before)


# -- NaN / Inf ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_weights(tmp_path, tiny_state, value):
    state = dict(tiny_state)
    bad = state["encoder.layer.1.attention.self.key.weight"].clone()
    bad[3, 4] = value
    bad[7, 0] = value
    state["encoder.layer.1.attention.self.key.weight"] = bad
    _write(tmp_path, state)

    with pytest.raises(CheckpointError, match="non-finite") as err:
        BertModel.from_pretrained(tmp_path)  # default: error
    # Named as in the file first, then the port's name.
    named = "encoder.layer.1.attention.self.key.weight -> bert_layers.1.self_attention.key.weight (2 of 1024 values"
    assert named in str(err.value)
    assert str(err.value).endswith("Pass check_finite='warn' to load it anyway")

    with pytest.warns(RuntimeWarning, match=r"non-finite weights: encoder\.layer\.1\.attention\.self\.key\.weight"):
        model = BertModel.from_pretrained(tmp_path, check_finite="warn")
    loaded = model.bert_layers[1].self_attention.key.weight
    assert torch.equal(torch.isfinite(loaded), torch.isfinite(bad))  # loaded as it is, as asked

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BertModel.from_pretrained(tmp_path, check_finite="ignore")

    with pytest.raises(ValueError, match="check_finite must be one of"):
        BertModel.from_pretrained(tmp_path, check_finite="loud")


def test_non_finite_half_precision(tmp_path, tiny_state):
    state = {k: v.to(torch.bfloat16) for k, v in tiny_state.items() if v.is_floating_point()}
    state["embeddings.LayerNorm.weight"][5] = float("inf")
    _write(tmp_path, state)
    named = r"embeddings\.LayerNorm\.weight -> embed_layer_norm\.weight \(1 of 32 values"
    with pytest.raises(CheckpointError, match=named):
        BertModel.from_pretrained(tmp_path)


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
