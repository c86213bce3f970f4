"""Context parallelism by head all-to-all (``cp_comm_type="a2a"``, DeepSpeed-Ulysses style).

Megatron gives CP rank ``r`` of ``cp`` two load-balanced chunks of ``c`` tokens (chunks ``r``
and ``2 * cp - 1 - r`` of ``2 * cp``; :mod:`megatron_s2.context_parallel`) for all of its heads.
Here one exchange over the CP group turns that into the **whole sequence for a ``1/cp`` slice
of the heads** (head group ``r``), the layer attends it exactly as a single GPU would (one
causal call over ``S`` tokens; S2 heads keep their global phases), and a second exchange brings
each rank's rows of every head group back. Backward runs the two exchanges the other way.

Why next to the all-gather design: every rank's attention is then one call over the whole
sequence, which runs at the single-GPU rate per token, where a rank's two chunk-sized calls
run slower at 32k (cuDNN: 3-12% per token), and it holds no gathered K/V of all heads; the
price is the copies below, large next to an S2 layer's short calls. Dense layers take it by
default up to 64k tokens (trained 1.5-2.5% faster at 32k-64k on two H100s;
``docs/context_parallel.md``), except on FlashAttention-4 where GQA makes it move far more
than the all-gather (``megatron_s2.attention.FA4_GATHER_MIN_VOLUME_RATIO``).
It needs the rank's query heads and K/V heads to be divisible by ``cp``.

Every exchange sends each chunk of each tensor as its own message straight into its place in
the receiving buffer (batched point-to-point, which NCCL runs as one grouped call), so no copy
restores chunk order, and a head group's q, k and v arrive as separate sequence-major tensors,
so the kernels' outputs and gradients come out in the layout the return exchange sends as it is.
The copies that remain are one pack of the rows a rank sends and one unpack of the rows it gets
back, each way: q/k/v and the output forward, dO and dq/dk/dv backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

__all__ = ["attend_heads_a2a", "a2a_unsupported_reason", "StandInGroup"]


def a2a_unsupported_reason(heads: int, groups: int, cp: int) -> str | None:
    """Why the head all-to-all cannot split ``heads`` query and ``groups`` K/V heads (a rank's,
    after tensor parallelism) over ``cp`` ranks, or None if it can."""
    if heads % cp or groups % cp:
        return (
            f"cp_comm_type='a2a' splits each rank's heads over the context-parallel ranks: "
            f"query heads ({heads}) and key/value heads ({groups}) per tensor-parallel rank must "
            f"be divisible by context_parallel_size ({cp})"
        )
    return None


class StandInGroup:
    """A CP group stand-in for one process (timing and tests): rank ``rank`` of ``size``, and
    ``exchange(outgoing, incoming)``, which a subclass defines (:func:`_exchange` calls it
    instead of sending: ``outgoing(j)`` are the messages for rank ``j``, ``incoming(j)`` the
    tensors to fill with rank ``j``'s)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def exchange(self, outgoing, incoming) -> None:
        raise NotImplementedError


def _chunk_index(rank: int, slot: int, cp: int) -> int:
    """Absolute chunk (of ``2 * cp``) that CP rank ``rank`` holds in its ``slot`` (0 or 1)."""
    return rank if slot == 0 else 2 * cp - 1 - rank


def _exchange(
    outgoing: Callable[[int], Sequence[torch.Tensor]],
    incoming: Callable[[int], Sequence[torch.Tensor]],
    group,
) -> None:
    """Send ``outgoing(j)`` to each CP rank ``j`` and receive ``incoming(j)`` from it, message
    by message in list order (contiguous tensors; this rank's own part is a local copy).

    ``group`` is the CP process group, or a :class:`StandInGroup` (one-process timing and
    tests), whose ``exchange`` runs instead.
    """
    if isinstance(group, StandInGroup):
        group.exchange(outgoing, incoming)
        return
    me = group.rank()
    ops = []
    for j in range(group.size()):
        if j == me:
            continue
        peer = dist.get_global_rank(group, j)
        ops += [dist.P2POp(dist.isend, t, peer, group) for t in outgoing(j)]
        ops += [dist.P2POp(dist.irecv, t, peer, group) for t in incoming(j)]
    for dst, src in zip(incoming(me), outgoing(me)):
        dst.copy_(src)
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def _rows_to_heads(parts: Sequence[torch.Tensor], group) -> list[torch.Tensor]:
    """This rank's rows of all heads -> the whole sequence of its head group.

    ``parts``: ``[2 * c, b, cp * h_i, hn]`` tensors (query, key, value: their head counts may
    differ; any strides). Returns ``[2 * cp * c, b, h_i, hn]`` tensors in absolute order, each
    contiguous (head group ``rank`` of each part): sequence-major, as the attention kernels
    then lay out their outputs and gradients, which the reverse exchange sends without a copy."""
    cp = group.size()
    rows, b, _, hn = parts[0].shape
    c = rows // 2
    sends, wholes = [], []
    for part in parts:
        h = part.shape[2] // cp
        # [2, c, b, cp, h, hn] -> [cp, 2, c, b, h, hn]: one message per (head group, chunk).
        sends.append(part.view(2, c, b, cp, h, hn).permute(3, 0, 1, 2, 4, 5).contiguous())
        wholes.append(part.new_empty(2 * cp * c, b, h, hn))
    chunks = [x.view(2 * cp, c, *x.shape[1:]) for x in wholes]
    _exchange(
        lambda j: [x[j, slot] for x in sends for slot in (0, 1)],
        lambda j: [x[_chunk_index(j, slot, cp)] for x in chunks for slot in (0, 1)],
        group,
    )
    return wholes


def _heads_to_rows(parts: Sequence[torch.Tensor], group) -> list[torch.Tensor]:
    """The inverse of :func:`_rows_to_heads`: ``[2 * cp * c, b, h_i, hn]`` tensors of this
    rank's head group (any strides; sequence-major contiguous ones are sent as they are) ->
    this rank's rows of all heads, ``[2 * c, b, cp * h_i, hn]`` each."""
    cp = group.size()
    seq, b, _, hn = parts[0].shape
    c = seq // (2 * cp)
    chunks = [part.contiguous().view(2 * cp, c, b, part.shape[2], hn) for part in parts]
    recvs = [x.new_empty(cp, 2, c, b, x.shape[3], hn) for x in chunks]
    _exchange(
        lambda j: [x[_chunk_index(j, slot, cp)] for x in chunks for slot in (0, 1)],
        lambda j: [x[j, slot] for x in recvs for slot in (0, 1)],
        group,
    )
    # [cp, 2, c, b, h, hn] -> [2, c, b, cp, h, hn]: head group j's heads at j * h.
    return [x.permute(1, 2, 3, 0, 4, 5).reshape(2 * c, b, cp * x.shape[4], hn) for x in recvs]


class _RowsToHeads(torch.autograd.Function):
    """(query, key, value) rows of all heads -> their head group's whole sequence; backward:
    :func:`_heads_to_rows` of the gradients."""

    @staticmethod
    def forward(ctx, group, query, key, value):
        ctx.group = group
        return tuple(_rows_to_heads((query, key, value), group))

    @staticmethod
    @once_differentiable  # point-to-point sends have no derivative
    def backward(ctx, dq, dk, dv):
        return (None, *_heads_to_rows((dq, dk, dv), ctx.group))


class _HeadsToRows(torch.autograd.Function):
    """A head group's whole-sequence output -> this rank's rows of all heads; backward:
    :func:`_rows_to_heads` of the gradient."""

    @staticmethod
    def forward(ctx, group, out):
        ctx.group = group
        return _heads_to_rows((out,), group)[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        return None, _rows_to_heads((dout,), ctx.group)[0]


def attend_heads_a2a(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor],
) -> torch.Tensor:
    """Core attention of one CP rank by head all-to-all, in Megatron's ``[s, b, heads, hn]``
    layout.

    Args:
        query: ``[2 * c, b, np, hn]``, this rank's two load-balanced chunks of all its heads.
        key, value: ``[2 * c, b, ng, hn]`` (GQA groups not repeated).
        group: the context-parallel process group (``cp`` ranks; ``np`` and ``ng`` divisible by
            ``cp``: :func:`a2a_unsupported_reason`).
        attend: ``attend(q, k, v, head_group) -> out``: causal attention of the whole sequence
            for head group ``head_group`` (query heads ``head_group * np / cp ..`` of this rank's),
            ``q [S, b, np / cp, hn]``, ``k, v [S, b, ng / cp, hn]`` (contiguous) ->
            ``[S, b, np / cp, hn]`` (any strides; contiguous ones are sent without a copy).
    Returns:
        ``[2 * c, b, np * hn]``.
    """
    rows, b, nq, hn = query.shape
    q, k, v = _RowsToHeads.apply(group, query, key, value)
    out = attend(q, k, v, group.rank())
    return _HeadsToRows.apply(group, out).view(rows, b, nq * hn)
