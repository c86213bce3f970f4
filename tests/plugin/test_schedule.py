"""AttentionSchedule: parsing, per-layer resolution, validation messages, reports."""

import glob
import os

import pytest

from megatron_s2.schedule import SCHEDULE_ENV_VAR, AttentionSchedule, ScheduleError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HYBRID = {
    "s2": {"block_size": 16, "local_blocks": 2, "vert_stride": 8, "head_offset": 1},
    "dense_layers": {"pattern": "SD", "indices": [0]},
    "overrides": {2: {"vert_stride": 4}, "-2": {"num_dense_heads": 2}},
}


def test_layer_kinds_pattern_indices_and_negative():
    s = AttentionSchedule.from_dict(HYBRID)
    assert s.layer_kinds(6) == ["dense", "dense", "S2", "dense", "S2", "dense"]
    s2 = AttentionSchedule.from_dict({"dense_layers": {"indices": [-1, 2]}})
    assert s2.dense_layer_indices(5) == [2, 4]
    assert AttentionSchedule.from_dict({}).layer_kinds(3) == ["S2"] * 3
    assert AttentionSchedule.all_dense().layer_kinds(2) == ["dense", "dense"]


def test_layer_pattern_uses_one_based_megatron_numbers_and_overrides():
    s = AttentionSchedule.from_dict(HYBRID)
    assert s.layer_pattern(1, 8, 4, num_layers=6) is None  # 0-based layer 0: dense
    p = s.layer_pattern(3, 8, 4, num_layers=6)  # 0-based layer 2
    assert (p.vert_stride, p.head_offset, p.block_size) == (4, 1, 16)
    p = s.layer_pattern(5, 8, 4, num_layers=6)  # layer 4 == -2
    assert (p.vert_stride, p.num_dense_heads) == (8, 2)
    with pytest.raises(ScheduleError, match="layer_number 7"):
        s.layer_pattern(7, 8, 4, num_layers=6)


def test_roundtrip():
    s = AttentionSchedule.from_dict(HYBRID)
    again = AttentionSchedule.from_dict(s.to_dict())
    assert again.to_dict() == s.to_dict()
    assert again.layer_kinds(6) == s.layer_kinds(6)


@pytest.mark.parametrize(
    "d, match",
    [
        ({"s2": {"vert_stride": 0}}, r"attention\.s2\.vert_stride must be an integer >= 1, got 0"),
        ({"s2": {"local_blocks": -1}}, r"attention\.s2\.local_blocks"),
        ({"s2": {"block_size": 48}}, r"attention\.s2\.block_size must be one of"),
        ({"s2": {"homo_head": "yes"}}, r"attention\.s2\.homo_head"),
        ({"s2": {"head_offset": 1.5}}, r"attention\.s2\.head_offset"),
        ({"s2": {"stride": 4}}, r"unknown key attention\.s2\.stride"),
        ({"layers": {}}, r"unknown key attention\.layers"),
        ({"dense_layers": {"every": 2}}, r"unknown key attention\.dense_layers\.every"),
        ({"dense_layers": {"pattern": "SX"}}, r"attention\.dense_layers\.pattern"),
        ({"dense_layers": {"indices": "0,1"}}, r"attention\.dense_layers\.indices"),
        ({"overrides": {"first": {}}}, r"attention\.overrides key 'first'"),
        ({"overrides": {1: {"vert_stride": 0}}}, r"attention\.overrides\.1\.vert_stride"),
        ({"overrides": {1: {"nope": 1}}}, r"unknown key attention\.overrides\.1\.nope"),
        ("s2", r"attention must be a mapping"),
    ],
)
def test_parse_errors_name_the_key(d, match):
    with pytest.raises(ScheduleError, match=match):
        AttentionSchedule.from_dict(d)


@pytest.mark.parametrize(
    "d, kw, match",
    [
        ({"dense_layers": {"indices": [4]}}, {}, r"attention\.dense_layers\.indices.*out of range"),
        ({"overrides": {-5: {"vert_stride": 2}}}, {}, r"attention\.overrides.*out of range"),
        (
            {"dense_layers": {"indices": [1]}, "overrides": {1: {"vert_stride": 2}}},
            {},
            r"attention\.overrides\.1: layer 1 is a dense layer",
        ),
        ({"dense_layers": {"pattern": "SDSDS"}}, {}, r"attention\.dense_layers\.pattern.*longer"),
        ({}, {"tensor_model_parallel_size": 3}, r"num_attention_heads \(8\) must be divisible"),
        (
            {},
            {"num_attention_heads": 24, "num_query_groups": 3, "tensor_model_parallel_size": 8},
            r"num_query_groups \(3\).*split across TP",
        ),
        (
            {},
            {"num_query_groups": 6, "num_attention_heads": 12, "tensor_model_parallel_size": 4},
            r"num_query_groups \(6\).*split across TP",
        ),
        ({"s2": {"num_dense_heads": 3}}, {}, r"attention\.s2 \(layer 0\).*num_dense_heads"),
        ({"overrides": {2: {"num_dense_heads": 3}}}, {}, r"attention\.overrides\.2 \(layer 2\)"),
        (
            {"s2": {"block_size": 64}},
            {"seq_length": 96},
            r"attention\.s2\.block_size \(64\) must divide",
        ),
    ],
)
def test_validate_errors_name_the_key(d, kw, match):
    args = dict(
        num_layers=4,
        num_attention_heads=8,
        num_query_groups=4,
        tensor_model_parallel_size=1,
        seq_length=None,
    )
    args.update(kw)
    with pytest.raises(ScheduleError, match=match):
        AttentionSchedule.from_dict(d).validate(**args)


def test_validate_accepts_replicated_gqa_groups():
    # 2 KV groups on TP=4: Megatron replicates each group on 2 ranks; no group is split.
    AttentionSchedule.from_dict({}).validate(4, 8, 2, 4, 128)


def test_summary_and_attention_pairs():
    s = AttentionSchedule.from_dict(HYBRID)
    pairs = s.attention_pairs(6, 8, 4, 256)
    causal = 256 * 257 // 2 * 8
    assert pairs[0] == causal and pairs[2] < causal
    table = s.summary(6, 8, 4, 256)
    lines = table.splitlines()
    assert "density@256" in lines[0]
    assert len([line for line in lines[2:-1] if line.split()[1] == "dense"]) == 4
    assert "model attention density" in lines[-1]


@pytest.mark.parametrize(
    "path", sorted(glob.glob(os.path.join(REPO, "configs", "attention", "*.yaml")))
)
def test_shipped_schedules_are_valid(path):
    s = AttentionSchedule.from_yaml(path)
    s.validate(32, 32, 8, 2, 8192)
    assert s.source == path


def test_shipped_examples_exist():
    names = {
        os.path.basename(p) for p in glob.glob(os.path.join(REPO, "configs", "attention", "*.yaml"))
    }
    assert {
        "phi3_small.yaml",
        "all_s2.yaml",
        "ablation_overrides.yaml",
        "retrieval_levers.yaml",
    } <= names
    levers = AttentionSchedule.from_yaml(
        os.path.join(REPO, "configs", "attention", "retrieval_levers.yaml")
    )
    assert levers.sinks and levers.layer_position(3, 8) == ("nope", None)
    assert levers.layer_position(0, 8) == ("rope", None)
    phi3 = AttentionSchedule.from_yaml(
        os.path.join(REPO, "configs", "attention", "phi3_small.yaml")
    )
    assert phi3.layer_kinds(4) == ["S2", "dense", "S2", "dense"]
    assert phi3.s2["head_offset"] == 1


def test_env_var(tmp_path, monkeypatch):
    f = tmp_path / "sched.yaml"
    f.write_text("s2: {block_size: 32, vert_stride: 4}\ndense_layers: {indices: [0]}\n")
    monkeypatch.setenv(SCHEDULE_ENV_VAR, str(f))
    s = AttentionSchedule.from_env()
    assert s.s2["block_size"] == 32 and s.layer_kinds(2) == ["dense", "S2"]
    monkeypatch.setenv(SCHEDULE_ENV_VAR, str(tmp_path / "missing.yaml"))
    with pytest.raises(ScheduleError, match=SCHEDULE_ENV_VAR):
        AttentionSchedule.from_env()
    monkeypatch.delenv(SCHEDULE_ENV_VAR)
    assert AttentionSchedule.from_env() is None


# ---------------------------------------------------------------------- union coverage at build
def test_coverage_holes_are_an_error_naming_layer_and_settings():
    # 32 heads, stride 64: head_step 2 gives 32 of 64 phases, so every other block is unseen.
    s = AttentionSchedule.from_dict({"s2": {"vert_stride": 64}, "dense_layers": {"indices": [0]}})
    with pytest.raises(
        ScheduleError,
        match=r"attention\.s2 \(layer 1\).*1016 of 2048 key blocks "
        r"unseen at 131072 tokens.*32 of 64 stripe phases"
        r".*allow_coverage_holes",
    ):
        s.validate(2, 32, 8, 1, 131072)
    # Without a training length: the same holes, found at a length where every phase shows.
    with pytest.raises(ScheduleError, match=r"32 of every 64 key blocks unseen"):
        AttentionSchedule.from_dict({"s2": {"vert_stride": 64}}).validate(2, 32, 8, 1)


@pytest.mark.parametrize(
    "heads, s2, fix",
    [
        (4, {"vert_stride": 8, "head_step": 2}, "vert_stride <= num_heads (4)"),
        (4, {"vert_stride": 8, "head_step": 1}, "vert_stride <= num_heads (4)"),
        (8, {"vert_stride": 8, "head_step": 2}, "head_step=1"),
        (8, {"vert_stride": 4, "homo_head": True}, "homo_head: false"),
        (
            8,
            {"vert_stride": 8, "head_step": 2, "homo_head": True},
            "head_step=1 with homo_head: false",
        ),
    ],
)
def test_coverage_error_offers_only_fixes_that_close_the_holes(heads, s2, fix):
    """The coverage error's advice is what closes the holes of this layer: head_step=1 is not
    offered where there are fewer heads than stripe phases (it was, even with head_step=1 set);
    applying the offered head/stride fix validates."""
    cfg = {"s2": dict(s2), "dense_layers": {"indices": [0]}}
    with pytest.raises(ScheduleError) as err:
        AttentionSchedule.from_dict(cfg).validate(2, heads, heads, 1, 4096)
    message = str(err.value)
    assert (
        f"Use {fix}, dense heads (num_dense_heads), or set attention.allow_coverage_holes"
        in message
    )
    if "vert_stride <=" in fix:
        assert "Use head_step=1" not in message
        cfg["s2"]["vert_stride"] = heads
        cfg["s2"]["head_step"] = 1
    else:
        cfg["s2"]["head_step"] = 1
        cfg["s2"]["homo_head"] = False
    AttentionSchedule.from_dict(cfg).validate(2, heads, heads, 1, 4096)


def test_coverage_holes_in_an_override_name_the_override():
    s = AttentionSchedule.from_dict({"overrides": {1: {"homo_head": True}}})
    with pytest.raises(ScheduleError, match=r"attention\.overrides\.1 \(layer 1\).*homo_head"):
        s.validate(2, 8, 4, 1, 4096)


def test_coverage_holes_allowed_when_the_schedule_says_so_and_shown_in_the_table():
    d = {
        "s2": {"block_size": 16, "local_blocks": 2, "vert_stride": 16},
        "allow_coverage_holes": True,
    }
    s = AttentionSchedule.from_dict(d)
    s.validate(2, 8, 4, 1, 1024)  # 8 heads, stride 16: half the phases
    row = s.summary(2, 8, 4, 1024).splitlines()[2]
    assert "31/64 unseen" in row  # odd blocks 1..61 (62, 63 lie in every later window)
    assert AttentionSchedule.from_dict(s.to_dict()).allow_coverage_holes
    with pytest.raises(ScheduleError, match="allow_coverage_holes must be true or false"):
        AttentionSchedule.from_dict({"allow_coverage_holes": "yes"})


def test_short_training_length_has_no_holes_inside_the_local_window():
    # At 2 blocks of 16 with local 2 every key block is in every later query's window.
    AttentionSchedule.from_dict(
        {"s2": {"block_size": 16, "local_blocks": 2, "vert_stride": 64}}
    ).validate(1, 8, 4, 1, 32)


def test_full_coverage_shown_in_the_table():
    table = AttentionSchedule.from_dict(HYBRID).summary(6, 8, 4, 256)
    assert "coverage" in table.splitlines()[0]
    assert all(line.split()[9] == "full" for line in table.splitlines()[2:-1])


def test_schedule_keys_are_the_pattern_settings():
    from s2attn import S2Pattern

    assert set(AttentionSchedule().s2) == set(S2Pattern.setting_names())
    p = AttentionSchedule.from_dict({"s2": {"head_step": 2, "homo_head": False}}).layer_pattern(
        1, 8, 4, num_layers=1
    )
    assert p.settings() == {**AttentionSchedule().s2, "head_step": 2}


@pytest.mark.parametrize(
    "text, key",
    [
        ("{s2: {vert_stride:16}}", "vert_stride"),
        ("{dense_layers: {pattern:DS}}", "pattern"),
    ],
)
def test_unknown_key_with_a_colon_says_yaml_needs_a_space(text, key):
    # A flow mapping typed without a space after ':' is one key to YAML; the message says so.
    import yaml

    with pytest.raises(ScheduleError, match=rf"YAML needs a space after ':'.*write \{{{key}: "):
        AttentionSchedule.from_dict(yaml.safe_load(text))
    # An unknown key without a colon gets no such hint.
    with pytest.raises(ScheduleError) as e:
        AttentionSchedule.from_dict({"s2": {"vert_strid": 16}})
    assert "YAML" not in str(e.value)
