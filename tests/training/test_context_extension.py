"""Context extension through the trainer (CPU): a dense model trained at 128 tokens continues at
512 tokens as an S2 hybrid with a new RoPE base and RoPE scaling, from its weights, at iteration
0 with a fresh LR schedule (``checkpoint.reset_iteration``)."""

import os

import pytest

from tests.training.test_trainer import run_trainer

DENSE = "attention={dense_layers: {pattern: D}}"


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, demo_dir):
    """A dense run at 128 tokens, 4 iterations, checkpoint at the end."""
    tmp = tmp_path_factory.mktemp("short")
    run_trainer(
        tmp, demo_dir, DENSE, "train.train_iters=4", "checkpoint.save_at_end=true", name="short"
    )
    return tmp / "short" / "checkpoints"


@pytest.mark.parametrize("scaling", ["position_interpolation", "llama3"])
def test_dense_128_to_s2_hybrid_512_with_new_rope(
    tmp_path,
    demo_dir,
    short_run,
    scaling,
):
    proc, recs = run_trainer(
        tmp_path,
        demo_dir,
        "model.seq_length=512",
        "model.rotary_base=100000",
        f"model.rope_scaling={scaling}",
        "model.rope_scaling_factor=4",
        "attention.dense_layers.pattern=DS",
        f"checkpoint.load_dir={short_run}",
        "checkpoint.reset_iteration=true",
        "checkpoint.load_optimizer=false",
        "train.train_iters=3",
        "checkpoint.save_at_end=true",
        name="long",
    )
    out = proc.stdout + proc.stderr
    assert "starting at iteration 0 from the weights of" in out
    # The settings that change what the weights mean are listed, and applied.
    for key in ("model.seq_length", "model.rotary_base", "model.rope_scaling", "attention"):
        assert key in out, key
    assert sorted(recs) == [1, 2, 3]
    # A fresh schedule: warm-up from the first step again (lr_warmup_iters=2 in the tests).
    assert recs[1]["lr"] < recs[2]["lr"]
    # The extended run's checkpoint holds iteration 3 of its own count and the new settings.
    tracker = tmp_path / "long" / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() == "3"


def test_weights_carry_over(tmp_path, demo_dir, short_run):
    """Starting from the short run's weights gives a lower first loss than a fresh model at the
    same settings: the weights (not only the shapes) were loaded."""
    common = ["model.seq_length=256", "train.train_iters=3", DENSE]
    _, fresh = run_trainer(tmp_path, demo_dir, *common, name="fresh")
    _, loaded = run_trainer(
        tmp_path,
        demo_dir,
        *common,
        f"checkpoint.load_dir={short_run}",
        "checkpoint.reset_iteration=true",
        name="loaded",
    )
    assert loaded[1]["loss"] < fresh[1]["loss"] - 0.05, (loaded[1], fresh[1])


def test_keep_iteration_continues_the_schedule(tmp_path, demo_dir, short_run):
    proc, recs = run_trainer(
        tmp_path,
        demo_dir,
        DENSE,
        "model.seq_length=256",
        f"checkpoint.load_dir={short_run}",
        "train.train_iters=6",
        name="kept",
    )
    assert "resumed from" in proc.stdout
    assert sorted(recs) == [5, 6]


def test_bad_rope_scaling_is_a_config_error(tmp_path, demo_dir):
    proc, _ = run_trainer(tmp_path, demo_dir, "model.rope_scaling=yarn", check=False, name="bad")
    assert proc.returncode == 2
    assert "model.rope_scaling" in proc.stderr and "position_interpolation" in proc.stderr
    proc, _ = run_trainer(
        tmp_path,
        demo_dir,
        "model.rope_scaling=llama3",
        "model.rope_scaling_factor=1",
        check=False,
        name="bad2",
    )
    assert proc.returncode == 2 and "model.rope_scaling_factor must be > 1" in proc.stderr


def test_preempted_extension_resumes_its_own_optimizer_and_schedule(
    tmp_path,
    demo_dir,
    short_run,
):
    """checkpoint.load_optimizer=false (the recipes' setting) applies to the start from
    load_dir only: an extension run stopped by SIGTERM resumes from its own checkpoint with its
    Adam state and LR schedule, so the losses and learning rates continue those of the
    uninterrupted run (and do not restart the warm-up)."""
    start = [
        "model.seq_length=256",
        "attention.dense_layers.pattern=DS",
        f"checkpoint.load_dir={short_run}",
        "checkpoint.reset_iteration=true",
        "checkpoint.load_optimizer=false",
        "train.train_iters=5",
    ]
    _, whole = run_trainer(tmp_path, demo_dir, *start, name="whole")
    proc, _ = run_trainer(tmp_path, demo_dir, *start, "debug.sigterm_at_iter=3", name="split")
    assert "saved checkpoint" in proc.stdout + proc.stderr
    proc, resumed = run_trainer(tmp_path, demo_dir, *start, name="split")
    assert "resum" in proc.stdout + proc.stderr
    for it in (4, 5):
        assert resumed[it]["lr"] == pytest.approx(whole[it]["lr"], rel=1e-6), it
        assert resumed[it]["loss"] == pytest.approx(whole[it]["loss"], rel=1e-5), it


_BF16_START_SCRIPT = """
import sys

import torch

from megatron_s2.training.cpu_mode import enable_cpu_mode

enable_cpu_mode()
sys.path.insert(0, ".")  # the working directory is the repository root: tests.helpers
from tests.helpers.megatron import TINY_SCHEDULE, init_single_process, tiny_s2_config  # noqa: E402

from megatron_s2.model import build_gpt_model  # noqa: E402
from megatron_s2.training.checkpointing import load_checkpoint, save_checkpoint  # noqa: E402
from megatron_s2.training.parallel import build_optimizer, wrap_model_chunks  # noqa: E402
from megatron_s2.training.run_config import OptimizerConfig, ParallelConfig  # noqa: E402

parallel = ParallelConfig()
config = None


def build(seed):
    torch.manual_seed(seed)
    model = wrap_model_chunks([build_gpt_model(config, 128, 64)], config, parallel, bf16=True)
    opt, sched = build_optimizer(
        OptimizerConfig(weight_decay=0.0, lr_warmup_iters=1), parallel, model, bf16=True,
        train_iters=10,
    )
    return model, opt, sched


def weights(model):
    return [p.detach().clone() for p in model[0].parameters()]


def zero_grad_step(model, opt):
    # Zero gradients, no weight decay: Adam's update is 0, so afterwards the weights are
    # whatever the optimizer's fp32 main copy holds.
    model[0].zero_grad_buffer()
    opt.zero_grad()
    ok, _, _ = opt.step()
    assert ok


def main():
    global config
    init_single_process()
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = tiny_s2_config(TINY_SCHEDULE, bf16=True, params_dtype=torch.bfloat16)
    model, opt, sched = build(0)
    zero_grad_step(model, opt)  # Adam state to save
    saved = weights(model)
    save_checkpoint(sys.argv[1], 5, model, opt, sched, consumed_samples=0, config={})
    model, opt, sched = build(1)
    assert any(not torch.equal(a, b) for a, b in zip(saved, weights(model))), "same init"
    load_checkpoint(sys.argv[1], model, opt, sched, load_optimizer=False)
    zero_grad_step(model, opt)
    for a, b in zip(saved, weights(model)):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    print("ok")


# The checkpoint writer starts worker processes: the script must be importable.
if __name__ == "__main__":
    main()
"""


def test_bf16_start_from_weights_keeps_them_through_the_first_step(tmp_path):
    """checkpoint.load_optimizer=false with bf16 parameters (every GPU run): the optimizer's
    fp32 main weights are refreshed from the loaded model, so its first step does not write the
    fresh model's random initialization back (this happened on the GPU: a 4k -> 16k extension
    went from loss 3.6 at iteration 1 to 8.9 at 15). Megatron's bf16 optimizer on the CPU."""
    import subprocess
    import sys

    from tests.helpers.megatron import REPO

    script = tmp_path / "bf16_start.py"
    script.write_text(_BF16_START_SCRIPT)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
