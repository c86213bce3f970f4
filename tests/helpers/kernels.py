"""Plain helpers of the s2attn kernel tests: inputs, token masks, fp64 references, comparisons.

Imported as ``from tests.helpers.kernels import token_mask`` (the fixtures and pytest hooks stay
in ``tests/conftest.py``). Nothing here imports the Triton kernels at module level: conftest.py
sets ``TRITON_INTERPRET=1`` before they are first imported when there is no CUDA device.
"""

from __future__ import annotations

import os

import pytest
import torch

# Whether the tests run on a CUDA device (else on the CPU, the kernels under the interpreter).
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def token_mask(pattern, seq_q, seq_k, q_start=0, k_start=0):
    """(local_heads, seq_q, seq_k) bool token mask from ``pattern.block_mask`` plus causality.
    Small sizes only; independent of the tile layouts."""
    B = pattern.block_size
    qpos = torch.arange(q_start, q_start + seq_q)
    kpos = torch.arange(k_start, k_start + seq_k)
    qb0, kb0 = q_start // B, k_start // B
    nq, nk = (q_start + seq_q - 1) // B - qb0 + 1, (k_start + seq_k - 1) // B - kb0 + 1
    bm = pattern.block_mask(nq, nk, qb0, kb0)
    m = bm[:, qpos // B - qb0][:, :, kpos // B - kb0]
    return m & (kpos[None, :] <= qpos[:, None])[None]


def make_inputs(
    batch, seq_q, seq_k, heads, kv_heads, head_dim, dtype, seed=0, layout="bshd", device=None
):
    """Random q, k, v (leaf tensors requiring grad) in ``[batch, seq, heads, dim]`` shape.

    ``layout="sbhd"`` gives non-contiguous views ``x.transpose(0, 1)`` of ``[seq, batch, heads,
    dim]`` storage (Megatron's layout)."""
    device = device or DEVICE
    g = torch.Generator(device="cpu").manual_seed(seed)

    def one(s, h):
        if layout == "sbhd":
            x = torch.randn(s, batch, h, head_dim, generator=g).to(device=device, dtype=dtype)
            x.requires_grad_(True)
            return x, x.transpose(0, 1)
        x = torch.randn(batch, s, h, head_dim, generator=g).to(device=device, dtype=dtype)
        x.requires_grad_(True)
        return x, x

    (qs, q), (ks, k), (vs, v) = one(seq_q, heads), one(seq_k, kv_heads), one(seq_k, kv_heads)
    return (qs, ks, vs), (q, k, v)


def upstream_grads(batch, seq_q, heads, head_dim, seed=1, device=None):
    """Random dOut [b, s, h, d] and dLSE [b, h, s] (fp64 on ``device``)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    do = torch.randn(batch, seq_q, heads, head_dim, generator=g, dtype=torch.float64)
    dl = torch.randn(batch, heads, seq_q, generator=g, dtype=torch.float64)
    device = device or DEVICE
    return do.to(device), dl.to(device)


def attention_with_grads(fn, leaves, views, dout=None, dlse=None, return_lse=True):
    """Run ``fn(q, k, v) -> (out, lse)`` (or out) and backprop ``sum(out*dout) + sum(lse*dlse)``
    (finite lse only: rows attending nothing have lse = -inf). Gradients are taken w.r.t. the
    storage tensors ``leaves`` and returned in the ``[b, s, h, d]`` view order (like ``views``)."""
    for x in leaves:
        x.grad = None
    res = fn(*views)
    out, lse = res if return_lse else (res, None)
    loss = 0.0
    if dout is not None:
        loss = loss + (out.double() * dout).sum()
    if dlse is not None:
        fin = torch.isfinite(lse)
        loss = loss + (torch.where(fin, lse, torch.zeros_like(lse)).double() * dlse).sum()
    grads = [None, None, None]
    if dout is not None or dlse is not None:
        loss.backward()
        grads = [
            x.grad if x.grad is None or x is v else x.grad.transpose(0, 1)
            for x, v in zip(leaves, views)
        ]
    return dict(
        out=out.detach(),
        lse=None if lse is None else lse.detach(),
        dq=grads[0],
        dk=grads[1],
        dv=grads[2],
    )


def fp64_reference(views, pattern, dout=None, dlse=None, **kw):
    """The PyTorch reference in fp64 on the (already rounded) inputs, with gradients."""
    from s2attn import s2_attention_reference

    leaves = [x.detach().to(torch.float64).requires_grad_(True) for x in views]
    return attention_with_grads(
        lambda q, k, v: s2_attention_reference(q, k, v, pattern, return_lse=True, **kw),
        leaves,
        leaves,
        dout,
        dlse,
    )


def rel_err(a, b):
    """max |a - b| / max |b| over finite entries (-inf positions must agree exactly)."""
    a, b = a.double(), b.double()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    assert torch.equal(fa, fb), "non-finite entries differ"
    assert torch.equal(a[~fa], b[~fb]), "infinite entries differ"
    if not fb.any():
        return 0.0
    diff = (a[fa] - b[fb]).abs().max().item()
    return diff / max(b[fb].abs().max().item(), 1e-6)


def assert_matches(got: dict, ref: dict, tol: float, names=("out", "lse", "dq", "dk", "dv")):
    """One comparison for outputs, LSE and gradients; returns the errors."""
    errs = {}
    for n in names:
        if ref.get(n) is None:
            continue
        assert got[n] is not None, f"{n} missing"
        assert got[n].shape == ref[n].shape, (
            f"{n}: shape {tuple(got[n].shape)} != {tuple(ref[n].shape)}"
        )
        assert torch.isfinite(got[n]).all() or n == "lse", f"{n} has non-finite values"
        errs[n] = rel_err(got[n], ref[n])
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errs})"
    return errs


# Run in a fresh interpreter: under TRITON_INTERPRET=1 (set by tests/conftest.py for the tl kernels)
# triton.language's own jit helpers, which Gluon code calls, would be interpreted objects.
_SM90_COMPILE = """
import importlib, json, sys
mod = importlib.import_module(sys.argv[1])
args = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
print(json.dumps(mod.compile_for_sm90(*args, **json.loads(sys.argv[5]))))
"""


def sm90_compile_stats(module: str, head_dim: int, block: int, tmp_path, **options) -> dict:
    """``module.compile_for_sm90(head_dim, block, tmp_path, **options)`` (a Gluon kernel module
    of s2attn) in a fresh interpreter without TRITON_INTERPRET: its statistics (``hgmma``,
    ``full_waits``, ``local_memory``, ``stack_bytes``, ``shared_bytes``, ``registers``). Skips
    where Triton ships no ``cuobjdump``."""
    import json
    import subprocess
    import sys

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("no cuobjdump next to Triton's ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            _SM90_COMPILE,
            module,
            str(head_dim),
            str(block),
            str(tmp_path),
            json.dumps(options),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def float64_packed_case(lens, heads, kv_heads, head_dim=16, block_size=64, seed=0):
    """Packed documents of ``lens`` tokens in float64 for the Gluon passes' emulations (an S2
    pattern of local 2, stride 2 and a TP rank's head offset): ``(pattern, varlen, cu, q, k, v,
    scale, g)`` with q/k/v ``[total, h, d]`` leaves that require grad, ``cu`` the int32
    ``cu_seqlens``, ``varlen`` the kernels' :class:`Varlen` and ``g`` the generator, for more
    random tensors."""
    from s2attn import S2Pattern
    from s2attn.tl_kernels import Varlen

    pattern = S2Pattern(
        num_heads=heads, num_kv_heads=kv_heads, block_size=block_size, local_blocks=2,
        vert_stride=2, head_offset=1,
    )  # fmt: skip
    total = sum(lens)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(total, h, head_dim, dtype=torch.float64, generator=g).requires_grad_(True)
        for h in (heads, kv_heads, kv_heads)
    )
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return pattern, Varlen(cu, max(lens), total), cu, q, k, v, head_dim**-0.5, g


def float64_s2_case(
    batch, seq, heads, kv_heads, local, stride, offset, head_dim=16, block_size=64, dense_heads=0
):
    """A block-``block_size`` S2 case (64 unless given; ``dense_heads`` dense heads) in float64
    for the Gluon passes' emulations: ``(pattern, q, k, v, do, scale, out, lse)`` with q/k/v
    ``[b, s, h, d]`` leaves that require grad, and ``out`` and ``lse [b, h, s]`` computed from
    the masked scores in float64 (differentiable; checked against the reference's output)."""
    from s2attn import S2Pattern, s2_attention_reference

    g = torch.Generator().manual_seed(seq + heads + offset)
    pattern = S2Pattern(
        num_heads=heads,
        num_kv_heads=kv_heads,
        block_size=block_size,
        local_blocks=local,
        vert_stride=stride,
        head_offset=offset,
        num_dense_heads=dense_heads,
    )
    q, k, v = (
        torch.randn(batch, seq, h, head_dim, dtype=torch.float64, generator=g).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )
    do = torch.randn(batch, seq, heads, head_dim, dtype=torch.float64, generator=g)
    scale = head_dim**-0.5
    # The reference's LSE is fp32: out and LSE come from the masked scores in float64.
    rep = heads // kv_heads
    sc = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(rep, 2)) * scale
    sc = sc.masked_fill(~token_mask(pattern, seq, seq)[None], float("-inf"))
    lse = torch.logsumexp(sc, dim=-1)
    p = torch.exp(sc - lse[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(rep, 2))
    assert (out - s2_attention_reference(q, k, v, pattern, scale)).abs().max() < 1e-9
    return pattern, q, k, v, do, scale, out, lse
