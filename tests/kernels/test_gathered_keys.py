"""Gathered key tiles (``s2attn.gathered_keys``): blocks 16 and 32 on the Gluon kernels' 64-key
tiles. Without a GPU: the layout over the gathered tiles expands to the pattern's token mask, and
the three Gluon passes' schedules, emulated in float64 on gathered K/V, give the reference's
output and gradients (tests/kernels/test_kernels_gpu.py runs the kernels)."""

from __future__ import annotations

import pytest
import torch

import s2attn.gluon_dkdv as gd
import s2attn.gluon_dq as gq
import s2attn.gluon_forward as gf
from s2attn import S2Pattern
from s2attn.gathered_keys import (
    TILE_N,
    check_call,
    gathered_keys,
    sum_groups,
    unsupported_reason,
)
from tests.helpers.kernels import float64_s2_case, token_mask

pytestmark = pytest.mark.version_independent

PATTERNS = [
    dict(num_heads=4, block_size=16, local_blocks=3, vert_stride=4),
    dict(num_heads=8, num_kv_heads=2, block_size=32, local_blocks=2, vert_stride=4, head_offset=1),
    dict(num_heads=4, block_size=16, local_blocks=16, vert_stride=8, num_dense_heads=1),
    # heads whose vertical keys do not fill whole tiles: a tile mixes both kinds
    dict(num_heads=2, block_size=16, local_blocks=2, vert_stride=3),
    dict(num_heads=4, num_kv_heads=1, block_size=16, local_blocks=1, vert_stride=2, homo_head=True),
]


def expand(keys, block_m, q_start=0):
    """(heads, seq - q_start, seq) token mask of the gathered layout at ``block_m``-row tiles
    of the queries from ``q_start``, at the keys' positions; checks that full entries need no
    mask."""
    lay = keys.layout(block_m, q_start=q_start)
    H, S = keys.num_heads, keys.seq
    out = torch.zeros(H, S - q_start, S, dtype=torch.bool)
    for item in range(H * lay.num_q_tiles):
        h, t = divmod(item, lay.num_q_tiles)
        q = q_start + torch.arange(t * block_m, (t + 1) * block_m)[:, None]
        for e in range(int(lay.row_ptr[item]), int(lay.row_ptr[item + 1])):
            p = int(lay.cols[e]) * TILE_N + torch.arange(TILE_N)
            ok = (q >= keys.key_lo[h, p]) & (q < keys.key_hi[h, p])
            ok &= (q >= int(lay.lo[e])) & (q < int(lay.hi[e]))
            if e < int(lay.row_split[item]):
                assert ok.all(), "an entry flagged full needs a mask"
            assert not out[h, t * block_m : (t + 1) * block_m][:, keys.order[p, h]][ok].any()
            out[h, t * block_m : (t + 1) * block_m, keys.order[p, h]] |= ok
    return out


@pytest.mark.parametrize("kw", PATTERNS)
@pytest.mark.parametrize("seq", [512, 768])
def test_gathered_layout_expands_to_the_token_mask(kw, seq):
    pattern = S2Pattern(**kw)
    keys = gathered_keys(pattern, seq, "cpu")
    # Each head's order is a permutation of whole pattern blocks.
    every = torch.arange(seq)[:, None].expand(seq, keys.num_heads)
    assert torch.equal(keys.order.sort(0).values, every)
    B, H = pattern.block_size, keys.num_heads
    assert torch.equal(keys.order.view(-1, B, H) % B, every.reshape(-1, B, H) % B)
    want = token_mask(pattern, seq, seq)
    for block_m in (128, 64):
        assert torch.equal(expand(keys, block_m), want)
    # A context-parallel chunk: the last queries, all keys from 0.
    for q_start in (128, 256):
        assert torch.equal(expand(keys, 128, q_start), want[:, q_start:])
    lay = keys.layout(64, with_csc=True)
    assert lay.col_ptr is not None and lay.group == 1 and lay.block_n == TILE_N


def test_vertical_tiles_are_full_below_the_window():
    # Block 16, window 16 blocks, stride 8, 16k tokens: most of the last query tile's entries
    # are the full vertical tiles behind its window, and the tiles computed are mostly attended.
    pattern = S2Pattern(num_heads=8, block_size=16, local_blocks=16, vert_stride=8)
    lay = gathered_keys(pattern, 16384, "cpu").layout(128)
    last = torch.arange(lay.num_q_tiles - 1, lay.num_heads * lay.num_q_tiles, lay.num_q_tiles)
    full = (lay.row_split[last] - lay.row_ptr[last]).float()
    total = (lay.row_ptr[last + 1] - lay.row_ptr[last]).float()
    assert (full / total).min() >= 0.8
    assert pattern.attended_pairs(16384) / (lay.nnz * 128 * TILE_N) > 0.85


def test_sum_groups_adds_each_kv_groups_heads():
    g = torch.randn(2, 64, 8, 4, dtype=torch.bfloat16)
    got = sum_groups(g, 4, torch.bfloat16)
    want = torch.stack([g[:, :, :4].float().sum(2), g[:, :, 4:].float().sum(2)], 2)
    assert torch.equal(got, want.to(torch.bfloat16))
    assert torch.equal(sum_groups(g, 1, torch.bfloat16), g)


@pytest.mark.parametrize(
    "batch,seq,heads,kv_heads,local,stride,offset,block,dense",
    [
        (2, 512, 4, 4, 3, 4, 0, 16, 0),  # MHA, two batch rows
        (1, 768, 8, 2, 2, 4, 1, 32, 0),  # GQA 8/2 at block 32, phase 1
        (1, 512, 4, 2, 16, 8, 0, 16, 1),  # a dense head, window of 16 blocks
        (1, 384, 2, 1, 2, 3, 0, 16, 0),  # tiles mixing vertical and local keys
    ],
)
def test_emulated_passes_on_gathered_keys_match_reference(
    batch, seq, heads, kv_heads, local, stride, offset, block, dense
):
    pattern, q, k, v, do, scale, out_ref, lse_ref = float64_s2_case(
        batch, seq, heads, kv_heads, local, stride, offset, block_size=block, dense_heads=dense
    )
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(out_ref, (q, k, v), do)
    q, k, v = q.detach(), k.detach(), v.detach()
    keys = gathered_keys(pattern, seq, "cpu")
    out, lse = gf.emulate_forward(q, k, v, pattern, scale, keys=keys)
    torch.testing.assert_close(out, out_ref.detach(), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, lse_ref.detach(), rtol=1e-9, atol=1e-9)
    dq, delta = gq.emulate_dq(do, None, q, k, v, out, lse, pattern, scale, keys=keys)
    dk, dv = gd.emulate_dkdv(do, q, k, v, lse, delta, pattern, scale, keys=keys)
    torch.testing.assert_close(dq, dq_ref, rtol=1e-9, atol=1e-9)
    group = pattern.group_size
    torch.testing.assert_close(sum_groups(dk, group, torch.float64), dk_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(sum_groups(dv, group, torch.float64), dv_ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "seq_k,q_start,heads,kv_heads,block", [(768, 256, 4, 2, 16), (1024, 768, 8, 2, 32)]
)
def test_emulated_passes_on_a_chunk_match_reference(seq_k, q_start, heads, kv_heads, block):
    """A context-parallel chunk (queries q_start.., keys from 0) on gathered tiles: the three
    passes' schedules against the full sequence's reference rows and gradients."""
    pattern, q, k, v, do, scale, out_ref, lse_ref = float64_s2_case(
        1, seq_k, heads, kv_heads, 4, 4, 1, block_size=block
    )
    sl = slice(q_start, None)
    # Only the chunk's rows carry an upstream gradient: the reference's K/V gradients are then
    # the chunk's.
    do = torch.cat([torch.zeros_like(do[:, :q_start]), do[:, sl]], 1)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(out_ref, (q, k, v), do)
    q, k, v = q.detach()[:, sl], k.detach(), v.detach()
    keys = gathered_keys(pattern, seq_k, "cpu")
    out, lse = gf.emulate_forward(q, k, v, pattern, scale, q_start, keys=keys)
    torch.testing.assert_close(out, out_ref.detach()[:, sl], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, lse_ref.detach()[..., sl], rtol=1e-9, atol=1e-9)
    dq, delta = gq.emulate_dq(
        do[:, sl], None, q, k, v, out, lse, pattern, scale, q_start, keys=keys
    )
    dk, dv = gd.emulate_dkdv(do[:, sl], q, k, v, lse, delta, pattern, scale, q_start, keys=keys)
    torch.testing.assert_close(dq, dq_ref[:, sl], rtol=1e-9, atol=1e-9)
    group = pattern.group_size
    torch.testing.assert_close(sum_groups(dk, group, torch.float64), dk_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(sum_groups(dv, group, torch.float64), dv_ref, rtol=1e-9, atol=1e-9)


def test_unsupported_calls_are_named():
    p16 = S2Pattern(num_heads=2, block_size=16, local_blocks=2, vert_stride=4)
    assert unsupported_reason(p16, 512, 512, 0, None) is None
    assert "block_size 64" in unsupported_reason(
        S2Pattern(num_heads=2, block_size=64, local_blocks=2, vert_stride=4), 512, 512, 0, None
    )
    assert "multiples of 128" in unsupported_reason(p16, 500, 500, 0, None)
    assert unsupported_reason(p16, 256, 512, 256, None) is None  # a context-parallel chunk
    assert "last positions" in unsupported_reason(p16, 256, 512, 128, None)
    user = S2Pattern.from_block_mask(p16.block_mask(32), 16)
    assert "user block mask" in unsupported_reason(user, 512, 512, 0, None)
    keys = gathered_keys(p16, 512, "cpu")
    check_call("fn", keys, p16, 2, 512)
    with pytest.raises(ValueError, match="fn: block_size 16 runs on gathered key tiles"):
        check_call("fn", None, p16, 2, 512)
    with pytest.raises(ValueError, match="fn: block_size 64 runs on gathered"):
        check_call("fn", keys, S2Pattern(num_heads=2, block_size=64, local_blocks=2), 2, 512)
    with pytest.raises(ValueError, match="2 heads x 512 keys, the call has 2 x 640"):
        check_call("fn", keys, p16, 2, 640)
    with pytest.raises(ValueError, match="fn: pass either lay or keys, not both"):
        check_call("fn", keys, p16, 2, 512, keys.layout(128))
    with pytest.raises(ValueError, match="block_size 64"):
        gathered_keys(
            S2Pattern(num_heads=2, block_size=64, local_blocks=2, vert_stride=4), 512, "cpu"
        )
