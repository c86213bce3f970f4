"""One-call ``GPTModel`` builder for an :class:`S2TransformerConfig`, and TP/PP-agnostic
weight helpers (load one set of unsharded weights into any layout, compare across layouts)."""

from __future__ import annotations

import inspect
import re
from typing import Dict, Iterator, Mapping, Optional, Tuple

import torch
from megatron.core.models.gpt import GPTModel

from .config import S2TransformerConfig
from .specs import get_s2_decoder_block_spec


def build_gpt_model(config: S2TransformerConfig, vocab_size: int, max_sequence_length: int,
                    pre_process: bool = True, post_process: bool = True, use_te: bool = False,
                    vp_stage: Optional[int] = None, qk_layernorm: bool = False,
                    **gpt_kwargs) -> GPTModel:
    """Build a Megatron-core ``GPTModel`` whose attention follows ``config.s2_schedule``.

    Args:
        config: an :class:`S2TransformerConfig` (schedule, true GQA groups, training sequence
            length and kernel backend are its fields, validated when it was built).
        vocab_size, max_sequence_length, pre_process, post_process: as for ``GPTModel``.
        use_te: Transformer Engine flavour (TE linears/norms, TE attention on dense layers).
        vp_stage: virtual pipeline stage of this model chunk (also passed to ``GPTModel``).
        qk_layernorm: normalize queries and keys per head.
        gpt_kwargs: passed to ``GPTModel`` (``position_embedding_type``, ``rotary_base``, ...).
    Returns:
        the ``GPTModel`` for this rank's pipeline (and virtual pipeline) stage.
    """
    if not isinstance(config, S2TransformerConfig):
        raise TypeError(f"build_gpt_model needs a megatron_s2.S2TransformerConfig (the attention "
                        f"schedule is one of its fields), got {type(config).__name__}")
    spec = get_s2_decoder_block_spec(config, use_te=use_te, vp_stage=vp_stage,
                                     qk_layernorm=qk_layernorm)
    if vp_stage is not None and "vp_stage" in inspect.signature(GPTModel.__init__).parameters:
        gpt_kwargs["vp_stage"] = vp_stage
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                    max_sequence_length=max_sequence_length, pre_process=pre_process,
                    post_process=post_process, **gpt_kwargs)


# ---------------------------------------------------------------------- unsharded weights
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    # DDP and Float16Module both keep the wrapped model in `.module`.
    while not isinstance(module, GPTModel) and hasattr(module, "module"):
        module = module.module
    return module


def _tp_slice(full: torch.Tensor, param: torch.nn.Parameter, name: str, config) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return full
    from megatron.core import parallel_state

    dim = param.partition_dim
    rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if config.gated_linear_unit and "linear_fc1." in name and dim == 0:
        # Each rank holds [gate_r; up_r], the unsharded weight is [gate; up].
        return torch.cat([h.chunk(tp, dim=0)[rank] for h in full.chunk(2, dim=0)], dim=0)
    return full.chunk(tp, dim=dim)[rank]


def named_parameters_unsharded(model_chunks) -> Iterator[Tuple[str, torch.nn.Parameter, object]]:
    """``(name, param, config)`` for this rank's parameters, with ``decoder.layers.<i>`` renamed
    to the layer's global 0-based index (the name the parameter has in a TP=1/PP=1 model)."""
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    for chunk in model_chunks:
        model = _unwrap(chunk)
        for name, param in model.named_parameters():
            m = _LAYER_RE.match(name)
            if m:
                layer = model.decoder.layers[int(m.group(1))]
                name = f"decoder.layers.{layer.layer_number - 1}." + name[m.end():]
            yield name, param, model.config


def iter_unsharded_pairs(model_chunks, full: Mapping[str, torch.Tensor]
                         ) -> Iterator[Tuple[str, torch.nn.Parameter, torch.Tensor]]:
    """For every parameter of this rank's model chunks, yield ``(unsharded_name, param, slice)``
    where ``slice`` is the part of ``full[unsharded_name]`` (a TP=1/PP=1 tensor of the same name)
    this rank holds. Layers are matched by their global ``layer_number``; TP slices follow the
    parameters' ``partition_dim`` (gated MLPs included). For loading one set of weights into any
    TP/PP layout and for comparing gradients across layouts."""
    for name, param, config in named_parameters_unsharded(model_chunks):
        if name not in full:
            raise KeyError(f"unsharded state has no entry {name!r}")
        yield name, param, _tp_slice(full[name], param, name, config)


@torch.no_grad()
def load_unsharded_parameters(model_chunks, full: Mapping[str, torch.Tensor]) -> None:
    """Copy TP=1/PP=1 parameters (``named_parameters()`` of an unwrapped single-rank GPTModel)
    into this rank's (possibly TP/PP/VPP-sharded, DDP- or Float16-wrapped) model chunks."""
    for name, param, value in iter_unsharded_pairs(model_chunks, full):
        if value.shape != param.shape:
            raise ValueError(f"{name}: unsharded slice {tuple(value.shape)} does not fit the "
                             f"parameter {tuple(param.shape)}")
        param.copy_(value.to(param.dtype))


def unsharded_parameters(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """``{name: tensor}`` of a single-rank (TP=1, PP=1) model, CPU fp32 copies."""
    return {n: p.detach().float().cpu().clone() for n, p in _unwrap(model).named_parameters()}
