#!/usr/bin/env python
"""Nsight Compute profile of one S2 attention forward + backward next to cuDNN's dense one (GPU).

    tools/profile_kernels.py run  [--seq 32768] [--cases s2,s2dense,cudnn] [--out DIR]
    tools/profile_kernels.py table DIR/ncu.csv

``run`` starts ``ncu`` on this script's ``--target`` mode, which compiles and warms every case
first and then calls each once inside a CUDA profiler range (``--profile-from-start off``), so
only those kernels are measured. ``ncu`` collects the SpeedOfLight, Occupancy, LaunchStats and
WarpStateStats sections (``--page raw --csv``); ``table`` turns that CSV into one markdown row
per kernel: time, SM and memory throughput (% of peak; L2 and DRAM apart), tensor-pipe activity
where the GPU reports it, occupancy, registers, shared memory, and the three largest warp-stall
reasons (in cycles per issued instruction). Issue 13's question, "which of fwd / dQ / dK-dV is
furthest from the roofline, and why", is read off that table.

Shapes as in ``tools/benchmark.py``: bf16, ``--tokens`` (batch x seq) 131072, 32 heads,
head_dim 128, block 64, local 16, stride 8; ``s2dense`` is s2attn on the dense causal pattern
(``vert_stride=1``), ``cudnn`` SDPA's cuDNN backend on the dense causal problem.
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import re
import shutil
import subprocess
import sys

CASES = ("s2", "s2dense", "cudnn")
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats")
# Warp-stall metrics of the WarpStateStats section: cycles a warp spends stalled for this reason
# per issued instruction.
STALL = re.compile(r"^smsp__average_warps?_issue_stalled_(.+)_per_issue_active\.ratio$")
# Tensor-pipe activity, wgmma (Hopper) or mma.sync: in none of SECTIONS, so asked for by name.
TENSOR_PIPE = (
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
)
# L2 and DRAM throughput, to tell a kernel limited by its tile loads (L2 -> SM) from one limited by
# its own instructions: the SpeedOfLight section reports only their maximum ("memory %").
MEMORY_UNITS = (
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
)
# Columns of the table: (header, metric names to try in order, format).
COLUMNS = (
    ("time ms", ("gpu__time_duration.sum",), "ms"),
    ("SM %", ("sm__throughput.avg.pct_of_peak_sustained_elapsed",), "pct"),
    ("memory %", ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",), "pct"),
    ("L2 %", MEMORY_UNITS[:1], "pct"),
    ("DRAM %", MEMORY_UNITS[1:], "pct"),
    ("tensor pipe %", TENSOR_PIPE, "pct"),
    ("occupancy %", ("sm__warps_active.avg.pct_of_peak_sustained_active",), "pct"),
    ("regs", ("launch__registers_per_thread",), "int"),
    (
        "shared KB",
        ("launch__shared_mem_per_block_dynamic", "launch__shared_mem_per_block_static"),
        "kb",
    ),
    ("grid", ("launch__grid_size",), "int"),
)


def _cases(names: str) -> list:
    cases = [c.strip() for c in names.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        raise SystemExit(f"--cases: choose from {','.join(CASES)}, got {names!r}")
    return cases


# ---- the profiled program (runs under ncu) ---------------------------------------------------
def target(args) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from s2attn import S2Pattern, s2_attention

    dev = torch.device("cuda")
    b = max(1, args.tokens // args.seq)
    h, d = args.heads, args.head_dim
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=gen)

    q, k, v, do = (rand(b, args.seq, h, d) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(True)
    stride = {"s2": args.vert_stride, "s2dense": 1}

    def call(case):
        if case == "cudnn":
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            out.backward(do.transpose(1, 2))
        else:
            pattern = S2Pattern(
                num_heads=h,
                block_size=args.block_size,
                local_blocks=args.local_blocks,
                vert_stride=stride[case],
            )
            s2_attention(q, k, v, pattern).backward(do)

    cases = _cases(args.cases)
    for case in cases:  # compile, autotune caches, layouts: nothing of this is profiled
        call(case)
        call(case)
    torch.cuda.synchronize()
    for case in cases:
        torch.cuda.profiler.start()
        call(case)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


# ---- running ncu and reading its CSV ---------------------------------------------------------
def run(args, passthrough: list) -> int:
    found = glob.glob("/usr/local/cuda/bin/ncu") + sorted(
        glob.glob("/opt/nvidia/nsight-compute/*/ncu")
    )
    ncu = shutil.which("ncu") or (found[-1] if found else None)
    if ncu is None:
        print("profile_kernels: ncu (Nsight Compute) not found", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, f"ncu-{args.seq}.csv")
    cmd = [ncu, "--profile-from-start", "off", "--page", "raw", "--csv"]
    for section in SECTIONS:
        cmd += ["--section", section]
    # Without naming them the tensor-pipe column stayed empty (H100, 2026-11-25).
    cmd += ["--metrics", ",".join(TENSOR_PIPE + MEMORY_UNITS)]
    cmd += ["--log-file", csv_path, sys.executable, os.path.abspath(__file__), "--target"]
    cmd += passthrough
    print("$ " + " ".join(cmd), flush=True)
    code = subprocess.call(cmd)
    if code == 0:
        print(table(csv_path))
    return code


def read_ncu_csv(path: str) -> list[dict]:
    """Rows of an ``ncu --page raw --csv`` log: one dict per kernel launch, metric -> text.

    ncu writes its own progress lines (``==PROF==``) before the CSV; the CSV's first row is the
    header, then a row of units (its ``ID`` cell empty), then one row per launch."""
    with open(path, newline="") as f:
        lines = [ln for ln in f if not ln.startswith("==")]
    rows = list(csv.reader(lines))
    if not rows:
        return []
    header, body = rows[0], rows[1:]
    units = [""] * len(header)
    if body and body[0] and body[0][0] == "":
        units, body = body[0], body[1:]
    out = []
    for row in body:
        if len(row) != len(header):
            continue
        rec = dict(zip(header, row))
        rec["_units"] = dict(zip(header, units))
        out.append(rec)
    return out


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def _value(rec: dict, names: tuple, kind: str) -> str:
    for name in names:
        x = _number(rec.get(name, ""))
        if x is None:
            continue
        unit = rec["_units"].get(name, "")
        if kind == "ms":
            scale = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}
            return f"{x * scale.get(unit, 1e-6):.2f}"
        if kind == "kb":
            scale = {"byte": 1 / 1024, "Kbyte": 1.0, "Mbyte": 1024.0}
            return f"{x * scale.get(unit, 1 / 1024):.0f}"
        if kind == "int":
            return f"{x:.0f}"
        return f"{x:.1f}"
    return "-"


def stalls(rec: dict, top: int = 3) -> str:
    """The ``top`` largest warp-stall reasons of a kernel, e.g. ``long_scoreboard 4.1``."""
    found = []
    for name, text in rec.items():
        m = STALL.match(name) if isinstance(name, str) else None
        x = _number(text) if m else None
        if m and x is not None and not m.group(1).endswith("_not_issued"):
            found.append((x, m.group(1)))
    found.sort(reverse=True)
    return ", ".join(f"{reason} {x:.1f}" for x, reason in found[:top]) or "-"


def _short_name(name: str) -> str:
    # Triton kernels keep their Python names; library kernels get mangled C++ names.
    name = re.sub(r"\(.*$", "", name)
    return name if len(name) <= 48 else name[:45] + "..."


def table(path: str) -> str:
    """Markdown table of an ncu CSV log (one row per kernel launch, in launch order)."""
    recs = read_ncu_csv(path)
    if not recs:
        return f"(no kernels in {path})"
    head = ["kernel", *(c[0] for c in COLUMNS), "top stalls (cycles/instruction)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rec in recs:
        name = _short_name(rec.get("Kernel Name", rec.get("Function Name", "?")))
        cells = [name, *(_value(rec, names, kind) for _, names, kind in COLUMNS), stalls(rec)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", nargs="?", choices=("run", "table"), default="run")
    ap.add_argument("csv", nargs="?", help="table: the ncu CSV log")
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=131072, help="batch x seq")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--local-blocks", type=int, default=16)
    ap.add_argument("--vert-stride", type=int, default=8)
    ap.add_argument("--cases", default=",".join(CASES), help=f"subset of {','.join(CASES)}")
    ap.add_argument("--out", default=os.environ.get("OUT", "profile"), help="run: output folder")
    args = ap.parse_args(argv)
    if args.target:
        target(args)
        return 0
    if args.mode == "table":
        if not args.csv:
            ap.error("table needs the CSV path")
        print(table(args.csv))
        return 0
    _cases(args.cases)
    shape = [a for a in argv if a not in ("run",)]
    drop = {"--out"}
    passthrough, skip = [], False
    for a in shape:
        if skip:
            skip = False
            continue
        if a in drop:
            skip = True
            continue
        if a.startswith("--out="):
            continue
        passthrough.append(a)
    return run(args, passthrough)


if __name__ == "__main__":
    sys.exit(main())
