"""megatron_s2: S2 sparse attention for Megatron-core GPT pretraining.

    from megatron_s2 import AttentionSchedule, build_gpt_model
    schedule = AttentionSchedule.from_yaml("configs/attention/phi3_small.yaml")
    model = build_gpt_model(config, schedule, vocab_size=..., max_sequence_length=8192)

Megatron-LM: ``MEGATRON_S2_SCHEDULE=schedule.yaml pretrain_gpt.py --spec megatron_s2.specs
s2_layer_spec ...`` (see docs/megatron.md).

Only the schedule is imported eagerly; the Megatron-dependent parts load on first use so that
``import megatron_s2`` (e.g. for the trainer's config parsing) stays light.
"""

from .schedule import SCHEDULE_ENV_VAR, AttentionSchedule, S2Settings, ScheduleError

_LAZY = {
    "build_gpt_model": "model",
    "load_unsharded_parameters": "model",
    "S2CoreAttention": "core_attention",
    "ScheduledCoreAttention": "core_attention",
    "FusedDenseAttention": "dense_attention",
    "SPNorm": "norm",
    "get_s2_layer_local_spec": "specs",
    "get_s2_layer_te_spec": "specs",
    "get_s2_decoder_block_spec": "specs",
}

__all__ = ["AttentionSchedule", "S2Settings", "ScheduleError", "SCHEDULE_ENV_VAR", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'megatron_s2' has no attribute {name!r}")
