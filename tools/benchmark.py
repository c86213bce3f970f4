"""Benchmark S2 attention against FlexAttention (same pattern) and dense causal SDPA.

    python tools/benchmark.py                       # the docs/benchmarks.md table (GPU)
    python tools/benchmark.py --seqs 32768 --sweep  # also try alternative kernel configs

For each sequence length (batch x seq = --tokens), times forward and forward+backward with CUDA
events (``triton.testing.do_bench``, median, after warm-up) for:
  * s2attn (this package's Triton kernels),
  * s2attn varlen (row "varlen"): the same tokens as packed documents of ``seq`` tokens through
    ``s2_attention_varlen`` (equal work: compare with the s2attn row); row "varlen-mixed" (not in
    the default rows): documents of seeded log-uniform lengths in [block, seq], odd ones included,
    at the same total tokens; both time the call a training loop makes
    (``check_cu_seqlens=False``),
  * FlexAttention with the identical S2 pattern: its BlockMask is built from our tile layout
    (partial/full 128-blocks), never from a dense S x S mask,
  * dense causal SDPA with the flash and cuDNN backends.
Effective TFLOP/s count attended token pairs only: forward 4*d per pair, backward 2.5x forward.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys

import torch
import torch.nn.functional as F

from s2attn import S2Pattern, s2_attention, s2_attention_varlen
from s2attn.layout import layout_for
from s2attn.triton_attention import KernelConfig, PassConfig, kernel_config

# FlexAttention's BlockMask granularity (its default block size).
FLEX_BLOCK = 128
# FLOPs per attended (query, key) pair and head dim: QK^T and PV, 2 each; backward 2.5x forward.
FWD_FLOPS_PER_PAIR_DIM = 4
BWD_FLOPS_OVER_FWD = 2.5


def tflops(pairs: int, d: int, ms: float, with_bwd: bool) -> float:
    flops = FWD_FLOPS_PER_PAIR_DIM * d * pairs * (1.0 + (BWD_FLOPS_OVER_FWD if with_bwd else 0.0))
    return flops / (ms * 1e-3) / 1e12


def bench(fn, warmup=25, rep=100) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def fwd_bwd(run, inputs, grad):
    def step():
        for t in inputs:
            t.grad = None
        run().backward(grad)

    return step


def flex_block_mask(pattern: S2Pattern, seq: int, device):
    """FlexAttention BlockMask for ``pattern`` from our layout at 128-token granularity."""
    from torch.nn.attention.flex_attention import BlockMask

    B, L, V = pattern.block_size, pattern.local_blocks, pattern.vert_stride
    bn = min(B, FLEX_BLOCK)
    lay = layout_for(pattern, seq, seq, 0, 0, FLEX_BLOCK, bn, device)
    H, nq = lay.num_heads, lay.num_q_tiles
    nk = -(-seq // FLEX_BLOCK)
    per = FLEX_BLOCK // bn  # our key tiles per flex key block
    counts = lay.row_ptr[1:] - lay.row_ptr[:-1]
    item = torch.repeat_interleave(torch.arange(H * nq, device=device), counts.long())
    e = torch.arange(lay.nnz, device=device)
    full = e < lay.row_split.long()[item]
    fk = lay.cols.long() // per
    idx = item * nk + fk
    n_sub = torch.zeros(H * nq * nk, dtype=torch.int32, device=device)
    n_full = torch.zeros_like(n_sub)
    n_sub.index_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))
    n_full.index_add_(0, idx, full.to(torch.int32))
    n_keys = torch.clamp(seq - torch.arange(nk, device=device) * FLEX_BLOCK, max=FLEX_BLOCK)
    subs_needed = (-(-n_keys // bn)).to(torch.int32)
    n_sub, n_full = n_sub.view(H, nq, nk), n_full.view(H, nq, nk)
    is_full = n_full == subs_needed[None, None, :]
    is_part = (n_sub > 0) & ~is_full

    def to_indices(sel):
        num = sel.sum(-1).to(torch.int32)[None]
        ind = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)[None]
        return num, ind

    kv_num, kv_ind = to_indices(is_part)
    full_num, full_ind = to_indices(is_full)
    dense, res = pattern.head_params(device)

    def mask_mod(b, h, q_idx, kv_idx):
        qb, kb = q_idx // B, kv_idx // B
        return (kv_idx <= q_idx) & (((qb - kb) < L) | (kb % V == res[h]) | dense[h])

    return BlockMask.from_kv_blocks(
        kv_num,
        kv_ind,
        full_num,
        full_ind,
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(seq, seq),
    )


def mixed_lengths(tokens: int, longest: int, shortest: int, seed: int = 0) -> list:
    """Document lengths for a realistic pack: log-uniform in ``[shortest, longest]`` (any
    integer, so most are no multiple of the block size), the last one filling ``tokens``."""
    gen = torch.Generator().manual_seed(seed)
    lens, left = [], tokens
    lo, hi = torch.log(torch.tensor(float(shortest))), torch.log(torch.tensor(float(longest)))
    while left > 0:
        n = int(torch.exp(lo + (hi - lo) * torch.rand((), generator=gen)))
        lens.append(min(max(n, 1), left))
        left -= lens[-1]
    return lens


def sweep_configs(base: KernelConfig) -> list:
    """Alternatives to ``base`` around each pass's tuned point (see tools/tune_kernels.py for a
    per-kernel sweep)."""
    r = dataclasses.replace

    def stages(n):
        return r(
            base,
            fwd=r(base.fwd, num_stages=n),
            dq=r(base.dq, num_stages=n),
            dkdv=r(base.dkdv, num_stages=n),
        )

    return [
        r(base, fwd=PassConfig(128, 4, base.fwd.num_stages)),
        r(base, fwd=PassConfig(128, 8, base.fwd.num_stages)),
        r(base, dq=PassConfig(64, 4, base.dq.num_stages)),
        r(base, dkdv=r(base.dkdv, block_m=64)),
        r(base, dkdv=PassConfig(64, 8, base.dkdv.num_stages)),
        stages(2),
        stages(4),
    ]


def config_label(cfg: KernelConfig, base: KernelConfig) -> str:
    """``s2attn`` for the default config, else the fields that differ from it."""
    diffs = [f"bn={cfg.block_n}"] if cfg.block_n != base.block_n else []
    for name in ("fwd", "dq", "dkdv"):
        got, ref = getattr(cfg, name), getattr(base, name)
        diffs += [
            f"{name}.{f.name}={getattr(got, f.name)}"
            for f in dataclasses.fields(got)
            if getattr(got, f.name) != getattr(ref, f.name)
        ]
    return "s2attn" + ("" if not diffs else " " + ",".join(diffs))


def run_case(seq, args, d, block, rows, sweep):
    dev = torch.device("cuda")
    batch = max(1, args.tokens // seq)
    H, Hkv = args.heads, args.kv_heads or args.heads
    pat = S2Pattern(
        num_heads=H,
        num_kv_heads=Hkv,
        block_size=block,
        local_blocks=args.local_blocks,
        vert_stride=args.vert_stride,
        head_offset=args.head_offset,
    )
    s2_pairs = pat.attended_pairs(seq) * batch
    dense_pairs = seq * (seq + 1) // 2 * H * batch
    torch.manual_seed(0)
    mk = lambda h: torch.randn(
        batch, seq, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True
    )
    q, k, v = mk(H), mk(Hkv), mk(Hkv)
    grad = torch.randn_like(q)
    res = []

    def record(name, pairs, f, fb):
        try:
            ms_f = bench(f)
            ms_fb = bench(fb)
        except Exception as exc:  # a baseline that cannot run at this size is reported, not fatal
            print(f"  {name}: failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
            res.append(
                dict(name=name, seq=seq, batch=batch, d=d, block=block, error=str(exc)[:300])
            )
            return
        r = dict(
            name=name,
            seq=seq,
            batch=batch,
            d=d,
            block=block,
            fwd_ms=ms_f,
            fwdbwd_ms=ms_fb,
            fwd_tflops=tflops(pairs, d, ms_f, False),
            fwdbwd_tflops=tflops(pairs, d, ms_fb, True),
        )
        res.append(r)
        print(
            f"  {name:<14} fwd {ms_f:8.2f} ms {r['fwd_tflops']:6.0f} TF/s | "
            f"fwd+bwd {ms_fb:8.2f} ms {r['fwdbwd_tflops']:6.0f} TF/s",
            flush=True,
        )

    base = kernel_config(pat, d, dev)
    for cfg in [base] + (sweep_configs(base) if sweep else []):
        run = lambda cfg=cfg: s2_attention(q, k, v, pat, kernel_config=cfg)
        record(config_label(cfg, base), s2_pairs, run, fwd_bwd(run, (q, k, v), grad))
    # The batch's tokens packed (views, no copy) for the varlen rows.
    qv, kv, vv = (x.view(batch * seq, *x.shape[2:]) for x in (q, k, v))
    for row in ("varlen", "varlen-mixed"):
        if row not in rows:
            continue
        lens = [seq] * batch if row == "varlen" else mixed_lengths(batch * seq, seq, block)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).to(dev)
        run = lambda cu=cu, lens=lens: s2_attention_varlen(
            qv, kv, vv, cu, max(lens), pat, check_cu_seqlens=False
        )
        pairs = s2_pairs if row == "varlen" else sum(pat.attended_pairs(n) for n in lens)
        name = "s2attn varlen" + ("" if row == "varlen" else f" mixed ({len(lens)} docs)")
        record(name, pairs, run, fwd_bwd(run, (q, k, v), grad.view(batch * seq, H, d)))
    if "flex" in rows:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        bm = flex_block_mask(pat, seq, dev)
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        gt = grad.transpose(1, 2).contiguous()
        run = lambda: flex(qt, kt, vt, block_mask=bm, enable_gqa=Hkv != H)
        record("flex (same S2)", s2_pairs, run, fwd_bwd(run, (qt, kt, vt), gt))
        del qt, kt, vt
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qd, kd, vd = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    gd = grad.transpose(1, 2).contiguous()
    for name, backend in (
        ("sdpa flash", SDPBackend.FLASH_ATTENTION),
        ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
    ):
        if name.split()[1] not in rows:
            continue

        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(
                    qd, kd, vd, is_causal=True, enable_gqa=Hkv != H
                )

        record(name + " dense", dense_pairs, run, fwd_bwd(run, (qd, kd, vd), gd))
    return res, pat.density(seq)


def summarize(results):
    """Markdown table with speedups of s2attn over each baseline (fwd+bwd)."""
    lines = [
        "| seq x batch | d | block | density | kernel | fwd ms | fwd TF/s | fwd+bwd ms "
        "| fwd+bwd TF/s | s2attn speedup (fwd+bwd) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (seq, d, block, dens), rs in results.items():
        ours = next((r for r in rs if r["name"] == "s2attn" and "fwdbwd_ms" in r), None)
        for r in rs:
            row = f"| {seq} x {r['batch']} | {d} | {block} | {dens:.3f} | {r['name']} |"
            if "fwdbwd_ms" not in r:
                lines.append(f"{row} failed | | | | |")
                continue
            sp = "" if ours is None or r is ours else f"{r['fwdbwd_ms'] / ours['fwdbwd_ms']:.2f}x"
            lines.append(
                f"{row} {r['fwd_ms']:.2f} | {r['fwd_tflops']:.0f} | "
                f"{r['fwdbwd_ms']:.2f} | {r['fwdbwd_tflops']:.0f} | {sp} |"
            )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--tokens", type=int, default=131072, help="batch x seq per case")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--local-blocks", type=int, default=16)
    ap.add_argument("--vert-stride", type=int, default=8)
    ap.add_argument("--head-offset", type=int, default=0)
    ap.add_argument(
        "--rows",
        default="varlen,flex,flash,cudnn",
        help="rows besides s2attn (comma list of varlen, varlen-mixed, flex, flash, cudnn)",
    )
    ap.add_argument(
        "--extra",
        action="store_true",
        help="also run head_dim 64 and block 16 rows at 32k (s2attn and flex)",
    )
    ap.add_argument("--sweep", action="store_true", help="also time alternative kernel configs")
    ap.add_argument("--json", default=None, help="write raw results here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("tools/benchmark.py needs a CUDA GPU")
    rows = set(args.rows.split(","))
    cases = [(s, args.head_dim, args.block_size, rows, args.sweep) for s in args.seqs]
    if args.extra:
        cases += [
            (32768, 64, args.block_size, {"flex", "cudnn"}, False),
            (32768, args.head_dim, 16, {"flex"}, False),
        ]
    print(
        f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | "
        f"{datetime.date.today()} | heads {args.heads}/{args.kv_heads or args.heads} "
        f"L={args.local_blocks} V={args.vert_stride} tokens={args.tokens}",
        flush=True,
    )
    results = {}
    for seq, d, block, rws, sw in cases:
        print(f"seq {seq} d {d} block {block}", flush=True)
        rs, dens = run_case(seq, args, d, block, rws, sw)
        results[(seq, d, block, dens)] = rs
        torch.cuda.empty_cache()
    table = summarize(results)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "date": str(datetime.date.today()),
                    "argv": sys.argv,
                    "results": [r for rs in results.values() for r in rs],
                    "table": table,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
