"""The S2 dK/dV pass for Hopper (sm_90) in Triton's Gluon dialect, the forward's schedule
(``gluon_forward.py``) turned around: keys are the program's rows.

Each (batch row, KV head, 64-key tile) item walks the tile's column lists
(``layout_for(..., with_csc=True)``: ``col_ptr``/``col_split``/``rows``, ``lo_c``/``hi_c``; the
full entries from the last query tile back, :func:`layout.full_descending_columns`, so that a
head's stripe columns running side by side read the same Q and dO tiles) for every query head
of its GQA group, as ``tl_kernels._s2_dkdv_kernel`` does; on gathered key tiles
(``gathered_keys.py``) an item is one query head's tile, read from its KV head. A
program runs two items (consecutive in the heaviest-first ``kv_order``) in two independent
pipelines, so that two warpgroups share each SM's tensor cores, as FlashAttention-3's backward
has them:

* a loader warp TMA-loads its item's K and V once, then each listed query tile's Q and dO
  (``TILE_M`` rows) with the rows' LSE (in log2 units, 0 for rows that attend nothing: the
  wrapper converts it once) and delta into its ``NUM_STAGES`` ring, guarded by
  ``ready``/``empty`` mbarriers (when the consumer read LSE and delta from global memory,
  they were the pass's top stall);
* a consumer warpgroup keeps dK and dV in registers and per query tile runs ``S^T = K Q^T`` and
  ``dP^T = V dO^T`` (async wgmma, both in flight; K and V from shared memory, at head_dim 64
  read once into registers), ``P^T = exp2(S^T - lse)`` (masked on partial entries), ``dV +=
  P^T dO``, ``dS^T = P^T (dP^T - delta)``, ``dK += dS^T Q`` (P^T and dS^T as register
  operands);
* it then writes dK (times the softmax scale) and dV through K's and V's shared-memory buffers
  and a TMA store.

No atomics: each program owns its keys' dK/dV (the deterministic backward stays). It takes what
:func:`gluon_forward.unsupported_reason` accepts, on 64-key tiles (blocks 64 and 128) or
gathered ones (blocks 16 and 32, ``gathered_keys.py``), packed documents included (blocks 64
and 128, a build of its own: pairs of the program map's slots, each column's entries inside
the document, :func:`layout.document_column_entries`; the query tile across the document's end
masked, the key tile across it stored through a masked store; LSE and delta copied so that
documents start on 16 bytes, :func:`document_aligned_stats`), and needs ``delta``
(``rowsum(dO * O) - dLSE``, from the dQ pass). The default at those blocks wherever the Gluon
forward is (``KernelConfig.gluon_dkdv``, ``S2ATTN_GLUON_FORWARD=0`` turns both off): checked on
the CPU (:func:`emulate_dkdv`, an sm_90 compile) and on H200/H100 GPUs
(``tests/kernels/test_kernels_gpu.py``); timings in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from . import gluon_forward as gf
from .layout import document_column_entries, full_descending_columns, layout_for

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

BLOCK_N = 64  # keys per item (the pattern block): one wgmma M extent per warpgroup
TILE_M = 64  # query rows per listed tile (the CSC layout's block_m)
NUM_STAGES = 2  # Q/dO ring depth: 2 x (Q + dO) tiles of 64 x 128 bf16 is 64 KiB
# Items a program runs side by side, each in a pipeline of its own (a loader warp and a consumer
# warpgroup), so that two warpgroups share each SM's tensor cores (FlashAttention-3's backward).
PIPELINES = 2
LOG2E = 1.0 / math.log(2.0)


if gluon is not None:
    CONSUMER_REGS = gl.constexpr(240)
    LOADER_REGS = gl.constexpr(24)
    # Head dims up to which the consumer holds K and V in registers as the A operands of
    # S^T = K Q^T and dP^T = V dO^T (at 128 the accumulators leave no room: ptxas spills and
    # serializes every wgmma).
    KV_IN_REGISTERS_MAX_D = gl.constexpr(64)
    # The kernel's ``items`` tuple: (order, n_items, num_k_tiles, seq_k), and for packed
    # documents also the program map and what the wrapper derives from it, at these indices:
    # (prog_tok, prog_len, doc_entries, stat_tok). Its length tells the two builds apart
    # (warp_specialize passes no constexprs to the partitions).
    FIXED_ITEMS = gl.constexpr(4)
    PROG_TOK, PROG_LEN, DOC_ENTRIES, STAT_TOK = (gl.constexpr(i) for i in range(4, 8))
    # A slot's run of column entries in ``doc_entries``: (first entry, end entry).
    RUN_FIELDS = gl.constexpr(2)
    NUM_PIPELINES = gl.constexpr(PIPELINES)

    @gluon.jit
    def _item_of(items, WG):
        """(batch row, KV head (query head on gathered tiles), key tile, map slot, first token,
        tokens, valid) of pipeline ``WG`` of this program: programs take consecutive pairs of
        ``order`` (heaviest first, so a pair's work is alike), every batch row in turn, each
        item's sequence from token 0 with ``seq_k`` tokens; packed documents: pairs of the
        program map's slots (the map slot indexes ``prog_tok``, ``prog_len``, ``stat_tok`` and
        ``doc_entries``; first token and tokens are the document's start in the packed row and
        its length; a padding slot, length 0, is not valid)."""
        order, n_items, num_k_tiles, seq_k = items[0], items[1], items[2], items[3]
        pid = gl.program_id(0)
        n_pairs = (n_items + 1) // NUM_PIPELINES  # rounded up (two pipelines)
        idx = (pid % n_pairs) * NUM_PIPELINES + WG
        valid = idx < n_items
        map_slot = gl.minimum(idx, n_items - 1)
        item = gl.load(order + map_slot)
        doc_start = gl.to_tensor(0)  # tensors, not the constexprs that a 1 or 0 argument becomes
        doc_len = gl.to_tensor(seq_k)
        if len(items) > FIXED_ITEMS:
            doc_start = gl.load(items[PROG_TOK] + map_slot)
            doc_len = gl.load(items[PROG_LEN] + map_slot)
            valid = valid & (doc_len > 0)
        kvh, kt = item // num_k_tiles, item % num_k_tiles
        return pid // n_pairs, kvh, kt, map_slot, doc_start, doc_len, valid

    @gluon.jit
    def _column_entries(col_ptr, col_split, items, c, map_slot, g, group):
        """``(first, split, end)`` entries of column ``c``'s list (full entries before
        ``split``); packed documents: those of query tiles inside the map slot's document, one
        run (:func:`layout.document_column_entries`)."""
        first = gl.load(col_ptr + c)
        split = gl.load(col_split + c)
        end = gl.load(col_ptr + c + 1)
        if len(items) > FIXED_ITEMS:
            run = items[DOC_ENTRIES] + (map_slot * group + g) * RUN_FIELDS
            first = gl.load(run)
            end = gl.load(run + 1)
        return first, split, end

    @gluon.jit
    def _loader(
        q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs,
        delta_bufs, k_smem, v_smem, kv_bar, ready, empty, col_ptr, col_split, rows, items,
        group, kv_group, key_lo, key_stride, stride_lse_b, stride_lse_h, views, WG,
    ):  # fmt: skip
        BM: gl.constexpr = q_bufs.type.shape[1]
        BN: gl.constexpr = k_smem.type.shape[1]
        STAGES: gl.constexpr = q_bufs.type.shape[0] // NUM_PIPELINES
        BOXES: gl.constexpr = BN // k_desc.block_type.shape[0]
        q_row_b, q_col_b, q_col_h, kv_row_b, kv_col_b, kv_col_h = views
        tile_bytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
        stat_bytes: gl.constexpr = lse_desc.block_type.nbytes + delta_desc.block_type.nbytes
        num_k_tiles = items[2]
        VARLEN: gl.constexpr = len(items) > FIXED_ITEMS  # packed documents
        b, kvh, kt, map_slot, tok, doc_len, valid = _item_of(items, WG)
        if valid:
            # Gathered tiles are per query head (kvh), read from its KV head's K and V. A
            # document's last key tile reads on into the next document's rows (or zeros past
            # the tensor's end): keys whose dK/dV are not stored.
            kv_col = b * kv_col_b + (kvh // kv_group) * kv_col_h
            bar = kv_bar.index(WG)
            mbarrier.expect(bar, BOXES * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
            keys = key_lo + kvh * key_stride
            kv_row = b * kv_row_b + tok
            stat_tok = tok
            if VARLEN:  # the document's rows in the statistics (see document_aligned_stats)
                stat_tok = gl.load(items[STAT_TOK] + map_slot)
            gf._load_kv_tile(k_desc, kv_row, kv_col, kt, keys, bar, k_smem.index(WG))
            gf._load_kv_tile(v_desc, kv_row, kv_col, kt, keys, bar, v_smem.index(WG))
            i = 0
            for g in range(group):
                h = kvh * group + g
                c = h * num_k_tiles + kt
                e0, _, e2 = _column_entries(col_ptr, col_split, items, c, map_slot, g, group)
                col = b * q_col_b + h * q_col_h
                for e in range(e0, e2):
                    slot = WG * STAGES + i % STAGES
                    mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
                    tile = gl.load(rows + e)
                    row = b * q_row_b + tok + tile * BM
                    bar = ready.index(slot)
                    mbarrier.expect(bar, tile_bytes + stat_bytes)
                    gf._tma_load(q_desc, [row, col], bar, q_bufs.index(slot))
                    gf._tma_load(do_desc, [row, col], bar, do_bufs.index(slot))
                    # The rows' LSE and delta travel with Q and dO: read by the consumer from
                    # global memory, they cost a load latency in every step's softmax.
                    stat = b * stride_lse_b + h * stride_lse_h + stat_tok + tile * BM
                    gf._tma_load(lse_desc, [stat], bar, lse_bufs.index(slot))
                    gf._tma_load(delta_desc, [stat], bar, delta_bufs.index(slot))
                    i += 1

    @gluon.jit
    def _tiles(
        k, v, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, dk, dv, rows, los, his,
        e_begin, e_end, i0, k_lo, k_hi, offs_m, qk_scale, q_start, doc_len, WG,
        MASKED: gl.constexpr, VARLEN: gl.constexpr,
    ):  # fmt: skip
        """List entries ``e_begin .. e_end`` (ring steps from ``i0``): accumulate dK, dV. Query
        rows are local (Q, dO, LSE, delta: the ring's), at absolute positions from ``q_start``
        (masks); queries ``k_lo <= q < k_hi`` attend each key (``gluon_forward._key_bounds``).
        Rows from ``doc_len`` on (past a packed document's end: the next document's, or zeros)
        attend nothing in the masked loop (``MASKED`` with ``VARLEN``), their row bound capped
        there: the caller sends every query tile that crosses a document's end through it."""
        BM: gl.constexpr = q_bufs.type.shape[1]
        BN: gl.constexpr = k.type.shape[0]
        STAGES: gl.constexpr = q_bufs.type.shape[0] // NUM_PIPELINES
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[WGMMA_VERSION, 0],
            warps_per_cta=[CONSUMER_WARPS, 1],
            instr_shape=[WGMMA_ROWS_PER_WARP, BM, WGMMA_K],
        )
        acc_layout: gl.constexpr = dk.type.layout
        op_layout: gl.constexpr = gl.DotOperandLayout(
            operand_index=0, parent=acc_layout, k_width=OPERAND_K_WIDTH
        )
        row_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        i = i0
        # Masks need the query tile's positions: its index is read one entry ahead.
        row = gl.load(rows + e_begin, mask=e_begin < e_end, other=0)
        for e in range(e_begin, e_end):
            slot = WG * STAGES + i % STAGES
            m_idx = row * BM + offs_m
            row = gl.load(rows + e + 1, mask=e + 1 < e_end, other=0)
            if MASKED:  # the entry's query range, read before the wait like the index
                lo = gl.load(los + e)
                hi = gl.load(his + e)
                if VARLEN:  # rows past the document's end attend nothing
                    hi = gl.minimum(hi, q_start + doc_len)
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            q = q_bufs.index(slot)
            do = do_bufs.index(slot)
            # The rows' LSE in log2 units, 0 where a row attends nothing (the wrapper's).
            lse2 = lse_bufs.index(slot).load(row_layout)
            delta = delta_bufs.index(slot).load(row_layout)
            st_tok = warpgroup_mma(
                k, q.permute((1, 0)), gl.zeros([BN, BM], gl.float32, s_layout),
                use_acc=False, is_async=True,
            )  # fmt: skip
            dpt_tok = warpgroup_mma(
                v, do.permute((1, 0)), gl.zeros([BN, BM], gl.float32, s_layout),
                use_acc=False, is_async=True,
            )  # fmt: skip
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok,))
            st = st * qk_scale - lse2[None, :]
            if MASKED:
                m_abs = q_start + m_idx
                ok = (m_abs[None, :] >= k_lo[:, None]) & (m_abs[None, :] < k_hi[:, None])
                ok = ok & (m_abs[None, :] >= lo) & (m_abs[None, :] < hi)
                st = gl.where(ok, st, -float("inf"))
            pt = gl.exp2(st)
            dv_tok = warpgroup_mma(
                gl.convert_layout(pt.to(q.dtype), op_layout), do, dv, is_async=True
            )
            dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt_tok,))
            dst = pt * (dpt - delta[None, :])
            dk_tok = warpgroup_mma(
                gl.convert_layout(dst.to(q.dtype), op_layout), q, dk, is_async=True
            )
            dv = warpgroup_mma_wait(num_outstanding=1, deps=(dv_tok,))
            dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk_tok,))
            mbarrier.arrive(empty.index(slot), count=1)
            i += 1
        return dk, dv, i

    @gluon.jit
    def _consumer(
        dk_desc, dv_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, kv_bar, ready,
        empty, col_ptr, col_split, rows, los, his, items, group, qk_scale, sm_scale, q_start,
        key_lo, key_hi, key_stride, dk_view, dv_view, WG,
    ):  # fmt: skip
        BM: gl.constexpr = q_bufs.type.shape[1]
        BN: gl.constexpr = k_smem.type.shape[1]
        D: gl.constexpr = k_smem.type.shape[2]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[WGMMA_VERSION, 0],
            warps_per_cta=[CONSUMER_WARPS, 1],
            instr_shape=[WGMMA_ROWS_PER_WARP, BM, WGMMA_K],
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[WGMMA_VERSION, 0],
            warps_per_cta=[CONSUMER_WARPS, 1],
            instr_shape=[WGMMA_ROWS_PER_WARP, D, WGMMA_K],
        )
        num_k_tiles = items[2]
        VARLEN: gl.constexpr = len(items) > FIXED_ITEMS  # packed documents
        b, kvh, kt, map_slot, tok, doc_len, valid = _item_of(items, WG)
        if valid:
            k_abs = kt * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
            offs_m = gl.arange(0, BM, layout=gl.SliceLayout(0, s_layout))
            dk = gl.zeros([BN, D], gl.float32, acc_layout)
            dv = gl.zeros([BN, D], gl.float32, acc_layout)
            k = k_smem.index(WG)
            v = v_smem.index(WG)
            mbarrier.wait(kv_bar.index(WG), 0)
            if D <= KV_IN_REGISTERS_MAX_D:
                kv_op: gl.constexpr = gl.DotOperandLayout(
                    operand_index=0, parent=s_layout, k_width=OPERAND_K_WIDTH
                )
                k = k.load(kv_op)
                v = v.load(kv_op)
            i = 0
            for g in range(group):
                h = kvh * group + g
                c = h * num_k_tiles + kt
                e0, e1, e2 = _column_entries(col_ptr, col_split, items, c, map_slot, g, group)
                k_lo, k_hi = gf._key_bounds(
                    k_abs, key_lo + h * key_stride, key_hi + h * key_stride, key_stride > 0
                )
                if VARLEN:
                    # A document's last query tile, when it runs past the document's end, is
                    # the first of its full entries (they run from the last tile back): masked.
                    first_tile = gl.load(rows + e0, mask=e0 < e1, other=0)
                    cross = (e0 < e1) & (first_tile * BM + BM > doc_len)
                    e_full = e0 + cross.to(gl.int32)
                    dk, dv, i = _tiles(
                        k, v, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, dk, dv, rows,
                        los, his, e0, e_full, i, k_lo, k_hi, offs_m, qk_scale, q_start, doc_len,
                        WG, True, VARLEN,
                    )  # fmt: skip
                    e0 = e_full
                dk, dv, i = _tiles(
                    k, v, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, dk, dv, rows, los,
                    his, e0, e1, i, k_lo, k_hi, offs_m, qk_scale, q_start, doc_len, WG, False,
                    VARLEN,
                )  # fmt: skip
                dk, dv, i = _tiles(
                    k, v, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, dk, dv, rows, los,
                    his, e1, e2, i, k_lo, k_hi, offs_m, qk_scale, q_start, doc_len, WG, True,
                    VARLEN,
                )  # fmt: skip
            if kt * BN + BN > doc_len:
                # The tile runs past its document's end: a masked store, not TMA (which would
                # write over the next document's keys).
                gf._store_rows(dk * sm_scale, dk_view, b, kvh, tok, kt * BN, doc_len)
                gf._store_rows(dv, dv_view, b, kvh, tok, kt * BN, doc_len)
            else:
                # K and V are read for the last time above (every MMA waited): their buffers
                # take dK and dV on the way out.
                k_smem.index(WG).store((dk * sm_scale).to(k.dtype))
                v_smem.index(WG).store(dv.to(v.dtype))
                fence_async_shared()
                _, _, dkv_row_b, dkv_col_b, dkv_col_h = dk_view
                col = b * dkv_col_b + kvh * dkv_col_h
                keys = key_lo + kvh * key_stride
                row0 = b * dkv_row_b + tok
                gf._store_kv_tile(dk_desc, row0, col, kt, keys, k_smem.index(WG))
                gf._store_kv_tile(dv_desc, row0, col, kt, keys, v_smem.index(WG))
                tma.store_wait(0)

    @gluon.jit
    def _s2_dkdv_gluon_kernel(
        q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, dk_ptr, dv_ptr, dk_stride, dv_stride,
        lse_desc, delta_desc, stride_lse_b, stride_lse_h, col_ptr, col_split, rows, los, his,
        doc_entries, order, prog_tok, prog_len, stat_tok, n_items, num_k_tiles, seq_k, group,
        qk_scale, sm_scale, q_start, key_lo, key_hi, key_stride, q_row_b, q_col_b, q_col_h,
        kv_row_b, kv_col_b, kv_col_h, dkv_row_b, dkv_col_b, dkv_col_h, kv_group,
        STAGES: gl.constexpr, BLOCK_N: gl.constexpr, VARLEN: gl.constexpr,
    ):  # fmt: skip
        """One program per pair of (batch row, KV head, key tile) items, or of packed-document
        program-map slots: two independent pipelines (a loader warp and a consumer warpgroup
        each), one item each."""
        q_bufs = gl.allocate_shared_memory(
            q_desc.dtype, [NUM_PIPELINES * STAGES] + q_desc.block_type.shape, q_desc.layout
        )
        do_bufs = gl.allocate_shared_memory(
            do_desc.dtype, [NUM_PIPELINES * STAGES] + do_desc.block_type.shape, do_desc.layout
        )
        lse_bufs = gl.allocate_shared_memory(
            lse_desc.dtype, [NUM_PIPELINES * STAGES] + lse_desc.block_type.shape, lse_desc.layout
        )
        delta_bufs = gl.allocate_shared_memory(
            delta_desc.dtype,
            [NUM_PIPELINES * STAGES] + delta_desc.block_type.shape,
            delta_desc.layout,
        )
        # K/V tiles of BLOCK_N keys: the descriptors' boxes, or several boxes of a gathered tile.
        D: gl.constexpr = k_desc.block_type.shape[1]
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_PIPELINES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_PIPELINES, BLOCK_N, D], v_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [NUM_PIPELINES, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(
            gl.int64, [NUM_PIPELINES * STAGES, 1], mbarrier.MBarrierLayout()
        )
        empty = gl.allocate_shared_memory(
            gl.int64, [NUM_PIPELINES * STAGES, 1], mbarrier.MBarrierLayout()
        )
        for s in gl.static_range(NUM_PIPELINES):
            mbarrier.init(kv_bar.index(s), count=1)
        for s in gl.static_range(NUM_PIPELINES * STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        fence_async_shared()
        views = (q_row_b, q_col_b, q_col_h, kv_row_b, kv_col_b, kv_col_h)
        # Packed documents add the program map and the documents' entries to the items (at
        # PROG_TOK .. STAT_TOK): the fixed-length build keeps no document values in registers.
        if VARLEN:
            items = (
                order, n_items, num_k_tiles, seq_k, prog_tok, prog_len, doc_entries, stat_tok
            )  # fmt: skip
        else:
            items = (order, n_items, num_k_tiles, seq_k)
        # dK and dV share their coordinates (the wrapper makes it so), not their row strides.
        dk_view = (dk_ptr, dk_stride, dkv_row_b, dkv_col_b, dkv_col_h)
        dv_view = (dv_ptr, dv_stride, dkv_row_b, dkv_col_b, dkv_col_h)
        loader_args = (
            q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs,
            delta_bufs, k_smem, v_smem, kv_bar, ready, empty, col_ptr, col_split, rows, items,
            group, kv_group, key_lo, key_stride, stride_lse_b, stride_lse_h, views,
        )  # fmt: skip
        consumer_args = (
            dk_desc, dv_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, kv_bar, ready,
            empty, col_ptr, col_split, rows, los, his, items, group, qk_scale, sm_scale,
            q_start, key_lo, key_hi, key_stride, dk_view, dv_view,
        )  # fmt: skip
        # The default partition (this kernel's 4 warps) is consumer 0; then consumer 1 and the
        # two loaders, with their register budgets. The pipeline index (last argument) reaches
        # a partition as a run-time value: it only selects buffers, barriers and the item.
        gl.warp_specialize(
            [
                (_consumer, consumer_args + (gl.to_tensor(0),)),
                (_consumer, consumer_args + (gl.to_tensor(1),)),
                (_loader, loader_args + (gl.to_tensor(0),)),
                (_loader, loader_args + (gl.to_tensor(1),)),
            ],
            [CONSUMER_WARPS, LOADER_WARPS, LOADER_WARPS],
            [CONSUMER_REGS, LOADER_REGS, LOADER_REGS],
        )


@functools.cache
def _row_stats_layout():
    """Shared-memory layout of one query tile's per-row statistics (``TILE_M`` fp32)."""
    return gl.NVMMASharedLayout.get_default_for([TILE_M], gl.float32)


def document_aligned_stats(varlen, prog_tok: torch.Tensor, *stats: torch.Tensor):
    """Per-row statistics of packed documents (``[1, hq, total]`` fp32 each) copied so that
    every document starts at a multiple of 16 bytes, as a TMA box must (a document's rows
    start anywhere in the flat ``[hq, total]``: at an odd token, or a head's row of an odd
    total). Returns ``(stat_tok, *padded)``: int32 ``[slots]``, the first row of each
    program-map slot's document (``prog_tok``'s) in the padded ``[1, hq, length]`` copies.
    Torch ops on the device, no host sync."""
    align = gf.STAT_ALIGN
    cu = varlen.cu_seqlens.long()
    starts = cu[:-1]
    num_docs = starts.numel()
    # Each document's start rounded up, plus one aligned gap per earlier document: the starts
    # stay aligned, and each document ends before the next one starts.
    aligned = (starts + align - 1) // align * align
    aligned += align * torch.arange(num_docs, device=cu.device)
    length = gf.document_aligned_length(varlen.total_tokens, num_docs)
    tokens = torch.arange(varlen.total_tokens, device=cu.device)
    # right=True: the last document starting at or before a token (empty ones share starts).
    doc = torch.searchsorted(starts, tokens, right=True) - 1
    rows = tokens - starts[doc] + aligned[doc]
    padded = []
    for x in stats:
        out = x.new_zeros(x.shape[0], x.shape[1], length)
        padded.append(out.index_copy_(2, rows, x))
    slot_doc = torch.searchsorted(starts, prog_tok.long(), right=True) - 1
    stat_tok = aligned[slot_doc.clamp(0, num_docs - 1)].to(torch.int32)
    return (stat_tok, *padded)


def _row_stats_descriptor(stat: torch.Tensor):
    """A TMA descriptor of per-row statistics ``[b, hq, s]`` (fp32, contiguous) read
    ``TILE_M`` rows at a time: the LSE and delta of one query tile."""
    flat = stat.reshape(-1)
    if flat.data_ptr() % gf.TMA_ALIGN_BYTES:  # TMA reads from 16-byte aligned addresses
        flat = flat.clone()
    return gf.TensorDescriptor.from_tensor(flat, [TILE_M], _row_stats_layout())


def s2_dkdv_gluon(
    do, q, k, v, lse, delta, pattern, scale: float, lay=None, q_start: int = 0, keys=None,
    varlen=None,
):  # fmt: skip
    """The dK/dV pass through the Gluon kernel: ``do`` and ``q [b, s, hq, d]``, ``k, v [b, sk,
    hkv, d]`` (bf16/fp16 on an sm_90 GPU, any strides: those :func:`gluon_forward.tma_view`
    cannot read are copied), ``lse`` and ``delta [b, hq, s]`` fp32 contiguous; the queries are
    positions ``q_start = sk - s ..`` (:func:`gluon_forward.s2_forward_gluon`). ``lay``: the
    pattern's CSC layout at ``TILE_M`` x ``BLOCK_N`` tiles (built when None). ``keys``:
    gathered key tiles (blocks 16 and 32), as :func:`gluon_forward.s2_forward_gluon` takes
    them: dK/dV then come per query head, ``[b, sk, hq, d]``, each rounded to k's dtype (the
    caller sums each KV group's heads). ``varlen``: packed documents (a
    ``tl_kernels.Varlen``, ``b = 1``; blocks 64 and 128). Returns ``dk, dv`` like k and v
    (zero on keys no query attends). The caller checks :func:`gluon_forward.unsupported_reason`."""
    b, s, hq, d = q.shape
    gf.check_chunk("s2_dkdv_gluon", q, k, q_start)
    if varlen is not None and b != 1:
        raise ValueError(f"s2_dkdv_gluon: packed documents are one batch row (b = 1), got b = {b}")
    gf.gathered_keys.check_call("s2_dkdv_gluon", keys, pattern, hq, k.shape[1], lay)
    # 64-key tiles (check_call let through only blocks 64 and 128, or 16 and 32 with keys): a
    # block of 64, half a block of 128, or a gathered tile of 16/32-key boxes.
    box = min(pattern.block_size, BLOCK_N)
    kv_group = 1  # query heads per item whose K/V is one KV head: the layout's group does it
    if keys is not None:
        lay = keys.layout(TILE_M, with_csc=True, q_start=q_start)
        kv_group = pattern.group_size  # an item is one query head's gathered tile
    if lay is None and varlen is not None:
        lay = varlen.layout(pattern, TILE_M, BLOCK_N, q.device, with_csc=True)
    if lay is None:
        lay = layout_for(
            pattern, s, k.shape[1], q_start, 0, TILE_M, BLOCK_N, q.device, with_csc=True
        )
    if lay.block_m != TILE_M or lay.block_n != BLOCK_N or lay.col_ptr is None:
        raise ValueError(
            f"s2_dkdv_gluon: needs a CSC layout of {TILE_M} x {BLOCK_N} tiles, got "
            f"{lay.block_m} x {lay.block_n}"
        )
    if kv_group == 1:
        dk, dv = torch.empty_like(k), torch.empty_like(v)  # k's layout where k is dense
    else:
        dk = torch.empty(b, k.shape[1], hq, d, dtype=k.dtype, device=k.device)
        dv = torch.empty_like(dk)
    views = {}
    # One set of coordinates serves Q and dO, one K and V.
    *_, views["q"], views["do"] = gf.paired_tma_views(q, do)
    *_, views["k"], views["v"] = gf.paired_tma_views(k, v)
    views["dk"], views["dv"] = gf.tma_view(dk), gf.tma_view(dv)
    if views["dk"] is None or views["dv"] is None or views["dk"][1:] != views["dv"][1:]:
        dk = torch.empty(dk.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(dv.shape, dtype=v.dtype, device=v.device)
        views["dk"], views["dv"] = gf.tma_view(dk), gf.tma_view(dv)
    n_items = lay.kv_order.numel()
    if varlen is None:
        order = lay.kv_order
        prog_tok = prog_len = doc_entries = order  # unread
    else:
        n_items, order, prog_tok, prog_len = varlen.programs(lay, kv=True)
        doc_entries = document_column_entries(lay, order, prog_len)
    if n_items == 0:
        return dk.zero_(), dv.zero_()
    # Read flat, a query tile at a time. The LSE goes in log2 units, with the rows that attend
    # nothing (lse = -inf) at 0 so that their p is 0, not NaN: done here once, not per key tile
    # in every step of the kernel, where it sat between the ring's wait and the step's MMAs.
    lse = torch.where(torch.isneginf(lse), 0.0, lse * LOG2E).contiguous()
    delta = delta.contiguous()
    stat_tok = order  # unread
    if varlen is not None:
        stat_tok, lse, delta = document_aligned_stats(varlen, prog_tok, lse, delta)
    n_pairs = -(-n_items // PIPELINES)

    def desc(name, rows):
        return gf._descriptor(views[name], rows, d)

    _s2_dkdv_gluon_kernel[(n_pairs * b,)](
        desc("q", TILE_M),
        desc("do", TILE_M),
        desc("k", box),
        desc("v", box),
        desc("dk", box),
        desc("dv", box),
        views["dk"].matrix,
        views["dv"].matrix,
        views["dk"].matrix.stride(0),
        views["dv"].matrix.stride(0),
        _row_stats_descriptor(lse),
        _row_stats_descriptor(delta),
        lse.stride(0),
        lse.stride(1),
        lay.col_ptr,
        lay.col_split,
        *full_descending_columns(lay),
        doc_entries,
        order,
        prog_tok,
        prog_len,
        stat_tok,
        n_items,
        lay.num_k_tiles,
        k.shape[1],
        lay.group,
        scale * LOG2E,
        scale,
        q_start,
        *gf.key_arrays(keys, lay.lo_c),
        *views["q"][1:],
        *views["k"][1:],
        *views["dk"][1:],
        kv_group,
        STAGES=NUM_STAGES,
        BLOCK_N=BLOCK_N,
        VARLEN=varlen is not None,
        num_warps=gf.WARPGROUP_WARPS,
    )
    return dk, dv


def compile_for_sm90(head_dim: int, block: int, out_dir: str, varlen: bool = False) -> dict:
    """As :func:`gluon_forward.compile_for_sm90`, for this kernel (``varlen``: its
    packed-documents build)."""
    tiles = {"q_desc": TILE_M, "do_desc": TILE_M}
    # TMA boxes of a pattern block, at most a 64-key tile (half a block of 128).
    tiles.update({n: min(block, BLOCK_N) for n in ("k_desc", "v_desc", "dk_desc", "dv_desc")})
    stat_desc = f"tensordesc<fp32[{TILE_M}],{_row_stats_layout()!r}>"
    types = {"lse_desc": stat_desc, "delta_desc": stat_desc, "qk_scale": "fp32", "sm_scale": "fp32"}
    lists = ("col_ptr", "col_split", "rows", "los", "his", "doc_entries", "order", "key_lo")
    types.update({n: "*i32" for n in lists + ("key_hi", "prog_tok", "prog_len", "stat_tok")})
    types.update(dk_ptr="*bf16", dv_ptr="*bf16")
    return gf.compile_kernel_for_sm90(
        _s2_dkdv_gluon_kernel,
        head_dim,
        tiles,
        types,
        NUM_STAGES,
        os.path.join(out_dir, f"dkdv_d{head_dim}_n{block}" + ("_varlen" if varlen else "")),
        block_n=BLOCK_N,
        VARLEN=varlen,
    )


def emulate_dkdv(
    do, q, k, v, lse, delta, pattern, scale: float, q_start: int = 0, keys=None, varlen=None
):  # fmt: skip
    """The kernel's schedule in float64 PyTorch on any device: same CSC arrays, programs of two
    items (with ``varlen``, the program map's slots and each document's run of entries), head
    loop, full/partial entries, masks, reads past a document's end (the next document's rows,
    zeros past the tensor's; LSE and delta read flat, as the kernel's TMA does) and stores of
    only the document's keys. Shapes, ``q_start``, ``keys`` and ``varlen`` as
    :func:`s2_dkdv_gluon`; returns ``(dk, dv)`` in float64 (per query head with ``keys``)."""
    b, s, hq, d = q.shape
    bn = BLOCK_N
    kv_group = 1
    if keys is not None:
        lay = keys.layout(TILE_M, with_csc=True, q_start=q_start)
        kv_group = pattern.group_size
    elif varlen is not None:
        lay = varlen.layout(pattern, TILE_M, bn, q.device, with_csc=True)
    else:
        lay = layout_for(pattern, s, k.shape[1], q_start, 0, TILE_M, bn, q.device, with_csc=True)
    qk_scale = scale * LOG2E
    out_shape = k.shape if keys is None else (b, k.shape[1], hq, d)
    dk = torch.zeros(out_shape, dtype=torch.float64)
    dv = torch.zeros(out_shape, dtype=torch.float64)
    col_ptr, col_split = lay.col_ptr.tolist(), lay.col_split.tolist()
    rows, los, his = (x.tolist() for x in full_descending_columns(lay))
    runs = stat_tok = None
    if varlen is not None:  # each slot's run of entries and statistics, as the wrapper's
        _, item_of, tok_of, len_of = varlen.programs(lay, kv=True)
        runs = document_column_entries(lay, item_of, len_of).tolist()
        stat_tok, lse, delta = document_aligned_stats(varlen, tok_of, lse, delta)
        stat_tok = stat_tok.tolist()
    offs_m = torch.arange(TILE_M)
    flat_lse, flat_delta = lse.reshape(-1), delta.reshape(-1)
    for bb, item, slot, tok, n in gf.emulated_work(lay, b, k.shape[1], varlen, kv=True):
        kvh, kt = item // lay.num_k_tiles, item % lay.num_k_tiles
        k_abs = kt * bn + torch.arange(bn)
        k_rows = tok + gf.emulated_key_rows(keys, kvh, k_abs)
        kk = gf.emulated_rows(k, bb, k_rows, kvh // kv_group)
        vv = gf.emulated_rows(v, bb, k_rows, kvh // kv_group)
        acc_k = torch.zeros(bn, d, dtype=torch.float64)
        acc_v = torch.zeros(bn, d, dtype=torch.float64)
        for g in range(lay.group):
            h = kvh * lay.group + g
            c = h * lay.num_k_tiles + kt
            first, split, end = col_ptr[c], col_split[c], col_ptr[c + 1]
            if runs is not None:
                first, end = runs[slot][g]
            for e in range(first, end):
                m_idx = rows[e] * TILE_M + offs_m
                qq = gf.emulated_rows(q, bb, tok + m_idx, h)
                dd = gf.emulated_rows(do, bb, tok + m_idx, h)
                row0 = tok if stat_tok is None else stat_tok[slot]
                stat = bb * lse.stride(0) + h * lse.stride(1) + row0 + m_idx
                row_lse = _flat_rows(flat_lse, stat)
                row_lse = torch.where(row_lse == -math.inf, 0.0, row_lse)
                row_delta = _flat_rows(flat_delta, stat)
                st = (kk @ qq.T) * qk_scale - row_lse[None, :] * LOG2E
                # Partial entries are masked, and so is a document's last query tile when it
                # runs past the document's end (then its first entry).
                crosses = runs is not None and e == first < split and (rows[e] + 1) * TILE_M > n
                if e >= split or crosses:  # S^T: the queries' mask, transposed
                    m_abs = q_start + m_idx
                    hi = his[e] if runs is None else min(his[e], q_start + n)
                    st = gf.emulated_mask_rows(st.T, los[e], hi, m_abs, keys, h, k_abs).T
                pt = torch.exp2(st)
                acc_v += pt @ dd
                acc_k += (pt * (vv @ dd.T - row_delta[None, :])) @ qq
        # As the kernel: a tile inside its sequence or document stores all its keys (TMA), one
        # across a document's end only the document's (a masked store).
        keep = slice(None) if kt * bn + bn <= n else k_abs < n
        dk[bb, k_rows[keep], kvh] = acc_k[keep] * scale
        dv[bb, k_rows[keep], kvh] = acc_v[keep]
    return dk, dv


def _flat_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` of a flat fp32 array in float64, zeros past its end (what TMA gives)."""
    inside = idx < x.numel()
    return torch.where(inside, x[torch.where(inside, idx, 0)].double(), 0.0)
