"""The retrieval levers on one process (CPU): numerics against independent float64 references
and the settings' checks.

* ``attention.s2.sinks``: :class:`S2CoreAttention` with sinks (the Triton kernels under the
  interpreter, and the PyTorch reference backend) against a float64 softmax with one extra logit
  per head, forward and gradients (q, k, v, sinks), GQA, a TP rank's heads, packed documents.
* ``attention.dense_layers.position_embedding`` / ``rotary_base``: the queries and keys that
  reach each layer's core attention against float64 RoPE at the layer's base (or none).
* Bad values are refused at load, naming the setting and the allowed values; a change of the
  levers between a checkpoint and a run is an attention change (noted on extension, refused on
  a resume of the run's own checkpoint).
"""

import math

import pytest
import torch

from tests.helpers.kernels import token_mask
from tests.helpers.megatron import TensorParallelGroups, init_single_process, tiny_s2_config

pytest.importorskip("megatron.core")

from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402

from megatron_s2.attention import S2CoreAttention, S2SelfAttention  # noqa: E402
from megatron_s2.schedule import AttentionSchedule, ScheduleError  # noqa: E402
from s2attn import S2Pattern  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _dist():
    # Megatron's RotaryEmbedding moves its frequencies to "the GPU" on first use: CPU mode maps
    # that to the CPU (as the trainer's CPU runs do).
    from megatron_s2.training.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    init_single_process()


# ------------------------------------------------------------------------------------ sinks
def _sink_reference(q, k, v, sinks, pattern, scale):
    """float64: ``[s, b, h, d]`` queries, ``[s, b, g, d]`` keys/values, ``[h]`` sinks: a softmax
    over the pattern's keys (every earlier key when ``pattern`` is None: a dense causal layer)
    plus one logit ``sinks[h]`` whose value vector is zero."""
    q, k, v, sinks = (x.double() for x in (q, k, v, sinks))
    s, b, h, d = q.shape
    rep = h // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    if pattern is None:
        mask = torch.ones(s, s, dtype=torch.bool).tril().expand(h, s, s)
    else:
        mask = token_mask(pattern, s, s)  # [h, s, s]
    scores = scores.masked_fill(~mask[None].to(scores.device), float("-inf"))
    sink = sinks[None, :, None, None].expand(b, h, s, 1)
    p = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("bhqk,kbhd->qbhd", p, v).reshape(s, b, h * d)


def _check_against_sink_reference(attn, pattern, seq, nh, ng, seed):
    """A core attention with sinks (``attn``, ``nh`` query heads and ``ng`` KV groups of 16 dims
    on this rank) against :func:`_sink_reference` under ``pattern`` (None: dense causal): its
    sinks set around the scores' range (so they matter), fresh random inputs of batch 2 from
    ``seed``; the output and the gradients of q, k, v and the sinks must match. Returns
    ``(out, q, k, v)`` for the caller's further checks."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(nh, generator=gen) * 2)
    q = torch.randn(seq, 2, nh, 16, generator=gen, requires_grad=True)
    k = torch.randn(seq, 2, ng, 16, generator=gen, requires_grad=True)
    v = torch.randn(seq, 2, ng, 16, generator=gen, requires_grad=True)
    dout = torch.randn(seq, 2, nh * 16, generator=gen)

    out = attn(q, k, v, None)
    ref = _sink_reference(q, k, v, attn.sinks, pattern, attn.softmax_scale)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    leaves = (q, k, v, attn.sinks)
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(ref, leaves, dout.double())
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(
            g.double(), w.double(), atol=5e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )
    return out, q, k, v


@pytest.mark.parametrize(
    "seq, heads, groups, tp_rank, tp, backend",
    [
        (64, 4, 2, 0, 1, "auto"),  # GQA, the Triton kernels (interpreted)
        (48, 4, 4, 0, 1, "auto"),  # MHA, a length that is not a power of two
        (64, 8, 2, 1, 2, "auto"),  # the second TP rank's heads of a GQA model
        (96, 8, 4, 0, 1, "reference"),
    ],
)
def test_sinks_match_float64_reference_forward_and_gradients(
    seq, heads, groups, tp_rank, tp, backend
):
    cfg = tiny_s2_config(
        {"s2": {"block_size": 16, "local_blocks": 2, "vert_stride": 2}},
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=16,
        s2_backend=backend,
        tensor_model_parallel_size=1,
    )
    pattern = S2Pattern(heads, groups, block_size=16, local_blocks=2, vert_stride=2, head_offset=1)
    attn = S2CoreAttention(
        cfg,
        1,
        AttnMaskType.causal,
        pattern=pattern,
        sinks=True,
        pg_collection=TensorParallelGroups(tp_rank, tp),
    )
    local = pattern.for_tp_rank(tp_rank, tp)
    nh, ng = local.local_num_heads, local.local_num_kv_heads
    assert attn.sinks.shape == (nh,) and attn.sinks.tensor_model_parallel
    out, q, k, v = _check_against_sink_reference(attn, local, seq, nh, ng, seq + heads + tp_rank)
    # Without sinks the same module's output differs: the sinks were applied.
    assert not torch.allclose(
        out,
        S2CoreAttention(
            cfg,
            1,
            AttnMaskType.causal,
            pattern=pattern,
            pg_collection=TensorParallelGroups(tp_rank, tp),
        )(q, k, v, None),
    )


# S2 layers that cover every key block with 4 heads (the dense layers' tests have S2 layers too).
_S2_SMALL = {"block_size": 16, "local_blocks": 2, "vert_stride": 2}


@pytest.mark.parametrize(
    "seq, heads, groups, tp_rank, tp, backend",
    [
        (64, 4, 2, 0, 1, "auto"),  # GQA, the Triton kernels (interpreted)
        (40, 4, 4, 0, 1, "auto"),  # MHA, a length that is not a multiple of the block
        (64, 8, 2, 1, 2, "auto"),  # the second TP rank's heads of a GQA model
        (80, 8, 4, 0, 1, "reference"),
    ],
)
def test_dense_layer_sinks_match_float64_reference_forward_and_gradients(
    seq, heads, groups, tp_rank, tp, backend
):
    """``attention.dense_layers.sinks``: the dense layer the schedule builds attends every
    earlier key with a sink logit per head, against an independent float64 causal softmax with
    the extra logit (forward; gradients of q, k, v and the sinks)."""
    from megatron_s2.attention import ScheduledCoreAttention

    cfg = tiny_s2_config(
        {"s2": _S2_SMALL, "dense_layers": {"pattern": "DS", "sinks": True}},
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=16,
        s2_backend=backend,
        tensor_model_parallel_size=1,
    )
    attn = ScheduledCoreAttention(
        config=cfg,
        layer_number=1,  # layer 0: dense
        attn_mask_type=AttnMaskType.causal,
        pg_collection=TensorParallelGroups(tp_rank, tp),
    )
    assert isinstance(attn, S2CoreAttention) and attn.dense_layer and attn.checkpoint_layer == 0
    nh, ng = heads // tp, max(1, groups // tp)
    assert attn.sinks.shape == (nh,) and attn.sinks.tensor_model_parallel
    assert "dense causal" in attn.extra_repr() and "sinks" in attn.extra_repr()
    out, q, k, v = _check_against_sink_reference(attn, None, seq, nh, ng, seq + heads + tp_rank + 1)
    # The same layer without the setting is the fused dense module, and its output is the
    # reference without sinks (so the sinks above were applied).
    plain_cfg = tiny_s2_config(
        {"s2": _S2_SMALL, "dense_layers": {"pattern": "DS"}},
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=16,
        tensor_model_parallel_size=1,
    )
    plain = ScheduledCoreAttention(
        config=plain_cfg,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        pg_collection=TensorParallelGroups(tp_rank, tp),
    )
    assert not isinstance(plain, S2CoreAttention)
    no_sink = _sink_reference(q, k, v, torch.full((nh,), -1e4), None, attn.softmax_scale)
    with torch.no_grad():
        torch.testing.assert_close(plain(q, k, v, None).double(), no_sink, atol=2e-5, rtol=1e-4)
        assert not torch.allclose(out.double(), no_sink, atol=1e-3)


def test_dense_layer_sinks_in_every_builder():
    """The GPT spec (every layer's module from the schedule's kinds) and S2CoreAttention built
    without a pattern give a dense layer with sinks the same module as ScheduledCoreAttention;
    the S2 layers keep theirs (sinks only with ``s2.sinks``)."""
    from megatron_s2.specs import get_s2_decoder_block_spec

    schedule = {"s2": {"block_size": 16}, "dense_layers": {"pattern": "DS", "sinks": True}}
    cfg = tiny_s2_config(schedule, num_layers=4)
    spec = get_s2_decoder_block_spec(cfg)
    built = [
        build_module(
            layer.submodules.self_attention.submodules.core_attention,
            config=cfg,
            layer_number=i + 1,
            attn_mask_type=AttnMaskType.causal,
        )
        for i, layer in enumerate(spec.layer_specs)
    ]
    assert [type(m).__name__ for m in built] == ["S2CoreAttention"] * 4
    assert [m.dense_layer for m in built] == [True, False, True, False]
    assert [m.sinks is not None for m in built] == [True, False, True, False]
    assert [m.checkpoint_layer for m in built] == [0, 1, 2, 3]
    dense = built[0].global_pattern
    assert dense.vert_stride == 1 and dense.block_size == 16
    direct = S2CoreAttention(cfg, 3, AttnMaskType.causal)
    assert direct.dense_layer and direct.sinks is not None
    assert direct.global_pattern.settings() == dense.settings()


def test_sinks_on_packed_documents_equal_each_document_alone():
    from megatron.core.packed_seq_params import PackedSeqParams

    cfg = tiny_s2_config(
        {"s2": {"block_size": 16, "local_blocks": 2, "vert_stride": 2, "sinks": True}},
        s2_backend="reference",
    )
    attn = S2CoreAttention(cfg, 1, AttnMaskType.causal)
    assert attn.sinks is not None  # from the schedule
    with torch.no_grad():
        attn.sinks.copy_(torch.linspace(-2, 2, 8))
    gen = torch.Generator().manual_seed(5)
    lengths = [40, 7, 49]
    t = sum(lengths)
    q, k, v = (torch.randn(t, n, 16, generator=gen) for n in (8, 4, 4))
    cu = torch.tensor([0, 40, 47, 96], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=49)
    packed = attn(q, k, v, None, packed_seq_params=psp)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = attn(q[a:b, None], k[a:b, None], v[a:b, None], None)
        torch.testing.assert_close(packed[a:b], alone[:, 0], atol=1e-5, rtol=1e-5)


def test_sinks_start_near_no_sinks():
    """SINK_INIT: with the near-zero scores of an untrained model, a row of n keys keeps
    n / (n + 1) of its output."""
    cfg = tiny_s2_config(
        {"s2": {"block_size": 16, "local_blocks": 2, "vert_stride": 2, "sinks": True}},
        s2_backend="reference",
    )
    attn = S2CoreAttention(cfg, 1, AttnMaskType.causal)
    plain = S2CoreAttention(cfg, 1, AttnMaskType.causal, sinks=False, pattern=attn.global_pattern)
    assert torch.all(attn.sinks == 0)
    q = torch.zeros(64, 1, 8, 16)  # equal scores: row i attends n_i keys with weight 1 / n_i
    v = torch.randn(64, 1, 4, 16)
    ratio = attn(q, v, v, None) / plain(q, v, v, None)
    mask = token_mask(attn.pattern, 64, 64)
    n = mask.sum(-1).T.double()  # [s, h]
    want = (n / (n + 1))[:, None, :, None].expand(64, 1, 8, 16).reshape(64, 1, 128)
    torch.testing.assert_close(ratio.double(), want, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------- position encodings
def _rope64(x, base, rotary_dim=None):
    """float64 RoPE (Megatron's non-interleaved layout) of ``x [s, b, h, d]`` at positions
    0 .. s-1 on the first ``rotary_dim`` channels."""
    x = x.double()
    d = x.shape[-1] if rotary_dim is None else rotary_dim
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv[None]
    cos, sin = ang.cos()[:, None, None], ang.sin()[:, None, None]
    x1, x2, rest = x[..., : d // 2], x[..., d // 2 : d], x[..., d:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def _layer_qk(schedule, layer_number, rotary=None, rotary_percent=1.0, model_base=10000.0):
    """The layer's (raw q, raw k, q and k at its core attention) for random hidden states, fed
    the model's rotary embedding at ``model_base``."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_s2.specs import get_s2_decoder_block_spec

    cfg = tiny_s2_config(schedule, s2_backend="reference")
    spec = get_s2_decoder_block_spec(cfg, rotary=rotary).layer_specs[layer_number - 1]
    attn = build_module(spec.submodules.self_attention, config=cfg, layer_number=layer_number)
    assert isinstance(attn, S2SelfAttention)
    seen = {}

    def grab(module, args):
        seen["q"], seen["k"] = args[0].detach(), args[1].detach()

    attn.core_attention.register_forward_pre_hook(grab)
    hidden = torch.randn(64, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    emb = RotaryEmbedding(16, rotary_percent, rotary_base=model_base, use_cpu_initialization=True)(
        64
    )
    with torch.no_grad():
        q, k, _ = attn.get_query_key_value_tensors(hidden)
        attn(hidden, None, rotary_pos_emb=emb)
    return q, k, seen["q"], seen["k"]


_SD = {"s2": {"block_size": 16, "local_blocks": 2, "vert_stride": 2}}


@pytest.mark.parametrize(
    "dense, layer, expect_base",
    [
        ({"pattern": "SD"}, 2, 10000.0),  # default: the model's RoPE everywhere
        ({"pattern": "SD", "position_embedding": "nope"}, 2, None),
        ({"pattern": "SD", "position_embedding": "nope"}, 1, 10000.0),  # S2 layers keep RoPE
        ({"pattern": "SD", "rotary_base": 5.0e6}, 2, 5.0e6),
        ({"pattern": "SD", "rotary_base": 5.0e6}, 3, 10000.0),
        ({"pattern": "D", "rotary_base": 1234.5}, 1, 1234.5),  # all dense
    ],
)
def test_layer_position_encoding_matches_float64_rope(dense, layer, expect_base):
    q, k, q_at, k_at = _layer_qk(_SD | {"dense_layers": dense}, layer)
    for raw, at in ((q, q_at), (k, k_at)):
        want = raw.double() if expect_base is None else _rope64(raw, expect_base)
        torch.testing.assert_close(at.double(), want, atol=2e-5, rtol=1e-5)


def test_dense_rotary_base_follows_the_models_rotary_percent():
    schedule = _SD | {"dense_layers": {"pattern": "SD", "rotary_base": 5.0e5}}
    q, _, q_at, _ = _layer_qk(schedule, 2, rotary={"rotary_percent": 0.5}, rotary_percent=0.5)
    torch.testing.assert_close(q_at.double(), _rope64(q, 5.0e5, rotary_dim=8), atol=2e-5, rtol=1e-5)
    # A layer built without the model's options would rotate another number of channels.
    with pytest.raises(ValueError, match="attention.dense_layers.rotary_base.*build_gpt_model"):
        _layer_qk(schedule, 2, rotary=None, rotary_percent=0.5)


def test_gpt_model_levers_wired_and_refused_without_rope():
    from megatron_s2.model import build_gpt_model

    schedule = _SD | {
        "dense_layers": {"pattern": "SD", "position_embedding": "nope"},
        "s2": _SD["s2"] | {"sinks": True},
    }
    cfg = tiny_s2_config(schedule, s2_backend="reference", s2_seq_length=64)
    model = build_gpt_model(cfg, 128, 64, position_embedding_type="rope")
    kinds = [
        (
            layer.self_attention.position_embedding,
            getattr(layer.self_attention.core_attention, "sinks", None) is not None,
        )
        for layer in model.decoder.layers
    ]
    assert kinds == [("rope", True), ("nope", False)] * 2
    assert sum(n.endswith(".sinks") for n, _ in model.named_parameters()) == 2
    tokens = torch.randint(0, 128, (2, 64))
    loss = model(tokens, torch.arange(64)[None].expand(2, 64), None, labels=tokens).mean()
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n.endswith(".sinks"))
    with pytest.raises(ValueError, match="position_embedding_type is 'learned_absolute'"):
        build_gpt_model(cfg, 128, 64)


@pytest.mark.parametrize("dense", [{"position_embedding": "nope"}, {"rotary_base": 3.0e5}])
def test_gpt_model_levers_on_packed_documents_equal_each_document_alone(dense):
    """Megatron's THD path (RoPE restarting per document) with the dense layers' own RoPE
    choice and sinks: each packed document gets the logits of running it alone."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_s2.model import build_gpt_model

    schedule = {"s2": _SD["s2"] | {"sinks": True}, "dense_layers": {"pattern": "SD", **dense}}
    cfg = tiny_s2_config(schedule, s2_backend="reference", s2_seq_length=128)
    model = build_gpt_model(cfg, 128, 128, position_embedding_type="rope").eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".sinks"):
                p.uniform_(-1, 1)
    gen = torch.Generator().manual_seed(4)
    lengths = [45, 3, 80]
    docs = [torch.randint(0, 128, (1, n), generator=gen) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 45, 48, 128], dtype=torch.int32)
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=80, max_seqlen_kv=80
    )
    with torch.no_grad():
        packed = model(torch.cat(docs, dim=1), positions, None, packed_seq_params=psp)
        for doc, a, b in zip(docs, cu[:-1].tolist(), cu[1:].tolist()):
            alone = model(doc, torch.arange(b - a)[None], None)
            torch.testing.assert_close(packed[:, a:b], alone, atol=1e-5, rtol=1e-5)


def test_sinks_gradients_under_selective_recomputation():
    """Megatron recomputes core attention in the backward (model.recompute: selective): the
    sinks' gradients are those of the plain backward."""
    from megatron_s2.model import build_gpt_model

    schedule = {"s2": _SD["s2"] | {"sinks": True}, "dense_layers": {"pattern": "SD"}}
    cfg = tiny_s2_config(schedule, s2_backend="reference", s2_seq_length=64)
    model = build_gpt_model(cfg, 128, 64, position_embedding_type="rope")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".sinks"):
                p.uniform_(-1, 1)
    tokens = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(64)[None].expand(2, 64)

    def sink_grads():
        model.zero_grad()
        model(tokens, positions, None, labels=tokens).mean().backward()
        return [p.grad.clone() for n, p in model.named_parameters() if n.endswith(".sinks")]

    plain = sink_grads()
    for layer in model.decoder.layers:
        layer.self_attention.checkpoint_core_attention = True
    recomputed = sink_grads()
    assert len(plain) == 2 and all(g.abs().sum() > 0 for g in plain)
    for a, b in zip(plain, recomputed):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_levers_refuse_megatrons_precomputed_rope():
    schedule = _SD | {"dense_layers": {"pattern": "SD", "position_embedding": "nope"}}
    cfg = tiny_s2_config(schedule, s2_backend="reference")
    from megatron_s2.specs import get_s2_decoder_block_spec

    spec = get_s2_decoder_block_spec(cfg).layer_specs[1].submodules.self_attention
    attn = build_module(spec, config=cfg, layer_number=2)
    hidden = torch.randn(16, 1, cfg.hidden_size)
    with pytest.raises(ValueError, match="rotary_pos_cos.*flash decoding"):
        attn(hidden, None, rotary_pos_cos=torch.ones(16, 8), rotary_pos_sin=torch.ones(16, 8))


# --------------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    "attention, match",
    [
        (
            {"dense_layers": {"pattern": "SD", "position_embedding": "alibi"}},
            r"attention.dense_layers.position_embedding must be one of rope, nope",
        ),
        (
            {"dense_layers": {"pattern": "SD", "rotary_base": -5}},
            r"attention.dense_layers.rotary_base must be a number > 0",
        ),
        (
            {"dense_layers": {"pattern": "SD", "rotary_base": "1e6"}},
            r"attention.dense_layers.rotary_base must be a number > 0",
        ),
        (
            {"dense_layers": {"pattern": "SD", "rotary_base": True}},
            r"attention.dense_layers.rotary_base must be a number > 0",
        ),
        (
            {"dense_layers": {"pattern": "SD", "position_embedding": "nope", "rotary_base": 1e6}},
            r"rotary_base \(1000000.0\) needs attention.dense_layers.position_embedding: rope",
        ),
        (
            {"dense_layers": {"pattern": "SD", "rope": "nope"}},
            r"unknown key attention.dense_layers.rope; allowed keys: pattern, indices, "
            r"position_embedding, rotary_base, sinks",
        ),
        ({"s2": {"sinks": "yes"}}, r"attention.s2.sinks must be true or false, got 'yes'"),
        ({"overrides": {1: {"sinks": True}}}, r"attention.overrides.1: sinks is set for every S2"),
        (
            {"dense_layers": {"position_embedding": "nope"}},
            r"apply to dense layers, and this schedule has none",
        ),
        (
            {"s2": {"sinks": True}, "dense_layers": {"pattern": "D"}},
            r"attention.s2.sinks applies to S2 layers",
        ),
        (
            {"dense_layers": {"pattern": "SD", "sinks": 1}},
            r"attention.dense_layers.sinks must be true or false, got 1",
        ),
        (
            {"dense_layers": {"sinks": True}},
            r"attention.dense_layers.sinks applies to dense layers, and this schedule has none",
        ),
    ],
)
def test_bad_lever_settings_are_refused_at_load(attention, match):
    from megatron_s2.training.run_config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match=match):
        cfg = RunConfig.from_dict({"data": {"demo": True}, "attention": attention})
        cfg.schedule()


@pytest.mark.parametrize("kernel", ["fa4", "sdpa"])
def test_dense_sinks_refuse_an_explicit_dense_kernel(kernel):
    """The dense layers with sinks run s2attn's kernel; an explicit model.dense_attention would
    be ignored, so the pair is refused naming both settings (``auto`` is fine)."""
    from megatron_s2.training.run_config import ConfigError, RunConfig

    attention = {"dense_layers": {"pattern": "SD", "sinks": True}}
    with pytest.raises(ConfigError, match=rf"model.dense_attention={kernel} .*dense_layers.sinks"):
        RunConfig.from_dict(
            {"data": {"demo": True}, "attention": attention, "model": {"dense_attention": kernel}}
        ).schedule()
    RunConfig.from_dict({"data": {"demo": True}, "attention": attention}).schedule()


def test_levers_in_the_schedule_table():
    sched = AttentionSchedule.from_dict(
        {
            "s2": {"block_size": 16, "sinks": True},
            "dense_layers": {"pattern": "SD", "rotary_base": 5e6},
        }
    )
    table = sched.summary(4, 8, 4, 256).splitlines()
    assert table[-2] == (
        "levers: RoPE base 5e+06 on the dense layers (S2 layers: the model's); learned attention "
        "sinks on the S2 layers"
    )
    assert "levers" not in AttentionSchedule.from_dict({"s2": {"block_size": 16}}).summary(4, 8)
    with pytest.raises(
        ScheduleError, match=r"unknown key attention.s2.sink; allowed keys: .*sinks"
    ):
        AttentionSchedule.from_dict({"s2": {"sink": True}})


def test_levers_round_trip_and_describe_layers():
    d = {
        "s2": {"block_size": 16, "sinks": True},
        "dense_layers": {"pattern": "SD", "position_embedding": "rope", "rotary_base": 5e6},
    }
    sched = AttentionSchedule.from_dict(d)
    assert AttentionSchedule.from_dict(sched.to_dict()).to_dict() == sched.to_dict()
    assert sched.layer_position(0, 4) == ("rope", None)
    assert sched.layer_position(1, 4) == ("rope", 5e6)
    assert sched.layer_description(0, 4)["sinks"] is True
    assert sched.layer_description(1, 4) == {
        "kind": "dense",
        "position_embedding": "rope",
        "rotary_base": 5e6,
        "sinks": False,
    }
    both = AttentionSchedule.from_dict(d | {"dense_layers": d["dense_layers"] | {"sinks": True}})
    assert both.to_dict()["dense_layers"]["sinks"] is True
    assert AttentionSchedule.from_dict(both.to_dict()).to_dict() == both.to_dict()
    assert both.layer_description(1, 4)["sinks"] is True
    assert both.describe_levers().endswith(
        "learned attention sinks on the S2 layers; learned attention sinks on the dense layers"
    )
    assert both.levers_set()[-1] == "attention.dense_layers.sinks: true"
    # The dense layers with sinks run in the s2 section's blocks: a length rule like an S2
    # layer's, also for an all-dense model.
    twin = AttentionSchedule.from_dict(
        {"s2": {"block_size": 32}, "dense_layers": {"pattern": "D", "sinks": True}}
    )
    assert twin.block_sizes(4) == [32]
    assert AttentionSchedule.from_dict({"dense_layers": {"pattern": "D"}}).block_sizes(4) == []
    with pytest.raises(
        ScheduleError,
        match=r"attention.s2.block_size \(32\) must divide the sequence length \(100\)",
    ):
        twin.validate(4, 8, 4, seq_length=100)
    with pytest.raises(ScheduleError):
        AttentionSchedule.from_dict({"dense_layers": {"position_embedding": None}})


@pytest.mark.parametrize(
    "change",
    [
        {"dense_layers": {"pattern": "SD", "position_embedding": "nope"}},
        {"dense_layers": {"pattern": "SD", "rotary_base": 1e6}},
        {"dense_layers": {"pattern": "SD"}, "s2": {"sinks": True}},
        {"dense_layers": {"pattern": "SD", "sinks": True}},
    ],
)
def test_lever_change_is_an_extension_change_not_a_resume(change):
    """Like model.rotary_base: noted (and applied) when a run starts from another run's
    weights (checkpoint.load_dir), refused when a run resumes its own checkpoint."""
    from megatron_s2.training.run_config import RunConfig, resume_changes

    saved = RunConfig.from_dict(
        {"data": {"demo": True}, "attention": {"dense_layers": {"pattern": "SD"}}}
    ).to_dict()
    cfg = RunConfig.from_dict({"data": {"demo": True}, "attention": change})
    noted = resume_changes(saved, cfg, own=False)
    assert noted.noted and not noted.refused
    assert all(c.key.startswith("attention") for c in noted.noted)
    own = resume_changes(saved, cfg, own=True)
    assert own.refused and not own.noted
    same = resume_changes(
        saved,
        RunConfig.from_dict({"data": {"demo": True}, "attention": saved["attention"]}),
        own=True,
    )
    assert not same.refused


def test_softmax_scale_unchanged_by_sinks():
    cfg = tiny_s2_config(
        {"s2": {"block_size": 16, "local_blocks": 2, "vert_stride": 2, "sinks": True}},
        s2_backend="reference",
    )
    assert S2CoreAttention(cfg, 1, AttnMaskType.causal).softmax_scale == 1 / math.sqrt(16)


def test_levers_are_study_axes():
    """megatron-s2-sweep checks a study's axes against the schedule's keys before any run."""
    from megatron_s2.training.sweep import StudyError, check_config_key

    for key in (
        "attention.s2.sinks",
        "attention.dense_layers.position_embedding",
        "attention.dense_layers.rotary_base",
        "attention.dense_layers.sinks",
    ):
        check_config_key(key, "study")
    with pytest.raises(StudyError, match="allowed there: .*sinks"):
        check_config_key("attention.s2.sink", "study")
    with pytest.raises(StudyError, match="allowed there: .*vert_stride"):
        check_config_key("attention.overrides.1.sinks", "study")


@pytest.mark.parametrize("dense", [True, False])
def test_attention_probe_counts_the_sink_in_its_weights(dense):
    """The attention probe recomputes a layer's weights for one query row; with learned sinks
    (dense or S2 layers) the sink's logit takes its share, and the weights times V still give
    the layer's output (``max_output_error``), which they do not without the sink. A dense layer
    with sinks is reported as dense."""
    from megatron_s2.attention import ScheduledCoreAttention
    from megatron_s2.training.evaluation.attention_probe import _Capture, _is_s2, needle_weights

    schedule = {"s2": _S2_SMALL, "dense_layers": {"pattern": "DS"}}
    schedule["dense_layers" if dense else "s2"] = schedule["dense_layers" if dense else "s2"] | {
        "sinks": True
    }
    cfg = tiny_s2_config(schedule, s2_backend="reference")
    layer = 1 if dense else 2
    attn = ScheduledCoreAttention(
        config=cfg, layer_number=layer, attn_mask_type=AttnMaskType.causal
    )
    assert attn.sinks is not None and _is_s2(attn) is not dense
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(attn.sinks.shape[0], generator=gen) * 2)
    q, k, v = (torch.randn(96, 1, n, 16, generator=gen) for n in (8, 4, 4))
    with _Capture([(layer - 1, attn)], row=90, span=slice(3, 9)) as cap:
        attn(q, k, v, None)
    assert cap.output_error < 1e-6, cap.output_error
    assert cap.mass[layer - 1].shape == (8,) and bool((cap.mass[layer - 1] >= 0).all())
    # Without the sink in the weights the same row's output is not reproduced.
    pattern = attn.pattern if not dense else None
    plain = needle_weights(q[:, 0], k[:, 0], 90, attn.softmax_scale, pattern)
    with_sink = needle_weights(q[:, 0], k[:, 0], 90, attn.softmax_scale, pattern, attn.sinks)
    got = attn(q, k, v, None)[90, 0].double().view(8, 16)
    vv = v[:91, 0].double().repeat_interleave(2, dim=1)
    for w, close in ((with_sink, True), (plain, False)):
        err = (torch.einsum("hk,khd->hd", w, vv) - got).abs().max()
        assert bool(err < 1e-5) is close, (close, float(err))
