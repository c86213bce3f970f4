"""Timing of GPU calls for the benchmark tools: every row of a comparison timed round by round
with the others (CUDA events, the L2 flushed before each run), medians.

Timed one after another, in blocks, rows of identical kernels differed by 4-7% on the H100s,
always in favour of the block that came first after a compile (the GPU's clocks fall as it
warms up: ``docs/benchmarks.md``); ``triton.testing.do_bench``'s defaults (25 ms of warm-up,
100 ms of repeats) also ran a 128k fwd+bwd once. Here each row runs once a round, the order
reversed every other round, at least :data:`MIN_RUNS` rounds after :data:`WARMUP_RUNS` untimed
ones.
"""

from __future__ import annotations

import math
import statistics
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
