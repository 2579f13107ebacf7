"""The package's import graph, read from the source (nothing is imported): no cycles, counting imports inside
functions and the package __init__ files an import runs, so that no import inside a function is there to dodge
one; and each layer imports only the layers below it (docs/architecture.md)."""
import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

# package -> packages it must not import (at any depth, inside functions too)
FORBIDDEN = {
    "config": {"kernels", "quant", "layers", "loading", "models", "engine", "bench", "server", "train", "demo"},
    "kernels": {"quant", "layers", "loading", "models", "engine", "bench", "server", "train", "demo"},
    "quant": {"layers", "loading", "models", "engine", "bench", "server", "train", "demo"},
    "layers": {"loading", "models", "engine", "bench", "server", "train", "demo"},
    "loading": {"layers", "models", "engine", "bench", "server", "train", "demo"},
    "models": {"engine", "bench", "server", "train", "demo"},
    "engine": {"bench", "server", "train", "demo"},
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (SRC / "flashdraft").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (getattr(test, "id", None) == "TYPE_CHECKING"
                                         or getattr(test, "attr", None) == "TYPE_CHECKING")


def _imports(mods: dict[str, Path]) -> dict[str, set[tuple[str, str]]]:
    """module -> {(imported module, name or '')}, every import statement outside `if TYPE_CHECKING:`."""
    found = {}
    for name, path in mods.items():
        out = set()

        def visit(node):
            for child in ast.iter_child_nodes(node):
                if _is_type_checking(child):
                    continue
                if isinstance(child, ast.Import):
                    out.update((a.name, "") for a in child.names)
                elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                    for a in child.names:
                        full = f"{child.module}.{a.name}"
                        out.add((full, "") if full in mods else (child.module, a.name))
                else:
                    visit(child)

        visit(ast.parse(path.read_text()))
        found[name] = {(m, n) for m, n in out if m.split(".")[0] == "flashdraft"}
    return found


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.fixture(scope="module")
def graph():
    mods = _modules()
    imports = _imports(mods)
    edges = {}
    for m, targets in imports.items():
        out = set()
        for target, _ in targets:
            while target not in mods:  # a name imported from a module
                target = target.rsplit(".", 1)[0]
            out.add(target)
            # importing a.b.c runs a and a.b first: the __init__ of every package above it that m is not inside
            parts = target.split(".")
            out.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                       if p in mods and not m.startswith(p + ".") and p != m)
        edges[m] = out - {m}
    return mods, imports, edges


def test_the_walk_sees_the_package(graph):
    mods, imports, edges = graph
    assert {"flashdraft.engine.speculative", "flashdraft.models.gemma4.model", "flashdraft.loading.gguf"} <= set(mods)
    assert "flashdraft.models.kv_cache" in edges["flashdraft.engine.speculative"]
    # inside a function (the Triton kernels are imported on first use) and from a package's __init__
    assert "flashdraft.kernels.attention_triton" in edges["flashdraft.layers.decode_attention"]
    assert "flashdraft.layers" in edges["flashdraft.engine.model_prep"]


def test_no_import_cycles(graph):
    mods, _, edges = graph
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def connect(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
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
                cycles.append(sorted(component))

    for v in sorted(mods):
        if v not in index:
            connect(v)
    assert cycles == []


def test_layers_import_only_what_is_below_them(graph):
    _, imports, _ = graph
    bad = sorted((m, t) for m, targets in imports.items() for t, _ in targets
                 if _package(t) in FORBIDDEN.get(_package(m), ()))
    assert bad == []


def test_no_private_names_across_packages(graph):
    _, imports, _ = graph
    bad = sorted((m, f"{t}.{n}") for m, targets in imports.items() for t, n in targets
                 if n.startswith("_") and not n.endswith("__") and _package(t) != _package(m))
    assert bad == []
