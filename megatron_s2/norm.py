"""A sequence-parallel-aware LayerNorm/RMSNorm for the non-Transformer-Engine spec.

Megatron's ``WrappedTorchNorm`` (the local spec's norm without Apex) asserts
``not config.sequence_parallel``. Under sequence parallelism each TP rank normalizes its own
sequence chunk, so the norm's weight (and bias) gradients are partial sums over the chunk;
Megatron's ``finalize_model_grads`` SUM-reduces over the TP group every parameter that carries
``sequence_parallel = True``. That flag is all a torch norm needs to be correct under SP.
"""

from __future__ import annotations

import torch


class SPNorm:
    """``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` (by ``config.normalization``) whose
    parameters are marked for Megatron's sequence-parallel gradient all-reduce.

    Same constructor as Megatron's norm modules; returns the torch module itself, so checkpoints
    keep the ``weight``/``bias`` names of ``WrappedTorchNorm``. Input ``[s(/tp), b, h]``.
    """

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = None,
    ):
        if getattr(config, "layernorm_zero_centered_gamma", False) or zero_centered_gamma:
            raise ValueError(
                "SPNorm: layernorm_zero_centered_gamma is not supported; use the "
                "Transformer Engine spec or set it to False"
            )
        if getattr(config, "memory_efficient_layer_norm", False):
            raise ValueError("SPNorm: memory_efficient_layer_norm is not supported")
        kind = normalization or config.normalization
        if kind == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif kind == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(
                f"SPNorm: normalization must be 'LayerNorm' or 'RMSNorm', got {kind!r}"
            )
        for p in norm.parameters():
            # Read by finalize_model_grads (TP all-reduce of SP grads) and by the distributed
            # optimizer / checkpointing as "replicated across TP".
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm
