"""Model-FLOPs accounting and the metrics files (no training)."""

import os

import pytest

from megatron_s2.training.metrics import (
    MetricsLogger,
    model_flops_per_iteration,
    plot_loss_curve,
    read_jsonl,
)
from megatron_s2.training.run_config import load_config

CONFIGS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs"
)


def test_flops_dense_matches_the_textbook_formula():
    cfg = load_config(os.path.join(CONFIGS, "gpt-125m-dense.yaml"))
    m, V = cfg.model, 384
    h, L, s, B = m.hidden_size, m.num_layers, m.seq_length, cfg.train.global_batch_size
    tokens = B * s
    # SwiGLU MLP (3 h x 4h matrices), QKV + output projections, LM head; fwd+bwd = 3x fwd.
    matmul = 2 * tokens * (L * (4 * h * h + 3 * h * 4 * h) + h * V)
    attn = B * 4 * (h // m.num_attention_heads) * m.num_attention_heads * L * s * (s + 1) // 2
    flops = model_flops_per_iteration(m, cfg.train.global_batch_size, V, cfg.schedule())
    assert flops == pytest.approx(3 * (matmul + attn))


def test_flops_count_s2_layers_at_their_density():
    dense = load_config(os.path.join(CONFIGS, "gpt-125m-dense.yaml"))
    s2 = load_config(os.path.join(CONFIGS, "gpt-125m-s2.yaml"))

    def flops(cfg):
        return model_flops_per_iteration(
            cfg.model, cfg.train.global_batch_size, 384, cfg.schedule()
        )

    fd, fs = flops(dense), flops(s2)
    m = s2.model

    def pairs(cfg):
        return sum(
            cfg.schedule().attention_pairs(m.num_layers, m.num_attention_heads, None, m.seq_length)
        )

    pairs_dense, pairs_s2 = pairs(dense), pairs(s2)
    assert pairs_s2 < pairs_dense
    d = m.hidden_size // m.num_attention_heads
    batch = s2.train.global_batch_size
    assert fd - fs == pytest.approx(3 * batch * 4 * d * (pairs_dense - pairs_s2))


def test_metrics_logger_resume_truncates_and_plots(tmp_path):
    log = MetricsLogger(str(tmp_path), 10, 0, enabled=True, progress_bar=False, tensorboard=False)
    for i in range(1, 7):
        log.log({"iteration": i, "loss": 5.0 - i * 0.1})
    log.log({"iteration": 5, "loss": 4.0}, prefix="valid")
    log.close()
    # A restart from the iteration-4 checkpoint drops the records of iterations 5-6.
    log = MetricsLogger(str(tmp_path), 10, 4, enabled=True, progress_bar=False, tensorboard=False)
    log.log({"iteration": 5, "loss": 1.0})
    log.close()
    recs = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [(r["kind"], r["iteration"]) for r in recs] == [("train", i) for i in range(1, 6)]
    assert recs[-1]["loss"] == 1.0
    png = str(tmp_path / "l.png")
    assert plot_loss_curve(str(tmp_path / "metrics.jsonl"), png) == png
    assert (tmp_path / "l.png").stat().st_size > 0


def test_disabled_logger_writes_nothing(tmp_path):
    log = MetricsLogger(str(tmp_path / "x"), 10, 0, enabled=False)
    log.log({"iteration": 1, "loss": 1.0})
    log.print("hello")
    log.close()
    assert not (tmp_path / "x").exists()
