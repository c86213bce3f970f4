"""The Gluon dK/dV pass (``s2attn.gluon_dkdv``) without a GPU: its schedule emulated in float64
against the reference's gradients, and a compile for sm_90 with the installed Triton
(tests/kernels/test_kernels_gpu.py has its device checks)."""

from __future__ import annotations

import pytest
import torch

import s2attn.gluon_dkdv as gd
from s2attn import S2Pattern, s2_attention_varlen_reference
from s2attn.tl_kernels import Varlen
from tests.helpers.kernels import float64_packed_case, float64_s2_case, sm90_compile_stats

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
# block 16: gathered key tiles, loaded and stored box by box; varlen: the packed-documents build
@pytest.mark.parametrize(
    "head_dim,block,varlen",
    [(128, 64, False), (64, 64, False), (128, 16, False), (128, 64, True), (64, 128, True)],
)
def test_compiles_for_sm90_with_wgmma_and_no_spills(head_dim, block, varlen, tmp_path):
    got = sm90_compile_stats("s2attn.gluon_dkdv", head_dim, block, tmp_path, varlen=varlen)
    # Per query tile: S^T and dP^T in head_dim/16 k-steps, dV and dK in 64/16; the loop is
    # compiled for full and for partial entries, in each of the two pipelines.
    assert got["hgmma"] >= 2 * 2 * (2 * head_dim // 16 + 2 * 64 // 16)
    assert got["local_memory"] == 0
    # At head_dim 128 dK, dV, S^T and dP^T fill 192 of a consumer's 240 registers: ptxas
    # spills a few scalars, mostly in the masked entries' loop (184-216 bytes with Triton 3.6
    # and 3.9, 256 in the packed-documents build with 3.6). The bound catches a change that
    # spills the tiles themselves.
    # Triton 3.9 (not the checked version, gluon_forward.triton_checked) spills a little more:
    # 296 bytes in the packed-documents build at head_dim 128, 8 at 64 (outside the loops).
    checked = gd.gf.triton_checked()
    if head_dim == 128:
        stack_limit = 256 if checked else 320
    else:
        stack_limit = 0 if checked else 8
    assert got["stack_bytes"] <= stack_limit
    # dV and dK take P^T and dS^T from registers, and at head_dim 64 S^T and dP^T take K and V.
    register_a = 2 * 2 * ((2 * head_dim // 16 if head_dim == 64 else 0) + 2 * 64 // 16)
    assert got["hgmma_register_a"] >= register_a
    # ptxas kept the wgmma asynchronous: a serialized kernel waits for each one
    assert got["full_waits"] <= got["hgmma"] // 4
    assert got["shared_bytes"] <= 227 * 1024


@pytest.mark.parametrize("block", [64, 128])
def test_emulated_schedule_on_packed_documents_matches_reference_gradients(block):
    """Packed documents (odd, empty and one-token ones, a TP rank's heads, GQA) through the
    dK/dV program map: each document's dK and dV as the reference's. Rows past a document's end
    (the next document's, or zeros) attend nothing, and the keys past its end are not stored
    (the emulation runs the last document first, so such a store would overwrite final rows)."""
    pattern, varlen, cu, q, k, v, scale, g = float64_packed_case(
        [300, 0, 1, 128, 77, 640, 65], 4, 2, block_size=block, seed=11 + block
    )
    out, lse = s2_attention_varlen_reference(q, k, v, cu, pattern, scale, return_lse=True)
    do = torch.randn(out.shape, dtype=torch.float64, generator=g)
    dk_ref, dv_ref = torch.autograd.grad(out, (k, v), do)
    one = lambda x: x.detach()[None]  # noqa: E731 - the kernels' [1, total, h, d]
    delta = (do * out.detach()).sum(-1).t()[None].contiguous()  # [1, h, total]
    dk, dv = gd.emulate_dkdv(
        one(do), one(q), one(k), one(v), lse.double()[None].contiguous(), delta, pattern, scale,
        varlen=varlen,
    )  # fmt: skip
    # The reference's LSE is fp32: P carries its rounding (about 1e-7).
    torch.testing.assert_close(dk[0], dk_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dv[0], dv_ref, rtol=1e-5, atol=1e-5)


def test_packed_documents_in_more_than_one_batch_row_rejected():
    """Packed documents are one batch row; another batch row would be ignored by the map."""
    pattern = S2Pattern(num_heads=2, block_size=64, local_blocks=2, vert_stride=2)
    x, stats = torch.zeros(2, 64, 2, 16), torch.zeros(2, 2, 64)
    varlen = Varlen(torch.tensor([0, 64], dtype=torch.int32), 64, 64)
    with pytest.raises(ValueError, match=r"one batch row \(b = 1\), got b = 2"):
        gd.s2_dkdv_gluon(x, x, x, x, stats, stats, pattern, 1.0, varlen=varlen)


def test_document_aligned_stats_start_every_document_on_16_bytes():
    """The dK/dV pass's copy of LSE and delta for packed documents: each program-map slot's
    document starts at a multiple of 4 rows (a TMA box's 16 bytes), heads too, and holds its
    document's values."""
    lens = [3, 0, 1, 130, 0, 77, 64, 5]
    total, heads = sum(lens), 3
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    varlen = Varlen(cu, max(lens), total)
    stats = [torch.randn(1, heads, total, dtype=torch.float32) for _ in range(2)]
    prog_tok = torch.tensor([0, 3, 4, 4, 134, 211, 275, 0], dtype=torch.int32)  # + padding's 0
    stat_tok, *padded = gd.document_aligned_stats(varlen, prog_tok, *stats)
    assert stat_tok.dtype == torch.int32 and (stat_tok % 4 == 0).all()
    length = padded[0].shape[2]
    assert length % 4 == 0 and all(p.shape == (1, heads, length) for p in padded)
    starts, runs = cu.tolist(), []
    for slot, tok in enumerate(prog_tok.tolist()[:-1]):
        n = lens[max(i for i in range(len(lens)) if starts[i] == tok and lens[i] > 0)]
        row = stat_tok[slot].item()
        for x, p in zip(stats, padded):
            assert torch.equal(p[0, :, row : row + n], x[0, :, tok : tok + n])
        runs.append((row, n))
    # Documents do not overlap in the copy: each starts past the previous one's end.
    runs = sorted(set(runs))
    assert len(runs) == 6 and all(a + n <= b for (a, n), (b, _) in zip(runs, runs[1:]))


@pytest.mark.parametrize("stride,kv_heads", [(4, 2), (1, 1)])
def test_document_column_entries_are_the_documents_run_of_each_column(stride, kv_heads):
    """:func:`s2attn.layout.document_column_entries`: for random slots (key tile, document
    length, padding slots included) the run it gives is exactly the column's entries (in
    :func:`full_descending_columns`' order) whose query tiles the document touches, with the
    full/partial split inside it."""
    from s2attn.layout import document_column_entries, full_descending_columns, layout_for

    pattern = S2Pattern(8, kv_heads, block_size=64, local_blocks=4, vert_stride=stride)
    lay = layout_for(pattern, 2048, 2048, 0, 0, gd.TILE_M, gd.BLOCK_N, "cpu", with_csc=True)
    g = torch.Generator().manual_seed(stride)
    n_items = (8 // lay.group) * lay.num_k_tiles
    items = torch.randint(0, n_items, (200,), generator=g, dtype=torch.int32)
    lens = torch.randint(0, 2049, (200,), generator=g, dtype=torch.int32)
    lens[:5] = torch.tensor([0, 1, 64, 65, 2048])
    runs = document_column_entries(lay, items, lens)
    assert runs.shape == (200, lay.group, 2) and runs.dtype == torch.int32
    rows = full_descending_columns(lay)[0].tolist()
    ptr, split = lay.col_ptr.tolist(), lay.col_split.tolist()
    nonempty = 0
    for i in range(200):
        item, touched = int(items[i]), -(-int(lens[i]) // gd.TILE_M)
        kv_head, key_tile = divmod(item, lay.num_k_tiles)
        for h in range(lay.group):
            c = (kv_head * lay.group + h) * lay.num_k_tiles + key_tile
            want = [e for e in range(ptr[c], ptr[c + 1]) if rows[e] < touched]
            first, end = runs[i, h].tolist()
            assert list(range(first, end)) == want
            assert first <= split[c] <= end or first == end
            nonempty += bool(want)
    assert nonempty > 50


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
