"""Bottom-right causal attention on cuDNN's graph API: the optional ``nvidia-cudnn-frontend``.

PyTorch's SDPA reaches cuDNN's fused attention with a top-left causal mask only, so under
context parallelism a dense layer's query chunk (the last ``sq`` of ``sk`` positions) costs two
SDPA calls merged by their log-sum-exp, plus the copies around them: 4-12% more time per token
than the single-GPU layer at 32k (``docs/context_parallel.md``). cuDNN aligns the causal mask at
the bottom right when asked to (``diagonal_alignment``), and its Python frontend (``pip install
nvidia-cudnn-frontend``, import name ``cudnn``) asks: one call a chunk each way, on the same
cuDNN kernels SDPA runs, reading Megatron's ``[s, b, h, d]`` tensors through their strides and
GQA's key heads as they are (no repeated heads, no copies).

:func:`causal_forward` and :func:`causal_backward` are the two calls, on ``[b, h, s, d]`` views
that the caller allocates (outputs and gradients are written in place);
``megatron_s2.context_parallel`` builds a CP rank's dense attention from them. A cuDNN graph is
built once per shape, strides, dtype and device, then reused.
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch

__all__ = [
    "CUDNN_FE_MODULE",
    "cudnn_frontend_import_error",
    "cudnn_frontend_unusable_reason",
    "causal_forward",
    "causal_backward",
]

CUDNN_FE_MODULE = "cudnn"
# cuDNN's fused attention as SDPA takes it on Hopper: 16-bit inputs, head sizes in multiples of
# 8 up to 128 (the sizes the dense layers' CP=1 path runs on cuDNN too).
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIM_MAX = 128

_GRAPHS: dict = {}
_MASK = __import__("os").environ.get("S2_CUDNN_FE_MASK", "bottom_right")
_HANDLES: dict = {}


@functools.cache
def cudnn_frontend_import_error() -> Optional[str]:
    """Why cuDNN's frontend cannot run attention here (None: it can). Cached: one import try."""
    try:
        cudnn = importlib.import_module(CUDNN_FE_MODULE)
        cudnn.backend_version()  # loads the cuDNN library itself
    except Exception as e:  # ImportError, or the library failing to load
        why = f"{type(e).__name__}: {e}"
        return f"{CUDNN_FE_MODULE} (nvidia-cudnn-frontend) does not import ({why})"
    if not hasattr(cudnn, "diagonal_alignment"):
        return "nvidia-cudnn-frontend is too old (no diagonal_alignment; 1.12 or newer needed)"
    return None


def cudnn_frontend_unusable_reason(q: torch.Tensor) -> Optional[str]:
    """Why :func:`causal_forward` cannot take queries like ``q [..., head_dim]`` (None: it can)."""
    if not q.is_cuda:
        return "cuDNN attention needs CUDA tensors"
    if q.dtype not in DTYPES:
        return f"cuDNN attention takes fp16/bf16, got {q.dtype}"
    hn = q.shape[-1]
    if hn % 8 or hn > HEAD_DIM_MAX:
        return f"cuDNN attention takes head_dim in multiples of 8 up to {HEAD_DIM_MAX}, got {hn}"
    if torch.cuda.get_device_capability(q.device) < (9, 0):
        return "the bottom-right cuDNN path is used on sm_90+ (Hopper) only"
    return cudnn_frontend_import_error()


def _handle(device: torch.device):
    """The device's cuDNN handle, set to PyTorch's current stream (kernels queue with torch's)."""
    import cudnn

    index = device.index if device.index is not None else torch.cuda.current_device()
    handle = _HANDLES.get(index)
    if handle is None:
        with torch.cuda.device(index):
            handle = _HANDLES[index] = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(index).cuda_stream)
    return handle


def _signature(*tensors: torch.Tensor) -> tuple:
    return tuple((tuple(t.shape), tuple(t.stride())) for t in tensors)


def _io_type(dtype: torch.dtype):
    import cudnn

    return cudnn.data_type.BFLOAT16 if dtype == torch.bfloat16 else cudnn.data_type.HALF


def _mask_args(sq, sk):
    import cudnn

    if _MASK == "bottom_right":
        return dict(
            diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_right_bound=0
        )
    return dict(
        diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=sk - sq
    )


def _build(graph) -> None:
    import cudnn

    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()


def _execute(graph, pack: dict, device: torch.device, handle) -> None:
    workspace = torch.empty(graph.get_workspace_size(), device=device, dtype=torch.uint8)
    graph.execute(pack, workspace, handle=handle)


def causal_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention aligned at the bottom right, written into ``out``.

    ``q [b, np, sq, hn]`` are the last ``sq`` positions of a ``sk``-token sequence whose keys and
    values are ``k, v [b, ng, sk, hn]`` (``sq <= sk``, ``np % ng == 0``: GQA groups as they are);
    query ``i`` attends keys ``<= sk - sq + i``. Any strides with the last dimension contiguous
    (views of Megatron's ``[s, b, h, d]``). ``out [b, np, sq, hn]`` receives the output;
    ``scale`` is the softmax scale. Returns the log-sum-exp ``[b, np, sq, 1]`` (fp32, natural
    log) that :func:`causal_backward` takes."""
    import cudnn

    # cuDNN's frontend reads tensors through DLPack, which refuses autograd leaves.
    q, k, v, out = (t.detach() for t in (q, k, v, out))
    b, nq, sq, _ = q.shape
    handle = _handle(q.device)
    key = ("fwd", q.device, q.dtype, scale, _signature(q, k, v, out))
    entry = _GRAPHS.get(key)
    if entry is None:
        graph = cudnn.pygraph(
            io_data_type=_io_type(q.dtype),
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
            handle=handle,
        )
        tq, tk, tv = (graph.tensor_like(t) for t in (q, k, v))
        to, tlse = graph.sdpa(
            name="causal_bottom_right",
            q=tq,
            k=tk,
            v=tv,
            generate_stats=True,
            attn_scale=scale,
            **_mask_args(q.shape[2], k.shape[2]),
        )
        to.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride()))
        tlse.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        tlse.set_dim([b, nq, sq, 1]).set_stride([nq * sq, sq, 1, 1])
        _build(graph)
        entry = _GRAPHS[key] = (graph, (tq, tk, tv, to, tlse))
    graph, (tq, tk, tv, to, tlse) = entry
    lse = torch.empty(b, nq, sq, 1, device=q.device, dtype=torch.float32)
    _execute(graph, {tq: q, tk: k, tv: v, to: out, tlse: lse}, q.device, handle)
    return lse


def causal_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    scale: float,
    deterministic: bool = False,
) -> None:
    """The backward of :func:`causal_forward`: writes ``dq`` (like ``q``), ``dk`` and ``dv``
    (like ``k``, ``v``: summed over each GQA group's query heads) from ``dout`` (like ``out``)
    and the forward's ``out`` and ``lse``. ``deterministic`` asks cuDNN for its deterministic
    algorithm (Megatron's ``deterministic_mode``); its default may accumulate with atomics."""
    import cudnn

    handle = _handle(q.device)
    tensors = tuple(t.detach() for t in (q, k, v, out, dout, lse, dq, dk, dv))
    key = ("bwd", q.device, q.dtype, scale, deterministic, _signature(*tensors))
    entry = _GRAPHS.get(key)
    if entry is None:
        graph = cudnn.pygraph(
            io_data_type=_io_type(q.dtype),
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
            handle=handle,
        )
        tq, tk, tv, to, tdo, tlse = (graph.tensor_like(t) for t in tensors[:6])
        tdq, tdk, tdv = graph.sdpa_backward(
            name="causal_bottom_right_backward",
            q=tq,
            k=tk,
            v=tv,
            o=to,
            dO=tdo,
            stats=tlse,
            attn_scale=scale,
            **_mask_args(q.shape[2], k.shape[2]),
            use_deterministic_algorithm=deterministic,
        )
        for node, t in ((tdq, dq), (tdk, dk), (tdv, dv)):
            node.set_output(True).set_dim(list(t.shape)).set_stride(list(t.stride()))
        _build(graph)
        entry = _GRAPHS[key] = (graph, (tq, tk, tv, to, tdo, tlse, tdq, tdk, tdv))
    graph, nodes = entry
    _execute(graph, dict(zip(nodes, tensors)), q.device, handle)
