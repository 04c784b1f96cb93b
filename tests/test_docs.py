"""Every ```python and ```bash block of README.md and docs/*.md runs as written.

Each block runs on its own (a fresh `python` for a Python block, `bash -euo pipefail` for a
shell one), so a reader can copy any one block: it must carry its own imports. The blocks of
one page share a temporary working folder, in page order, so a later block may read what an
earlier one wrote (`runs/sms`, `texts.csv`); `docs/`, `configs/` and `scripts/` are linked into
it, so a block reads as if run from the checkout's root. They run on the bundled checkpoint and
data; the console scripts and `python` are this interpreter's. A block that cannot run here (it installs
packages, needs a GPU, a model id that is not bundled, or a run of many minutes) carries the
line `<!-- docs-check: skip (the reason) -->` right before its opening fence, and is reported
as skipped with that reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"<!--\s*docs-check:\s*skip\s*\((?P<why>[^)]+)\)\s*-->")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
RUN_LANGS = {"python": "python", "bash": "bash"}
BLOCK_TIMEOUT_S = 300
CHECKOUT_FOLDERS = ("docs", "configs", "scripts")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the line of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of a page, in order, each with the skip reason on the line before it."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{page.name}:{i + 1}: a code block that is never closed"
        before = lines[i - 1] if i > 0 else ""
        marker = SKIP.search(before)
        assert marker or "docs-check" not in before, f"{page.name}:{i}: write `<!-- docs-check: skip (why) -->`"
        found.append(
            Block(page, i + 1, opening["lang"], "\n".join(lines[i + 1 : end]) + "\n", marker and marker["why"])
        )
        i = end + 1
    return found


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def run_block(block: Block, cwd: Path) -> subprocess.CompletedProcess:
    if block.lang == "python":
        command = [sys.executable, "-c", block.code]
    else:
        command = ["bash", "-euo", "pipefail", "-c", block.code]
    return subprocess.run(
        command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, check=False
    )


def test_blocks_are_found_and_every_language_is_known():
    every = [b for page in PAGES for b in blocks_of(page)]
    assert sum(b.page.name == "README.md" for b in every) >= 5
    unknown = sorted({b.name for b in every if b.lang not in (*RUN_LANGS, "text", "json")})
    assert not unknown, f"code blocks without a language this check knows (python, bash, text, json): {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_block_runs(page: Path, tmp_path: Path):
    for folder in CHECKOUT_FOLDERS:
        (tmp_path / folder).symlink_to(ROOT / folder, target_is_directory=True)
    ran, skipped = [], []
    for block in blocks_of(page):
        if block.lang not in RUN_LANGS:
            continue
        if block.skip:
            skipped.append(f"{block.name} ({block.skip})")
            continue
        result = run_block(block, tmp_path)
        assert result.returncode == 0, (
            f"the code block at {block.name} failed (exit {result.returncode}):\n{block.code}\n"
            f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
        )
        ran.append(block.name)
    print(f"{page.name}: ran {len(ran)}, skipped {len(skipped)}: {skipped}")
