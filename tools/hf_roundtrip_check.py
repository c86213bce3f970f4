"""The Hugging Face round trip of issue 52, end to end, as one command with a JSON report.

    python tools/hf_roundtrip_check.py --device cuda --out hf_check.json        # one H200
    python tools/hf_roundtrip_check.py --tiny --device cpu --steps 3 --out r.json   # CPU test

Steps (each one timed; the first that fails ends the check, its command and output tail in
the report):

1. ``build``: a random Llama made by ``transformers`` from a ``LlamaConfig`` (no download):
   125M-shaped (12 layers, hidden 768, 12 heads in 4 KV groups, MLP 2048, vocabulary 32,000,
   RoPE base 500k, 16,384 positions), or ``--tiny`` (4 layers, hidden 64, 4 heads in 2 groups,
   vocabulary 384); ``save_pretrained`` as safetensors, no tokenizer, so the run uses the byte
   tokenizer (258 ids, inside either vocabulary) and the built-in synthetic corpus.
2. ``import``: ``megatron-s2-hf import`` with ``--s2-pattern DS`` (half the layers S2, the
   attention weights shared) at ``--seq-length`` (16,384; tiny 128).
3. ``train``: ``python -m megatron_s2.training --config run.yaml`` for ``--steps`` steps (100)
   of ``--global-batch-size`` sequences at that length, bf16 on the GPU, fp32 in the trainer's
   CPU mode; first and last loss and tokens/s from the run's ``summary.json`` /
   ``metrics.jsonl``.
4. ``export``: ``megatron-s2-hf export`` of the trained run (bf16 on the GPU, fp32 on the CPU).
5. ``ours``: the trained checkpoint through the trainer's own model
   (``megatron_s2.training.evaluation.model.load_eval_model``, the run's precision) on a fresh
   random batch of ``--length`` tokens (a multiple of the S2 block): our logits; and the same
   weights with every layer dense (our dense twin).
6. ``compare``: the export loaded with ``megatron_s2.hf.s2_attention.load_s2_model`` (the
   ``"s2"`` attention) and with ``attn_implementation="sdpa"`` (every layer dense), same dtype,
   same tokens; their logits against ours.

Three pairs of logits are compared (:func:`logit_stats`: max and mean |diff|, the mean over
std(ours), top-1 agreement, the mean inside and past the S2 local window):

* ``s2_vs_ours``: the S2 load against ours, the pair under test;
* ``dense_vs_ours_dense``: the sdpa load against our dense twin: the same weights and the same
  attention on both sides, so what differs is only how the two implementations round (fused
  QKV vs separate projections, Megatron's vs transformers' RoPE, RMSNorm, residual adds, dense
  attention kernels). This is the noise floor, measured on this model, at this length;
* ``dense_vs_ours``: the sdpa load against ours: what S2 changes.

The verdict (``"verdict": "PASS"`` only if every check holds; bf16 on the GPU / fp32 on the
CPU):

* ``s2_within_noise_of_dense_pair``: mean |S2 load - ours| <= 2 x mean |sdpa load - our dense
  twin| (or <= 5e-3 / 1e-6 x std(ours), where the noise is smaller still). Why 2: the S2 layers
  run the same s2attn kernel on both sides, so the S2 pair adds no rounding of its own beyond
  the dense pair's; 2 leaves room for the two models' different activations.
* ``s2_mean_within_tolerance``: mean |S2 load - ours| <= 5e-2 / 1e-4 x std(ours), a fixed cap
  whatever the noise floor says. Why 5e-2 in bf16: measured on the CPU (2026-11-28, 4,096
  tokens, this 125M shape, random weights), one bf16 forward of ``transformers`` is 1.5% of
  the logits' std from its fp32 forward on average (1.2% inside the local window, 1.6% past
  it: it grows with the position). Two independent bf16 implementations are then about
  sqrt(2) x 1.5% = 2.1% apart, more at 16k; a 2e-2 cap would fail a correct model, 5e-2 leaves
  a factor 2. A wrong S2 layer moves the logits by far more: dense instead of S2 is 19% of the
  std at 4k (26% past the window) on the same model. In fp32 the two sides differ by float
  rounding only (~1e-6).
* ``s2_top1_agreement``: the top-1 token of the S2 load agrees with ours at no fewer positions
  than the dense pair's minus 1% (0.1% in fp32). Not a fixed 99%: a barely trained model's two
  best logits are often closer than the rounding noise (the CPU measurement above: 95% top-1
  agreement between bf16 and fp32 of the same random model), so a fixed rate would fail a
  correct model; the dense pair shows how often rounding alone flips the top token here.
* ``s2_differs_from_dense``: past the S2 local window, mean |sdpa load - ours| >= 4 x mean
  |S2 load - ours|. Without it the check could not fail: a loader that ran the S2 layers densely
  would pass the others whenever S2 changed the logits less than the noise. Inside the window
  (``prefix``: every S2 row there is the full causal row) dense and S2 agree up to rounding.

The work directory (``--work-dir``, default a fresh temporary one) holds the checkpoints, the
run and the logits; it is deleted after a PASS unless ``--keep-work``. The report is written
after every step, so an interrupted check still leaves what it did.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

# The check's clock starts with the process: --time-limit covers its own imports too.
PROCESS_START = time.monotonic()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS = os.path.abspath(__file__)

# The model shapes (LlamaConfig keywords). The tiny one has head size 16, the S2 kernels'
# smallest, and a vocabulary above the byte tokenizer's 258 ids.
SHAPES = {
    "125m": dict(
        num_hidden_layers=12,
        hidden_size=768,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        vocab_size=32000,
        rope_theta=500000.0,
        max_position_embeddings=16384,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=384,
        rope_theta=500000.0,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}
# The S2 layers' settings: the project's 125M configs (64-token blocks, a 1k-token local window,
# a stripe every 8th block: ~1/8 of the far keys at 16k); the tiny one scaled to its lengths
# (a 32-token window).
S2_SETTINGS = {
    "125m": {"block_size": 64, "local_blocks": 16, "vert_stride": 8, "head_offset": 0},
    "tiny": {"block_size": 16, "local_blocks": 2, "vert_stride": 4, "head_offset": 0},
}
S2_PATTERN = "DS"
DEFAULT_SEQ = {"125m": 16384, "tiny": 128}
# Tolerances per compute dtype (module docstring).
TOLERANCES = {
    "bfloat16": {
        "tol_mean": 5e-2,
        "noise_factor": 2.0,
        "floor": 5e-3,
        "top1_slack": 0.01,
        "min_dense_ratio": 4.0,
    },
    "float32": {
        "tol_mean": 1e-4,
        "noise_factor": 2.0,
        "floor": 1e-6,
        "top1_slack": 0.001,
        "min_dense_ratio": 4.0,
    },
}
STEP_NAMES = ("build", "import", "train", "export", "ours", "compare")
TAIL_CHARS = 4000


# ------------------------------------------------------------------------------------ arguments
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Hugging Face round trip: build a random Llama, import it with half the "
        "layers S2, train, export, and compare transformers' logits (S2 attention) with ours.",
    )
    p.add_argument("--out", required=True, help="the JSON report to write")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU test) instead of 125M")
    p.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    p.add_argument(
        "--seq-length", type=int, default=None, help="training length (16384; --tiny 128)"
    )
    p.add_argument(
        "--length",
        type=int,
        default=None,
        help="length of the compared batch, a multiple of the S2 block (default: --seq-length)",
    )
    p.add_argument(
        "--global-batch-size", type=int, default=2, help="sequences per step (default 2)"
    )
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (default 6e-4)")
    p.add_argument("--seed", type=int, default=0, help="model init and compared tokens")
    p.add_argument("--work-dir", default=None, help="default: a new temporary directory")
    p.add_argument("--keep-work", action="store_true", help="keep the work directory")
    p.add_argument(
        "--time-limit",
        type=float,
        default=480.0,
        help="seconds for the whole check (default 480); a step past it fails the check",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p


def _settings(args) -> dict:
    """The check's settings from the arguments; raises ValueError naming the bad option."""
    shape = "tiny" if args.tiny else "125m"
    seq = args.seq_length or DEFAULT_SEQ[shape]
    length = args.length or seq
    s2 = dict(S2_SETTINGS[shape])
    block = s2["block_size"]
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.global_batch_size < 1:
        raise ValueError(f"--global-batch-size must be >= 1, got {args.global_batch_size}")
    if seq < 1 or seq % block:
        raise ValueError(f"--seq-length must be a positive multiple of the S2 block {block}")
    if length < 1 or length % block:
        raise ValueError(f"--length must be a positive multiple of the S2 block {block}")
    if length > seq:
        raise ValueError(
            f"--length {length} exceeds --seq-length {seq}, the length the model trains at"
        )
    window = s2["block_size"] * s2["local_blocks"]
    if length <= window:
        raise ValueError(
            f"--length {length} must exceed the S2 local window ({window} tokens): inside it "
            f"S2 equals dense attention and the comparison cannot tell them apart"
        )
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available (use --device cpu)")
    model = dict(SHAPES[shape])
    model["max_position_embeddings"] = max(model["max_position_embeddings"], seq)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    return {
        "device": args.device,
        "shape": shape,
        "model": model,
        "s2_pattern": S2_PATTERN,
        "s2": s2,
        "s2_window_tokens": window,
        "seq_length": seq,
        "length": length,
        "steps": args.steps,
        "global_batch_size": args.global_batch_size,
        "micro_batch_size": 1,
        "lr": args.lr,
        "seed": args.seed,
        "dtype": dtype,
        "tolerance": TOLERANCES[dtype],
    }


# ------------------------------------------------------------------------------------ running
def _tail(text: Optional[str]) -> str:
    return (text or "")[-TAIL_CHARS:]


def _subprocess_env(work: str, device: str) -> dict:
    """The steps' environment: the repository importable (a ``s2attn`` link to ``kernels/``
    where the package is not installed), no Triton interpreter (CPU mode runs the PyTorch
    reference attention), no GPU for ``--device cpu``."""
    paths = [REPO]
    if importlib.util.find_spec("s2attn") is None:
        shim = os.path.join(work, "shim")
        os.makedirs(shim, exist_ok=True)
        link = os.path.join(shim, "s2attn")
        if not os.path.exists(link):
            os.symlink(os.path.join(REPO, "kernels"), link)
        paths.insert(0, shim)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in sys.path if p and p != REPO])
    env.pop("TRITON_INTERPRET", None)
    env.pop("RANK", None)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "2")
    return env


class Check:
    """The report and the steps that fill it; :meth:`write` after every step."""

    def __init__(
        self,
        out: str,
        work: str,
        settings: dict,
        time_limit: float,
        start: Optional[float] = None,
    ):
        """``time_limit`` seconds from ``start`` (a ``time.monotonic()``; default now)."""
        self.out, self.work, self.settings = out, work, settings
        self.start = time.monotonic() if start is None else start
        self.deadline = self.start + time_limit
        self.env = _subprocess_env(work, settings["device"])
        self.report: dict[str, Any] = {
            "tool": "tools/hf_roundtrip_check.py",
            "verdict": "RUNNING",
            "failed_step": None,
            "reason": None,
            "settings": settings,
            "environment": _environment(),
            "work_dir": work,
            "steps": {},
            "comparison": None,
            "total_wall_s": None,
        }
        self.write()

    def write(self) -> None:
        self.report["total_wall_s"] = round(time.monotonic() - self.start, 2)
        tmp = self.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.report, f, indent=2)
        os.replace(tmp, self.out)

    def run(self, name: str, cmd: list[str]) -> dict:
        """Run step ``name`` as ``cmd`` (a subprocess in the repository root); record its wall
        time, and on failure its command and output tail. Returns the step's record."""
        record: dict[str, Any] = {"command": shlex.join(cmd)}
        self.report["steps"][name] = record
        left = self.deadline - time.monotonic()
        if left <= 0:
            return self._failed(name, record, "no time left (--time-limit)")
        print(f"[hf-check] {name}: {record['command']}", flush=True)
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=left
            )
        except subprocess.TimeoutExpired as e:
            record["wall_s"] = round(time.monotonic() - t0, 2)
            record["stdout_tail"] = _tail(_text(e.stdout))
            record["stderr_tail"] = _tail(_text(e.stderr))
            return self._failed(name, record, f"timed out after {left:.0f} s (--time-limit)")
        record["wall_s"] = round(time.monotonic() - t0, 2)
        record["returncode"] = proc.returncode
        if proc.returncode != 0:
            record["stdout_tail"] = _tail(proc.stdout)
            record["stderr_tail"] = _tail(proc.stderr)
            return self._failed(name, record, f"exit code {proc.returncode}")
        record["ok"] = True
        print(f"[hf-check] {name}: done in {record['wall_s']} s", flush=True)
        self.write()
        return record

    def _failed(self, name: str, record: dict, why: str) -> dict:
        record["ok"] = False
        self.fail(name, f"step {name!r} failed: {why}")
        return record

    def fail(self, step: Optional[str], reason: str) -> None:
        if self.report["verdict"] != "FAIL":
            self.report.update(verdict="FAIL", failed_step=step, reason=reason)
        print(f"[hf-check] FAIL: {reason}", file=sys.stderr, flush=True)
        self.write()

    @property
    def failed(self) -> bool:
        return self.report["verdict"] == "FAIL"


def _text(b) -> str:
    if b is None:
        return ""
    return b.decode(errors="replace") if isinstance(b, bytes) else b


def _environment() -> dict:
    """Python and the packages' versions, read from their metadata (importing them here would
    cost this process seconds and, for torch, memory it never uses)."""
    from importlib import metadata

    info = {"python": platform.python_version(), "host": platform.node()}
    for dist in ("torch", "transformers", "triton", "megatron-core", "safetensors"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:  # reported; the step that needs it fails
            info[dist] = None
    return info


def _worker(step: str, work: str) -> list[str]:
    return [
        sys.executable,
        THIS,
        "--worker",
        step,
        "--out",
        os.path.join(work, "unused.json"),
        work,
    ]


def run_check(args, start: Optional[float] = None) -> dict:
    """Run every step (module docstring); returns the report (also written to ``args.out``).
    ``start``: the ``time.monotonic()`` that ``--time-limit`` counts from (default now)."""
    settings = _settings(args)
    work = os.path.abspath(args.work_dir or tempfile.mkdtemp(prefix="hf_roundtrip_"))
    os.makedirs(work, exist_ok=True)
    leftovers = [n for n in ("hf", "imported", "run", "exported") if os.path.exists(f"{work}/{n}")]
    if leftovers:
        raise ValueError(f"--work-dir {work} already holds {', '.join(leftovers)}: give a new one")
    with open(os.path.join(work, "settings.json"), "w") as f:
        json.dump(settings, f, indent=2)
    check = Check(os.path.abspath(args.out), work, settings, args.time_limit, start)
    s = settings
    py = sys.executable
    hf, imported, run, exported = (
        os.path.join(work, n) for n in ("hf", "imported", "run", "exported")
    )
    steps = [
        ("build", _worker("build", work)),
        (
            "import",
            [
                py, "-m", "megatron_s2.hf.cli", "import", hf, imported,
                "--seq-length", str(s["seq_length"]),
                "--s2-pattern", s["s2_pattern"],
                "--s2-settings", json.dumps(s["s2"]),
                "--name", "hf-roundtrip",
            ],
        ),
        ("train", _train_command(s, work)),
        (
            "export",
            [py, "-m", "megatron_s2.hf.cli", "export", run, exported, "--dtype", s["dtype"]],
        ),
        ("ours", _worker("ours", work)),
        ("compare", _worker("compare", work)),
    ]  # fmt: skip
    for name, cmd in steps:
        record = check.run(name, cmd)
        if check.failed:
            break
        try:
            if name == "train":
                record.update(_training_record(run))
            elif name in ("build", "ours"):
                record.update(_read_json(os.path.join(work, f"{name}.json")))
            elif name == "compare":
                comparison = _read_json(os.path.join(work, "compare.json"))
                check.report["comparison"] = comparison
                if not comparison["pass"]:
                    check.fail("compare", "; ".join(comparison["failures"]))
        except Exception as e:  # an unreadable result is the step's failure
            record["ok"] = False
            record["error"] = _tail(traceback.format_exc())
            check.fail(name, f"step {name!r}: its result cannot be read ({e})")
        check.write()
        if check.failed:
            break
    if not check.failed:
        check.report.update(verdict="PASS")
    check.write()
    if check.report["verdict"] == "PASS" and not args.keep_work and args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
        check.report["work_dir"] = None
        check.write()
    return check.report


def _train_command(s: dict, work: str) -> list[str]:
    """The trainer on the imported run.yaml: the built-in synthetic corpus (byte tokens), one
    sequence per micro-batch, a checkpoint at the end, a loss record every step."""
    warmup = max(1, s["steps"] // 10)
    tokens = s["steps"] * s["global_batch_size"] * s["seq_length"]
    return [
        sys.executable,
        "-m",
        "megatron_s2.training",
        "--config",
        os.path.join(work, "imported", "run.yaml"),
        "name=hf-roundtrip",
        f"logging.run_dir={os.path.join(work, 'run')}",
        "data.demo=true",
        f"data.demo_dir={os.path.join(work, 'demo')}",
        f"data.cache_dir={os.path.join(work, 'cache')}",
        # Enough documents for the run to read each token once (the corpus is byte-level:
        # ~1,700 tokens a document).
        f"data.demo_num_docs={max(64, tokens // 1500)}",
        "data.split=100,0,0",
        f"train.train_iters={s['steps']}",
        f"train.micro_batch_size={s['micro_batch_size']}",
        f"train.global_batch_size={s['global_batch_size']}",
        f"train.precision={'bf16' if s['dtype'] == 'bfloat16' else 'fp32'}",
        f"train.seed={s['seed'] + 1}",
        "train.eval_interval=0",
        f"optimizer.lr={s['lr']}",
        f"optimizer.min_lr={s['lr'] / 10:g}",
        f"optimizer.lr_warmup_iters={warmup}",
        "checkpoint.save_interval=0",
        "checkpoint.save_at_end=true",
        "logging.log_interval=1",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.plot=false",
    ]


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def _training_record(run: str) -> dict:
    """First and last loss, tokens/s (the run's mean, and the median of the steps after the
    first tenth, which leaves out the kernels' compilation), peak memory."""
    summary = _read_json(os.path.join(run, "summary.json"))
    records = []
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                if r.get("kind") == "train":
                    records.append(r)
    records.sort(key=lambda r: r["iteration"])
    steady = [r["tokens_per_s"] for r in records[len(records) // 10 + 1 :]] or [
        r["tokens_per_s"] for r in records
    ]
    steady.sort()
    memory = [v for r in records for k, v in r.items() if k.endswith("mem_gib")]
    losses = [r["loss"] for r in records]
    if not losses or not all(math.isfinite(x) for x in losses):
        raise ValueError(f"the run's losses are missing or not finite: {losses[:5]}")
    return {
        "iterations": summary["iteration"],
        "stopped_by": summary["stopped_by"],
        "first_loss": summary["first_loss"],
        "last_loss": summary["final_loss"],
        "tokens_per_s_mean": summary["tokens_per_s"],
        "tokens_per_s_median_steady": steady[len(steady) // 2] if steady else None,
        "tflops_per_gpu": summary["tflops_per_gpu"],
        "peak_memory_gib": max(memory) if memory else None,
        "last_checkpoint": summary["last_checkpoint"],
    }


# ------------------------------------------------------------------------------------ workers
def build_model(work: str, s: dict) -> dict:
    """Step 1: the random Llama of ``s["model"]`` (transformers' own initialisation, seeded),
    saved with ``save_pretrained`` to ``work/hf`` in fp32 safetensors."""
    import torch
    import transformers

    torch.manual_seed(s["seed"])
    config = transformers.LlamaConfig(**s["model"])
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(os.path.join(work, "hf"), safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    gpu = torch.cuda.get_device_name(0) if s["device"] == "cuda" else None
    return {"parameters": params, "architecture": type(model).__name__, "gpu": gpu}


def our_logits(work: str, s: dict) -> dict:
    """Step 5: the trained checkpoint through the trainer's model at the run's precision, on
    ``s["length"]`` random byte tokens (``work/tokens.pt``): logits ``[1, length, vocab]`` fp32
    to ``work/ours.pt``; and the same weights with every layer dense (``work/ours_dense.pt``),
    the twin of ``transformers``' sdpa load that measures the rounding noise between the two
    implementations."""
    import dataclasses

    import torch

    if s["device"] == "cpu":
        import megatron.core.distributed  # noqa: F401  (before CPU mode patches torch)

    from megatron_s2.training.build import Runtime, build_run, load_weights
    from megatron_s2.training.evaluation.model import check_lengths, load_eval_model

    em = load_eval_model(None, os.path.join(work, "run", "checkpoints"), max_length=s["length"])
    check_lengths(em.cfg, [s["length"]], allow_extrapolation=False, what="--length")
    gen = torch.Generator().manual_seed(s["seed"] + 7)
    # Byte tokens (0..255): what the model read in training, drawn at random.
    tokens = torch.randint(0, 256, (1, s["length"]), generator=gen)
    torch.save(tokens, os.path.join(work, "tokens.pt"))
    positions = torch.arange(s["length"]).unsqueeze(0)

    def forward(chunks) -> tuple[Any, float]:
        (chunk,) = chunks
        chunk.eval()
        t0 = time.monotonic()
        with torch.no_grad():
            out = chunk(tokens.to(em.device), positions.to(em.device), None)
        if em.device.type == "cuda":
            torch.cuda.synchronize()
        return out.float().cpu(), time.monotonic() - t0

    logits, seconds = forward(em.model)
    torch.save(logits, os.path.join(work, "ours.pt"))
    shape = list(logits.shape)
    del em.model[:], logits
    # The dense twin: the same run config with attention None (every layer dense), built and
    # loaded as load_eval_model does, in the process groups it started.
    dense_cfg = dataclasses.replace(em.cfg, attention=None)
    model = dataclasses.replace(em.cfg.model, seq_length=max(s["length"], em.cfg.model.seq_length))
    runtime = Runtime.detect(em.cfg.train.precision)
    parts = build_run(model, em.cfg.parallel, dense_cfg.schedule(), em.vocab_size, runtime)
    load_weights(parts, os.path.dirname(em.checkpoint), em.iteration)
    dense_logits, dense_seconds = forward(parts.model)
    torch.save(dense_logits, os.path.join(work, "ours_dense.pt"))
    return {
        "checkpoint": em.checkpoint,
        "iteration": em.iteration,
        "logits_shape": shape,
        "forward_s": {"s2": round(seconds, 3), "dense": round(dense_seconds, 3)},
        "precision": em.cfg.train.precision,
    }


def logit_stats(ours, other, window: int) -> dict:
    """How far ``other``'s logits ``[1, s, V]`` are from ``ours`` (fp32 tensors, same device):
    max and mean absolute difference, the mean relative to std(ours), top-1 agreement, and the
    mean difference on the positions inside (``prefix``) and past (``tail``) the S2 local window
    of ``window`` tokens."""
    diff = (ours - other).abs()
    std = float(ours.std())
    top1 = float((ours.argmax(-1) == other.argmax(-1)).float().mean())
    return {
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "ours_std": std,
        "mean_abs_diff_over_std": float(diff.mean()) / std,
        "top1_agreement": top1,
        "prefix_tokens": window,
        "prefix_mean_abs_diff": float(diff[:, :window].mean()),
        "tail_mean_abs_diff": float(diff[:, window:].mean()),
        "tail_top1_agreement": float(
            (ours[:, window:].argmax(-1) == other[:, window:].argmax(-1)).float().mean()
        ),
    }


def judge(s2: dict, pair: dict, dense: dict, tol: dict) -> tuple[bool, list[str], dict]:
    """The verdict (module docstring) from :func:`logit_stats` of the S2 load against ours
    (``s2``), of the dense load against our dense twin (``pair``: the rounding noise between
    the two implementations) and of the dense load against ours (``dense``): (pass, the failed
    checks in words, each check's outcome)."""
    failures = []
    std = s2["ours_std"]
    ok_cap = s2["mean_abs_diff_over_std"] <= tol["tol_mean"]
    if not ok_cap:
        failures.append(
            f"S2 load vs ours: mean |diff| = {s2['mean_abs_diff_over_std']:.3g} x std(logits) "
            f"> tolerance {tol['tol_mean']:g}"
        )
    allowed = max(tol["noise_factor"] * pair["mean_abs_diff"], tol["floor"] * std)
    ok_noise = s2["mean_abs_diff"] <= allowed
    if not ok_noise:
        failures.append(
            f"S2 load vs ours: mean |diff| = {s2['mean_abs_diff']:.3g}, more than "
            f"{tol['noise_factor']:g} x the dense pair's {pair['mean_abs_diff']:.3g} (the "
            f"rounding noise between transformers and ours)"
        )
    ok_top1 = s2["top1_agreement"] >= pair["top1_agreement"] - tol["top1_slack"]
    if not ok_top1:
        failures.append(
            f"S2 load vs ours: top-1 agreement {s2['top1_agreement']:.4f}, below the dense "
            f"pair's {pair['top1_agreement']:.4f} by more than {tol['top1_slack']:g}"
        )
    # Past the window: how much further the dense load is from ours than the S2 load (an
    # S2 load that matches ours exactly, as in fp32 on the CPU, makes it infinite).
    dense_tail, s2_tail = dense["tail_mean_abs_diff"], s2["tail_mean_abs_diff"]
    ratio = dense_tail / s2_tail if s2_tail > 0 else (math.inf if dense_tail > 0 else 0.0)
    ok_dense = ratio >= tol["min_dense_ratio"]
    if not ok_dense:
        failures.append(
            f"dense (sdpa) load vs ours past the S2 window: mean |diff| only {ratio:.3g} x the "
            f"S2 load's (need >= {tol['min_dense_ratio']:g}): S2 does not change the logits "
            f"clearly, so the comparison cannot tell S2 from dense"
        )
    checks = {
        "s2_mean_within_tolerance": ok_cap,
        "s2_within_noise_of_dense_pair": ok_noise,
        "s2_allowed_mean_abs_diff": allowed,
        "s2_top1_agreement": ok_top1,
        "s2_differs_from_dense": ok_dense,
        # JSON has no infinity: null where the S2 load matched ours exactly.
        "dense_over_s2_tail_ratio": ratio if math.isfinite(ratio) else None,
    }
    return not failures, failures, checks


def compare(work: str, s: dict) -> dict:
    """Step 6: the export in ``transformers``, with the S2 attention and all dense (sdpa),
    against ``work/ours.pt``; the verdict in ``work/compare.json``."""
    import torch
    import transformers

    from megatron_s2.hf.s2_attention import layer_patterns, load_s2_model

    device = torch.device(s["device"])
    dtype = getattr(torch, s["dtype"])
    path = os.path.join(work, "exported")
    tokens = torch.load(os.path.join(work, "tokens.pt")).to(device)
    ours = torch.load(os.path.join(work, "ours.pt")).to(device)
    ours_dense = torch.load(os.path.join(work, "ours_dense.pt")).to(device)
    config = transformers.AutoConfig.from_pretrained(path)
    patterns = layer_patterns(config)
    kinds = "".join("D" if p is None else "S" for p in patterns)
    windows = {p.block_size * p.local_blocks for p in patterns if p is not None}
    if len(windows) != 1:
        raise ValueError(f"expected one S2 local window, the export's layers have {windows}")
    (window,) = windows

    def logits_of(model) -> tuple[Any, float]:
        model.to(device).eval()
        t0 = time.monotonic()
        with torch.no_grad():
            out = model(input_ids=tokens).logits.float()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out, time.monotonic() - t0

    model = load_s2_model(path, dtype=dtype)
    impl = model.config._attn_implementation
    s2_logits, s2_s = logits_of(model)
    del model
    dense = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa"
    )
    dense_logits, dense_s = logits_of(dense)
    del dense
    if s2_logits.shape != ours.shape:
        raise ValueError(f"logits shapes differ: transformers {s2_logits.shape}, ours {ours.shape}")
    s2_stats = logit_stats(ours, s2_logits, window)
    pair_stats = logit_stats(ours_dense, dense_logits, window)
    dense_stats = logit_stats(ours, dense_logits, window)
    passed, failures, checks = judge(s2_stats, pair_stats, dense_stats, s["tolerance"])
    result = {
        "pass": passed,
        "failures": failures,
        "checks": checks,
        "tolerance": s["tolerance"],
        "dtype": s["dtype"],
        "length": s["length"],
        "layer_kinds": kinds,
        "s2_attn_implementation": impl,
        "s2_window_tokens": window,
        "s2_vs_ours": s2_stats,
        "dense_vs_ours_dense": pair_stats,
        "dense_vs_ours": dense_stats,
        "ours_dense_vs_ours": logit_stats(ours, ours_dense, window),
        "s2_vs_dense_top1_agreement": float(
            (s2_logits.argmax(-1) == dense_logits.argmax(-1)).float().mean()
        ),
        "forward_s": {"s2": round(s2_s, 3), "dense": round(dense_s, 3)},
    }
    return result


def _run_worker(step: str, work: str) -> None:
    s = _read_json(os.path.join(work, "settings.json"))
    if step == "build":
        result, name = build_model(work, s), "build.json"
    elif step == "ours":
        result, name = our_logits(work, s), "ours.json"
    elif step == "compare":
        result, name = compare(work, s), "compare.json"
    else:
        raise SystemExit(f"unknown worker step {step!r}")
    with open(os.path.join(work, name), "w") as f:
        json.dump(result, f, indent=2)


def main(argv: Optional[list[str]] = None, start: Optional[float] = None) -> int:
    """Exit code 0 on PASS, 1 on FAIL, 2 for bad options (nothing run). ``--time-limit`` counts
    from ``start`` (a ``time.monotonic()``): the process's start on the command line, else the
    call (a caller that imported this module long before, as a test does, keeps its budget)."""
    parser = _parser()
    parser.add_argument("work", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _run_worker(args.worker, args.work)
        return 0
    try:
        report = run_check(args, start)
    except ValueError as e:
        print(f"[hf-check] error: {e}", file=sys.stderr)
        return 2
    print(
        f"[hf-check] {report['verdict']} in {report['total_wall_s']} s"
        + (f": {report['reason']}" if report["reason"] else "")
        + f"; report {args.out}",
        flush=True,
    )
    return 0 if report["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main(start=PROCESS_START))
