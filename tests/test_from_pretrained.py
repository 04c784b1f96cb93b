"""transformers' call patterns and fine-tuning conveniences, each against transformers in
the same run: from_pretrained keywords (torch_dtype, dtype="auto", device_map, config
overrides, unknown keywords refused and never written to config.json), return_dict and
use_cache in forward, gradient checkpointing, resize_token_embeddings."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import EXACT, TINY, TOL, hf_model, random_batch

from bert_port import BertForMaskedLM, BertForSequenceClassification, BertModel


@pytest.fixture
def tiny_fp16(tmp_path):
    """A tiny transformers checkpoint saved in float16."""
    hf = hf_model(TINY).to(torch.float16)
    hf.save_pretrained(tmp_path / "fp16")
    return tmp_path / "fp16"


def test_torch_dtype_and_auto(tiny_fp16, minilm_path):
    import transformers

    assert BertModel.from_pretrained(minilm_path, torch_dtype=torch.float16).dtype == torch.float16
    assert BertModel.from_pretrained(minilm_path, torch_dtype="bfloat16").dtype == torch.bfloat16
    reference = transformers.BertModel.from_pretrained(str(tiny_fp16), dtype="auto")
    for kwargs in ({"dtype": "auto"}, {"torch_dtype": "auto"}, {}):
        assert BertModel.from_pretrained(tiny_fp16, **kwargs).dtype == reference.dtype == torch.float16
    with pytest.raises(ValueError, match="disagree"):
        BertModel.from_pretrained(minilm_path, dtype=torch.float32, torch_dtype=torch.float16)


def test_device_map_as_one_device(minilm_path):
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    for device_map in ("cpu", {"": "cpu"}, torch.device("cpu"), "auto"):
        model = BertModel.from_pretrained(minilm_path, device_map=device_map)
        expected = accelerator.type if device_map == "auto" and accelerator is not None else "cpu"
        assert model.device.type == expected
    with pytest.raises(ValueError, match="several devices"):
        BertModel.from_pretrained(minilm_path, device_map={"embeddings": "cpu", "encoder": "cuda:0"})
    with pytest.raises(ValueError, match="disagree"):
        BertModel.from_pretrained(minilm_path, device="cpu", device_map="meta")


def test_config_overrides_and_unknown_keywords(tmp_path, minilm_path):
    import transformers

    model = BertForSequenceClassification.from_pretrained(minilm_path, num_labels=3, hidden_dropout_prob=0.2)
    reference = transformers.BertForSequenceClassification.from_pretrained(
        str(minilm_path), num_labels=3, hidden_dropout_prob=0.2
    )
    assert model.config.num_labels == reference.config.num_labels == 3
    assert model.config.hidden_dropout_prob == reference.config.hidden_dropout_prob == 0.2
    # A field the checkpoint's config.json has, though BertConfig does not model it.
    assert BertModel.from_pretrained(minilm_path, gradient_checkpointing=True).config.extra["gradient_checkpointing"]

    with pytest.raises(TypeError, match="'no_such_option'"):
        BertModel.from_pretrained(minilm_path, no_such_option=3)
    with pytest.raises(TypeError, match="'no_such_option'"):
        transformers.BertModel.from_pretrained(str(minilm_path), no_such_option=3)

    # Runtime choices are never written to config.json; real overrides are, as transformers does.
    model = BertModel.from_pretrained(
        minilm_path, attn_implementation="eager", optimize=False, torch_dtype="float32", device_map="cpu"
    )
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert not {"attn_implementation", "unpad_inputs", "device_map", "torch_dtype", "no_such_option"} & set(saved)


def test_transformers_loader_keywords(minilm_path):
    """transformers' usual loader keywords: `local_files_only` is taken (every load is local),
    those the port does not support say so and why, not "check the spelling"; a
    SentenceEncoder's errors name SentenceEncoder."""
    import transformers

    from bert_port import SentenceEncoder
    from bert_port.loader_arguments import UNSUPPORTED_LOADER_ARGUMENTS

    ours = BertModel.from_pretrained(minilm_path, local_files_only=True, **EXACT)
    reference = transformers.BertModel.from_pretrained(
        str(minilm_path), local_files_only=True, attn_implementation="eager"
    ).eval()
    batch = random_batch(ours.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(**batch)[0], reference(**batch)[0], **TOL[torch.float32])
    for name, value in [("token", "hf_x"), ("trust_remote_code", True), ("low_cpu_mem_usage", True)]:
        with pytest.raises(TypeError) as err:
            BertModel.from_pretrained(minilm_path, **{name: value})
        message = str(err.value)
        assert f"BertModel.from_pretrained() does not support {name}=: " in message
        assert UNSUPPORTED_LOADER_ARGUMENTS[name] in message and "spelling" not in message
    for kwargs in ({"force_download": True}, {"no_such_option": 3}):
        with pytest.raises(TypeError) as err:
            SentenceEncoder.from_pretrained(minilm_path, **kwargs)
        assert str(err.value).startswith("SentenceEncoder.from_pretrained() ") and "BertModel" not in str(err.value)
    assert "normalize" in str(err.value)  # the arguments it lists are SentenceEncoder's too


def test_return_dict_false_and_use_cache(tmp_path):
    hf = hf_model(TINY)
    hf.save_pretrained(tmp_path)
    ours = BertModel.from_pretrained(tmp_path, **EXACT)
    batch = random_batch(TINY["vocab_size"])
    with torch.no_grad():
        actual = ours(**batch, return_dict=False, use_cache=False)
        expected = hf(**batch, return_dict=False, use_cache=False)
        with_hidden = ours(**batch, return_dict=False, output_hidden_states=True)
        hf_hidden = hf(**batch, return_dict=False, output_hidden_states=True)
    assert isinstance(actual, tuple) and len(actual) == len(expected) == 2
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))
    assert len(with_hidden) == len(hf_hidden) == 3 and len(with_hidden[2]) == len(hf_hidden[2])
    assert all(torch.equal(a, e) for a, e in zip(with_hidden[2], hf_hidden[2]))

    # The classifier's tuple is transformers' tuple: (loss, logits[, hidden_states]), value for value.
    hf_classifier = hf_model(TINY, "BertForSequenceClassification")
    hf_classifier.save_pretrained(tmp_path / "classifier")
    classifier = BertForSequenceClassification.from_pretrained(tmp_path / "classifier", **EXACT)
    labels = torch.tensor([0, 1, 0])
    for kwargs in ({"labels": labels}, {}, {"labels": labels, "output_hidden_states": True}):
        with torch.no_grad():
            out = classifier(**batch, **kwargs, return_dict=False)
            reference = hf_classifier(**batch, **kwargs, return_dict=False)
        assert isinstance(out, tuple) and len(out) == len(reference), kwargs
        for a, e in zip(out, reference):
            if isinstance(e, tuple):
                assert len(a) == len(e) and all(torch.equal(x, y) for x, y in zip(a, e))
            else:
                assert torch.equal(a, e), kwargs


def _grads(model, batch, seed=0) -> dict[str, torch.Tensor]:
    model.zero_grad()
    torch.manual_seed(seed)
    out = model(**batch)
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
    (hidden * batch["attention_mask"][..., None]).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("exact", [True, False])
def test_gradient_checkpointing_gives_the_same_gradients(tmp_path, exact):
    hf = hf_model(TINY)
    hf.save_pretrained(tmp_path)
    ours = BertModel.from_pretrained(tmp_path, **(EXACT if exact else {})).train()  # dropout on
    batch = random_batch(TINY["vocab_size"])
    plain = _grads(ours, batch)
    ours.gradient_checkpointing_enable()
    assert ours.is_gradient_checkpointing
    checkpointed = _grads(ours, batch)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        assert torch.equal(plain[name], checkpointed[name]), name
    ours.gradient_checkpointing_disable()
    assert not ours.is_gradient_checkpointing
    with pytest.raises(ValueError, match="use_reentrant"):
        ours.gradient_checkpointing_enable({"use_reentrant": True})


def test_gradient_checkpointing_matches_transformers(tmp_path):
    """Without dropout (whose random masks the two libraries draw differently), checkpointed
    gradients equal transformers' checkpointed gradients, bit for bit in exact mode."""
    from bert_port import checkpoint

    config = dict(TINY, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    hf = hf_model(config)
    hf.save_pretrained(tmp_path)
    ours = BertModel.from_pretrained(tmp_path, **EXACT).train()
    ours.gradient_checkpointing_enable()
    hf.train().activation_checkpointing_enable()
    batch = random_batch(TINY["vocab_size"])
    actual = _grads(ours, batch)
    expected = {checkpoint.hf_to_port({k: v}).state_dict.popitem()[0]: v for k, v in _grads(hf, batch).items()}
    assert actual.keys() == expected.keys()
    for name in actual:
        assert torch.equal(actual[name], expected[name]), name


def test_resize_token_embeddings_as_transformers(tmp_path):
    import transformers

    hf = hf_model(TINY, "BertForMaskedLM")
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    hf.save_pretrained(tmp_path / "src")
    ours = BertForMaskedLM.from_pretrained(tmp_path / "src", **EXACT)
    old = ours.get_input_embeddings().weight.detach().clone()
    old_bias = ours.cls.predictions.bias.detach().clone()

    returned = ours.resize_token_embeddings(120)
    hf.resize_token_embeddings(120)
    assert returned is ours.get_input_embeddings() and returned.num_embeddings == 120
    assert ours.config.vocab_size == hf.config.vocab_size == 120
    ours_w, hf_w = ours.get_input_embeddings().weight.detach(), hf.get_input_embeddings().weight.detach()
    assert torch.equal(ours_w[:99], hf_w[:99]) and torch.equal(ours_w[:99], old)
    # New rows: the old rows' mean; transformers draws them around that mean with covariance
    # 1e-9 times the old rows', so it is within a few of those standard deviations of ours.
    assert torch.equal(ours_w[99:], old.mean(0).expand(21, -1))
    spread = (1e-9 * old.var(0, correction=0)).sqrt()
    assert ((hf_w[99:] - ours_w[99:]).abs() <= 8 * spread + 1e-7).all()
    # The tied decoder and its bias follow.
    assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
    assert ours.cls.predictions.decoder.bias is ours.cls.predictions.bias
    assert torch.equal(ours.cls.predictions.bias[:99], old_bias)
    assert torch.equal(ours.cls.predictions.bias[99:], hf.cls.predictions.bias[99:].detach())  # zeros

    batch = random_batch(99)  # old tokens: the new rows differ by transformers' noise
    with torch.no_grad():
        torch.testing.assert_close(ours(**batch).logits[..., :99], hf(**batch).logits[..., :99], **TOL[torch.float32])
    ours.save_pretrained(tmp_path / "resized")
    back, info = transformers.BertForMaskedLM.from_pretrained(str(tmp_path / "resized"), output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {} and back.config.vocab_size == 120

    # Shrinking keeps the first rows; pad_to_multiple_of rounds up, as in transformers.
    ours.resize_token_embeddings(90)
    hf.resize_token_embeddings(90)
    assert torch.equal(ours.get_input_embeddings().weight, hf.get_input_embeddings().weight)
    assert ours.resize_token_embeddings(100, pad_to_multiple_of=64).num_embeddings == 128
    assert hf.resize_token_embeddings(100, pad_to_multiple_of=64).num_embeddings == 128
    with pytest.raises(ValueError, match="new_num_tokens must be a positive integer"):
        ours.resize_token_embeddings(0)


def test_loading_does_not_import_the_write_side():
    """Loading never writes, by construction: `loading`, `loader_arguments` and the checkpoint
    package's read side (`reading`, `finite`, `locate`) import neither `saving` nor any of the
    write side (`storage.staging`, `checkpoint.shards`: staged writes, the exclusive lock, repair)."""
    import ast
    import inspect

    from bert_port import loader_arguments, loading
    from bert_port.checkpoint import finite, locate, reading

    write_side = {"saving", "StagedWrite", "stage_weights", "write_weights", "atomic_write", "DirectoryLock", "tidy"}
    write_side |= {"staging", "shards", "repair", "recover", "files"}
    for module in (loading, loader_arguments, reading, finite, locate):
        tree = ast.parse(inspect.getsource(module))
        names = {
            alias.name.rsplit(".", 1)[-1]
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom | ast.Import)
            for alias in n.names
        }
        names |= {n.module.rsplit(".", 1)[-1] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not names & write_side, (module.__name__, names & write_side)


def test_convert_loads_and_saves_through_the_library(tmp_path, monkeypatch):
    """bert-port-convert builds, loads and saves with the same functions as from_pretrained
    and save_pretrained, so the two cannot drift apart."""
    from bert_port import loading, saving
    from bert_port.cli.convert import main as convert_main

    hf_model(TINY).save_pretrained(tmp_path / "src")
    calls = []
    for module, name in ((loading, "build_and_load"), (loading, "load_hf_state_dict"), (saving, "save_pretrained")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    assert convert_main([str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    assert calls == ["build_and_load", "load_hf_state_dict", "save_pretrained"]
