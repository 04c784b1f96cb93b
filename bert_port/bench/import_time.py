"""Import time of `bert_port` against `from transformers import BertModel`, each in a
fresh process (torch imported first and timed apart), and whether `import bert_port`
pulls in transformers.

Each measurement runs `import_probe.py` by path in a fresh process (see there why).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from .harness import progress

PROBE = Path(__file__).with_name("import_probe.py")


def probe(kind: str) -> dict[str, Any]:
    """Import times of `kind` ("port" or "transformers") in a fresh process."""
    out = subprocess.run([sys.executable, str(PROBE), kind], capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{PROBE} {kind} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def section_import(reps: int, report) -> dict[str, Any]:
    report.section("import time (fresh processes; torch imported first and timed apart)")
    runs: dict[str, list[dict]] = {"port": [], "transformers": []}
    for _ in progress(range(reps), "import"):
        for kind, rows in runs.items():
            rows.append(probe(kind))
    result = {
        kind: {
            "package_s": statistics.median(r["package_s"] for r in rows),
            "torch_s": statistics.median(r["torch_s"] for r in rows),
            "transformers_imported": any(r["transformers_imported"] for r in rows),
        }
        for kind, rows in runs.items()
    }
    p, t = result["port"], result["transformers"]
    report.table(
        ("import", "seconds (median)", "imports transformers"),
        (
            ("import torch", f"{p['torch_s']:.3f}", "no"),
            ("import bert_port (after torch)", f"{p['package_s']:.3f}", "YES" if p["transformers_imported"] else "no"),
            ("from transformers import BertModel (after torch)", f"{t['package_s']:.3f}", "yes"),
        ),
    )
    return result
