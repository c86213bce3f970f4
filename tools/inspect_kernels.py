#!/usr/bin/env python
"""What the s2attn kernels compile to on Hopper, without a GPU: resources and instruction mix.

Each launch the library makes for one call (forward, dQ, dK/dV) is captured with its real
arguments on the CPU, compiled for ``sm_90`` with the argument specialization a GPU launch gets,
and summarized: registers per thread, spilled registers, shared memory, and counts of the
instructions that decide Hopper speed, read from the PTX and the SASS (``cuobjdump`` ships with
Triton): ``wgmma`` / ``HGMMA`` (warpgroup tensor-core MMA) versus ``mma.sync`` / ``HMMA`` (the
older, slower path), ``cp.async`` (pipelined global-to-shared copies), ``cp.async.bulk.tensor``
(TMA), local-memory traffic (``LDL``/``STL``: spills or a register array indexed at run time).
METHOD.md in the device notes: "read what costs no device time" before spending GPU minutes.

    python tools/inspect_kernels.py                       # bf16, d128, block 64, the GPU defaults
    python tools/inspect_kernels.py --head-dim 64 --block-size 16 --kv-heads 2
    python tools/inspect_kernels.py --fwd 128,8,3 --dq 128,8,3 --dkdv 64,8,2   # other tiles
    python tools/inspect_kernels.py --tma                 # tiles through TMA descriptors
    python tools/inspect_kernels.py --kernels /tmp/old/kernels   # another copy of the package
    python tools/inspect_kernels.py --dump /tmp/asm      # also write .ttgir/.ptx/.sass files

Tiles are ``block_m,num_warps,num_stages`` per pass (:class:`s2attn.config.PassConfig`).
The numbers describe compiled code, not speed: a candidate that keeps HGMMA, has no spills and
fits the shared memory still has to be timed on the device (tools/benchmark.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# PTX and SASS instructions counted per kernel: name -> regular expression on one line.
PTX_COUNTS = {
    "wgmma": r"\bwgmma\.mma_async",
    "mma.sync": r"\bmma\.sync",
    "cp.async": r"\bcp\.async\.(?:ca|cg)",
    "tma": r"\bcp\.async\.bulk\.tensor",
    "ex2": r"\bex2\.approx",
}
SASS_COUNTS = {
    "HGMMA": r"\bHGMMA\b",
    "HMMA": r"\bHMMA\b",
    "LDGSTS": r"\bLDGSTS\b",
    "UTMALDG": r"\bUTMALDG\b",
    "LDL/STL": r"\b(?:LDL|STL)\b",
    "BAR": r"\bBAR\b",
}
HOPPER_SHARED_BYTES = 232448


def _import_s2attn(folder: Path = REPO / "kernels"):
    """s2attn from ``folder`` (default: this checkout's kernels/)."""
    import importlib.util

    init = Path(folder) / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "s2attn", init, submodule_search_locations=[str(init.parent)]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["s2attn"] = mod
    spec.loader.exec_module(mod)
    return mod


def _target():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    target = GPUTarget("cuda", 90, 128)
    return target, make_backend(target)


def compile_sm90(fn, args, kwargs):
    """Compile ``fn[grid](*args, **kwargs)`` for sm_90 as ``JITFunction.run`` would on an H100
    (divisibility-by-16 and ==1 specialization of the arguments, the launch options)."""
    import triton
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    target, backend = _target()
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, options = binder(*args, **kwargs)
    options, sig, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    return triton.compile(
        ASTSource(fn, sig, constexprs, attrs), target=target, options=options.__dict__
    )


def _sass(cubin: bytes) -> str:
    """SASS text of a cubin through the cuobjdump that ships with Triton ('' if absent)."""
    from triton.backends.nvidia import compiler as nv

    tool = Path(nv.__file__).parent / "bin" / "cuobjdump"
    if not tool.exists():
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True)
    return run.stdout if run.returncode == 0 else ""


def loop_waits(ttgir: str) -> list[list[int]]:
    """Per innermost ``scf.for`` loop of a kernel's TTGIR (the tile loops; an outer loop, such as
    the dK/dV pass's loop over a KV group's query heads, holds the inner loops' prologues and
    drains), the ``num`` of each ``ttg.async_wait`` in its body: how many async copy groups stay
    in flight while the step waits for its tiles. 0 at the top of a step means nothing was
    prefetched beyond the tile about to be used (its load latency is exposed); ``num_stages=3``
    pipelining shows 2 or more."""
    loops, stack, inner = [], [], set()
    for line in ttgir.splitlines():
        indent = len(line) - len(line.lstrip())
        if re.search(r"\bscf\.for\b", line):
            if stack:
                inner.add(stack[-1][1])  # the enclosing loop is not innermost
            loops.append([])
            stack.append((indent, len(loops) - 1))
            continue
        while stack and line.strip().startswith("}") and indent <= stack[-1][0]:
            stack.pop()
        if stack:
            m = re.search(r"ttg\.async_wait\b.*\{num = (\d+)", line)
            if m:
                loops[stack[-1][1]].append(int(m.group(1)))
    return [w for i, w in enumerate(loops) if i not in inner]


def _count(text: str, patterns: dict) -> dict:
    return {k: len(re.findall(p, text)) for k, p in patterns.items()}


def capture_launches(pattern, *, seq, head_dim, dtype, config=None, batch=1, doc_lens=None):
    """``[(pass name, kernel, args, kwargs)]`` of the ``tl`` kernel launches of one forward and
    one backward call (``s2attn.dispatch``) on CPU tensors ``[batch, seq, heads, head_dim]``,
    with the launch configuration a CUDA tensor would get (``config=None``:
    :func:`s2attn.config.kernel_config`'s GPU default for ``dtype``). ``doc_lens``: one packed
    row of documents of these lengths (varlen; ``seq`` is ignored)."""
    from s2attn import dispatch, tl_kernels
    from s2attn.config import kernel_config

    captured = []

    class Capture:
        # Stands in for a kernel: kernel[grid](*args, **kwargs) records the launch.
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *a, **kw: captured.append((self.fn, a, kw))

    names = ("_s2_fwd_kernel", "_s2_dq_kernel", "_s2_dkdv_kernel")
    saved = {n: getattr(tl_kernels, n) for n in names}
    if config is None:
        config = kernel_config(pattern, head_dim, "cuda", dtype)
    vl = None
    if doc_lens is not None:
        seq, batch = sum(doc_lens), 1
        cu = torch.tensor([0, *torch.tensor(doc_lens).cumsum(0).tolist()], dtype=torch.int32)
        vl = tl_kernels.Varlen(cu, max(doc_lens), seq)
    h, hkv = pattern.num_heads, pattern.num_kv_heads
    q = torch.randn(batch, seq, h, head_dim, dtype=dtype)
    k = torch.randn(batch, seq, hkv, head_dim, dtype=dtype)
    v = torch.randn_like(k)
    lse = torch.zeros(batch, h, seq)
    try:
        for n in names:
            setattr(tl_kernels, n, Capture(saved[n]))
        # The backward with an LSE gradient (dQ's HAS_DLSE: one more row load).
        dispatch.s2_forward(q, k, v, pattern, head_dim**-0.5, 0, 0, config, vl)
        dispatch.s2_backward(q, lse, q, k, v, q, lse, pattern, head_dim**-0.5, 0, 0, config, vl)
    finally:
        for n, fn in saved.items():
            setattr(tl_kernels, n, fn)
    return [
        (fn.__name__.replace("_s2_", "").replace("_kernel", ""), fn, a, kw)
        for fn, a, kw in captured
    ]


def inspect(launches, dump: Path | None = None) -> list[dict]:
    """One row per launch: its tile, resources and instruction counts."""
    rows = []
    for name, fn, args, kwargs in launches:
        c = compile_sm90(fn, args, kwargs)
        md = c.metadata
        sass = _sass(c.asm["cubin"])
        row = dict(
            kernel=name,
            tile=f"m{kwargs['BLOCK_M']} n{kwargs['BLOCK_N']} w{kwargs['num_warps']} "
            f"s{kwargs['num_stages']}",
            # Triton fills its own register counts only when it loads the binary on a device.
            **_ptxas_resources(c.asm["ptx"]),
            shared=md.shared,
            # The fewest copy groups left in flight by a wait inside each tile loop.
            loop_inflight=",".join(str(min(w)) for w in loop_waits(c.asm["ttgir"]) if w),
            **_count(c.asm["ptx"], PTX_COUNTS),
            **(_count(sass, SASS_COUNTS) if sass else {}),
        )
        rows.append(row)
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            for ext in ("ttgir", "ptx"):
                (dump / f"{name}.{ext}").write_text(c.asm[ext])
            if sass:
                (dump / f"{name}.sass").write_text(sass)
    return rows


def _ptxas_resources(ptx: str) -> dict:
    """Registers and spill bytes from ``ptxas -v`` for sm_90a."""
    from triton.backends.nvidia import compiler as nv

    ptxas = nv.get_ptxas(90).path  # the one Triton itself assembles sm_90 with
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run(
            [str(ptxas), "-v", "--gpu-name=sm_90a", str(src), "-o", str(Path(d) / "k.o")],
            capture_output=True,
            text=True,
        )
    log = run.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return dict(
        regs=int(regs.group(1)) if regs else None, spills=int(spill.group(1)) if spill else None
    )


def _pass(text: str | None):
    if text is None:
        return None
    m, w, s = (int(x) for x in text.split(","))
    return m, w, s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--local-blocks", type=int, default=4)
    ap.add_argument("--vert-stride", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048, help="tokens (compiled code is the same)")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--varlen", action="store_true", help="the packed-documents launches")
    ap.add_argument("--fwd", help="block_m,num_warps,num_stages of the forward")
    ap.add_argument("--dq", help="block_m,num_warps,num_stages of the dQ pass")
    ap.add_argument("--dkdv", help="block_m,num_warps,num_stages of the dK/dV pass")
    ap.add_argument("--block-n", type=int, help="key tile (default: the pattern block, <= 64)")
    ap.add_argument("--tma", action="store_true", help="KernelConfig(tma=True): TMA tile loads")
    ap.add_argument(
        "--kernels",
        type=Path,
        default=REPO / "kernels",
        help="the s2attn package folder to compile (e.g. an earlier commit's, from git archive)",
    )
    ap.add_argument("--dump", type=Path, help="write each kernel's TTGIR, PTX and SASS here")
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        # Under the interpreter the kernels are not JITFunctions and cannot be compiled.
        sys.exit("tools/inspect_kernels.py compiles for sm_90: unset TRITON_INTERPRET")
    _import_s2attn(args.kernels)
    from s2attn import S2Pattern
    from s2attn.config import PassConfig, kernel_config

    dtype = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32)[args.dtype]
    pattern = S2Pattern(
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        block_size=args.block_size,
        local_blocks=args.local_blocks,
        vert_stride=args.vert_stride,
    )
    config = kernel_config(pattern, args.head_dim, "cuda", dtype)
    overrides = {k: _pass(getattr(args, k)) for k in ("fwd", "dq", "dkdv")}
    import dataclasses

    for key, val in overrides.items():
        if val is not None:
            config = dataclasses.replace(config, **{key: PassConfig(*val)})
    if args.block_n is not None:
        config = dataclasses.replace(config, block_n=args.block_n)
    if args.tma:
        config = dataclasses.replace(config, tma=True)
    # Varlen: three documents of uneven, non-block-multiple lengths in one packed row.
    third = args.seq - (args.seq // 2 + 3) - (args.seq // 4 - 5)
    doc_lens = [args.seq // 2 + 3, args.seq // 4 - 5, third] if args.varlen else None
    launches = capture_launches(
        pattern,
        seq=args.seq,
        head_dim=args.head_dim,
        dtype=dtype,
        config=config,
        doc_lens=doc_lens,
    )
    rows = inspect(launches, args.dump)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    import triton

    print(
        f"sm_90, Triton {triton.__version__}, {args.dtype}, d{args.head_dim}, "
        f"block {args.block_size}, heads {args.heads}/{args.kv_heads}"
        f"{', varlen' if args.varlen else ''}"
    )
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    over = [r["kernel"] for r in rows if r["shared"] > HOPPER_SHARED_BYTES]
    if over:
        print(f"over Hopper's {HOPPER_SHARED_BYTES} bytes of shared memory: {over}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
