"""Which kernels run an S2 attention call, and the autograd Function around them.

:func:`s2attn.s2_attention` and :func:`s2attn.s2_attention_varlen` (``attention.py``) call
:class:`S2AttentionFunction`; its forward runs :func:`s2_forward`, its backward
:func:`s2_backward`. Each pass takes one of two kernels, by the call's :class:`KernelConfig`
(default :func:`s2attn.config.kernel_config`) and by what the call is:

* the Gluon kernel (``gluon_forward.py``, ``gluon_dq.py``, ``gluon_dkdv.py``: sm_90) where the
  config turns it on (``gluon_fwd``, ``gluon_dq``, ``gluon_dkdv``; on by default on an H100/H200
  with a checked Triton, ``S2ATTN_GLUON_FORWARD`` overrides) and the call qualifies
  (:func:`s2attn.gluon_forward.unsupported_reason`: self-attention or a context-parallel chunk,
  bf16/fp16, head_dim 64 or 128, block 64 or 128, or 16 and 32 on gathered key tiles,
  ``gathered_keys.py``; the backward passes at ``GLUON_BWD_BLOCKS``);
* the ``tl`` kernel (``tl_kernels.py``) otherwise: any GPU, the CPU interpreter, fp32, other
  shapes, offsets, and user masks whose blocks do not merge into the Gluon kernels' tiles.

The passes exchange only ``out``, ``lse`` and ``delta``, so any mix of the two runs (e.g. the
Gluon forward with the ``tl`` backward).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import gathered_keys, gluon_dkdv, gluon_dq, gluon_forward, tl_kernels
from .config import GLUON_BWD_BLOCKS, KernelConfig, kernel_config
from .pattern import S2Pattern
from .tl_kernels import Varlen, pass_layout


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
    sq, d = q.shape[1], q.shape[-1]
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
    return tl_kernels.s2_forward_tl(q, k, v, pattern, scale, q_start, k_start, cfg, varlen)


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
    blocks 16 and 32: summed from per-head parts). The dQ pass runs first: it forms ``delta``,
    which the dK/dV pass reads."""
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
        dq, delta = tl_kernels.s2_dq_tl(do, dlse, q, k, v, out, lse, *args)
    if dkdv_ok:
        tile = gluon_dkdv.TILE_M
        lay = pass_layout(pattern, sq, sk, q_start, 0, tile, bn, q.device, varlen, csc=True)
        if lay.block_m == gluon_dkdv.TILE_M:
            dk, dv = gluon_dkdv.s2_dkdv_gluon(
                do, q, k, v, lse, delta, pattern, scale, lay, q_start, varlen=varlen
            )
            return dq, dk, dv
    dk, dv = tl_kernels.s2_dkdv_tl(do, q, k, v, lse, delta, *args)
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
        dq, delta = tl_kernels.s2_dq_tl(do, dlse, q, k, v, out, lse, *args)
    if not cfg.gluon_dkdv:
        return (dq, *tl_kernels.s2_dkdv_tl(do, q, k, v, lse, delta, *args))
    dk, dv = gluon_dkdv.s2_dkdv_gluon(
        do, q, k, v, lse, delta, pattern, scale, q_start=q_start, keys=keys
    )
    group = pattern.group_size
    dk = gathered_keys.sum_groups(dk, group, k.dtype)
    return dq, dk, gathered_keys.sum_groups(dv, group, v.dtype)


def _gluon_rows_layout(pattern, sq, sk, q_start, tile, block_n, device, varlen):
    """The row-list layout of a Gluon forward or dQ call at ``tile`` query rows; where a user
    mask merges into 128-row tiles but not into the 192-row ones of head_dim 64, at 128 rows
    (two consumer warpgroups), as before the wider tiles."""
    lay = pass_layout(pattern, sq, sk, q_start, 0, tile, block_n, device, varlen)
    if lay.block_m != tile and tile != gluon_forward.TILE_M:
        lay = pass_layout(
            pattern, sq, sk, q_start, 0, gluon_forward.TILE_M, block_n, device, varlen
        )
    return lay
