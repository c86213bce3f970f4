"""Run-config loading, overrides and validation errors."""

import glob
import os

import pytest

from megatron_s2.training.run_config import ConfigError, RunConfig, apply_overrides, load_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))
# Context-extension recipes (they start from another run's checkpoint).
EXTEND_CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "extend", "*.yaml")))


def test_default_is_the_demo():
    cfg = load_config()
    assert cfg.name == "demo" and cfg.data.demo
    assert cfg.run_dir == os.path.join("runs", "demo")
    assert cfg.checkpoint_dir == os.path.join("runs", "demo", "checkpoints")


@pytest.mark.parametrize("path", CONFIGS + EXTEND_CONFIGS, ids=os.path.basename)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    cfg.schedule()  # the attention schedule fits the model
    p = cfg.parallel
    cfg.validate(
        world_size=p.tensor_model_parallel_size
        * p.pipeline_model_parallel_size
        * p.context_parallel_size
    )


@pytest.mark.parametrize("path", EXTEND_CONFIGS, ids=os.path.basename)
def test_extension_configs_start_from_weights_with_their_memory_noted(path):
    cfg = load_config(path)
    assert cfg.checkpoint.load_dir and cfg.checkpoint.reset_iteration
    assert cfg.model.seq_length >= 32768
    with open(path) as f:
        assert "GiB" in f.read()  # the memory per GPU is written next to the settings


def test_shipped_configs_come_in_dense_s2_pairs():
    names = {os.path.basename(p)[:-5] for p in CONFIGS}
    for size in ("gpt-125m", "gpt-1.3b", "gpt-7b"):
        assert f"{size}-dense" in names and f"{size}-s2" in names, size
        dense, s2 = (
            load_config(os.path.join(REPO, "configs", f"{size}-{k}.yaml")) for k in ("dense", "s2")
        )
        # Twins differ only in the attention schedule and the run name.
        d, s = dense.to_dict(), s2.to_dict()
        for key in ("name", "attention"):
            d.pop(key), s.pop(key)
        assert d == s, size


def test_overrides_parse_yaml_values_and_nest():
    cfg = load_config(
        None,
        [
            "train.train_iters=7",
            "optimizer.lr_warmup_iters=2",
            "optimizer.lr=1e-3",
            "model.num_query_groups=2",
            "data.blend=[[0.3, a], [0.7, b]]",
            "attention.s2.vert_stride=8",
            "checkpoint.keep_last=2",
            "name=x",
        ],
    )
    assert cfg.train.train_iters == 7 and cfg.optimizer.lr == 1e-3
    assert cfg.model.num_query_groups == 2
    assert cfg.blend() == (["a", "b"], [0.3, 0.7])
    assert cfg.attention["s2"]["vert_stride"] == 8 and cfg.attention["s2"]["block_size"] == 16
    assert cfg.checkpoint.keep_last == 2 and cfg.name == "x"


def test_override_null_and_int_to_float():
    cfg = load_config(None, ["model.rotary_base=500000", "optimizer.lr_decay_iters=null"])
    assert cfg.model.rotary_base == 500000.0 and isinstance(cfg.model.rotary_base, float)
    assert cfg.optimizer.lr_decay_iters is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.micro_batch_size=0", "train.micro_batch_size must be >= 1, got 0"),
        ("train.bogus=1", "unknown key(s) train.bogus in train; allowed keys:"),
        ("bogus.x=1", "unknown key(s) bogus in the run config; allowed keys:"),
        ("train.train_iters=abc", "train.train_iters must be of type int, got 'abc'"),
        ("train.train_iters=1.5", "train.train_iters must be of type int"),
        ("logging.progress_bar=3", "logging.progress_bar must be of type bool"),
        (
            "train.precision=fp16",
            "train.precision must be one of ['auto', 'bf16', 'fp32'], got 'fp16'",
        ),
        ("model.recompute=some", "model.recompute must be one of ['none', 'selective', 'full']"),
        (
            ("train.micro_batch_size=4", "train.global_batch_size=6"),
            "train.global_batch_size (6) must be divisible by train.micro_batch_size (4)",
        ),
        (
            "model.num_attention_heads=3",
            "model.hidden_size (128) must be divisible by model.num_attention_heads (3)",
        ),
        (
            "parallel.tensor_model_parallel_size=8",
            "must be divisible by parallel.tensor_model_parallel_size (8)",
        ),
        (
            "parallel.pipeline_model_parallel_size=3",
            "model.num_layers (4) must be divisible by the number of pipeline chunks",
        ),
        (
            "parallel.sequence_parallel=true",
            "parallel.sequence_parallel needs parallel.tensor_model_parallel_size > 1",
        ),
        ("optimizer.min_lr=1.0", "optimizer.min_lr must be in [0, optimizer.lr="),
        (
            "optimizer.lr_warmup_iters=500",
            "optimizer.lr_warmup_iters (500) must be smaller than the decay length",
        ),
        ("data.demo=false", "data.blend is empty"),
        (
            "data.blend=[[0, a]]",
            "data.blend must be a list of prefixes or of [weight, prefix] pairs",
        ),
        ("data.split=90,10", "data.split must be three non-negative weights"),
        ("train", "override 'train' must look like key.sub=value"),
        ("train..x=1", "must look like key.sub=value"),
        ("train.seed.x=1", "override 'train.seed.x=1': train.seed is not a section"),
        ("name=a/b", "name must be one folder name"),
        (
            "checkpoint.on_resume=merge",
            "checkpoint.on_resume must be one of ['apply', 'keep'], got 'merge'",
        ),
        (
            "model.transformer_impl=te",
            "model.transformer_impl must be one of ['local', 'transformer_engine'], got 'te'",
        ),
        (
            "model.dense_attention=flash",
            "model.dense_attention must be one of ['auto', 'sdpa', 'fa4'], got 'flash'",
        ),
        (
            ["model.dense_attention=fa4", "model.transformer_impl=transformer_engine"],
            "model.dense_attention=fa4 applies to model.transformer_impl=local",
        ),
        (
            "parallel.cp_comm_type=p2p",
            "parallel.cp_comm_type must be one of ['auto', 'all_gather', 'a2a'], got 'p2p'",
        ),
        (
            [
                "parallel.cp_comm_type=a2a",
                "parallel.context_parallel_size=4",
                "model.num_query_groups=2",
            ],
            "model.num_query_groups / TP (2) must be divisible by parallel.context_parallel_size "
            "(4)",
        ),
    ],
)
def test_validation_errors_name_the_key(override, message):
    overrides = [override] if isinstance(override, str) else list(override)
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_schedule_errors_are_config_errors():
    with pytest.raises(ConfigError, match=r"attention\.s2\.block_size"):
        load_config(None, ["attention.s2.block_size=24"]).schedule()
    with pytest.raises(ConfigError, match=r"unknown key attention\.bogus"):
        load_config(None, ["attention.bogus=1"]).schedule()
    with pytest.raises(ConfigError, match=r"seq|block"):
        load_config(None, ["model.seq_length=520"]).schedule()


def test_world_size_checks():
    cfg = load_config(None, ["parallel.tensor_model_parallel_size=2"])
    with pytest.raises(
        ConfigError, match="world size 3 is not divisible by tensor x pipeline x context"
    ):
        cfg.validate(world_size=3)
    cfg = load_config(None, ["train.global_batch_size=4", "train.micro_batch_size=4"])
    with pytest.raises(
        ConfigError,
        match=r"train.global_batch_size \(4\) must be divisible by "
        r"train.micro_batch_size x data-parallel size \(4 x 2\)",
    ):
        cfg.validate(world_size=2)
    assert (
        load_config(
            None, ["train.global_batch_size=16", "train.micro_batch_size=2"]
        ).num_microbatches(4)
        == 2
    )


def test_missing_file_and_round_trip(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    cfg = load_config()
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    assert apply_overrides({}, ["a.b.c=1"]) == {"a": {"b": {"c": 1}}}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["attention.s2.head_offset=9"],
            "attention.s2.head_offset must be a stripe phase 0..3 (0 = the authors' library, "
            "1 = Phi-3-small/vLLM; phases repeat every vert_stride=4), got 9, which would act "
            "as 1",
        ),
        (
            ["attention.overrides={1: {vert_stride: 2, head_offset: 2}}"],
            "attention.overrides.1.head_offset must be a stripe phase 0..1",
        ),
    ],
)
def test_head_offset_is_a_stripe_phase(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides).schedule()
    assert message in str(e.value)


@pytest.mark.parametrize("offset, stride", [(0, 4), (1, 4), (3, 4), (1, 1), (1, 2)])
def test_head_offset_phases_accepted(offset, stride):
    # 0 and 1 (the published conventions) always; any phase below vert_stride.
    load_config(
        None, [f"attention.s2.head_offset={offset}", f"attention.s2.vert_stride={stride}"]
    ).schedule()


def test_transformer_engine_impl_is_refused_where_it_cannot_run(monkeypatch):
    """model.transformer_impl=transformer_engine: a config error before any GPU work on the CPU
    and where TE does not import; the local implementation always passes."""
    import megatron_s2.specs
    from megatron_s2.training.parallel import check_transformer_impl

    cfg = load_config(None, ["model.transformer_impl=transformer_engine"])
    cfg.validate()  # the value itself is valid
    check_transformer_impl("local", gpu=False)
    with pytest.raises(ConfigError, match="transformer_engine needs a CUDA GPU"):
        check_transformer_impl(cfg.model.transformer_impl, gpu=False)
    monkeypatch.setattr(megatron_s2.specs, "HAVE_TE", False)
    with pytest.raises(ConfigError, match="Transformer Engine is not installed here"):
        check_transformer_impl(cfg.model.transformer_impl, gpu=True)
    monkeypatch.setattr(megatron_s2.specs, "HAVE_TE", True)
    check_transformer_impl(cfg.model.transformer_impl, gpu=True)


def test_dense_attention_fa4_is_refused_where_it_cannot_run(monkeypatch):
    """model.dense_attention=fa4: a config error before any GPU work in CPU mode and where
    FlashAttention-4 does not import; "auto" and "sdpa" always pass (auto falls back to SDPA)."""
    import megatron_s2.flash_attention4 as fa4mod
    import megatron_s2.training.parallel as par

    cfg = load_config(None, ["model.dense_attention=fa4"])
    cfg.validate()  # the value itself is valid
    for ok in ("auto", "sdpa"):
        par.check_dense_attention(
            load_config(None, [f"model.dense_attention={ok}"]).model, gpu=False
        )
    with pytest.raises(ConfigError, match="dense_attention=fa4 needs a CUDA GPU"):
        par.check_dense_attention(cfg.model, gpu=False)
    monkeypatch.setattr(fa4mod, "fa4_import_error", lambda: "flash_attn.cute does not import (x)")
    with pytest.raises(ConfigError, match="pip install flash-attn-4"):
        par.check_dense_attention(cfg.model, gpu=True)
    monkeypatch.setattr(fa4mod, "fa4_import_error", lambda: None)
    par.check_dense_attention(cfg.model, gpu=True)


def test_transformer_impl_change_is_refused_on_resume():
    """TE and local layers hold differently named parameters (TE fuses the norms)."""
    from megatron_s2.training.run_config import resume_changes

    old = load_config(None, []).to_dict()
    new = load_config(None, ["model.transformer_impl=transformer_engine"])
    refused = resume_changes(old, new, own=True).refused
    assert [c.key for c in refused] == ["model.transformer_impl"]
    # A checkpoint written before the setting existed was local.
    del old["model"]["transformer_impl"]
    assert resume_changes(old, new, own=True).refused[0].checkpoint == "local"
    assert not resume_changes(old, load_config(None, []), own=True).refused


def test_qkv_bias_and_norm_epsilon_on_resume_and_in_the_model_config():
    """model.add_qkv_bias changes the state dict (refused on any resume); model.norm_epsilon
    changes what the weights mean (refused on the run's own resume, listed from another run's
    weights). Both reach Megatron's config (--add-qkv-bias, --norm-epsilon); a checkpoint that
    predates them was written without QKV biases."""
    from megatron_s2.training import parallel
    from megatron_s2.training.run_config import resume_changes

    old = load_config(None, []).to_dict()
    new = load_config(None, ["model.add_qkv_bias=true", "model.norm_epsilon=1e-6"])
    for own in (True, False):
        changes = resume_changes(old, new, own=own)
        assert [c.key for c in changes.refused if c.key == "model.add_qkv_bias"] == [
            "model.add_qkv_bias"
        ]
        assert "model.norm_epsilon" in {c.key for c in (changes.refused if own else changes.noted)}
    del old["model"]["add_qkv_bias"], old["model"]["norm_epsilon"]
    assert [c.key for c in resume_changes(old, new, own=True).refused] == ["model.add_qkv_bias"]
    tc = parallel.transformer_config(new.model, new.parallel, new.attention, bf16=False)
    assert tc.add_qkv_bias and not tc.add_bias_linear and tc.layernorm_epsilon == 1e-6
    for bad in ("0", "1.5", "-1e-5"):
        with pytest.raises(ConfigError, match=r"model.norm_epsilon must be in \(0, 1\)"):
            load_config(None, [f"model.norm_epsilon={bad}"])


def test_explicit_vocab_size_must_split_over_tensor_parallel_ranks():
    """An exact vocabulary (an imported model's) splits by rows over the TP ranks."""
    load_config(None, ["model.vocab_size=384", "parallel.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"model.vocab_size \(385\) must be divisible by"):
        load_config(None, ["model.vocab_size=385", "parallel.tensor_model_parallel_size=2"])


TE = "model.transformer_impl=transformer_engine"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model.fp8=e5m2", TE],
            "model.fp8 must be null (no FP8) or one of ['hybrid', 'e4m3'], got 'e5m2'",
        ),
        (
            [TE, "model.fp8=hybrid", "model.fp8_recipe=custom"],
            "model.fp8_recipe must be one of ['delayed', 'tensorwise', 'blockwise', 'mxfp8'], "
            "got 'custom'",
        ),
        (
            ["model.fp8=hybrid"],
            "model.fp8=hybrid needs model.transformer_impl=transformer_engine (FP8 GEMMs are "
            "Transformer Engine's), got model.transformer_impl=local",
        ),
        (
            [TE, "model.fp8=e4m3", "train.precision=fp32"],
            "model.fp8=e4m3 needs bf16 training (FP8 GEMMs inside bf16 layers, as Megatron's "
            "--fp8-format with --bf16), got train.precision=fp32",
        ),
        (
            [TE, "model.fp8=hybrid", "model.seq_length=500", "train.micro_batch_size=1"],
            "tokens per rank (train.micro_batch_size x model.seq_length / context parallel) = "
            "500 (not a multiple of 8)",
        ),
        (
            [TE, "model.fp8=hybrid", "model.hidden_size=136", "model.num_attention_heads=4"],
            "model.hidden_size = 136 (not a multiple of 16)",
        ),
        (
            [
                TE,
                "model.fp8=hybrid",
                "parallel.tensor_model_parallel_size=2",
                "parallel.sequence_parallel=true",
                "model.seq_length=524",
                "train.micro_batch_size=1",
            ],
            "/ tensor parallel) = 262 (not a multiple of 8)",
        ),
    ],
)
def test_fp8_errors_name_the_setting_and_the_allowed_values(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_fp8_is_refused_where_it_cannot_run(monkeypatch):
    """The machine-dependent FP8 checks (trainer start-up, before any process group): CPU mode,
    fp32, TE missing, and a GPU whose TE build lacks the recipe."""
    import megatron_s2.specs
    from megatron_s2.training import parallel

    m = load_config(None, [TE, "model.fp8=hybrid"]).model
    parallel.check_fp8(load_config().model, gpu=False, bf16=False)  # no FP8: nothing to check
    with pytest.raises(ConfigError, match=r"model\.fp8=hybrid .* needs a CUDA GPU .* CPU mode"):
        parallel.check_fp8(m, gpu=False, bf16=False)
    with pytest.raises(ConfigError, match="needs bf16 training"):
        parallel.check_fp8(m, gpu=True, bf16=False)
    monkeypatch.setattr(megatron_s2.specs, "HAVE_TE", False)
    with pytest.raises(ConfigError, match="Transformer Engine is not installed here"):
        parallel.check_fp8(m, gpu=True, bf16=True)
    monkeypatch.setattr(megatron_s2.specs, "HAVE_TE", True)
    monkeypatch.setattr(parallel, "_te_fp8_support", lambda name: (False, f"no {name} here"))
    monkeypatch.setattr(parallel.torch.cuda, "get_device_name", lambda: "a test GPU")
    with pytest.raises(ConfigError, match=r"cannot run this recipe on this GPU \(a test GPU\): "):
        parallel.check_fp8(m, gpu=True, bf16=True)
    asked = []
    monkeypatch.setattr(parallel, "_te_fp8_support", lambda name: asked.append(name) or (True, ""))
    parallel.check_fp8(m, gpu=True, bf16=True)
    mx = load_config(None, [TE, "model.fp8=e4m3", "model.fp8_recipe=mxfp8"]).model
    parallel.check_fp8(mx, gpu=True, bf16=True)
    assert asked == ["fp8", "mxfp8"]


@pytest.mark.parametrize("fmt, recipe", [("hybrid", "delayed"), ("e4m3", "tensorwise")])
def test_fp8_maps_to_the_transformer_config(fmt, recipe):
    """model.fp8 / model.fp8_recipe become Megatron's TransformerConfig fields (what
    --fp8-format / --fp8-recipe set), attention stays bf16; without FP8 Megatron's defaults
    stay. Built on the CPU: the config itself needs no Transformer Engine."""
    from megatron_s2.training import parallel

    cfg = load_config(None, [TE, f"model.fp8={fmt}", f"model.fp8_recipe={recipe}"])
    assert parallel.fp8_kwargs(cfg.model) == {
        "fp8": fmt,
        "fp8_recipe": recipe,
        "fp8_dot_product_attention": False,
        "fp8_multi_head_attention": False,
    }
    config = parallel.transformer_config(cfg.model, cfg.parallel, cfg.schedule(), bf16=True)
    assert config.fp8 == fmt and config.fp8_recipe == recipe
    assert not config.fp8_dot_product_attention and not config.fp8_multi_head_attention
    plain = load_config()
    assert parallel.fp8_kwargs(plain.model) == {}
    config = parallel.transformer_config(plain.model, plain.parallel, plain.schedule(), bf16=False)
    assert config.fp8 is None


def test_fp8_may_change_on_resume():
    """Like Megatron-LM (--fp8-format is not among the arguments a checkpoint pins), FP8 is how
    a run executes: a resume may switch it on or off; the difference is printed."""
    from megatron_s2.training.run_config import resume_changes

    old = load_config(None, [TE]).to_dict()
    new = load_config(None, [TE, "model.fp8=hybrid", "model.fp8_recipe=tensorwise"])
    changes = resume_changes(old, new, own=True)
    assert not changes.refused and not changes.plan
    assert {c.key for c in changes.other} == {"model.fp8", "model.fp8_recipe"}
    # A checkpoint written before the keys existed: not compared, nothing refused.
    del old["model"]["fp8"], old["model"]["fp8_recipe"]
    assert not resume_changes(old, new, own=True).refused


def test_deterministic_maps_to_megatrons_deterministic_mode_and_may_change_on_resume():
    """train.deterministic becomes Megatron's deterministic_mode (what --deterministic-mode
    sets: FA4's deterministic backward, the embedding's); off by default. Like Megatron-LM's
    flag it is how a run executes, so a resume may switch it (the change is printed) and a
    checkpoint written before the key existed is not refused."""
    from megatron_s2.training import parallel
    from megatron_s2.training.run_config import resume_changes

    plain = load_config()
    assert plain.train.deterministic is False
    tc = parallel.transformer_config(plain.model, plain.parallel, plain.attention, bf16=False)
    assert tc.deterministic_mode is False
    det = load_config(None, ["train.deterministic=true"])
    tc = parallel.transformer_config(
        det.model, det.parallel, det.attention, bf16=False, deterministic=det.train.deterministic
    )
    assert tc.deterministic_mode is True
    old = plain.to_dict()
    changes = resume_changes(old, det, own=True)
    assert not changes.refused and not changes.plan
    assert [c.key for c in changes.other] == ["train.deterministic"]
    del old["train"]["deterministic"]
    assert not resume_changes(old, det, own=True).refused
    with pytest.raises(ConfigError, match="train.deterministic"):
        load_config(None, ["train.deterministic=sometimes"])


@pytest.mark.parametrize(
    "comm, expect", [("auto", None), ("all_gather", "all_gather"), ("a2a", "a2a")]
)
def test_cp_comm_type_maps_to_the_transformer_config(comm, expect):
    """parallel.cp_comm_type becomes Megatron's TransformerConfig.cp_comm_type (what
    --cp-comm-type sets); "auto" leaves Megatron's None, each layer kind's own default."""
    from megatron_s2.training import parallel

    cfg = load_config(None, ["parallel.context_parallel_size=2", f"parallel.cp_comm_type={comm}"])
    tc = parallel.transformer_config(cfg.model, cfg.parallel, cfg.attention, bf16=False)
    assert tc.cp_comm_type == expect


def test_schedule_is_parsed_once_per_config(monkeypatch):
    from megatron_s2.schedule import AttentionSchedule

    parsed = []
    from_dict = AttentionSchedule.from_dict.__func__

    def counting(cls, *args, **kwargs):
        parsed.append(1)
        return from_dict(cls, *args, **kwargs)

    monkeypatch.setattr(AttentionSchedule, "from_dict", classmethod(counting))
    cfg = load_config()
    first = cfg.schedule()
    assert cfg.schedule() is first and cfg.schedule() is first
    assert len(parsed) == 1
    # The cache is no setting: the config's mapping, equality and round trip do not see it.
    assert "_schedule_cache" not in cfg.to_dict()
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


def test_replaced_or_changed_config_parses_its_own_schedule():
    import copy
    import dataclasses
    import pickle

    cfg = load_config()
    sched = cfg.schedule()
    assert sched.layer_kinds(4) == ["dense", "S2", "dense", "S2"]
    # A copy made by dataclasses.replace with another attention schedule: its own schedule.
    dense = dataclasses.replace(cfg, attention=None)
    assert dense.schedule() is not sched and dense.schedule().layer_kinds(4) == ["dense"] * 4
    assert cfg.schedule() is sched  # the original keeps its own
    # A replace() copy with the same settings parses its own too (no shared state).
    assert dataclasses.replace(cfg).schedule() is not sched
    # Changed in place (as an override would): parsed again, and checked again.
    cfg.attention = {**cfg.attention, "s2": {**cfg.attention["s2"], "block_size": 32}}
    assert cfg.schedule() is not sched and cfg.schedule().block_sizes(4) == [32]
    cfg.model.seq_length = 528  # 16 divides it, 32 does not: the new schedule refuses it
    with pytest.raises(ConfigError, match=r"block_size \(32\) must divide"):
        cfg.schedule()
    cfg.model.seq_length = 512
    again = cfg.schedule()
    cfg.parallel.context_parallel_size = 2
    assert cfg.schedule() is not again  # the CP rule depends on the layout
    cfg.parallel.context_parallel_size = 1
    # Copies and pickles leave the parsed schedule behind; they parse their own.
    for other in (copy.copy(cfg), copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert "_schedule_cache" not in vars(other)
        assert other == cfg and other.schedule().block_sizes(4) == [32]


def test_unknown_key_with_a_colon_says_yaml_needs_a_space():
    import yaml

    with pytest.raises(ConfigError, match=r"YAML needs a space after ':'.*write \{lr: 1e-4\}"):
        RunConfig.from_dict({"optimizer": yaml.safe_load("{lr:1e-4}")})
    with pytest.raises(ConfigError) as e:
        RunConfig.from_dict({"optimizer": {"lrr": 1e-4}})
    assert "YAML" not in str(e.value)
