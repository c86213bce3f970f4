"""The s2attn modules import one way: a call reads down from ``attention.py`` through
``dispatch.py`` to the kernel modules, and none of those imports back (read from the source, so
imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

# Independent of the megatron-core version: CI runs this module in its first suite only.
pytestmark = pytest.mark.version_independent

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
# Modules that hold kernels or what they are built from: below the dispatch.
KERNEL_MODULES = (
    "tl_kernels",
    "gluon_forward",
    "gluon_dq",
    "gluon_dkdv",
    "gathered_keys",
    "layout",
    "pattern",
    "config",
)


def _imports() -> dict[str, set[str]]:
    """Module name -> the s2attn modules it imports (``from . import x``, ``from .x import``,
    ``import s2attn.x``, ``from s2attn import x``), anywhere in its source."""
    names = {p.stem for p in KERNELS.glob("*.py")}
    edges = {}
    for path in KERNELS.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                relative = node.level == 1
                if not relative and not (node.module or "").startswith("s2attn"):
                    continue
                parts = (node.module or "").split(".")[0 if relative else 1 :]
                if parts and parts[0]:
                    found.add(parts[0])
                else:
                    found |= {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("s2attn.")}
        edges[path.stem] = (found & names) - {path.stem}
    return edges


def test_no_import_circles():
    edges = _imports()
    done, path = set(), []

    def visit(mod):
        if mod in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(mod) :] + [mod]))
        if mod in done:
            return
        path.append(mod)
        for dep in sorted(edges[mod]):
            visit(dep)
        path.pop()
        done.add(mod)

    for mod in sorted(edges):
        visit(mod)


def test_kernel_modules_do_not_import_the_dispatch():
    edges = _imports()
    assert edges["attention"] >= {"dispatch"}
    assert edges["dispatch"] >= {"tl_kernels", "gluon_forward", "gluon_dq", "gluon_dkdv"}
    back = {m: edges[m] & {"dispatch", "attention"} for m in KERNEL_MODULES}
    assert not any(back.values()), back
