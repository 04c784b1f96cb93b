"""The comparison: per-site statistics of ours - reference (and of the reference spread) over
batches, and the same on every device x dtype (`check_matrix`).

A *site* is the embedding output, each layer's hidden state, `last_hidden_state` and
`pooler_output` on real tokens (gated by the tolerance), and the pad positions (reported
only). Each site's `Stats` hold the max and mean abs difference, the max relative difference,
the worst cosine and the share of the tolerance used, all in float64.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..tolerance import TOLERANCES, Tolerance
from .inputs import Batch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "int8": torch.int8,  # the port with quantization="int8" (CPU); the reference stays float32
}
INT8_ON_CPU_ONLY = "int8 runs on the CPU only (bert_port.speed)"


# Every compared tensor is a LayerNorm or tanh output, so O(1): the relative difference is
# taken over elements with |ref| >= REL_FLOOR, below which atol governs anyway.
REL_FLOOR = 1e-3

# -----------------------------------------------------------------------------------------
# Statistics


@dataclass
class Stats:
    """Running statistics of the difference between two sets of (n, H) vectors."""

    max_abs: float = 0.0
    sum_abs: float = 0.0
    count: int = 0  # finite elements compared
    max_rel: float = 0.0  # max |d| / |ref| over |ref| >= REL_FLOOR
    min_cos: float = 1.0  # worst cosine similarity of one token's vectors
    worst_ratio: float = 0.0  # max |d| / (atol + rtol |ref|): <= 1 is within tolerance
    worst_at: str = ""  # where worst_ratio occurred
    nonfinite: int = 0  # elements non-finite on one side only (or different non-finite values)

    @property
    def mean_abs(self) -> float:
        return self.sum_abs / self.count if self.count else 0.0

    def update(self, ours: Tensor, ref: Tensor, tol: Tolerance, locate: Callable[[int], str]) -> None:
        """Add (n, H) vectors; `locate(i)` describes vector i for `worst_at`."""
        if ours.numel() == 0:
            return
        a, b = ours.double(), ref.double()
        finite = torch.isfinite(a) & torch.isfinite(b)
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        self.nonfinite += int((~finite & ~same).sum())
        if self.nonfinite and not self.worst_at:
            row = int((~finite & ~same).any(dim=-1).nonzero()[0, 0])
            self.worst_at = f"non-finite at {locate(row)}"
        diff = torch.where(finite, (a - b).abs(), torch.zeros((), dtype=a.dtype, device=a.device))
        ref_abs = b.abs()
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.sum_abs += float(diff.sum())
        self.count += int(finite.sum())
        big = finite & (ref_abs >= REL_FLOOR)
        if bool(big.any()):
            self.max_rel = max(self.max_rel, float((diff[big] / ref_abs[big]).max()))
        bound = tol.atol + tol.rtol * ref_abs
        ratio = torch.where(diff == 0, torch.zeros_like(diff), diff / bound)  # d / 0 = inf: any d fails a 0 bound
        worst = int(ratio.argmax())
        if float(ratio.view(-1)[worst]) > self.worst_ratio:
            self.worst_ratio = float(ratio.view(-1)[worst])
            if not self.nonfinite:
                self.worst_at = locate(worst // a.shape[-1])
        rows = finite.all(dim=-1) & (diff != 0).any(dim=-1)  # identical vectors: cos = 1 exactly, not 1 - 1e-16
        if bool(rows.any()):
            cos = F.cosine_similarity(a[rows], b[rows], dim=-1, eps=1e-30)
            self.min_cos = min(self.min_cos, float(cos.min()))

    def within(self) -> bool:
        return self.nonfinite == 0 and self.worst_ratio <= 1.0  # NaN ratio compares False: fails

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_abs": _num(self.max_abs),
            "mean_abs": _num(self.mean_abs),
            "max_rel": _num(self.max_rel),
            "min_cos": _num(self.min_cos),
            "tolerance_used": _num(self.worst_ratio),
            "worst_at": self.worst_at,
            "elements": self.count,
            "nonfinite_mismatches": self.nonfinite,
        }


def _num(x: float) -> float | str:
    # JSON has no NaN/Infinity; write them as strings so the file stays standard.
    return x if math.isfinite(x) else str(x)


@dataclass
class Site:
    """One place where the two models are compared. `gated` sites must be within tolerance;
    the others (padding positions, whose values no caller reads) need only agree on
    finiteness and are reported for information."""

    name: str
    gated: bool
    ours: Stats = field(default_factory=Stats)
    spread: Stats | None = None

    @property
    def passed(self) -> bool:
        return self.ours.within() if self.gated else self.ours.nonfinite == 0


def _site_views(out: Any, mask: Tensor) -> list[tuple[str, bool, Tensor | None]]:
    """(site, gated, (n, H) vectors) for one model output; `mask` (B, T) bool, True = token."""
    hidden = getattr(out, "hidden_states", None)
    if hidden is None:
        raise ValueError(
            "a model returned no hidden_states: it must accept output_hidden_states=True and return "
            "hidden_states (embedding output first, then every layer), as transformers.BertModel does"
        )
    pooled = getattr(out, "pooler_output", None)
    return [
        ("embeddings", True, hidden[0][mask]),
        *((f"layer {i}", True, h[mask]) for i, h in enumerate(hidden[1:])),
        ("last_hidden_state", True, out.last_hidden_state[mask]),
        ("pooler_output", True, None if pooled is None else pooled[mask[:, 0]]),
        ("pad positions", False, out.last_hidden_state[~mask]),
    ]


def compare(
    ours: nn.Module,
    reference: nn.Module,
    batches: Iterable[Batch],
    *,
    tolerance: Tolerance,
    spread_reference: nn.Module | None = None,
    progress: bool = False,
    desc: str = "",
) -> list[Site]:
    """Run `ours`, `reference` (and `spread_reference`) on every batch, on the device of
    `ours`, and return per-site statistics of ours - reference (and spread - reference).

    Sites: "embeddings", "layer 0" ... "layer N-1" (the output of `bert_layers.i`, i.e.
    transformers' `encoder.layer.i`), "last_hidden_state" (all on real tokens),
    "pooler_output" (rows whose first token is real) and "pad positions" (the
    last_hidden_state at padding, for information)."""
    from tqdm.auto import tqdm

    device = next(ours.parameters()).device
    sites: dict[str, Site] = {}
    for batch in tqdm(batches, desc=desc, unit="batch", disable=not progress, leave=False):
        inputs = {k: v.to(device) for k, v in batch.inputs.items()}
        mask = inputs["attention_mask"].bool()  # (B, T)
        with torch.no_grad():
            models = [m for m in (ours, reference, spread_reference) if m is not None]
            outs = [m(**inputs, output_hidden_states=True) for m in models]
        views = [_site_views(o, mask) for o in outs]
        depths = [len(v) - 4 for v in views]  # embeddings, last, pooler and pads are not layers
        if len(set(depths)) > 1:
            raise ValueError(f"the models disagree on depth: {depths[0]} layers (ours) against {depths[1]}")
        # (row, position) of every compared vector, in the order boolean indexing yields them.
        where = {
            "pooler_output": [(r, 0) for r in mask[:, 0].nonzero()[:, 0].tolist()],
            "pad positions": (~mask).nonzero().tolist(),
        }
        real_tokens = mask.nonzero().tolist()
        for k, (name, gated, mine) in enumerate(views[0]):
            _, _, theirs = views[1][k]
            if (mine is None) != (theirs is None):
                side = "ours" if mine is None else "the reference"
                raise ValueError(f"{side} returns no {name} and the other does: build both with the same pooler")
            if mine is None:
                continue
            positions = where.get(name, real_tokens)

            def locate(i: int, positions=positions, batch=batch) -> str:
                row, pos = positions[i]
                return f"batch '{batch.name}' row {row} token {pos}"

            site = sites.setdefault(name, Site(name, gated, spread=Stats() if len(views) > 2 else None))
            site.ours.update(mine, theirs, tolerance, locate)
            if site.spread is not None:
                site.spread.update(views[2][k][2], theirs, tolerance, locate)
    return list(sites.values())


# -----------------------------------------------------------------------------------------
# The device x dtype matrix


@dataclass
class Row:
    """The comparison on one device in one dtype, or why it was skipped."""

    device: str
    dtype: str
    tolerance: Tolerance | None = None
    sites: list[Site] = field(default_factory=list)
    skipped: str | None = None
    seconds: float = 0.0

    @property
    def status(self) -> str:
        if self.skipped:
            return "SKIPPED"
        return "PASS" if all(s.passed for s in self.sites) else "FAIL"

    @property
    def first_failure(self) -> Site | None:
        return next((s for s in self.sites if not s.passed), None)


@dataclass
class Report:
    rows: list[Row]
    meta: dict[str, Any] = field(default_factory=dict)  # printed as "key: value" in the header

    @property
    def ran(self) -> list[Row]:
        return [r for r in self.rows if not r.skipped]

    @property
    def passed(self) -> bool:
        return bool(self.ran) and all(r.status == "PASS" for r in self.ran)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """Full-precision float32 matmuls (TF32 off on CUDA) for the duration, then restore."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def cuda_unavailable_reason() -> str | None:
    if torch.cuda.is_available():
        return None
    return "no CUDA device (torch.cuda.is_available() is False)"


def check_matrix(
    ours: nn.Module,
    reference: nn.Module,
    batches: Sequence[Batch],
    *,
    devices: Sequence[str],
    dtypes: Sequence[torch.dtype],
    tolerances: dict[torch.dtype, Tolerance] | None = None,
    spread_reference: nn.Module | None = None,
    progress: bool = False,
) -> list[Row]:
    """`compare` on copies of the models cast to every device x dtype. The models are left
    as they are; CUDA rows are skipped, with the reason, when no GPU is present. Float32
    runs with TF32 off."""
    tolerances = {**TOLERANCES, **(tolerances or {})}
    unknown = [dtype_name(d) for d in dtypes if d not in tolerances]
    if unknown:
        raise ValueError(f"no tolerance for {', '.join(unknown)}: pass tolerances={{dtype: Tolerance(atol, rtol)}}")
    rows = []
    for device in devices:
        unavailable = cuda_unavailable_reason() if device.startswith("cuda") else None
        for dtype in dtypes:
            int8_elsewhere = dtype == torch.int8 and device != "cpu"
            reason = unavailable or (INT8_ON_CPU_ONLY if int8_elsewhere else None)
            row = Row(device, dtype_name(dtype), tolerances[dtype], skipped=reason)
            rows.append(row)
            if reason:
                continue
            start = time.perf_counter()
            models = _copies(ours, reference, spread_reference, device, dtype)
            with exact_float32():
                row.sites = compare(
                    models[0],
                    models[1],
                    batches,
                    tolerance=row.tolerance,
                    spread_reference=models[2],
                    progress=progress,
                    desc=f"{device} {row.dtype}",
                )
            row.seconds = time.perf_counter() - start
            del models
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    return rows


def _copies(ours: nn.Module, reference: nn.Module, spread: nn.Module | None, device: str, dtype: torch.dtype) -> list:
    """The three models on `device` in `dtype`, copied (the originals are left as they are).
    int8: ours quantized from a float32 copy (`quantization.quantize_for_loading`: it calibrates
    with the tokenizer of the folder it was loaded from), the references in float32."""
    if dtype != torch.int8:
        return [
            None if m is None else copy.deepcopy(m).to(device=device, dtype=dtype).eval()
            for m in (ours, reference, spread)
        ]
    from ..speed.quantization import quantize_for_loading

    quantized = quantize_for_loading(copy.deepcopy(ours).float())
    return [quantized] + [None if m is None else copy.deepcopy(m).float().eval() for m in (reference, spread)]
