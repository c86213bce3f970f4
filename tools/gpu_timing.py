"""Timing of GPU calls for the benchmark tools: every row of a comparison timed round by round
with the others (CUDA events, the L2 flushed before each run), medians.

Timed one after another, in blocks, rows of identical kernels differed by 4-7% on the H100s,
always in favour of the block that came first after a compile (the GPU's clocks fall as it warms
up: ``docs/notebook/2026-11-benchmarks-kernel-work.md``); ``triton.testing.do_bench``'s defaults
(25 ms of warm-up, 100 ms of repeats) also ran a 128k fwd+bwd once. Here each row runs once a
round, the order reversed every other round, at least :data:`MIN_RUNS` rounds after
:data:`WARMUP_RUNS` untimed ones.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

MIN_RUNS = 10  # timed runs of each row at least
WARMUP_RUNS = 2  # untimed runs of each row before the first round
# Bytes written before each timed run so that no run finds its inputs in L2 (the H100's is
# 50 MB), as do_bench does.
L2_FLUSH_BYTES = 256 * 2**20


def round_order(n_rows: int, rounds: int) -> list[int]:
    """Row indices in the order :func:`time_rows` runs them: ``rounds`` rounds of every row,
    in order in even rounds and in reverse in odd ones, so that no row always runs first (with
    two rows: 0 1 1 0 0 1 ...)."""
    return [i for r in range(rounds) for i in (range(n_rows)[:: 1 if r % 2 == 0 else -1])]


def time_rows(
    fns: list[Callable],
    min_runs: int = MIN_RUNS,
    rep: float = 100.0,
    before: Callable[[], None] | None = None,
) -> list[float]:
    """Median ms of each of ``fns`` (CUDA events, L2 flushed before each run) over
    ``min_runs`` rounds, or more where a round is short, at least ``rep`` ms a row on average;
    every row runs :data:`WARMUP_RUNS` times untimed first (compiles included). ``before`` runs
    ahead of each timed run, outside its time (several processes: a barrier, so that no run's
    time includes waiting for a peer that is still in the previous one)."""
    for _ in range(WARMUP_RUNS):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    round_ms = (time.perf_counter() - start) * 1e3
    rounds = max(min_runs, math.ceil(rep * len(fns) / max(round_ms, 1e-3)))
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    events = []
    for which in round_order(len(fns), rounds):
        flush.zero_()
        if before is not None:
            before()
        ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev[0].record()
        fns[which]()
        ev[1].record()
        events.append((which, ev))
    torch.cuda.synchronize()
    ms = [[] for _ in fns]
    for which, (begin, end) in events:
        ms[which].append(begin.elapsed_time(end))
    return [statistics.median(m) for m in ms]


def fwd_bwd_step(fn: Callable, leaves) -> Callable[[], None]:
    """A row for :func:`time_rows`: one forward ``fn()`` and its backward (gradient of ones),
    the gradients of ``leaves`` cleared first so that none accumulates across runs."""

    def step():
        for t in leaves:
            t.grad = None
        out = fn()
        out.backward(torch.ones_like(out))

    return step


class PowerSampler:
    """The GPU's power draw and SM clock, sampled by ``nvidia-smi`` every ``interval_ms``
    while the ``with`` block runs (timings on the lent H100s ran at the 700 W limit, the SM
    clock 25-30% below its maximum, so a faster kernel can slow the ones around it:
    ``docs/notebook/2026-11-benchmarks-kernel-work.md``, "Three consumer warpgroups at head_dim
    64"). ``gpu``: what
    ``nvidia-smi --id`` takes (an index or a PCI bus id; :func:`nvidia_smi_id`). Where
    ``command`` is missing or prints nothing, :meth:`summary` is None and nothing fails."""

    QUERY = "power.draw,power.limit,clocks.sm"

    def __init__(self, gpu: str = "0", interval_ms: int = 200, command: str = "nvidia-smi"):
        # Line-buffered where coreutils' stdbuf exists: into a pipe, stdio would hold the
        # samples in a block buffer that a stopped process never writes.
        wrap = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []
        self.args = wrap + [
            command,
            f"--id={gpu}",
            f"--query-gpu={self.QUERY}",
            "--format=csv,noheader,nounits",
            f"-lms={interval_ms}",
        ]
        self.proc = None
        self.samples: list[tuple[float, float, float]] = []

    def __enter__(self):
        try:
            # A session of its own, so that stopping it stops whatever it started.
            self.proc = subprocess.Popen(
                self.args,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
        except OSError:  # no nvidia-smi: timings go on without the samples
            self.proc = None
        return self

    def __exit__(self, *exc):
        if self.proc is None:
            return False
        out = ""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):  # Ctrl-C first, as by hand
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                out, _ = self.proc.communicate(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
        self.samples = parse_power_samples(out or "")
        return False

    def summary(self) -> dict | None:
        """Median and largest power draw (W), the power limit (W), median and smallest SM
        clock (MHz) and the sample count; None without samples."""
        if not self.samples:
            return None
        power, limit, clock = (list(x) for x in zip(*self.samples))
        return dict(
            power_w_median=statistics.median(power),
            power_w_max=max(power),
            power_limit_w=statistics.median(limit),
            sm_mhz_median=statistics.median(clock),
            sm_mhz_min=min(clock),
            samples=len(power),
        )


def parse_power_samples(text: str) -> list[tuple[float, float, float]]:
    """``(power W, limit W, SM MHz)`` of each ``nvidia-smi`` line that has all three numbers
    (``[N/A]`` fields and partial lines are skipped)."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            power, limit, clock = (float(p) for p in parts)
        except ValueError:
            continue
        samples.append((power, limit, clock))
    return samples


def describe_power(summary: dict | None) -> str:
    """One line for a table's notes: power and SM clock while the rows were timed."""
    if summary is None:
        return "GPU power: not sampled (no nvidia-smi)"
    s = summary
    return (
        f"GPU while timed: power median {s['power_w_median']:.0f} W, max {s['power_w_max']:.0f} "
        f"of {s['power_limit_w']:.0f} W; SM clock median {s['sm_mhz_median']:.0f} MHz, min "
        f"{s['sm_mhz_min']:.0f} ({s['samples']} samples)"
    )


# Dense bf16/fp16 tensor-core FLOPs a clock per SM, by compute capability: Hopper's wgmma
# (an H100 SXM's 989 TF/s are 132 SMs at 1830 MHz times this). Other GPUs are not in the table.
TENSOR_FLOPS_PER_CLOCK_SM = {(9, 0): 4096}


def tensor_peak_tflops(sm_mhz: float, sms: int, capability: tuple) -> float | None:
    """The dense bf16/fp16 tensor-core peak (TFLOP/s) of ``sms`` SMs of compute ``capability``
    at ``sm_mhz``: what a kernel's products can reach at the clock the power limit left. None
    where the table has no rate for the GPU."""
    per_clock = TENSOR_FLOPS_PER_CLOCK_SM.get(tuple(capability))
    if per_clock is None:
        return None
    return per_clock * sms * sm_mhz * 1e6 / 1e12


def nvidia_smi_id(device=None) -> str:
    """``nvidia-smi --id`` of a CUDA device (None: the current one): its PCI bus id where torch
    reports one (right under ``CUDA_VISIBLE_DEVICES``), else its index; "0" without CUDA."""
    if not torch.cuda.is_available():
        return "0"
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    idx = torch.device(device).index or 0
    props = torch.cuda.get_device_properties(idx)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return str(idx)
    domain = getattr(props, "pci_domain_id", 0)
    dev = getattr(props, "pci_device_id", 0)
    return f"{domain:08X}:{bus:02X}:{dev:02X}.0"
