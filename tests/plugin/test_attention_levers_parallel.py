"""The retrieval levers under TP / SP / PP / CP (CPU, gloo, 2 processes): a tiny fp32 model with
NoPE or their own RoPE base on the dense layers and learned sinks on the S2 layers (and, with
NoPE, on the dense layers too) trains the
same losses, grad norms and first-step gradients (the sinks' included) in every layout as in one
process. tools/gpu_parallel_check.py's harness (as tests/plugin/test_megatron_parallel.py)."""

import pytest

from tests.helpers.megatron import import_tool

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.slow

_S2 = {"block_size": 16, "local_blocks": 2, "vert_stride": 8, "head_offset": 1, "sinks": True}
SCHEDULES = {
    "nope_sinks": {  # sinks on every layer: the dense ones run the S2 module, dense pattern
        "s2": _S2,
        "dense_layers": {"pattern": "SD", "position_embedding": "nope", "sinks": True},
        "overrides": {2: {"vert_stride": 2, "num_dense_heads": 2}},
    },
    "rotary_base_sinks": {
        "s2": _S2,
        "dense_layers": {"pattern": "SD", "rotary_base": 1.0e6},
        "overrides": {2: {"vert_stride": 2, "num_dense_heads": 2}},
    },
}
LAYOUTS = {
    "nope_sinks": ["tp2_sp", "pp2", "cp2_all_gather", "cp2_a2a"],
    "rotary_base_sinks": ["tp2", "pp2", "cp2", "cp2_a2a"],
}


@pytest.fixture(scope="module", params=sorted(SCHEDULES))
def results(request, tmp_path_factory):
    tool = import_tool()
    cc = tool.CheckConfig.tiny_cpu(schedule=SCHEDULES[request.param])
    layouts = [layout for layout in tool.GPU_LAYOUTS if layout.name in LAYOUTS[request.param]]
    rows = tool.run_check(cc, layouts, str(tmp_path_factory.mktemp(request.param)))
    print(tool.format_table(rows))
    return request.param, {r["layout"]: r for r in rows}


def test_levers_match_single_process_in_every_layout(results):
    name, rows = results
    assert sorted(rows) == sorted(LAYOUTS[name])
    for layout, row in rows.items():
        assert "error" not in row, (layout, row.get("error"))
        assert row["passed"], (layout, row)
        assert row["max_rel_loss_diff"] < 1e-5, layout
        assert row["max_rel_grad_diff_step0"] < 1e-4, layout
        assert len(row["losses"]) == 2
