"""S2 in Megatron-core's HybridModel (megatron_s2.hybrid): CPU on gloo, a GPU twin behind `gpu`.

The hybrid stack ``"*-" * N`` computes exactly the GPTModel of N layers: the same weights give the
same loss and gradients, so a hybrid model built with our spec is checked against the GPT model
built by ``build_gpt_model`` (itself checked against the reference and across TP/PP elsewhere).
megatron-core 0.16.1 has no HybridModel: there only the error test runs.
"""

import re

import pytest
import torch

from tests.helpers.megatron import TINY_SCHEDULE, free_port, init_single_process, tiny_config

pytest.importorskip("megatron.core")

from megatron_s2.config import S2TransformerConfig  # noqa: E402
from megatron_s2.hybrid import (  # noqa: E402
    HAVE_HYBRID,
    HybridModelUnavailable,
    S2HybridTransformerConfig,
    attention_layer_index,
)
from megatron_s2.schedule import ScheduleError  # noqa: E402

needs_hybrid = pytest.mark.skipif(not HAVE_HYBRID, reason="megatron-core without HybridModel")

SEQ, VOCAB = 128, 128
# TINY_SCHEDULE on 4 attention layers: S2, dense, S2 (override: stride 4, 2 dense heads), dense.
TINY_KINDS = ["S2CoreAttention", "FusedDenseAttention"] * 2


@pytest.fixture(scope="module", autouse=True)
def _dist():
    init_single_process()


def _hybrid_config(pattern="*-" * 4, schedule=TINY_SCHEDULE, backend="reference", seq=SEQ, **kw):
    return tiny_config(
        config_class=S2HybridTransformerConfig,
        num_layers=kw.pop("num_layers", 0),
        hybrid_layer_pattern=pattern,
        s2_schedule=schedule,
        s2_backend=backend,
        s2_seq_length=seq,
        **kw,
    )


def _hybrid(pattern="*-" * 4, schedule=TINY_SCHEDULE, backend="reference", seq=SEQ, **kw):
    from megatron_s2.hybrid import build_hybrid_model

    use_te = kw.pop("use_te", False)
    cfg = _hybrid_config(pattern, schedule, backend, seq, **kw)
    return build_hybrid_model(
        cfg,
        vocab_size=VOCAB,
        max_sequence_length=seq,
        position_embedding_type="learned_absolute",
        use_te=use_te,
    )


def _gpt(schedule=TINY_SCHEDULE, backend="reference", seq=SEQ, **kw):
    from megatron_s2.model import build_gpt_model

    use_te = kw.pop("use_te", False)
    cfg = tiny_config(
        config_class=S2TransformerConfig,
        s2_schedule=schedule,
        s2_backend=backend,
        s2_seq_length=seq,
        **kw,
    )
    return build_gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=seq, use_te=use_te)


def gpt_to_hybrid_name(name: str) -> str:
    """GPT layer i's attention half -> hybrid layer 2i, its MLP half -> 2i + 1 (pattern "*-")."""
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if m is None:
        return name.replace("decoder.final_layernorm.", "decoder.final_norm.")
    i, rest = int(m.group(1)), m.group(2)
    attention = rest.startswith(("input_layernorm.", "self_attention."))
    return f"decoder.layers.{2 * i + (0 if attention else 1)}.{rest}"


def _copy_gpt_weights(gpt, hybrid) -> None:
    hybrid.load_state_dict({gpt_to_hybrid_name(k): v for k, v in gpt.state_dict().items()})


def _loss_and_grads(model, device="cpu", seq=SEQ):
    gen = torch.Generator().manual_seed(1)
    tok = torch.randint(0, VOCAB, (2, seq), generator=gen).to(device)
    pos = torch.arange(seq, device=device)[None].expand(2, -1)
    model.zero_grad()
    loss = model(tok, pos, None, labels=tok).float().mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss.detach(), grads


def _max_relative_grad_difference(hybrid_grads, gpt_grads) -> float:
    """max over the GPT model's parameters of max|g_hybrid - g_gpt| / max|g_gpt|."""
    worst = 0.0
    for name, grad in gpt_grads.items():
        got = hybrid_grads[gpt_to_hybrid_name(name)].float()
        scale = grad.float().abs().max().clamp_min(1e-12)
        worst = max(worst, float((got - grad.float()).abs().max() / scale))
    return worst


def _attention_layers(model):
    return [
        (type(layer.self_attention.core_attention).__name__, layer.layer_number)
        for layer in model.decoder.layers
        if hasattr(layer.self_attention, "core_attention")
    ]


# ---------------------------------------------------------------------------- layer numbering
def test_attention_layer_index_counts_attention_layers_only():
    assert [attention_layer_index("*-*-", n) for n in (1, 3)] == [0, 1]
    # '|' is a stage boundary, not a layer; Megatron's layer numbers skip it too.
    assert [attention_layer_index("*--|**-|-*", n) for n in (1, 4, 5, 8)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"layer_number 2 is not an attention \('\*'\) layer"):
        attention_layer_index("*-*-", 2)
    with pytest.raises(ValueError, match="layer_number 5"):
        attention_layer_index("*-*-", 5)


# ---------------------------------------------------------------------------- 0.16.1
@pytest.mark.skipif(HAVE_HYBRID, reason="HybridModel present")
def test_without_hybrid_model_config_and_builder_explain():
    from megatron_s2.hybrid import build_hybrid_model, get_s2_hybrid_stack_spec

    with pytest.raises(HybridModelUnavailable, match=r"megatron-core >= 0\.19.*installed"):
        _hybrid_config()
    for call in (build_hybrid_model, get_s2_hybrid_stack_spec):
        with pytest.raises(HybridModelUnavailable, match="HybridModel"):
            call(None, 1, 1) if call is build_hybrid_model else call(None)


# ---------------------------------------------------------------------------- models (0.19+)
@needs_hybrid
def test_hybrid_equals_gpt_with_the_same_weights():
    """Loss and every gradient of the hybrid "*-*-*-*-" equal the 4-layer GPTModel's (fp32, the
    same ops in the same order); a schedule indexed differently would not."""
    gpt, hybrid = _gpt(), _hybrid()
    assert [k for k, _ in _attention_layers(hybrid)] == TINY_KINDS
    assert [n for _, n in _attention_layers(hybrid)] == [1, 3, 5, 7]
    # The S2 layers carry the GPT layers' full-model patterns (the override reached layer 2).
    g_layers, h_layers = gpt.decoder.layers, hybrid.decoder.layers
    for i in (0, 2):
        gp = g_layers[i].self_attention.core_attention.global_pattern
        assert repr(h_layers[2 * i].self_attention.core_attention.global_pattern) == repr(gp)
    assert h_layers[4].self_attention.core_attention.global_pattern.vert_stride == 4

    _copy_gpt_weights(gpt, hybrid)
    loss_g, grads_g = _loss_and_grads(gpt)
    loss_h, grads_h = _loss_and_grads(hybrid)
    torch.testing.assert_close(loss_h, loss_g, rtol=1e-6, atol=1e-6)
    assert len(grads_h) == len(grads_g)
    for name, grad in grads_g.items():
        torch.testing.assert_close(
            grads_h[gpt_to_hybrid_name(name)], grad, rtol=1e-5, atol=1e-6, msg=name
        )

    # Not vacuous: the same weights with every attention layer dense give other gradients, far
    # outside the tolerance above (at init the losses differ only by ~1e-4, too little to test).
    dense = _hybrid(schedule={"dense_layers": {"pattern": "D"}})
    _copy_gpt_weights(gpt, dense)
    _, grads_d = _loss_and_grads(dense)
    assert _max_relative_grad_difference(grads_d, grads_g) > 1e-2


@needs_hybrid
def test_hybrid_with_sinks_on_every_layer_equals_gpt():
    """attention.dense_layers.sinks (with s2.sinks): the hybrid's dense attention layers are the
    S2 module with a dense pattern and sinks, as the GPT model's, and with the same weights (the
    sinks included, set away from their start) the two give the same loss and gradients."""
    schedule = TINY_SCHEDULE | {
        "s2": TINY_SCHEDULE["s2"] | {"sinks": True},
        "dense_layers": {"pattern": "SD", "sinks": True},
    }
    gpt, hybrid = _gpt(schedule=schedule), _hybrid(schedule=schedule)
    assert [k for k, _ in _attention_layers(hybrid)] == ["S2CoreAttention"] * 4
    cores = [layer.self_attention.core_attention for layer in hybrid.decoder.layers[::2]]
    assert [c.dense_layer for c in cores] == [False, True, False, True]
    assert [c.checkpoint_layer for c in cores] == [0, 1, 2, 3]
    with torch.no_grad():
        for i, layer in enumerate(gpt.decoder.layers):
            layer.self_attention.core_attention.sinks.fill_(0.5 * i - 1.0)
    _copy_gpt_weights(gpt, hybrid)
    loss_g, grads_g = _loss_and_grads(gpt)
    loss_h, grads_h = _loss_and_grads(hybrid)
    torch.testing.assert_close(loss_h, loss_g, rtol=1e-6, atol=1e-6)
    assert _max_relative_grad_difference(grads_h, grads_g) < 1e-5
    assert any(n.endswith("core_attention.sinks") for n in grads_g)


@needs_hybrid
def test_hybrid_on_the_triton_kernels_trains():
    """backend "auto": the S2 layers run the Triton kernels (under the interpreter on CPU) and
    agree with the PyTorch reference backend; small (one S2 layer, 64 tokens) for CI."""
    schedule = {
        "s2": {"block_size": 16, "local_blocks": 1, "vert_stride": 2},
        "dense_layers": {"pattern": "SD"},
    }
    hybrid = _hybrid("*-*-", schedule, backend="auto", seq=64)
    assert [k for k, _ in _attention_layers(hybrid)] == TINY_KINDS[:2]
    loss, grads = _loss_and_grads(hybrid, seq=64)
    ref = _hybrid("*-*-", schedule, backend="reference", seq=64)
    ref.load_state_dict(hybrid.state_dict())
    loss_ref, grads_ref = _loss_and_grads(ref, seq=64)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


@needs_hybrid
def test_schedule_indexes_attention_layers_between_mlp_runs():
    """Index k of the schedule is the k-th '*' whatever sits between: here 5 attention layers
    in 9 hybrid layers; dense_layers.indices [-1] is the last '*' (hybrid layer 9), the
    override 1 the second '*' (hybrid layer 2)."""
    schedule = {
        "s2": {"block_size": 16, "local_blocks": 2, "vert_stride": 4},
        "dense_layers": {"indices": [0, -1]},
        "overrides": {1: {"vert_stride": 8, "head_offset": 1}},
    }
    model = _hybrid("**--*-*-*", schedule)
    assert _attention_layers(model) == [
        ("FusedDenseAttention", 1),
        ("S2CoreAttention", 2),
        ("S2CoreAttention", 5),
        ("S2CoreAttention", 7),
        ("FusedDenseAttention", 9),
    ]
    strides = [
        layer.self_attention.core_attention.pattern.vert_stride
        for layer in model.decoder.layers
        if type(getattr(layer.self_attention, "core_attention", None)).__name__ == "S2CoreAttention"
    ]
    assert strides == [8, 4, 4]
    _loss_and_grads(model)


@needs_hybrid
def test_later_pipeline_stage_keeps_the_global_attention_index():
    """A stage builds its layers with Megatron's global layer numbers (pp_layer_offset), so the
    second half of "*-*-|*-*-" gets attention layers 2 and 3 of the schedule."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_s2.hybrid import get_s2_hybrid_stack_spec

    cfg = _hybrid_config(
        "*-*-*-*-", {"s2": {"block_size": 16, "local_blocks": 2}, "dense_layers": {"indices": [2]}}
    )
    stage = build_module(
        get_s2_hybrid_stack_spec(cfg),
        cfg,
        pre_process=False,
        layer_type_list=list("*-*-"),
        pp_layer_offset=4,
        post_process=True,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    kinds = [
        (type(layer.self_attention.core_attention).__name__, layer.layer_number)
        for layer in stage.layers
        if hasattr(layer.self_attention, "core_attention")
    ]
    assert kinds == [("FusedDenseAttention", 5), ("S2CoreAttention", 7)]


@needs_hybrid
def test_schedule_table_lists_attention_layers(caplog):
    caplog.set_level("INFO", logger="megatron_s2.schedule")
    _hybrid_config("*-*--*-*-", {"s2": {"block_size": 16, "local_blocks": 3, "vert_stride": 4}})
    table = [r.getMessage() for r in caplog.records if "schedule" in r.getMessage()][-1]
    rows = [ln.split()[0] for ln in table.splitlines()[3:] if ln.strip()[:1].isdigit()]
    assert rows == ["0", "1", "2", "3"]


# ---------------------------------------------------------------------------- errors (0.19+)
@needs_hybrid
@pytest.mark.parametrize(
    "kw, err, match",
    [
        ({"pattern": None}, ValueError, r"hybrid_layer_pattern is required.*'\*', '-', 'M', '\|'"),
        ({"pattern": "*-E-"}, ValueError, r"symbols \['E'\] are not supported.*allowed: '\*'"),
        ({"pattern": "*-*-/*-"}, ValueError, r"multi-token prediction \('/' patterns\)"),
        ({"pattern": "----"}, ValueError, r"has no attention \('\*'\) layers"),
        ({"pattern": "M*M*"}, ValueError, r"hybrid_layer_pattern 'M\*M\*' has Mamba.*mamba_ssm"),
        ({"num_layers": 4}, ValueError, r"num_layers \(4\) must equal .* \(8\)"),
        ({"pattern": "*-|*-"}, ValueError, r"2 '\|'-separated pipeline segments.* is 1"),
        # 8 hybrid layers but 4 attention layers: index 5 does not exist.
        (
            {"schedule": {"dense_layers": {"indices": [5]}}},
            ScheduleError,
            r"dense_layers.indices: layer index 5 is out of range for 4 layers",
        ),
    ],
)
def test_config_errors_name_the_setting(kw, err, match):
    if "M" in (kw.get("pattern") or ""):
        import importlib.util

        if importlib.util.find_spec("mamba_ssm") and importlib.util.find_spec("causal_conv1d"):
            pytest.skip("mamba_ssm is installed")
    with pytest.raises(err, match=match):
        _hybrid_config(**kw)


@needs_hybrid
def test_builder_errors():
    from megatron_s2.hybrid import build_hybrid_model, get_s2_hybrid_stack_spec
    from megatron_s2.specs import HAVE_TE, TransformerEngineMissing

    gpt_cfg = tiny_config(config_class=S2TransformerConfig, s2_schedule=TINY_SCHEDULE)
    with pytest.raises(TypeError, match="needs a megatron_s2.hybrid.S2HybridTransformerConfig"):
        build_hybrid_model(gpt_cfg, vocab_size=VOCAB, max_sequence_length=SEQ)
    cfg = _hybrid_config()
    with pytest.raises(ValueError, match="hybrid_layer_pattern must not be passed"):
        build_hybrid_model(cfg, VOCAB, SEQ, hybrid_layer_pattern="*-")
    if not HAVE_TE:
        with pytest.raises(TransformerEngineMissing, match="use_te=True"):
            get_s2_hybrid_stack_spec(cfg, use_te=True)


# ---------------------------------------------------------------------------- model class
def test_gpt_twin_patterns():
    from megatron_s2.hybrid import is_gpt_twin_pattern

    assert is_gpt_twin_pattern("*-*-") and is_gpt_twin_pattern("*-|*-")
    assert not any(map(is_gpt_twin_pattern, ["*--*", "**--", "*-*", "*|-", ""]))


def _sharded_keys(model) -> dict:
    """checkpoint key -> shape of every sharded tensor of ``model`` (a fresh, unfilled dict)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return {
        t.key: tuple(t.global_shape)
        for t in nested_values(model.sharded_state_dict())
        if hasattr(t, "global_shape")
    }


@needs_hybrid
def test_model_class_twins_checkpoint_under_the_same_keys():
    """build_model of model_config("hybrid") is a HybridModel whose checkpoint keys and shapes
    are exactly the GPTModel's (so either class resumes the other's checkpoints), with the
    parameters in the same order (the distributed optimizer's flat buffers match); its plain
    state_dict keeps Megatron's hybrid names."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_s2.model import build_model, model_config

    fields = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=4,
        kv_channels=16,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        gated_linear_unit=True,
        use_cpu_initialization=True,
        add_bias_linear=False,
        s2_schedule=TINY_SCHEDULE,
        s2_seq_length=SEQ,
        s2_backend="reference",
    )
    kw = dict(position_embedding_type="rope", share_embeddings_and_output_weights=False)
    gpt = build_model(model_config("gpt", **fields), VOCAB, SEQ, **kw)
    hybrid_config = model_config("hybrid", **fields)
    hybrid = build_model(hybrid_config, VOCAB, SEQ, **kw)
    assert isinstance(gpt, GPTModel) and isinstance(hybrid, HybridModel)
    assert hybrid_config.hybrid_layer_pattern == "*-" * 4 and hybrid_config.num_layers == 8
    assert _sharded_keys(hybrid) == _sharded_keys(gpt)
    assert "decoder.final_norm.weight" in hybrid.state_dict()
    assert [gpt_to_hybrid_name(n) for n, _ in gpt.named_parameters()] == [
        n for n, _ in hybrid.named_parameters()
    ]
    pipelined = model_config(
        "hybrid", pipeline_model_parallel_size=2, pipeline_dtype=torch.float32, **fields
    )
    assert pipelined.hybrid_layer_pattern == "*-*-|*-*-"


# ---------------------------------------------------------------------------- Megatron-LM
@needs_hybrid
def test_ready_stack_spec_under_megatron_lm_pretrain_hybrid(tmp_path, monkeypatch):
    """What Megatron-LM's pretrain_hybrid.py does with `--spec megatron_s2.hybrid
    s2_hybrid_stack_spec`: a plain TransformerConfig (num_layers = the pattern's length), the
    pattern in Megatron-LM's arguments, the schedule in $MEGATRON_S2_SCHEDULE. The model equals
    the S2HybridTransformerConfig one (same weights, same loss); a schedule index beyond the
    attention layers is refused, and without Megatron-LM's arguments the error says what is
    missing. 64 tokens (four 16-token blocks): the plain config's S2 and dense layers run the
    Triton kernels under the interpreter on the CPU (backend "auto"), and what is checked here
    (the spec path and its errors, the same model) does not need the longer sequence."""
    import types

    import yaml
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.training import global_vars

    from megatron_s2.hybrid import s2_hybrid_stack_spec

    pattern, seq = "*-" * 4, 64
    path = tmp_path / "schedule.yaml"
    path.write_text(yaml.safe_dump(TINY_SCHEDULE))
    monkeypatch.setenv("MEGATRON_S2_SCHEDULE", str(path))

    def megatron_lm_model():
        # hybrid_builder of Megatron-LM 0.19 (hybrid_builders.py), with our spec.
        return HybridModel(
            config=tiny_config(num_layers=len(pattern)),
            hybrid_stack_spec=s2_hybrid_stack_spec,
            vocab_size=VOCAB,
            max_sequence_length=seq,
            hybrid_layer_pattern=pattern,
            position_embedding_type="learned_absolute",
        )

    with pytest.raises(TypeError, match="pretrain_hybrid.py with --hybrid-layer-pattern"):
        megatron_lm_model()
    monkeypatch.setattr(
        global_vars, "_GLOBAL_ARGS", types.SimpleNamespace(hybrid_layer_pattern=pattern)
    )
    model = megatron_lm_model()
    assert [k for k, _ in _attention_layers(model)] == TINY_KINDS
    ours = _hybrid(seq=seq)
    model.load_state_dict(ours.state_dict())
    torch.testing.assert_close(
        _loss_and_grads(model, seq=seq)[0], _loss_and_grads(ours, seq=seq)[0]
    )

    # A second file: the schedule of a path is read once per process.
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**TINY_SCHEDULE, "dense_layers": {"indices": [5]}}))
    monkeypatch.setenv("MEGATRON_S2_SCHEDULE", str(bad))
    with pytest.raises(ScheduleError, match="layer index 5 is out of range for 4 layers"):
        megatron_lm_model()


# ---------------------------------------------------------------------------- TP=2 (gloo)
def _tp2_worker(rank, port, out):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(2, 1)
    try:
        gpt = _gpt(tensor_model_parallel_size=2)
        hybrid = _hybrid(tensor_model_parallel_size=2)
        kinds = [k for k, _ in _attention_layers(hybrid)]
        heads = [
            (layer.self_attention.core_attention.pattern.head_start)
            for layer in hybrid.decoder.layers[::4]
        ]
        _copy_gpt_weights(gpt, hybrid)
        loss_g, grads_g = _loss_and_grads(gpt)
        loss_h, grads_h = _loss_and_grads(hybrid)
        diff = max(
            float((grads_h[gpt_to_hybrid_name(n)] - g).abs().max()) for n, g in grads_g.items()
        )
        out.put((rank, kinds, heads, float(loss_g), float(loss_h), diff))
    finally:
        torch.distributed.destroy_process_group()


@needs_hybrid
@pytest.mark.slow
def test_tensor_parallel_2_equals_gpt():
    """TP=2 on two gloo processes: each rank's hybrid shard equals its GPT shard, and each rank's
    S2 layers compute its half of the heads (heads [0, 4) and [4, 8) of the full pattern)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_tp2_worker, args=(free_port(), out), nprocs=2, start_method="spawn")
    rows = sorted(out.get() for _ in range(2))
    for rank, kinds, heads, loss_g, loss_h, diff in rows:
        assert kinds == TINY_KINDS
        assert heads == [4 * rank, 4 * rank]
        assert abs(loss_h - loss_g) < 1e-6 and diff < 1e-5, (rank, loss_g, loss_h, diff)


# ---------------------------------------------------------------------------- GPU
def _check_cuda_twin(use_te: bool, dense_kind: str) -> None:
    """bf16 on a GPU, 1k tokens: the hybrid twin's loss and gradients match the GPTModel's from
    the same weights, and an all-dense schedule on those weights does not."""
    seq, kw = 1024, dict(bf16=True, params_dtype=torch.bfloat16, use_te=use_te)
    # .bfloat16() does what Megatron's Float16Module wrapper does in training: the learned
    # position embedding is a plain torch.nn.Embedding that ignores params_dtype.
    gpt = _gpt(backend="auto", seq=seq, **kw).cuda().bfloat16()
    hybrid = _hybrid(backend="auto", seq=seq, **kw).cuda().bfloat16()
    assert [k for k, _ in _attention_layers(hybrid)] == ["S2CoreAttention", dense_kind] * 2
    _copy_gpt_weights(gpt, hybrid)
    loss_g, grads_g = _loss_and_grads(gpt, "cuda", seq)
    loss_h, grads_h = _loss_and_grads(hybrid, "cuda", seq)
    torch.testing.assert_close(loss_h, loss_g, rtol=1e-2, atol=1e-2)
    for name, grad in grads_g.items():
        got = grads_h[gpt_to_hybrid_name(name)].float()
        scale = grad.float().abs().max().clamp_min(1e-6)
        assert float((got - grad.float()).abs().max() / scale) < 2e-2, name
    dense = _hybrid(schedule={"dense_layers": {"pattern": "D"}}, seq=seq, **kw).cuda().bfloat16()
    _copy_gpt_weights(gpt, dense)
    _, grads_d = _loss_and_grads(dense, "cuda", seq)
    assert _max_relative_grad_difference(grads_d, grads_g) > 0.1


@needs_hybrid
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hybrid_equals_gpt_on_cuda_bf16():
    """The local flavour: the Triton kernels on S2 layers and SDPA on dense ones."""
    _check_cuda_twin(use_te=False, dense_kind="FusedDenseAttention")


@needs_hybrid
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hybrid_te_flavour_equals_gpt_te_spec_on_cuda_bf16():
    """The TE flavour against the GPT TE spec: TE linears with their fused norms (the same
    parameter names in both, layer numbers mapped as for the local flavour), the Triton kernels
    on S2 layers and TEDotProductAttention on dense ones."""
    from megatron_s2.specs import HAVE_TE

    if not HAVE_TE:
        pytest.skip("needs Transformer Engine")
    _check_cuda_twin(use_te=True, dense_kind="TEDotProductAttention")
