"""Can Triton 3.6's Gluon express a FlashAttention-3-shaped forward for the H100? Compile-only.

A warp-specialized skeleton, compiled for sm_90 on a machine without a GPU: one loader warp
issues TMA loads of K/V tiles into a two-stage ring guarded by mbarriers (``ready`` / ``empty``),
two consumer warpgroups each take a 64-row query tile and run ``S = Q K^T`` (``wgmma`` from
shared memory), the online softmax, and ``O += P V`` (``wgmma`` with P in registers). It is
the shape issue 13 asks for, which plain ``triton.language`` does not compile for sm_90 in 3.6
(``tl.range(warp_specialize=True)`` fails in ``make_ttgir``). Not numerically checked and not
launched: one CTA, one head, no causal mask, no S2 pattern; it answers only "does it compile,
to HGMMA, in what registers and shared memory" (docs/benchmarks.md, issue 13's section).

    python -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    /tmp/t36/bin/python docs/profiles/gluon_sm90_compile_probe.py     # writes out/fa3_probe.*

Triton 3.6 specifics met on the way: ``GPUTarget("cuda", 90, 32)`` (the last field is the warp
size); ``gl.warp_specialize`` takes the worker arguments as a literal tuple per partition (a
tuple held in a variable turns its constexprs into tensors, hence the sizes read from the
shared-memory types below).
"""

import os
import re
import subprocess

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BM, BN, D = 64, 128, 128  # per-consumer-warpgroup M tile


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, N_CTX):
    BM: gl.constexpr = q_smem.type.shape[1]
    BN: gl.constexpr = k_bufs.type.shape[1]
    NUM_STAGES: gl.constexpr = k_bufs.type.shape[0]
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [0, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [BM, 0], q_bar, q_smem.index(1))
    i = 0
    for n in range(0, N_CTX, BN):
        s = i % NUM_STAGES
        ph = (i // NUM_STAGES) & 1
        mbarrier.wait(empty.index(s), ph ^ 1)
        mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [n, 0], ready.index(s), k_bufs.index(s))
        tma.async_copy_global_to_shared(v_desc, [n, 0], ready.index(s), v_bufs.index(s))
        i += 1


@gluon.jit
def _consumer_body(
    q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_smem, N_CTX, qk_scale, WG: gl.constexpr
):
    # Sizes from the shared-memory types: constexprs passed to a worker arrive as tensors.
    BM: gl.constexpr = q_smem.type.shape[1]
    BN: gl.constexpr = k_bufs.type.shape[1]
    D: gl.constexpr = k_bufs.type.shape[2]
    NUM_STAGES: gl.constexpr = k_bufs.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q = q_smem.index(WG)
    mbarrier.wait(q_bar, 0)
    m_i = gl.full([BM], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.full([BM], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BM, D], gl.float32, o_layout)
    i = 0
    for _ in range(0, N_CTX, BN):
        s = i % NUM_STAGES
        ph = (i // NUM_STAGES) & 1
        mbarrier.wait(ready.index(s), ph)
        k = k_bufs.index(s)
        v = v_bufs.index(s)
        s_acc = gl.zeros([BM, BN], gl.float32, s_layout)
        s_tok = warpgroup_mma(q, k.permute((1, 0)), s_acc, use_acc=False, is_async=True)
        s_acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        m_new = gl.maximum(m_i, gl.max(s_acc, 1) * qk_scale)
        p = gl.exp2(s_acc * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
        acc = acc * alpha_o[:, None]
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        o_tok = warpgroup_mma(p_op, v, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
        mbarrier.arrive(empty.index(s), count=1)
        m_i = m_new
        i += 1
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    o_smem.index(WG).store((acc / l_o[:, None]).to(gl.bfloat16))
    fence_async_shared()


@gluon.jit
def _consumer_default(q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_smem, N_CTX, qk_scale):
    _consumer_body(q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_smem, N_CTX, qk_scale, 0)


@gluon.jit
def _consumer_worker(
    q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_smem, N_CTX, qk_scale
):
    _consumer_body(q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_smem, N_CTX, qk_scale, 1)


@gluon.jit
def _loader_worker(
    q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_smem, N_CTX, qk_scale
):
    _loader(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, N_CTX)


@gluon.jit
def fa3_probe_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    N_CTX,
    qk_scale,
    BM: gl.constexpr,
    BN: gl.constexpr,
    D: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(
        k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout
    )
    v_bufs = gl.allocate_shared_memory(
        v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout
    )
    o_smem = gl.allocate_shared_memory(o_desc.dtype, [2] + o_desc.block_type.shape, o_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumer warpgroups release a stage
    fence_async_shared()
    wargs = (
        q_desc,
        k_desc,
        v_desc,
        q_smem,
        k_bufs,
        v_bufs,
        q_bar,
        ready,
        empty,
        o_smem,
        N_CTX,
        qk_scale,
    )
    gl.warp_specialize(
        [
            (
                _consumer_default,
                (q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_smem, N_CTX, qk_scale),
            ),
            (_consumer_worker, wargs),
            (_loader_worker, wargs),
        ],
        [4, 1],
        [240, 24],
    )
    tma.async_copy_shared_to_global(o_desc, [0, 0], o_smem.index(0))
    tma.async_copy_shared_to_global(o_desc, [BM, 0], o_smem.index(1))
    tma.store_wait(0)


def dsig(block):
    lay = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return f"tensordesc<bf16[{block[0]}, {block[1]}],{lay!r}>"


if __name__ == "__main__":
    sig = {
        "q_desc": dsig([BM, D]),
        "k_desc": dsig([BN, D]),
        "v_desc": dsig([BN, D]),
        "o_desc": dsig([BM, D]),
        "N_CTX": "i32",
        "qk_scale": "fp32",
        "BM": "constexpr",
        "BN": "constexpr",
        "D": "constexpr",
        "NUM_STAGES": "constexpr",
    }
    src = GluonASTSource(
        fa3_probe_kernel, signature=sig, constexprs={"BM": BM, "BN": BN, "D": D, "NUM_STAGES": 2}
    )
    ck = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 240}
    )
    os.makedirs("out", exist_ok=True)
    for ext, t in ck.asm.items():
        open(f"out/fa3_probe.{ext}", "wb" if isinstance(t, bytes) else "w").write(t)
    bind = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    sass = subprocess.run(
        [f"{bind}/cuobjdump", "-sass", "out/fa3_probe.cubin"], capture_output=True, text=True
    ).stdout
    open("out/fa3_probe.sass", "w").write(sass)
    ptx = ck.asm["ptx"]
    print(
        "wgmma.mma_async:",
        ptx.count("wgmma.mma_async"),
        "HGMMA:",
        sass.count("HGMMA"),
        "setmaxnreg:",
        sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+\d+", ptx))),
    )
    print("num_warps:", ck.metadata.num_warps, "shared:", ck.metadata.shared)
    print(
        subprocess.run(
            [f"{bind}/cuobjdump", "-res-usage", "out/fa3_probe.cubin"],
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
