"""Plain PyTorch S2 attention: the ground truth for tests and the CPU fallback.

Computes attention one chunk of query blocks at a time under activation checkpointing, so peak
memory is O(chunk x seq) rather than O(seq^2) in forward and backward.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from .pattern import S2Pattern

# Query tokens per checkpointed chunk: bounds the reference's peak memory to about
# chunk x seq_k scores per head.
DEFAULT_CHUNK_TOKENS = 1024


def _chunk(q, k, v, pattern: S2Pattern, scale: float, q_pos0: int, k_start: int):
    """q: [b, c, hq, d] at absolute positions q_pos0..; k, v: [b, sk, hq, d] (already grouped)."""
    B = pattern.block_size
    c, sk = q.shape[1], k.shape[1]
    qb0, qb1 = q_pos0 // B, (q_pos0 + c - 1) // B
    kb0, kb1 = k_start // B, (k_start + sk - 1) // B
    bm = pattern.block_mask(qb1 - qb0 + 1, kb1 - kb0 + 1, qb0, kb0).to(q.device)  # (h, nq, nk)
    qpos = torch.arange(q_pos0, q_pos0 + c, device=q.device)
    kpos = torch.arange(k_start, k_start + sk, device=q.device)
    allowed = bm[:, (qpos // B - qb0)][:, :, (kpos // B - kb0)]  # (h, c, sk)
    allowed = allowed & (kpos[None, :] <= qpos[:, None])[None]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = s.masked_fill(~allowed[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (b, h, c)
    # Rows with nothing allowed (only possible with offsets) get zero output, lse = -inf.
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    o = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return o, lse


def s2_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: S2Pattern,
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
    q_start: int = 0,
    k_start: int = 0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
):
    """Reference S2 attention (same contract as :func:`s2attn.s2_attention`).

    Args:
        q: ``[batch, seq_q, heads, head_dim]``; k, v: ``[batch, seq_k, kv_heads, head_dim]``.
        pattern: pattern whose local heads match ``heads``.
        softmax_scale: defaults to ``1/sqrt(head_dim)``.
        q_start, k_start: absolute token position of the first query / key.
        chunk_tokens: query tokens per checkpointed chunk (peak memory ~ chunk x seq_k scores).
    Returns:
        out ``[batch, seq_q, heads, head_dim]`` in q's dtype (and lse ``[batch, heads, seq_q]``,
        fp32 natural log, if ``return_lse``). Computed in fp32 (fp64 for fp64 inputs).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = q.shape[2] // k.shape[2]
    qf = q.to(work)
    kf = k.to(work).repeat_interleave(g, dim=2)
    vf = v.to(work).repeat_interleave(g, dim=2)
    B = pattern.block_size
    step = max(B, (chunk_tokens // B) * B)
    outs, lses = [], []
    sq = q.shape[1]
    bounds = list(range(0, sq, step)) + [sq]
    for a, b in zip(bounds[:-1], bounds[1:]):
        fn = lambda qq, kk, vv, a=a: _chunk(qq, kk, vv, pattern, scale, q_start + a, k_start)
        if torch.is_grad_enabled() and (qf.requires_grad or kf.requires_grad or vf.requires_grad):
            o, lse = checkpoint(fn, qf[:, a:b], kf, vf, use_reentrant=False)
        else:
            o, lse = fn(qf[:, a:b], kf, vf)
        outs.append(o)
        lses.append(lse)
    out = torch.cat(outs, dim=1).to(q.dtype)
    if return_lse:
        return out, torch.cat(lses, dim=-1).float()
    return out


def s2_attention_varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    pattern: S2Pattern,
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
):
    """Reference of :func:`s2attn.s2_attention_varlen`: :func:`s2_attention_reference` on each
    document of the packed ``q [total, heads, dim]``, ``k, v [total, kv_heads, dim]`` in turn
    (positions restart at each document). Reads ``cu_seqlens`` on the host.

    Returns out ``[total, heads, dim]`` in q's dtype (and lse ``[heads, total]`` fp32).
    """
    bounds = cu_seqlens.tolist()
    outs, lses = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if a == b:
            continue
        o, lse = s2_attention_reference(
            q[None, a:b],
            k[None, a:b],
            v[None, a:b],
            pattern,
            softmax_scale=softmax_scale,
            return_lse=True,
            chunk_tokens=chunk_tokens,
        )
        outs.append(o[0])
        lses.append(lse[0])
    if not outs:  # no tokens at all: empty results, still connected to q for autograd
        out, lse = q.clone(), q.sum(-1).t().float()
    else:
        out, lse = torch.cat(outs, 0), torch.cat(lses, -1)
    return (out, lse) if return_lse else out
