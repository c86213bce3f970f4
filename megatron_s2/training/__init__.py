"""The training application: ``megatron-s2-train``, built from Megatron-core's parts.

Separate from the plugin (``megatron_s2``: config, schedule, attention, specs, model) so that a
Megatron-LM user who only needs the layer spec installs none of the trainer's dependencies.
"""
