"""No import circles in ``s2attn`` (``kernels/``) and ``megatron_s2``.

The graph is read from the source (AST), not by importing (``tests/helpers/imports.py``): every
``import`` statement counts, the ones inside functions included, since a function-level import
that closes a circle only hides it until the function runs. A module that imports another,
directly or through others, must not be imported back by it. This covers the kernels too
(``tests/kernels/test_kernel_imports.py`` checks only their direction).

Run as a script (``python -m tests.project.test_import_graph``) it prints the graph's edges and
its circles.
"""

from __future__ import annotations

import sys

from tests.helpers.imports import import_graph, imports_of


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


def circle_through(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One import circle through ``component[0]`` inside ``component`` (a strongly connected
    component), the shortest: ``[a, b, ..., a]``."""
    start, inside = component[0], set(component)
    previous, queue = {}, [start]
    for v in queue:
        for w in sorted(graph.get(v, ())):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if w in inside and w not in previous:
                previous[w] = v
                queue.append(w)
    raise ValueError(f"{component} is not strongly connected")


def describe(graph: dict[str, set[str]], found: list[list[str]]) -> str:
    """One line per component: a circle in it, then every module of the component."""
    return "\n".join(
        f"  {' -> '.join(circle_through(graph, c))}"
        + (f"   (all entangled: {', '.join(c)})" if len(c) > 2 else "")
        for c in found
    )


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


def test_import_names_resolve_to_modules(tmp_path):
    known = {"pkg", "pkg.sub", "pkg.sub.mod", "pkg.sub.other", "pkg.top"}
    init = tmp_path / "__init__.py"  # pkg.sub's __init__: its own anchor
    init.write_text("from . import mod\nfrom .other import name\nfrom .. import top\n")
    assert imports_of("pkg.sub", str(init), known) == {"pkg.sub.mod", "pkg.sub.other", "pkg.top"}
    src = tmp_path / "mod.py"  # pkg.sub.mod: relative to pkg.sub
    src.write_text("import pkg.sub.other.name\nfrom pkg import sub, missing\nimport os\n")
    assert imports_of("pkg.sub.mod", str(src), known) == {"pkg.sub.other", "pkg.sub", "pkg"}


def test_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "b"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert circle_through(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert describe(graph, [["b", "c"]]) == "  b -> c -> b"


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import circles (modules that import each other, directly or through " + (
        "others):\n" + describe(graph, found)
    )


if __name__ == "__main__":
    g = import_graph()
    for m, targets in g.items():
        print(m, "->", ", ".join(sorted(targets)) or "-")
    c = cycles(g)
    print("cycles:", ("\n" + describe(g, c)) if c else "none")
    sys.exit(1 if c else 0)
