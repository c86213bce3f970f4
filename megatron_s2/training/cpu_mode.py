"""Explicit CPU mode: run Megatron-core's GPU-only paths on the CPU (gloo), for tests and demos.

megatron-core (0.16.1 to 0.19.x) hard-codes CUDA in places that have nothing to do with the
math: the tensor-parallel RNG tracker, RoPE's ``inv_freq``, DDP grad buffers, the optimizers'
parameter type assertions, the pipeline schedules, ``dist_checkpointing.save``, DDP's stream
synchronisation (0.19). :func:`enable_cpu_mode` patches exactly those seams, process-wide:

* ``cuda`` devices (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")``, a bare device index) become
  ``cpu`` in torch's tensor factories, ``Tensor.to``, ``Tensor.cuda``, ``Module.cuda``;
  ``Tensor.pin_memory`` and the factories' ``pin_memory=True`` are no-ops;
* ``torch.cuda.current_device/synchronize/set_device/empty_cache/...`` are CPU no-ops, the CUDA
  RNG (``torch.cuda.manual_seed``, ``get/set_rng_state`` and Megatron's tracker helpers) is the CPU
  generator;
* streams and events (``torch.cuda.current_stream/default_stream/Stream/Event/stream/set_stream``,
  ``Tensor.record_stream``) are inert stand-ins: the CPU runs everything in program order, so
  there is nothing to order. megatron-core 0.19's DDP needs this: ``start_grad_sync`` asks for
  the current stream on every step (to wait on CUDA-graph events), also without CUDA graphs;
* ``Tensor.type()`` reports CPU tensors with CUDA type names (``torch.cuda.FloatTensor``) so the
  optimizers' checks pass.

Collectives are left alone: gloo has ``reduce_scatter_tensor`` (also coalesced) in every torch
we support. An all-reduce-and-slice emulation used to stand in for it and broke the distributed
optimizer: inside Megatron's coalescing manager the all-reduce is deferred, so the slice copied
unreduced gradients.

Separately, :func:`megatron_import_without_compile` imports megatron-core without the
``torch.compile`` wrappers it puts on its fusion functions (seconds of start-up per process, for
functions a CPU run never calls); the trainer's CPU start uses both.

It is never enabled implicitly: call it first thing in a CPU run (after that, Megatron code
behaves as on one GPU per process). It is idempotent. Do not use it in a GPU run.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

logger = logging.getLogger(__name__)

_ENABLED = False

_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "arange",
    "tensor",
    "as_tensor",
    "rand",
    "randn",
    "randint",
    "randperm",
    "empty_strided",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "linspace",
    "eye",
    "frombuffer",
)


def _uncompiled(model=None, **_options):
    """``torch.compile``'s signature, compiling nothing: ``fn`` itself, or a decorator that
    returns its function (megatron-core's own fallback where compile is missing)."""
    if model is None:
        return lambda fn: fn
    return model


@contextlib.contextmanager
def megatron_import_without_compile():
    """Import megatron-core inside this block without its ``torch.compile`` wrappers.

    megatron-core wraps about 40 fusion functions in ``torch.compile`` when it is imported
    (``megatron.core.jit.jit_fuser``), and the first wrap imports torch._dynamo and inductor:
    about 3.7 s of every CPU process's start (7.5 s for the whole import on 2 cores), in a mode
    that calls none of them (the trainer turns the bias/activation/RoPE fusions off, and
    Megatron's bias-dropout-add takes its unfused path without a bias). Inside the block
    ``torch.compile`` returns the function unchanged, so ``jit_fuser`` keeps that no-op for the
    whole process, as megatron-core does where compile is unavailable. Does nothing when
    megatron-core is already imported. CPU mode only: a GPU run keeps the compiled fusions.
    """
    import sys

    if "megatron.core" in sys.modules:
        yield
        return
    real = torch.compile
    torch.compile = _uncompiled
    try:
        yield
    finally:
        torch.compile = real


def cpu_mode_enabled() -> bool:
    return _ENABLED


def _is_cuda_device(d) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, int) and not isinstance(d, bool)


def _map(d):
    return torch.device("cpu") if _is_cuda_device(d) else d


def _wrap_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _map(kwargs["device"])
        # Pinned host memory needs an accelerator (Megatron's CP slicing asks for it).
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    wrapper._s2_cpu_mode = True
    return wrapper


class _CpuEvent:
    """Stands in for ``torch.cuda.Event``: already complete when created."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end_event) -> float:
        return 0.0


class _CpuStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is already ordered, so every wait is done."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True

    # `with stream:` is how some callers switch streams.
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_CPU_STREAM = _CpuStream()


def enable_cpu_mode() -> None:
    """Patch torch and Megatron-core so that their CUDA-only paths run on the CPU (see module
    docstring). Call before building models; idempotent."""
    global _ENABLED
    if _ENABLED:
        return
    if torch.cuda.is_available():
        logger.warning(
            "enable_cpu_mode(): CUDA is available but CPU mode maps every 'cuda' "
            "tensor to the CPU for this process"
        )

    for name in _FACTORIES:
        fn = getattr(torch, name, None)
        if fn is not None and not getattr(fn, "_s2_cpu_mode", False):
            setattr(torch, name, _wrap_factory(fn))

    orig_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and _is_cuda_device(args[0]):
            args = ("cpu",) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _map(kwargs["device"])
        return orig_to(self, *args, **kwargs)

    torch.Tensor.to = to
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self

    orig_type = torch.Tensor.type

    def type_(self, *args, **kwargs):
        if args or kwargs:
            return orig_type(self, *args, **kwargs)
        t = orig_type(self)
        if t.startswith("torch.") and ".cuda." not in t:
            return t.replace("torch.", "torch.cuda.", 1)
        return t

    torch.Tensor.type = type_

    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.device_count = lambda: 1
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.max_memory_reserved = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.current_stream = lambda *a, **k: _CPU_STREAM
    cuda.default_stream = lambda *a, **k: _CPU_STREAM
    cuda.set_stream = lambda *a, **k: None
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.Stream = _CpuStream
    cuda.Event = _CpuEvent
    torch.Tensor.record_stream = lambda self, *a, **k: None
    try:
        cuda.random.get_rng_state = cuda.get_rng_state
        cuda.random.set_rng_state = cuda.set_rng_state
        cuda.random.manual_seed = cuda.manual_seed
    except AttributeError:
        pass

    try:
        from megatron.core.tensor_parallel import random as mrandom

        mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
        mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    except ImportError:  # Megatron not installed: torch patches alone
        pass
    # The tracker's fork() warns on every call when the CUDA and CPU generators are one.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    _ENABLED = True
