"""Context parallelism in the core-attention modules: two gloo processes (CP=2) against one process
attending the whole sequence (CP=1), outputs and dq/dk/dv of S2 and dense layers.

Each rank holds Megatron's load-balanced chunks (rank r: chunks r and 3 - r of four) of the same
random q/k/v; every rank's rows of the CP=2 result must equal the same rows of the CP=1 result.
The model-level equivalence (losses and gradients of a training step, also with TP=2) is in
tests/plugin/test_megatron_parallel.py.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.helpers.megatron import free_port, tiny_s2_config  # noqa: E402

SEQ = 128
BATCH = 2
SCHEDULE = {
    "s2": {"block_size": 16, "local_blocks": 2, "vert_stride": 8, "head_offset": 1},
    "dense_layers": {"pattern": "SD"},
}


def _local_rows(x: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """Megatron's split of ``[S, ...]``: chunks ``rank`` and ``2cp - 1 - rank``."""
    chunks = x.chunk(2 * cp, dim=0)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=0)


def _inputs(seed: int, heads: int, groups: int, dim: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(SEQ, BATCH, heads, dim, generator=g)
    k = torch.randn(SEQ, BATCH, groups, dim, generator=g)
    v = torch.randn(SEQ, BATCH, groups, dim, generator=g)
    dout = torch.randn(SEQ, BATCH, heads * dim, generator=g)
    return q, k, v, dout


def _run(module, q, k, v, dout):
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = module(*leaves, None)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def _worker(rank: int, port: int, backend: str, result_dir: str):
    from megatron_s2.training.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_s2.attention import FusedDenseAttention, S2CoreAttention

    parallel_state.initialize_model_parallel(context_parallel_size=2)
    errors = {}
    for layer, cls in ((1, S2CoreAttention), (2, FusedDenseAttention)):
        cfgs = {
            cp: tiny_s2_config(
                SCHEDULE, s2_seq_length=SEQ, s2_backend=backend, context_parallel_size=cp
            )
            for cp in (1, 2)
        }
        heads, groups, dim = 8, 4, cfgs[1].kv_channels
        single = cls(config=cfgs[1], layer_number=layer, attn_mask_type=AttnMaskType.causal)
        q, k, v, dout = _inputs(seed=100 + layer, heads=heads, groups=groups, dim=dim)
        expect = [_local_rows(t, rank, 2) for t in _run(single, q, k, v, dout)]
        for comm in ("all_gather", "a2a"):
            split = cls(
                config=cfgs[2],
                layer_number=layer,
                attn_mask_type=AttnMaskType.causal,
                cp_comm_type=comm,
            )
            assert single.cp_group is None and split.cp_group.size() == 2
            assert split.cp_comm == comm
            got = _run(split, *(_local_rows(t, rank, 2) for t in (q, k, v, dout)))
            errors[f"{cls.__name__} {comm}"] = [
                float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, expect)
            ]
    _check_comm_choice(AttnMaskType.causal)
    torch.save(errors, os.path.join(result_dir, f"rank{rank}.pt"))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def _check_comm_choice(causal):
    """cp_comm_type at construction (CP=2 initialized): each layer kind's default, Megatron's
    values we do not run refused by name, "a2a" refused where the heads do not split."""
    from megatron_s2.attention import FusedDenseAttention, S2CoreAttention

    def build(cls, groups=4, config_kw=None, **kw):
        cfg = tiny_s2_config(
            SCHEDULE,
            s2_seq_length=SEQ,
            context_parallel_size=2,
            num_query_groups=groups,
            **(config_kw or {}),
        )
        return cls(
            config=cfg, layer_number=1 + (cls is FusedDenseAttention), **kw, attn_mask_type=causal
        )

    assert build(S2CoreAttention).cp_comm == "all_gather"
    assert build(FusedDenseAttention).cp_comm == "auto"  # GQA: 8 heads, 4 groups
    assert build(FusedDenseAttention, groups=8).cp_comm == "auto"
    assert build(FusedDenseAttention, groups=1).cp_comm == "all_gather"  # 1 group: no split
    assert build(FusedDenseAttention, groups=8, cp_comm_type="p2p").cp_comm == "auto"
    assert build(FusedDenseAttention, cp_comm_type="all_gather").cp_comm == "all_gather"
    assert build(S2CoreAttention, cp_comm_type="a2a").cp_comm == "a2a"
    # "auto" on a dense layer: the all-to-all up to DENSE_A2A_MAX_SEQ tokens, the all-gather
    # beyond (which path runs, seen through stand-ins; SEQ tokens over the two ranks here).
    import megatron_s2.attention as attention

    dense, taken = build(FusedDenseAttention), []
    names = (
        "attend_heads_a2a",
        "dense_local_chunks",
        "DENSE_A2A_MAX_SEQ",
        "use_fa4",
        "FA4_GATHER_MIN_VOLUME_RATIO",
    )
    saved = [getattr(attention, n) for n in names]
    attention.attend_heads_a2a = lambda *a, **k: taken.append("a2a")
    attention.dense_local_chunks = lambda *a, **k: taken.append("all_gather")
    try:
        q, k, v, _ = _inputs(seed=0, heads=8, groups=4, dim=dense.config.kv_channels)
        for limit in (SEQ, SEQ - 1):
            attention.DENSE_A2A_MAX_SEQ = limit
            dense(q[: SEQ // 2], k[: SEQ // 2], v[: SEQ // 2], None)
        # With FlashAttention-4 (stood in for: every backend but "sdpa" takes it): 8 query
        # heads on 4 K/V heads at CP=2 would make the all-to-all move 1.5x the all-gather's
        # bytes, under FA4_GATHER_MIN_VOLUME_RATIO, so the all-to-all; at a ratio of 1.5
        # and up the all-gather; with dense_backend "sdpa" the all-to-all again.
        attention.DENSE_A2A_MAX_SEQ = SEQ
        seen = []

        def fa4_stand_in(backend, query, dropout=0.0):
            seen.append(query.shape)
            return backend != "sdpa"

        attention.use_fa4 = fa4_stand_in
        rows = [x[: SEQ // 2] for x in (q, k, v)]
        dense(*rows, None)
        attention.FA4_GATHER_MIN_VOLUME_RATIO = 1.5
        dense(*rows, None)
        build(FusedDenseAttention, config_kw={"dense_backend": "sdpa"})(*rows, None)
        mha = build(FusedDenseAttention, groups=8)
        q, k, v, _ = _inputs(seed=1, heads=8, groups=8, dim=mha.config.kv_channels)
        mha(q[: SEQ // 2], k[: SEQ // 2], v[: SEQ // 2], None)  # ratio 1: the all-to-all
    finally:
        for n, value in zip(names, saved):
            setattr(attention, n, value)
    assert taken == ["a2a", "all_gather", "a2a", "all_gather", "a2a", "a2a"]
    # FA4 was asked about the rank's own queries, once a layer (the ranks' answers agreed).
    assert seen == [rows[0].shape] * 2
    with pytest.raises(ValueError, match=r"cp_comm_type='a2a\+p2p' is not supported.*one of"):
        build(FusedDenseAttention, cp_comm_type="a2a+p2p")
    with pytest.raises(ValueError, match=r"key/value heads \(1\) .* context_parallel_size \(2\)"):
        build(S2CoreAttention, groups=1, cp_comm_type="a2a")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_core_attention_cp2_matches_cp1(tmp_path, backend, monkeypatch):
    """S2 (backend: PyTorch reference, or the Triton kernels under the interpreter) and dense
    layers, each on both CP communications (all-gather, head all-to-all): out, dq, dk, dv of
    each rank's rows equal CP=1's to fp32 rounding. Also the cp_comm_type choices."""
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.multiprocessing.spawn(
        _worker, args=(free_port(), backend, str(tmp_path)), nprocs=2, join=True
    )
    for rank in range(2):
        errors = torch.load(tmp_path / f"rank{rank}.pt")
        for module, errs in errors.items():
            assert max(errs) < 1e-5, (rank, module, dict(zip(("out", "dq", "dk", "dv"), errs)))


def test_chunk_length_errors_name_context_parallel_size():
    from megatron_s2.context_parallel import check_context_parallel_length

    assert check_context_parallel_length("m", 64, 2, 16) == 32
    with pytest.raises(ValueError, match="context_parallel_size=2.*multiple of 2 x"):
        check_context_parallel_length("m", 63, 2)
    with pytest.raises(ValueError, match="context_parallel_size=2.*block_size \\(16\\).*= 64"):
        check_context_parallel_length("m", 40, 2, 16)


def test_config_rejects_cp_size_the_sequence_cannot_serve():
    with pytest.raises(ValueError, match="context_parallel_size=2: s2_seq_length \\(96\\)"):
        tiny_s2_config(SCHEDULE, s2_seq_length=96, context_parallel_size=2)
    tiny_s2_config(SCHEDULE, s2_seq_length=128, context_parallel_size=2)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, groups", [(16, 16), (32, 8)])
def test_gpu_rank_chunks_match_whole_sequence(heads, groups):
    """bf16 on CUDA, 8k tokens split for CP=2 and CP=4: every rank's chunks (S2: the kernels at
    q_start; dense: cuDNN parts merged by LSE, rank-level and per chunk, and FlashAttention
    varlen) equal the whole-sequence layer's rows, forward and dq; dk/dv summed over the ranks
    equal the whole layer's (what the reduce-scatter of the gather's backward computes). Also
    FlashAttention-4, one call a chunk, where it is installed."""
    from megatron_s2.context_parallel import (
        attend_rank_chunks,
        dense_causal_suffix,
        dense_rank_chunks,
    )
    from megatron_s2.flash_attention4 import fa4_unusable_reason
    from s2attn import S2Pattern, s2_attention

    dev, seq, dim = torch.device("cuda"), 8192, 128
    g = torch.Generator(device=dev).manual_seed(3)
    q = torch.randn(seq, 1, heads, dim, device=dev, generator=g, dtype=torch.bfloat16)
    kv = [
        torch.randn(seq, 1, groups, dim, device=dev, generator=g, dtype=torch.bfloat16)
        for _ in range(2)
    ]
    scale = dim**-0.5
    pattern = S2Pattern(heads, groups, block_size=64, local_blocks=16, vert_stride=8)

    def whole(kind, qq, k, v):
        if kind == "s2":
            out = s2_attention(qq.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), pattern)
            return out.transpose(0, 1).reshape(seq, 1, -1)
        qt, kt, vt = (x.permute(1, 2, 0, 3) for x in (qq, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True
        )
        return out.permute(2, 0, 1, 3).reshape(seq, 1, -1)

    def per_chunk(at):
        return lambda rows, k, v, rank, cp, chunk: attend_rank_chunks(
            rows, k, v, rank, cp, at, chunk
        )

    attend = {
        "s2": per_chunk(lambda a, b, c, start: s2_attention(a, b, c, pattern, q_start=start)),
        "cudnn": lambda *args: dense_rank_chunks(*args, scale, impl="cudnn"),
        "cudnn one stream": lambda *args: dense_rank_chunks(*args, scale, "cudnn-one-stream"),
        "cudnn per chunk": per_chunk(
            lambda a, b, c, start: dense_causal_suffix(a, b, c, scale, impl="cudnn")
        ),
        "flash": per_chunk(
            lambda a, b, c, start: dense_causal_suffix(a, b, c, scale, impl="flash")
        ),
    }
    if fa4_unusable_reason(q) is None:  # FlashAttention-4 installed: one call a chunk
        attend["fa4"] = lambda *args: dense_rank_chunks(*args, scale, impl="fa4")

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    for kind in attend:
        qq, k, v = (t.clone().requires_grad_() for t in (q, *kv))
        ref = whole(kind, qq, k, v)
        dout = torch.randn_like(ref)
        ref.backward(dout)
        for cp in (2, 4):
            kc, vc = (t.detach().clone().requires_grad_() for t in kv)
            for rank in range(cp):
                rows = _local_rows(q, rank, cp).clone().requires_grad_()
                out = attend[kind](rows, kc, vc, rank, cp, seq // (2 * cp))
                out.backward(_local_rows(dout, rank, cp))
                assert rel(out, _local_rows(ref.detach(), rank, cp)) < 2e-2, (kind, cp, rank)
                assert rel(rows.grad, _local_rows(qq.grad, rank, cp)) < 2e-2, (kind, cp, rank)
            assert rel(kc.grad, k.grad) < 2e-2, (kind, cp, "dk")
            assert rel(vc.grad, v.grad) < 2e-2, (kind, cp, "dv")


@pytest.mark.gpu
@pytest.mark.parametrize("heads, groups", [(16, 16), (32, 8)])
def test_gpu_rank_chunks_cudnn_two_streams_equal_one(heads, groups):
    """The rank-level cuDNN function with its two chunks on two CUDA streams gives what it gives
    with them one after the other, every rank of CP 2 and 4 at 16k tokens: the same bits for
    the output, dK and dV (the same calls, the dK/dV sums in the same order), and dQ to its
    run-to-run spread (cuDNN's dQ is not bitwise reproducible even on one stream: measured on
    an H100, two one-stream runs differ by up to 4.9e-4). A missing stream synchronization
    would read a buffer before it is written."""
    from megatron_s2.context_parallel import dense_rank_chunks

    dev, seq, dim = torch.device("cuda"), 16384, 128
    if torch.cuda.get_device_capability(dev) < (9, 0):
        pytest.skip("the rank-level cuDNN path needs sm_90+")
    g = torch.Generator(device=dev).manual_seed(5)
    q = torch.randn(seq, 1, heads, dim, device=dev, generator=g, dtype=torch.bfloat16)
    k, v = (
        torch.randn(seq, 1, groups, dim, device=dev, generator=g, dtype=torch.bfloat16)
        for _ in range(2)
    )
    for cp in (2, 4):
        for rank in range(cp):
            got = []
            for impl in ("cudnn", "cudnn-one-stream"):
                rows, kc, vc = (
                    t.clone().requires_grad_() for t in (_local_rows(q, rank, cp), k, v)
                )
                out = dense_rank_chunks(rows, kc, vc, rank, cp, seq // (2 * cp), dim**-0.5, impl)
                out.backward(torch.ones_like(out))
                got.append((out.detach(), rows.grad, kc.grad, vc.grad))
            (out, dq, dk, dv), (out1, dq1, dk1, dv1) = got
            for a, b, name in ((out, out1, "out"), (dk, dk1, "dk"), (dv, dv1, "dv")):
                assert torch.equal(a, b), (cp, rank, name)
            spread = float((dq.float() - dq1.float()).abs().max() / dq1.float().abs().max())
            assert spread < 1e-2, (cp, rank, spread)


@pytest.mark.gpu
def test_gpu_dense_rank_chunks_default_order(monkeypatch):
    """``impl="auto"`` takes FlashAttention-4 for bf16 where it is installed (one call a chunk,
    measured faster: docs/context_parallel.md), else the rank-level cuDNN Function on a Hopper
    GPU (faster than per-chunk calls), and the per-chunk path for fp32 (neither runs it)."""
    from megatron_s2 import context_parallel as cpmod
    from megatron_s2.flash_attention4 import fa4_import_error

    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev) < (9, 0):
        pytest.skip("cuDNN/FA4 attention paths need sm_90+")
    fa4 = fa4_import_error() is None
    calls = []
    real_cudnn, real_fa4 = cpmod._RankChunksCudnn.apply, cpmod.fa4_causal
    monkeypatch.setattr(
        cpmod._RankChunksCudnn, "apply", lambda *a: calls.append("cudnn") or real_cudnn(*a)
    )
    monkeypatch.setattr(cpmod, "fa4_causal", lambda *a: calls.append("fa4") or real_fa4(*a))
    bf16 = ["fa4", "fa4"] if fa4 else ["cudnn"]
    for dtype, expected in ((torch.bfloat16, bf16), (torch.float32, [])):
        q = torch.randn(512, 1, 4, 64, device=dev, dtype=dtype)
        kv = torch.randn(1024, 1, 2, 64, device=dev, dtype=dtype)
        calls.clear()
        out = cpmod.dense_rank_chunks(q, kv, kv, 1, 2, 256, 0.125)
        assert out.shape == (512, 1, 256) and calls == expected, dtype


@pytest.mark.gpu
@pytest.mark.parametrize("heads, groups", [(8, 8), (8, 2)])
def test_gpu_fa4_dense_layer_matches_sdpa(heads, groups):
    """Where FlashAttention-4 is installed, its causal call (``fa4_causal``, the dense layer's
    kernel under "auto") is as close to the fp32 result as SDPA's bf16 kernel, outputs and
    gradients, MHA and GQA, at an odd length. The module's routing to it is
    test_megatron_gpu.py's ``FusedDenseAttention`` check, which takes FA4 where installed."""
    from megatron_s2.flash_attention4 import fa4_causal, fa4_import_error

    if fa4_import_error() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs FlashAttention-4 (tools/stage_flash_attn4.sh) on sm_90+")
    dev, seq, dim = torch.device("cuda"), 3000, 128
    g = torch.Generator(device=dev).manual_seed(5)
    q = torch.randn(1, seq, heads, dim, device=dev, generator=g)
    k, v = (torch.randn(1, seq, groups, dim, device=dev, generator=g) for _ in range(2))
    dout = torch.randn(1, seq, heads, dim, device=dev, generator=g)
    scale = dim**-0.5

    def run(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(dout.to(dtype))
        return [out.float()] + [t.grad.float() for t in leaves]

    def sdpa(a, b, c):
        qt, kt, vt = (x.transpose(1, 2) for x in (a, b, c))
        out = torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2)

    exact = run(sdpa, torch.float32)
    got_fa4 = run(lambda a, b, c: fa4_causal(a, b, c, scale), torch.bfloat16)
    got_sdpa = run(sdpa, torch.bfloat16)
    for name, ref, a, b in zip(("out", "dq", "dk", "dv"), exact, got_fa4, got_sdpa):
        err_fa4 = float((a - ref).abs().max() / ref.abs().max())
        err_sdpa = float((b - ref).abs().max() / ref.abs().max())
        assert err_fa4 < 2 * err_sdpa + 1e-3, (name, err_fa4, err_sdpa)


def _scores(q, k, causal: bool, scale: float):
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:  # top-left, as cuDNN's is_causal
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return s


def _fake_cudnn_part(q, k, v, causal, scale):
    """cuDNN's fused attention call in float64 math: (out, lse [b, h, sq, 1], args)."""
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.exp(s - lse) @ v, lse, ("args", causal, k.shape[2])


def _fake_cudnn_part_grads(dout, q, k, v, out, lse, causal, args, scale):
    """cuDNN's backward of one call given the merged out/lse: FlashAttention's formulas."""
    assert args == ("args", causal, k.shape[2])  # the call's own saved arguments
    p = torch.exp(_scores(q, k, causal, scale) - lse)
    dp = dout @ v.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, p.transpose(-1, -2) @ dout


@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2)])
def test_rank_chunks_cudnn_bookkeeping_matches_whole_sequence(monkeypatch, heads, groups):
    """The rank-level cuDNN function's bookkeeping (GQA heads repeated once, each chunk's own
    keys causally and earlier keys in full, LSE merges written in place, dK/dV of both chunks
    in one K-sized buffer, repeated heads summed back) on the CPU, with the cuDNN calls played
    by float64 math: every rank's output and dq equal the whole causal layer's rows, and dk/dv
    summed over the ranks equal its dk/dv, for CP 2 and 4, MHA and GQA."""
    import megatron_s2.context_parallel as cpmod

    monkeypatch.setattr(cpmod, "_cudnn_part", _fake_cudnn_part)
    monkeypatch.setattr(cpmod, "_cudnn_part_grads", _fake_cudnn_part_grads)
    dim, scale = 8, 8**-0.5
    q, k, v, _ = (t.double() for t in _inputs(5, heads, groups, dim))
    dout = torch.randn(SEQ, BATCH, heads, dim, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    qt, kt, vt = (t.permute(1, 2, 0, 3) for t in leaves)
    rep = heads // groups
    kt, vt = kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1)
    whole = torch.softmax(_scores(qt, kt, True, scale), dim=-1) @ vt
    whole = whole.permute(2, 0, 1, 3)
    whole.backward(dout)
    for cp in (2, 4):
        kc, vc = (t.clone().requires_grad_(True) for t in (k, v))
        for rank in range(cp):
            rows = _local_rows(q, rank, cp).clone().requires_grad_(True)
            chunk = SEQ // (2 * cp)
            out = cpmod.dense_rank_chunks(rows, kc, vc, rank, cp, chunk, scale, impl="cudnn")
            out.backward(_local_rows(dout, rank, cp).reshape(out.shape))
            want = _local_rows(whole.detach(), rank, cp).reshape(out.shape)
            torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(rows.grad, _local_rows(leaves[0].grad, rank, cp))
        torch.testing.assert_close(kc.grad, leaves[1].grad)
        torch.testing.assert_close(vc.grad, leaves[2].grad)


def test_dense_rank_chunks_rejects_unknown_impl():
    from megatron_s2.context_parallel import dense_rank_chunks

    q = torch.zeros(4, 1, 2, 8)
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'fa4', 'cudnn', 'cudnn-"):
        dense_rank_chunks(q, q, q, 0, 2, 2, 1.0, impl="fast")


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2)])
def test_rank_chunks_match_whole_sequence_with_gradients(heads, groups, batch):
    """attend_rank_chunks with gradients (the rank-level Function that builds dQ and dK/dV in
    one buffer each: at batch 1 rank 0's later chunk's dK/dV are that buffer) in float64 on the
    CPU, for S2 (reference kernels at the chunks' absolute starts) and the per-chunk dense path,
    K/V as views of one stacked tensor as the gather gives them: every rank's output and dq
    equal the whole layer's rows and dk/dv summed over the ranks equal its dk/dv, CP 2 and 4,
    MHA and GQA; without gradients the same output; under saved-tensor hooks (non-reentrant
    checkpointing, offloading) the composed path, same gradients."""
    from megatron_s2.context_parallel import attend_rank_chunks, dense_causal_suffix
    from s2attn import S2Pattern, s2_attention

    dim, scale = 8, 8**-0.5
    q, k, v, _ = (t[:, :batch].double() for t in _inputs(7, heads, groups, dim))
    dout = torch.randn(SEQ, batch, heads, dim, dtype=torch.float64)
    pattern = S2Pattern(heads, groups, block_size=16, local_blocks=2, vert_stride=2)

    def s2(a, b, c, start):
        return s2_attention(a, b, c, pattern, q_start=start, backend="reference")

    def dense(a, b, c, start):
        return dense_causal_suffix(a, b, c, scale, impl="sdpa")

    for attend in (s2, dense):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        whole = attend(*(t.transpose(0, 1) for t in leaves), 0).transpose(0, 1)
        whole.backward(dout)
        whole = whole.detach().reshape(SEQ, batch, -1)
        for cp, hooks in ((2, False), (4, False), (2, True)):
            kv = torch.stack((k, v), dim=1).requires_grad_(True)  # [S, 2, b, ng, hn]
            chunk = SEQ // (2 * cp)
            for rank in range(cp):
                rows = _local_rows(q, rank, cp).clone().requires_grad_(True)
                with torch.autograd.graph.save_on_cpu() if hooks else contextlib.nullcontext():
                    out = attend_rank_chunks(rows, kv[:, 0], kv[:, 1], rank, cp, attend, chunk)
                out.backward(_local_rows(dout, rank, cp).reshape(out.shape))
                want = _local_rows(whole, rank, cp)
                torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
                torch.testing.assert_close(rows.grad, _local_rows(leaves[0].grad, rank, cp))
                with torch.no_grad():
                    again = attend_rank_chunks(rows, kv[:, 0], kv[:, 1], rank, cp, attend, chunk)
                torch.testing.assert_close(again, out.detach(), rtol=0, atol=0)
            torch.testing.assert_close(kv.grad[:, 0], leaves[1].grad)
            torch.testing.assert_close(kv.grad[:, 1], leaves[2].grad)


def test_rank_chunks_second_backward_is_a_clear_error():
    """The rank-level Function frees its chunks' graphs in the backward: a second backward
    (retain_graph=True) is a RuntimeError saying so, not a failure inside autograd."""
    from megatron_s2.context_parallel import attend_rank_chunks, dense_causal_suffix

    q, k, v, _ = (t.double().requires_grad_(True) for t in _inputs(3, 4, 2, 8))
    rows = _local_rows(q, 0, 2)
    out = attend_rank_chunks(
        rows, k, v, 0, 2, lambda a, b, c, s: dense_causal_suffix(a, b, c, 1.0, "sdpa"), SEQ // 4
    )
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        out.sum().backward()


def test_gather_bookkeeping_functions_gradients():
    """The K/V gather's two bookkeeping Functions (the chunk permutation, the K/V split) have
    the gradients of the indexing they replace (float64 gradcheck)."""
    from megatron_s2.context_parallel import _chunk_orders, _PermuteChunks, _SplitKV

    chunks = torch.randn(8, 3, 2, dtype=torch.float64, requires_grad=True)
    order, inverse = _chunk_orders(4, chunks.device)
    # Absolute chunk j is rank j's first chunk (2j) or rank 2cp-1-j's second (2(2cp-1-j)+1).
    assert order.tolist() == [0, 2, 4, 6, 7, 5, 3, 1]
    assert torch.equal(order[inverse], torch.arange(8))
    torch.autograd.gradcheck(lambda x: _PermuteChunks.apply(x, order, inverse), (chunks,))
    torch.testing.assert_close(_PermuteChunks.apply(chunks, order, inverse), chunks[order])
    kv = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(_SplitKV.apply, (kv,))
    torch.autograd.gradcheck(lambda x: _SplitKV.apply(x)[1], (kv,))  # dK unused: zeros


def test_rank_chunks_under_autocast_keep_the_attention_and_input_dtypes():
    """Under autocast the rank's output has the attention's dtype (bf16 here) and its
    gradients the inputs' (fp32), as the chunk calls composed by autograd give them."""
    from megatron_s2.context_parallel import attend_rank_chunks, dense_causal_suffix

    q, k, v, _ = (t.requires_grad_(True) for t in _inputs(4, 4, 2, 8))
    rows = _local_rows(q, 1, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attend_rank_chunks(
            rows, k, v, 1, 2, lambda a, b, c, s: dense_causal_suffix(a, b, c, 1.0, "sdpa"), 32
        )
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.float32
    assert q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0
