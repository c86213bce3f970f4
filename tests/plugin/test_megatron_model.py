"""Single-process Megatron integration: module contracts, specs, model building (CPU, gloo)."""

import os

import pytest
import torch

from tests.helpers.megatron import (
    REPO,
    TINY_SCHEDULE,
    TensorParallelGroups,
    init_single_process,
    tiny_config,
    tiny_s2_config,
)

pytest.importorskip("megatron.core")

from megatron.core.transformer.enums import AttnMaskType  # noqa: E402

from megatron_s2.attention import (  # noqa: E402
    FusedDenseAttention,
    S2CoreAttention,
    ScheduledCoreAttention,
)
from megatron_s2.config import S2TransformerConfig  # noqa: E402
from megatron_s2.schedule import SCHEDULE_ENV_VAR, AttentionSchedule, ScheduleError  # noqa: E402
from s2attn import S2Pattern, s2_attention_reference  # noqa: E402

SEQ, VOCAB = 128, 128


@pytest.fixture(scope="module", autouse=True)
def _dist():
    init_single_process()


def _qkv(s=SEQ, b=2, h=8, g=4, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, h, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(s, b, g, d, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(s, b, g, d, generator=gen, dtype=torch.float64, requires_grad=True)
    return q, k, v


def _naive_causal(q, k, v, scale):
    """[s, b, h, d] GQA causal attention, the slow obvious way."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    o = torch.einsum("bhqk,kbhd->qbhd", p, v)
    return o.reshape(q.shape[0], q.shape[1], -1)


def _build(schedule, backend="reference", **cfg_kw):
    """A tiny GPTModel. ``backend`` of the S2 layers: "reference" (fast on CPU) or "auto" (the
    Triton kernels, under the interpreter in this test session)."""
    from megatron_s2.model import build_gpt_model

    cfg = tiny_s2_config(schedule, s2_backend=backend, s2_seq_length=SEQ, **cfg_kw)
    return build_gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=SEQ)


def _fwd_bwd(model, seq=SEQ):
    gen = torch.Generator().manual_seed(1)
    tok = torch.randint(0, VOCAB, (2, seq), generator=gen)
    pos = torch.arange(seq)[None].expand(2, -1)
    loss = model(tok, pos, None, labels=tok).mean()
    loss.backward()
    assert torch.isfinite(loss)
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    return float(loss)


def _core_kinds(model):
    return [
        (type(layer.self_attention.core_attention).__name__, layer.layer_number)
        for layer in model.decoder.layers
    ]


# ---------------------------------------------------------------------- core attention contract
def test_s2_core_attention_matches_reference_and_shapes():
    cfg = tiny_config()
    pattern = S2Pattern(8, 4, block_size=16, local_blocks=2, vert_stride=4, head_offset=1)
    mod = S2CoreAttention(
        cfg,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        pattern=pattern,
        pg_collection=TensorParallelGroups(0, 1),
    )
    q, k, v = _qkv()
    out = mod(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    assert out.shape == (SEQ, 2, 128)
    ref = s2_attention_reference(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), pattern)
    torch.testing.assert_close(out, ref.transpose(0, 1).reshape(SEQ, 2, 128))
    out.sum().backward()
    assert q.grad is not None and k.grad.shape == k.shape


def test_s2_core_attention_tp_ranks_compute_their_rows_of_the_full_pattern():
    """Each TP rank's output equals its heads' slice of the full model's output; phases use
    global head indices (vert_stride 8 = heads, so every head has its own phase)."""
    cfg = tiny_config()
    pattern = S2Pattern(
        8, 4, block_size=16, local_blocks=2, vert_stride=8, head_offset=1, num_dense_heads=2
    )
    q, k, v = _qkv()
    full = S2CoreAttention(
        cfg,
        1,
        AttnMaskType.causal,
        "self",
        pattern=pattern,
        pg_collection=TensorParallelGroups(0, 1),
    )(q, k, v, None)
    parts = []
    for r in range(2):
        mod = S2CoreAttention(
            cfg,
            1,
            AttnMaskType.causal,
            "self",
            pattern=pattern,
            pg_collection=TensorParallelGroups(r, 2),
        )
        assert (mod.pattern.head_start, mod.pattern.head_end) == (4 * r, 4 * r + 4)
        parts.append(
            mod(
                q[:, :, 4 * r : 4 * r + 4],
                k[:, :, 2 * r : 2 * r + 2],
                v[:, :, 2 * r : 2 * r + 2],
                None,
            )
        )
    torch.testing.assert_close(torch.cat(parts, dim=-1), full)
    # Local head indices would give a different answer for rank 1.
    local_pattern = S2Pattern(
        4, 2, block_size=16, local_blocks=2, vert_stride=8, head_offset=1, num_dense_heads=1
    )
    wrong = s2_attention_reference(
        q[:, :, 4:].transpose(0, 1),
        k[:, :, 2:].transpose(0, 1),
        v[:, :, 2:].transpose(0, 1),
        local_pattern,
    )
    wrong = wrong.transpose(0, 1).reshape(parts[1].shape)
    assert not torch.allclose(wrong, parts[1])


def test_s2_layer_follows_global_layer_number():
    cfg = tiny_s2_config(TINY_SCHEDULE)
    m3 = S2CoreAttention(
        cfg, 3, AttnMaskType.causal, "self", pg_collection=TensorParallelGroups(0, 1)
    )
    assert (m3.pattern.vert_stride, m3.pattern.num_dense_heads) == (4, 2)  # override of 0-based 2
    with pytest.raises(ValueError, match="layer 2 is dense"):
        S2CoreAttention(
            cfg, 2, AttnMaskType.causal, "self", pg_collection=TensorParallelGroups(0, 1)
        )


def test_s2_with_full_window_is_dense_causal():
    """An S2 pattern whose local window spans the sequence is dense causal attention; so is the
    fused dense module."""
    cfg = tiny_config()
    q, k, v = (x.float().detach() for x in _qkv())
    expect = _naive_causal(q, k, v, 16**-0.5)
    s2 = S2CoreAttention(
        cfg,
        1,
        AttnMaskType.causal,
        "self",
        pg_collection=TensorParallelGroups(0, 1),
        pattern=S2Pattern(8, 4, block_size=16, local_blocks=SEQ // 16, vert_stride=4),
    )
    dense = FusedDenseAttention(
        cfg, 1, AttnMaskType.causal, "self", pg_collection=TensorParallelGroups(0, 1)
    )
    torch.testing.assert_close(s2(q, k, v, None), expect, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense(q, k, v, None), expect, atol=1e-5, rtol=1e-5)


def test_fused_dense_attention_gqa_and_scale():
    cfg = tiny_config()
    q, k, v = _qkv()
    mod = FusedDenseAttention(
        cfg,
        2,
        AttnMaskType.causal,
        "self",
        softmax_scale=0.2,
        pg_collection=TensorParallelGroups(0, 1),
    )
    torch.testing.assert_close(mod(q, k, v, None), _naive_causal(q, k, v, 0.2))


@pytest.mark.parametrize("cls", [S2CoreAttention, FusedDenseAttention])
@pytest.mark.parametrize(
    "cfg_kw, ctor_kw, match",
    [
        (
            {},
            {"attn_mask_type": AttnMaskType.padding},
            "attn_mask_type must be AttnMaskType.causal",
        ),
        ({}, {"attention_type": "cross"}, "attention_type must be 'self'"),
        (
            {"context_parallel_size": 2},
            {},
            "context_parallel_size=2 but the context-parallel process group has",
        ),
        ({"window_size": (32, 0)}, {}, "window_size"),
        ({}, {"k_channels": 32, "v_channels": 16}, "multi-latent"),
    ],
)
def test_unsupported_configurations_fail_at_construction(cls, cfg_kw, ctor_kw, match):
    cfg = tiny_config()
    for key, val in cfg_kw.items():  # set after __post_init__: some need other parallel settings
        setattr(cfg, key, val)
    kw = dict(
        config=cfg,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        pg_collection=TensorParallelGroups(0, 1),
    )
    if cls is S2CoreAttention:
        kw["pattern"] = S2Pattern(8, 4, block_size=16, local_blocks=2, vert_stride=4)
    kw.update(ctor_kw)
    with pytest.raises(ValueError, match=match):
        cls(**kw)


def test_dense_backend_on_cpu(monkeypatch):
    """The dense layer's backend: "auto" and "sdpa" run SDPA on the CPU (FlashAttention-4 has no
    CPU kernels); "fa4" is refused at construction where FA4 does not import, and at forward
    where it cannot run the call (CPU tensors), naming why."""
    import megatron_s2.attention as att
    import megatron_s2.flash_attention4 as fa4mod

    q, k, v = _qkv()
    for backend in ("auto", "sdpa"):
        cfg = tiny_config(config_class=S2TransformerConfig, s2_schedule={}, dense_backend=backend)
        mod = FusedDenseAttention(
            cfg, 2, AttnMaskType.causal, "self", pg_collection=TensorParallelGroups(0, 1)
        )
        assert f"backend {backend}" in repr(mod)
        torch.testing.assert_close(mod(q, k, v, None), _naive_causal(q, k, v, 16**-0.5))
    monkeypatch.setattr(fa4mod, "fa4_import_error", lambda: "flash_attn.cute does not import")
    with pytest.raises(ValueError, match="needs FlashAttention-4.*pip install flash-attn-4"):
        tiny_config(config_class=S2TransformerConfig, s2_schedule={}, dense_backend="fa4")
    monkeypatch.setattr(fa4mod, "fa4_import_error", lambda: None)
    cfg = tiny_config(config_class=S2TransformerConfig, s2_schedule={}, dense_backend="fa4")
    mod = FusedDenseAttention(
        cfg, 2, AttnMaskType.causal, "self", pg_collection=TensorParallelGroups(0, 1)
    )
    with pytest.raises(ValueError, match="dense_backend='fa4': FlashAttention-4 needs CUDA"):
        mod(q, k, v, None)
    assert not att.use_fa4("sdpa", q) and not att.use_fa4("auto", q)


def test_s2_rejects_dropout_dense_accepts_it():
    cfg = tiny_config(attention_dropout=0.1)
    pattern = S2Pattern(8, 4, block_size=16, local_blocks=2, vert_stride=4)
    with pytest.raises(
        ValueError, match=r"attention_dropout=0.0 \(Megatron-LM: --attention-dropout 0.0\)"
    ):
        S2CoreAttention(
            cfg,
            1,
            AttnMaskType.causal,
            "self",
            pattern=pattern,
            pg_collection=TensorParallelGroups(0, 1),
        )
    FusedDenseAttention(
        cfg, 1, AttnMaskType.causal, "self", pg_collection=TensorParallelGroups(0, 1)
    )


def test_forward_rejects_bias_masks_and_bad_packing():
    from megatron.core.packed_seq_params import PackedSeqParams

    cfg = tiny_config()
    mod = S2CoreAttention(
        cfg,
        1,
        AttnMaskType.causal,
        "self",
        pg_collection=TensorParallelGroups(0, 1),
        pattern=S2Pattern(8, 4, block_size=16, local_blocks=2, vert_stride=4),
    )
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="attention_bias"):
        mod(q, k, v, None, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="AttnMaskType.causal"):
        mod(q, k, v, None, attn_mask_type=AttnMaskType.no_mask)
    t = q[:, 0]
    cu = torch.tensor([0, 50, SEQ], dtype=torch.int32)
    with pytest.raises(ValueError, match="qkv_format must be 'thd'"):
        mod(t, k[:, 0], v[:, 0], None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_kv differ"):
        bad = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=torch.tensor([0, 60, SEQ])
        )
        mod(t, k[:, 0], v[:, 0], None, packed_seq_params=bad)
    with pytest.raises(ValueError, match="padded THD documents"):
        padded = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=torch.tensor([0, 64, SEQ], dtype=torch.int32),
        )
        mod(t, k[:, 0], v[:, 0], None, packed_seq_params=padded)


@pytest.mark.parametrize("cls", [S2CoreAttention, FusedDenseAttention])
def test_packed_documents_equal_each_document_alone(cls):
    """THD core attention (Megatron's [t, heads, hn] with cu_seqlens) equals running every
    document on its own, outputs and gradients: nothing crosses documents and the pattern
    restarts at each document's first token."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cfg = tiny_config()
    kw = dict(pg_collection=TensorParallelGroups(0, 1))
    if cls is S2CoreAttention:
        kw["pattern"] = S2Pattern(8, 4, block_size=16, local_blocks=2, vert_stride=4)
    mod = cls(cfg, 1, AttnMaskType.causal, "self", **kw)
    lengths = [37, 1, 0, 70, 20]
    q, k, v = (x[: sum(lengths), 0].detach().requires_grad_() for x in _qkv())
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=70)
    out = mod(q, k, v, None, packed_seq_params=psp)
    assert out.shape == (sum(lengths), 8 * 16)
    grad = torch.randn_like(out)
    out.backward(grad)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if a == b:
            continue
        qd, kd, vd = (x.detach()[a:b, None].requires_grad_() for x in (q, k, v))
        alone = mod(qd, kd, vd, None)[:, 0]
        torch.testing.assert_close(out[a:b], alone)
        alone.backward(grad[a:b])
        for packed, single in ((q, qd), (k, kd), (v, vd)):
            torch.testing.assert_close(packed.grad[a:b], single.grad[:, 0])


def test_gpt_model_with_packed_documents_equals_separate_documents():
    """Megatron's THD path end to end: a hybrid GPTModel fed documents packed into one row with
    positions restarting per document gives each document's logits of running it alone."""
    from megatron.core.packed_seq_params import PackedSeqParams

    model = _build(TINY_SCHEDULE, backend="reference")
    model.eval()
    lengths = [45, 3, 80]
    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, VOCAB, (1, n), generator=gen) for n in lengths]
    tokens = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 45, 48, 128], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=80)
    with torch.no_grad():
        packed = model(tokens, positions, None, packed_seq_params=psp)
        for doc, a, b in zip(docs, cu[:-1].tolist(), cu[1:].tolist()):
            alone = model(doc, torch.arange(b - a)[None], None)
            torch.testing.assert_close(packed[:, a:b], alone, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- models
@pytest.mark.parametrize(
    "schedule, kinds, backend",
    [
        (TINY_SCHEDULE, ["S2CoreAttention", "FusedDenseAttention"] * 2, "auto"),
        (
            {"s2": {"block_size": 16, "local_blocks": 2, "vert_stride": 4}},
            ["S2CoreAttention"] * 4,
            "reference",
        ),
        ({"dense_layers": {"pattern": "D"}}, ["FusedDenseAttention"] * 4, "reference"),
    ],
)
def test_build_gpt_model_per_layer_modules_and_train_step(schedule, kinds, backend):
    model = _build(schedule, backend=backend)
    assert [k for k, _ in _core_kinds(model)] == kinds
    assert [n for _, n in _core_kinds(model)] == [1, 2, 3, 4]
    assert model.config.s2_schedule is not None
    _fwd_bwd(model)


def test_build_from_shipped_ablation_yaml():
    """The shipped ablation schedule (block 64) on an 8-layer model at 128 tokens."""
    model = _build(
        os.path.join(REPO, "configs", "attention", "ablation_overrides.yaml"), num_layers=8
    )
    kinds = [k for k, _ in _core_kinds(model)]
    assert kinds == ["FusedDenseAttention"] + ["S2CoreAttention"] * 6 + ["FusedDenseAttention"]
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert (
        cores[2].pattern.vert_stride,
        cores[3].pattern.local_blocks,
        cores[4].pattern.num_dense_heads,
    ) == (16, 8, 4)


def test_build_gpt_model_validates_schedule():
    with pytest.raises(ScheduleError, match=r"attention\.dense_layers\.indices"):
        _build({"dense_layers": {"indices": [9]}})
    with pytest.raises(ScheduleError, match=r"attention\.s2\.block_size \(64\) must divide"):
        tiny_s2_config({"s2": {"block_size": 64}}, s2_seq_length=96)
    from megatron_s2.model import build_gpt_model

    with pytest.raises(TypeError, match="S2TransformerConfig"):
        build_gpt_model(tiny_config(), vocab_size=VOCAB, max_sequence_length=SEQ)


def test_build_logs_schedule_table(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="megatron_s2.schedule"):
        _build(TINY_SCHEDULE)
    assert "density@128" in caplog.text and "dense" in caplog.text


def test_block_spec_slices_pipeline_stages():
    from megatron_s2.specs import get_s2_decoder_block_spec

    cfg = tiny_s2_config({"dense_layers": {"indices": [2]}}, num_layers=4)
    cfg.pipeline_model_parallel_size = 2
    stage1 = get_s2_decoder_block_spec(cfg, pp_rank=1)
    cores = [s.submodules.self_attention.submodules.core_attention for s in stage1.layer_specs]
    # Stage 1 holds global layers 2 and 3 (0-based): dense then S2.
    assert cores[0] is FusedDenseAttention
    assert cores[1] is S2CoreAttention


def test_spec_import_module_path(tmp_path, monkeypatch):
    """Megatron-LM's --spec path: import the spec object by name, schedule from the env var,
    one spec for all layers; GPTModel builds and trains. 64 tokens (four 16-token blocks): a
    plain TransformerConfig runs the Triton kernels (backend "auto", under the interpreter on the
    CPU) in every layer, and the spec path does not need the longer sequence (the kernels in
    the model at 128 tokens: test_build_gpt_model_per_layer_modules_and_train_step)."""
    seq = 64
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import import_module

    f = tmp_path / "sched.yaml"
    f.write_text(
        "s2: {block_size: 16, local_blocks: 2, vert_stride: 8, head_offset: 1}\n"
        "dense_layers: {pattern: DS}\n"
    )
    monkeypatch.setenv(SCHEDULE_ENV_VAR, str(f))
    spec = import_module(("megatron_s2.specs", "s2_layer_spec"))
    assert spec is not None
    assert spec.submodules.self_attention.submodules.core_attention.module is ScheduledCoreAttention
    cfg = tiny_config()
    model = GPTModel(
        config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=seq
    )
    assert [k for k, _ in _core_kinds(model)] == ["FusedDenseAttention", "S2CoreAttention"] * 2
    _fwd_bwd(model, seq)


def test_scheduled_core_attention_without_schedule_explains():
    cfg = tiny_config()
    os.environ.pop(SCHEDULE_ENV_VAR, None)
    with pytest.raises(ValueError, match=SCHEDULE_ENV_VAR):
        ScheduledCoreAttention(
            config=cfg,
            layer_number=1,
            attn_mask_type=AttnMaskType.causal,
            attention_type="self",
            pg_collection=TensorParallelGroups(0, 1),
        )


def test_sp_norm_marks_parameters():
    from megatron_s2.norm import SPNorm

    cfg = tiny_config(normalization="LayerNorm")
    cfg.sequence_parallel = True
    norm = SPNorm(cfg, 64)
    assert isinstance(norm, torch.nn.LayerNorm)
    assert all(p.sequence_parallel for p in norm.parameters())
    assert isinstance(SPNorm(tiny_config(), 64), torch.nn.RMSNorm)
    with pytest.raises(ValueError, match="normalization"):
        SPNorm(tiny_config(), 64, normalization="L2Norm")


def test_te_spec_absent_or_buildable():
    from megatron_s2 import specs

    if not specs.HAVE_TE:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.spec_utils import import_module

        # As Megatron-LM's --spec imports it: an object, which fails at build with the reason.
        spec = import_module(("megatron_s2.specs", "s2_layer_spec_te"))
        with pytest.raises(
            specs.TransformerEngineMissing,
            match=r"Transformer Engine.*pip install.*s2_layer_spec "
            r"--transformer-impl local",
        ):
            GPTModel(
                config=tiny_config(),
                transformer_layer_spec=spec,
                vocab_size=VOCAB,
                max_sequence_length=SEQ,
            )
        with pytest.raises(specs.TransformerEngineMissing, match="Transformer Engine"):
            specs.get_s2_layer_te_spec()
    else:
        assert (
            specs.s2_layer_spec_te.submodules.self_attention.submodules.core_attention.params[
                "dense_attention"
            ].__name__
            == "TEDotProductAttention"
        )


# ---------------------------------------------------------------------- typed config
def test_s2_transformer_config_declares_validates_and_survives_copies():
    import copy

    path = os.path.join(REPO, "configs", "attention", "ablation_overrides.yaml")
    cfg = tiny_s2_config(path, num_layers=8, s2_seq_length=SEQ)
    assert isinstance(cfg.s2_schedule, AttentionSchedule) and cfg.s2_schedule.source == path
    assert cfg.s2_num_query_groups == 4 and cfg.attention_dropout == 0.0
    # Megatron deep-copies the config and fakes num_query_groups when groups < TP.
    dup = copy.deepcopy(cfg)
    dup.num_query_groups = 8
    assert dup.s2_num_query_groups == 4 and dup.s2_schedule.to_dict() == cfg.s2_schedule.to_dict()
    assert "s2_schedule" in {f.name for f in __import__("dataclasses").fields(S2TransformerConfig)}


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"s2_schedule": None}, "s2_schedule is required"),
        ({"s2_schedule": {}, "s2_backend": "cuda"}, r"s2_backend must be one of"),
        (
            {"s2_schedule": {}, "dense_backend": "flash"},
            r"dense_backend must be one of \('auto', 'sdpa', 'fa4'\)",
        ),
        (
            {"s2_schedule": {}, "dense_backend": "fa4", "attention_dropout": 0.1},
            r"dense_backend='fa4': FlashAttention-4 has no attention dropout",
        ),
        ({"s2_schedule": {"s2": {"vert_stride": 0}}}, r"attention\.s2\.vert_stride"),
        (
            {
                "s2_schedule": {"s2": {"block_size": 16, "local_blocks": 1, "vert_stride": 16}},
                "s2_seq_length": 512,
            },
            r"unseen at 512 tokens",
        ),
    ],
)
def test_s2_transformer_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(config_class=S2TransformerConfig, **kw)


def test_packed_documents_checked_once_per_batch(monkeypatch):
    """The cu_seqlens value checks (a device sync each) run for the first layer that sees a
    PackedSeqParams; later layers of the same forward skip them; a new batch is checked again,
    and invalid values are still caught."""
    from megatron.core.packed_seq_params import PackedSeqParams

    import megatron_s2.attention as attention

    calls = []
    real = attention.s2_attention_varlen

    def spy(*args, check_cu_seqlens=True, **kw):
        calls.append(check_cu_seqlens)
        return real(*args, check_cu_seqlens=check_cu_seqlens, **kw)

    monkeypatch.setattr(attention, "s2_attention_varlen", spy)
    cfg = tiny_config()
    pattern = S2Pattern(8, 4, block_size=16, local_blocks=2, vert_stride=4)
    layers = [
        S2CoreAttention(
            cfg, i, AttnMaskType.causal, "self", pg_collection=TensorParallelGroups(0, 1), pattern=p
        )
        for i, p in ((1, pattern), (2, pattern))
    ]
    q, k, v = (x[:, 0] for x in _qkv())

    def batch(cu):
        cu = torch.tensor(cu, dtype=torch.int32)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)

    psp = batch([0, 50, SEQ])
    for layer in layers:
        layer(q, k, v, None, packed_seq_params=psp)
    layers[0](q, k, v, None, packed_seq_params=batch([0, 20, SEQ]))
    assert calls == [True, False, True]
    with pytest.raises(ValueError, match="cu_seqlens must end at total_tokens"):
        layers[0](q, k, v, None, packed_seq_params=batch([0, 20, SEQ - 1]))
