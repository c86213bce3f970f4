"""The explicit CPU mode (``megatron_s2.training.cpu_mode``) on the installed megatron-core.

CPU mode patches torch process-wide, so each check runs in a fresh interpreter: the rest of the
session must keep the real torch. The DDP check goes through the seams that differ between
megatron-core versions (0.19's ``start_grad_sync`` asks for the current CUDA stream on every
step), with and without overlapped grad reduction.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from megatron_helpers import REPO, free_port

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU mode is for machines without CUDA")


def _run(code: str) -> str:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    # The kernels are not involved; the interpreter would only slow the imports down.
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_streams_and_events_are_inert_only_after_enabling():
    out = _run("""
        import torch
        before = torch.cuda.current_stream
        from megatron_s2.training import cpu_mode
        assert torch.cuda.current_stream is before, "importing must not patch"
        assert not cpu_mode.cpu_mode_enabled()
        cpu_mode.enable_cpu_mode()
        cpu_mode.enable_cpu_mode()
        s = torch.cuda.current_stream()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        s.wait_event(e)
        s.wait_stream(torch.cuda.default_stream())
        assert s.record_event().query()
        side = torch.cuda.Stream(device=torch.cuda.current_device())
        with torch.cuda.stream(side):
            x = torch.ones(3, device="cuda")
        x.record_stream(side)
        side.synchronize()
        torch.cuda.synchronize()
        assert x.device.type == "cpu" and e.elapsed_time(e) == 0.0
        print("ok")
    """)
    assert out.strip().endswith("ok")


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_megatron_ddp_grad_sync_runs_in_cpu_mode(overlap):
    _run(f"""
        from megatron_s2.training.cpu_mode import enable_cpu_mode
        enable_cpu_mode()
        import torch
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig)
        from megatron.core.transformer import TransformerConfig

        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                   use_cpu_initialization=True)
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        ref = [p.detach().clone().requires_grad_(True) for p in module.parameters()]
        ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(overlap_grad_reduce={overlap},
                                                  bucket_size=64), module)
        x = torch.randn(4, 8)
        for _ in range(2):
            ddp.zero_grad_buffer()
            ddp(x).sum().backward()
            ddp.finish_grad_sync()
        h = torch.nn.functional.linear(x, ref[0], ref[1])
        torch.nn.functional.linear(h, ref[2], ref[3]).sum().backward()
        for p, r in zip(module.parameters(), ref):
            torch.testing.assert_close(p.main_grad, r.grad)
        torch.distributed.destroy_process_group()
    """)
