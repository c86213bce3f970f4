"""The s2attn modules import one way: a call reads down from ``attention.py`` through
``dispatch.py`` to the kernel modules, and none of those imports back (read from the source by
``tests/helpers/imports.py``, so imports inside functions count too). That no import circle
exists at all, here and in megatron_s2, is ``tests/project/test_import_graph.py``'s check."""

from __future__ import annotations

import pytest

from tests.helpers.imports import import_graph

# Independent of the megatron-core version: CI runs this module in its first suite only.
pytestmark = pytest.mark.version_independent

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
ABOVE = ("dispatch", "attention")


def _imports() -> dict[str, set[str]]:
    """s2attn module (short name; ``s2attn`` for the package's ``__init__``) -> the s2attn
    modules it imports (short names)."""

    def short(name: str) -> str:
        return name.removeprefix("s2attn.")

    return {
        short(m): {short(t) for t in targets if t == "s2attn" or t.startswith("s2attn.")}
        for m, targets in import_graph().items()
        if m == "s2attn" or m.startswith("s2attn.")
    }


def test_kernel_modules_do_not_import_the_dispatch():
    edges = _imports()
    missing = [m for m in ("attention", "dispatch", *KERNEL_MODULES) if m not in edges]
    assert not missing, f"s2attn modules this test names are not in kernels/: {missing}"
    assert "dispatch" in edges["attention"], "s2attn.attention no longer imports s2attn.dispatch"
    calls = {"tl_kernels", "gluon_forward", "gluon_dq", "gluon_dkdv"}
    assert edges["dispatch"] >= calls, (
        f"s2attn.dispatch does not import {sorted(calls - edges['dispatch'])}"
    )
    back = sorted(
        f"s2attn.{m} -> s2attn.{a}" for m in KERNEL_MODULES for a in ABOVE if a in edges[m]
    )
    assert not back, "kernel modules importing back up (the dispatch or the entry point):\n" + (
        "\n".join(back)
    )
