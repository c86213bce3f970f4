#!/usr/bin/env python
"""A context-parallel rank's dense attention with the real exchange over NCCL, next to one
GPU's whole-sequence layer: does CP cost a dense layer anything per token?

    torchrun --nproc-per-node 2 tools/cp_exchange_benchmark.py
    torchrun --nproc-per-node 2 tools/cp_exchange_benchmark.py --seqs 32768 --heads 16/4
    torchrun --nproc-per-node 2 tools/cp_exchange_benchmark.py --high-priority
    torchrun --nproc-per-node 2 tools/cp_exchange_benchmark.py --fa4   # FlashAttention-4 too

Every rank times, forward + backward, round by round with each other (``gpu_timing``, the same
rounds on every rank so that their exchanges pair up, the ranks meeting before each run):

* ``CP=1``: the whole sequence of all heads on the rank's own GPU, as ``FusedDenseAttention``
  runs it without CP (SDPA/cuDNN, ``dense_attention=sdpa``; with ``--fa4`` also on
  FlashAttention-4, and every CP row again on it);
* ``a2a``: the head all-to-all (``attend_heads_a2a``) over the CP group, its transfers
  included;
* ``all-gather``: K/V gathered, the rank's two chunks by the rank-level cuDNN function
  (``dense_local_chunks``, the path beyond ``DENSE_A2A_MAX_SEQ``).

"per token vs CP=1" divides a rank's time per query token (``S / CP`` of them) by the CP=1
row's on the same GPU: 1.00 means CP costs the layer nothing per token, below 1 that it gains.
Printed by rank 0, with every rank's value. ``--high-priority`` times the CP rows again on a
group whose NCCL stream has high priority (Megatron's ``high_priority_stream_groups=["cp"]``):
1-2% faster on the layer at 32k without GQA, within the noise otherwise and in training
(``docs/context_parallel.md``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_timing import fwd_bwd_step, time_rows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

RUNS = 20  # timed rounds: a fixed count, the same on every rank (their exchanges pair up)


def _local_rows(x: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """Megatron's load-balanced split of ``[S, ...]``: chunks ``rank`` and ``2cp - 1 - rank``."""
    chunks = x.chunk(2 * cp)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]]).detach().requires_grad_()


def run(
    seq: int, heads: int, groups: int, dim: int, groups_by_label: dict, fa4: bool = False
) -> list[tuple]:
    """``(row, [ms of each rank], [per-token ratio of each rank])`` for one shape: the CP=1 row,
    then the a2a and all-gather rows on each of ``groups_by_label`` (label -> CP group); with
    ``fa4``, the same rows on FlashAttention-4 (where it imports). Every ratio is against the
    SDPA CP=1 row: the dense layer without FlashAttention-4."""
    from megatron_s2.context_parallel import dense_local_chunks
    from megatron_s2.context_parallel_a2a import a2a_unsupported_reason, attend_heads_a2a
    from megatron_s2.flash_attention4 import fa4_causal, fa4_unusable_reason

    group = next(iter(groups_by_label.values()))
    cp, rank = group.size(), group.rank()
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)  # every rank draws the same sequence
    q, k, v = (
        torch.randn(seq, 1, n, dim, device=dev, dtype=dt, generator=g).requires_grad_()
        for n in (heads, groups, groups)
    )
    scale = dim**-0.5

    def sdpa(qh, kh, vh, head_group=0):  # FusedDenseAttention._attend_whole on SDPA
        x = [t.permute(1, 2, 0, 3) for t in (qh, kh, vh)]
        out = F.scaled_dot_product_attention(
            *x, is_causal=True, scale=scale, enable_gqa=x[0].shape[1] != x[1].shape[1]
        )
        return out.permute(2, 0, 1, 3)

    def fa4_whole(qh, kh, vh, head_group=0):  # ... and on FlashAttention-4
        return fa4_causal(*(t.transpose(0, 1) for t in (qh, kh, vh)), scale).transpose(0, 1)

    rq, rk, rv = (_local_rows(x, rank, cp) for x in (q, k, v))
    chunk = seq // (2 * cp)
    rows = [("CP=1, SDPA", fwd_bwd_step(lambda: sdpa(q, k, v), (q, k, v)), seq)]
    kernels = [("", sdpa, "sdpa")]
    if fa4:
        why_not = fa4_unusable_reason(q)
        if why_not and rank == 0:
            print(f"# FlashAttention-4 rows left out: {why_not}", file=sys.stderr)
        if not why_not:
            rows.append(("CP=1, FA4", fwd_bwd_step(lambda: fa4_whole(q, k, v), (q, k, v)), seq))
            kernels.append((", FA4", fa4_whole, "fa4"))
    for kernel, attend, backend in kernels:
        for label, grp in groups_by_label.items():
            if a2a_unsupported_reason(heads, groups, cp) is None:
                a2a = fwd_bwd_step(
                    lambda grp=grp, attend=attend: attend_heads_a2a(rq, rk, rv, grp, attend),
                    (rq, rk, rv),
                )
                rows.append((f"CP={cp} a2a{kernel}{label}", a2a, seq // cp))
            gather = fwd_bwd_step(
                lambda grp=grp, backend=backend: dense_local_chunks(
                    rq, rk, rv, grp, chunk, scale, backend=backend
                ),
                (rq, rk, rv),
            )
            rows.append((f"CP={cp} all-gather{kernel}{label}", gather, seq // cp))
    # The ranks meet before every timed run: a row after one without exchanges (CP=1) would
    # otherwise include waiting for the slower rank to finish it.
    token = torch.zeros(1, device=dev)
    ms = time_rows(
        [step for _, step, _ in rows],
        min_runs=RUNS,
        rep=0.0,
        before=lambda: dist.all_reduce(token, group=group),
    )
    mine = torch.tensor([ms, [t / n for t, (_, _, n) in zip(ms, rows)]], device=dev)
    every = [torch.empty_like(mine) for _ in range(cp)]
    dist.all_gather(every, mine, group=group)
    return [
        (name, [float(r[0, i]) for r in every], [float(r[1, i] / r[1, 0]) for r in every])
        for i, (name, _, _) in enumerate(rows)
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--heads", nargs="+", default=["16/16", "16/4"], help="query/KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument(
        "--high-priority",
        action="store_true",
        help="also time the CP rows on a group whose NCCL stream has high priority",
    )
    ap.add_argument(
        "--fa4", action="store_true", help="also the rows on FlashAttention-4 where it imports"
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        print("cp_exchange_benchmark runs under torchrun on CUDA GPUs", file=sys.stderr)
        return 2
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    ranks = list(range(dist.get_world_size()))
    groups_by_label = {"": dist.new_group(ranks)}
    if args.high_priority:
        # What Megatron's high_priority_stream_groups=["cp"] makes of the CP group.
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        groups_by_label[", high-priority stream"] = dist.new_group(ranks, pg_options=options)
    me = dist.get_rank()
    if me == 0:
        print(
            f"# {dist.get_world_size()}x {torch.cuda.get_device_name(0)}, NCCL, torch "
            f"{torch.__version__}, {datetime.date.today()}, bf16, head_dim {args.head_dim}, "
            "batch 1, fwd+bwd"
        )
        print("| heads | seq | row | ms, each rank | per token vs CP=1, each rank |")
        print("|---|---|---|---|---|")
    for spec in args.heads:
        heads, groups = (int(x) for x in spec.split("/"))
        for seq in args.seqs:
            for name, ms, rel in run(seq, heads, groups, args.head_dim, groups_by_label, args.fa4):
                if me == 0:
                    print(
                        f"| {spec} | {seq} | {name} | {' / '.join(f'{m:.2f}' for m in ms)} | "
                        f"{' / '.join(f'{r:.3f}' for r in rel)} |",
                        flush=True,
                    )
            torch.cuda.empty_cache()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
