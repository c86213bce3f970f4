"""TP / PP / VPP / SP / CP equivalence on CPU: 2 (CP2+TP2: 4) gloo processes in CPU mode.

Runs tools/gpu_parallel_check.py's harness with a tiny fp32 model: the TP=1/PP=1 reference on one
process, then TP=2, TP=2+SP, PP=2, PP=2+VPP=2 and CP=2 on two (CP: each layer kind's default
communication, then every layer on the all-gather, then on the head all-to-all), CP=2 with
TP=2+SP or PP=2 on
four, each from the same initial weights and data (CP ranks: Megatron's load-balanced chunks of
it), through Megatron's pipeline schedules, DDP, finalize_model_grads and Adam. Losses and grad
norms of 2 steps and all first-step gradients must match (fp32: to ~1e-6).
The S2 layers use the PyTorch reference backend here; the kernels have their own tests.
"""

import pytest

from tests.helpers.megatron import import_tool

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tool = import_tool()
    cc = tool.CheckConfig.tiny_cpu()
    rows = tool.run_check(cc, tool.GPU_LAYOUTS, str(tmp_path_factory.mktemp("parallel")))
    print(tool.format_table(rows))
    return {r["layout"]: r for r in rows}


@pytest.mark.parametrize(
    "layout",
    [
        "tp2",
        "tp2_sp",
        "pp2",
        "pp2_vpp2",
        "cp2",
        "cp2_all_gather",
        "cp2_a2a",
        "cp2_tp2_sp",
        "cp2_tp2_a2a",
        "cp2_pp2",
    ],
)
def test_parallel_layout_matches_single_process(results, layout):
    row = results[layout]
    assert "error" not in row, row.get("error")
    assert row["passed"], row
    assert row["max_rel_loss_diff"] < 1e-5
    assert row["max_rel_grad_diff_step0"] < 1e-4
    assert len(row["losses"]) == 2


@pytest.mark.parametrize(
    "layout, expect",
    [
        ("cp2", {"S2CoreAttention": "all_gather", "FusedDenseAttention": "auto"}),
        ("cp2_all_gather", {"S2CoreAttention": "all_gather", "FusedDenseAttention": "all_gather"}),
        ("cp2_a2a", {"S2CoreAttention": "a2a", "FusedDenseAttention": "a2a"}),
        ("cp2_tp2_a2a", {"S2CoreAttention": "a2a", "FusedDenseAttention": "a2a"}),
    ],
)
def test_cp_comm_type_reaches_the_core_attention(results, layout, expect):
    """parallel.cp_comm_type through Megatron's layers to each core-attention module."""
    assert results[layout]["cp_comm"] == expect
