"""The ``tl`` (``triton.language``) kernels of S2 attention and their launch wrappers.

:func:`s2_forward_tl`, :func:`s2_dq_tl` and :func:`s2_dkdv_tl` launch the forward, dQ and dK/dV
kernels defined below them; :mod:`s2attn.dispatch` decides when they run rather than the Gluon
kernels (``gluon_forward.py``, ``gluon_dq.py``, ``gluon_dkdv.py``), and holds the autograd
Function. The kernels run on any CUDA GPU, and on the CPU under ``TRITON_INTERPRET=1``.

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

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton before host-side tensor descriptors: tma=True takes pointer loads
    TensorDescriptor = None

from .config import TMA_DTYPES, KernelConfig, PassConfig
from .layout import layout_for, varlen_grid, varlen_layout_len, varlen_programs
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
# Hopper's TMA: the global address and every stride but the innermost (which must be 1) are
# multiples of 16 bytes, and a tile row is at least 16 bytes.
TMA_ALIGN_BYTES = 16


# ------------------------------------------------------------------------------------- launching
def s2_forward_tl(
    q,
    k,
    v,
    pattern: S2Pattern,
    scale: float,
    q_start: int,
    k_start: int,
    config: KernelConfig,
    varlen: Optional[Varlen] = None,
):
    """Forward pass through :func:`_s2_fwd_kernel` at ``config.fwd``'s tiles. q ``[b, sq, h,
    d]``, k/v ``[b, sk, h_kv, d]`` (any strides). Returns ``out`` (q's shape and layout) and
    ``lse [b, h, sq]`` fp32 (natural log). With ``varlen`` the tensors are one packed row
    (``b = 1``) of documents and ``q_start = k_start = 0``."""
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    fwd = config.fwd
    lay = pass_layout(
        pattern, sq, sk, q_start, k_start, fwd.block_m, config.block_n, q.device, varlen
    )
    out = torch.empty_like(q)
    lse = torch.empty((b, hq, sq), device=q.device, dtype=torch.float32)
    _launch(
        _s2_fwd_kernel,
        (q, k, v, out, lse),
        lay,
        varlen,
        starts=(q_start, k_start),
        tail=(lay.group, scale * LOG2E.value),
        walked=(k, v),
        tma=config.tma,
        shape=fwd,
    )
    return out, lse


def s2_dq_tl(
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
    """dQ pass through :func:`_s2_dq_kernel` at ``config.dq``'s tiles: do like q, dlse ``[b, h,
    sq]`` fp32 contiguous or None. Returns ``dq`` (q's layout) and ``delta [b, h, sq]`` fp32
    (``rowsum(dO * O) - dLSE``) for the dK/dV pass."""
    sq, sk = q.shape[1], k.shape[1]
    lay = pass_layout(
        pattern, sq, sk, q_start, k_start, config.dq.block_m, config.block_n, q.device, varlen
    )
    dq = torch.empty_like(q)
    delta = torch.empty_like(lse)
    _launch(
        _s2_dq_kernel,
        (q, k, v, out, do, lse, dlse if dlse is not None else lse, delta, dq),
        lay,
        varlen,
        starts=(q_start, k_start),
        tail=(lay.group, scale * LOG2E.value, scale),
        walked=(k, v),
        tma=config.tma,
        shape=config.dq,
        HAS_DLSE=dlse is not None,
    )
    return dq, delta


def s2_dkdv_tl(
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
    """dK/dV pass through :func:`_s2_dkdv_kernel` at ``config.dkdv``'s tiles: do like q, lse and
    delta ``[b, h, sq]`` fp32 (``delta`` from the dQ pass). Returns ``dk, dv`` in the layouts of
    k, v."""
    sq, sk = q.shape[1], k.shape[1]
    block_m = config.dkdv.block_m
    lay = pass_layout(
        pattern, sq, sk, q_start, k_start, block_m, config.block_n, q.device, varlen, csc=True
    )
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _launch(
        _s2_dkdv_kernel,
        (q, k, v, do, lse, delta, dk, dv),
        lay,
        varlen,
        starts=(q_start, k_start),
        tail=(lay.num_k_tiles, lay.group, scale * LOG2E.value, scale),
        walked=(q, do),
        tma=config.tma,
        shape=config.dkdv,
        kv=True,
    )
    return dk, dv


def _launch(
    kernel,
    tensors: tuple,
    lay,
    varlen: Optional[Varlen],
    *,
    starts: tuple,
    tail: tuple,
    walked: tuple,
    tma: bool,
    shape: PassConfig,
    kv: bool = False,
    **flags,
) -> None:
    """Launch ``kernel``, one of the three passes, over ``lay``'s programs (none for a pack of
    empty documents), with its arguments in the order the three kernels share:

    ``tensors``, the pointers (Q, K, V first); the strides of those of them that are ``[b, s,
    h, d]``, in order, and of the first ``[b, h, s]`` one (the LSE: delta and dLSE are alike);
    the layout's lists (over query tiles, or over key tiles with ``kv``); the program map;
    heads, query and key lengths, ``starts`` (``q_start, k_start``) and the query tile count;
    ``tail``, the pass's own sizes and scales; the TMA descriptors of ``walked`` (the tensors
    the tile loop reads) when ``tma`` (else Nones: pointer loads); the shared constexprs, the
    pass's own ``flags`` and ``shape``'s warps and stages."""
    q, k = tensors[0], tensors[1]
    grid, order, prog_tok, prog_len = _programs(lay, q.shape[0], varlen, kv)
    if grid == 0:
        return
    if kv:
        lists = (lay.col_ptr, lay.col_split, lay.rows, lay.lo_c, lay.hi_c)
    else:
        lists = (lay.row_ptr, lay.row_split, lay.cols, lay.lo, lay.hi)
    stats = next(t for t in tensors if t.dim() == 3)
    tiles = _tile_descriptors(tma, walked, lay.block_m if kv else lay.block_n)
    kernel[(grid,)](
        *tensors,
        *(st for t in tensors if t.dim() == 4 for st in t.stride()),
        stats.stride(0),
        stats.stride(1),
        *lists,
        order,
        prog_tok,
        prog_len,
        q.shape[2],
        q.shape[1],
        k.shape[1],
        *starts,
        lay.num_q_tiles,
        *tail,
        *tiles,
        BLOCK_M=lay.block_m,
        BLOCK_N=lay.block_n,
        HEAD_DIM=q.shape[-1],
        PRECISION=_precision(q.dtype),
        VARLEN=varlen is not None,
        TMA=tiles[0] is not None,
        INTERPRET=_INTERPRETED,
        num_warps=shape.num_warps,
        num_stages=shape.num_stages,
        **flags,
    )


def pass_layout(pattern, sq, sk, q_start, k_start, block_m, block_n, device, varlen, csc=False):
    """The tile layout of one pass: for the call's lengths, or one that serves every document."""
    if varlen is None:
        return layout_for(pattern, sq, sk, q_start, k_start, block_m, block_n, device, csc)
    return varlen.layout(pattern, block_m, block_n, device, csc)


def _programs(lay, batch: int, varlen: Optional[Varlen], kv: bool):
    """``(grid, order, prog_tok, prog_len)`` kernel arguments of one pass (the last two are
    unused placeholders for fixed-length calls)."""
    order = lay.kv_order if kv else lay.q_order
    if varlen is None:
        return order.numel() * batch, order, order, order
    return varlen.programs(lay, kv)


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


def _precision(dtype):
    # fp32 inputs (tests, interpreter) get exact fp32 dots; bf16/fp16 ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


# --------------------------------------------------------------------------------------- forward
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


# -------------------------------------------------------------------------------------------- dQ
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


# ----------------------------------------------------------------------------------------- dK/dV
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
def _jump(i, jump_at, jump_by, JUMP: tl.constexpr):
    """List position of loop step ``i``: ``i``, or with JUMP ``i + jump_by`` from ``jump_at`` on."""
    if JUMP:
        i = tl.where(i < jump_at, i, i + jump_by)
    return i


# ----------------------------------------------------------- shared: what a program does, its reads
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


# The kernels run under Triton's interpreter iff triton.jit saw TRITON_INTERPRET at import time;
# checking the kernel object (not the environment now) keeps the flag true to what runs (hence
# here, after the kernels; the launches above read it when they run).
_INTERPRETED = not isinstance(_s2_fwd_kernel, triton.runtime.JITFunction)


# ----------------------------------------------------------------------- varlen program maps
# Documents, and layout items of one head, handled per vector step of the map kernels.
MAP_CHUNK = tl.constexpr(1024)
# Packs of fewer documents (at most MAP_CHUNK) build their map in one launch.
MAP_FUSED_DOCS = 1024


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
