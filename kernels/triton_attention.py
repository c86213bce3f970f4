"""Triton forward and backward kernels for S2 attention, and their autograd Function.

FlashAttention-2 structure over the sparse tile lists of :mod:`s2attn.layout`:
forward and dQ programs own a query tile and walk its key tiles; dK/dV programs own a key tile of
one KV head and walk, for every query head of its GQA group, the query tiles that attend it, so
dK/dV are accumulated in registers with no atomics (deterministic). Each walk does the "full"
tiles first without any masking, then the "partial" tiles (causal diagonal, row range, sequence
end) with masking applied to the logits *before* the exponential.

With ``KernelConfig(tma=True)`` the tiles the loops walk (K/V in the forward and dQ passes, Q/dO
in the dK/dV pass) are read through tensor descriptors over the ``[b, s, h, d]`` tensors: Hopper's
tensor memory accelerator (TMA) copies a whole tile per instruction, instead of every thread
computing its addresses. Rows past a tensor's sequence length read as zeros, as the masked loads
give; inside a packed row they are the next document's tokens, finite and masked out by the
logits like any key outside the document.

Logits are kept in base 2 (``qk_scale = softmax_scale * log2(e)``); the returned LSE is the
natural-log log-sum-exp of the scaled logits, fp32, shape ``[batch, heads, seq_q]``.

Varlen (packed documents, ``VARLEN`` constexpr): the S2 pattern restarts at every document start,
so a document of length ``L`` uses exactly the first ``ceil(L / tile)`` query and key tiles of
the layout of any longer sequence. One layout (for a length ``>= max_seqlen``) serves every
document; a program gets its layout item, its document's first token and length from a program
map (:func:`varlen_program_map`: one small Triton launch on ``cu_seqlens``, no host sync),
offsets its pointers by that token and bounds rows and keys by that length. Inputs are the packed
``[1, total, heads, dim]`` tensors themselves, never a padded copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton before host-side tensor descriptors: tma=True takes pointer loads
    TensorDescriptor = None

from . import gathered_keys, gluon_dkdv, gluon_dq, gluon_forward
from .layout import MIN_TILE, layout_for, varlen_grid, varlen_layout_len, varlen_programs
from .pattern import S2Pattern

# Logits are kept in base 2 (exp2 is the fast path); the LSE is returned in natural log.
# constexpr so the @triton.jit code can read them (it reads no other globals).
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# fp32 -> bf16 keeps the high 16 bits of the fp32 pattern (used only under the interpreter).
_BF16_DROPPED_BITS = tl.constexpr(16)
_BF16_HALF_ULP = tl.constexpr(1 << 15)
_BF16_KEPT_MASK = tl.constexpr(0xFFFF0000)
# Varlen dK/dV: entries of a key tile's query-tile list read per vector load when counting those
# that lie inside the program's document (one load covers a light column's whole list).
ENTRY_SCAN = tl.constexpr(128)


# --------------------------------------------------------------------- interpreter-safe helpers
# On the GPU both helpers are exactly the plain operation (INTERPRET is a constexpr False there).
@triton.jit
def _mma(a, b, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """``a @ b`` with fp32 accumulation."""
    if INTERPRET:
        # The interpreter stores bf16 as uint16 and its tl.dot multiplies those raw bits
        # (triton-lang/triton#11584). Widened operands give what a bf16/fp16 MMA computes: exact
        # products summed in fp32.
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def _cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``x`` to ``dtype``, rounding to nearest even like the GPU's conversion."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            # The interpreter converts fp32 to bf16 by dropping the low bits (round toward zero,
            # twice the GPU's error). Round the fp32 bits to nearest even first: the drop is
            # then exact. NaNs are left alone (rounding could carry their payload into inf).
            bits = x.to(tl.uint32, bitcast=True)
            bits += _BF16_HALF_ULP - 1 + ((bits >> _BF16_DROPPED_BITS) & 1)
            rounded = (bits & _BF16_KEPT_MASK).to(tl.float32, bitcast=True)
            x = tl.where(x != x, x, rounded)
    return x.to(dtype)


# ------------------------------------------------------------------------- what a program does
@triton.jit
def _program(pid, order, prog_tok, prog_len, n_items, seq_q, seq_k, VARLEN: tl.constexpr):
    """``(item, b, tok0, seq_q, seq_k)`` of program ``pid``: its layout item, the batch row and
    first token of its sequence, and the query and key lengths that bound it.

    Fixed length: every batch row runs through ``order``; tokens start at 0 and the lengths are
    the call's. Varlen (one packed row): the program map names the item, the document's first
    token (which offsets every pointer) and its length (which bounds queries and keys: both
    restart at the document start), three independent loads. The map's padding slots have
    length 0.
    """
    if VARLEN:
        item = tl.load(order + pid)
        tok0 = tl.load(prog_tok + pid)
        seq_q = tl.load(prog_len + pid)
        seq_k = seq_q
        b = 0
    else:
        item = tl.load(order + pid % n_items)
        b = (pid // n_items).to(tl.int64)
        tok0 = 0
    return item, b, tok0, seq_q, seq_k


@triton.jit
def _seq_offset(b, tok0, stride_b, stride_s, VARLEN: tl.constexpr):
    """Element offset of a sequence's first token: batch row ``b`` (fixed length) or token
    ``tok0`` of the packed row (varlen), in 64 bits."""
    if VARLEN:
        off = tok0.to(tl.int64) * stride_s
    else:
        off = b * stride_b
    return off


@triton.jit
def _entries_below(rows, begin, end, tile_a, tile_b, SCAN: tl.constexpr):
    """How many of ``rows[begin:end]`` (ascending query tiles) are ``< tile_a`` and
    ``< tile_b``: the lengths of the list's prefixes inside those bounds. Vector loads of
    ``SCAN`` entries, independent of each other, instead of a chain of dependent ones."""
    n_a = begin * 0
    n_b = begin * 0
    for c in range(begin, end, SCAN):
        idx = c + tl.arange(0, SCAN)
        qt = tl.load(rows + idx, mask=idx < end, other=tile_b)
        n_a += tl.sum((qt < tile_a).to(tl.int32))
        n_b += tl.sum((qt < tile_b).to(tl.int32))
    return n_a, n_b


@triton.jit
def _list_entry(entries, pos, step, end):
    """``entries[pos]`` if loop step ``step < end``, else 0: the tile-list entry of the loop's
    next step.

    Each tile loop loads the entry of step ``i + 1`` during step ``i`` and carries it. The
    K/V (or Q/dO) tile addresses then depend on a loop-carried value, and Triton's software
    pipeliner keeps ``num_stages - 1`` tiles in flight; with the entry loaded in the step that
    uses it, Triton 3.6 made the entry itself an async copy and waited for every copy at the top
    of each step (one tile in flight, the load latency exposed). tools/inspect_kernels.py shows
    the difference in the compiled loop (``async_wait`` counts, buffers per tile)."""
    return tl.load(entries + pos, mask=step < end, other=0)


@triton.jit
def _tma_rows(desc, batch, row0, head, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``[ROWS, HEAD_DIM]``: rows ``row0 ..`` of head ``head`` of batch row ``batch``, through a
    tensor descriptor over a ``[b, s, h, d]`` tensor (block ``[1, ROWS, 1, HEAD_DIM]``)."""
    return desc.load([batch, row0, head, 0]).reshape(ROWS, HEAD_DIM)


@triton.jit
def _tma_origin(b, tok0, VARLEN: tl.constexpr):
    """Descriptor coordinates ``(batch, first row)`` of a program's sequence (int32)."""
    if VARLEN:
        batch = 0
        row0 = tok0
    else:
        batch = b.to(tl.int32)
        row0 = 0
    return batch, row0


# --------------------------------------------------------------------------------------- forward
@triton.jit
def _fwd_tiles(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    cols,
    los,
    his,
    e_begin,
    e_end,
    q_abs,
    offs_n,
    offs_d,
    stride_ks,
    stride_kd,
    stride_vs,
    stride_vd,
    seq_k,
    k_start,
    qk_scale,
    k_desc,
    v_desc,
    tma_b,
    tma_row,
    kv_head,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    TMA: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    kt_next = _list_entry(cols, e_begin, e_begin, e_end)
    for e in range(e_begin, e_end):
        kt = kt_next
        kt_next = _list_entry(cols, e + 1, e + 1, e_end)
        n_idx = kt * BLOCK_N + offs_n
        if TMA:
            k_row = tma_row + kt * BLOCK_N
            k = tl.trans(_tma_rows(k_desc, tma_b, k_row, kv_head, BLOCK_N, HEAD_DIM))
        else:
            k_ptrs = k_base + n_idx[None, :].to(tl.int64) * stride_ks + offs_d[:, None] * stride_kd
            if MASKED:
                k = tl.load(k_ptrs, mask=n_idx[None, :] < seq_k, other=0.0)
            else:
                k = tl.load(k_ptrs)
        s = _mma(q, k, PRECISION, INTERPRET) * qk_scale
        if MASKED:
            lo = tl.load(los + e)
            hi = tl.load(his + e)
            ok = (
                ((k_start + n_idx)[None, :] <= q_abs[:, None])
                & (q_abs[:, None] >= lo)
                & (q_abs[:, None] < hi)
                & (n_idx[None, :] < seq_k)
            )
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing allowed yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if TMA:
            v = _tma_rows(v_desc, tma_b, k_row, kv_head, BLOCK_N, HEAD_DIM)
        else:
            v_ptrs = v_base + n_idx[:, None].to(tl.int64) * stride_vs + offs_d[None, :] * stride_vd
            if MASKED:
                v = tl.load(v_ptrs, mask=n_idx[:, None] < seq_k, other=0.0)
            else:
                v = tl.load(v_ptrs)
        acc = acc * alpha[:, None] + _mma(_cast(p, v.dtype, INTERPRET), v, PRECISION, INTERPRET)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _s2_fwd_kernel(
    Q,
    K,
    V,
    Out,
    LSE,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ob,
    stride_os,
    stride_oh,
    stride_od,
    stride_lse_b,
    stride_lse_h,
    row_ptr,
    row_split,
    cols,
    los,
    his,
    order,
    prog_tok,
    prog_len,
    num_heads,
    seq_q,
    seq_k,
    q_start,
    k_start,
    num_q_tiles,
    group,
    qk_scale,
    k_desc,
    v_desc,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    VARLEN: tl.constexpr,
    TMA: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    item, b, tok0, seq_q, seq_k = _program(
        pid, order, prog_tok, prog_len, num_heads * num_q_tiles, seq_q, seq_k, VARLEN
    )
    tma_b, tma_row = _tma_origin(b, tok0, VARLEN)
    h = item // num_q_tiles
    qt = item % num_q_tiles
    if VARLEN:
        # The map puts every tile inside its document; only padding slots (length 0) stop here.
        if qt * BLOCK_M >= seq_q:
            return
    kvh = (h // group).to(tl.int64)
    h64 = h.to(tl.int64)
    offs_m = qt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_abs = q_start + offs_m
    row_ok = offs_m < seq_q
    q = tl.load(
        Q
        + _seq_offset(b, tok0, stride_qb, stride_qs, VARLEN)
        + h64 * stride_qh
        + offs_m[:, None].to(tl.int64) * stride_qs
        + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None],
        other=0.0,
    )
    # Full entries need no key bound: their keys precede the tile's first row, which lies inside
    # the sequence (a varlen document); partial ones mask keys at seq_k.
    k_base = K + _seq_offset(b, tok0, stride_kb, stride_ks, VARLEN) + kvh * stride_kh
    v_base = V + _seq_offset(b, tok0, stride_vb, stride_vs, VARLEN) + kvh * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    e0 = tl.load(row_ptr + item)
    e1 = tl.load(row_split + item)
    e2 = tl.load(row_ptr + item + 1)
    acc, l_i, m_i = _fwd_tiles(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        cols,
        los,
        his,
        e0,
        e1,
        q_abs,
        offs_n,
        offs_d,
        stride_ks,
        stride_kd,
        stride_vs,
        stride_vd,
        seq_k,
        k_start,
        qk_scale,
        k_desc,
        v_desc,
        tma_b,
        tma_row,
        h // group,
        BLOCK_N,
        HEAD_DIM,
        False,
        TMA,
        PRECISION,
        INTERPRET,
    )
    acc, l_i, m_i = _fwd_tiles(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        cols,
        los,
        his,
        e1,
        e2,
        q_abs,
        offs_n,
        offs_d,
        stride_ks,
        stride_kd,
        stride_vs,
        stride_vd,
        seq_k,
        k_start,
        qk_scale,
        k_desc,
        v_desc,
        tma_b,
        tma_row,
        h // group,
        BLOCK_N,
        HEAD_DIM,
        True,
        TMA,
        PRECISION,
        INTERPRET,
    )
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    tl.store(
        Out
        + _seq_offset(b, tok0, stride_ob, stride_os, VARLEN)
        + h64 * stride_oh
        + offs_m[:, None].to(tl.int64) * stride_os
        + offs_d[None, :] * stride_od,
        _cast(out, Out.dtype.element_ty, INTERPRET),
        mask=row_ok[:, None],
    )
    lse_row = LSE + _seq_offset(b, tok0, stride_lse_b, 1, VARLEN) + h64 * stride_lse_h
    tl.store(lse_row + offs_m, lse, mask=row_ok)


# -------------------------------------------------------------------------------------- backward
@triton.jit
def _jump(i, jump_at, jump_by, JUMP: tl.constexpr):
    """List position of loop step ``i``: ``i``, or with JUMP ``i + jump_by`` from ``jump_at`` on."""
    if JUMP:
        i = tl.where(i < jump_at, i, i + jump_by)
    return i


@triton.jit
def _dkdv_tiles(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse_base,
    delta_base,
    rows,
    los,
    his,
    e_begin,
    e_end,
    jump_at,
    jump_by,
    k_abs,
    offs_m,
    offs_d,
    stride_qs,
    stride_qd,
    stride_dos,
    stride_dod,
    seq_q,
    q_start,
    qk_scale,
    q_desc,
    do_desc,
    tma_b,
    tma_row,
    head,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    JUMP: tl.constexpr,
    TMA: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # With JUMP, steps from jump_at on read entry i + jump_by: two ranges of the list in one
    # loop (varlen: the query tile across the document's end, then the partial entries).
    e_next = _jump(e_begin, jump_at, jump_by, JUMP)
    qt_next = _list_entry(rows, e_next, e_begin, e_end)
    for i in range(e_begin, e_end):
        e = e_next
        qt = qt_next
        e_next = _jump(i + 1, jump_at, jump_by, JUMP)
        qt_next = _list_entry(rows, e_next, i + 1, e_end)
        m_idx = qt * BLOCK_M + offs_m
        m64 = m_idx[:, None].to(tl.int64)
        if TMA:
            q_row = tma_row + qt * BLOCK_M
            q = _tma_rows(q_desc, tma_b, q_row, head, BLOCK_M, HEAD_DIM)
            do = _tma_rows(do_desc, tma_b, q_row, head, BLOCK_M, HEAD_DIM)
        if MASKED:
            row_ok = m_idx < seq_q
            if not TMA:
                q = tl.load(
                    q_base + m64 * stride_qs + offs_d[None, :] * stride_qd,
                    mask=row_ok[:, None],
                    other=0.0,
                )
                do = tl.load(
                    do_base + m64 * stride_dos + offs_d[None, :] * stride_dod,
                    mask=row_ok[:, None],
                    other=0.0,
                )
            lse = tl.load(lse_base + m_idx, mask=row_ok, other=0.0)
            delta = tl.load(delta_base + m_idx, mask=row_ok, other=0.0)
            # Rows that attend nothing (lse = -inf, only with offsets) must give p = 0, not NaN.
            lse = tl.where(lse == float("-inf"), 0.0, lse)
        else:
            if not TMA:
                q = tl.load(q_base + m64 * stride_qs + offs_d[None, :] * stride_qd)
                do = tl.load(do_base + m64 * stride_dos + offs_d[None, :] * stride_dod)
            lse = tl.load(lse_base + m_idx)
            delta = tl.load(delta_base + m_idx)
        # Transposed scores [BLOCK_N, BLOCK_M]: keys are this program's rows.
        sT = _mma(k, tl.trans(q), PRECISION, INTERPRET) * qk_scale - (lse * LOG2E)[None, :]
        if MASKED:
            q_abs = q_start + m_idx
            lo = tl.load(los + e)
            hi = tl.load(his + e)
            ok = (
                (k_abs[:, None] <= q_abs[None, :])
                & (q_abs[None, :] >= lo)
                & (q_abs[None, :] < hi)
                & (m_idx[None, :] < seq_q)
            )
            sT = tl.where(ok, sT, float("-inf"))
        pT = tl.math.exp2(sT)
        dv += _mma(_cast(pT, do.dtype, INTERPRET), do, PRECISION, INTERPRET)
        dpT = _mma(v, tl.trans(do), PRECISION, INTERPRET)
        dsT = pT * (dpT - delta[None, :])
        dk += _mma(_cast(dsT, q.dtype, INTERPRET), q, PRECISION, INTERPRET)
    return dk, dv


@triton.jit
def _s2_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dod,
    stride_dkb,
    stride_dks,
    stride_dkh,
    stride_dkd,
    stride_dvb,
    stride_dvs,
    stride_dvh,
    stride_dvd,
    stride_lse_b,
    stride_lse_h,
    col_ptr,
    col_split,
    rows,
    los,
    his,
    order,
    prog_tok,
    prog_len,
    num_heads,
    seq_q,
    seq_k,
    q_start,
    k_start,
    num_q_tiles,
    num_k_tiles,
    group,
    qk_scale,
    sm_scale,
    q_desc,
    do_desc,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    VARLEN: tl.constexpr,
    TMA: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    item, b, tok0, seq_q, seq_k = _program(
        pid, order, prog_tok, prog_len, (num_heads // group) * num_k_tiles, seq_q, seq_k, VARLEN
    )
    tma_b, tma_row = _tma_origin(b, tok0, VARLEN)
    kvh = item // num_k_tiles
    kt = item % num_k_tiles
    if VARLEN:
        # The map puts every tile inside its document; only padding slots (length 0) stop here.
        if kt * BLOCK_N >= seq_k:
            return
        # The layout may be for a longer sequence: its query-tile lists then run past the
        # document. Tiles wholly inside it may go unmasked; the one across its end needs the row
        # bound. A document that fills the layout needs neither (no lookups, as fixed length).
        q_tiles_inside = seq_q // BLOCK_M
        q_tiles_touched = tl.cdiv(seq_q, BLOCK_M)
        fills_layout = q_tiles_inside >= num_q_tiles
    kvh64 = kvh.to(tl.int64)
    offs_n = kt * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    n64 = offs_n[:, None].to(tl.int64)
    key_ok = offs_n < seq_k
    k = tl.load(
        K
        + _seq_offset(b, tok0, stride_kb, stride_ks, VARLEN)
        + kvh64 * stride_kh
        + n64 * stride_ks
        + offs_d[None, :] * stride_kd,
        mask=key_ok[:, None],
        other=0.0,
    )
    v = tl.load(
        V
        + _seq_offset(b, tok0, stride_vb, stride_vs, VARLEN)
        + kvh64 * stride_vh
        + n64 * stride_vs
        + offs_d[None, :] * stride_vd,
        mask=key_ok[:, None],
        other=0.0,
    )
    k_abs = k_start + offs_n
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for g in range(0, group):
        h = kvh * group + g
        h64 = h.to(tl.int64)
        q_base = Q + _seq_offset(b, tok0, stride_qb, stride_qs, VARLEN) + h64 * stride_qh
        do_base = DO + _seq_offset(b, tok0, stride_dob, stride_dos, VARLEN) + h64 * stride_doh
        row_off = _seq_offset(b, tok0, stride_lse_b, 1, VARLEN) + h64 * stride_lse_h
        lse_base = LSE + row_off
        delta_base = DELTA + row_off
        c = h * num_k_tiles + kt
        e0 = tl.load(col_ptr + c)
        e1 = tl.load(col_split + c)
        e2 = tl.load(col_ptr + c + 1)
        full_end = e1
        straddle_end = e1
        partial_end = e2
        if VARLEN:
            if not fills_layout:
                # Both lists ascend in query tile: the entries inside the document are prefixes.
                n_inside, n_touched = _entries_below(
                    rows, e0, e1, q_tiles_inside, q_tiles_touched, ENTRY_SCAN
                )
                n_partial, _ = _entries_below(
                    rows, e1, e2, q_tiles_touched, q_tiles_touched, ENTRY_SCAN
                )
                full_end = e0 + n_inside
                straddle_end = e0 + n_touched
                partial_end = e1 + n_partial
        dk, dv = _dkdv_tiles(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            lse_base,
            delta_base,
            rows,
            los,
            his,
            e0,
            full_end,
            0,
            0,
            k_abs,
            offs_m,
            offs_d,
            stride_qs,
            stride_qd,
            stride_dos,
            stride_dod,
            seq_q,
            q_start,
            qk_scale,
            q_desc,
            do_desc,
            tma_b,
            tma_row,
            h,
            BLOCK_M,
            HEAD_DIM,
            False,
            False,
            TMA,
            PRECISION,
            INTERPRET,
        )
        # Masked: varlen's full entries of the query tile across the document's end (masked at
        # seq_q), then the partial entries, in one loop (one loop less to hold registers for:
        # the dK/dV kernel is at the register limit).
        dk, dv = _dkdv_tiles(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            lse_base,
            delta_base,
            rows,
            los,
            his,
            full_end,
            straddle_end + partial_end - e1,
            straddle_end,
            e1 - straddle_end,
            k_abs,
            offs_m,
            offs_d,
            stride_qs,
            stride_qd,
            stride_dos,
            stride_dod,
            seq_q,
            q_start,
            qk_scale,
            q_desc,
            do_desc,
            tma_b,
            tma_row,
            h,
            BLOCK_M,
            HEAD_DIM,
            True,
            VARLEN,
            TMA,
            PRECISION,
            INTERPRET,
        )
    dk *= sm_scale
    tl.store(
        DK
        + _seq_offset(b, tok0, stride_dkb, stride_dks, VARLEN)
        + kvh64 * stride_dkh
        + n64 * stride_dks
        + offs_d[None, :] * stride_dkd,
        _cast(dk, DK.dtype.element_ty, INTERPRET),
        mask=key_ok[:, None],
    )
    tl.store(
        DV
        + _seq_offset(b, tok0, stride_dvb, stride_dvs, VARLEN)
        + kvh64 * stride_dvh
        + n64 * stride_dvs
        + offs_d[None, :] * stride_dvd,
        _cast(dv, DV.dtype.element_ty, INTERPRET),
        mask=key_ok[:, None],
    )


@triton.jit
def _dq_tiles(
    dq,
    q,
    do,
    lse2,
    delta,
    k_base,
    v_base,
    cols,
    los,
    his,
    e_begin,
    e_end,
    q_abs,
    offs_n,
    offs_d,
    stride_ks,
    stride_kd,
    stride_vs,
    stride_vd,
    seq_k,
    k_start,
    qk_scale,
    k_desc,
    v_desc,
    tma_b,
    tma_row,
    kv_head,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    TMA: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    kt_next = _list_entry(cols, e_begin, e_begin, e_end)
    for e in range(e_begin, e_end):
        kt = kt_next
        kt_next = _list_entry(cols, e + 1, e + 1, e_end)
        n_idx = kt * BLOCK_N + offs_n
        n64 = n_idx[:, None].to(tl.int64)
        if TMA:
            k_row = tma_row + kt * BLOCK_N
            k = _tma_rows(k_desc, tma_b, k_row, kv_head, BLOCK_N, HEAD_DIM)
            v = _tma_rows(v_desc, tma_b, k_row, kv_head, BLOCK_N, HEAD_DIM)
        elif MASKED:
            k = tl.load(
                k_base + n64 * stride_ks + offs_d[None, :] * stride_kd,
                mask=n_idx[:, None] < seq_k,
                other=0.0,
            )
            v = tl.load(
                v_base + n64 * stride_vs + offs_d[None, :] * stride_vd,
                mask=n_idx[:, None] < seq_k,
                other=0.0,
            )
        else:
            k = tl.load(k_base + n64 * stride_ks + offs_d[None, :] * stride_kd)
            v = tl.load(v_base + n64 * stride_vs + offs_d[None, :] * stride_vd)
        s = _mma(q, tl.trans(k), PRECISION, INTERPRET) * qk_scale - lse2[:, None]
        if MASKED:
            lo = tl.load(los + e)
            hi = tl.load(his + e)
            ok = (
                ((k_start + n_idx)[None, :] <= q_abs[:, None])
                & (q_abs[:, None] >= lo)
                & (q_abs[:, None] < hi)
                & (n_idx[None, :] < seq_k)
            )
            s = tl.where(ok, s, float("-inf"))
        p = tl.math.exp2(s)
        dp = _mma(do, tl.trans(v), PRECISION, INTERPRET)
        ds = p * (dp - delta[:, None])
        dq += _mma(_cast(ds, k.dtype, INTERPRET), k, PRECISION, INTERPRET)
    return dq


@triton.jit
def _s2_dq_kernel(
    Q,
    K,
    V,
    Out,
    DO,
    LSE,
    DLSE,
    DELTA,
    DQ,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ob,
    stride_os,
    stride_oh,
    stride_od,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dod,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    stride_dqd,
    stride_lse_b,
    stride_lse_h,
    row_ptr,
    row_split,
    cols,
    los,
    his,
    order,
    prog_tok,
    prog_len,
    num_heads,
    seq_q,
    seq_k,
    q_start,
    k_start,
    num_q_tiles,
    group,
    qk_scale,
    sm_scale,
    k_desc,
    v_desc,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    VARLEN: tl.constexpr,
    TMA: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # dQ programs own query rows, so they also produce each row's
    # delta = rowsum(dO * O) - dLSE (dLSE enters the softmax gradient as P * dLSE) and store it
    # for the dK/dV pass, which runs afterwards.
    pid = tl.program_id(0)
    item, b, tok0, seq_q, seq_k = _program(
        pid, order, prog_tok, prog_len, num_heads * num_q_tiles, seq_q, seq_k, VARLEN
    )
    tma_b, tma_row = _tma_origin(b, tok0, VARLEN)
    h = item // num_q_tiles
    qt = item % num_q_tiles
    if VARLEN:
        # The map puts every tile inside its document; only padding slots (length 0) stop here.
        if qt * BLOCK_M >= seq_q:
            return
    h64 = h.to(tl.int64)
    kvh = (h // group).to(tl.int64)
    offs_m = qt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_q
    m64 = offs_m[:, None].to(tl.int64)
    q = tl.load(
        Q
        + _seq_offset(b, tok0, stride_qb, stride_qs, VARLEN)
        + h64 * stride_qh
        + m64 * stride_qs
        + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None],
        other=0.0,
    )
    do = tl.load(
        DO
        + _seq_offset(b, tok0, stride_dob, stride_dos, VARLEN)
        + h64 * stride_doh
        + m64 * stride_dos
        + offs_d[None, :] * stride_dod,
        mask=row_ok[:, None],
        other=0.0,
    )
    row_base = _seq_offset(b, tok0, stride_lse_b, 1, VARLEN) + h64 * stride_lse_h
    lse = tl.load(LSE + row_base + offs_m, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse) * LOG2E
    o = tl.load(
        Out
        + _seq_offset(b, tok0, stride_ob, stride_os, VARLEN)
        + h64 * stride_oh
        + m64 * stride_os
        + offs_d[None, :] * stride_od,
        mask=row_ok[:, None],
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + row_base + offs_m, mask=row_ok, other=0.0)
    tl.store(DELTA + row_base + offs_m, delta, mask=row_ok)
    k_base = K + _seq_offset(b, tok0, stride_kb, stride_ks, VARLEN) + kvh * stride_kh
    v_base = V + _seq_offset(b, tok0, stride_vb, stride_vs, VARLEN) + kvh * stride_vh
    q_abs = q_start + offs_m
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    e0 = tl.load(row_ptr + item)
    e1 = tl.load(row_split + item)
    e2 = tl.load(row_ptr + item + 1)
    dq = _dq_tiles(
        dq,
        q,
        do,
        lse2,
        delta,
        k_base,
        v_base,
        cols,
        los,
        his,
        e0,
        e1,
        q_abs,
        offs_n,
        offs_d,
        stride_ks,
        stride_kd,
        stride_vs,
        stride_vd,
        seq_k,
        k_start,
        qk_scale,
        k_desc,
        v_desc,
        tma_b,
        tma_row,
        h // group,
        BLOCK_N,
        HEAD_DIM,
        False,
        TMA,
        PRECISION,
        INTERPRET,
    )
    dq = _dq_tiles(
        dq,
        q,
        do,
        lse2,
        delta,
        k_base,
        v_base,
        cols,
        los,
        his,
        e1,
        e2,
        q_abs,
        offs_n,
        offs_d,
        stride_ks,
        stride_kd,
        stride_vs,
        stride_vd,
        seq_k,
        k_start,
        qk_scale,
        k_desc,
        v_desc,
        tma_b,
        tma_row,
        h // group,
        BLOCK_N,
        HEAD_DIM,
        True,
        TMA,
        PRECISION,
        INTERPRET,
    )
    dq *= sm_scale
    tl.store(
        DQ
        + _seq_offset(b, tok0, stride_dqb, stride_dqs, VARLEN)
        + h64 * stride_dqh
        + m64 * stride_dqs
        + offs_d[None, :] * stride_dqd,
        _cast(dq, DQ.dtype.element_ty, INTERPRET),
        mask=row_ok[:, None],
    )


# ------------------------------------------------------------------------------------- launching
# The kernels run under Triton's interpreter iff triton.jit saw TRITON_INTERPRET at import time;
# checking the kernel object (not the environment now) keeps the flag true to what runs.
_INTERPRETED = not isinstance(_s2_fwd_kernel, triton.runtime.JITFunction)

# Key tiles: one pattern block, or 64-key slices of a larger one (never two blocks).
MAX_BLOCK_N = 64
# Merge-Q: query tiles span several small pattern blocks, up to this many tokens.
MAX_BLOCK_M = 128


def _is_pow2(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class PassConfig:
    """Launch shape of one kernel pass: query tile rows ``block_m`` (a power of two >= 16),
    ``num_warps`` (a power of two) and software-pipeline ``num_stages`` (>= 1)."""

    block_m: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        if not _is_pow2(self.block_m) or self.block_m < MIN_TILE:
            raise ValueError(
                f"PassConfig.block_m must be a power of two >= {MIN_TILE}, got {self.block_m!r}"
            )
        if not _is_pow2(self.num_warps):
            raise ValueError(f"PassConfig.num_warps must be a power of two, got {self.num_warps!r}")
        if (
            isinstance(self.num_stages, bool)
            or not isinstance(self.num_stages, int)
            or self.num_stages < 1
        ):
            raise ValueError(
                f"PassConfig.num_stages must be an integer >= 1, got {self.num_stages!r}"
            )


@dataclass(frozen=True)
class KernelConfig:
    """Tile shapes and launch options of the three kernels of one attention call.

    ``block_n``: key tile of every pass (a power of two >= 16 that divides the pattern's block
    size, so a key tile never spans two pattern blocks). ``fwd``, ``dq``, ``dkdv``: the
    :class:`PassConfig` of the forward, dQ and dK/dV kernels; their ``block_m`` may merge
    several pattern blocks (Merge-Q). ``tma``: read the walked tiles through TMA tensor
    descriptors (Hopper; bf16/fp16 tensors whose alignment allows it, else the pointer loads
    run). ``gluon_fwd``: run the forward through the warp-specialized Gluon kernel
    (``gluon_forward.py``: sm_90) on the calls it takes, the ``tl`` forward (``fwd``) on the
    others. ``gluon_dkdv``: the same for the dK/dV pass (``gluon_dkdv.py``: sm_90; on wherever
    ``gluon_fwd`` is on by default and the block is 64 or 128, on 64-key tiles). ``gluon_dq``:
    the same for the dQ pass (``gluon_dq.py``; on where ``gluon_dkdv`` is). At blocks 16 and 32
    the three Gluon kernels run on gathered 64-key tiles (``gathered_keys.py``: self-attention
    and context-parallel chunks, lengths multiples of 128), on by default like the block-64
    ones. Derive
    variants with ``dataclasses.replace``, e.g. ``replace(cfg, dq=PassConfig(64, 4, 3))`` or
    ``replace(cfg, gluon_fwd=False)``.
    """

    block_n: int
    fwd: PassConfig
    dq: PassConfig
    dkdv: PassConfig
    tma: bool = False
    gluon_fwd: bool = False
    gluon_dkdv: bool = False
    gluon_dq: bool = False

    def __post_init__(self):
        for name in ("tma", "gluon_fwd", "gluon_dkdv", "gluon_dq"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"KernelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if not _is_pow2(self.block_n) or self.block_n < MIN_TILE:
            raise ValueError(
                f"KernelConfig.block_n must be a power of two >= {MIN_TILE}, got {self.block_n!r}"
            )
        for name in ("fwd", "dq", "dkdv"):
            if not isinstance(getattr(self, name), PassConfig):
                raise TypeError(
                    f"KernelConfig.{name} must be a PassConfig, "
                    f"got {type(getattr(self, name)).__name__}"
                )


# GPU defaults, measured on H100 (tools/tune_kernels.py, d=128, block 64; docs/benchmarks.md).
GPU_FWD = PassConfig(block_m=64, num_warps=4, num_stages=3)
GPU_DQ = PassConfig(block_m=128, num_warps=8, num_stages=3)
GPU_DKDV = PassConfig(block_m=32, num_warps=4, num_stages=3)
# 16-bit inputs at d=128 (measured 2026-11-23): TMA tile loads with a 128-row forward tile on 8
# warps are 6-11% faster in the forward and 7% in dQ than pointer loads with GPU_FWD. With the
# 64-row forward tile TMA is slower, so the two go together, and only where they were measured
# (fp32 tiles take no TMA, and a 128-row fp32 forward tile would not fit shared memory).
GPU_FWD_TMA = PassConfig(block_m=128, num_warps=8, num_stages=3)
TMA_HEAD_DIMS = (128,)
# Off d=128 (not re-tuned): narrower heads run dQ on 4 warps, wider ones (256) pipeline both
# backward passes 2 deep.
WIDE_HEAD_DIM = 128
GPU_DQ_NARROW_WARPS = 4
GPU_BWD_WIDE_STAGES = 2
# fp32 inputs (tests, exact checks) take twice the shared memory per tile: at d >= 128 the dQ
# pass's 128-row tile, 3 stages deep, would need 288 KB (Hopper has 227 KB per block), so it
# runs 64-row tiles (208 KB). bf16/fp16 are unaffected (tests/test_shared_memory.py compiles
# every default for sm_90 and checks the budget).
FP32_DQ_BLOCK_M = 64
# Interpreter: query tiles of two pattern blocks still exercise Merge-Q while keeping the CPU
# tests fast; dK/dV takes the GPU's query tile; there is no pipeline to stage.
INTERPRETER_MERGED_BLOCKS = 2
INTERPRETER_WARPS = 4
INTERPRETER_STAGES = 1


# Pattern blocks whose Gluon-forward calls the Gluon backward passes take too: on 64-key tiles
# (a block of 64, half a block of 128), and blocks 16 and 32 on gathered key tiles.
GLUON_BWD_BLOCKS = (gluon_dkdv.BLOCK_N, 2 * gluon_dkdv.BLOCK_N) + gathered_keys.BLOCK_SIZES


def kernel_config(pattern: S2Pattern, head_dim: int, device, dtype=None) -> KernelConfig:
    """The default :class:`KernelConfig` for ``pattern`` at ``head_dim`` on ``device`` (a
    ``torch.device`` or its name): CUDA gets the tuned GPU shapes, anything else the
    interpreter's. ``dtype`` (the inputs' torch dtype; None: a 16-bit one) shrinks tiles that
    would not fit the GPU's shared memory in fp32."""
    block_n = min(pattern.block_size, MAX_BLOCK_N)
    if torch.device(device).type != "cuda":
        merged = PassConfig(
            min(MAX_BLOCK_M, INTERPRETER_MERGED_BLOCKS * pattern.block_size),
            INTERPRETER_WARPS,
            INTERPRETER_STAGES,
        )
        return KernelConfig(
            block_n,
            fwd=merged,
            dq=merged,
            dkdv=dataclasses.replace(merged, block_m=GPU_DKDV.block_m),
        )
    dq, dkdv = GPU_DQ, GPU_DKDV
    if head_dim < WIDE_HEAD_DIM:
        dq = dataclasses.replace(dq, num_warps=GPU_DQ_NARROW_WARPS)
    if head_dim > WIDE_HEAD_DIM:
        dq = dataclasses.replace(dq, num_stages=GPU_BWD_WIDE_STAGES)
        dkdv = dataclasses.replace(dkdv, num_stages=GPU_BWD_WIDE_STAGES)
    if dtype == torch.float32 and head_dim >= WIDE_HEAD_DIM:
        dq = dataclasses.replace(dq, block_m=FP32_DQ_BLOCK_M)
    gluon = gluon_forward.enabled_by_default(head_dim, pattern.block_size, device, dtype)
    gluon_bwd = gluon and pattern.block_size in GLUON_BWD_BLOCKS
    if head_dim in TMA_HEAD_DIMS and (dtype is None or dtype in TMA_DTYPES):
        fwd, tma = GPU_FWD_TMA, True
    else:
        fwd, tma = GPU_FWD, False
    return KernelConfig(
        block_n, fwd, dq, dkdv, tma=tma, gluon_fwd=gluon, gluon_dkdv=gluon_bwd, gluon_dq=gluon_bwd
    )


# Hopper's TMA: the global address and every stride but the innermost (which must be 1) are
# multiples of 16 bytes, and a tile row is at least 16 bytes.
TMA_ALIGN_BYTES = 16
# TMA tiles for the 16-bit training dtypes only: fp32 tiles (tests, exact checks) staged for TMA
# would exceed Hopper's shared memory in the dQ pass at head_dim 128 (262 KB, measured with
# tools/inspect_kernels.py), and fp32 runs are not where speed matters.
TMA_DTYPES = (torch.bfloat16, torch.float16)


def tma_compatible(t: torch.Tensor) -> bool:
    """Whether ``[b, s, h, d]`` tensor ``t`` can be read through a TMA tensor descriptor."""
    size = t.element_size()
    return (
        t.dtype in TMA_DTYPES
        and t.stride(-1) == 1
        and t.data_ptr() % TMA_ALIGN_BYTES == 0
        and t.shape[-1] * size >= TMA_ALIGN_BYTES
        and all(st * size % TMA_ALIGN_BYTES == 0 for st in t.stride()[:-1])
    )


def _tile_descriptors(enabled: bool, tensors, rows: int) -> tuple:
    """Tensor descriptors of ``[b, s, h, d]`` ``tensors`` with ``[1, rows, 1, d]`` tiles when
    ``enabled`` and every tensor allows one (else Nones: the kernels take the pointer path)."""
    if not (enabled and TensorDescriptor is not None and all(tma_compatible(t) for t in tensors)):
        return (None,) * len(tensors)
    return tuple(
        TensorDescriptor(t, list(t.shape), list(t.stride()), [1, rows, 1, t.shape[-1]])
        for t in tensors
    )


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2), t.stride(3)


def _precision(dtype):
    # fp32 inputs (tests, interpreter) get exact fp32 dots; bf16/fp16 ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


# ----------------------------------------------------------------------- varlen program maps
# Documents, and layout items of one head, handled per vector step of the map kernels.
MAP_CHUNK = tl.constexpr(1024)
# Packs of fewer documents (at most MAP_CHUNK) build their map in one launch.
MAP_FUSED_DOCS = 1024


@triton.jit
def _varlen_doc_starts(cu_seqlens, starts, num_docs, tile, num_tiles, CHUNK: tl.constexpr):
    """``starts[d]``: tiles of the documents before ``d`` (``starts[num_docs]``: all of them),
    each document's ``ceil(length / tile)`` clamped to the layout's ``num_tiles``. One program,
    a running sum over chunks of documents."""
    carry = tl.program_id(0) * 0
    for c in range(0, num_docs, CHUNK):
        d = c + tl.arange(0, CHUNK)
        ok = d < num_docs
        lo = tl.load(cu_seqlens + d, mask=ok, other=0)
        hi = tl.load(cu_seqlens + d + 1, mask=ok, other=0)
        n = tl.minimum((tl.maximum(hi - lo, 0) + tile - 1) // tile, num_tiles)
        tl.store(starts + d, carry + tl.cumsum(n, 0) - n, mask=ok)
        carry += tl.sum(n, 0)
    tl.store(starts + num_docs, carry)


@triton.jit
def _varlen_map_kernel(
    cu_seqlens,
    starts,
    order,
    prog_item,
    prog_tok,
    prog_len,
    num_docs,
    num_heads,
    num_tiles,
    tile,
    grid,
    CHUNK: tl.constexpr,
    FUSED: tl.constexpr,
):
    """Program ``(d, h)`` writes the map's slots of document ``d``, head ``h``: the layout's
    order of head ``h`` (``order[h * num_tiles:][:num_tiles]``, heaviest first) restricted to the
    document's tiles, at ``num_heads * starts[d] + h * tiles(d)``. Program ``(num_docs, h)``
    fills a share of the padding slots after the last document with empty programs. ``FUSED``
    (fewer than ``CHUNK`` documents): every program sums the tiles before its document itself
    (one vector load of ``cu_seqlens``) and ``starts`` is unused: one launch instead of two."""
    d = tl.program_id(0)
    h = tl.program_id(1)
    if FUSED:
        i = tl.arange(0, CHUNK)
        ok = i < num_docs
        lo = tl.load(cu_seqlens + i, mask=ok, other=0)
        hi = tl.load(cu_seqlens + i + 1, mask=ok, other=0)
        n_all = tl.minimum((tl.maximum(hi - lo, 0) + tile - 1) // tile, num_tiles)
        total = tl.sum(n_all, 0)
        before = tl.sum(tl.where(i < d, n_all, 0), 0)
    else:
        total = tl.load(starts + num_docs)
        before = tl.load(starts + tl.minimum(d, num_docs))
    if d == num_docs:
        first = num_heads * total + h * CHUNK
        for c in range(first, grid, num_heads * CHUNK):
            i = c + tl.arange(0, CHUNK)
            ok = i < grid
            zero = i * 0
            tl.store(prog_item + i, zero, mask=ok)
            tl.store(prog_tok + i, zero, mask=ok)
            tl.store(prog_len + i, zero, mask=ok)
    else:
        tok0 = tl.load(cu_seqlens + d)
        length = tl.maximum(tl.load(cu_seqlens + d + 1) - tok0, 0)
        n = tl.minimum((length + tile - 1) // tile, num_tiles)
        base = num_heads * before + h * n
        head0 = h * num_tiles
        placed = n * 0
        for c in range(0, num_tiles, CHUNK):
            j = c + tl.arange(0, CHUNK)
            item = tl.load(order + head0 + j, mask=j < num_tiles, other=0)
            keep = (j < num_tiles) & (item - head0 < n)
            k32 = keep.to(tl.int32)
            slot = base + placed + tl.cumsum(k32, 0) - k32
            # Only lengths over max_seqlen (unchecked, invalid) could run past the grid.
            keep = keep & (slot < grid)
            tl.store(prog_item + slot, item, mask=keep)
            tl.store(prog_tok + slot, slot * 0 + tok0, mask=keep)
            tl.store(prog_len + slot, slot * 0 + length, mask=keep)
            placed += tl.sum(k32, 0)


def varlen_program_map(
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    total_tokens: int,
    tile: int,
    num_heads: int,
    num_tiles: int,
    order: torch.Tensor,
    work: torch.Tensor,
):
    """Program map of a launch over packed documents: ``(grid, prog_item, prog_tok, prog_len)``,
    int32 on ``cu_seqlens``' device.

    Program ``p`` does layout item ``prog_item[p]`` of the document that starts at token
    ``prog_tok[p]`` and has ``prog_len[p]`` tokens; padding slots have length 0. The order is
    :func:`s2attn.layout.varlen_programs`' (document by document, head by head, heaviest first
    inside a head: a fixed-length batch's order for equal documents). ``order``, ``work``: the
    layout's heaviest-first order of the pass's items (head-major) and their work.

    Built from ``cu_seqlens`` without reading it back, in one small Triton launch (two from
    ``MAP_FUSED_DOCS`` documents on) on CUDA and under the interpreter. The torch ops it replaces
    (120+ launches per map, 0.4-1.7 ms on an H100) remain the reference and serve CPU tensors
    with compiled kernels (compile-only checks).
    """
    grid = varlen_grid(cu_seqlens.numel() - 1, max_seqlen, total_tokens, tile, num_heads, num_tiles)
    device = cu_seqlens.device
    if grid == 0:
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        return 0, empty, empty, empty
    if device.type != "cuda" and not _INTERPRETED:
        _, doc, item = varlen_programs(
            cu_seqlens, max_seqlen, total_tokens, tile, num_heads, num_tiles, work
        )
        cu_ext = torch.cat([cu_seqlens, cu_seqlens[-1:]]).to(torch.int32)
        tok = torch.where(doc < cu_seqlens.numel() - 1, cu_ext[doc], 0).to(torch.int32)
        return grid, item, tok, (cu_ext[doc + 1] - cu_ext[doc]).to(torch.int32)
    num_docs = cu_seqlens.numel() - 1
    prog = torch.empty(3, grid, dtype=torch.int32, device=device)
    fused = num_docs < min(MAP_FUSED_DOCS, MAP_CHUNK.value)
    starts = prog  # unused when fused
    if not fused:
        starts = torch.empty(num_docs + 1, dtype=torch.int32, device=device)
        _varlen_doc_starts[(1,)](cu_seqlens, starts, num_docs, tile, num_tiles, CHUNK=MAP_CHUNK)
    _varlen_map_kernel[(num_docs + 1, num_heads)](
        cu_seqlens,
        starts,
        order,
        prog[0],
        prog[1],
        prog[2],
        num_docs,
        num_heads,
        num_tiles,
        tile,
        grid,
        CHUNK=MAP_CHUNK,
        FUSED=fused,
    )
    return grid, prog[0], prog[1], prog[2]


@dataclass(eq=False)
class Varlen:
    """Packed documents of a varlen call (FlashAttention's varlen convention).

    ``cu_seqlens``: int32 ``[num_docs + 1]`` on the kernels' device, document ``i`` holding tokens
    ``cu_seqlens[i] .. cu_seqlens[i + 1]`` of the packed ``[1, total_tokens, heads, dim]``
    tensors; ``max_seqlen``: a host int ``>=`` every document's length (no device read needed).
    Caches the program maps of its launches, so a forward and backward with equal tiles share
    them.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    total_tokens: int

    def __post_init__(self):
        self._maps = {}

    def layout(self, pattern: S2Pattern, block_m: int, block_n: int, device, with_csc=False):
        n = varlen_layout_len(pattern, self.max_seqlen, max(block_m, block_n))
        return layout_for(pattern, n, n, 0, 0, block_m, block_n, device, with_csc)

    def programs(self, lay, kv: bool):
        """``(grid, prog_item, prog_tok, prog_len)`` of a pass over query tiles or (``kv``) key
        tiles."""
        key = (id(lay), kv)
        if key not in self._maps:
            if kv:
                heads, tile, tiles = lay.num_heads // lay.group, lay.block_n, lay.num_k_tiles
                order, work = lay.kv_order, lay.kv_work
            else:
                heads, tile, tiles = lay.num_heads, lay.block_m, lay.num_q_tiles
                order, work = lay.q_order, lay.q_work
            self._maps[key] = varlen_program_map(
                self.cu_seqlens, self.max_seqlen, self.total_tokens, tile, heads, tiles, order, work
            )
        return self._maps[key]


def _pass_layout(pattern, sq, sk, q_start, k_start, block_m, block_n, device, varlen, csc=False):
    """The tile layout of one pass: for the call's lengths, or one that serves every document."""
    if varlen is None:
        return layout_for(pattern, sq, sk, q_start, k_start, block_m, block_n, device, csc)
    return varlen.layout(pattern, block_m, block_n, device, csc)


def _gluon_rows_layout(pattern, sq, sk, q_start, tile, block_n, device, varlen):
    """The row-list layout of a Gluon forward or dQ call at ``tile`` query rows; where a user
    mask merges into 128-row tiles but not into the 192-row ones of head_dim 64, at 128 rows
    (two consumer warpgroups), as before the wider tiles."""
    lay = _pass_layout(pattern, sq, sk, q_start, 0, tile, block_n, device, varlen)
    if lay.block_m != tile and tile != gluon_forward.TILE_M:
        lay = _pass_layout(
            pattern, sq, sk, q_start, 0, gluon_forward.TILE_M, block_n, device, varlen
        )
    return lay


def _programs(lay, batch: int, varlen: Optional[Varlen], kv: bool):
    """``(grid, order, prog_tok, prog_len)`` kernel arguments of one pass (the last two are
    unused placeholders for fixed-length calls)."""
    order = lay.kv_order if kv else lay.q_order
    if varlen is None:
        return order.numel() * batch, order, order, order
    return varlen.programs(lay, kv)


def s2_forward(
    q,
    k,
    v,
    pattern: S2Pattern,
    scale: float,
    q_start: int,
    k_start: int,
    config: Optional[KernelConfig] = None,
    varlen: Optional[Varlen] = None,
):
    """Forward pass. q ``[b, sq, h, d]``, k/v ``[b, sk, h_kv, d]`` (any strides); ``config``
    defaults to :func:`kernel_config`. Returns ``out`` (q's shape and layout) and ``lse
    [b, h, sq]`` fp32. With ``varlen`` the tensors are one packed row (``b = 1``) of documents
    and ``q_start = k_start = 0``."""
    cfg = config if config is not None else kernel_config(pattern, q.shape[-1], q.device, q.dtype)
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    if cfg.gluon_fwd and not gluon_forward.unsupported_reason(
        q, k, v, pattern, q_start, k_start, varlen
    ):
        if pattern.block_size in gathered_keys.BLOCK_SIZES:
            keys = gathered_keys.gathered_keys(pattern, sk, q.device)
            return gluon_forward.s2_forward_gluon(
                q, k, v, pattern, scale, q_start=q_start, keys=keys
            )
        tile = gluon_forward.forward_tile_m(pattern.block_size, d, q_start, varlen)
        bn = gluon_forward.key_tile(pattern.block_size, d)
        lay = _gluon_rows_layout(pattern, sq, sk, q_start, tile, bn, q.device, varlen)
        # A user mask that cannot merge blocks into a 128-row tile falls back to smaller
        # tiles, which the Gluon kernel does not take.
        if lay.block_m in (tile, gluon_forward.TILE_M):
            return gluon_forward.s2_forward_gluon(
                q, k, v, pattern, scale, lay, q_start, varlen=varlen
            )
    lay = _pass_layout(
        pattern, sq, sk, q_start, k_start, cfg.fwd.block_m, cfg.block_n, q.device, varlen
    )
    out = torch.empty_like(q)
    lse = torch.empty((b, hq, sq), device=q.device, dtype=torch.float32)
    grid, order, prog_tok, prog_len = _programs(lay, b, varlen, kv=False)
    if grid == 0:
        return out, lse
    tiles = _tile_descriptors(cfg.tma, (k, v), lay.block_n)
    _s2_fwd_kernel[(grid,)](
        q,
        k,
        v,
        out,
        lse,
        *_strides(q),
        *_strides(k),
        *_strides(v),
        *_strides(out),
        lse.stride(0),
        lse.stride(1),
        lay.row_ptr,
        lay.row_split,
        lay.cols,
        lay.lo,
        lay.hi,
        order,
        prog_tok,
        prog_len,
        hq,
        sq,
        sk,
        q_start,
        k_start,
        lay.num_q_tiles,
        lay.group,
        scale * LOG2E.value,
        *tiles,
        BLOCK_M=lay.block_m,
        BLOCK_N=lay.block_n,
        HEAD_DIM=d,
        PRECISION=_precision(q.dtype),
        VARLEN=varlen is not None,
        TMA=tiles[0] is not None,
        INTERPRET=_INTERPRETED,
        num_warps=cfg.fwd.num_warps,
        num_stages=cfg.fwd.num_stages,
    )
    return out, lse


def bwd_dkdv(
    do,
    q,
    k,
    v,
    lse,
    delta,
    pattern: S2Pattern,
    scale: float,
    q_start: int,
    k_start: int,
    config: KernelConfig,
    varlen: Optional[Varlen] = None,
):
    """dK/dV pass: do like q, lse and delta ``[b, h, sq]`` fp32 (``delta`` from
    :func:`bwd_dq`). Returns ``dk, dv`` in the layouts of k, v."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    lay = _pass_layout(
        pattern,
        sq,
        sk,
        q_start,
        k_start,
        config.dkdv.block_m,
        config.block_n,
        q.device,
        varlen,
        csc=True,
    )
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    grid, order, prog_tok, prog_len = _programs(lay, b, varlen, kv=True)
    if grid == 0:
        return dk, dv
    tiles = _tile_descriptors(config.tma, (q, do), lay.block_m)
    _s2_dkdv_kernel[(grid,)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        *_strides(q),
        *_strides(k),
        *_strides(v),
        *_strides(do),
        *_strides(dk),
        *_strides(dv),
        lse.stride(0),
        lse.stride(1),
        lay.col_ptr,
        lay.col_split,
        lay.rows,
        lay.lo_c,
        lay.hi_c,
        order,
        prog_tok,
        prog_len,
        hq,
        sq,
        sk,
        q_start,
        k_start,
        lay.num_q_tiles,
        lay.num_k_tiles,
        lay.group,
        scale * LOG2E.value,
        scale,
        *tiles,
        BLOCK_M=lay.block_m,
        BLOCK_N=lay.block_n,
        HEAD_DIM=d,
        PRECISION=_precision(q.dtype),
        VARLEN=varlen is not None,
        TMA=tiles[0] is not None,
        INTERPRET=_INTERPRETED,
        num_warps=config.dkdv.num_warps,
        num_stages=config.dkdv.num_stages,
    )
    return dk, dv


def bwd_dq(
    do,
    dlse,
    q,
    k,
    v,
    out,
    lse,
    pattern: S2Pattern,
    scale: float,
    q_start: int,
    k_start: int,
    config: KernelConfig,
    varlen: Optional[Varlen] = None,
):
    """dQ pass: do like q, dlse ``[b, h, sq]`` fp32 contiguous or None. Returns ``dq`` (q's
    layout) and ``delta [b, h, sq]`` fp32 for :func:`bwd_dkdv`."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    lay = _pass_layout(
        pattern, sq, sk, q_start, k_start, config.dq.block_m, config.block_n, q.device, varlen
    )
    dq = torch.empty_like(q)
    delta = torch.empty_like(lse)
    grid, order, prog_tok, prog_len = _programs(lay, b, varlen, kv=False)
    if grid == 0:
        return dq, delta
    tiles = _tile_descriptors(config.tma, (k, v), lay.block_n)
    _s2_dq_kernel[(grid,)](
        q,
        k,
        v,
        out,
        do,
        lse,
        dlse if dlse is not None else lse,
        delta,
        dq,
        *_strides(q),
        *_strides(k),
        *_strides(v),
        *_strides(out),
        *_strides(do),
        *_strides(dq),
        lse.stride(0),
        lse.stride(1),
        lay.row_ptr,
        lay.row_split,
        lay.cols,
        lay.lo,
        lay.hi,
        order,
        prog_tok,
        prog_len,
        hq,
        sq,
        sk,
        q_start,
        k_start,
        lay.num_q_tiles,
        lay.group,
        scale * LOG2E.value,
        scale,
        *tiles,
        BLOCK_M=lay.block_m,
        BLOCK_N=lay.block_n,
        HEAD_DIM=d,
        PRECISION=_precision(q.dtype),
        HAS_DLSE=dlse is not None,
        VARLEN=varlen is not None,
        TMA=tiles[0] is not None,
        INTERPRET=_INTERPRETED,
        num_warps=config.dq.num_warps,
        num_stages=config.dq.num_stages,
    )
    return dq, delta


def s2_backward(
    do,
    dlse,
    q,
    k,
    v,
    out,
    lse,
    pattern: S2Pattern,
    scale: float,
    q_start: int,
    k_start: int,
    config: Optional[KernelConfig] = None,
    varlen: Optional[Varlen] = None,
):
    """Backward of :func:`s2_forward` for upstream ``do`` (like q) and ``dlse`` (``[b, h, sq]``
    or None). Returns ``dq, dk, dv`` in the layouts of q, k, v (dK/dV contiguous under GQA at
    blocks 16 and 32: summed from per-head parts)."""
    cfg = config if config is not None else kernel_config(pattern, q.shape[-1], q.device, q.dtype)
    args = (pattern, scale, q_start, k_start, cfg, varlen)
    # The Gluon passes take the calls that the Gluon forward would take (self-attention,
    # context-parallel chunks: keys from 0, queries their last positions from q_start, and
    # packed documents at blocks 64 and 128), at the blocks of GLUON_BWD_BLOCKS.
    gathered = pattern.block_size in gathered_keys.BLOCK_SIZES
    gluon_takes = pattern.block_size in GLUON_BWD_BLOCKS and not gluon_forward.unsupported_reason(
        q, k, v, pattern, q_start, k_start, varlen
    )
    dq_ok = cfg.gluon_dq and gluon_takes
    dkdv_ok = cfg.gluon_dkdv and gluon_takes
    sq, sk, bn = q.shape[1], k.shape[1], gluon_dkdv.BLOCK_N
    if gathered and (dq_ok or dkdv_ok):
        return _gathered_backward(do, dlse, q, k, v, out, lse, cfg, args)
    dq = None
    if dq_ok:
        tile = gluon_dq.tile_m(pattern.block_size, q.shape[-1], q_start, varlen)
        lay = _gluon_rows_layout(pattern, sq, sk, q_start, tile, bn, q.device, varlen)
        if lay.block_m in (tile, gluon_dq.TILE_M):  # not a user mask that forced smaller tiles
            dq, delta = gluon_dq.s2_dq_gluon(
                do, dlse, q, k, v, out, lse, pattern, scale, lay, q_start, varlen=varlen
            )
    if dq is None:
        dq, delta = bwd_dq(do, dlse, q, k, v, out, lse, *args)
    if dkdv_ok:
        tile = gluon_dkdv.TILE_M
        lay = _pass_layout(pattern, sq, sk, q_start, 0, tile, bn, q.device, varlen, csc=True)
        if lay.block_m == gluon_dkdv.TILE_M:
            dk, dv = gluon_dkdv.s2_dkdv_gluon(
                do, q, k, v, lse, delta, pattern, scale, lay, q_start, varlen=varlen
            )
            return dq, dk, dv
    dk, dv = bwd_dkdv(do, q, k, v, lse, delta, *args)
    return dq, dk, dv


def _gathered_backward(do, dlse, q, k, v, out, lse, cfg: KernelConfig, args):
    """:func:`s2_backward` at blocks 16/32 with the Gluon passes on gathered key tiles (the
    ``tl`` pass for whichever of dQ and dK/dV the config leaves off)."""
    pattern, scale, q_start = args[:3]
    keys = gathered_keys.gathered_keys(pattern, k.shape[1], q.device)
    if cfg.gluon_dq:
        dq, delta = gluon_dq.s2_dq_gluon(
            do, dlse, q, k, v, out, lse, pattern, scale, q_start=q_start, keys=keys
        )
    else:
        dq, delta = bwd_dq(do, dlse, q, k, v, out, lse, *args)
    if not cfg.gluon_dkdv:
        return (dq, *bwd_dkdv(do, q, k, v, lse, delta, *args))
    dk, dv = gluon_dkdv.s2_dkdv_gluon(
        do, q, k, v, lse, delta, pattern, scale, q_start=q_start, keys=keys
    )
    group = pattern.group_size
    dk = gathered_keys.sum_groups(dk, group, k.dtype)
    return dq, dk, gathered_keys.sum_groups(dv, group, v.dtype)


class S2AttentionFunction(torch.autograd.Function):
    """autograd wrapper: ``(q, k, v, pattern, scale, q_start, k_start, config=None, varlen=None)
    -> (out, lse)``; ``config`` (a :class:`KernelConfig`, default :func:`kernel_config`) serves
    both the forward and the backward; ``varlen`` (a :class:`Varlen`) makes q, k, v one packed
    row of documents."""

    @staticmethod
    def forward(ctx, q, k, v, pattern, scale, q_start, k_start, config=None, varlen=None):
        if config is None:
            config = kernel_config(pattern, q.shape[-1], q.device, q.dtype)
        out, lse = s2_forward(q, k, v, pattern, scale, q_start, k_start, config, varlen)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (pattern, scale, q_start, k_start, config, varlen)
        # Unused outputs (lse when the caller did not ask for it) arrive as None, not zeros.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = s2_backward(
            dout, dlse.contiguous() if dlse is not None else None, q, k, v, out, lse, *ctx.args
        )
        return dq, dk, dv, None, None, None, None, None, None
