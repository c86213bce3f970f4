"""Gathered key tiles: S2 patterns whose blocks are smaller than the Gluon kernels' 64-key tile.

At block 16 or 32 a 64-key tile of the sequence holds several pattern blocks that different
query rows attend: typically one vertical block, attended by every later query, among local
ones, attended only inside the window. A kernel on such tiles would compute the whole tile for
the one block's long column; one on 16-key tiles runs tiny MMAs (``mma.sync``, not wgmma).

Instead each query head gets its own order of the keys: its vertical blocks first, then the
other blocks, both ascending. Consecutive :data:`TILE_N` keys of that order form a tile whose
blocks are of one kind (but one tile per head where the vertical keys do not fill whole tiles),
so a vertical tile is attended in full by every query tile after its
last key (the long columns of the block-64 layout), and a local tile by the few query tiles of
its window. The Gluon kernels run on these tiles, loading each from K and V with one TMA box
per pattern block at the block's position (nothing is copied). A partial entry masks each key
``p`` of head ``h`` by the query range that attends it, ``key_lo[h, p] <= q < key_hi[h, p]``:
from the key's own position (causal) to the end of its window for a local block, to the end of
the sequence for a vertical one. That is the S2 rule itself (a key in block ``j`` is attended
by query block ``i >= j`` iff ``i - j < L`` or ``j`` is vertical), so the masks are exact for
every S2 pattern; dense heads have only vertical blocks. The dK/dV pass stores each tile's
gradients box by box at the keys' positions, one per query head (a KV group's heads see
different tiles); :func:`sum_groups` adds a group's. Under GQA that costs two transient
``[b, seq, heads, d]`` buffers in the backward (dK and dV per query head); the index arrays
(``key_lo``/``key_hi`` and the layouts) are built once per pattern and length and cached.

Only S2-rule patterns, one sequence per call (no packed documents), keys from position 0 with
the queries their last positions (self-attention, or a context-parallel chunk) and lengths that
are multiples of 128 take this path (:func:`unsupported_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .layout import TileLayout, assemble_layout
from .pattern import S2Pattern

TILE_N = 64  # keys per gathered tile: the Gluon kernels' key tile
BLOCK_SIZES = (16, 32)  # blocks that pack whole into TILE_N (64 and up take the plain layout)
SEQ_MULTIPLE = 128  # the Gluon forward's query tile


def unsupported_reason(
    pattern: S2Pattern, seq_q: int, seq_k: int, q_start: int, varlen
) -> Optional[str]:
    """Why a call with these settings cannot run on gathered key tiles (None: it can)."""
    if pattern.is_user_mask:
        return "a user block mask (gathered tiles follow the S2 rule)"
    if pattern.block_size not in BLOCK_SIZES:
        return f"block_size {pattern.block_size}: not one of {BLOCK_SIZES}"
    if varlen is not None:
        return "packed documents (varlen)"
    if q_start + seq_q != seq_k:
        return "the queries are not the keys' last positions (q_start + seq_q != seq_k)"
    if seq_q % SEQ_MULTIPLE or seq_k % SEQ_MULTIPLE:
        return f"sequence lengths {seq_q}, {seq_k}: not multiples of {SEQ_MULTIPLE}"
    return None


@dataclass
class GatheredKeys:
    """Per query head, the order of the keys that packs each 64-key tile with blocks of one
    kind, for ``seq`` keys from position 0.

    ``order [seq, heads]`` int64: the key position at gathered position ``p`` of head ``h``.
    ``key_lo, key_hi [heads, seq]`` int32: queries ``key_lo <= q < key_hi`` attend
    gathered key ``p``.
    """

    seq: int
    order: torch.Tensor
    key_lo: torch.Tensor
    key_hi: torch.Tensor
    _layouts: dict = field(default_factory=dict, repr=False)

    @property
    def num_heads(self) -> int:
        return self.order.shape[1]

    def layout(self, block_m: int, with_csc: bool = False, q_start: int = 0) -> TileLayout:
        """The tile layout over ``block_m``-row query tiles of the queries at ``q_start ..
        seq - 1`` (a context-parallel chunk's, or all) and the gathered ``TILE_N``-key tiles
        (one KV head per query head: ``group`` 1)."""
        key = (block_m, with_csc, q_start)
        if key not in self._layouts:
            self._layouts[key] = _gathered_layout(self, block_m, with_csc, q_start)
        return self._layouts[key]


def gathered_keys(pattern: S2Pattern, seq: int, device) -> GatheredKeys:
    """Build (or fetch from the pattern's cache) the :class:`GatheredKeys` of ``pattern``'s
    local heads for ``seq`` keys from position 0 (a multiple of :data:`SEQ_MULTIPLE`)."""
    key = ("gathered_keys", seq, str(device))
    cache = pattern._cache
    if key in cache:
        return cache[key]
    B, L, V = pattern.block_size, pattern.local_blocks, pattern.vert_stride
    if B not in BLOCK_SIZES or seq % SEQ_MULTIPLE:
        raise ValueError(
            f"gathered_keys: block_size {B} (allowed {BLOCK_SIZES}) and seq {seq} (a multiple of "
            f"{SEQ_MULTIPLE})"
        )
    nb = seq // B
    dense, res = pattern.head_params(device)
    blk = torch.arange(nb, device=device)
    vertical = dense[:, None] | (blk[None, :] % V == res[:, None])  # [heads, blocks]
    # Vertical blocks first, then the local-only ones, each kind ascending.
    blk_order = torch.argsort((~vertical).to(torch.int64) * nb + blk[None, :], dim=1)
    pos = (blk_order[:, :, None] * B + torch.arange(B, device=device)).reshape(-1, seq)
    vert_key = vertical.gather(1, blk_order).repeat_interleave(B, dim=1)
    window_end = torch.clamp((pos // B + L) * B, max=seq)
    key_hi = torch.where(vert_key, torch.full_like(pos, seq), window_end)
    keys = GatheredKeys(
        seq=seq,
        order=pos.t().contiguous(),
        key_lo=pos.to(torch.int32).contiguous(),
        key_hi=key_hi.to(torch.int32).contiguous(),
    )
    cache[key] = keys
    return keys


def _gathered_layout(keys: GatheredKeys, block_m: int, with_csc: bool, q_start: int) -> TileLayout:
    """Entries of every (query tile, gathered key tile) pair that some key of the tile is
    attended by: the query tiles from the tile's first attending row to its last; full where
    every key is attended by every row of the query tile."""
    H, S = keys.num_heads, keys.seq
    nqt, nkt = (S - q_start) // block_m, S // TILE_N
    lo_t = keys.key_lo.view(H, nkt, TILE_N).to(torch.int64)
    hi_t = keys.key_hi.view(H, nkt, TILE_N).to(torch.int64)
    min_lo, max_lo = lo_t.min(-1).values.flatten(), lo_t.max(-1).values.flatten()
    min_hi, max_hi = hi_t.min(-1).values.flatten(), hi_t.max(-1).values.flatten()
    # Query tiles (of the queries from q_start) between the tile's first and last attending row.
    first = torch.clamp(min_lo - q_start, min=0) // block_m
    counts = torch.clamp((max_hi - 1 - q_start) // block_m - first + 1, min=0)
    col = torch.repeat_interleave(torch.arange(H * nkt, device=min_lo.device), counts)
    ptr = torch.cumsum(counts, 0) - counts
    qt = first[col] + torch.arange(col.numel(), device=col.device) - ptr[col]
    h, kt = torch.div(col, nkt, rounding_mode="floor"), col % nkt
    item = h * nqt + qt
    by_row = torch.argsort(item * nkt + kt)
    item, kt, qt, col = item[by_row], kt[by_row], qt[by_row], col[by_row]
    t0 = q_start + qt * block_m
    t1 = t0 + block_m
    full = (t0 >= max_lo[col]) & (t1 <= min_hi[col])
    lo = torch.maximum(t0, min_lo[col])
    hi = torch.minimum(t1, max_hi[col])
    return assemble_layout(item, kt, lo, hi, full, H, 1, nqt, nkt, block_m, TILE_N, with_csc)


def check_call(fn: str, keys, pattern: S2Pattern, num_heads: int, seq_k: int, lay=None) -> None:
    """ValueError naming ``fn`` unless ``keys`` (or None) fits a call of ``pattern`` with
    ``num_heads`` query heads and ``seq_k`` keys: gathered tiles exactly at blocks 16 and 32,
    and no explicit layout ``lay`` beside them (the tiles come with their own)."""
    if keys is not None and lay is not None:
        raise ValueError(
            f"{fn}: pass either lay or keys, not both (gathered keys build their own layout)"
        )
    gathered = pattern.block_size in BLOCK_SIZES
    if (keys is not None) != gathered:
        raise ValueError(
            f"{fn}: block_size {pattern.block_size} runs on gathered key tiles "
            f"(keys=gathered_keys(...)) exactly when it is one of {BLOCK_SIZES}"
        )
    if keys is not None and (keys.seq != seq_k or keys.num_heads != num_heads):
        raise ValueError(
            f"{fn}: the gathered keys are for {keys.num_heads} heads x {keys.seq} keys, the call "
            f"has {num_heads} x {seq_k}"
        )


def sum_groups(g: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-query-head gradients ``g [b, seq, heads, d]`` (the dK/dV pass on gathered tiles,
    each already rounded to its dtype: under GQA the result carries ``group`` roundings where
    the block-64 pass rounds once) summed over each KV group's ``group`` heads in fp32 or
    wider: ``[b, seq, h_kv, d]`` of ``dtype`` (``g`` itself when ``group`` is 1)."""
    if group == 1:
        return g.to(dtype)
    b, s, h, d = g.shape
    acc = torch.promote_types(g.dtype, torch.float32)
    # sum(dtype=) widens each element as the reduction reads it: g.to(acc).sum(3) wrote and
    # read a float32 copy of g first, 3-4 ms of a 45 ms fwd+bwd (32k, GQA 32/8, H100).
    return g.view(b, s, h // group, group, d).sum(3, dtype=acc).to(dtype)
