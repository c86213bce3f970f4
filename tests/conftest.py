"""Shared setup of the tests: environment, pytest hooks and fixtures (every subfolder).

Without CUDA the real Triton kernels run under the Triton interpreter: ``TRITON_INTERPRET=1`` has
to be set before the kernels are defined (``triton.jit`` reads it when ``s2attn.tl_kernels``
is first imported), and pytest loads this file before any test module. bf16 under the interpreter
needs no help from here: the kernels handle it themselves
(tests/kernels/test_interpreter_dtypes.py).
The plain helpers (inputs, references, Megatron set-up, the Slurm cluster): ``tests/helpers/``.
"""

from __future__ import annotations

import os

from tests.helpers.kernels import CUDA

if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


def pytest_configure(config):
    # The Triton interpreter's scalar handling under numpy 2.x (harmless, thousands per test).
    config.addinivalue_line(
        "filterwarnings",
        "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning",
    )


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    # CPU mode (megatron_s2.training.cpu_mode), which CPU tests switch on for their whole
    # process, maps "cuda" to the CPU: a gpu test after one would pass without a GPU kernel
    # having run. Its module-scoped fixtures run in setup, so this is checked again at the call.
    if "gpu" in item.keywords:
        _refuse_cpu_mode(item)


def pytest_runtest_call(item):
    if "gpu" in item.keywords:
        _refuse_cpu_mode(item)


def _refuse_cpu_mode(item) -> None:
    import sys

    cpu_mode = sys.modules.get("megatron_s2.training.cpu_mode")
    if cpu_mode is not None and cpu_mode.cpu_mode_enabled():
        pytest.fail(
            f"{item.nodeid}: CPU mode is on in this process (a CPU test switched it on), so "
            "'cuda' would run on the CPU; run the gpu tests apart (pytest -m gpu)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """The demo corpus (``megatron_s2.training.demo_corpus``, default settings), generated once
    per test session (once per pytest-xdist worker) for every module whose runs train on it.

    The runs only read it (each test gives the trainer its own ``data.cache_dir`` or run
    directory); a test that damages or rewrites a corpus makes its own. It was a fixture of
    test_trainer.py that other modules imported, and an imported fixture is a separate fixture
    of each importing module: the corpus was generated once per module (~7 s of CPU each)."""
    from megatron_s2.training.demo_corpus import ensure_demo_data

    d = tmp_path_factory.mktemp("demo_data")
    ensure_demo_data(str(d))
    return str(d)


@pytest.fixture(params=[False, True], ids=["pointer-tiles", "tma-tiles"])
def tile_loads(request, monkeypatch):
    """Runs a test twice: default kernel configs as they are, then with ``tma=True`` (the walked
    tiles read through TMA tensor descriptors, 16-bit inputs only). Yields None, or with TMA the
    list of descriptors built, so a test can check that the TMA path really ran."""
    import dataclasses

    from s2attn import dispatch, tl_kernels

    built = []
    if request.param:
        if tl_kernels.TensorDescriptor is None:
            pytest.skip("this Triton has no host-side tensor descriptors (TMA tiles)")
        default, make = dispatch.kernel_config, tl_kernels.TensorDescriptor

        def with_tma(*a, **kw):
            return dataclasses.replace(default(*a, **kw), tma=True)

        def counted(*a, **kw):
            built.append(a[0].shape)
            return make(*a, **kw)

        monkeypatch.setattr(dispatch, "kernel_config", with_tma)
        monkeypatch.setattr(tl_kernels, "TensorDescriptor", counted)
    yield built if request.param else None
