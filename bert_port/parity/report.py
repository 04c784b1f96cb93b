"""The parity report: the terminal tables, the JSON of every figure, and the plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .compare import Report, Row

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


HEADER = (
    f"  {'site':<19}{'max abs':>10}{'mean abs':>10}{'max rel':>10}{'1-cos':>10}"
    f" |{'spread max':>11}{'spread 1-cos':>13} |{'tol used':>9}{'spread':>8}"
)


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
    skipped_devices = set()
    for row in report.rows:
        if not row.skipped:
            lines += ["", *_row_table(row)]
        elif row.device not in skipped_devices:
            skipped_devices.add(row.device)
            dtypes = ", ".join(r.dtype for r in report.rows if r.device == row.device and r.skipped)
            lines += ["", f"{row.device} ({dtypes}): SKIPPED, {row.skipped}"]
    return "\n".join(lines + ["", *_summary(report)])


def _row_table(row: Row) -> list[str]:
    """One device x dtype: its status line, one line per site, the failure if any."""
    lines = [f"{row.device} {row.dtype}: {row.status}   tolerance {row.tolerance}   ({row.seconds:.1f} s)", HEADER]
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
    return lines


def _summary(report: Report) -> list[str]:
    """One line per device x dtype, then the verdict (and, on a FAIL between two checkpoints
    whose configs differ, those fields as the likely causes)."""
    lines = ["summary"]
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
        return [*lines, "NOTHING COMPARED: every requested row was skipped"]
    if report.passed:
        return [*lines, f"PASS: {len(ran)} of {len(ran)} device x dtype rows within tolerance at every site"]
    failed = [f"{r.device} {r.dtype}" for r in ran if r.status == "FAIL"]
    lines.append(f"FAIL: {len(failed)} of {len(ran)} device x dtype rows out of tolerance ({', '.join(failed)})")
    if "config_differences" in report.meta:
        lines.append(f"likely causes: the two checkpoints' configs differ in {report.meta['config_differences']}")
    return lines


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
    from ..extras import require

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
