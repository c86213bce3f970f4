"""Context parallelism for core attention: all-gather K/V, attend the local query chunks at their
absolute positions.

Megatron splits a sequence of ``S`` tokens over ``cp`` ranks in ``2 * cp`` chunks of
``c = S / (2 * cp)`` tokens and gives rank ``r`` chunks ``r`` and ``2 * cp - 1 - r`` (a causal
load balance: one early, one late chunk). Its local tensors are ``[2 * c, ...]``: rows
``[0, c)`` are positions ``r * c + i``, rows ``[c, 2c)`` positions ``(2 * cp - 1 - r) * c + i``.

Each rank all-gathers K/V over the CP group (one collective for both), restores absolute order,
and attends each of its two query chunks to the key prefix that chunk can see, with the query
chunk's absolute start so the S2 pattern (local window, stripes at absolute block positions)
and the causal diagonal are the single-GPU ones. The gather's backward reduce-scatters dK/dV,
so every rank ends with the gradients of its own K/V rows.

Why all-gather (``docs/context_parallel.md`` has the measurements): K/V are small next to the
queries under GQA (the 7B config gathers 8 of 32 heads), the S2 pattern reads stripes from the
whole prefix so a ring would still visit almost every rank at every step, and one collective
per layer keeps the kernels' single fused launch per chunk. The other communication, the head
all-to-all (``cp_comm_type="a2a"``: :mod:`megatron_s2.context_parallel_a2a`), is the dense
layers' default up to 64k tokens.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from torch.autograd.function import once_differentiable

from megatron_s2.flash_attention4 import fa4_causal, use_fa4
from megatron_s2.parallel_lengths import check_parallel_lengths

__all__ = [
    "context_parallel_group",
    "batch_on_this_cp_rank",
    "check_context_parallel_length",
    "gather_sequence",
    "attend_local_chunks",
    "attend_rank_chunks",
    "dense_local_chunks",
    "dense_rank_chunks",
    "dense_causal_suffix",
]


def context_parallel_group(pg_collection=None):
    """The context-parallel group from a ``ProcessGroupCollection`` or Megatron's globals (None
    when Megatron's parallel state is not initialized: a single-process model)."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is None:
        group = parallel_state.get_context_parallel_group(check_initialized=False)
    return group


def batch_on_this_cp_rank(batch: dict) -> dict:
    """This CP rank's part of a micro-batch ``{name: [b, s, ...]}``: Megatron's
    ``get_batch_on_this_cp_rank`` (chunks ``r`` and ``2 * cp - 1 - r`` of every tensor's sequence
    dimension), called as each megatron-core version takes it (0.18 made ``is_hybrid_cp`` a
    required argument, and 0.19 reads the world's size when no ``cp_group`` is given)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    group = parallel_state.get_context_parallel_group()
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)
    return get_batch_on_this_cp_rank(batch, cp_group=group)


def check_context_parallel_length(
    module: str, local_seq: int, cp: int, block_size: Optional[int] = None
) -> int:
    """The chunk length ``c`` of a rank's ``local_seq = 2 * c`` rows; ``ValueError`` naming
    ``context_parallel_size`` if the split cannot serve the layer (an odd local length, or S2
    chunks not starting on block boundaries). Host-side, before any kernel runs.

    The rule is :func:`~megatron_s2.parallel_lengths.check_parallel_lengths`' for the whole
    sequence (``cp`` ranks of ``local_seq`` tokens): a layer whose config was never checked (a
    plain ``TransformerConfig``) fails here under the same rule."""
    check_parallel_lengths(
        local_seq * cp, cp=cp, block_sizes=() if block_size is None else (block_size,), where=module
    )
    return local_seq // 2


@functools.cache
def _chunk_orders(cp: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, inverse)``: the index of each absolute chunk ``j`` in the gathered ``[rank,
    slot]`` order (``2r + slot``), and that permutation's inverse. Built once per CP size and
    device: a tensor made from a list on every layer call is a host-to-device copy that waits
    for the host."""
    order = [2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp)]
    inverse = sorted(range(2 * cp), key=order.__getitem__)
    return torch.tensor(order, device=device), torch.tensor(inverse, device=device)


def gather_sequence(local: torch.Tensor, group) -> torch.Tensor:
    """All-gather a rank's ``[2 * c, ...]`` rows over the CP ``group`` into the whole sequence
    ``[2 * cp * c, ...]`` in absolute order. Differentiable: the backward sums the gradient over
    the ranks and returns each rank its own rows (Megatron's reduce-scatter)."""
    cp = group.size()
    full = tensor_parallel.gather_from_sequence_parallel_region(
        local, tensor_parallel_output_grad=True, group=group
    )
    chunks = full.view(2 * cp, local.shape[0] // 2, *local.shape[1:])
    order, inverse = _chunk_orders(cp, local.device)
    return _PermuteChunks.apply(chunks, order, inverse).flatten(0, 1)


class _PermuteChunks(torch.autograd.Function):
    """``chunks[order]`` for a permutation ``order`` of dim 0 (``inverse`` its inverse), whose
    backward gathers the gradient back by the inverse: autograd's own, for an index, zero-fills
    a sequence-sized buffer and scatters into it with accumulation."""

    @staticmethod
    def forward(ctx, chunks, order, inverse):
        ctx.inverse = inverse  # a cached constant, not an activation
        return chunks[order]

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.inverse], None, None


def attend_local_chunks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor],
    chunk: int,
    composed: bool = False,
) -> torch.Tensor:
    """Core attention of one CP rank in Megatron's ``[s, b, heads, hn]`` layout.

    Args:
        query: ``[2 * chunk, b, np, hn]``, this rank's two query chunks.
        key, value: ``[2 * chunk, b, ng, hn]``, this rank's K/V rows (gathered here).
        group: the context-parallel process group.
        attend: ``attend(q, k, v, q_start) -> out`` on ``[b, s, heads, hn]`` views: causal
            attention of the queries at absolute positions ``q_start ..`` to keys ``0 ..``
            (the keys end where the queries end).
        chunk: tokens per chunk (:func:`check_context_parallel_length`).
        composed: run the chunks through plain autograd even where gradients are wanted
            (:func:`attend_rank_chunks`): for an ``attend`` with parameters of its own (S2
            sinks), whose gradients :class:`_RankChunks` would not return.
    Returns:
        ``[2 * chunk, b, np * hn]``.
    """
    key, value = _gather_kv(key, value, group)
    return attend_rank_chunks(
        query, key, value, group.rank(), group.size(), attend, chunk, composed=composed
    )


def dense_local_chunks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group,
    chunk: int,
    scale: float,
    backend: str = "auto",
    deterministic: bool = False,
) -> torch.Tensor:
    """:func:`attend_local_chunks` for a dense causal layer (:func:`dense_rank_chunks`): same
    shapes, ``scale`` the softmax scale, ``backend`` the layer's dense backend
    (:data:`megatron_s2.flash_attention4.DENSE_BACKENDS`: "auto", "sdpa" never takes FA4, "fa4"
    always), ``deterministic`` FA4's deterministic backward."""
    key, value = _gather_kv(key, value, group)
    if backend == "sdpa":  # today's kernels only: no FA4 even where it is installed
        impl = "cudnn" if _cudnn_usable(query) else "per-chunk"
    else:
        impl = backend  # "auto" or "fa4", as dense_rank_chunks reads them
    return dense_rank_chunks(
        query, key, value, group.rank(), group.size(), chunk, scale, impl, deterministic
    )


def _gather_kv(key, value, group):
    # One collective for K and V: they travel stacked.
    kv = gather_sequence(torch.stack((key, value), dim=1), group)  # [S, 2, b, ng, hn]
    return _SplitKV.apply(kv)


class _SplitKV(torch.autograd.Function):
    """``kv [S, 2, ...] -> (kv[:, 0], kv[:, 1])`` whose backward stacks dK and dV in one copy:
    autograd's own, for two selections of one tensor, zero-fills a K/V-sized gradient for each
    and adds the two."""

    @staticmethod
    def forward(ctx, kv):
        return kv[:, 0], kv[:, 1]

    @staticmethod
    def backward(ctx, dk, dv):  # an unused one arrives as zeros (materialized grads)
        return torch.stack((dk, dv), dim=1)


def attend_rank_chunks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rank: int,
    cp: int,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor],
    chunk: int,
    composed: bool = False,
) -> torch.Tensor:
    """The compute of :func:`attend_local_chunks` once K/V are whole: ``query [2 * chunk, b, np,
    hn]`` of CP rank ``rank`` of ``cp`` against ``key, value [2 * cp * chunk, b, ng, hn]`` in
    absolute order -> ``[2 * chunk, b, np * hn]`` (also what the benchmark times per rank).
    Where gradients are wanted it runs as :class:`_RankChunks`, which builds the rank's dQ and
    dK/dV in one buffer each, unless ``composed``: :class:`_RankChunks` returns gradients for
    query, key and value only, so an ``attend`` with parameters of its own runs composed."""
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if wants_grad and not composed and not _saved_tensor_hooks_active():
        return _RankChunks.apply(query, key, value, rank, cp, chunk, attend)
    # Without gradients; or under saved-tensor hooks (non-reentrant checkpointing, activation
    # offloading), which must see what the chunks save: _RankChunks keeps that in its context.
    outs = [attend(*part) for part in _chunk_parts(query, key, value, rank, cp, chunk)]
    sq, b, nq, hn = query.shape
    return torch.cat(outs, dim=1).transpose(0, 1).reshape(sq, b, nq * hn)


def _saved_tensor_hooks_active() -> bool:
    """Whether ``torch.autograd.graph.saved_tensors_hooks`` are in force here (PyTorch has no
    public query; where the private one is missing, assume they are: the composed path is
    always right)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def _chunk_parts(query, key, value, rank: int, cp: int, chunk: int):
    """``(q, k, v, q_start)`` of the rank's two chunks, early one first: ``[b, s, h, hn]`` views
    of its query rows and of the key prefix each sees (keys ``0 ..`` the chunk's end)."""
    q, k_abs, v_abs = (x.transpose(0, 1) for x in (query, key, value))
    for slot, index in enumerate((rank, 2 * cp - 1 - rank)):
        end = (index + 1) * chunk
        yield q[:, slot * chunk : (slot + 1) * chunk], k_abs[:, :end], v_abs[:, :end], index * chunk


class _RankChunks(torch.autograd.Function):
    """:func:`attend_rank_chunks` with gradients, for any differentiable ``attend`` (the S2
    kernels, FlashAttention-4, the per-chunk dense paths): each chunk's call runs under its own
    autograd graph on detached views, and the backward assembles the rank's gradients once:
    outputs and dQ written into the rank's buffers, dK/dV into one K-sized buffer each (the
    later chunk's keys fill it, the earlier chunk's are added in). Through autograd's slicing
    and concatenation each chunk's dK/dV became a zero-padded K-sized tensor and the two were
    summed, as were the chunks' dQ: 18-24% of an S2 rank's GPU time at 32k
    (``docs/context_parallel.md``)."""

    @staticmethod
    def forward(ctx, query, key, value, rank, cp, chunk, attend):
        out = None
        graphs = []
        with torch.enable_grad():
            for slot, (q, k, v, q_start) in enumerate(
                _chunk_parts(query, key, value, rank, cp, chunk)
            ):
                leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
                o = attend(*leaves, q_start)
                if out is None:  # the attention's dtype (autocast may differ from query's)
                    out = o.new_empty(query.shape)
                out[slot * chunk : (slot + 1) * chunk].copy_(o.detach().transpose(0, 1))
                graphs.append((o, leaves))
        ctx.graphs, ctx.chunk = graphs, chunk
        ctx.shapes = (query.shape, key.shape)
        ctx.q_dtype = query.dtype  # dQ's, which autocast may set apart from the output's
        sq, b, nq, hn = query.shape
        return out.view(sq, b, nq * hn)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        if ctx.graphs is None:
            raise RuntimeError(
                "attend_rank_chunks: backward ran a second time (retain_graph=True): a CP "
                "rank's chunk graphs are freed by the first backward"
            )
        chunk = ctx.chunk
        q_shape, k_shape = ctx.shapes
        dq = dout.new_empty(q_shape, dtype=ctx.q_dtype)
        dout = dout.view(q_shape)
        graphs, ctx.graphs = ctx.graphs, None

        def chunk_grads(slot):
            """dK, dV ``[keys, b, ng, hn]`` of chunk ``slot``, its dQ written into ``dq``; the
            chunk's graph (and the tensors it saved) freed."""
            (o, leaves), graphs[slot] = graphs[slot], None
            rows = slice(slot * chunk, (slot + 1) * chunk)
            d_q, d_k, d_v = torch.autograd.grad(o, leaves, dout[rows].transpose(0, 1))
            dq[rows].copy_(d_q.transpose(0, 1))
            return d_k.transpose(0, 1), d_v.transpose(0, 1)

        # The later chunk first: it sees every key the earlier one sees (and the keys between),
        # so its dK/dV fill the K-sized buffers (or are them, where it ends at the last key)
        # and the earlier chunk's are added in.
        late = list(chunk_grads(1))
        bufs = []
        for i, part in enumerate(late):
            late[i] = None  # each partial freed once copied: one at a time next to the buffers
            if part.shape != k_shape or not part.is_contiguous():
                buf = part.new_empty(k_shape)
                buf[: part.shape[0]].copy_(part)
                buf[part.shape[0] :].zero_()
                part = buf
            bufs.append(part)
        dk, dv = bufs
        for buf, part in zip(bufs, chunk_grads(0)):
            buf[: part.shape[0]].add_(part)
        return dq, dk, dv, None, None, None, None


@functools.cache
def _varlen_flash():
    """PyTorch's varlen FlashAttention (``torch.nn.attention.varlen.varlen_attn``) and how it
    is told "causal, bottom-right": its keyword changed across releases. None if absent.

    Looked up on first use, not at import: importing it loads torch's compiler stack (~0.7 s),
    which CPU runs and every process that only builds a model never need."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params


FLASH_DTYPES = (torch.float16, torch.bfloat16)
# cuDNN's fused attention (what SDPA picks for dense causal layers on Hopper) takes head sizes up
# to 128 in multiples of 8.
CUDNN_MAX_HEAD_DIM = 128


def _cudnn_usable(q: torch.Tensor) -> bool:
    return (
        q.is_cuda
        and q.dtype in FLASH_DTYPES
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= CUDNN_MAX_HEAD_DIM
        and torch.backends.cudnn.is_available()
        and torch.cuda.get_device_capability(q.device) >= (9, 0)
        and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward")
    )


def _cudnn_part(q, k, v, causal: bool, scale: float):
    """One cuDNN attention call ``[b, h, s, d]``: ``(out, lse [b, h, sq, 1], backward args)``."""
    out, lse, cu_q, cu_k, max_q, max_k, seed, offset, _ = (
        torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
    )
    return out, lse, (seed, offset, cu_q, cu_k, max_q, max_k)


def _cudnn_part_grads(dout, q, k, v, out, lse, causal: bool, args, scale: float):
    """cuDNN's backward of one :func:`_cudnn_part` call given the *merged* ``out`` and ``lse``
    of all parts (each part then gets its exact share): ``(dq, dk, dv)``."""
    seed, offset, cu_q, cu_k, max_q, max_k = args
    # The op reads the LSE as a contiguous [b, h, sq, 1] whatever its strides: a row slice of a
    # larger LSE gave a wrong dQ on an H100 (docs/context_parallel.md, "one causal square").
    lse = lse.contiguous()
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cu_q, cu_k, max_q, max_k, 0.0, causal,
        scale=scale,
    )  # fmt: skip


def _merge_parts(out_a, lse_a, out_b, lse_b, dest=None):
    """Attention over the union of two parts' disjoint keys from each part's output and LSE
    ``[b, h, sq, 1]``: ``(out, lse)``, the output in fp32 math (or wider), written into
    ``dest`` (any strides) when given, else a new tensor in ``out_b``'s dtype."""
    lse = torch.logaddexp(lse_a, lse_b)
    acc = torch.promote_types(out_b.dtype, torch.float32)  # fp32 for 16-bit parts
    mixed = out_a.to(acc) * torch.exp(lse_a - lse)
    mixed.addcmul_(out_b.to(acc), torch.exp(lse_b - lse))
    if dest is None:
        return mixed.to(out_b.dtype), lse
    return dest.copy_(mixed), lse


class _CausalSuffixCudnn(torch.autograd.Function):
    """Bottom-right causal attention as two cuDNN calls merged by their log-sum-exp.

    The queries (the last ``sq`` of ``sk`` positions) see the keys before them in full (a
    rectangular, non-causal call) and their own ``sq`` keys causally (a square call, where
    top-left and bottom-right causal coincide). The backward runs cuDNN's backward of each part
    with the *merged* output and log-sum-exp, which gives each part's exact share of the
    gradients (softmax rows are normalized by the merged sum).
    """

    @staticmethod
    def forward(ctx, q, k, v, scale):
        split = k.shape[2] - q.shape[2]
        out, lse, diag = _cudnn_part(q, k[:, :, split:], v[:, :, split:], True, scale)
        prefix = None
        if split:
            out_p, lse_p, prefix = _cudnn_part(q, k[:, :, :split], v[:, :, :split], False, scale)
            out, lse = _merge_parts(out_p, lse_p, out, lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.parts = (prefix, diag)
        ctx.scale, ctx.split = scale, split
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        prefix, diag = ctx.parts
        split = ctx.split
        dout = dout.contiguous() if dout.stride() != out.stride() else dout

        def part_grads(kk, vv, causal, args):
            return _cudnn_part_grads(dout, q, kk, vv, out, lse, causal, args, ctx.scale)

        dq, dk, dv = part_grads(k[:, :, split:], v[:, :, split:], True, diag)
        if split:
            dq_p, dk_p, dv_p = part_grads(k[:, :, :split], v[:, :, :split], False, prefix)
            dq = dq + dq_p
            dk, dv = torch.cat((dk_p, dk), dim=2), torch.cat((dv_p, dv), dim=2)
        return dq, dk, dv, None


_SIDE_STREAMS: dict = {}


def _concurrently(first: Callable, second: Callable, streams: bool):
    """``(first(), second())``; with ``streams`` (their tensors on the current CUDA device),
    ``first`` runs on a side stream while ``second`` runs on the current one, which then waits
    for it. A rank's two chunks are independent calls of a few milliseconds each at 32k, whose
    last waves leave SMs idle: side by side, one chunk's calls fill the other's tail. Tensors
    ``first`` returns were allocated on the side stream and are marked as used on the current
    one (their memory is not reused before the current stream's work on them is done)."""
    if not streams:
        return first(), second()
    device = torch.cuda.current_device()
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    main = torch.cuda.current_stream(device)
    side.wait_stream(main)  # the inputs (and any memory the allocator recycles) are ready
    with torch.cuda.stream(side):
        a = first()
    b = second()
    main.wait_stream(side)
    todo = [a]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            x.record_stream(main)
        elif isinstance(x, (tuple, list)):
            todo.extend(x)
    return a, b


class _RankChunksCudnn(torch.autograd.Function):
    """A CP rank's two query chunks against the whole K/V, dense and causal, on cuDNN (the
    default of :func:`dense_rank_chunks` where cuDNN runs): each chunk as
    :class:`_CausalSuffixCudnn` computes it (its own keys causally, the keys before them in
    full, merged by LSE), with the bookkeeping done once for both chunks: GQA heads repeated
    once, outputs and dQ written in place in Megatron's layout, and dK/dV built in one K-sized
    buffer (the later chunk's parts fill it, the earlier chunk's add in) rather than
    concatenated per chunk and zero-padded by autograd's slicing (``docs/context_parallel.md``:
    those copies were 9-12% of a rank's time at 32k). With ``streams`` the two chunks' calls
    run side by side on two CUDA streams (:func:`_concurrently`), forward and backward; the
    dK/dV sums keep their order (the same bits either way; cuDNN's dQ differs from run to run
    in its last bits on one stream too).

    ``query [2 * chunk, b, np, hn]``, ``key, value [S, b, ng, hn]`` in absolute order ->
    ``[2 * chunk, b, np * hn]``.
    """

    @staticmethod
    def forward(ctx, query, key, value, rank, cp, chunk, scale, streams):
        rep = query.shape[2] // key.shape[2]
        if rep > 1:  # cuDNN's call takes equal head counts
            key, value = key.repeat_interleave(rep, dim=2), value.repeat_interleave(rep, dim=2)
        out = torch.empty_like(query)
        qt, kt, vt, ot = (x.permute(1, 2, 0, 3) for x in (query, key, value, out))  # [b, h, s, d]

        def attend(slot, index):
            rows = slice(slot * chunk, (slot + 1) * chunk)
            split, end = index * chunk, (index + 1) * chunk
            q_c = qt[:, :, rows]
            out_d, lse, diag = _cudnn_part(
                q_c, kt[:, :, split:end], vt[:, :, split:end], True, scale
            )
            prefix = None
            if split:
                out_p, lse_p, prefix = _cudnn_part(
                    q_c, kt[:, :, :split], vt[:, :, :split], False, scale
                )
                _, lse = _merge_parts(out_p, lse_p, out_d, lse, dest=ot[:, :, rows])
            else:
                ot[:, :, rows].copy_(out_d)
            return rows, split, end, lse, diag, prefix

        parts = _concurrently(
            lambda: attend(0, rank), lambda: attend(1, 2 * cp - 1 - rank), streams
        )
        ctx.save_for_backward(query, key, value, out)
        ctx.parts, ctx.scale, ctx.rep, ctx.streams = parts, scale, rep, streams
        return out.view(out.shape[0], out.shape[1], -1)

    @staticmethod
    def backward(ctx, dout):
        query, key, value, out = ctx.saved_tensors
        dout = dout.contiguous().view(out.shape)
        dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        qt, kt, vt, ot, dot, dqt, dkt, dvt = (
            x.permute(1, 2, 0, 3) for x in (query, key, value, out, dout, dq, dk, dv)
        )

        def chunk_grads(rows, split, end, lse, diag, prefix):
            """dQ of the chunk (written in place) and its dK/dV parts (diagonal, prefix)."""
            q_c, o_c, do_c = qt[:, :, rows], ot[:, :, rows], dot[:, :, rows]

            def grads(lo, hi, causal, args):
                kk, vv = kt[:, :, lo:hi], vt[:, :, lo:hi]
                return _cudnn_part_grads(do_c, q_c, kk, vv, o_c, lse, causal, args, ctx.scale)

            dq_d, dk_d, dv_d = grads(split, end, True, diag)
            if prefix is None:
                dqt[:, :, rows].copy_(dq_d)
                return dk_d, dv_d, None, None
            dq_p, dk_p, dv_p = grads(0, split, False, prefix)
            torch.add(dq_d, dq_p, out=dqt[:, :, rows])
            return dk_d, dv_d, dk_p, dv_p

        early, late = ctx.parts
        early_grads, late_grads = _concurrently(
            lambda: chunk_grads(*early), lambda: chunk_grads(*late), ctx.streams
        )
        # The later chunk sees every key the earlier one sees: its parts fill the K-sized
        # buffers, then the earlier chunk's are added into them.
        for (_, split, end, *_), (dk_d, dv_d, dk_p, dv_p), fill in (
            (late, late_grads, True),
            (early, early_grads, False),
        ):
            for buf, d_diag, d_prefix in ((dkt, dk_d, dk_p), (dvt, dv_d, dv_p)):
                if fill:
                    if d_prefix is not None:
                        buf[:, :, :split].copy_(d_prefix)
                    buf[:, :, split:end].copy_(d_diag)
                    buf[:, :, end:].zero_()
                else:
                    if d_prefix is not None:
                        buf[:, :, :split].add_(d_prefix)
                    buf[:, :, split:end].add_(d_diag)
        if ctx.rep > 1:  # repeat_interleave put group g's copies at heads g * rep ..
            s_len, b, _, hn = dk.shape
            dk = dk.view(s_len, b, -1, ctx.rep, hn).sum(3)
            dv = dv.view(s_len, b, -1, ctx.rep, hn).sum(3)
        return dq, dk, dv, None, None, None, None, None


RANK_IMPLS = ("auto", "fa4", "cudnn", "cudnn-one-stream", "per-chunk")


def dense_rank_chunks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rank: int,
    cp: int,
    chunk: int,
    scale: float,
    impl: str = "auto",
    deterministic: bool = False,
) -> torch.Tensor:
    """Dense causal attention of CP rank ``rank``'s two query chunks once K/V are whole:
    ``query [2 * chunk, b, np, hn]``, ``key, value [2 * cp * chunk, b, ng, hn]`` in absolute
    order -> ``[2 * chunk, b, np * hn]``.

    ``impl`` "fa4": one FlashAttention-4 call a chunk (its causal mask aligns at the bottom
    right; :mod:`megatron_s2.flash_attention4`); "cudnn": the rank-level
    :class:`_RankChunksCudnn` (fp16/bf16, head_dim <= 128, sm_90+ with cuDNN), its two chunks
    on two CUDA streams ("cudnn-one-stream": one after the other); "per-chunk":
    :func:`attend_rank_chunks` with :func:`dense_causal_suffix` per chunk; "auto" (default):
    the first of them that runs here. On an H200 the rank-level cuDNN path took 2-16% less
    time a rank than per-chunk cuDNN calls at 32k and 1-7% at 128k, with a 6-36% higher
    transient peak inside the call (its K-sized gradient buffers; ``docs/context_parallel.md``,
    which also has the FA4 rows). ``deterministic`` applies to FA4's backward; cuDNN's dK and dV
    are bitwise reproducible, its dQ is not (nor is it for the CP=1 layer on SDPA: the same
    kernel)."""
    if impl not in RANK_IMPLS:
        raise ValueError(f"dense_rank_chunks: impl must be one of {RANK_IMPLS}, got {impl!r}")
    if impl in ("auto", "fa4") and use_fa4(impl, query):

        def attend_fa4(q, k, v, q_start):
            return fa4_causal(q, k, v, scale, deterministic)

        return attend_rank_chunks(query, key, value, rank, cp, attend_fa4, chunk)
    usable = _cudnn_usable(query)
    if impl.startswith("cudnn") and query.is_cuda and not usable:
        raise ValueError(
            f"dense_rank_chunks: impl={impl!r} needs fp16/bf16, head_dim <= 128 and a "
            "multiple of 8, on an sm_90+ GPU with cuDNN"
        )
    if impl.startswith("cudnn") or (impl == "auto" and usable):
        # CPU tensors (the bookkeeping tests' stand-ins) run one after the other.
        streams = query.is_cuda and impl != "cudnn-one-stream"
        return _RankChunksCudnn.apply(query, key, value, rank, cp, chunk, scale, streams)

    def attend(q, k, v, q_start):
        return dense_causal_suffix(q, k, v, scale)

    return attend_rank_chunks(query, key, value, rank, cp, attend, chunk)


DENSE_IMPLS = ("auto", "fa4", "cudnn", "flash", "sdpa")


def dense_causal_suffix(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, impl: str = "auto"
) -> torch.Tensor:
    """Dense causal attention of the last ``sq`` positions of a ``sk``-token prefix.

    ``q [b, sq, np, hn]`` are positions ``sk - sq .. sk - 1``; ``k, v [b, sk, ng, hn]`` positions
    ``0 .. sk - 1`` (GQA groups not repeated). Query ``i`` attends keys ``<= sk - sq + i``
    (causal aligned at the bottom right). Returns ``[b, sq, np, hn]``.

    On Hopper in fp16/bf16 (head_dim <= 128): cuDNN, the kernel SDPA runs for the CP=1 dense
    layer, as two calls merged by their log-sum-exp (:class:`_CausalSuffixCudnn`). Other CUDA
    GPUs: FlashAttention's varlen kernel, which aligns causal masks at the bottom right itself.
    Elsewhere (CPU, fp32): SDPA with PyTorch's lower-right causal bias. ``impl`` forces one of
    them (tests, benchmarks): "cudnn", "flash", "sdpa", or "fa4" (FlashAttention-4, one call:
    never picked by "auto" here; :func:`dense_rank_chunks` picks it); default "auto".
    """
    if impl not in DENSE_IMPLS:
        raise ValueError(f"dense_causal_suffix: impl must be one of {DENSE_IMPLS}, got {impl!r}")
    if impl == "fa4":
        return fa4_causal(q, k, v, scale)
    b, sq, nq, hn = q.shape
    sk, ng = k.shape[1], k.shape[2]
    auto = impl == "auto"
    if impl == "cudnn" or (auto and _cudnn_usable(q)):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [b, h, s, d] views
        if ng != nq:
            kt = kt.repeat_interleave(nq // ng, dim=1)
            vt = vt.repeat_interleave(nq // ng, dim=1)
        return _CausalSuffixCudnn.apply(qt, kt, vt, scale).transpose(1, 2)
    # Looked up only where it may run (CUDA, 16-bit): the lookup imports torch's compiler stack.
    flash = (
        _varlen_flash()
        if impl == "flash" or (auto and q.is_cuda and q.dtype in FLASH_DTYPES)
        else None
    )
    if impl == "flash" and flash is None:
        raise RuntimeError(
            "dense_causal_suffix: impl='flash' needs torch.nn.attention.varlen.varlen_attn "
            f"(with window_size or is_causal), which torch {torch.__version__} lacks; "
            f"use one of {DENSE_IMPLS} without 'flash'"
        )
    if flash is not None:
        varlen_attn, causal, has_gqa = flash
        if ng != nq and not has_gqa:
            k = k.repeat_interleave(nq // ng, dim=2)
            v = v.repeat_interleave(nq // ng, dim=2)
        gqa = {"enable_gqa": True} if has_gqa and ng != nq else {}
        cu_q = torch.arange(0, (b + 1) * sq, sq, device=q.device, dtype=torch.int32)
        cu_k = torch.arange(0, (b + 1) * sk, sk, device=q.device, dtype=torch.int32)
        out = varlen_attn(
            q.reshape(b * sq, nq, hn),
            k.reshape(b * sk, k.shape[2], hn),
            v.reshape(b * sk, v.shape[2], hn),
            cu_q,
            cu_k,
            sq,
            sk,
            scale=scale,
            **causal,
            **gqa,
        )
        return out.view(b, sq, nq, hn)
    from torch.nn.attention.bias import causal_lower_right

    # SDPA wants [b, h, s, d].
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if ng != nq:
        kt = kt.repeat_interleave(nq // ng, dim=1)
        vt = vt.repeat_interleave(nq // ng, dim=1)
    out = F.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=causal_lower_right(sq, sk), scale=scale
    )
    return out.transpose(1, 2)
