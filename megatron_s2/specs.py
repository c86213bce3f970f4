"""Megatron-core layer and block specs with S2 core attention.

Two ways to describe a hybrid model:

* **One layer spec for every layer** (:func:`get_s2_layer_local_spec`, :func:`get_s2_layer_te_spec`,
  and the ready objects :data:`s2_layer_spec` / :data:`s2_layer_spec_te`). Its core attention is
  :class:`~megatron_s2.attention.ScheduledCoreAttention`, which picks S2 or dense attention
  by the layer's global number from the model's schedule (``S2TransformerConfig.s2_schedule``,
  or ``$MEGATRON_S2_SCHEDULE`` for a plain ``TransformerConfig``). This is what Megatron-LM's
  ``pretrain_gpt.py --spec MODULE NAME`` needs: ``--spec megatron_s2.specs s2_layer_spec``.
* **A block spec with one explicit spec per layer** (:func:`get_s2_decoder_block_spec`), sliced
  to a pipeline stage like Megatron's ``get_gpt_decoder_block_spec``; the module of every layer
  is visible in the spec. :func:`megatron_s2.model.build_gpt_model` uses it.

Flavours: *local* (Megatron's own linears, :class:`~megatron_s2.norm.SPNorm` norms that support
sequence parallelism, dense layers on fused SDPA) and *TE* (Transformer Engine linears with fused
norms, TE attention for dense layers). Asking for a TE spec (or ``s2_layer_spec_te``) without
Transformer Engine raises an error that says what to install or which spec to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from .attention import (
    FusedDenseAttention,
    S2CoreAttention,
    S2SelfAttention,
    ScheduledCoreAttention,
)
from .config import s2_settings_of
from .norm import SPNorm

try:
    # Import TE itself first: without it, megatron.core.extensions.transformer_engine still
    # imports (its TE classes become mocks).
    import transformer_engine  # noqa: F401
    from megatron.core.extensions.transformer_engine import (
        TEDotProductAttention,
        TELayerNormColumnParallelLinear,
        TENorm,
        TERowParallelLinear,
    )

    HAVE_TE = True
except Exception:  # ImportError, or TE present but broken for this torch
    HAVE_TE = False

__all__ = [
    "get_s2_layer_local_spec",
    "get_s2_layer_te_spec",
    "get_s2_decoder_block_spec",
    "s2_layer_spec",
    "s2_layer_spec_te",
    "HAVE_TE",
    "TransformerEngineMissing",
]


class TransformerEngineMissing(RuntimeError):
    """A Transformer Engine spec was asked for where ``transformer_engine`` does not import.

    A ``RuntimeError`` on purpose: Megatron's ``import_module`` (``--spec``) turns an
    ``ImportError`` into a log line and a ``None`` spec."""


def _require_te(what: str) -> None:
    if not HAVE_TE:
        raise TransformerEngineMissing(
            f"{what} needs NVIDIA Transformer Engine, which is not installed here (or failed to "
            f"import with this torch). Install it (pip install --no-build-isolation "
            f"'transformer_engine[pytorch]', matching your CUDA and torch), or use the local "
            f"spec: --spec megatron_s2.specs s2_layer_spec --transformer-impl local under "
            f"Megatron-LM, use_te=False in megatron_s2.build_gpt_model"
        )


def _mlp_spec(fc1, fc2):
    submodules = MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2)
    # megatron-core >= 0.19 builds a layer's MLP through MLP.as_mlp_submodule (and warns when it
    # has to rewrap a ModuleSpec); 0.16.1 knows only the ModuleSpec form.
    if hasattr(MLP, "as_mlp_submodule"):
        return partial(MLP.as_mlp_submodule, submodules=submodules)
    return ModuleSpec(module=MLP, submodules=submodules)


@dataclass(frozen=True)
class _FlavourModules:
    """The modules a transformer layer takes from its flavour (local or TE), shared by the GPT
    layer spec here and the hybrid stack spec (:mod:`megatron_s2.hybrid`)."""

    qkv: type
    proj: type
    fc1: type
    fc2: type
    in_norm: type
    pre_mlp_norm: type
    qk_norm: type
    dense_attention: type
    # sharded_state_dict_keys_map entries of the attention and MLP halves of a layer
    attn_keys: dict
    mlp_keys: dict


def _flavour_modules(use_te: bool, qk_layernorm: bool, what: str) -> _FlavourModules:
    """Linears, norms and dense attention of the TE (``use_te``) or local flavour; ``what``
    names the caller in the error raised when TE is asked for and missing."""
    if use_te:
        _require_te(what)
        # TE fuses the pre-attention and pre-MLP norms into the following linear layer.
        return _FlavourModules(
            qkv=TELayerNormColumnParallelLinear,
            proj=TERowParallelLinear,
            fc1=TELayerNormColumnParallelLinear,
            fc2=TERowParallelLinear,
            in_norm=IdentityOp,
            pre_mlp_norm=IdentityOp,
            qk_norm=TENorm if qk_layernorm else IdentityOp,
            dense_attention=TEDotProductAttention,
            attn_keys={},
            mlp_keys={},
        )
    return _FlavourModules(
        qkv=ColumnParallelLinear,
        proj=RowParallelLinear,
        fc1=ColumnParallelLinear,
        fc2=RowParallelLinear,
        in_norm=SPNorm,
        pre_mlp_norm=SPNorm,
        qk_norm=SPNorm if qk_layernorm else IdentityOp,
        dense_attention=FusedDenseAttention,
        # Checkpoints stay interchangeable with the TE flavour (Megatron's local spec does this).
        attn_keys={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"},
        mlp_keys={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
    )


def self_attention_params(scheduled=None, rotary: Optional[dict] = None) -> dict:
    """``params`` of the :class:`~megatron_s2.attention.S2SelfAttention` spec: causal masks, the
    core-attention builder that maps layer numbers to the schedule (``scheduled``; None:
    :class:`ScheduledCoreAttention`) and the model's rotary options (``rotary``:
    :data:`megatron_s2.attention.ROTARY_KWARGS`) for the dense layers' own RoPE base."""
    return {"attn_mask_type": AttnMaskType.causal, "scheduled": scheduled, "rotary": rotary}


def _layer_spec(
    core_attention, use_te: bool, qk_layernorm: bool, rotary: Optional[dict] = None
) -> ModuleSpec:
    m = _flavour_modules(use_te, qk_layernorm, "S2 TE layer spec")
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=m.in_norm,
            self_attention=ModuleSpec(
                # SelfAttention with the schedule's position encoding per layer (NoPE or another
                # RoPE base on dense layers); plain SelfAttention for every other layer.
                module=S2SelfAttention,
                params=self_attention_params(rotary=rotary),
                submodules=SelfAttentionSubmodules(
                    linear_qkv=m.qkv,
                    core_attention=core_attention,
                    linear_proj=m.proj,
                    q_layernorm=m.qk_norm,
                    k_layernorm=m.qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=m.pre_mlp_norm,
            mlp=_mlp_spec(m.fc1, m.fc2),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={**m.attn_keys, **m.mlp_keys},
        ),
    )


def _scheduled_core_attention(use_te: bool) -> ModuleSpec:
    dense = TEDotProductAttention if use_te else FusedDenseAttention
    return ModuleSpec(module=ScheduledCoreAttention, params={"dense_attention": dense})


def get_s2_layer_local_spec(qk_layernorm: bool = False) -> ModuleSpec:
    """One ``TransformerLayer`` spec for all layers of a hybrid model, Megatron-core modules only.

    Core attention is chosen per layer from the model config's schedule when the model is
    built. Norms are :class:`SPNorm` (LayerNorm or RMSNorm per ``config.normalization``;
    sequence parallel works)."""
    return _layer_spec(_scheduled_core_attention(False), False, qk_layernorm)


def get_s2_layer_te_spec(qk_layernorm: bool = False) -> ModuleSpec:
    """Like :func:`get_s2_layer_local_spec` with Transformer Engine linears and fused norms;
    dense layers use ``TEDotProductAttention``."""
    _require_te("get_s2_layer_te_spec")
    return _layer_spec(_scheduled_core_attention(True), True, qk_layernorm)


def get_s2_decoder_block_spec(
    config,
    use_te: bool = False,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
    qk_layernorm: bool = False,
    rotary: Optional[dict] = None,
) -> TransformerBlockSubmodules:
    """``TransformerBlockSubmodules`` for this pipeline (and virtual pipeline) stage.

    Every layer gets an explicit core attention: :class:`S2CoreAttention` for S2 layers, the
    flavour's dense attention otherwise; the stage's slice follows Megatron's own layer
    assignment (``pipeline_model_parallel_layout`` or the uniform/uneven split), so layer ``i`` of
    a stage is global layer ``offset + i``. The final norm matches the flavour (SP-capable).
    ``rotary``: the model's rotary options (:data:`megatron_s2.attention.ROTARY_KWARGS`), for
    dense layers with their own RoPE base (``attention.dense_layers.rotary_base``).
    """
    if use_te:
        _require_te("get_s2_decoder_block_spec(use_te=True)")
    dense = TEDotProductAttention if use_te else FusedDenseAttention
    schedule = s2_settings_of(config).schedule
    # Dense layers with learned sinks run S2CoreAttention with a dense pattern (it finds the
    # layer dense in the schedule and builds that pattern itself).
    plain_dense = dense if not schedule.dense_sinks else S2CoreAttention
    specs = [
        _layer_spec(
            plain_dense if kind == "dense" else S2CoreAttention, use_te, qk_layernorm, rotary
        )
        for kind in schedule.layer_kinds(config.num_layers)
    ]

    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:
        from megatron.core.transformer.enums import LayerType

        ids = layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank
        )
        local = [specs[i] for i in ids]
    else:
        n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local = specs[offset : offset + n]
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=TENorm if use_te else SPNorm)


class _TransformerEngineMissingLayer(TransformerLayer):
    """Stands in for the TE layer spec where TE does not import: building a model with it fails
    with :class:`TransformerEngineMissing` instead of Megatron's "specialize for NoneType"."""

    def __init__(self, *args, **kwargs):
        _require_te("megatron_s2.specs.s2_layer_spec_te")


# Ready-made objects for `pretrain_gpt.py --spec megatron_s2.specs s2_layer_spec` (Megatron-LM
# imports a spec object, not a factory). The schedule is resolved when each layer is built.
s2_layer_spec: ModuleSpec = get_s2_layer_local_spec()
s2_layer_spec_te: ModuleSpec = (
    get_s2_layer_te_spec() if HAVE_TE else ModuleSpec(module=_TransformerEngineMissingLayer)
)
