"""The explicit CPU mode (``megatron_s2.training.cpu_mode``) on the installed megatron-core.

CPU mode patches torch process-wide, so each check runs in a fresh interpreter: the rest of the
session must keep the real torch. The data-parallel check takes one optimizer step on two gloo
ranks through the seams that differ between megatron-core versions (0.19's ``start_grad_sync``
asks for the current CUDA stream on every step) and through the distributed optimizer's
reduce-scatter, which runs inside a coalescing manager: an emulated reduce-scatter there once
left data-parallel gradients unreduced.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.helpers.megatron import REPO, free_port

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU mode is for machines without CUDA"
)


def _run_args(*args: str) -> str:
    env = dict(
        os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1"
    )
    # The kernels are not involved; the interpreter would only slow the imports down.
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _run(code: str) -> str:
    return _run_args("-c", textwrap.dedent(code))


def _run_file(path, *args: str) -> str:
    return _run_args(str(path), *args)


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


_DDP_SCRIPT = """
import sys

import torch

# CPU mode before any Megatron import, as in the trainer: patches must not depend on import order.
from megatron_s2.training.cpu_mode import enable_cpu_mode

enable_cpu_mode()


def main(rank, dist_opt, overlap):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                               use_cpu_initialization=True)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    ref = [p.detach().clone().requires_grad_(True) for p in module.parameters()]
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=dist_opt,
                                              overlap_grad_reduce=overlap, bucket_size=100),
        module)
    # The distributed optimizer takes only Adam; eps 1 keeps its step proportional to the
    # gradient, so a wrongly reduced gradient cannot hide behind Adam's sign-like first step.
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=0.5, adam_eps=1.0, weight_decay=0.0, clip_grad=0.0,
                        use_distributed_optimizer=dist_opt), [ddp])
    x = torch.randn(2, 4, 8)  # one batch per rank, same seed everywhere
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ddp(x[rank]).sum().backward()
    ddp.finish_grad_sync()
    ok, _, _ = opt.step()
    assert ok
    # A data-parallel step is a step on the mean of the ranks' gradients.
    h = torch.nn.functional.linear(x, ref[0], ref[1])
    (torch.nn.functional.linear(h, ref[2], ref[3]).sum((1, 2)).mean()).backward()
    torch.optim.Adam(ref, lr=0.5, eps=1.0).step()
    for p, r in zip(module.parameters(), ref):
        torch.testing.assert_close(p.detach(), r.detach())
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    torch.multiprocessing.spawn(main, args=(sys.argv[1] == "1", sys.argv[2] == "1"), nprocs=2)
"""


@pytest.mark.parametrize(
    "dist_opt,overlap", [(False, False), (True, True)], ids=["allreduce", "distopt_overlap"]
)
def test_megatron_data_parallel_step_in_cpu_mode(tmp_path, dist_opt, overlap):
    """Two gloo ranks through Megatron's DDP grad sync (0.19: the current-stream waits) and
    optimizer (the distributed one reduce-scatters inside a coalescing manager)."""
    script = tmp_path / "ddp_step.py"
    script.write_text(_DDP_SCRIPT)
    _run_file(script, str(int(dist_opt)), str(int(overlap)))


def test_checkpoint_rng_state_in_cpu_mode_carries_no_cuda_state():
    # `megatron-s2-hf import` runs in CPU mode on the GPU machine too; there cpu_mode maps
    # torch.cuda.get_rng_state to the CPU generator's state, which a GPU run's
    # torch.cuda.set_rng_state refused ("RNG state is wrong size", 2026-11-28 on an H200). With
    # CUDA made to look available, a CPU-mode save must carry no CUDA state, and a CPU-mode load
    # must not hand a saved one to the (mapped) CUDA generator.
    out = _run("""
        import torch
        from megatron_s2.training import checkpointing, cpu_mode
        torch.cuda.is_available = lambda: True
        torch.version.cuda = "13.0"
        calls = []
        torch.cuda.get_rng_state = lambda *a, **k: calls.append("get") or torch.get_rng_state()
        torch.cuda.set_rng_state = lambda *a, **k: calls.append("set")
        cpu_mode.enable_cpu_mode()
        torch.cuda.get_rng_state = lambda *a, **k: calls.append("get") or torch.get_rng_state()
        torch.cuda.set_rng_state = lambda *a, **k: calls.append("set")
        state = checkpointing._rng_state()
        assert "cuda" not in state and "tracker" not in state, sorted(state)
        # A checkpoint that does carry one (saved on a GPU): the CPU state is restored, the
        # CUDA one left alone.
        torch.manual_seed(3)
        expected = torch.rand(2)
        torch.manual_seed(3)
        saved = checkpointing._rng_state()
        torch.rand(5)
        saved["cuda"] = torch.get_rng_state()
        saved["tracker"] = {}
        checkpointing._set_rng_state(saved)
        assert torch.equal(torch.rand(2), expected)
        assert calls == [], calls
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_megatron_imports_without_its_compile_wrappers_in_cpu_mode():
    """CPU mode imports megatron-core with torch.compile standing in as a no-op: its fusion
    functions stay plain Python (jit_fuser returns its function), inductor is not loaded, and
    torch.compile is the real one again afterwards. Without the block, jit_fuser compiles."""
    out = _run("""
        import sys, torch
        real = torch.compile
        from megatron_s2.training.cpu_mode import megatron_import_without_compile
        with megatron_import_without_compile():
            import megatron.core.distributed
        from megatron.core import jit
        from megatron.core.fusions import fused_bias_dropout
        assert torch.compile is real
        def f(x):
            return x
        assert jit.jit_fuser(f) is f
        train = fused_bias_dropout.bias_dropout_add_fused_train
        assert not hasattr(train, "_torchdynamo_orig_callable"), train
        assert "torch._inductor.compile_fx" not in sys.modules
        with megatron_import_without_compile():  # already imported: nothing to do
            assert torch.compile is real
        print("ok")
    """)
    assert out.strip().endswith("ok")
    # The control: the plain import compiles (so the test above can tell the two apart).
    out = _run("""
        import megatron.core.distributed
        from megatron.core.fusions import fused_bias_dropout
        train = fused_bias_dropout.bias_dropout_add_fused_train
        print(hasattr(train, "_torchdynamo_orig_callable"))
    """)
    assert out.strip().splitlines()[-1] == "True"


SAVE_SCRIPT = """
    import contextlib, multiprocessing.managers, os, sys
    from megatron_s2.training import checkpointing, cpu_mode
    cpu_mode.enable_cpu_mode()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from tests.helpers.megatron import init_single_process
    init_single_process()
    started = []
    start = multiprocessing.managers.BaseManager.start
    def recorded_start(self, *a, **k):
        started.append(type(self).__name__)
        return start(self, *a, **k)
    multiprocessing.managers.BaseManager.start = recorded_start
    def saves(root):
        for iteration in (1, 2):  # the second save in the same process too
            path = checkpointing.save_checkpoint(
                root, iteration, [], None, None, consumed_samples=5, config={"x": 1}
            )
        assert checkpointing.latest_iteration(root) == 2
        assert dist_checkpointing.load_common_state_dict(path)["consumed_samples"] == 5
        return sorted(os.listdir(path))
    files = saves(sys.argv[1] + "/cpu")
    print("cpu: files", files, "managers", started,
          "queue left", type(filesystem_async._results_queue).__name__)
    # The control, after: megatron-core's own results queue (a Manager's) in the same process.
    checkpointing._cpu_mode_write_results_in_process = contextlib.nullcontext
    print("control: files", saves(sys.argv[1] + "/control"), "managers", started)
"""


def test_checkpoint_save_in_cpu_mode_starts_no_helper_process(tmp_path):
    """megatron-core's writer hands its results over through a spawned multiprocessing Manager,
    whose first use imports torch (~3 s of each CPU process's first save). In CPU mode the
    trainer's synchronous save passes them in-process instead: no Manager, the same files, and
    megatron-core's own queue is left as it was. The control, with megatron-core's queue (run
    after, in the same process), starts one (so this test can tell the two apart) and writes
    the same files."""
    out = _run_args("-c", textwrap.dedent(SAVE_SCRIPT), str(tmp_path)).splitlines()
    cpu = next(line for line in out if line.startswith("cpu: "))
    control = next(line for line in out if line.startswith("control: "))
    files = cpu[len("cpu: ") :].split(" managers")[0]
    assert cpu.endswith("managers [] queue left NoneType"), out
    assert control.endswith("managers ['SyncManager']"), out
    assert control == f"control: {files} managers ['SyncManager']", out
    assert "'.metadata'" in files and "'__0_0.distcp'" in files, files


def test_a_gpu_test_fails_where_cpu_mode_is_on(monkeypatch):
    """tests/conftest.py: a gpu-marked test in a process where a CPU test switched CPU mode on
    fails, naming why, instead of passing on the CPU ("cuda" mapped there)."""
    from megatron_s2.training import cpu_mode
    from tests.conftest import _refuse_cpu_mode

    class Item:
        nodeid = "tests/plugin/test_x.py::test_on_cuda"

    monkeypatch.setattr(cpu_mode, "cpu_mode_enabled", lambda: False)
    _refuse_cpu_mode(Item())  # CPU mode off: nothing to say
    monkeypatch.setattr(cpu_mode, "cpu_mode_enabled", lambda: True)
    with pytest.raises(pytest.fail.Exception, match="test_on_cuda: CPU mode is on in this"):
        _refuse_cpu_mode(Item())
