"""The public entry point: :func:`s2_attention`."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Optional

import torch

from .pattern import S2Pattern
from .reference import s2_attention_reference

if TYPE_CHECKING:  # imported lazily: triton.jit decides at import whether to interpret them
    from .triton_attention import KernelConfig

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
BACKENDS = ("auto", "triton", "reference")


def _triton_usable(q: torch.Tensor) -> bool:
    return q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def validate_inputs(q, k, v, pattern: S2Pattern, q_start: int, k_start: int) -> None:
    """Raise ``ValueError`` naming the offending argument; runs before any kernel launch."""
    if not isinstance(pattern, S2Pattern):
        raise TypeError(f"s2_attention: pattern must be an S2Pattern, got {type(pattern).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"s2_attention: {name} must be a 4-D tensor [batch, seq, heads, head_dim]"
            )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"s2_attention: dtype must be fp16, bf16, fp32 or fp64, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"s2_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError("s2_attention: q, k, v must be on the same device")
    b, sq, hq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(
            f"s2_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape"
        )
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(
            f"s2_attention: k/v batch and head_dim {tuple(k.shape)} must match q {tuple(q.shape)}"
        )
    hkv = k.shape[2]
    if hq != pattern.local_num_heads:
        raise ValueError(
            f"s2_attention: q has {hq} heads but the pattern covers "
            f"{pattern.local_num_heads} heads (global heads [{pattern.head_start}, "
            f"{pattern.head_end})); use pattern.head_range()"
        )
    if hkv != pattern.local_num_kv_heads:
        raise ValueError(
            f"s2_attention: k/v have {hkv} heads but the pattern expects "
            f"{pattern.local_num_kv_heads} KV heads (num_heads={pattern.num_heads}, "
            f"num_kv_heads={pattern.num_kv_heads})"
        )
    if sq < 1 or k.shape[1] < 1:
        raise ValueError("s2_attention: sequence lengths must be >= 1")
    B = pattern.block_size
    for name, val in (("q_start", q_start), ("k_start", k_start)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 0 or val % B:
            raise ValueError(
                f"s2_attention: {name} must be a non-negative multiple of block_size={B}, "
                f"got {val!r}"
            )
    pattern.check_seq_len(q_start + sq, "q_start + seq_q")
    pattern.check_seq_len(k_start + k.shape[1], "k_start + seq_k")


def s2_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: S2Pattern,
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
    q_start: int = 0,
    k_start: int = 0,
    backend: str = "auto",
    kernel_config: Optional[KernelConfig] = None,
):
    """Causal S2 block-sparse attention with autograd.

    Args:
        q: ``[batch, seq_q, heads, head_dim]``, any strides (e.g. a transposed view of Megatron's
            ``[seq, batch, heads, dim]``; no copy is made).
        k, v: ``[batch, seq_k, kv_heads, head_dim]``; ``heads % kv_heads == 0`` (GQA/MQA). Query
            head ``j`` uses KV head ``j // (heads // kv_heads)``.
        pattern: :class:`S2Pattern`; its local heads (``head_range``) must match ``heads``.
        softmax_scale: multiplies ``q.k``; default ``1/sqrt(head_dim)``.
        return_lse: also return the log-sum-exp ``[batch, heads, seq_q]`` (fp32, natural log,
            scale included), differentiable, so partial results over key chunks can be merged.
        q_start, k_start: absolute token positions of ``q[:, 0]`` and ``k[:, 0]`` (multiples of
            the block size); the pattern and the causal mask use absolute positions.
        backend: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"reference"``
            (PyTorch), or ``"auto"`` (Triton when usable).
        kernel_config: tile shapes and launch options of the Triton kernels
            (``s2attn.triton_attention.KernelConfig``), used for the forward and the backward;
            default ``kernel_config(pattern, head_dim, q.device)`` from the same module. The
            reference backend has no tiles and ignores it.
    Returns:
        ``out`` with q's shape, dtype and memory layout (and ``lse`` if ``return_lse``). Query rows
        that attend no key (only possible with offsets) are 0 with lse ``-inf``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"s2_attention: backend must be one of {BACKENDS}, got {backend!r}")
    validate_inputs(q, k, v, pattern, q_start, k_start)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    use_triton = backend == "triton" or (backend == "auto" and _triton_usable(q))
    if use_triton and q.dtype != torch.float64:
        if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"s2_attention: head_dim must be one of {SUPPORTED_HEAD_DIMS} for the Triton "
                f"backend, got {q.shape[-1]}"
            )
        if not _triton_usable(q):
            raise ValueError(
                "s2_attention: backend='triton' needs CUDA tensors or TRITON_INTERPRET=1"
            )
        from .triton_attention import KernelConfig, S2AttentionFunction

        if kernel_config is not None and not isinstance(kernel_config, KernelConfig):
            raise TypeError(
                f"s2_attention: kernel_config must be a KernelConfig, "
                f"got {type(kernel_config).__name__}"
            )
        out, lse = S2AttentionFunction.apply(
            q, k, v, pattern, scale, q_start, k_start, kernel_config
        )
        return (out, lse) if return_lse else out
    if backend == "triton":
        raise ValueError(
            "s2_attention: the Triton backend does not take fp64; use backend='reference'"
        )
    return s2_attention_reference(
        q,
        k,
        v,
        pattern,
        softmax_scale=scale,
        return_lse=return_lse,
        q_start=q_start,
        k_start=k_start,
    )
