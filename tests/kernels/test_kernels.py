"""The real Triton kernels (interpreter on CPU) against the fp64 PyTorch reference.

Every case checks out, LSE and dq/dk/dv (with gradient flowing through both outputs) at shapes
longer than local_blocks*block_size and vert_stride*block_size, mostly not multiples of the
block size, so local band, stripes, Merge-Q tiles and ragged tails are all exercised.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from s2attn import S2Pattern, config, dispatch, s2_attention, s2_attention_reference, tl_kernels
from tests.helpers.kernels import (
    DEVICE,
    assert_matches,
    attention_with_grads,
    fp64_reference,
    make_inputs,
    rel_err,
    token_mask,
    upstream_grads,
)

# Independent of the megatron-core version: CI runs this module in its first suite only.
pytestmark = pytest.mark.version_independent

FP32_TOL = 1e-5
BF16_TOL = 2e-2


@dataclasses.dataclass
class Case:
    id: str
    block: int = 16
    local: int = 2
    stride: int = 3
    heads: int = 2
    kv_heads: int = None
    head_dim: int = 32
    seq_q: int = 197
    seq_k: int = None
    batch: int = 1
    q_start: int = 0
    k_start: int = 0
    dtype: torch.dtype = torch.float32
    scale: float = None
    offset: int = 0
    dense: int = 0
    homo: bool = False
    layout: str = "bshd"
    lse_grad: bool = True
    out_grad: bool = True

    def pattern(self):
        return S2Pattern(
            num_heads=self.heads,
            num_kv_heads=self.kv_heads or self.heads,
            block_size=self.block,
            local_blocks=self.local,
            vert_stride=self.stride,
            head_offset=self.offset,
            num_dense_heads=self.dense,
            homo_head=self.homo,
        )


CASES = [
    # block sizes x head dims x GQA ratios
    Case("b16-d32-mha", block=16, head_dim=32, heads=2, seq_q=197),
    Case("b16-d128", block=16, head_dim=128, heads=2, kv_heads=1, seq_q=150, stride=4),
    Case("b32-d64-gqa2", block=32, head_dim=64, heads=4, kv_heads=2, seq_q=301, stride=4),
    Case("b64-d16-mqa", block=64, head_dim=16, heads=4, kv_heads=1, seq_q=333, local=1, stride=2),
    Case("b128-d32", block=128, head_dim=32, heads=2, kv_heads=1, seq_q=300, local=1, stride=2),
    Case(
        "b16-d64-gqa4-phi3",
        block=16,
        head_dim=64,
        heads=4,
        kv_heads=1,
        seq_q=181,
        stride=4,
        offset=1,
    ),
    # head_step > 1 (fewer heads than the stride)
    Case("b16-step2", block=16, heads=2, stride=4, local=1, seq_q=170),
    Case("dense-heads", block=16, heads=4, kv_heads=2, dense=2, seq_q=150, stride=4),
    Case("homo-head", block=16, heads=2, kv_heads=1, homo=True, offset=1, seq_q=150),
    Case("batch2", block=32, heads=2, batch=2, seq_q=200, local=1, stride=2),
    Case("scale0.3", block=16, heads=2, scale=0.3, seq_q=160),
    Case("exact-multiple", block=32, heads=2, seq_q=256, local=1, stride=3),
    Case("tiny-seq", block=16, heads=2, seq_q=5),
    # offsets: a later query chunk against the full key prefix
    Case("q_start", block=16, heads=2, q_start=64, seq_q=150, seq_k=214),
    # key chunk starting after the first queries: rows 0..63 attend nothing (out 0, lse -inf)
    Case("k_after_q", block=16, heads=2, kv_heads=1, k_start=64, seq_q=200, seq_k=136),
    # key chunk ending before the queries do (partial result for merging)
    Case("k_prefix_only", block=32, heads=2, q_start=128, seq_q=100, seq_k=160, local=1, stride=2),
    # Megatron layout: non-contiguous [s, b, h, d] storage seen as [b, s, h, d]
    Case("sbhd-gqa", block=16, heads=4, kv_heads=2, batch=2, layout="sbhd", seq_q=120),
    Case(
        "bf16-sbhd-gqa-off",
        block=16,
        heads=4,
        kv_heads=2,
        batch=2,
        layout="sbhd",
        dtype=torch.bfloat16,
        seq_q=100,
        q_start=48,
        seq_k=148,
    ),
    # gradient only through the output, or only through the LSE
    Case("grad-out-only", block=16, heads=2, lse_grad=False, seq_q=150),
    Case("grad-lse-only", block=32, heads=2, out_grad=False, seq_q=150, local=1, stride=2),
    # bf16
    Case("bf16-b16-gqa2", block=16, heads=4, kv_heads=2, dtype=torch.bfloat16, seq_q=181, stride=4),
    Case(
        "bf16-b64-mqa-off",
        block=64,
        heads=2,
        kv_heads=1,
        dtype=torch.bfloat16,
        seq_q=200,
        q_start=64,
        seq_k=264,
        local=1,
        stride=2,
        head_dim=64,
    ),
    # fp16
    Case(
        "fp16-b32-gqa2",
        block=32,
        heads=4,
        kv_heads=2,
        dtype=torch.float16,
        seq_q=170,
        head_dim=64,
        local=1,
        stride=2,
    ),
]


def _run_case(c: Case, pattern=None):
    pattern = pattern or c.pattern()
    seq_k = c.seq_k or c.seq_q
    hkv = c.kv_heads or c.heads
    leaves, views = make_inputs(
        c.batch,
        c.seq_q,
        seq_k,
        c.heads,
        hkv,
        c.head_dim,
        c.dtype,
        seed=zlib.crc32(c.id.encode()) % 1000,
        layout=c.layout,
    )
    do, dl = upstream_grads(c.batch, c.seq_q, c.heads, c.head_dim)
    do, dl = (do if c.out_grad else None), (dl if c.lse_grad else None)
    kw = dict(softmax_scale=c.scale, q_start=c.q_start, k_start=c.k_start)
    got = attention_with_grads(
        lambda q, k, v: s2_attention(
            q, k, v, pattern, return_lse=c.lse_grad or not c.out_grad, backend="triton", **kw
        ),
        leaves,
        views,
        do,
        dl,
        return_lse=c.lse_grad or not c.out_grad,
    )
    ref = fp64_reference(views, pattern, do, dl, **kw)
    return got, ref, views, leaves


@pytest.mark.timeout(120)
@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_triton_matches_fp64_reference(c, tile_loads):
    if tile_loads is not None and c.dtype == torch.float32:
        pytest.skip("TMA tiles are for 16-bit inputs (fp32 takes the pointer loads)")
    got, ref, views, _ = _run_case(c)
    names = ["out", "dq", "dk", "dv"] + (["lse"] if got["lse"] is not None else [])
    assert got["out"].dtype == c.dtype
    if got["lse"] is not None:
        assert got["lse"].dtype == torch.float32
        assert got["lse"].shape == (c.batch, c.heads, c.seq_q)
    assert_matches(got, ref, FP32_TOL if c.dtype == torch.float32 else BF16_TOL, names)
    assert tile_loads is None or tile_loads, "tma=True built no descriptor: pointer loads ran"
    if c.dtype == torch.bfloat16:
        _check_bf16_not_worse_than_unfused_bf16(c, got, ref, views)


def _check_bf16_not_worse_than_unfused_bf16(c, got, ref, views):
    """The kernel's bf16 error vs fp64 should be comparable to that of a plain bf16 computation
    (masked attention with every matmul/softmax rounded to bf16) on the same inputs."""
    pattern = c.pattern()
    mask = token_mask(pattern, c.seq_q, c.seq_k or c.seq_q, c.q_start, c.k_start).to(DEVICE)
    g = c.heads // (c.kv_heads or c.heads)
    scale = c.scale or 1.0 / c.head_dim**0.5

    def bf16_attention(q, k, v):
        k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
        s = s.masked_fill(~mask[None], float("-inf"))
        lse = torch.logsumexp(s.float(), -1)
        p = torch.softmax(s.float(), -1).nan_to_num(0.0).to(q.dtype)
        return torch.einsum("bhqk,bkhd->bqhd", p, v), lse

    leaves = [x.detach().clone().requires_grad_(True) for x in views]
    do, dl = upstream_grads(c.batch, c.seq_q, c.heads, c.head_dim)
    base = attention_with_grads(bf16_attention, leaves, leaves, do, dl)
    for n in ("out", "dq", "dk", "dv"):
        e_k, e_b = rel_err(got[n], ref[n]), rel_err(base[n], ref[n])
        assert e_k <= 2.0 * e_b + 2e-3, (
            f"{n}: kernel bf16 error {e_k:.3g} vs unfused bf16 {e_b:.3g}"
        )


def test_empty_rows_are_zero_with_minus_inf_lse():
    c = next(x for x in CASES if x.id == "k_after_q")
    got, ref, _, _ = _run_case(c)
    empty = torch.arange(c.seq_q) < c.k_start - c.q_start
    assert torch.isneginf(got["lse"][:, :, empty]).all()
    assert torch.isfinite(got["lse"][:, :, ~empty]).all()
    assert (got["out"][:, empty] == 0).all()
    assert (got["dq"][:, empty] == 0).all()


def test_output_keeps_caller_layout_without_copying_inputs(monkeypatch):
    c = Case("layout", block=16, heads=4, kv_heads=2, batch=2, layout="sbhd", seq_q=70)
    pattern = c.pattern()
    leaves, (q, k, v) = make_inputs(2, 70, 70, 4, 2, 32, torch.float32, layout="sbhd")
    assert not q.is_contiguous()
    seen = {}
    orig_fwd, orig_bwd = dispatch.s2_forward, dispatch.s2_backward

    def fwd(q_, k_, v_, *a, **kw):
        seen["fwd"] = (q_.data_ptr(), k_.data_ptr(), v_.data_ptr(), q_.stride(), k_.stride())
        return orig_fwd(q_, k_, v_, *a, **kw)

    def bwd(do_, dlse_, q_, k_, v_, *a, **kw):
        seen["bwd"] = (q_.data_ptr(), k_.data_ptr(), v_.data_ptr(), q_.stride(), k_.stride())
        return orig_bwd(do_, dlse_, q_, k_, v_, *a, **kw)

    monkeypatch.setattr(dispatch, "s2_forward", fwd)
    monkeypatch.setattr(dispatch, "s2_backward", bwd)
    out = s2_attention(q, k, v, pattern, backend="triton")
    expect = (q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(), k.stride())
    assert seen["fwd"] == expect
    assert out.shape == q.shape and out.stride() == q.stride()
    out.sum().backward()
    assert seen["bwd"] == expect
    for x in leaves:
        assert x.grad.is_contiguous()  # gradient arrives in the storage's own [s, b, h, d] layout
    ref = s2_attention_reference(
        q.detach().double(), k.detach().double(), v.detach().double(), pattern
    )
    assert rel_err(out.detach(), ref) <= FP32_TOL


@pytest.mark.timeout(120)
def test_backward_is_deterministic():
    c = Case("det", block=16, heads=4, kv_heads=1, seq_q=170, stride=3)
    runs = [_run_case(c)[0] for _ in range(2)]
    for n in ("dq", "dk", "dv", "out", "lse"):
        assert torch.equal(runs[0][n], runs[1][n]), n


# ------------------------------------------------------------------------------ head ranges
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank,tp", [(1, 2), (2, 4)])
def test_tp_rank_output_equals_slice_of_full_pattern(rank, tp):
    full = S2Pattern(
        num_heads=8, num_kv_heads=4, block_size=16, local_blocks=1, vert_stride=8, head_offset=1
    )
    rp = full.for_tp_rank(rank, tp)
    S, d = 200, 32
    h0, h1 = rp.head_start, rp.head_end
    g = full.group_size
    # The rank's pattern must differ from a pattern that forgets the global head index, or the
    # comparison below could not catch a head-indexing bug.
    naive = S2Pattern(
        num_heads=h1 - h0,
        num_kv_heads=(h1 - h0) // g,
        block_size=16,
        local_blocks=1,
        vert_stride=8,
        head_offset=1,
    )
    assert not torch.equal(naive.block_mask(13), rp.block_mask(13))
    _, (q, k, v) = make_inputs(1, S, S, 8, 4, d, torch.float32, seed=rank)
    ref_full = s2_attention_reference(
        q.detach().double(), k.detach().double(), v.detach().double(), full, return_lse=True
    )
    qs, ks, vs = (
        x.detach()[:, :, a:b].clone().requires_grad_(True)
        for x, a, b in ((q, h0, h1), (k, h0 // g, h1 // g), (v, h0 // g, h1 // g))
    )
    do, dl = upstream_grads(1, S, h1 - h0, d)
    got = attention_with_grads(
        lambda a, b, c: s2_attention(a, b, c, rp, return_lse=True, backend="triton"),
        (qs, ks, vs),
        (qs, ks, vs),
        do,
        dl,
    )
    assert_matches(got, {"out": ref_full[0][:, :, h0:h1], "lse": ref_full[1][:, h0:h1]}, FP32_TOL)
    ref_rank = fp64_reference((qs, ks, vs), rp, do, dl)
    assert_matches(got, ref_rank, FP32_TOL)


# ------------------------------------------------------------------------------ user masks
def _efficient_user_mask(heads, nb, gen):
    """Causal, diagonal, every column a prefix run from the diagonal down (KV-cache efficient),
    with random lengths so it is no S2 pattern."""
    i = torch.arange(nb)[:, None]
    j = torch.arange(nb)[None, :]
    run = torch.randint(1, nb + 1, (heads, 1, nb), generator=gen)
    return (j <= i)[None] & ((i - j)[None] < run)


def _inefficient_user_mask(heads, nb, gen):
    """Random causal mask: attended rows of a column have gaps (re-attends dropped blocks)."""
    m = torch.rand(heads, nb, nb, generator=gen) < 0.4
    m &= torch.ones(nb, nb, dtype=torch.bool).tril()
    m |= torch.eye(nb, dtype=torch.bool)
    m[:, nb - 1, 0] = True
    m[:, 2, 0] = False
    m[:, 1, 0] = True  # column 0: attended at rows 0, 1, dropped at 2, attended again at nb-1
    return m


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "kind,block,seq", [("efficient", 16, 190), ("inefficient", 16, 190), ("inefficient", 64, 300)]
)
def test_user_mask_exact(kind, block, seq):
    gen = torch.Generator().manual_seed(7)
    nb = -(-seq // block) + 1
    fn = _efficient_user_mask if kind == "efficient" else _inefficient_user_mask
    mask = fn(4, nb, gen)
    pattern = S2Pattern.from_block_mask(mask, block, num_kv_heads=2)
    assert torch.equal(pattern.block_mask(nb), mask)
    c = Case(kind, block=block, heads=4, kv_heads=2, seq_q=seq)
    got, ref, _, _ = _run_case(c, pattern)
    assert_matches(got, ref, FP32_TOL)


# ------------------------------------------------------------------------------ kernel configs
def _pinned_default_config(block, head_dim, cuda, dtype=None):
    """The defaults, written out (pinned: a change must be deliberate). The GPU's 128-row forward
    tile with TMA loads replaced the 64-row one at d=128 for 16-bit inputs on 2026-11-23."""
    bn = min(block, 64)
    if not cuda:
        return dict(
            bn=bn,
            fwd_m=min(128, 2 * block),
            fwd_warps=4,
            fwd_stages=1,
            dq_m=min(128, 2 * block),
            dq_warps=4,
            dq_stages=1,
            dkdv_m=32,
            dkdv_warps=4,
            dkdv_stages=1,
            tma=False,
        )
    bwd_stages = 2 if head_dim > 128 else 3
    tma = head_dim == 128 and dtype != torch.float32
    return dict(
        bn=bn,
        fwd_m=128 if tma else 64,
        fwd_warps=8 if tma else 4,
        fwd_stages=3,
        dq_m=64 if (dtype == torch.float32 and head_dim >= 128) else 128,
        dq_warps=8 if head_dim >= 128 else 4,
        dq_stages=bwd_stages,
        dkdv_m=32,
        dkdv_warps=4,
        dkdv_stages=bwd_stages,
        tma=tma,
    )


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_default_kernel_config_pinned(device, block, head_dim, dtype):
    p = S2Pattern(num_heads=2, block_size=block, local_blocks=2, vert_stride=2)
    cfg = config.kernel_config(p, head_dim, torch.device(device), dtype)
    flat = dict(bn=cfg.block_n, tma=cfg.tma)
    for name in ("fwd", "dq", "dkdv"):
        pc = getattr(cfg, name)
        flat.update(
            {
                f"{name}_m": pc.block_m,
                f"{name}_warps": pc.num_warps,
                f"{name}_stages": pc.num_stages,
            }
        )
    assert flat == _pinned_default_config(block, head_dim, device == "cuda", dtype)
    assert config.kernel_config(p, head_dim, device, dtype) == cfg  # a device name works too


@pytest.mark.timeout(120)
def test_kernel_config_reaches_every_launch(monkeypatch):
    """A config given to s2_attention shapes the forward and both backward launches."""
    c = Case("cfg", block=32, heads=4, kv_heads=2, seq_q=150, local=1, stride=2)
    pattern = c.pattern()
    PC = config.PassConfig
    cfg = config.KernelConfig(block_n=16, fwd=PC(16, 4, 1), dq=PC(64, 2, 1), dkdv=PC(16, 1, 1))
    assert cfg != config.kernel_config(pattern, c.head_dim, DEVICE)
    tiles = []
    orig_layout = tl_kernels.layout_for

    def layout_for(pattern_, sq, sk, qs, ks, block_m, block_n, device, with_csc=False):
        tiles.append((block_m, block_n, with_csc))
        return orig_layout(pattern_, sq, sk, qs, ks, block_m, block_n, device, with_csc)

    monkeypatch.setattr(tl_kernels, "layout_for", layout_for)
    _assert_config_matches_reference(c, cfg)
    assert tiles == [(16, 16, False), (64, 16, False), (16, 16, True)]


def _assert_config_matches_reference(c: Case, cfg) -> None:
    """Case ``c`` through the Triton kernels with ``cfg``: out, LSE and dq/dk/dv against fp64."""
    pattern = c.pattern()
    leaves, views = make_inputs(1, c.seq_q, c.seq_q, c.heads, c.kv_heads, c.head_dim, c.dtype)
    do, dl = upstream_grads(1, c.seq_q, c.heads, c.head_dim)
    got = attention_with_grads(
        lambda q, k, v: s2_attention(
            q, k, v, pattern, return_lse=True, backend="triton", kernel_config=cfg
        ),
        leaves,
        views,
        do,
        dl,
    )
    assert_matches(got, fp64_reference(views, pattern, do, dl), FP32_TOL)


@pytest.mark.timeout(180)
def test_wide_key_tiles_of_a_128_block_pattern_match_the_reference():
    """128-key tiles (as tools/benchmark.py's ``bn=128`` sweep configs use them, one per pattern
    block of 128): forward, LSE and every gradient equal the fp64 reference, GQA and an odd
    length."""
    c = Case("bn128", block=128, heads=4, kv_heads=2, seq_q=700, local=1, stride=2)
    PC = config.PassConfig
    cfg = config.KernelConfig(block_n=128, fwd=PC(128, 4, 1), dq=PC(128, 4, 1), dkdv=PC(32, 4, 1))
    _assert_config_matches_reference(c, cfg)


def test_kernel_config_checked():
    PC = config.PassConfig
    with pytest.raises(ValueError, match="block_m"):
        PC(24, 4, 1)
    with pytest.raises(ValueError, match="num_warps"):
        PC(32, 3, 1)
    with pytest.raises(ValueError, match="num_stages"):
        PC(32, 4, 0)
    with pytest.raises(ValueError, match="block_n"):
        config.KernelConfig(8, PC(32, 4, 1), PC(32, 4, 1), PC(32, 4, 1))
    with pytest.raises(TypeError, match="dq"):
        config.KernelConfig(16, PC(32, 4, 1), dict(block_m=32), PC(32, 4, 1))
    q, k, v = _api_inputs()
    p = S2Pattern(num_heads=4, num_kv_heads=2, block_size=16, local_blocks=2, vert_stride=4)
    with pytest.raises(TypeError, match="kernel_config"):
        s2_attention(q, k, v, p, backend="triton", kernel_config={"fwd_m": 64})
    # A key tile larger than the pattern's block would span two blocks.
    big_n = config.KernelConfig(32, PC(32, 4, 1), PC(32, 4, 1), PC(32, 4, 1))
    with pytest.raises(ValueError, match="block_n"):
        s2_attention(q, k, v, p, backend="triton", kernel_config=big_n)


# ------------------------------------------------------------------------------ bad arguments
def _api_inputs(b=1, s=64, h=4, hkv=2, d=32, dtype=torch.float32):
    q = torch.randn(b, s, h, d, dtype=dtype)
    k = torch.randn(b, s, hkv, d, dtype=dtype)
    return q, k, k.clone()


BAD_CALLS = [
    ("q heads", lambda p: (_api_inputs(h=8, hkv=4), {}), "heads"),
    ("kv heads", lambda p: (_api_inputs(h=4, hkv=1), {}), "k/v"),
    ("q_start", lambda p: (_api_inputs(), dict(q_start=8)), "q_start"),
    ("k_start", lambda p: (_api_inputs(), dict(k_start=-16)), "k_start"),
    (
        "dtype",
        lambda p: ((lambda q, k, v: (q, k.to(torch.bfloat16), v))(*_api_inputs()), {}),
        "dtype",
    ),
    ("head_dim", lambda p: (_api_inputs(d=48), {}), "head_dim"),
    ("kv shape", lambda p: ((lambda q, k, v: (q, k, v[:, :32]))(*_api_inputs()), {}), "shape"),
    ("backend", lambda p: (_api_inputs(), dict(backend="cuda")), "backend"),
]


@pytest.mark.parametrize("name,make,word", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_s2_attention_rejects_bad_arguments(name, make, word):
    p = S2Pattern(num_heads=4, num_kv_heads=2, block_size=16, local_blocks=2, vert_stride=4)
    (q, k, v), kw = make(p)
    kw.setdefault("backend", "triton")
    with pytest.raises(ValueError, match=word):
        s2_attention(q, k, v, p, **kw)


def test_sequence_longer_than_user_mask_rejected():
    mask = torch.ones(2, 4, 4, dtype=torch.bool).tril()
    p = S2Pattern.from_block_mask(mask, 16)
    q = torch.randn(1, 65, 2, 16)
    with pytest.raises(ValueError, match="user mask"):
        s2_attention(q, q, q, p, backend="triton")
    with pytest.raises(ValueError, match="user mask"):
        s2_attention(q[:, :40], q[:, :40], q[:, :40], p, q_start=32, backend="triton")
    # exactly the mask's length is fine
    out = s2_attention(q[:, :64], q[:, :64], q[:, :64], p, backend="reference")
    assert out.shape == (1, 64, 2, 16)


def test_tma_only_where_the_tensors_allow_it():
    """TMA needs 16-byte aligned addresses and strides and rows of >= 16 bytes; other tensors
    take the pointer loads (same results), never a failing or wrong TMA copy."""
    ok = torch.randn(2, 40, 4, 32, dtype=torch.bfloat16)
    assert tl_kernels.tma_compatible(ok)
    assert tl_kernels.tma_compatible(ok.transpose(0, 1).contiguous().transpose(0, 1))  # sbhd view
    assert not tl_kernels.tma_compatible(torch.randn(2, 40, 4, 4, dtype=torch.bfloat16))  # 8 B rows
    assert not tl_kernels.tma_compatible(ok[..., ::2])  # strided innermost dim
    shifted = torch.randn(2 * 40 * 4 * 32 + 1, dtype=torch.bfloat16)[1:].view(2, 40, 4, 32)
    assert not tl_kernels.tma_compatible(shifted)  # address 2 bytes past alignment
    assert not tl_kernels.tma_compatible(ok.float())  # fp32 keeps the pointer loads
    assert tl_kernels._tile_descriptors(True, (ok, shifted), 16) == (None, None)
    assert tl_kernels._tile_descriptors(False, (ok,), 16) == (None,)
    assert all(d is not None for d in tl_kernels._tile_descriptors(True, (ok, ok), 16))
    p = S2Pattern(num_heads=4, block_size=16, local_blocks=2, vert_stride=3)
    cfg = dataclasses.replace(config.kernel_config(p, 32, DEVICE), tma=True)
    q = shifted.to(DEVICE)
    got = s2_attention(q, q, q, p, backend="triton", kernel_config=cfg)
    ref = s2_attention_reference(q.double(), q.double(), q.double(), p)
    assert rel_err(got, ref) < 1e-2
