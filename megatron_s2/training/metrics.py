"""Training metrics: model FLOPs, console progress, TensorBoard, JSONL and the loss-curve plot.

Model FLOPs per iteration (the usual "model FLOPs" convention: recomputation is not counted, so
TFLOP/s are comparable across recompute settings)::

    tokens  = global_batch_size * seq_length
    matmul  = 2 * tokens * (L * (h * (q + 2 * kv) + q * h + m * h * f) + h * V)   # forward
    attn    = global_batch_size * 4 * d * sum(pairs_l)                           # forward
    flops   = 3 * (matmul + attn)                                                # fwd + bwd

with ``L`` layers, hidden ``h``, ``q = heads * d`` and ``kv = groups * d`` projection widths,
``m = 3`` for SwiGLU (2 otherwise), FFN width ``f``, padded vocabulary ``V``, head dim ``d``.
``pairs_l`` is the number of (query, key) token pairs layer ``l`` really attends, summed over its
heads (:meth:`megatron_s2.schedule.AttentionSchedule.attention_pairs`): the causal triangle for
dense layers, the S2 pattern's pairs for S2 layers, so S2 attention counts at its real density.
Each pair costs ``2 * d`` for ``QK^T`` and ``2 * d`` for ``PV``; backward is counted as twice the
forward. TFLOP/s per GPU divides by the step time and the world size.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional

from .run_config import LoggingConfig, ModelConfig

__all__ = [
    "model_flops_per_iteration",
    "MetricsLogger",
    "plot_loss_curve",
    "memory_gib",
    "Throughput",
    "ThroughputMeter",
    "read_jsonl",
]


def model_flops_per_iteration(
    model: ModelConfig, global_batch_size: int, vocab_size: int, schedule
) -> float:
    """Model FLOPs (forward + backward) of one optimizer step; see the module docstring.

    ``model`` is the run config's model section, ``schedule`` its attention schedule."""
    m = model
    h, L = m.hidden_size, m.num_layers
    heads = m.num_attention_heads
    groups = m.num_query_groups or heads
    d = m.kv_channels or h // heads
    f = m.ffn_size
    tokens = global_batch_size * m.seq_length
    mlp_mats = 3 if m.swiglu else 2
    per_token = (
        L * (h * (heads * d + 2 * groups * d) + heads * d * h + mlp_mats * h * f) + h * vocab_size
    )
    matmul = 2.0 * tokens * per_token
    pairs = sum(schedule.attention_pairs(L, heads, groups, m.seq_length))
    attn = global_batch_size * 4.0 * d * pairs
    return 3.0 * (matmul + attn)


def memory_gib() -> tuple[str, float]:
    """(label, GiB): peak CUDA memory allocated on this GPU, else this process's resident set."""
    import torch

    if (
        torch.cuda.is_available()
        and torch.cuda.device_count() > 0
        and torch.version.cuda is not None
    ):
        try:
            return "gpu_mem_gib", torch.cuda.max_memory_allocated() / 2**30
        except Exception:  # CPU mode: torch.cuda is stubbed
            pass
    import psutil

    return "cpu_rss_gib", psutil.Process().memory_info().rss / 2**30


class MetricsLogger:
    """Writes metrics of the main rank to the console (tqdm bar on a TTY + lines), TensorBoard
    and JSONL.

    Only the global rank 0 writes; every other rank gets a logger whose methods do nothing.
    ``log_interval``: training records after the first iteration, every that many iterations
    and after the last one (:meth:`should_log`).
    """

    def __init__(
        self,
        run_dir: str,
        total_iters: int,
        start_iter: int,
        *,
        enabled: bool,
        progress_bar: bool = True,
        tensorboard: bool = True,
        log_interval: int = 1,
    ):
        self.enabled = enabled
        self.total_iters = total_iters
        self.log_interval = log_interval
        self.run_dir = run_dir
        self.jsonl_path = os.path.join(run_dir, "metrics.jsonl")
        self._bar = None
        self._tb = None
        self._jsonl = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        # Appending keeps the records of earlier segments of a resumed run; records of iterations
        # past the resume point (lost with a crash) are dropped, so the file reads as one run.
        self._truncate_after(start_iter)
        self._jsonl = open(self.jsonl_path, "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(
                    os.path.join(run_dir, "tensorboard"), purge_step=start_iter + 1
                )
            except ImportError:
                print(
                    "[megatron-s2] tensorboard is not installed; TensorBoard logging is off",
                    flush=True,
                )
        # A bar redrawn with carriage returns is noise in a log file (slurm, CI): only on a TTY.
        if progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_iters,
                initial=start_iter,
                desc="train",
                unit="it",
                dynamic_ncols=True,
                leave=True,
            )

    @classmethod
    def from_config(
        cls,
        config: LoggingConfig,
        run_dir: str,
        total_iters: int,
        start_iter: int,
        *,
        enabled: bool,
    ) -> MetricsLogger:
        """The logger of a run's ``logging`` section (``run_dir``: the resolved run directory)."""
        return cls(
            run_dir,
            total_iters,
            start_iter,
            enabled=enabled,
            progress_bar=config.progress_bar,
            tensorboard=config.tensorboard,
            log_interval=config.log_interval,
        )

    def should_log(self, iteration: int) -> bool:
        """Write a training record after ``iteration``? After the run's first iteration (the
        loss curve starts at its start), every ``log_interval`` and after the last one. (Every
        rank gets the same answer.)"""
        return iteration == 1 or iteration % self.log_interval == 0 or iteration == self.total_iters

    def _truncate_after(self, start_iter: int) -> None:
        if not os.path.exists(self.jsonl_path):
            return
        with open(self.jsonl_path) as f:
            lines = f.readlines()
        kept = [
            ln for ln in lines if ln.strip() and json.loads(ln).get("iteration", 0) <= start_iter
        ]
        if len(kept) != len(lines):
            with open(self.jsonl_path, "w") as f:
                f.writelines(kept)

    def print(self, msg: str) -> None:
        """A console line that does not break the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(msg)
        else:
            print(msg, flush=True)

    def advance(self, n: int = 1, **postfix) -> None:
        """Move the progress bar by ``n`` iterations, showing ``postfix`` values."""
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)

    def log(self, record: dict, prefix: str = "train") -> None:
        """Write one record (must contain ``iteration``) to JSONL and TensorBoard."""
        if not self.enabled:
            return
        record = {"kind": prefix, **record}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            step = record["iteration"]
            for k, v in record.items():
                if (
                    k not in ("iteration", "kind")
                    and isinstance(v, (int, float))
                    and math.isfinite(v)
                ):
                    self._tb.add_scalar(f"{prefix}/{k}", v, step)
            self._tb.flush()

    def close(self) -> None:
        """Flush and close everything."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


def read_jsonl(path: str) -> list[dict]:
    """Records of a metrics.jsonl file."""
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def plot_loss_curve(jsonl_path: str, out_path: str, title: Optional[str] = None) -> Optional[str]:
    """Plot train (and validation) loss from ``metrics.jsonl`` to a PNG; None if nothing to plot."""
    records = read_jsonl(jsonl_path)

    def curve(kind: str) -> list:
        return [
            (r["iteration"], r["loss"]) for r in records if r.get("kind") == kind and "loss" in r
        ]

    train, valid = curve("train"), curve("valid")
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train), label="train")
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def _synchronized_clock() -> float:
    """Seconds on a monotonic clock, after the GPU finished its queued work (so that a lap
    measures the GPU's time, not the host's)."""
    import torch

    if torch.cuda.is_available() and torch.version.cuda is not None:
        try:
            torch.cuda.synchronize()
        except Exception:  # CPU mode stubs CUDA
            pass
    return time.perf_counter()


@dataclass(frozen=True)
class Throughput:
    """Training speed over some iterations."""

    seconds_per_iteration: float
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs (see the module docstring)


class ThroughputMeter:
    """Training time in windows (one per logged record) and the throughput they give.

    Only training counts: :meth:`paused` leaves out evaluation and checkpoint saves. The first
    window holds the warm-up (allocator, first-call overheads), so the run's :meth:`mean` leaves
    it out when there are others.

    Args:
        tokens_per_iteration: global batch size x sequence length.
        flops_per_iteration: :func:`model_flops_per_iteration`.
        world_size: processes (GPUs) sharing the work.
        clock: seconds; default synchronises CUDA first.
    """

    def __init__(
        self,
        tokens_per_iteration: int,
        flops_per_iteration: float,
        world_size: int,
        clock: Callable[[], float] = _synchronized_clock,
    ):
        self.tokens_per_iteration = tokens_per_iteration
        self.flops_per_iteration = flops_per_iteration
        self.world_size = world_size
        self._clock = clock
        self._t0 = clock()
        self._iters, self._time = 0, 0.0
        self._windows: list[tuple[int, float]] = []  # (iterations, seconds)
        self.last = Throughput(0.0, 0.0, 0.0)

    def _lap(self) -> float:
        t = self._clock()
        dt, self._t0 = t - self._t0, t
        return dt

    def start(self) -> None:
        """Start timing now (setup before this does not count)."""
        self._lap()

    def step(self) -> None:
        """Count one training iteration into the current window."""
        self._iters += 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Bank the training time so far; the time inside the block is not training."""
        self._time += self._lap()
        try:
            yield
        finally:
            self._lap()

    def _throughput(self, iters: int, seconds: float) -> Throughput:
        per_iter = seconds / iters
        return Throughput(
            per_iter,
            self.tokens_per_iteration / per_iter,
            self.flops_per_iteration / per_iter / self.world_size / 1e12,
        )

    def close_window(self) -> Throughput:
        """End the current window (at least one iteration) and return its throughput."""
        self._time += self._lap()
        self.last = self._throughput(self._iters, self._time)
        self._windows.append((self._iters, self._time))
        self._iters, self._time = 0, 0.0
        return self.last

    def finish(self) -> None:
        """Keep the iterations of a run that stopped between two records, up to the last one."""
        if self._iters:
            self._windows.append((self._iters, self._time))
            self._iters, self._time = 0, 0.0

    def mean(self) -> Throughput:
        """Throughput of the run without its warm-up window; the last window's (zeros without
        any) when no time was measured."""
        steady = self._windows[1:] or self._windows
        iters, seconds = sum(w[0] for w in steady), sum(w[1] for w in steady)
        return self._throughput(iters, seconds) if seconds else self.last
