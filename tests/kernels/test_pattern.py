"""S2Pattern (hand-worked golden masks, coverage, density, validation) and the tile layouts."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from s2attn import S2Pattern
from s2attn.layout import build_layout, layout_for
from tests.helpers.kernels import token_mask

# Independent of the megatron-core version: CI runs this module in its first suite only.
pytestmark = pytest.mark.version_independent


def M(*rows: str) -> torch.Tensor:
    """0/1 matrix from literal rows like "1100"."""
    return torch.tensor([[c == "1" for c in r] for r in rows], dtype=torch.bool)


# Block masks worked out by hand (8 blocks). Key block j is vertical for head h iff
# (j + phase(h)) % V == 0, phase(h) = h * step + offset; local band L = 2 includes the diagonal.
RES0 = M(
    "10000000",  # stripes at j % 4 == 0
    "11000000",
    "11100000",
    "10110000",
    "10011000",
    "10001100",
    "10001110",
    "10001011",
)
RES3 = M(
    "10000000",  # stripes at j % 4 == 3
    "11000000",
    "01100000",
    "00110000",
    "00011000",
    "00011100",
    "00010110",
    "00010011",
)
RES2 = M(
    "10000000",  # stripes at j % 4 == 2
    "11000000",
    "01100000",
    "00110000",
    "00111000",
    "00101100",
    "00100110",
    "00100011",
)
RES1 = M(
    "10000000",  # stripes at j % 4 == 1
    "11000000",
    "01100000",
    "01110000",
    "01011000",
    "01001100",
    "01000110",
    "01000111",
)


def _p(**kw):
    base = dict(num_heads=4, block_size=16, local_blocks=2, vert_stride=4)
    base.update(kw)
    return S2Pattern(**base)


def test_golden_offset0():
    # phase(h) = h: h0 -> j%4==0, h1 -> j%4==3, h2 -> j%4==2, h3 -> j%4==1
    bm = _p(head_offset=0).block_mask(8)
    for h, want in enumerate([RES0, RES3, RES2, RES1]):
        assert torch.equal(bm[h], want), h


def test_golden_offset1_phi3():
    # phase(h) = h + 1: h0 -> j%4==3, h1 -> 2, h2 -> 1, h3 -> 0
    bm = _p(head_offset=1).block_mask(8)
    for h, want in enumerate([RES3, RES2, RES1, RES0]):
        assert torch.equal(bm[h], want), h


def test_golden_fewer_heads_than_stride():
    # 2 heads, V = 8: step = 4; offset 1: phase 1 (j%8==7) and phase 5 (j%8==3); L = 1.
    p = S2Pattern(num_heads=2, block_size=16, local_blocks=1, vert_stride=8, head_offset=1)
    assert p.head_step == 4
    h1 = M(
        "1000000000",
        "0100000000",
        "0010000000",
        "0001000000",
        "0001100000",
        "0001010000",
        "0001001000",
        "0001000100",
        "0001000010",
        "0001000001",
    )
    h0 = M(
        "1000000000",
        "0100000000",
        "0010000000",
        "0001000000",
        "0000100000",
        "0000010000",
        "0000001000",
        "0000000100",
        "0000000110",
        "0000000101",
    )
    bm = p.block_mask(10)
    assert torch.equal(bm[0], h0)
    assert torch.equal(bm[1], h1)


def test_golden_dense_heads():
    # 4 heads, 2 dense: h % 2 == 0 dense. L = 1, V = 4, offset 0: h1 -> j%4==3, h3 -> j%4==1.
    p = S2Pattern(num_heads=4, block_size=16, local_blocks=1, vert_stride=4, num_dense_heads=2)
    assert [p.is_dense_head(h) for h in range(4)] == [True, False, True, False]
    dense = M("100000", "110000", "111000", "111100", "111110", "111111")
    h1 = M("100000", "010000", "001000", "000100", "000110", "000101")
    h3 = M("100000", "010000", "011000", "010100", "010010", "010001")
    bm = p.block_mask(6)
    for h, want in enumerate([dense, h1, dense, h3]):
        assert torch.equal(bm[h], want), h


def test_golden_homo_head():
    bm = _p(homo_head=True, num_kv_heads=2).block_mask(8)
    for h in range(4):
        assert torch.equal(bm[h], RES0), h
    bm = _p(homo_head=True, head_offset=1).block_mask(8)
    for h in range(4):
        assert torch.equal(bm[h], RES3), h


def test_block_mask_offsets_are_absolute():
    p = _p(head_offset=1, num_kv_heads=2)
    full = p.block_mask(8)
    assert torch.equal(p.block_mask(3, 5, q_block_start=5, k_block_start=1), full[:, 5:8, 1:6])


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(num_kv_heads=4, head_offset=1),
        dict(num_dense_heads=4),
        dict(homo_head=True, num_kv_heads=4),
    ],
)
def test_head_range_rows_equal_full_rows(kw):
    p = S2Pattern(num_heads=8, block_size=16, local_blocks=2, vert_stride=8, **kw)
    full = p.block_mask(20)
    for tp in (2, 4):
        for r in range(tp):
            rp = p.for_tp_rank(r, tp)
            n = 8 // tp
            assert (rp.head_start, rp.head_end) == (r * n, (r + 1) * n)
            assert torch.equal(rp.block_mask(20), full[r * n : (r + 1) * n])
    assert torch.equal(p.head_range(2, 6).block_mask(20), full[2:6])
    um = S2Pattern.from_block_mask(full, 16, num_kv_heads=4)
    assert torch.equal(um.head_range(4, 8).block_mask(20), full[4:8])


# ------------------------------------------------------------------------------ coverage
def test_coverage_complete_when_heads_ge_stride():
    rep = S2Pattern(num_heads=8, block_size=64, local_blocks=4, vert_stride=8).coverage(64 * 100)
    assert rep.complete and rep.uncovered_blocks == []
    rep = S2Pattern(
        num_heads=32, num_kv_heads=8, block_size=64, local_blocks=16, vert_stride=8
    ).coverage(131072)
    assert rep.complete


def test_coverage_holes_32_heads_stride_64():
    p = S2Pattern(num_heads=32, block_size=64, local_blocks=16, vert_stride=64)
    assert p.head_step == 2
    nb = 8192 // 64
    rep = p.coverage(8192)
    assert not rep.complete
    # step 2 -> only even residues: odd key blocks beyond everyone's local window are never seen
    assert rep.uncovered_blocks == [j for j in range(1, nb - 16, 2)]


def test_coverage_per_group_gqa():
    # 8 heads, 2 KV groups, V = 8, L = 1, 16 blocks. Group 0 (h0-3): residues {0, 7, 6, 5};
    # group 1 (h4-7): residues {4, 3, 2, 1}. A block j needs a stripe iff j + 1 < 16.
    p = S2Pattern(num_heads=8, num_kv_heads=2, block_size=16, local_blocks=1, vert_stride=8)
    rep = p.coverage(256)
    assert rep.complete
    assert rep.group_uncovered_blocks == [[1, 2, 3, 4, 9, 10, 11, 12], [0, 5, 6, 7, 8, 13, 14]]
    # TP rank 1 of 2 holds group 1 only: holes are reported at the rank level too.
    assert p.for_tp_rank(1, 2).coverage(256).uncovered_blocks == [0, 5, 6, 7, 8, 13, 14]


def test_coverage_user_mask_hole():
    nb = 6
    m = torch.ones(2, nb, nb, dtype=torch.bool).tril()
    m[:, 3:, 1] = False  # block 1 seen only from block rows 1 and 2
    rep = S2Pattern.from_block_mask(m, 16).coverage(nb * 16)
    assert rep.uncovered_blocks == [1]
    m[1, 5, 1] = True  # still missing from row 3 and 4
    assert S2Pattern.from_block_mask(m, 16).coverage(nb * 16).uncovered_blocks == [1]


# ------------------------------------------------------------------------------ KV-cache efficiency
def test_kv_cache_efficiency_s2_and_reattending_mask():
    p = _p()
    assert p.is_kv_cache_efficient
    m = p.block_mask(8).clone()
    m[:, 7, 1] = True  # block 1 was dropped by rows 3..6, row 7 attends it again
    assert not S2Pattern.from_block_mask(m, 16).is_kv_cache_efficient


@pytest.mark.parametrize("src", ["s2", "tril"])
def test_kv_cache_efficiency_of_efficient_user_masks(src):
    m = _p().block_mask(8) if src == "s2" else torch.ones(4, 8, 8, dtype=torch.bool).tril()
    assert S2Pattern.from_block_mask(m, 16).is_kv_cache_efficient


# ------------------------------------------------------------------------------ density
@pytest.mark.parametrize(
    "seq,kw",
    [
        (333, dict(num_heads=4, block_size=16, local_blocks=2, vert_stride=3)),
        (
            200,
            dict(
                num_heads=4,
                num_kv_heads=2,
                block_size=32,
                local_blocks=1,
                vert_stride=2,
                num_dense_heads=2,
                head_offset=1,
            ),
        ),
        (
            64 * 7 + 5,
            dict(num_heads=2, block_size=64, local_blocks=2, vert_stride=4, homo_head=True),
        ),
    ],
)
def test_density_matches_brute_force(seq, kw):
    p = S2Pattern(**kw)
    tm = token_mask(p, seq, seq)
    assert p.attended_pairs(seq) == int(tm.sum())
    assert p.density(seq) == pytest.approx(
        int(tm.sum()) / (seq * (seq + 1) // 2 * p.num_heads), abs=1e-12
    )
    um = S2Pattern.from_block_mask(p.block_mask(-(-seq // p.block_size)), p.block_size)
    assert um.attended_pairs(seq) == int(tm.sum())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seq,want", [(8192, 0.324), (32768, 0.177), (131072, 0.138)])
def test_documented_density(seq, want):
    p = S2Pattern(num_heads=32, num_kv_heads=8, block_size=64, local_blocks=16, vert_stride=8)
    assert abs(p.density(seq) - want) < 1e-3


# ------------------------------------------------------------------------------ bad arguments
BAD_PATTERNS = [
    (dict(num_heads=4, block_size=48), "block_size"),
    (dict(num_heads=4, block_size=256), "block_size"),
    (dict(num_heads=4, local_blocks=0), "local_blocks"),
    (dict(num_heads=4, vert_stride=0), "vert_stride"),
    (dict(num_heads=6, num_kv_heads=4), "num_kv_heads"),
    (dict(num_heads=0), "num_heads"),
    (dict(num_heads=8, num_dense_heads=3), "num_dense_heads"),
    (dict(num_heads=8, num_kv_heads=2, head_start=2, head_end=8), "splits a GQA group"),
    (dict(num_heads=8, head_start=4, head_end=4), "head range"),
]


@pytest.mark.parametrize(
    "kw,word", BAD_PATTERNS, ids=[w + str(i) for i, (_, w) in enumerate(BAD_PATTERNS)]
)
def test_pattern_rejects_bad_arguments(kw, word):
    with pytest.raises(ValueError, match=word):
        S2Pattern(**kw)


def test_head_range_and_tp_errors():
    p = S2Pattern(num_heads=8, num_kv_heads=4)
    with pytest.raises(ValueError, match="splits a GQA group"):
        p.head_range(1, 5)
    with pytest.raises(ValueError, match="tensor-parallel"):
        p.for_tp_rank(0, 3)
    with pytest.raises(ValueError, match="tensor-parallel"):
        p.for_tp_rank(0, 8)  # 8 q heads split, but 4 KV heads cannot be
    with pytest.raises(ValueError, match="head_range"):
        p.head_range(0, 10)


def test_user_mask_errors():
    ok = torch.ones(2, 4, 4, dtype=torch.bool).tril()
    S2Pattern.from_block_mask(ok, 16)
    bad = ok.clone()
    bad[0, 1, 2] = True
    with pytest.raises(ValueError, match="causal"):
        S2Pattern.from_block_mask(bad, 16)
    bad = ok.clone()
    bad[1, 2, 2] = False
    with pytest.raises(ValueError, match="diagonal"):
        S2Pattern.from_block_mask(bad, 16)
    with pytest.raises(ValueError, match="shape"):
        S2Pattern.from_block_mask(torch.ones(2, 4, 5, dtype=torch.bool).tril(), 16)
    with pytest.raises(ValueError, match="user_mask"):
        S2Pattern(num_heads=3, user_mask=ok)
    p = S2Pattern.from_block_mask(ok, 16)
    with pytest.raises(ValueError, match="user mask"):
        p.check_seq_len(65)
    with pytest.raises(ValueError, match="user_mask"):
        p.block_mask(5)


# ------------------------------------------------------------------------------ tile layouts
def expand_layout(lay, seq_q, seq_k, q_start, k_start):
    """Dense (heads, seq_q, seq_k) token mask from the CSR entries; also checks that no
    (item, key tile) repeats and that entries flagged full need no mask at all."""
    H, nqt = lay.num_heads, lay.num_q_tiles
    bm, bn = lay.block_m, lay.block_n
    out = torch.zeros(H, seq_q, seq_k, dtype=torch.bool)
    rp, rs = lay.row_ptr.tolist(), lay.row_split.tolist()
    cols, lo, hi = lay.cols.tolist(), lay.lo.tolist(), lay.hi.tolist()
    qpos_all = torch.arange(q_start, q_start + seq_q)
    kpos_all = torch.arange(k_start, k_start + seq_k)
    for item in range(H * nqt):
        h, t = divmod(item, nqt)
        assert rp[item] <= rs[item] <= rp[item + 1]
        kts = cols[rp[item] : rp[item + 1]]
        assert len(set(kts)) == len(kts), f"item {item}: repeated key tiles"
        # full entries first, each part sorted by key tile
        assert kts[: rs[item] - rp[item]] == sorted(kts[: rs[item] - rp[item]])
        assert kts[rs[item] - rp[item] :] == sorted(kts[rs[item] - rp[item] :])
        r0, r1 = t * bm, min((t + 1) * bm, seq_q)
        for e in range(rp[item], rp[item + 1]):
            c0, c1 = cols[e] * bn, min((cols[e] + 1) * bn, seq_k)
            assert 0 <= c0 < seq_k
            qp, kp = qpos_all[r0:r1], kpos_all[c0:c1]
            sub = (qp >= lo[e])[:, None] & (qp < hi[e])[:, None] & (kp[None, :] <= qp[:, None])
            needs_no_mask = (
                bool(sub.all()) and (t + 1) * bm <= seq_q and (cols[e] + 1) * bn <= seq_k
            )
            assert (e < rs[item]) == needs_no_mask, f"entry {e}: full flag {e < rs[item]}"
            out[h, r0:r1, c0:c1] |= sub
    return out


def csr_entries(lay):
    nqt = lay.num_q_tiles
    ent = {}
    for item in range(lay.num_heads * nqt):
        for e in range(int(lay.row_ptr[item]), int(lay.row_ptr[item + 1])):
            key = (item // nqt, item % nqt, int(lay.cols[e]))
            ent[key] = (int(lay.lo[e]), int(lay.hi[e]), e < int(lay.row_split[item]))
    return ent


def csc_entries(lay):
    nkt = lay.num_k_tiles
    ent = {}
    for item in range(lay.num_heads * nkt):
        a, s, b = int(lay.col_ptr[item]), int(lay.col_split[item]), int(lay.col_ptr[item + 1])
        assert a <= s <= b
        rows = lay.rows[a:b].tolist()
        assert rows[: s - a] == sorted(rows[: s - a]) and rows[s - a :] == sorted(rows[s - a :])
        for e in range(a, b):
            key = (item // nkt, int(lay.rows[e]), item % nkt)
            assert key not in ent
            ent[key] = (int(lay.lo_c[e]), int(lay.hi_c[e]), e < s)
    return ent


def _check_order(order, work, num_heads):
    """A permutation of the items, head by head (items h * per .. (h + 1) * per - 1 together),
    heaviest first inside each head (layout.py's documented program order)."""
    order, per = order.long(), work.numel() // num_heads
    assert torch.equal(order.sort().values, torch.arange(work.numel()))
    assert torch.equal(order // per, torch.arange(work.numel()) // per)
    w = work[order].view(num_heads, per)
    assert (w[:, :-1] >= w[:, 1:]).all()


def check_orders(lay):
    counts = (lay.row_ptr[1:] - lay.row_ptr[:-1]).long()
    _check_order(lay.q_order, counts, lay.num_heads)
    ccounts = (lay.col_ptr[1:] - lay.col_ptr[:-1]).long()
    hkv = lay.num_heads // lay.group
    _check_order(lay.kv_order, ccounts.view(hkv, lay.group, lay.num_k_tiles).sum(1).flatten(), hkv)


LAYOUT_CASES = [
    # (pattern kwargs, seq_q, seq_k, q_start, k_start, block_m, block_n)
    (dict(num_heads=4, block_size=16, local_blocks=2, vert_stride=3), 333, 333, 0, 0, 64, 16),
    (dict(num_heads=4, block_size=16, local_blocks=2, vert_stride=3), 333, 333, 0, 0, 16, 16),
    (
        dict(
            num_heads=4, num_kv_heads=2, block_size=32, local_blocks=3, vert_stride=4, head_offset=1
        ),
        301,
        301,
        0,
        0,
        128,
        32,
    ),
    (
        dict(num_heads=2, num_kv_heads=1, block_size=64, local_blocks=1, vert_stride=2),
        400,
        400,
        0,
        0,
        32,
        64,
    ),
    (dict(num_heads=2, block_size=128, local_blocks=1, vert_stride=2), 600, 600, 0, 0, 128, 64),
    (dict(num_heads=2, block_size=128, local_blocks=1, vert_stride=2), 600, 600, 0, 0, 32, 64),
    (
        dict(
            num_heads=4,
            num_kv_heads=2,
            block_size=16,
            local_blocks=2,
            vert_stride=4,
            num_dense_heads=2,
        ),
        250,
        250,
        0,
        0,
        64,
        16,
    ),
    (
        dict(num_heads=2, block_size=16, local_blocks=1, vert_stride=4, homo_head=True),
        200,
        200,
        0,
        0,
        32,
        16,
    ),
    (dict(num_heads=2, block_size=16, local_blocks=2, vert_stride=3), 150, 214, 64, 0, 64, 16),
    (dict(num_heads=2, block_size=16, local_blocks=2, vert_stride=3), 200, 136, 0, 64, 64, 16),
    (dict(num_heads=2, block_size=16, local_blocks=2, vert_stride=3), 100, 160, 128, 0, 32, 16),
    (dict(num_heads=2, block_size=32, local_blocks=2, vert_stride=3), 97, 500, 320, 32, 128, 32),
]


@pytest.mark.parametrize("kw,sq,sk,qs,ks,bm,bn", LAYOUT_CASES)
@pytest.mark.parametrize("path", ["arith", "mask"])
def test_layout_expands_to_reference_token_mask(kw, sq, sk, qs, ks, bm, bn, path):
    p = S2Pattern(**kw)
    if path == "mask":
        nb = -(-max(qs + sq, ks + sk) // p.block_size)
        p = S2Pattern.from_block_mask(p.block_mask(nb), p.block_size, num_kv_heads=p.num_kv_heads)
    lay = build_layout(p, sq, sk, qs, ks, bm, bn, "cpu", with_csc=True)
    assert (lay.block_m, lay.block_n) == (bm, bn)
    want = token_mask(p, sq, sk, qs, ks)
    got = expand_layout(lay, sq, sk, qs, ks)
    assert torch.equal(got, want)
    assert csc_entries(lay) == csr_entries(lay)
    check_orders(lay)


def test_layout_head_range_equals_rows_of_full():
    p = S2Pattern(
        num_heads=8, num_kv_heads=4, block_size=16, local_blocks=2, vert_stride=8, head_offset=1
    )
    full = expand_layout(build_layout(p, 300, 300, 0, 0, 64, 16, "cpu", True), 300, 300, 0, 0)
    for r in range(2):
        rp = p.for_tp_rank(r, 2)
        lay = build_layout(rp, 300, 300, 0, 0, 64, 16, "cpu", True)
        assert torch.equal(expand_layout(lay, 300, 300, 0, 0), full[4 * r : 4 * r + 4])


def test_non_mergeable_user_mask_falls_back_and_stays_exact():
    gen = torch.Generator().manual_seed(3)
    nb = 12
    m = (torch.rand(2, nb, nb, generator=gen) < 0.4) & torch.ones(nb, nb, dtype=torch.bool).tril()
    m |= torch.eye(nb, dtype=torch.bool)
    m[:, 0:3, 0] = torch.tensor([True, False, True])  # rows 0 and 2 attend block 0, row 1 not
    p = S2Pattern.from_block_mask(m, 16)
    lay = layout_for(p, 180, 180, 0, 0, 64, 16, "cpu", with_csc=True)
    assert lay.block_m == 16
    assert torch.equal(expand_layout(lay, 180, 180, 0, 0), token_mask(p, 180, 180))
    assert csc_entries(lay) == csr_entries(lay)


class _MaxNumel(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.max = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.max = max(self.max, o.numel())
        return out


LAYOUT_128K = dict(num_heads=32, block_size=64, local_blocks=16, vert_stride=8)


def _build_128k():
    return build_layout(
        S2Pattern(**LAYOUT_128K), 131072, 131072, 0, 0, 128, 64, "cpu", with_csc=True
    )


@pytest.mark.timeout(120)
def test_layout_128k_build_time():
    # CPU time of this process, not wall time: other jobs share the CI cores.
    t0, c0 = time.perf_counter(), time.process_time()
    lay = _build_128k()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(
        f"\nlayout build, 128k tokens, 32 heads, with CSC: {dt:.3f} s wall, {cpu:.3f} s CPU, "
        f"nnz {lay.nnz}"
    )
    # On the CPU this is a sanity bound (O(nnz) work, ~4.7M entries, shared 2-core CI box); the
    # kernels build layouts on the GPU, where tests/kernels/test_kernels_gpu.py requires < 1 s.
    assert cpu < 12.0


@pytest.mark.timeout(120)
def test_layout_128k_never_materializes_seq_squared(monkeypatch):
    S = 131072
    # The S2 path must not even call block_mask (H x nb x nb), let alone build S x S.
    monkeypatch.setattr(S2Pattern, "block_mask", lambda *a, **k: pytest.fail("block_mask called"))
    mode = _MaxNumel()
    with mode:
        lay = _build_128k()
    # Entries: ~13.8% of the causal block triangle per head, two query blocks per 128-row tile.
    assert lay.nnz < 32 * (S // 128) * (S // 64) * 0.2
    assert mode.max <= 4 * lay.nnz
    assert mode.max < S * S // 64


def test_equal_s2_patterns_share_layouts_but_user_masks_do_not():
    # Every S2 layer of a model builds its own S2Pattern; their kernel layouts must be built once.
    kw = dict(num_heads=4, block_size=16, local_blocks=2, vert_stride=4)
    lay = build_layout(S2Pattern(**kw), 200, 200, 0, 0, 32, 16, "cpu", True)
    assert build_layout(S2Pattern(**kw), 200, 200, 0, 0, 32, 16, "cpu", True) is lay
    assert (
        build_layout(S2Pattern(**kw, head_offset=1), 200, 200, 0, 0, 32, 16, "cpu", True) is not lay
    )
    assert (
        build_layout(S2Pattern(**kw).head_range(0, 2), 200, 200, 0, 0, 32, 16, "cpu", True)
        is not lay
    )
    m1 = S2Pattern.from_block_mask(S2Pattern(**kw).block_mask(13), 16)
    m2 = S2Pattern.from_block_mask(S2Pattern(**kw, head_offset=1).block_mask(13), 16)
    assert build_layout(m1, 200, 200, 0, 0, 32, 16, "cpu", True) is not build_layout(
        m2, 200, 200, 0, 0, 32, 16, "cpu", True
    )
