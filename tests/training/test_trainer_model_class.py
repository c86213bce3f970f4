"""The trainer's model class (``model.model_class``: gpt | hybrid | auto) on the CPU.

megatron-core 0.19.2: a run on ``HybridModel`` (the ``"*-" * N`` twin of the GPT model) gives the
GPT run's losses for the same config and seed, with a dense and an S2 hybrid schedule, and resumes
from its own checkpoints and from the GPT model's (and back). megatron-core 0.16.1 has no
``HybridModel``: there ``model.model_class=hybrid`` is refused when the config is loaded.
"""

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

from megatron_s2.training.run_config import ConfigError, load_config
from tests.training.test_trainer import TINY  # the same tiny model as the trainer tests

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "configs", "demo.yaml")

# megatron-core's version from its package metadata: the test file is collected without
# importing megatron (the run-config tests below need none).
CORE = tuple(int(x) for x in metadata.version("megatron-core").split(".")[:2])
HAS_HYBRID = CORE >= (0, 19)
needs_hybrid = pytest.mark.skipif(not HAS_HYBRID, reason="megatron-core < 0.19: no HybridModel")

# The losses of the two classes were bit-identical when this was written (the same parameters
# in the same order from the same RNG draws, the same ops); the tolerance leaves room for a
# summation order that a future megatron-core might change, far below a step's loss change.
LOSS_TOLERANCE = 1e-5

# Layer 0 dense, layer 1 S2 (the demo's "DS"); and every layer dense.
SCHEDULES = {"s2": [], "dense": ["attention.dense_layers.pattern=D"]}


def _train(tmp_path, demo_dir, name, model_class, *overrides):
    """Run the trainer CLI in a subprocess; return (stdout + stderr, {iteration: loss})."""
    run_dir = tmp_path / name
    cmd = [sys.executable, "-m", "megatron_s2.training", "--config", DEMO]
    cmd += [f"name={name}", f"logging.run_dir={run_dir}", f"data.demo_dir={demo_dir}"]
    cmd += [f"data.cache_dir={tmp_path / 'cache'}", f"model.model_class={model_class}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # The trainer's CPU mode runs the PyTorch reference attention, not the Triton interpreter.
    env.pop("TRITON_INTERPRET", None)
    env.pop("RANK", None)
    proc = subprocess.run(
        cmd + TINY + list(overrides),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    losses = {}
    with open(run_dir / "metrics.jsonl") as f:
        for record in map(json.loads, filter(str.strip, f)):
            if record["kind"] == "train":  # a resumed run appends: the last record counts
                losses[record["iteration"]] = record["loss"]
    return out, losses


def _assert_same_losses(got: dict, want: dict, iterations) -> None:
    for i in iterations:
        assert got[i] == pytest.approx(want[i], abs=LOSS_TOLERANCE), (i, got, want)


# ---------------------------------------------------------------------------- run config
def test_unknown_model_class_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"model.model_class=transformer: 'transformer' is not"):
        load_config(None, ["model.model_class=transformer"])


@pytest.mark.skipif(HAS_HYBRID, reason="megatron-core >= 0.19 has HybridModel")
def test_hybrid_is_refused_on_megatron_core_without_hybrid_model(tmp_path):
    """0.16.1: the error names the setting, the allowed values and the version needed, when the
    config is loaded (the CLI exits 2 before anything is written)."""
    from megatron_s2.training import cli

    expected = (
        r"model.model_class=hybrid: HybridModel needs megatron-core >= 0\.19, the installed one "
        r"is 0\.16\.\d+; allowed: gpt, hybrid, auto \(gpt: GPTModel; hybrid: HybridModel, "
        r"megatron-core >= 0\.19; auto: hybrid where megatron-core has it, else gpt\)"
    )
    with pytest.raises(ConfigError, match=expected):
        load_config(None, ["model.model_class=hybrid"])
    run_dir = tmp_path / "run"
    code = cli.main(["model.model_class=hybrid", f"logging.run_dir={run_dir}"])
    assert code == cli.EXIT_CONFIG_ERROR and not run_dir.exists()
    # auto and gpt load.
    for value in ("auto", "gpt"):
        assert load_config(None, [f"model.model_class={value}"]).model.model_class == value


@needs_hybrid
def test_hybrid_with_llama3_rope_scaling_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"HybridModel does not support model.rope_scaling=lla"):
        load_config(None, ["model.model_class=hybrid", "model.rope_scaling=llama3"])


def test_auto_builds_hybrid_where_megatron_core_has_it():
    """The trainer's model config (``parallel.transformer_config``): auto is the hybrid twin on
    0.19+ (pattern "*-" per GPT layer, GPT checkpoint keys), GPT on 0.16; gpt stays GPT; Llama 3
    RoPE scaling, which only GPTModel has, keeps auto on GPT."""
    pytest.importorskip("megatron.core")
    from megatron_s2.training import parallel

    def built(*overrides):
        cfg = load_config(None, list(overrides))
        config = parallel.transformer_config(cfg.model, cfg.parallel, cfg.schedule(), bf16=False)
        return type(config).__name__, getattr(config, "hybrid_layer_pattern", None)

    hybrid = ("S2HybridTransformerConfig", "*-" * 4)
    assert built() == (hybrid if HAS_HYBRID else ("S2TransformerConfig", None))
    assert built("model.model_class=gpt") == ("S2TransformerConfig", None)
    assert built("model.rope_scaling=llama3", "model.rope_scaling_factor=2") == (
        "S2TransformerConfig",
        None,
    )


# ---------------------------------------------------------------------------- trainer runs
@needs_hybrid
@pytest.mark.slow
def test_dense_hybrid_run_has_the_gpt_runs_losses(tmp_path, demo_dir):
    _, gpt = _train(tmp_path, demo_dir, "gpt", "gpt", "train.train_iters=4", *SCHEDULES["dense"])
    _, hyb = _train(
        tmp_path, demo_dir, "hybrid", "hybrid", "train.train_iters=4", *SCHEDULES["dense"]
    )
    _assert_same_losses(hyb, gpt, range(1, 5))


@needs_hybrid
@pytest.mark.slow
def test_s2_hybrid_run_has_the_gpt_runs_losses_and_resumes_across_classes(tmp_path, demo_dir):
    """S2 schedule, 6 iterations. The GPT run uninterrupted; a hybrid run stopped at 3 (the
    SIGTERM hook saves) and resumed as hybrid; its iteration-3 checkpoint resumed as GPT; a GPT
    run stopped at 3 and resumed as hybrid. Every loss equals the uninterrupted GPT run's."""
    n, k = "train.train_iters=6", "debug.sigterm_at_iter=3"
    _, gpt = _train(tmp_path, demo_dir, "gpt", "gpt", n)

    _, first = _train(tmp_path, demo_dir, "hyb", "hybrid", n, k)
    assert sorted(first) == [1, 2, 3]
    out, resumed = _train(tmp_path, demo_dir, "hyb", "hybrid", n)
    assert "resumed from" in out
    _assert_same_losses(resumed, gpt, range(1, 7))

    # The same checkpoint (iteration 3: the resumed run saved nothing more) resumed on GPTModel.
    out, as_gpt = _train(tmp_path, demo_dir, "hyb", "gpt", n)
    assert "resumed from" in out and "model.model_class" in out  # the change is printed
    _assert_same_losses(as_gpt, gpt, range(4, 7))

    _train(tmp_path, demo_dir, "gpt_then_hybrid", "gpt", n, k)
    out, as_hybrid = _train(tmp_path, demo_dir, "gpt_then_hybrid", "hybrid", n)
    assert "resumed from" in out
    _assert_same_losses(as_hybrid, gpt, range(1, 7))
