"""One profiled training step (``debug.profile_step``): where the GPU time of a step goes.

The trainer runs the step ``debug.profile_step`` under ``torch.profiler`` and every rank writes
``<run_dir>/profile/step<N>.rank<R>.json``: the step's wall time, the summed time of its GPU
kernels, the share of that time in each kernel class of :data:`KERNEL_CLASSES` (attention,
communication, GEMM, other), the rank's peak memory so far and its most expensive kernels.

Kernel classes are decided by name (:func:`kernel_class`), the first class whose pattern matches
(case-insensitive) wins, in this order:

* ``attention``: our S2 kernels (``_s2_fwd_kernel``, ``_s2_dq_gluon_kernel``, ...) and the dense
  attention kernels of other people: SDPA's FlashAttention-2 (``flash_fwd_kernel``), cuDNN's
  fused SDPA (``cudnn_generated_..._sdpa_...``), FlashAttention-4 (CuTe DSL kernels named
  ``...flash_attn...``/``...FlashAttention...``), Transformer Engine's fused attention (``fmha``,
  ``fused_attn``);
* ``communication``: NCCL's kernels (``ncclDevKernel_...``, ``ncclKernel_...``);
* ``gemm``: cuBLAS/cuBLASLt and CUTLASS matmuls (``gemm``, ``nvjet``, ``xmma``, ``cutlass``);
* ``other``: everything else (norms, RoPE, elementwise, the optimizer, copies).

Shares are of the summed kernel time of the rank, not of the wall time: communication kernels
overlap compute kernels on other streams, so the shares tell where the GPU's work is, and a
communication share is an upper bound of the time communication adds to a step.

This module imports torch only inside :func:`profile_step` (the share arithmetic is plain
Python, tested on lists of fake events).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterable, Iterator
from typing import Optional

__all__ = [
    "KERNEL_CLASSES",
    "kernel_class",
    "kernel_shares",
    "kernel_events",
    "profile_path",
    "profile_step",
]

# (class, pattern) in the order they are tried; see the module docstring.
KERNEL_CLASSES = (
    (
        "attention",
        re.compile(
            r"_s2_|s2attn|flash_fwd|flash_bwd|flash_attn|flashattention|fmha|sdpa|fused_attn"
            r"|attention",
            re.IGNORECASE,
        ),
    ),
    ("communication", re.compile(r"nccl", re.IGNORECASE)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas", re.IGNORECASE)),
)
OTHER = "other"
TOP_KERNELS = 25


def kernel_class(name: str) -> str:
    """The class of a GPU kernel called ``name``: the first of :data:`KERNEL_CLASSES` whose
    pattern occurs in it, else ``"other"``."""
    for label, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return label
    return OTHER


def kernel_shares(events: Iterable[tuple[str, float]], top: int = TOP_KERNELS) -> dict:
    """Summarise GPU kernels ``events``, ``(name, microseconds)`` pairs (a name may repeat).

    Returns ``total_kernel_ms`` (their summed time, ms), ``ms`` and ``share`` per class (every
    class of :data:`KERNEL_CLASSES` and ``other``, shares of the total, None when the total is
    0: no GPU kernels, as in the CPU mode) and ``top_kernels``: the ``top`` names with the most
    time, each ``{"name", "class", "ms"}``, most first."""
    by_name: dict[str, float] = {}
    for name, us in events:
        if us < 0:
            raise ValueError(f"kernel {name!r} has a negative time ({us} us)")
        by_name[name] = by_name.get(name, 0.0) + float(us)
    labels = [label for label, _ in KERNEL_CLASSES] + [OTHER]
    per_class = dict.fromkeys(labels, 0.0)
    for name, us in by_name.items():
        per_class[kernel_class(name)] += us
    total = sum(per_class.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {
        "total_kernel_ms": total / 1e3,
        "ms": {label: us / 1e3 for label, us in per_class.items()},
        "share": {label: (us / total if total else None) for label, us in per_class.items()},
        "top_kernels": [
            {"name": name, "class": kernel_class(name), "ms": us / 1e3} for name, us in ranked
        ],
    }


def kernel_events(averages) -> list[tuple[str, float]]:
    """``(name, microseconds)`` of the GPU kernels in a profiler's ``key_averages()``: the
    entries that ran on a CUDA device, with their self device time (``self_device_time_total``,
    called ``self_cuda_time_total`` before torch 2.4). User annotations on the GPU timeline
    (``record_function`` ranges) are left out: they span kernels already counted."""
    from torch.autograd import DeviceType

    out = []
    for evt in averages:
        if getattr(evt, "device_type", None) != DeviceType.CUDA:
            continue
        if getattr(evt, "is_user_annotation", False):
            continue
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = getattr(evt, "self_cuda_time_total", 0.0)
        if us:
            out.append((evt.key, float(us)))
    return out


def profile_path(run_dir: str, iteration: int, rank: int) -> str:
    """Where rank ``rank`` writes the summary of profiled iteration ``iteration``."""
    return os.path.join(run_dir, "profile", f"step{iteration}.rank{rank}.json")


@contextlib.contextmanager
def profile_step(run_dir: str, iteration: int, rank: int, *, gpu: bool) -> Iterator[None]:
    """Profile the block (one training step, iteration ``iteration``) and write this rank's
    summary to :func:`profile_path`: ``iteration``, ``rank``, ``wall_ms`` (the block, after the
    GPU finished it), ``peak_mem_gib`` (this GPU's peak allocated memory so far; None on the
    CPU) and :func:`kernel_shares` of its GPU kernels (empty in the CPU mode)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    # CPU activity too on the GPU: kineto attributes the kernels through their launches.
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    sync()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        yield
        sync()
    wall_ms = (time.perf_counter() - t0) * 1e3
    peak: Optional[float] = torch.cuda.max_memory_allocated() / 2**30 if gpu else None
    summary = {
        "iteration": iteration,
        "rank": rank,
        "wall_ms": wall_ms,
        "peak_mem_gib": peak,
        **kernel_shares(kernel_events(prof.key_averages()) if gpu else []),
    }
    path = profile_path(run_dir, iteration, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
