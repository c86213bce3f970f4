"""TP/PP-agnostic parameter names: load one set of unsharded (TP=1, PP=1) weights into any
parallel layout, and compare parameters or gradients across layouts (the parallel checks)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch
from megatron.core.models.gpt import GPTModel

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


def named_parameters_unsharded(model_chunks) -> Iterator[tuple[str, torch.nn.Parameter, object]]:
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
                name = f"decoder.layers.{layer.layer_number - 1}." + name[m.end() :]
            yield name, param, model.config


def iter_unsharded_pairs(
    model_chunks, full: Mapping[str, torch.Tensor]
) -> Iterator[tuple[str, torch.nn.Parameter, torch.Tensor]]:
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
            raise ValueError(
                f"{name}: unsharded slice {tuple(value.shape)} does not fit the "
                f"parameter {tuple(param.shape)}"
            )
        param.copy_(value.to(param.dtype))


def unsharded_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of a single-rank (TP=1, PP=1) model, CPU fp32 copies."""
    return {n: p.detach().float().cpu().clone() for n, p in _unwrap(model).named_parameters()}
