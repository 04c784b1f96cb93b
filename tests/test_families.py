"""The BERT family: RoBERTa, XLM-RoBERTa, DistilBERT and ELECTRA checkpoints, saved by
transformers from random weights, against transformers' own classes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import EXACT, REAL_SENTENCES, TOL, assert_bitwise, outputs_on_real_tokens

from bert_port import BertModel
from bert_port.assets import minilm_dir
from bert_port.config import ConfigError

# Tiny configs of each family, in the family's own config.json names. RoBERTa and XLM-R get
# tokenizers trained here (byte-level BPE, SentencePiece unigram); DistilBERT and ELECTRA the
# bundled all-MiniLM-L6-v2 WordPiece tokenizer, hence its vocabulary.
SHAPES = dict(vocab_size=300, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
WORDPIECE = 30522
FAMILIES = {
    "roberta": ("RobertaConfig", "RobertaModel", dict(SHAPES, hidden_size=32, max_position_embeddings=66)),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", dict(SHAPES, hidden_size=32, max_position_embeddings=66)),
    "distilbert": (
        "DistilBertConfig",
        "DistilBertModel",
        dict(vocab_size=WORDPIECE, n_layers=2, n_heads=4, dim=32, hidden_dim=37, max_position_embeddings=64),
    ),
    "electra": ("ElectraConfig", "ElectraModel", dict(SHAPES, vocab_size=WORDPIECE, hidden_size=64, embedding_size=32)),
}
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # ids 0..4: pad 1, as RoBERTa's
ROBERTA_TOKENIZER_CONFIG = dict(
    bos_token="<s>", eos_token="</s>", cls_token="<s>", sep_token="</s>", pad_token="<pad>", unk_token="<unk>"
)


def write_tokenizer(model_type: str, path) -> None:
    """The tokenizer files of the family's kind in `path`: tokenizer.json (built with `tokenizers`,
    no download) and tokenizer_config.json, as transformers and sentence-transformers read them."""
    from tokenizers import ByteLevelBPETokenizer, SentencePieceUnigramTokenizer, processors

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if model_type in ("distilbert", "electra"):
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
            shutil.copy(minilm_dir() / name, path / name)
        return
    if model_type == "roberta":
        tok, cls = ByteLevelBPETokenizer(), "RobertaTokenizer"
        tok.train_from_iterator(REAL_SENTENCES, vocab_size=300, special_tokens=ROBERTA_SPECIALS, show_progress=False)
    else:
        tok, cls = SentencePieceUnigramTokenizer(), "XLMRobertaTokenizer"
        tok.train_from_iterator(
            REAL_SENTENCES, vocab_size=120, special_tokens=ROBERTA_SPECIALS, unk_token="<unk>", show_progress=False
        )
    tok._tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tok.save(str(path / "tokenizer.json"))
    settings = dict(ROBERTA_TOKENIZER_CONFIG, tokenizer_class=cls, model_max_length=64, mask_token="<mask>")
    (path / "tokenizer_config.json").write_text(json.dumps(settings))


def save_random(model_type: str, path, cls_name: str | None = None, **fields):
    """A transformers model of the family with random weights (seed 0), saved to `path`."""
    import transformers

    config_cls, model_cls, shape = FAMILIES[model_type]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**shape, **fields})
    model = getattr(transformers, cls_name or model_cls)(config).eval()
    model.save_pretrained(str(path))
    write_tokenizer(model_type, path)
    return model


def test_unknown_model_type_is_refused(tmp_path):
    from bert_port import BertConfig

    with pytest.raises(ConfigError, match="model_type 'gpt2', which this port cannot compute exactly"):
        BertConfig.from_dict(dict(SHAPES, hidden_size=32, model_type="gpt2"))


def _batch(vocab_size: int, pad: int) -> dict:
    """Ids avoiding `pad` with ragged right padding of `pad` (row i has i pads)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_size, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    for i in range(1, 3):
        mask[i, 9 - i :] = 0
    return {"input_ids": ids.masked_fill(mask == 0, pad), "attention_mask": mask}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_loads_strictly_and_matches_transformers(tmp_path, model_type):
    """A checkpoint of each family, saved by transformers, loads with nothing missing or
    unexpected and matches transformers' own class in fp32 (default path) and bit for bit in
    exact mode."""
    hf = save_random(model_type, tmp_path)
    pad = hf.config.pad_token_id
    batch = _batch(hf.config.vocab_size, pad)
    with torch.no_grad():
        expected = hf(**batch).last_hidden_state.masked_fill(batch["attention_mask"][..., None] == 0, 0)
    port = BertModel.from_pretrained(tmp_path)
    assert port.loading_info["newly_initialized"] == [] and port.loading_info["unused"] == []
    hidden, _ = outputs_on_real_tokens(port, batch)
    torch.testing.assert_close(hidden, expected, **TOL[torch.float32])
    exact = BertModel.from_pretrained(tmp_path, **EXACT)
    hf.set_attn_implementation("eager")  # exact mode is transformers' eager path, operation for operation
    with torch.no_grad():
        out = exact(**batch)
        ref = hf(**batch)
    assert_bitwise([out.last_hidden_state], [ref.last_hidden_state])
    if getattr(ref, "pooler_output", None) is not None:
        assert_bitwise([out.pooler_output], [ref.pooler_output])
    else:
        assert out.pooler_output is None


@pytest.mark.parametrize(
    "model_type",
    ["roberta", *(pytest.param(t, marks=pytest.mark.slow) for t in ("xlm-roberta", "distilbert", "electra"))],
)
def test_parity_cli_passes_against_the_family_class(tmp_path, capsys, model_type):
    """`bert-port-parity` compares with the family's own transformers class, read by transformers."""
    from bert_port.cli import parity as parity_cli

    hf = save_random(model_type, tmp_path)
    argv = ["--checkpoint", str(tmp_path), "--no-progress", "--dtype", "float32", "--device", "cpu"]
    assert parity_cli.main(argv) == 0
    report = capsys.readouterr().out
    assert f"transformers.{type(hf).__name__}.from_pretrained read" in report and "PASS: 1 of 1" in report


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_saved_folder_loads_in_transformers_with_its_own_class(tmp_path, model_type):
    """Saving back writes the family's config.json names and key names: transformers' own class
    loads the folder with nothing missing or unexpected, and computes what it computed before."""
    import transformers

    hf = save_random(model_type, tmp_path / "in")
    port = BertModel.from_pretrained(tmp_path / "in")
    port.save_pretrained(tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    read = json.loads((tmp_path / "in" / "config.json").read_text())
    assert written["model_type"] == model_type and written["architectures"] == [type(hf).__name__]
    assert {k: v for k, v in written.items() if k in read and k != "transformers_version"} == {
        k: v for k, v in read.items() if k in written and k != "transformers_version"
    }
    cls = getattr(transformers, type(hf).__name__)
    again, info = cls.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(again.config) is type(hf.config)
    for key, tensor in hf.state_dict().items():
        assert torch.equal(again.state_dict()[key], tensor), key


def test_distilbert_config_reads_and_writes_its_own_names():
    from bert_port import BertConfig

    config = BertConfig.from_dict(dict(FAMILIES["distilbert"][2], model_type="distilbert", sinusoidal_pos_embds=True))
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (32, 2, 37)
    assert config.type_vocab_size == 0 and config.layer_norm_eps == 1e-12
    written = config.to_dict()
    assert written["dim"] == 32 and written["sinusoidal_pos_embds"] is True
    assert not {"hidden_size", "type_vocab_size", "layer_norm_eps", "position_embedding_type"} & set(written)


@pytest.mark.parametrize("model_type", ["roberta", "distilbert", "electra"])
def test_token_classification_loads_the_family_head(tmp_path, model_type):
    """Task heads that compute the same as BERT's (token classification) load from the family's
    task checkpoint (`roberta.` prefix) strictly and match transformers' logits."""
    from bert_port.heads import BertForTokenClassification

    cls = FAMILIES[model_type][1].replace("Model", "ForTokenClassification")
    hf = save_random(model_type, tmp_path, cls_name=cls, num_labels=3)
    batch = _batch(hf.config.vocab_size, hf.config.pad_token_id)
    port = BertForTokenClassification.from_pretrained(tmp_path, **EXACT)
    assert port.loading_info["newly_initialized"] == [] and port.hf_architecture == cls
    hf.set_attn_implementation("eager")
    with torch.no_grad():
        assert_bitwise([port(**batch)["logits"]], [hf(**batch).logits])


def test_a_head_the_family_lacks_is_refused(tmp_path):
    """RoBERTa has no next-sentence head: BertForPreTraining refuses a RoBERTa checkpoint in one line
    rather than load it wrong (the heads it computes: test_family_heads.py)."""
    from bert_port.heads import BertForPreTraining

    save_random("roberta", tmp_path, cls_name="RobertaForMaskedLM")
    with pytest.raises(ValueError, match="no roberta counterpart in transformers") as err:
        BertForPreTraining.from_pretrained(tmp_path)
    assert "\n" not in str(err.value)


def _sentence_folder(model_type: str, path) -> Path:
    """A sentence-transformers folder (Transformer, mean Pooling, Normalize) saved by
    sentence-transformers itself around a random checkpoint of the family and its tokenizer."""
    from sentence_transformers import SentenceTransformer, models

    save_random(model_type, path / "hf")
    transformer = models.Transformer(str(path / "hf"), max_seq_length=48)
    pooling = models.Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu").save(str(path / "st"))
    # sentence-transformers 6 writes its modules' own paths; the hub's folders (all-distilroberta-v1,
    # multilingual-e5) the classic `sentence_transformers.models.*`: SentenceEncoder reads both.
    assert not json.loads((path / "st" / "modules.json").read_text())[0]["type"].startswith(
        "sentence_transformers.models."
    )
    return path / "st"


@pytest.mark.parametrize("model_type", ["roberta", "distilbert", pytest.param("xlm-roberta", marks=pytest.mark.slow)])
def test_sentence_encoder_equals_sentence_transformers(tmp_path, model_type):
    """SentenceEncoder reads a sentence-transformers folder built on the family (BPE tokenizer for
    RoBERTa, SentencePiece for XLM-R, WordPiece for DistilBERT) and gives its embeddings."""
    from sentence_transformers import SentenceTransformer

    from bert_port.sentence import SentenceEncoder

    folder = _sentence_folder(model_type, tmp_path)
    texts = [*REAL_SENTENCES, "a pair of words"]
    expected = SentenceTransformer(str(folder), device="cpu", local_files_only=True).encode(
        texts, convert_to_tensor=True
    )
    encoder = SentenceEncoder.from_pretrained(folder)
    assert encoder.model.config.family.model_type == model_type and encoder.max_seq_length == 48
    torch.testing.assert_close(encoder.encode(texts, convert_to_tensor=True), expected, **TOL[torch.float32])
    exact = SentenceEncoder.from_pretrained(folder, **EXACT)
    torch.testing.assert_close(exact.encode(texts, convert_to_tensor=True), expected, **TOL[torch.float32])


def test_family_checkpoint_found_in_the_hf_cache(tmp_path, monkeypatch):
    """A DistilBERT checkpoint laid out in the local HF cache loads by model id, as BERT's do."""
    from test_checkpoint_locate import _add_to_cache

    hf = save_random("distilbert", tmp_path / "saved")
    files = {p.name: p for p in (tmp_path / "saved").iterdir() if p.is_file()}
    _add_to_cache(tmp_path / "hub", "distilbert/tiny-random", files, "d" * 40)
    port = BertModel.from_pretrained("distilbert/tiny-random", cache_dir=tmp_path / "hub", **EXACT)
    batch = _batch(hf.config.vocab_size, hf.config.pad_token_id)
    hf.set_attn_implementation("eager")
    with torch.no_grad():
        assert_bitwise([port(**batch).last_hidden_state], [hf(**batch).last_hidden_state])


@pytest.mark.parametrize("model_type", ["roberta", "electra"])
def test_batch_invariance_holds_on_the_family(tmp_path, model_type):
    """On the default path a text gets the same bits alone and in a padded batch: RoBERTa's
    positions and ELECTRA's projection depend on the row alone."""
    hf = save_random(model_type, tmp_path)
    batch = _batch(hf.config.vocab_size, hf.config.pad_token_id)
    port = BertModel.from_pretrained(tmp_path)
    with torch.no_grad():
        together = port(**batch).last_hidden_state
        for i in range(3):
            n = int(batch["attention_mask"][i].sum())
            alone = port(**{k: v[i : i + 1, :n] for k, v in batch.items()}).last_hidden_state
            assert_bitwise([alone[0]], [together[i, :n]])


def test_roberta_positions_from_embeddings_and_the_longest_input(tmp_path):
    """From `inputs_embeds` RoBERTa's positions run padding_idx + 1 .. as transformers'; an input
    longer than max_position_embeddings less padding_idx + 1 is refused, saying to what to truncate."""
    hf = save_random("roberta", tmp_path)
    port = BertModel.from_pretrained(tmp_path, **EXACT)
    hf.set_attn_implementation("eager")
    embeds = hf.embeddings.word_embeddings(_batch(hf.config.vocab_size, 1)["input_ids"]).detach()
    with torch.no_grad():
        assert_bitwise([port(inputs_embeds=embeds).last_hidden_state], [hf(inputs_embeds=embeds).last_hidden_state])
    assert port.config.max_sequence_length == 64
    port(input_ids=torch.full((1, 64), 5))
    with pytest.raises(ValueError, match="truncation to 64"):
        port(input_ids=torch.full((1, 65), 5))


def test_distilbert_key_table_round_trips_a_task_checkpoint():
    """The DistilBERT table, both directions: a task model's keys (`distilbert.` prefix) to port
    names and back, every key accounted for, the head's name kept."""
    from bert_port.checkpoint import KEY_TABLES, hf_to_port, port_to_hf

    table = KEY_TABLES["distilbert"]
    names = [k.format(1) for k in table] + ["classifier.weight", "classifier.bias"]
    state = {"distilbert." + k if not k.startswith("classifier.") else k: torch.zeros(1) for k in names}
    conversion = hf_to_port(state, table="distilbert")
    assert not conversion.unmapped and "bert_layers.1.self_attention.query.weight" in conversion.state_dict
    assert set(port_to_hf(conversion.state_dict, encoder_prefix="distilbert.", table="distilbert")) == set(state)
    assert conversion.layout.spell("classifier.weight") == "classifier.weight"
    assert (
        conversion.layout.spell("bert_layers.0.interm_dense.weight") == "distilbert.transformer.layer.0.ffn.lin1.weight"
    )
