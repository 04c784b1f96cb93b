"""The pieces of one optimiser step: processes and devices, RNG state, AdamW, the learning-
rate schedules of transformers' `get_scheduler`, and `train_step` (accumulation, autocast,
the fp16 gradient scaler, clipping, the divergence check).

Batches. `batch_size` is the *global* batch of one optimiser step. It is split into
`grad_accum_steps` micro-batches and across the processes of a torchrun job, so the same
`batch_size` gives the same run whatever the number of processes or accumulation steps:
every process draws from the same seeded permutation (`DistributedSampler`, which hands
process r the positions r, r + W, r + 2W, ...), so optimiser step k sees exactly the
examples at positions [k*B, (k+1)*B) of that permutation, and each example's loss is
divided by the number of real examples in the step (the sampler's padding repeats, when
len(train) is not a multiple of W, get weight 0). Only float rounding differs. Dropout
masks are drawn per process, so runs with dropout > 0 agree in distribution, not bitwise.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import random
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data.distributed import DistributedSampler

from ..devices import resolve_device
from ..losses import per_example_loss
from ..problem import ProblemType
from .settings import FinetuneError, TrainingSettings

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

log = logging.getLogger(__name__)

# Not --resume: it must keep the settings, so it would diverge again at the same step.
DIVERGED_ADVICE = (
    "lower --lr, keep --max-grad-norm on (e.g. 1.0), or drop --bf16, and start again with "
    "--overwrite or in another --output-dir"
)


class DivergedError(FinetuneError):
    """The loss or the gradient became NaN or infinite: nothing is saved from such a step."""


def check_finite_weights(model: nn.Module, when: str) -> None:
    """No checkpoint is ever written from NaN or infinite weights."""
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise DivergedError(
            f"{len(bad)} weight tensor(s) hold NaN or Inf at {when} (e.g. {', '.join(bad[:3])}); "
            f"nothing was saved from them; {DIVERGED_ADVICE}"
        )


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
    NCCL on CUDA, gloo on the CPU. `device` is a `--device` string (`devices.resolve_device`);
    "auto" and "cuda" give each process the GPU of its local rank, "cuda:N" GPU N."""
    try:
        resolved = resolve_device(device, what="--device")
    except ValueError as exc:
        raise FinetuneError(str(exc)) from None
    if resolved.type not in ("cpu", "cuda"):
        raise FinetuneError(f"--device {device!r} gives {resolved}; fine-tuning runs on 'cpu' or 'cuda[:N]'")
    use_cuda = resolved.type == "cuda"
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        index = resolved.index if resolved.index is not None else local_rank
        if index >= torch.cuda.device_count():
            raise FinetuneError(
                f"process {rank} wants cuda:{index} (its local rank), but this machine has "
                f"{torch.cuda.device_count()} CUDA device(s); start at most that many processes per node"
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


class StopRequest:
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


class ResumableSampler(DistributedSampler):
    """`DistributedSampler` that can start part-way into an epoch (resume): `start` positions
    of this process's share are skipped."""

    start = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.start :])

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start)


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


# -----------------------------------------------------------------------------------------
# Optimiser and schedule


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on weight matrices and embeddings; none on biases and
    LayerNorm parameters (as BERT was trained and HF's Trainer does). Frozen parameters
    are left out, and a tied parameter (an MLM decoder's weight is the word embedding) is
    listed once, under its first name, as `model.named_parameters()` gives it to the Trainer:
    twice, AdamW would take its step twice. Each group carries the names under "names"."""
    decay: dict[str, nn.Parameter] = {}
    no_decay: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            full = f"{module_name}.{name}" if module_name else name
            (no_decay if isinstance(module, nn.LayerNorm) or name == "bias" else decay)[full] = param
    return [
        {"params": list(decay.values()), "names": list(decay), "weight_decay": weight_decay},
        {"params": list(no_decay.values()), "names": list(no_decay), "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: TrainingSettings) -> torch.optim.AdamW:
    groups = param_groups(model, cfg.weight_decay)
    params = [p for g in groups for p in g["params"]]
    # The fused kernel: one pass over each tensor instead of a dozen (a large gain on the CPU,
    # where MiniLM's (30522, 384) word embeddings are half its parameters; see the bench).
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=fused or None
    )


# The factor of the peak learning rate at (0-based) step s: transformers' formulas
# (`transformers.optimization`), as module-level functions so that the schedule pickles
# into the resumable checkpoint. Warmup rises from 0: step 0 runs at lr 0, as in transformers.
def _warmup(step: int, warmup: int) -> float:
    return step / max(1, warmup)


def linear_factor(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def cosine_factor(step: int, *, warmup: int, total: int) -> float:
    """Half a cosine from the peak to 0 after warmup (transformers' num_cycles=0.5)."""
    if step < warmup:
        return _warmup(step, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def constant_factor(step: int, *, warmup: int, total: int) -> float:
    return 1.0  # transformers' "constant" has no warmup either


def constant_with_warmup_factor(step: int, *, warmup: int, total: int) -> float:
    return _warmup(step, warmup) if step < warmup else 1.0


SCHEDULES = {
    "linear": linear_factor,
    "cosine": cosine_factor,
    "constant": constant_factor,
    "constant_with_warmup": constant_with_warmup_factor,
}


def resolve_warmup(warmup_steps: int | None, warmup_ratio: float, total_steps: int) -> int:
    """The warmup of a run of `total_steps`: `warmup_steps` when set, else ceil(`warmup_ratio` *
    total), as transformers' `TrainingArguments.get_warmup_steps`; never more than the run."""
    warmup = warmup_steps if warmup_steps is not None else math.ceil(warmup_ratio * total_steps)
    return min(warmup, total_steps)


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, kind: str = "linear"
) -> LambdaLR:
    """The learning-rate schedule `kind` (a `--lr-scheduler-type`): the same factors as
    transformers' `get_scheduler(kind, optimizer, warmup_steps, total_steps)`."""
    if kind not in SCHEDULES:
        raise FinetuneError(f"unknown lr_scheduler_type {kind!r}; use one of {', '.join(SCHEDULES)}")
    return LambdaLR(optimizer, functools.partial(SCHEDULES[kind], warmup=warmup_steps, total=total_steps))


# -----------------------------------------------------------------------------------------
# One step


def autocast(device: torch.device, bf16: bool = False, fp16: bool = False):
    """The forward pass's autocast: bf16 or fp16 (weights and optimiser stay fp32)."""
    dtype = torch.float16 if fp16 else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=bf16 or fp16)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LambdaLR | None,
    micro_batches: list[dict[str, Tensor]],
    weights: list[Tensor],
    n_real: int,
    *,
    problem_type: str = ProblemType.SINGLE_LABEL,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
    world_size: int = 1,
    max_grad_norm: float = 1.0,
    bf16: bool = False,
    scaler: torch.amp.GradScaler | None = None,
) -> tuple[Tensor, float | None]:
    """One optimiser step over the micro-batches this process holds. `weights` (one (b,)
    tensor per micro-batch) are 1 for real examples, 0 for sampler padding; `n_real` is the
    number of real examples in the *global* step (of their target tokens, for a language
    model's `loss_fn`). Each example's loss is divided by
    `n_real` (times `world_size`, since DDP averages gradients over processes), so the
    gradient is the mean over the global batch however it is split. With `scaler` (fp16),
    the loss is scaled, and a step whose gradient overflowed is skipped (and the scale
    lowered) rather than called diverged, as fp16 training expects now and then.
    `loss_fn(logits, labels)` (fp32 logits) gives each example's loss, (b,), in place of
    `problem_type`'s: a language model's sums over its tokens (`lm_data.token_losses`).

    Returns this process's summed loss of real examples (a 0-d tensor) and the gradient
    norm before clipping (None when clipping is off)."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=micro_batches[0]["input_ids"].device)
    fp16 = scaler is not None
    for i, (batch, weight) in enumerate(zip(micro_batches, weights)):
        last = i == len(micro_batches) - 1
        # Accumulating micro-batches skip DDP's gradient all-reduce until the last one.
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with autocast(loss_sum.device, bf16=bf16, fp16=fp16):
                logits = model(
                    input_ids=batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    token_type_ids=batch["token_type_ids"],
                ).logits
            if loss_fn is None:
                losses = per_example_loss(logits.float(), batch["labels"], problem_type)  # (b,)
            else:
                losses = loss_fn(logits.float(), batch["labels"])
            loss = (losses * weight).sum() * (world_size / n_real)
            (scaler.scale(loss) if fp16 else loss).backward()
        loss_sum += (losses.detach() * weight).sum().double()
    return loss_sum, _clip_and_step(optimizer, scheduler, max_grad_norm, scaler)


def _clip_and_step(
    optimizer: torch.optim.Optimizer,
    scheduler: LambdaLR | None,
    max_grad_norm: float,
    scaler: torch.amp.GradScaler | None,
) -> float | None:
    """Clip the accumulated gradient, check it, and take the optimiser and schedule step.
    Returns the gradient norm before clipping (None when clipping is off)."""
    fp16 = scaler is not None
    if fp16:
        scaler.unscale_(optimizer)  # clip and report the true gradient
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
    if fp16:
        scale = scaler.get_scale()
        scaler.step(optimizer)  # skipped when the gradient holds Inf/NaN
        scaler.update()
        if scheduler is not None and scaler.get_scale() >= scale:  # as transformers: no schedule step when skipped
            scheduler.step()
    elif not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        raise DivergedError(f"the gradient norm is {norm}")
    else:
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm
