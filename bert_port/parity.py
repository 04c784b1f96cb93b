"""Layer-by-layer parity of the port with a reference BERT, and the report.

`compare` runs our model and a reference model on the same batches and measures, at every
*site* (the embedding output, each layer's hidden state, `last_hidden_state` and
`pooler_output`), how far apart they are. The reference is any module that takes the same
inputs and returns `hidden_states` (embeddings first) and `pooler_output` with
`output_hidden_states=True`: `transformers.BertModel`, another port, or a test double. An
optional third model, the reference under the other attention implementation, gives the
*reference spread*: how far the reference is from itself when only the attention kernel
changes. The tolerances are the project's policy (`tolerance.py`); the report prints
that spread beside our difference.

`check_matrix` repeats `compare` per device and dtype; `format_report`, `report_to_json`
and `plot_report` present the result. Nothing here imports `transformers`: the CLI
(`bert_port/cli/parity.py`) builds the reference and passes it in.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .tokenization import encode
from .tolerance import TOLERANCES, Tolerance

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
DEVICES = ("cpu", "cuda")


# Every compared tensor is a LayerNorm or tanh output, so O(1): the relative difference is
# taken over elements with |ref| >= REL_FLOOR, below which atol governs anyway.
REL_FLOOR = 1e-3

# Built-in real text: movie-review sentences (MR), SMS messages, news and technical prose,
# accents, CJK, numbers and punctuation, of varied lengths, and sentence pairs.
DEFAULT_TEXTS: tuple[str, ...] = (
    (
        "the rock is destined to be the 21st century's new \" conan \" and that he's going to make a splash even "
        "greater than arnold schwarzenegger , jean-claud van damme or steven segal ."
    ),
    (
        'the gorgeously elaborate continuation of " the lord of the rings " trilogy is so huge that a column of words '
        "cannot adequately describe co-writer/director peter jackson's expanded vision of j . r . r . tolkien's "
        "middle-earth ."
    ),
    "simplistic , silly and tedious .",
    "A gripping, beautifully shot film that never lets go.",
    "I wouldn't recommend this restaurant to anyone.",
    "Go until jurong point, crazy.. Available only in bugis n great world la e buffet... Cine there got amore wat...",
    "WINNER!! As a valued network customer you have been selected to receive a £900 prize reward! Call 09061701461.",
    "Ok lar... Joking wif u oni...",
    "naïve café owners' résumé: Ünïcödé and 中文 characters, too!",
    "The Federal Reserve held interest rates steady on Wednesday, citing a slowing labour market.",
    "BERT encodes each token in the context of the whole sentence, left and right.",
    "ok",
)
DEFAULT_PAIRS: tuple[tuple[str, str], ...] = (
    ("A man is playing a guitar on stage.", "Someone performs music in front of an audience."),
    ("The cat sat on the mat.", "A dog barked at the mailman all morning long."),
    ("How do I reset my password?", "Click 'Forgot password' on the sign-in page and follow the e-mail link."),
    ("Paris is the capital of France.", "Paris est la capitale de la France."),
)


# -----------------------------------------------------------------------------------------
# Inputs


@dataclass
class Batch:
    """One batch of model inputs ((B, T) long tensors) with a name for the report."""

    name: str
    inputs: dict[str, Tensor]

    @property
    def rows(self) -> int:
        return int(self.inputs["input_ids"].shape[0])

    @property
    def real_tokens(self) -> int:
        return int(self.inputs["attention_mask"].sum())

    @property
    def pad_tokens(self) -> int:
        return int(self.inputs["attention_mask"].numel()) - self.real_tokens


def read_texts_file(path: str | Path) -> list[tuple[str, str | None]]:
    """Read one example per line: a text, or a sentence pair as two tab-separated segments.
    Blank lines are skipped. Raises `ValueError` naming the offending line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ValueError(f"--texts-file {path} does not exist") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--texts-file {path} is not UTF-8 text ({exc}); re-save it as UTF-8") from None
    examples: list[tuple[str, str | None]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) > 2:
            raise ValueError(
                f"{path}, line {number}: {len(fields)} tab-separated fields; expected one (a text) or two "
                "(a sentence pair). Remove label or id columns first"
            )
        first = fields[0].strip()
        second = fields[1].strip() if len(fields) == 2 else ""
        if not first:
            raise ValueError(f"{path}, line {number}: the first segment is empty")
        examples.append((first, second or None))
    if not examples:
        raise ValueError(f"--texts-file {path} holds no text: write one text (or tab-separated pair) per line")
    return examples


def build_batches(
    tokenizer,
    examples: Sequence[tuple[str, str | None]],
    *,
    batch_size: int,
    max_length: int,
    adversarial: bool = True,
) -> list[Batch]:
    """Tokenize `examples` ((text, second segment or None)) into batches of `batch_size`,
    single texts and pairs batched apart; then, with `adversarial`, the edge cases:
    a row of exactly `max_length` real tokens, a batch holding an all-padding row and a
    row whose only real token is [CLS], and a batch of one one-token sequence (T = 1)."""
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    batches = []
    singles = [a for a, b in examples if b is None]
    pairs = [(a, b) for a, b in examples if b is not None]
    for start in range(0, len(singles), batch_size):
        chunk = singles[start : start + batch_size]
        inputs = encode(tokenizer, chunk, max_length=max_length)
        batches.append(Batch(f"texts {start + 1}-{start + len(chunk)}", inputs))
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        inputs = encode(tokenizer, [a for a, _ in chunk], [b for _, b in chunk], max_length=max_length)
        batches.append(Batch(f"pairs {start + 1}-{start + len(chunk)}", inputs))
    if adversarial:
        batches += adversarial_batches(tokenizer, max_length)
    return batches


def adversarial_batches(tokenizer, max_length: int) -> list[Batch]:
    """The built-in edge cases (see `build_batches`)."""
    text = " ".join(DEFAULT_TEXTS)
    while len(tokenizer.encode(text).ids) < max_length:
        text = f"{text} {text}"
    longest = encode(tokenizer, [text], max_length=max_length)  # (1, max_length)

    edge = encode(tokenizer, [DEFAULT_TEXTS[3], "", ""])  # real row + two rows to overwrite, (3, T)
    pad_id = tokenizer.token_to_id("[PAD]") or 0
    cls_id = int(edge["input_ids"][0, 0])
    edge["input_ids"][1:] = pad_id
    edge["attention_mask"][1:] = 0
    edge["token_type_ids"][1:] = 0
    edge["input_ids"][2, 0] = cls_id  # row 2: [CLS] alone, the rest padding
    edge["attention_mask"][2, 0] = 1

    one = {
        "input_ids": torch.tensor([[cls_id]]),
        "token_type_ids": torch.zeros(1, 1, dtype=torch.long),
        "attention_mask": torch.ones(1, 1, dtype=torch.long),
    }
    return [
        Batch(f"max-length row (T={longest['input_ids'].shape[1]})", longest),
        Batch("all-pad row + [CLS]-only row", edge),
        Batch("one token (T=1)", one),
    ]


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
        reason = cuda_unavailable_reason() if device.startswith("cuda") else None
        for dtype in dtypes:
            row = Row(device, dtype_name(dtype), tolerances[dtype], skipped=reason)
            rows.append(row)
            if reason:
                continue
            start = time.perf_counter()
            models = [
                None if m is None else copy.deepcopy(m).to(device=device, dtype=dtype).eval()
                for m in (ours, reference, spread_reference)
            ]
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


# -----------------------------------------------------------------------------------------
# Presentation


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.2e}"


def _ratio(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    return f"{x:.3f}" if x < 100 else f"{x:.3g}"


def describe_failure(row: Row) -> str:
    site = row.first_failure
    if site is None:
        return ""
    if site.ours.nonfinite:
        return f"first failing site: {site.name} ({site.ours.nonfinite} non-finite mismatches, {site.ours.worst_at})"
    return (
        f"first failing site: {site.name} (max abs {_fmt(site.ours.max_abs)}, "
        f"{_ratio(site.ours.worst_ratio)}x the tolerance, at {site.ours.worst_at})"
    )


def _worst(row: Row, side: str) -> float:
    stats = [getattr(s, side) for s in row.sites if s.gated and getattr(s, side) is not None]
    return max((st.worst_ratio for st in stats), default=0.0)


def format_report(report: Report) -> str:
    """The terminal report: a header, one table per device x dtype, and a summary."""
    lines = ["bert-port parity: bert_port.BertModel against the reference, site by site"]
    width = max((len(k) for k in report.meta), default=0)
    lines += [f"  {k:<{width}}  {v}" for k, v in report.meta.items()]
    lines += [
        "  columns: ours - reference over real tokens; '1-cos': 1 - the worst token's cosine similarity;",
        "  'spread': the reference against itself under the other attention implementation;",
        "  'tol used': max |d| / (atol + rtol |ref|) for ours and for the spread; a site passes at <= 1.",
    ]
    header = (
        f"  {'site':<19}{'max abs':>10}{'mean abs':>10}{'max rel':>10}{'1-cos':>10}"
        f" |{'spread max':>11}{'spread 1-cos':>13} |{'tol used':>9}{'spread':>8}"
    )
    skipped_devices = set()
    for row in report.rows:
        if row.skipped:
            if row.device not in skipped_devices:
                skipped_devices.add(row.device)
                dtypes = ", ".join(r.dtype for r in report.rows if r.device == row.device and r.skipped)
                lines += ["", f"{row.device} ({dtypes}): SKIPPED, {row.skipped}"]
            continue
        lines += ["", f"{row.device} {row.dtype}: {row.status}   tolerance {row.tolerance}   ({row.seconds:.1f} s)"]
        lines.append(header)
        for site in row.sites:
            o, s = site.ours, site.spread
            spread = f"{_fmt(s.max_abs):>11}{_fmt(1 - s.min_cos):>13}" if s else f"{'-':>11}{'-':>13}"
            if site.gated:
                used = f"{_ratio(o.worst_ratio):>9}{_ratio(s.worst_ratio) if s else '-':>8}"
            else:
                used = f"{'info':>9}{'info':>8}"
            name = site.name if site.gated else f"{site.name} *"
            lines.append(
                f"  {name:<19}{_fmt(o.max_abs):>10}{_fmt(o.mean_abs):>10}{_fmt(o.max_rel):>10}{_fmt(1 - o.min_cos):>10}"
                f" |{spread} |{used}" + ("   <- FAIL" if not site.passed else "")
            )
        lines.append(
            "  * last_hidden_state at padding: values no caller reads (the port's default unpadded path "
            "writes zeros there); they must only agree on NaN/Inf."
        )
        if row.status == "FAIL":
            lines.append(f"  {describe_failure(row)}")
    lines += ["", "summary"]
    skipped_devices = set()
    for row in report.rows:
        if row.skipped:
            if row.device not in skipped_devices:
                skipped_devices.add(row.device)
                lines.append(f"  {row.device:<5}{'all':<10}{'SKIPPED':<9}{row.skipped}")
            continue
        detail = describe_failure(row) or (
            f"worst site uses {_ratio(_worst(row, 'ours'))} of the tolerance"
            + (f" (transformers' own spread: {_ratio(_worst(row, 'spread'))})" if row.sites[0].spread else "")
        )
        lines.append(f"  {row.device:<5}{row.dtype:<10}{row.status:<9}{detail}")
    ran = report.ran
    if not ran:
        lines.append("NOTHING COMPARED: every requested row was skipped")
    elif report.passed:
        lines.append(f"PASS: {len(ran)} of {len(ran)} device x dtype rows within tolerance at every site")
    else:
        failed = [f"{r.device} {r.dtype}" for r in ran if r.status == "FAIL"]
        lines.append(f"FAIL: {len(failed)} of {len(ran)} device x dtype rows out of tolerance ({', '.join(failed)})")
    return "\n".join(lines)


def report_to_json(report: Report) -> dict[str, Any]:
    """Every figure of the report, as a JSON-ready dict."""
    return {
        "passed": report.passed,
        "meta": report.meta,
        "rows": [
            {
                "device": r.device,
                "dtype": r.dtype,
                "status": r.status,
                "skipped": r.skipped,
                "seconds": r.seconds,
                "tolerance": None if r.tolerance is None else {"atol": r.tolerance.atol, "rtol": r.tolerance.rtol},
                "first_failing_site": r.first_failure.name if r.first_failure else None,
                "sites": [
                    {
                        "name": s.name,
                        "gated": s.gated,
                        "passed": s.passed,
                        "ours": s.ours.to_dict(),
                        "spread": None if s.spread is None else s.spread.to_dict(),
                    }
                    for s in r.sites
                ],
            }
            for r in report.rows
        ],
    }


def plot_report(report: Report, path: str | Path) -> Path:
    """PNG: per site, max abs difference (left) and share of tolerance used (right), log
    scale, one colour per device x dtype; solid ours, dashed the reference spread. Needs
    matplotlib (`pip install 'bert-port[plot]'`); raises `MissingExtra` without it."""
    from .extras import require

    matplotlib = require("matplotlib", "the parity plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = 1e-12  # exact zeros (bit-identical results) are drawn here
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    names = []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, row in enumerate(report.ran):
        # Distinct colours, markers and shrinking sizes keep rows visible where they coincide
        # (e.g. every dtype bit-identical, all drawn at the floor).
        color, marker, size = colors[n % len(colors)], "osD^vP*X"[n % 8], max(9 - 1.5 * n, 3)
        gated = [s for s in row.sites if s.gated]
        names = [s.name.replace("last_hidden_state", "last hidden").replace("pooler_output", "pooler") for s in gated]
        x = range(len(gated))
        label = f"{row.device} {row.dtype}"
        for ax, key in ((axes[0], "max_abs"), (axes[1], "worst_ratio")):
            ours = [max(getattr(s.ours, key), floor) for s in gated]
            ax.plot(x, ours, "-", marker=marker, markersize=size, color=color, label=f"{label}: ours")
            if all(s.spread is not None for s in gated):
                spread = [max(getattr(s.spread, key), floor) for s in gated]
                ax.plot(x, spread, "--", color=color, alpha=0.6, label=f"{label}: reference spread")
    for ax, title in ((axes[0], "max |ours - reference| (real tokens)"), (axes[1], "share of tolerance used")):
        ax.set_yscale("log")
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylim(bottom=floor / 3)
    axes[1].axhline(1.0, color="red", linewidth=1, label="tolerance")
    axes[0].text(
        0.01, 0.97, f"0 (bit-identical) is drawn at {floor:g}", transform=axes[0].transAxes, fontsize=8, va="top"
    )
    axes[1].legend(fontsize=7, loc="best")
    fig.suptitle(f"bert_port parity: {report.meta.get('checkpoint', '')}", fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
