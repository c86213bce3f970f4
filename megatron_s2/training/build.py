"""One way to assemble a run: where this process runs, the model, the optimizer, the weights.

The trainer (:class:`~.trainer.Trainer`), the long-context evaluator
(:func:`~.evaluation.model.load_eval_model`) and ``tools/gpu_parallel_check.py`` all assemble
their runs here, from the building blocks of :mod:`.parallel` (which stay Megatron-core's own
pieces: ``initialize_model_parallel``, ``DistributedDataParallel``, ``get_megatron_optimizer``,
``dist_checkpointing``):

    runtime = Runtime.detect(precision)        # GPU or CPU mode, bf16 or fp32; no side effects
    runtime.check(model_section)                # what this machine cannot run, before anything
    runtime.start(parallel_section, seed=seed)  # CPU mode, process group, Megatron's groups
    parts = build_run(model_section, parallel_section, schedule, vocab_size, runtime,
                      optimizer=optimizer_section, train_iters=n)   # training: DDP + optimizer
    parts = build_run(model_section, parallel_section, schedule, vocab_size, runtime)
    load_weights(parts, root, iteration)        # evaluation: the model of one checkpoint

A training run resumes through its :class:`~.checkpointing.Checkpointer` (optimizer, LR schedule
and data position with the weights); an evaluation loads the weights only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from . import parallel
from .parallel import DistributedEnv
from .run_config import ConfigError, ModelConfig, OptimizerConfig, ParallelConfig

__all__ = ["Runtime", "RunParts", "model_vocab_size", "build_run", "load_weights"]


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: its place in the launch, GPU or CPU mode, bf16 or fp32.

    ``gpu`` False is the explicit CPU mode (:mod:`.cpu_mode`: gloo, fp32); ``bf16`` is the
    parameters' and pipeline's dtype (else fp32).
    """

    env: DistributedEnv
    gpu: bool
    bf16: bool

    @classmethod
    def detect(cls, precision: str, env: Optional[DistributedEnv] = None) -> Runtime:
        """The runtime of a run of ``train.precision`` on this machine: GPU mode where CUDA is
        available, CPU mode otherwise; ``env`` defaults to torchrun's variables (a world of one
        without them). Raises :class:`~.run_config.ConfigError` for bf16 without a GPU. Changes
        nothing in the process."""
        gpu = torch.cuda.is_available()
        return cls(
            env=env or DistributedEnv.from_environment(),
            gpu=gpu,
            bf16=parallel.use_bf16(precision, gpu=gpu),
        )

    @property
    def device(self) -> torch.device:
        """This rank's device (after :meth:`start` on GPU: the one ``LOCAL_RANK`` selects)."""
        if self.gpu:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def check(self, model: ModelConfig) -> None:
        """Refuse model settings this machine cannot run (FP8, Transformer Engine layers,
        FlashAttention-4 dense attention), before any process group or GPU work."""
        parallel.check_fp8(model, gpu=self.gpu, bf16=self.bf16)
        parallel.check_transformer_impl(model.transformer_impl, gpu=self.gpu)
        parallel.check_dense_attention(model, gpu=self.gpu)

    def start_process(self) -> None:
        """CPU mode (without a GPU) and torch.distributed (NCCL or gloo); the latter is left as it
        is when it already runs. CPU mode patches torch for the whole process: call this only
        once the inputs are checked."""
        if not self.gpu:
            from .cpu_mode import enable_cpu_mode, megatron_import_without_compile

            # Megatron's distributed package must be imported before CPU mode patches torch,
            # and without its torch.compile wrappers (seconds of start-up, never called here).
            with megatron_import_without_compile():
                import megatron.core.distributed  # noqa: F401

            enable_cpu_mode()
        parallel.init_process_group(self.env, gpu=self.gpu)

    def start(
        self, parallel_section: ParallelConfig, *, seed: int, deterministic: bool = False
    ) -> None:
        """:meth:`start_process`, then Megatron's TP/PP/CP/DP groups for ``parallel_section``
        and the seeds of every RNG (collective). ``deterministic`` (``train.deterministic``):
        the libraries' deterministic algorithms first
        (:func:`.parallel.use_deterministic_algorithms`), before the first GPU work."""
        if deterministic:
            parallel.use_deterministic_algorithms()
        self.start_process()
        parallel.init_model_parallel(parallel_section, seed=seed)


@dataclass
class RunParts:
    """What :func:`build_run` assembled on this rank.

    ``config``: the Megatron model config (:class:`megatron_s2.config.S2TransformerConfig`);
    ``model``: the model chunks, one per virtual pipeline stage: in Megatron DDP for training,
    in eval mode otherwise (``Float16Module`` in bf16 either way); ``optimizer``/``scheduler``:
    Megatron's optimizer and LR schedule, None when not training; ``dp_rank``/``dp_size``: this
    rank's data-parallel position (it reads its share of the data).
    """

    config: object
    model: list
    optimizer: Optional[object] = None
    scheduler: Optional[object] = None
    dp_rank: int = 0
    dp_size: int = 1


def model_vocab_size(model: ModelConfig, parallel_section: ParallelConfig, tokenizer) -> int:
    """The model's (padded) vocabulary size: ``model.vocab_size``, else the tokenizer's rounded
    up to a multiple of ``model.make_vocab_size_divisible_by`` x TP (Megatron's rule). Raises
    :class:`~.run_config.ConfigError` when it is smaller than the tokenizer's vocabulary."""
    from .tokenizer import padded_vocab_size

    vocab_size = model.vocab_size or padded_vocab_size(
        tokenizer.vocab_size,
        model.make_vocab_size_divisible_by,
        parallel_section.tensor_model_parallel_size,
    )
    if vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({vocab_size}) is smaller than the tokenizer's "
            f"vocabulary ({tokenizer.vocab_size})"
        )
    return vocab_size


def build_run(
    model: ModelConfig,
    parallel_section: ParallelConfig,
    schedule,
    vocab_size: int,
    runtime: Runtime,
    *,
    optimizer: Optional[OptimizerConfig] = None,
    train_iters: int = 0,
    backend: str = "auto",
    init_weights: Optional[Callable[[list], None]] = None,
    deterministic: bool = False,
) -> RunParts:
    """Build this rank's model (and, with ``optimizer``, what trains it) after
    :meth:`Runtime.start` (collective).

    Args:
        model, parallel_section: the run config's sections.
        schedule: the attention schedule (``AttentionSchedule``, its mapping or a YAML path).
        vocab_size: the padded vocabulary size.
        runtime: where the run runs (device, bf16).
        optimizer: the run's ``optimizer`` section: build for training (Megatron DDP, the
            optimizer and its LR schedule over ``train_iters``, the schedule hooks); None: for
            evaluation (no DDP, chunks in eval mode).
        backend: ``s2attn.s2_attention`` backend of the S2 layers.
        init_weights: called with the unwrapped chunks before they are wrapped, e.g. to load
            other initial weights (the parallel check's reference weights).
        deterministic: Megatron's ``deterministic_mode`` in the model config
            (``train.deterministic``; :meth:`Runtime.start` sets the rest of the process).
    """
    from megatron.core import parallel_state as ps

    bf16 = runtime.bf16
    config = parallel.transformer_config(
        model, parallel_section, schedule, bf16=bf16, backend=backend, deterministic=deterministic
    )
    chunks = parallel.build_model_chunks(model, config, vocab_size, gpu=runtime.gpu)
    if init_weights is not None:
        init_weights(chunks)
    dp = dict(dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size())
    if optimizer is None:
        chunks = parallel.wrap_model_chunks(chunks, config, parallel_section, bf16=bf16, ddp=False)
        for chunk in chunks:
            chunk.eval()
        return RunParts(config, chunks, **dp)
    chunks = parallel.wrap_model_chunks(chunks, config, parallel_section, bf16=bf16)
    opt, scheduler = parallel.build_optimizer(
        optimizer, parallel_section, chunks, bf16=bf16, train_iters=train_iters
    )
    parallel.connect_schedule_hooks(config, chunks, opt, parallel_section)
    return RunParts(config, chunks, opt, scheduler, **dp)


def load_weights(parts: RunParts, root: str, iteration: int) -> None:
    """Load the model weights of checkpoint ``iteration`` under ``root`` into ``parts.model``
    (collective; the optimizer state, LR schedule and data position stay in the checkpoint).
    Raises :class:`~.errors.CheckpointError` when its files are damaged."""
    from .checkpointing import load_checkpoint

    load_checkpoint(root, parts.model, None, None, iteration=iteration, load_optimizer=False)
