#!/usr/bin/env python
"""Context-parallel attention cost on one GPU: per-rank compute and memory of the all-gather and
head all-to-all designs next to the single-GPU (CP=1) layer, for S2 and dense layers.

    python tools/cp_benchmark.py                          # 1.3B- and 7B-shaped heads, 32k + 128k
    python tools/cp_benchmark.py --seqs 32768 --cp 2 4 --heads 32/8
    python tools/cp_benchmark.py --seqs 32768 --cp 2 --profile dense   # where the time goes

Each row times one layer's core attention, forward + backward (CUDA events, median of at least
10 runs; all rows of a shape timed round by round with each other, ``gpu_timing.py``): CP=1
attends the whole sequence as the modules do (S2: ``s2_attention``; dense:
``FusedDenseAttention``'s SDPA, and FlashAttention-4 where it is installed); CP=N attends one
rank's two load-balanced query chunks against the whole K/V (what each rank computes after the
all-gather; ranks 0 and N-1 bracket the balance; dense: the rank-level cuDNN function, or one
FA4 call a chunk). The "a2a" kinds time ``cp_comm_type="a2a"`` instead: a rank's whole-sequence
call for its ``1/N`` of the heads with the exchanges' packing, unpacking and local writes
(``loopback_group``), not their transfer. "per-token vs CP=1" is the rank's time per query token
over its kind's CP=1 row's (1.00 = no overhead from splitting); "per-token vs dense SDPA CP=1"
compares every dense row with today's dense layer on SDPA. Memory is the peak allocation of the
fwd+bwd above its inputs. The communication itself is not timed here (one GPU); its volume per
layer is printed: K and V of the whole sequence, ``(N-1)/N`` of it received by each rank (a2a:
the rank's q, k, v and output rows, ``(N-1)/N`` of them). ``--kinds dense-one-stream
dense-per-chunk dense-fa2`` add the earlier dense paths (the rank-level cuDNN function on one
stream; two cuDNN calls a chunk; FlashAttention-2's varlen).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F
from gpu_timing import fwd_bwd_step, time_rows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# The 1.3B hybrid's S2 layers (configs/gpt-1.3b-s2.yaml).
S2_SETTINGS = dict(block_size=64, local_blocks=16, vert_stride=8, head_offset=0)


def _peak_mib(step) -> float:
    """Peak MiB that one call of ``step`` allocates above what is live before it (after a first,
    untimed call)."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


# Kernel-name fragments of the --profile breakdown's groups, first match wins (lower case).
PROFILE_GROUPS = (
    ("cuDNN/flash attention backward", ("bprop", "bwd", "backward", "dgrad")),
    ("cuDNN/flash attention forward", ("fprop", "fwd", "forward", "flash", "cudnn", "sdpa")),
    ("S2 Triton kernels", ("_s2_", "s2_fwd")),
    ("copies and concatenation", ("copy", "cat", "memcpy", "memset", "fill")),
    ("LSE merge and other elementwise", ("elementwise", "vectorized", "reduce", "exp", "log")),
)


def profile_breakdown(step_fn, steps: int = 3) -> list[tuple[str, float]]:
    """``(group, ms per step)`` of the GPU kernels ``step_fn`` launches, over ``steps`` profiled
    steps (torch.profiler), grouped by :data:`PROFILE_GROUPS`, largest first, with the
    unmatched kernels as "other"."""
    from torch.profiler import ProfilerActivity, profile

    step_fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step_fn()
        torch.cuda.synchronize()
    return group_kernel_times(prof.key_averages(), steps)


def group_kernel_times(events, steps: int) -> list[tuple[str, float]]:
    """``(group, ms per step)``, largest first, of profiler ``events`` (``key`` the kernel
    name, self device time in microseconds) over ``steps`` steps."""
    totals: dict[str, float] = {}
    for ev in events:
        us = getattr(ev, "self_device_time_total", None)
        if us is None:
            us = ev.self_cuda_time_total
        if us <= 0:
            continue
        name = ev.key.lower()
        group = next((g for g, keys in PROFILE_GROUPS if any(k in name for k in keys)), "other")
        totals[group] = totals.get(group, 0.0) + us / 1000 / steps
    return sorted(totals.items(), key=lambda kv: -kv[1])


KINDS = (
    "S2", "dense", "dense-fa4", "S2-a2a", "dense-a2a", "dense-fa4-a2a",
    "dense-one-stream", "dense-per-chunk", "dense-fa2", "dense-s2attn",
)  # fmt: skip


def loopback_group(rank: int, size: int):
    """CP rank ``rank`` of ``size`` for :func:`megatron_s2.context_parallel_a2a.attend_heads_a2a`
    on one GPU: every message the rank would receive is a copy of the one it sends to that peer
    (the same sizes), so a timing has the exchanges' packing, unpacking and local writes but not
    the NVLink transfer."""
    from megatron_s2.context_parallel_a2a import StandInGroup

    class Loopback(StandInGroup):
        def exchange(self, outgoing, incoming) -> None:
            for j in range(self.size()):
                for dst, src in zip(incoming(j), outgoing(j)):
                    dst.copy_(src)

    return Loopback(rank, size)


DEFAULT_KINDS = ("S2", "dense", "dense-a2a", "dense-fa4")


def run(
    seq: int,
    heads: int,
    groups: int,
    dim: int,
    cps: list[int],
    profile_kinds=(),
    kinds=DEFAULT_KINDS,
) -> list[dict]:
    """Time the ``kinds`` of one head shape at ``seq`` tokens: a CP=1 row (where the kind has
    one) and ranks 0 and N-1 of each CP size in ``cps``. Kinds: "S2"; "dense" (SDPA at CP=1,
    the rank-level cuDNN function under CP: the module's all-gather path with
    ``dense_attention=sdpa``); "dense-fa4" (FlashAttention-4 at CP=1 and one FA4 call a chunk:
    that path with "auto" where FA4 is installed; skipped with a note where it is not);
    "S2-a2a", "dense-a2a", "dense-fa4-a2a" (the head all-to-all, ``cp_comm_type="a2a"``: the
    dense layers' default up to 64k tokens); "dense-one-stream"
    (the rank-level cuDNN function with its two chunks one after the other), "dense-per-chunk"
    (two cuDNN calls a chunk, merged by LSE) and "dense-fa2" (FlashAttention-2 varlen), the
    earlier paths; "dense-s2attn" (our kernels on the dense causal pattern, ``vert_stride=1``,
    one call a chunk: whether they would serve dense chunks better than cuDNN). ``rel`` is per
    token against the kind's CP=1 row (the per-chunk and FA2 rows:
    SDPA's), ``rel_sdpa`` against dense SDPA at CP=1 (today's dense layer; dense kinds only)."""
    from megatron_s2.context_parallel import (
        attend_rank_chunks,
        dense_causal_suffix,
        dense_rank_chunks,
    )
    from megatron_s2.context_parallel_a2a import attend_heads_a2a
    from megatron_s2.flash_attention4 import fa4_causal, fa4_unusable_reason
    from s2attn import S2Pattern, s2_attention

    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(seq, 1, heads, dim, device=dev, dtype=dt, generator=g).requires_grad_()
    k = torch.randn(seq, 1, groups, dim, device=dev, dtype=dt, generator=g).requires_grad_()
    v = torch.randn(seq, 1, groups, dim, device=dev, dtype=dt, generator=g).requires_grad_()
    scale = dim**-0.5
    pattern = S2Pattern(num_heads=heads, num_kv_heads=groups, **S2_SETTINGS)

    def s2_at(qc, kc, vc, q_start):
        return s2_attention(qc, kc, vc, pattern, softmax_scale=scale, q_start=q_start)

    dense_pattern = S2Pattern(
        num_heads=heads, num_kv_heads=groups, **{**S2_SETTINGS, "vert_stride": 1}
    )

    def s2_dense_at(qc, kc, vc, q_start):
        return s2_attention(qc, kc, vc, dense_pattern, softmax_scale=scale, q_start=q_start)

    def s2_dense_full():
        return s2_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), dense_pattern)

    def suffix(impl):
        return lambda qc, kc, vc, q_start: dense_causal_suffix(qc, kc, vc, scale, impl=impl)

    def s2_full():
        return s2_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), pattern)

    def dense_full():  # FusedDenseAttention's CP=1 path with dense_attention=sdpa
        qt, kt, vt = (x.permute(1, 2, 0, 3) for x in (q, k, v))
        return F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale, enable_gqa=groups != heads
        )

    def fa4_full():  # its CP=1 path where FA4 runs
        return fa4_causal(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale)

    def per_chunk(at):
        return lambda rows_q, rank, cp, chunk: attend_rank_chunks(rows_q, k, v, rank, cp, at, chunk)

    def rank_level(impl):
        return lambda rows_q, rank, cp, chunk: dense_rank_chunks(
            rows_q, k, v, rank, cp, chunk, scale, impl=impl
        )

    def s2_heads(qh, kh, vh, head_group):  # S2CoreAttention._attend_heads
        n = qh.shape[2]
        part = pattern.head_range(head_group * n, (head_group + 1) * n)
        out = s2_attention(
            qh.transpose(0, 1), kh.transpose(0, 1), vh.transpose(0, 1), part, softmax_scale=scale
        )
        return out.transpose(0, 1)

    def sdpa_heads(qh, kh, vh, head_group):  # FusedDenseAttention._attend_whole on SDPA
        qt, kt, vt = (x.permute(1, 2, 0, 3) for x in (qh, kh, vh))
        gqa = qt.shape[1] != kt.shape[1]
        out = F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa
        )
        return out.permute(2, 0, 1, 3)

    def fa4_heads(qh, kh, vh, head_group):  # ... and on FA4
        qt, kt, vt = (x.transpose(0, 1) for x in (qh, kh, vh))
        return fa4_causal(qt, kt, vt, scale).transpose(0, 1)

    def a2a(attend):
        """One rank's head all-to-all path; its K/V rows are the rank's own (``rows_k``)."""
        return lambda rows_q, rank, cp, chunk, rows_k, rows_v: attend_heads_a2a(
            rows_q, rows_k, rows_v, loopback_group(rank, cp), attend
        )

    table = {
        "S2": ("S2", s2_full, per_chunk(s2_at), cps),
        "S2-a2a": ("S2, head all-to-all", None, a2a(s2_heads), cps),
        "dense-a2a": ("dense, head all-to-all, SDPA", None, a2a(sdpa_heads), cps),
        "dense-fa4-a2a": ("dense, head all-to-all, FA4", None, a2a(fa4_heads), cps),
        "dense": ("dense, SDPA / rank-level cuDNN", dense_full, rank_level("cudnn"), cps),
        "dense-fa4": ("dense, FA4", fa4_full, rank_level("fa4"), cps),
        "dense-one-stream": (
            "dense, rank-level cuDNN, one stream",
            None,
            rank_level("cudnn-one-stream"),
            cps,
        ),
        "dense-per-chunk": ("dense, cuDNN per chunk", None, per_chunk(suffix("cudnn")), cps),
        "dense-fa2": ("dense, FA2 varlen", None, per_chunk(suffix("flash")), cps[:1]),
        "dense-s2attn": ("dense, s2attn V=1", s2_dense_full, per_chunk(s2_dense_at), cps),
    }
    # Every row of this shape is timed round by round with the others (gpu_timing.time_rows):
    # timed one after another, the first (CP=1 SDPA, right after a compile) ran on a cooler,
    # faster-clocked GPU than the CP rows after it.
    # An a2a kind's per-token ratio divides by the CP=1 row of the kind it splits: time that
    # kind first.
    bases = {"S2-a2a": "S2", "dense-fa4-a2a": "dense-fa4"}
    kinds = list(dict.fromkeys([*(bases[n] for n in kinds if n in bases), *kinds]))
    rows, steps = [], []
    s2_row = fa4_row = None
    kv_mib = 2 * seq * groups * dim * 2 / 2**20
    # The head all-to-all's forward at CP=1 (a rank: 1/cp of it): q, k, v out, the output back.
    a2a_mib = (2 * heads + 2 * groups) * seq * dim * 2 / 2**20
    sdpa = None  # index of dense SDPA's CP=1 row in ``rows``
    if any(kind.startswith("dense") for kind in kinds):
        steps.append(fwd_bwd_step(dense_full, (q, k, v)))
        rows.append(dict(kind="dense SDPA", seq=seq, cp=1, rank="-", kv=0, prof=None, own=None))
        sdpa = 0
    for name in kinds:
        kind, full, at, kind_cps = table[name]
        skip = fa4_unusable_reason(q) if name.startswith("dense-fa4") else None
        if skip:
            print(f"# {kind}: skipped ({skip})")
            continue
        profiled = name.split("-")[0] in profile_kinds
        # The row this kind's "per-token vs CP=1" divides by: its own CP=1 row, the a2a
        # kinds' that of the kind they split (the same whole-sequence call).
        own = {"S2-a2a": s2_row, "dense-fa4-a2a": fa4_row}.get(name, sdpa)
        if full is not None:
            if full is dense_full:  # SDPA's CP=1 row is timed once: both columns share it
                rows[sdpa]["kind"] = kind
            else:
                steps.append(fwd_bwd_step(full, (q, k, v)))
                rows.append(dict(kind=kind, seq=seq, cp=1, rank="-", kv=0, prof=None, own=None))
                own = len(rows) - 1
                if name == "S2":
                    s2_row = own
                elif name == "dense-fa4":
                    fa4_row = own
            if profiled:
                rows[own]["prof"] = profile_breakdown(steps[own])
        for cp in kind_cps:
            chunk = seq // (2 * cp)
            for rank in sorted({0, cp - 1}):
                rows_q = torch.cat(
                    [q[rank * chunk : (rank + 1) * chunk], q[(2 * cp - 1 - rank) * chunk :][:chunk]]
                ).detach()
                rows_q.requires_grad_()
                if name.endswith("a2a"):
                    # The head all-to-all starts from the rank's own K/V rows.
                    rows_k, rows_v = (
                        torch.cat(
                            [x[rank * chunk :][:chunk], x[(2 * cp - 1 - rank) * chunk :][:chunk]]
                        )
                        .detach()
                        .requires_grad_()
                        for x in (k, v)
                    )

                    def local(
                        rows_q=rows_q, rank=rank, cp=cp, chunk=chunk, at=at, kv=(rows_k, rows_v)
                    ):
                        return at(rows_q, rank, cp, chunk, *kv)

                    grads_of = (rows_q, rows_k, rows_v)
                else:

                    def local(rows_q=rows_q, rank=rank, cp=cp, chunk=chunk, at=at):
                        return at(rows_q, rank, cp, chunk)

                    grads_of = (rows_q, k, v)
                steps.append(fwd_bwd_step(local, grads_of))
                rows.append(
                    dict(
                        kind=kind,
                        seq=seq,
                        cp=cp,
                        rank=rank,
                        kv=(a2a_mib / cp if name.endswith("a2a") else kv_mib) * (cp - 1) / cp,
                        prof=profile_breakdown(steps[-1]) if profiled else None,
                        own=own,
                    )
                )
    for row, step in zip(rows, steps):
        row["mem"] = _peak_mib(step)
    for row, ms in zip(rows, time_rows(steps)):
        row["ms"] = ms
    for row in rows:
        tokens = seq if row["cp"] == 1 else seq // row["cp"]
        per_token = row["ms"] / tokens
        own = row.pop("own")
        ref = rows[own] if own is not None else row
        row["rel"] = per_token / (ref["ms"] / seq)
        # Every dense kind's label starts with "dense" (the S2 one is "S2").
        dense = row["kind"].startswith("dense")
        row["rel_sdpa"] = per_token / (rows[sdpa]["ms"] / seq) if dense else None
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    ap.add_argument(
        "--heads", nargs="+", default=["16/16", "32/8"], help="query/KV heads, head_dim 128"
    )
    ap.add_argument(
        "--profile",
        nargs="*",
        default=[],
        choices=["S2", "dense"],
        help="also print each row's GPU time by kernel group (torch.profiler): S2 and/or dense",
    )
    ap.add_argument(
        "--kinds",
        nargs="+",
        default=list(DEFAULT_KINDS),
        choices=KINDS,
        help="attention paths to time (default: S2; dense on SDPA/cuDNN by all-gather and by "
        "head all-to-all; dense FA4 where installed)",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cp_benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    print(
        f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
        f"{datetime.date.today()}, bf16, head_dim 128, batch 1, S2 {S2_SETTINGS}"
    )
    print(
        "| heads | seq | layer | CP | rank | fwd+bwd ms | per-token vs CP=1 | "
        "per-token vs dense SDPA CP=1 | peak MiB | received MiB (fwd) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for spec in args.heads:
        heads, groups = (int(x) for x in spec.split("/"))
        for seq in args.seqs:
            rows = run(seq, heads, groups, 128, args.cp, args.profile, args.kinds)
            for r in rows:
                vs_sdpa = "-" if r["rel_sdpa"] is None else f"{r['rel_sdpa']:.2f}"
                print(
                    f"| {spec} | {seq} | {r['kind']} | {r['cp']} | {r['rank']} | {r['ms']:.2f} | "
                    f"{r['rel']:.2f} | {vs_sdpa} | {r['mem']:.0f} | {r['kv']:.0f} |"
                )
            for r in rows:
                if r["prof"]:
                    # Per query token, as the table's ratio: ms per step over the rank's rows.
                    n = seq if r["cp"] == 1 else seq // r["cp"]
                    parts = ", ".join(f"{g} {ms:.2f} ms" for g, ms in r["prof"])
                    total = sum(ms for _, ms in r["prof"])
                    print(
                        f"#   profile {spec} {seq} {r['kind']} CP={r['cp']} rank {r['rank']}: "
                        f"{total:.2f} ms GPU a step ({1e6 * total / n:.1f} ns a query token): "
                        f"{parts}"
                    )
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
