"""The import graph of ``s2attn`` (folder ``kernels/``) and ``megatron_s2``, read from the source.

One builder for the tests that check imports (``tests/project/test_import_graph.py``: no
circles; ``tests/project/test_architecture_doc.py``: the documented module graph;
``tests/kernels/test_kernel_imports.py``: the kernels below the dispatch). Nothing is imported:
the files' syntax trees are read, so neither package needs to be importable.

- A module is a ``.py`` file of a package folder, named by its dotted import name; a package's
  ``__init__.py`` is the package itself (``s2attn``, ``megatron_s2.training``). Folders whose
  name starts with ``.`` or ``_`` (``__pycache__``) are left out.
- Every ``import`` and ``from ... import`` counts, at any depth of the code: a function-level
  import that closes a circle only hides it until the function runs.
- Relative imports are resolved to absolute names (a plain module is relative to its package, a
  package's ``__init__`` to itself).
- An imported name maps to the longest module prefix: ``from pkg import mod`` is the module
  ``pkg.mod`` where that is one, else ``pkg``; ``import a.b.c`` with ``a.b`` the deepest module is
  ``a.b``. Imports of anything outside the packages are dropped, and so is a module's import of
  itself.
"""

from __future__ import annotations

import ast
import functools
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Import name -> folder (relative to the repository): the kernels import as ``s2attn``
# (pyproject's package-dir).
PACKAGES = {"s2attn": "kernels", "megatron_s2": "megatron_s2"}


def module_files() -> dict[str, str]:
    """``{dotted module name: source file}`` for every module of :data:`PACKAGES`."""
    found = {}
    for package, folder in PACKAGES.items():
        root = os.path.join(REPO, folder)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "_")))
            rel = os.path.relpath(dirpath, root)
            parts = [package] + ([] if rel == "." else rel.split(os.sep))
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                stem = name[: -len(".py")]
                dotted = ".".join(parts if stem == "__init__" else [*parts, stem])
                found[dotted] = os.path.join(dirpath, name)
    return found


def is_package(path: str) -> bool:
    """Whether the source file ``path`` is a package's ``__init__.py``."""
    return os.path.basename(path) == "__init__.py"


def absolute(module: str, package: bool, level: int, target: str | None) -> str:
    """The absolute name of ``from <level dots><target> import ...`` written in ``module``
    (``package``: whether ``module`` is a package's ``__init__``, its own anchor)."""
    if level == 0:
        return target or ""
    base = module.split(".")
    base = base if package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(module: str, path: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` (source file ``path``) imports, at any depth of
    its code (see the module docstring for how names map to modules)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = is_package(path)
    out = set()

    def add(name: str) -> None:
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in known:
            out.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = absolute(module, package, node.level, node.module)
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                add(full if full in known else base)
    out.discard(module)
    return out


@functools.cache
def _graph() -> dict[str, frozenset[str]]:
    files = module_files()
    known = set(files)
    return {m: frozenset(imports_of(m, p, known)) for m, p in sorted(files.items())}


def import_graph() -> dict[str, set[str]]:
    """``{module: the modules of PACKAGES it imports}``, every module of the tree a key (read
    once per test session; each call returns a fresh copy)."""
    return {m: set(targets) for m, targets in _graph().items()}
