"""docs/architecture.md's module graph against the real imports of s2attn and megatron_s2.

The graph is the ```modules block of the document: a package line ``name (folder/)``, then one
indented line per module, ``module -> imported, imported`` (names of the same package, or
dotted names of the other one; ``s2attn`` alone is the package itself), ``#`` starting a
comment. The real graph is read from the source files' syntax trees by
``tests/helpers/imports.py`` (every ``import`` and ``from ... import``, at any depth, relative
ones resolved), so the test needs neither package to import. It checks that every documented
module exists, every documented edge is a real import, every module of the tree appears, every
import between them is drawn, and the layering the document states (s2attn imports nothing of
megatron_s2; the plugin never imports the application).

    python -m tests.project.test_architecture_doc   # print the real graph in the document's format
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from tests.helpers import imports
from tests.helpers.imports import PACKAGES, REPO, import_graph, module_files

DOC = os.path.join(REPO, "docs", "architecture.md")
# The application's packages: the trainer, and the Hugging Face import/export beside it.
APPLICATION = ("megatron_s2.training", "megatron_s2.hf")
ARROW = re.compile(r"\s*(?:->|──►)\s*")
HEADER = re.compile(r"^(?P<package>[\w.]+)\s+\((?P<folder>[\w/]+)\)$")


def is_package(module: str, mods: dict[str, str]) -> bool:
    """Whether ``module`` is a package (its file an ``__init__.py``)."""
    return imports.is_package(mods[module])


# ---- the documented graph -----------------------------------------------------------------------
@dataclass
class DocGraph:
    """The document's modules (``{name: line}``) and edges (``{(importer, imported): line}``);
    line numbers are the document's, 1-based. ``errors``: lines that do not parse."""

    modules: dict[str, int] = field(default_factory=dict)
    edges: dict[tuple[str, str], int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def modules_block(text: str) -> tuple[int, list[str]]:
    """(line number of the block's first line, its lines) of the ```modules fenced block."""
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line.strip() == "```modules"]
    assert len(starts) == 1, f"{DOC}: expected one ```modules block, found {len(starts)}"
    start = starts[0] + 1
    end = next(i for i in range(start, len(lines)) if lines[i].strip().startswith("```"))
    return start + 1, lines[start:end]


def parse_doc(text: str, known: set[str]) -> DocGraph:
    """The graph drawn in ``text``'s ```modules block. An edge's target is looked up in the
    line's package first, then as a dotted name (``known``: the tree's modules, so that
    ``schedule`` in ``megatron_s2.training`` means ``megatron_s2.schedule`` only where the
    application has none of its own; an unknown target stays as written, relative)."""
    first, lines = modules_block(text)
    graph, package = DocGraph(), None
    for n, raw in enumerate(lines, first):
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if not line[0].isspace():
            m = HEADER.match(line.strip())
            if not m:
                graph.errors.append(f"line {n}: not a package line `name (folder/)`: {raw!r}")
            package = m["package"] if m else None
            continue
        if package is None:
            graph.errors.append(f"line {n}: a module before any package line: {raw!r}")
            continue
        source, *rest = ARROW.split(line.strip(), maxsplit=1)
        module = f"{package}.{source}"
        if module in graph.modules:
            graph.errors.append(
                f"line {n}: {module} listed twice (first on {graph.modules[module]})"
            )
        graph.modules[module] = n
        for target in (t.strip() for t in (rest[0].split(",") if rest else []) if t.strip()):
            local = f"{package}.{target}"
            resolved = local if local in known or target not in known else target
            graph.edges[(module, resolved)] = n
    return graph


def documented() -> tuple[DocGraph, dict[str, set[str]], dict[str, str]]:
    mods = module_files()
    with open(DOC) as f:
        doc = parse_doc(f.read(), set(mods))
    return doc, import_graph(), mods


# ---- the checks ---------------------------------------------------------------------------------
def test_the_module_graph_parses():
    doc, _, _ = documented()
    assert not doc.errors, "docs/architecture.md's ```modules block:\n" + "\n".join(doc.errors)


def test_every_documented_module_exists():
    doc, graph, _ = documented()
    missing = [f"line {n}: {m}" for m, n in doc.modules.items() if m not in graph]
    assert not missing, (
        "docs/architecture.md's module graph lists modules that are not in the tree (moved or "
        "renamed? `python -m tests.project.test_architecture_doc` prints the real graph):\n"
        + "\n".join(missing)
    )


def test_every_documented_edge_is_a_real_import():
    doc, graph, _ = documented()
    wrong = [
        f"line {n}: {a} -> {b}: "
        + (f"{b} is not a module of the tree" if b not in graph else f"{a} does not import {b}")
        for (a, b), n in doc.edges.items()
        if a in graph and b not in graph.get(a, ())
    ]
    assert not wrong, "docs/architecture.md's module graph draws imports that do not exist:\n" + (
        "\n".join(wrong)
    )


def test_every_module_of_the_tree_appears():
    doc, graph, mods = documented()
    absent = sorted(m for m in graph if m not in doc.modules and not is_package(m, mods))
    assert not absent, (
        "modules missing from docs/architecture.md's module graph (add a line under their "
        "package):\n"
        + "\n".join(f"{m} -> {', '.join(sorted(graph[m])) or '(nothing)'}" for m in absent)
    )


def test_every_import_between_the_modules_is_drawn():
    doc, graph, mods = documented()
    undrawn = sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        if a in doc.modules
        for b in targets
        if (a, b) not in doc.edges
    )
    assert not undrawn, "imports missing from docs/architecture.md's module graph:\n" + (
        "\n".join(undrawn)
    )


def _in_application(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in APPLICATION)


def test_the_layers_import_downwards_only():
    """The document's rule: s2attn imports nothing of megatron_s2, the plugin nothing of the
    application (``megatron_s2.training``, ``megatron_s2.hf``)."""
    _, graph, _ = documented()
    up = sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if (a.split(".")[0] == "s2attn" and b.split(".")[0] == "megatron_s2")
        or (a.split(".")[0] == "megatron_s2" and not _in_application(a) and _in_application(b))
    )
    assert not up, "imports against the layering of docs/architecture.md:\n" + "\n".join(up)


def format_graph(graph: dict[str, set[str]], mods: dict[str, str]) -> str:
    """The real graph in the ```modules block's format (no descriptions): one package line
    per package, one line per module (packages' ``__init__`` left out), targets relative to
    the package where they are in it."""
    out = []
    # bottom-up: s2attn first, then megatron_s2, then its subpackages
    order = list(PACKAGES)
    packages = sorted(
        (m for m in mods if is_package(m, mods)),
        key=lambda p: (order.index(p.split(".")[0]), p.count("."), p),
    )
    for package in packages:
        folder = os.path.relpath(os.path.dirname(mods[package]), REPO) + "/"
        out.append(f"{package} ({folder})")
        for module in sorted(m for m in graph if m.rpartition(".")[0] == package):
            if is_package(module, mods):
                continue
            # the package's own modules by their short names first, then the other packages'
            local = sorted(t for t in graph[module] if t.rpartition(".")[0] == package)
            names = [t.removeprefix(package + ".") for t in local]
            names += sorted(t for t in graph[module] if t not in local)
            short = module.removeprefix(package + ".")
            out.append(f"  {short}" + (f" -> {', '.join(names)}" if names else ""))
    return "\n".join(out)


if __name__ == "__main__":
    print(format_graph(import_graph(), module_files()))
