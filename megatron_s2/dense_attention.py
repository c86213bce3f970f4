"""Dense causal core attention through PyTorch SDPA (the dense layers of the local spec).

Megatron's local ``DotProductAttention`` materializes the ``[b, h, s, s]`` score matrix, which at
long context does not fit in memory. :class:`FusedDenseAttention` has the same constructor and
forward contract but calls ``torch.nn.functional.scaled_dot_product_attention``, which on GPU
dispatches to the flash / cuDNN / memory-efficient kernels (O(s) memory).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from .core_attention import check_common_support, tp_group_of

def _sdpa_has_gqa() -> bool:
    # A builtin without an introspectable signature: read its docstring (torch >= 2.5 has it).
    return "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


_SDPA_HAS_GQA = _sdpa_has_gqa()


class FusedDenseAttention(MegatronModule):
    """Dense causal attention with ``DotProductAttention``'s contract, on fused SDPA kernels.

    Forward: query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` (GQA groups not repeated)
    -> ``[sq, b, np * hn]``. Attention dropout is supported (under the tensor-parallel RNG
    tracker, as Megatron does it).
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, **kwargs):
        super().__init__(config=config)
        check_common_support(type(self).__name__, config, layer_number, attn_mask_type,
                             attention_type, kwargs)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.dropout_p = float(config.attention_dropout if attention_dropout is None
                               else attention_dropout)
        self.softmax_scale = (1.0 / math.sqrt(config.kv_channels) if softmax_scale is None
                              else float(softmax_scale))
        self.tp_group = tp_group_of(pg_collection)

    def extra_repr(self) -> str:
        return f"layer={self.layer_number}, dense causal (SDPA), dropout={self.dropout_p}"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        """query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` -> ``[sq, b, np * hn]``.

        ``attention_mask`` is ignored: the mask type is causal (checked at construction)."""
        from .core_attention import check_forward_support

        check_forward_support(type(self).__name__, attn_mask_type, attention_bias, packed_seq_params)
        sq, b, nq, hn = query.shape
        # SDPA wants [b, h, s, d]; the permutes are views.
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        ng = k.shape[1]
        kwargs = {}
        if ng != nq:
            if _SDPA_HAS_GQA:
                kwargs["enable_gqa"] = True
            else:
                k = k.repeat_interleave(nq // ng, dim=1)
                v = v.repeat_interleave(nq // ng, dim=1)
        p = self.dropout_p if self.training else 0.0

        def attend():
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                  scale=self.softmax_scale, **kwargs)

        if p > 0 and not self.config.sequence_parallel:
            # Heads differ across TP ranks, so their dropout masks must too (Megatron's rule).
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = attend()
        else:
            out = attend()
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, nq * hn)
