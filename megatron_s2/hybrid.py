"""S2 attention in Megatron-core's ``HybridModel`` (megatron-core >= 0.19).

megatron-core 0.19 deprecates ``GPTModel`` in favour of ``HybridModel``, whose stack is described
by a *hybrid layer pattern*: one character per layer, ``*`` self-attention, ``-`` MLP, ``M``
Mamba, ``|`` a pipeline-stage boundary. A GPT model of ``N`` layers is the pattern ``"*-" * N``
(``2N`` hybrid layers): GPT layer ``i``'s attention is the ``i``-th ``*``, its MLP the ``i``-th
``-``; Megatron's GPT-to-Hybrid checkpoint conversion pairs them the same way.

**Which layer the schedule indexes.** The attention schedule (``megatron_s2.schedule``) indexes
**attention layers**: YAML index ``k`` is the ``k``-th ``*`` of the pattern (0-based, negative
from the last ``*``), whatever MLP or Mamba layers sit between. So a schedule written for a GPT
model applies unchanged to its hybrid twin, and inserting MLP/Mamba layers does not shift it.
Megatron hands each layer its global 1-based ``layer_number`` (position in the pattern with the
``|`` removed) under any pipeline split, auto or by ``|``, with or without virtual stages; the
attention index is computed from that number and the full pattern, so it is the same on every
pipeline layout.

Pieces:

* :class:`S2HybridTransformerConfig` -- :class:`S2TransformerConfig` plus the hybrid layer
  pattern; validated once (pattern symbols, layer count, the schedule against the attention
  layers) before any module is built.
* :func:`get_s2_hybrid_stack_spec` -- the ``HybridStack`` spec: attention layers with
  :class:`HybridScheduledCoreAttention` (S2 or dense per attention layer), MLP layers, and, with
  Transformer Engine and ``mamba_ssm``, Megatron's own Mamba layers.
* :func:`build_hybrid_model` -- the one-call ``HybridModel`` builder (``build_gpt_model``'s twin).

Flavours as in :mod:`megatron_s2.specs`: *local* (Megatron-core linears, :class:`SPNorm` norms,
also as the final norm, which ``HybridStack`` hard-codes to TE's) and *TE*. Mamba layers exist
only in Megatron's TE flavour and need ``mamba_ssm`` and ``causal_conv1d``. Multi-token
prediction (``/`` in the pattern) and the other layer kinds (MoE, GDN, MLA, DSA) are refused.

On megatron-core without ``HybridModel`` (0.16.1) this module imports; the config and builders
raise :class:`HybridModelUnavailable`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)

from .attention import (
    S2SelfAttention,
    ScheduledCoreAttention,
    check_position_levers,
    rotary_options,
)
from .config import S2TransformerConfig, s2_settings_of
from .norm import SPNorm
from .specs import _flavour_modules, _mlp_spec, self_attention_params

try:
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.ssm.mlp_layer import MLPLayer

    HAVE_HYBRID = True
except ImportError:
    HAVE_HYBRID = False

__all__ = [
    "S2HybridTransformerConfig",
    "HybridScheduledCoreAttention",
    "get_s2_hybrid_stack_spec",
    "s2_hybrid_stack_spec",
    "build_hybrid_model",
    "attention_layer_index",
    "is_gpt_twin_pattern",
    "HybridModelUnavailable",
    "HAVE_HYBRID",
]

ATTENTION, MLP, MAMBA, PIPE, MTP = "*", "-", "M", "|", "/"
_SUPPORTED = (ATTENTION, MLP, MAMBA, PIPE)


class HybridModelUnavailable(RuntimeError):
    """The installed megatron-core has no ``HybridModel`` (it arrived in 0.19)."""


def _require_hybrid(what: str) -> None:
    if HAVE_HYBRID:
        return
    try:
        from megatron.core.package_info import __version__ as version
    except ImportError:
        version = "unknown"
    raise HybridModelUnavailable(
        f"{what} needs Megatron-core's HybridModel (megatron.core.models.hybrid), which "
        f"megatron-core >= 0.19 has; the installed megatron-core is {version}. Upgrade "
        f"megatron-core (0.19 needs Python >= 3.12), or build a GPTModel with "
        f"megatron_s2.build_gpt_model"
    )


def _mamba_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("mamba_ssm", "causal_conv1d"))


def _main_pattern(pattern: str) -> str:
    """The layer characters of a hybrid pattern: ``|`` stage boundaries removed."""
    return pattern.replace(PIPE, "")


def attention_layer_index(hybrid_layer_pattern: str, layer_number: int) -> int:
    """0-based index among the attention (``*``) layers of the hybrid layer with Megatron's
    global 1-based ``layer_number`` in ``hybrid_layer_pattern`` (``|`` boundaries ignored): the
    layer index the attention schedule uses. ``"*-*-"``: layer 1 -> 0, layer 3 -> 1."""
    layers = _main_pattern(hybrid_layer_pattern)
    if not 1 <= layer_number <= len(layers) or layers[layer_number - 1] != ATTENTION:
        raise ValueError(
            f"layer_number {layer_number} is not an attention ('*') layer of the hybrid layer "
            f"pattern {hybrid_layer_pattern!r} (1-based, '|' not counted)"
        )
    return layers[: layer_number - 1].count(ATTENTION)


def is_gpt_twin_pattern(hybrid_layer_pattern: str) -> bool:
    """Whether the pattern is a GPT model's twin: ``"*-" * N`` (``|`` boundaries anywhere
    between the pairs), so hybrid layers ``2i`` and ``2i + 1`` are GPT layer ``i``."""
    pairs = hybrid_layer_pattern.split(PIPE)
    return bool(_main_pattern(hybrid_layer_pattern)) and all(
        len(p) % 2 == 0 and p == "*-" * (len(p) // 2) for p in pairs
    )


def _check_pattern(pattern) -> str:
    """The pattern's layer characters; ValueError naming the setting on anything unsupported."""
    where = "S2HybridTransformerConfig.hybrid_layer_pattern"
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(
            f"{where} is required: a string of {', '.join(repr(s) for s in _SUPPORTED)} "
            f"(attention, MLP, Mamba, pipeline-stage boundary), e.g. '*-*-*-*-'; got {pattern!r}"
        )
    if MTP in pattern:
        raise ValueError(
            f"{where} {pattern!r}: multi-token prediction ('/' patterns) is not supported with "
            f"S2 attention; remove the part from '/' on"
        )
    bad = sorted(set(pattern) - set(_SUPPORTED))
    if bad:
        raise ValueError(
            f"{where} {pattern!r}: layer symbols {bad} are not supported with S2 attention; "
            f"allowed: '*' (attention), '-' (MLP), 'M' (Mamba), '|' (pipeline-stage boundary)"
        )
    layers = _main_pattern(pattern)
    if ATTENTION not in layers:
        raise ValueError(
            f"{where} {pattern!r} has no attention ('*') layers, so the attention schedule "
            f"applies to nothing; use Megatron's own hybrid stack spec for such a model"
        )
    if MAMBA in layers and not _mamba_available():
        raise ValueError(
            f"{where} {pattern!r} has Mamba ('M') layers, which need the packages mamba_ssm "
            f"and causal_conv1d (not installed here); install them (and Transformer Engine), "
            f"or use a pattern of '*' and '-' only"
        )
    return layers


@dataclass
class S2HybridTransformerConfig(S2TransformerConfig):
    """:class:`S2TransformerConfig` for a ``HybridModel``: the S2 settings plus the stack's layer
    pattern, validated once in ``__post_init__``.

    Args (beyond :class:`S2TransformerConfig`):
        hybrid_layer_pattern: Megatron's hybrid layer pattern, one character per layer: ``*``
            attention, ``-`` MLP, ``M`` Mamba (needs ``mamba_ssm``, ``causal_conv1d`` and TE),
            ``|`` pipeline-stage boundary. Required.
        gpt_checkpoint_keys: checkpoint under the keys of the GPT model whose twin this is
            (pattern ``"*-" * N``, ``|`` between pairs): a checkpoint of either class then
            loads into the other (:class:`S2HybridStack`). Megatron's own hybrid keys otherwise.

    ``num_layers`` counts every hybrid layer (Megatron's convention: ``"*-*-"`` is 4 layers); 0
    (the default) takes it from the pattern. ``s2_schedule`` indexes the attention layers only
    (:func:`attention_layer_index`) and is validated against their number.
    ``is_hybrid_model`` defaults to True, as Megatron-LM sets it for hybrid models (the output
    layers' init std then scales with ``1/sqrt(num_layers)``, equal to a GPT model's
    ``1/sqrt(2 * gpt_layers)`` for the ``"*-"`` twin).
    """

    hybrid_layer_pattern: Optional[str] = None
    is_hybrid_model: bool = True
    gpt_checkpoint_keys: bool = False

    def __post_init__(self):
        _require_hybrid("S2HybridTransformerConfig")
        layers = _check_pattern(self.hybrid_layer_pattern)
        if not self.num_layers:
            self.num_layers = len(layers)
        elif self.num_layers != len(layers):
            raise ValueError(
                f"S2HybridTransformerConfig.num_layers ({self.num_layers}) must equal the number "
                f"of layers in hybrid_layer_pattern {self.hybrid_layer_pattern!r} "
                f"({len(layers)}), or be left at 0 to take it from the pattern"
            )
        if self.gpt_checkpoint_keys and not is_gpt_twin_pattern(self.hybrid_layer_pattern):
            raise ValueError(
                f"S2HybridTransformerConfig.gpt_checkpoint_keys needs a GPT model's twin: "
                f"hybrid_layer_pattern '*-' * N ('|' only between pairs), got "
                f"{self.hybrid_layer_pattern!r}"
            )
        segments = self.hybrid_layer_pattern.count(PIPE) + 1
        stages = self.pipeline_model_parallel_size * (
            self.virtual_pipeline_model_parallel_size or 1
        )
        if segments > 1 and segments != stages:
            # Megatron builds segment vp_stage * pp + pp_rank only: with fewer stages than
            # segments the rest of the model would silently be missing.
            raise ValueError(
                f"S2HybridTransformerConfig.hybrid_layer_pattern {self.hybrid_layer_pattern!r} "
                f"has {segments} '|'-separated pipeline segments, but pipeline_model_parallel_"
                f"size x virtual_pipeline_model_parallel_size is {stages}; they must be equal "
                f"(or leave out '|' for Megatron's even split)"
            )
        super().__post_init__()

    def s2_schedule_layers(self) -> int:
        """The attention (``*``) layers: the layers the schedule indexes."""
        return _main_pattern(self.hybrid_layer_pattern).count(ATTENTION)


class HybridScheduledCoreAttention(ScheduledCoreAttention):
    """Core-attention builder for the attention layers of a hybrid stack: S2 or dense per layer.

    ``HybridStack`` builds every ``*`` layer from one spec and passes its global 1-based
    ``layer_number``; this looks up the layer's attention index (:func:`attention_layer_index`)
    in ``config.s2_schedule`` and returns an :class:`S2CoreAttention` with that index's pattern,
    or ``dense_attention(...)`` (default :class:`FusedDenseAttention`; the TE spec passes
    ``TEDotProductAttention``). The returned module keeps Megatron's ``layer_number``.

    A plain ``TransformerConfig`` (Megatron-LM's ``pretrain_hybrid.py --spec``) has no layer
    pattern: it is read from Megatron-LM's arguments (``--hybrid-layer-pattern``), the schedule
    from ``$MEGATRON_S2_SCHEDULE`` (:func:`megatron_s2.config.s2_settings_of`), checked against
    the pattern's attention layers.
    """

    @classmethod
    def schedule_position(cls, config, layer_number: int) -> tuple[int, int]:
        if isinstance(config, S2HybridTransformerConfig):
            index = attention_layer_index(config.hybrid_layer_pattern, layer_number)
            return index + 1, config.s2_schedule_layers()
        pattern = _megatron_lm_pattern()
        if pattern is None:
            raise TypeError(
                f"HybridScheduledCoreAttention needs a megatron_s2.hybrid."
                f"S2HybridTransformerConfig (the hybrid layer pattern maps layer numbers to "
                f"attention layers), or Megatron-LM's pretrain_hybrid.py with "
                f"--hybrid-layer-pattern; got a {type(config).__name__} and no Megatron-LM "
                f"arguments"
            )
        attention_layers = _check_pattern(pattern).count(ATTENTION)
        # s2_settings_of checks the schedule against config.num_layers, which counts every
        # hybrid layer; the schedule indexes the attention layers only.
        settings = s2_settings_of(config)
        settings.schedule.validate(
            attention_layers,
            config.num_attention_heads,
            settings.num_query_groups,
            config.tensor_model_parallel_size,
        )
        return attention_layer_index(pattern, layer_number) + 1, attention_layers


def _megatron_lm_pattern() -> Optional[str]:
    """``--hybrid-layer-pattern`` of a running Megatron-LM (``pretrain_hybrid.py``), else None."""
    try:
        from megatron.training.global_vars import get_args

        args = get_args()
    except (ImportError, AssertionError):  # no Megatron-LM, or its arguments not parsed
        return None
    return getattr(args, "hybrid_layer_pattern", None)


if HAVE_HYBRID:

    class S2HybridModel(HybridModel):
        """``HybridModel`` whose checkpoint matches its GPT twin's with
        ``config.gpt_checkpoint_keys`` (the layers' keys are :class:`S2HybridStack`'s): like
        ``GPTModel``, it leaves out the output layer's ``_extra_state``, which is empty."""

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
            """``HybridModel``'s sharded state dict; with ``config.gpt_checkpoint_keys`` without
            the (empty) output-layer extra state, as ``GPTModel``'s."""
            sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            if getattr(self.config, "gpt_checkpoint_keys", False):
                extra = sd.pop(f"{prefix}output_layer._extra_state", None)
                if extra is not None and extra.data:
                    raise ValueError(
                        f"the output layer's extra state is not empty ({extra.data!r}); a "
                        f"GPTModel checkpoint has no place for it"
                    )
            return sd

    class S2HybridStack(HybridStack):
        """``HybridStack`` with the final norm from the spec (``params={"final_norm": ...}``:
        Megatron's stack always builds TE's norm, which the local flavour must not need) and,
        with ``config.gpt_checkpoint_keys``, the GPT twin's checkpoint keys.

        Checkpoint keys: ``HybridStack`` keys each layer by its own index
        (``layers.<n>.``); a ``GPTModel``'s ``TransformerBlock`` stacks its layers into one
        tensor per parameter (``layers.<name>`` with the layer as a leading axis), or, when the
        checkpoint metadata asks for non-homogeneous layers, keys them ``layers.<i>.``. With
        ``gpt_checkpoint_keys`` this stack does what ``TransformerBlock`` does with GPT layer
        ``i`` = hybrid layers ``2i`` and ``2i + 1`` (attention and MLP: their parameter names do
        not overlap), and keys the final norm ``final_layernorm``: a checkpoint of either model
        class loads into the other (the parameters also come in the GPT model's order, so the
        distributed optimizer's flat buffers match)."""

        def __init__(self, config, submodules, *args, final_norm=SPNorm, **kwargs):
            post_layer_norm = kwargs.pop("post_layer_norm", True)
            super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                self.final_norm = build_module(
                    final_norm,
                    config=config,
                    hidden_size=config.hidden_size,
                    eps=config.layernorm_epsilon,
                )

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
            """``HybridStack``'s sharded state dict, under the GPT twin's keys when
            ``config.gpt_checkpoint_keys``."""
            if not getattr(self.config, "gpt_checkpoint_keys", False):
                return super().sharded_state_dict(prefix, sharded_offsets, metadata)
            from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
            from megatron.core.transformer.utils import sharded_state_dict_default

            metadata = metadata or {}
            # TransformerBlock's rule (the flags that apply to a dense GPT model).
            per_layer_keys = bool(
                metadata.get("non_homogeneous_layers")
                or metadata.get("singleton_local_shards")
                or self.config.hetereogenous_dist_checkpoint
            )
            gpt_layers = self.config.num_layers // 2
            sd = {}
            for index, layer in enumerate(self.layers):
                gpt_layer = (layer.layer_number - 1) // 2
                local = f"{prefix}layers.{index}."
                if per_layer_keys:
                    key, offsets = f"{prefix}layers.{gpt_layer}.", []
                else:
                    key, offsets = f"{prefix}layers.", [(0, gpt_layer, gpt_layers)]
                layer_sd = layer.sharded_state_dict(local, offsets, metadata)
                replace_prefix_for_sharding(layer_sd, local, key)
                sd.update(layer_sd)
            for name, module in self.named_children():
                if module is self.layers:
                    continue
                module_sd = sharded_state_dict_default(
                    module, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=self.tp_group
                )
                if name == "final_norm":
                    replace_prefix_for_sharding(
                        module_sd, f"{prefix}final_norm.", f"{prefix}final_layernorm."
                    )
                sd.update(module_sd)
            return sd


def get_s2_hybrid_stack_spec(
    config: S2HybridTransformerConfig,
    use_te: bool = False,
    qk_layernorm: bool = False,
    rotary: Optional[dict] = None,
) -> ModuleSpec:
    """The ``HybridStack`` spec for ``HybridModel(hybrid_stack_spec=...)`` with S2 attention.

    Attention layers (``*``): ``TransformerLayer`` with self-attention only, core attention
    :class:`HybridScheduledCoreAttention`. MLP layers (``-``): Megatron's ``MLPLayer``. Mamba
    layers (``M``, TE flavour only): Megatron's own spec. A hybrid attention layer followed by an
    MLP layer computes exactly a GPT ``TransformerLayer`` of :mod:`megatron_s2.specs`.

    Args:
        config: the model's :class:`S2HybridTransformerConfig` (its pattern decides which layer
            kinds the spec needs).
        use_te: Transformer Engine flavour (TE linears with fused norms, TE final norm,
            ``TEDotProductAttention`` on dense layers); needs TE.
        qk_layernorm: normalize queries and keys per head.
        rotary: the model's rotary options (:data:`megatron_s2.attention.ROTARY_KWARGS`), for
            dense layers with their own RoPE base (``attention.dense_layers.rotary_base``).
    """
    _require_hybrid("get_s2_hybrid_stack_spec")
    if not isinstance(config, S2HybridTransformerConfig):
        raise TypeError(
            f"get_s2_hybrid_stack_spec needs a megatron_s2.hybrid.S2HybridTransformerConfig, "
            f"got {type(config).__name__}"
        )
    has_mamba = MAMBA in config.hybrid_layer_pattern
    if has_mamba and not use_te:
        raise ValueError(
            f"S2HybridTransformerConfig.hybrid_layer_pattern "
            f"{config.hybrid_layer_pattern!r} has Mamba ('M') layers, which Megatron-core "
            f"builds only with Transformer Engine: use use_te=True, or a pattern of '*' and "
            f"'-' only"
        )
    return _stack_spec(
        use_te, qk_layernorm, mamba=has_mamba, s2_stack=config.gpt_checkpoint_keys, rotary=rotary
    )


def _stack_spec(
    use_te: bool, qk_layernorm: bool, *, mamba: bool, s2_stack: bool, rotary: Optional[dict] = None
) -> ModuleSpec:
    """The ``HybridStack`` spec of a flavour: attention and MLP layers, Mamba layers when
    ``mamba``; :class:`S2HybridStack` for the local flavour and, with ``s2_stack`` (GPT
    checkpoint keys), for TE."""
    m = _flavour_modules(use_te, qk_layernorm, "the S2 HybridModel spec with use_te=True")

    attention_layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=m.in_norm,
            self_attention=ModuleSpec(
                module=S2SelfAttention,
                params=self_attention_params(HybridScheduledCoreAttention, rotary),
                submodules=SelfAttentionSubmodules(
                    linear_qkv=m.qkv,
                    core_attention=ModuleSpec(
                        module=HybridScheduledCoreAttention,
                        params={"dense_attention": m.dense_attention},
                    ),
                    linear_proj=m.proj,
                    q_layernorm=m.qk_norm,
                    k_layernorm=m.qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=m.attn_keys,
        ),
    )
    mlp_layer = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=m.pre_mlp_norm,
            mlp=_mlp_spec(m.fc1, m.fc2),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=m.mlp_keys,
        ),
    )
    layers = {"attention_layer": attention_layer, "mlp_layer": mlp_layer}
    if mamba:
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

        layers["mamba_layer"] = hybrid_stack_spec.submodules.mamba_layer
    submodules = HybridStackSubmodules(**layers)
    if use_te and not s2_stack:
        return ModuleSpec(module=HybridStack, submodules=submodules)
    final_norm = SPNorm
    if use_te:  # the final norm HybridStack itself builds; S2HybridStack adds the GPT keys
        from megatron.core.extensions.transformer_engine import TENorm as final_norm
    return ModuleSpec(
        module=S2HybridStack, submodules=submodules, params={"final_norm": final_norm}
    )


# Ready object for Megatron-LM's `pretrain_hybrid.py --spec megatron_s2.hybrid
# s2_hybrid_stack_spec` (local flavour: '*' and '-' layers, `--transformer-impl local`); None on
# a megatron-core without HybridModel.
s2_hybrid_stack_spec: Optional[ModuleSpec] = (
    _stack_spec(False, False, mamba=False, s2_stack=True) if HAVE_HYBRID else None
)


_PATTERN_KWARGS = (
    "hybrid_layer_pattern",
    "hybrid_override_pattern",
    "hybrid_attention_ratio",
    "hybrid_mlp_ratio",
)


def build_hybrid_model(
    config: S2HybridTransformerConfig,
    vocab_size: int,
    max_sequence_length: int,
    pre_process: bool = True,
    post_process: bool = True,
    use_te: bool = False,
    vp_stage: Optional[int] = None,
    qk_layernorm: bool = False,
    **hybrid_kwargs,
):
    """Build a Megatron-core ``HybridModel`` whose attention layers follow ``config.s2_schedule``.

    Args:
        config: an :class:`S2HybridTransformerConfig` (layer pattern, schedule, true GQA groups,
            training length, kernel backend; validated when it was built).
        vocab_size, max_sequence_length, pre_process, post_process: as for ``HybridModel``.
        use_te: Transformer Engine flavour (:func:`get_s2_hybrid_stack_spec`).
        vp_stage: virtual pipeline stage of this model chunk (the pattern needs ``|`` stage
            boundaries for virtual pipelining, Megatron's rule).
        qk_layernorm: normalize queries and keys per head.
        hybrid_kwargs: passed to ``HybridModel`` (``position_embedding_type`` -- its default is
            ``"none"``, GPTModel's ``"learned_absolute"`` -- ``rotary_base``,
            ``share_embeddings_and_output_weights``, ...). The pattern is the config's.
    Returns:
        the ``HybridModel`` (:class:`S2HybridModel`) for this rank's pipeline (and virtual
        pipeline) stage; its forward
        takes ``(input_ids [b, s], position_ids [b, s], attention_mask, labels=[b, s])`` and
        returns the per-token loss ``[b, s]`` (logits ``[b, s, vocab / tp]`` without labels).
    """
    _require_hybrid("build_hybrid_model")
    if not isinstance(config, S2HybridTransformerConfig):
        raise TypeError(
            f"build_hybrid_model needs a megatron_s2.hybrid.S2HybridTransformerConfig (the "
            f"layer pattern and the attention schedule are its fields), got "
            f"{type(config).__name__}"
        )
    given = [k for k in _PATTERN_KWARGS if k in hybrid_kwargs]
    if given:
        raise ValueError(
            f"build_hybrid_model: {', '.join(given)} must not be passed; the layer pattern is "
            f"S2HybridTransformerConfig.hybrid_layer_pattern ({config.hybrid_layer_pattern!r})"
        )
    # HybridModel's default position embedding is none.
    check_position_levers(config.s2_schedule, hybrid_kwargs.get("position_embedding_type", "none"))
    spec = get_s2_hybrid_stack_spec(
        config, use_te=use_te, qk_layernorm=qk_layernorm, rotary=rotary_options(hybrid_kwargs)
    )
    return S2HybridModel(
        config=config,
        hybrid_stack_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        hybrid_layer_pattern=config.hybrid_layer_pattern,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        **hybrid_kwargs,
    )
