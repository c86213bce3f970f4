"""Probe behind the "128-key tiles" table (docs/notebook/2026-11-benchmarks-kernel-work.md, the
section that runs this file): the forward of a dense causal pattern with 64-key tiles (block 64,
and block 128 sliced to 64) against 128-key tiles (block 128), and cuDNN's dense causal forward,
on the same bf16 inputs (4 x 32k tokens, 32 heads, d 128).

    python docs/profiles/probe_key_tile.py      # a GPU; on the CPU (interpreter) a tiny check

Prints (block, config, ms, effective TFLOP/s, max |out - out of the first row|) per row.
"""

import dataclasses

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from s2attn import S2Pattern
from s2attn.config import PassConfig, kernel_config
from s2attn.dispatch import s2_forward

CUDA = torch.cuda.is_available()
B, S, H, D = (4, 32768, 32, 128) if CUDA else (1, 512, 2, 64)
DTYPE = torch.bfloat16
DEV = "cuda" if CUDA else "cpu"


def configs(block, base):
    yield "default", base
    if block != 128:
        return
    for stages in (2, 3) if CUDA else (1,):
        for tma in (True, False) if CUDA else (False,):
            fwd = PassConfig(128, 8 if CUDA else 4, stages)
            cfg = dataclasses.replace(base, block_n=128, fwd=fwd, tma=tma)
            yield f"n128 m128 w8 s{stages} tma={tma}", cfg
    if CUDA:
        cfg = dataclasses.replace(base, block_n=128, fwd=PassConfig(64, 4, 2), tma=False)
        yield "n128 m64 w4 s2 tma=False", cfg


def main():
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device=DEV, dtype=DTYPE) for _ in range(3))
    scale = D**-0.5
    flops = 4 * D * B * H * S * (S + 1) / 2  # forward, causal pairs only
    ref = None
    for block in (64, 128):
        pattern = S2Pattern(num_heads=H, block_size=block, local_blocks=1, vert_stride=1)
        for name, cfg in configs(block, kernel_config(pattern, D, DEV, DTYPE)):
            out, _ = s2_forward(q, k, v, pattern, scale, 0, 0, cfg)
            ref = out.float() if ref is None else ref
            err = (out.float() - ref).abs().max().item()
            ms = float("nan")
            if CUDA:
                run = lambda p=pattern, c=cfg: s2_forward(q, k, v, p, scale, 0, 0, c)  # noqa: E731
                ms = triton.testing.do_bench(run, warmup=25, rep=200)
            print((block, name, ms, flops / ms / 1e9, err), flush=True)
    if CUDA:
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            run = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                qt, kt, vt, is_causal=True
            )
            ms = triton.testing.do_bench(run, warmup=25, rep=200)
            err = (run().transpose(1, 2).float() - ref).abs().max().item()
        print(("cudnn", ms, flops / ms / 1e9, err), flush=True)
    print(torch.cuda.get_device_name() if CUDA else "cpu", torch.__version__)


if __name__ == "__main__":
    main()
