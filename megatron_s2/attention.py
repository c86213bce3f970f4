"""Core attention modules for Megatron-core's ``SelfAttentionSubmodules.core_attention`` slot.

All three have the constructor and forward contract of Megatron's ``DotProductAttention``:

* :class:`S2CoreAttention` -- S2 block-sparse attention for one layer. Its pattern is the layer's
  full-model pattern (chosen by the **global** layer number) restricted to this TP rank's
  **global** head range, so every rank computes exactly its rows of the full model.
* :class:`FusedDenseAttention` -- dense causal attention on PyTorch's fused SDPA kernels, or
  FlashAttention-4 where it is installed (the dense layers of the local spec; Megatron's local
  ``DotProductAttention`` materializes the ``[b, h, s, s]`` scores, which does not fit at long
  context).
* :class:`ScheduledCoreAttention` -- returns one of the two (or the TE spec's dense attention)
  for each layer from the attention schedule, so one layer spec serves a whole hybrid model
  (``pretrain_gpt.py --spec megatron_s2.specs s2_layer_spec``).

and one for the ``self_attention`` slot of a transformer layer:

* :class:`S2SelfAttention` -- Megatron's ``SelfAttention`` with the schedule's position
  encoding per layer: the model's RoPE, none (``dense_layers.position_embedding: nope``) or RoPE
  with the dense layers' own base (``dense_layers.rotary_base``).

The schedule and the other S2 settings come from the config (:func:`megatron_s2.config.
s2_settings_of`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from s2attn import S2Pattern, s2_attention, s2_attention_varlen

from .config import dense_backend_of, s2_backend_of, s2_settings_of
from .context_parallel import (
    attend_local_chunks,
    check_context_parallel_length,
    context_parallel_group,
    dense_local_chunks,
)
from .context_parallel_a2a import a2a_unsupported_reason, attend_heads_a2a
from .flash_attention4 import check_dense_backend, fa4_causal, use_fa4
from .parallel_lengths import check_packed_sequences

__all__ = [
    "S2CoreAttention",
    "FusedDenseAttention",
    "ScheduledCoreAttention",
    "S2SelfAttention",
    "apply_sinks",
]


# Where Megatron's cp_comm_type leaves it to us (None, "p2p"): dense layers take the head
# all-to-all for sequences up to DENSE_A2A_MAX_SEQ tokens where their heads split over the CP
# ranks (not on FlashAttention-4 under GQA: FusedDenseAttention._auto_a2a), the all-gather
# beyond; S2 layers the all-gather. Measured on 2 H100s, CP=2, training
# the 1.3B models (docs/context_parallel.md): dense at 32k 2.5% faster on a2a (2.2% with GQA),
# at 64k 1.5% faster, at 128k 2.2% slower; S2 calls are 5x shorter, so the all-to-all's
# copies cost them 1.3-1.9x per token where the all-gather costs 1.1-1.4x (the hybrid at 32k:
# within 0.2% either way).
DENSE_A2A_MAX_SEQ = 65536

# FlashAttention-4 dense layers under GQA: "auto" takes the all-gather where the head all-to-all
# would move at least this many times its bytes, (np / ng + 1) / cp (q, k, v and the output of a
# rank's rows against K and V of all of them). With the transfers on two H100s at 32k: at 2.5
# (16/4 heads, CP=2) the all-gather took 0.91-0.92 of the SDPA layer's per-token time, the
# all-to-all 0.95-0.96; at 1 (16/16) the all-to-all led, 0.97-0.98 against 0.99-1.00. In between
# is unmeasured: the all-to-all stays there.
FA4_GATHER_MIN_VOLUME_RATIO = 2.5

# Tile block of the dense pattern used for packed (THD) sequences on dense layers: the kernels'
# widest tile, so each document's causal triangle is covered by the fewest tiles.
DENSE_BLOCK_SIZE = 128


def _tp_group(pg_collection):
    """The tensor-parallel group from a ``ProcessGroupCollection`` or Megatron's globals."""
    if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
        return pg_collection.tp
    return parallel_state.get_tensor_model_parallel_group()


def _softmax_scale(config, softmax_scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else float(softmax_scale)


# Megatron's TransformerConfig.cp_comm_type values the local spec's modules take: "all_gather"
# (K/V gathered, each rank's two chunks attended: megatron_s2.context_parallel), "a2a" (heads
# exchanged, each rank the whole sequence of its head group: megatron_s2.context_parallel_a2a);
# None and "p2p" (Megatron's default; we have no ring) pick per layer kind: DENSE_A2A_MAX_SEQ
# and FA4_GATHER_MIN_VOLUME_RATIO.
CP_COMM_TYPES = (None, "p2p", "all_gather", "a2a")


def _context_parallel(
    module: str,
    config,
    layer_number: int,
    pg_collection,
    dropout: float,
    cp_comm_type: Optional[str] = None,
    prefer_a2a: bool = False,
):
    """``(group, comm)``: this layer's context-parallel group (None without context
    parallelism) and how it communicates: "all_gather", "a2a" (asked for by ``cp_comm_type``),
    or "auto" (left to us, ``prefer_a2a`` and the heads split: the layer picks by length)."""
    cp = getattr(config, "context_parallel_size", 1) or 1
    if cp == 1:
        return None, None
    where = f"{module} (layer {layer_number})"
    if dropout:
        raise ValueError(
            f"{where}: attention dropout ({dropout}) with context_parallel_size={cp} is not "
            f"supported; set attention_dropout=0.0"
        )
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(
            f"{where}: cp_comm_type={cp_comm_type!r} is not supported by the local spec's "
            f"attention; use one of {CP_COMM_TYPES} (None and 'p2p' pick the measured default)"
        )
    group = context_parallel_group(pg_collection)
    if group is None or group.size() != cp:
        raise ValueError(
            f"{where}: context_parallel_size={cp} but the context-parallel process group has "
            f"{None if group is None else group.size()} ranks; initialize Megatron's parallel "
            f"state (or pass pg_collection) with the same context_parallel_size"
        )
    tp = _tp_group(pg_collection).size()
    heads, groups = config.num_attention_heads // tp, max(1, config.num_query_groups // tp)
    why_not = a2a_unsupported_reason(heads, groups, cp)
    if cp_comm_type == "a2a" and why_not:
        raise ValueError(f"{where}: {why_not} (tensor_model_parallel_size={tp})")
    if cp_comm_type in ("all_gather", "a2a"):
        return group, cp_comm_type
    return group, "auto" if prefer_a2a and not why_not else "all_gather"


def _check_layer_support(
    module: str, config, layer_number: int, attn_mask_type, attention_type, extra_kwargs: dict
) -> None:
    """Construction-time checks shared by the S2 and fused dense modules (ValueError)."""
    where = f"{module} (layer {layer_number})"
    if attn_mask_type != AttnMaskType.causal:
        raise ValueError(
            f"{where}: attn_mask_type must be AttnMaskType.causal, got {attn_mask_type}"
        )
    if attention_type != "self":
        raise ValueError(f"{where}: attention_type must be 'self', got {attention_type!r}")
    softmax_type = getattr(config, "softmax_type", "vanilla")
    if softmax_type not in (None, "vanilla"):
        raise ValueError(f"{where}: softmax_type must be 'vanilla', got {softmax_type!r}")
    if getattr(config, "window_size", None) is not None:
        raise ValueError(
            f"{where}: window_size (sliding-window attention) is not supported; S2 "
            f"layers have their own local window"
        )
    k_ch, v_ch = extra_kwargs.get("k_channels"), extra_kwargs.get("v_channels")
    if any(ch is not None and ch != config.kv_channels for ch in (k_ch, v_ch)):
        raise ValueError(
            f"{where}: different key/value head sizes (multi-latent attention) are not supported"
        )


def _check_forward_support(module: str, attn_mask_type, attention_bias):
    """Forward-time checks: things only the forward call reveals."""
    if attention_bias is not None:
        raise ValueError(f"{module}: attention_bias is not supported")
    if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
        raise ValueError(
            f"{module}: attn_mask_type must be AttnMaskType.causal, got {attn_mask_type}"
        )


# Attribute on Megatron's PackedSeqParams recording that our checks ran on it: every layer of a
# forward gets the same object, and the checks read cu_seqlens back to the host (a device sync),
# so they run for the first layer only.
_CHECKED_ATTR = "_megatron_s2_checked"


def _packed_documents(module: str, packed_seq_params) -> tuple[torch.Tensor, int, bool]:
    """``(cu_seqlens, max_seqlen, check_values)`` of Megatron's THD ``PackedSeqParams`` for
    self-attention; ``check_values`` is False once an earlier layer has checked the same
    ``cu_seqlens`` tensor.

    Megatron hands core attention THD tensors ``[t, heads, hn]`` (the batch dimension of one is
    squeezed) and has already applied RoPE with positions restarting at every document."""
    if packed_seq_params.qkv_format != "thd":
        raise ValueError(
            f"{module}: packed_seq_params.qkv_format must be 'thd', "
            f"got {packed_seq_params.qkv_format!r}"
        )
    cu_q = packed_seq_params.cu_seqlens_q
    if cu_q is None:
        raise ValueError(f"{module}: packed_seq_params.cu_seqlens_q is required for THD")
    checked = getattr(packed_seq_params, _CHECKED_ATTR, None)
    if checked is not None and checked[0] is cu_q:
        return checked[1], checked[2], False
    cu_kv = packed_seq_params.cu_seqlens_kv
    if cu_kv is not None and cu_kv is not cu_q and not torch.equal(cu_kv, cu_q):
        raise ValueError(
            f"{module}: cu_seqlens_q and cu_seqlens_kv differ; causal self-attention packs the "
            f"same documents for queries and keys"
        )
    for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        padded = getattr(packed_seq_params, name, None)
        if padded is not None and padded is not cu_q and not torch.equal(padded, cu_q):
            raise ValueError(
                f"{module}: padded THD documents (packed_seq_params.{name}, used with context "
                f"parallelism) are not supported yet; pack without padding"
            )
    max_seqlen = packed_seq_params.max_seqlen_q
    if max_seqlen is None:
        max_seqlen = (cu_q[1:] - cu_q[:-1]).max() if cu_q.numel() > 1 else 0
    return cu_q.to(torch.int32), int(max_seqlen), True


def _attend_documents(
    module: str, query, key, value, packed_seq_params, pattern, softmax_scale, backend, sinks=None
) -> torch.Tensor:
    """THD core attention: ``[t, np, hn]``, ``[t, ng, hn]`` -> ``[t, np * hn]``, each packed
    document attended on its own under ``pattern`` (restarting at its first token); ``sinks``
    ``[np]`` applied per row when given (:func:`apply_sinks`)."""
    cu_seqlens, max_seqlen, check = _packed_documents(module, packed_seq_params)
    out = s2_attention_varlen(
        query,
        key,
        value,
        cu_seqlens,
        max_seqlen,
        pattern,
        softmax_scale=softmax_scale,
        backend=backend,
        check_cu_seqlens=check,
        return_lse=sinks is not None,
    )
    if sinks is not None:  # out [t, np, hn], lse [np, t]: as a batch of one
        out, lse = out
        out = apply_sinks(out[None], lse[None], sinks)[0]
    if check:  # only after s2_attention_varlen accepted the values
        setattr(
            packed_seq_params,
            _CHECKED_ATTR,
            (packed_seq_params.cu_seqlens_q, cu_seqlens, max_seqlen),
        )
    return out.reshape(out.shape[0], -1)


def _reject_packed_with_cp(module: str, cp_group) -> None:
    # The rule is parallel_lengths'; a layer holds a CP group only when CP > 1.
    if cp_group is not None:
        check_packed_sequences(cp_group.size(), where=module)


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Learned attention sinks on an attention output (gpt-oss style).

    A sink is one more logit per head in every query's softmax, with a zero value vector: the
    weights of the real keys shrink by ``Z / (Z + exp(sink))`` with ``Z = exp(lse)``, so
    ``out * sigmoid(lse - sink)``. Rows that attend no key (``lse = -inf``) stay 0.

    Args:
        out: ``[b, s, h, d]`` attention output without sinks (any float dtype).
        lse: ``[b, h, s]`` its log-sum-exp over the attended keys (natural log, fp32).
        sinks: ``[h]`` sink logits (in units of the scaled scores).
    Returns:
        ``[b, s, h, d]`` in ``out``'s dtype; the factor is computed in fp32.
    """
    factor = torch.sigmoid(lse - sinks.float()[None, :, None])  # [b, h, s]
    return (out.float() * factor.transpose(1, 2)[..., None]).to(out.dtype)


# Initial sink logit. 0 is "softmax plus one" (a zero logit beside the keys): a row of n keys with
# the near-zero scores of an untrained model keeps n / (n + 1) of its output (>= 94% past the
# first 16 tokens, >= 99.9% past 1k), so training starts near the no-sink model, and unlike a
# very negative start (sigmoid saturated at 1) the sink's gradient does not vanish. The same for
# every head and every rank, so layouts and seeds start alike (gpt-oss draws its sinks around 0).
SINK_INIT = 0.0


class S2CoreAttention(MegatronModule):
    """S2 block-sparse causal core attention for one transformer layer.

    Args (Megatron's core-attention contract, plus):
        pattern: an explicit full-model :class:`s2attn.S2Pattern` (all global heads); default:
            the schedule's pattern for ``layer_number``.
        sinks: a learned sink logit per head (:func:`apply_sinks`; parameter ``sinks``, this
            rank's heads, TP-sharded in checkpoints); default: the schedule's ``s2.sinks``
            where the pattern comes from the schedule, else False.
        checkpoint_layer: the 0-based schedule layer naming the sinks in checkpoints; default
            ``layer_number - 1`` (:class:`ScheduledCoreAttention` passes the schedule's).

    A dense layer of a schedule with ``dense_layers.sinks`` is this module too, with the
    schedule's dense pattern (:meth:`AttentionSchedule.dense_sink_pattern`: every earlier key)
    and sinks: the fused dense kernels return no log-sum-exp gradient, which the sinks need.
    ``dense_layer`` is then True (the attention probe and ``extra_repr`` read it).

    Forward: query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` (this rank's heads, GQA
    groups not repeated) -> ``[sq, b, np * hn]``; packed documents (THD ``packed_seq_params``):
    ``[t, np, hn]``, ``[t, ng, hn]`` -> ``[t, np * hn]``. Under context parallelism ``sq`` is
    this rank's two load-balanced chunks (:mod:`megatron_s2.context_parallel`), attended at
    their absolute positions.

    Unsupported (ValueError at construction): non-causal masks, attention dropout > 0,
    non-vanilla softmax, sliding windows, MLA head sizes, FP8 attention; at forward: attention
    bias, padded THD documents, THD together with context parallelism.
    ``apply_query_key_layer_scaling`` needs nothing: it rescales by the layer number before the
    softmax and back inside it, a numerical no-op for the fp32-accumulating kernel.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        pattern: Optional[S2Pattern] = None,
        sinks: Optional[bool] = None,
        checkpoint_layer: Optional[int] = None,
        dense_layer: bool = False,
        **kwargs,
    ):
        super().__init__(config=config)
        name = type(self).__name__
        # The sinks' checkpoint name (sharded_state_dict): the 0-based schedule layer.
        self.checkpoint_layer = layer_number - 1 if checkpoint_layer is None else checkpoint_layer
        _check_layer_support(name, config, layer_number, attn_mask_type, attention_type, kwargs)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"{name} (layer {layer_number}): attention dropout ({dropout}) is not implemented "
                f"for S2 layers nor for dense layers with learned sinks "
                f"(attention.dense_layers.sinks); set TransformerConfig.attention_dropout=0.0 "
                f"(Megatron-LM: --attention-dropout 0.0)"
            )
        if getattr(config, "fp8_dot_product_attention", False):
            raise ValueError(
                f"{name} (layer {layer_number}): fp8_dot_product_attention is not "
                f"supported by S2 layers"
            )
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = _softmax_scale(config, softmax_scale)
        self.backend = s2_backend_of(config)
        self.cp_group, self.cp_comm = _context_parallel(
            name, config, layer_number, pg_collection, 0.0, cp_comm_type, prefer_a2a=False
        )

        tp_group = _tp_group(pg_collection)
        heads = config.num_attention_heads
        # config.num_query_groups is what this rank's K/V carry (Megatron's replicated value
        # when the true groups are fewer than TP ranks). Phases are per query head, so the rows
        # of the pattern do not depend on it.
        groups = config.num_query_groups
        self.dense_layer = bool(dense_layer)
        if pattern is None:
            schedule = s2_settings_of(config).schedule
            pattern = schedule.layer_pattern(layer_number, heads, groups, config.num_layers)
            if pattern is None and schedule.dense_sinks:
                # A dense layer with learned sinks (the GPT spec builds every layer's module
                # from the schedule's kinds; ScheduledCoreAttention passes the pattern itself).
                pattern, self.dense_layer = schedule.dense_sink_pattern(heads, groups), True
                sinks = schedule.dense_sinks if sinks is None else sinks
            elif pattern is None:
                raise ValueError(
                    f"{name}: layer {layer_number} is dense in the attention "
                    f"schedule; build it with ScheduledCoreAttention or a dense module"
                )
            else:
                sinks = schedule.sinks if sinks is None else sinks
        elif pattern.num_heads != heads:
            raise ValueError(
                f"{name}: pattern has {pattern.num_heads} heads, the model {heads} "
                f"(pattern heads are global, across TP ranks)"
            )
        else:
            pattern = pattern.with_heads(heads, groups)
        self.global_pattern = pattern
        # Equal patterns share the kernels' index-structure cache, so S2 layers with the same
        # settings build their layouts once for the whole model.
        self.pattern = pattern.for_tp_rank(tp_group.rank(), tp_group.size())
        # cp_comm_type="a2a": this rank attends its head group, with those heads' global phases.
        self.head_group_pattern = None
        if self.cp_comm == "a2a":
            cp, rank = self.cp_group.size(), self.cp_group.rank()
            n = self.pattern.local_num_heads // cp
            start = self.pattern.head_start + rank * n
            self.head_group_pattern = self.pattern.head_range(start, start + n)
        self.tp_group = tp_group
        self.sinks = None
        if sinks:
            device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
            self.sinks = torch.nn.Parameter(
                torch.full(
                    (self.pattern.local_num_heads,),
                    SINK_INIT,
                    device=device,
                    dtype=config.params_dtype,
                )
            )
            # Sharded over TP by heads like the QKV rows; loading unsharded weights and the
            # parallel checks read these attributes.
            tensor_parallel.set_tensor_model_parallel_attributes(self.sinks, True, 0, 1)

    def extra_repr(self) -> str:
        p = self.pattern
        what = "dense causal (s2attn, dense pattern)" if self.dense_layer else p.describe()
        return (
            f"layer={self.layer_number}, heads=[{p.head_start}, {p.head_end}) of "
            f"{p.num_heads}, {what}{', sinks' if self.sinks is not None else ''}"
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """The sinks as a TP-sharded tensor (axis 0, heads), like Megatron's learnable softmax
        offset; nothing without sinks (the module has no other state).

        Megatron stores a layer's tensors stacked over the layers (one checkpoint tensor per
        name with a leading layer axis: ``sharded_offsets``), which needs the tensor in every
        layer; only S2 layers have sinks, so each layer's sinks are a checkpoint tensor of their
        own, ``...core_attention.sinks.layer_<i>`` with ``i`` the 0-based schedule layer (the
        same for a GPT model and its HybridModel twin)."""
        if self.sinks is None:
            return {}
        out = make_sharded_tensors_for_checkpoint(
            {"sinks": self.sinks},
            prefix,
            {"sinks": 0},
            (),
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )
        out[f"{prefix}sinks"].key = f"{prefix}sinks.layer_{self.checkpoint_layer}"
        return out

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
        **kwargs,
    ) -> torch.Tensor:
        """query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` -> ``[sq, b, np * hn]``; with
        THD ``packed_seq_params``: query ``[t, np, hn]``, key/value ``[t, ng, hn]`` -> ``[t, np *
        hn]``, each document attended on its own with the pattern restarting at its first token.

        ``attention_mask`` is ignored: causality comes from the mask type (checked)."""
        name = type(self).__name__
        _check_forward_support(name, attn_mask_type, attention_bias)
        if packed_seq_params is not None:
            _reject_packed_with_cp(name, self.cp_group)
            return _attend_documents(
                name,
                query,
                key,
                value,
                packed_seq_params,
                self.pattern,
                self.softmax_scale,
                self.backend,
                self.sinks,
            )
        if self.cp_group is not None:
            chunk = check_context_parallel_length(
                name, query.shape[0], self.cp_group.size(), self.pattern.block_size
            )
            if self.cp_comm == "a2a":
                return attend_heads_a2a(query, key, value, self.cp_group, self._attend_heads)
            # Each query row is whole on its rank (K/V all-gathered), so the sinks apply per
            # chunk; with sinks the chunks run composed, for the sinks' gradient.
            return attend_local_chunks(
                query,
                key,
                value,
                self.cp_group,
                self._attend_at,
                chunk,
                composed=self.sinks is not None,
            )
        sq, b, nq, hn = query.shape
        return self._attend_whole(query, key, value, self.pattern).reshape(sq, b, nq * hn)

    def _attend_heads(self, q, k, v, head_group: int) -> torch.Tensor:
        """The cp_comm_type="a2a" path: the whole sequence of this rank's head group (the
        exchange's ``head_group`` is the CP rank, whose pattern was built at construction)."""
        sinks = None
        if self.sinks is not None:  # this head group's: heads head_group * n .. of the rank's
            n = q.shape[2]
            sinks = self.sinks[head_group * n : (head_group + 1) * n]
        return self._attend_whole(q, k, v, self.head_group_pattern, sinks)

    def _attend_whole(
        self, query, key, value, pattern: S2Pattern, sinks: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """A whole sequence under ``pattern``: ``[s, b, np, hn]``, ``[s, b, ng, hn]`` (any
        strides) -> ``[s, b, np, hn]`` (a view of the kernel's output); ``sinks`` ``[np]``
        (default: the layer's, all its heads)."""
        out = self._s2(
            query.transpose(0, 1),
            key.transpose(0, 1),
            value.transpose(0, 1),
            pattern,
            0,
            self.sinks if sinks is None else sinks,
        )
        # out is [b, s, np, hn] laid out like the transposed query; back to Megatron's [s, b, h].
        return out.transpose(0, 1)

    def _attend_at(self, q, k, v, q_start: int) -> torch.Tensor:
        """Queries at absolute positions ``q_start ..`` against keys ``0 ..`` (``[b, s, h, hn]``
        views): the context-parallel chunks."""
        return self._s2(q, k, v, self.pattern, q_start, self.sinks)

    def _s2(self, q, k, v, pattern: S2Pattern, q_start: int, sinks) -> torch.Tensor:
        """``s2_attention`` on ``[b, s, h, hn]`` views, with ``sinks [h]`` applied when given."""
        out = s2_attention(
            q,
            k,
            v,
            pattern,
            softmax_scale=self.softmax_scale,
            q_start=q_start,
            backend=self.backend,
            return_lse=sinks is not None,
        )
        if sinks is None:
            return out
        return apply_sinks(*out, sinks)


def _sdpa_has_gqa() -> bool:
    # A builtin without an introspectable signature: read its docstring (torch >= 2.5 has it).
    return "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


_SDPA_HAS_GQA = _sdpa_has_gqa()


class FusedDenseAttention(MegatronModule):
    """Dense causal attention with ``DotProductAttention``'s contract, on fused SDPA kernels
    (flash / cuDNN / memory-efficient on GPU: O(s) memory), or on FlashAttention-4 where the
    config's ``dense_backend`` ("auto" by default) finds it installed and able to run the call
    (:mod:`megatron_s2.flash_attention4`).

    Forward: query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` (GQA groups not repeated)
    -> ``[sq, b, np * hn]``. Attention dropout is supported (under the tensor-parallel RNG
    tracker, as Megatron does it), except with context parallelism. There, by ``cp_comm_type``
    (default: by length, :data:`DENSE_A2A_MAX_SEQ`, and on FlashAttention-4 by the GQA ratio,
    :data:`FA4_GATHER_MIN_VOLUME_RATIO`), each rank either attends the whole sequence
    for its share of the heads (the head all-to-all, :mod:`megatron_s2.context_parallel_a2a`)
    or its two query chunks to the all-gathered keys, causally aligned at each chunk's end
    (cuDNN on Hopper, FlashAttention's varlen kernel on other GPUs;
    :func:`megatron_s2.context_parallel.dense_rank_chunks`).
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        **kwargs,
    ):
        super().__init__(config=config)
        _check_layer_support(
            type(self).__name__, config, layer_number, attn_mask_type, attention_type, kwargs
        )
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.dropout_p = float(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.softmax_scale = _softmax_scale(config, softmax_scale)
        self.backend = s2_backend_of(config)
        self.dense_backend = dense_backend_of(config)
        check_dense_backend(
            f"{type(self).__name__} (layer {layer_number}): dense_backend",
            self.dense_backend,
            self.dropout_p,
        )
        self.deterministic = bool(getattr(config, "deterministic_mode", False))
        self.cp_group, self.cp_comm = _context_parallel(
            type(self).__name__,
            config,
            layer_number,
            pg_collection,
            self.dropout_p,
            cp_comm_type,
            prefer_a2a=True,
        )
        self._dense_patterns = {}
        self._fa4_agreed = {}  # (dtype, head_dim) -> FA4 on every CP rank (_fa4_on_every_rank)

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_number}, dense causal (backend {self.dense_backend}), "
            f"dropout={self.dropout_p}"
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
        **kwargs,
    ) -> torch.Tensor:
        """query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` -> ``[sq, b, np * hn]``; with
        THD ``packed_seq_params``: ``[t, np, hn]``, ``[t, ng, hn]`` -> ``[t, np * hn]``, causal
        within each document.

        ``attention_mask`` is ignored: the mask type is causal (checked at construction)."""
        name = type(self).__name__
        _check_forward_support(name, attn_mask_type, attention_bias)
        if packed_seq_params is not None:
            _reject_packed_with_cp(name, self.cp_group)
            return self._forward_packed(name, query, key, value, packed_seq_params)
        if self.cp_group is not None:
            chunk = check_context_parallel_length(name, query.shape[0], self.cp_group.size())
            if self.cp_comm == "a2a" or (self.cp_comm == "auto" and self._auto_a2a(query, key)):
                return attend_heads_a2a(query, key, value, self.cp_group, self._attend_heads)
            scale, backend = self.softmax_scale, self.dense_backend
            return dense_local_chunks(
                query, key, value, self.cp_group, chunk, scale, backend, self.deterministic
            )
        sq, b, nq, hn = query.shape
        p = self.dropout_p if self.training else 0.0
        if p > 0 and not self.config.sequence_parallel:
            # Heads differ across TP ranks, so their dropout masks must too (Megatron's rule).
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._attend_whole(query, key, value, p)
        else:
            out = self._attend_whole(query, key, value, p)
        return out.reshape(sq, b, nq * hn)

    def _auto_a2a(self, query, key) -> bool:
        """Whether the default ("auto") communication is the head all-to-all for this rank's
        ``query [2c, b, np, hn]`` and ``key [2c, b, ng, hn]``: up to DENSE_A2A_MAX_SEQ tokens,
        except on FlashAttention-4 where GQA makes the all-to-all move
        FA4_GATHER_MIN_VOLUME_RATIO times the all-gather's bytes or more (FA4's chunk calls keep
        its rate, so the smaller transfer wins)."""
        cp = self.cp_group.size()
        if query.shape[0] * cp > DENSE_A2A_MAX_SEQ:
            return False
        volume_ratio = (query.shape[2] / key.shape[2] + 1) / cp
        return volume_ratio < FA4_GATHER_MIN_VOLUME_RATIO or not self._fa4_on_every_rank(query)

    def _fa4_on_every_rank(self, query) -> bool:
        """Whether every CP rank runs FA4 on queries like ``query``: agreed once per dtype and
        head dim (one all-reduce), because the answer picks the communication, and ranks that
        picked differently (FA4 importable on some nodes only) would hang in their exchanges."""
        key = (query.dtype, query.shape[-1])
        if key not in self._fa4_agreed:
            here = torch.tensor([int(use_fa4(self.dense_backend, query))], device=query.device)
            torch.distributed.all_reduce(
                here, op=torch.distributed.ReduceOp.MIN, group=self.cp_group
            )
            self._fa4_agreed[key] = bool(here.item())
        return self._fa4_agreed[key]

    def _attend_heads(self, q, k, v, head_group: int) -> torch.Tensor:
        """The cp_comm_type="a2a" path's whole sequence of one head group: every head group is
        the same dense causal attention."""
        return self._attend_whole(q, k, v, 0.0)

    def _attend_whole(self, query, key, value, p: float) -> torch.Tensor:
        """Causal attention of a whole sequence: ``[s, b, np, hn]``, ``[s, b, ng, hn]`` (any
        strides) -> ``[s, b, np, hn]`` (a view of the kernel's output), dropout ``p``."""
        # FA4 aligns causal masks at the bottom right, SDPA at the top left: they agree on
        # self-attention (sq == sk), the only case FA4 takes here.
        if query.shape[0] == key.shape[0] and use_fa4(self.dense_backend, query, p):
            # [s, b, h, d] -> [b, s, h, d] views (FA4's layout; GQA groups as they are).
            q, k, v = (x.transpose(0, 1) for x in (query, key, value))
            return fa4_causal(q, k, v, self.softmax_scale, self.deterministic).transpose(0, 1)
        # SDPA wants [b, h, s, d]; the permutes are views.
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        nq, ng = q.shape[1], k.shape[1]
        gqa = {}
        if ng != nq:
            if _SDPA_HAS_GQA:
                gqa["enable_gqa"] = True
            else:
                k = k.repeat_interleave(nq // ng, dim=1)
                v = v.repeat_interleave(nq // ng, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=p, is_causal=True, scale=self.softmax_scale, **gqa
        )
        return out.permute(2, 0, 1, 3)  # [b, np, s, hn] -> [s, b, np, hn]

    def _forward_packed(self, name, query, key, value, packed_seq_params) -> torch.Tensor:
        # SDPA has no variable-length causal form; s2attn's varlen kernel with a dense pattern
        # (vert_stride 1: every head dense) attends each document causally in one launch.
        if self.training and self.dropout_p > 0:
            raise ValueError(
                f"{name} (layer {self.layer_number}): attention dropout with packed sequences "
                f"is not supported; set attention_dropout=0.0"
            )
        heads, groups = query.shape[1], key.shape[1]
        pattern = self._dense_patterns.get((heads, groups))
        if pattern is None:
            pattern = S2Pattern(heads, groups, block_size=DENSE_BLOCK_SIZE, vert_stride=1)
            self._dense_patterns[(heads, groups)] = pattern
        return _attend_documents(
            name, query, key, value, packed_seq_params, pattern, self.softmax_scale, self.backend
        )


class ScheduledCoreAttention:
    """Core-attention builder: S2 or dense for each layer, from the attention schedule.

    ``ScheduledCoreAttention(config=..., layer_number=..., ...)`` returns an
    :class:`S2CoreAttention` for S2 layers and ``dense_attention(...)`` for dense ones (default
    :class:`FusedDenseAttention`; the TE spec passes Transformer Engine's attention through
    ``ModuleSpec(params={"dense_attention": ...})``). The layer is looked up by its global
    1-based ``layer_number``, so one spec serves every pipeline stage.
    """

    def __new__(
        cls,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        *,
        dense_attention=FusedDenseAttention,
        **kwargs,
    ):
        schedule_layer, schedule_layers = cls.schedule_position(config, layer_number)
        schedule = s2_settings_of(config).schedule
        heads, groups = config.num_attention_heads, config.num_query_groups
        pattern = schedule.layer_pattern(schedule_layer, heads, groups, schedule_layers)
        module = dense_attention if pattern is None else S2CoreAttention
        if pattern is not None:
            kwargs["pattern"] = pattern
            kwargs["sinks"] = schedule.sinks
            kwargs["checkpoint_layer"] = schedule_layer - 1
        elif schedule.dense_sinks:
            # A dense layer with learned sinks: s2attn's kernel with a dense pattern (the sinks
            # need its log-sum-exp gradient), whatever the flavour's dense attention.
            module = S2CoreAttention
            kwargs["pattern"] = schedule.dense_sink_pattern(heads, groups)
            kwargs["sinks"] = True
            kwargs["checkpoint_layer"] = schedule_layer - 1
            kwargs["dense_layer"] = True
        return module(
            config=config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type=attention_type,
            **kwargs,
        )

    @classmethod
    def schedule_position(cls, config, layer_number: int) -> tuple[int, int]:
        """``(schedule layer number, 1-based; layers the schedule indexes)`` of the layer with
        Megatron's global 1-based ``layer_number``: every layer of a GPT model."""
        return layer_number, config.num_layers


# GPTModel / HybridModel arguments that shape the model's rotary embedding besides its base: the
# dense layers' own RoPE (attention.dense_layers.rotary_base) is built with the same values.
ROTARY_KWARGS = (
    "rotary_percent",
    "seq_len_interpolation_factor",
    "rope_scaling",
    "rope_scaling_factor",
)


def rotary_options(model_kwargs: dict) -> dict:
    """The model builder's arguments that shape its rotary embedding besides the base
    (:data:`megatron_s2.attention.ROTARY_KWARGS`): the dense layers' own RoPE is built alike."""
    return {k: model_kwargs[k] for k in ROTARY_KWARGS if k in model_kwargs}


def check_position_levers(schedule, position_embedding_type: Optional[str]) -> None:
    """Refuse ``attention.dense_layers.position_embedding`` / ``rotary_base`` on a model without
    RoPE (``position_embedding_type`` other than ``"rope"``): there is no rotary embedding to
    drop or rebase, and the setting would silently do nothing."""
    if schedule.has_position_levers() and position_embedding_type != "rope":
        raise ValueError(
            f"attention.dense_layers.position_embedding={schedule.dense_position_embedding!r} / "
            f"rotary_base={schedule.dense_rotary_base} change the dense layers' RoPE, and this "
            f"model's position_embedding_type is {position_embedding_type!r}; build it with "
            f"position_embedding_type='rope' or leave the dense layers' settings at their "
            f"defaults (rope, null)"
        )


# SelfAttention.forward arguments of Megatron's inference RoPE paths (cos/sin precomputed by the
# model), which the dense layers' levers cannot follow.
_COS_SIN_KWARGS = ("rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin")


class S2SelfAttention(SelfAttention):
    """Megatron's ``SelfAttention`` with the attention schedule's position encoding per layer.

    The model computes one rotary embedding (its ``rotary_base``) and hands it to every layer;
    ``SelfAttention`` rotates queries and keys with it before core attention. Here a dense layer
    of a schedule with ``dense_layers.position_embedding: nope`` drops it (no position
    encoding: Command A, Llama 4), and one with ``dense_layers.rotary_base`` replaces it by the
    same embedding at its own base (Gemma 3, MiMo-V2-Flash), built like the model's
    (``rotary``: :data:`ROTARY_KWARGS`, from the model builder) and sliced to this rank's
    load-balanced chunks under context parallelism as the model's is. S2 layers, and every layer
    of a schedule without these settings, run exactly Megatron's ``SelfAttention``.

    Args (``SelfAttention``'s, plus):
        scheduled: the core-attention builder whose ``schedule_position`` maps Megatron's
            ``layer_number`` to the schedule's layer (:class:`ScheduledCoreAttention`, or the
            hybrid stack's).
        rotary: :data:`ROTARY_KWARGS` of the model's rotary embedding (default: Megatron's
            defaults, ``rotary_percent`` 1 and no scaling).
    """

    def __init__(
        self,
        config,
        submodules,
        layer_number: int,
        attn_mask_type=AttnMaskType.padding,
        *,
        scheduled=None,
        rotary: Optional[dict] = None,
        **kwargs,
    ):
        super().__init__(config, submodules, layer_number, attn_mask_type, **kwargs)
        scheduled = ScheduledCoreAttention if scheduled is None else scheduled
        layer, layers = scheduled.schedule_position(config, layer_number)
        schedule = s2_settings_of(config).schedule
        self.position_embedding, base = schedule.layer_position(layer - 1, layers)
        self.rotary_base = base
        self.dense_rotary = None
        if base is not None:
            unknown = set(rotary or {}) - set(ROTARY_KWARGS)
            if unknown:
                raise ValueError(
                    f"S2SelfAttention (layer {layer_number}): rotary takes {ROTARY_KWARGS}, got "
                    f"{sorted(unknown)}"
                )
            options = {"rotary_percent": 1.0} | {
                k: v for k, v in (rotary or {}).items() if v is not None
            }
            self.dense_rotary = RotaryEmbedding(
                kv_channels=config.kv_channels,
                rotary_interleaved=config.rotary_interleaved,
                rotary_base=base,
                use_cpu_initialization=config.use_cpu_initialization,
                cp_group=self.pg_collection.cp,
                **options,
            )

    def extra_repr(self) -> str:
        if self.position_embedding == "nope":
            return "position embedding: none (NoPE)"
        if self.rotary_base is not None:
            return f"position embedding: RoPE, base {self.rotary_base:g}"
        return ""

    def forward(
        self,
        hidden_states,
        attention_mask,
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb=None,
        *args,
        **kwargs,
    ):
        """``SelfAttention.forward`` with ``rotary_pos_emb`` (the model's, ``[s / cp, 1, 1, d]``
        or a (q, k) pair of them) dropped for a NoPE layer or replaced by the layer's own."""
        if self.position_embedding == "nope" or self.dense_rotary is not None:
            # Megatron's inference fast paths rotate from the model's precomputed cos/sin, past
            # this layer's choice: refused rather than silently using the model's RoPE.
            given = [k for k in _COS_SIN_KWARGS if kwargs.get(k) is not None]
            if given:
                raise ValueError(
                    f"S2SelfAttention (layer {self.layer_number}): "
                    f"attention.dense_layers.position_embedding / rotary_base do not support "
                    f"Megatron's precomputed RoPE ({', '.join(given)}: flash decoding or the "
                    f"dynamic inference engine); run the model's plain forward"
                )
        if rotary_pos_emb is not None and self.position_embedding == "nope":
            rotary_pos_emb = None
        elif rotary_pos_emb is not None and self.dense_rotary is not None:
            rotary_pos_emb = self._own_rotary(rotary_pos_emb, kwargs.get("packed_seq_params"))
        return super().forward(
            hidden_states,
            attention_mask,
            key_value_states,
            inference_context,
            rotary_pos_emb,
            *args,
            **kwargs,
        )

    def _own_rotary(self, model_emb, packed_seq_params) -> torch.Tensor:
        """This layer's embedding for the positions the model's ``model_emb`` covers: the model
        sliced its full-length embedding to this CP rank's two chunks (``s / cp`` rows; packed
        THD sequences are not sliced), and ``RotaryEmbedding.forward`` slices ours alike."""
        emb = model_emb[0] if isinstance(model_emb, tuple) else model_emb
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        cp_group = self.pg_collection.cp
        cp = 1 if packed or cp_group is None else cp_group.size()
        own = self.dense_rotary(emb.shape[0] * cp, packed_seq=packed)
        if own.shape[-1] != emb.shape[-1]:
            raise ValueError(
                f"attention.dense_layers.rotary_base: the layer's rotary embedding has "
                f"{own.shape[-1]} channels, the model's {emb.shape[-1]}: build the model with "
                f"megatron_s2.build_gpt_model / build_model (which pass the model's "
                f"{', '.join(ROTARY_KWARGS)} to the layers)"
            )
        return own.to(emb.device)
