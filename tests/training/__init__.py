"""Tests of megatron_s2.training: run config, trainer, checkpoints, data, evaluation, sweeps."""
