"""The Gluon dQ pass (``s2attn.gluon_dq``) without a GPU: its schedule emulated in float64
against the reference's gradients, and a compile for sm_90 with the installed Triton
(tests/kernels/test_kernels_gpu.py has its device checks)."""

from __future__ import annotations

import pytest
import torch

import s2attn.gluon_dq as gq
from s2attn import s2_attention_varlen_reference
from tests.helpers.kernels import float64_packed_case, float64_s2_case, sm90_compile_stats

pytestmark = pytest.mark.version_independent


@pytest.mark.parametrize(
    "batch,seq,heads,kv_heads,local,stride,offset,with_dlse",
    [
        (2, 512, 4, 4, 2, 4, 0, False),  # MHA, two batch rows
        (1, 1024, 8, 2, 4, 8, 0, True),  # GQA 8/2, an LSE gradient
        (1, 512, 2, 2, 16, 1, 0, False),  # dense causal
        (1, 640, 4, 2, 2, 4, 3, True),  # a TP rank's heads; 5 query tiles
    ],
)
def test_emulated_schedule_matches_reference_gradients(
    batch, seq, heads, kv_heads, local, stride, offset, with_dlse
):
    pattern, q, k, v, do, scale, out, lse = float64_s2_case(
        batch, seq, heads, kv_heads, local, stride, offset
    )
    g = torch.Generator().manual_seed(seq)
    dlse = torch.randn(lse.shape, dtype=torch.float64, generator=g) if with_dlse else None
    grads = [do] + ([dlse] if with_dlse else [])
    outs = [out] + ([lse] if with_dlse else [])
    (dq_ref,) = torch.autograd.grad(outs, (q,), grads)
    dq, delta = gq.emulate_dq(
        do, dlse, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), pattern, scale
    )
    torch.testing.assert_close(dq, dq_ref, rtol=1e-9, atol=1e-9)
    want = (do * out.detach()).sum(-1).transpose(1, 2) - (dlse if with_dlse else 0)
    torch.testing.assert_close(delta, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "batch,seq,kv_heads,with_dlse",
    [(2, 640, 2, True), (1, 768, 4, False)],  # the last 192-row tile of 64 rows; tiles that fill
)
def test_emulated_three_warpgroup_schedule_matches_reference_gradients(
    batch, seq, kv_heads, with_dlse
):
    """head_dim 64 at block 64: three consumer warpgroups on 192-row tiles, the last of which
    may run past the sequence (rows read with an LSE of +inf, not stored)."""
    assert gq.tile_m(64, 64) == 192
    pattern, q, k, v, do, scale, out, lse = float64_s2_case(
        batch, seq, 4, kv_heads, 4, 2, 1, head_dim=64
    )
    g = torch.Generator().manual_seed(seq + 1)
    dlse = torch.randn(lse.shape, dtype=torch.float64, generator=g) if with_dlse else None
    outs, grads = [out] + ([lse] if with_dlse else []), [do] + ([dlse] if with_dlse else [])
    (dq_ref,) = torch.autograd.grad(outs, (q,), grads)
    dq, _ = gq.emulate_dq(
        do, dlse, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), pattern, scale
    )
    torch.testing.assert_close(dq, dq_ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("with_dlse", [False, True])
def test_emulated_schedule_on_packed_documents_matches_reference_gradients(with_dlse):
    """Packed documents (odd, empty and one-token ones, GQA) through the program map: dQ and
    delta of each document as the reference's, rows past a document's end neither read as
    attending nor stored."""
    pattern, varlen, cu, q, k, v, scale, g = float64_packed_case(
        [300, 0, 1, 128, 77, 640], 4, 2, seed=7 + with_dlse
    )
    out, lse = s2_attention_varlen_reference(q, k, v, cu, pattern, scale, return_lse=True)
    lse = lse.double()
    do = torch.randn(out.shape, dtype=torch.float64, generator=g)
    dlse = torch.randn(lse.shape, dtype=torch.float64, generator=g) if with_dlse else None
    outs, grads = [out] + ([lse] if with_dlse else []), [do] + ([dlse] if with_dlse else [])
    (dq_ref,) = torch.autograd.grad(outs, (q,), grads)
    one = lambda x: x.detach()[None]  # noqa: E731 - the kernels' [1, total, h, d]
    dq, delta = gq.emulate_dq(
        one(do), one(dlse) if with_dlse else None, one(q), one(k), one(v), one(out),
        one(lse), pattern, scale, varlen=varlen,
    )  # fmt: skip
    # The reference's LSE is fp32: P carries its rounding (about 1e-7).
    torch.testing.assert_close(dq[0], dq_ref, rtol=1e-5, atol=1e-5)
    want = (do * out.detach()).sum(-1).t() - (dlse if with_dlse else 0)
    torch.testing.assert_close(delta[0], want, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(gq.gluon is None, reason="this Triton has no Gluon Hopper API")
@pytest.mark.timeout(600)
# block 16: gathered key tiles, loaded box by box
@pytest.mark.parametrize("head_dim,block", [(128, 64), (64, 64), (128, 16)])
def test_compiles_for_sm90_with_wgmma_and_no_spills(head_dim, block, tmp_path):
    got = sm90_compile_stats("s2attn.gluon_dq", head_dim, block, tmp_path)
    consumers = gq.tile_m(block, head_dim) // gq.WG_ROWS  # three at head_dim 64, block 64
    # Per key tile: S and dP in head_dim/16 k-steps, dQ in 64/16; the loop is compiled for
    # full and for partial entries, in each consumer warpgroup.
    assert got["hgmma"] >= consumers * 2 * (2 * head_dim // 16 + 64 // 16)
    assert got["local_memory"] == 0
    # No spills but, at head_dim 128 with Triton 3.9, two scalars (8 bytes; read once a step
    # in the masked loop, none in the full entries' loop; Triton 3.6: none); with three
    # consumers (160 registers) 3.6 keeps two values (16 bytes) on the stack, 3.9 none.
    assert got["stack_bytes"] <= (8 if head_dim == 128 else 16 if consumers == 3 else 0)
    if consumers == 3:
        # Q and dO from shared memory there: only dQ += dS K takes a register operand.
        assert got["hgmma_register_a"] == consumers * 2 * (64 // 16)
        assert got["full_waits"] <= got["hgmma"] // 4
        return
    # S = Q K^T takes Q from registers (and dO in dP = dO V^T in the full entries' loop), as
    # dQ += dS K takes dS: with both operands in shared memory a 64-key product reads 128
    # bytes a clock. Per consumer: the full entries' loop, then the masked one (dO from
    # shared memory there at head_dim 128).
    masked_do = head_dim == 64
    full_loop = 2 * head_dim // 16 + 64 // 16
    masked_loop = (1 + masked_do) * head_dim // 16 + 64 // 16
    register_a = 2 * (full_loop + masked_loop)
    assert got["hgmma_register_a"] >= register_a
    # ptxas kept the wgmma asynchronous: a serialized kernel waits for each one
    assert got["full_waits"] <= got["hgmma"] // 4
    assert got["shared_bytes"] <= 227 * 1024
