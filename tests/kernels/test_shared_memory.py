"""Every default kernel launch fits Hopper's shared memory (CPU; compiles for sm_90).

A launch whose compiled kernel needs more shared memory than the GPU has fails only on the GPU
(``triton.runtime.errors.OutOfResources``). Triton compiles for sm_90 without one, so here each
launch the library makes (forward, dQ, dK/dV; fixed length and varlen; default
:func:`s2attn.config.kernel_config` for the inputs' dtype) is captured with its real
arguments, compiled for ``cuda:90`` with the same argument specialization as a GPU launch, and
its ``metadata.shared`` checked against the H100's 227 KB per block. Shapes: those of the GPU
tests (bf16 and fp32, head_dim 64/128, block 16/64, GQA, and MHA, where ``group == 1`` is
specialized). Runs in a fresh process (conftest sets ``TRITON_INTERPRET=1``, under which the
kernels are not compilable); skipped where this Triton cannot compile for sm_90.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Independent of the megatron-core version: CI runs this module in its first suite only.
pytestmark = pytest.mark.version_independent

# H100/H200: 227 KB of shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin).
HOPPER_SHARED_BYTES = 232448

# id: (dtype, head_dim, pattern block, heads, kv heads)
# The largest footprints only (measured 2026-11-23: head_dim 64 and block 16 need less shared
# memory on every kernel, fixed and varlen), so the compile check stays short in CI.
CASES = {f"{dt}-d128-b64-gqa": (dt, 128, 64, 4, 2) for dt in ("bf16", "fp32")}
# The benchmark's MHA rows: group 1 is a specialized constant (other groups compile alike).
CASES["bf16-d128-b64-mha"] = ("bf16", 128, 64, 4, 4)

SCRIPT = r"""
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

assert os.environ.get("TRITON_INTERPRET") != "1"


# tools/inspect_kernels.py compiles a captured launch for sm_90 as a GPU launch would.
sys.path.insert(0, os.environ["S2_TOOLS"])
from inspect_kernels import capture_launches, compile_sm90, loop_waits  # noqa: E402


def probe():
    # Can this Triton compile (to a cubin, with ptxas) for sm_90 here?
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(x, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x + i, tl.load(x + i) + 1.0)

    import torch

    compile_sm90(_probe, (torch.zeros(16),), dict(BLOCK=16))


def run_case(case):
    name, (dt, d, block, h, hkv) = case
    import torch

    from s2attn import S2Pattern, tl_kernels

    here = os.path.realpath(tl_kernels.__file__)
    assert here == os.environ["S2ATTN_CHECKOUT"], here

    dtype = dict(bf16=torch.bfloat16, fp32=torch.float32)[dt]
    p = S2Pattern(num_heads=h, num_kv_heads=hkv, block_size=block, local_blocks=2, vert_stride=3)
    lens = [300, 1, 64, 37]
    out = {}
    for varlen in (False, True):
        # The GPU default config for the dtype, as a user's call on a CUDA tensor gets it.
        docs = lens if varlen else None
        shape = dict(seq=sum(lens), head_dim=d, dtype=dtype, batch=2, doc_lens=docs)
        launches = capture_launches(p, **shape)
        for tag, fn, a, kw in launches:
            c = compile_sm90(fn, a, kw)
            cfg = f"m{kw['BLOCK_M']} n{kw['BLOCK_N']} w{kw['num_warps']} s{kw['num_stages']}"
            out[("varlen " if varlen else "fixed ") + tag] = dict(
                shared=c.metadata.shared, config=cfg, loop_waits=loop_waits(c.asm["ttgir"])
            )
    return name, out


if __name__ == "__main__":
    try:
        probe()
    # No sm_90 compilation here: a Triton without these APIs, no CUDA backend or no ptxas.
    except (ImportError, AttributeError, TypeError, KeyError, FileNotFoundError, RuntimeError) as e:
        print(json.dumps({"skip": f"{type(e).__name__}: {e}"}))
        sys.exit(0)
    cases = json.loads(sys.argv[1])
    with ProcessPoolExecutor(max_workers=max(1, min(len(cases), os.cpu_count() or 1))) as ex:
        results = dict(ex.map(run_case, cases.items()))
    print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """``{case: {"fixed fwd": {"shared": bytes, "config": ...}, ...}}`` of every launch."""
    root = Path(__file__).resolve().parents[2]
    tmp = tmp_path_factory.mktemp("sm90")
    # This checkout's kernels as `s2attn`, whatever an installed copy points at.
    (tmp / "s2attn").symlink_to(root / "kernels", target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp), env.get("PYTHONPATH")]))
    env["S2_TOOLS"] = str(root / "tools")
    env["S2ATTN_CHECKOUT"] = os.path.realpath(root / "kernels" / "tl_kernels.py")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default; silences its warning
    script = tmp / "compile_sm90.py"  # a file: @triton.jit reads its source
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps(CASES)],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in res:
        pytest.skip(f"cannot compile for sm_90 here: {res['skip']}")
    return res


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case", list(CASES))
def test_default_launches_fit_hopper_shared_memory(compiled, case):
    launches = compiled[case]
    # 3 kernels, fixed length and varlen.
    assert len(launches) == 6, sorted(launches)
    print(
        f"\n{case}: " + ", ".join(f"{k} {v['shared']} ({v['config']})" for k, v in launches.items())
    )
    over = {k: v for k, v in launches.items() if v["shared"] > HOPPER_SHARED_BYTES}
    assert not over, f"{case}: over {HOPPER_SHARED_BYTES} bytes of shared memory: {over}"


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("fp32")])
def test_tile_loops_keep_tiles_in_flight(compiled, case):
    """Every tile loop of every 16-bit launch is software-pipelined: the wait at the top of a
    step leaves later tiles' copies in flight (``async_wait`` num > 0). Loading the tile-list
    entry in the step that uses it once gave num = 0 in the main loops of all three kernels
    (one tile in flight, its latency exposed); kernels/tl_kernels.py's _list_entry."""
    for launch, info in compiled[case].items():
        waits = [w for w in info["loop_waits"] if w]
        assert waits, f"{case} {launch}: no pipelined tile loop"
        starved = [w for w in waits if min(w) == 0]
        assert not starved, f"{case} {launch}: a tile loop waits for every copy: {waits}"


def _tool():
    from tests.helpers.megatron import import_tool

    return import_tool("inspect_kernels")


def test_loop_waits_reads_innermost_tile_loops():
    """tools/inspect_kernels.loop_waits on a hand-written TTGIR skeleton: an outer loop whose body
    holds an inner pipelined loop and a drain wait; only the inner loops are reported."""
    ttgir = """
    %a = ttg.async_wait %x {num = 0 : i32}
    %r:2 = scf.for %g = %c0 to %c4 step %c1 iter_args() -> () {
      %p = ttg.async_wait %y {num = 0 : i32}
      %s:3 = scf.for %i = %e0 to %e1 step %c1 iter_args() -> () {
        %w = ttg.async_wait %k, %v {num = 2 : i32}
        scf.yield
      } loc(#loc1)
      %t:3 = scf.for %i = %e1 to %e2 step %c1 iter_args() -> () {
        %w2 = ttg.async_wait %k {num = 0 : i32}
        %w3 = ttg.async_wait %v {num = 4 : i32}
        scf.yield
      } loc(#loc2)
      %d = ttg.async_wait {num = 0 : i32}
      scf.yield
    } loc(#loc3)
    """
    assert _tool().loop_waits(ttgir) == [[2], [0, 4]]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_inspect_kernels_tool_prints_a_table():
    """The tool end to end at a small shape: one row per kernel, tensor-core MMAs counted."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    args = ["--head-dim", "64", "--block-size", "64", "--seq", "256", "--kv-heads", "2"]
    proc = subprocess.run(
        [sys.executable, str(root / "tools" / "inspect_kernels.py"), *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=600,
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr:
        pytest.skip(f"cannot compile for sm_90 here: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout[proc.stdout.index("[") :])
    assert [r["kernel"] for r in rows] == ["fwd", "dq", "dkdv"]
    for r in rows:
        assert r["wgmma"] > 0 and r["HGMMA"] > 0 and r["spills"] == 0, r
        assert r["shared"] <= HOPPER_SHARED_BYTES, r
        assert r["loop_inflight"] and "0" not in r["loop_inflight"].split(","), r
