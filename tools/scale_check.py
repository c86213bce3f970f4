#!/usr/bin/env python
"""At scale on four GPUs: the 7B-shaped S2 hybrid at 32k and 128k next to its dense twin (issue 54).

    python tools/scale_check.py --dry-run                     # the command matrix and its time
    python tools/scale_check.py --json runs/scale/scale.json  # everything, resumable
    python tools/scale_check.py --parts speed --seqs 131072 --layouts tp4 --time-budget 560 \\
        --json /tmp/scale/scale.json --copy-json $OUT/scale.json
    python tools/scale_tables.py runs/scale/scale.json        # the docs tables and the estimate

The model is that of ``configs/extend/gpt-7b-s2-128k.yaml`` (32 layers, hidden 4096, 32 query
heads in 8 KV groups, SwiGLU 14336), taken from ``configs/gpt-7b-s2.yaml`` (the same shape, no
``checkpoint.load_dir``) at ``model.seq_length`` 32768 or 131072. Models (``--models``):

* ``ds``: the hybrid, every second layer S2 (``DS``; block 64, local 16, stride 8);
* ``s2``: every layer S2 (the override ``attention.dense_layers.pattern=S``);
* ``dense``: the dense twin ``configs/gpt-7b-dense.yaml`` with ``model.dense_attention=auto``
  (FlashAttention-4 where it is installed, else PyTorch's cuDNN SDPA; the JSON says which).

Layouts (``--layouts``, names ``tp<T>cp<C>``, ``tp<T>`` or ``cp<C>``, T x C = ``--gpus``, DP 1):
``tp2cp2`` and ``tp4`` at both lengths, ``cp4`` at 128k only unless asked for by name; tensor
parallelism always with sequence parallelism, the distributed optimizer with gradient-reduce
overlap, one sequence a step. Recomputation (``--recompute auto``): selective where
``tools/estimate_memory.py`` puts the layout under ``--memory-budget-gib`` (default 100 GiB,
headroom below the issue's 120 GB goal: the estimate's activation constant is fitted on a 125M
model), else full. With its numbers the 32k layouts run selective (TP2 x CP2 93 GiB, TP4 83 GiB)
and the 128k ones full (45-76 GiB; selective would need 239-269 GiB).

Each run is the trainer on four GPUs (``python -m torch.distributed.run --standalone
--nproc_per_node 4 -m megatron_s2.training --config ... overrides``), the overrides of
``tools/e2e_benchmark.py``'s speed run (synthetic corpus, byte tokenizer, no evaluation, no
checkpoint, one log record a step; its ``Run``, ``execute`` and ``read_result`` run and read it)
plus the layout's, ``model.vocab_size=512`` (Megatron pads the byte vocabulary to 128 x TP: 384
at TP1, 512 at TP2/TP4; one size lets checkpoints move between layouts and keeps the FLOPs
equal), ``train.seed`` 1234 and ``debug.profile_step`` = the last step. Per run: tokens/s per GPU
(median of the steps after ``--warmup-steps``, the profiled step left out), the trainer's model
TFLOP/s per GPU, peak memory per GPU (the largest over the ranks: the trainer logs it) and, from
the profiled step, the share of each rank's GPU kernel time in attention and in NCCL kernels
(``megatron_s2/training/profiling.py``; mean over the ranks).

Parts (``--parts``, default all):

* ``speed``: the matrix above;
* ``equivalence``: the hybrid at ``--equiv-seq`` (32k) in every layout of ``--equiv-layouts``
  (default tp2cp2, tp4, cp4; the first is the reference) for 10 steps from one common
  checkpoint (``eq-init``: one step at LR 0 in the reference layout, because Megatron
  initialises each TP shard from its own RNG stream, so two layouts never start from equal
  weights on their own), the same data and seed, full recomputation, the dense layers on
  PyTorch's SDPA in every run (FlashAttention-4 may arrive between two device calls), LR 3e-5
  with 2 warm-up steps and cosine decay over the 10. Each step's loss must agree with the
  reference's within relative ``EQUIV_RTOL`` = 2e-2: the bf16 loss tolerance of
  ``tools/gpu_parallel_check.py``
  (``tolerances('bf16')``), whose layouts differed from one GPU by 1e-5..7e-5 at small width
  (docs/notebook/2026-11-benchmarks-training-multi-gpu.md); a layout bug (a wrong head slice, a
  CP chunk attended at the wrong offset) moves the loss by far more, and in fp32 on the CPU the
  check's own TP2 and CP2 runs agree to 1e-7 (tests/tools/test_scale_check.py). The reference
  saves a checkpoint at step ``RESUME_AT`` (6); ``resume-<--resume-layout>`` (default tp4)
  resumes it (``checkpoint.load_dir``, iteration count and LR schedule kept). At a changed layout
  the trainer restores the weights and LR schedule and restarts the optimizer state
  (megatron_s2/training/checkpointing.py), so its first step (7) must give the reference's
  step-7 loss (relative 2e-2) and learning rate (relative 1e-6); the later steps are recorded
  only. The checkpoints (about 100 GB each at 7B: bf16 weights, fp32 main weights and Adam
  moments) are deleted once every run that loads them finished, unless ``--keep-checkpoints``.
* ``te``: the hybrid in ``--te-layout`` (TP2 x CP2) with
  ``model.transformer_impl=transformer_engine`` (TE's linears and TE's own CP attention on the
  dense layers) beside the local spec's speed run of the same length and layout; recorded as
  "not installed: ..." where Transformer Engine does not import (the trainer's own check;
  ``tools/stage_transformer_engine.sh`` carries TE to the lent machines). The two specs start
  from the same seed; their first losses are shown side by side, not asserted equal.

Time (``--dry-run`` prints it per run and per part): startup ``STARTUP_S`` = 45 s per run
(torchrun, imports, the 7B model and optimizer, Triton compilation; a guess), a checkpoint save
or load ``CHECKPOINT_S`` = 90 s (~100 GB), and the steps (one more for the profiled step) at
``EST_TFLOPS_PER_GPU`` = 300 model TFLOP/s per GPU: the 1.3B hybrid through this trainer on
H100s ran 322-346 at 128k with full recomputation at CP 1-2 (docs/benchmarks.md's history,
docs/notebook/2026-11-benchmarks-training-multi-gpu.md), less is assumed for tensor
parallelism's communication. One step of the 7B model is then ~1.3-1.9 s at 32k and ~6-16 s at
128k (all-S2 / DS / dense: 7.4, 13.2, 19.0 PFLOP a 128k step). Twenty steps a run would take
about 49 minutes for the speed matrix alone (32k 8 min, 128k 41 min), so ``DEFAULT_STEPS`` are
12 steps at 32k (2 warm-up, 9 measured, 1 profiled) and 5 at 128k (2 measured), about 23
minutes for the 15 speed runs (32k 6.5, 128k 16.6; 11 of them startup); the equivalence and
resume runs about 14 minutes, the TE pair about 3. The device calls of a lease are at most 10
minutes each: ``--time-budget`` (seconds, counted from the command's start) leaves runs that
would not fit for the next call and stops a run still going at the deadline (left for the
next call too; a run is recorded as failed when its own timeout, ``--run-timeout`` or four
times its estimate plus 3 minutes, stops it). A later call repeats the command: runs already in
``--json`` are skipped (``--retry-failed`` runs the failed ones again), and ``--copy-json``
writes the JSON also to ``$OUT`` after every run. Speed runs go length by length in
``--seqs`` order, so the default ``--seqs 131072 32768`` measures 128k first. Each record keeps
the dense kernel its call's machine had (``dense_attention``: FA4, else cuDNN).

Bad input (an unknown layout or model, a layout that does not multiply to ``--gpus`` or divide
the heads, a length the layout's sequence/context parallelism or the S2 blocks cannot split:
``megatron_s2/parallel_lengths.py`` through the run config's own checks) is refused before any
GPU work, naming the option and what it allows.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import shutil
import sys
import time
from typing import Optional

TOOLS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TOOLS)
for _p in (TOOLS, REPO):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import e2e_benchmark  # noqa: E402  (tools/ is not a package: imported from its folder)
import estimate_memory  # noqa: E402

MODELS = {
    "ds": (os.path.join(REPO, "configs", "gpt-7b-s2.yaml"), ()),
    "s2": (os.path.join(REPO, "configs", "gpt-7b-s2.yaml"), ("attention.dense_layers.pattern=S",)),
    "dense": (os.path.join(REPO, "configs", "gpt-7b-dense.yaml"), ("model.dense_attention=auto",)),
}
LABELS = {"ds": "DS hybrid", "s2": "all-S2", "dense": "dense"}
DEFAULT_MODELS = ("ds", "s2", "dense")
DEFAULT_SEQS = (131072, 32768)  # 128k first: the goal is there
# The default matrix: every layout at 128k, CP4 only there (the "CP4 at 128k").
DEFAULT_LAYOUTS = {32768: ("tp2cp2", "tp4"), 131072: ("tp2cp2", "tp4", "cp4")}
DEFAULT_STEPS = {32768: 12, 131072: 5}
FALLBACK_STEPS = 10  # another length, without --steps
DEFAULT_WARMUP_STEPS = 2
PARTS = ("speed", "equivalence", "te")
RECOMPUTE = ("auto", "selective", "full")
MEMORY_BUDGET_GIB = 100.0

# The time model of --dry-run and --time-budget (see the module docstring).
STARTUP_S = 45.0
CHECKPOINT_S = 90.0
EST_TFLOPS_PER_GPU = 300.0

# The equivalence part (see the module docstring).
EQUIV_SEQ = 32768
EQUIV_LAYOUTS = ("tp2cp2", "tp4", "cp4")  # the first is the reference
EQUIV_STEPS = 10
EQUIV_RTOL = 2e-2
LR_RTOL = 1e-6
RESUME_AT = 6
RESUME_LAYOUT = "tp4"
EQUIV_OPTIMIZER = (
    "optimizer.lr=3e-5",
    "optimizer.min_lr=3e-6",
    "optimizer.lr_warmup_iters=2",
    f"optimizer.lr_decay_iters={EQUIV_STEPS}",
    "optimizer.lr_decay_style=cosine",
)
TE_LAYOUT = "tp2cp2"
# The padded vocabulary of every run: Megatron pads the byte tokenizer's to a multiple of
# 128 x TP (384 at TP1, 512 at TP2 and TP4), and a checkpoint loads only into its own
# embedding shape; one size for all lets the equivalence runs move between layouts and keeps
# the FLOPs of all layouts equal.
VOCAB_SIZE = 512
# A trainer's own words in its log, ahead of torchrun's summary of the failed ranks.
_ERROR_LINE = re.compile(r"^(megatron-s2-train: .*|\w*(Error|Exception): .*)$")
SEED = 1234

_LAYOUT_RE = re.compile(r"^(?:tp(\d+))?(?:cp(\d+))?$")


class ScaleCheckError(ValueError):
    """Bad input: names the option and what it allows."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """A tensor x context parallel layout on ``tp * cp`` GPUs (data parallel size 1)."""

    name: str
    tp: int
    cp: int

    @property
    def gpus(self) -> int:
        return self.tp * self.cp

    def overrides(self) -> list:
        """The trainer's ``parallel`` overrides: sequence parallelism with TP, the distributed
        optimizer, gradient-reduce overlap."""
        return [
            f"parallel.tensor_model_parallel_size={self.tp}",
            f"parallel.context_parallel_size={self.cp}",
            "parallel.pipeline_model_parallel_size=1",
            f"parallel.sequence_parallel={'true' if self.tp > 1 else 'false'}",
            "parallel.use_distributed_optimizer=true",
            "parallel.overlap_grad_reduce=true",
        ]


def parse_layout(name: str, gpus: int, option: str = "--layouts") -> Layout:
    """``tp2cp2``, ``tp4``, ``cp4``, ... as a :class:`Layout`; ScaleCheckError naming
    ``option`` when the name is not of that form or the layout does not fill ``gpus`` GPUs."""
    m = _LAYOUT_RE.match(name)
    if not name or not m:
        raise ScaleCheckError(
            f"{option}: {name!r} is not a layout; write tp<T>cp<C>, tp<T> or cp<C> with "
            f"T x C = --gpus ({gpus}): {', '.join(layout_names(gpus))}"
        )
    tp, cp = int(m.group(1) or 1), int(m.group(2) or 1)
    if tp < 1 or cp < 1 or tp * cp != gpus:
        raise ScaleCheckError(
            f"{option}: {name} uses {tp} x {cp} = {tp * cp} GPUs, not --gpus ({gpus}); "
            f"the layouts of {gpus} GPUs are {', '.join(layout_names(gpus))}"
        )
    return Layout(name, tp, cp)


def layout_names(gpus: int) -> list:
    """Every layout name of ``gpus`` GPUs: TP x CP with DP 1."""
    out = []
    for tp in range(gpus, 0, -1):
        if gpus % tp == 0:
            cp = gpus // tp
            out.append(("" if tp == 1 else f"tp{tp}") + ("" if cp == 1 else f"cp{cp}"))
    return out


@dataclasses.dataclass(frozen=True)
class Planned:
    """One trainer run of the check: ``part`` (speed, te, equivalence, resume), its model,
    layout and length, the trainer ``Run`` (e2e_benchmark's), the steps the medians skip and
    the estimate of its seconds."""

    part: str
    model: str
    layout: Layout
    seq: int
    steps: int
    recompute: str
    run: e2e_benchmark.Run
    warmup_steps: int
    exclude: tuple
    estimate_s: float
    transformer_impl: str = "local"
    after: tuple = ()  # names of runs whose checkpoints this one loads

    @property
    def name(self) -> str:
        return self.run.name


def _launcher(gpus: int, python: str) -> list:
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus)]


def load_run_config(model: str, layout: Layout, seq: int, overrides=()):
    """The trainer's run config of ``model`` at ``seq`` tokens in ``layout`` (validated against
    the layout's world size, the attention schedule parsed: every rule of the trainer, the
    sequence-length rules of megatron_s2/parallel_lengths.py among them). Raises the run
    config's ConfigError."""
    from megatron_s2.training.run_config import load_config

    config, extra = MODELS[model]
    cfg = load_config(
        config,
        list(extra)
        + [f"model.seq_length={seq}", "train.global_batch_size=1", "train.micro_batch_size=1"]
        + [f"model.vocab_size={VOCAB_SIZE}"]
        + layout.overrides()
        + list(overrides),
    )
    cfg.validate(world_size=layout.gpus)
    cfg.schedule()
    return cfg


def choose_recompute(
    model: str, layout: Layout, seq: int, budget_gib: float, overrides=()
) -> tuple:
    """(``selective`` or ``full``, the selective estimate in GiB): selective where
    tools/estimate_memory.py's estimate of it fits ``budget_gib`` per GPU, else full
    (``overrides``: the trainer overrides the runs get)."""
    cfg = load_run_config(model, layout, seq, list(overrides) + ["model.recompute=selective"])
    gib = estimate_memory.estimate(cfg, layout.gpus, estimate_memory._vocab(cfg)).total
    return ("selective" if gib <= budget_gib else "full"), gib


_FLOPS: dict = {}


def estimate_seconds(cfg, gpus: int, steps: int, checkpoints: int = 0) -> float:
    """Wall seconds of a run of ``cfg`` on ``gpus`` GPUs for ``steps`` steps (plus one step's
    worth for the profiled one) with ``checkpoints`` saves or loads: see the module docstring."""
    from megatron_s2.training.metrics import model_flops_per_iteration

    vocab = estimate_memory._vocab(cfg)
    # Counting an S2 schedule's pairs at 128k takes seconds: once per model and length.
    key = (json.dumps(cfg.attention, sort_keys=True), dataclasses.astuple(cfg.model), vocab)
    if key not in _FLOPS:
        _FLOPS[key] = model_flops_per_iteration(
            cfg.model, cfg.train.global_batch_size, vocab, cfg.schedule()
        )
    flops = _FLOPS[key]
    step_s = flops / (EST_TFLOPS_PER_GPU * 1e12 * gpus)
    return STARTUP_S + CHECKPOINT_S * checkpoints + step_s * (steps + 1)


def _planned(
    part,
    model,
    layout,
    seq,
    steps,
    recompute,
    out_dir,
    name,
    overrides,
    python,
    *,
    warmup,
    profile=True,
    checkpoints=0,
    after=(),
    impl="local",
) -> Planned:
    run_dir = os.path.join(os.path.abspath(out_dir), name)
    ours = e2e_benchmark.run_overrides(seq, steps, run_dir) + layout.overrides()
    ours += [f"model.recompute={recompute}", f"train.seed={SEED}", f"model.vocab_size={VOCAB_SIZE}"]
    if profile:
        ours.append(f"debug.profile_step={steps}")
    config, extra = MODELS[model]
    ours = list(extra) + ours + list(overrides)
    cfg = load_run_config(model, layout, seq, ours)
    argv = _launcher(layout.gpus, python) + ["-m", "megatron_s2.training", "--config", config]
    argv += ["--restart"] + ours
    exclude = (steps,) if profile else ()
    return Planned(
        part=part,
        model=model,
        layout=layout,
        seq=seq,
        steps=steps,
        recompute=recompute,
        run=e2e_benchmark.Run(model, seq, run_dir, tuple(argv)),
        warmup_steps=warmup,
        exclude=exclude,
        estimate_s=estimate_seconds(cfg, layout.gpus, steps, checkpoints),
        transformer_impl=impl,
        after=tuple(after),
    )


def _seq_tag(seq: int) -> str:
    return f"{seq // 1024}k" if seq % 1024 == 0 else str(seq)


def recompute_for(args, layout: Layout, seq: int) -> str:
    """``--recompute``, or with ``auto`` what :func:`choose_recompute` picks for the hybrid
    (all three models keep the same per-layer activations: attention keeps no scores)."""
    if args.recompute != "auto":
        return args.recompute
    return choose_recompute("ds", layout, seq, args.memory_budget_gib, args.override)[0]


def plan_speed(args, layouts_by_seq, recompute_of, python) -> list:
    """The speed matrix: length-major, then layout, then model."""
    out = []
    for seq, layouts in layouts_by_seq.items():
        steps = args.steps or DEFAULT_STEPS.get(seq, FALLBACK_STEPS)
        for layout in layouts:
            for model in args.models:
                out.append(
                    _planned(
                        "speed",
                        model,
                        layout,
                        seq,
                        steps,
                        recompute_of[(layout.name, seq)],
                        args.out_dir,
                        f"speed-{model}-{layout.name}-{_seq_tag(seq)}",
                        args.override,
                        python,
                        warmup=args.warmup_steps,
                    )
                )
    return out


def plan_te(args, recompute_of, python) -> list:
    """TE spec and local spec of the hybrid at TP2 x CP2, at each length of ``--seqs``."""
    layout = parse_layout(args.te_layout, args.gpus, "--te-layout")
    out = []
    for seq in args.seqs:
        steps = args.steps or DEFAULT_STEPS.get(seq, FALLBACK_STEPS)
        rc = recompute_of.get((layout.name, seq)) or recompute_for(args, layout, seq)
        for impl, name in (
            ("local", f"speed-ds-{layout.name}-{_seq_tag(seq)}"),
            ("transformer_engine", f"te-ds-{layout.name}-{_seq_tag(seq)}"),
        ):
            extra = list(args.override)
            if impl == "transformer_engine":
                extra.append("model.transformer_impl=transformer_engine")
            out.append(
                _planned(
                    "speed" if impl == "local" else "te",
                    "ds",
                    layout,
                    seq,
                    steps,
                    rc,
                    args.out_dir,
                    name,
                    extra,
                    python,
                    warmup=args.warmup_steps,
                    impl=impl,
                )
            )
    return out


def plan_equivalence(args, python) -> list:
    """eq-init, the hybrid in every equivalence layout from it (the reference first: it saves
    the checkpoint the resume run loads), then the resume at TP4."""
    seq = args.equiv_seq
    layouts = [parse_layout(n, args.gpus, "--equiv-layouts") for n in args.equiv_layouts]
    ref = layouts[0]  # the reference: the others' losses are compared with its
    tag = _seq_tag(seq)
    init_dir = os.path.join(os.path.abspath(args.out_dir), f"eq-init-{tag}")
    # The same recomputation everywhere (full fits every layout) and the same LR schedule; its
    # warm-up makes eq-init's one step use LR 0, so its checkpoint holds the initial weights.
    # The dense layers on PyTorch's SDPA in every run: FA4 may be installed between two calls.
    common = ["model.recompute=full", "model.dense_attention=sdpa"] + list(EQUIV_OPTIMIZER)
    init = _planned(
        "equivalence",
        "ds",
        ref,
        seq,
        1,
        "full",
        args.out_dir,
        f"eq-init-{tag}",
        common + list(args.override) + ["checkpoint.save_at_end=true"],
        python,
        warmup=0,
        profile=False,
        checkpoints=1,
    )
    out = [init]
    start = [
        f"checkpoint.load_dir={os.path.join(init_dir, 'checkpoints')}",
        "checkpoint.reset_iteration=true",
        "checkpoint.load_optimizer=false",
    ]
    ref_dir = None
    for layout in layouts:
        name = f"eq-{layout.name}-{tag}"
        saves = layout.name == ref.name
        extra = common + start + list(args.override)
        if saves:
            # One checkpoint, at RESUME_AT: the resume run loads the newest in the folder.
            extra += [f"checkpoint.save_interval={RESUME_AT}", "checkpoint.save_at_end=false"]
            ref_dir = os.path.join(os.path.abspath(args.out_dir), name)
        out.append(
            _planned(
                "equivalence",
                "ds",
                layout,
                seq,
                EQUIV_STEPS,
                "full",
                args.out_dir,
                name,
                extra,
                python,
                warmup=0,
                profile=False,
                checkpoints=2 if saves else 1,
                after=(init.name,),
            )
        )
    resume = parse_layout(args.resume_layout, args.gpus, "--resume-layout")
    extra = common + list(args.override)
    extra += [
        f"checkpoint.load_dir={os.path.join(ref_dir, 'checkpoints')}",
        "checkpoint.reset_iteration=false",
        "checkpoint.load_optimizer=true",
    ]
    out.append(
        _planned(
            "resume",
            "ds",
            resume,
            seq,
            EQUIV_STEPS,
            "full",
            args.out_dir,
            f"resume-{resume.name}-{tag}",
            extra,
            python,
            warmup=0,
            profile=False,
            checkpoints=1,
            after=(f"eq-{ref.name}-{tag}",),
        )
    )
    return out


def plan(args, python: str = sys.executable) -> list:
    """Every run of the parts asked for, checked (ScaleCheckError) before anything runs."""
    from megatron_s2.training.run_config import ConfigError

    layouts_by_seq = {}
    for seq in args.seqs if "speed" in args.parts else ():
        names = args.layouts or DEFAULT_LAYOUTS.get(seq, DEFAULT_LAYOUTS[131072])
        layouts_by_seq[seq] = [parse_layout(n, args.gpus) for n in names]
    recompute_of = {}
    try:
        for seq, layouts in layouts_by_seq.items():
            for layout in layouts:
                for model in args.models:
                    # Every model at every layout and length, before the recomputation is chosen:
                    # the length rules differ (S2 blocks under CP) and a refusal names its run.
                    load_run_config(model, layout, seq, args.override)
                recompute_of[(layout.name, seq)] = recompute_for(args, layout, seq)
        runs = []
        if "speed" in args.parts:
            runs += plan_speed(args, layouts_by_seq, recompute_of, python)
        if "te" in args.parts:
            names = {r.name for r in runs}
            runs += [r for r in plan_te(args, recompute_of, python) if r.name not in names]
        if "equivalence" in args.parts:
            runs += plan_equivalence(args, python)
    except ConfigError as e:
        raise ScaleCheckError(f"--layouts/--seqs/--models: {e}") from None
    return runs


# ---------------------------------------------------------------------------------- reading runs
def read_steps(run_dir: str) -> dict:
    """Per-iteration ``loss`` and ``lr`` of a run's ``metrics.jsonl`` train records:
    ``{"losses": {iteration: loss}, "lrs": {iteration: lr}}`` (iterations as strings, as JSON
    keeps them)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    losses, lrs = {}, {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                r = json.loads(line)
                if r.get("kind") == "train" and "loss" in r:
                    losses[str(r["iteration"])] = r["loss"]
                    if "lr" in r:
                        lrs[str(r["iteration"])] = r["lr"]
    return {"losses": losses, "lrs": lrs}


def read_profile(run_dir: str, iteration: int) -> Optional[dict]:
    """The profiled step's summaries of every rank (``<run_dir>/profile/step<N>.rank<R>.json``)
    folded into one: ``ranks``, the mean share of each kernel class over the ranks (``share``),
    the largest (``max_share``), the mean step wall time and kernel time (ms), the largest peak
    memory; None when no rank wrote one."""
    folder = os.path.join(run_dir, "profile")
    pattern = re.compile(rf"^step{iteration}\.rank(\d+)\.json$")
    rows = []
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if pattern.match(name):
                with open(os.path.join(folder, name)) as f:
                    rows.append(json.load(f))
    if not rows:
        return None
    classes = list(rows[0]["share"])
    share, max_share = {}, {}
    for c in classes:
        vals = [r["share"][c] for r in rows if r["share"].get(c) is not None]
        share[c] = sum(vals) / len(vals) if vals else None
        max_share[c] = max(vals) if vals else None
    peaks = [r["peak_mem_gib"] for r in rows if r.get("peak_mem_gib") is not None]
    return {
        "iteration": iteration,
        "ranks": len(rows),
        "share": share,
        "max_share": max_share,
        "wall_ms": sum(r["wall_ms"] for r in rows) / len(rows),
        "kernel_ms": sum(r["total_kernel_ms"] for r in rows) / len(rows),
        "peak_mem_gib": max(peaks) if peaks else None,
        "top_kernels_rank0": rows[0].get("top_kernels", [])[:10],
    }


def error_detail(log: str) -> Optional[str]:
    """The first error line a failed run's ranks wrote to ``log`` (the trainer's refusal, a
    Python exception), which torchrun's closing summary hides; None when there is none."""
    try:
        with open(log, errors="replace") as f:
            for line in f:
                line = line.strip()
                if _ERROR_LINE.match(line) and "ChildFailedError" not in line:
                    return line[:400]
    except OSError:
        pass
    return None


def record(p: Planned, result: dict, seconds: float) -> dict:
    """The JSON record of finished run ``p``: what it ran and ``result`` (e2e_benchmark's
    execute record), plus tokens/s per GPU, the profile, per-step losses and learning rates."""
    out = {
        "name": p.name,
        "part": p.part,
        "model": p.model,
        "layout": p.layout.name,
        "tp": p.layout.tp,
        "cp": p.layout.cp,
        "gpus": p.layout.gpus,
        "seq": p.seq,
        "steps_planned": p.steps,
        "recompute": p.recompute,
        "transformer_impl": p.transformer_impl,
        "estimate_s": round(p.estimate_s, 1),
        "seconds": round(seconds, 1),
        "argv": list(p.run.argv),
        **result,
    }
    if "median_tokens_per_s" in result:
        out["tokens_per_s_per_gpu"] = result["median_tokens_per_s"] / p.layout.gpus
    if p.exclude:
        out["profile"] = read_profile(p.run.run_dir, p.exclude[0])
    if "error" in result and result.get("log"):
        out["error_detail"] = error_detail(result["log"])
    out.update(read_steps(p.run.run_dir))
    return out


# --------------------------------------------------------------------------------------- the run
def _device_facts() -> dict:
    """The machine: GPU name and count, torch, whether FA4 and TE import (what the dense twin
    and the TE part run on)."""
    import torch

    from megatron_s2.flash_attention4 import fa4_import_error

    facts = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
        "gpus_found": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch": torch.__version__,
    }
    fa4 = fa4_import_error()
    facts["dense_attention"] = "fa4" if fa4 is None else f"cudnn (FlashAttention-4: {fa4})"
    facts["transformer_engine"] = te_status(torch.cuda.is_available())
    return facts


def te_status(gpu: bool) -> str:
    """``"installed"``, else ``"not installed: <why>"`` (the trainer's own check)."""
    from megatron_s2.training.parallel import check_transformer_impl
    from megatron_s2.training.run_config import ConfigError

    try:
        check_transformer_impl("transformer_engine", gpu=gpu)
    except ConfigError as e:
        return f"not installed: {e}"
    return "installed"


def load_document(path: Optional[str]) -> dict:
    """The JSON of earlier calls (resumed), else a new one."""
    if path and os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
        if doc.get("tool") != "scale_check":
            raise ScaleCheckError(f"--json: {path} is not a scale_check JSON (no tool key)")
        return doc
    return {"tool": "scale_check", "runs": [], "commands": []}


def write_document(doc: dict, paths) -> None:
    """Write ``doc`` to every path of ``paths`` (atomically: a call stopped while writing
    leaves the previous version)."""
    for path in paths:
        if not path:
            continue
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)


def _remove_checkpoints(run_dir: str) -> None:
    folder = os.path.join(run_dir, "checkpoints")
    if os.path.isdir(folder):
        shutil.rmtree(folder, ignore_errors=True)
        print(f"  removed {folder} (--keep-checkpoints keeps them)", flush=True)


def run_timeout(p: Planned, given: Optional[float]) -> float:
    """Seconds a run may take: ``--run-timeout``, else four times its estimate plus 3 minutes
    (a run that slow is stuck, say on a collective, and must not hold the call)."""
    return given if given is not None else 4 * p.estimate_s + 180


def _checkpoints_lost(runs: list, done: dict) -> list:
    """Finished runs whose checkpoints a run still to come needs but that are gone (a fresh
    machine under an old JSON): they must run again, before their users."""
    lost = []
    for p in runs:
        users = [q for q in runs if p.name in q.after and q.name not in done]
        ckpt = os.path.join(p.run.run_dir, "checkpoints")
        if users and p.name in done and "error" not in done[p.name] and not os.path.isdir(ckpt):
            lost.append(p.name)
    return lost


def execute_all(runs: list, args, doc: dict, t_start: Optional[float] = None) -> int:
    """Run what ``doc`` does not hold yet, in order, within ``--time-budget`` counted from
    ``t_start`` (``time.monotonic()``; default now); write the JSON after every run. Returns
    the number of runs left for a later call (a run the budget cut short is one of them: it is
    not recorded, and runs again in full next time)."""
    done = {r["name"]: r for r in doc["runs"]}
    for name in _checkpoints_lost(runs, done):
        print(f"## {name}: its checkpoints are gone; running it again", flush=True)
        del done[name]
        doc["runs"] = [r for r in doc["runs"] if r["name"] != name]
    t_start = time.monotonic() if t_start is None else t_start
    left = 0

    def keep(rec: dict) -> None:
        doc["runs"] = [r for r in doc["runs"] if r["name"] != rec["name"]] + [rec]
        done[rec["name"]] = rec
        write_document(doc, [args.json, args.copy_json])

    for p in runs:
        old = done.get(p.name)
        if old is not None and ("error" not in old or not args.retry_failed):
            continue
        blocked = [a for a in p.after if a not in done or "error" in done[a]]
        if blocked:
            reason = f"needs {', '.join(blocked)} first"
            if all(a in done for a in blocked):  # they failed: record why this cannot run
                keep({"name": p.name, "part": p.part, "error": f"skipped: {reason} (failed)"})
            else:
                left += 1
            continue
        te = doc.get("transformer_engine", "")
        if p.transformer_impl == "transformer_engine" and not str(te).startswith("installed"):
            keep({"name": p.name, "part": p.part, "error": te})
            continue
        timeout = run_timeout(p, args.run_timeout)
        cut_by_budget = False
        if args.time_budget is not None:
            remaining = args.time_budget - (time.monotonic() - t_start)
            if p.estimate_s > remaining:
                print(
                    f"## {p.name}: left for the next call (estimate {p.estimate_s:.0f} s, "
                    f"{remaining:.0f} s of --time-budget left)",
                    flush=True,
                )
                left += 1
                continue
            if remaining < timeout:
                timeout, cut_by_budget = remaining, True
        # A run directory of an earlier attempt goes (--restart would keep it aside, with
        # its ~100 GB of checkpoints).
        shutil.rmtree(p.run.run_dir, ignore_errors=True)
        t0 = time.monotonic()
        result = e2e_benchmark.execute(p.run, p.warmup_steps, timeout, p.exclude)
        if cut_by_budget and str(result.get("error", "")).startswith("timed out"):
            print(f"## {p.name}: cut by --time-budget; it runs again next call", flush=True)
            left += 1
            break  # the budget is spent
        rec = record(p, result, time.monotonic() - t0)
        # What this call's machine had: FA4 may be installed between two calls.
        rec["dense_attention"] = doc.get("dense_attention")
        keep(rec)
        _free_disk(runs, done, args)
    return left


def _free_disk(runs: list, done: dict, args) -> None:
    """Remove a checkpoint once every run that loads it finished (they are ~100 GB each)."""
    if args.keep_checkpoints:
        return
    for p in runs:
        users = [q for q in runs if p.name in q.after]
        if users and p.name in done and all(q.name in done for q in users):
            _remove_checkpoints(p.run.run_dir)


def build_arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument(
        "--models", default=",".join(DEFAULT_MODELS), help=f"comma list of {', '.join(MODELS)}"
    )
    ap.add_argument(
        "--layouts",
        default=None,
        help="comma list of tp<T>cp<C>/tp<T>/cp<C> (T x C = --gpus); default tp2cp2,tp4 at 32k "
        "and tp2cp2,tp4,cp4 at 128k",
    )
    ap.add_argument("--seqs", type=int, nargs="+", default=list(DEFAULT_SEQS))
    ap.add_argument("--gpus", type=int, default=4, help="GPUs per run (TP x CP; DP is 1)")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps per speed and TE run (default 20 at 32k, 6 at 128k, 10 otherwise)",
    )
    ap.add_argument("--warmup-steps", type=int, default=DEFAULT_WARMUP_STEPS)
    ap.add_argument("--recompute", default="auto", help=f"one of {', '.join(RECOMPUTE)}")
    ap.add_argument("--memory-budget-gib", type=float, default=MEMORY_BUDGET_GIB)
    ap.add_argument("--equiv-seq", type=int, default=EQUIV_SEQ)
    ap.add_argument(
        "--equiv-layouts",
        default=",".join(EQUIV_LAYOUTS),
        help="layouts of the equivalence part, the reference first",
    )
    ap.add_argument(
        "--resume-layout", default=RESUME_LAYOUT, help="resumes the reference's checkpoint"
    )
    ap.add_argument("--te-layout", default=TE_LAYOUT, help="layout of the TE spec's runs")
    ap.add_argument("--out-dir", default=os.path.join(REPO, "runs", "scale"))
    ap.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra trainer override for every run (repeatable; applied after ours)",
    )
    ap.add_argument("--json", default=None, help="the results (read first: resumes)")
    ap.add_argument("--copy-json", default=None, help="also write the JSON here (e.g. $OUT)")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds for this call")
    ap.add_argument(
        "--run-timeout",
        type=float,
        default=None,
        help="seconds per run (default: 4 x its estimate + 180)",
    )
    ap.add_argument("--retry-failed", action="store_true")
    ap.add_argument("--keep-checkpoints", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="print the runs and their estimate")
    return ap


def _comma_list(ap, option: str, text: str, allowed) -> list:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if allowed is not None and x not in allowed]
    if not items or bad:
        ap.error(f"{option}: unknown {bad or text!r}; allowed: {', '.join(allowed)}")
    return items


def parse_args(argv=None):
    """The arguments, checked: unknown parts, models, layouts and recomputation are refused
    (``ap.error``, exit status 2) before anything else."""
    ap = build_arg_parser()
    args = ap.parse_args(argv)
    args.parts = _comma_list(ap, "--parts", args.parts, PARTS)
    args.models = _comma_list(ap, "--models", args.models, tuple(MODELS))
    if args.recompute not in RECOMPUTE:
        ap.error(f"--recompute: unknown {args.recompute!r}; allowed: {', '.join(RECOMPUTE)}")
    if args.gpus < 1:
        ap.error(f"--gpus must be >= 1, got {args.gpus}")
    try:
        if args.layouts is not None:
            args.layouts = _comma_list(ap, "--layouts", args.layouts, None)
            for name in args.layouts:
                parse_layout(name, args.gpus)
        args.equiv_layouts = _comma_list(ap, "--equiv-layouts", args.equiv_layouts, None)
        if "equivalence" in args.parts:
            for name in args.equiv_layouts:
                parse_layout(name, args.gpus, "--equiv-layouts")
            parse_layout(args.resume_layout, args.gpus, "--resume-layout")
            if args.resume_layout == args.equiv_layouts[0]:
                raise ScaleCheckError(
                    f"--resume-layout ({args.resume_layout}) must differ from the first of "
                    f"--equiv-layouts (the reference, whose checkpoint it resumes)"
                )
            if len(set(args.equiv_layouts)) != len(args.equiv_layouts):
                raise ScaleCheckError(f"--equiv-layouts: {args.equiv_layouts} repeats a layout")
        if "te" in args.parts:
            parse_layout(args.te_layout, args.gpus, "--te-layout")
    except ScaleCheckError as e:
        ap.error(str(e))
    if any(s < 1 for s in args.seqs):
        ap.error(f"--seqs must be positive token counts, got {args.seqs}")
    if args.steps is not None and args.steps <= args.warmup_steps + 1:
        ap.error(
            f"--steps ({args.steps}) must exceed --warmup-steps ({args.warmup_steps}) + 1 (the "
            f"profiled last step is not measured)"
        )
    for seq in args.seqs:
        if args.steps is None and DEFAULT_STEPS.get(seq, FALLBACK_STEPS) <= args.warmup_steps + 1:
            ap.error(f"--warmup-steps ({args.warmup_steps}) leaves no measured step; lower it")
    return ap, args


def main(argv=None) -> int:
    """Check everything, then run (or with ``--dry-run`` print) every run; 0 when all
    finished (TE recorded as not installed counts as finished), 1 when some failed, 3 when some
    are left for another call. Exit status 2: bad options, or fewer GPUs than ``--gpus``."""
    t_start = time.monotonic()  # --time-budget counts the planning too
    ap, args = parse_args(argv)
    try:
        runs = plan(args)
    except ScaleCheckError as e:
        ap.error(str(e))
    if args.dry_run:
        per_part: dict = {}
        for p in runs:
            per_part[p.part] = per_part.get(p.part, 0.0) + p.estimate_s
            print(f"# {p.name} ({p.part}, recompute {p.recompute}, ~{p.estimate_s:.0f} s)")
            print(shlex.join(p.run.argv))
        parts = ", ".join(f"{k} {v / 60:.1f}" for k, v in per_part.items())
        total = sum(per_part.values())
        print(f"# {len(runs)} runs, estimate {total / 60:.1f} min ({parts})")
        return 0
    facts = _device_facts()
    if 0 < facts["gpus_found"] < args.gpus:
        ap.error(f"--gpus {args.gpus}: this machine has {facts['gpus_found']} GPU(s)")
    doc = load_document(args.json)
    doc.update(facts)
    doc["gpus"] = args.gpus
    doc["date"] = str(datetime.date.today())
    doc["commands"] = doc.get("commands", []) + [sys.argv]
    doc["equivalence_rtol"], doc["lr_rtol"] = EQUIV_RTOL, LR_RTOL
    doc["resume_at"], doc["equivalence_reference"] = RESUME_AT, args.equiv_layouts[0]
    doc["model_params"] = model_params(runs[0], args.override) if runs else None
    print(f"# {doc['device']} x {doc['gpus_found']} | torch {doc['torch']} | {doc['date']}")
    print(f"# dense attention: {doc['dense_attention']}; TE: {doc['transformer_engine']}")
    write_document(doc, [args.json, args.copy_json])
    left = execute_all(runs, args, doc, t_start)
    import scale_tables

    print(scale_tables.format_all(doc), flush=True)
    if left:
        print(f"# {left} run(s) left: run the same command again", flush=True)
        return 3
    names = {p.name for p in runs}
    # TE recorded as not installed is a fact of the machine, not a failed run.
    failed = [
        r["name"]
        for r in doc["runs"]
        if r["name"] in names and "error" in r and not str(r["error"]).startswith("not installed")
    ]
    return 1 if failed else 0


def model_params(p: Planned, overrides=()) -> int:
    """Parameters of the model (all ranks together, embeddings and output layer included)."""
    cfg = load_run_config(p.model, p.layout, p.seq, overrides)
    m, vocab = cfg.model, estimate_memory._vocab(cfg)
    return int(m.num_layers * estimate_memory._layer_params(m) + 2 * vocab * m.hidden_size)


if __name__ == "__main__":
    sys.exit(main())
