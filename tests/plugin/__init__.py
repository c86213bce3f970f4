"""Tests of the megatron_s2 plugin: schedule, attention, specs, models, context parallelism."""
