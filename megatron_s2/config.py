"""``S2TransformerConfig``: Megatron's ``TransformerConfig`` with the S2 settings as declared
fields.

This follows Megatron's own pattern for attention variants (``MLATransformerConfig``): the
variant's settings are dataclass fields, validated once in ``__post_init__``, and survive the
deep copies Megatron makes of the config (e.g. when it replaces ``num_query_groups`` by the TP
size for a model with fewer KV groups than TP ranks).

Megatron-LM's ``pretrain_gpt.py --spec`` builds a plain ``TransformerConfig``; for that path
:func:`s2_settings_of` falls back to the schedule named by ``$MEGATRON_S2_SCHEDULE``.

The sequence-length rules of the parallel layouts (:func:`check_parallel_lengths`,
:func:`check_packed_sequences`) live in :mod:`megatron_s2.parallel_lengths`, which imports no
Megatron, and are re-exported here beside the config that applies them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

from megatron.core.transformer import TransformerConfig

from s2attn.attention import BACKENDS

from .flash_attention4 import check_dense_backend
from .parallel_lengths import check_packed_sequences, check_parallel_lengths
from .schedule import SCHEDULE_ENV_VAR, AttentionSchedule, ScheduleError

__all__ = [
    "S2TransformerConfig",
    "S2Settings",
    "s2_settings_of",
    "s2_backend_of",
    "dense_backend_of",
    "check_parallel_lengths",
    "check_packed_sequences",
]

ScheduleLike = Union[AttentionSchedule, dict, str, os.PathLike]


@dataclass
class S2TransformerConfig(TransformerConfig):
    """``TransformerConfig`` plus the S2 attention settings.

    Args (beyond ``TransformerConfig``):
        s2_schedule: the attention schedule: an :class:`AttentionSchedule`, its mapping, or a
            YAML path (converted in ``__post_init__``). Required.
        s2_num_query_groups: the model's real number of KV groups; default ``num_query_groups``.
            Kept because Megatron overwrites ``num_query_groups`` with the TP size in the config
            copy it hands core attention when there are fewer groups than TP ranks.
        s2_seq_length: training sequence length in tokens: checked against the block sizes and
            the parallel layout (:func:`check_parallel_lengths`), used for union coverage and
            the per-layer density table. None = not known (coverage is
            checked at a length where every stripe phase shows).
        s2_backend: ``s2attn.s2_attention`` backend: "auto" (Triton on CUDA), "triton",
            "reference" (PyTorch).
        dense_backend: the dense layers' kernel (local spec): "auto" (FlashAttention-4 where
            the optional ``flash-attn-4`` package runs the call, else SDPA/cuDNN), "sdpa", or
            "fa4" (required; :mod:`megatron_s2.flash_attention4`).

    ``attention_dropout`` defaults to 0.0 here (Megatron's default is 0.1): S2 layers have no
    attention dropout and refuse a non-zero value.
    """

    attention_dropout: float = 0.0
    s2_schedule: Optional[ScheduleLike] = None
    s2_num_query_groups: Optional[int] = None
    s2_seq_length: Optional[int] = None
    s2_backend: str = "auto"
    dense_backend: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        if self.s2_schedule is None:
            raise ScheduleError(
                "S2TransformerConfig.s2_schedule is required: an AttentionSchedule, its mapping or "
                "a YAML path (AttentionSchedule.all_dense() for a dense baseline)"
            )
        self.s2_schedule = AttentionSchedule.coerce(self.s2_schedule)
        if self.s2_num_query_groups is None:
            self.s2_num_query_groups = self.num_query_groups
        if self.s2_backend not in BACKENDS:
            raise ValueError(
                f"S2TransformerConfig.s2_backend must be one of {BACKENDS}, got {self.s2_backend!r}"
            )
        check_dense_backend(
            "S2TransformerConfig.dense_backend", self.dense_backend, self.attention_dropout
        )
        if self.s2_seq_length is not None and self.s2_seq_length < 1:
            raise ValueError(
                f"S2TransformerConfig.s2_seq_length must be >= 1, got {self.s2_seq_length}"
            )
        settings = s2_settings_of(self)
        layers = self.s2_schedule_layers()
        settings.schedule.validate(
            layers,
            self.num_attention_heads,
            settings.num_query_groups,
            self.tensor_model_parallel_size,
            settings.seq_length,
        )
        if settings.seq_length is not None:
            check_parallel_lengths(
                settings.seq_length,
                tp=self.tensor_model_parallel_size,
                cp=self.context_parallel_size,
                sequence_parallel=self.sequence_parallel,
                block_sizes=settings.schedule.block_sizes(layers),
                seq_name="s2_seq_length",
            )
        settings.log_summary(self)

    def s2_schedule_layers(self) -> int:
        """How many layers the attention schedule indexes: every layer of a GPT model (the
        HybridModel config, :class:`megatron_s2.hybrid.S2HybridTransformerConfig`, counts its
        attention layers only)."""
        return self.num_layers


@dataclass(frozen=True)
class S2Settings:
    """The S2 view of a model config, whichever config class carries it."""

    schedule: AttentionSchedule
    num_query_groups: int  # the true group count
    seq_length: Optional[int]
    backend: str

    def log_summary(self, config) -> None:
        layers = (
            config.s2_schedule_layers()
            if isinstance(config, S2TransformerConfig)
            else config.num_layers
        )
        self.schedule.log_summary(
            layers, config.num_attention_heads, self.num_query_groups, self.seq_length
        )


def s2_settings_of(config) -> S2Settings:
    """The S2 settings of a model config: the fields of an :class:`S2TransformerConfig`, or for a
    plain ``TransformerConfig`` (Megatron-LM's ``--spec`` path) the schedule in
    ``$MEGATRON_S2_SCHEDULE``, validated against the config and logged once."""
    if isinstance(config, S2TransformerConfig):
        return S2Settings(
            config.s2_schedule, config.s2_num_query_groups, config.s2_seq_length, config.s2_backend
        )
    schedule = AttentionSchedule.from_env()
    if schedule is None:
        raise ScheduleError(
            f"megatron_s2: this model's config is a plain TransformerConfig with no attention "
            f"schedule. Build it as megatron_s2.S2TransformerConfig(..., s2_schedule=...) or, "
            f"under Megatron-LM's pretrain_gpt.py --spec, point ${SCHEDULE_ENV_VAR} at a "
            f"schedule YAML"
        )
    settings = S2Settings(schedule, config.num_query_groups, None, "auto")
    schedule.validate(
        config.num_layers,
        config.num_attention_heads,
        settings.num_query_groups,
        config.tensor_model_parallel_size,
    )
    settings.log_summary(config)
    return settings


def s2_backend_of(config) -> str:
    """The ``s2_attention`` backend of a model config ("auto" for a plain ``TransformerConfig``)."""
    return config.s2_backend if isinstance(config, S2TransformerConfig) else "auto"


def dense_backend_of(config) -> str:
    """The dense layers' backend of a model config (:data:`megatron_s2.flash_attention4.
    DENSE_BACKENDS`; "auto" for a plain ``TransformerConfig``)."""
    return config.dense_backend if isinstance(config, S2TransformerConfig) else "auto"
