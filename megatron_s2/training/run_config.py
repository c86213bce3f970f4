"""Run configuration: one YAML file, ``key.sub=value`` overrides, validation.

A run config has one section per concern (``model``, ``parallel``, ``train``, ``optimizer``,
``data``, ``checkpoint``, ``logging``, ``debug``, ``attention``). Every section is a dataclass;
unknown keys, wrong types and inconsistent values raise :class:`ConfigError` (a ``ValueError``)
naming the key.

``attention`` is the S2 attention schedule of :mod:`megatron_s2.schedule` and is kept as a plain
mapping here: its schema belongs to :class:`~megatron_s2.schedule.AttentionSchedule`, which
:meth:`RunConfig.schedule` parses and checks against the model shape.

Precedence: dataclass defaults < YAML file < command-line overrides. An override's value is
parsed as YAML (``train.lr=3e-4``, ``attention.s2.vert_stride=16``, ``data.blend=[a, b]``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from ..flash_attention4 import DENSE_BACKENDS
from ..parallel_lengths import (
    CONTEXT_PARALLEL,
    CONTEXT_PARALLEL_BLOCKS,
    PACKED_CONTEXT_PARALLEL,
    SEQUENCE_PARALLEL,
    ParallelLengthError,
    check_packed_sequences,
    check_parallel_lengths,
)

__all__ = [
    "ConfigError",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "OptimizerConfig",
    "DataConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "DebugConfig",
    "RunConfig",
    "load_config",
    "apply_overrides",
    "yaml_load",
    "DEMO_CONFIG",
    "ON_RESUME",
    "SettingChange",
    "ResumeChanges",
    "resume_changes",
    "format_changes",
]

# The built-in default run (``megatron-s2-train`` without --config).
DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


class ConfigError(ValueError):
    """A run-config value is missing, unknown, mistyped or inconsistent."""


@dataclass
class ModelConfig:
    """GPT shape. ``ffn_hidden_size``/``num_query_groups``/``kv_channels`` None = usual default."""

    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    seq_length: int = 512
    # None: the tokenizer's vocabulary padded to a multiple of make_vocab_size_divisible_by * TP.
    vocab_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 128
    normalization: str = "RMSNorm"
    # Epsilon of every RMSNorm/LayerNorm (Megatron's --norm-epsilon; Llama 3: 1e-5, Qwen2: 1e-6).
    norm_epsilon: float = 1e-5
    swiglu: bool = True
    # Biases on the query/key/value projection only (Megatron's --add-qkv-bias; Qwen2 has them).
    add_qkv_bias: bool = False
    rotary_base: float = 10000.0
    # RoPE scaling for context extension, Megatron-core's GPTModel options: "none",
    # "position_interpolation" (positions divided by rope_scaling_factor) or "llama3" (Llama
    # 3.1's frequency-dependent scaling by rope_scaling_factor, original context 8192).
    rope_scaling: str = "none"
    rope_scaling_factor: float = 8.0
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    # Megatron's --transformer-impl: "local" (Megatron's own linears and norms, our fused dense
    # attention) or "transformer_engine" (TE linears with fused norms, TEDotProductAttention on
    # dense layers; S2 layers keep our core attention). TE needs a CUDA GPU and TE installed.
    transformer_impl: str = "local"
    # Kernel of the dense layers' attention with transformer_impl=local: "auto" (FlashAttention-4
    # where the optional flash-attn-4 package is installed and runs the call, else PyTorch's
    # SDPA/cuDNN), "sdpa", or "fa4" (required). Under context parallelism FA4 attends each
    # query chunk in one call (docs/context_parallel.md).
    dense_attention: str = "auto"
    # FP8 GEMMs in the TE linears (Megatron's --fp8-format): null (bf16), "hybrid" (e4m3
    # forward, e5m2 gradients) or "e4m3". Attention stays bf16: S2 layers are our kernels, and
    # TE's dense attention gets fp8_dot_product_attention=False. Needs transformer_engine, bf16
    # and a GPU whose TE build supports the recipe.
    fp8: Optional[str] = None
    # Megatron's --fp8-recipe: how the FP8 scales are found. "delayed" (amax history; Megatron's
    # default), "tensorwise" (current scaling), "blockwise" (Hopper), "mxfp8" (Blackwell).
    fp8_recipe: str = "delayed"
    untie_embeddings_and_output_weights: bool = True
    # Megatron-core model class: "gpt" (GPTModel), "hybrid" (HybridModel, the "*-" * num_layers
    # twin of the GPT model; megatron-core >= 0.19) or "auto" (hybrid where megatron-core has it).
    # Checkpoints of either load into the other (megatron_s2.model.build_model).
    model_class: str = "auto"
    # Activation recomputation: "none", "selective" (core attention only) or "full".
    recompute: str = "none"
    recompute_num_layers: int = 1

    @property
    def query_groups(self) -> int:
        """KV groups: ``num_query_groups``, else one per head (no GQA)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        """FFN width: ``ffn_hidden_size``, else Megatron's default 4h (also with SwiGLU)."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    def validate(self) -> None:
        """Check the model section's own values; raise :class:`ConfigError` naming the key.
        The FP8 checks that need the precision and the parallel layout are in
        :func:`_check_fp8`."""
        _at_least("model.num_layers", self.num_layers, 1)
        _at_least("model.hidden_size", self.hidden_size, 1)
        _at_least("model.num_attention_heads", self.num_attention_heads, 1)
        _at_least("model.seq_length", self.seq_length, 1)
        _at_least("model.make_vocab_size_divisible_by", self.make_vocab_size_divisible_by, 1)
        _at_least("model.recompute_num_layers", self.recompute_num_layers, 1)
        for key in ("num_query_groups", "kv_channels", "ffn_hidden_size", "vocab_size"):
            if getattr(self, key) is not None:
                _at_least(f"model.{key}", getattr(self, key), 1)
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by "
                f"model.num_attention_heads ({self.num_attention_heads}) unless "
                "model.kv_channels is set"
            )
        groups = self.query_groups
        if self.num_attention_heads % groups:
            raise ConfigError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be divisible "
                f"by model.num_query_groups ({groups})"
            )
        _one_of("model.normalization", self.normalization, ("RMSNorm", "LayerNorm"))
        if not 0.0 < self.norm_epsilon < 1.0:
            raise ConfigError(f"model.norm_epsilon must be in (0, 1), got {self.norm_epsilon}")
        _one_of("model.recompute", self.recompute, ("none", "selective", "full"))
        if self.rotary_base <= 0:
            raise ConfigError(f"model.rotary_base must be > 0, got {self.rotary_base}")
        _one_of("model.rope_scaling", self.rope_scaling, ROPE_SCALING)
        if self.rope_scaling != "none" and self.rope_scaling_factor <= 1.0:
            raise ConfigError(
                f"model.rope_scaling_factor must be > 1 with model.rope_scaling="
                f"{self.rope_scaling}, got {self.rope_scaling_factor}"
            )
        _one_of("model.transformer_impl", self.transformer_impl, TRANSFORMER_IMPLS)
        _one_of("model.dense_attention", self.dense_attention, DENSE_BACKENDS)
        if self.dense_attention == "fa4" and self.transformer_impl != "local":
            raise ConfigError(
                "model.dense_attention=fa4 applies to model.transformer_impl=local (the TE spec's "
                "dense layers run Transformer Engine's attention); set model.dense_attention=auto"
            )
        _one_of("model.fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        if self.fp8 is not None:
            if self.fp8 not in FP8_FORMATS:
                raise ConfigError(
                    f"model.fp8 must be null (no FP8) or one of {list(FP8_FORMATS)}, got "
                    f"{self.fp8!r}"
                )
            if self.transformer_impl != "transformer_engine":
                raise ConfigError(
                    f"model.fp8={self.fp8} needs model.transformer_impl=transformer_engine (FP8 "
                    f"GEMMs are Transformer Engine's), got model.transformer_impl="
                    f"{self.transformer_impl}; set model.transformer_impl=transformer_engine or "
                    f"model.fp8=null"
                )
        if not 0.0 <= self.hidden_dropout < 1.0:
            raise ConfigError(f"model.hidden_dropout must be in [0, 1), got {self.hidden_dropout}")
        from ..model import model_class_problem  # package metadata only: megatron not loaded

        llama3 = "model.rope_scaling=llama3" if self.rope_scaling == "llama3" else None
        if problem := model_class_problem(self.model_class, gpt_only=llama3):
            raise ConfigError(f"model.model_class={self.model_class}: {problem}")


@dataclass
class ParallelConfig:
    """Model parallelism; data parallelism is whatever remains of the world size."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    # Megatron's cp_comm_type for every layer: "auto" (each layer kind's measured default:
    # megatron_s2.attention), "all_gather" or "a2a" (docs/context_parallel.md).
    cp_comm_type: str = "auto"
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False

    def validate(self) -> None:
        """Check the parallel section's own values; how the layout fits the model (heads,
        layers, sequence length) is checked after every section's own
        (:meth:`RunConfig.validate`)."""
        _at_least("parallel.tensor_model_parallel_size", self.tensor_model_parallel_size, 1)
        _at_least("parallel.pipeline_model_parallel_size", self.pipeline_model_parallel_size, 1)
        _at_least("parallel.context_parallel_size", self.context_parallel_size, 1)
        _one_of("parallel.cp_comm_type", self.cp_comm_type, CP_COMM_TYPES)
        if self.virtual_pipeline_model_parallel_size is not None:
            _at_least(
                "parallel.virtual_pipeline_model_parallel_size",
                self.virtual_pipeline_model_parallel_size,
                2,
            )
            if self.pipeline_model_parallel_size < 2:
                raise ConfigError(
                    "parallel.virtual_pipeline_model_parallel_size needs "
                    "parallel.pipeline_model_parallel_size >= 2"
                )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError(
                "parallel.sequence_parallel needs parallel.tensor_model_parallel_size > 1"
            )
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError(
                "parallel.overlap_param_gather needs parallel.use_distributed_optimizer"
            )

    @property
    def pipeline_chunks(self) -> int:
        """Model chunks along the pipeline: pipeline x virtual pipeline size."""
        return self.pipeline_model_parallel_size * (self.virtual_pipeline_model_parallel_size or 1)


@dataclass
class TrainConfig:
    """Batch sizes, length of the run, precision and evaluation cadence."""

    micro_batch_size: int = 1
    global_batch_size: int = 8
    train_iters: int = 300
    seed: int = 1234
    # "auto": bf16 on GPU, fp32 on CPU.
    precision: str = "auto"
    eval_interval: int = 100
    eval_iters: int = 4
    # Restart position ids after every EOD (Megatron's dataset option; needed by pack_documents).
    reset_position_ids: bool = False
    # Leave out the loss of predicting the token after an EOD (the next document's first).
    eod_mask_loss: bool = False
    # Each micro-batch as one packed sequence of documents split at EOD: no attention across
    # documents, RoPE restarting per document. false: samples attend across EOD (Megatron's
    # default concatenation).
    pack_documents: bool = False
    # Every training and validation sample starts with the EOD token (the sample moved one token
    # right behind it): a fixed first token that takes the attention sink, the role BOS plays in
    # Llama-style pretraining, so that no content ever sits at position 0. The evaluator then
    # starts every prompt and held-out sequence with EOD too.
    eod_first: bool = False
    num_workers: int = 0
    # Bitwise reproducible reruns (Megatron's deterministic_mode, FA4's deterministic backward,
    # PyTorch's deterministic algorithms): the dense layers' attention backward otherwise sums
    # dQ in an order that varies from run to run (docs/quality.md, "The noise band").
    deterministic: bool = False

    def validate(self) -> None:
        """Check the train section's own values (``pack_documents`` and what it needs:
        :func:`_check_packing`)."""
        _at_least("train.micro_batch_size", self.micro_batch_size, 1)
        _at_least("train.global_batch_size", self.global_batch_size, 1)
        _at_least("train.train_iters", self.train_iters, 1)
        _at_least("train.eval_interval", self.eval_interval, 0)
        _at_least("train.eval_iters", self.eval_iters, 0)
        _at_least("train.num_workers", self.num_workers, 0)
        _one_of("train.precision", self.precision, ("auto", "bf16", "fp32"))
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"train.global_batch_size ({self.global_batch_size}) must be divisible by "
                f"train.micro_batch_size ({self.micro_batch_size})"
            )
        if self.eod_first and self.reset_position_ids:
            # Megatron's dataset restarts positions after each EOD of the sample it read; an EOD
            # put first afterwards would leave positions that disagree.
            raise ConfigError(
                "train.eod_first=true cannot go with train.reset_position_ids=true (nor "
                "train.pack_documents, which needs it): the EOD put first would end a document "
                "of one token that no other token attends to; set train.eod_first=false, or "
                "both reset_position_ids and pack_documents false"
            )


@dataclass
class OptimizerConfig:
    """AdamW and the learning-rate schedule (Megatron's OptimizerParamScheduler)."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # Warm-up length, as Megatron's --lr-warmup-iters / --lr-warmup-fraction (give at most one):
    # iterations, or a fraction of the decay length (optimizer.lr_decay_iters, else the run),
    # which follows train.train_iters (the demo's 0.08: 20 of its 250 iterations, 1.6 of 20).
    # Neither: 20 iterations. A command-line override of one replaces the YAML file's other.
    lr_warmup_iters: Optional[int] = None
    lr_warmup_fraction: Optional[float] = None
    # None: decay over the whole run.
    lr_decay_iters: Optional[int] = None
    lr_decay_style: str = "cosine"

    def validate(self) -> None:
        """Check the optimizer section's own values (warm-up against the run's length:
        :func:`_check_lr_schedule`)."""
        if self.lr <= 0:
            raise ConfigError(f"optimizer.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(
                f"optimizer.min_lr must be in [0, optimizer.lr={self.lr}], got {self.min_lr}"
            )
        if self.weight_decay < 0:
            raise ConfigError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        if self.clip_grad < 0:
            raise ConfigError(f"optimizer.clip_grad must be >= 0 (0 = off), got {self.clip_grad}")
        if self.lr_warmup_iters is not None:
            _at_least("optimizer.lr_warmup_iters", self.lr_warmup_iters, 0)
        if self.lr_warmup_fraction is not None:
            if self.lr_warmup_iters is not None:
                raise ConfigError(
                    "give one of optimizer.lr_warmup_iters and optimizer.lr_warmup_fraction "
                    "(Megatron's --lr-warmup-iters / --lr-warmup-fraction), not both"
                )
            if not 0.0 <= self.lr_warmup_fraction < 1.0:
                raise ConfigError(
                    f"optimizer.lr_warmup_fraction must be in [0, 1) (a fraction of the decay "
                    f"length), got {self.lr_warmup_fraction}"
                )
        if self.lr_decay_iters is not None:
            _at_least("optimizer.lr_decay_iters", self.lr_decay_iters, 1)
        _one_of(
            "optimizer.lr_decay_style",
            self.lr_decay_style,
            ("constant", "linear", "cosine", "inverse-square-root"),
        )

    def warmup_steps(self, decay_iters: int) -> float:
        """Warm-up length in iterations for a decay over ``decay_iters`` iterations: the
        fraction of it (a float, as Megatron-LM passes ``--lr-warmup-fraction`` to its
        scheduler), else ``lr_warmup_iters``, else the default 20."""
        if self.lr_warmup_fraction is not None:
            return self.lr_warmup_fraction * decay_iters
        if self.lr_warmup_iters is not None:
            return self.lr_warmup_iters
        return DEFAULT_WARMUP_ITERS


# The warm-up of a config that sets neither optimizer.lr_warmup_iters nor lr_warmup_fraction.
DEFAULT_WARMUP_ITERS = 20


@dataclass
class DataConfig:
    """Indexed datasets (``.bin/.idx`` prefixes) and the tokenizer that wrote them.

    ``blend``: a list of prefixes, or of ``[weight, prefix]`` pairs for several corpora.
    ``demo: true`` generates the synthetic demo corpus into ``demo_dir`` and uses it instead.
    """

    blend: Optional[list] = None
    split: str = "98,2,0"
    tokenizer: str = "byte"
    demo: bool = False
    demo_dir: str = "data/demo"
    # Documents of the generated demo corpus; None = the generator's default (~2M tokens).
    demo_num_docs: Optional[int] = None
    # Megatron caches its sample indices here; None = next to the data.
    cache_dir: Optional[str] = None

    def validate(self) -> None:
        """Check the data section: a corpus to read, a well-formed blend and split."""
        if self.demo_num_docs is not None:
            _at_least("data.demo_num_docs", self.demo_num_docs, 1)
        if not self.demo and not self.blend:
            raise ConfigError(
                "data.blend is empty: give indexed-dataset prefixes (data.blend=[path/prefix]) "
                "or set data.demo=true for the built-in synthetic corpus"
            )
        if self.blend:
            _blend_pairs(self.blend)  # raises on a malformed blend
        check_split(self.split)


def check_split(split: str, option: str = "data.split") -> list[float]:
    """The weights of a ``data.split`` string ``'train,valid,test'`` (e.g. ``'39166,708,0'``);
    :class:`ConfigError` naming ``option`` unless they are three finite non-negative numbers,
    not all 0 (Megatron's own parser would read ``'-1,2'`` as 1, 2, 0)."""
    parts = str(split).split(",")
    try:
        weights = [float(x) for x in parts]
    except ValueError:
        weights = []
    if (
        len(parts) != 3
        or len(weights) != 3
        or not all(math.isfinite(w) and w >= 0 for w in weights)
        or sum(weights) <= 0
    ):
        raise ConfigError(
            f"{option} must be three non-negative weights 'train,valid,test', got {split!r}"
        )
    return weights


# model.transformer_impl: the layer implementations of Megatron's --transformer-impl.
TRANSFORMER_IMPLS = ("local", "transformer_engine")
# model.fp8 / model.fp8_recipe: the values of Megatron's --fp8-format / --fp8-recipe that the
# trainer takes. Megatron's "custom" recipe is left out: it needs a quantizer factory, which
# the run config has no key for.
FP8_FORMATS = ("hybrid", "e4m3")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
# model.rope_scaling: Megatron-core's RoPE scaling methods (GPTModel arguments).
ROPE_SCALING = ("none", "position_interpolation", "llama3")
CP_COMM_TYPES = ("auto", "all_gather", "a2a")

# checkpoint.on_resume: what a resumed run does with changed plan settings (PLAN_KEYS).
ON_RESUME = ("apply", "keep")


@dataclass
class CheckpointConfig:
    """``dir`` None = ``<logging.run_dir>/checkpoints``; ``save_interval`` 0 = only at the end."""

    dir: Optional[str] = None
    save_interval: int = 0
    save_at_end: bool = True
    # Resume from the newest intact checkpoint in ``dir`` when there is one. false: never resume
    # (a run directory that already holds a run is then refused; start over with --restart).
    resume: bool = True
    # A resumed run whose plan settings (LR schedule, iterations, intervals, data) differ from
    # its checkpoint's: "apply" uses the values given now, "keep" the checkpoint's; either way
    # the differences are printed. Model shape, attention, tokenizer and seq length never change.
    on_resume: str = "apply"
    # Start from the newest checkpoint here while ``dir`` has none yet (e.g. another run's).
    load_dir: Optional[str] = None
    # Keep only the newest N checkpoints; None keeps all.
    keep_last: Optional[int] = None
    # false: take only the model weights from load_dir's checkpoint (fine-tuning, or a new
    # optimizer); the run's own checkpoints always restore the optimizer and LR schedule.
    load_optimizer: bool = True
    # Starting from another run's checkpoint (load_dir): true starts at iteration 0 with a fresh
    # LR schedule (warm-up included) and the data from its start, as continual pretraining such
    # as context extension does; false continues that run's iteration count and LR schedule.
    reset_iteration: bool = False

    def validate(self) -> None:
        """Check the checkpoint section's own values."""
        _at_least("checkpoint.save_interval", self.save_interval, 0)
        _one_of("checkpoint.on_resume", self.on_resume, ON_RESUME)
        if self.keep_last is not None:
            _at_least("checkpoint.keep_last", self.keep_last, 1)


@dataclass
class LoggingConfig:
    """Console, TensorBoard and JSONL logging. ``run_dir`` None = ``runs/<name>``."""

    run_dir: Optional[str] = None
    log_interval: int = 10
    progress_bar: bool = True
    tensorboard: bool = True
    plot: bool = True

    def validate(self) -> None:
        """Check the logging section's own values."""
        _at_least("logging.log_interval", self.log_interval, 1)


@dataclass
class DebugConfig:
    """Test hooks. ``nan_at_iter``: make the loss NaN at that iteration (exercises the NaN stop)."""

    nan_at_iter: Optional[int] = None
    # Stop after this iteration as if SIGTERM had arrived (exercises the graceful stop).
    sigterm_at_iter: Optional[int] = None
    # Run this iteration under torch.profiler; every rank writes the share of its GPU kernel
    # time in attention, communication and GEMM kernels to <run_dir>/profile/ (profiling.py).
    profile_step: Optional[int] = None

    def validate(self) -> None:
        """``profile_step`` is an iteration (>= 1) or None; the other hooks take any iteration
        (or None): one that never comes simply never fires."""
        if self.profile_step is not None:
            _at_least("debug.profile_step", self.profile_step, 1)


@dataclass
class RunConfig:
    """A whole run."""

    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    # S2 attention schedule (megatron_s2.schedule.AttentionSchedule.from_dict); None = all dense.
    attention: Optional[dict] = None

    # ---- derived paths -------------------------------------------------------------------
    @property
    def run_dir(self) -> str:
        return self.logging.run_dir or os.path.join("runs", self.name)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.run_dir, "checkpoints")

    def to_dict(self) -> dict:
        """Plain nested dict (what ``from_dict`` accepts); written next to every run."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        """Build and validate a config from a nested mapping (unknown keys rejected)."""
        cfg = _build(cls, d, "")
        cfg.validate()
        return cfg

    # ---- validation ------------------------------------------------------------------------
    def validate(self, world_size: Optional[int] = None) -> None:
        """Check values and their consistency; ``world_size`` adds the data-parallel checks.

        Each section checks its own values (``model.validate()``, ... in the order of the
        sections), then the run's name, then the checks across sections
        (:data:`_CROSS_SECTION_CHECKS`, each a small function), which can therefore rely on
        every section's values being valid (a TP size >= 1 before dividing by it); the first
        failure raises a :class:`ConfigError` naming the keys."""
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if dataclasses.is_dataclass(section):
                section.validate()
        _check_name(self.name)
        for check in _CROSS_SECTION_CHECKS:
            check(self)
        if world_size is not None:
            self.data_parallel_size(world_size)

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel size for ``world_size`` processes (raises if it does not divide)."""
        p = self.parallel
        model_parallel = (
            p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
        )
        if world_size % model_parallel:
            raise ConfigError(
                f"world size {world_size} is not divisible by tensor x pipeline x context parallel "
                f"size ({p.tensor_model_parallel_size} x {p.pipeline_model_parallel_size} x "
                f"{p.context_parallel_size} = {model_parallel})"
            )
        dp = world_size // model_parallel
        per_step = self.train.micro_batch_size * dp
        if self.train.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size ({self.train.global_batch_size}) must be divisible by "
                "train.micro_batch_size x data-parallel size "
                f"({self.train.micro_batch_size} x {dp})"
            )
        return dp

    def num_microbatches(self, world_size: int) -> int:
        """Micro-batches per step and data-parallel rank (gradient accumulation steps)."""
        dp = self.data_parallel_size(world_size)
        return self.train.global_batch_size // (self.train.micro_batch_size * dp)

    def schedule(self):
        """The attention schedule (:class:`~megatron_s2.schedule.AttentionSchedule`), parsed and
        checked against the model and the parallel layout (None = all dense); raises
        :class:`ConfigError`.

        Parsed once per config: later calls return the same object while the settings it was
        parsed from (``attention``, the model's shape and length, the parallel layout) are
        unchanged; a change to any of them, in place or in a copy (``dataclasses.replace``,
        ``copy``, pickling), parses again."""
        key = self._schedule_key()
        cached = self.__dict__.get("_schedule_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        sched = self._parse_schedule()
        # A plain attribute, not a field: to_dict(), == and replace() do not see it.
        self._schedule_cache = (key, sched)
        return sched

    def coverage_holes_beyond_length(self) -> Optional[str]:
        """Why the schedule, valid at ``model.seq_length``, would be refused at a longer length
        (S2 layers leaving key blocks unseen beyond it), or None: the reason names the layer and
        the settings to change. None too where ``attention.allow_coverage_holes`` is set."""
        from ..schedule import ScheduleError

        m = self.model
        try:
            self.schedule().validate(
                m.num_layers,
                m.num_attention_heads,
                m.num_query_groups,
                self.parallel.tensor_model_parallel_size,
            )
        except ScheduleError as e:
            return str(e)
        return None

    def _schedule_key(self) -> tuple:
        """Everything :meth:`_parse_schedule` reads, as a comparable value."""
        m, p = self.model, self.parallel
        return (
            _frozen(self.attention),
            m.num_layers,
            m.num_attention_heads,
            m.num_query_groups,
            m.seq_length,
            p.tensor_model_parallel_size,
            p.context_parallel_size,
            p.sequence_parallel,
        )

    def _parse_schedule(self):
        from ..schedule import AttentionSchedule, ScheduleError

        m = self.model
        try:
            if self.attention is None:
                sched = AttentionSchedule.all_dense()
            else:
                sched = AttentionSchedule.from_dict(self.attention, prefix="attention")
            sched.validate(
                m.num_layers,
                m.num_attention_heads,
                m.num_query_groups,
                self.parallel.tensor_model_parallel_size,
                m.seq_length,
            )
        except ScheduleError as e:
            raise ConfigError(str(e)) from None
        if sched.dense_sinks and m.dense_attention != "auto":
            # The dense layers with sinks run s2attn's kernel (the sinks need its log-sum-exp
            # gradient): an explicit dense kernel would silently not be used.
            raise ConfigError(
                f"model.dense_attention={m.dense_attention} picks the dense layers' kernel, and "
                f"attention.dense_layers.sinks runs them on s2attn's kernel with a dense pattern "
                f"(learned sinks need its log-sum-exp gradient); set model.dense_attention=auto "
                f"or attention.dense_layers.sinks=false"
            )
        _check_sequence_lengths(self, sched.block_sizes(m.num_layers))
        return sched

    def __getstate__(self) -> dict:
        # Copies and pickles leave the parsed schedule behind (it is rebuilt on first use).
        state = dict(self.__dict__)
        state.pop("_schedule_cache", None)
        return state

    def keeping(self, saved: dict, keys: list[str]) -> RunConfig:
        """This config with the dotted ``keys`` set to their values in ``saved`` (a checkpoint's
        config mapping): what ``checkpoint.on_resume=keep`` runs."""
        d = self.to_dict()
        for key in keys:
            _set_dotted(d, key, _get_dotted(saved, key))
        for key, other in (WARMUP_KEYS, WARMUP_KEYS[::-1]):
            # The checkpoint's warm-up, in whichever of the two keys it is given, replaces this
            # config's (the two are alternatives).
            kept = f"optimizer.{key}" in keys and _get_dotted(saved, f"optimizer.{key}") is not None
            if kept and f"optimizer.{other}" not in keys:
                d["optimizer"][other] = None
        try:
            return RunConfig.from_dict(d)
        except ConfigError as e:
            raise ConfigError(
                f"checkpoint.on_resume=keep: the checkpoint's values of {', '.join(keys)} do not "
                f"fit the settings given now: {e}"
            ) from None

    def blend(self) -> tuple[list[str], Optional[list[float]]]:
        """``data.blend`` as (prefixes, weights or None)."""
        return _blend_pairs(self.data.blend or [])


# The longest ``name``: the run directory ``runs/<name>`` must stay one valid file name also as
# ``--restart`` renames it (``<name>.old-YYYYmmdd-HHMMSS-N``), and Linux file names have at most
# 255 bytes (NAME_MAX).
NAME_MAX_BYTES = 255 - len(".old-YYYYmmdd-HHMMSS-99")


def _check_name(name: str) -> None:
    """``name`` is one folder name under ``runs/``: not empty, not ``.``/``..`` (they would be
    ``runs/`` itself or the checkout), no path separator, short enough for the file system."""
    if not name or name in (".", "..") or any(c in name for c in ("/", "\\", "\0")):
        raise ConfigError(
            f"name must be one folder name (the run directory is runs/<name>): not empty, not "
            f"'.' or '..', without '/' or '\\', got {name!r}; to put the run elsewhere set "
            f"logging.run_dir"
        )
    size = len(name.encode())
    if size > NAME_MAX_BYTES:
        raise ConfigError(
            f"name is {size} bytes long, more than the {NAME_MAX_BYTES} a run directory's name "
            f"may have (file names have at most 255 bytes, and --restart appends "
            f"'.old-<time>'): choose a shorter name"
        )


# ---- checks across sections (RunConfig.validate runs them after every section's own) ---------


def _check_fp8(cfg: RunConfig) -> None:
    """The FP8 checks that read other sections than the model's (no hardware needed): the
    precision, and the GEMM shapes Transformer Engine's FP8 kernels take under the layout."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if m.fp8 is None:
        return
    if t.precision == "fp32":
        raise ConfigError(
            f"model.fp8={m.fp8} needs bf16 training (FP8 GEMMs inside bf16 layers, as "
            f"Megatron's --fp8-format with --bf16), got train.precision=fp32; set "
            f"train.precision to 'auto' or 'bf16', or model.fp8=null"
        )
    # Transformer Engine asserts at the first forward that every FP8 GEMM input has rows
    # divisible by 8 and columns by 16 (weights likewise); finding out here costs nothing.
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    tokens = t.micro_batch_size * m.seq_length // cp
    if p.sequence_parallel:
        tokens //= tp
    rows = {
        "tokens per rank (train.micro_batch_size x model.seq_length / context parallel"
        + (" / tensor parallel" if p.sequence_parallel else "")
        + ")": tokens,
        "QKV output features per tensor-parallel rank": (
            (m.num_attention_heads + 2 * m.query_groups) * d // tp
        ),
        "FFN output features per tensor-parallel rank": ((2 if m.swiglu else 1) * m.ffn_size // tp),
    }
    cols = {
        "model.hidden_size": m.hidden_size,
        "attention output features per tensor-parallel rank (heads x kv_channels / TP)": (
            m.num_attention_heads * d // tp
        ),
        "FFN width per tensor-parallel rank (model.ffn_hidden_size / TP)": m.ffn_size // tp,
    }
    bad = [f"{k} = {v} (not a multiple of 8)" for k, v in rows.items() if v % 8]
    bad += [f"{k} = {v} (not a multiple of 16)" for k, v in cols.items() if v % 16]
    if bad:
        raise ConfigError(
            f"model.fp8={m.fp8}: Transformer Engine's FP8 GEMMs need row counts divisible "
            f"by 8 and inner sizes divisible by 16: " + "; ".join(bad)
        )


def _check_model_split(cfg: RunConfig) -> None:
    """The model splits over the tensor-parallel ranks (heads) and pipeline chunks (layers)."""
    m, p = cfg.model, cfg.parallel
    tp = p.tensor_model_parallel_size
    if m.num_attention_heads % tp:
        raise ConfigError(
            f"model.num_attention_heads ({m.num_attention_heads}) must be divisible "
            f"by parallel.tensor_model_parallel_size ({tp})"
        )
    if m.vocab_size is not None and m.vocab_size % tp:
        # Megatron splits the embedding and output layer by vocabulary rows over the TP ranks.
        raise ConfigError(
            f"model.vocab_size ({m.vocab_size}) must be divisible by "
            f"parallel.tensor_model_parallel_size ({tp}): the embedding is split by rows "
            f"(leave model.vocab_size unset to pad the tokenizer's vocabulary)"
        )
    if m.num_layers % p.pipeline_chunks:
        raise ConfigError(
            f"model.num_layers ({m.num_layers}) must be divisible by the number of "
            f"pipeline chunks (pipeline x virtual = {p.pipeline_chunks})"
        )


def _length_message(e: ParallelLengthError) -> str:
    """A :func:`~megatron_s2.parallel_lengths.check_parallel_lengths` failure restated in the run
    config's keys."""
    seq, cp = e.seq_length, e.context_parallel
    if e.rule == SEQUENCE_PARALLEL:
        return (
            f"model.seq_length ({seq}) must be divisible by tensor x context parallel size "
            f"({e.multiple}) with parallel.sequence_parallel"
        )
    if e.rule == CONTEXT_PARALLEL:
        return (
            f"model.seq_length ({seq}) must be divisible by 2 x parallel.context_parallel_size "
            f"({e.multiple})"
        )
    if e.rule == CONTEXT_PARALLEL_BLOCKS:
        return (
            f"parallel.context_parallel_size ({cp}) needs model.seq_length ({seq}) to be a "
            f"multiple of {e.multiple}: Megatron splits the sequence in 2 x "
            f"context_parallel_size chunks, and each must be a whole number of every S2 layer's "
            f"blocks (block sizes {list(e.block_sizes)})"
        )
    if e.rule == PACKED_CONTEXT_PARALLEL:
        return (
            f"train.pack_documents=true and parallel.context_parallel_size={cp} are not "
            f"supported together yet; set parallel.context_parallel_size=1 or "
            f"train.pack_documents=false"
        )
    return str(e)  # a rule this restatement does not know yet: the plugin's own words


def _check_sequence_lengths(cfg: RunConfig, block_sizes=()) -> None:
    """``model.seq_length`` under the parallel layout (sequence and context parallelism; the S2
    layers' ``block_sizes`` once the schedule is parsed): the plugin's rule,
    :func:`~megatron_s2.parallel_lengths.check_parallel_lengths`, in the run config's keys."""
    m, p = cfg.model, cfg.parallel
    try:
        check_parallel_lengths(
            m.seq_length,
            tp=p.tensor_model_parallel_size,
            cp=p.context_parallel_size,
            sequence_parallel=p.sequence_parallel,
            block_sizes=block_sizes,
        )
    except ParallelLengthError as e:
        raise ConfigError(_length_message(e)) from None


def _check_cp_comm_type(cfg: RunConfig) -> None:
    """``parallel.cp_comm_type=a2a`` splits each TP rank's heads and groups over the CP ranks."""
    m, p = cfg.model, cfg.parallel
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    if cp > 1 and p.cp_comm_type == "a2a":
        from ..context_parallel_a2a import a2a_unsupported_reason

        heads, groups = m.num_attention_heads // tp, max(1, m.query_groups // tp)
        if a2a_unsupported_reason(heads, groups, cp):
            raise ConfigError(
                f"parallel.cp_comm_type=a2a splits each tensor-parallel rank's heads over the "
                f"context-parallel ranks: model.num_attention_heads / TP ({heads}) and "
                f"model.num_query_groups / TP ({groups}) must be divisible by "
                f"parallel.context_parallel_size ({cp}); use cp_comm_type auto or all_gather"
            )


def _check_packing(cfg: RunConfig) -> None:
    """What ``train.pack_documents`` needs: no context parallelism (the plugin's refusal,
    :func:`~megatron_s2.parallel_lengths.check_packed_sequences`, in the run config's keys),
    then ``train.reset_position_ids``. In that order: a config that fails both hears of the CP
    refusal first, which setting ``reset_position_ids`` would not cure."""
    t = cfg.train
    if not t.pack_documents:
        return
    try:
        check_packed_sequences(cfg.parallel.context_parallel_size)
    except ParallelLengthError as e:
        raise ConfigError(_length_message(e)) from None
    if not t.reset_position_ids:
        raise ConfigError(
            "train.pack_documents=true needs train.reset_position_ids=true: packed documents "
            "are attended on their own, so their positions restart at every document's "
            "first token; set both, or train.pack_documents=false"
        )


def _check_lr_schedule(cfg: RunConfig) -> None:
    """The warm-up ends before the decay does (``optimizer.lr_decay_iters``, else the run)."""
    o = cfg.optimizer
    decay = o.lr_decay_iters if o.lr_decay_iters is not None else cfg.train.train_iters
    warmup = o.warmup_steps(decay)
    if warmup >= decay:
        given = "" if o.lr_warmup_iters is not None else ", the default"
        raise ConfigError(
            f"optimizer.lr_warmup_iters ({warmup:g}{given}) must be smaller than the decay "
            f"length ({decay}, optimizer.lr_decay_iters or train.train_iters); set a shorter "
            f"optimizer.lr_warmup_iters, or optimizer.lr_warmup_fraction (a fraction of the "
            f"decay length, which follows train.train_iters)"
        )


# In the order RunConfig.validate runs them, after every section's own checks: FP8, how the
# model splits over the layout, the sequence length under it, then the train and optimizer plans.
_CROSS_SECTION_CHECKS = (
    _check_fp8,
    _check_model_split,
    _check_sequence_lengths,
    _check_cp_comm_type,
    _check_packing,
    _check_lr_schedule,
)


def _frozen(value: Any) -> Any:
    """``value`` (a YAML-like mapping, list or scalar) as a comparable snapshot: the types are
    kept, so ``16`` and ``16.0`` or ``{}`` and ``[]`` differ as the schedule's parser sees them."""
    if isinstance(value, dict):
        return (dict, tuple((_frozen(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_frozen(v) for v in value))
    return (type(value), value)


def _at_least(key: str, value, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value}")


def _one_of(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {list(allowed)}, got {value!r}")


def _blend_pairs(blend: list) -> tuple[list[str], Optional[list[float]]]:
    if not isinstance(blend, list):
        raise ConfigError(f"data.blend must be a list, got {type(blend).__name__}")
    if all(isinstance(x, str) for x in blend):
        return list(blend), None
    prefixes, weights = [], []
    for item in blend:
        ok = (
            isinstance(item, (list, tuple))
            and len(item) == 2
            and isinstance(item[0], (int, float))
            and not isinstance(item[0], bool)
            and isinstance(item[1], str)
            and item[0] > 0
        )
        if not ok:
            raise ConfigError(
                "data.blend must be a list of prefixes or of [weight, prefix] pairs "
                f"with weight > 0, got entry {item!r}"
            )
        weights.append(float(item[0]))
        prefixes.append(item[1])
    return prefixes, weights


# ---- construction from mappings, with type checks ---------------------------------------------


def _check_type(key: str, value: Any, tp: Any) -> Any:
    """Return ``value`` converted to annotation ``tp``; raise ConfigError if it cannot be."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _check_type(key, value, args[0])
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # PyYAML reads "1e-3" (no dot) as a string; accept it as the number it means.
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif tp is list or origin is list:
        if isinstance(value, (list, tuple)):
            return list(value)
    elif tp is dict or origin is dict:
        if isinstance(value, dict):
            return value
    else:
        raise TypeError(f"unsupported config annotation {tp!r} for {key}")
    name = getattr(tp, "__name__", str(tp))
    raise ConfigError(f"{key} must be of type {name}, got {value!r} ({type(value).__name__})")


def _build(cls, d: Any, prefix: str):
    where = prefix.rstrip(".") or "the run config"
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(d).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        from ..config_hints import colon_hint

        raise ConfigError(
            f"unknown key(s) {', '.join(prefix + str(k) for k in unknown)} in {where}; "
            f"allowed keys: {', '.join(sorted(fields))}" + colon_hint(unknown)
        )
    kwargs = {}
    for name, value in d.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _check_type(prefix + name, value, tp)
    return cls(**kwargs)


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A YAML mapping gives one key twice (:class:`UniqueKeyLoader`)."""


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (plain PyYAML keeps the
    last value silently: a config edited in two places would run with whichever came later)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
                seen.setdefault(key, line)
            except TypeError:  # an unhashable key: the base class reports it
                break
            if first is not None:
                raise DuplicateKeyError(
                    None,
                    None,
                    f"key {key!r} appears twice in one mapping (lines {first} and {line}); "
                    f"keep one",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def yaml_load(text) -> Any:
    """Parse YAML ``text`` (a string or an open file) like ``yaml.safe_load``, but refuse
    duplicate keys (:class:`UniqueKeyLoader`); raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=UniqueKeyLoader)


def apply_overrides(d: dict, overrides: list[str]) -> dict:
    """Apply ``key.sub=value`` strings to the nested mapping ``d`` (in place; returned).

    Values are parsed as YAML. Unknown keys are caught later by :meth:`RunConfig.from_dict`,
    inside ``attention`` they are caught by the schedule's own parser.
    """
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        try:
            value = yaml_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from None
        node = d
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return d


def load_config(
    path: Optional[str | os.PathLike] = None, overrides: Optional[list[str]] = None
) -> RunConfig:
    """Load ``path`` (None = the built-in demo config), apply overrides, validate."""
    path = Path(path) if path is not None else DEMO_CONFIG
    if path.is_dir():
        yamls = sorted(str(p) for p in path.glob("*.yaml"))[:5]
        hint = f" (it holds {', '.join(yamls)})" if yamls else ""
        raise ConfigError(
            f"--config {str(path)!r} is a directory; give one run config YAML file{hint}"
        )
    if not path.is_file():
        what = "is not a regular file" if path.exists() else "does not exist"
        raise ConfigError(f"config file {str(path)!r} {what}")
    try:
        with open(path) as f:
            d = yaml_load(f)
    except DuplicateKeyError as e:
        raise ConfigError(f"{path}: {e.problem}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read ({e})") from None
    if d is None or d == {}:
        # Without this the defaults would run and the first complaint would be data.blend.
        raise ConfigError(
            f"{path} is empty (no settings): a run config needs at least its data "
            f"(data.blend, or data.demo: true); start from configs/demo.yaml or "
            f"configs/gpt-125m-s2.yaml"
        )
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    overrides = overrides or []
    _warmup_override_replaces_the_files(d, overrides)
    apply_overrides(d, overrides)
    return RunConfig.from_dict(d)


WARMUP_KEYS = ("lr_warmup_iters", "lr_warmup_fraction")


def _warmup_override_replaces_the_files(d: dict, overrides: list[str]) -> None:
    """The two warm-up keys are alternatives: an override of one (``optimizer.lr_warmup_iters=2``
    on the demo, whose file sets the fraction) drops the file's other, as the later value of
    one setting replaces an earlier one; both given as overrides stay both (and are refused)."""
    given = {item.partition("=")[0].strip() for item in overrides}
    section = d.get("optimizer")
    if not isinstance(section, dict):
        return
    for key, other in (WARMUP_KEYS, WARMUP_KEYS[::-1]):
        if f"optimizer.{key}" in given and f"optimizer.{other}" not in given:
            section.pop(other, None)


# ---- resuming: which settings may differ from the checkpoint's ---------------------------------

# The shape of the weights: a checkpoint loads only into the same shapes. Compared as resolved
# values (num_query_groups None and 4 with 4 heads are the same model). The padded vocabulary is
# compared by the trainer, which knows the tokenizer.
SHAPE_KEYS = (
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.num_query_groups",
    "model.kv_channels",
    "model.ffn_hidden_size",
    "model.normalization",
    "model.swiglu",
    "model.add_qkv_bias",
    "model.untie_embeddings_and_output_weights",
    # TE fuses the norms into the linears (other parameter names): not the same state dict.
    "model.transformer_impl",
)
# Not shapes, but what the weights were trained to mean. Refused when a run resumes its own
# checkpoint; printed (and applied) when a new run starts from another run's weights
# (checkpoint.load_dir), e.g. to turn a dense model into an S2 hybrid.
MEANING_KEYS = (
    "model.seq_length",
    "model.rotary_base",
    "model.rope_scaling",
    "model.rope_scaling_factor",
    "model.norm_epsilon",
    "data.tokenizer",
    "attention",
    # The prompt protocol: such a model reads every input behind EOD (the evaluator follows it).
    "train.eod_first",
)
# The run's plan: checkpoint.on_resume decides whether a resumed run uses the values given now
# ("apply") or its checkpoint's ("keep"); both print the differences. A section covers its keys.
PLAN_KEYS = (
    "optimizer",
    "train.train_iters",
    "train.global_batch_size",
    "train.seed",
    "train.eval_interval",
    "train.eval_iters",
    "train.reset_position_ids",
    "train.eod_mask_loss",
    "train.pack_documents",
    "model.hidden_dropout",
    "data.blend",
    "data.split",
    "data.demo",
    "data.demo_dir",
    "data.demo_num_docs",
    "checkpoint.save_interval",
    "checkpoint.save_at_end",
    "checkpoint.keep_last",
    "logging.log_interval",
)
# Where the run lives and how it resumes: not compared.
UNCOMPARED_KEYS = (
    "name",
    "logging.run_dir",
    "checkpoint.dir",
    "checkpoint.load_dir",
    "checkpoint.resume",
    "checkpoint.on_resume",
    "checkpoint.reset_iteration",
    "data.cache_dir",
)
# Every other key (parallel layout, micro-batch size, precision, recomputation, data workers,
# logging outputs, debug hooks) is how the run executes: the value given now is used, and
# differences are printed.


@dataclass(frozen=True)
class SettingChange:
    """One setting that differs between a checkpoint's run config and the run's."""

    key: str
    checkpoint: Any
    now: Any


@dataclass
class ResumeChanges:
    """How the run config differs from the config stored in the checkpoint it resumes from.

    ``refused``: settings that cannot change (shape; attention, tokenizer, seq length when
    resuming the run's own checkpoint). ``noted``: those of them a new run started from another
    run's weights may change. ``plan``: what ``checkpoint.on_resume`` decides. ``other``: how the
    run executes (always the values given now).
    """

    refused: list = field(default_factory=list)
    noted: list = field(default_factory=list)
    plan: list = field(default_factory=list)
    other: list = field(default_factory=list)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _get_dotted(d: dict, key: str):
    for part in key.split("."):
        d = d[part]
    return d


def _set_dotted(d: dict, key: str, value) -> None:
    *parents, last = key.split(".")
    for part in parents:
        d = d.setdefault(part, {})
    d[last] = value


def _in(key: str, keys: tuple) -> bool:
    return any(key == k or key.startswith(k + ".") for k in keys)


def _resolved_shape(d: dict) -> dict:
    """The SHAPE_KEYS of config mapping ``d`` with the defaults resolved."""
    m = {f.name: f.default for f in dataclasses.fields(ModelConfig)} | (d.get("model") or {})
    heads, hidden = m["num_attention_heads"], m["hidden_size"]
    resolved = {
        "num_query_groups": m["num_query_groups"] or heads,
        "kv_channels": m["kv_channels"] or (hidden // heads if heads else None),
        "ffn_hidden_size": m["ffn_hidden_size"] or 4 * hidden,
    }
    return {key: resolved.get(key[6:], m.get(key[6:])) for key in SHAPE_KEYS}


def _attention_changes(saved: dict, cfg: RunConfig) -> list:
    """Differences of the attention pattern, layer by layer: a schedule written differently
    (a pattern string instead of indices, defaults spelled out) is the same pattern."""
    from ..schedule import AttentionSchedule

    def schedule(d):  # None: every layer dense, as RunConfig.schedule() reads it
        if d is None:
            return AttentionSchedule.all_dense()
        return AttentionSchedule.from_dict(d, prefix="attention")

    n = cfg.model.num_layers
    try:
        old, new = schedule(saved.get("attention")), schedule(cfg.attention)
        # layer_description: the S2 pattern settings and the levers (sinks, the dense layers'
        # position encoding), so a change of either is seen like any other attention change.
        if [old.layer_description(i, n) for i in range(n)] == [
            new.layer_description(i, n) for i in range(n)
        ]:
            return []
        a, b = old.to_dict(), new.to_dict()
    except Exception:  # a schedule an older version wrote: compare what is written
        a, b = saved.get("attention") or {}, cfg.attention or {}
    fa, fb = _flatten(a, "attention."), _flatten(b, "attention.")
    changes = [
        SettingChange(k, fa.get(k), fb.get(k))
        for k in sorted(set(fa) | set(fb), key=str)
        if fa.get(k) != fb.get(k)
    ]
    return changes or [SettingChange("attention", a, b)]


# Keys added after run configs were first saved whose absence from a saved config means the
# behaviour of the versions before them: compared as that value, not skipped.
ABSENT_MEANS = {"train.eod_first": False}


def resume_changes(saved: dict, cfg: RunConfig, *, own: bool) -> ResumeChanges:
    """Compare ``cfg`` with ``saved``, the run config stored in the checkpoint to resume from.

    ``own``: the checkpoint is the run's own (a resume), not another run's (``load_dir``).
    Keys missing on one side (a config written by another version) are not compared, except
    those of :data:`ABSENT_MEANS`, whose absence is the value given there.
    """
    out = ResumeChanges()
    old_shape, new_shape = _resolved_shape(saved), _resolved_shape(cfg.to_dict())
    for key in SHAPE_KEYS:
        if old_shape[key] != new_shape[key]:
            out.refused.append(SettingChange(key, old_shape[key], new_shape[key]))
    meaning = _attention_changes(saved, cfg)
    fa, fb = (
        _flatten({k: v for k, v in saved.items() if k != "attention"}),
        _flatten({k: v for k, v in cfg.to_dict().items() if k != "attention"}),
    )
    fa = {**ABSENT_MEANS, **fa}
    for key in sorted(set(fa) & set(fb)):
        if fa[key] == fb[key] or _in(key, UNCOMPARED_KEYS) or key in SHAPE_KEYS:
            continue
        change = SettingChange(key, fa[key], fb[key])
        if _in(key, MEANING_KEYS):
            meaning.append(change)
        elif _in(key, PLAN_KEYS):
            out.plan.append(change)
        elif key != "model.init_method_std":  # used only to initialise: no effect on a resume
            out.other.append(change)
    (out.refused if own else out.noted).extend(meaning)
    return out


def format_changes(changes: list, old: str = "checkpoint", new: str = "now") -> str:
    """A table of ``changes``: one line per key with the checkpoint's and the new value."""

    def show(v) -> str:
        text = yaml.safe_dump(v, default_flow_style=True, width=1000).strip()
        return text.removesuffix("...").strip()

    rows = [("", old, new)] + [(c.key, show(c.checkpoint), show(c.now)) for c in changes]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"  {k:<{widths[0]}}  {a:<{widths[1]}}  {b}".rstrip() for k, a, b in rows)
