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
    ("bert_port.serve", 3),
    ("bert_port.training", 2),
    ("bert_port.embed", 2),
    ("bert_port.parity", 2),
    ("bert_port.reference", 2),
    ("bert_port.sentence", 2),
    ("bert_port.sentence_api", 2),
    ("bert_port.sentence_folder", 2),
    ("bert_port.similarity", 2),
    ("bert_port.loading", 1),
    ("bert_port.saving", 1),
    ("bert_port.loader_arguments", 1),
    ("bert_port.checkpoint", 1),
]
LAYER_NAMES = {0: "model", 1: "loading/saving", 2: "training/embed/sentence/parity", 3: "cli/bench/facade"}

# Known circles: none; a new one fails `test_no_new_import_circle`.
KNOWN_CIRCLES: list[frozenset[str]] = []

# Known climbs (importer, imported), each to be removed.
KNOWN_CLIMBS: set[tuple[str, str]] = set()


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


def _closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    return seen


def test_the_model_does_not_reach_into_data_or_training_tasks():
    """The heads need a problem type's loss (`losses`), not its labels, readers or metrics."""
    graph = import_graph()
    sideways = {"bert_port.problem", "bert_port.data", "bert_port.records", "bert_port.tagged", "bert_port.metrics"}
    for model in ("bert_port.bert", "bert_port.heads", "bert_port.classifier", "bert_port.base_bert"):
        assert not _closure(graph, model) & sideways, (model, sorted(_closure(graph, model) & sideways))
    assert "bert_port.losses" in graph["bert_port.classifier"]


def test_every_port_model_has_its_load_and_save_methods_after_any_import():
    """`loading` and `saving` set them on the model class (the model layer cannot import them);
    the package's __init__ imports both, so importing only bert.py still gives them."""
    import subprocess
    import sys

    code = (
        "from bert_port.bert import BertModel; import inspect; "
        "print(all(hasattr(BertModel, m) for m in ('from_pretrained', 'load_hf_state_dict', 'save_pretrained', "
        "'hf_state_dict')), 'quantization' in inspect.signature(BertModel.from_pretrained).parameters)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr


def test_the_checks_catch_a_planted_circle_and_climb():
    graph = {"bert_port.bert": {"bert_port.training.recipe"}, "bert_port.training.recipe": {"bert_port.bert"}}
    assert circles(graph) == [frozenset(graph)]
    assert climbs(graph) == {("bert_port.bert", "bert_port.training.recipe")}
