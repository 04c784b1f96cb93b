"""The package's imports go one way: no import circle, and no import that climbs the layers.

Every module's imports are read with `ast`, those inside functions and under
`TYPE_CHECKING` included (a circle through a function is still a circle at run time, and a
type-only import still ties the two modules together). Layers, lowest first (the table in
docs/architecture.md): the model and everything it uses < loading and saving < training,
embedding (`embed/`, `sentence`), parity < commands, benchmarks and the package's facade
(`bert_port/__init__.py`, the public API, which the commands may use).
A module may import from its own layer or a lower one.

The circles and climbs that existed when this test was written are allowlisted below, each
to be removed; the test fails on any new one, on a known circle that grows, and on an
allowlist entry that no longer exists (delete it, so it cannot come back unnoticed).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "bert_port"

# Layer of a module by its dotted name's prefix; the first match wins, unmatched is the model (0).
LAYERS = [
    ("bert_port.cli", 3),
    ("bert_port.bench", 3),
    ("bert_port.training", 2),
    ("bert_port.embed", 2),
    ("bert_port.parity", 2),
    ("bert_port.reference", 2),
    ("bert_port.sentence", 2),
    ("bert_port.sentence_api", 2),
    ("bert_port.similarity", 2),
    ("bert_port.loading", 1),
    ("bert_port.saving", 1),
    ("bert_port.loader_arguments", 1),
    ("bert_port.checkpoint", 1),
]
LAYER_NAMES = {0: "model", 1: "loading/saving", 2: "training/embed/sentence/parity", 3: "cli/bench/facade"}

# Known circles (issue 40), each to be removed by splitting the modules that form it.
KNOWN_CIRCLES: list[frozenset[str]] = [
    # the loader and saver are typed on the model class and read its class attributes; the loader
    # applies the speed layer (bert_port.speed), whose modules subclass the model's, so the model
    # classes' from_pretrained reaches them through it
    frozenset(
        {
            "bert_port.base_bert",
            "bert_port.loading",
            "bert_port.saving",
            "bert_port.loader_arguments",
            "bert_port.bert",
            "bert_port.speed",
            "bert_port.speed.layers",
            "bert_port.speed.quantization",
        }
    ),
    frozenset({"bert_port.heads", "bert_port.generation"}),
]

# Known climbs (importer, imported), each to be removed.
KNOWN_CLIMBS: set[tuple[str, str]] = {
    # the model's base class calls the loader and saver: type them on a small protocol instead
    ("bert_port.base_bert", "bert_port.loading"),
    ("bert_port.base_bert", "bert_port.saving"),
    # the readers' writers use checkpoint.atomic_write: move the staged write below both
    ("bert_port.records", "bert_port.checkpoint"),
    ("bert_port.tagged", "bert_port.checkpoint"),
    # TokenizerError subclasses CheckpointError, which pulls in the whole checkpoint package
    ("bert_port.tokenization", "bert_port.checkpoint"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(name: str) -> int:
    if name == "bert_port":
        return 3
    return next((n for prefix, n in LAYERS if name == prefix or name.startswith(prefix + ".")), 0)


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports anywhere in its source; `from pkg import sub`
    counts as importing the submodule `pkg.sub` when there is one, else `pkg` itself."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "bert_port"}
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(node, name, path.name == "__init__.py")
            if target.split(".")[0] != "bert_port":
                continue
            subs = {f"{target}.{a.name}" for a in node.names} & known
            found |= subs or {target}
            if len(subs) < len(node.names):
                found.add(target)
    return (found & known) - {name}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def climbs(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in graph.items() for b in targets if layer(b) > layer(a)}


def test_the_import_graph_is_read():
    graph = import_graph()
    assert "bert_port.bert" in graph["bert_port.heads"]
    assert "bert_port.checkpoint.keys" in graph["bert_port.loading"] | graph["bert_port.checkpoint"]
    # an import inside a function counts
    assert any(graph[m] for m in graph if m.startswith("bert_port.cli."))


def test_no_new_import_circle():
    found = circles(import_graph())
    new = [sorted(c) for c in found if c not in KNOWN_CIRCLES]
    assert not new, f"import circles (split a module, or move the shared piece down a layer): {new}"
    gone = [sorted(c) for c in KNOWN_CIRCLES if c not in found]
    assert not gone, f"these allowlisted circles are gone or changed: delete them from KNOWN_CIRCLES: {gone}"


def test_no_new_import_that_climbs_the_layers():
    found = climbs(import_graph())
    described = sorted(
        f"{a} ({LAYER_NAMES[layer(a)]}) imports {b} ({LAYER_NAMES[layer(b)]})" for a, b in found - KNOWN_CLIMBS
    )
    assert not described, f"imports that climb the layers of docs/architecture.md: {described}"
    gone = sorted(KNOWN_CLIMBS - found)
    assert not gone, f"these allowlisted climbs are gone: delete them from KNOWN_CLIMBS: {gone}"


def test_the_checks_catch_a_planted_circle_and_climb():
    graph = {"bert_port.bert": {"bert_port.training.recipe"}, "bert_port.training.recipe": {"bert_port.bert"}}
    assert circles(graph) == [frozenset(graph)]
    assert climbs(graph) == {("bert_port.bert", "bert_port.training.recipe")}
