"""The experimental fused backward (``KernelConfig(fused_bwd=True)``: the dK/dV programs also add
dQ, in a fixed order per query tile) against the fp64 reference and the two-pass backward, with
the real kernels (interpreter on the CPU); and its schedule: every (query head, query tile)
gets its contributions numbered 0, 1, 2, ... in program order, each program's entries once."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import (
    DEVICE,
    assert_matches,
    attention_with_grads,
    fp64_reference,
    make_inputs,
    upstream_grads,
)

import s2attn.triton_attention as tri_mod
from s2attn import S2Pattern, s2_attention, s2_attention_varlen
from s2attn.layout import fused_backward_schedule, layout_for

pytestmark = pytest.mark.version_independent

FP32_TOL = 1e-5
BF16_TOL = 2e-2

CASES = [
    # id, batch, seq, heads, kv heads, head dim, block, local, stride, q_start, dtype
    ("gqa-odd-fp32", 2, 200, 4, 2, 32, 16, 2, 3, 0, torch.float32),
    ("offset-mha-d64-fp32", 1, 96, 4, 4, 64, 16, 1, 2, 32, torch.float32),
    ("mqa-block32-bf16", 1, 130, 4, 1, 32, 32, 2, 2, 0, torch.bfloat16),
]


def _config(pattern, d, dtype, fused):
    cfg = tri_mod.kernel_config(pattern, d, DEVICE, dtype)
    return dataclasses.replace(cfg, fused_bwd=fused)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fused_backward_matches_reference_and_two_pass(case):
    _, b, s, h, hk, d, block, local, stride, q_start, dtype = case
    pattern = S2Pattern(
        num_heads=h, num_kv_heads=hk, block_size=block, local_blocks=local, vert_stride=stride
    )
    # Megatron's [s, b, h, d] storage seen as [b, s, h, d] views: strided inputs.
    leaves, views = make_inputs(b, s, s + q_start, h, hk, d, dtype, layout="sbhd")
    dout, dlse = upstream_grads(b, s, h, d)
    ref = fp64_reference(views, pattern, dout, dlse, q_start=q_start)
    got = {}
    for fused in (False, True):
        cfg = _config(pattern, d, dtype, fused)
        got[fused] = attention_with_grads(
            lambda q_, k_, v_, cfg=cfg: s2_attention(
                q_,
                k_,
                v_,
                pattern,
                return_lse=True,
                q_start=q_start,
                backend="triton",
                kernel_config=cfg,
            ),
            leaves,
            views,
            dout,
            dlse,
        )
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert_matches(got[True], ref, tol)
    # dK/dV come from the same loop either way; dQ sums the same products in another order.
    for name in ("dk", "dv"):
        assert torch.equal(got[True][name], got[False][name]), name
    assert_matches(got[True], got[False], tol, names=("dq",))


def test_fused_backward_is_deterministic():
    pattern = S2Pattern(num_heads=4, num_kv_heads=2, block_size=16, local_blocks=2, vert_stride=3)
    _, (q, k, v) = make_inputs(1, 150, 150, 4, 2, 32, torch.float32, seed=3)
    cfg = _config(pattern, 32, torch.float32, True)
    grads = []
    for _ in range(2):
        out = s2_attention(q, k, v, pattern, backend="triton", kernel_config=cfg)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_schedule_numbers_each_query_tiles_contributions_in_program_order(group):
    heads = 4
    pattern = S2Pattern(
        num_heads=heads, num_kv_heads=heads // group, block_size=16, local_blocks=2, vert_stride=3
    )
    lay = layout_for(pattern, 320, 320, 0, 0, 32, 16, "cpu", with_csc=True)
    order, turns = fused_backward_schedule(lay)
    nkt, nqt = lay.num_k_tiles, lay.num_q_tiles
    n_items = (heads // group) * nkt
    assert sorted(order.tolist()) == list(range(n_items))
    # Heads interleaved: consecutive programs belong to different KV heads when there are several.
    if heads // group > 1:
        assert len({int(i) // nkt for i in order[: heads // group]}) == heads // group
    # Walk the programs in order, as the kernel's tickets do, and check every turn.
    seen = torch.zeros(heads, nqt, dtype=torch.int64)
    col_ptr, rows = lay.col_ptr.tolist(), lay.rows.tolist()
    for item in order.tolist():
        kvh, kt = divmod(item, nkt)
        for h in range(kvh * group, (kvh + 1) * group):
            c = h * nkt + kt
            for e in range(col_ptr[c], col_ptr[c + 1]):
                assert turns[e] == seen[h, rows[e]], (item, h, rows[e])
                seen[h, rows[e]] += 1
    # Every query tile's contributions were all counted: as many as its row list has entries.
    row_counts = (lay.row_ptr[1:] - lay.row_ptr[:-1]).view(heads, nqt)
    assert torch.equal(seen, row_counts.to(torch.int64))


def test_a_wrong_schedule_poisons_dq_under_the_interpreter(monkeypatch):
    """The check behind the tests above: contributions out of turn are not silently summed."""
    if not tri_mod._INTERPRETED:
        pytest.skip("the interpreter's turn check (a GPU would wait instead)")
    real = tri_mod.fused_backward_schedule

    def out_of_turn(lay):
        order, turns = real(lay)
        return order, torch.zeros_like(turns)

    monkeypatch.setattr(tri_mod, "fused_backward_schedule", out_of_turn)
    pattern = S2Pattern(num_heads=2, num_kv_heads=2, block_size=16, local_blocks=2, vert_stride=2)
    _, (q, k, v) = make_inputs(1, 96, 96, 2, 2, 32, torch.float32)
    cfg = _config(pattern, 32, torch.float32, True)
    out = s2_attention(q, k, v, pattern, backend="triton", kernel_config=cfg)
    dq, dk = torch.autograd.grad(out.sum(), (q, k))
    assert dq.isnan().any() and torch.isfinite(dk).all()


def test_fused_flag_must_be_a_bool():
    cfg = tri_mod.kernel_config(
        S2Pattern(num_heads=2, block_size=16, local_blocks=1, vert_stride=2), 32, "cpu"
    )
    with pytest.raises(TypeError, match="KernelConfig.fused_bwd must be a bool"):
        dataclasses.replace(cfg, fused_bwd=1)


def test_varlen_calls_keep_the_two_passes():
    """Packed documents are not fused (``KernelConfig.fused_bwd`` says so): the same gradients
    as without the flag, not an error."""
    pattern = S2Pattern(num_heads=2, num_kv_heads=1, block_size=16, local_blocks=1, vert_stride=2)
    lens = [37, 1, 64]
    cu = torch.tensor([0, 37, 38, 102], dtype=torch.int32, device=DEVICE)
    _, (q, k, v) = make_inputs(1, sum(lens), sum(lens), 2, 1, 32, torch.float32, seed=5)
    grads = []
    for fused in (False, True):
        cfg = _config(pattern, 32, torch.float32, fused)
        out = s2_attention_varlen(
            q[0], k[0], v[0], cu, max(lens), pattern, backend="triton", kernel_config=cfg
        )
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
