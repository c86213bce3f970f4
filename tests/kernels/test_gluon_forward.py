"""The Gluon S2 forward (``s2attn.gluon_forward``) without a GPU.

Gluon kernels do not run under the Triton interpreter, so the CPU checks are: the kernel's
schedule emulated in float64 against the reference (tile lists, program order, warpgroup
split, masks, online softmax), the TMA views' address arithmetic for every layout the wrapper
takes, when the forward is chosen, and a compile of the kernel for sm_90 with the installed
Triton. tests/kernels/test_kernels_gpu.py runs the kernel itself on an H100.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import s2attn.gluon_forward as gf
from s2attn import S2Pattern, s2_attention_reference, s2_attention_varlen_reference
from s2attn.config import kernel_config
from s2attn.tl_kernels import Varlen
from tests.helpers.kernels import sm90_compile_stats

pytestmark = pytest.mark.version_independent

needs_gluon = pytest.mark.skipif(gf.gluon is None, reason="this Triton has no Gluon Hopper API")


@pytest.mark.parametrize(
    "batch,seq,heads,kv_heads,head_dim,block,local,stride,offset",
    [
        (2, 512, 4, 4, 16, 64, 2, 4, 0),  # MHA, two batch rows
        (1, 1024, 8, 2, 16, 64, 4, 8, 0),  # GQA 8/2
        (1, 768, 4, 4, 16, 128, 2, 2, 0),  # 128-token blocks: one block a query tile
        (1, 768, 2, 2, 128, 128, 2, 2, 0),  # the same at head_dim 128: 64-key halves of blocks
        (1, 512, 2, 2, 16, 64, 16, 1, 0),  # dense causal
        (1, 640, 4, 2, 16, 64, 2, 4, 3),  # a TP rank's heads (phase from head 3)
        # head_dim 64: three warpgroups, 192-row tiles; 640 rows end in a 64-row tile
        (2, 640, 4, 2, 64, 64, 4, 2, 1),
        (1, 768, 2, 2, 64, 64, 16, 1, 0),  # dense causal, tiles that fill the sequence
        (1, 640, 2, 2, 128, 64, 4, 2, 0),  # head_dim 128: two warpgroups, 128-row tiles
    ],
)
def test_emulated_schedule_matches_reference(
    batch, seq, heads, kv_heads, head_dim, block, local, stride, offset
):
    g = torch.Generator().manual_seed(seq + heads + offset)
    pattern = S2Pattern(
        num_heads=heads,
        num_kv_heads=kv_heads,
        block_size=block,
        local_blocks=local,
        vert_stride=stride,
        head_offset=offset,
    )
    q, k, v = (
        torch.randn(batch, seq, h, head_dim, dtype=torch.float64, generator=g)
        for h in (heads, kv_heads, kv_heads)
    )
    scale = head_dim**-0.5
    out, lse = gf.emulate_forward(q, k, v, pattern, scale)
    ref, ref_lse = s2_attention_reference(q, k, v, pattern, scale, return_lse=True)
    assert (out - ref).abs().max().item() < 1e-10
    assert (lse - ref_lse.double()).abs().max().item() < 1e-5  # the reference's LSE is fp32


@pytest.mark.parametrize(
    "lens,heads,kv_heads,head_dim,block",
    [
        ([300, 0, 1, 128, 77, 640], 4, 2, 16, 64),  # odd, empty and one-token documents, GQA
        ([200, 450], 2, 2, 128, 128),  # head_dim 128 at block 128: 64-key halves of blocks
    ],
)
def test_emulated_schedule_on_packed_documents_matches_reference(
    lens, heads, kv_heads, head_dim, block
):
    """Packed documents through the program map: each document attended on its own, the
    tiles that run past a document's end reading the next one's rows (or zeros past the
    tensor's end) and storing only their own rows."""
    g = torch.Generator().manual_seed(sum(lens) + heads)
    pattern = S2Pattern(
        num_heads=heads,
        num_kv_heads=kv_heads,
        block_size=block,
        local_blocks=2,
        vert_stride=2,
        head_offset=1,
    )
    total = sum(lens)
    q, k, v = (
        torch.randn(1, total, h, head_dim, dtype=torch.float64, generator=g)
        for h in (heads, kv_heads, kv_heads)
    )
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim**-0.5
    varlen = Varlen(cu, max(lens), total)
    out, lse = gf.emulate_forward(q, k, v, pattern, scale, varlen=varlen)
    ref, ref_lse = s2_attention_varlen_reference(
        q[0], k[0], v[0], cu, pattern, softmax_scale=scale, return_lse=True
    )
    assert (out[0] - ref).abs().max().item() < 1e-10
    assert (lse[0] - ref_lse.double()).abs().max().item() < 1e-5  # the reference's is fp32


def _read_through(view: gf.TmaView, t: torch.Tensor) -> torch.Tensor:
    """``t`` rebuilt from the view's matrix with the kernel's coordinates."""
    b, s, h, d = t.shape
    got = torch.empty_like(t)
    for i in range(b):
        for j in range(h):
            col = i * view.col_b + j * view.col_h
            got[i, :, j] = view.matrix[i * view.row_b : i * view.row_b + s, col : col + d]
    return got


def _fused_qkv_value(s, b, groups, per_group, d):
    """Megatron's value: a slice of the fused QKV projection ``[s, b, groups, (per_group + 2)
    * d]``, seen as ``[b, s, groups, d]``."""
    mixed = torch.randn(s, b, groups, (per_group + 2) * d, dtype=torch.bfloat16)
    return mixed[..., (per_group + 1) * d :].transpose(0, 1)


@pytest.mark.parametrize(
    "name,make,batch_in",
    [
        ("bshd", lambda: torch.randn(2, 256, 4, 64, dtype=torch.bfloat16), "rows"),
        ("sbhd", lambda: torch.randn(256, 3, 4, 64, dtype=torch.bfloat16).transpose(0, 1), "cols"),
        ("fused-qkv", lambda: _fused_qkv_value(256, 2, 2, 4, 64), "cols"),
        ("one-row", lambda: torch.randn(1, 256, 4, 128, dtype=torch.float16), "rows"),
    ],
)
def test_tma_view_addresses_every_token_and_head(name, make, batch_in):
    t = make()
    view = gf.tma_view(t)
    assert view is not None, name
    assert (view.row_b == 0) == (batch_in == "cols")
    assert view.matrix.stride(1) == 1 and view.matrix.data_ptr() == t.data_ptr()
    torch.testing.assert_close(_read_through(view, t), t, rtol=0, atol=0)


def test_paired_views_share_coordinates_or_make_both_dense():
    bshd = torch.randn(2, 256, 4, 64, dtype=torch.bfloat16)
    sbhd = torch.randn(256, 2, 4, 64, dtype=torch.bfloat16).transpose(0, 1)
    a, b, va, vb = gf.paired_tma_views(bshd, bshd.clone())
    assert a is bshd and va[1:] == vb[1:]  # already alike: no copy
    a, b, va, vb = gf.paired_tma_views(bshd, sbhd)  # two layouts: both dense copies
    assert a.is_contiguous() and b.is_contiguous() and va[1:] == vb[1:]
    assert torch.equal(b, sbhd)
    fresh = torch.empty(2, 256, 4, 64, dtype=torch.bfloat16)
    a, out, va, vo = gf.paired_tma_views(sbhd, fresh, b_is_output=True)
    assert out is not fresh and out.is_contiguous() and va[1:] == vo[1:]
    assert torch.equal(a, sbhd)


def test_tma_view_refuses_what_it_cannot_address():
    # head_dim not innermost
    assert gf.tma_view(torch.randn(1, 256, 64, 4, dtype=torch.bfloat16).transpose(2, 3)) is None
    # heads of a token spread over more than a row: [b, h, s, d] seen as [b, s, h, d]
    assert gf.tma_view(torch.randn(2, 4, 256, 64, dtype=torch.bfloat16).transpose(1, 2)) is None
    # a row stride that is not a multiple of 16 bytes
    odd = torch.randn(1, 256, 1, 65, dtype=torch.bfloat16)[..., :64]
    assert gf.tma_view(odd) is None


def test_not_chosen_off_sm90_or_by_the_switch(monkeypatch):
    pattern = S2Pattern(num_heads=4, block_size=64, local_blocks=2, vert_stride=4)
    assert kernel_config(pattern, 128, "cpu").gluon_fwd is False
    monkeypatch.setenv(gf.ENV_SWITCH, "yes")
    with pytest.raises(ValueError, match="S2ATTN_GLUON_FORWARD='yes'"):
        gf.enabled_by_default(128, 64, "cuda")
    if gf.gluon is None:
        return
    for cap, switch, head_dim, block, dtype, want in [
        ((9, 0), "1", 128, 64, torch.bfloat16, True),
        ((9, 0), "1", 64, 128, None, True),
        ((9, 0), "0", 128, 64, torch.bfloat16, False),
        ((9, 0), "", 128, 64, torch.bfloat16, gf.triton_checked()),
        ((8, 0), "1", 128, 64, torch.bfloat16, False),  # A100: no wgmma
        ((10, 0), "1", 128, 64, torch.bfloat16, False),  # Blackwell: another MMA
        ((9, 0), "1", 256, 64, torch.bfloat16, False),
        ((9, 0), "1", 128, 16, torch.bfloat16, True),  # on gathered key tiles
        ((9, 0), "1", 64, 32, torch.bfloat16, True),
        ((9, 0), "1", 128, 256, torch.bfloat16, False),
        ((9, 0), "1", 128, 64, torch.float32, False),
    ]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        monkeypatch.setenv(gf.ENV_SWITCH, switch)
        got = gf.enabled_by_default(head_dim, block, "cuda", dtype)
        assert got is want, (cap, switch, head_dim, block, dtype)


def test_calls_it_does_not_take_say_why():
    pattern = S2Pattern(num_heads=4, block_size=64, local_blocks=2, vert_stride=4)
    q = torch.randn(1, 256, 4, 64, dtype=torch.bfloat16)
    why = lambda **kw: gf.unsupported_reason(
        kw.get("q", q), kw.get("k", q), q, kw.get("pattern", pattern), kw.get("qs", 0), 0,
        kw.get("varlen"),
    )  # fmt: skip
    if gf.gluon is None:
        assert "Gluon" in why()
        return
    block_16 = S2Pattern(num_heads=4, block_size=16, local_blocks=2, vert_stride=4)
    assert "varlen" in why(varlen=object(), pattern=block_16)
    assert "sm_90" in why(varlen=object())  # packed documents at block 64 pass the rest
    assert "last positions" in why(qs=128)  # queries past the keys' end
    assert "last positions" in why(k=q[:, :128])
    assert "sm_90" in why()  # a CPU tensor
    assert "sm_90" in why(q=q[:, :128], qs=128)  # a context-parallel chunk passes the rest


def test_three_warpgroups_at_head_dim_64_on_whole_sequences_of_64_token_blocks():
    """Three consumers (192-row tiles) where two cannot hide each other's latencies (head_dim
    64, 64-key tiles), two wherever else the tiling or registers differ."""
    assert gf.consumers_for(64, 64) == 3 and gf.forward_tile_m(64, 64) == 192
    assert gf.consumers_for(64, 16) == 2  # only the kernels' head_dim 64
    assert gf.consumers_for(64, 128) == 2 and gf.forward_tile_m(64, 128) == 128
    assert gf.consumers_for(128, 64) == 2  # 128-key tiles: their scores fill the registers
    assert gf.consumers_for(16, 64) == 2  # gathered key tiles
    assert gf.consumers_for(64, 64, q_start=256) == 2  # a context-parallel chunk
    assert gf.consumers_for(64, 64, varlen=object()) == 2  # packed documents
    # three 64-row tiles of Q and O and three K/V stages of 64 x 64 fit the budget
    assert gf.ring_stages(64, 64, consumers=3) == 3


def test_user_mask_that_merges_into_128_rows_only_keeps_two_warpgroups():
    """A user mask whose rows attending a key block are contiguous in every 128-row tile but
    not in a 192-row one: the Gluon calls take the 128-row layout (two warpgroups) rather than
    falling back to the tl kernels; an S2 pattern gets its 192-row layout."""
    from s2attn.dispatch import _gluon_rows_layout

    nb = 6
    mask = torch.eye(nb, dtype=torch.bool)[None]
    mask[0, 2, 0] = True  # query block 2, not block 1, attends key block 0
    masked = S2Pattern.from_block_mask(mask, block_size=64)
    lay = _gluon_rows_layout(masked, nb * 64, nb * 64, 0, 192, 64, "cpu", None)
    assert lay.block_m == 128
    plain = S2Pattern(num_heads=1, block_size=64, local_blocks=2, vert_stride=2)
    assert _gluon_rows_layout(plain, nb * 64, nb * 64, 0, 192, 64, "cpu", None).block_m == 192


@needs_gluon
@pytest.mark.timeout(600)
@pytest.mark.parametrize("head_dim,block", [(128, 64), (64, 128), (128, 16), (64, 64)])
def test_compiles_for_sm90_with_wgmma_and_no_spills(head_dim, block, tmp_path):
    """The installed Triton builds the kernel for the H100: a Gluon API change shows here, not
    first on a user's GPU. wgmma (HGMMA in SASS) for both MMAs, no local memory."""
    got = sm90_compile_stats("s2attn.gluon_forward", head_dim, block, tmp_path)
    # Per key tile: S = Q K^T in head_dim/16 k-steps, O += P V in block/16, of 64-row wgmma;
    # the loop is compiled twice (unmasked and masked entries).
    assert got["hgmma"] >= 2 * (head_dim + block) // 16
    assert got["local_memory"] == 0
    # No spills in the key-tile loops with the Triton the kernel was checked with on a GPU
    # (3.6); 3.9 keeps a few scalars of the persistent programs' item loop on the stack,
    # some reloaded in the key-tile loops (its Gluon kernels are off by default): up to 39
    # reloads and 80 bytes at head_dim 64, block 128 since the item loop also carries a packed
    # document's start and length. A spilled tile would take hundreds.
    assert got["key_loop_spills"] <= (0 if gf.triton_checked() else 48)
    assert got["stack_bytes"] <= (0 if gf.triton_checked() else 96)
    # O += P V takes P from registers and S = Q K^T takes Q on 64-key tiles (and, with the
    # checked Triton, on 128-key ones at head_dim 64): with both operands in shared memory a
    # 64-key product reads 128 bytes a clock.
    tile = max(block, 64)
    three = gf.consumers_for(block, head_dim) == 3  # Q from shared memory there
    if tile * head_dim <= 64 * 128 and (tile == 64 or gf.triton_checked()) and not three:
        assert got["hgmma_register_a"] == got["hgmma"]
    else:
        assert 0 < got["hgmma_register_a"] < got["hgmma"]
    # ptxas kept the wgmma asynchronous: a serialized kernel waits for each one
    assert got["full_waits"] <= got["hgmma"] // 4
    assert got["shared_bytes"] <= 227 * 1024


def test_loop_spill_count_reads_only_the_innermost_wgmma_loops():
    """Spills (LDL/STL) count inside the innermost loops that issue wgmma, not in the item
    loop around them nor in loops without wgmma; predicated ones count too."""
    sass = """
        /*0000*/                   STL [R1], R2 ;
        /*0010*/                   LDL R3, [R1] ;
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, R88, gdesc[UR4], RZ ;
        /*0030*/                   LDL R4, [R1+0x4] ;
        /*0040*/               @P0 STL [R1+0x8], R5 ;
        /*0050*/               @P1 BRA 0x20 ;
        /*0060*/                   LDL R6, [R1] ;
        /*0070*/                   HGMMA.64x64x16.F32.BF16 R24, R88, gdesc[UR4], RZ ;
        /*0080*/                   LDL R7, [R1] ;
        /*0090*/               @P2 BRA 0x70 ;
        /*00a0*/              @!P3 BRA 0x10 ;
        /*00b0*/                   LDL R8, [R1] ;
        /*00c0*/               @P4 BRA 0xb0 ;
        /*00d0*/                   EXIT ;
    """
    # loops 0x20-0x50 (2 spills) and 0x70-0x90 (1); 0x10-0xa0 holds both (outer); 0xb0-0xc0
    # issues no wgmma
    assert gf._innermost_mma_loop_spills(sass) == 3


def test_persistent_programs_one_per_sm_for_short_items_one_per_item_for_long(monkeypatch):
    """S2 work items (a few dozen key tiles) share one program per SM; long causal rows get a
    program each, as does work with fewer items than SMs."""
    sms = SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: sms)
    limit = gf.FWD_PERSISTENT_TILES
    assert gf.persistent_programs(32768, 46.8, "cuda") == 132
    assert gf.persistent_programs(100, 46.8, "cuda") == 100
    assert gf.persistent_programs(32768, 257.0, "cuda") == 32768
    assert gf.persistent_programs(32768, limit, "cuda") == 132


@pytest.mark.parametrize(
    "seq_k,q_start,heads,kv_heads,local,stride,offset",
    [
        (768, 256, 4, 2, 2, 4, 0),  # a late chunk: stripes and window reach back before it
        (1024, 768, 8, 2, 4, 8, 1),  # GQA 8/2, the last chunk of 4; key tiles nobody attends
        (512, 256, 2, 2, 16, 1, 0),  # dense causal: a full rectangle before the diagonal
    ],
)
def test_emulated_chunk_schedules_match_reference(
    seq_k, q_start, heads, kv_heads, local, stride, offset
):
    """A context-parallel chunk (queries at ``q_start ..``, the last of ``seq_k`` keys from 0)
    through all three Gluon passes' schedules, emulated in float64, against the reference at
    the same positions: outputs, LSE and dQ/dK/dV (dK/dV zero on keys nothing attends)."""
    from s2attn import gluon_dkdv as gd
    from s2attn import gluon_dq as gq

    g = torch.Generator().manual_seed(seq_k + q_start + heads)
    pattern = S2Pattern(
        num_heads=heads,
        num_kv_heads=kv_heads,
        block_size=64,
        local_blocks=local,
        vert_stride=stride,
        head_offset=offset,
    )
    sq, d = seq_k - q_start, 16
    q = torch.randn(1, sq, heads, d, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (
        torch.randn(1, seq_k, kv_heads, d, dtype=torch.float64, generator=g, requires_grad=True)
        for _ in range(2)
    )
    do = torch.randn(1, sq, heads, d, dtype=torch.float64, generator=g)
    scale = d**-0.5
    ref, ref_lse = s2_attention_reference(q, k, v, pattern, scale, return_lse=True, q_start=q_start)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(ref, (q, k, v), do)
    q, k, v, ref = q.detach(), k.detach(), v.detach(), ref.detach()
    out, lse = gf.emulate_forward(q, k, v, pattern, scale, q_start)
    assert (out - ref).abs().max().item() < 1e-10
    assert (lse - ref_lse.double()).abs().max().item() < 1e-5  # the reference's LSE is fp32
    dq, delta = gq.emulate_dq(do, None, q, k, v, out, lse, pattern, scale, q_start)
    torch.testing.assert_close(dq, dq_ref, rtol=1e-9, atol=1e-9)
    dk, dv = gd.emulate_dkdv(do, q, k, v, lse, delta, pattern, scale, q_start)
    torch.testing.assert_close(dk, dk_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(dv, dv_ref, rtol=1e-9, atol=1e-9)
    # Keys that no query head of their group attends (the GQA case has them) came out zero.
    idle = dk_ref.abs().amax(dim=(0, 3)) == 0  # [seq_k, kv_heads]
    assert bool(idle.any()) == (heads > kv_heads)
    assert not dk[0].abs().amax(-1)[idle].any() and not dv[0].abs().amax(-1)[idle].any()


def test_wrappers_refuse_queries_that_are_not_the_keys_last_positions():
    """All three Gluon passes check ``q_start + sq == sk`` before any GPU work."""
    from s2attn import gluon_dkdv as gd
    from s2attn import gluon_dq as gq

    pattern = S2Pattern(num_heads=2, block_size=64, local_blocks=2, vert_stride=4)
    q, k = torch.zeros(1, 128, 2, 16), torch.zeros(1, 256, 2, 16)
    calls = {
        "s2_forward_gluon": lambda qs: gf.s2_forward_gluon(q, k, k, pattern, 1.0, q_start=qs),
        "s2_dq_gluon": lambda qs: gq.s2_dq_gluon(q, None, q, k, k, q, None, pattern, 1.0, None, qs),
        "s2_dkdv_gluon": lambda qs: gd.s2_dkdv_gluon(
            q, q, k, k, None, None, pattern, 1.0, None, qs
        ),
    }
    for name, call in calls.items():
        for q_start in (0, 64):
            with pytest.raises(ValueError, match=rf"{name}: .*q_start \({q_start}\) \+ 128"):
                call(q_start)
