"""megatron_s2: S2 sparse attention for Megatron-core GPT models (the plugin).

    from megatron_s2 import S2TransformerConfig, build_gpt_model
    config = S2TransformerConfig(num_layers=32, ...,
                                 s2_schedule="configs/attention/phi3_small.yaml",
                                 s2_seq_length=8192)
    model = build_gpt_model(config, vocab_size=..., max_sequence_length=8192)

Megatron-LM: ``MEGATRON_S2_SCHEDULE=schedule.yaml pretrain_gpt.py --spec megatron_s2.specs
s2_layer_spec ...`` (see docs/megatron.md).

Data flows one way: schedule YAML -> :class:`AttentionSchedule` -> :class:`S2TransformerConfig`
-> specs -> core attention -> ``s2attn``. Every name loads on first use (the schedule needs
torch, the rest Megatron), so that the torch-free parts of ``megatron_s2.training`` (the
sweep's and the run config's command lines) start without them. The training application lives
in ``megatron_s2.training``.
"""

_LAZY = {
    "AttentionSchedule": "schedule",
    "ScheduleError": "schedule",
    "SCHEDULE_ENV_VAR": "schedule",
    "S2TransformerConfig": "config",
    "build_gpt_model": "model",
    "build_model": "model",
    "model_config": "model",
    "S2HybridTransformerConfig": "hybrid",
    "build_hybrid_model": "hybrid",
    "get_s2_hybrid_stack_spec": "hybrid",
    "load_unsharded_parameters": "unsharded",
    "S2CoreAttention": "attention",
    "ScheduledCoreAttention": "attention",
    "FusedDenseAttention": "attention",
    "SPNorm": "norm",
    "get_s2_layer_local_spec": "specs",
    "get_s2_layer_te_spec": "specs",
    "get_s2_decoder_block_spec": "specs",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'megatron_s2' has no attribute {name!r}")
