"""End-to-end training speed: the 1.3B-shaped S2 hybrid vs its dense twin through our trainer.

    python tools/e2e_benchmark.py                          # 32k and 128k, both models (one GPU)
    python tools/e2e_benchmark.py --seqs 32768 --json e2e.json
    python tools/e2e_benchmark.py --dry-run                # print the trainer commands only

Each run is ``python -m megatron_s2.training --config configs/gpt-1.3b-{s2,dense}.yaml`` with
overrides for a short speed run on one GPU: ``model.seq_length`` = the length, full
recomputation (selective does not fit 80 GB at 32k), micro and global batch 1, ``--steps``
steps, no evaluation, no checkpoint, the built-in synthetic corpus (byte tokenizer), one log
record per step. The two configs differ only in ``attention`` (every second layer S2 with block
64, local 16, stride 8, vs all dense). Runs go one after another (32k pair first), each in
``<out-dir>/e2e-<model>-<len>k`` with its log next to it; ``--restart`` moves an older run
aside.

Reported per run: the median of the per-step tokens/s in ``metrics.jsonl`` after
``--warmup-steps`` steps (compilation, allocator warm-up), and the trainer's own
``summary.json`` figure (all steps but the first log window) for comparison; peak GPU memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {
    "s2": os.path.join(REPO, "configs", "gpt-1.3b-s2.yaml"),
    "dense": os.path.join(REPO, "configs", "gpt-1.3b-dense.yaml"),
}
LABELS = {"s2": "S2 hybrid", "dense": "dense"}
DEFAULT_SEQS = (32768, 131072)
DEFAULT_STEPS = 6
DEFAULT_WARMUP_STEPS = 2
# Trainer lines worth echoing from a run's log (the rest stays in the log file).
ECHO_PREFIXES = ("[megatron-s2]", "  throughput", "iter ")
TAIL_LINES = 25


@dataclasses.dataclass(frozen=True)
class Run:
    """One trainer run: ``model`` (a ``MODELS`` key) at ``seq`` tokens, in ``run_dir``."""

    model: str
    seq: int
    run_dir: str
    argv: tuple

    @property
    def name(self) -> str:
        return os.path.basename(self.run_dir)


def run_overrides(seq: int, steps: int, run_dir: str) -> list:
    """Trainer overrides (``key=value``) that turn a 1.3B config into a speed run of ``steps``
    steps at ``seq`` tokens on one GPU, writing into ``run_dir``."""
    return [
        f"name={os.path.basename(run_dir)}",
        f"logging.run_dir={run_dir}",
        f"model.seq_length={seq}",
        "model.recompute=full",
        "train.micro_batch_size=1",
        "train.global_batch_size=1",
        f"train.train_iters={steps}",
        # Speed only: no evaluation (its split would be smaller than one 128k sample), no
        # checkpoint, no warm-up that the short run could not finish.
        "train.eval_interval=0",
        "optimizer.lr_warmup_iters=0",
        "checkpoint.save_interval=0",
        "checkpoint.save_at_end=false",
        "data.demo=true",
        "data.split=100,0,0",
        "logging.log_interval=1",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.plot=false",
    ]


def plan_runs(
    seqs, models, steps: int, out_dir: str, overrides=(), python: str = sys.executable
) -> list:
    """The runs, length-major (both models of the first length first); ``overrides`` are
    appended after ours, so they win (the trainer applies overrides in order)."""
    runs = []
    for seq in seqs:
        for model in models:
            run_dir = os.path.join(os.path.abspath(out_dir), f"e2e-{model}-{seq // 1024}k")
            argv = [python, "-m", "megatron_s2.training", "--config", MODELS[model], "--restart"]
            argv += run_overrides(seq, steps, run_dir) + list(overrides)
            runs.append(Run(model, seq, run_dir, tuple(argv)))
    return runs


def read_result(run_dir: str, warmup_steps: int, exclude_iterations=()) -> dict:
    """Speed of a finished run from its ``metrics.jsonl`` (one train record per step):
    ``median_tokens_per_s`` and ``median_tflops_per_gpu`` (the trainer's model TFLOP/s per GPU)
    over the steps after ``warmup_steps`` but ``exclude_iterations`` (a profiled step, say),
    ``steps`` (last iteration), ``peak_mem_gib`` (the largest of the records' ``mem_kind``:
    ``gpu_mem_gib``, peak CUDA memory allocated on rank 0, or ``cpu_rss_gib`` in CPU mode),
    ``peak_mem_gib_max_rank`` (the same, largest over all ranks; None from a trainer that does
    not log it), and ``summary_tokens_per_s`` / ``summary_tflops_per_gpu`` from ``summary.json``
    (None without one). ValueError when no step came after the warm-up."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    train = [r for r in records if r.get("kind") == "train" and "tokens_per_s" in r]
    kept = [
        r
        for r in train
        if r["iteration"] > warmup_steps and r["iteration"] not in exclude_iterations
    ]
    if not kept:
        raise ValueError(
            f"{run_dir}: no training step after the {warmup_steps} warm-up steps "
            f"({len(train)} logged); raise --steps"
        )
    mem_key = next((k for k in ("gpu_mem_gib", "cpu_rss_gib") if k in train[-1]), None)
    ranks_key = f"{mem_key}_max_rank"
    summary_path = os.path.join(run_dir, "summary.json")
    summary = {}
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
    tflops = [r["tflops_per_gpu"] for r in kept if "tflops_per_gpu" in r]
    return {
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in kept),
        "summary_tokens_per_s": summary.get("tokens_per_s"),
        "median_tflops_per_gpu": statistics.median(tflops) if tflops else None,
        "summary_tflops_per_gpu": summary.get("tflops_per_gpu"),
        "steps": train[-1]["iteration"],
        "measured_steps": len(kept),
        "peak_mem_gib": max(r.get(mem_key, 0.0) for r in train) if mem_key else None,
        "peak_mem_gib_max_rank": (
            max(r[ranks_key] for r in train if ranks_key in r)
            if mem_key and any(ranks_key in r for r in train)
            else None
        ),
        "mem_kind": mem_key,
    }


def _num(x: Optional[float], fmt: str = "{:,.0f}") -> str:
    return "" if x is None else fmt.format(x)


def _cell(by: dict, model: str, key: str, fmt: str = "{:,.0f}", failed: str = "") -> str:
    r = by.get(model)
    if r is None:
        return ""
    if "error" in r:
        return failed
    return _num(r.get(key), fmt)


def format_table(results) -> str:
    """Markdown table, one line per length with the two models side by side (tokens/s, the
    S2 / dense ratio, summary.json's tokens/s, peak memory), then the failures."""
    lines = [
        "| seq | S2 hybrid tokens/s | dense tokens/s | S2 / dense | summary.json tokens/s "
        "(S2 / dense) | peak memory GiB (S2 / dense) |",
        "|---|---|---|---|---|---|",
    ]
    errors = []
    for seq in dict.fromkeys(r["seq"] for r in results):
        by = {r["model"]: r for r in results if r["seq"] == seq}
        for model in MODELS:
            if model in by and "error" in by[model]:
                errors.append(f"{LABELS[model]} at {seq}: {by[model]['error']}")
        s2, dense = (by.get(m) if "error" not in by.get(m, {}) else None for m in MODELS)
        speed = [_cell(by, m, "median_tokens_per_s", failed="failed") for m in MODELS]
        summary = [_cell(by, m, "summary_tokens_per_s") for m in MODELS]
        mem = [_cell(by, m, "peak_mem_gib", "{:.1f}") for m in MODELS]
        ratio = (
            f"{s2['median_tokens_per_s'] / dense['median_tokens_per_s']:.2f}x"
            if s2 and dense
            else ""
        )
        lines.append(
            f"| {seq} | {speed[0]} | {speed[1]} | {ratio} | {summary[0]} / {summary[1]} | "
            f"{mem[0]} / {mem[1]} |"
        )
    return "\n".join(lines + ([""] + [f"failed: {e}" for e in errors] if errors else []))


def _tail(path: str, n: int) -> list:
    with open(path, errors="replace") as f:
        return f.read().splitlines()[-n:]


def execute(run: Run, warmup_steps: int, timeout: Optional[float], exclude_iterations=()) -> dict:
    """Run the trainer for ``run`` (its output in ``<run_dir>.log``; progress and summary lines
    echoed) and return its result record (:func:`read_result`'s, ``exclude_iterations`` left
    out of the medians; ``error`` instead when the run failed)."""
    os.makedirs(os.path.dirname(run.run_dir), exist_ok=True)
    log = run.run_dir + ".log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    print(f"## {run.name}: {shlex.join(run.argv)}", flush=True)
    out = {"model": run.model, "seq": run.seq, "run_dir": run.run_dir, "log": log}
    with open(log, "w") as f:
        # A session of its own: a launcher's ranks (torchrun's children) go with it on a
        # timeout, instead of holding their GPUs as orphans while the next run starts.
        proc = subprocess.Popen(
            run.argv,
            cwd=REPO,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGKILL, not SIGTERM: the trainer answers SIGTERM with a checkpoint save.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    for line in _tail(log, 400):
        if line.startswith(ECHO_PREFIXES):
            print(f"  {line}", flush=True)
    if code != 0:
        why = f"timed out after {timeout:.0f} s" if code is None else f"exit code {code}"
        tail = _tail(log, TAIL_LINES)
        print("\n".join(f"  | {line}" for line in tail), flush=True)
        last = next((line for line in reversed(tail) if line.strip()), "")
        return {**out, "error": f"{why}: {last[:200]}"}
    try:
        return {**out, **read_result(run.run_dir, warmup_steps, exclude_iterations)}
    except (OSError, ValueError) as exc:
        return {**out, "error": str(exc)}


def json_document(device: str, results: list, torch_version: str) -> dict:
    """What ``--json`` writes (tools/docs_tables.py makes docs/benchmarks.md's end-to-end table
    from it): ``device`` (the GPU's name, or ``CPU``), ``date`` (today, ISO), ``torch`` (its
    version), ``argv`` (this command as run) and ``results`` (one :func:`execute` record per
    finished run, in run order)."""
    return {
        "device": device,
        "date": str(datetime.date.today()),
        "torch": torch_version,
        "argv": sys.argv,
        "results": results,
    }


def build_arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seqs", type=int, nargs="+", default=list(DEFAULT_SEQS))
    ap.add_argument("--models", default="s2,dense", help="comma list of s2, dense")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps per run")
    ap.add_argument(
        "--warmup-steps",
        type=int,
        default=DEFAULT_WARMUP_STEPS,
        help="first steps left out of the median",
    )
    ap.add_argument("--out-dir", default=os.path.join(REPO, "runs", "e2e"))
    ap.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra trainer override for every run (repeatable; applied after ours)",
    )
    ap.add_argument("--run-timeout", type=float, default=None, help="seconds per run")
    ap.add_argument("--json", default=None, help="write the results here (after every run)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return ap


def main(argv=None) -> int:
    """Run (or with ``--dry-run`` print) every run; 0 when all finished, 1 otherwise."""
    ap = build_arg_parser()
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        ap.error(f"--models: unknown {bad}; known: {', '.join(MODELS)}")
    if args.steps <= args.warmup_steps:
        ap.error(f"--steps ({args.steps}) must exceed --warmup-steps ({args.warmup_steps})")
    runs = plan_runs(args.seqs, models, args.steps, args.out_dir, args.override)
    if args.dry_run:
        for run in runs:
            print(shlex.join(run.argv))
        return 0
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"# {device} | torch {torch.__version__} | {datetime.date.today()}", flush=True)
    results = []
    for run in runs:
        results.append(execute(run, args.warmup_steps, args.run_timeout))
        if args.json:
            # Rewritten after every run, so a run cut short by a time limit loses only itself.
            with open(args.json, "w") as f:
                json.dump(json_document(device, results, torch.__version__), f, indent=1)
    print(format_table(results), flush=True)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
