"""What the kernels of one attention call are launched with, and the defaults per device.

:class:`KernelConfig` holds the tile shapes and launch options of the three passes (forward, dQ,
dK/dV: a :class:`PassConfig` each) and which of them run through the Gluon kernels;
:func:`kernel_config` is the default for a pattern, head dim, device and dtype: the tiles tuned
on an H100 for the ``tl`` kernels (:mod:`s2attn.tl_kernels`), the interpreter's small ones
elsewhere, and the Gluon kernels (``gluon_forward.py``, ``gluon_dq.py``, ``gluon_dkdv.py``) on
where :func:`s2attn.gluon_forward.enabled_by_default` allows them (``S2ATTN_GLUON_FORWARD``).
:mod:`s2attn.dispatch` applies it call by call.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import gathered_keys, gluon_dkdv, gluon_forward
from .layout import MIN_TILE
from .pattern import S2Pattern

# Key tiles: one pattern block, or 64-key slices of a larger one (never two blocks).
MAX_BLOCK_N = 64
# Merge-Q: query tiles span several small pattern blocks, up to this many tokens.
MAX_BLOCK_M = 128


def _is_pow2(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class PassConfig:
    """Launch shape of one kernel pass: query tile rows ``block_m`` (a power of two >= 16),
    ``num_warps`` (a power of two) and software-pipeline ``num_stages`` (>= 1)."""

    block_m: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        if not _is_pow2(self.block_m) or self.block_m < MIN_TILE:
            raise ValueError(
                f"PassConfig.block_m must be a power of two >= {MIN_TILE}, got {self.block_m!r}"
            )
        if not _is_pow2(self.num_warps):
            raise ValueError(f"PassConfig.num_warps must be a power of two, got {self.num_warps!r}")
        if (
            isinstance(self.num_stages, bool)
            or not isinstance(self.num_stages, int)
            or self.num_stages < 1
        ):
            raise ValueError(
                f"PassConfig.num_stages must be an integer >= 1, got {self.num_stages!r}"
            )


@dataclass(frozen=True)
class KernelConfig:
    """Tile shapes and launch options of the three kernels of one attention call.

    ``block_n``: key tile of every pass (a power of two >= 16 that divides the pattern's block
    size, so a key tile never spans two pattern blocks). ``fwd``, ``dq``, ``dkdv``: the
    :class:`PassConfig` of the forward, dQ and dK/dV kernels; their ``block_m`` may merge
    several pattern blocks (Merge-Q). ``tma``: read the walked tiles through TMA tensor
    descriptors (Hopper; bf16/fp16 tensors whose alignment allows it, else the pointer loads
    run). ``gluon_fwd``: run the forward through the warp-specialized Gluon kernel
    (``gluon_forward.py``: sm_90) on the calls it takes, the ``tl`` forward (``fwd``) on the
    others. ``gluon_dkdv``: the same for the dK/dV pass (``gluon_dkdv.py``: sm_90; on wherever
    ``gluon_fwd`` is on by default and the block is 64 or 128, on 64-key tiles). ``gluon_dq``:
    the same for the dQ pass (``gluon_dq.py``; on where ``gluon_dkdv`` is). At blocks 16 and 32
    the three Gluon kernels run on gathered 64-key tiles (``gathered_keys.py``: self-attention
    and context-parallel chunks, lengths multiples of 128), on by default like the block-64
    ones. Derive variants with ``dataclasses.replace``, e.g.
    ``replace(cfg, dq=PassConfig(64, 4, 3))`` or ``replace(cfg, gluon_fwd=False)``.
    """

    block_n: int
    fwd: PassConfig
    dq: PassConfig
    dkdv: PassConfig
    tma: bool = False
    gluon_fwd: bool = False
    gluon_dkdv: bool = False
    gluon_dq: bool = False

    def __post_init__(self):
        for name in ("tma", "gluon_fwd", "gluon_dkdv", "gluon_dq"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"KernelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if not _is_pow2(self.block_n) or self.block_n < MIN_TILE:
            raise ValueError(
                f"KernelConfig.block_n must be a power of two >= {MIN_TILE}, got {self.block_n!r}"
            )
        for name in ("fwd", "dq", "dkdv"):
            if not isinstance(getattr(self, name), PassConfig):
                raise TypeError(
                    f"KernelConfig.{name} must be a PassConfig, "
                    f"got {type(getattr(self, name)).__name__}"
                )


# GPU defaults, measured on H100 (tools/tune_kernels.py, d=128, block 64; docs/benchmarks.md).
GPU_FWD = PassConfig(block_m=64, num_warps=4, num_stages=3)
GPU_DQ = PassConfig(block_m=128, num_warps=8, num_stages=3)
GPU_DKDV = PassConfig(block_m=32, num_warps=4, num_stages=3)
# 16-bit inputs at d=128 (measured 2026-11-23): TMA tile loads with a 128-row forward tile on 8
# warps are 6-11% faster in the forward and 7% in dQ than pointer loads with GPU_FWD. With the
# 64-row forward tile TMA is slower, so the two go together, and only where they were measured
# (fp32 tiles take no TMA, and a 128-row fp32 forward tile would not fit shared memory).
GPU_FWD_TMA = PassConfig(block_m=128, num_warps=8, num_stages=3)
TMA_HEAD_DIMS = (128,)
# TMA tiles for the 16-bit training dtypes only: fp32 tiles (tests, exact checks) staged for TMA
# would exceed Hopper's shared memory in the dQ pass at head_dim 128 (262 KB, measured with
# tools/inspect_kernels.py), and fp32 runs are not where speed matters.
TMA_DTYPES = (torch.bfloat16, torch.float16)
# Off d=128 (not re-tuned): narrower heads run dQ on 4 warps, wider ones (256) pipeline both
# backward passes 2 deep.
WIDE_HEAD_DIM = 128
GPU_DQ_NARROW_WARPS = 4
GPU_BWD_WIDE_STAGES = 2
# fp32 inputs (tests, exact checks) take twice the shared memory per tile: at d >= 128 the dQ
# pass's 128-row tile, 3 stages deep, would need 288 KB (Hopper has 227 KB per block), so it
# runs 64-row tiles (208 KB). bf16/fp16 are unaffected (tests/kernels/test_shared_memory.py compiles
# every default for sm_90 and checks the budget).
FP32_DQ_BLOCK_M = 64
# Interpreter: query tiles of two pattern blocks still exercise Merge-Q while keeping the CPU
# tests fast; dK/dV takes the GPU's query tile; there is no pipeline to stage.
INTERPRETER_MERGED_BLOCKS = 2
INTERPRETER_WARPS = 4
INTERPRETER_STAGES = 1


# Pattern blocks whose Gluon-forward calls the Gluon backward passes take too: on 64-key tiles
# (a block of 64, half a block of 128), and blocks 16 and 32 on gathered key tiles.
GLUON_BWD_BLOCKS = (gluon_dkdv.BLOCK_N, 2 * gluon_dkdv.BLOCK_N) + gathered_keys.BLOCK_SIZES


def kernel_config(pattern: S2Pattern, head_dim: int, device, dtype=None) -> KernelConfig:
    """The default :class:`KernelConfig` for ``pattern`` at ``head_dim`` on ``device`` (a
    ``torch.device`` or its name): CUDA gets the tuned GPU shapes, anything else the
    interpreter's. ``dtype`` (the inputs' torch dtype; None: a 16-bit one) shrinks tiles that
    would not fit the GPU's shared memory in fp32."""
    block_n = min(pattern.block_size, MAX_BLOCK_N)
    if torch.device(device).type != "cuda":
        merged = PassConfig(
            min(MAX_BLOCK_M, INTERPRETER_MERGED_BLOCKS * pattern.block_size),
            INTERPRETER_WARPS,
            INTERPRETER_STAGES,
        )
        return KernelConfig(
            block_n,
            fwd=merged,
            dq=merged,
            dkdv=dataclasses.replace(merged, block_m=GPU_DKDV.block_m),
        )
    dq, dkdv = GPU_DQ, GPU_DKDV
    if head_dim < WIDE_HEAD_DIM:
        dq = dataclasses.replace(dq, num_warps=GPU_DQ_NARROW_WARPS)
    if head_dim > WIDE_HEAD_DIM:
        dq = dataclasses.replace(dq, num_stages=GPU_BWD_WIDE_STAGES)
        dkdv = dataclasses.replace(dkdv, num_stages=GPU_BWD_WIDE_STAGES)
    if dtype == torch.float32 and head_dim >= WIDE_HEAD_DIM:
        dq = dataclasses.replace(dq, block_m=FP32_DQ_BLOCK_M)
    gluon = gluon_forward.enabled_by_default(head_dim, pattern.block_size, device, dtype)
    gluon_bwd = gluon and pattern.block_size in GLUON_BWD_BLOCKS
    if head_dim in TMA_HEAD_DIMS and (dtype is None or dtype in TMA_DTYPES):
        fwd, tma = GPU_FWD_TMA, True
    else:
        fwd, tma = GPU_FWD, False
    return KernelConfig(
        block_n, fwd, dq, dkdv, tma=tma, gluon_fwd=gluon, gluon_dkdv=gluon_bwd, gluon_dq=gluon_bwd
    )
