"""FlashAttention-4 for the dense causal layers: the optional ``flash-attn-4`` package.

Dense layers run on PyTorch's SDPA (cuDNN on Hopper) unless FlashAttention-4 is installed
(``pip install flash-attn-4``, import name ``flash_attn.cute``). Where it imports and can run the
call (:func:`fa4_unusable_reason`: CUDA sm_90/sm_100/sm_110, fp16/bf16, the head sizes FA4 takes
on that architecture, no attention dropout), the ``auto`` backend takes it, because:

- on an H100 its dense causal fwd+bwd runs 15% faster than cuDNN's (``docs/benchmarks.md``);
- its causal mask aligns at the bottom right when queries are fewer than keys, so a
  context-parallel rank attends each query chunk to its key prefix in **one** call, where cuDNN
  (top-left causal only) needs two calls merged by their log-sum-exp
  (``docs/context_parallel.md``).

``model.dense_attention`` in the trainer (``S2TransformerConfig.dense_backend``) picks it:
"auto" (default), "sdpa" (never FA4) or "fa4" (required: a clear error where it cannot run).
FA4's backward accumulates dQ (and, under GQA, dK/dV over a group's heads) with atomics:
run-to-run differences at rounding level (as SDPA's dQ:
:func:`megatron_s2.context_parallel.dense_rank_chunks`), unless Megatron's ``deterministic_mode``
is set, which asks for its deterministic backward (``train.deterministic`` in the trainer).
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # torch loads with the first tensor: the run config reads DENSE_BACKENDS alone
    import torch

__all__ = [
    "DENSE_BACKENDS",
    "FA4_MODULE",
    "fa4_import_error",
    "fa4_unusable_reason",
    "check_dense_backend",
    "use_fa4",
    "fa4_causal",
]

DENSE_BACKENDS = ("auto", "sdpa", "fa4")
FA4_MODULE = "flash_attn.cute"
# Head sizes (multiples of 8) FA4 4.0 takes per compute capability major; elsewhere its asserts
# would fail the call instead of letting "auto" fall back to SDPA.
FA4_HEAD_DIMS = {
    9: lambda hn: 8 <= hn <= 256,
    10: lambda hn: 8 <= hn <= 128 or hn == 256,
    11: lambda hn: 8 <= hn <= 128 or hn == 256,
}


@functools.cache
def fa4_import_error() -> Optional[str]:
    """Why ``flash_attn.cute`` does not import here (None: it does). Cached: one import try."""
    try:
        importlib.import_module(FA4_MODULE)
    except Exception as e:  # ImportError, or its CUDA DSL failing to load on this machine
        return f"{FA4_MODULE} does not import ({type(e).__name__}: {e})"
    return None


def fa4_unusable_reason(q: torch.Tensor, dropout: float = 0.0) -> Optional[str]:
    """Why FA4 cannot run dense attention on queries like ``q [..., head_dim]`` (None: it can)."""
    import torch

    if dropout > 0:
        return f"attention dropout ({dropout}) is not supported by FlashAttention-4"
    if not q.is_cuda:
        return "FlashAttention-4 needs CUDA tensors"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention-4 takes fp16/bf16, got {q.dtype}"
    major = torch.cuda.get_device_capability(q.device)[0]
    if major not in FA4_HEAD_DIMS:
        return "FlashAttention-4 runs here on sm_90 (Hopper) and sm_100/sm_110 (Blackwell) only"
    hn = q.shape[-1]
    if hn % 8 or not FA4_HEAD_DIMS[major](hn):
        return f"FlashAttention-4 on sm_{major}x does not take head_dim {hn}"
    return fa4_import_error()


def check_dense_backend(setting: str, backend: str, dropout: float = 0.0) -> None:
    """Reject a dense backend that cannot work whatever the inputs, before any GPU work:
    an unknown name, or "fa4" with attention dropout or without the package. ``setting`` names
    the option in the message (``S2TransformerConfig.dense_backend``, ``model.dense_attention``)."""
    if backend not in DENSE_BACKENDS:
        raise ValueError(f"{setting} must be one of {DENSE_BACKENDS}, got {backend!r}")
    if backend != "fa4":
        return
    if dropout > 0:
        raise ValueError(
            f"{setting}='fa4': FlashAttention-4 has no attention dropout (attention_dropout="
            f"{dropout}); set it to 0.0 or use 'auto'/'sdpa'"
        )
    missing = fa4_import_error()
    if missing:
        raise ValueError(
            f"{setting}='fa4' needs FlashAttention-4: {missing}. Install it with "
            f"`pip install flash-attn-4` or use 'auto'/'sdpa'"
        )


def use_fa4(backend: str, q: torch.Tensor, dropout: float = 0.0) -> bool:
    """Whether dense attention on ``q`` runs on FA4 under ``backend`` (one of
    :data:`DENSE_BACKENDS`): "auto" where it can run, "fa4" always (ValueError naming why it
    cannot), "sdpa" never."""
    if backend == "sdpa":
        return False
    reason = fa4_unusable_reason(q, dropout)
    if backend == "fa4" and reason:
        raise ValueError(f"dense_backend='fa4': {reason}")
    return reason is None


def fa4_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    deterministic: bool = False,
) -> torch.Tensor:
    """Causal attention on FlashAttention-4, aligned at the bottom right.

    ``q [b, sq, np, hn]`` are the last ``sq`` positions of a ``sk``-token sequence whose keys and
    values are ``k, v [b, sk, ng, hn]`` (``sq <= sk``; GQA groups not repeated, ``np % ng == 0``):
    query ``i`` attends keys ``<= sk - sq + i``. ``scale`` is the softmax scale;
    ``deterministic`` asks for FA4's deterministic backward (Megatron's ``deterministic_mode``).
    Returns ``[b, sq, np, hn]``; differentiable (FA4's own autograd Function)."""
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(q, k, v, softmax_scale=scale, causal=True, deterministic=deterministic)
    return out[0] if isinstance(out, tuple) else out
