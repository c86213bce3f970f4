"""tests/hf load models with transformers in the test process. pytest-xdist may have run a file
that turned the trainer's CPU mode on in the same worker before (megatron_s2.training.cpu_mode
wraps torch's tensor factories to map "cuda" to the CPU), and transformers 5's from_pretrained
then leaves non-persistent buffers (RoPE's inv_freq) uninitialised when ``torch.tensor`` is a
Python wrapper. Nothing in tests/hf needs CPU mode in-process (Megatron runs in subprocesses
here), so each module runs with torch's own factories and gets CPU mode's back after."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _torch_factories_unwrapped():
    from megatron_s2.training.cpu_mode import _FACTORIES

    wrapped = {}
    for name in _FACTORIES:
        fn = getattr(torch, name, None)
        if getattr(fn, "_s2_cpu_mode", False):
            wrapped[name] = fn
            setattr(torch, name, fn.__wrapped__)
    yield
    for name, fn in wrapped.items():
        setattr(torch, name, fn)
