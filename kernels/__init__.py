"""s2attn: framework-agnostic S2 (sparsely-sharded) attention.

    from s2attn import S2Pattern, s2_attention, s2_attention_varlen
    pattern = S2Pattern(num_heads=32, num_kv_heads=8, block_size=64, local_blocks=16, vert_stride=8)
    out = s2_attention(q, k, v, pattern)          # q [b, s, h, d], k/v [b, s, h_kv, d]
    out = s2_attention_varlen(q, k, v, cu_seqlens, max_seqlen, pattern)  # packed [t, h, d]

Importable without Megatron. The Triton kernels run on CUDA, or on the CPU under
``TRITON_INTERPRET=1``; the PyTorch reference is the CPU fallback.
"""

from .attention import s2_attention, s2_attention_varlen
from .pattern import SUPPORTED_BLOCK_SIZES, CoverageReport, S2Pattern
from .reference import s2_attention_reference, s2_attention_varlen_reference

__all__ = [
    "S2Pattern",
    "CoverageReport",
    "SUPPORTED_BLOCK_SIZES",
    "s2_attention",
    "s2_attention_reference",
    "s2_attention_varlen",
    "s2_attention_varlen_reference",
]
