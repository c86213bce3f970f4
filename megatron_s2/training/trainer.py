"""The pretraining run of ``megatron-s2-train``: :class:`Trainer` and :func:`train`.

The trainer wires components together, each of which decides for itself when it acts:

* :mod:`.build` starts the process groups and builds the model chunks in DDP and the optimizer
  (from the building blocks of :mod:`.parallel`), as the evaluator does;
* :mod:`.step` runs one global batch through Megatron's pipeline schedule;
* :class:`~.metrics.MetricsLogger` logs (``should_log``), :class:`~.metrics.ThroughputMeter`
  times the training between records;
* :class:`~.evaluation.validation.Evaluator` computes the validation loss (``should_run``);
* :class:`~.checkpointing.Checkpointer` resumes and saves (``should_save``);
* :class:`~.preemption.Preemption` stops on SIGTERM or Ctrl-C (``should_stop``).

Before anything is built, the run claims its directory (:mod:`.run_dir`: lock, ``--restart``,
writable directories), finds the checkpoint to resume from (the newest intact one) and compares
its stored run config with this one (:func:`~.run_config.resume_changes`): settings that cannot
change are refused, plan settings are applied or kept (``checkpoint.on_resume``) with a note. A
finished run has nothing to do and leaves its directory untouched.

Without CUDA the trainer runs in the explicit CPU mode (:mod:`megatron_s2.training.cpu_mode`):
gloo, fp32, PyTorch reference attention. A GPU run uses NCCL, bf16 and the Triton kernels.
The command line is in :mod:`megatron_s2.training.cli`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from .build import Runtime, build_run, model_vocab_size
from .checkpointing import (
    Checkpointer,
    ResumeCandidate,
    estimate_checkpoint_bytes,
    find_resume,
    read_checkpoint_config,
    stored_run_dir,
)
from .data import Datasets, build_datasets, chunk_micro_batches
from .errors import CheckpointError, NonFiniteLossError, RunDirError
from .evaluation.validation import Evaluator
from .metrics import (
    MetricsLogger,
    ThroughputMeter,
    memory_gib,
    model_flops_per_iteration,
    plot_loss_curve,
    read_jsonl,
)
from .preemption import Preemption
from .run_config import ConfigError, RunConfig, format_changes, resume_changes
from .run_dir import check_free_space, on_rank0, open_run_directory, previous_run
from .step import ForwardBackward, zero_grad

__all__ = ["Trainer", "train", "check_config", "RunResult", "StepResult", "NonFiniteLossError"]

# Perplexity is reported as exp(loss); beyond this loss it only overflows.
MAX_LOSS_FOR_PPL = 50.0
PREFIX = "[megatron-s2]"


def coverage_beyond_length_note(cfg: RunConfig) -> str:
    """A note (one line, or "" when there is nothing to say) for a schedule that covers every
    key block at ``model.seq_length`` but leaves blocks unseen beyond it (possible when the local
    window spans the whole training length). Such a model trains, but a longer run refuses its
    schedule and ``megatron-s2-hf export`` refuses the model (transformers runs it at any
    length), which the user would otherwise learn only after training."""
    reason = cfg.coverage_holes_beyond_length()
    if reason is None:
        return ""
    return (
        f"{PREFIX} note: the S2 layers cover every key block at {cfg.model.seq_length} tokens "
        f"but not beyond: a longer run refuses this schedule and megatron-s2-hf export refuses "
        f"the model (unless --allow-coverage-holes): {reason}"
    )


@dataclass
class RunResult:
    """What a run did (returned by :func:`train`)."""

    iteration: int
    losses: dict  # iteration -> train loss (every iteration of this process)
    valid_losses: dict
    stopped_by: str  # "done", "sigterm", "sigint", "nothing to do"
    tokens_per_s: float  # over the iterations of this process
    tflops_per_gpu: float
    run_dir: str
    last_checkpoint: Optional[str]
    resumed_from: Optional[str] = None  # the checkpoint this process started from


@dataclass(frozen=True)
class StepResult:
    """One optimizer step."""

    iteration: int  # the iteration it completed
    loss: float
    grad_norm: float  # NaN when the optimizer reports none
    lr: float  # the learning rate this step used (set before it, moved on after it)


def _rank0() -> bool:
    return torch.distributed.get_rank() == 0


def check_config(cfg: RunConfig) -> Runtime:
    """The checks of ``cfg`` the trainer makes before it starts anything (``--print-config``
    makes them too): the precision on this machine, the attention schedule against the model
    and layout, the layout against the launch's world size (torchrun's ``WORLD_SIZE``, else 1).
    Raises :class:`ConfigError`; returns the runtime it detected."""
    runtime = Runtime.detect(cfg.train.precision)
    cfg.schedule()
    cfg.validate(world_size=runtime.env.world_size)
    return runtime


class Trainer:
    """A training run of ``cfg``, set up on construction (collective over all ranks).

    Construction starts torch.distributed and Megatron's parallel groups, claims the run
    directory, resolves the checkpoint to resume from and the settings to use, then builds the
    data, the model, optimizer and LR schedule and loads the checkpoint. :meth:`train` runs the
    loop; :meth:`train_step` is one iteration. ``restart``: move a previous run in the run
    directory aside and start afresh (the CLI's ``--restart``).

    When the checkpoint is already at ``train.train_iters`` there is nothing to do
    (:attr:`nothing_to_do`): nothing is built or written and :meth:`train` returns at once.
    """

    def __init__(self, cfg: RunConfig, *, restart: bool = False):
        self.cfg = cfg
        self.runtime = check_config(cfg)
        self.gpu, self.bf16 = self.runtime.gpu, self.runtime.bf16
        self.schedule = cfg.schedule()
        self.runtime.check(cfg.model)
        self.runtime.start(cfg.parallel, seed=cfg.train.seed, deterministic=cfg.train.deterministic)
        self.world_size = torch.distributed.get_world_size()
        self.rank0 = _rank0()
        self.device = self.runtime.device
        self._locks: list = []
        self.train_data: list = []
        self.metrics: Optional[MetricsLogger] = None
        self.preemption = Preemption(simulate_at=cfg.debug.sigterm_at_iter)
        self.nothing_to_do = False
        self._announce_mode()
        try:
            self._setup(restart)
        except BaseException:
            self.close()
            raise

    def _setup(self, restart: bool) -> None:
        # The run directory: lock, --restart, writable (rank 0 acts, every rank learns).
        def claim():
            info, self._locks = open_run_directory(
                self.cfg.run_dir,
                self.cfg.checkpoint_dir,
                restart=restart,
                stored_owner=stored_run_dir,
            )
            return info

        for old, new in on_rank0(claim).moved_aside:
            self._print(f"{PREFIX} --restart: moved the previous run {old} to {new}")

        # The checkpoint to resume from and the settings to run with, before anything is built.
        candidate, saved, saved_vocab = on_rank0(self._locate_checkpoint)
        self.resume_candidate: Optional[ResumeCandidate] = candidate
        if candidate is not None:
            if candidate.problems:
                self._warn(
                    "skipped damaged checkpoint(s):\n  "
                    + "\n  ".join(candidate.problems)
                    + f"\n  resuming from the newest intact checkpoint {candidate.path}"
                )
            self.cfg = self._reconcile(candidate, saved)
            self.schedule = self.cfg.schedule()
            fresh = candidate.starts_fresh(self.cfg.checkpoint)
            if not fresh and candidate.iteration >= self.cfg.train.train_iters:
                self.nothing_to_do = True
                self._print(
                    f"{PREFIX} nothing to do: {candidate.path} is at iteration "
                    f"{candidate.iteration} and train.train_iters is "
                    f"{self.cfg.train.train_iters}. The run's files in {self.cfg.run_dir} are "
                    f"left as they are. Raise train.train_iters to train further, or start over "
                    f"with --restart."
                )
                return
        cfg = self.cfg
        self._write_run_config()

        self.datasets, self.vocab_size = self._build_data()
        if saved_vocab is not None and saved_vocab != self.vocab_size:
            raise ConfigError(
                f"cannot resume from {candidate.path}: its padded vocabulary has {saved_vocab} "
                f"entries, this run's {self.vocab_size} (data.tokenizer, model.vocab_size, "
                f"model.make_vocab_size_divisible_by x tensor parallel size): the embedding "
                f"shapes differ"
            )

        model, p = cfg.model, cfg.parallel
        parts = build_run(
            model,
            p,
            self.schedule,
            self.vocab_size,
            self.runtime,
            optimizer=cfg.optimizer,
            train_iters=cfg.train.train_iters,
            deterministic=cfg.train.deterministic,
        )
        self.model_config, self.model = parts.config, parts.model
        self.optimizer, self.scheduler = parts.optimizer, parts.scheduler
        self._check_checkpoint_space()

        self.checkpointer = Checkpointer(
            cfg.checkpoint,
            cfg.checkpoint_dir,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            run_config=cfg.to_dict(),
            optimizer_config=cfg.optimizer,
            padded_vocab_size=self.vocab_size,
        )
        self.iteration, self.consumed_samples = 0, 0
        self.resumed_from: Optional[str] = None
        if candidate is not None:
            resumed = self.checkpointer.load(candidate)
            self.iteration, self.consumed_samples = resumed.iteration, resumed.consumed_samples
            self.resumed_from = resumed.path
            if resumed.reset:
                self._print(
                    f"{PREFIX} starting at iteration 0 from the weights of {resumed.path} "
                    f"(checkpoint.reset_iteration: fresh LR schedule, data from its start; "
                    f"optimizer state {'loaded' if cfg.checkpoint.load_optimizer else 'new'})"
                )
            else:
                self._print(
                    f"{PREFIX} resumed from {resumed.path} (iteration {resumed.iteration}, "
                    f"{resumed.consumed_samples} samples consumed; next learning rate "
                    f"{self.optimizer.param_groups[0]['lr']:.3e})"
                )

        t = cfg.train
        dp_rank, dp_size = parts.dp_rank, parts.dp_size
        self.train_data = chunk_micro_batches(
            len(self.model),
            self.datasets.train,
            self.consumed_samples,
            t.micro_batch_size,
            dp_rank,
            dp_size,
            num_workers=t.num_workers,
        )
        self.forward_backward = ForwardBackward(
            self.model,
            num_microbatches=cfg.num_microbatches(self.world_size),
            seq_length=model.seq_length,
            micro_batch_size=t.micro_batch_size,
            device=self.device,
            context_parallel_size=p.context_parallel_size,
            pack_eod=self.datasets.eod if t.pack_documents else None,
        )
        self.evaluator = Evaluator(
            t, self.datasets.valid, self.forward_backward, dp_rank=dp_rank, dp_size=dp_size
        )
        self.metrics = MetricsLogger.from_config(
            cfg.logging, cfg.run_dir, t.train_iters, self.iteration, enabled=self.rank0
        )
        self.throughput = ThroughputMeter(
            t.global_batch_size * model.seq_length,
            model_flops_per_iteration(model, t.global_batch_size, self.vocab_size, self.schedule),
            self.world_size,
        )
        self.losses: dict[int, float] = {}
        self.valid_losses: dict[int, float] = {}
        self._describe_run(dp_size)

    # ---------------------------------------------------------------- resume resolution
    def _locate_checkpoint(self):
        """Rank 0: the checkpoint to resume from, its stored run config and padded vocabulary;
        refuses to start a new run over a previous one."""
        cfg = self.cfg
        candidate = find_resume(cfg.checkpoint, cfg.checkpoint_dir)
        if candidate is None or not candidate.own:
            # A new run (possibly from another run's weights) needs a directory without a run.
            found = previous_run(cfg.run_dir, cfg.checkpoint_dir)
            if found:
                why = (
                    "and checkpoint.resume=false"
                    if not cfg.checkpoint.resume
                    else "but no checkpoint of its own to resume from"
                )
                # Only the checkpoint directory holds the previous run: that is what to change.
                ckpt_only = cfg.checkpoint.dir is not None and found == [
                    f"checkpoints in {cfg.checkpoint_dir}"
                ]
                where = f"checkpoint.dir {cfg.checkpoint_dir}" if ckpt_only else cfg.run_dir
                if ckpt_only:
                    other = "checkpoint.dir="
                elif cfg.checkpoint.dir is not None:
                    other = "name=/logging.run_dir= and checkpoint.dir="
                else:
                    other = "name=/logging.run_dir="
                moved = cfg.checkpoint_dir if ckpt_only else cfg.run_dir
                raise RunDirError(
                    f"{where} holds a previous run ({', '.join(found)}) {why}: a new run "
                    f"there would mix the two runs' metrics and checkpoints. Start over with "
                    f"--restart (moves it to {moved}.old-<time>), or use another {other}"
                )
        if candidate is None and cfg.checkpoint.resume and cfg.checkpoint.load_dir:
            # Asked for another run's weights that are not there (its run failed, or never
            # ran): starting from random weights instead would be a silent wrong result.
            raise CheckpointError(
                f"checkpoint.load_dir {cfg.checkpoint.load_dir} holds no checkpoint (and "
                f"{cfg.checkpoint_dir} none of this run's own): this run would start from "
                f"random weights instead of the weights it names. Train that run first, fix "
                f"the path, or drop checkpoint.load_dir to start from scratch"
            )
        if candidate is None:
            return None, None, None
        saved, vocab = read_checkpoint_config(candidate.path)
        return candidate, saved, vocab

    def _reconcile(self, candidate: ResumeCandidate, saved: Optional[dict]) -> RunConfig:
        """The config to run with: refuse settings a resume cannot change, apply or keep the
        plan (``checkpoint.on_resume``), print every difference."""
        cfg = self.cfg
        if saved is None:
            self._warn(
                f"{candidate.path} stores no run config: its settings cannot be compared; the "
                f"values given now are used"
            )
            return cfg
        changes = resume_changes(saved, cfg, own=candidate.own)
        if changes.refused:
            if candidate.own:
                raise ConfigError(
                    f"cannot resume run '{saved.get('name', '?')}' from {candidate.path}: these "
                    f"settings differ from its checkpoint's, and a resumed run cannot change "
                    f"them (its weights were trained with them):\n"
                    f"{format_changes(changes.refused)}\n"
                    f"Resume with the checkpoint's values (drop these overrides), or start a new "
                    f"run: another name=/logging.run_dir=, or --restart (moves {cfg.run_dir} "
                    f"aside)."
                )
            raise ConfigError(
                f"cannot start from {candidate.path} (run '{saved.get('name', '?')}', "
                f"checkpoint.load_dir): its weights have another shape:\n"
                f"{format_changes(changes.refused)}"
            )
        if changes.noted:
            self._print(
                f"{PREFIX} starting from another run's weights ({candidate.path}); these "
                f"settings differ from that run's and are used as given now:\n"
                + format_changes(changes.noted, "that run", "now")
            )
        if changes.plan:
            if cfg.checkpoint.on_resume == "keep":
                self._print(
                    f"{PREFIX} checkpoint.on_resume=keep: resuming with the checkpoint's "
                    f"settings; these values given now are ignored "
                    f"(checkpoint.on_resume=apply uses them):\n"
                    + format_changes(changes.plan, "kept", "ignored")
                )
                cfg = cfg.keeping(saved, [c.key for c in changes.plan])
            else:
                self._print(
                    f"{PREFIX} checkpoint.on_resume=apply: resuming with changed settings (the "
                    f"LR schedule follows the new optimizer and train settings; "
                    f"checkpoint.on_resume=keep keeps the checkpoint's):\n"
                    + format_changes(changes.plan)
                )
        if changes.other:
            self._print(
                f"{PREFIX} run settings changed since the checkpoint (used as given now):\n"
                + format_changes(changes.other)
            )
        return cfg

    def _check_checkpoint_space(self) -> None:
        """Room for one checkpoint (weights + Adam state of all ranks) in the checkpoint
        directory, checked before training (collective)."""
        from megatron.core import parallel_state as ps

        params = [p for chunk in self.model for p in chunk.parameters()]
        local = torch.tensor([float(sum(p.numel() for p in params))], device=self.device)
        torch.distributed.all_reduce(local)
        # Every model-parallel shard is replicated over the data- and context-parallel ranks.
        replicas = ps.get_data_parallel_world_size(with_context_parallel=True)
        needed = estimate_checkpoint_bytes(
            int(local.item()) // replicas,
            params[0].element_size() if params else 4,
            with_optimizer=True,
        )
        on_rank0(lambda: check_free_space(self.cfg.checkpoint_dir, needed))

    # ------------------------------------------------------------------------------ setup
    def _print(self, msg: str) -> None:
        if self.rank0:
            print(msg, flush=True)

    def _warn(self, msg: str) -> None:
        if self.rank0:
            print(f"{PREFIX} warning: {msg}", file=sys.stderr, flush=True)

    def _announce_mode(self) -> None:
        if self.gpu:
            mode = (
                f"GPU mode: {torch.cuda.get_device_name()} x {self.world_size}, NCCL, "
                f"{'bf16' if self.bf16 else 'fp32'}, Triton S2 kernels"
            )
            m = self.cfg.model
            if m.transformer_impl == "transformer_engine":
                mode += ", Transformer Engine layers"
            if m.fp8 is not None:
                # The tokens/s of FP8 and bf16 runs are compared from these logs.
                mode += f", FP8 linears ({m.fp8}, {m.fp8_recipe} scaling; attention bf16)"
        else:
            attention = (
                "Triton interpreter attention (TRITON_INTERPRET=1: slow)"
                if os.environ.get("TRITON_INTERPRET") == "1"
                else "PyTorch reference attention"
            )
            mode = f"CPU mode: {self.world_size} process(es), gloo, fp32, {attention}"
        if self.cfg.train.deterministic:
            # Reruns are compared bit for bit only when the log says they were asked to be.
            mode += ", deterministic algorithms (train.deterministic)"
        self._print(f"{PREFIX} {mode}")

    def _write_run_config(self) -> None:
        if not self.rank0:
            return
        import yaml

        os.makedirs(self.cfg.run_dir, exist_ok=True)
        with open(os.path.join(self.cfg.run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(self.cfg.to_dict(), f, sort_keys=False)

    def _build_data(self) -> tuple[Datasets, int]:
        """The train/valid datasets and the model's (padded) vocabulary size. Needs
        torch.distributed: the dataset builder synchronises its index cache."""
        from .tokenizer import load_tokenizer

        cfg, d, t = self.cfg, self.cfg.data, self.cfg.train
        tokenizer = load_tokenizer(d.tokenizer)
        if d.demo:
            from .demo_corpus import ensure_demo_data

            self._print(f"{PREFIX} demo corpus in {d.demo_dir} (generated on first use)")
            extra = {"num_docs": d.demo_num_docs} if d.demo_num_docs else {}
            prefixes, weights = [ensure_demo_data(d.demo_dir, seed=0, **extra)], None
        else:
            prefixes, weights = cfg.blend()
        vocab_size = model_vocab_size(cfg.model, cfg.parallel, tokenizer)
        evaluates = bool(t.eval_interval and t.eval_iters)
        datasets = build_datasets(
            prefixes,
            weights,
            tokenizer=tokenizer,
            seq_length=cfg.model.seq_length,
            seed=t.seed,
            split=d.split,
            train_samples=t.train_iters * t.global_batch_size,
            valid_samples=t.eval_iters * t.global_batch_size if evaluates else 0,
            cache_dir=d.cache_dir,
            reset_position_ids=t.reset_position_ids,
            eod_mask_loss=t.eod_mask_loss,
            eod_first=t.eod_first,
        )
        return datasets, vocab_size

    def _describe_run(self, dp_size: int) -> None:
        cfg, m, p, t = self.cfg, self.cfg.model, self.cfg.parallel, self.cfg.train
        n_params = sum(param.numel() for chunk in self.model for param in chunk.parameters())
        self.metrics.print(
            f"{PREFIX} {cfg.name}: {n_params / 1e6:.2f}M parameters on this rank, world "
            f"{self.world_size} (TP {p.tensor_model_parallel_size}, PP "
            f"{p.pipeline_model_parallel_size}, CP {p.context_parallel_size}, DP {dp_size}), "
            f"{self.forward_backward.num_microbatches} micro-batches of {t.micro_batch_size} x "
            f"{m.seq_length} tokens per step"
            + (
                f", each packed into one sequence of documents split at EOD (id "
                f"{self.datasets.eod}; train.pack_documents)\n"
                if t.pack_documents
                else "\n"
            )
            + self.schedule.summary(
                m.num_layers, m.num_attention_heads, m.query_groups, m.seq_length
            )
        )
        note = coverage_beyond_length_note(cfg)
        if note:
            self.metrics.print(note)

    def _profiling(self, iteration: int):
        """The profiler around iteration ``iteration`` when it is ``debug.profile_step``
        (every rank writes its summary: :mod:`.profiling`), else nothing."""
        if iteration != self.cfg.debug.profile_step:
            return contextlib.nullcontext()
        from .profiling import profile_step

        self._print(f"{PREFIX} profiling iteration {iteration} (debug.profile_step)")
        rank = torch.distributed.get_rank()
        return profile_step(self.cfg.run_dir, iteration, rank, gpu=self.gpu)

    # ------------------------------------------------------------------------ one step
    def train_step(self) -> StepResult:
        """One optimizer step on the next global batch. Raises :class:`NonFiniteLossError`
        before the optimizer step on a NaN/inf loss, after it on a NaN/inf gradient norm."""
        done = self.iteration + 1
        zero_grad(self.model, self.optimizer)
        loss = self.forward_backward(
            self.train_data, poison_loss=self.cfg.debug.nan_at_iter == done
        ).loss
        last_good = self.checkpointer.last_checkpoint or "none (no checkpoint was saved yet)"
        if not math.isfinite(loss):
            raise NonFiniteLossError(
                f"loss is {loss} at iteration {done}: stopping before the optimizer step "
                f"(weights untouched). Last good checkpoint: {last_good}. Try a lower "
                f"optimizer.lr, a longer optimizer.lr_warmup_iters or a smaller "
                f"optimizer.clip_grad."
            )
        # The LR this step uses: the scheduler moves it on for the next step right after.
        lr = self.optimizer.param_groups[0]["lr"]
        _, grad_norm, _ = self.optimizer.step()
        if grad_norm is not None and not math.isfinite(grad_norm):
            # The step already used it: stop before a checkpoint can store the damage.
            raise NonFiniteLossError(
                f"gradient norm is {grad_norm} at iteration {done} (loss {loss:.4f}): "
                f"stopping without saving. Last good checkpoint: {last_good}."
            )
        self.scheduler.step(increment=1)
        self.iteration = done
        self.consumed_samples += self.cfg.train.global_batch_size
        self.losses[done] = loss
        self.throughput.step()
        self.metrics.advance(1, loss=f"{loss:.4f}")
        return StepResult(
            done,
            loss,
            float(grad_norm) if grad_norm is not None else math.nan,
            lr,
        )

    # ---------------------------------------------------------------- the other concerns
    def log_step(self, step: StepResult) -> None:
        """Close the throughput window and write the training record of ``step``."""
        speed = self.throughput.close_window()
        mem_key, mem = memory_gib()
        # Rank 0 writes the record; the most loaded rank's memory is what a layout must fit.
        peak = torch.tensor([mem], device=self.device)
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        self.metrics.log(
            {
                "iteration": step.iteration,
                "loss": step.loss,
                "lr": step.lr,
                "grad_norm": step.grad_norm,
                "tokens_per_s": speed.tokens_per_s,
                "tflops_per_gpu": speed.tflops_per_gpu,
                mem_key: mem,
                f"{mem_key}_max_rank": float(peak.item()),
                "consumed_samples": self.consumed_samples,
                "step_time_s": speed.seconds_per_iteration,
            }
        )
        device = mem_key.split("_")[0]  # "gpu", or "cpu" in the CPU mode: one process each
        per = "GPU" if device == "gpu" else "process"
        self.metrics.print(
            f"iter {step.iteration:6d}/{self.cfg.train.train_iters} | loss {step.loss:.4f} | "
            f"lr {step.lr:.3e} | grad norm {step.grad_norm:.3f} | "
            f"{speed.tokens_per_s:,.0f} tok/s | {speed.tflops_per_gpu:.2f} TFLOP/s/{per} | "
            f"{device} mem {mem:.2f} GiB"
        )

    def evaluate(self) -> float:
        """Validation loss at the current iteration, logged (its time is not training time)."""
        with self.throughput.paused():
            loss = self.evaluator.run()
            self.valid_losses[self.iteration] = loss
            self.metrics.log(
                {
                    "iteration": self.iteration,
                    "loss": loss,
                    "ppl": math.exp(min(loss, MAX_LOSS_FOR_PPL)),
                },
                prefix="valid",
            )
            self.metrics.print(
                f"{PREFIX} validation at iteration {self.iteration}: loss {loss:.4f}"
            )
        return loss

    def save(self) -> str:
        """Checkpoint the current state (its time is not training time)."""
        with self.throughput.paused():
            path = self.checkpointer.save(self.iteration, self.consumed_samples)
            self.metrics.print(f"{PREFIX} saved checkpoint {path}")
        return path

    # -------------------------------------------------------------------------- the loop
    def train(self) -> RunResult:
        """Train up to ``train.train_iters`` or until SIGTERM/Ctrl-C; write the summary
        (rank 0). With nothing to do, return at once and leave the run directory untouched."""
        if self.nothing_to_do:
            self.close()
            return RunResult(
                iteration=self.resume_candidate.iteration,
                losses={},
                valid_losses={},
                stopped_by="nothing to do",
                tokens_per_s=0.0,
                tflops_per_gpu=0.0,
                run_dir=self.cfg.run_dir,
                last_checkpoint=self.resume_candidate.path,
                resumed_from=self.resume_candidate.path,
            )
        stopped_by = "done"
        self.preemption.install()
        self.throughput.start()
        try:
            for chunk in self.model:
                chunk.train()
            while self.iteration < self.cfg.train.train_iters:
                with self._profiling(self.iteration + 1):
                    step = self.train_step()
                logged = self.metrics.should_log(self.iteration)
                if logged:
                    self.log_step(step)
                if self.evaluator.should_run(self.iteration):
                    self.evaluate()
                if self.preemption.should_stop(self.iteration, self.device):
                    stopped_by = self.preemption.reason
                    if not logged:  # metrics.jsonl ends where the run stopped
                        self.log_step(step)
                    what = "Ctrl-C" if stopped_by == "sigint" else "SIGTERM"
                    self.metrics.print(
                        f"{PREFIX} {what}: saving a checkpoint at iteration "
                        f"{self.iteration} and stopping"
                    )
                    self.save()
                    break
                if self.checkpointer.should_save(self.iteration):
                    self.save()
            else:
                if self.checkpointer.should_save_at_end(self.iteration):
                    self.save()
        finally:
            self.close()
        self.throughput.finish()
        speed = self.throughput.mean()
        result = RunResult(
            iteration=self.iteration,
            losses=self.losses,
            valid_losses=self.valid_losses,
            stopped_by=stopped_by,
            tokens_per_s=speed.tokens_per_s,
            tflops_per_gpu=speed.tflops_per_gpu,
            run_dir=self.cfg.run_dir,
            last_checkpoint=self.checkpointer.last_checkpoint,
            resumed_from=self.resumed_from,
        )
        if self.rank0:
            write_summary(result, self.cfg.name, plot=self.cfg.logging.plot)
        return result

    def close(self) -> None:
        """Restore the signal handlers, close the logs, shut data-loader workers down (they
        ignore SIGTERM, see :mod:`megatron_s2.training.data`) and release the run directory.
        Safe to call more than once and on a partly set-up trainer."""
        self.preemption.uninstall()
        if self.metrics is not None:
            self.metrics.close()
        for it in self.train_data:
            it.close()
        self.train_data = []
        for lock in self._locks:
            lock.release()
        self._locks = []


def train(cfg: RunConfig, *, restart: bool = False) -> RunResult:
    """Run (or resume) the training described by ``cfg``; collective over all ranks.
    ``restart``: move a previous run in the run directory aside and start afresh."""
    return Trainer(cfg, restart=restart).train()


def _summary_losses(jsonl: str) -> tuple[list, list]:
    """(iteration, loss) of the train and of the validation records of ``metrics.jsonl``: the
    whole run's, across resumes."""
    records = read_jsonl(jsonl) if os.path.exists(jsonl) else []

    def curve(kind: str) -> list:
        return sorted(
            (r["iteration"], r["loss"]) for r in records if r.get("kind") == kind and "loss" in r
        )

    return curve("train"), curve("valid")


def write_summary(r: RunResult, name: str, *, plot: bool) -> None:
    """Write ``summary.json`` (and ``loss.png`` when ``plot``) into the run directory and print
    the run's summary. Losses are quoted from ``metrics.jsonl`` (the whole run, what the plot
    shows); throughput is this process's."""
    jsonl = os.path.join(r.run_dir, "metrics.jsonl")
    png = None
    if plot and os.path.exists(jsonl):
        png = plot_loss_curve(jsonl, os.path.join(r.run_dir, "loss.png"), title=name)
    train_losses, valid_losses = _summary_losses(jsonl)
    summary = {
        "name": name,
        "iteration": r.iteration,
        "stopped_by": r.stopped_by,
        "first_loss": train_losses[0][1] if train_losses else None,
        "first_loss_iteration": train_losses[0][0] if train_losses else None,
        "final_loss": train_losses[-1][1] if train_losses else None,
        "final_loss_iteration": train_losses[-1][0] if train_losses else None,
        "final_valid_loss": valid_losses[-1][1] if valid_losses else None,
        "final_valid_iteration": valid_losses[-1][0] if valid_losses else None,
        "tokens_per_s": r.tokens_per_s,
        "tflops_per_gpu": r.tflops_per_gpu,
        "resumed_from": r.resumed_from,
        "metrics": jsonl,
        "loss_curve": png,
        "last_checkpoint": r.last_checkpoint,
    }
    with open(os.path.join(r.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    lines = [f"{PREFIX} {name}: {r.stopped_by} at iteration {r.iteration}"]
    if train_losses:
        (i0, l0), (i1, l1) = train_losses[0], train_losses[-1]
        lines.append(f"  train loss      {l0:.4f} (iter {i0}) -> {l1:.4f} (iter {i1})")
    if valid_losses:
        i1, l1 = valid_losses[-1]
        lines.append(f"  valid loss      {l1:.4f} (iter {i1})")
    session = f" (this session, from {r.resumed_from})" if r.resumed_from else ""
    # One process a GPU on a GPU machine; in CPU mode a process is not a GPU (nor its speed).
    per = "per GPU" if torch.cuda.is_available() else "per process (CPU mode)"
    lines.append(
        f"  throughput      {r.tokens_per_s:,.0f} tokens/s, "
        f"{r.tflops_per_gpu:.3f} model TFLOP/s {per}{session}"
    )
    lines.append(
        f"  metrics         {jsonl} (TensorBoard: {os.path.join(r.run_dir, 'tensorboard')})"
    )
    if png:
        lines.append(f"  loss curve      {png}")
    if r.last_checkpoint:
        lines.append(f"  checkpoint      {r.last_checkpoint}")
    print("\n".join(lines), flush=True)
