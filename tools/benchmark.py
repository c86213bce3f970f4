"""Benchmark S2 attention against FlexAttention (same pattern) and dense causal kernels.

    python tools/benchmark.py                       # the docs/benchmarks.md table (GPU)
    python tools/benchmark.py --seqs 32768 --sweep  # also try alternative kernel configs
    python tools/benchmark.py --list-rows           # which rows this machine can run (no GPU)
    python tools/benchmark.py --seqs 32768 --rows= --passes  # also each Gluon pass alone

For each sequence length (batch x seq = --tokens), times forward and forward+backward with CUDA
events (median of at least 10 runs after 2 warm-up runs, L2 flushed) for the row ``s2attn`` (this
package's Triton kernels on the S2 pattern) and the rows named by ``--rows``:
  * ``s2dense``: s2attn on a dense causal pattern (``vert_stride=1``: every key block is on a
    stripe), the base rate that every S2 speed-up multiplies,
  * ``varlen``: the same tokens as packed documents of ``seq`` tokens through
    ``s2_attention_varlen`` (equal work: compare with the s2attn row); ``varlen-mixed`` (not in
    the default rows): documents of seeded log-uniform lengths in [block, seq], odd ones
    included, at the same total tokens; both time the call a training loop makes
    (``check_cu_seqlens=False``),
  * ``flex`` / ``flex-fa4``: FlexAttention with the identical S2 pattern, Triton backend and
    FlashAttention-4 backend (``kernel_options={"BACKEND": "FLASH"}``, needs ``flash-attn-4``);
    its BlockMask is built from our tile layout (partial/full 128-blocks), never from a dense
    S x S mask,
  * ``flash`` / ``cudnn``: dense causal SDPA with the flash (FA2) and cuDNN backends,
  * ``fa4``: dense causal FlashAttention-4 (``flash_attn.cute.flash_attn_func`` of the
    ``flash-attn-4`` package; tools/stage_flash_attn4.sh carries it to the lent GPU machines).
With ``--baseline DIR`` (another copy of the s2attn package, e.g. an earlier commit's
``kernels/`` from ``git archive``), rows ``base s2attn`` (and ``base s2attn dense (V=1)`` when
s2dense runs) time that copy on the same inputs in the same run: a kernel change is judged
against its predecessor side by side, not against a number from another day. All rows of a
case are timed round by round (each row once a round, the order reversed every other round;
each row the median of at least 10 runs), so that all see the same clocks as the GPU warms up.
Rows whose package does not import are skipped with a printed note. Each case also prints the
GPU's power draw and SM clock while its rows were timed (``nvidia-smi``, every 200 ms; kept in
the JSON records as ``gpu_power``): the lent H100s time these kernels at their power limit.
Effective TFLOP/s count attended token pairs only: forward 4*d per pair, backward 2.5x forward.
The table gives each
row's fwd+bwd rate as a fraction of the best dense kernel (flash, cudnn, fa4) in the same run,
and a footer per case with our rows' forward and forward+backward fractions. ``--passes`` also
times our three Gluon passes (forward, dQ, dK/dV) one by one, round by round (and the
``--baseline`` copy's), each rated by its own matrix products over the attended pairs: which
pass is furthest from the tensor cores' rate, and (sm_90) each pass's share of the tensor cores'
peak at the median SM clock seen while the passes ran (a power-limited GPU runs below its
boost clock). The footer also gives our rows' rate per matrix product run: our deterministic
backward runs 9 products a forward and backward where the dense kernels' fused ones run the 7
that the effective rate credits.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import sys
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from gpu_timing import (
    PowerSampler,
    describe_power,
    nvidia_smi_id,
    tensor_peak_tflops,
    time_rows,
)

from s2attn import S2Pattern, s2_attention, s2_attention_varlen
from s2attn.config import GLUON_BWD_BLOCKS, KernelConfig, PassConfig, kernel_config
from s2attn.layout import layout_for

# FlexAttention's BlockMask granularity (its default block size; FA4's block-sparse backward
# on Hopper also needs 128-key blocks).
FLEX_BLOCK = 128
# FLOPs per attended (query, key) pair and head dim: QK^T and PV, 2 each; backward 2.5x forward.
FWD_FLOPS_PER_PAIR_DIM = 4
BWD_FLOPS_OVER_FWD = 2.5

# Rows besides "s2attn" (--rows keys), in table order, with their table labels.
ROWS = {
    "s2dense": "s2attn dense (V=1)",
    "varlen": "s2attn varlen",
    "varlen-mixed": "s2attn varlen mixed",
    "flex": "flex (same S2)",
    "flex-fa4": "flex FA4 (same S2)",
    "flash": "sdpa flash dense",
    "cudnn": "sdpa cudnn dense",
    "fa4": "fa4 dense",
}
DEFAULT_ROWS = "s2dense,varlen,flex,flex-fa4,flash,cudnn,fa4"
# Other people's dense causal kernels: "best dense" is the fastest of these in the same case.
# Our own dense-pattern row is left out on purpose: it is what we measure against them.
DENSE_BASELINES = ("flash", "cudnn", "fa4")
# Rows of ours whose fractions of the best dense rate the footer spells out (base-*: the
# --baseline copy of the package).
OUR_ROWS = ("s2attn", "s2dense", "base-s2attn", "base-s2dense")
BASELINE_PACKAGE = "s2attn_baseline"
# Matrix products per attended pair in each Gluon pass (--passes): the forward's S and PV, the
# dQ pass's S, dP and dQ, the dK/dV pass's S^T, dP^T, dV and dK (2 * d FLOPs each).
PASS_PRODUCTS = {"fwd": 2, "dq": 3, "dkdv": 4}
# A forward and backward of ours runs all three passes' products (the deterministic backward
# computes S and dP in both of its passes); the effective rate credits a fused backward's 5
# (2.5x the forward's 2), what the dense baselines run.
OUR_PRODUCTS = sum(PASS_PRODUCTS.values())
CREDITED_PRODUCTS = PASS_PRODUCTS["fwd"] * (1 + BWD_FLOPS_OVER_FWD)
FA4_MODULE = "flash_attn.cute"
STAGE_HINT = "carry flash-attn-4 with tools/stage_flash_attn4.sh (docs/benchmarks.md)"
# Rate keys of a result record: forward alone and forward+backward.
RATES = ("fwd_tflops", "fwdbwd_tflops")


def tflops(pairs: int, d: int, ms: float, with_bwd: bool) -> float:
    """Effective TFLOP/s of ``pairs`` attended (query, key) pairs at head dim ``d`` run in
    ``ms`` milliseconds (forward 4*d FLOPs per pair; backward 2.5x forward when ``with_bwd``)."""
    flops = FWD_FLOPS_PER_PAIR_DIM * d * pairs * (1.0 + (BWD_FLOPS_OVER_FWD if with_bwd else 0.0))
    return flops / (ms * 1e-3) / 1e12


def dense_causal_pairs(seq: int, heads: int, batch: int = 1) -> int:
    """Attended pairs of dense causal attention: ``seq*(seq+1)/2`` per query head and sequence
    (the diagonal included), what the dense rows are credited with."""
    return seq * (seq + 1) // 2 * heads * batch


def dense_pattern(pattern: S2Pattern) -> S2Pattern:
    """``pattern`` with ``vert_stride=1``: every key block lies on every head's stripe, so the
    S2 rule attends the whole causal triangle while running the same sparse kernels (tile
    lists, masks, program order), at the same heads, block and local window."""
    return S2Pattern(
        num_heads=pattern.num_heads,
        num_kv_heads=pattern.num_kv_heads,
        block_size=pattern.block_size,
        local_blocks=pattern.local_blocks,
        vert_stride=1,
        head_offset=0,
    )


def row_pairs(row: str, pattern: S2Pattern, seq: int, batch: int, lens=None) -> int:
    """Attended (query, key) pairs that ``row`` is credited with for ``batch`` sequences of
    ``seq`` tokens: the S2 pattern's for our S2 rows and Flex (same BlockMask), the causal
    triangle for the dense kernels and our dense-pattern row; ``varlen-mixed`` counts each
    document of ``lens`` (token counts summing to ``batch * seq``) as a sequence of its own."""
    if row == "varlen-mixed":
        return sum(pattern.attended_pairs(n) for n in lens)
    if row in ("s2attn", "varlen", "flex", "flex-fa4"):
        return pattern.attended_pairs(seq) * batch
    if row == "s2dense":
        return dense_pattern(pattern).attended_pairs(seq) * batch
    if row in DENSE_BASELINES:
        return dense_causal_pairs(seq, pattern.num_heads, batch)
    raise ValueError(f"unknown row {row!r}")


def parse_rows(text: str) -> list:
    """``--rows`` (comma list of ``ROWS`` keys, blanks ignored) as a list in the given order;
    ValueError naming any unknown key (a typo would otherwise drop a row silently)."""
    rows = [r.strip() for r in text.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    return list(dict.fromkeys(rows))


def _import_error(import_module: Callable, name: str) -> Optional[str]:
    try:
        import_module(name)
    except Exception as exc:  # an installed but broken package is as unusable as a missing one
        return f"{name} does not import ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
    return None


def flex_backends() -> tuple:
    """The ``BACKEND`` values this torch's FlexAttention accepts (empty before the option)."""
    try:
        from torch.nn.attention.flex_attention import FlexKernelOptions
    except ImportError:
        return ()
    if "BACKEND" not in getattr(FlexKernelOptions, "__annotations__", {}):
        return ()
    return ("AUTO", "TRITON", "FLASH", "TRITON_DECODE")


def unavailable_rows(
    rows, import_module: Callable = importlib.import_module, backends: Optional[tuple] = None
) -> dict:
    """``{row: reason}`` for the rows of ``rows`` that cannot run here because a package is
    missing: ``fa4`` needs ``flash_attn.cute`` (flash-attn-4); ``flex-fa4`` needs it too
    (torch's FLASH backend calls it) and a FlexAttention with the ``BACKEND`` kernel option.
    ``import_module`` and ``backends`` (default: :func:`flex_backends`) are for tests."""
    out = {}
    need_fa4 = [r for r in rows if r in ("fa4", "flex-fa4")]
    fa4_missing = _import_error(import_module, FA4_MODULE) if need_fa4 else None
    for r in need_fa4:
        if fa4_missing:
            out[r] = f"{fa4_missing}; {STAGE_HINT}"
    if "flex-fa4" in rows and "flex-fa4" not in out:
        if "FLASH" not in (flex_backends() if backends is None else backends):
            out["flex-fa4"] = (
                f"torch {torch.__version__} FlexAttention has no kernel_options BACKEND='FLASH'"
            )
    return out


def plan_rows(rows, unavailable: dict) -> tuple:
    """(rows to run, [(row, reason)] to skip), both in ``rows`` order."""
    run = [r for r in rows if r not in unavailable]
    skipped = [(r, unavailable[r]) for r in rows if r in unavailable]
    return run, skipped


def fwd_bwd(run, inputs, grad):
    def step():
        for t in inputs:
            t.grad = None
        run().backward(grad)

    return step


def _allow_flex_recompiles() -> None:
    # Every case compiles flex_attention again (dynamic=False; a new shape or backend each), and
    # past dynamo's recompile limit (8) it would silently run eagerly, materializing S x S.
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 64))


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


# 128-key tiles: measured +8% on the forward of a dense causal pattern at block 128 (H100,
# docs/notebook/2026-11-benchmarks-kernel-work.md); a key tile never spans two pattern blocks,
# so only blocks of 128 take them.
WIDE_KEY_TILE = 128


def sweep_configs(base: KernelConfig, match=True, block_size: int = 64) -> list:
    """Alternatives to ``base`` around each pass's tuned point (see tools/tune_kernels.py for a
    per-kernel sweep); with ``match`` a string, only those whose label contains it. A pattern
    ``block_size`` of 128 adds 128-key tiles (``bn=128``) with the forward on 128 rows x 8 warps,
    3 stages, TMA loads and pointer loads."""
    if isinstance(match, str):
        configs = sweep_configs(base, block_size=block_size)
        return [c for c in configs if match in config_label(c, base)]
    r = dataclasses.replace
    wide = []
    if block_size % WIDE_KEY_TILE == 0 and base.block_n < WIDE_KEY_TILE:
        wide = [
            r(base, block_n=WIDE_KEY_TILE, fwd=PassConfig(128, 8, 3), tma=tma)
            for tma in (True, False)
        ]

    def stages(n):
        return r(
            base,
            fwd=r(base.fwd, num_stages=n),
            dq=r(base.dq, num_stages=n),
            dkdv=r(base.dkdv, num_stages=n),
        )

    # With the Gluon forward on, the fwd PassConfig variants below only change the calls it
    # does not take; the tl forward itself is one variant.
    gluon_off = [r(base, gluon_fwd=False)] if base.gluon_fwd else []
    # The Gluon backward passes toggled where they can run (with the Gluon forward: sm_90, the
    # blocks of GLUON_BWD_BLOCKS): dK/dV, dQ, and both at once.
    if base.gluon_fwd and block_size in GLUON_BWD_BLOCKS:
        gluon_off.append(r(base, gluon_dkdv=not base.gluon_dkdv))
        gluon_off.append(r(base, gluon_dq=not base.gluon_dq))
        if base.gluon_dkdv == base.gluon_dq:
            gluon_off.append(r(base, gluon_dkdv=not base.gluon_dkdv, gluon_dq=not base.gluon_dq))
    return (
        gluon_off
        + [
            r(base, tma=not base.tma),
            r(base, fwd=PassConfig(128, 4, base.fwd.num_stages)),
            r(base, fwd=PassConfig(128, 8, base.fwd.num_stages)),
            r(base, dq=PassConfig(64, 4, base.dq.num_stages)),
            r(base, dkdv=r(base.dkdv, block_m=64)),
            r(base, dkdv=PassConfig(64, 8, base.dkdv.num_stages)),
            stages(2),
            stages(4),
        ]
        + wide
    )


def config_label(cfg: KernelConfig, base: KernelConfig) -> str:
    """``s2attn`` for the default config, else the fields that differ from it."""
    diffs = [f"bn={cfg.block_n}"] if cfg.block_n != base.block_n else []
    diffs += [f"tma={cfg.tma}"] if cfg.tma != base.tma else []
    diffs += [f"gluon_fwd={cfg.gluon_fwd}"] if cfg.gluon_fwd != base.gluon_fwd else []
    diffs += [f"gluon_dkdv={cfg.gluon_dkdv}"] if cfg.gluon_dkdv != base.gluon_dkdv else []
    diffs += [f"gluon_dq={cfg.gluon_dq}"] if cfg.gluon_dq != base.gluon_dq else []
    for name in ("fwd", "dq", "dkdv"):
        got, ref = getattr(cfg, name), getattr(base, name)
        diffs += [
            f"{name}.{f.name}={getattr(got, f.name)}"
            for f in dataclasses.fields(got)
            if getattr(got, f.name) != getattr(ref, f.name)
        ]
    return "s2attn" + ("" if not diffs else " " + ",".join(diffs))


def load_baseline(path: str):
    """Import the s2attn package in folder ``path`` (its ``__init__.py`` inside) under the name
    ``s2attn_baseline``, next to this checkout's ``s2attn``; returns the module."""
    import importlib.util
    import os

    init = os.path.join(path, "__init__.py")
    if not os.path.isfile(init):
        raise SystemExit(f"--baseline {path}: no __init__.py there (give an s2attn package folder)")
    spec = importlib.util.spec_from_file_location(
        BASELINE_PACKAGE, init, submodule_search_locations=[path]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[BASELINE_PACKAGE] = mod
    spec.loader.exec_module(mod)
    return mod


def baseline_pattern(base, pattern: S2Pattern):
    """``pattern`` rebuilt with the baseline package's own S2Pattern class (same fields)."""
    fields = {f.name: getattr(pattern, f.name) for f in dataclasses.fields(pattern) if f.init}
    return base.S2Pattern(**fields)


def run_case(seq, args, d, block, rows, sweep, skipped=(), baseline=None):
    """Time the s2attn row (and ``--sweep`` configs) and ``rows`` (``ROWS`` keys that can run)
    at one shape, and with ``args.passes`` each Gluon pass alone; ``skipped``: ``[(row,
    reason)]`` recorded as skipped. Returns (records, density of the S2 pattern at ``seq``)."""
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
    torch.manual_seed(0)
    mk = lambda h: torch.randn(
        batch, seq, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True
    )
    q, k, v = mk(H), mk(Hkv), mk(Hkv)
    grad = torch.randn_like(q)
    res = []
    shape = dict(seq=seq, batch=batch, d=d, block=block)

    pending = []  # (row, name, pairs, forward, forward + backward), timed together at the end

    def record(row, name, pairs, f, fb):
        pending.append((row, name, pairs, f, fb))

    for row, reason in skipped:
        print(f"  {ROWS[row]}: skipped ({reason})", flush=True)

    base = kernel_config(pat, d, dev)
    configs = [base] + (sweep_configs(base, sweep, block) if sweep else [])
    baseline_rows = {}  # row -> the --baseline package's run of it, default config

    def with_baseline(row, p):
        if baseline is not None:
            bp = baseline_pattern(baseline, p)
            baseline_rows[row] = lambda: baseline.s2_attention(q, k, v, bp)

    for cfg in configs:
        run = lambda cfg=cfg: s2_attention(q, k, v, pat, kernel_config=cfg)
        pairs = row_pairs("s2attn", pat, seq, batch)
        record("s2attn", config_label(cfg, base), pairs, run, fwd_bwd(run, (q, k, v), grad))
    with_baseline("s2attn", pat)
    if "s2dense" in rows:
        dpat = dense_pattern(pat)
        # A filtered sweep is short enough to try its configs on the dense pattern too: the
        # base rate that every S2 speed-up multiplies.
        dense_configs = configs if isinstance(sweep, str) else [base]
        for cfg in dense_configs:
            run = lambda cfg=cfg: s2_attention(q, k, v, dpat, kernel_config=cfg)
            pairs = row_pairs("s2dense", pat, seq, batch)
            label = ROWS["s2dense"] + config_label(cfg, base).removeprefix("s2attn")
            record("s2dense", label, pairs, run, fwd_bwd(run, (q, k, v), grad))
        with_baseline("s2dense", dpat)
    for row, run in baseline_rows.items():
        name = "base " + ("s2attn" if row == "s2attn" else ROWS[row])
        pairs = row_pairs(row, pat, seq, batch)
        record("base-" + row, name, pairs, run, fwd_bwd(run, (q, k, v), grad))
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
        pairs = row_pairs(row, pat, seq, batch, lens)
        name = ROWS[row] + ("" if row == "varlen" else f" ({len(lens)} docs)")
        record(row, name, pairs, run, fwd_bwd(run, (q, k, v), grad.view(batch * seq, H, d)))
    flex_rows = [r for r in ("flex", "flex-fa4") if r in rows]
    if flex_rows:
        from torch.nn.attention.flex_attention import flex_attention

        _allow_flex_recompiles()
        flex = torch.compile(flex_attention, dynamic=False)
        bm = flex_block_mask(pat, seq, dev)
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        gt = grad.transpose(1, 2).contiguous()
        for row in flex_rows:
            # Both backends get the same BlockMask, so they attend exactly the same pairs.
            opts = {"BACKEND": "FLASH"} if row == "flex-fa4" else None
            run = lambda opts=opts: flex(
                qt, kt, vt, block_mask=bm, enable_gqa=Hkv != H, kernel_options=opts
            )
            pairs = row_pairs(row, pat, seq, batch)
            record(row, ROWS[row], pairs, run, fwd_bwd(run, (qt, kt, vt), gt))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qd, kd, vd = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    gd = grad.transpose(1, 2).contiguous()
    for row, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ):
        if row not in rows:
            continue

        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(
                    qd, kd, vd, is_causal=True, enable_gqa=Hkv != H
                )

        pairs = row_pairs(row, pat, seq, batch)
        record(row, ROWS[row], pairs, run, fwd_bwd(run, (qd, kd, vd), gd))
    if "fa4" in rows:
        from flash_attn.cute import flash_attn_func

        # FA4 takes our [batch, seq, heads, dim] layout and GQA as is; it returns (out, lse).
        run = lambda: flash_attn_func(q, k, v, causal=True)[0]
        pairs = row_pairs("fa4", pat, seq, batch)
        record("fa4", ROWS["fa4"], pairs, run, fwd_bwd(run, (q, k, v), grad))
    res += timed_records(pending, shape)
    if args.passes:
        why = passes_unsupported(block, dev)
        if why:
            print(f"  passes: skipped ({why})")
        else:
            for r in time_passes(pat, q, k, v, grad, baseline):
                res.append(dict(row="pass", name=f"{r['kernel']} {r['pass_name']}", **shape, **r))
    # Skipped rows close the case's table lines, so the timed ones keep their usual order.
    res += [dict(row=row, name=ROWS[row], **shape, skipped=why) for row, why in skipped]
    return res, pat.density(seq)


def passes_unsupported(block: int, device) -> Optional[str]:
    """Why ``--passes`` cannot time the Gluon passes one by one here, or None: they run on
    sm_90 at the blocks of ``GLUON_BWD_BLOCKS`` (16 and 32 on gathered key tiles)."""
    if block not in GLUON_BWD_BLOCKS:
        return f"block {block}: the Gluon passes take blocks {GLUON_BWD_BLOCKS}"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "the Gluon passes run on sm_90 only"
    return None


def pass_calls(package: str, pat, q, k, v, do) -> list:
    """``[(name, call)]``: the forward, dQ and dK/dV Gluon passes of ``package`` (``s2attn``
    or the ``--baseline`` copy; ``pat`` its own S2Pattern) on ``q [b, s, hq, d]``, ``k, v
    [b, s, hkv, d]`` and upstream ``do`` like q, with their layouts built once beforehand and
    the backward's inputs (out, LSE, delta) from one run of the passes before them. Blocks 16
    and 32 run on the gathered key tiles, whose dK/dV pass leaves per-query-head gradients
    (the group sum after it is not timed)."""
    gf, gq, gd, lay, gk = (
        importlib.import_module(f"{package}.{m}")
        for m in ("gluon_forward", "gluon_dq", "gluon_dkdv", "layout", "gathered_keys")
    )
    seq, dev, scale = q.shape[1], q.device, q.shape[-1] ** -0.5
    if pat.block_size in gk.BLOCK_SIZES:  # the passes build the gathered tiles' layouts
        tiles = dict.fromkeys(("fwd", "dq", "dkdv"), dict(keys=gk.gathered_keys(pat, seq, dev)))
    else:
        # The forward's key tile (before key_tile existed, a copy's was the pattern's block).
        bn = getattr(gf, "key_tile", lambda block, d: block)(pat.block_size, q.shape[-1])
        # The forward's query tile (a baseline copy from before forward_tile_m: TILE_M).
        fwd_tile = getattr(gf, "forward_tile_m", lambda block, d: gf.TILE_M)(
            pat.block_size, q.shape[-1]
        )
        dq_tile = getattr(gq, "tile_m", lambda block, d: gq.TILE_M)(pat.block_size, q.shape[-1])
        tiles = {
            "fwd": dict(lay=lay.layout_for(pat, seq, seq, 0, 0, fwd_tile, bn, dev)),
            "dq": dict(lay=lay.layout_for(pat, seq, seq, 0, 0, dq_tile, gd.BLOCK_N, dev)),
            "dkdv": dict(
                lay=lay.layout_for(pat, seq, seq, 0, 0, gd.TILE_M, gd.BLOCK_N, dev, with_csc=True)
            ),
        }
    out, lse = gf.s2_forward_gluon(q, k, v, pat, scale, **tiles["fwd"])
    _, delta = gq.s2_dq_gluon(do, None, q, k, v, out, lse, pat, scale, **tiles["dq"])
    return [
        ("fwd", lambda: gf.s2_forward_gluon(q, k, v, pat, scale, **tiles["fwd"])),
        ("dq", lambda: gq.s2_dq_gluon(do, None, q, k, v, out, lse, pat, scale, **tiles["dq"])),
        ("dkdv", lambda: gd.s2_dkdv_gluon(do, q, k, v, lse, delta, pat, scale, **tiles["dkdv"])),
    ]


def time_passes(pat, q, k, v, do, baseline=None) -> list[dict]:
    """Time :func:`pass_calls` of s2attn (and of ``baseline``, a package module) round by
    round; print and return one record per package and pass: ``ms`` and ``tflops``, the
    pass's own matrix products (``PASS_PRODUCTS``) over the attended pairs."""
    q, k, v, do = (x.detach() for x in (q, k, v, do))
    packages = [("s2attn", "s2attn", pat)]
    if baseline is not None:
        packages.append(("base s2attn", baseline.__name__, baseline_pattern(baseline, pat)))
    calls = [(label, *c) for label, pkg, p in packages for c in pass_calls(pkg, p, q, k, v, do)]
    with PowerSampler(nvidia_smi_id()) as power:
        ms = time_rows([c[2] for c in calls])
    peak = pass_peak(power.summary(), q.device)
    flops_per_product = 2 * q.shape[-1] * pat.attended_pairs(q.shape[1]) * q.shape[0]
    recs = [
        dict(
            kernel=label,
            pass_name=name,
            ms=t,
            tflops=PASS_PRODUCTS[name] * flops_per_product / t / 1e9,
            peak_tflops=peak,
        )
        for (label, name, _), t in zip(calls, ms)
    ]
    if peak is not None:
        print(f"  passes: tensor-core peak at the median SM clock {peak:.0f} TF/s", flush=True)
    for label, _, _ in packages:
        cells = [pass_cell(r) for r in recs if r["kernel"] == label]
        print(f"  passes, {label:<11} " + " | ".join(cells), flush=True)
    return recs


def pass_peak(power: Optional[dict], device) -> Optional[float]:
    """The tensor cores' peak (TF/s) at the median SM clock ``power`` (a
    :class:`PowerSampler` summary) saw on ``device``; None without samples or a known rate."""
    if power is None or torch.device(device).type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return tensor_peak_tflops(
        power["sm_mhz_median"], props.multi_processor_count, (props.major, props.minor)
    )


def pass_cell(rec: dict) -> str:
    """One pass's time and rate, and its share of the clock's peak where known."""
    cell = f"{rec['pass_name']} {rec['ms']:7.2f} ms {rec['tflops']:4.0f} TF/s"
    if rec.get("peak_tflops"):
        cell += f" ({100 * rec['tflops'] / rec['peak_tflops']:.0f}% of peak)"
    return cell


def timed_records(pending, shape: dict) -> list[dict]:
    """Time ``pending`` rows ``(row, name, pairs, forward, forward + backward)`` of one case
    together (:func:`time_rows`: the forwards round by round, then the forward + backward
    calls) and return their records in the same order, printed; a row whose first call fails
    (a baseline that cannot run at this size) is reported and recorded with its error, and the
    others are timed without it."""
    res, ok = [None] * len(pending), []
    for i, (row, name, _, f, fb) in enumerate(pending):
        try:
            f()
            fb()
        except Exception as exc:  # a baseline that cannot run at this size is reported, not fatal
            print(f"  {name}: failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
            res[i] = dict(row=row, name=name, **shape, error=str(exc)[:300])
            continue
        ok.append(i)
    with PowerSampler(nvidia_smi_id()) as power:
        fwd_ms = time_rows([pending[i][3] for i in ok])
        both_ms = time_rows([pending[i][4] for i in ok])
    gpu_power = power.summary()
    print(f"  {describe_power(gpu_power)}", flush=True)
    d = shape["d"]
    for i, ms_f, ms_fb in zip(ok, fwd_ms, both_ms):
        row, name, pairs, _, _ = pending[i]
        r = dict(
            row=row,
            name=name,
            **shape,
            pairs=pairs,
            fwd_ms=ms_f,
            fwdbwd_ms=ms_fb,
            fwd_tflops=tflops(pairs, d, ms_f, False),
            fwdbwd_tflops=tflops(pairs, d, ms_fb, True),
            gpu_power=gpu_power,
        )
        res[i] = r
        print(
            f"  {name:<18} fwd {ms_f:8.2f} ms {r['fwd_tflops']:6.0f} TF/s | "
            f"fwd+bwd {ms_fb:8.2f} ms {r['fwdbwd_tflops']:6.0f} TF/s",
            flush=True,
        )
    return res


def best_dense(records, rate: str = "fwdbwd_tflops") -> Optional[dict]:
    """The record of the fastest dense baseline (``DENSE_BASELINES``) by ``rate`` (a key of
    ``RATES``) among ``records`` of one case that ran; None when none ran."""
    timed = [r for r in records if r.get("row") in DENSE_BASELINES and rate in r]
    return max(timed, key=lambda r: r[rate], default=None)


def fraction_of_best_dense(record: dict, records, rate: str = "fwdbwd_tflops") -> Optional[float]:
    """``record``'s ``rate`` over the best dense baseline's in the same case (1.0 = as fast
    per attended pair); None when either did not run."""
    best = best_dense(records, rate)
    if best is None or rate not in record:
        return None
    return record[rate] / best[rate]


def _pct(x: Optional[float]) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


def case_footer(seq: int, batch: int, d: int, block: int, records) -> list:
    """Lines that say how our rows compare with the best dense kernel of one case."""
    head = f"seq {seq} x {batch}, d {d}, block {block}:"
    bests = {rate: best_dense(records, rate) for rate in RATES}
    if bests["fwdbwd_tflops"] is None:
        return [f"{head} no dense baseline ran, no fraction"]
    lines = [
        f"{head} best dense fwd+bwd {bests['fwdbwd_tflops']['name']} "
        f"{bests['fwdbwd_tflops']['fwdbwd_tflops']:.0f} TF/s, fwd "
        f"{bests['fwd_tflops']['name']} {bests['fwd_tflops']['fwd_tflops']:.0f} TF/s"
    ]
    best_fb = bests["fwdbwd_tflops"]["fwdbwd_tflops"]
    for r in records:
        if r.get("row") not in OUR_ROWS or "fwdbwd_tflops" not in r:
            continue
        fb = fraction_of_best_dense(r, records, "fwdbwd_tflops")
        f = fraction_of_best_dense(r, records, "fwd_tflops")
        # Per product run: ours run OUR_PRODUCTS where the dense kernels run the credited ones.
        run = r["fwdbwd_tflops"] * OUR_PRODUCTS / CREDITED_PRODUCTS
        lines.append(
            f"  {r['name']}: fwd+bwd {r['fwdbwd_tflops']:.0f} TF/s = {_pct(fb)} of best dense, "
            f"fwd {r['fwd_tflops']:.0f} TF/s = {_pct(f)}; per product run ({OUR_PRODUCTS} "
            f"against {CREDITED_PRODUCTS:g}) {run:.0f} TF/s = {_pct(run / best_fb)}"
        )
    return lines


def summarize(results) -> str:
    """Markdown table of every case (``{(seq, d, block, density): records}``): times, rates,
    s2attn's speed-up over each row (fwd+bwd time) and each row's fwd+bwd rate as a fraction
    of the best dense baseline of its case; then one footer block per case."""
    lines = [
        "| seq x batch | d | block | density | kernel | fwd ms | fwd TF/s | fwd+bwd ms "
        "| fwd+bwd TF/s | s2attn speedup (fwd+bwd) | of best dense (fwd+bwd TF/s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    footer = []
    for (seq, d, block, dens), rs in results.items():
        rs = [r for r in rs if r.get("row") != "pass"]  # --passes: printed as they ran
        ours = next((r for r in rs if r["name"] == "s2attn" and "fwdbwd_ms" in r), None)
        for r in rs:
            row = f"| {seq} x {r['batch']} | {d} | {block} | {dens:.3f} | {r['name']} |"
            if "skipped" in r:
                lines.append(f"{row} skipped | | | | | |")
                continue
            if "fwdbwd_ms" not in r:
                lines.append(f"{row} failed | | | | | |")
                continue
            sp = "" if ours is None or r is ours else f"{r['fwdbwd_ms'] / ours['fwdbwd_ms']:.2f}x"
            frac = _pct(fraction_of_best_dense(r, rs))
            lines.append(
                f"{row} {r['fwd_ms']:.2f} | {r['fwd_tflops']:.0f} | "
                f"{r['fwdbwd_ms']:.2f} | {r['fwdbwd_tflops']:.0f} | {sp} | {frac} |"
            )
        batch = rs[0]["batch"] if rs else 1
        footer += case_footer(seq, batch, d, block, rs)
    skipped = sorted(
        {(r["name"], r["skipped"]) for rs in results.values() for r in rs if "skipped" in r}
    )
    notes = [f"skipped {name}: {why}" for name, why in skipped]
    return "\n".join(lines + [""] + footer + ([""] + notes if notes else []))


def json_document(results: dict, table: str, device: str) -> dict:
    """What ``--json`` writes (tools/docs_tables.py makes docs/benchmarks.md's tables from it):
    ``device`` (the GPU's name), ``date`` (today, ISO), ``torch`` (its version), ``argv`` (this
    command as run), ``results`` (every record of ``results``, ``{(seq, d, block, density):
    records}``, case by case: a timed row's keys are :func:`timed_records`', a skipped row has
    ``skipped``, a failed one ``error``, a ``--passes`` record ``row="pass"``) and ``table``
    (the markdown :func:`summarize` printed)."""
    return {
        "device": device,
        "date": str(datetime.date.today()),
        "torch": torch.__version__,
        "argv": sys.argv,
        "results": [r for rs in results.values() for r in rs],
        "table": table,
    }


def build_cases(args, rows: list) -> list:
    """(seq, head_dim, block, rows, sweep) per case: ``--seqs`` at the given shape, plus with
    ``--extra`` head_dim 64 and block 16 at 32k, each with its dense baselines and FA4 rows so
    that its fraction of the best dense rate is measured at its own head dim."""
    sweep = args.sweep_match or args.sweep
    cases = [(s, args.head_dim, args.block_size, list(rows), sweep) for s in args.seqs]
    if args.extra:
        cases += [
            (32768, 64, args.block_size, ["s2dense", "flex", "flex-fa4", "cudnn", "fa4"], False),
            (32768, args.head_dim, 16, ["flex", "flex-fa4", "cudnn", "fa4"], False),
        ]
    return cases


def build_arg_parser() -> argparse.ArgumentParser:
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
        default=DEFAULT_ROWS,
        help=f"rows besides s2attn, comma list of {', '.join(ROWS)} (default {DEFAULT_ROWS})",
    )
    ap.add_argument(
        "--extra",
        action="store_true",
        help="also run head_dim 64 and block 16 cases at 32k (s2attn, flex, dense baselines)",
    )
    ap.add_argument("--sweep", action="store_true", help="also time alternative kernel configs")
    ap.add_argument(
        "--sweep-match",
        default=None,
        metavar="TEXT",
        help="only the sweep configs whose label contains TEXT (e.g. bn=128), also on the "
        "s2dense row",
    )
    ap.add_argument(
        "--baseline",
        default=None,
        metavar="DIR",
        help="another copy of the s2attn package (e.g. `git archive COMMIT kernels`) timed in "
        "the same run as rows 'base s2attn' / 'base s2attn dense (V=1)'",
    )
    ap.add_argument(
        "--passes",
        action="store_true",
        help="also time each Gluon pass (forward, dQ, dK/dV) alone, rated by its own matrix "
        "products (sm_90, blocks 16, 32, 64 and 128)",
    )
    ap.add_argument("--json", default=None, help="write raw results here")
    ap.add_argument(
        "--list-rows",
        action="store_true",
        help="print which of --rows this machine can run (and why not), then exit; no GPU needed",
    )
    return ap


def main(argv=None):
    ap = build_arg_parser()
    args = ap.parse_args(argv)
    try:
        rows = parse_rows(args.rows)
    except ValueError as exc:
        ap.error(str(exc))
    cases = build_cases(args, rows)
    unavailable = unavailable_rows({r for c in cases for r in c[3]})
    if args.list_rows:
        for r in rows:
            state = f"skipped: {unavailable[r]}" if r in unavailable else "available"
            print(f"{r:<13} {ROWS[r]:<20} {state}")
        return
    if not torch.cuda.is_available():
        sys.exit("tools/benchmark.py needs a CUDA GPU")
    print(
        f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | "
        f"{datetime.date.today()} | heads {args.heads}/{args.kv_heads or args.heads} "
        f"L={args.local_blocks} V={args.vert_stride} tokens={args.tokens}",
        flush=True,
    )
    baseline = load_baseline(args.baseline) if args.baseline else None
    results = {}
    for seq, d, block, rws, sw in cases:
        print(f"seq {seq} d {d} block {block}", flush=True)
        run, skipped = plan_rows(rws, unavailable)
        rs, dens = run_case(seq, args, d, block, run, sw, skipped, baseline)
        results[(seq, d, block, dens)] = rs
        torch.cuda.empty_cache()
    table = summarize(results)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(json_document(results, table, torch.cuda.get_device_name()), f, indent=1)


if __name__ == "__main__":
    main()
