"""The S2 forward for Hopper (sm_90) in Triton's Gluon dialect, FlashAttention-3-shaped.

It runs the same tile lists as ``tl_kernels._s2_fwd_kernel`` (``layout_for`` with 128-row
query tiles, 192-row ones at head_dim 64 on 64-token blocks: ``row_ptr``/``row_split``/``cols``,
``lo``/``hi``, the heaviest-first ``q_order``) through the producer/consumer schedule that
plain ``triton.language`` does not express on sm_90:

* one loader warp walks the item's key-tile list and TMA-loads each K and V tile into a
  ``ring_stages`` ring of shared-memory buffers, each guarded by a ``ready`` mbarrier (the TMA
  landed) and an ``empty`` one (every consumer is done with it);
* two consumer warpgroups (three at head_dim 64 on 64-token blocks: :func:`consumers_for`)
  each own 64 rows of the query tile and run ``S = Q K^T`` (async wgmma; with two, Q read
  once into registers on 64-key tiles; K from shared memory), the online softmax in
  registers and ``O += P V`` (wgmma with P in registers), software-pipelined so that a
  tile's softmax runs under the previous tile's ``P V``; full entries skip the mask, partial
  ones apply the causal bound and the entry's ``[lo, hi)`` query range;
* the epilogue writes the LSE (natural log, ``-inf`` for rows that attend nothing) and the
  output to shared memory, which a storer warp TMA-stores while the consumers go on.

A program runs one (batch row, head, query tile) work item or, where items are short (S2
patterns: ``FWD_PERSISTENT_TILES``), one program per SM strides through many, its K/V ring
positions running on from item to item and the next item's Q loaded while the current one
finishes (:func:`persistent_programs`).

:func:`s2_forward_gluon` takes what :func:`unsupported_reason` accepts: self-attention
(``q_start = k_start = 0``, equal lengths; at 192-row tiles the last one may run past the end,
stored through a masked store) or a context-parallel chunk, ``s`` a multiple of 128, or packed
documents of any lengths (``varlen``, blocks 64 and 128: the ``tl`` path's program
map, a document's last tile stored through a masked store); bf16/fp16, head_dim 64 or 128,
block 64 or 128 (key tiles of 64 keys at head_dim 128, of the block at 64: :func:`key_tile`),
or block 16 or 32 on gathered 64-key tiles (``gathered_keys.py``: the loader fetches a tile
box by box, one TMA box per pattern block), on an sm_90 GPU. ``dispatch.s2_forward``
calls it when its ``KernelConfig.gluon_fwd`` is set and the call qualifies, and runs the ``tl``
kernel otherwise; either backward (``gluon_dq.py``/``gluon_dkdv.py`` or the ``tl`` passes)
reads only ``out`` and ``lse``.

Tensors reach the kernel as 2-D TMA views ``[rows, columns]`` whose rows are tokens: the batch
is either in the rows (``[b, s, h, d]`` contiguous: ``[b * s, h * d]``) or in the columns
(Megatron's ``[s, b, h, d]`` seen as ``[b, s, h, d]``: ``[s, b * h * d]``), so both layouts run
without a copy; a head's tile is at row ``b * row_b + token`` and column ``b * col_b + head *
col_h``. Gluon kernels do not run under ``TRITON_INTERPRET=1``: the CPU tests check this
schedule through :func:`emulate_forward` (float64, same arrays and order) and compile the kernel
for sm_90; the GPU tests compare it with the ``tl`` kernel and the reference.
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple, Optional

import torch
import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # Triton < 3.5 has no Gluon for Hopper: the tl forward runs
    gluon = None

from . import gathered_keys
from .layout import layout_for

WG_ROWS = 64  # query rows per consumer warpgroup: one wgmma M extent of 4 warps
# Warps of a warpgroup, the unit that issues a wgmma: each consumer, and the kernels' default
# partition (consumer 0, so also the launch's num_warps).
WARPGROUP_WARPS = 4
NUM_CONSUMERS = 2  # warpgroups sharing each K/V tile; the query tile is their rows together
TILE_M = WG_ROWS * NUM_CONSUMERS  # the layout's block_m (and the sequences' granularity)
# At head_dim 64 one warpgroup's step issues about as many instructions and exponentials as
# the tensor cores take clocks for its products, so two warpgroups cannot hide each other's
# latencies (docs/benchmarks.md, "What bounds head_dim 64"): there three share a 192-row query
# tile, as FlashAttention-3 has it at that head dim. Their scores, P and O fit the smaller
# register budget that three consumers leave (WIDE_CONSUMER_REGS).
WIDE_CONSUMERS = 3
WIDE_D = 64
# ... on 64-token blocks (64-key tiles); 128-key tiles (block 128 at head_dim 64) keep two.
WIDE_BLOCK = 64
# K/V ring depth: 3 stages where they fit next to the Q and O tiles (block 64 at d 128 is
# 3 x 32 + 64 KiB), else 2. The pipelined consumer holds a stage a step longer (see
# _consume_row_list): with 2 stages the loader had half a step to land the next tile.
MAX_STAGES = 3
MIN_STAGES = 2  # one tile in use, the next one landing
SHARED_BUDGET_BYTES = 200 * 1024  # of the H100's 227 KiB a block may take
HEAD_DIMS = (64, 128)
MAX_D_FOR_128_KEY_TILES = 64  # key_tile
# Keys per K/V tile above that head dim: a block of 64, half a block of 128 (key_tile).
WIDE_D_KEY_TILE = 64
BLOCK_SIZES = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)
ELEMENT_BYTES = 2  # of those dtypes: what shared memory holds per tile element
SM90 = (9, 0)  # the CUDA capability the kernels are written for (H100, H200: wgmma, TMA)
# Triton versions whose Gluon kernels have been checked on an H100/H200
# (tests/kernels/test_kernels_gpu.py); on others they run only when S2ATTN_GLUON_FORWARD=1 asks
# for it (the switch also governs the Gluon dK/dV pass, which kernel_config turns on with the
# forward).
CHECKED_TRITON = ("3.6",)
ENV_SWITCH = "S2ATTN_GLUON_FORWARD"  # "0": never, "1": on any Triton with Gluon, unset: checked
LN2 = math.log(2.0)
# Key tiles per work item (mean) up to which the forward runs persistent programs
# (persistent_programs). On the H100 and H200 the persistent forward ran S2 patterns 1-11%
# faster (the most at 8k-32k, at block 16 and head_dim 64: items of 20-60 tiles; 128k at
# block 64: 143) but dense causal ones (257 tiles at 32k, 1024 at 128k) 4-8% slower;
# docs/benchmarks.md, "Persistent forward".
FWD_PERSISTENT_TILES = 192
INT32_LIMIT = 2**31
INT32_MAX = INT32_LIMIT - 1  # a key's end of attending queries when nothing bounds it

if gluon is not None:
    # Register budgets after warp specialization: the consumers hold S, P and O in registers,
    # the loader only addresses (setmaxnreg moves the rest to the consumers).
    CONSUMER_REGS = gl.constexpr(240)
    LOADER_REGS = gl.constexpr(24)
    # 12 consumer warps next to the one-warp roles, padded to a warpgroup of 24 registers a
    # thread: (65536 - 128 * 24) / 384 = 162, rounded down to setmaxnreg's multiple of 8.
    WIDE_CONSUMER_REGS = gl.constexpr(160)
    # Warps per warp_specialize partition: a consumer is a warpgroup; the loader and the storer
    # only issue TMA copies and wait on barriers, which one warp does.
    CONSUMER_WARPS = gl.constexpr(WARPGROUP_WARPS)
    LOADER_WARPS = gl.constexpr(1)
    # The layout of a wgmma's accumulator (NVMMADistributedLayout): version 3 is Hopper's
    # warpgroup MMA; the warpgroup's warps stack along M, 16 rows each (4 x 16 = WG_ROWS), and
    # an instruction reduces over 16 elements of 16-bit operands.
    WGMMA_VERSION = gl.constexpr(3)
    WGMMA_ROWS_PER_WARP = gl.constexpr(16)
    WGMMA_K = gl.constexpr(16)
    # Register operands of a wgmma (DotOperandLayout): two 16-bit elements per 32-bit register.
    OPERAND_K_WIDTH = gl.constexpr(2)
    # ln 2 for the kernel, which reads only constexpr globals: the LSE leaves in natural log.
    LN2_CONSTEXPR = gl.constexpr(LN2)
    NO_KEY_END = gl.constexpr(INT32_MAX)
    # Q is the scores' register operand on key tiles of up to Q_IN_REGISTERS_MAX_N keys whose
    # scores and Q together fit (tile x head_dim up to Q_IN_REGISTERS_MAX_ND): 64-key tiles,
    # and 128-key ones (head_dim 64, key_tile) with the checked Triton (3.6: no spills,
    # forward 4% faster at 32k on an H100; 3.9's ptxas spills 96 bytes in the key loops there).
    Q_IN_REGISTERS_MAX_ND = gl.constexpr(64 * 128)
    # ... and with two consumer warpgroups only: three (head_dim 64) have 160 registers a
    # thread, and with Q there Triton 3.9's ptxas spilled 67 values in the key loops (3.6:
    # none); on an H100 the forward ran 383 TF/s with Q in registers against 396 from shared
    # memory (32k; docs/benchmarks.md, "Three consumer warpgroups at head_dim 64").
    Q_IN_REGISTERS_MAX_CONSUMERS = gl.constexpr(2)
    Q_IN_REGISTERS_MAX_N = gl.constexpr(
        128 if triton.__version__.startswith(CHECKED_TRITON) else 64
    )
    # Triton 3.7 renamed the TMA copies; the old names raise there.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


def consumers_for(block_size: int, head_dim: int, q_start: int = 0, varlen=None) -> int:
    """Consumer warpgroups of the forward and the dQ pass (each 64 query rows of a work item's
    tile): ``WIDE_CONSUMERS`` at head_dim ``WIDE_D`` on 64-token blocks of a whole sequence
    (the last tile may run past the sequence's end: masked store), else ``NUM_CONSUMERS``.
    Packed documents, context-parallel chunks, gathered key tiles (blocks 16, 32) and 128-key
    tiles keep two."""
    wide = head_dim == WIDE_D and block_size == WIDE_BLOCK and not q_start and varlen is None
    return WIDE_CONSUMERS if wide else NUM_CONSUMERS


def forward_tile_m(block_size: int, head_dim: int, q_start: int = 0, varlen=None) -> int:
    """Query rows of the forward's work item: the layout's ``block_m`` (:func:`consumers_for`)."""
    return WG_ROWS * consumers_for(block_size, head_dim, q_start, varlen)


def call_tile_m(pattern, head_dim: int, q_start: int = 0, varlen=None, lay=None, keys=None):
    """Query rows of a forward or dQ work item of one call: :func:`forward_tile_m`, or 128 (two
    warpgroups) where the caller passes a layout of 128-row tiles (a user mask that merges
    into those but not into 192-row ones)."""
    if lay is not None and keys is None and lay.block_m == TILE_M:
        return TILE_M
    return forward_tile_m(pattern.block_size, head_dim, q_start, varlen)


def key_tile(block_size: int, head_dim: int) -> int:
    """Keys per K/V tile (and TMA box) of the forward on a pattern of ``block_size`` (64 or
    128; blocks 16 and 32 take gathered tiles): the block, but at most 64 at head_dim 128,
    where a 128-key tile leaves shared memory for two K/V stages only and the forward ran
    25-26% slower than on 64-key halves of each block (H100, ``docs/benchmarks.md``); at head
    dim 64, 128-key tiles in three stages ran 15% faster."""
    return block_size if head_dim <= MAX_D_FOR_128_KEY_TILES else min(block_size, WIDE_D_KEY_TILE)


def triton_checked() -> bool:
    """Whether the installed Triton is one the Gluon forward was checked with on a GPU."""
    return any(triton.__version__.startswith(v + ".") for v in CHECKED_TRITON)


def enabled_by_default(head_dim: int, block_size: int, device, dtype=None) -> bool:
    """The default of ``KernelConfig.gluon_fwd``: Gluon importable, an sm_90 ``device``, a
    checked Triton (or ``S2ATTN_GLUON_FORWARD=1``; ``=0`` turns it off), a supported head dim,
    block size and dtype (None: a 16-bit one)."""
    switch = os.environ.get(ENV_SWITCH, "")
    if switch not in ("", "0", "1"):
        raise ValueError(f"{ENV_SWITCH}={switch!r}: use 0 (off), 1 (on) or leave it unset")
    if gluon is None or switch == "0" or (switch == "" and not triton_checked()):
        return False
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device) != SM90:
        return False
    blocks = BLOCK_SIZES + gathered_keys.BLOCK_SIZES
    shapes_ok = head_dim in HEAD_DIMS and block_size in blocks
    return shapes_ok and (dtype is None or dtype in DTYPES)


def unsupported_reason(q, k, v, pattern, q_start: int, k_start: int, varlen) -> Optional[str]:
    """Why this call cannot take the Gluon kernels (None: it can). q ``[b, sq, hq, d]``, k/v
    ``[b, sk, hkv, d]``; the pattern and head counts are already validated by the caller.
    Packed documents (``varlen``) at blocks 64 and 128."""
    if gluon is None:
        return "this Triton has no Gluon Hopper API"
    if varlen is not None and pattern.block_size not in BLOCK_SIZES:
        return f"packed documents (varlen) at block_size {pattern.block_size} (not {BLOCK_SIZES})"
    if k_start or q_start + q.shape[1] != k.shape[1]:
        # Self-attention, or a context-parallel chunk: the last sq of sk positions from 0.
        return (
            "keys not from position 0, or queries not the keys' last positions (k_start, q_start)"
        )
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != SM90:
        return "not an sm_90 GPU"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype}: bf16 or fp16"
    if varlen is None and (q.shape[1] % TILE_M or k.shape[1] % TILE_M):
        return f"sequence lengths {q.shape[1]}, {k.shape[1]}: not multiples of {TILE_M}"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head_dim {q.shape[-1]}: not one of {HEAD_DIMS}"
    if pattern.block_size not in BLOCK_SIZES:
        # Smaller blocks run on gathered 64-key tiles, which take fewer kinds of call.
        why = gathered_keys.unsupported_reason(pattern, q.shape[1], k.shape[1], q_start, varlen)
        if why:
            return f"block_size {pattern.block_size} (not one of {BLOCK_SIZES}): {why}"
    rows = q.shape[1]
    if varlen is not None:  # the dK/dV pass's copy of the LSE aligns each document's start
        # At least the copy's document_aligned_length: one STAT_ALIGN gap per document, two more.
        rows += STAT_ALIGN * (varlen.cu_seqlens.numel() + 1)
    if q.shape[0] * q.shape[2] * rows >= INT32_LIMIT:
        return "the LSE has 2^31 elements or more (the kernel's offsets are 32-bit)"
    return None


# ------------------------------------------------------------------------------------- kernel
if gluon is not None:

    @gluon.jit
    def _item_of_program(order, n_items, num_q_tiles):
        """(batch row, head, query tile, layout item) of a program that runs one item (the dQ
        pass): every batch row runs through ``order`` (heaviest items first), as in the ``tl``
        kernel."""
        pid = gl.program_id(0)
        item = gl.load(order + pid % n_items)
        return pid // n_items, item // num_q_tiles, item % num_q_tiles, item

    @gluon.jit
    def _document_rows(slot, prog_tok, prog_len, seq_q, varlen):
        """(first row, rows) of program-map slot ``slot``'s document (``varlen``), else of a
        whole sequence: row 0 and ``seq_q`` rows."""
        tok = gl.to_tensor(0)  # tensors, not the constexprs that a 1 or 0 argument becomes
        rows = gl.to_tensor(seq_q)
        if varlen:
            tok = gl.load(prog_tok + slot)
            rows = gl.load(prog_len + slot)
        return tok, rows

    @gluon.jit
    def _tile_in_document(qt, BM: gl.constexpr, NC: gl.constexpr, rows):
        """Whether query tile ``qt`` (``NC`` warpgroups of ``BM`` rows) ends inside its
        document (or sequence) of ``rows`` rows: then TMA stores it, else a masked store, as
        TMA would write over the next document's rows (or the next batch row's)."""
        return qt * NC * BM + NC * BM <= rows

    @gluon.jit
    def _work_item(t, work):
        """(batch row, head, query tile, layout item, first row, rows) of work item ``t``. Fixed
        lengths: the layout's items in ``order`` (head by head, heaviest first within a head,
        so that programs running at the same time share a head's K/V in L2), each for every
        batch row in turn; the item's sequence starts at row 0 of its batch row and has
        ``seq_q`` query rows. Packed documents (``varlen``): ``order``, ``prog_tok`` and
        ``prog_len`` are the program map (layout item, document start, document length: 0 for
        a padding slot, which every role skips). A program strides through the items by the
        grid size."""
        order, prog_tok, prog_len, n_work, batch, num_q_tiles, seq_q, varlen = work
        item = gl.load(order + t // batch)
        tok, rows = _document_rows(t, prog_tok, prog_len, seq_q, varlen)
        return t % batch, item // num_q_tiles, item % num_q_tiles, item, tok, rows

    @gluon.jit
    def _loader(
        q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, q_empty, ready, empty, row_ptr,
        cols, work, group, key_lo, key_stride, q_row_b, q_col_b, q_col_h, kv_row_b, kv_col_b,
        kv_col_h,
    ):  # fmt: skip
        """This program's work items one after another: each item's Q tiles (one a consumer)
        once the consumers are done with the previous item's, then its K/V tiles into the
        ring, whose positions run on across items (``ring``)."""
        NC: gl.constexpr = q_smem.type.shape[0]
        BM: gl.constexpr = q_smem.type.shape[1]
        ring = 0
        n = 0
        for t in range(gl.program_id(0), work[3], gl.num_programs(0)):
            b, h, qt, item, tok, rows = _work_item(t, work)
            if rows > 0:
                # A document's (or a 192-row tiling's) last tile reads on into the next rows
                # (or zeros past the tensor's end): its queries' outputs are not stored, and
                # its keys lie after every query of the document (masked as causal).
                q_row = b * q_row_b + tok + qt * NC * BM
                q_col = b * q_col_b + h * q_col_h
                mbarrier.wait(q_empty, (n & 1) ^ 1)
                mbarrier.expect(q_bar, NC * q_desc.block_type.nbytes)
                for c in gl.static_range(NC):
                    _tma_load(q_desc, [q_row + c * BM, q_col], q_bar, q_smem.index(c))
                e0 = gl.load(row_ptr + item)
                e2 = gl.load(row_ptr + item + 1)
                kv_col = b * kv_col_b + (h // group) * kv_col_h
                _load_kv_ring(
                    k_desc, v_desc, k_bufs, v_bufs, ready, empty, cols, e0, e2, e0 - ring,
                    b * kv_row_b + tok, kv_col, key_lo + h * key_stride,
                )  # fmt: skip
                ring += e2 - e0
                n += 1

    @gluon.jit
    def _storer(
        o_desc, o_smem, o_ready, o_empty, work, o_row_b, o_col_b, o_col_h,
    ):  # fmt: skip
        """TMA-stores each work item's output once the consumers have written their rows
        to ``o_smem``, and frees the buffers for the next item when the copy has read them:
        the consumers go on to the next item meanwhile. A document's tile that runs past its
        end is stored by the consumers themselves (:func:`_consumer`)."""
        NC: gl.constexpr = o_smem.type.shape[0]
        BM: gl.constexpr = o_smem.type.shape[1]
        n = 0
        for t in range(gl.program_id(0), work[3], gl.num_programs(0)):
            b, h, qt, item, tok, rows = _work_item(t, work)
            if rows > 0:
                row = b * o_row_b + tok + qt * NC * BM
                col = b * o_col_b + h * o_col_h
                mbarrier.wait(o_ready, n & 1)
                if _tile_in_document(qt, BM, NC, rows):
                    for c in gl.static_range(NC):
                        _tma_store(o_desc, [row + c * BM, col], o_smem.index(c))
                    tma.store_wait(0)
                mbarrier.arrive(o_empty, count=1)
                n += 1

    @gluon.jit
    def _load_kv_tile(desc, row0, col, kt, key_lo, bar, buf):
        """TMA-load key tile ``kt`` of ``buf``'s rows: one box at row ``row0 + kt * rows`` when
        the descriptor's box is the whole tile (keys in sequence order), else a box per pattern
        block of a gathered tile, each at its block's position in ``key_lo``."""
        BN: gl.constexpr = buf.type.shape[0]
        BOX: gl.constexpr = desc.block_type.shape[0]
        if BOX == BN:
            _tma_load(desc, [row0 + kt * BN, col], bar, buf)
        else:
            for r in gl.static_range(BN // BOX):
                pos = gl.load(key_lo + kt * BN + r * BOX)
                _tma_load(desc, [row0 + pos, col], bar, buf.slice(r * BOX, BOX))

    @gluon.jit
    def _store_kv_tile(desc, row0, col, kt, key_lo, buf):
        """TMA-store ``buf`` (key tile ``kt``'s rows) as :func:`_load_kv_tile` loaded it."""
        BN: gl.constexpr = buf.type.shape[0]
        BOX: gl.constexpr = desc.block_type.shape[0]
        if BOX == BN:
            _tma_store(desc, [row0 + kt * BN, col], buf)
        else:
            for r in gl.static_range(BN // BOX):
                pos = gl.load(key_lo + kt * BN + r * BOX)
                _tma_store(desc, [row0 + pos, col], buf.slice(r * BOX, BOX))

    @gluon.jit
    def _load_kv_ring(
        k_desc, v_desc, k_bufs, v_bufs, ready, empty, cols, e0, e2, origin, kv_row, kv_col,
        key_lo,
    ):  # fmt: skip
        """TMA-load the K and V tiles of row-list entries ``e0 .. e2`` into the ``STAGES`` ring
        that every consumer warpgroup reads (the forward's and the dQ pass's loader), entry
        ``e`` at ring position ``e - origin``; gathered tiles (``key_lo``: this head's key
        positions) box by box (:func:`_load_kv_tile`)."""
        BN: gl.constexpr = k_bufs.type.shape[1]
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        BOXES: gl.constexpr = BN // k_desc.block_type.shape[0]
        for e in range(e0, e2):
            i = e - origin
            stage = i % STAGES
            # A stage is free once every consumer released its previous use; the first pass
            # waits on the phase before the barrier's first, which counts as completed.
            mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
            kt = gl.load(cols + e)
            mbarrier.expect(
                ready.index(stage),
                BOXES * (k_desc.block_type.nbytes + v_desc.block_type.nbytes),
            )
            bar = ready.index(stage)
            _load_kv_tile(k_desc, kv_row, kv_col, kt, key_lo, bar, k_bufs.index(stage))
            _load_kv_tile(v_desc, kv_row, kv_col, kt, key_lo, bar, v_bufs.index(stage))

    @gluon.jit
    def _key_bounds(n, key_lo, key_hi, gathered):
        """Per key ``n`` (indices into K) the query range ``[lo, hi)`` that attends it. Keys in
        sequence order (``gathered`` false): from the key's position on (causal); gathered key
        tiles (``gathered_keys.py``): read from ``key_lo``/``key_hi`` (this head's rows),
        issued ahead of the wait for the scores so that their latency hides under the MMA."""
        k_lo = n
        k_hi = gl.full_like(n, NO_KEY_END)
        if gathered:
            k_lo = gl.load(key_lo + n)
            k_hi = gl.load(key_hi + n)
        return k_lo, k_hi

    @gluon.jit
    def _mask_rows(s, lo, hi, q_abs, k_lo, k_hi):
        """Scores ``s [rows, BN]`` of a partial row-list entry with the disallowed pairs at
        -inf: query rows outside the entry's ``[lo, hi)`` (read by the caller ahead of the
        wait for ``s``, like :func:`_key_bounds`) or outside each key's range ``[k_lo, k_hi)``."""
        ok = (q_abs[:, None] >= k_lo[None, :]) & (q_abs[:, None] < k_hi[None, :])
        ok = ok & (q_abs[:, None] >= lo) & (q_abs[:, None] < hi)
        return gl.where(ok, s, -float("inf"))

    @gluon.jit
    def _mask_partial(s, lo, hi, q_abs, k_lo, k_hi, q_first, key_last, gathered):
        """:func:`_mask_rows` where one warpgroup's rows need it (the dQ pass's masked loop,
        which skips the entries that none of its rows attends). A partial entry is partial for
        the query tile, but for a warpgroup's 64 rows ``q_first ..`` it is often all
        allowed (the rows inside ``[lo, hi)`` and at or after ``key_last``, the tile's last
        key, in sequence order): those skip the elementwise compares and the key ranges' use;
        the branch is uniform per warpgroup. (The forward keeps :func:`_mask_rows`: in its
        partial entries' loop this gained nothing and lost at block 128;
        ``docs/benchmarks.md``.)"""
        q_last = q_first + s.type.shape[0] - 1
        if gathered | (lo > q_first) | (hi <= q_last) | (key_last > q_first):
            s = _mask_rows(s, lo, hi, q_abs, k_lo, k_hi)
        return s

    @gluon.jit
    def _softmax_step(s, m_i, l_i, qk_scale):
        """Online softmax of raw scores ``s [rows, BN]`` (``Q K^T``; ``qk_scale`` takes them to
        log2 units) against the running max ``m_i`` (raw units) and sum ``l_i``: returns
        ``p``, the new ``m_i`` and ``l_i``, and ``alpha``, the factor that takes what was
        accumulated at the old max to the new one. The scale is applied inside the
        exponent's argument, one FFMA an element, rather than to the scores first."""
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # A row with nothing allowed yet keeps m = -inf: shift it by 0 so exp2 gives 0, not NaN.
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale - (m_use * qk_scale)[:, None])
        alpha = gl.exp2((m_i - m_use) * qk_scale)
        return p, m_new, l_i * alpha + gl.sum(p, 1), alpha

    @gluon.jit
    def _pipelined_steps(
        q, k_bufs, v_bufs, ready, empty, acc, p_op, m_i, l_i, q_abs, offs_n, cols, los, his,
        e_begin, e_end, e0, qk_scale, key_lo, key_hi, gathered, MASKED: gl.constexpr,
    ):  # fmt: skip
        """Steps ``e_begin .. e_end`` of :func:`_consume_row_list` (ring positions counted
        from ``e0``): each issues ``S_j`` and ``O += P_{j-1} V_{j-1}`` (``p_op``: the previous
        step's probabilities) and runs the softmax of ``S_j`` under the latter; ``MASKED``
        (partial entries) applies :func:`_mask_rows`. Returns ``acc, p_op, m_i, l_i``."""
        BM: gl.constexpr = q.type.shape[0]
        BN: gl.constexpr = k_bufs.type.shape[1]
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[WGMMA_VERSION, 0],
            warps_per_cta=[CONSUMER_WARPS, 1],
            instr_shape=[WGMMA_ROWS_PER_WARP, BN, WGMMA_K],
        )
        o_layout: gl.constexpr = acc.type.layout
        p_layout: gl.constexpr = p_op.type.layout
        for e in range(e_begin, e_end):
            i = e - e0
            stage = i % STAGES
            prev = (i - 1) % STAGES
            mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
            s_tok = warpgroup_mma(
                q, k_bufs.index(stage).permute((1, 0)), gl.zeros([BM, BN], gl.float32, s_layout),
                use_acc=False, is_async=True,
            )  # fmt: skip
            o_tok = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
            if MASKED:  # the bounds load under the MMAs
                k_lo, k_hi = _key_bounds(gl.load(cols + e) * BN + offs_n, key_lo, key_hi, gathered)
                lo = gl.load(los + e)
                hi = gl.load(his + e)
            # wgmma groups complete in order: S_j is done while P_{j-1} V_{j-1} may still run.
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
            if MASKED:
                s = _mask_rows(s, lo, hi, q_abs, k_lo, k_hi)
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
            mbarrier.arrive(empty.index(prev), count=1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_op = gl.convert_layout(p.to(q.dtype), p_layout)
        return acc, p_op, m_i, l_i

    @gluon.jit
    def _consume_row_list(
        q, k_bufs, v_bufs, ready, empty, acc, q_abs, offs_n, cols, los, his, e0, e1, e2,
        origin, qk_scale, key_lo, key_hi, gathered,
    ):  # fmt: skip
        """The item's row-list entries ``e0 .. e2`` (from ``e1`` on partial: masked), entry
        ``e`` at ring position ``e - origin``; returns the unnormalised output, the row max and
        the row sum.

        Software-pipelined as FlashAttention-3's intra-warpgroup overlap: step ``j`` issues
        ``S_j = Q K_j^T`` and then ``O += P_{j-1} V_{j-1}``, and the softmax of ``S_j`` runs
        while the tensor cores do the latter. A stage is released once its ``V`` was used,
        a step after its ``K``: the ring is a stage deeper for that (:func:`ring_stages`).
        """
        BM: gl.constexpr = q.type.shape[0]
        BN: gl.constexpr = k_bufs.type.shape[1]
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[WGMMA_VERSION, 0],
            warps_per_cta=[CONSUMER_WARPS, 1],
            instr_shape=[WGMMA_ROWS_PER_WARP, BN, WGMMA_K],
        )
        o_layout: gl.constexpr = acc.type.layout
        p_layout: gl.constexpr = gl.DotOperandLayout(
            operand_index=0, parent=o_layout, k_width=OPERAND_K_WIDTH
        )
        m_i = gl.full([BM], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.full([BM], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
        # Step 0 alone: nothing is accumulated yet to overlap its scores with. Every query tile
        # attends its own diagonal block, so the list is never empty.
        i0 = e0 - origin
        mbarrier.wait(ready.index(i0 % STAGES), (i0 // STAGES) & 1)
        s_tok = warpgroup_mma(
            q, k_bufs.index(i0 % STAGES).permute((1, 0)),
            gl.zeros([BM, BN], gl.float32, s_layout),
            use_acc=False, is_async=True,
        )  # fmt: skip
        n = gl.load(cols + e0) * BN + offs_n
        k_lo, k_hi = _key_bounds(n, key_lo, key_hi, gathered & (e0 >= e1))
        lo = gl.load(los + e0)
        hi = gl.load(his + e0)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        if e0 >= e1:
            s = _mask_rows(s, lo, hi, q_abs, k_lo, k_hi)
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale)
        p_op = gl.convert_layout(p.to(q.dtype), p_layout)
        # Full entries, then partial ones (masked): two loops, so that the full entries'
        # loop, where the time goes, carries no branch and reads no mask bounds.
        e_mid = gl.maximum(e1, e0 + 1)
        acc, p_op, m_i, l_i = _pipelined_steps(
            q, k_bufs, v_bufs, ready, empty, acc, p_op, m_i, l_i, q_abs, offs_n, cols, los, his,
            e0 + 1, e_mid, origin, qk_scale, key_lo, key_hi, gathered, False,
        )  # fmt: skip
        acc, p_op, m_i, l_i = _pipelined_steps(
            q, k_bufs, v_bufs, ready, empty, acc, p_op, m_i, l_i, q_abs, offs_n, cols, los, his,
            e_mid, e2, origin, qk_scale, key_lo, key_hi, gathered, True,
        )  # fmt: skip
        last = (e2 - 1 - origin) % STAGES
        o_tok = warpgroup_mma(p_op, v_bufs.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
        mbarrier.arrive(empty.index(last), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def _consumer(
        q_smem, k_bufs, v_bufs, q_bar, q_empty, ready, empty, o_smem, o_ready, o_empty, LSE,
        stride_lse_b, stride_lse_h, row_ptr, row_split, cols, los, his, work, qk_scale, q_start,
        key_lo, key_hi, key_stride, o_view, WG,
    ):  # fmt: skip
        """Consumer warpgroup ``WG`` (0 .. consumers - 1, a run-time value: it only selects the
        rows and buffers): its 64 rows of each work item's query tile, at absolute positions from
        ``q_start`` (the masks': from the document's start for packed documents) and local
        rows from 0 (the LSE's, after the document's first row ``tok``)."""
        ring = 0
        n = 0
        for t in range(gl.program_id(0), work[3], gl.num_programs(0)):
            b, h, qt, item, tok, rows = _work_item(t, work)
            if rows > 0:
                ring, n = _consume_item(
                    q_smem, k_bufs, v_bufs, q_bar, q_empty, ready, empty, o_smem, o_ready,
                    o_empty, LSE, stride_lse_b, stride_lse_h, row_ptr, row_split, cols, los,
                    his, qk_scale, q_start, key_lo, key_hi, key_stride, o_view, WG, b, h, qt,
                    item, tok, rows, ring, n,
                )  # fmt: skip

    @gluon.jit
    def _consume_item(
        q_smem, k_bufs, v_bufs, q_bar, q_empty, ready, empty, o_smem, o_ready, o_empty, LSE,
        stride_lse_b, stride_lse_h, row_ptr, row_split, cols, los, his, qk_scale, q_start,
        key_lo, key_hi, key_stride, o_view, WG, b, h, qt, item, tok, rows, ring, n,
    ):  # fmt: skip
        """One work item of :func:`_consumer`; returns the ring position and item count after
        it."""
        # Sizes from the shared-memory types: constexprs passed to a worker arrive as tensors.
        NC: gl.constexpr = q_smem.type.shape[0]
        BM: gl.constexpr = q_smem.type.shape[1]
        BN: gl.constexpr = k_bufs.type.shape[1]
        D: gl.constexpr = k_bufs.type.shape[2]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[WGMMA_VERSION, 0],
            warps_per_cta=[CONSUMER_WARPS, 1],
            instr_shape=[WGMMA_ROWS_PER_WARP, BN, WGMMA_K],
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[WGMMA_VERSION, 0],
            warps_per_cta=[CONSUMER_WARPS, 1],
            instr_shape=[WGMMA_ROWS_PER_WARP, D, WGMMA_K],
        )
        offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        e0 = gl.load(row_ptr + item)
        e1 = gl.load(row_split + item)
        e2 = gl.load(row_ptr + item + 1)
        q_loc = qt * NC * BM + WG * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
        q_abs = q_start + q_loc
        acc = gl.zeros([BM, D], gl.float32, o_layout)
        mbarrier.wait(q_bar, n & 1)
        # Q as the scores' register operand on 64-key tiles (two consumers): read from shared
        # memory once, not by every S = Q K^T wgmma, which with both operands there reads 128
        # bytes a clock (an SM's whole shared-memory bandwidth, shared with the K/V TMA writes
        # and P V's reads of V); its buffer is then free for the next item's Q at once.
        q = q_smem.index(WG)
        q_in_registers: gl.constexpr = (
            (BN * D <= Q_IN_REGISTERS_MAX_ND)
            & (BN <= Q_IN_REGISTERS_MAX_N)
            & (NC <= Q_IN_REGISTERS_MAX_CONSUMERS)
        )
        if q_in_registers:
            q = q.load(
                gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=OPERAND_K_WIDTH)
            )
            fence_async_shared()  # the reads above before the next TMA write
            mbarrier.arrive(q_empty, count=1)
        acc, m_i, l_i = _consume_row_list(
            q, k_bufs, v_bufs, ready, empty, acc, q_abs, offs_n, cols, los, his,
            e0, e1, e2, e0 - ring, qk_scale, key_lo + h * key_stride,
            key_hi + h * key_stride, key_stride > 0,
        )  # fmt: skip
        if not q_in_registers:
            mbarrier.arrive(q_empty, count=1)  # the wgmma that read Q have completed
        ring += e2 - e0
        nothing = l_i == 0.0
        l_safe = gl.where(nothing, 1.0, l_i)
        lse = gl.where(nothing, -float("inf"), (m_i * qk_scale + gl.log2(l_safe)) * LN2_CONSTEXPR)
        gl.store(LSE + b * stride_lse_b + h * stride_lse_h + tok + q_loc, lse, q_loc < rows)
        out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
        mbarrier.wait(o_empty, (n & 1) ^ 1)  # the previous item's output has left
        if _tile_in_document(qt, BM, NC, rows):
            o_smem.index(WG).store(out.to(o_smem.dtype))
            fence_async_shared()
        else:
            # The tile runs past its document's end: a TMA store would write over the next
            # document's rows, so the rows inside go out through a masked store.
            _store_rows(out, o_view, b, h, tok, qt * NC * BM + WG * BM, rows)
        mbarrier.arrive(o_ready, count=1)
        n += 1
        return ring, n

    @gluon.jit
    def _store_rows(out, o_view, b, h, tok, first, rows):
        """Store rows ``first ..`` of ``out [BM, D]`` (an item's output, document-relative)
        that are before ``rows``, at the document's row ``tok`` on: ``o_view`` is the output's
        pointer, row stride and :class:`TmaView` offsets."""
        out_ptr, o_stride, o_row_b, o_col_b, o_col_h = o_view
        BM: gl.constexpr = out.type.shape[0]
        D: gl.constexpr = out.type.shape[1]
        layout: gl.constexpr = out.type.layout
        r = first + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        c = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        row = (b * o_row_b + tok + r).to(gl.int64) * o_stride
        ptr = out_ptr + row[:, None] + (b * o_col_b + h * o_col_h + c)[None, :]
        gl.store(ptr, out.to(out_ptr.dtype.element_ty), (r < rows)[:, None])

    @gluon.jit
    def _s2_fwd_gluon_kernel(
        q_desc, k_desc, v_desc, o_desc, out_ptr, o_stride, LSE, stride_lse_b, stride_lse_h, row_ptr,
        row_split, cols, los, his, order, prog_tok, prog_len, n_work, batch, num_q_tiles, seq_q,
        varlen, group, qk_scale, q_start, key_lo, key_hi, key_stride, q_row_b, q_col_b, q_col_h,
        kv_row_b, kv_col_b, kv_col_h, o_row_b, o_col_b, o_col_h, STAGES: gl.constexpr,
        BLOCK_N: gl.constexpr, CONSUMERS: gl.constexpr = NUM_CONSUMERS,
    ):  # fmt: skip
        """Programs striding through the ``n_work`` work items (a query tile of ``CONSUMERS``
        x 64 rows of one head and batch row, or of one document, each: :func:`_work_item`):
        one per SM on S2 patterns, one per item on long causal rows
        (:func:`persistent_programs`). Within a program the loader fetches the next item's Q
        and first K/V tiles while the consumers finish the current one, and the output leaves
        through the storer while they start the next."""
        # Barriers count CONSUMERS arrivals: only the two warp_specialize lists below exist.
        gl.static_assert((CONSUMERS == 2) | (CONSUMERS == 3))
        q_smem = gl.allocate_shared_memory(
            q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout
        )
        # K/V tiles of BLOCK_N keys: the descriptors' boxes, or several boxes of a gathered tile.
        D: gl.constexpr = k_desc.block_type.shape[1]
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
        o_smem = gl.allocate_shared_memory(
            o_desc.dtype, [CONSUMERS] + o_desc.block_type.shape, o_desc.layout
        )
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        o_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        o_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(q_empty, count=CONSUMERS)  # every consumer warpgroup releases Q
        mbarrier.init(o_ready, count=CONSUMERS)  # every one has written its output rows
        mbarrier.init(o_empty, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=CONSUMERS)  # every consumer releases a stage
        fence_async_shared()
        work = (order, prog_tok, prog_len, n_work, batch, num_q_tiles, seq_q, varlen)
        o_view = (out_ptr, o_stride, o_row_b, o_col_b, o_col_h)
        consumer_args = (
            q_smem, k_bufs, v_bufs, q_bar, q_empty, ready, empty, o_smem, o_ready, o_empty,
            LSE, stride_lse_b, stride_lse_h, row_ptr, row_split, cols, los, his, work,
            qk_scale, q_start, key_lo, key_hi, key_stride, o_view,
        )  # fmt: skip
        loader_args = (
            q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, q_empty, ready, empty,
            row_ptr, cols, work, group, key_lo, key_stride, q_row_b, q_col_b, q_col_h,
            kv_row_b, kv_col_b, kv_col_h,
        )  # fmt: skip
        storer_args = (o_desc, o_smem, o_ready, o_empty, work, o_row_b, o_col_b, o_col_h)
        # The default partition (this kernel's 4 warps) is consumer 0; then the other
        # consumers (4 warps each), the loader and the storer (1 warp each), with their
        # register budgets.
        if CONSUMERS == 3:  # WIDE_CONSUMERS
            gl.warp_specialize(
                [
                    (_consumer, consumer_args + (gl.to_tensor(0),)),
                    (_consumer, consumer_args + (gl.to_tensor(1),)),
                    (_consumer, consumer_args + (gl.to_tensor(2),)),
                    (_loader, loader_args),
                    (_storer, storer_args),
                ],
                [CONSUMER_WARPS, CONSUMER_WARPS, LOADER_WARPS, LOADER_WARPS],
                [WIDE_CONSUMER_REGS, WIDE_CONSUMER_REGS, LOADER_REGS, LOADER_REGS],
            )
        else:
            gl.warp_specialize(
                [
                    (_consumer, consumer_args + (gl.to_tensor(0),)),
                    (_consumer, consumer_args + (gl.to_tensor(1),)),
                    (_loader, loader_args),
                    (_storer, storer_args),
                ],
                [CONSUMER_WARPS, LOADER_WARPS, LOADER_WARPS],
                [CONSUMER_REGS, LOADER_REGS, LOADER_REGS],
            )


# ------------------------------------------------------------------------------------ wrapper
class TmaView(NamedTuple):
    """A ``[b, s, h, d]`` tensor as the kernel reads it: ``matrix`` a 2-D ``[rows, columns]``
    view (unit column stride) where token ``t`` of batch row ``i``, head ``j`` starts at row
    ``i * row_b + t``, column ``i * col_b + j * col_h``."""

    matrix: torch.Tensor
    row_b: int
    col_b: int
    col_h: int


# Hopper's TMA: the base address and the row stride are multiples of 16 bytes.
TMA_ALIGN_BYTES = 16

# Statistics (fp32, 4 bytes) per TMA alignment unit: a 1-D box of LSE or delta starts on a
# multiple.
STAT_BYTES = 4
STAT_ALIGN = TMA_ALIGN_BYTES // STAT_BYTES


def document_aligned_length(total_tokens: int, num_docs: int) -> int:
    """Rows per head of the packed documents' LSE/delta copy in which every document starts
    on ``STAT_ALIGN`` rows (``gluon_dkdv.document_aligned_stats``): each start rounded up, one
    gap of ``STAT_ALIGN`` per earlier document, the whole rounded up."""
    return -(-(total_tokens + STAT_ALIGN * (num_docs + 1)) // STAT_ALIGN) * STAT_ALIGN


def tma_view(t: torch.Tensor) -> Optional[TmaView]:
    """The :class:`TmaView` of ``[b, s, h, d]`` tensor ``t`` without a copy, or None when its
    strides allow none: the batch in the rows (``t.stride(0) == s * t.stride(1)``, e.g. a
    contiguous ``[b, s, h, d]``) or in the columns (a token's row holds every batch row's heads,
    e.g. a contiguous ``[s, b, h, d]`` transposed, or a slice of a fused QKV projection)."""
    b, s, h, d = t.shape
    sb, ss, sh, sd = t.stride()
    size = t.element_size()
    if sd != 1 or ss * size % TMA_ALIGN_BYTES or t.data_ptr() % TMA_ALIGN_BYTES:
        return None
    heads_width = (h - 1) * sh + d
    if (b == 1 or sb == s * ss) and heads_width <= ss:
        return TmaView(t.as_strided((b * s, heads_width), (ss, 1)), s, 0, sh)
    width = (b - 1) * sb + heads_width
    if 0 <= sb and width <= ss:
        return TmaView(t.as_strided((s, width), (ss, 1)), 0, sb, sh)
    return None


def paired_tma_views(a: torch.Tensor, b: torch.Tensor, b_is_output: bool = False):
    """TMA views of two like-shaped ``[b, s, h, d]`` tensors that a kernel addresses with one
    set of coordinates: where their strides differ, or one cannot be read in place, ``a`` is
    copied dense and so is ``b`` (or, with ``b_is_output``, ``b`` is allocated dense: the
    kernel writes it). Returns ``(a, b, view_a, view_b)``."""
    va, vb = tma_view(a), tma_view(b)
    if va is None or vb is None or va[1:] != vb[1:]:
        a = a.contiguous()
        b = torch.empty_like(a) if b_is_output else b.contiguous()
        va, vb = tma_view(a), tma_view(b)
    return a, b, va, vb


def ring_stages(
    block: int, head_dim: int, element_bytes: int = ELEMENT_BYTES, consumers: int = NUM_CONSUMERS
) -> int:
    """K/V ring depth of the forward for key tiles of ``block`` rows (16-bit elements) next to
    the Q and O tiles of ``consumers`` warpgroups."""
    tile = block * head_dim * element_bytes
    fixed = 2 * consumers * WG_ROWS * head_dim * element_bytes  # Q and O tiles
    fits = (SHARED_BUDGET_BYTES - fixed) // (2 * tile)
    return max(MIN_STAGES, min(MAX_STAGES, fits))


def _gl_dtype(dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


@functools.cache
def _tile_layout(rows: int, head_dim: int, dtype: torch.dtype):
    # Built once: made anew for each of a fwd+bwd's 18 TMA descriptors, the layouts took a
    # sixth of the call's host time.
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], _gl_dtype(dtype))


def _descriptor(view: TmaView, rows: int, head_dim: int):
    block = [rows, head_dim]
    return TensorDescriptor.from_tensor(
        view.matrix, block, _tile_layout(rows, head_dim, view.matrix.dtype)
    )


def check_chunk(fn: str, q, k, q_start: int) -> None:
    """The three Gluon passes take queries ``q [b, s, ...]`` that are the last ``s`` of the
    keys ``k [b, sk, ...]`` (positions ``q_start = sk - s ..``); ValueError naming ``fn``
    otherwise."""
    s, sk = q.shape[1], k.shape[1]
    if q_start + s != sk:
        raise ValueError(
            f"{fn}: the queries must be the keys' last positions: q_start ({q_start}) + {s} "
            f"queries != {sk} keys"
        )


def key_arrays(keys, fallback: torch.Tensor):
    """``(key_lo, key_hi, key_stride)`` kernel arguments: a :class:`gathered_keys.GatheredKeys`'
    per-key query ranges, or (``keys`` None: keys in sequence order) placeholders and stride 0,
    which the kernels read as "causal, nothing to load"."""
    if keys is None:
        return fallback, fallback, 0
    return keys.key_lo, keys.key_hi, keys.seq


def s2_forward_gluon(
    q, k, v, pattern, scale: float, lay=None, q_start: int = 0, keys=None, programs=None,
    varlen=None,
):  # fmt: skip
    """S2 forward through the Gluon kernel. q ``[b, s, hq, d]``, k/v ``[b, sk, hkv, d]`` (bf16
    or fp16 on an sm_90 GPU; any strides: those :func:`tma_view` cannot read are copied first);
    the queries are positions ``q_start .. sk - 1`` (``q_start = sk - s``: 0 for
    self-attention, a context-parallel chunk's start otherwise); ``scale`` the softmax scale;
    ``lay`` the pattern's layout at :func:`forward_tile_m` query rows (or 128) and
    :func:`key_tile` keys for this ``(s, sk, q_start)`` (built when None). With ``keys`` (a
    :class:`gathered_keys.GatheredKeys`, block 16/32) the key tiles are gathered ones (their
    own layout), each loaded from k/v block by block. Returns ``out`` like q (q's layout where
    q is dense) and ``lse [b, hq, s]`` fp32 (natural log), as
    ``tl_kernels.s2_forward_tl`` does. ``programs``: how many programs share the work items
    (None: :func:`persistent_programs`' choice; the tests pass a few, so that each program
    runs many items). ``varlen`` (a ``tl_kernels.Varlen``): q, k, v are one packed row
    ``[1, total, h, d]`` of documents, each attended on its own (``lay``: the layout that
    serves every document, ``varlen.layout``), through the same program map as the ``tl``
    kernels. The caller checks :func:`unsupported_reason` first."""
    b, s, hq, d = q.shape
    check_chunk("s2_forward_gluon", q, k, q_start)
    gathered_keys.check_call("s2_forward_gluon", keys, pattern, hq, k.shape[1], lay)
    box = bn = key_tile(pattern.block_size, d)  # TMA box rows: a pattern block or half of one
    group = pattern.group_size
    tile_m = call_tile_m(pattern, d, q_start, varlen, lay, keys)
    consumers = tile_m // WG_ROWS
    if keys is not None:
        lay = keys.layout(tile_m, q_start=q_start)
        bn = lay.block_n
    if lay is None and varlen is not None:
        lay = varlen.layout(pattern, tile_m, bn, q.device)
    if lay is None:
        lay = layout_for(pattern, s, k.shape[1], q_start, 0, tile_m, bn, q.device)
    if lay.block_m != tile_m or lay.block_n != bn:
        raise ValueError(
            f"s2_forward_gluon: the layout has {lay.block_m} x {lay.block_n} tiles, the kernel "
            f"{tile_m} x {bn}"
        )
    out = torch.empty_like(q)  # q's layout where q is dense (Megatron's [s, b, h, d] too)
    lse = torch.empty((b, hq, s), device=q.device, dtype=torch.float32)
    ov = tma_view(out)
    if ov is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        ov = tma_view(out)
    qv = tma_view(q) or tma_view(q.contiguous())
    _, _, kv_, vv = paired_tma_views(k, v)  # one set of coordinates serves K and V
    n_items = lay.q_order.numel()
    if varlen is None:
        n_work, order = n_items * b, lay.q_order
        prog_tok = prog_len = order  # unread
    else:
        n_work, order, prog_tok, prog_len = varlen.programs(lay, kv=False)
    if n_work == 0:
        return out, lse
    if programs is None:
        programs = persistent_programs(n_work, lay.nnz / n_items, q.device)
    _s2_fwd_gluon_kernel[(programs,)](
        _descriptor(qv, WG_ROWS, d),
        _descriptor(kv_, box, d),
        _descriptor(vv, box, d),
        _descriptor(ov, WG_ROWS, d),
        ov.matrix,
        ov.matrix.stride(0),
        lse,
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
        n_work,
        b,
        lay.num_q_tiles,
        s,
        int(varlen is not None),
        group,
        scale / LN2,
        q_start,
        *key_arrays(keys, lay.lo),
        *qv[1:],
        *kv_[1:],
        *ov[1:],
        STAGES=ring_stages(bn, d, consumers=consumers),
        BLOCK_N=bn,
        CONSUMERS=consumers,
        num_warps=WARPGROUP_WARPS,
    )
    return out, lse


def persistent_programs(n_work: int, mean_tiles: float, device) -> int:
    """How many programs the forward launches for ``n_work`` work items of ``mean_tiles`` key
    tiles on average: one per SM, each striding through the items, where items are short (up
    to ``FWD_PERSISTENT_TILES``; S2 patterns: the next item's loads and the last
    one's output overlap the work instead of a new program's start-up), else one per item,
    the GPU's dispatcher starting each as an SM frees up (long causal rows: items from a few
    to a thousand tiles, which a fixed stride through the head-by-head order shares out
    unevenly, and programs that drift apart on a head's K/V, which L2 serves once for the
    programs in step)."""
    if mean_tiles > FWD_PERSISTENT_TILES:
        return n_work
    return min(n_work, torch.cuda.get_device_properties(device).multi_processor_count)


def compile_for_sm90(head_dim: int, block: int, out_dir: str, consumers: int = 0) -> dict:
    """Compile the kernel for an H100 (sm_90a) without a GPU, bf16 tiles; the cubin goes to
    ``out_dir``. Returns ``hgmma`` (wgmma instructions in the SASS), ``local_memory`` and
    ``stack_bytes`` (a thread's local memory and stack frame: spilled registers land in the
    latter), ``key_loop_spills`` (:func:`_innermost_mma_loop_spills`), ``hgmma_register_a``
    (those whose A operand is in registers), ``full_waits`` (``wgmma.wait_group 0`` in the
    SASS: as many as ``hgmma`` when ptxas serialized the wgmma, C7512/C7514),
    ``shared_bytes``, ``registers`` (the default partition's). Needs ``cuobjdump`` next to
    Triton's ``ptxas``; not under ``TRITON_INTERPRET=1``. ``block``: the pattern's (blocks 16
    and 32 load gathered 64-key tiles box by box); ``consumers``: the consumer warpgroups
    (0: what :func:`consumers_for` takes for a whole sequence)."""
    box = key_tile(block, head_dim)
    tile = max(box, gathered_keys.TILE_N)
    consumers = consumers or consumers_for(block, head_dim)
    return compile_kernel_for_sm90(
        _s2_fwd_gluon_kernel,
        head_dim,
        {"q_desc": WG_ROWS, "k_desc": box, "v_desc": box, "o_desc": WG_ROWS},
        {"LSE": "*fp32", "out_ptr": "*bf16", "qk_scale": "fp32", **ROW_LIST_TYPES},
        ring_stages(tile, head_dim, consumers=consumers),
        os.path.join(out_dir, f"fwd_d{head_dim}_n{block}_c{consumers}"),
        block_n=tile,
        CONSUMERS=consumers,
    )


# The layout arrays a row-list kernel takes (int32 pointers).
ROW_LIST_TYPES = {
    n: "*i32"
    for n in (
        "row_ptr", "row_split", "cols", "los", "his", "order", "key_lo", "key_hi", "prog_tok",
        "prog_len",
    )
}  # fmt: skip


def compile_kernel_for_sm90(
    kernel, head_dim: int, tiles: dict, types: dict, stages: int, stem, block_n: int, **flags
):
    """Compile Gluon ``kernel`` for sm_90a (4 warps) without a GPU and write ``stem.cubin``:
    ``tiles`` maps each TMA descriptor argument to its tile rows (bf16 ``[rows, head_dim]``),
    ``types`` the other arguments that are not ``i32``, ``stages`` the ``STAGES`` constexpr,
    ``block_n`` the ``BLOCK_N`` one (the K/V tile's rows), ``flags`` any other constexprs.
    Returns :func:`compile_for_sm90`'s statistics."""
    import re
    import subprocess

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(rows):
        lay = gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.bfloat16)
        return f"tensordesc<bf16[{rows}, {head_dim}],{lay!r}>"

    sig = {n: types.get(n, "i32") for n in kernel.arg_names}
    constexprs = {"STAGES": stages, "BLOCK_N": block_n, **flags}
    sig.update(
        {n: desc(rows) for n, rows in tiles.items()}, **dict.fromkeys(constexprs, "constexpr")
    )
    src = GluonASTSource(kernel, signature=sig, constexprs=constexprs)
    # sm_90, 32-thread warps; num_warps: the default partition, one warpgroup, as a launch has
    target = GPUTarget("cuda", 90, 32)
    compiled = triton.compile(src, target=target, options={"num_warps": WARPGROUP_WARPS})
    cubin = stem + ".cubin"
    with open(cubin, "wb") as f:
        f.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True)
    usage = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True).stdout
    local = [int(x) for x in re.findall(r"LOCAL:(\d+)", usage)]
    stack = [int(x) for x in re.findall(r"STACK:(\d+)", usage)]
    regs = [int(x) for x in re.findall(r"REG:(\d+)", usage)]
    return {
        "key_loop_spills": _innermost_mma_loop_spills(sass.stdout),
        "hgmma": sass.stdout.count("HGMMA"),
        # wgmma whose A operand is in registers (``HGMMA... Rd, Ra, gdesc[..]``), not shared memory
        "hgmma_register_a": len(re.findall(r"HGMMA\.\S+ R\d+, R\d+, gdesc", sass.stdout)),
        "full_waits": sass.stdout.count("WARPGROUP.DEPBAR.LE gsb0, 0x0"),
        "local_memory": max(local, default=0),
        "stack_bytes": max(stack, default=0),
        "shared_bytes": compiled.metadata.shared,
        "registers": max(regs, default=0),
    }


def _innermost_mma_loop_spills(sass: str) -> int:
    """Local-memory loads and stores (``LDL``/``STL``: spilled registers) inside the innermost
    SASS loops that issue wgmma, the key-tile loops, where a spill costs every step; the
    persistent programs' item loop around them may keep a few values there (reloaded once
    an item). A loop is a backward ``BRA`` and the code from its target to it."""
    import re

    code = [
        (int(m.group(1), 16), m.group(2))
        for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    ]
    loops = []
    for addr, ins in code:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)\s*$", ins)
        start = int(target.group(1), 16) if target else addr
        if start < addr:
            body = [i for a, i in code if start <= a <= addr]
            if any("HGMMA" in i for i in body):
                loops.append((start, addr, body))
    innermost = [
        body
        for lo, hi, body in loops
        if not any(lo <= lo2 and hi2 <= hi and (lo2, hi2) != (lo, hi) for lo2, hi2, _ in loops)
    ]
    return sum(i.lstrip("@!P0123456789T ").startswith(("LDL", "STL")) for b in innermost for i in b)


# ------------------------------------------------------------------------------ CPU emulation
def emulated_key_bounds(keys, h: int, n: torch.Tensor):
    """:func:`_key_bounds` in PyTorch: the query range ``[lo, hi)`` attending keys ``n`` of
    head ``h``'s tile (``keys`` None: in sequence order, causal)."""
    if keys is None:
        return n, torch.full_like(n, INT32_MAX)
    return keys.key_lo[h, n].long(), keys.key_hi[h, n].long()


def emulated_key_rows(keys, h: int, n: torch.Tensor) -> torch.Tensor:
    """The rows of K/V that keys ``n`` of head ``h``'s tiles are: ``n`` in sequence order, the
    gathered keys' positions otherwise (what :func:`_load_kv_tile` loads box by box)."""
    return n if keys is None else keys.order[n, h]


def emulated_mask_rows(sc, lo: int, hi: int, q_abs, keys, h: int, n) -> torch.Tensor:
    """:func:`_mask_rows` in PyTorch: scores ``sc [rows, keys]`` of query positions ``q_abs``
    against keys ``n`` of head ``h``'s tile, at -inf outside the entry's ``[lo, hi)`` and
    outside each key's query range (:func:`emulated_key_bounds`)."""
    k_lo, k_hi = emulated_key_bounds(keys, h, n)
    ok = (
        (q_abs[:, None] >= k_lo[None, :])
        & (q_abs[:, None] < k_hi[None, :])
        & (q_abs[:, None] >= lo)
        & (q_abs[:, None] < hi)
    )
    return sc.masked_fill(~ok, -math.inf)


def emulated_mask_partial(sc, lo: int, hi: int, q_abs, keys, h: int, n) -> torch.Tensor:
    """:func:`_mask_partial` in PyTorch, both its cases (all allowed, elementwise:
    :func:`emulated_mask_rows`); ``q_abs`` ascending, at least one of its rows in ``[lo, hi)``
    (the caller skips the entries none attends), the rest as there."""
    q_first, q_last = int(q_abs[0]), int(q_abs[-1])
    if keys is None and lo <= q_first and hi > q_last and int(n.max()) <= q_first:
        return sc
    return emulated_mask_rows(sc, lo, hi, q_abs, keys, h, n)


def emulated_work(lay, batch: int, seq: int, varlen=None, kv: bool = False) -> list:
    """``(batch row, layout item, map slot, first row, rows)`` of each work item of the
    forward and the dQ pass (``kv``: the dK/dV pass, items over key tiles), as the emulations
    run them: every layout item for every batch row, the sequence from row 0 with ``seq`` rows
    (map slot 0); or (``varlen``) the program map's slots that hold a document, last document
    first, so that a tile that stored past its document's end would write over rows already
    final, as it may in the kernels, whose programs finish in any order."""
    if varlen is None:
        order = (lay.kv_order if kv else lay.q_order).tolist()
        n = len(order)
        return [(pid // n, order[pid % n], 0, 0, seq) for pid in range(n * batch)]
    item_of, tok_of, len_of = (x.tolist() for x in varlen.programs(lay, kv=kv)[1:])
    slots = enumerate(zip(item_of, tok_of, len_of))
    return [(0, i, p, t, n) for p, (i, t, n) in slots if n > 0][::-1]


def emulated_rows(x: torch.Tensor, bb: int, r: torch.Tensor, head: int) -> torch.Tensor:
    """Rows ``r`` of ``x [b, s, h, d]``'s batch row ``bb`` and head ``head`` in float64, zeros
    past the end (what a TMA load gives there)."""
    inside = r < x.shape[1]
    got = x[bb, torch.where(inside, r, 0), head].double()
    return torch.where(inside[:, None], got, 0.0)


def emulate_forward(q, k, v, pattern, scale: float, q_start: int = 0, keys=None, varlen=None):
    """The kernel's schedule in float64 PyTorch on any device: the same layout arrays, program
    order (with ``varlen``, the program map), warpgroup split of each query tile, full/partial
    entry split, masks, base-2 online softmax and reads past a document's end (the next
    document's rows, zeros past the tensor's, as TMA gives), so that its index logic is
    checked where no GPU is. Shapes, ``q_start``, ``keys`` and ``varlen`` as
    :func:`s2_forward_gluon`; returns ``(out, lse)`` in float64."""
    b, s, hq, d = q.shape
    bn = key_tile(pattern.block_size, d)
    consumers = consumers_for(pattern.block_size, d, q_start, varlen)
    tile_m = WG_ROWS * consumers
    if keys is not None:
        lay = keys.layout(tile_m, q_start=q_start)
        bn = lay.block_n
    elif varlen is not None:
        lay = varlen.layout(pattern, tile_m, bn, q.device)
    else:
        lay = layout_for(pattern, s, k.shape[1], q_start, 0, tile_m, bn, q.device)
    qk_scale = scale / LN2
    out = torch.zeros(b, s, hq, d, dtype=torch.float64)
    lse = torch.empty(b, hq, s, dtype=torch.float64)
    row_ptr, row_split = lay.row_ptr.tolist(), lay.row_split.tolist()
    cols, los, his = lay.cols.tolist(), lay.lo.tolist(), lay.hi.tolist()
    offs_n = torch.arange(bn)
    for bb, item, _, tok, n_rows in emulated_work(lay, b, s, varlen):
        h, qt = item // lay.num_q_tiles, item % lay.num_q_tiles
        kvh = h // pattern.group_size
        e0, e1, e2 = row_ptr[item], row_split[item], row_ptr[item + 1]
        for wg in range(consumers):
            q_loc = qt * tile_m + wg * WG_ROWS + torch.arange(WG_ROWS)
            q_abs = q_start + q_loc
            qq = emulated_rows(q, bb, tok + q_loc, h)
            m_i = torch.full((WG_ROWS,), -math.inf, dtype=torch.float64)
            l_i = torch.zeros(WG_ROWS, dtype=torch.float64)
            acc = torch.zeros(WG_ROWS, d, dtype=torch.float64)
            for e in range(e0, e2):
                n = cols[e] * bn + offs_n
                rows = tok + emulated_key_rows(keys, h, n)
                sc = (qq @ emulated_rows(k, bb, rows, kvh).T) * qk_scale
                if e >= e1:
                    sc = emulated_mask_rows(sc, los[e], his[e], q_abs, keys, h, n)
                m_new = torch.maximum(m_i, sc.max(1).values)
                m_use = torch.where(m_new == -math.inf, 0.0, m_new)
                p = torch.exp2(sc - m_use[:, None])
                alpha = torch.exp2(m_i - m_use)
                l_i = l_i * alpha + p.sum(1)
                acc = acc * alpha[:, None] + p @ emulated_rows(v, bb, rows, kvh)
                m_i = m_new
            nothing = l_i == 0
            l_safe = torch.where(nothing, 1.0, l_i)
            keep = q_loc < n_rows  # rows past the document's end are not stored
            dst = tok + q_loc[keep]
            lse_rows = torch.where(nothing, -math.inf, (m_i + torch.log2(l_safe)) * LN2)
            lse[bb, h, dst] = lse_rows[keep]
            out[bb, dst, h] = (acc / l_safe[:, None])[keep]
    return out, lse
