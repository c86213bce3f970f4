"""Tile-level index structures that drive the Triton kernels.

A kernel program owns a query tile of ``block_m`` tokens (forward, dQ) or a key tile of
``block_n`` tokens (dK/dV) and visits only the tiles the pattern connects it to. ``block_n``
never spans two pattern blocks (``block_size % block_n == 0``), while ``block_m`` may merge
several query blocks into one tile (Merge-Q): each (query tile, key tile) entry then carries the
absolute token range ``[lo, hi)`` of the tile's rows that attend it. That is exact whenever the
attending rows of every key block form one contiguous run inside the tile, which holds for every
S2 pattern (KV-cache efficient); user masks are checked and built without merging otherwise.

Entries of each program are ordered "full" first (every row attends every key: no masking in the
kernel) and "partial" second (causal diagonal, row range, sequence end). Programs are launched
head by head, heaviest first inside each head, so the long rows / vertical columns of a 128k
sequence do not form a tail while concurrent programs share one head's K/V in L2.

S2 layouts are generated arithmetically in O(heads * tiles * nnz) without any block mask; user
masks go through their (small) block mask.

Packed documents (varlen) reuse these layouts: the pattern restarts at each document start, so
a document of ``L`` tokens uses exactly the first ``ceil(L / tile)`` query and key tiles of a
layout for any length whose tiles are all complete. :func:`varlen_layout_len` picks that length
(few distinct values, so the cache stays small); the launch's program map (layout item, document
start and length per program) is built on the device from ``cu_seqlens`` (one small Triton launch
in :mod:`s2attn.tl_kernels`; :func:`varlen_programs` is its torch reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .pattern import S2Pattern

# Smallest tile side: tl.dot needs at least 16 rows and columns.
MIN_TILE = 16


class MergeNotExact(ValueError):
    """A user mask whose attending rows are not contiguous inside a merged query tile."""


@dataclass
class TileLayout:
    """Index arrays (int32, on the kernel's device) for one (sequence chunk, tile shape).

    CSR over query tiles (forward, dQ), items ``h * num_q_tiles + t``:
        ``row_ptr[item] .. row_split[item]`` full entries, ``.. row_ptr[item + 1]`` partial ones;
        ``cols[e]`` key tile, ``lo[e], hi[e]`` absolute query token range attending.
    CSC over key tiles (dK/dV), items ``h * num_k_tiles + kt``: ``col_ptr``, ``col_split``,
        ``rows`` (query tile), ``lo_c``, ``hi_c``.
    ``q_order``: query items, head by head, heaviest first within a head; ``kv_order``: (kv head,
    key tile) items likewise, each item's work summed over the query heads of its group.
    ``q_work``, ``kv_work``: those works (entries per item). Varlen launches run the orders per
    document, restricted to the document's tiles.
    """

    block_m: int
    block_n: int
    num_heads: int
    group: int
    num_q_tiles: int
    num_k_tiles: int
    row_ptr: torch.Tensor
    row_split: torch.Tensor
    cols: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    q_order: torch.Tensor
    q_work: torch.Tensor = None
    col_ptr: torch.Tensor = None
    col_split: torch.Tensor = None
    rows: torch.Tensor = None
    lo_c: torch.Tensor = None
    hi_c: torch.Tensor = None
    kv_order: torch.Tensor = None
    kv_work: torch.Tensor = None
    _csc_descending: tuple = None  # full_descending_columns' arrays, built on first use
    _csc_segment_keys: torch.Tensor = None  # document_column_entries' search keys, likewise

    @property
    def nnz(self) -> int:
        return int(self.cols.numel())


def _entry_columns(lay: TileLayout) -> torch.Tensor:
    """The column (CSC item) of each of ``lay``'s column-list entries, int64 ``[nnz]``."""
    ptr = lay.col_ptr.long()
    counts = ptr[1:] - ptr[:-1]
    return torch.repeat_interleave(torch.arange(counts.numel(), device=ptr.device), counts)


def full_descending_columns(lay: TileLayout) -> tuple:
    """``(rows, lo_c, hi_c)`` of ``lay``'s column lists with each list's full entries turned
    round, from the last query tile back (the partial ones after them as before; ``col_ptr``
    and ``col_split`` stay valid): the Gluon dK/dV pass's order. Built once per layout.

    The dK/dV programs of one head that run at the same time are its heaviest columns, the
    vertical stripes, ``vert_stride`` blocks apart. In ascending order each reads a query tile's
    Q and dO ``vert_stride`` steps after its neighbour did, and in between they fell out of L2
    (at 32k the pass drew 61% of the H100's DRAM bandwidth, the dense pattern 2%); from the
    end, they read the same tiles in the same steps. (The ``tl`` kernels keep the ascending
    order: their packed-document path counts each list's prefix inside a document.)"""
    if lay._csc_descending is None:
        column = _entry_columns(lay)
        idx = torch.arange(column.numel(), device=column.device)
        start = lay.col_ptr.long()[column]
        split = lay.col_split.long()[column]
        perm = torch.where(idx < split, start + split - 1 - idx, idx)
        lay._csc_descending = tuple(x[perm].contiguous() for x in (lay.rows, lay.lo_c, lay.hi_c))
    return lay._csc_descending


def document_column_entries(
    lay: TileLayout, prog_item: torch.Tensor, prog_len: torch.Tensor
) -> torch.Tensor:
    """The entries of each dK/dV program-map slot's columns that lie in its document: int32
    ``[slots, group, 2]``, the first and end entry of the column of every query head of the
    slot's group (``prog_item``: ``kv_head * num_k_tiles + key_tile``; ``prog_len``: document
    lengths, 0 on padding slots, which get no entries).

    A layout serves documents up to its length, so a column lists query tiles past a shorter
    document's end. In :func:`full_descending_columns`' order those are the first full entries
    and the last partial ones: the document's entries are one run, ``col_split`` inside it (or
    at either end). Found by binary search in one sorted key per entry (segment, query tile),
    torch ops on the layout's device, no host sync."""
    if lay._csc_segment_keys is None:
        column = _entry_columns(lay)
        idx = torch.arange(column.numel(), device=column.device)
        # Segments 2c (full entries of column c) and 2c + 1 (its partial ones) follow each other
        # in entry order, each ascending in query tile: the keys ascend over the whole list.
        segment = 2 * column + (idx >= lay.col_split.long()[column]).long()
        lay._csc_segment_keys = segment * (lay.num_q_tiles + 1) + lay.rows.long()
    keys, span = lay._csc_segment_keys, lay.num_q_tiles + 1
    item = prog_item.long()
    heads = torch.arange(lay.group, device=item.device)
    kv_head, key_tile = item // lay.num_k_tiles, item % lay.num_k_tiles
    column = (kv_head[:, None] * lay.group + heads) * lay.num_k_tiles + key_tile[:, None]
    touched = (prog_len.long()[:, None] + lay.block_m - 1) // lay.block_m  # the document's tiles
    full_inside = torch.searchsorted(keys, 2 * column * span + touched) - lay.col_ptr.long()[column]
    first = lay.col_split.long()[column] - full_inside
    end = torch.searchsorted(keys, (2 * column + 1) * span + touched)
    return torch.stack((first, end), -1).to(torch.int32).contiguous()


def _s2_entries(pattern: S2Pattern, seq_q, seq_k, q_start, k_start, block_m, block_n, device):
    """Arithmetic (item, key tile, lo, hi) entries of an S2-rule pattern."""
    B, L, V = pattern.block_size, pattern.local_blocks, pattern.vert_stride
    H = pattern.local_num_heads
    nqt = -(-seq_q // block_m)
    dense, res = pattern.head_params(device)
    t = torch.arange(nqt, device=device)
    tile_start = q_start + t * block_m
    tile_last = torch.clamp(tile_start + block_m, max=q_start + seq_q) - 1
    qb0 = (tile_start // B)[None, :].expand(H, nqt)
    qb1 = (tile_last // B)[None, :].expand(H, nqt)
    kb_lo, kb_hi = k_start // B, (k_start + seq_k - 1) // B
    dn = dense[:, None].expand(H, nqt)
    r = res[:, None].expand(H, nqt)
    # Local band [a_loc, b_loc] (everything up to the diagonal for dense heads).
    a_loc = torch.where(dn, torch.full_like(qb0, kb_lo), torch.clamp(qb0 - L + 1, min=kb_lo))
    b_loc = torch.clamp(qb1, max=kb_hi)
    n_loc = torch.clamp(b_loc - a_loc + 1, min=0)
    # Stripes strictly left of the band: j in [kb_lo, min(qb0 - L, kb_hi)], j % V == r.
    va = torch.full_like(qb0, kb_lo)
    vb = torch.clamp(qb0 - L, max=kb_hi)
    n_vert = torch.div(vb - r, V, rounding_mode="floor") - torch.div(
        va - 1 - r, V, rounding_mode="floor"
    )
    n_vert = torch.where(dn | (vb < va), torch.zeros_like(n_vert), n_vert)
    first_v = va + torch.remainder(r - va, V)
    sub = B // block_n
    counts = ((n_vert + n_loc) * sub).flatten()
    item = torch.repeat_interleave(torch.arange(H * nqt, device=device), counts)
    ptr = torch.cumsum(counts, 0) - counts
    e = torch.arange(item.numel(), device=device) - ptr[item]
    blk, sub_i = torch.div(e, sub, rounding_mode="floor"), e % sub
    nv, fv, al = n_vert.flatten()[item], first_v.flatten()[item], a_loc.flatten()[item]
    j = torch.where(blk < nv, fv + blk * V, al + (blk - nv))
    kt = torch.div(j * B - k_start, block_n, rounding_mode="floor") + sub_i
    hh = torch.div(item, nqt, rounding_mode="floor")
    tt = item % nqt
    vertical = dense[hh] | (j % V == res[hh])
    q0, q1 = qb0.flatten()[item], qb1.flatten()[item]
    lo_blk = torch.maximum(q0, j)
    hi_blk = torch.where(vertical, q1, torch.minimum(q1, j + L - 1))
    lo = torch.maximum(lo_blk * B, tile_start[tt])
    hi = torch.minimum((hi_blk + 1) * B, tile_last[tt] + 1)
    return item, kt, lo, hi


def _mask_entries(pattern: S2Pattern, seq_q, seq_k, q_start, k_start, block_m, block_n, device):
    """Entries of a user block mask; raises MergeNotExact if merged rows are not contiguous."""
    B = pattern.block_size
    nqt = -(-seq_q // block_m)
    qb0, qb1 = q_start // B, (q_start + seq_q - 1) // B
    kb0, kb1 = k_start // B, (k_start + seq_k - 1) // B
    bm = pattern.block_mask(qb1 - qb0 + 1, kb1 - kb0 + 1, qb0, kb0).to(device)
    h, i, j = torch.nonzero(bm, as_tuple=True)
    i, j = i + qb0, j + kb0
    # A block may span several tiles (block_m < B) or a tile several blocks (Merge-Q).
    per = max(1, B // block_m)
    if per > 1:
        h, i, j = (x.repeat_interleave(per) for x in (h, i, j))
        t = torch.div(i * B - q_start, block_m, rounding_mode="floor") + torch.arange(
            per, device=device
        ).repeat(len(i) // per)
    else:
        t = torch.div(i * B - q_start, block_m, rounding_mode="floor")
    keep = t < nqt
    h, i, j, t = h[keep], i[keep], j[keep], t[keep]
    nkb = kb1 - kb0 + 1
    key = (h * nqt + t) * nkb + (j - kb0)
    uniq, inv = torch.unique(key, return_inverse=True)
    big = torch.iinfo(torch.int64).max
    imin = torch.full_like(uniq, big).scatter_reduce(0, inv, i, "amin")
    imax = torch.full_like(uniq, -1).scatter_reduce(0, inv, i, "amax")
    cnt = torch.zeros_like(uniq).scatter_add(0, inv, torch.ones_like(i))
    if per == 1 and bool((cnt != imax - imin + 1).any()):
        raise MergeNotExact("rows attending a key block are not contiguous within a query tile")
    item = torch.div(uniq, nkb, rounding_mode="floor")
    jj = uniq % nkb + kb0
    tt = item % nqt
    tile_start = q_start + tt * block_m
    tile_end = torch.clamp(tile_start + block_m, max=q_start + seq_q)
    sub = B // block_n
    item, jj, tile_start, tile_end, imin, imax = (
        x.repeat_interleave(sub) for x in (item, jj, tile_start, tile_end, imin, imax)
    )
    kt = torch.div(jj * B - k_start, block_n, rounding_mode="floor") + torch.arange(
        sub, device=device
    ).repeat(len(uniq))
    lo = torch.maximum(imin * B, tile_start)
    hi = torch.minimum((imax + 1) * B, tile_end)
    return item, kt, lo, hi


def _full_flags(item, kt, lo, hi, nqt, seq_q, seq_k, q_start, k_start, block_m, block_n):
    t = item % nqt
    t0 = q_start + t * block_m
    t1 = t0 + block_m
    return (
        (lo <= t0)
        & (hi >= t1)
        & (t1 <= q_start + seq_q)
        & (k_start + (kt + 1) * block_n - 1 <= t0)
        & ((kt + 1) * block_n <= seq_k)
    )


def _ptrs(groups, num_groups):
    counts = torch.bincount(groups, minlength=num_groups)
    ptr = torch.zeros(num_groups + 1, dtype=torch.int64, device=groups.device)
    ptr[1:] = torch.cumsum(counts, 0)
    return ptr, counts


def _full_first(group: torch.Tensor, full: torch.Tensor, ptr: torch.Tensor, num_groups: int):
    """Permutation moving, inside each run of equal ``group`` (sorted input), the ``full``
    entries before the others, both keeping their order; and the full count per group."""
    n = group.numel()
    f = full.to(torch.int64)
    before = torch.cumsum(f, 0) - f  # full entries before e (exclusive)
    start = ptr[:-1][group]
    full_rank = before - before[start] if n else before
    n_full = torch.bincount(group[full], minlength=num_groups)
    rank_in_rest = torch.arange(n, device=group.device) - start - full_rank
    pos = torch.where(full, start + full_rank, start + n_full[group] + rank_in_rest)
    perm = torch.empty_like(pos)
    perm[pos] = torch.arange(n, device=group.device)
    return perm, n_full


def _head_major_heavy_first(work: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Program order: head by head (concurrent programs then share one head's K/V in L2),
    heaviest tiles first inside each head (so no long program is left for the tail)."""
    per = work.numel() // num_heads
    head = torch.arange(work.numel(), device=work.device) // per
    most = int(work.max())
    return torch.argsort(head * (most + 1) + (most - work), stable=True)


def build_layout(
    pattern: S2Pattern,
    seq_q: int,
    seq_k: int,
    q_start: int,
    k_start: int,
    block_m: int,
    block_n: int,
    device,
    with_csc: bool,
) -> TileLayout:
    """Build (or fetch from the pattern's cache) the tile layout for one attention call."""
    key = (seq_q, seq_k, q_start, k_start, block_m, block_n, str(device), with_csc)
    cache = pattern._cache
    if key in cache:
        return cache[key]
    if pattern.block_size % block_n:
        raise ValueError(f"block_n={block_n} must divide block_size={pattern.block_size}")
    build = _mask_entries if pattern.is_user_mask else _s2_entries
    item, kt, lo, hi = build(pattern, seq_q, seq_k, q_start, k_start, block_m, block_n, device)
    keep = (kt * block_n < seq_k) & (lo < hi)
    item, kt, lo, hi = item[keep], kt[keep], lo[keep], hi[keep]
    H = pattern.local_num_heads
    nqt = -(-seq_q // block_m)
    nkt = -(-seq_k // block_n)
    full = _full_flags(item, kt, lo, hi, nqt, seq_q, seq_k, q_start, k_start, block_m, block_n)
    lay = assemble_layout(
        item, kt, lo, hi, full, H, pattern.group_size, nqt, nkt, block_m, block_n, with_csc
    )
    cache[key] = lay
    return lay


def assemble_layout(
    item, kt, lo, hi, full, num_heads, group, nqt, nkt, block_m, block_n, with_csc
) -> TileLayout:
    """The :class:`TileLayout` of entries ``item`` (``h * nqt + query tile``), ``kt`` (key
    tile), ``lo``/``hi`` (query token range attending) and ``full`` (no mask needed), sorted by
    (item, key tile); ``group`` query heads share a KV head. With ``with_csc`` also the
    column lists of the dK/dV pass."""
    H = num_heads
    i32 = lambda x: x.to(torch.int32).contiguous()
    # Entries arrive sorted by (item, key tile); a stable full-first partition inside each item
    # gives the CSR order without a sort.
    row_ptr, counts = _ptrs(item, H * nqt)
    order, n_full = _full_first(item, full, row_ptr, H * nqt)
    lay = TileLayout(
        block_m=block_m,
        block_n=block_n,
        num_heads=H,
        group=group,
        num_q_tiles=nqt,
        num_k_tiles=nkt,
        row_ptr=i32(row_ptr),
        row_split=i32(row_ptr[:-1] + n_full),
        cols=i32(kt[order]),
        lo=i32(lo[order]),
        hi=i32(hi[order]),
        q_order=i32(_head_major_heavy_first(counts, H)),
        q_work=i32(counts),
    )
    if with_csc:
        h = torch.div(item, nqt, rounding_mode="floor")
        t = item % nqt
        citem = h * nkt + kt
        # Stable sort by key tile keeps query tiles ascending inside each (head, key tile).
        # int32 keys sort faster; the key range decides whether they fit.
        fits = H * nkt <= torch.iinfo(torch.int32).max
        by_col = torch.sort(citem.to(torch.int32) if fits else citem, stable=True).indices
        citem_s = citem[by_col]
        col_ptr, ccounts = _ptrs(citem_s, H * nkt)
        corder, nc_full = _full_first(citem_s, full[by_col], col_ptr, H * nkt)
        corder = by_col[corder]
        kv_work = ccounts.view(H // group, group, nkt).sum(1).flatten()
        lay.col_ptr, lay.col_split = i32(col_ptr), i32(col_ptr[:-1] + nc_full)
        lay.rows, lay.lo_c, lay.hi_c = i32(t[corder]), i32(lo[corder]), i32(hi[corder])
        lay.kv_order = i32(_head_major_heavy_first(kv_work, H // group))
        lay.kv_work = i32(kv_work)
    return lay


def layout_for(
    pattern: S2Pattern, seq_q, seq_k, q_start, k_start, block_m, block_n, device, with_csc=False
) -> TileLayout:
    """Like :func:`build_layout`, falling back to unmerged query tiles (``block_m`` = block
    size, at least ``MIN_TILE``) when a user mask cannot be merged exactly."""
    try:
        return build_layout(
            pattern, seq_q, seq_k, q_start, k_start, block_m, block_n, device, with_csc
        )
    except MergeNotExact:
        bm = max(MIN_TILE, min(block_m, pattern.block_size))
        return build_layout(pattern, seq_q, seq_k, q_start, k_start, bm, block_n, device, with_csc)


# ------------------------------------------------------------------------------ packed documents
# Sort keys of varlen programs: (document, head) above, inverted work below these many bits
# (a layout item's entry count fits in an int32).
_WORK_BITS = 31
_WORK_MAX = (1 << _WORK_BITS) - 1


def varlen_layout_len(pattern: S2Pattern, max_seqlen: int, largest_tile: int) -> int:
    """Length of the layout that serves documents of up to ``max_seqlen`` tokens.

    The next power of two (at least ``largest_tile``, so every tile of the layout is complete):
    a document's tiles then have the same entries whatever ``max_seqlen`` is, so its results do
    not depend on the other documents of the pack, and the varying maximum of packed batches
    maps to few layouts (each cached by the pattern; together at most 4/3 the memory of the
    largest). A user mask caps it at the mask's length.
    """
    n = 1 << (max(max_seqlen, largest_tile, 1) - 1).bit_length()
    return n if pattern.max_seq_len is None else min(n, pattern.max_seq_len)


def varlen_grid(
    num_docs: int, max_seqlen: int, total_tokens: int, tile: int, num_heads: int, num_tiles: int
) -> int:
    """Program slots of a varlen launch, from host values only: per head at most
    ``min(ceil(total / tile) + num_docs, num_docs * ceil(max_seqlen / tile))`` tiles (the latter
    clamped to the layout's ``num_tiles``); the slots past the real count are padding."""
    per_doc = min(-(-max_seqlen // tile), num_tiles)
    return num_heads * min(-(-total_tokens // tile) + num_docs, num_docs * per_doc)


def varlen_programs(
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    total_tokens: int,
    tile: int,
    num_heads: int,
    num_tiles: int,
    work: torch.Tensor,
):
    """Program map of a launch over packed documents with torch ops: ``(grid, prog_doc,
    prog_item)`` (the reference of the kernels' map, which one small Triton launch builds in
    :func:`s2attn.tl_kernels.varlen_program_map`).

    Program ``p`` does layout item ``prog_item[p]`` (``head * num_tiles + tile``, ``tile`` tokens
    each) of document ``prog_doc[p]``. Programs go document by document, head by head and, within
    a head, heaviest first by ``work`` (entries per layout item, ties by tile): the order of a
    fixed-length launch over a batch, so equal documents run exactly like a batch.

    Built on ``cu_seqlens``' device without reading it back: :func:`varlen_grid` bounds the
    program count; the slots past the real count (at most ``num_docs`` per head) get document
    ``num_docs`` and item 0. Tiles are clamped to the layout's ``num_tiles`` so that even invalid
    lengths read nothing outside the layout.
    """
    device = cu_seqlens.device
    num_docs = cu_seqlens.numel() - 1
    grid = varlen_grid(num_docs, max_seqlen, total_tokens, tile, num_heads, num_tiles)
    cu = cu_seqlens.to(torch.int64)
    tiles = torch.clamp(torch.div(cu[1:] - cu[:-1] + tile - 1, tile, rounding_mode="floor"), 0)
    tiles = torch.clamp(tiles, max=num_tiles)
    progs = tiles * num_heads
    ends = torch.cumsum(progs, 0)
    pid = torch.arange(grid, device=device)
    doc = torch.searchsorted(ends, pid, right=True)
    real = doc < num_docs
    d = torch.clamp(doc, max=max(num_docs - 1, 0))
    local = pid - (ends[d] - progs[d])
    per_head = torch.clamp(tiles[d], min=1)
    head = torch.where(real, torch.div(local, per_head, rounding_mode="floor"), 0)
    item = torch.where(real, head * num_tiles + local % per_head, 0)
    key = ((doc * num_heads + head) << _WORK_BITS) + (_WORK_MAX - work.to(torch.int64)[item])
    order = torch.sort(key, stable=True).indices
    return grid, doc[order].to(torch.int32), item[order].to(torch.int32)
