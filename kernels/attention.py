"""The public entry points: :func:`s2_attention` and :func:`s2_attention_varlen`."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Optional

import torch

from .pattern import S2Pattern
from .reference import s2_attention_reference, s2_attention_varlen_reference

if TYPE_CHECKING:  # imported lazily: triton.jit decides at import whether to interpret them
    from .config import KernelConfig

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
BACKENDS = ("auto", "triton", "reference")
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _triton_usable(q: torch.Tensor) -> bool:
    return q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _check_tensors(fn: str, q, k, v, pattern, shapes: tuple) -> None:
    """Types, dtypes, devices and head counts shared by both entry points; ``shapes`` names the
    dimensions of q and k/v (heads and head_dim last)."""
    if not isinstance(pattern, S2Pattern):
        raise TypeError(f"{fn}: pattern must be an S2Pattern, got {type(pattern).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        dims = shapes[0] if name == "q" else shapes[1]
        if not isinstance(t, torch.Tensor) or t.dim() != len(dims):
            raise ValueError(f"{fn}: {name} must be a {len(dims)}-D tensor [{', '.join(dims)}]")
    if q.dtype not in DTYPES:
        raise ValueError(f"{fn}: dtype must be fp16, bf16, fp32 or fp64, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{fn}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: q, k, v must be on the same device")
    if k.shape != v.shape:
        raise ValueError(
            f"{fn}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape"
        )
    hq, hkv = q.shape[-2], k.shape[-2]
    if hq != pattern.local_num_heads:
        raise ValueError(
            f"{fn}: q has {hq} heads but the pattern covers "
            f"{pattern.local_num_heads} heads (global heads [{pattern.head_start}, "
            f"{pattern.head_end})); use pattern.head_range()"
        )
    if hkv != pattern.local_num_kv_heads:
        raise ValueError(
            f"{fn}: k/v have {hkv} heads but the pattern expects "
            f"{pattern.local_num_kv_heads} KV heads (num_heads={pattern.num_heads}, "
            f"num_kv_heads={pattern.num_kv_heads})"
        )


def _check_backend(fn: str, backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {BACKENDS}, got {backend!r}")


def _scale(q, softmax_scale) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def _use_triton(fn: str, q, backend: str, kernel_config) -> bool:
    """Whether the Triton kernels run (else the reference); raises where ``backend="triton"``
    cannot be honoured or ``kernel_config`` is no KernelConfig."""
    use_triton = backend == "triton" or (backend == "auto" and _triton_usable(q))
    if not use_triton or q.dtype == torch.float64:
        if backend == "triton":
            raise ValueError(
                f"{fn}: the Triton backend does not take fp64; use backend='reference'"
            )
        return False
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"{fn}: head_dim must be one of {SUPPORTED_HEAD_DIMS} for the Triton "
            f"backend, got {q.shape[-1]}"
        )
    if not _triton_usable(q):
        raise ValueError(f"{fn}: backend='triton' needs CUDA tensors or TRITON_INTERPRET=1")
    from .config import KernelConfig

    if kernel_config is not None and not isinstance(kernel_config, KernelConfig):
        raise TypeError(
            f"{fn}: kernel_config must be a KernelConfig, got {type(kernel_config).__name__}"
        )
    return True


def validate_inputs(q, k, v, pattern: S2Pattern, q_start: int, k_start: int) -> None:
    """Raise ``ValueError`` naming the offending argument; runs before any kernel launch."""
    _check_tensors(
        "s2_attention",
        q,
        k,
        v,
        pattern,
        (("batch", "seq", "heads", "head_dim"), ("batch", "seq", "kv_heads", "head_dim")),
    )
    b, sq, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(
            f"s2_attention: k/v batch and head_dim {tuple(k.shape)} must match q {tuple(q.shape)}"
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
            (``s2attn.config.KernelConfig``), used for the forward and the backward;
            default ``kernel_config(pattern, head_dim, q.device, q.dtype)`` from the same
            module. The reference backend has no tiles and ignores it.
    Returns:
        ``out`` with q's shape, dtype and memory layout (and ``lse`` if ``return_lse``). Query rows
        that attend no key (only possible with offsets) are 0 with lse ``-inf``.
    """
    _check_backend("s2_attention", backend)
    validate_inputs(q, k, v, pattern, q_start, k_start)
    scale = _scale(q, softmax_scale)
    if _use_triton("s2_attention", q, backend, kernel_config):
        from .dispatch import S2AttentionFunction

        out, lse = S2AttentionFunction.apply(
            q, k, v, pattern, scale, q_start, k_start, kernel_config
        )
        return (out, lse) if return_lse else out
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


def validate_varlen_inputs(
    q, k, v, cu_seqlens, max_seqlen, pattern: S2Pattern, check_values: bool = True
) -> None:
    """Checks of :func:`s2_attention_varlen`'s arguments, ``ValueError`` naming the argument.

    Shapes, dtypes and devices always; with ``check_values`` also ``cu_seqlens``' values, which
    takes one device-to-host copy of it.
    """
    fn = "s2_attention_varlen"
    _check_tensors(
        fn,
        q,
        k,
        v,
        pattern,
        (("total_tokens", "heads", "head_dim"), ("total_tokens", "kv_heads", "head_dim")),
    )
    total, _, d = q.shape
    if k.shape[0] != total or k.shape[2] != d:
        raise ValueError(
            f"{fn}: k/v {tuple(k.shape)} must have q's total_tokens and head_dim "
            f"(q {tuple(q.shape)})"
        )
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(
            f"{fn}: cu_seqlens must be a torch.int32 tensor [num_docs + 1], "
            f"got {type(cu_seqlens).__name__}"
        )
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(
            f"{fn}: cu_seqlens must have dtype torch.int32 (as FlashAttention's varlen API), "
            f"got {cu_seqlens.dtype}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"{fn}: cu_seqlens must be 1-D [num_docs + 1] with num_docs >= 1, "
            f"got shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device != q.device:
        raise ValueError(
            f"{fn}: cu_seqlens must be on q's device ({q.device}), got {cu_seqlens.device}"
        )
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(
            f"{fn}: max_seqlen must be a Python int >= 0 (the longest document's length), "
            f"got {max_seqlen!r}"
        )
    if pattern.max_seq_len is not None and max_seqlen > pattern.max_seq_len:
        raise ValueError(
            f"{fn}: max_seqlen={max_seqlen} exceeds the user mask's {pattern.max_seq_len} "
            f"tokens ({pattern.max_seq_len // pattern.block_size} blocks of {pattern.block_size})"
        )
    if not check_values:
        return
    cu = cu_seqlens.to("cpu", torch.int64)
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0:
        raise ValueError(f"{fn}: cu_seqlens must start at 0, got {int(cu[0])}")
    if bool((lengths < 0).any()):
        i = int(torch.nonzero(lengths < 0)[0])
        raise ValueError(
            f"{fn}: cu_seqlens must be non-decreasing, got cu_seqlens[{i}]={int(cu[i])} > "
            f"cu_seqlens[{i + 1}]={int(cu[i + 1])}"
        )
    if int(cu[-1]) != total:
        raise ValueError(
            f"{fn}: cu_seqlens must end at total_tokens={total} (q.shape[0]), got {int(cu[-1])}"
        )
    longest = int(lengths.max())
    if longest > max_seqlen:
        raise ValueError(
            f"{fn}: max_seqlen={max_seqlen} is less than the longest document's length "
            f"{longest} (document {int(lengths.argmax())})"
        )


def s2_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    pattern: S2Pattern,
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
    backend: str = "auto",
    kernel_config: Optional[KernelConfig] = None,
    check_cu_seqlens: bool = True,
):
    """Causal S2 attention over packed documents (THD layout, FlashAttention's varlen API).

    Each document is attended on its own, as if it were a sequence of its own: the local window,
    the vertical stripes and the causal diagonal restart at its first token, and no query
    attends a key of another document. Documents need not be multiples of the block size; empty
    and one-token documents are fine. No padded copy is made.

    Args:
        q: ``[total_tokens, heads, head_dim]``, any strides.
        k, v: ``[total_tokens, kv_heads, head_dim]``; ``heads % kv_heads == 0`` (GQA/MQA).
        cu_seqlens: torch.int32 ``[num_docs + 1]`` on q's device: document ``i`` is tokens
            ``cu_seqlens[i] .. cu_seqlens[i + 1]``; starts at 0, non-decreasing, ends at
            ``total_tokens``.
        max_seqlen: Python int ``>=`` every document's length (a host value, so launching needs
            no device read). It selects the tile layout (the next power of two), not the result.
        pattern: :class:`S2Pattern`; its local heads must match ``heads``; a user-mask pattern
            takes documents up to its mask's length.
        softmax_scale, backend, kernel_config: as for :func:`s2_attention`.
        return_lse: also return the log-sum-exp ``[heads, total_tokens]`` (fp32, natural log,
            scale included), differentiable.
        check_cu_seqlens: check ``cu_seqlens``' values and ``max_seqlen`` against them (one
            device-to-host copy of ``cu_seqlens``, a synchronization on CUDA). Shapes, dtypes
            and devices are always checked. A training loop that builds ``cu_seqlens`` itself may
            pass False; invalid values then give wrong results.
    Returns:
        ``out [total_tokens, heads, head_dim]`` in q's dtype (and ``lse`` if ``return_lse``).
    """
    fn = "s2_attention_varlen"
    _check_backend(fn, backend)
    validate_varlen_inputs(q, k, v, cu_seqlens, max_seqlen, pattern, check_cu_seqlens)
    scale = _scale(q, softmax_scale)
    if _use_triton(fn, q, backend, kernel_config):
        from .dispatch import S2AttentionFunction
        from .tl_kernels import Varlen

        packed = Varlen(cu_seqlens, max_seqlen, q.shape[0])
        out, lse = S2AttentionFunction.apply(
            q[None], k[None], v[None], pattern, scale, 0, 0, kernel_config, packed
        )
        # squeeze, not [0]: a select's backward allocates a zero tensor and copies the grad in.
        return (out.squeeze(0), lse.squeeze(0)) if return_lse else out.squeeze(0)
    return s2_attention_varlen_reference(
        q, k, v, cu_seqlens, pattern, softmax_scale=scale, return_lse=return_lse
    )
