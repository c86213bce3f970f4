"""No import circles in ``s2attn`` (``kernels/``) and ``megatron_s2``.

The graph is read from the source (AST), not by importing: every ``import`` statement counts,
the ones inside functions included, since a function-level import that closes a circle only
hides it until the function runs. A module that imports another, directly or through others,
must not be imported back by it.

Run as a script (``python tests/project/test_import_graph.py``) it prints the graph's edges.
"""

from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Import name -> folder: the kernels import as ``s2attn`` (pyproject's package-dir).
PACKAGES = {
    "s2attn": os.path.join(ROOT, "kernels"),
    "megatron_s2": os.path.join(ROOT, "megatron_s2"),
}


def module_files() -> dict[str, str]:
    """Dotted module name -> source file, for every module of :data:`PACKAGES`."""
    found = {}
    for package, folder in PACKAGES.items():
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            rel = os.path.relpath(dirpath, folder)
            parts = [package] + ([] if rel == "." else rel.split(os.sep))
            for name in filenames:
                if not name.endswith(".py"):
                    continue
                stem = name[:-3]
                dotted = ".".join(parts if stem == "__init__" else parts + [stem])
                found[dotted] = os.path.join(dirpath, name)
    return found


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of ``from <level dots><target> import ...`` written in ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".")
    # A package's __init__ is its own anchor; a plain module's anchor is its package.
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(module: str, path: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` (source ``path``) imports, at any depth of its
    code. ``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else
    ``pkg``; an import of something outside ``known`` is left out."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    is_package = os.path.basename(path) == "__init__.py"
    out = set()

    def add(name: str) -> None:
        # The longest known prefix: ``megatron_s2.training.step.forward_step`` -> the module.
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            candidate = ".".join(parts[:n])
            if candidate in known:
                out.add(candidate)
                return

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.level, node.module)
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                add(full if full in known else base)
    out.discard(module)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports (within :data:`PACKAGES`)."""
    files = module_files()
    known = set(files)
    return {m: imports_of(m, p, known) for m, p in sorted(files.items())}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each sorted:
    every such component holds at least one import circle."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        # Recursion depth is bounded by the number of modules (about a hundred).
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_packages():
    graph = import_graph()
    # A few edges that exist by design: a reader of a failure can trust the graph itself.
    assert "s2attn.pattern" in graph["s2attn.layout"]
    assert "megatron_s2.schedule" in graph["megatron_s2.config"]
    assert "megatron_s2.training.run_config" in graph["megatron_s2.training.cli"]


def test_function_level_imports_count(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from .other import thing\n")
    assert imports_of("pkg.m", str(src), {"pkg.m", "pkg.other"}) == {"pkg.other"}


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import circles among:\n" + "\n".join("  " + ", ".join(c) for c in found)


if __name__ == "__main__":
    g = import_graph()
    for m, targets in g.items():
        print(m, "->", ", ".join(sorted(targets)) or "-")
    c = cycles(g)
    print("cycles:", c or "none")
    sys.exit(1 if c else 0)
