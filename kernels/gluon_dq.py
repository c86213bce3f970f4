"""The S2 dQ pass for Hopper (sm_90) in Triton's Gluon dialect: the forward's schedule
(``gluon_forward.py``) with the backward's row math.

Each (batch row, head, query tile) item walks the tile's row list (the forward's layout:
``row_ptr``/``row_split``/``cols``, ``lo``/``hi``; 128-row tiles, 192-row ones at head_dim 64 on
64-token blocks, :func:`tile_m`) in one program:

* a loader warp TMA-loads the tile's Q, dO and O rows once, then each listed key tile's K and V
  into a ``NUM_STAGES`` ring shared by the consumers, guarded by ``ready``/``empty`` mbarriers;
* two or three consumer warpgroups, 64 query rows each, first form ``delta = rowsum(dO * O) -
  dLSE`` from the shared-memory tiles (written out for the dK/dV pass), then per key tile run
  ``S = Q K^T`` and ``dP = dO V^T`` (async wgmma, both in flight; with two consumers Q, and dO
  in the full entries' loop, read once into registers), ``P = exp2(S - lse)`` (masked on
  partial entries), ``dS = P (dP - delta)`` and ``dQ += dS K`` (dS as a register operand),
  skipping the partial entries that none of its rows attends;
* each then writes dQ (times the softmax scale) through its O buffer, free once delta is
  formed, and the program stores the tile by TMA (a tile that runs past the sequence's or the
  document's end: each consumer its rows through a masked store).

It takes what :func:`gluon_forward.unsupported_reason` accepts, on 64-key tiles (blocks 64 and
128; packed documents too, through the forward's program map: a document's last tile reads
its extra rows' LSE as +inf and stores dQ through a masked store) or gathered ones (blocks 16
and 32, ``gathered_keys.py``), and is
the default wherever the Gluon dK/dV pass is (``KernelConfig.gluon_dq``; ``S2ATTN_GLUON_FORWARD=0``
turns all three Gluon kernels off): checked on the CPU (:func:`emulate_dq`, an sm_90 compile) and
on an H200 (``tests/kernels/test_kernels_gpu.py``), fwd+bwd up to 4% faster than with the ``tl`` dQ
pass, never slower (``docs/benchmarks.md``).
"""

from __future__ import annotations

import math
import os

import torch

from . import gluon_forward as gf
from .layout import layout_for

gluon, gl = gf.gluon, (gf.gl if gf.gluon is not None else None)
if gluon is not None:
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # The wgmma layouts' and the partitions' numbers, as the forward names them.
    from .gluon_forward import (
        CONSUMER_WARPS,
        LOADER_WARPS,
        OPERAND_K_WIDTH,
        WGMMA_K,
        WGMMA_ROWS_PER_WARP,
        WGMMA_VERSION,
    )

BLOCK_N = 64  # keys per listed tile (the pattern block)
WG_ROWS = gf.WG_ROWS  # query rows per consumer warpgroup
TILE_M = gf.TILE_M  # the layout's block_m at two consumer warpgroups (tile_m: the call's)
NUM_STAGES = 2  # K/V ring depth: 2 x (K + V) tiles of 64 x 128 bf16 is 64 KiB
LOG2E = 1.0 / math.log(2.0)


if gluon is not None:
    CONSUMER_REGS = gl.constexpr(240)
    LOADER_REGS = gl.constexpr(24)
    # Three consumer warpgroups and the loader warp (padded to a warpgroup): 160-168 each.
    WIDE_CONSUMER_REGS = gl.constexpr(160)
    # dO is a register operand in the full entries' loop, and in the masked loop up to
    # MASKED_DO_IN_REGISTERS_MAX_D: at head_dim 128 the masks need those registers (dO in
    # registers in both loops spilled 152 bytes).
    DO_IN_REGISTERS_MAX_D = gl.constexpr(128)
    # Q and dO are register operands with two consumer warpgroups only: three (head_dim 64)
    # have 160 registers a thread, where Triton 3.6's ptxas spilled 131 values in the key loops
    # with both in registers, 7 with one; from shared memory the pass ran as fast (H100:
    # docs/benchmarks.md, "Three consumer warpgroups at head_dim 64").
    Q_IN_REGISTERS_MAX_CONSUMERS = gl.constexpr(2)
    DO_IN_REGISTERS_MAX_CONSUMERS = gl.constexpr(2)
    MASKED_DO_IN_REGISTERS_MAX_D = gl.constexpr(64)
    # log2(e) for the kernel, which reads only constexpr globals: the LSE arrives in natural log.
    LOG2E_CONSTEXPR = gl.constexpr(LOG2E)

    @gluon.jit
    def _program_item(items):
        """(batch row, head, query tile, layout item, first row, rows) of this program: one
        item of the layout for every batch row (:func:`gluon_forward._item_of_program`), its
        sequence from row 0 with ``seq_q`` query rows; packed documents (``varlen``): the
        program map's item, document start and length (0: a padding slot, which every role
        skips)."""
        order, n_items, num_q_tiles, prog_tok, prog_len, seq_q, varlen = items
        b, h, qt, item = gf._item_of_program(order, n_items, num_q_tiles)
        tok, rows = gf._document_rows(gl.program_id(0), prog_tok, prog_len, seq_q, varlen)
        return b, h, qt, item, tok, rows

    @gluon.jit
    def _loader(
        q_desc, do_desc, o_desc, k_desc, v_desc, q_smem, do_smem, o_smem, k_bufs, v_bufs,
        row_bar, ready, empty, row_ptr, cols, items, group, key_lo, key_stride, views,
    ):  # fmt: skip
        b, h, qt, item, tok, rows = _program_item(items)
        if rows > 0:
            _load_item(
                q_desc, do_desc, o_desc, k_desc, v_desc, q_smem, do_smem, o_smem, k_bufs,
                v_bufs, row_bar, ready, empty, row_ptr, cols, group, key_lo, key_stride, views,
                b, h, qt, item, tok,
            )  # fmt: skip

    @gluon.jit
    def _load_item(
        q_desc, do_desc, o_desc, k_desc, v_desc, q_smem, do_smem, o_smem, k_bufs, v_bufs,
        row_bar, ready, empty, row_ptr, cols, group, key_lo, key_stride, views, b, h, qt, item,
        tok,
    ):  # fmt: skip
        """The loader's work for one item: Q, dO and O rows (a document's last tile reads on
        into the next document's rows, or zeros past the tensor's end: rows whose results are
        not stored), then the item's K/V tiles into the ring."""
        NC: gl.constexpr = q_smem.type.shape[0]
        BM: gl.constexpr = q_smem.type.shape[1]
        q_row_b, q_col_b, q_col_h, o_row_b, o_col_b, o_col_h, kv_row_b, kv_col_b, kv_col_h = views
        q_row = b * q_row_b + tok + qt * NC * BM
        q_col = b * q_col_b + h * q_col_h
        o_row = b * o_row_b + tok + qt * NC * BM
        o_col = b * o_col_b + h * o_col_h
        mbarrier.expect(
            row_bar,
            NC * (q_desc.block_type.nbytes + do_desc.block_type.nbytes + o_desc.block_type.nbytes),
        )
        for c in gl.static_range(NC):
            gf._tma_load(q_desc, [q_row + c * BM, q_col], row_bar, q_smem.index(c))
            gf._tma_load(do_desc, [o_row + c * BM, o_col], row_bar, do_smem.index(c))
            gf._tma_load(o_desc, [o_row + c * BM, o_col], row_bar, o_smem.index(c))
        e0 = gl.load(row_ptr + item)
        e2 = gl.load(row_ptr + item + 1)
        kv_col = b * kv_col_b + (h // group) * kv_col_h
        gf._load_kv_ring(
            k_desc, v_desc, k_bufs, v_bufs, ready, empty, cols, e0, e2, e0, b * kv_row_b + tok,
            kv_col, key_lo + h * key_stride,
        )  # fmt: skip

    @gluon.jit
    def _tiles(
        q, do, k_bufs, v_bufs, ready, empty, dq, lse2, delta, q_abs, q_first, offs_n, cols,
        los, his, e_begin, e_end, e0, qk_scale, key_lo, key_hi, gathered, MASKED: gl.constexpr,
    ):  # fmt: skip
        """Entries ``e_begin .. e_end`` of the item's list (ring position counted from ``e0``)
        for the query rows at ``q_abs`` (the first: ``q_first``): accumulate dQ (unscaled)."""
        BM: gl.constexpr = q.type.shape[0]
        BN: gl.constexpr = k_bufs.type.shape[1]
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[WGMMA_VERSION, 0],
            warps_per_cta=[CONSUMER_WARPS, 1],
            instr_shape=[WGMMA_ROWS_PER_WARP, BN, WGMMA_K],
        )
        acc_layout: gl.constexpr = dq.type.layout
        op_layout: gl.constexpr = gl.DotOperandLayout(
            operand_index=0, parent=acc_layout, k_width=OPERAND_K_WIDTH
        )
        for e in range(e_begin, e_end):
            i = e - e0
            stage = i % STAGES
            live = True
            if MASKED:
                # No row of this warpgroup attends the entry (the window's first block seen by
                # a tile's later rows, a later diagonal block by its first rows): dS = 0,
                # so the warpgroup skips the step's products and only releases the stage.
                live = (gl.load(his + e) > q_first) & (gl.load(los + e) < q_first + BM)
            mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
            if live:
                k = k_bufs.index(stage)
                s_tok = warpgroup_mma(
                    q, k.permute((1, 0)), gl.zeros([BM, BN], gl.float32, s_layout),
                    use_acc=False, is_async=True,
                )  # fmt: skip
                dp_tok = warpgroup_mma(
                    do, v_bufs.index(stage).permute((1, 0)),
                    gl.zeros([BM, BN], gl.float32, s_layout), use_acc=False, is_async=True,
                )  # fmt: skip
                if MASKED:  # read again here, not held across the products (ptxas spilled them)
                    key0 = gl.load(cols + e) * BN
                    k_lo, k_hi = gf._key_bounds(key0 + offs_n, key_lo, key_hi, gathered)
                    lo = gl.load(los + e)
                    hi = gl.load(his + e)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
                s = s * qk_scale - lse2[:, None]
                if MASKED:
                    s = gf._mask_partial(
                        s, lo, hi, q_abs, k_lo, k_hi, q_first, key0 + BN - 1, gathered
                    )  # fmt: skip
                p = gl.exp2(s)
                dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok,))
                ds = p * (dp - delta[:, None])
                dq_tok = warpgroup_mma(
                    gl.convert_layout(ds.to(q.dtype), op_layout), k, dq, is_async=True
                )
                dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok,))
            mbarrier.arrive(empty.index(stage), count=1)
        return dq

    @gluon.jit
    def _consumer(
        q_smem, do_smem, o_smem, k_bufs, v_bufs, row_bar, ready, empty, LSE, DLSE, DELTA,
        stride_lse_b, stride_lse_h, has_dlse, row_ptr, row_split, cols, los, his, items,
        qk_scale, sm_scale, q_start, key_lo, key_hi, key_stride, dq_view, WG,
    ):  # fmt: skip
        b, h, qt, item, tok, rows = _program_item(items)
        if rows > 0:
            _consume_item(
                q_smem, do_smem, o_smem, k_bufs, v_bufs, row_bar, ready, empty, LSE, DLSE,
                DELTA, stride_lse_b, stride_lse_h, has_dlse, row_ptr, row_split, cols, los, his,
                qk_scale, sm_scale, q_start, key_lo, key_hi, key_stride, dq_view, WG, b, h, qt,
                item, tok, rows,
            )  # fmt: skip

    @gluon.jit
    def _consume_item(
        q_smem, do_smem, o_smem, k_bufs, v_bufs, row_bar, ready, empty, LSE, DLSE, DELTA,
        stride_lse_b, stride_lse_h, has_dlse, row_ptr, row_split, cols, los, his, qk_scale,
        sm_scale, q_start, key_lo, key_hi, key_stride, dq_view, WG, b, h, qt, item, tok, rows,
    ):  # fmt: skip
        """Consumer warpgroup ``WG``'s 64 rows of the item: document-relative positions (the
        masks'), rows from the document's first row ``tok`` (Q, dO, O, LSE, delta, dQ); rows
        past the document's end (``rows``) read an LSE of +inf, so their P is 0, and are not
        stored."""
        NC: gl.constexpr = q_smem.type.shape[0]
        BM: gl.constexpr = q_smem.type.shape[1]
        BN: gl.constexpr = k_bufs.type.shape[1]
        D: gl.constexpr = k_bufs.type.shape[2]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[WGMMA_VERSION, 0],
            warps_per_cta=[CONSUMER_WARPS, 1],
            instr_shape=[WGMMA_ROWS_PER_WARP, BN, WGMMA_K],
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[WGMMA_VERSION, 0],
            warps_per_cta=[CONSUMER_WARPS, 1],
            instr_shape=[WGMMA_ROWS_PER_WARP, D, WGMMA_K],
        )
        e0 = gl.load(row_ptr + item)
        e1 = gl.load(row_split + item)
        e2 = gl.load(row_ptr + item + 1)
        row_off = b * stride_lse_b + h * stride_lse_h + tok
        first = qt * NC * BM + WG * BM
        # Local rows index Q, dO, O, LSE and delta; absolute positions (from q_start) the masks.
        q_loc = first + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
        q_abs = q_start + q_loc
        offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        mbarrier.wait(row_bar, 0)
        # Q (and dO up to DO_IN_REGISTERS_MAX_D, in the full entries' loop) as the register
        # operands of S = Q K^T and dP = dO V^T, with two consumer warpgroups (see
        # Q_IN_REGISTERS_MAX_CONSUMERS): read from shared memory once, not by every
        # step's 64-key products (with both operands there, each reads 128 bytes a clock: an
        # SM's whole shared-memory bandwidth, which the K/V TMA writes and dQ += dS K share).
        a_layout: gl.constexpr = gl.DotOperandLayout(
            operand_index=0, parent=s_layout, k_width=OPERAND_K_WIDTH
        )
        q = q_smem.index(WG)
        if NC <= Q_IN_REGISTERS_MAX_CONSUMERS:
            q = q.load(a_layout)
        do_s = do_smem.index(WG)
        do = do_s
        if (D <= DO_IN_REGISTERS_MAX_D) & (NC <= DO_IN_REGISTERS_MAX_CONSUMERS):
            do = do_s.load(a_layout)
        do_masked = do_s
        if D <= MASKED_DO_IN_REGISTERS_MAX_D:
            do_masked = do
        o = o_smem.index(WG)
        # delta = rowsum(dO * O) - dLSE (dLSE enters the softmax gradient as P * dLSE), in fp32.
        rows_acc = first + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
        delta = gl.sum(do_s.load(acc_layout).to(gl.float32) * o.load(acc_layout).to(gl.float32), 1)
        if has_dlse != 0:
            delta -= gl.load(DLSE + row_off + rows_acc, rows_acc < rows, 0.0)
        gl.store(DELTA + row_off + rows_acc, delta, rows_acc < rows)
        delta = gl.convert_layout(delta, gl.SliceLayout(1, s_layout))
        lse = gl.load(LSE + row_off + q_loc, q_loc < rows, float("inf"))
        # A row that attends nothing has lse = -inf: shift it by 0 so its p is 0, not NaN.
        lse2 = gl.where(lse == -float("inf"), 0.0, lse * LOG2E_CONSTEXPR)
        dq = gl.zeros([BM, D], gl.float32, acc_layout)
        key_lo += h * key_stride
        key_hi += h * key_stride
        gathered = key_stride > 0
        dq = _tiles(
            q, do, k_bufs, v_bufs, ready, empty, dq, lse2, delta, q_abs, q_start + first, offs_n,
            cols, los, his, e0, e1, e0, qk_scale, key_lo, key_hi, gathered, False,
        )  # fmt: skip
        dq = _tiles(
            q, do_masked, k_bufs, v_bufs, ready, empty, dq, lse2, delta, q_abs, q_start + first,
            offs_n, cols, los, his, e1, e2, e0, qk_scale, key_lo, key_hi, gathered, True,
        )  # fmt: skip
        if gf._tile_in_document(qt, BM, NC, rows):
            # O was last read for delta: its buffer takes dQ on the way out.
            o.store((dq * sm_scale).to(o.dtype))
            fence_async_shared()
        else:
            # The tile runs past its document's end: a masked store, not TMA (which would
            # write over the next document's rows).
            gf._store_rows(dq * sm_scale, dq_view, b, h, tok, first, rows)

    @gluon.jit
    def _s2_dq_gluon_kernel(
        q_desc, do_desc, o_desc, k_desc, v_desc, dq_desc, dq_ptr, dq_stride, LSE, DLSE, DELTA,
        stride_lse_b, stride_lse_h, has_dlse, row_ptr, row_split, cols, los, his, order,
        prog_tok, prog_len, n_items, num_q_tiles, seq_q, varlen, group, qk_scale, sm_scale,
        q_start, key_lo, key_hi, key_stride, q_row_b, q_col_b, q_col_h, o_row_b, o_col_b,
        o_col_h, kv_row_b, kv_col_b, kv_col_h, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
        CONSUMERS: gl.constexpr = gf.NUM_CONSUMERS,
    ):  # fmt: skip
        """One program per (batch row, layout item), a query tile of ``CONSUMERS`` x 64 rows of
        one head, or per slot of a packed-documents program map (:func:`_program_item`)."""
        BM: gl.constexpr = q_desc.block_type.shape[0]
        # Barriers count CONSUMERS arrivals: only the two warp_specialize lists below exist.
        gl.static_assert((CONSUMERS == 2) | (CONSUMERS == 3))
        q_smem = gl.allocate_shared_memory(
            q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout
        )
        do_smem = gl.allocate_shared_memory(
            do_desc.dtype, [CONSUMERS] + do_desc.block_type.shape, do_desc.layout
        )
        o_smem = gl.allocate_shared_memory(
            o_desc.dtype, [CONSUMERS] + o_desc.block_type.shape, o_desc.layout
        )
        # K/V tiles of BLOCK_N keys: the descriptors' boxes, or several boxes of a gathered tile.
        D: gl.constexpr = k_desc.block_type.shape[1]
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
        row_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(row_bar, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=CONSUMERS)  # every consumer releases a stage
        fence_async_shared()
        views = (q_row_b, q_col_b, q_col_h, o_row_b, o_col_b, o_col_h, kv_row_b, kv_col_b, kv_col_h)
        items = (order, n_items, num_q_tiles, prog_tok, prog_len, seq_q, varlen)
        dq_view = (dq_ptr, dq_stride, q_row_b, q_col_b, q_col_h)  # dQ shares Q's coordinates
        loader_args = (
            q_desc, do_desc, o_desc, k_desc, v_desc, q_smem, do_smem, o_smem, k_bufs, v_bufs,
            row_bar, ready, empty, row_ptr, cols, items, group, key_lo, key_stride, views,
        )  # fmt: skip
        consumer_args = (
            q_smem, do_smem, o_smem, k_bufs, v_bufs, row_bar, ready, empty, LSE, DLSE, DELTA,
            stride_lse_b, stride_lse_h, has_dlse, row_ptr, row_split, cols, los, his, items,
            qk_scale, sm_scale, q_start, key_lo, key_hi, key_stride, dq_view,
        )  # fmt: skip
        # The default partition (this kernel's 4 warps) is consumer 0; then the other consumers
        # and the loader. The warpgroup index reaches a partition as a run-time value: it only
        # selects the buffers and rows.
        if CONSUMERS == 3:
            gl.warp_specialize(
                [
                    (_consumer, consumer_args + (gl.to_tensor(0),)),
                    (_consumer, consumer_args + (gl.to_tensor(1),)),
                    (_consumer, consumer_args + (gl.to_tensor(2),)),
                    (_loader, loader_args),
                ],
                [CONSUMER_WARPS, CONSUMER_WARPS, LOADER_WARPS],
                [WIDE_CONSUMER_REGS, WIDE_CONSUMER_REGS, LOADER_REGS],
            )
        else:
            gl.warp_specialize(
                [
                    (_consumer, consumer_args + (gl.to_tensor(0),)),
                    (_consumer, consumer_args + (gl.to_tensor(1),)),
                    (_loader, loader_args),
                ],
                [CONSUMER_WARPS, LOADER_WARPS],
                [CONSUMER_REGS, LOADER_REGS],
            )
        b, h, qt, item, tok, rows = _program_item(items)
        # else the consumers stored their rows themselves
        if gf._tile_in_document(qt, BM, CONSUMERS, rows):
            row = b * q_row_b + tok + qt * CONSUMERS * BM
            col = b * q_col_b + h * q_col_h
            # dQ shares Q's coordinates (the wrapper makes it so).
            for c in gl.static_range(CONSUMERS):
                gf._tma_store(dq_desc, [row + c * BM, col], o_smem.index(c))
            tma.store_wait(0)


def tile_m(block_size: int, head_dim: int, q_start: int = 0, varlen=None) -> int:
    """Query rows of a dQ work item, the layout's ``block_m``: 64 per consumer warpgroup, as
    many warpgroups as the forward runs (:func:`gluon_forward.consumers_for`: three at head_dim
    64 on 64-token blocks of whole sequences, where two leave the step's latencies exposed)."""
    return gf.forward_tile_m(block_size, head_dim, q_start, varlen)


def s2_dq_gluon(
    do, dlse, q, k, v, out, lse, pattern, scale: float, lay=None, q_start: int = 0, keys=None,
    varlen=None,
):  # fmt: skip
    """The dQ pass through the Gluon kernel: ``do``, ``out`` and ``q [b, s, hq, d]``, ``k, v [b,
    sk, hkv, d]`` (bf16/fp16 on an sm_90 GPU, any strides: those :func:`gluon_forward.tma_view`
    cannot read are copied), ``lse [b, hq, s]`` fp32 contiguous, ``dlse`` like it or None; the
    queries are positions ``q_start = sk - s ..`` (:func:`gluon_forward.s2_forward_gluon`).
    ``lay``: the pattern's layout at :func:`tile_m` (or 128) x ``BLOCK_N`` tiles (the
    forward's at block 64; built when None). ``keys``: gathered key tiles (blocks 16 and 32), as
    :func:`gluon_forward.s2_forward_gluon` takes them. Returns ``dq`` like q and ``delta [b, hq,
    s]`` fp32 (``rowsum(dO * O) - dLSE``, for the dK/dV pass), as ``tl_kernels.s2_dq_tl``
    does. ``varlen``: packed documents, as :func:`gluon_forward.s2_forward_gluon` takes them.
    The caller checks :func:`gluon_forward.unsupported_reason`."""
    b, s, hq, d = q.shape
    gf.check_chunk("s2_dq_gluon", q, k, q_start)
    gf.gathered_keys.check_call("s2_dq_gluon", keys, pattern, hq, k.shape[1], lay)
    # 64-key tiles (check_call let through only blocks 64 and 128, or 16 and 32 with keys): a
    # block of 64, half a block of 128, or a gathered tile of 16/32-key boxes.
    box = min(pattern.block_size, BLOCK_N)
    tm = gf.call_tile_m(pattern, d, q_start, varlen, lay, keys)
    if keys is not None:
        lay = keys.layout(tm, q_start=q_start)
    if lay is None and varlen is not None:
        lay = varlen.layout(pattern, tm, BLOCK_N, q.device)
    if lay is None:
        lay = layout_for(pattern, s, k.shape[1], q_start, 0, tm, BLOCK_N, q.device)
    if lay.block_m != tm or lay.block_n != BLOCK_N:
        raise ValueError(
            f"s2_dq_gluon: the layout has {lay.block_m} x {lay.block_n} tiles, the kernel "
            f"{tm} x {BLOCK_N}"
        )
    # dQ is written at Q's coordinates (q's layout where q is dense), dO and O share theirs,
    # K and V theirs.
    _, dq, qv, dqv = gf.paired_tma_views(q, torch.empty_like(q), b_is_output=True)
    *_, dov, ov = gf.paired_tma_views(do, out)
    *_, kv_, vv = gf.paired_tma_views(k, v)
    delta = torch.empty_like(lse)
    n_items = lay.q_order.numel()
    if varlen is None:
        grid, order = n_items * b, lay.q_order
        prog_tok = prog_len = order  # unread
    else:
        grid, order, prog_tok, prog_len = varlen.programs(lay, kv=False)
        n_items = grid  # a program per map slot
    if grid == 0:
        return dq.zero_(), delta.copy_(-dlse if dlse is not None else torch.zeros_like(lse))

    def desc(view, rows):
        return gf._descriptor(view, rows, d)

    _s2_dq_gluon_kernel[(grid,)](
        desc(qv, WG_ROWS),
        desc(dov, WG_ROWS),
        desc(ov, WG_ROWS),
        desc(kv_, box),
        desc(vv, box),
        desc(dqv, WG_ROWS),
        dqv.matrix,
        dqv.matrix.stride(0),
        lse,
        dlse if dlse is not None else lse,
        delta,
        lse.stride(0),
        lse.stride(1),
        int(dlse is not None),
        lay.row_ptr,
        lay.row_split,
        lay.cols,
        lay.lo,
        lay.hi,
        order,
        prog_tok,
        prog_len,
        n_items,
        lay.num_q_tiles,
        s,
        int(varlen is not None),
        pattern.group_size,
        scale * LOG2E,
        scale,
        q_start,
        *gf.key_arrays(keys, lay.lo),
        *qv[1:],
        *ov[1:],
        *kv_[1:],
        STAGES=NUM_STAGES,
        BLOCK_N=BLOCK_N,
        CONSUMERS=tm // WG_ROWS,
        num_warps=gf.WARPGROUP_WARPS,
    )
    return dq, delta


def compile_for_sm90(head_dim: int, block: int, out_dir: str) -> dict:
    """As :func:`gluon_forward.compile_for_sm90`, for this kernel (as many consumer warpgroups
    as :func:`tile_m` takes for a whole sequence)."""
    tiles = {n: WG_ROWS for n in ("q_desc", "do_desc", "o_desc", "dq_desc")}
    types = {n: "*fp32" for n in ("LSE", "DLSE", "DELTA")}
    types["dq_ptr"] = "*bf16"
    types.update(qk_scale="fp32", sm_scale="fp32", **gf.ROW_LIST_TYPES)
    return gf.compile_kernel_for_sm90(
        _s2_dq_gluon_kernel,
        head_dim,
        {**tiles, "k_desc": min(block, BLOCK_N), "v_desc": min(block, BLOCK_N)},
        types,
        NUM_STAGES,
        os.path.join(out_dir, f"dq_d{head_dim}_n{block}"),
        block_n=BLOCK_N,
        CONSUMERS=tile_m(block, head_dim) // WG_ROWS,
    )


def emulate_dq(
    do, dlse, q, k, v, out, lse, pattern, scale: float, q_start: int = 0, keys=None, varlen=None
):
    """The kernel's schedule in float64 PyTorch on any device: the same layout arrays, program
    order (with ``varlen``, the program map), warpgroup split of each query tile, full/partial
    entries, masks, and reads past a document's end (the next document's rows, zeros past the
    tensor's; their LSE as +inf). Shapes, ``q_start``, ``keys`` and ``varlen`` as
    :func:`s2_dq_gluon`; returns ``(dq, delta)`` in float64."""
    b, s, hq, d = q.shape
    bn = BLOCK_N
    tm = tile_m(pattern.block_size, d, q_start, varlen)
    if keys is not None:
        lay = keys.layout(tm, q_start=q_start)
    elif varlen is not None:
        lay = varlen.layout(pattern, tm, bn, q.device)
    else:
        lay = layout_for(pattern, s, k.shape[1], q_start, 0, tm, bn, q.device)
    group = pattern.group_size
    qk_scale = scale * LOG2E
    dq = torch.zeros(q.shape, dtype=torch.float64)
    delta = torch.zeros(lse.shape, dtype=torch.float64)
    row_ptr, row_split = lay.row_ptr.tolist(), lay.row_split.tolist()
    cols, los, his = lay.cols.tolist(), lay.lo.tolist(), lay.hi.tolist()
    offs_n = torch.arange(bn)
    for bb, item, _, tok, n_rows in gf.emulated_work(lay, b, s, varlen):
        h, qt = item // lay.num_q_tiles, item % lay.num_q_tiles
        kvh = h // group
        for wg in range(tm // WG_ROWS):
            q_loc = qt * tm + wg * WG_ROWS + torch.arange(WG_ROWS)
            q_abs = q_start + q_loc
            keep = q_loc < n_rows  # rows of the document: read and stored
            qq, dd, oo = (gf.emulated_rows(x, bb, tok + q_loc, h) for x in (q, do, out))
            row_delta = (dd * oo).sum(-1)
            if dlse is not None:
                row_dlse = dlse[bb, h].double()
                row_delta = row_delta - torch.where(keep, row_dlse[(tok + q_loc) * keep], 0.0)
            dst = tok + q_loc[keep]
            delta[bb, h, dst] = row_delta[keep]
            row_lse = torch.where(keep, lse[bb, h].double()[(tok + q_loc) * keep], math.inf)
            lse2 = torch.where(row_lse == -math.inf, 0.0, row_lse * LOG2E)
            acc = torch.zeros(WG_ROWS, d, dtype=torch.float64)
            first = q_start + qt * tm + wg * WG_ROWS
            for e in range(row_ptr[item], row_ptr[item + 1]):
                masked = e >= row_split[item]
                if masked and not (his[e] > first and los[e] < first + WG_ROWS):
                    continue  # the kernel's skip: no row of this warpgroup attends the entry
                n_abs = cols[e] * bn + offs_n
                rows = tok + gf.emulated_key_rows(keys, h, n_abs)
                kk, vv = gf.emulated_rows(k, bb, rows, kvh), gf.emulated_rows(v, bb, rows, kvh)
                sc = (qq @ kk.T) * qk_scale - lse2[:, None]
                if masked:
                    sc = gf.emulated_mask_partial(sc, los[e], his[e], q_abs, keys, h, n_abs)
                p = torch.exp2(sc)
                acc += (p * (dd @ vv.T - row_delta[:, None])) @ kk
            dq[bb, dst, h] = (acc * scale)[keep]
    return dq, delta
