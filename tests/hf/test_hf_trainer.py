"""An imported Hugging Face model through the trainer (CPU): ``megatron-s2-train --config
OUT_DIR/run.yaml`` starts from the imported weights at iteration 0 and makes half the layers S2
at load (``attention.dense_layers.pattern=DS``: the attention weights are shared); the export of
that run records its S2 schedule in ``config.json``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml

from tests.hf.test_hf_import_export import REPO, _env, _random_model
from tests.training.test_trainer import read_metrics

transformers = pytest.importorskip("transformers")

TRAIN = [
    "data.demo=true",
    "model.seq_length=128",
    "attention.dense_layers.pattern=DS",
    "attention.s2.block_size=16",
    "attention.s2.local_blocks=2",
    "attention.s2.vert_stride=2",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.train_iters=2",
    "train.eval_interval=0",
    "optimizer.lr_warmup_iters=1",
    "logging.log_interval=1",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_at_end=true",
]


def _cli(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.mark.slow
def test_imported_model_trains_as_s2_hybrid_and_exports_its_schedule(
    tmp_path,
    demo_dir,
):
    # Head size 16 (the S2 kernels' smallest); a vocabulary above the byte tokenizer's 258.
    config = transformers.LlamaConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
    )
    _random_model(config).save_pretrained(tmp_path / "hf")
    _cli("-m", "megatron_s2.hf.cli", "import", str(tmp_path / "hf"), str(tmp_path / "imp"))
    run = tmp_path / "run"
    proc = _cli(
        "-m",
        "megatron_s2.training",
        "--config",
        str(tmp_path / "imp" / "run.yaml"),
        "name=hybrid",
        f"logging.run_dir={run}",
        f"data.demo_dir={demo_dir}",
        f"data.cache_dir={tmp_path / 'cache'}",
        *TRAIN,
    )
    out = proc.stdout + proc.stderr
    assert "starting at iteration 0 from the weights of" in out
    assert str(tmp_path / "imp" / "checkpoints" / "iter_0000000") in out
    assert "attention" in out and "model.seq_length" in out  # the changes at load, listed
    recs = read_metrics(run)
    assert sorted(recs) == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in recs.values())

    _cli("-m", "megatron_s2.hf.cli", "export", str(run), str(tmp_path / "out"))
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    # The run config's attention section, as the run held it (its config.yaml).
    held = yaml.safe_load((run / "config.yaml").read_text())["attention"]
    assert held == {
        "dense_layers": {"pattern": "DS"},
        "s2": {"block_size": 16, "local_blocks": 2, "vert_stride": 2},
    }
    # Every setting written out (defaults included), the same schedule as the run's.
    from megatron_s2.schedule import AttentionSchedule

    assert exported["s2_attention"] == AttentionSchedule.from_dict(held).to_dict()
    assert exported["s2_attention"]["s2"]["local_blocks"] == 2
    assert exported["attn_implementation"] == "s2"
    assert exported["architectures"] == ["LlamaForCausalLM"]
    # The trained weights, back in Hugging Face's layout.
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "out" / "model.safetensors")
    before = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(tensors) == sorted(before)
    assert not torch.equal(
        tensors["model.layers.1.mlp.up_proj.weight"], before["model.layers.1.mlp.up_proj.weight"]
    )
    # transformers reads the config (the S2 attention itself is megatron_s2.hf.s2_attention's).
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert cfg.num_hidden_layers == 2 and cfg.vocab_size == 384
    # A plain load of the hybrid, where nothing registered "s2" (a fresh interpreter), fails
    # loudly instead of running the S2 layers dense; an explicit attention still loads.
    plain = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, transformers; "
            "transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plain.returncode != 0 and 'attn_implementation="s2"' in plain.stderr, plain.stderr[
        -2000:
    ]
    dense = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="sdpa"
    )
    assert dense.config._attn_implementation == "sdpa"
