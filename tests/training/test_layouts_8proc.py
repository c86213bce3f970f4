"""The parallel layout of configs/extend/gpt-7b-s2-128k.yaml on 8 gloo processes (CPU, fp32).

The layout (TP, CP, PP, SP, distributed optimizer, recomputation) and the attention schedule's
shape (dense/S2 pattern, stripe phase) and the GQA head counts are read from the config; only the
width, depth and length are cut down so that 8 processes fit on 2 CPU cores. Runs:

- ``init``: one process, one step, saved: the weights every other run starts from (TP shards
  its random initialisation per rank, so two layouts would not start from the same model).
- ``single``: one process from ``init`` (fresh optimizer and LR schedule, as the config's
  ``checkpoint.reset_iteration`` / ``load_optimizer: false`` start does), uninterrupted.
- ``config``: the config's layout (TP4 x CP2) from ``init``; stopped by the SIGTERM hook after
  ``SAVED_AT`` steps with a checkpoint.
- ``config`` again, resumed from its own checkpoint under the swapped layout (TP and CP sizes
  exchanged, TP2 x CP4): its steps are the swapped layout's check against one process.
- ``single_resumed``: the ``config`` checkpoint resumed in one process.

Compared: the loss, gradient norm and learning rate rank 0 logs every step (fp32: layouts
differ only in the order of their sums).
"""

import json
import os
import sys

import pytest
import yaml

from tests.training.test_trainer import REPO, run_trainer

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.slow, pytest.mark.eight_processes]

CONFIG = os.path.join(REPO, "configs", "extend", "gpt-7b-s2-128k.yaml")
EIGHT_PROCESSES = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc-per-node",
    "8",
]
STEPS = 4
SAVED_AT = 2
# fp32 on the CPU: layouts differ only in the order of sums (all-reduces, sharded norms).
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-5


def _config():
    with open(CONFIG) as f:
        return yaml.safe_load(f)


def _layout_overrides(parallel: dict) -> list[str]:
    return [f"parallel.{key}={json.dumps(value)}" for key, value in parallel.items()]


def _tiny_model(cfg: dict) -> list[str]:
    model, attention = cfg["model"], cfg["attention"]
    s2 = attention["s2"]
    return [
        "model.num_layers=4",
        "model.hidden_size=128",
        # The 7B's query heads and KV groups, so each TP rank holds as many of them as there.
        f"model.num_attention_heads={model['num_attention_heads']}",
        f"model.num_query_groups={model['num_query_groups']}",
        "model.kv_channels=16",
        "model.ffn_hidden_size=256",
        # 2 x CP x block_size divides it at CP 2 and 4; SP's TP-split of a CP chunk too.
        "model.seq_length=256",
        f"model.rotary_base={model['rotary_base']}",
        f"model.recompute={model['recompute']}",
        # The padded vocabulary would otherwise grow with TP (and a resume refuses that).
        "model.vocab_size=384",
        f"attention.dense_layers.pattern={attention['dense_layers']['pattern']}",
        f"attention.s2.head_offset={s2['head_offset']}",
        "attention.s2.block_size=16",
        "attention.s2.local_blocks=2",
        # A stride of 16 gives the 8 heads of a TP4 rank phases no other rank's heads have, so
        # a rank attending with local instead of global head indices changes the losses.
        "attention.s2.vert_stride=16",
        f"train.micro_batch_size={cfg['train']['micro_batch_size']}",
        "train.global_batch_size=2",
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_dir):
    cfg = _config()
    parallel = cfg["parallel"]
    swapped = dict(
        parallel,
        tensor_model_parallel_size=parallel["context_parallel_size"],
        context_parallel_size=parallel["tensor_model_parallel_size"],
    )
    tmp = tmp_path_factory.mktemp("layouts8")
    model = _tiny_model(cfg)

    def run(name, *overrides, launcher=None):
        return run_trainer(tmp, demo_dir, *model, *overrides, name=name, launcher=launcher)

    run("init", "train.train_iters=1", "optimizer.lr_warmup_iters=0", "checkpoint.save_at_end=true")
    start = [
        f"checkpoint.load_dir={tmp / 'init' / 'checkpoints'}",
        "checkpoint.reset_iteration=true",
        "checkpoint.load_optimizer=false",
        f"train.train_iters={STEPS}",
    ]
    out = {"parallel": parallel, "swapped": swapped}
    out["single"] = run("single", *start)
    out["config"] = run(
        "config",
        *start,
        *_layout_overrides(parallel),
        f"debug.sigterm_at_iter={SAVED_AT}",
        launcher=EIGHT_PROCESSES,
    )
    # A requeued job's own resume under the swapped layout (load_optimizer concerns the start
    # from load_dir only; test_context_extension checks an own resume with it set).
    out["resumed"] = run(
        "config",
        f"train.train_iters={STEPS}",
        *_layout_overrides(swapped),
        launcher=EIGHT_PROCESSES,
    )
    out["single_resumed"] = run(
        "single_resumed",
        f"checkpoint.load_dir={tmp / 'config' / 'checkpoints'}",
        f"train.train_iters={STEPS}",
    )
    return out


def _assert_same(got: dict, want: dict, iterations, what: str):
    for i in iterations:
        assert got[i]["loss"] == pytest.approx(want[i]["loss"], rel=LOSS_RTOL), (what, i)
        assert got[i]["grad_norm"] == pytest.approx(want[i]["grad_norm"], rel=GRAD_NORM_RTOL), (
            what,
            i,
        )
        assert got[i]["lr"] == pytest.approx(want[i]["lr"], rel=1e-6), (what, i)


def _describes(proc, parallel: dict) -> str:
    return (
        f"world 8 (TP {parallel['tensor_model_parallel_size']}, "
        f"PP {parallel['pipeline_model_parallel_size']}, "
        f"CP {parallel['context_parallel_size']}, DP 1)"
    ) in proc.stdout


def test_config_layout_trains_the_single_process_losses(runs):
    parallel = runs["parallel"]
    # The config must fill one 8-GPU node with model parallelism, else this is not its layout.
    sizes = [parallel[f"{k}_model_parallel_size"] for k in ("tensor", "pipeline")]
    assert sizes[0] * sizes[1] * parallel["context_parallel_size"] == 8, parallel
    assert parallel["tensor_model_parallel_size"] != parallel["context_parallel_size"], parallel
    _, single = runs["single"]
    proc, config = runs["config"]
    assert _describes(proc, parallel), proc.stdout[-2000:]
    assert sorted(config) == list(range(1, SAVED_AT + 1))
    # Agreement must not be agreement on a constant: the steps really change the model.
    losses = [single[i]["loss"] for i in range(1, STEPS + 1)]
    assert len({round(x, 3) for x in losses}) == STEPS, losses
    _assert_same(config, single, range(1, SAVED_AT + 1), "config layout vs one process")


def test_config_layout_checkpoint_resumes_under_the_swapped_layout(runs):
    _, single = runs["single"]
    proc, resumed = runs["resumed"]
    assert _describes(proc, runs["swapped"]), proc.stdout[-2000:]
    assert "resumed from" in proc.stdout and f"iteration {SAVED_AT}," in proc.stdout
    # Megatron's dp_reshardable optimizer state cannot follow a TP/CP change: weights and LR
    # schedule load, Adam restarts (logged), so only the first resumed step can still equal the
    # uninterrupted run; later ones must equal the same checkpoint resumed in one process.
    assert "the optimizer state restarts" in proc.stderr
    assert sorted(resumed) == list(range(1, STEPS + 1))
    _assert_same(resumed, single, [SAVED_AT + 1], "resumed vs uninterrupted")
    _, single_resumed = runs["single_resumed"]
    assert sorted(single_resumed) == list(range(SAVED_AT + 1, STEPS + 1))
    _assert_same(
        resumed, single_resumed, range(SAVED_AT + 1, STEPS + 1), "resumed vs one-process resume"
    )
