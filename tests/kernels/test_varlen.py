"""Varlen (packed documents) entry point: the real Triton kernels (interpreter on CPU) against a
float64 reference run document by document.

Documents mix lengths that are not multiples of the block size, empty and one-token documents,
and long ones several times ``local_blocks * block_size`` and ``vert_stride * block_size``, so
local band, stripes, Merge-Q tiles and ragged document ends are all exercised. Every case checks
out, LSE and dq/dk/dv with gradient flowing through both outputs. On a CUDA machine the same
tests run the compiled kernels.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from s2attn import S2Pattern, s2_attention, s2_attention_varlen, s2_attention_varlen_reference
from s2attn.layout import varlen_layout_len, varlen_programs
from tests.helpers.kernels import DEVICE, assert_matches, attention_with_grads, rel_err, token_mask

# Independent of the megatron-core version: CI runs this module in its first suite only.
pytestmark = pytest.mark.version_independent

FP32_TOL = 1e-5
BF16_TOL = 2e-2


def _cu(lens, device=DEVICE):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).to(device)


@dataclasses.dataclass
class Case:
    id: str
    lens: list
    block: int = 16
    local: int = 2
    stride: int = 3
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 32
    dtype: torch.dtype = torch.float32
    offset: int = 0
    dense: int = 0
    fused: bool = False  # q, k, v as strided slices of one packed qkv tensor
    user_mask: bool = False

    def pattern(self):
        if self.user_mask:
            return S2Pattern.from_block_mask(
                _gappy_user_mask(self.heads, -(-max(self.lens) // self.block)),
                self.block,
                num_kv_heads=self.kv_heads,
            )
        return S2Pattern(
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            block_size=self.block,
            local_blocks=self.local,
            vert_stride=self.stride,
            head_offset=self.offset,
            num_dense_heads=self.dense,
        )


def _gappy_user_mask(heads, nb):
    """Random causal block mask whose columns have gaps (not mergeable: Merge-Q falls back)."""
    gen = torch.Generator().manual_seed(11)
    m = torch.rand(heads, nb, nb, generator=gen) < 0.4
    m &= torch.ones(nb, nb, dtype=torch.bool).tril()
    m |= torch.eye(nb, dtype=torch.bool)
    m[:, 1, 0], m[:, 2, 0], m[:, nb - 1, 0] = True, False, True
    return m


CASES = [
    Case("odd-gqa2", [37, 0, 1, 130, 16, 5], heads=4, kv_heads=2),
    Case(
        "many-short-mqa",
        [0, 1, 2, 3, 5, 7, 0, 1, 11, 13, 16, 17, 1, 0, 9, 31, 33],
        local=1,
        stride=2,
        head_dim=16,
    ),
    # 230 tokens: 7x local_blocks * block_size, 4.8x vert_stride * block_size; phase 1
    Case("one-long-d64", [3, 230], head_dim=64, offset=1),
    Case("b64-d128", [300, 64, 2], block=64, local=1, stride=2, head_dim=128),
    Case("b32-dense-heads", [100, 45, 1], block=32, heads=4, kv_heads=2, dense=2, local=1),
    Case("fused-qkv-mha", [50, 77], kv_heads=2, head_dim=16, fused=True),
    Case("user-mask", [150, 7, 0, 3], head_dim=16, user_mask=True),
    Case("bf16-gqa2", [90, 1, 47, 0], heads=4, kv_heads=2, dtype=torch.bfloat16),
]


def _inputs(c: Case, seed=None):
    """Leaf q, k, v ``[total, heads, dim]`` (or strided slices of one qkv leaf) and fp64
    upstream gradients dOut ``[total, heads, dim]`` and dLSE ``[heads, total]``."""
    g = torch.Generator().manual_seed(zlib.crc32(c.id.encode()) % 1000 if seed is None else seed)
    total, h, hkv, d = sum(c.lens), c.heads, c.kv_heads, c.head_dim
    if c.fused:
        qkv = torch.randn(total, h + 2 * hkv, d, generator=g).to(DEVICE, c.dtype)
        qkv.requires_grad_(True)
        views = (qkv[:, :h], qkv[:, h : h + hkv], qkv[:, h + hkv :])
        leaves = None
    else:
        views = tuple(
            torch.randn(total, n, d, generator=g).to(DEVICE, c.dtype).requires_grad_(True)
            for n in (h, hkv, hkv)
        )
        leaves = views
    do = torch.randn(total, h, d, generator=g, dtype=torch.float64).to(DEVICE)
    dl = torch.randn(h, total, generator=g, dtype=torch.float64).to(DEVICE)
    return views, leaves, do, dl


def _run(fn, views, do, dl):
    """``fn(q, k, v) -> (out, lse)`` with gradients of ``sum(out*do) + sum(lse*dl)`` w.r.t. the
    views (for fused inputs: the slices of the one qkv gradient)."""
    if all(x.is_leaf for x in views):
        return attention_with_grads(fn, views, views, do, dl)
    base = views[0]._base
    base.grad = None
    out, lse = fn(*views)
    ((out.double() * do).sum() + (lse.double() * dl).sum()).backward()
    h, hkv = views[0].shape[1], views[1].shape[1]
    gq, gk, gv = base.grad[:, :h], base.grad[:, h : h + hkv], base.grad[:, h + hkv :]
    return dict(out=out.detach(), lse=lse.detach(), dq=gq, dk=gk, dv=gv)


def _triton(c: Case, views, do, dl, pattern=None, lens=None, max_seqlen=None):
    pattern = pattern or c.pattern()
    lens = lens or c.lens
    cu = _cu(lens)
    mx = max(lens) if max_seqlen is None else max_seqlen
    return _run(
        lambda q, k, v: s2_attention_varlen(
            q, k, v, cu, mx, pattern, return_lse=True, backend="triton"
        ),
        views,
        do,
        dl,
    )


def _fp64_reference(c: Case, views, do, dl, pattern=None):
    pattern = pattern or c.pattern()
    leaves = [x.detach().double().requires_grad_(True) for x in views]
    cu = _cu(c.lens)
    return attention_with_grads(
        lambda q, k, v: s2_attention_varlen(
            q, k, v, cu, max(c.lens), pattern, return_lse=True, backend="reference"
        ),
        leaves,
        leaves,
        do,
        dl,
    )


def _packed_token_mask(pattern, lens):
    """``[heads, total, total]`` block-diagonal mask: each document's own S2 token mask (from
    ``pattern.block_mask``, positions restarting at the document), nothing across documents."""
    total = sum(lens)
    m = torch.zeros(pattern.local_num_heads, total, total, dtype=torch.bool)
    a = 0
    for n in lens:
        if n:
            m[:, a : a + n, a : a + n] = token_mask(pattern, n, n)
        a += n
    return m.to(DEVICE)


def _masked_attention(q, k, v, mask, scale):
    """Plain attention in q's dtype (softmax at least in fp32) under a token mask; out, lse."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = s.masked_fill(~mask, float("-inf")).to(torch.promote_types(q.dtype, torch.float32))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", p, v), lse


# ------------------------------------------------------------------------- against float64
@pytest.mark.timeout(120)
@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_varlen_matches_fp64_reference(c, tile_loads):
    if tile_loads is not None and c.dtype == torch.float32:
        pytest.skip("TMA tiles are for 16-bit inputs (fp32 takes the pointer loads)")
    views, _, do, dl = _inputs(c)
    got = _triton(c, views, do, dl)
    ref = _fp64_reference(c, views, do, dl)
    total = sum(c.lens)
    assert got["out"].shape == (total, c.heads, c.head_dim) and got["out"].dtype == c.dtype
    assert got["lse"].shape == (c.heads, total) and got["lse"].dtype == torch.float32
    assert_matches(got, ref, FP32_TOL if c.dtype == torch.float32 else BF16_TOL)
    assert tile_loads is None or tile_loads, "tma=True built no descriptor: pointer loads ran"
    if c.dtype == torch.bfloat16:
        # No worse than plain bf16 attention (matmuls and probabilities rounded to bf16) under
        # the same packed mask, both measured against float64.
        mask = _packed_token_mask(c.pattern(), c.lens)
        leaves = [x.detach().clone().requires_grad_(True) for x in views]
        base = attention_with_grads(
            lambda q, k, v: _masked_attention(q, k, v, mask, c.head_dim**-0.5),
            leaves,
            leaves,
            do,
            dl,
        )
        for n in ("out", "dq", "dk", "dv"):
            e_k, e_b = rel_err(got[n], ref[n]), rel_err(base[n], ref[n])
            assert e_k <= 2.0 * e_b + 2e-3, f"{n}: varlen bf16 error {e_k:.3g} vs plain {e_b:.3g}"


def test_reference_is_the_packed_block_diagonal_mask():
    """The reference (document by document) equals dense attention under the block-diagonal
    mask of per-document S2 masks: positions restart at every document."""
    c = Case("ref", [45, 0, 1, 70, 33], heads=4, kv_heads=2, head_dim=16, offset=1)
    pattern = c.pattern()
    views, _, _, _ = _inputs(c)
    q, k, v = (x.detach().double() for x in views)
    out, lse = s2_attention_varlen_reference(q, k, v, _cu(c.lens), pattern, return_lse=True)
    # A mask from absolute packed positions would differ: the check can tell them apart.
    absolute = token_mask(pattern, sum(c.lens), sum(c.lens)).to(DEVICE)
    packed = _packed_token_mask(pattern, c.lens)
    assert not torch.equal(absolute & packed, packed)
    r_out, r_lse = _masked_attention(q, k, v, packed, c.head_dim**-0.5)
    assert rel_err(out, r_out) < 1e-12
    assert rel_err(lse, r_lse) < 1e-6  # the reference returns the LSE in fp32


# ------------------------------------------------------------------------- exactness and isolation
@pytest.mark.timeout(120)
def test_one_document_equals_fixed_length_exactly():
    """Two documents of 128 tokens (a multiple of every tile) packed, and the first one alone,
    give bitwise the same out, LSE and gradients as the fixed-length kernel on a batch of two."""
    c = Case("single", [128, 128], heads=2, kv_heads=1, head_dim=16)
    pattern = c.pattern()
    views, _, do, dl = _inputs(c)
    packed = _triton(c, views, do, dl)

    def fixed(q, k, v):
        out, lse = s2_attention(
            q.unflatten(0, (2, 128)),
            k.unflatten(0, (2, 128)),
            v.unflatten(0, (2, 128)),
            pattern,
            return_lse=True,
            backend="triton",
        )
        return out.flatten(0, 1), lse.transpose(0, 1).flatten(1)

    batch = _run(fixed, views, do, dl)
    for n in ("out", "lse", "dq", "dk", "dv"):
        assert torch.equal(packed[n], batch[n]), n
    first = [x.detach()[:128].clone().requires_grad_(True) for x in views]
    one = _triton(c, first, do[:128], dl[:, :128], lens=[128])
    for n in ("out", "dq", "dk", "dv"):
        assert torch.equal(one[n], packed[n][:128]), n
    assert torch.equal(one["lse"], packed["lse"][:, :128])


@pytest.mark.timeout(120)
def test_no_attention_across_documents():
    """Changing one document's q, k and v leaves every other document's out, LSE and gradients
    bitwise unchanged; the changed document's own results do change."""
    c = Case("leak", [29, 64, 1, 50], heads=4, kv_heads=2, head_dim=16)
    views, _, do, dl = _inputs(c)
    base = _triton(c, views, do, dl)
    a, b = 29, 93  # document 1
    changed = [x.detach().clone() for x in views]
    g = torch.Generator().manual_seed(3)
    for x in changed:
        x[a:b] = torch.randn(x[a:b].shape, generator=g).to(x) * 3
    changed = [x.requires_grad_(True) for x in changed]
    got = _triton(c, changed, do, dl)
    keep = torch.ones(sum(c.lens), dtype=torch.bool)
    keep[a:b] = False
    for n in ("out", "dq", "dk", "dv"):
        assert torch.equal(got[n][keep], base[n][keep]), n
        assert not torch.equal(got[n][~keep], base[n][~keep]), n
    assert torch.equal(got["lse"][:, keep], base["lse"][:, keep])


@pytest.mark.timeout(120)
def test_document_results_do_not_depend_on_the_pack():
    """A document's results are bitwise the same wherever it sits in a pack, whatever its
    neighbours and max_seqlen (the layouts differ: 64 vs 512 tokens)."""
    c = Case("pack", [45], heads=2, kv_heads=1, head_dim=16)
    views, _, do, dl = _inputs(c)
    alone = _triton(c, views, do, dl, max_seqlen=45)
    g = torch.Generator().manual_seed(5)
    lens = [3, 300, 45, 0, 7]
    a = 303
    packed_views = []
    for x in views:
        y = torch.randn(sum(lens), *x.shape[1:], generator=g).to(DEVICE)
        y[a : a + 45] = x.detach()
        packed_views.append(y.requires_grad_(True))
    p_do = torch.randn(sum(lens), *do.shape[1:], generator=g, dtype=torch.float64).to(DEVICE)
    p_dl = torch.randn(dl.shape[0], sum(lens), generator=g, dtype=torch.float64).to(DEVICE)
    p_do[a : a + 45], p_dl[:, a : a + 45] = do, dl
    assert varlen_layout_len(c.pattern(), 45, 32) != varlen_layout_len(c.pattern(), 300, 32)
    packed = _triton(c, packed_views, p_do, p_dl, lens=lens)
    for n in ("out", "dq", "dk", "dv"):
        assert torch.equal(packed[n][a : a + 45], alone[n]), n
    assert torch.equal(packed["lse"][:, a : a + 45], alone["lse"])


@pytest.mark.timeout(120)
def test_backward_is_deterministic():
    c = Case("det", [70, 1, 99], heads=4, kv_heads=1, head_dim=16)
    views, _, do, dl = _inputs(c)
    runs = [_triton(c, views, do, dl) for _ in range(2)]
    for n in ("out", "lse", "dq", "dk", "dv"):
        assert torch.equal(runs[0][n], runs[1][n]), n


def test_no_tokens_at_all():
    p = Case("empty", [0, 0]).pattern()
    q = torch.randn(0, 2, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(0, 1, 16, device=DEVICE, requires_grad=True)
    cu = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    for backend in ("triton", "reference"):
        out, lse = s2_attention_varlen(q, k, k, cu, 0, p, return_lse=True, backend=backend)
        assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
        (out.sum() + lse.sum()).backward()
        assert q.grad.shape == q.shape


# ------------------------------------------------------------------------- program map
def test_program_map_covers_every_tile_once_in_order():
    lens = [0, 5, 64, 1, 0, 130, 33]
    tile, heads, num_tiles = 32, 3, 8
    work = torch.randint(0, 50, (heads * num_tiles,), generator=torch.Generator().manual_seed(0))
    cu = _cu(lens, "cpu")
    grid, doc, item = varlen_programs(cu, max(lens), sum(lens), tile, heads, num_tiles, work)
    need = [-(-n // tile) for n in lens]
    assert grid >= heads * sum(need)
    real = doc < len(lens)
    assert int(real.sum()) == heads * sum(need)  # padding slots name document num_docs
    assert not real[int(real.sum()) :].any()  # ... and come last
    seen = sorted(zip(doc[real].tolist(), item[real].tolist()))
    expect = [
        (d, h * num_tiles + t)
        for d in range(len(lens))
        for h in range(heads)
        for t in range(need[d])
    ]
    assert seen == sorted(expect)
    # Document by document, head by head, heaviest first.
    d, it = doc[real].long(), item[real].long()
    key = (d * heads + it // num_tiles) * 1000 + (999 - work[it])
    assert bool((key[1:] >= key[:-1]).all())


@pytest.mark.parametrize("launches", ["fused", "two"])
def test_kernel_program_map_matches_the_torch_reference(monkeypatch, launches):
    """The kernels' map (item, document start, length per program; Triton, one launch or,
    from ``MAP_FUSED_DOCS`` documents on, two) is the torch reference's order exactly; padding
    slots are empty programs (length 0)."""
    from s2attn import tl_kernels

    if launches == "two":
        monkeypatch.setattr(tl_kernels, "MAP_FUSED_DOCS", 0)
    g = torch.Generator().manual_seed(3)
    tile, heads, num_tiles = 32, 3, 16
    packs = [[0, 5, 64, 1, 0, 130, 33], [0, 0], [512], [511, 1, 480]]
    packs += [torch.randint(0, 300, (n,), generator=g).tolist() for n in (1, 4, 11)]
    for lens in packs:
        work = torch.randint(0, 50, (heads * num_tiles,), generator=g)
        most = int(work.max())
        head = torch.arange(work.numel()) // num_tiles
        order = torch.argsort(head * (most + 1) + (most - work), stable=True).to(torch.int32)
        cu = _cu(lens, DEVICE)
        args = (cu, max(lens), sum(lens), tile, heads, num_tiles)
        grid, item, tok, length = (
            x.cpu() if torch.is_tensor(x) else x
            for x in tl_kernels.varlen_program_map(*args, order.to(DEVICE), work.to(DEVICE))
        )
        ref_grid, doc, ref_item = varlen_programs(
            *(a.cpu() if torch.is_tensor(a) else a for a in args), work
        )
        assert grid == ref_grid == item.numel() == tok.numel() == length.numel(), lens
        cu_ext = torch.cat([cu.cpu(), cu.cpu()[-1:]])
        real = doc < len(lens)
        assert torch.equal(item[real], ref_item[real]), lens
        assert torch.equal(tok[real], cu_ext[doc[real].long()]), lens
        assert torch.equal(length[real], cu_ext[doc[real].long() + 1] - cu_ext[doc[real].long()])
        assert bool((length[real] > 0).all())
        for x in (item, tok, length):
            assert not x[~real].any(), lens


def test_layout_length_is_a_power_of_two_capped_by_a_user_mask():
    p = S2Pattern(num_heads=2, block_size=16, local_blocks=2, vert_stride=3)
    assert [varlen_layout_len(p, n, 32) for n in (0, 1, 32, 33, 1000)] == [32, 32, 32, 64, 1024]
    m = S2Pattern.from_block_mask(torch.ones(2, 10, 10, dtype=torch.bool).tril(), 16)
    assert varlen_layout_len(m, 150, 32) == 160


# ------------------------------------------------------------------------- bad arguments
def _api(total=40, h=4, hkv=2, d=16, lens=(17, 23)):
    """Valid CPU arguments (the checks run before anything else, on any device)."""
    q = torch.randn(total, h, d)
    k = torch.randn(total, hkv, d)
    return q, k, k.clone(), _cu(list(lens), "cpu"), max(lens)


def _with(**kw):
    def make():
        q, k, v, cu, mx = _api()
        args = dict(q=q, k=k, v=v, cu_seqlens=cu, max_seqlen=mx)
        for name, f in kw.items():
            args[name] = f(args[name]) if callable(f) else f
        return args

    return make


BAD_CALLS = [
    ("cu int64", _with(cu_seqlens=lambda c: c.long()), "cu_seqlens must have dtype torch.int32"),
    ("cu 2-D", _with(cu_seqlens=lambda c: c[None]), r"cu_seqlens must be 1-D \[num_docs \+ 1\]"),
    ("cu one entry", _with(cu_seqlens=lambda c: c[:1]), "num_docs >= 1"),
    ("cu list", _with(cu_seqlens=[0, 17, 40]), "cu_seqlens must be a torch.int32 tensor"),
    (
        "cu start",
        _with(cu_seqlens=torch.tensor([1, 17, 40], dtype=torch.int32)),
        "cu_seqlens must start at 0",
    ),
    (
        "cu decreasing",
        _with(cu_seqlens=torch.tensor([0, 30, 20, 40], dtype=torch.int32), max_seqlen=30),
        r"non-decreasing, got cu_seqlens\[1\]=30 > cu_seqlens\[2\]=20",
    ),
    (
        "cu end",
        _with(cu_seqlens=torch.tensor([0, 17, 39], dtype=torch.int32)),
        "cu_seqlens must end at total_tokens=40",
    ),
    (
        "max short",
        _with(max_seqlen=22),
        "max_seqlen=22 is less than the longest document's length 23",
    ),
    ("max tensor", _with(max_seqlen=torch.tensor(23)), "max_seqlen must be a Python int"),
    ("max bool", _with(max_seqlen=True), "max_seqlen must be a Python int"),
    ("max negative", _with(max_seqlen=-1), "max_seqlen must be a Python int >= 0"),
    ("q 4-D", _with(q=lambda q: q[None]), r"q must be a 3-D tensor \[total_tokens, heads"),
    ("kv tokens", _with(k=lambda k: k[:39], v=lambda v: v[:39]), "total_tokens"),
    ("kv heads", _with(k=lambda k: k[:, :1], v=lambda v: v[:, :1]), "KV heads"),
    ("q heads", _with(q=lambda q: q[:, :3]), "q has 3 heads"),
    ("dtype", _with(k=lambda k: k.double()), "share a dtype"),
    (
        "head_dim",
        _with(q=lambda q: q[..., :12], k=lambda k: k[..., :12], v=lambda v: v[..., :12]),
        "head_dim",
    ),
]


@pytest.mark.parametrize("name,make,match", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_varlen_rejects_bad_arguments(name, make, match):
    p = S2Pattern(num_heads=4, num_kv_heads=2, block_size=16, local_blocks=2, vert_stride=3)
    with pytest.raises(ValueError, match=match):
        s2_attention_varlen(pattern=p, backend="triton", **make())


def test_varlen_rejects_bad_pattern_backend_and_mask_length():
    q, k, v, cu, mx = _api()
    p = S2Pattern(num_heads=4, num_kv_heads=2, block_size=16, local_blocks=2, vert_stride=3)
    with pytest.raises(TypeError, match="pattern must be an S2Pattern"):
        s2_attention_varlen(q, k, v, cu, mx, "s2")
    with pytest.raises(ValueError, match="backend must be one of"):
        s2_attention_varlen(q, k, v, cu, mx, p, backend="cuda")
    with pytest.raises(ValueError, match="Triton backend does not take fp64"):
        s2_attention_varlen(q.double(), k.double(), v.double(), cu, mx, p, backend="triton")
    mask = S2Pattern.from_block_mask(torch.ones(4, 1, 1, dtype=torch.bool), 16, num_kv_heads=2)
    with pytest.raises(ValueError, match="max_seqlen=23 exceeds the user mask's 16 tokens"):
        s2_attention_varlen(q, k, v, cu, mx, mask)


def test_value_checks_can_be_skipped():
    """check_cu_seqlens=False skips the checks that read cu_seqlens (e.g. its last entry); the
    others stay."""
    q, k, v, cu, mx = _api()
    p = S2Pattern(num_heads=4, num_kv_heads=2, block_size=16, local_blocks=2, vert_stride=3)
    short = torch.tensor([0, 17, 39], dtype=torch.int32)
    with pytest.raises(ValueError, match="end at total_tokens"):
        s2_attention_varlen(q, k, v, short, mx, p, backend="reference")
    s2_attention_varlen(q, k, v, short, mx, p, backend="reference", check_cu_seqlens=False)
    with pytest.raises(ValueError, match="int32"):
        s2_attention_varlen(q, k, v, cu.long(), mx, p, check_cu_seqlens=False)
