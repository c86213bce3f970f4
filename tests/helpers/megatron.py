"""Shared helpers for the Megatron integration tests (tiny models, single-process setup)."""

from __future__ import annotations

import contextlib
import io
import os
import random
import socket
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(REPO, "tools")

TINY_SCHEDULE = {
    "s2": {"block_size": 16, "local_blocks": 2, "vert_stride": 8, "head_offset": 1},
    "dense_layers": {"pattern": "SD"},
    "overrides": {2: {"vert_stride": 4, "num_dense_heads": 2}},
}


# Ports for the tests' process groups: below Linux's ephemeral range (32768-60999 by default),
# in a slice of their own per pytest-xdist worker. A port found by binding to 0 comes from the
# ephemeral range and is closed before rank 0's store binds it; in between, the other worker's
# gloo and store connections (which take ephemeral ports) can take it, and the test fails with
# EADDRINUSE (seen in CI). Within one worker the tests run one at a time. The range stays clear
# of launch/slurm.sbatch's rendezvous ports (15000-29999), which the Slurm tests use.
_PORT_LOW, _PORT_HIGH = 5000, 15000
# Not the global random module: Megatron's set-up seeds it, which would make processes sharing a
# slice try the same ports in the same order.
_PORT_RNG = random.SystemRandom()


def _port_slice() -> range:
    """This xdist worker's ports: the range split evenly over PYTEST_XDIST_WORKER_COUNT workers
    (gw0 the first part; without xdist the whole range)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker[2:].isdigit() and count.isdigit() and int(count) > 0):
        return range(_PORT_LOW, _PORT_HIGH)
    size = (_PORT_HIGH - _PORT_LOW) // int(count)
    low = _PORT_LOW + int(worker[2:]) * size
    return range(low, low + size)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, drawn at random from this xdist worker's slice
    (:func:`_port_slice`); after 64 draws that were all in use, one the kernel picks."""
    ports = _port_slice()
    for port in _PORT_RNG.sample(ports, min(64, len(ports))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process() -> None:
    """gloo world of one and Megatron TP=PP=1 in this process (idempotent; no CPU mode)."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        try:
            torch.distributed.get_rank(group=parallel_state.get_pipeline_model_parallel_group())
        except (ValueError, RuntimeError):
            # Groups of a world an earlier test tore down and replaced: start over.
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def tiny_config(config_class=None, **kw):
    """A 4-layer, hidden-64, 8-head (4 KV groups, head size 16) TransformerConfig for CPU tests."""
    from megatron.core.transformer import TransformerConfig

    # kv_channels 16: the smallest head size the Triton kernels take (the test session runs them
    # under the interpreter on CPU).
    base = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=4,
        kv_channels=16,
        ffn_hidden_size=128,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        normalization="RMSNorm",
        use_cpu_initialization=True,
        add_bias_linear=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        params_dtype=torch.float32,
    )
    base.update(kw)
    return (config_class or TransformerConfig)(**base)


def tiny_s2_config(schedule, **kw):
    """:func:`tiny_config` as a ``megatron_s2.S2TransformerConfig`` carrying ``schedule``."""
    from megatron_s2.config import S2TransformerConfig

    return tiny_config(config_class=S2TransformerConfig, s2_schedule=schedule, **kw)


def import_tool(name: str = "gpu_parallel_check"):
    """Import tools/<name>.py. gpu_parallel_check's launches take their port from free_port
    (this worker's slice) instead of the kernel's ephemeral range; the tool still retries a
    launch whose port was taken."""
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    module = __import__(name)
    if name == "gpu_parallel_check":
        module._free_port = free_port
    return module


def run_tool_main(name: str, argv) -> subprocess.CompletedProcess:
    """tools/<name>.py's ``main(argv)`` in this process, its output captured: the exit code,
    stdout and stderr as a ``CompletedProcess`` (what ``subprocess.run(..., text=True)`` of the
    command line returns). For tools whose work takes milliseconds, where a process of its own
    would add an interpreter's start-up (and numpy's, scipy's) to every call."""
    argv = [str(a) for a in argv]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = import_tool(name).main(argv)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


class _Group:
    """A stand-in process group: rank and size only (what the attention modules ask)."""

    def __init__(self, rank, size):
        self._r, self._s = rank, size

    def rank(self):
        return self._r

    def size(self):
        return self._s


class TensorParallelGroups:
    """A stand-in ``pg_collection`` whose ``tp`` group says ``rank`` of ``size``: builds one
    tensor-parallel rank's attention module in a single process."""

    def __init__(self, rank, size):
        self.tp = _Group(rank, size)
