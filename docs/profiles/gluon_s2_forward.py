"""The S2 forward in Gluon, FlashAttention-3-shaped, for the H100 (issue 13). An experiment, not
part of ``s2attn``: it runs the same tile lists as ``kernels/triton_attention.py``'s
``_s2_fwd_kernel`` (``s2attn.layout.layout_for``, 128-row query tiles) through Hopper's
producer/consumer schedule, which plain ``triton.language`` 3.6 does not compile for sm_90:

* one loader warp walks the item's key-tile list (``cols[row_ptr[item] .. row_ptr[item+1]]``)
  and issues TMA loads of each K and V tile into a ``NUM_STAGES`` ring of shared-memory buffers,
  each guarded by a ``ready`` mbarrier (TMA landed) and an ``empty`` one (both consumers done);
* two consumer warpgroups each own 64 rows of the 128-row query tile and run ``S = Q K^T``
  (async wgmma from shared memory), the online softmax in registers, and ``O += P V`` (wgmma
  with P in registers); full entries (``row_ptr .. row_split``) skip the mask, partial ones
  apply the causal bound and the entry's ``[lo, hi)`` query range, as the Triton kernel does;
* the epilogue writes the LSE (natural log, ``-inf`` for rows that attend nothing) and the
  output through shared memory and a TMA store.

Limits of the experiment (the wrapper checks them): self-attention (``q_start = k_start = 0``,
equal lengths) on contiguous ``[b, s, h, d]`` bf16/fp16 tensors, ``s`` a multiple of 128,
``d`` 64 or 128, the key tile equal to the pattern's block size (64 or 128), GQA allowed.

    python docs/profiles/gluon_s2_forward.py            # with a GPU: check, then time
    python docs/profiles/gluon_s2_forward.py --compile  # without one: sm_90 compile only

On a GPU it compares the output and LSE with ``s2attn``'s Triton forward and a float32
PyTorch reference (fresh random inputs, the real softmax scale), then times both kernels with
``triton.testing.do_bench`` and prints effective TFLOP/s over attended pairs. Without one it
compiles for sm_90 (Triton 3.6, ``GPUTarget("cuda", 90, 32)``) and prints the HGMMA count,
registers and shared memory (the recipe of the skeleton it grew from, commit a0f550f).
"""

import argparse
import functools
import math
import os
import re
import subprocess
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LN2 = math.log(2.0)
WG_ROWS = 64  # query rows per consumer warpgroup: one wgmma M extent of 4 warps
NUM_CONSUMERS = 2  # warpgroups sharing each K/V tile; the query tile is their rows together
TILE_M = WG_ROWS * NUM_CONSUMERS  # the s2attn layout's block_m
NUM_STAGES = 2  # K/V ring depth: 2 x (K + V) tiles of 128 x 128 bf16 is 128 KiB
# Register budgets after warp specialization: the consumers hold S, P and O in registers, the
# loader only addresses (setmaxnreg moves the rest to the consumers).
CONSUMER_REGS = gl.constexpr(240)
LOADER_REGS = gl.constexpr(24)


@gluon.jit
def _item_of_program(order, n_items, num_q_tiles):
    """(batch row, head, query tile, layout item) of this program: every batch row runs
    through ``order`` (heaviest items first), as in the Triton kernel."""
    pid = gl.program_id(0)
    item = gl.load(order + pid % n_items)
    return pid // n_items, item // num_q_tiles, item % num_q_tiles, item


@gluon.jit
def _loader(
    q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, row_ptr, cols, order,
    n_items, seq, num_q_tiles, group,
):  # fmt: skip
    BM: gl.constexpr = q_smem.type.shape[1]
    BN: gl.constexpr = k_bufs.type.shape[1]
    D: gl.constexpr = k_bufs.type.shape[2]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    b, h, qt, item = _item_of_program(order, n_items, num_q_tiles)
    row0 = b * seq  # the sequence's first row in the [b * s, heads * d] view
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0 + qt * 2 * BM, h * D], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(
        q_desc, [row0 + qt * 2 * BM + BM, h * D], q_bar, q_smem.index(1)
    )
    e0 = gl.load(row_ptr + item)
    e2 = gl.load(row_ptr + item + 1)
    kv_col = (h // group) * D
    for e in range(e0, e2):
        i = e - e0
        stage = i % STAGES
        # A stage is free once both consumers released its previous use; the first pass waits
        # on the phase before the barrier's first, which has completed.
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
        kt = gl.load(cols + e)
        mbarrier.expect(ready.index(stage), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            k_desc, [row0 + kt * BN, kv_col], ready.index(stage), k_bufs.index(stage)
        )
        tma.async_copy_global_to_shared(
            v_desc, [row0 + kt * BN, kv_col], ready.index(stage), v_bufs.index(stage)
        )


@gluon.jit
def _consume_tiles(
    q, k_bufs, v_bufs, ready, empty, acc, m_i, l_i, q_abs, offs_n, cols, los, his, e_begin,
    e_end, e0, qk_scale, MASKED: gl.constexpr,
):  # fmt: skip
    """Entries ``e_begin .. e_end`` of the item's list (ring position counted from ``e0``)."""
    BM: gl.constexpr = q.type.shape[0]
    BN: gl.constexpr = k_bufs.type.shape[1]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
    )
    o_layout: gl.constexpr = acc.type.layout
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    for e in range(e_begin, e_end):
        i = e - e0
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        s_tok = warpgroup_mma(
            q,
            k_bufs.index(stage).permute((1, 0)),
            gl.zeros([BM, BN], gl.float32, s_layout),
            use_acc=False,
            is_async=True,
        )
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,)) * qk_scale
        if MASKED:
            kt = gl.load(cols + e)
            lo = gl.load(los + e)
            hi = gl.load(his + e)
            n_abs = kt * BN + offs_n
            ok = (n_abs[None, :] <= q_abs[:, None]) & (q_abs[:, None] >= lo) & (q_abs[:, None] < hi)
            s = gl.where(ok, s, -float("inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # A row with nothing allowed yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
        p = gl.exp2(s - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(q.dtype), p_layout)
        o_tok = warpgroup_mma(p_op, v_bufs.index(stage), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
        mbarrier.arrive(empty.index(stage), count=1)
        m_i = m_new
    return acc, m_i, l_i


@gluon.jit
def _consumer(
    q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_smem, LSE, stride_lse_b, stride_lse_h,
    row_ptr, row_split, cols, los, his, order, n_items, num_q_tiles, qk_scale, WG: gl.constexpr,
):  # fmt: skip
    # Sizes from the shared-memory types: constexprs passed to a worker arrive as tensors.
    BM: gl.constexpr = q_smem.type.shape[1]
    BN: gl.constexpr = k_bufs.type.shape[1]
    D: gl.constexpr = k_bufs.type.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16]
    )
    b, h, qt, item = _item_of_program(order, n_items, num_q_tiles)
    e0 = gl.load(row_ptr + item)
    e1 = gl.load(row_split + item)
    e2 = gl.load(row_ptr + item + 1)
    q_abs = qt * 2 * BM + WG * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BM], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.full([BM], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BM, D], gl.float32, o_layout)
    mbarrier.wait(q_bar, 0)
    q = q_smem.index(WG)
    acc, m_i, l_i = _consume_tiles(
        q, k_bufs, v_bufs, ready, empty, acc, m_i, l_i, q_abs, offs_n, cols, los, his,
        e0, e1, e0, qk_scale, False,
    )  # fmt: skip
    acc, m_i, l_i = _consume_tiles(
        q, k_bufs, v_bufs, ready, empty, acc, m_i, l_i, q_abs, offs_n, cols, los, his,
        e1, e2, e0, qk_scale, True,
    )  # fmt: skip
    nothing = l_i == 0.0
    l_safe = gl.where(nothing, 1.0, l_i)
    lse = gl.where(nothing, -float("inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    gl.store(LSE + b * stride_lse_b + h * stride_lse_h + q_abs, lse)
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    o_smem.index(WG).store(out.to(o_smem.dtype))
    fence_async_shared()


# The three partitions take one argument list (the kernel's, with the shared-memory buffers and
# barriers); each uses what it needs.
@gluon.jit
def _consumer0(
    q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_smem, LSE,
    stride_lse_b, stride_lse_h, row_ptr, row_split, cols, los, his, order, n_items, seq,
    num_q_tiles, group, qk_scale,
):  # fmt: skip
    _consumer(
        q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_smem, LSE, stride_lse_b, stride_lse_h,
        row_ptr, row_split, cols, los, his, order, n_items, num_q_tiles, qk_scale, 0,
    )  # fmt: skip


@gluon.jit
def _consumer1(
    q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_smem, LSE,
    stride_lse_b, stride_lse_h, row_ptr, row_split, cols, los, his, order, n_items, seq,
    num_q_tiles, group, qk_scale,
):  # fmt: skip
    _consumer(
        q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_smem, LSE, stride_lse_b, stride_lse_h,
        row_ptr, row_split, cols, los, his, order, n_items, num_q_tiles, qk_scale, 1,
    )  # fmt: skip


@gluon.jit
def _loader_worker(
    q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_smem, LSE,
    stride_lse_b, stride_lse_h, row_ptr, row_split, cols, los, his, order, n_items, seq,
    num_q_tiles, group, qk_scale,
):  # fmt: skip
    _loader(
        q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, row_ptr, cols,
        order, n_items, seq, num_q_tiles, group,
    )  # fmt: skip


@gluon.jit
def s2_fwd_gluon_kernel(
    q_desc, k_desc, v_desc, o_desc, LSE, stride_lse_b, stride_lse_h, row_ptr, row_split, cols,
    los, his, order, n_items, seq, num_q_tiles, group, qk_scale, STAGES: gl.constexpr,
):  # fmt: skip
    """One program per (batch row, layout item): a 128-row query tile of one head."""
    BM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(
        k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout
    )
    v_bufs = gl.allocate_shared_memory(
        v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout
    )
    o_smem = gl.allocate_shared_memory(o_desc.dtype, [2] + o_desc.block_type.shape, o_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumer warpgroups release a stage
    fence_async_shared()
    args = (
        q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_smem, LSE,
        stride_lse_b, stride_lse_h, row_ptr, row_split, cols, los, his, order, n_items, seq,
        num_q_tiles, group, qk_scale,
    )  # fmt: skip
    # The default partition (this kernel's 4 warps) is consumer 0; then consumer 1 (4 warps) and
    # the loader (1 warp), with their register budgets.
    gl.warp_specialize(
        [(_consumer0, args), (_consumer1, args), (_loader_worker, args)],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )
    b, h, qt, item = _item_of_program(order, n_items, num_q_tiles)
    row = b * seq + qt * 2 * BM
    tma.async_copy_shared_to_global(o_desc, [row, h * D], o_smem.index(0))
    tma.async_copy_shared_to_global(o_desc, [row + BM, h * D], o_smem.index(1))
    tma.store_wait(0)


def _gl_dtype(torch_dtype):
    import torch

    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[torch_dtype]


def gluon_s2_forward(q, k, v, pattern, scale):
    """S2 forward through the Gluon kernel. q ``[b, s, hq, d]``, k/v ``[b, s, hkv, d]``,
    contiguous bf16/fp16 on an sm_90 GPU; returns ``out`` like q and ``lse [b, hq, s]`` fp32
    (natural log). Raises ``ValueError`` for shapes outside the experiment's limits."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from s2attn.layout import layout_for

    b, s, hq, d = q.shape
    hkv = k.shape[2]
    bn = pattern.block_size
    problems = []
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        problems.append(f"dtype {q.dtype}: bf16 or fp16 (all three alike)")
    if k.shape != (b, s, hkv, d) or v.shape != k.shape:
        problems.append("k and v [b, s, hkv, d] with q's b, s and d (self-attention)")
    if s % TILE_M:
        problems.append(f"sequence length {s}: a multiple of {TILE_M}")
    if d not in (64, 128):
        problems.append(f"head_dim {d}: 64 or 128")
    if bn not in (64, 128):
        problems.append(f"block_size {bn}: 64 or 128")
    if hq % hkv:
        problems.append(f"query heads {hq}: a multiple of the KV heads {hkv}")
    elif (hq, hq // hkv) != (pattern.local_num_heads, pattern.group_size):
        problems.append(
            f"heads {hq}/{hkv}: the pattern's {pattern.local_num_heads} query heads in groups of "
            f"{pattern.group_size}"
        )
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        problems.append("q, k, v contiguous [b, s, h, d]")
    if problems:
        raise ValueError("gluon_s2_forward: " + "; ".join(problems))
    lay = layout_for(pattern, s, s, 0, 0, TILE_M, bn, q.device)
    if lay.block_m != TILE_M:
        raise ValueError(f"gluon_s2_forward: the pattern needs {lay.block_m}-row query tiles")
    out = torch.empty_like(q)
    lse = torch.empty((b, hq, s), device=q.device, dtype=torch.float32)
    gdt = _gl_dtype(q.dtype)

    def desc(t, heads, rows):
        block = [rows, d]
        layout = gl.NVMMASharedLayout.get_default_for(block, gdt)
        return TensorDescriptor.from_tensor(t.view(b * s, heads * d), block, layout)

    n_items = lay.q_order.numel()
    s2_fwd_gluon_kernel[(n_items * b,)](
        desc(q, hq, WG_ROWS),
        desc(k, hkv, bn),
        desc(v, hkv, bn),
        desc(out, hq, WG_ROWS),
        lse,
        lse.stride(0),
        lse.stride(1),
        lay.row_ptr,
        lay.row_split,
        lay.cols,
        lay.lo,
        lay.hi,
        lay.q_order,
        n_items,
        s,
        lay.num_q_tiles,
        lay.group,
        scale / LN2,
        STAGES=NUM_STAGES,
        num_warps=4,
    )
    return out, lse


def emulate_s2_forward(q, k, v, pattern, scale):
    """The kernel's schedule in float64 PyTorch on any device: the same layout arrays, program
    order, warpgroup split of each 128-row tile, full/partial entry split, masks and online
    softmax (base 2), so that its index logic is checked where no GPU is (``--emulate``)."""
    import torch

    from s2attn.layout import layout_for

    b, s, hq, d = q.shape
    bn = pattern.block_size
    lay = layout_for(pattern, s, s, 0, 0, TILE_M, bn, q.device)
    qk_scale = scale / LN2
    out = torch.zeros(b, s, hq, d, dtype=torch.float64)
    lse = torch.empty(b, hq, s, dtype=torch.float64)
    row_ptr, row_split = lay.row_ptr.tolist(), lay.row_split.tolist()
    cols, los, his = lay.cols.tolist(), lay.lo.tolist(), lay.hi.tolist()
    n_items = lay.q_order.numel()
    order = lay.q_order.tolist()
    offs_n = torch.arange(bn)
    for pid in range(n_items * b):
        item = order[pid % n_items]
        bb, h, qt = pid // n_items, item // lay.num_q_tiles, item % lay.num_q_tiles
        kvh = h // lay.group
        e0, e1, e2 = row_ptr[item], row_split[item], row_ptr[item + 1]
        for wg in range(NUM_CONSUMERS):
            q_abs = qt * TILE_M + wg * WG_ROWS + torch.arange(WG_ROWS)
            qq = q[bb, q_abs, h].double()
            m_i = torch.full((WG_ROWS,), -math.inf, dtype=torch.float64)
            l_i = torch.zeros(WG_ROWS, dtype=torch.float64)
            acc = torch.zeros(WG_ROWS, d, dtype=torch.float64)
            for e in range(e0, e2):
                kt = cols[e]
                keys = kt * bn + offs_n
                sc = (qq @ k[bb, keys, kvh].double().T) * qk_scale
                if e >= e1:
                    ok = (
                        (keys[None, :] <= q_abs[:, None])
                        & (q_abs[:, None] >= los[e])
                        & (q_abs[:, None] < his[e])
                    )
                    sc = sc.masked_fill(~ok, -math.inf)
                m_new = torch.maximum(m_i, sc.max(1).values)
                m_use = torch.where(m_new == -math.inf, 0.0, m_new)
                p = torch.exp2(sc - m_use[:, None])
                alpha = torch.exp2(m_i - m_use)
                l_i = l_i * alpha + p.sum(1)
                acc = acc * alpha[:, None] + p @ v[bb, keys, kvh].double()
                m_i = m_new
            nothing = l_i == 0
            l_safe = torch.where(nothing, 1.0, l_i)
            lse[bb, h, q_abs] = torch.where(nothing, -math.inf, (m_i + torch.log2(l_safe)) * LN2)
            out[bb, q_abs, h] = acc / l_safe[:, None]
    return out, lse


def _emulate():
    import torch

    import s2attn

    torch.manual_seed(0)
    shapes = [  # (batch, seq, q heads, kv heads, head_dim, block, local, stride)
        (2, 512, 4, 4, 16, 64, 2, 4),
        (1, 1024, 8, 2, 16, 64, 4, 8),
        (1, 768, 4, 4, 16, 128, 2, 2),
        (1, 512, 2, 2, 16, 64, 16, 1),  # dense causal
    ]
    for bsz, s, hq, hkv, d, blk, loc, vs in shapes:
        pattern = s2attn.S2Pattern(
            num_heads=hq, num_kv_heads=hkv, block_size=blk, local_blocks=loc, vert_stride=vs
        )
        q, k, v = (torch.randn(bsz, s, h, d, dtype=torch.float64) for h in (hq, hkv, hkv))
        out, lse = emulate_s2_forward(q, k, v, pattern, d**-0.5)
        ref, ref_lse = s2attn.s2_attention_reference(q, k, v, pattern, d**-0.5, return_lse=True)
        err = (out - ref).abs().max().item()
        lse_err = (lse - ref_lse).abs().max().item()
        print(f"b{bsz} s{s} h{hq}/{hkv} block{blk} L{loc} V{vs}: out {err:.1e}, lse {lse_err:.1e}")
        if not (err < 1e-10 and lse_err < 1e-5):  # the reference returns its LSE in fp32
            sys.exit("emulated schedule differs from the reference")


def _check_and_time():
    import torch
    from triton.testing import do_bench

    import s2attn
    from s2attn import s2_attention_reference, triton_attention

    torch.manual_seed(0)
    dev = "cuda"
    shapes = [  # (batch, seq, q heads, kv heads, head_dim, block, local, stride)
        (2, 1024, 4, 4, 64, 64, 4, 4),
        (1, 2048, 8, 2, 128, 64, 4, 8),
        (1, 1536, 4, 4, 128, 128, 2, 4),
        (1, 2048, 4, 4, 128, 64, 16, 1),  # dense causal
    ]
    ok = True
    for bsz, s, hq, hkv, d, blk, loc, vs in shapes:
        pattern = s2attn.S2Pattern(
            num_heads=hq, num_kv_heads=hkv, block_size=blk, local_blocks=loc, vert_stride=vs
        )
        q = torch.randn(bsz, s, hq, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(bsz, s, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(bsz, s, hkv, d, device=dev, dtype=torch.bfloat16)
        scale = d**-0.5
        out, lse = gluon_s2_forward(q, k, v, pattern, scale)
        ref_out, ref_lse = s2_attention_reference(
            q.float(), k.float(), v.float(), pattern, scale, return_lse=True
        )
        tl_out, _ = triton_attention.s2_forward(q, k, v, pattern, scale, 0, 0)
        err = (out.float() - ref_out).abs().max().item()
        tl_err = (tl_out.float() - ref_out).abs().max().item()
        lse_err = (lse - ref_lse).abs().max().item()
        good = err <= 2 * tl_err + 1e-2 and lse_err <= 1e-2 and torch.isfinite(out).all().item()
        ok &= good
        print(
            f"b{bsz} s{s} h{hq}/{hkv} d{d} block{blk} L{loc} V{vs}: max|out-ref| gluon {err:.3e}"
            f" triton {tl_err:.3e}, max|lse-ref| {lse_err:.3e}: {'OK' if good else 'FAIL'}"
        )
    if not ok:
        sys.exit("gluon_s2_forward: mismatch")
    # Issue 13's shapes: 128k tokens a call, 32 query heads, head_dim 128, block 64, window 16.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for s in (32768, 131072):
        bsz, hq, d = 131072 // s, 32, 128
        for hkv, vs, name in ((32, 8, "S2"), (8, 8, "S2, GQA 32/8"), (32, 1, "dense causal")):
            pattern = s2attn.S2Pattern(
                num_heads=hq, num_kv_heads=hkv, block_size=64, local_blocks=16, vert_stride=vs
            )
            q, k, v = (
                torch.randn(bsz, s, h, d, device=dev, dtype=torch.bfloat16) for h in (hq, hkv, hkv)
            )
            flops = 4 * d * pattern.attended_pairs(s) * bsz  # forward: QK^T and PV, 2 flops each
            args = (q, k, v, pattern, d**-0.5)
            g = do_bench(functools.partial(gluon_s2_forward, *args), warmup=25, rep=200)
            t = do_bench(
                functools.partial(triton_attention.s2_forward, *args, 0, 0), warmup=25, rep=200
            )
            print(
                f"seq {s} {name}: gluon {g:.2f} ms ({flops / g / 1e9:.0f} TF/s), "
                f"triton {t:.2f} ms ({flops / t / 1e9:.0f} TF/s)"
            )
        # The dense rate to aim at: cuDNN's causal forward, as SDPA runs it ([b, h, s, d]).
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            sdpa = torch.nn.functional.scaled_dot_product_attention
            c = do_bench(functools.partial(sdpa, qt, kt, vt, is_causal=True), warmup=25, rep=200)
        print(f"seq {s} dense causal: cuDNN {c:.2f} ms ({flops / c / 1e9:.0f} TF/s)")


def _compile_only(out_dir="out"):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def dsig(block):
        lay = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        return f"tensordesc<bf16[{block[0]}, {block[1]}],{lay!r}>"

    for d, bn in ((128, 64), (128, 128), (64, 64)):
        sig = {
            "q_desc": dsig([WG_ROWS, d]),
            "k_desc": dsig([bn, d]),
            "v_desc": dsig([bn, d]),
            "o_desc": dsig([WG_ROWS, d]),
            "LSE": "*fp32",
            "stride_lse_b": "i32",
            "stride_lse_h": "i32",
            "row_ptr": "*i32",
            "row_split": "*i32",
            "cols": "*i32",
            "los": "*i32",
            "his": "*i32",
            "order": "*i32",
            "n_items": "i32",
            "seq": "i32",
            "num_q_tiles": "i32",
            "group": "i32",
            "qk_scale": "fp32",
            "STAGES": "constexpr",
        }
        src = GluonASTSource(s2_fwd_gluon_kernel, signature=sig, constexprs={"STAGES": NUM_STAGES})
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        os.makedirs(out_dir, exist_ok=True)
        stem = f"{out_dir}/s2_fwd_gluon_d{d}_n{bn}"
        open(f"{stem}.cubin", "wb").write(ck.asm["cubin"])
        bind = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
        sass = subprocess.run(
            [f"{bind}/cuobjdump", "-sass", f"{stem}.cubin"], capture_output=True, text=True
        ).stdout
        usage = subprocess.run(
            [f"{bind}/cuobjdump", "-res-usage", f"{stem}.cubin"], capture_output=True, text=True
        ).stdout.strip()
        regs = re.findall(r"REG:(\d+)", usage)
        maxnreg = sorted(
            set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+\d+", ck.asm["ptx"]))
        )
        print(
            f"d {d}, key tile {bn}: HGMMA {sass.count('HGMMA')}, warps {ck.metadata.num_warps}, "
            f"shared {ck.metadata.shared} B, registers {regs[-1] if regs else '?'}, "
            f"setmaxnreg {maxnreg}"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", action="store_true", help="compile for sm_90 only (no GPU)")
    ap.add_argument(
        "--emulate", action="store_true", help="the kernel's schedule in float64 on the CPU"
    )
    args = ap.parse_args()
    if args.compile:
        _compile_only()
    elif args.emulate:
        _emulate()
    else:
        _check_and_time()
