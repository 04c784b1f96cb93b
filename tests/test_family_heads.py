"""The task heads of the BERT family (sequence and token classification, masked LM, question
answering, ELECTRA's discriminator), from random checkpoints saved by transformers, against
transformers' own classes in the same run: loading, outputs, losses, saving back, refusals."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import EXACT, TOL, assert_bitwise
from test_families import FAMILIES, _batch, save_random

import bert_port
from bert_port import BertConfig, BertModel

# transformers' head class suffix -> the port's class and the output compared.
HEADS = {
    "ForSequenceClassification": ("BertForSequenceClassification", "logits"),
    "ForTokenClassification": ("BertForTokenClassification", "logits"),
    "ForMaskedLM": ("BertForMaskedLM", "logits"),
    "ForQuestionAnswering": ("BertForQuestionAnswering", "start_logits"),
}
CASES = [(family, head) for family in FAMILIES for head in HEADS] + [("electra", "ForPreTraining")]


def _classes(family: str, head: str) -> tuple[str, type]:
    """transformers' class name (RobertaForMaskedLM) and the port's class of a family's head."""
    prefix = FAMILIES[family][1].removesuffix("Model")
    port = "ElectraForPreTraining" if head == "ForPreTraining" else HEADS[head][0]
    return prefix + head, getattr(bert_port, port)


def _save(family: str, head: str, path):
    """A random transformers model of the family's head saved to `path` (3 labels; QA's 2)."""
    return save_random(family, path, cls_name=_classes(family, head)[0], num_labels=2 if "Question" in head else 3)


def _labels(head: str, batch: dict, vocab_size: int) -> dict:
    """Labels of the head's loss for `batch` (B=3, T=9), seeded."""
    g = torch.Generator().manual_seed(1)
    if head == "ForSequenceClassification":
        return {"labels": torch.tensor([0, 2, 1])}
    if head == "ForQuestionAnswering":
        return {"start_positions": torch.tensor([1, 2, 30]), "end_positions": torch.tensor([3, 4, 5])}
    if head == "ForPreTraining":
        return {"labels": torch.randint(0, 2, (3, 9), generator=g)}
    high = 3 if head == "ForTokenClassification" else vocab_size
    return {"labels": torch.randint(0, high, (3, 9), generator=g).masked_fill(batch["attention_mask"] == 0, -100)}


def _on_real_tokens(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token outputs (B, T, ...) with the padding positions zeroed; per-text ones unchanged."""
    if out.dim() == 1 or out.shape[:2] != mask.shape:
        return out
    keep = mask.bool().reshape(*mask.shape, *([1] * (out.dim() - 2)))
    return out.masked_fill(~keep, 0)


@pytest.mark.parametrize(("family", "head"), CASES)
def test_family_head_loads_strictly_and_matches_transformers(tmp_path, family, head):
    """Each family's head loads from transformers' checkpoint with nothing missing, unexpected or
    dropped; on the default path its outputs and loss match transformers' within the fp32
    tolerance, and in exact mode its outputs are transformers' eager ones bit for bit."""
    hf = _save(family, head, tmp_path)
    _, port_cls = _classes(family, head)
    batch = _batch(hf.config.vocab_size, hf.config.pad_token_id)
    labels = _labels(head, batch, hf.config.vocab_size)
    key = HEADS.get(head, (None, "logits"))[1]
    port = port_cls.from_pretrained(tmp_path)
    info = port.loading_info
    assert info["newly_initialized"] == [] and info["unused"] == [] and info["dropped"] == []
    assert port.hf_architecture == type(hf).__name__
    with torch.no_grad():
        ours, theirs = port(**batch, **labels), hf(**batch, **labels)
    mask = batch["attention_mask"]
    torch.testing.assert_close(
        _on_real_tokens(ours[key], mask), _on_real_tokens(theirs[key], mask), **TOL[torch.float32]
    )
    if head != "ForQuestionAnswering":  # its softmax runs over the padding positions too, which the speed path skips
        torch.testing.assert_close(ours["loss"], theirs.loss, **TOL[torch.float32])

    exact = _exact(port_cls, tmp_path)
    hf.set_attn_implementation("eager")
    with torch.no_grad():
        ours, theirs = exact(**batch, **labels), hf(**batch, **labels)
    assert_bitwise([ours[key]], [theirs[key]])
    torch.testing.assert_close(ours["loss"], theirs.loss, **TOL[torch.float32])


def _exact(port_cls: type, path):
    """The port's model in exact mode (transformers' eager path, operation for operation). The
    discriminator's (1, H) output layer is read from the safetensors file in place, at an offset
    that is not 64-byte aligned, and a one-column GEMM's bits follow the alignment: given memory of
    its own, as transformers holds it, the head is transformers' bit for bit."""
    model = port_cls.from_pretrained(path, **EXACT)
    for param in getattr(model, "discriminator_predictions", torch.nn.Module()).parameters():
        param.data = param.data.clone()
    return model


@pytest.mark.parametrize(("family", "head"), CASES)
def test_family_head_drops_out_where_transformers_does(tmp_path, family, head):
    """In training, from the same seed, each head's outputs are transformers' bit for bit in exact
    mode: the same dropouts in the same order (RoBERTa's and ELECTRA's before `pre_classifier` too,
    DistilBERT's `seq_classif_dropout` and `qa_dropout`)."""
    hf = _save(family, head, tmp_path)
    port = _exact(_classes(family, head)[1], tmp_path).train()
    hf.set_attn_implementation("eager")
    hf.train()
    batch = _batch(hf.config.vocab_size, hf.config.pad_token_id)
    key = HEADS.get(head, (None, "logits"))[1]
    torch.manual_seed(5)
    ours = port(**batch)[key]
    torch.manual_seed(5)
    assert_bitwise([ours], [hf(**batch)[key]])


@pytest.mark.parametrize(("family", "head"), CASES)
def test_family_head_saves_a_folder_transformers_loads_with_its_class(tmp_path, family, head):
    """save_pretrained writes the family's head names (`classifier.out_proj`, `lm_head`,
    `vocab_projector`, `generator_lm_head`, ...) and `architectures`: transformers' own class loads
    the folder with nothing missing or unexpected, and every tensor is the one it saved."""
    import transformers

    hf = _save(family, head, tmp_path / "in")
    port = _classes(family, head)[1].from_pretrained(tmp_path / "in")
    port.save_pretrained(tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == [type(hf).__name__] and written["model_type"] == family
    again, info = getattr(transformers, type(hf).__name__).from_pretrained(
        str(tmp_path / "out"), output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = again.state_dict()
    assert state.keys() == hf.state_dict().keys()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize(
    ("family", "cls", "reason"),
    [
        ("roberta", "BertForPreTraining", "no roberta counterpart"),
        ("distilbert", "BertLMHeadModel", "no distilbert counterpart"),
        ("electra", "BertForPreTraining", "use BertModel or .*ElectraForPreTraining"),
        ("bert", "ElectraForPreTraining", "no bert counterpart"),
    ],
)
def test_a_head_the_port_does_not_compute_is_refused_in_one_line(family, cls, reason):
    """A head with no counterpart in the family (RoBERTa has no next-sentence head; ELECTRA's
    ForPreTraining is its discriminator, not BERT's) is refused when built, in one line."""
    shape = FAMILIES.get(family, FAMILIES["roberta"])[2]
    config = BertConfig.from_dict(dict(shape, model_type=family))
    with pytest.raises(ValueError, match=reason) as err:
        getattr(bert_port, cls)(config)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", ["distilbert", "electra"])
def test_an_untied_mlm_whose_bias_is_the_decoders_is_refused(family):
    """DistilBERT's and ELECTRA's MLM bias is the decoder's own: untied, the port's head cannot
    hold it, so the model is refused in one line that says why."""
    config = BertConfig.from_dict(dict(FAMILIES[family][2], model_type=family, tie_word_embeddings=False))
    with pytest.raises(ValueError, match="untied .* MLM head") as err:
        bert_port.BertForMaskedLM(config)
    assert "\n" not in str(err.value)


def test_untied_roberta_mlm_matches_transformers(tmp_path):
    """RoBERTa's untied decoder keeps its own weight and bias, as BERT's: it loads and matches."""
    hf = save_random("roberta", tmp_path, cls_name="RobertaForMaskedLM", tie_word_embeddings=False)
    port = bert_port.BertForMaskedLM.from_pretrained(tmp_path, **EXACT)
    assert port.loading_info["newly_initialized"] == [] and port.loading_info["unused"] == []
    hf.set_attn_implementation("eager")
    batch = _batch(hf.config.vocab_size, 1)
    with torch.no_grad():
        assert_bitwise([port(**batch).logits], [hf(**batch).logits])


def test_a_bare_model_and_another_head_read_a_task_checkpoint(tmp_path):
    """A bare RobertaModel reads an MLM checkpoint, its `lm_head` dropped and reported, as it reads
    BERT's `cls.predictions`; a sequence classifier built on it initialises its head and says so."""
    save_random("roberta", tmp_path, cls_name="RobertaForMaskedLM")
    bare = BertModel.from_pretrained(tmp_path)
    assert bare.loading_info["dropped"] and all(k.startswith("lm_head.") for k in bare.loading_info["dropped"])
    classifier = bert_port.BertForSequenceClassification.from_pretrained(tmp_path, num_labels=2)
    assert sorted(classifier.loading_info["newly_initialized"]) == [
        "classifier.bias",
        "classifier.weight",
        "pre_classifier.bias",
        "pre_classifier.weight",
    ]


@pytest.mark.parametrize("head", ["ForSequenceClassification", "ForMaskedLM"])
def test_batch_invariance_holds_on_roberta_heads(tmp_path, head):
    """On the default speed path (from_pretrained), a RoBERTa text gets the same logits bit for bit
    alone and inside a padded batch."""
    hf = _save("roberta", head, tmp_path)
    batch = _batch(hf.config.vocab_size, hf.config.pad_token_id)
    port = _classes("roberta", head)[1].from_pretrained(tmp_path)
    with torch.no_grad():
        together = port(**batch).logits
        for i in range(3):
            n = int(batch["attention_mask"][i].sum())
            alone = port(**{k: v[i : i + 1, :n] for k, v in batch.items()}).logits
            assert_bitwise([alone[0]], [together[i] if together.dim() == 2 else together[i, :n]])


def test_head_tables_round_trip_and_spell_the_files_names():
    """Each head table, both directions: a family's head keys to port names and back, every key
    accounted for; a head key the file lacks is named as the family's file names it."""
    from bert_port.checkpoint import HEAD_TABLES, head_table, hf_to_port, port_to_hf

    for table, heads in HEAD_TABLES.items():
        for head, names in heads.items():
            prefix = {"roberta": "roberta.", "distilbert": "distilbert.", "electra": "electra."}[table]
            state = {name: torch.zeros(1) for name in names} | {prefix + "embeddings.LayerNorm.weight": torch.zeros(1)}
            conversion = hf_to_port(state, table=table, heads=head_table(table, head))
            assert (
                not conversion.unmapped and not conversion.dropped and set(names.values()) <= set(conversion.state_dict)
            )
            assert set(port_to_hf(conversion.state_dict, prefix, table, head_table(table, head))) == set(state)
            for hf_name, port_name in names.items():
                assert conversion.layout.spell(port_name) == hf_name
