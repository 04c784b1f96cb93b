"""int8 against float32 of the same model, in the same run, on a mixed corpus of real text
(`data.load_mixed`: tweets, SMS, MR, Amazon and NYT snippets, and one- and two-word messages):
the bar of `tolerance.INT8_ACCURACY` must hold where MR alone hid the short texts' loss.

Two planted faults must fail the same check: the scheme before the LayerNorm-fed projections
kept their widest channels in float32 ("thank you!" at 0.98 cosine), and one activation step
for a whole batch (torch's dynamic quantization), which on MR alone now passes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bert_port import SentenceEncoder
from bert_port.data import SHORT_TEXTS, load_mixed
from bert_port.speed import kernels, quantization
from bert_port.speed.quantization import Int8Linear
from bert_port.tolerance import INT8_ACCURACY

PER_SOURCE, QUERIES, K = 50, 100, 10  # 5 sources x 50 + the short texts: 280 texts


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return load_mixed(PER_SOURCE, seed=1).texts


@pytest.fixture(scope="module")
def reference(minilm_path, texts) -> torch.Tensor:
    return SentenceEncoder.from_pretrained(minilm_path).encode(texts, batch_size=64, convert_to_tensor=True)


def int8_embeddings(minilm_path, texts: list[str]) -> torch.Tensor:
    return SentenceEncoder.from_pretrained(minilm_path, quantization="int8").encode(
        texts, batch_size=64, convert_to_tensor=True
    )


def check_accuracy(expected: torch.Tensor, actual: torch.Tensor, texts: list[str]) -> None:
    """Cosine to float32, mean and worst (naming the worst text), and the top-K neighbours of
    QUERIES texts kept."""
    cos = F.cosine_similarity(actual, expected, dim=1)
    bar = INT8_ACCURACY
    assert cos.mean() >= bar.embedding_cosine_mean, f"mean cosine {cos.mean():.5f}"
    worst = int(cos.argmin())
    assert cos[worst] >= bar.embedding_cosine_min, f"worst cosine {cos[worst]:.5f} ({texts[worst]!r})"

    def top(e: torch.Tensor) -> torch.Tensor:
        sim = F.normalize(e, dim=1)[:QUERIES] @ F.normalize(e, dim=1).T
        sim[torch.arange(QUERIES), torch.arange(QUERIES)] = -2.0  # not itself
        return sim.topk(K, dim=1).indices

    kept = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top(expected), top(actual))) / (K * QUERIES)
    assert kept >= bar.neighbours_agree, f"top-{K} neighbours kept {kept:.3f}"


def test_the_corpus_mixes_sources_and_short_texts(texts):
    labels = load_mixed(PER_SOURCE, seed=1).labels
    assert {label: labels.count(label) for label in set(labels)} == {
        **dict.fromkeys(("tweets", "sms", "mr", "amazon", "nyt"), PER_SOURCE),
        "short": len(SHORT_TEXTS),
    }
    assert "thank you!" in texts and len(set(texts)) == len(texts)


@pytest.mark.slow
def test_int8_meets_the_bar_on_mixed_text(minilm_path, reference, texts):
    check_accuracy(reference, int8_embeddings(minilm_path, texts), texts)


@pytest.mark.slow
def test_planted_no_float_channels_before_layernorm_fed_projections_fails(minilm_path, reference, texts, monkeypatch):
    monkeypatch.setattr(quantization, "LN_FLOAT_CHANNELS", 0)
    with pytest.raises(AssertionError, match="worst cosine"):
        check_accuracy(reference, int8_embeddings(minilm_path, texts), texts)


@pytest.mark.slow
def test_planted_per_batch_activation_scale_fails(minilm_path, reference, texts, monkeypatch):
    """One step for every row of a batch instead of each row's own, planted in the PyTorch path
    (the C kernels off)."""
    own = Int8Linear._steps
    monkeypatch.setattr(kernels, "available", lambda: False)
    monkeypatch.setattr(Int8Linear, "_steps", lambda self, rows: own(self, rows).amax().expand(rows.shape[0], 1))
    with pytest.raises(AssertionError):
        check_accuracy(reference, int8_embeddings(minilm_path, texts), texts)
