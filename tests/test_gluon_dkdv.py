"""The Gluon dK/dV pass (``s2attn.gluon_dkdv``) without a GPU: its schedule emulated in float64
against the reference's gradients, and a compile for sm_90 with the installed Triton
(tests/test_kernels_gpu.py has its device checks)."""

from __future__ import annotations

import pytest
import torch
from conftest import float64_s2_case, sm90_compile_stats

import s2attn.gluon_dkdv as gd

pytestmark = pytest.mark.version_independent


@pytest.mark.parametrize(
    "batch,seq,heads,kv_heads,local,stride,offset",
    [
        (2, 512, 4, 4, 2, 4, 0),  # MHA, two batch rows
        (1, 1024, 8, 2, 4, 8, 0),  # GQA 8/2
        (1, 512, 2, 2, 16, 1, 0),  # dense causal
        (1, 640, 4, 2, 2, 4, 3),  # a TP rank's heads; 10 key tiles x 2 KV heads
        (1, 576, 2, 1, 2, 4, 0),  # 9 key tiles: the last program runs one item
    ],
)
def test_emulated_schedule_matches_reference_gradients(
    batch, seq, heads, kv_heads, local, stride, offset
):
    pattern, q, k, v, do, scale, out, lse = float64_s2_case(
        batch, seq, heads, kv_heads, local, stride, offset
    )
    dk_ref, dv_ref = torch.autograd.grad(out, (k, v), do)
    delta = (do * out.detach()).sum(-1).transpose(1, 2)  # [b, h, s]
    dk, dv = gd.emulate_dkdv(
        do, q.detach(), k.detach(), v.detach(), lse.detach(), delta, pattern, scale
    )
    torch.testing.assert_close(dk, dk_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(dv, dv_ref, rtol=1e-9, atol=1e-9)


def test_block_128_runs_on_64_key_tiles():
    """Block 128: the dQ and dK/dV schedules on 64-key tiles (half a block each) give the
    reference's gradients (GQA 4/2, an LSE-free delta)."""
    import s2attn.gluon_dq as gq

    pattern, q, k, v, do, scale, out, lse = float64_s2_case(1, 768, 4, 2, 2, 3, 1, block_size=128)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(out, (q, k, v), do)
    q, k, v, out, lse = (x.detach() for x in (q, k, v, out, lse))
    dq, delta = gq.emulate_dq(do, None, q, k, v, out, lse, pattern, scale)
    dk, dv = gd.emulate_dkdv(do, q, k, v, lse, delta, pattern, scale)
    for got, want in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.skipif(gd.gluon is None, reason="this Triton has no Gluon Hopper API")
@pytest.mark.timeout(600)
# block 16: gathered key tiles, loaded and stored box by box
@pytest.mark.parametrize("head_dim,block", [(128, 64), (64, 64), (128, 16)])
def test_compiles_for_sm90_with_wgmma_and_no_spills(head_dim, block, tmp_path):
    got = sm90_compile_stats("s2attn.gluon_dkdv", head_dim, block, tmp_path)
    # Per query tile: S^T and dP^T in head_dim/16 k-steps, dV and dK in 64/16; the loop is
    # compiled for full and for partial entries, in each of the two pipelines.
    assert got["hgmma"] >= 2 * 2 * (2 * head_dim // 16 + 2 * 64 // 16)
    assert got["local_memory"] == 0
    # At head_dim 128 dK, dV, S^T and dP^T fill 192 of a consumer's 240 registers: ptxas
    # spills a few scalars, mostly in the masked entries' loop (184-216 bytes with Triton 3.6
    # and 3.9). The bound catches a change that spills the tiles themselves.
    assert got["stack_bytes"] <= (256 if head_dim == 128 else 0)
    # dV and dK take P^T and dS^T from registers, and at head_dim 64 S^T and dP^T take K and V.
    register_a = 2 * 2 * ((2 * head_dim // 16 if head_dim == 64 else 0) + 2 * 64 // 16)
    assert got["hgmma_register_a"] >= register_a
    # ptxas kept the wgmma asynchronous: a serialized kernel waits for each one
    assert got["full_waits"] <= got["hgmma"] // 4
    assert got["shared_bytes"] <= 227 * 1024


@pytest.mark.parametrize("local,stride,kv_heads", [(4, 8, 4), (16, 1, 2)])
def test_full_descending_columns_turns_round_only_the_full_entries(local, stride, kv_heads):
    """The Gluon dK/dV pass's column order (:func:`s2attn.layout.full_descending_columns`): in
    every column list the full entries run from the last query tile back, the partial ones keep
    their place, and each list holds the same (query tile, lo, hi) entries as before."""
    from s2attn import S2Pattern
    from s2attn.layout import full_descending_columns, layout_for

    pattern = S2Pattern(8, kv_heads, block_size=64, local_blocks=local, vert_stride=stride)
    lay = layout_for(pattern, 4096, 4096, 0, 0, gd.TILE_M, gd.BLOCK_N, "cpu", with_csc=True)
    rows, lo, hi = full_descending_columns(lay)
    assert full_descending_columns(lay)[0] is rows  # built once per layout
    ptr, split = lay.col_ptr.tolist(), lay.col_split.tolist()
    turned = 0
    for c in range(len(ptr) - 1):
        a, m, z = ptr[c], split[c], ptr[c + 1]
        full = rows[a:m].tolist()
        assert full == sorted(full, reverse=True)
        assert rows[m:z].tolist() == lay.rows[m:z].tolist()
        before = set(zip(lay.rows[a:z].tolist(), lay.lo_c[a:z].tolist(), lay.hi_c[a:z].tolist()))
        assert set(zip(rows[a:z].tolist(), lo[a:z].tolist(), hi[a:z].tolist())) == before
        turned += m - a > 1
    assert turned > 0
