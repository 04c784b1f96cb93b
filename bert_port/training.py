"""Fine-tuning a sequence classifier: the loop behind `bert-port-finetune`.

One function, `finetune(cfg)`, runs the whole job: data, model, AdamW (no weight decay on
biases and LayerNorm), linear warmup then linear decay (torch's `LinearLR` +
`SequentialLR`), gradient clipping and accumulation, optional bf16 autocast, evaluation
(loss, accuracy, macro-F1, per-class figures) after every epoch, the best checkpoint by a
validation metric saved in HF format, `metrics.json`, a PNG of the curves, and resumable
checkpoints.

Batches. `batch_size` is the *global* batch of one optimiser step. It is split into
`grad_accum_steps` micro-batches and across the processes of a torchrun job, so the same
`batch_size` gives the same run whatever the number of processes or accumulation steps:
every process draws from the same seeded permutation (`DistributedSampler`, which hands
process r the positions r, r + W, r + 2W, ...), so optimiser step k sees exactly the
examples at positions [k*B, (k+1)*B) of that permutation, and each example's loss is
divided by the number of real examples in the step (the sampler's padding repeats, when
len(train) is not a multiple of W, get weight 0). Only float rounding differs. Dropout
masks are drawn per process, so runs with dropout > 0 agree in distribution, not bitwise.

Resume. `last-checkpoint.pt` in the output directory holds the model, optimiser, scheduler,
every process's RNG state, the data position (epoch and step within it) and the history;
it is written to a temporary file and renamed into place (`checkpoint.atomic_write`) at
the end of every epoch, every `save_steps` steps, at `stop_after_steps`, and when the job
is interrupted (Ctrl-C / SIGTERM stop after the current step). `resume=True` continues
from it and gives the same weights as the uninterrupted run.

Faults. Every setting is checked before any work (types too, for a config file; numbers
finite and in range; `max_length` against the model's position table), and the data files
are read in full before the model is built. A step whose gradient or loss is NaN or
infinite stops the run with `DivergedError` before the optimiser takes it, and no weights
are ever saved unless every tensor is finite. The output directory is locked for the run
(an flock, which dies with its process), and the hidden temporaries a `kill -9` left there
are deleted by the next run or `--resume`. Per-class figures and the confusion matrix are
stored only up to `DETAIL_MAX_CLASSES` labels (the matrix for the best evaluation only);
above that an evaluation keeps a fixed-size summary, and evaluation counts per class
rather than filling a K x K matrix, so memory and files stay bounded for any K.

The loop runs `bert_port.BertForSequenceClassification`, or with `reference="hf"`
transformers' model of the same name (passed in by the command line, since this package
never imports transformers), started from the very same weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim.lr_scheduler import LinearLR, LRScheduler, SequentialLR
from torch.utils.data.distributed import DistributedSampler
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from .assets import minilm_dir
from .classifier import BertForSequenceClassification, per_example_loss
from .config import BertConfig
from .data import (
    BUILTIN_DATASETS,
    Collator,
    DataError,
    TextDataset,
    builtin_splits,
    check_labels,
    chunks,
    label_names,
    length_sorted,
    load_texts,
    validation_split,
    write_texts,
)
from .tokenization import load_tokenizer

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

log = logging.getLogger(__name__)

PROBLEM_TYPE = "single_label_classification"
METRICS = ("accuracy", "macro_f1", "loss")  # choices for metric_for_best; loss is minimised
LAST_CHECKPOINT = "last-checkpoint.pt"
METRICS_FILE = "metrics.json"
CURVES_FILE = "training_curves.png"
RESOLVED_CONFIG = "training_config.json"
# Settings a resumed run must share with the run that wrote the checkpoint: they decide the
# data order, the schedule and the model.
RESUME_MUST_MATCH = (
    "checkpoint",
    "reference",
    "dataset",
    "train",
    "validation",
    "text_column",
    "text_pair_column",
    "label_column",
    "validation_split",
    "max_train_examples",
    "max_length",
    "epochs",
    "max_steps",
    "batch_size",
    "lr",
    "weight_decay",
    "warmup_ratio",
    "warmup_steps",
    "seed",
    "freeze_encoder",
    "classifier_dropout",
)


class FinetuneError(ValueError):
    """A configuration or run state that cannot be used; the message says what to do."""


class DivergedError(FinetuneError):
    """The loss or the gradient became NaN or infinite: nothing is saved from such a step."""


@dataclass
class FinetuneConfig:
    # Model.
    checkpoint: str | None = None  # directory or cached model id; None: the bundled all-MiniLM-L6-v2
    reference: str = "port"  # "port": bert_port's model; "hf": transformers' model, same loop and weights
    attn_implementation: str = "sdpa"  # "sdpa" or "eager"
    classifier_dropout: float | None = None  # None: the checkpoint's (else hidden_dropout_prob)
    # Data.
    dataset: str | None = None  # "mr" | "sms": a bundled split instead of files
    train: str | None = None  # CSV, TSV or JSONL
    validation: str | None = None  # if None, `validation_split` of train is held out
    test: str | None = None
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    validation_split: float = 0.1
    max_train_examples: int | None = None  # use only the first N training examples
    max_length: int = 128  # tokens per example, longer ones are truncated
    # Optimisation.
    epochs: int = 3
    max_steps: int | None = None  # stop (and end the schedule) after this many optimiser steps
    batch_size: int = 32  # global: examples per optimiser step, over accumulation and processes
    grad_accum_steps: int = 1
    eval_batch_size: int = 64  # per process
    lr: float = 5e-5
    weight_decay: float = 0.01  # not applied to biases and LayerNorm weights
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    warmup_ratio: float = 0.1  # of the optimiser steps, unless warmup_steps is given
    warmup_steps: int | None = None
    max_grad_norm: float = 1.0  # 0 turns clipping off
    seed: int = 42
    bf16: bool = False  # bf16 autocast for forward passes; weights and optimiser stay fp32
    freeze_encoder: bool = False  # train only the classifier head
    # Evaluation, checkpoints, runtime.
    metric_for_best: str = "accuracy"  # "accuracy" | "macro_f1" | "loss"
    output_dir: str = "runs/finetune"
    overwrite: bool = False  # start afresh in an output_dir that holds a run (resume wins over it)
    resume: bool = False
    save_steps: int | None = None  # also write the resumable checkpoint every N steps
    stop_after_steps: int | None = None  # stop as if interrupted (schedule unchanged); resume later
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    compare_to: str | None = None  # another run's output dir: report the loss-curve difference

    def validate(self) -> None:
        """Refuse settings that mean nothing before any work is done (a config file can hold
        any JSON type, so types are checked too). Every problem is listed at once."""
        problems = []

        def bad(name: str, want: str) -> None:
            value = getattr(self, name)
            problems.append(f"--{name.replace('_', '-')} must be {want}, got {value!r}")

        for name in (
            "reference",
            "attn_implementation",
            "text_column",
            "label_column",
            "metric_for_best",
            "output_dir",
            "device",
        ):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                bad(name, "a non-empty string")
        for name in ("checkpoint", "dataset", "train", "validation", "test", "text_pair_column", "compare_to"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                bad(name, "a non-empty string")
        for name in ("bf16", "freeze_encoder", "overwrite", "resume"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "true or false")
        for name in ("epochs", "batch_size", "grad_accum_steps", "eval_batch_size", "max_length"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                bad(name, "a positive integer")
        for name in ("max_steps", "max_train_examples", "save_steps", "stop_after_steps"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                bad(name, "a positive integer")
        if self.warmup_steps is not None and (not _is_int(self.warmup_steps) or self.warmup_steps < 0):
            bad("warmup_steps", "an integer >= 0")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
            bad("seed", "an integer in [0, 2**63)")
        # Floats: finite, in range. `not lo < x` also catches NaN, which compares false.
        for name, lo, hi, closed, want in (
            ("lr", 0.0, math.inf, False, "a finite number > 0 (e.g. 5e-5)"),
            ("adam_eps", 0.0, math.inf, False, "a finite number > 0 (e.g. 1e-8)"),
            ("weight_decay", 0.0, math.inf, True, "a finite number >= 0"),
            ("max_grad_norm", 0.0, math.inf, True, "a finite number >= 0 (0 turns clipping off)"),
            ("adam_beta1", 0.0, 1.0, True, "in [0, 1)"),
            ("adam_beta2", 0.0, 1.0, True, "in [0, 1)"),
            ("warmup_ratio", 0.0, 1.0, True, "in [0, 1)"),
            ("validation_split", 0.0, 1.0, False, "strictly between 0 and 1"),
            ("classifier_dropout", 0.0, 1.0, True, "in [0, 1)"),
        ):
            value = getattr(self, name)
            if name == "classifier_dropout" and value is None:
                continue
            if (
                not _is_number(value)
                or not math.isfinite(value)
                or not (lo <= value if closed else lo < value)
                or not value < hi
            ):
                bad(name, want)
        if self.reference not in ("port", "hf"):
            problems.append(f"reference must be 'port' or 'hf', got {self.reference!r}")
        if self.attn_implementation not in ("sdpa", "eager"):
            problems.append(f"attn_implementation must be 'sdpa' or 'eager', got {self.attn_implementation!r}")
        if self.dataset is not None and self.dataset not in BUILTIN_DATASETS:
            problems.append(f"dataset must be one of {', '.join(BUILTIN_DATASETS)}, got {self.dataset!r}")
        if self.dataset is not None and self.train is not None:
            problems.append("give either a bundled dataset (--dataset) or a training file (--train), not both")
        if self.dataset is None and self.train is None:
            problems.append("no training data: pass --train FILE (CSV, TSV or JSONL) or --dataset mr|sms")
        if self.metric_for_best not in METRICS:
            problems.append(f"metric_for_best must be one of {', '.join(METRICS)}, got {self.metric_for_best!r}")
        columns = [c for c in (self.text_column, self.text_pair_column, self.label_column) if c is not None]
        if len(set(columns)) < len(columns):
            problems.append(
                f"--text-column, --text-pair-column and --label-column must name different columns, got {columns}"
            )
        if isinstance(self.device, str) and not _DEVICE.fullmatch(self.device):
            problems.append(f"--device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if _is_int(self.max_length) and self.max_length >= 1:
            try:
                check_max_length(self.max_length, None, pairs=self.text_pair_column is not None)
            except FinetuneError as exc:
                problems.append(str(exc))
        if problems:
            raise FinetuneError("invalid fine-tuning configuration:\n  - " + "\n  - ".join(problems))


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_max_length(max_length: int, max_positions: int | None, pairs: bool = False, flag: str = "--max-length"):
    """`max_length` must leave room for text beside [CLS]/[SEP] (below that the tokenizer
    silently stops truncating) and fit the model's position table (beyond it the first long
    batch fails mid-run)."""
    least = 5 if pairs else 3  # [CLS] a [SEP] (b [SEP])
    if max_length < least:
        raise FinetuneError(
            f"{flag} {max_length} leaves no room for text beside [CLS] and [SEP]; use at least "
            f"{least}{' with a text pair' if pairs else ''} (typically 128)"
        )
    if max_positions is not None and max_length > max_positions:
        raise FinetuneError(
            f"{flag} {max_length} exceeds the model's max_position_embeddings ({max_positions}): "
            f"sequences that long cannot be encoded; use {flag} {max_positions} or less"
        )


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a `configs/*.json` fine-tuning configuration: an object whose keys are
    `FinetuneConfig` fields. Unknown keys are an error (a typo would silently do nothing)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FinetuneError(f"no configuration file at {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FinetuneError(f"{path} is not valid JSON ({exc})") from None
    except OSError as exc:
        raise FinetuneError(f"cannot read the configuration file {path} ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise FinetuneError(f"{path} must hold a JSON object of settings")
    known = {f.name for f in dataclasses.fields(FinetuneConfig)}
    data = {k.replace("-", "_"): v for k, v in data.items() if not k.startswith("_")}  # "_comment" keys allowed
    unknown = sorted(set(data) - known)
    if unknown:
        raise FinetuneError(
            f"{path}: unknown setting(s) {', '.join(unknown)}; valid ones are {', '.join(sorted(known))}"
        )
    return data


# -----------------------------------------------------------------------------------------
# Processes and devices


@dataclass
class Dist:
    """This process's place in a torchrun job (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    owns_group: bool = False  # this module started the process group and ends it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def sum(self, tensor: Tensor) -> Tensor:
        if self.enabled:
            tensor = tensor.to(self.device)
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def gather(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


def setup_distributed(device: str = "auto") -> Dist:
    """Join the torchrun job described by the environment (WORLD_SIZE, RANK, LOCAL_RANK):
    NCCL on CUDA, gloo on the CPU. Each process uses the GPU of its local rank."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise FinetuneError(f"device {device!r} asked for, but CUDA is not available here; use --device cpu")
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        index = int(device.split(":")[1]) if ":" in device else local_rank
        if index >= torch.cuda.device_count():
            raise FinetuneError(
                f"device cuda:{index} asked for, but this machine has {torch.cuda.device_count()} "
                "CUDA device(s); pick one of them with --device cuda:N"
            )
        torch_device = torch.device("cuda", index)
        torch.cuda.set_device(torch_device)
    else:
        torch_device = torch.device("cpu")
    owns = False
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        owns = True
    return Dist(rank=rank, world_size=world_size, device=torch_device, owns_group=owns)


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,  # this process's device
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


# -----------------------------------------------------------------------------------------
# Optimiser and schedule


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on weight matrices and embeddings; none on biases and
    LayerNorm parameters (as BERT was trained and HF's Trainer does). Frozen parameters
    are left out. Each group carries the parameter names under "names"."""
    decay: dict[str, nn.Parameter] = {}
    no_decay: dict[str, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            full = f"{module_name}.{name}" if module_name else name
            (no_decay if isinstance(module, nn.LayerNorm) or name == "bias" else decay)[full] = param
    return [
        {"params": list(decay.values()), "names": list(decay), "weight_decay": weight_decay},
        {"params": list(no_decay.values()), "names": list(no_decay), "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: FinetuneConfig) -> torch.optim.AdamW:
    groups = param_groups(model, cfg.weight_decay)
    params = [p for g in groups for p in g["params"]]
    # The fused kernel: one pass over each tensor instead of a dozen (7x faster on the CPU
    # for MiniLM, whose 30522 x 384 word embeddings are half its parameters).
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=fused or None
    )


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int) -> LRScheduler:
    """Linear warmup to the peak over `warmup_steps` steps, then linear decay towards 0 at
    `total_steps`. The factor at step s (0-based) is (s + 1) / warmup_steps during warmup,
    then (total - s) / (total - warmup): HF's `get_linear_schedule_with_warmup`, except
    that warmup starts at peak/warmup rather than spending its first step at lr 0."""
    decay = LinearLR(optimizer, start_factor=1.0, end_factor=0.0, total_iters=max(1, total_steps - warmup_steps))
    if warmup_steps < 2:
        return decay
    warmup = LinearLR(optimizer, start_factor=1.0 / warmup_steps, end_factor=1.0, total_iters=warmup_steps - 1)
    return SequentialLR(optimizer, [warmup, decay], milestones=[warmup_steps])


# -----------------------------------------------------------------------------------------
# Steps and evaluation


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler | None,
    micro_batches: list[dict[str, Tensor]],
    weights: list[Tensor],
    n_real: int,
    *,
    world_size: int = 1,
    max_grad_norm: float = 1.0,
    bf16: bool = False,
) -> tuple[Tensor, float | None]:
    """One optimiser step over the micro-batches this process holds. `weights` (one (b,)
    tensor per micro-batch) are 1 for real examples, 0 for sampler padding; `n_real` is the
    number of real examples in the *global* step. Each example's loss is divided by
    `n_real` (times `world_size`, since DDP averages gradients over processes), so the
    gradient is the mean over the global batch however it is split.

    Returns this process's summed loss of real examples (a 0-d tensor) and the gradient
    norm before clipping (None when clipping is off)."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=micro_batches[0]["input_ids"].device)
    device_type = loss_sum.device.type
    for i, (batch, weight) in enumerate(zip(micro_batches, weights)):
        last = i == len(micro_batches) - 1
        # Accumulating micro-batches skip DDP's gradient all-reduce until the last one.
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(
                    input_ids=batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    token_type_ids=batch["token_type_ids"],
                ).logits
            losses = per_example_loss(logits.float(), batch["labels"], PROBLEM_TYPE)  # (b,)
            ((losses * weight).sum() * (world_size / n_real)).backward()
        loss_sum += (losses.detach() * weight).sum().double()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = None
    if max_grad_norm > 0:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
        norm = grad_norm
    else:
        # The 2-norm of the per-tensor norms, as clip_grad_norm_ computes it.
        grads = [p.grad.detach().norm() for p in params if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0
    # DDP has averaged the gradients by now, so every process sees the same norm and stops together.
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        raise DivergedError(f"the gradient norm is {norm}")
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


# Per-class figures and the confusion matrix are stored only up to this many labels; above
# it an evaluation keeps a fixed-size summary, so metrics.json and the training state stay
# bounded however many classes there are (10,000 classes: 800 MB per confusion matrix).
DETAIL_MAX_CLASSES = 50
WORST_CLASSES = 10  # listed in the summary of a many-class evaluation


def metrics_from_counts(
    tp: Tensor, predicted: Tensor, actual: Tensor, loss_sum: float, names: list[str], confusion: Tensor | None = None
) -> dict[str, Any]:
    """Accuracy, macro-F1 and per-class precision/recall/F1 from per-class counts (K,):
    true positives, predictions and true labels. Macro-F1 averages over the classes that
    occur as a true label or a prediction (scikit-learn's default). Up to
    `DETAIL_MAX_CLASSES` classes the result holds `per_class` and the `confusion` matrix
    (rows: true label, columns: prediction) if given; above it `per_class_summary`."""
    tp, predicted, actual = (x.double().cpu() for x in (tp, predicted, actual))
    total = float(actual.sum())
    precision = torch.where(predicted > 0, tp / predicted.clamp(min=1), torch.zeros_like(tp))
    recall = torch.where(actual > 0, tp / actual.clamp(min=1), torch.zeros_like(tp))
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp(min=1e-300), 0.0)
    present = (predicted + actual) > 0
    result: dict[str, Any] = {
        "loss": loss_sum / total,
        "accuracy": float(tp.sum()) / total,
        "macro_f1": float(f1[present].mean()) if bool(present.any()) else 0.0,
        "n": int(total),
    }
    if len(names) <= DETAIL_MAX_CLASSES:
        result["per_class"] = {
            name: {
                "precision": float(precision[i]),
                "recall": float(recall[i]),
                "f1": float(f1[i]),
                "support": int(actual[i]),
            }
            for i, name in enumerate(names)
        }
        if confusion is not None:
            result["confusion"] = confusion.long().cpu().tolist()
    else:
        supported = (actual > 0).nonzero().flatten()
        worst = supported[f1[supported].argsort(stable=True)[:WORST_CLASSES]].tolist()
        q = (
            f1[present].quantile(torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=f1.dtype)).tolist()
            if bool(present.any())
            else [0.0] * 5
        )
        result["per_class_summary"] = {
            "classes": len(names),
            "classes_present": int(present.sum()),
            "f1_quantiles": dict(zip(("min", "p25", "median", "p75", "max"), q)),
            "worst_f1": [{"label": names[i], "f1": float(f1[i]), "support": int(actual[i])} for i in worst],
        }
    return result


@torch.no_grad()
def evaluate(
    model: nn.Module,
    collate: Collator,
    names: list[str],
    dist_info: Dist,
    batch_size: int,
    bf16: bool = False,
    desc: str = "eval",
) -> dict[str, Any]:
    """Loss, accuracy, macro-F1 on `collate.dataset`, split over the processes (each takes
    every W-th example of a length-sorted order; no padding, so every example counts once)."""
    was_training = model.training
    model.eval()
    device = dist_info.device
    order = length_sorted(collate.dataset)[dist_info.rank :: dist_info.world_size]
    K = len(names)
    # Counts, not a K x K matrix (unless K is small enough to store it): memory O(K).
    counts = torch.zeros(3, K, dtype=torch.float64, device=device)  # true positives, predicted, actual
    confusion = torch.zeros(K * K if K <= DETAIL_MAX_CLASSES else 0, dtype=torch.float64, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    batches = list(chunks(order, batch_size))
    for indices in tqdm(batches, desc=desc, leave=False, disable=not dist_info.is_main, dynamic_ncols=True):
        batch = {k: v.to(device) for k, v in collate(indices).items()}
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
            logits = model(**inputs).logits.float()
        loss_sum += per_example_loss(logits, batch["labels"], PROBLEM_TYPE).sum().double()
        labels, guess = batch["labels"], logits.argmax(-1)
        counts[0] += torch.bincount(labels[labels == guess], minlength=K).double()
        counts[1] += torch.bincount(guess, minlength=K).double()
        counts[2] += torch.bincount(labels, minlength=K).double()
        if confusion.numel():
            confusion += torch.bincount(labels * K + guess, minlength=K * K).double()
    counts, confusion, loss_sum = dist_info.sum(counts), dist_info.sum(confusion), dist_info.sum(loss_sum)
    model.train(was_training)
    return metrics_from_counts(*counts, float(loss_sum), names, confusion.view(K, K) if confusion.numel() else None)


@torch.no_grad()
def predict(
    model: nn.Module,
    tokenizer,
    dataset: TextDataset,
    batch_size: int = 64,
    max_length: int = 128,
    device: str | torch.device = "cpu",
    bf16: bool = False,
) -> Tensor:
    """Class probabilities (N, num_labels) for every text of `dataset`, in its order."""
    if not _is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    check_max_length(max_length, model.config.max_position_embeddings, pairs=dataset.pairs is not None)
    device = torch.device(device)
    model.eval()
    collate = Collator(tokenizer, dataset, max_length)
    probs = torch.full((len(dataset), model.config.num_labels), math.nan)  # NaN until written: a gap shows
    for indices in tqdm(list(chunks(length_sorted(dataset), batch_size)), desc="predict", dynamic_ncols=True):
        batch = {k: v.to(device) for k, v in collate(indices).items() if k != "index"}
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(**batch).logits.float()
        probs[torch.tensor(indices)] = logits.softmax(-1).cpu()
    return probs


# -----------------------------------------------------------------------------------------
# Data and model


@dataclass
class Splits:
    train: TextDataset
    validation: TextDataset
    test: TextDataset | None
    names: list[str]  # the label map: id -> name


def load_splits(cfg: FinetuneConfig) -> Splits:
    """Read the configured data, check the labels, and build the label map from training."""
    if cfg.dataset is not None:
        parts = builtin_splits(cfg.dataset)
        train, validation, test = parts["train"], parts["validation"], parts["test"]
    else:
        read = dict(text_column=cfg.text_column, label_column=cfg.label_column, text_pair_column=cfg.text_pair_column)
        train = load_texts(cfg.train, **read)
        if cfg.validation is not None:
            validation = load_texts(cfg.validation, **read)
        else:
            train, validation = validation_split(train, cfg.validation_split, cfg.seed)
        test = load_texts(cfg.test, **read) if cfg.test is not None else None
    if cfg.max_train_examples is not None:
        train = train.subset(range(min(cfg.max_train_examples, len(train))))
    names = label_names(train.labels)
    if len(names) < 2:
        raise DataError(
            f"{train.source}: every training example has the label {names[0]!r}; a classifier needs "
            "examples of at least two labels"
        )
    check_labels(validation, names, "validation")
    if test is not None:
        check_labels(test, names, "test")
    return Splits(train, validation, test, names)


def build_model(cfg: FinetuneConfig, names: list[str], hf_module=None) -> tuple[nn.Module, Path]:
    """The classifier to train, in train mode, and the directory of its tokenizer. The head
    is initialised from the seeded RNG. With `hf_module` (the `transformers` module) the
    reference model is built and given exactly the port model's initial weights."""

    overrides: dict[str, Any] = {
        "id2label": dict(enumerate(names)),
        "label2id": {name: i for i, name in enumerate(names)},
        "problem_type": PROBLEM_TYPE,
        "attn_implementation": cfg.attn_implementation,
    }
    if cfg.classifier_dropout is not None:
        overrides["classifier_dropout"] = cfg.classifier_dropout
    set_seed(cfg.seed)
    model = BertForSequenceClassification.from_pretrained(cfg.checkpoint or minilm_dir(), **overrides)
    source_dir = Path(model.source_dir)
    if hf_module is not None:
        with torch.random.fork_rng(devices=[]):  # HF's own random init must not move the RNG dropout will use
            model = to_hf_model(model, hf_module, cfg.attn_implementation)
    if cfg.freeze_encoder:
        for param in model.bert.parameters():
            param.requires_grad_(False)
    return model.train(), source_dir


def to_hf_model(model: BertForSequenceClassification, hf_module, attn_implementation: str = "sdpa") -> nn.Module:
    """transformers' BertForSequenceClassification holding `model`'s weights (strict)."""
    hf_config = hf_module.BertConfig(**model.config.to_dict())
    hf_config._attn_implementation = attn_implementation
    reference = hf_module.BertForSequenceClassification(hf_config)
    reference.load_state_dict(model.hf_state_dict(), strict=True)
    return reference


def load_trained(output_dir: str | os.PathLike, hf_module=None, attn_implementation: str = "sdpa") -> nn.Module:
    """Load the saved best checkpoint with the same implementation that trained it."""
    if hf_module is not None:
        return hf_module.BertForSequenceClassification.from_pretrained(
            str(output_dir), attn_implementation=attn_implementation
        ).eval()
    return BertForSequenceClassification.from_pretrained(output_dir, attn_implementation=attn_implementation)


def save_model(model: nn.Module, output_dir: Path, source_dir: Path) -> None:
    """HF-format checkpoint of `model` with the tokenizer files beside it."""
    if isinstance(model, BertForSequenceClassification):
        model.source_dir = source_dir
        model.save_pretrained(output_dir)
        return
    model.save_pretrained(str(output_dir))  # transformers' model: copy its tokenizer ourselves
    for name in ckpt.TOKENIZER_FILES:
        if (source_dir / name).is_file():
            with ckpt.atomic_write(output_dir / name) as tmp:
                tmp.write_bytes((source_dir / name).read_bytes())


# -----------------------------------------------------------------------------------------
# Checkpoints, metrics, plots


def _torch_save_atomic(obj: Any, path: Path) -> None:
    with ckpt.atomic_write(path) as tmp:
        torch.save(obj, tmp)


def write_json(obj: Any, path: Path) -> None:
    with ckpt.atomic_write(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def plot_curves(metrics: dict[str, Any], path: Path, other: dict[str, Any] | None = None) -> Path:
    """Training loss per step (and its running mean), validation loss at each evaluation,
    and validation accuracy / macro-F1; `other` (another run's metrics) is overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    # The other run is drawn dashed on top, so identical curves show as one line with dashes.
    runs = [(metrics, "", "C0", "-")] + ([(other, f" ({other.get('name', 'other')})", "C3", "--")] if other else [])
    for run, suffix, color, style in runs:
        steps = [s["step"] for s in run["steps"]]
        losses = [s["loss"] for s in run["steps"]]
        ax_loss.plot(steps, losses, color=color, alpha=0.3, lw=0.8, ls=style)
        ax_loss.plot(
            steps, _running_mean(losses, 20), color=color, lw=1.5, ls=style, label=f"train loss{suffix} (mean of 20)"
        )
        evals = run["evaluations"]
        if evals:
            at = [e["step"] for e in evals]
            ax_loss.plot(
                at,
                [e["validation"]["loss"] for e in evals],
                "o",
                ls=style,
                color=color,
                label=f"validation loss{suffix}",
            )
            ax_acc.plot(
                at, [e["validation"]["accuracy"] for e in evals], "o", ls=style, color=color, label=f"accuracy{suffix}"
            )
            ax_acc.plot(
                at,
                [e["validation"]["macro_f1"] for e in evals],
                "s",
                ls=style,
                color=color,
                mfc="none",
                label=f"macro-F1{suffix}",
            )
    ax_lr = ax_loss.twinx()  # the schedule, for reading the loss against it
    ax_lr.plot(
        [s["step"] for s in metrics["steps"]],
        [s["lr"] for s in metrics["steps"]],
        color="0.6",
        lw=0.8,
        ls=":",
        label="learning rate (right axis)",
    )
    ax_lr.set_ylabel("learning rate", color="0.4")
    ax_lr.set_ylim(bottom=0)
    ax_loss.set(xlabel="optimiser step", ylabel="cross-entropy", title="loss")
    ax_acc.set(xlabel="optimiser step", ylabel="validation", title="validation metrics", ylim=(0.0, 1.05))
    for e in metrics["evaluations"]:
        ax_acc.annotate(
            f"{e['validation']['accuracy']:.3f}",
            (e["step"], e["validation"]["accuracy"]),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=7,
        )
    ax_loss.grid(alpha=0.3)
    ax_acc.grid(alpha=0.3)
    handles = [h for ax in (ax_loss, ax_lr) for h in ax.get_legend_handles_labels()[0]]
    # On the twin axes, the top layer, so that the lr line does not run over the legend.
    ax_lr.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="lower left")
    if ax_acc.get_legend_handles_labels()[0]:
        ax_acc.legend(fontsize=7, loc="lower right")
    title = metrics.get("name", "")
    if other:
        c = compare_runs(metrics, other)
        title += f"  vs  {other.get('name', 'other')}: per-step train loss |diff| max {c['max_abs_loss_diff']:.2e}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with ckpt.atomic_write(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path


def _running_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def compare_runs(metrics: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Per-step training-loss difference between two runs over their common steps, and
    their test results side by side."""
    a = {s["step"]: s["loss"] for s in metrics["steps"]}
    b = {s["step"]: s["loss"] for s in other["steps"]}
    common = sorted(set(a) & set(b))
    diffs = [abs(a[s] - b[s]) for s in common]
    first = lambda d: min((s for s, x in zip(common, d) if x > 1e-4), default=None)
    return {
        "other": other.get("output_dir"),
        "steps_compared": len(common),
        "max_abs_loss_diff": max(diffs, default=float("nan")),
        "mean_abs_loss_diff": sum(diffs) / len(diffs) if diffs else float("nan"),
        "max_abs_loss_diff_first_20": max(diffs[:20], default=float("nan")),
        "first_step_above_1e-4": first(diffs),
        "test": {"this": metrics.get("test"), "other": other.get("test")},
    }


# -----------------------------------------------------------------------------------------
# The job


class _StopRequest:
    """Turns Ctrl-C / SIGTERM into "stop after this step and save"; a second Ctrl-C aborts."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("interrupted: stopping after the current step and saving a checkpoint (again to abort)")

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class _Sampler(DistributedSampler):
    """`DistributedSampler` that can start part-way into an epoch (resume)."""

    start = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.start :])

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start)


def finetune(cfg: FinetuneConfig, hf_module=None) -> dict[str, Any]:
    """Run the fine-tuning job `cfg` (under torchrun, as one of its processes). Returns the
    metrics written to `metrics.json`; `status` is "completed" or "stopped" (interrupted
    or `stop_after_steps`; continue with `resume=True`)."""
    cfg.validate()
    if cfg.reference == "hf" and hf_module is None:
        raise FinetuneError("reference='hf' needs the transformers module: run it through `bert-port-finetune`")
    dist_info = setup_distributed(cfg.device)
    try:
        with contextlib.ExitStack() as stack:
            return _finetune(cfg, dist_info, hf_module if cfg.reference == "hf" else None, stack)
    finally:
        if dist_info.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _finetune(cfg: FinetuneConfig, d: Dist, hf_module, stack: contextlib.ExitStack) -> dict[str, Any]:
    t_start = time.perf_counter()
    out = Path(cfg.output_dir)
    last_path = out / LAST_CHECKPOINT
    if out.exists() and not out.is_dir():
        raise FinetuneError(f"--output-dir {out} is a file, not a directory; choose another --output-dir")
    if cfg.resume and not last_path.is_file():
        raise FinetuneError(
            f"--resume: no {LAST_CHECKPOINT} in {out} (the run stopped before its first checkpoint, "
            "or never ran there); start it again without --resume (with --overwrite if the "
            "directory holds a metrics.json)"
        )
    if not cfg.resume and not cfg.overwrite and (last_path.is_file() or (out / METRICS_FILE).is_file()):
        raise FinetuneError(
            f"{out} already holds a fine-tuning run; pass --resume to continue it, --overwrite to "
            "start it again, or choose another --output-dir"
        )
    if cfg.compare_to is not None and not Path(cfg.compare_to).is_dir():
        raise FinetuneError(f"--compare-to {cfg.compare_to} is not a directory; pass the --output-dir of another run")
    model_config = BertConfig.from_json_file(ckpt.locate_checkpoint(cfg.checkpoint or minilm_dir()).config_file)
    check_max_length(cfg.max_length, model_config.max_position_embeddings, pairs=cfg.text_pair_column is not None)
    splits = load_splits(cfg)
    names = splits.names
    refusal = None
    if d.is_main:  # held to the end of the run; a killed run's lock goes with its process
        try:
            stack.enter_context(_own_output_dir(out))
        except FinetuneError as exc:
            refusal = str(exc)
    refusal = d.gather(refusal)[0]  # every process learns rank 0's answer: none is left waiting in a collective
    if refusal is not None:
        raise FinetuneError(refusal)
    if cfg.overwrite and not cfg.resume and d.is_main:
        for name in (LAST_CHECKPOINT, METRICS_FILE):
            (out / name).unlink(missing_ok=True)
    micro = cfg.batch_size // (cfg.grad_accum_steps * d.world_size)
    if micro * cfg.grad_accum_steps * d.world_size != cfg.batch_size:
        raise FinetuneError(
            f"batch_size {cfg.batch_size} must be a multiple of grad_accum_steps x processes = "
            f"{cfg.grad_accum_steps} x {d.world_size}"
        )

    model, source_dir = build_model(cfg, names, hf_module)
    model.to(d.device)
    tokenizer = load_tokenizer(source_dir)
    train_collate = Collator(tokenizer, splits.train, cfg.max_length, names)
    val_collate = Collator(tokenizer, splits.validation, cfg.max_length, names)

    n_train = len(splits.train)
    sampler = _Sampler(splits.train, num_replicas=d.world_size, rank=d.rank, shuffle=True, seed=cfg.seed)
    steps_per_epoch = math.ceil(n_train / cfg.batch_size)  # = ceil(ceil(n / W) / (micro * accum)), see module doc
    total_steps = cfg.max_steps if cfg.max_steps is not None else cfg.epochs * steps_per_epoch
    n_epochs = math.ceil(total_steps / steps_per_epoch)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else math.ceil(cfg.warmup_ratio * total_steps)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, min(warmup, total_steps), total_steps)
    ddp_model: nn.Module = model
    if d.enabled:
        device_ids = [d.device.index] if d.device.type == "cuda" else None
        ddp_model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    n_test = len(splits.test) if splits.test else 0
    resolved = {
        **dataclasses.asdict(cfg),
        "labels": names,
        "sizes": {"train": n_train, "validation": len(splits.validation), "test": n_test},
        "world_size": d.world_size,
        "micro_batch_size": micro,
        "steps_per_epoch": steps_per_epoch,
        "total_steps": total_steps,
        "warmup_steps": min(warmup, total_steps),
        "device": str(d.device),
        "model": type(model).__module__ + "." + type(model).__name__,
        "tokenizer_dir": str(source_dir),
        "torch": torch.__version__,
    }
    history: dict[str, Any] = {"steps": [], "evaluations": [], "best": None, "train_time_s": 0.0, "examples": 0}
    epoch, step_in_epoch, global_step = 0, 0, 0
    if cfg.resume:
        state = _load_last(last_path)
        _check_resumable(state, cfg, names, last_path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        epoch, step_in_epoch, global_step = (state["progress"][k] for k in ("epoch", "step_in_epoch", "global_step"))
        history = state["history"]
        rngs = state["rng"]
        if len(rngs) != d.world_size:
            log.warning(
                "resuming with %d process(es) after %d: data order and schedule continue exactly, dropout masks do not",
                d.world_size,
                len(rngs),
            )
        set_rng_state(rngs[d.rank % len(rngs)])
        if d.is_main:
            log.info("resumed from %s at epoch %d, step %d", last_path, epoch + 1, global_step)
    if d.is_main:
        out.mkdir(parents=True, exist_ok=True)
        write_json(resolved, out / RESOLVED_CONFIG)
        if cfg.dataset is not None and not cfg.resume:  # the bundled split as files, to inspect or reuse with --train
            for split in ("train", "validation", "test"):
                write_texts(getattr(splits, split), out / "data" / f"{split}.csv")
        log.info(
            "%d train / %d validation / %d test examples, labels %s; %d step(s) per epoch of %d examples "
            "(%d per micro-batch x %d accumulation x %d process(es)), %d steps, %d warmup, on %s",
            n_train,
            len(splits.validation),
            n_test,
            names,
            steps_per_epoch,
            cfg.batch_size,
            micro,
            cfg.grad_accum_steps,
            d.world_size,
            total_steps,
            min(warmup, total_steps),
            d.device,
        )

    def save_last(progress: dict[str, int]) -> None:
        _check_finite_weights(model, f"step {global_step}")
        rngs = d.gather(rng_state())
        if d.is_main:
            _torch_save_atomic(
                {
                    "format": 1,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng": rngs,
                    "progress": progress,
                    "history": history,
                    "labels": names,
                    "config": dataclasses.asdict(cfg),
                },
                last_path,
            )
        d.barrier()

    def metrics_doc(status: str) -> dict[str, Any]:
        train_time = history["train_time_s"]
        return {
            "name": f"{type(model).__module__.split('.')[0]} {type(model).__name__} on {cfg.dataset or cfg.train}",
            "output_dir": str(out),
            "status": status,
            "labels": names,
            "config": resolved,
            "global_step": global_step,
            "epochs_completed": round(global_step / steps_per_epoch, 4),
            "train_time_s": round(train_time, 2),
            "train_examples_per_s": round(history["examples"] / train_time, 2) if train_time else None,
            "best": history["best"],
            "evaluations": history["evaluations"],
            "steps": history["steps"],
        }

    def run_evaluation() -> None:
        result = evaluate(model, val_collate, names, d, cfg.eval_batch_size, cfg.bf16, desc="validation")
        if not math.isfinite(result["loss"]):  # accuracy would be the argmax of NaN: meaningless
            raise DivergedError(
                f"the validation loss after epoch {epoch + 1} (step {global_step}) is "
                f"{result['loss']}: the weights are broken. Nothing was saved from them; "
                f"{_DIVERGED_ADVICE}"
            )
        steps_this_epoch = [s["loss"] for s in history["steps"] if s["epoch"] == epoch + 1]
        record = {
            "epoch": epoch + 1,
            "step": global_step,
            "train_loss": sum(steps_this_epoch) / len(steps_this_epoch) if steps_this_epoch else None,
            # The confusion matrix is kept for the best evaluation only (below), not every one.
            "validation": {k: v for k, v in result.items() if k != "confusion"},
        }
        history["evaluations"].append(record)
        value = result[cfg.metric_for_best]
        best = history["best"]
        better = best is None or (value < best["value"] if cfg.metric_for_best == "loss" else value > best["value"])
        if better:
            history["best"] = {"epoch": epoch + 1, "step": global_step, "metric": cfg.metric_for_best, "value": value}
            if "confusion" in result:
                history["best"]["confusion"] = result["confusion"]
            _check_finite_weights(model, f"epoch {epoch + 1}")
            if d.is_main:
                save_model(model, out, source_dir)
            d.barrier()
        if d.is_main:
            log.info(
                "epoch %d step %d: validation loss %.4f accuracy %.4f macro-F1 %.4f%s",
                epoch + 1,
                global_step,
                result["loss"],
                result["accuracy"],
                result["macro_f1"],
                " (best so far)" if better else "",
            )
            write_json(metrics_doc("running"), out / METRICS_FILE)

    status = "completed"
    with _StopRequest() as stop:
        while epoch < n_epochs and global_step < total_steps:
            sampler.set_epoch(epoch)
            sampler.start = step_in_epoch * cfg.grad_accum_steps * micro
            micro_batches = list(chunks(list(sampler), micro))
            bar = tqdm(
                total=min(steps_per_epoch, total_steps - global_step + step_in_epoch),
                initial=step_in_epoch,
                desc=f"epoch {epoch + 1}/{n_epochs}",
                unit="step",
                disable=not d.is_main,
                dynamic_ncols=True,
            )
            t_epoch = time.perf_counter()
            examples_epoch, start_step = 0, step_in_epoch
            for k in range(start_step, steps_per_epoch):
                t0 = time.perf_counter()
                first = (k - start_step) * cfg.grad_accum_steps
                group = micro_batches[first : first + cfg.grad_accum_steps]
                n_real = min(cfg.batch_size, n_train - k * cfg.batch_size)
                batches, weights = [], []
                for j, indices in enumerate(group):
                    # Positions in this process's list; global position = rank + local * world size.
                    local = torch.arange(len(indices)) + (k * cfg.grad_accum_steps + j) * micro
                    weights.append(((d.rank + local * d.world_size) < n_train).float().to(d.device))
                    batches.append({key: v.to(d.device) for key, v in train_collate(indices).items()})
                lr = optimizer.param_groups[0]["lr"]
                try:
                    loss_sum, grad_norm = train_step(
                        ddp_model,
                        optimizer,
                        scheduler,
                        batches,
                        weights,
                        n_real,
                        world_size=d.world_size,
                        max_grad_norm=cfg.max_grad_norm,
                        bf16=cfg.bf16,
                    )
                except DivergedError as exc:
                    raise DivergedError(
                        f"step {global_step + 1} (epoch {epoch + 1}, lr {lr:.3g}) diverged: {exc}. "
                        f"The step was not taken and nothing was saved from it; "
                        f"{_DIVERGED_ADVICE}"
                    ) from None
                loss = float(d.sum(loss_sum)) / n_real
                if not math.isfinite(loss):  # the same on every process: it was summed over them
                    raise DivergedError(
                        f"the training loss at step {global_step + 1} (epoch {epoch + 1}, "
                        f"lr {lr:.3g}) is {loss}; nothing was saved from it; "
                        f"{_DIVERGED_ADVICE}"
                    )
                global_step += 1
                step_in_epoch = k + 1
                elapsed = time.perf_counter() - t0
                history["train_time_s"] += elapsed
                history["examples"] += n_real
                examples_epoch += n_real
                history["steps"].append(
                    {"step": global_step, "epoch": epoch + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm}
                )
                bar.update(1)
                bar.set_postfix(
                    loss=f"{loss:.4f}", lr=f"{lr:.2e}", ex_s=f"{examples_epoch / (time.perf_counter() - t_epoch):.1f}"
                )
                stop_now = stop.requested or (cfg.stop_after_steps is not None and global_step >= cfg.stop_after_steps)
                if d.enabled:  # every process must agree to stop at the same step
                    stop_now = bool(d.sum(torch.tensor(float(stop_now))) > 0)
                if stop_now and global_step < total_steps:
                    bar.close()
                    save_last({"epoch": epoch, "step_in_epoch": step_in_epoch, "global_step": global_step})
                    status = "stopped"
                    break
                if cfg.save_steps and global_step % cfg.save_steps == 0:
                    save_last({"epoch": epoch, "step_in_epoch": step_in_epoch, "global_step": global_step})
                if global_step >= total_steps:
                    break
            bar.close()
            if status == "stopped":
                break
            run_evaluation()
            epoch, step_in_epoch = epoch + 1, 0
            save_last({"epoch": epoch, "step_in_epoch": 0, "global_step": global_step})

    metrics = metrics_doc(status)
    if status == "completed":
        if splits.test is not None:
            best = load_trained(out, hf_module, cfg.attn_implementation).to(d.device)
            test_collate = Collator(tokenizer, splits.test, cfg.max_length, names)
            metrics["test"] = evaluate(best, test_collate, names, d, cfg.eval_batch_size, cfg.bf16, desc="test")
        if cfg.compare_to and d.is_main:
            other_path = Path(cfg.compare_to) / METRICS_FILE
            try:
                other = json.loads(other_path.read_text(encoding="utf-8"))
                metrics["comparison"] = compare_runs(metrics, other)
                plot_curves(metrics, out / "comparison_curves.png", other)
            except (OSError, ValueError, KeyError, TypeError) as exc:  # never lose a finished run over it
                log.warning(
                    "compare_to: cannot compare with %s (%s: %s); the run itself is complete",
                    other_path,
                    type(exc).__name__,
                    exc,
                )
    metrics["wall_time_s"] = round(time.perf_counter() - t_start, 2)  # this invocation, data to test
    if d.is_main:
        write_json(metrics, out / METRICS_FILE)
        if metrics["steps"]:
            plot_curves(metrics, out / CURVES_FILE)
    d.barrier()
    return metrics


# Not --resume: it must keep the settings, so it would diverge again at the same step.
_DIVERGED_ADVICE = (
    "lower --lr, keep --max-grad-norm on (e.g. 1.0), or drop --bf16, and start again with "
    "--overwrite or in another --output-dir"
)


@contextlib.contextmanager
def _own_output_dir(out: Path):
    """Create `out`, lock it for this run (a second run into it is refused), and delete the
    temporaries a killed run left behind (`kill -9` cannot clean up after itself). The lock
    is an flock on the directory: the kernel drops it when its process dies, so a killed
    run never blocks the next."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out, os.O_RDONLY)
    except OSError as exc:
        raise FinetuneError(
            f"cannot create or open --output-dir {out} ({exc.strerror}); choose a directory you can write to"
        ) from None
    os.close(fd)
    if not os.access(out, os.W_OK):
        raise FinetuneError(f"--output-dir {out} is not writable; choose a directory you can write to")
    try:
        # The same lock as checkpoint saves take, re-entrant, so this run's own saves into
        # `out` nest inside it; another run is refused at once, and a save from another
        # process waits for this run to end.
        lock = ckpt.DirectoryLock(out, blocking=False)
    except BlockingIOError:
        raise FinetuneError(
            f"another bert-port-finetune is writing into {out} right now; wait for it to end or "
            "choose another --output-dir"
        ) from None
    try:
        # What killed saves left (`checkpoint.StagedWrite` and `data.write_texts` stage files
        # as hidden temporaries): a save killed after its commit is finished, the rest deleted.
        removed = size = 0
        for folder in (out, out / "data"):
            if folder.is_dir():
                count, nbytes = ckpt.tidy(folder)
                removed, size = removed + count, size + nbytes
        if removed:
            log.warning(
                "removed %d temporary file(s) (%.1f MiB) left in %s by an interrupted run", removed, size / 2**20, out
            )
        yield out
    finally:
        lock.release()


def _load_last(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 (torch raises many types for a damaged file)
        raise FinetuneError(
            f"cannot read {path} ({type(exc).__name__}: {str(exc)[:200]}); it is damaged. Start "
            "the run again with --overwrite, or in another --output-dir"
        ) from None


def _check_finite_weights(model: nn.Module, when: str) -> None:
    """No checkpoint is ever written from NaN or infinite weights."""
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise DivergedError(
            f"{len(bad)} weight tensor(s) hold NaN or Inf at {when} (e.g. {', '.join(bad[:3])}); "
            f"nothing was saved from them; {_DIVERGED_ADVICE}"
        )


def _check_resumable(state: dict[str, Any], cfg: FinetuneConfig, names: list[str], path: Path) -> None:
    if not isinstance(state, dict) or state.get("format") != 1:
        raise FinetuneError(f"{path} is not a checkpoint this version can resume from; start a new run")
    if state["labels"] != names:
        raise FinetuneError(
            f"{path} was trained with labels {state['labels']}, the data now gives {names}; resume "
            "with the same data or start a new --output-dir"
        )
    saved = state["config"]
    differ = [
        f"{k}: checkpoint {saved.get(k)!r}, now {getattr(cfg, k)!r}"
        for k in RESUME_MUST_MATCH
        if saved.get(k) != getattr(cfg, k)
    ]
    if differ:
        raise FinetuneError(
            f"cannot resume from {path}: these settings differ from the run that wrote it:\n  - "
            + "\n  - ".join(differ)
            + "\nResume with the same settings, or start a new --output-dir"
        )
