"""Time each S2 kernel (forward, dK/dV, dQ) alone over candidate tile configs (GPU).

    python tools/tune_kernels.py --seq 32768 --tokens 131072

Prints one line per (kernel, config, pointer or TMA tile loads) with the median time (the
candidates of a kernel timed round by round, ``gpu_timing.py``); the fastest per kernel is what
``s2attn.config.kernel_config`` should return on this GPU (its ``GPU_*`` defaults).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from gpu_timing import time_rows

from s2attn import S2Pattern, dispatch, tl_kernels
from s2attn.config import PassConfig, kernel_config

# Candidates per pass as (block_m, num_warps, num_stages).
FWD = [
    PassConfig(*c)
    for c in [(128, 8, 3), (128, 8, 4), (128, 4, 3), (64, 4, 3), (64, 4, 4), (64, 8, 3)]
]
DKDV = [
    PassConfig(*c)
    for c in [(32, 4, 3), (32, 4, 4), (32, 8, 3), (16, 4, 3), (64, 4, 3), (64, 8, 3), (64, 8, 2)]
]
DQ = [
    PassConfig(*c)
    for c in [(64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 8, 3), (128, 8, 2), (128, 4, 3)]
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument(
        "--tma",
        choices=("off", "on", "both"),
        default="both",
        help="tile loads per candidate: pointer (off), TMA descriptors (on), or each (both)",
    )
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    b = max(1, args.tokens // args.seq)
    H, G, d = args.heads, args.kv_heads or args.heads, args.head_dim
    pat = S2Pattern(
        num_heads=H, num_kv_heads=G, block_size=args.block_size, local_blocks=16, vert_stride=8
    )
    mk = lambda h: torch.randn(b, args.seq, h, d, device=dev, dtype=torch.bfloat16)
    q, k, v = mk(H), mk(G), mk(G)
    do = torch.randn_like(q)
    scale = d**-0.5
    base = kernel_config(pat, d, dev)
    out, lse = dispatch.s2_forward(q, k, v, pat, scale, 0, 0, base)
    _, delta = tl_kernels.s2_dq_tl(do, None, q, k, v, out, lse, pat, scale, 0, 0, base)
    print(f"seq {args.seq} x {b}, heads {H}/{G}, d {d}, block {args.block_size}; default {base}")
    for name, cands, fn in (
        ("fwd", FWD, lambda c: dispatch.s2_forward(q, k, v, pat, scale, 0, 0, c)),
        (
            "dkdv",
            DKDV,
            lambda c: tl_kernels.s2_dkdv_tl(do, q, k, v, lse, delta, pat, scale, 0, 0, c),
        ),
        ("dq", DQ, lambda c: tl_kernels.s2_dq_tl(do, None, q, k, v, out, lse, pat, scale, 0, 0, c)),
    ):
        tmas = {"off": (False,), "on": (True,), "both": (False, True)}[args.tma]
        runs, labels = [], []
        for cand, tma in ((c, t) for c in cands for t in tmas):
            cfg = dataclasses.replace(base, tma=tma, **{name: cand})
            label = f"{cand}{' tma' if tma else ''}"
            run = lambda fn=fn, cfg=cfg: fn(cfg)
            try:
                run()
            except Exception as exc:  # e.g. out of shared memory for a tile shape
                print(f"  {name:5} {label}: failed {type(exc).__name__}")
                continue
            runs.append(run)
            labels.append(label)
        # All candidates of a pass timed round by round: one after another, the first ran on a
        # cooler, faster-clocked GPU (gpu_timing.py).
        times = time_rows(runs)
        for label, ms in zip(labels, times):
            print(f"  {name:5} {label}: {ms:7.2f} ms", flush=True)
        if times:
            print(f"  best {name}: {min(zip(times, labels))}")


if __name__ == "__main__":
    main()
