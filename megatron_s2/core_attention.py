"""S2 core attention for Megatron-core's ``SelfAttentionSubmodules.core_attention`` slot.

Two modules with the constructor and forward contract of Megatron's ``DotProductAttention``:

* :class:`S2CoreAttention` -- S2 block-sparse attention for one layer. Its pattern is the layer's
  full-model pattern (chosen by the **global** layer number) restricted to this TP rank's
  **global** head range, so every rank computes exactly its rows of the full model.
* :class:`ScheduledCoreAttention` -- a builder that returns an :class:`S2CoreAttention` or a dense
  core attention depending on the attention schedule's entry for the layer. It lets one layer
  spec serve a whole hybrid model (``pretrain_gpt.py --spec megatron_s2.specs s2_layer_spec``).

The schedule is looked up on the ``TransformerConfig`` (attribute ``s2_schedule``, set by
:func:`megatron_s2.model.build_gpt_model`; custom config attributes survive Megatron's deep
copies), else in the YAML file named by ``$MEGATRON_S2_SCHEDULE``.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from s2attn import S2Pattern, s2_attention

from .schedule import SCHEDULE_ENV_VAR, AttentionSchedule, ScheduleError

logger = logging.getLogger(__name__)

# Custom TransformerConfig attributes read here (set by build_gpt_model).
CONFIG_SCHEDULE_ATTR = "s2_schedule"
CONFIG_TRUE_GROUPS_ATTR = "s2_num_query_groups"  # Megatron fakes num_query_groups when < TP
CONFIG_SEQ_LENGTH_ATTR = "s2_seq_length"          # for the schedule table's density column
CONFIG_BACKEND_ATTR = "s2_backend"                # s2_attention backend; default "auto"


def tp_group_of(pg_collection):
    """The tensor-parallel group from a ``ProcessGroupCollection`` or Megatron's globals."""
    if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
        return pg_collection.tp
    return parallel_state.get_tensor_model_parallel_group()


def check_common_support(module: str, config, layer_number: int, attn_mask_type, attention_type,
                         extra_kwargs: dict) -> None:
    """Construction-time checks shared by the S2 and fused dense modules (ValueError)."""
    if attn_mask_type != AttnMaskType.causal:
        raise ValueError(f"{module} (layer {layer_number}): attn_mask_type must be "
                         f"AttnMaskType.causal, got {attn_mask_type}")
    if attention_type != "self":
        raise ValueError(f"{module} (layer {layer_number}): attention_type must be 'self', "
                         f"got {attention_type!r}")
    cp = getattr(config, "context_parallel_size", 1) or 1
    if cp > 1:
        raise ValueError(f"{module} (layer {layer_number}): context_parallel_size={cp} is not "
                         f"supported yet; use context_parallel_size=1")
    softmax_type = getattr(config, "softmax_type", "vanilla")
    if softmax_type not in (None, "vanilla"):
        raise ValueError(f"{module} (layer {layer_number}): softmax_type must be 'vanilla', "
                         f"got {softmax_type!r}")
    if getattr(config, "window_size", None) is not None:
        raise ValueError(f"{module} (layer {layer_number}): window_size (sliding-window "
                         f"attention) is not supported; S2 layers have their own local window")
    k_ch, v_ch = extra_kwargs.get("k_channels"), extra_kwargs.get("v_channels")
    if (k_ch is not None and k_ch != config.kv_channels) or (v_ch is not None and v_ch != config.kv_channels):
        raise ValueError(f"{module} (layer {layer_number}): different key/value head sizes "
                         f"(multi-latent attention) are not supported")


def check_forward_support(module: str, attn_mask_type, attention_bias, packed_seq_params) -> None:
    """Forward-time checks: things only the forward call reveals."""
    if packed_seq_params is not None:
        raise ValueError(f"{module}: packed sequences (packed_seq_params, THD format) are not "
                         f"supported; train on fixed-length [s, b] batches")
    if attention_bias is not None:
        raise ValueError(f"{module}: attention_bias is not supported")
    if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
        raise ValueError(f"{module}: attn_mask_type must be AttnMaskType.causal, got {attn_mask_type}")


def true_num_query_groups(config) -> int:
    """The model's real number of KV groups (Megatron overwrites ``num_query_groups`` with the TP
    size in the config copy it hands core attention when groups < TP)."""
    g = getattr(config, CONFIG_TRUE_GROUPS_ATTR, None)
    return g or config.num_query_groups or config.num_attention_heads


_LOGGED = set()


def _training_seq_length(config) -> Optional[int]:
    seq = getattr(config, CONFIG_SEQ_LENGTH_ATTR, None)
    if seq:
        return seq
    try:  # under Megatron-LM's pretrain_gpt.py the run's arguments hold it
        from megatron.training import get_args  # type: ignore

        return getattr(get_args(), "seq_length", None)
    except Exception:
        return None


def resolve_schedule(config) -> AttentionSchedule:
    """The attention schedule of a model config: ``config.s2_schedule``, else
    ``$MEGATRON_S2_SCHEDULE``. Validated against the config and logged once per schedule."""
    schedule = getattr(config, CONFIG_SCHEDULE_ATTR, None)
    if schedule is None:
        schedule = AttentionSchedule.from_env()
    if schedule is None:
        raise ValueError(
            f"megatron_s2: no attention schedule for this model. Build it with "
            f"megatron_s2.model.build_gpt_model(config, schedule, ...), set "
            f"config.{CONFIG_SCHEDULE_ATTR}, or point ${SCHEDULE_ENV_VAR} at a schedule YAML")
    if isinstance(schedule, dict):
        schedule = AttentionSchedule.from_dict(schedule)
    key = (id(schedule), config.num_layers, config.num_attention_heads)
    if key not in _LOGGED:
        tp = config.tensor_model_parallel_size
        groups = true_num_query_groups(config)
        seq = _training_seq_length(config)
        schedule.validate(config.num_layers, config.num_attention_heads, groups, tp, seq)
        _LOGGED.add(key)
        rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if rank0:
            logger.info("S2 attention schedule%s:\n%s",
                        f" ({schedule.source})" if schedule.source else "",
                        schedule.summary(config.num_layers, config.num_attention_heads, groups, seq))
    return schedule


class S2CoreAttention(MegatronModule):
    """S2 block-sparse causal core attention for one transformer layer.

    Args (Megatron's core-attention contract, plus):
        schedule: the attention schedule; default :func:`resolve_schedule` of ``config``.
        pattern: an explicit full-model :class:`s2attn.S2Pattern` (overrides the schedule).

    Forward: query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` (this rank's heads, GQA
    groups not repeated) -> ``[sq, b, np * hn]``.

    Unsupported (ValueError at construction): non-causal masks, attention dropout > 0 (set
    ``attention_dropout=0.0`` in the TransformerConfig), context parallelism, non-vanilla
    softmax, sliding windows, MLA head sizes; at forward: packed/THD sequences, attention bias.
    ``apply_query_key_layer_scaling`` needs nothing: it rescales by the layer number before the
    softmax and back inside it, a numerical no-op for the fp32-accumulating kernel.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, schedule: Optional[AttentionSchedule] = None,
                 pattern: Optional[S2Pattern] = None, **kwargs):
        super().__init__(config=config)
        name = type(self).__name__
        check_common_support(name, config, layer_number, attn_mask_type, attention_type, kwargs)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"{name} (layer {layer_number}): attention dropout ({dropout}) is not "
                             f"implemented for S2 layers; set TransformerConfig.attention_dropout=0.0")
        if getattr(config, "fp8_dot_product_attention", False):
            raise ValueError(f"{name} (layer {layer_number}): fp8_dot_product_attention is not "
                             f"supported by S2 layers")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = (1.0 / math.sqrt(config.kv_channels) if softmax_scale is None
                              else float(softmax_scale))

        tp_group = tp_group_of(pg_collection)
        tp_rank, tp_size = tp_group.rank(), tp_group.size()
        heads = config.num_attention_heads
        # config.num_query_groups is what this rank's K/V actually carry (Megatron's replicated
        # value when true groups < TP). Phases are per query head, so the rows are the same.
        groups = config.num_query_groups or heads
        if pattern is None:
            schedule = resolve_schedule(config) if schedule is None else schedule
            pattern = schedule.layer_pattern(layer_number, heads, groups, config.num_layers)
            if pattern is None:
                raise ValueError(f"{name}: layer {layer_number} is dense in the attention schedule; "
                                 f"build it with ScheduledCoreAttention or a dense module")
        elif pattern.num_heads != heads:
            raise ValueError(f"{name}: pattern has {pattern.num_heads} heads, the model "
                             f"{heads} (pattern heads are global, across TP ranks)")
        else:
            pattern = S2Pattern(**{**{f: getattr(pattern, f) for f in (
                "block_size", "local_blocks", "vert_stride", "head_offset", "num_dense_heads",
                "homo_head", "head_step", "user_mask")}, "num_heads": heads, "num_kv_heads": groups})
        self.global_pattern = pattern
        # Equal patterns share the kernels' index-structure cache, so S2 layers with the same
        # settings build their layouts once for the whole model.
        self.pattern = pattern.for_tp_rank(tp_rank, tp_size)
        self.backend = getattr(config, CONFIG_BACKEND_ATTR, None) or "auto"

    def extra_repr(self) -> str:
        p = self.pattern
        return (f"layer={self.layer_number}, heads=[{p.head_start}, {p.head_end}) of {p.num_heads}, "
                f"{p.describe()}")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        """query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` -> ``[sq, b, np * hn]``.

        ``attention_mask`` is ignored: causality comes from the mask type (checked)."""
        check_forward_support(type(self).__name__, attn_mask_type, attention_bias, packed_seq_params)
        sq, b, nq, hn = query.shape
        out = s2_attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                           self.pattern, softmax_scale=self.softmax_scale, backend=self.backend)
        # out is [b, sq, np, hn] laid out like the transposed query; back to Megatron's [s, b, h].
        return out.transpose(0, 1).reshape(sq, b, nq * hn)


class ScheduledCoreAttention:
    """Core-attention builder: S2 or dense for each layer, from the attention schedule.

    ``ScheduledCoreAttention(config=..., layer_number=..., ...)`` returns an
    :class:`S2CoreAttention` for S2 layers and ``dense_attention(...)`` for dense ones (default
    :class:`megatron_s2.dense_attention.FusedDenseAttention`; the TE spec passes Transformer
    Engine's attention through ``ModuleSpec(params={"dense_attention": ...})``). The layer is
    looked up by its global 1-based ``layer_number``, so one spec serves every pipeline stage.
    """

    def __new__(cls, config, layer_number: int, attn_mask_type: AttnMaskType,
                attention_type: str = "self", *, dense_attention=None,
                schedule: Optional[AttentionSchedule] = None, **kwargs):
        schedule = resolve_schedule(config) if schedule is None else schedule
        pattern = schedule.layer_pattern(layer_number, config.num_attention_heads,
                                         config.num_query_groups or config.num_attention_heads,
                                         config.num_layers)
        if pattern is None:
            if dense_attention is None:
                from .dense_attention import FusedDenseAttention as dense_attention
            return dense_attention(config=config, layer_number=layer_number,
                                   attn_mask_type=attn_mask_type, attention_type=attention_type,
                                   **kwargs)
        return S2CoreAttention(config=config, layer_number=layer_number,
                               attn_mask_type=attn_mask_type, attention_type=attention_type,
                               pattern=pattern, **kwargs)


__all__ = ["S2CoreAttention", "ScheduledCoreAttention", "resolve_schedule", "true_num_query_groups",
           "ScheduleError"]
