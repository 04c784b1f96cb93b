"""The Layout table of docs/architecture.md matches the tree, and no module is over the line cap.
The table names every module of `bert_port/` (by path, or as a member of a package row such as
`bert_port/bench/`), and every path it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _layout_rows() -> list[str]:
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = page.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `")]


def _named_paths(rows: list[str]) -> set[str]:
    """Every `path` in the first column, with `a.py`, `b.py` after a folder spelt out in it."""
    named = set()
    for row in rows:
        first = row.split("|")[1]
        folder = ""
        for token in re.findall(r"`([^`]+)`", first):
            if "/" in token:
                folder = token.rsplit("/", 1)[0] + "/" if not token.endswith("/") else token
                named.add(token)
            else:
                named.add(folder + token)
    return named


def test_every_module_is_in_the_layout_table_and_every_row_exists():
    rows = _layout_rows()
    named = _named_paths(rows)
    packages = {p for p in named if p.endswith("/")}
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "bert_port").rglob("*.py") if p.name != "__init__.py"}
    unnamed = sorted(m for m in modules if m not in named and not any(m.startswith(pkg) for pkg in packages))
    assert not unnamed, f"modules missing from the Layout table of docs/architecture.md: {unnamed}"
    for path in sorted(named):
        if "*" not in path:
            assert (ROOT / path).exists(), f"docs/architecture.md's Layout table names {path}, which does not exist"
    # Modules of a package row are each named in its description, so the row says what they do.
    for row in rows:
        first, what = row.split("|")[1], row.split("|")[2]
        for pkg in re.findall(r"`(bert_port/\w+/)`", first):
            members = {p.stem for p in (ROOT / pkg).glob("*.py") if p.name != "__init__.py"}
            missing = sorted(m for m in members if f"`{m}`" not in what)
            assert not missing, f"the row for {pkg} does not name {missing}"


MAX_LINES = 450  # a module a reader takes in at one sitting; split by job, not by line count


def test_no_module_is_over_the_line_cap():
    files = [*(ROOT / "bert_port").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]
    over = {
        str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not over, f"modules over {MAX_LINES} lines (split them by job, along the direction of dependency): {over}"


def test_every_package_is_listed_for_the_wheel():
    """pyproject.toml lists the packages (configs/ maps to one, so none is discovered): a package
    left off is missing from the wheel, which `make wheel-check` finds only at the end of CI."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "bert_port").rglob("__init__.py")}
    assert found <= listed, (
        f"packages missing from pyproject.toml's [tool.setuptools] packages: {sorted(found - listed)}"
    )
