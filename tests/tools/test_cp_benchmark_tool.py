"""tools/cp_benchmark.py's --profile grouping, on fake profiler events (the tool needs a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.helpers.megatron import import_tool

cpb = import_tool("cp_benchmark")

pytestmark = pytest.mark.version_independent


def _ev(name, us, legacy=False):
    if legacy:  # torch before self_device_time_total
        return SimpleNamespace(key=name, self_cuda_time_total=us)
    return SimpleNamespace(key=name, self_device_time_total=us)


WANT = [
    ("cuDNN/flash attention backward", 3.0),
    ("cuDNN/flash attention forward", 1.0),
    ("S2 Triton kernels", 0.5),
    ("LSE merge and other elementwise", 0.2),
    ("copies and concatenation", 0.1),
    ("other", 0.01),
]


def test_kernel_times_grouped_per_step_largest_first():
    events = [
        _ev("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3", 9000.0),
        _ev("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", 3000.0),
        _ev("void at::native::elementwise_kernel<128, 2>", 600.0),
        _ev("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>", 300.0, True),
        _ev("_s2_dkdv_kernel", 1500.0),
        _ev("some_unknown_kernel", 30.0),
        _ev("cudaDeviceSynchronize", 0.0),
    ]
    got = cpb.group_kernel_times(events, steps=3)
    assert [g for g, _ in got] == [g for g, _ in WANT]
    assert [ms for _, ms in got] == pytest.approx([ms for _, ms in WANT])


def test_exchange_benchmark_needs_torchrun_on_gpus(capsys, monkeypatch):
    """tools/cp_exchange_benchmark.py times real NCCL exchanges: outside torchrun on CUDA GPUs it
    says so and exits 2 instead of failing later."""
    tool = import_tool("cp_exchange_benchmark")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert tool.main([]) == 2
    assert "torchrun on CUDA GPUs" in capsys.readouterr().err
