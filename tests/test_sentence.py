"""SentenceEncoder against sentence-transformers, computed in the same run on the bundled
all-MiniLM-L6-v2 (Transformer, mean Pooling, Normalize, max_seq_length 256), and the
sentence-transformers files that save_pretrained and bert-port-convert keep."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import REAL_SENTENCES, TINY, TOL

from bert_port import BertModel, CheckpointError, SentenceEncoder
from bert_port.cli.convert import main as convert_main
from bert_port.sentence import POOLING_MODES, pool

# Longer than max_seq_length (256) and than the position table (512): truncated as
# sentence-transformers truncates. Padding-only and empty texts too.
TEXTS = [*REAL_SENTENCES, " ".join(["word"] * 300), "lorem ipsum dolor " * 200, "", "  spaced  "]


@pytest.fixture(scope="module")
def st_reference(minilm_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu", local_files_only=True)


def _st_encode(model, texts=TEXTS, **kwargs) -> torch.Tensor:
    return model.encode(texts, convert_to_tensor=True, batch_size=4, **kwargs).cpu()


def test_follows_the_checkpoint_files(minilm_path):
    encoder = SentenceEncoder.from_pretrained(minilm_path)
    assert encoder.pooling == ("mean",) and encoder.normalize and encoder.max_seq_length == 256


def test_encode_equals_sentence_transformers(minilm_path, st_reference):
    encoder = SentenceEncoder.from_pretrained(minilm_path)
    expected = _st_encode(st_reference)
    actual = encoder.encode(TEXTS, batch_size=4, convert_to_tensor=True)
    assert actual.shape == (len(TEXTS), 384)
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])
    torch.testing.assert_close(actual.norm(dim=1), torch.ones(len(TEXTS)), **TOL[torch.float32])
    # Order and batching do not matter; one bare string is one text, as in sentence-transformers.
    torch.testing.assert_close(
        encoder.encode(TEXTS[::-1], batch_size=1, convert_to_tensor=True), expected.flip(0), **TOL[torch.float32]
    )
    single = encoder.encode(TEXTS[0], convert_to_tensor=True)
    assert single.shape == (384,)
    torch.testing.assert_close(single, st_reference.encode(TEXTS[0], convert_to_tensor=True), **TOL[torch.float32])
    # The pooler output is not this model's embedding.
    from bert_port import encode

    batch = encode(encoder.tokenizer, TEXTS[:3])
    with torch.no_grad():
        pooled = encoder.model(**batch).pooler_output
    assert (torch.nn.functional.normalize(pooled, dim=1) - expected[:3]).abs().max() > 0.1


def test_encode_returns_what_sentence_transformers_returns(minilm_path, st_reference):
    """numpy float32 by default, a list of (D,) tensors with neither conversion, and one
    (D,) row for a bare string: the types and values of sentence-transformers' `encode`."""
    import numpy as np

    encoder = SentenceEncoder.from_pretrained(minilm_path)
    array, theirs = encoder.encode(TEXTS, batch_size=4), st_reference.encode(TEXTS, batch_size=4)
    assert isinstance(array, np.ndarray) and array.dtype == theirs.dtype == np.float32
    assert array.shape == theirs.shape == (len(TEXTS), 384)
    torch.testing.assert_close(torch.from_numpy(array), torch.from_numpy(theirs), **TOL[torch.float32])
    rows = encoder.encode(TEXTS, convert_to_numpy=False)
    assert isinstance(rows, list) and len(rows) == len(TEXTS) and all(r.shape == (384,) for r in rows)
    torch.testing.assert_close(torch.stack(rows), torch.from_numpy(array), **TOL[torch.float32])
    single = encoder.encode(TEXTS[1])
    assert isinstance(single, np.ndarray) and single.shape == (384,)


def test_encode_says_how_many_texts_it_truncated(minilm_path, caplog):
    """TEXTS holds two texts over max_seq_length (256) tokens: one warning names them, and
    texts that fit give none."""
    encoder = SentenceEncoder.from_pretrained(minilm_path)
    with caplog.at_level(logging.WARNING, logger="bert_port.sentence"):
        encoder.encode(TEXTS, batch_size=3)
    warnings = [r.getMessage() for r in caplog.records if r.name == "bert_port.sentence"]
    assert len(warnings) == 1 and warnings[0].startswith(f"2 of {len(TEXTS)} texts had more than max_seq_length=256")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bert_port.sentence"):
        encoder.encode(REAL_SENTENCES)
    assert not [r for r in caplog.records if r.name == "bert_port.sentence"]


def test_encode_progress_bar(minilm_path, capsys):
    encoder = SentenceEncoder.from_pretrained(minilm_path)
    encoder.encode(REAL_SENTENCES, batch_size=2, show_progress_bar=True)
    err = capsys.readouterr().err
    assert "Batches" in err and "3/3" in err
    encoder.encode(REAL_SENTENCES, batch_size=2, show_progress_bar=False)
    assert "Batches" not in capsys.readouterr().err


def test_normalize_embeddings_as_sentence_transformers(minilm_path, st_reference):
    """`normalize_embeddings=False` (sentence-transformers' default) adds no normalisation and
    keeps the checkpoint's Normalize module; `normalize=False` at load drops that module;
    `normalize_embeddings=True` normalises on top, each as sentence-transformers does."""
    from sentence_transformers import SentenceTransformer

    texts = TEXTS[:4]
    encoder = SentenceEncoder.from_pretrained(minilm_path)
    kept = encoder.encode(texts, normalize_embeddings=False, convert_to_tensor=True)
    torch.testing.assert_close(kept, _st_encode(st_reference, texts, normalize_embeddings=False), **TOL[torch.float32])
    torch.testing.assert_close(kept.norm(dim=1), torch.ones(len(texts)), **TOL[torch.float32])
    # sentence-transformers without its Normalize module: the raw mean-pooled vectors.
    no_norm = SentenceTransformer(modules=[st_reference[0], st_reference[1]], device="cpu")
    raw_encoder = SentenceEncoder.from_pretrained(minilm_path, normalize=False)
    raw = raw_encoder.encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(raw, _st_encode(no_norm, texts), **TOL[torch.float32])
    assert (raw.norm(dim=1) - 1).abs().max() > 0.1
    forced = raw_encoder.encode(texts, normalize_embeddings=True, convert_to_tensor=True)
    torch.testing.assert_close(forced, _st_encode(no_norm, texts, normalize_embeddings=True), **TOL[torch.float32])


def test_forward_gives_differentiable_embeddings(minilm_path):
    from bert_port import encode

    encoder = SentenceEncoder.from_pretrained(minilm_path).train()
    batch = encode(encoder.tokenizer, TEXTS[:3], max_length=encoder.max_seq_length)
    out = encoder(**batch)
    out.sum().backward()
    assert out.shape == (3, 384) and encoder.model.word_embedding.weight.grad is not None


def test_saved_model_and_converted_checkpoint_load_in_sentence_transformers(tmp_path, minilm_path, st_reference):
    from sentence_transformers import SentenceTransformer

    expected = _st_encode(st_reference)
    BertModel.from_pretrained(minilm_path).save_pretrained(tmp_path / "saved")
    assert convert_main([str(minilm_path), str(tmp_path / "converted")]) == 0
    for name in ("saved", "converted"):
        out = tmp_path / name
        for file in ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json"):
            assert (out / file).read_bytes() == (minilm_path / file).read_bytes(), file
        reloaded = SentenceTransformer(str(out), device="cpu", local_files_only=True)
        torch.testing.assert_close(_st_encode(reloaded), expected, **TOL[torch.float32])
        torch.testing.assert_close(
            SentenceEncoder.from_pretrained(out).encode(TEXTS, convert_to_tensor=True), expected, **TOL[torch.float32]
        )


def _plain_copy(minilm_path, directory):
    """The bundled model without its sentence-transformers files: a plain BERT folder."""
    import shutil

    directory.mkdir()
    for file in minilm_path.iterdir():
        if file.is_file() and file.name not in ("modules.json", "sentence_bert_config.json", "README.md"):
            shutil.copy(file, directory / file.name)
    return directory


def test_save_over_another_models_sentence_transformers_files_removes_them(tmp_path, minilm_path, st_reference, capsys):
    """A model with no sentence-transformers source, saved (or converted) into a folder that
    holds another model's modules.json, 1_Pooling/, 2_Normalize/, ...: those go in the same
    commit, so SentenceTransformer reads the folder as the plain BERT it now is."""
    from sentence_transformers import SentenceTransformer

    plain = _plain_copy(minilm_path, tmp_path / "plain")
    no_norm = SentenceTransformer(modules=[st_reference[0], st_reference[1]], device="cpu")
    expected = _st_encode(no_norm, TEXTS[:4])
    st_names = {"modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling"}
    for how in ("save", "convert"):
        out = tmp_path / how
        BertModel.from_pretrained(minilm_path).save_pretrained(out)
        (out / "2_Normalize").mkdir()
        modules = json.loads((out / "modules.json").read_text())
        (out / "modules.json").write_text(json.dumps([*modules[:2], {**modules[2], "path": "2_Normalize"}]))
        capsys.readouterr()
        if how == "save":
            BertModel.from_pretrained(plain).save_pretrained(out)
        else:
            assert convert_main([str(plain), str(out), "--overwrite"]) == 0
            assert "copied:" not in capsys.readouterr().out
        left = {p.name for p in out.iterdir()}
        assert not left & (st_names | {"2_Normalize"}), left
        reloaded = SentenceTransformer(str(out), device="cpu", local_files_only=True)
        torch.testing.assert_close(_st_encode(reloaded, TEXTS[:4]), expected, **TOL[torch.float32])
    # From a sentence-transformers SRC, convert says what it copied.
    assert convert_main([str(minilm_path), str(tmp_path / "st")]) == 0
    report = capsys.readouterr().out
    assert "copied:    sentence-transformers files from SRC: modules.json" in report and "1_Pooling/" in report


def test_encoder_save_with_normalize_from_a_folder_without_it(tmp_path, minilm_path):
    """`normalize=True` over a plain BERT folder (no modules.json, no 2_Normalize/): the save
    lists Normalize, and sentence-transformers reading it computes what the encoder does."""
    from sentence_transformers import SentenceTransformer

    plain = _plain_copy(minilm_path, tmp_path / "plain")
    encoder = SentenceEncoder.from_pretrained(plain, normalize=True)
    encoder.save_pretrained(tmp_path / "out")
    modules = json.loads((tmp_path / "out" / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    reloaded = SentenceTransformer(str(tmp_path / "out"), device="cpu", local_files_only=True)
    actual = encoder.encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(actual, _st_encode(reloaded), **TOL[torch.float32])
    # sentence-transformers on the plain folder (its defaults: mean pooling), normalised on request.
    on_plain = SentenceTransformer(str(plain), device="cpu", local_files_only=True)
    assert reloaded.max_seq_length == on_plain.max_seq_length == encoder.max_seq_length
    torch.testing.assert_close(actual, _st_encode(on_plain, normalize_embeddings=True), **TOL[torch.float32])


@pytest.mark.parametrize("pooling", [("cls",), ("mean", "max"), ("max", "cls")])  # all modes: the tiny test below
def test_encoder_save_writes_its_own_pipeline(tmp_path, minilm_path, pooling):
    from sentence_transformers import SentenceTransformer

    encoder = SentenceEncoder.from_pretrained(minilm_path, pooling=pooling, normalize=False, max_seq_length=64)
    encoder.save_pretrained(tmp_path)
    reloaded = SentenceTransformer(str(tmp_path), device="cpu", local_files_only=True)
    assert reloaded.max_seq_length == 64
    texts = TEXTS[:7]  # one over max_seq_length
    actual = encoder.encode(texts, convert_to_tensor=True)
    assert actual.shape == (len(texts), 384 * len(pooling))
    torch.testing.assert_close(actual, _st_encode(reloaded, texts), **TOL[torch.float32])
    again = SentenceEncoder.from_pretrained(tmp_path)
    assert again.pooling == pooling and not again.normalize and again.max_seq_length == 64


@pytest.mark.parametrize("mode", POOLING_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_equals_sentence_transformers_pooling(mode, dtype):
    """The tiny path: random token vectors with right and left padding, every mode."""
    from sentence_transformers.models import Pooling

    B, T, H = 4, 7, TINY["hidden_size"]
    tokens = torch.randn(B, T, H).to(dtype)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 5:] = 0
    mask[2, :3] = 0  # left padding: cls reads the first real token
    mask[3, 1:] = 0
    reference = Pooling(H, pooling_mode=mode)
    expected = reference({"token_embeddings": tokens, "attention_mask": mask})["sentence_embedding"]
    actual = pool(tokens, mask, (mode,))
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, **TOL[dtype])


def test_older_folder_with_bert_in_a_module_folder(tmp_path, minilm_path, st_reference):
    """Older sentence-transformers folders keep BERT in `0_BERT/` (modules.json gives the
    Transformer that path, and its sentence_bert_config.json lives there): loaded from it, with
    what sentence-transformers computes for the same folder; a missing folder is named."""
    import shutil

    from sentence_transformers import SentenceTransformer

    root = tmp_path / "old"
    root.mkdir()
    _plain_copy(minilm_path, root / "0_BERT")
    shutil.copy(minilm_path / "sentence_bert_config.json", root / "0_BERT")
    shutil.copytree(minilm_path / "1_Pooling", root / "1_Pooling")
    modules = json.loads((minilm_path / "modules.json").read_text())
    modules[0]["path"] = "0_BERT"
    (root / "modules.json").write_text(json.dumps(modules))
    encoder = SentenceEncoder.from_pretrained(root, max_seq_length=None)
    assert encoder.normalize and encoder.max_seq_length == 256
    reference = SentenceTransformer(str(root), device="cpu", local_files_only=True)
    torch.testing.assert_close(
        encoder.encode(TEXTS, convert_to_tensor=True), _st_encode(reference), **TOL[torch.float32]
    )
    torch.testing.assert_close(
        encoder.encode(TEXTS, convert_to_tensor=True), _st_encode(st_reference), **TOL[torch.float32]
    )

    shutil.rmtree(root / "0_BERT")
    with pytest.raises(CheckpointError, match=r"Transformer module \(the BERT weights\) in 0_BERT/.*does not exist"):
        SentenceEncoder.from_pretrained(root)


def test_unsupported_pipeline_is_refused(tmp_path, minilm_path):
    import shutil

    shutil.copytree(minilm_path, tmp_path / "m")
    modules = json.loads((tmp_path / "m" / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "m" / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(CheckpointError, match="Dense.*Use sentence-transformers"):
        SentenceEncoder.from_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="pooling 'weightedmean' is not supported"):
        SentenceEncoder.from_pretrained(minilm_path, pooling="weightedmean")
    with pytest.raises(ValueError, match="max_seq_length must be an integer in"):
        SentenceEncoder.from_pretrained(minilm_path, max_seq_length=1000)
