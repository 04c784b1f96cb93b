"""`BertLMHeadModel` and `tie_word_embeddings=False` against transformers in the same run.

The causal LM loads transformers' `BertLMHeadModel` checkpoints with nothing missing or
unexpected, gives its logits and shifted next-token loss bit for bit in exact mode (within
the fp32 policy otherwise), and saves files transformers loads back. With
`tie_word_embeddings=False` every MLM head (BertForMaskedLM, BertForPreTraining,
BertLMHeadModel) keeps a decoder of its own, as transformers 5 does: loaded from the file (not
the embeddings), saved beside them, resized on its own."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import EXACT, TINY, TOL, hf_model, random_batch
from safetensors.torch import load_file

from bert_port import BertConfig, BertForMaskedLM, BertForPreTraining, BertLMHeadModel, CheckpointError

pytestmark = pytest.mark.usefixtures("single_thread")

DECODER = dict(TINY, is_decoder=True)
MLM_HEADS = {
    "BertForMaskedLM": (BertForMaskedLM, TINY),
    "BertForPreTraining": (BertForPreTraining, TINY),
    "BertLMHeadModel": (BertLMHeadModel, DECODER),
}


def _reference(name: str, config: dict):
    """transformers' model with every parameter random (its init leaves biases at zero)."""
    hf = hf_model(config, name)
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return hf


def _lm_labels(batch: dict) -> torch.Tensor:
    return batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)


def _outputs(model, batch: dict, **kwargs) -> tuple:
    with torch.no_grad():
        return model(**batch, **kwargs, return_dict=False)


def test_lm_head_loads_transformers_checkpoint_and_matches(tmp_path):
    hf = _reference("BertLMHeadModel", DECODER)
    hf.save_pretrained(tmp_path / "hf")
    batch = random_batch(TINY["vocab_size"])
    labels = _lm_labels(batch)
    expected = _outputs(hf, batch, labels=labels)  # (loss, logits); labels turn its cache off

    exact = BertLMHeadModel.from_pretrained(tmp_path / "hf", **EXACT)
    info = exact.loading_info
    assert info["newly_initialized"] == [] and info["dropped"] == [] and info["unused"] == []
    actual = _outputs(exact, batch, labels=labels)
    assert len(actual) == len(expected) == 2
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))
    assert exact.get_output_embeddings().weight is exact.get_input_embeddings().weight

    default = BertLMHeadModel.from_pretrained(tmp_path / "hf")  # sdpa on the padded batch
    for a, e in zip(_outputs(default, batch, labels=labels), expected):
        torch.testing.assert_close(a, e, **TOL[torch.float32])

    exact.save_pretrained(tmp_path / "ours")
    back, loaded = type(hf).from_pretrained(str(tmp_path / "ours"), output_loading_info=True)
    assert {k: v for k, v in loaded.items() if v} == {}
    back.set_attn_implementation("eager")
    assert all(torch.equal(a, e) for a, e in zip(_outputs(back.eval(), batch, labels=labels), expected))
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["architectures"] == ["BertLMHeadModel"] and config["is_decoder"] is True


def test_causal_loss_scores_each_position_against_the_next_label():
    """The loss is the cross-entropy of the logits at t against labels[t + 1], -100 left out;
    the last position predicts nothing. Checked against that definition computed directly."""
    model = BertLMHeadModel(BertConfig.from_dict(DECODER)).eval()
    batch = random_batch(TINY["vocab_size"])
    labels = _lm_labels(batch)
    with torch.no_grad():
        out = model(**batch, labels=labels)
    logits, target = out.logits[:, :-1], labels[:, 1:]
    keep = target != -100
    expected = torch.nn.functional.cross_entropy(logits[keep], target[keep])
    torch.testing.assert_close(out.loss, expected, **TOL[torch.float32])
    with torch.no_grad():
        last_only = model(**batch, logits_to_keep=1).logits
    assert last_only.shape == (3, 1, TINY["vocab_size"])  # the head's GEMM on 3 rows, not 27: within the policy
    torch.testing.assert_close(last_only, out.logits[:, -1:], **TOL[torch.float32])


def _untied_checkpoint(name: str, directory) -> torch.nn.Module:
    """transformers' `name` with tie_word_embeddings=False and random weights everywhere (the
    decoder's weight and bias differ from the embedding and from cls.predictions.bias), saved."""
    hf = _reference(name, dict(MLM_HEADS[name][1], tie_word_embeddings=False))
    predictions = hf.cls.predictions
    assert predictions.decoder.weight is not hf.bert.embeddings.word_embeddings.weight
    assert predictions.decoder.bias is not predictions.bias
    hf.save_pretrained(directory)
    return hf


def _head_inputs(name: str) -> tuple[dict, dict]:
    batch = random_batch(TINY["vocab_size"])
    labels = {"labels": _lm_labels(batch)}
    if name == "BertForPreTraining":
        labels["next_sentence_label"] = torch.tensor([0, 1, 1])
    return batch, labels


@pytest.mark.parametrize("name", list(MLM_HEADS))
def test_untied_head_loads_its_own_decoder_and_saves_it(tmp_path, name):
    hf = _untied_checkpoint(name, tmp_path / "hf")
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias", "cls.predictions.bias"} <= set(saved)
    batch, labels = _head_inputs(name)
    expected = _outputs(hf, batch, **labels)

    ours = MLM_HEADS[name][0].from_pretrained(tmp_path / "hf", **EXACT)
    assert ours.config.tie_word_embeddings is False and ours.loading_info["newly_initialized"] == []
    decoder = ours.cls.predictions.decoder
    assert decoder.weight is not ours.get_input_embeddings().weight
    assert torch.equal(decoder.weight, saved["cls.predictions.decoder.weight"])
    assert torch.equal(decoder.bias, saved["cls.predictions.decoder.bias"])
    assert torch.equal(ours.cls.predictions.bias, saved["cls.predictions.bias"])
    assert all(torch.equal(a, e) for a, e in zip(_outputs(ours, batch, **labels), expected))

    ours.save_pretrained(tmp_path / "ours")
    written = load_file(tmp_path / "ours" / "model.safetensors")
    for key in ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias", "cls.predictions.bias"):
        assert torch.equal(written[key], saved[key]), key
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["tie_word_embeddings"] is False
    back, info = type(hf).from_pretrained(str(tmp_path / "ours"), output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    back.set_attn_implementation("eager")
    assert all(torch.equal(a, e) for a, e in zip(_outputs(back.eval(), batch, **labels), expected))


@pytest.mark.parametrize("name", list(MLM_HEADS))
def test_untied_resize_resizes_embedding_and_decoder_each_as_transformers(tmp_path, name):
    """Each keeps its old rows; new decoder rows and bias entries are the old ones' mean, where
    transformers draws them around that mean with a spread of 1e-9 of the old ones'. The saved
    model reloads in transformers with nothing missing (transformers' own resized untied model
    aliases cls.predictions.bias to the decoder's bias and then saves only one of them)."""
    import transformers

    hf = _untied_checkpoint(name, tmp_path / "hf")
    ours = MLM_HEADS[name][0].from_pretrained(tmp_path / "hf", **EXACT)
    old_weight = ours.cls.predictions.decoder.weight.detach().clone()
    old_bias = ours.cls.predictions.decoder.bias.detach().clone()
    ours.resize_token_embeddings(120)
    hf.resize_token_embeddings(120)

    embedding, decoder = ours.get_input_embeddings(), ours.get_output_embeddings()
    assert embedding.weight is not decoder.weight and ours.config.vocab_size == 120
    assert decoder.weight.shape == (120, TINY["hidden_size"]) and decoder.out_features == 120
    assert ours.cls.predictions.bias.shape == decoder.bias.shape == (120,)
    hf_decoder = hf.get_output_embeddings()
    assert torch.equal(decoder.weight[:99], old_weight) and torch.equal(hf_decoder.weight[:99].detach(), old_weight)
    assert torch.equal(decoder.bias[:99], old_bias)
    assert torch.equal(decoder.weight[99:], old_weight.mean(0).expand(21, -1))
    spread = (1e-9 * old_weight.var(0, correction=0)).sqrt()
    assert ((hf_decoder.weight[99:].detach() - decoder.weight[99:]).abs() <= 8 * spread + 1e-7).all()
    torch.testing.assert_close(decoder.bias[99:], hf_decoder.bias[99:].detach(), atol=1e-7, rtol=0)
    assert torch.equal(embedding.weight[:99], hf.get_input_embeddings().weight[:99].detach())

    batch, _ = _head_inputs(name)  # the old tokens' logits: the new rows differ by transformers' noise
    for a, e in zip(_outputs(ours, batch), _outputs(hf, batch)):
        torch.testing.assert_close(a[..., :99], e[..., :99], **TOL[torch.float32])
    ours.save_pretrained(tmp_path / "resized")
    back, info = getattr(transformers, name).from_pretrained(str(tmp_path / "resized"), output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {} and back.config.vocab_size == 120
    assert torch.equal(back.cls.predictions.decoder.bias, decoder.bias.detach())


def test_untied_checkpoint_under_a_tied_config_says_how_to_load_it(tmp_path):
    _untied_checkpoint("BertForMaskedLM", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(CheckpointError, match=r"decoder\.weight differs from.*tie_word_embeddings=False"):
        BertForMaskedLM.from_pretrained(tmp_path)
    model = BertForMaskedLM.from_pretrained(tmp_path, tie_word_embeddings=False)
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight


def test_tie_word_embeddings_in_config_json():
    """Written when the file had it or when False; a tied config.json that left it out stays so."""
    assert "tie_word_embeddings" not in BertConfig.from_dict(TINY).to_dict()
    assert BertConfig.from_dict({**TINY, "tie_word_embeddings": True}).to_dict()["tie_word_embeddings"] is True
    assert BertConfig(tie_word_embeddings=False).to_dict()["tie_word_embeddings"] is False
    with pytest.raises(ValueError, match="tie_word_embeddings must be true or false"):
        BertConfig.from_dict({**TINY, "tie_word_embeddings": "no"})
