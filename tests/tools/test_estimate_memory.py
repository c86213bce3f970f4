"""tools/estimate_memory.py: the calibration point and how the layout divides memory."""

import os

import pytest

from megatron_s2.training.run_config import load_config
from tests.helpers.megatron import import_tool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "gpt-125m-s2.yaml")
tool = import_tool("estimate_memory")


def _estimate(overrides=(), gpus=1, vocab=384):
    return tool.estimate(load_config(CONFIG, list(overrides)), gpus, vocab)


def test_reproduces_the_measured_125m_run():
    # docs/notebook/2026-11-benchmarks-training-multi-gpu.md: the 125M hybrid at 8k, micro
    # batch 2, bf16, one H100: 10.7 GiB.
    assert _estimate().total == pytest.approx(10.7, rel=0.05)


@pytest.mark.parametrize(
    "config, gpus, overrides, measured",
    [
        # docs/quality.md: the 125M model on the code corpus at 4k, micro batch 8, one H100.
        (
            "gpt-125m-s2.yaml",
            1,
            ["model.seq_length=4096", "train.micro_batch_size=8", "train.global_batch_size=32"],
            25.8,
        ),
        # docs/context_parallel.md: the 1.3B hybrid at 128k, full recompute, one and two H200s.
        ("gpt-1.3b-s2.yaml", 1, [], 66.7),
        ("gpt-1.3b-s2.yaml", 2, ["parallel.context_parallel_size=2"], 38.3),
    ],
)
def test_reproduces_the_measured_runs_with_a_32k_vocabulary(config, gpus, overrides, measured):
    if config == "gpt-1.3b-s2.yaml":
        overrides = [
            "model.seq_length=131072",
            "model.recompute=full",
            "train.global_batch_size=1",
            "train.train_iters=8",
            "optimizer.lr_warmup_iters=2",
            *overrides,
        ]
    cfg = load_config(os.path.join(REPO, "configs", config), overrides)
    assert tool.estimate(cfg, gpus, 32768).total == pytest.approx(measured, rel=0.08)


def test_layouts_divide_what_they_shard():
    base = _estimate(["model.seq_length=32768", "train.micro_batch_size=1"], gpus=2)
    cp = _estimate(
        ["model.seq_length=32768", "train.micro_batch_size=1", "parallel.context_parallel_size=2"],
        gpus=2,
    )
    tp = _estimate(
        [
            "model.seq_length=32768",
            "train.micro_batch_size=1",
            "parallel.tensor_model_parallel_size=2",
            "parallel.sequence_parallel=true",
        ],
        gpus=2,
    )
    assert cp.activations == pytest.approx(base.activations / 2)
    assert cp.weights == base.weights
    assert cp.cp_kv > 0 and base.cp_kv == 0
    assert tp.weights == pytest.approx(base.weights / 2, rel=0.01)
    assert tp.logits == pytest.approx(base.logits / 2)
    full = _estimate(["model.seq_length=32768", "model.recompute=full"])
    assert full.activations < _estimate(["model.seq_length=32768"]).activations / 4


def test_cli_prints_the_total(capsys):
    assert tool.main(["--config", CONFIG, "--gpus", "1"]) == 0
    assert "GiB" in capsys.readouterr().out
