"""Context parallelism by head all-to-all (``megatron_s2.context_parallel_a2a``): every CP rank's
output rows and dq/dk/dv equal the whole-sequence attention's, in float64 on the CPU.

The CP ranks run as threads of one process that exchange through a shared mailbox (a
``StandInGroup``), so CP=4 costs no process start. The modules with a real gloo group (CP=2,
both comm types) are in tests/plugin/test_context_parallel.py; the GPU test runs the real kernels on
one device.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_s2.context_parallel_a2a import (  # noqa: E402
    StandInGroup,
    a2a_unsupported_reason,
    attend_heads_a2a,
)


class ThreadGroup(StandInGroup):
    """CP rank ``rank`` of ``size`` threads: each exchange posts the rank's outgoing messages,
    waits for every rank, then takes its incoming ones."""

    def __init__(self, rank: int, size: int, mailbox: dict, barrier: threading.Barrier):
        super().__init__(rank, size)
        self._box, self._barrier = mailbox, barrier

    def exchange(self, outgoing, incoming) -> None:
        for j in range(self._size):
            self._box[(self._rank, j)] = [t.clone() for t in outgoing(j)]
        self._barrier.wait()
        for j in range(self._size):
            got, want = self._box[(j, self._rank)], incoming(j)
            assert [t.shape for t in got] == [t.shape for t in want]
            for dst, src in zip(want, got):
                dst.copy_(src)
        self._barrier.wait()


def run_ranks(cp: int, fn) -> list:
    """``fn(group)`` on ``cp`` threads, one per CP rank; their results by rank."""
    box, barrier = {}, threading.Barrier(cp, timeout=60)
    results, errors = [None] * cp, []

    def target(rank):
        try:
            results[rank] = fn(ThreadGroup(rank, cp, box, barrier))
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def local_rows(x: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """Megatron's split of ``[S, ...]``: chunks ``rank`` and ``2cp - 1 - rank``."""
    chunks = x.chunk(2 * cp, dim=0)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=0)


def head_scaled_causal(q, k, v, first_head: int) -> torch.Tensor:
    """Causal attention ``[s, b, h, d]`` (K/V with GQA groups) whose softmax scale depends on
    the **global** head (``first_head + h``): a wrong head group shows up in the output."""
    s, b, h, d = q.shape
    rep = h // k.shape[2]
    k, v = (x.repeat_interleave(rep, dim=2) for x in (k, v))
    heads = torch.arange(first_head, first_head + h, dtype=q.dtype)
    scale = (1 + 0.25 * heads).view(1, h, 1, 1) / math.sqrt(d)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bhst,tbhd->sbhd", probs, v)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("heads, groups", [(8, 8), (8, 4)])
@pytest.mark.parametrize("batch", [1, 2])
def test_a2a_matches_whole_sequence(cp, heads, groups, batch):
    seq, dim = 16 * cp, 8
    g = torch.Generator().manual_seed(1000 * cp + 10 * heads + groups + batch)
    q, k, v = (
        torch.randn(seq, batch, n, dim, generator=g, dtype=torch.float64)
        for n in (heads, groups, groups)
    )
    dout = torch.randn(seq, batch, heads * dim, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = head_scaled_causal(*leaves, first_head=0).reshape(seq, batch, heads * dim)
    ref.backward(dout)
    expect = [ref.detach()] + [t.grad for t in leaves]

    def rank_fn(group):
        rank = group.rank()
        # The query as Megatron's QKV split leaves it: a strided view, not a contiguous tensor.
        wide = torch.zeros(seq // cp, batch, heads + 1, dim, dtype=torch.float64)
        wide[:, :, 1:] = local_rows(q, rank, cp)
        wide.requires_grad_()
        lq = wide[:, :, 1:]
        lk, lv = (local_rows(x, rank, cp).clone().requires_grad_() for x in (k, v))
        hq = heads // cp

        def attend(qh, kh, vh, head_group):
            assert qh.shape == (seq, batch, hq, dim) and kh.shape[2] == groups // cp
            return head_scaled_causal(qh, kh, vh, first_head=head_group * hq)

        out = attend_heads_a2a(lq, lk, lv, group, attend)
        out.backward(local_rows(dout, rank, cp))
        return out.detach(), wide.grad[:, :, 1:], lk.grad, lv.grad

    for rank, got in enumerate(run_ranks(cp, rank_fn)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, expect):
            torch.testing.assert_close(
                a, local_rows(b, rank, cp), rtol=1e-10, atol=1e-10, msg=f"rank {rank} {name}"
            )


def test_a2a_needs_heads_divisible_by_cp():
    assert a2a_unsupported_reason(8, 4, 4) is None
    assert "key/value heads (2)" in a2a_unsupported_reason(8, 2, 4)
    assert "query heads (6)" in a2a_unsupported_reason(6, 6, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, groups", [(16, 16), (32, 8)])
def test_gpu_a2a_kernels_match_whole_sequence(heads, groups):
    """bf16 on CUDA, 8k tokens, with the layers' kernels on what the exchange hands them (a
    head group's q, k, v as sequence-major tensors; their outputs and gradients sent back as
    they come): S2 (its head group's global heads) and dense SDPA (cuDNN). CP=1 runs the
    whole path forward and backward on one thread (the exchanges are copies); CP=2 and CP=4
    forward on threads, one per rank (CUDA autograd runs every backward on one device thread,
    where the ranks' exchanges would wait on each other). Every rank's rows equal the
    whole-sequence layer's."""
    from s2attn import S2Pattern, s2_attention

    dev, seq, dim = torch.device("cuda"), 8192, 128
    g = torch.Generator(device=dev).manual_seed(5)
    q = torch.randn(seq, 1, heads, dim, device=dev, generator=g, dtype=torch.bfloat16)
    k, v = (
        torch.randn(seq, 1, groups, dim, device=dev, generator=g, dtype=torch.bfloat16)
        for _ in range(2)
    )
    scale = dim**-0.5
    pattern = S2Pattern(heads, groups, block_size=64, local_blocks=16, vert_stride=8)

    def s2(qh, kh, vh, head_group):
        n = qh.shape[2]
        part = pattern.head_range(head_group * n, (head_group + 1) * n)
        x = [t.transpose(0, 1) for t in (qh, kh, vh)]
        return s2_attention(*x, part, softmax_scale=scale).transpose(0, 1)

    def dense(qh, kh, vh, head_group):
        x = [t.permute(1, 2, 0, 3) for t in (qh, kh, vh)]
        out = torch.nn.functional.scaled_dot_product_attention(
            *x, is_causal=True, scale=scale, enable_gqa=True
        )
        return out.permute(2, 0, 1, 3)

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    for name, attend in (("s2", s2), ("dense", dense)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = attend(*leaves, 0).reshape(seq, 1, heads * dim)
        dout = torch.randn_like(ref)
        ref.backward(dout)

        def one_rank(group, attend=attend, dout=dout):
            xs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = attend_heads_a2a(*xs, group, attend)
            out.backward(dout)
            return out.detach(), *(t.grad for t in xs)

        (got,) = run_ranks(1, one_rank)
        for part, a, b in zip(("out", "dq", "dk", "dv"), got, [ref] + [t.grad for t in leaves]):
            assert rel(a, b) < 2e-2, (name, "CP=1", part)
        for cp in (2, 4):

            def rank_fn(group, attend=attend, cp=cp):
                xs = [local_rows(t, group.rank(), cp) for t in (q, k, v)]
                with torch.no_grad():
                    return attend_heads_a2a(*xs, group, attend)

            for rank, out in enumerate(run_ranks(cp, rank_fn)):
                expect = local_rows(ref.detach(), rank, cp)
                assert rel(out, expect) < 2e-2, (name, cp, rank)


def test_a2a_second_backward_is_a_clear_error():
    """The exchanges' backward sends tensors; it has no derivative of its own."""

    def rank_fn(group):
        q, k, v = (
            torch.randn(8, 1, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)
        )
        out = attend_heads_a2a(q, k, v, group, lambda a, b, c, j: a * b.sum() * c.sum())
        (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable|twice"):
            dq.sum().backward()

    run_ranks(1, rank_fn)
