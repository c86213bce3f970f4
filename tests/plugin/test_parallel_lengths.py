"""The sequence-length rules of the parallel layouts (megatron_s2.parallel_lengths): each rule,
its message (the setting and the allowed values), and that every caller applies the same rule."""

import pytest

from megatron_s2.parallel_lengths import (
    CONTEXT_PARALLEL,
    CONTEXT_PARALLEL_BLOCKS,
    PACKED_CONTEXT_PARALLEL,
    SEQUENCE_PARALLEL,
    ParallelLengthError,
    check_packed_sequences,
    check_parallel_lengths,
    context_parallel_unit,
)


def _fails(seq_length, **kw) -> ParallelLengthError:
    with pytest.raises(ParallelLengthError) as e:
        check_parallel_lengths(seq_length, **kw)
    assert isinstance(e.value, ValueError)  # callers that catch ValueError keep working
    return e.value


@pytest.mark.parametrize(
    "seq_length, kw",
    [
        (7, {}),  # no parallelism: any length
        (8, {"tp": 2, "sequence_parallel": True}),
        (7, {"tp": 2}),  # TP without sequence parallelism splits heads, not tokens
        (24, {"tp": 2, "cp": 2, "sequence_parallel": True}),
        (8, {"cp": 2}),
        (64, {"cp": 2, "block_sizes": [16]}),
        (384, {"cp": 2, "block_sizes": [16, 32, 48]}),
        (7, {"cp": 1, "block_sizes": [16]}),  # no CP split: the schedule checks the blocks
    ],
)
def test_lengths_the_layout_can_split_pass(seq_length, kw):
    check_parallel_lengths(seq_length, **kw)


def test_sequence_parallel_rule_names_both_sizes_and_the_multiple():
    e = _fails(10, tp=4, sequence_parallel=True)
    assert e.rule == SEQUENCE_PARALLEL and e.multiple == 4 and e.seq_length == 10
    assert "sequence_parallel: seq_length (10) must be a multiple of " in str(e)
    assert "tensor_model_parallel_size x context_parallel_size = 4" in str(e)
    # With CP the tokens of each CP rank are split again over the TP ranks: TP x CP.
    e = _fails(20, tp=4, cp=2, sequence_parallel=True)
    assert e.multiple == 8 and "= 8" in str(e)


def test_context_parallel_rule_names_the_size_and_the_multiple():
    e = _fails(6, cp=2)
    assert e.rule == CONTEXT_PARALLEL and e.multiple == 4 and e.context_parallel == 2
    assert str(e).startswith("context_parallel_size=2: seq_length (6) must be a multiple of ")
    assert "2 x context_parallel_size = 4" in str(e)


def test_block_rule_names_the_failing_block_size_and_the_multiple():
    e = _fails(64, cp=2, block_sizes=[16, 32], seq_name="s2_seq_length")
    assert e.rule == CONTEXT_PARALLEL_BLOCKS and e.multiple == 128 and e.block_sizes == (16, 32)
    text = str(e)
    assert text.startswith("context_parallel_size=2: s2_seq_length (64)")
    assert "chunks of 16 tokens" in text and "block_size (32)" in text  # 16 divides 16
    assert "(their least common multiple: 128)" in text
    e = _fails(80, cp=2, block_sizes=[16])
    assert "block_size (16)" in str(e) and str(e).endswith("x block_size = 64")


def test_rules_are_checked_in_order():
    # Fails all three: sequence parallelism is reported first, then the CP chunks.
    assert _fails(6, tp=4, cp=2, sequence_parallel=True, block_sizes=[16]).rule == (
        SEQUENCE_PARALLEL
    )
    assert _fails(6, tp=2, cp=2, block_sizes=[16]).rule == CONTEXT_PARALLEL


def test_where_prefixes_the_message():
    assert str(_fails(6, cp=2, where="S2CoreAttention")).startswith(
        "S2CoreAttention: context_parallel_size=2"
    )


def test_context_parallel_unit():
    assert context_parallel_unit(1) == 2
    assert context_parallel_unit(4) == 8
    assert context_parallel_unit(2, [16, 48]) == 192  # lcm(64, 192)


def test_packing_with_context_parallelism_is_refused():
    check_packed_sequences(1)
    with pytest.raises(ParallelLengthError) as e:
        check_packed_sequences(4, where="m")
    assert e.value.rule == PACKED_CONTEXT_PARALLEL and e.value.context_parallel == 4
    assert str(e.value).startswith("m: packed sequences (THD packed_seq_params) and ")
    assert "context_parallel_size=4 are not supported together yet" in str(e.value)
    assert "use context_parallel_size=1 or unpacked sequences" in str(e.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [
                "parallel.tensor_model_parallel_size=2",
                "parallel.sequence_parallel=true",
                "model.seq_length=513",
                "attention=null",
            ],
            "model.seq_length (513) must be divisible by tensor x context parallel size (2) "
            "with parallel.sequence_parallel",
        ),
        (
            ["parallel.context_parallel_size=4", "model.seq_length=516", "attention=null"],
            "model.seq_length (516) must be divisible by 2 x parallel.context_parallel_size (8)",
        ),
        (
            [
                "parallel.context_parallel_size=2",
                "train.pack_documents=true",
                "train.reset_position_ids=true",
            ],
            "train.pack_documents=true and parallel.context_parallel_size=2 are not supported "
            "together yet; set parallel.context_parallel_size=1 or train.pack_documents=false",
        ),
    ],
)
def test_run_config_states_the_rules_in_its_keys(overrides, message):
    from megatron_s2.training.run_config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_run_config_block_rule_waits_for_the_schedule():
    from megatron_s2.training.run_config import ConfigError, load_config

    # 2 x CP and the demo's block size (16) divide 528, 2 x CP x 16 does not: the schedule's
    # blocks decide, when it is parsed.
    cfg = load_config(None, ["parallel.context_parallel_size=2", "model.seq_length=528"])
    with pytest.raises(ConfigError) as e:
        cfg.schedule()
    assert "parallel.context_parallel_size (2) needs model.seq_length (528) to be a multiple" in (
        str(e.value)
    )
    assert "block sizes [16]" in str(e.value)


def test_model_config_applies_the_same_rules():
    """S2TransformerConfig raises the plugin's message, with its own name for the length."""
    from megatron_s2.config import S2TransformerConfig
    from megatron_s2.schedule import AttentionSchedule

    def config(schedule=None, **kw):
        return S2TransformerConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            s2_schedule=schedule or AttentionSchedule.from_dict({"s2": {"block_size": 16}}),
            use_cpu_initialization=True,
            **kw,
        )

    config(s2_seq_length=128, context_parallel_size=2)
    with pytest.raises(ParallelLengthError, match=r"context_parallel_size=2: s2_seq_length \(96\)"):
        config(s2_seq_length=96, context_parallel_size=2)
    with pytest.raises(ParallelLengthError, match=r"sequence_parallel: s2_seq_length \(130\)"):
        config(
            AttentionSchedule.all_dense(),  # dense: no block size to divide the length first
            s2_seq_length=130,
            tensor_model_parallel_size=4,
            sequence_parallel=True,
        )
