"""``S2TransformerConfig``: Megatron's ``TransformerConfig`` with the S2 settings as declared
fields.

This follows Megatron's own pattern for attention variants (``MLATransformerConfig``): the
variant's settings are dataclass fields, validated once in ``__post_init__``, and survive the
deep copies Megatron makes of the config (e.g. when it replaces ``num_query_groups`` by the TP
size for a model with fewer KV groups than TP ranks).

Megatron-LM's ``pretrain_gpt.py --spec`` builds a plain ``TransformerConfig``; for that path
:func:`s2_settings_of` falls back to the schedule named by ``$MEGATRON_S2_SCHEDULE``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

from megatron.core.transformer import TransformerConfig

from s2attn.attention import BACKENDS

from .flash_attention4 import check_dense_backend
from .schedule import SCHEDULE_ENV_VAR, AttentionSchedule, ScheduleError

__all__ = [
    "S2TransformerConfig",
    "S2Settings",
    "s2_settings_of",
    "s2_backend_of",
    "dense_backend_of",
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
        s2_seq_length: training sequence length in tokens: checked against the block sizes, used
            for union coverage and the per-layer density table. None = not known (coverage is
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
        cp = self.context_parallel_size
        if cp > 1 and settings.seq_length is not None:
            unit = settings.schedule.context_parallel_unit(layers, cp)
            if settings.seq_length % unit:
                raise ValueError(
                    f"context_parallel_size={cp}: s2_seq_length ({settings.seq_length}) must be a "
                    f"multiple of {unit} (2 x context_parallel_size chunks, each a whole number "
                    f"of every S2 layer's blocks {settings.schedule.block_sizes(layers)})"
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
