"""The retrieval levers' sinks on a GPU: the kernels (Hopper's included) with a learned sink
logit per head, on a dense layer (the dense pattern) and on an S2 layer, bf16 forward and
gradients against the float64 reference of tests/plugin/test_attention_levers.py. A module of
its own: that module's CPU tests switch CPU mode on for their process, which maps "cuda" to the
CPU."""

import pytest
import torch

from tests.helpers.megatron import init_single_process, tiny_s2_config

pytest.importorskip("megatron.core")

from megatron.core.transformer.enums import AttnMaskType  # noqa: E402

from megatron_s2.training.cpu_mode import cpu_mode_enabled  # noqa: E402
from tests.plugin.test_attention_levers import _sink_reference  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _dist():
    init_single_process()


@pytest.mark.parametrize("dense", [True, False])
def test_sinks_on_cuda_bf16_match_float64_reference(dense):
    """The GPU kernels (Hopper's included) with sinks on a dense layer (dense pattern) and on an
    S2 layer: bf16 forward and gradients against the float64 reference, at a length of several
    blocks in every tile size."""
    from megatron_s2.attention import ScheduledCoreAttention

    # CPU mode (the CPU tests' switch, process-wide) maps "cuda" to the CPU: this test would
    # then pass without a GPU kernel having run.
    assert not cpu_mode_enabled(), "CPU mode is on in this process: run the gpu tests apart"
    torch.manual_seed(3)
    s2 = {"block_size": 64, "local_blocks": 4, "vert_stride": 4}
    schedule = {"s2": s2, "dense_layers": {"pattern": "DS"}}
    side = "dense_layers" if dense else "s2"
    schedule[side] = schedule[side] | {"sinks": True}
    cfg = tiny_s2_config(schedule, num_attention_heads=8, num_query_groups=4, kv_channels=64)
    attn = ScheduledCoreAttention(
        config=cfg, layer_number=1 if dense else 2, attn_mask_type=AttnMaskType.causal
    ).cuda()
    assert attn.dense_layer is dense
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(8) * 2)
    seq = 1536
    q, k, v = (
        torch.randn(seq, 2, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for n in (8, 4, 4)
    )
    dout = torch.randn(seq, 2, 8 * 64, device="cuda", dtype=torch.bfloat16)
    out = attn(q, k, v, None)
    assert out.is_cuda
    pattern = None if dense else attn.pattern
    ref = _sink_reference(q, k, v, attn.sinks, pattern, attn.softmax_scale)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    leaves = (q, k, v, attn.sinks)
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(ref, leaves, dout.double())
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        err = float((g.double() - w).abs().max() / w.abs().max())
        assert err < 3e-2, (name, err)
