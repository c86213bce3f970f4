"""Stand-ins for the GPU parts of tools/benchmark.py, so its tables and JSON run on a CPU."""

from __future__ import annotations


def fake_power_sampler(summary: dict) -> type:
    """A class with ``tools/gpu_timing.PowerSampler``'s interface (a context manager over one
    GPU) whose ``summary()`` is ``summary`` (power in W, SM clock in MHz, sample count)."""

    class FakePowerSampler:
        def __init__(self, gpu):
            self.gpu = gpu

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def summary(self):
            return summary

    return FakePowerSampler
