"""The jobs on the BERT family: `bert-port-embed` on sentence-transformers
folders built on RoBERTa and DistilBERT writes sentence-transformers' embeddings, and int8 loads
the family's layers and keeps its bar against the family's float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import REAL_SENTENCES, TOL
from test_families import _sentence_folder, save_random

from bert_port import BertModel
from bert_port.speed.quantization import Int8Linear
from bert_port.tolerance import INT8_ACCURACY


@pytest.mark.parametrize("model_type", ["roberta", "distilbert"])
def test_embed_command_on_a_family_folder_equals_sentence_transformers(tmp_path, model_type):
    from sentence_transformers import SentenceTransformer

    from bert_port.cli import embed
    from bert_port.embed import read_embeddings

    folder = _sentence_folder(model_type, tmp_path)
    texts = [*REAL_SENTENCES, "a pair of words"]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    argv = ["--model", str(folder), "--device", "cpu", "--no-progress", str(tmp_path / "in.txt"), str(tmp_path / "out")]
    assert embed.main(argv) == 0
    _, written = read_embeddings(tmp_path / "out")
    expected = SentenceTransformer(str(folder), device="cpu", local_files_only=True).encode(
        texts, convert_to_tensor=True
    )
    torch.testing.assert_close(torch.as_tensor(written), expected, **TOL[torch.float32])


@pytest.mark.parametrize("model_type", ["roberta", "distilbert", "electra"])
def test_int8_loads_the_family_and_keeps_the_bar(tmp_path, model_type):
    """Every encoder projection of the family becomes an Int8Linear (ELECTRA's embedding
    projection stays float: it is no LayerNorm-fed encoder layer), and the hidden states keep
    int8's cosine bar against the same checkpoint in float32."""
    hf = save_random(model_type, tmp_path)
    fp32 = BertModel.from_pretrained(tmp_path)
    int8 = BertModel.from_pretrained(tmp_path, quantization="int8")
    layers = int8.config.num_hidden_layers
    assert sum(isinstance(m, Int8Linear) for m in int8.modules()) >= 6 * layers
    ids = torch.randint(5, hf.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    ids[1, 8:] = hf.config.pad_token_id or 0
    with torch.inference_mode():
        actual = int8(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]
        expected = fp32(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]
    assert torch.isfinite(actual).all()
    assert F.cosine_similarity(actual, expected, dim=1).min() >= INT8_ACCURACY.embedding_cosine_min
