#!/usr/bin/env python
"""Tables of ``tools/scale_check.py``'s JSON (markdown, for docs/benchmarks.md) and an estimate
for 8 and 16 GPUs from its measured compute and communication.

    python tools/scale_tables.py docs/benchmarks/results/DATE-DEVICE/scale.json
    python tools/scale_tables.py scale.json --tables estimate --inter-node-gbps 25

Tables (``--tables``, default all): ``speed`` (one row per run: tokens/s and model TFLOP/s per
GPU, the ratio to the dense twin in the same layout and length, peak memory per GPU over the
ranks, the profiled step's attention and NCCL shares of the GPU kernel time; then issue 54's
goal per layout at 128k: all-S2 >= 2.5x and DS >= 1.5x the dense twin, memory under 120 GB),
``equivalence``
(each layout's largest per-step loss difference to TP2 x CP2's, the resume at TP4), ``te`` (the
Transformer Engine spec against the local one) and ``estimate``.

**The estimate is a model, not a measurement.** For each measured run (TP x CP = 4 GPUs, DP 1):
step time ``T = seq / tokens_per_s``, communication ``T_comm = c x T`` with ``c`` the profiled
step's NCCL share of the GPU kernel time (mean over the ranks; NCCL kernels that overlap compute
make this an upper bound), compute ``T - T_comm``, both per GPU constant when the same layout is
replicated by data parallelism (the same micro-batch, the same TP/CP messages inside a node).
Added: the gradient reduce-scatter (fp32, 4 bytes a parameter) and parameter all-gather (bf16, 2
bytes) of the distributed optimizer over the data x context parallel group, as a ring:
``(n - 1) / n x 6 B x params / TP / bandwidth``, counted without overlap (the trainer overlaps
the reduce-scatter with the backward, so this is pessimistic), minus the same term at DP 1
(``n`` = CP, already in the measurement, at the intra-node bandwidth). Scenarios: 8 GPUs in one
node (DP 2, ``--intra-node-gbps``, default 360 GB/s: NCCL's bus bandwidth on H200 NVLink), 8
GPUs as two nodes of four (DP 2 across the nodes, ``--inter-node-gbps`` per GPU, default 50 GB/s:
one 400 Gb/s NIC per GPU) and 16 GPUs as two nodes of eight (DP 4 across the nodes). The ring
runs at the slowest link's bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

MODEL_ORDER = ("ds", "s2", "dense")
LABELS = {"ds": "DS hybrid", "s2": "all-S2", "dense": "dense"}
INTRA_NODE_GBPS = 360.0
INTER_NODE_GBPS = 50.0
# Bytes per parameter the distributed optimizer moves per step: fp32 gradients reduce-scattered,
# bf16 parameters all-gathered.
DP_BYTES_PER_PARAM = 4 + 2
TABLES = ("speed", "equivalence", "te", "estimate")


def _fmt(x, spec: str = "{:,.0f}") -> str:
    return "" if x is None else spec.format(x)


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


def _why(run: dict) -> str:
    """Why a run failed: the trainer's own error line when the log had one, else the exit."""
    return run.get("error_detail") or run.get("error") or "no result"


def _ok(run: dict) -> bool:
    return "error" not in run and run.get("median_tokens_per_s") is not None


def speed_runs(doc: dict) -> list:
    """The speed part's finished and failed runs, by length, layout and model."""
    runs = [r for r in doc.get("runs", []) if r.get("part") == "speed"]
    order = {m: i for i, m in enumerate(MODEL_ORDER)}
    return sorted(
        runs, key=lambda r: (r.get("seq", 0), r.get("layout", ""), order.get(r.get("model"), 9))
    )


def format_speed(doc: dict) -> str:
    """One row per speed run; the last column is the ratio of its tokens/s per GPU to the dense
    twin's at the same length and layout."""
    lines = [
        "| seq | layout | recompute | model | tokens/s per GPU | vs dense | model TFLOP/s per "
        "GPU | peak memory per GPU (GiB, max over ranks) | attention share | NCCL share | "
        "steps measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    runs = speed_runs(doc)
    dense = {
        (r["seq"], r["layout"]): r["tokens_per_s_per_gpu"]
        for r in runs
        if r.get("model") == "dense" and _ok(r)
    }
    failed = []
    for r in runs:
        seq, layout, model = r.get("seq"), r.get("layout"), r.get("model")
        if not _ok(r):
            failed.append(f"{r['name']}: {_why(r)}")
            lines.append(
                f"| {seq} | {layout} | {r.get('recompute', '')} | {LABELS.get(model, model)} | "
                f"failed | | | | | | |"
            )
            continue
        base = dense.get((seq, layout))
        ratio = f"{r['tokens_per_s_per_gpu'] / base:.2f}x" if base else ""
        prof = r.get("profile") or {}
        share = prof.get("share") or {}
        mem = r.get("peak_mem_gib_max_rank") or r.get("peak_mem_gib")
        label = LABELS.get(model, model)
        if model == "dense" and r.get("dense_attention"):
            label += f" ({str(r['dense_attention']).split(' ')[0]})"  # fa4 or cudnn
        lines.append(
            f"| {seq} | {layout} | {r.get('recompute', '')} | {label} | "
            f"{_fmt(r['tokens_per_s_per_gpu'])} | {ratio} | "
            f"{_fmt(r.get('median_tflops_per_gpu'))} | {_fmt(mem, '{:.1f}')} | "
            f"{_pct(share.get('attention'))} | {_pct(share.get('communication'))} | "
            f"{r.get('measured_steps', '')} |"
        )
    return "\n".join(lines + ([""] + [f"- failed: {f}" for f in failed] if failed else []))


# Issue 54's goal at 128k: all-S2 and the DS hybrid against the dense twin's tokens/s per GPU,
# and memory per GPU under 120 GB (GB = 1e9 bytes; the tables show GiB).
GOAL_SEQ = 131072
GOAL_RATIOS = {"s2": 2.5, "ds": 1.5}
GOAL_MEMORY_GIB = 120e9 / 2**30


def goal(doc: dict) -> list:
    """Issue 54's goal per layout at 128k: ``{"layout", "ratios": {model: x or None},
    "ratio_ok": {model: bool or None}, "max_mem_gib", "mem_ok"}`` (None where a run is
    missing or failed)."""
    runs = [r for r in speed_runs(doc) if r.get("seq") == GOAL_SEQ]
    out = []
    for layout in dict.fromkeys(r["layout"] for r in runs):
        by = {r["model"]: r for r in runs if r["layout"] == layout and _ok(r)}
        dense = by.get("dense")
        ratios = {
            m: (by[m]["tokens_per_s_per_gpu"] / dense["tokens_per_s_per_gpu"])
            if m in by and dense
            else None
            for m in GOAL_RATIOS
        }
        mems = [r.get("peak_mem_gib_max_rank") or r.get("peak_mem_gib") for r in by.values()]
        mems = [m for m in mems if m is not None]
        out.append(
            {
                "layout": layout,
                "ratios": ratios,
                "ratio_ok": {
                    m: (x >= GOAL_RATIOS[m]) if x is not None else None for m, x in ratios.items()
                },
                "max_mem_gib": max(mems) if mems else None,
                "mem_ok": (max(mems) < GOAL_MEMORY_GIB) if mems else None,
            }
        )
    return out


def format_goal(doc: dict) -> str:
    """:func:`goal` as a table, one row per layout at 128k."""
    rows = goal(doc)
    if not rows:
        return "Goal: no 128k speed run yet."

    def mark(ok) -> str:
        return "" if ok is None else (" (met)" if ok else " (not met)")

    lines = [
        "| layout | all-S2 / dense (goal 2.5x) | DS / dense (goal 1.5x) | largest memory per GPU, "
        f"GiB (goal < {GOAL_MEMORY_GIB:.1f} GiB = 120 GB) |",
        "|---|---|---|---|",
    ]
    for g in rows:
        r, ok = g["ratios"], g["ratio_ok"]
        lines.append(
            f"| {g['layout']} | {_fmt(r['s2'], '{:.2f}x')}{mark(ok['s2'])} | "
            f"{_fmt(r['ds'], '{:.2f}x')}{mark(ok['ds'])} | "
            f"{_fmt(g['max_mem_gib'], '{:.1f}')}{mark(g['mem_ok'])} |"
        )
    return "\n".join(lines)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def equivalence_summary(doc: dict) -> dict:
    """The equivalence and resume verdicts of ``doc``.

    ``layouts``: per equivalence run other than the reference, ``max_rel_loss_diff`` over the
    iterations both logged and ``passed`` (<= ``equivalence_rtol``), or ``error``.
    ``resume``: the resumed run's first iteration, its loss and learning rate against the
    reference's at that iteration, ``passed`` (loss within ``equivalence_rtol``, lr within
    ``lr_rtol``), the later iterations' loss differences (recorded only: the optimizer state
    restarts at a changed layout), or ``error``. Missing runs give empty entries."""
    runs = {r["name"]: r for r in doc.get("runs", [])}
    rtol, lr_rtol = doc.get("equivalence_rtol", 2e-2), doc.get("lr_rtol", 1e-6)
    ref_layout = doc.get("equivalence_reference", "tp2cp2")
    eq = [r for r in runs.values() if r.get("part") == "equivalence" and "-init-" not in r["name"]]
    ref = next((r for r in eq if r.get("layout") == ref_layout), None)
    out = {"reference": ref["name"] if ref else None, "rtol": rtol, "layouts": {}, "resume": {}}
    if ref is None or "error" in ref:
        if ref is not None:
            out["error"] = f"reference {ref['name']}: {_why(ref)}"
        return out
    ref_losses, ref_lrs = ref.get("losses", {}), ref.get("lrs", {})
    for r in eq:
        if r is ref:
            continue
        if "error" in r:
            out["layouts"][r["layout"]] = {"error": _why(r), "passed": False}
            continue
        common = sorted(set(r.get("losses", {})) & set(ref_losses), key=int)
        diffs = [_rel(r["losses"][i], ref_losses[i]) for i in common]
        worst = max(diffs) if diffs else None
        out["layouts"][r["layout"]] = {
            "iterations": len(common),
            "max_rel_loss_diff": worst,
            "passed": bool(diffs) and worst <= rtol,
        }
    resume = next((r for r in runs.values() if r.get("part") == "resume"), None)
    if resume is not None:
        if "error" in resume:
            out["resume"] = {"name": resume["name"], "error": _why(resume), "passed": False}
        else:
            its = sorted(resume.get("losses", {}), key=int)
            first = its[0] if its else None
            if first is None or first not in ref_losses:
                out["resume"] = {"name": resume["name"], "passed": False, "error": "no step"}
            else:
                loss_d = _rel(resume["losses"][first], ref_losses[first])
                lr_d = _rel(resume["lrs"][first], ref_lrs[first])
                out["resume"] = {
                    "name": resume["name"],
                    "layout": resume.get("layout"),
                    "first_iteration": int(first),
                    "loss": resume["losses"][first],
                    "reference_loss": ref_losses[first],
                    "lr": resume["lrs"][first],
                    "reference_lr": ref_lrs[first],
                    "rel_loss_diff": loss_d,
                    "rel_lr_diff": lr_d,
                    "later_rel_loss_diffs": [
                        _rel(resume["losses"][i], ref_losses[i]) for i in its[1:] if i in ref_losses
                    ],
                    "passed": loss_d <= rtol and lr_d <= lr_rtol,
                }
    return out


def format_equivalence(doc: dict) -> str:
    """The equivalence verdicts as a table, then the resume line."""
    s = equivalence_summary(doc)
    if s.get("reference") is None:
        return "equivalence: not run"
    if "error" in s:
        return f"equivalence: {s['error']}"
    lines = [
        f"Against {s['reference']} (tolerance: relative {s['rtol']:g} per step):",
        "",
        "| layout | steps compared | max relative loss difference | result |",
        "|---|---|---|---|",
    ]
    for layout, v in s["layouts"].items():
        if "error" in v:
            lines.append(f"| {layout} | | failed: {v['error'][:120]} | FAIL |")
            continue
        lines.append(
            f"| {layout} | {v['iterations']} | {_fmt(v['max_rel_loss_diff'], '{:.1e}')} | "
            f"{'PASS' if v['passed'] else 'FAIL'} |"
        )
    r = s["resume"]
    if r:
        lines.append("")
        if "error" in r:
            lines.append(f"Resume ({r['name']}): FAIL, {r['error']}")
        else:
            lines.append(
                f"Resume at {r['layout']} from {s['reference']}'s checkpoint: iteration "
                f"{r['first_iteration']} loss {r['loss']:.5f} vs {r['reference_loss']:.5f} "
                f"(relative {r['rel_loss_diff']:.1e}), lr {r['lr']:.4e} vs "
                f"{r['reference_lr']:.4e} (relative {r['rel_lr_diff']:.1e}): "
                f"{'PASS' if r['passed'] else 'FAIL'}; later steps (fresh optimizer state) "
                f"differ by up to "
                f"{_fmt(max(r['later_rel_loss_diffs'], default=None), '{:.1e}')}"
            )
    return "\n".join(lines)


def format_te(doc: dict) -> str:
    """The TE spec's runs next to the local spec's speed runs of the same length and layout."""
    te = [r for r in doc.get("runs", []) if r.get("part") == "te"]
    if not te:
        return f"Transformer Engine: not run ({doc.get('transformer_engine', 'unknown')})"
    local = {
        (r.get("seq"), r.get("layout")): r
        for r in doc.get("runs", [])
        if r.get("part") == "speed" and r.get("model") == "ds"
    }
    lines = [
        "| seq | layout | local tokens/s per GPU | TE tokens/s per GPU | TE / local | first-step "
        "loss (local / TE) | peak memory GiB (local / TE) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in te:
        base = local.get((r.get("seq"), r.get("layout")))
        if not _ok(r):
            lines.append(
                f"| {r.get('seq', '')} | {r.get('layout', '')} | "
                f"{_fmt(base and base.get('tokens_per_s_per_gpu'))} | {_why(r)} "
                f"| | | |"
            )
            continue
        ratio = (
            f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.2f}x"
            if base and _ok(base)
            else ""
        )

        def first_loss(x):
            losses = (x or {}).get("losses") or {}
            return losses.get("1")

        lines.append(
            f"| {r['seq']} | {r['layout']} | {_fmt(base and base.get('tokens_per_s_per_gpu'))} | "
            f"{_fmt(r['tokens_per_s_per_gpu'])} | {ratio} | "
            f"{_fmt(first_loss(base), '{:.4f}')} / {_fmt(first_loss(r), '{:.4f}')} | "
            f"{_fmt(base and base.get('peak_mem_gib_max_rank'), '{:.1f}')} / "
            f"{_fmt(r.get('peak_mem_gib_max_rank'), '{:.1f}')} |"
        )
    return "\n".join(lines)


def dp_sync_seconds(params_per_gpu: float, group: int, gbps: float) -> float:
    """Seconds of the distributed optimizer's gradient reduce-scatter and parameter all-gather
    over a ring of ``group`` GPUs at ``gbps`` GB/s, ``params_per_gpu`` parameters each."""
    if group <= 1:
        return 0.0
    return (group - 1) / group * DP_BYTES_PER_PARAM * params_per_gpu / (gbps * 1e9)


def scenarios(intra_gbps: float, inter_gbps: float) -> list:
    """(label, GPUs, data-parallel replicas, bandwidth GB/s of the slowest DP link)."""
    return [
        ("8 GPUs, one node", 8, 2, intra_gbps),
        ("8 GPUs, two nodes of 4", 8, 2, inter_gbps),
        ("16 GPUs, two nodes of 8", 16, 4, inter_gbps),
    ]


def estimate(
    doc: dict, intra_gbps: float = INTRA_NODE_GBPS, inter_gbps: float = INTER_NODE_GBPS
) -> list:
    """The scaling estimate (module docstring) per speed run with a profile: ``name``, ``seq``,
    ``layout``, ``model``, the measured ``tokens_per_s_per_gpu``, ``step_s``, ``comm_s`` and one
    ``{"scenario", "gpus", "dp", "step_s", "tokens_per_s_per_gpu", "vs_measured"}`` per
    scenario."""
    params = doc.get("model_params")
    out = []
    for r in speed_runs(doc):
        prof = r.get("profile") or {}
        c = (prof.get("share") or {}).get("communication")
        if not _ok(r) or c is None or not params:
            continue
        tp, cp, seq = r["tp"], r["cp"], r["seq"]
        step = seq / r["median_tokens_per_s"]
        comm = c * step
        per_gpu = params / tp
        measured_dp = dp_sync_seconds(per_gpu, cp, intra_gbps)
        rows = []
        for label, gpus, dp, gbps in scenarios(intra_gbps, inter_gbps):
            new = step - min(measured_dp, comm) + dp_sync_seconds(per_gpu, dp * cp, gbps)
            tps = seq / (new * tp * cp)
            rows.append(
                {
                    "scenario": label,
                    "gpus": gpus,
                    "dp": dp,
                    "step_s": new,
                    "tokens_per_s_per_gpu": tps,
                    "vs_measured": tps / r["tokens_per_s_per_gpu"],
                }
            )
        out.append(
            {
                "name": r["name"],
                "seq": seq,
                "layout": r["layout"],
                "model": r["model"],
                "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
                "step_s": step,
                "comm_s": comm,
                "scenarios": rows,
            }
        )
    return out


def format_estimate(
    doc: dict, intra_gbps: float = INTRA_NODE_GBPS, inter_gbps: float = INTER_NODE_GBPS
) -> str:
    """:func:`estimate` as a markdown table, labelled as an estimate with its bandwidths."""
    rows = estimate(doc, intra_gbps, inter_gbps)
    if not rows:
        return "Estimate: no speed run with a profiled step yet."
    labels = [s[0] for s in scenarios(intra_gbps, inter_gbps)]
    lines = [
        f"Estimate, not a measurement (tools/scale_tables.py's model: per-GPU compute and the "
        f"layout's own communication as measured on 4 GPUs, plus the data-parallel gradient and "
        f"parameter exchange without overlap at {intra_gbps:g} GB/s inside a node and "
        f"{inter_gbps:g} GB/s per GPU between nodes). Tokens/s per GPU:",
        "",
        "| seq | layout | model | measured, 4 GPUs | NCCL time per step (s) | "
        + " | ".join(labels)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(labels),
    ]
    for e in rows:
        cells = [
            f"{s['tokens_per_s_per_gpu']:,.0f} ({s['vs_measured']:.2f}x)" for s in e["scenarios"]
        ]
        lines.append(
            f"| {e['seq']} | {e['layout']} | {LABELS.get(e['model'], e['model'])} | "
            f"{e['tokens_per_s_per_gpu']:,.0f} | {e['comm_s']:.2f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def format_all(
    doc: dict,
    tables=TABLES,
    intra_gbps: float = INTRA_NODE_GBPS,
    inter_gbps: float = INTER_NODE_GBPS,
) -> str:
    """The tables asked for, each under a heading line, with the machine's facts first."""
    head = (
        f"{doc.get('device', '?')}, {doc.get('gpus', '?')} GPUs per run, torch "
        f"{doc.get('torch', '?')}, {doc.get('date', '?')}; dense attention "
        f"{doc.get('dense_attention', '?')}; Transformer Engine "
        f"{doc.get('transformer_engine', '?')}"
    )
    parts = [head]
    if "speed" in tables:
        parts += ["**Speed**", format_speed(doc)]
        parts += ["**Goal at 128k (issue 54)**", format_goal(doc)]
    if "equivalence" in tables:
        parts += ["**Equivalence and resume**", format_equivalence(doc)]
    if "te" in tables:
        parts += ["**Transformer Engine spec, TP2 x CP2**", format_te(doc)]
    if "estimate" in tables:
        parts += ["**8 and 16 GPUs (estimate)**", format_estimate(doc, intra_gbps, inter_gbps)]
    return "\n\n".join(parts)


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("json", help="tools/scale_check.py's --json")
    ap.add_argument("--tables", default=",".join(TABLES), help=f"comma list of {TABLES}")
    ap.add_argument("--intra-node-gbps", type=float, default=INTRA_NODE_GBPS)
    ap.add_argument("--inter-node-gbps", type=float, default=INTER_NODE_GBPS)
    args = ap.parse_args(argv)
    tables = [t.strip() for t in args.tables.split(",") if t.strip()]
    bad = [t for t in tables if t not in TABLES]
    if bad or not tables:
        ap.error(f"--tables: unknown {bad}; allowed: {', '.join(TABLES)}")
    for option in ("intra_node_gbps", "inter_node_gbps"):
        if getattr(args, option) <= 0:
            ap.error(f"--{option.replace('_', '-')} must be > 0")
    with open(args.json) as f:
        doc = json.load(f)
    print(format_all(doc, tables, args.intra_node_gbps, args.inter_node_gbps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
