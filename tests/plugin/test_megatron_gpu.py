"""GPU checks of the Megatron integration (skipped without CUDA)."""

import pytest
import torch

from tests.helpers.megatron import import_tool

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _PG:
    class _G:
        def rank(self):
            return 0

        def size(self):
            return 1

    tp = _G()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_core_attention_modules_on_cuda_8k(dtype):
    """S2CoreAttention (Triton) vs the fp32 reference, and FusedDenseAttention vs SDPA math, at
    8k tokens in Megatron's [s, b, h, d] layout with GQA."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_s2.attention import FusedDenseAttention, S2CoreAttention
    from s2attn import S2Pattern, s2_attention_reference

    s, b, h, g, d = 8192, 1, 8, 2, 64
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=h * d,
        num_attention_heads=h,
        num_query_groups=g,
        attention_dropout=0.0,
    )
    pattern = S2Pattern(h, g, block_size=64, local_blocks=16, vert_stride=8, head_offset=1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(s, b, h, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(s, b, g, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(s, b, g, d, device="cuda", dtype=dtype, generator=gen)
    s2 = S2CoreAttention(cfg, 1, AttnMaskType.causal, "self", pattern=pattern, pg_collection=_PG())
    out = s2(q, k, v, None)
    ref = s2_attention_reference(*(x.float().transpose(0, 1) for x in (q, k, v)), pattern)
    torch.testing.assert_close(
        out.float(), ref.transpose(0, 1).reshape(s, b, h * d), atol=2e-2, rtol=2e-2
    )
    dense = FusedDenseAttention(cfg, 2, AttnMaskType.causal, "self", pg_collection=_PG())
    dense_out = dense(q, k, v, None)
    full = S2Pattern(h, g, block_size=64, local_blocks=s // 64, vert_stride=8)
    ref_dense = s2_attention_reference(*(x.float().transpose(0, 1) for x in (q, k, v)), full)
    torch.testing.assert_close(
        dense_out.float(), ref_dense.transpose(0, 1).reshape(s, b, h * d), atol=2e-2, rtol=2e-2
    )


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_parallel_equivalence_two_gpus(tmp_path):
    """TP=2+SP, PP=2, TP=2, PP=2+VPP=2 and CP=2 (and the 4-GPU layouts where 4 GPUs are
    visible) equal the single-GPU run: bf16, 2k tokens, 3 steps (tools/gpu_parallel_check.py
    runs the full 8k version)."""
    tool = import_tool()
    cc = tool.CheckConfig(seq_length=2048, steps=3)
    layouts = [x for x in tool.GPU_LAYOUTS if x.world <= torch.cuda.device_count()]
    rows = tool.run_check(cc, layouts, str(tmp_path))
    print(tool.format_table(rows))
    assert all(r["passed"] for r in rows), tool.format_table(rows)


@needs_cuda
def test_build_gpt_model_bf16_trains_on_cuda():
    """The plugin's one-call path on a GPU: S2TransformerConfig + build_gpt_model, bf16, the Triton
    kernels on S2 layers and SDPA on dense ones, RoPE, a few AdamW steps lower the loss on a
    repeated batch."""
    from megatron.core import parallel_state, tensor_parallel

    from megatron_s2 import S2TransformerConfig, build_gpt_model
    from tests.helpers.megatron import TINY_SCHEDULE, init_single_process

    init_single_process()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    seq, vocab = 2048, 512
    cfg = S2TransformerConfig(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_query_groups=2,
        ffn_hidden_size=512,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        s2_schedule=TINY_SCHEDULE,
        s2_seq_length=seq,
    )
    model = build_gpt_model(
        cfg, vocab_size=vocab, max_sequence_length=seq, position_embedding_type="rope"
    ).cuda()
    kinds = [type(layer.self_attention.core_attention).__name__ for layer in model.decoder.layers]
    assert kinds == ["S2CoreAttention", "FusedDenseAttention"] * 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    tok = torch.randint(0, vocab, (2, seq), device="cuda", generator=gen)
    pos = torch.arange(seq, device="cuda")[None].expand(2, -1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = model(tok, pos, None, labels=tok).float().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0], losses
