"""The Transformer Engine spec against the local spec (issue 14).

GPU tests (``gpu`` marker; skipped without CUDA, without Transformer Engine, or with too few
GPUs): tools/gpu_parallel_check.py in its TE mode, the TE spec on one GPU and under TP=2+SP,
PP=2 and CP=2, each against the local spec's single-GPU run from the same weights (bf16
tolerance); and the trainer with the TE spec and FP8 linears for a few steps.

CPU tests: what of that path runs without TE: the tool's arguments, the local <-> TE parameter
names on a real local model's state dict, the TE mode refused with --cpu or without TE, and the
harness's ``single`` layout (the checked spec on one device) against the reference.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.megatron import import_tool

pytest.importorskip("megatron.core")

from megatron_s2.specs import HAVE_TE  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TE = "transformer_engine"

needs_te = pytest.mark.skipif(not HAVE_TE, reason="needs Transformer Engine")


def _gpus(n: int):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} GPU(s)")


# ----------------------------------------------------------------------------------- GPU tests
@pytest.mark.gpu
@needs_te
@_gpus(1)
def test_te_spec_on_one_gpu_matches_local_spec(tmp_path):
    """The TE spec (fused-norm TE linears, TEDotProductAttention on dense layers, our S2 core
    attention) trains the local spec's losses from the same weights: bf16, 2k tokens, 3 steps."""
    tool = import_tool()
    cc = tool.CheckConfig(seq_length=2048, steps=3, transformer_impl=TE)
    rows = tool.run_check(cc, [tool.SINGLE], str(tmp_path))
    print(tool.format_table(rows))
    assert all(r["passed"] for r in rows), tool.format_table(rows)


@pytest.mark.gpu
@pytest.mark.slow
@needs_te
@_gpus(2)
def test_te_spec_parallel_layouts_match_local_spec(tmp_path):
    """TP=2+SP, PP=2 and CP=2 with the TE spec equal the local spec's single-GPU run (bf16
    tolerance), as does the TE spec on one GPU."""
    tool = import_tool()
    cc = tool.CheckConfig(seq_length=2048, steps=3, transformer_impl=TE)
    names = ("single", "tp2_sp", "pp2", "cp2")
    layouts = [layout for layout in [tool.SINGLE] + tool.GPU_LAYOUTS if layout.name in names]
    rows = tool.run_check(cc, layouts, str(tmp_path))
    print(tool.format_table(rows))
    assert [r["layout"] for r in rows] == list(names)
    assert all(r["passed"] for r in rows), tool.format_table(rows)


@pytest.mark.gpu
@pytest.mark.slow
@needs_te
@_gpus(1)
def test_trainer_te_spec_resume_reproduces_uninterrupted_losses(tmp_path):
    """With TE importable, megatron-core's optimizer is TE's FusedAdam, not the torch AdamW that
    the trainer's resume path was written and CPU-tested for: a TE-spec run stopped at step k
    (the SIGTERM hook saves there) and resumed in a new process trains the uninterrupted run's
    losses and learning rates."""
    from megatron_s2.training.demo_corpus import ensure_demo_data
    from tests.training.test_trainer import run_trainer

    demo = str(tmp_path / "demo")
    ensure_demo_data(demo)
    n, k = 8, 4
    te = (f"model.transformer_impl={TE}", f"train.train_iters={n}")
    _, full = run_trainer(tmp_path, demo, *te, name="full")
    proc, first = run_trainer(tmp_path, demo, *te, f"debug.sigterm_at_iter={k}", name="resumed")
    assert "Transformer Engine layers" in proc.stdout
    assert sorted(first) == list(range(1, k + 1))
    proc, resumed = run_trainer(tmp_path, demo, *te, name="resumed")
    assert "resumed from" in proc.stdout
    assert sorted(resumed) == sorted(full) == list(range(1, n + 1))
    for i in range(1, n + 1):
        assert resumed[i]["loss"] == pytest.approx(full[i]["loss"], rel=2e-3), i
        assert resumed[i]["lr"] == pytest.approx(full[i]["lr"], rel=1e-6), i


@pytest.mark.gpu
@pytest.mark.slow
@needs_te
@_gpus(1)
def test_trainer_te_spec_with_fp8_linears_trains(tmp_path):
    """megatron-s2-train with model.transformer_impl=transformer_engine and model.fp8=hybrid:
    the start-up line names FP8, the loss is finite and falls over 30 steps of the demo corpus.
    A GPU whose TE build lacks FP8 (compute capability < 8.9) gets the config error instead."""
    from megatron_s2.training.parallel import _te_fp8_support

    available, reason = _te_fp8_support("fp8") or (True, "")
    if not available:
        pytest.skip(f"Transformer Engine has no FP8 on this GPU: {reason}")
    env = dict(os.environ)
    env.pop("RANK", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_s2.training",
            "name=te-fp8",
            f"logging.run_dir={tmp_path / 'run'}",
            f"data.demo_dir={tmp_path / 'data'}",
            "data.demo_num_docs=400",
            f"model.transformer_impl={TE}",
            "model.fp8=hybrid",
            "train.train_iters=30",
            "train.eval_interval=0",
            "logging.log_interval=1",
            "logging.progress_bar=false",
            "checkpoint.save_at_end=false",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "FP8 linears (hybrid, delayed scaling; attention bf16)" in proc.stdout
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] - 0.5, losses


# ----------------------------------------------------------------------------------- CPU tests
def test_arguments_of_the_te_mode():
    tool = import_tool()
    args, cc, layouts = tool.parse_args([])
    assert (cc.transformer_impl, cc.reference_impl) == ("local", "local")
    assert [layout.name for layout in layouts] == [layout.name for layout in tool.GPU_LAYOUTS]

    args, cc, layouts = tool.parse_args(["--transformer-impl", TE, "--seq-length", "2048"])
    assert (cc.transformer_impl, cc.reference_impl, cc.seq_length) == (TE, "local", 2048)
    # The TE spec on one device comes first: a spec difference shows apart from a parallel one.
    assert [layout.name for layout in layouts][:2] == ["single", "tp2_sp"]
    assert (cc.loss_rtol, cc.gnorm_rtol, cc.grad_rtol) == tool.tolerances("bf16", False)

    _, cc, layouts = tool.parse_args(
        ["--transformer-impl", TE, "--reference-impl", TE, "--layouts", "tp2_sp,cp2"]
    )
    assert cc.reference_impl == TE
    assert [layout.name for layout in layouts] == ["tp2_sp", "cp2"]
    _, _, layouts = tool.parse_args(["--layouts", "single,pp2"])
    assert [layout.name for layout in layouts] == ["single", "pp2"]
    with pytest.raises(SystemExit):
        tool.parse_args(["--transformer-impl", "te"])
    with pytest.raises(SystemExit):
        tool.parse_args(["--layouts", "tp3"])


def test_te_mode_is_refused_without_te_or_on_the_cpu(monkeypatch, capsys, tmp_path):
    """Exit status 2 and the reason before anything is launched: TE has no CPU kernels, and
    without transformer_engine the TE spec cannot be built."""
    import megatron_s2.specs

    tool = import_tool()
    out = str(tmp_path / "report.json")
    assert tool.main(["--cpu", "--transformer-impl", TE, "--out", out]) == 2
    assert "transformer_engine needs a CUDA GPU" in capsys.readouterr().err
    monkeypatch.setattr(megatron_s2.specs, "HAVE_TE", False)
    assert tool.main(["--reference-impl", TE, "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("--transformer-impl/--reference-impl: model.transformer_impl=")
    assert "Transformer Engine is not installed here" in err
    assert not os.path.exists(out)
    _, cc, _ = tool.parse_args(["--cpu"])
    assert tool.check_impls(cc) is None


def test_key_map_is_megatrons_local_to_te_map():
    """The renaming reuses the local spec's checkpoint key map, which is the map Megatron's own
    local GPT layer spec uses to keep its checkpoints loadable into the TE spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    tool = import_tool()
    megatron = get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
    assert tool.te_key_map() == {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    }
    assert all(megatron[k] == v for k, v in tool.te_key_map().items())


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_local_state_dict_renamed_for_the_te_spec(normalization):
    """A real local-spec model's unsharded parameters get exactly the TE spec's names (the
    norms fused into the following linear, LayerNorm biases included); tensors travel
    untouched and the renaming inverts."""
    from megatron_s2 import build_gpt_model
    from megatron_s2.unsharded import unsharded_parameters
    from tests.helpers.megatron import TINY_SCHEDULE, init_single_process, tiny_s2_config

    tool = import_tool()
    init_single_process()
    config = tiny_s2_config(TINY_SCHEDULE, normalization=normalization)
    model = build_gpt_model(config, vocab_size=64, max_sequence_length=64)
    local = unsharded_parameters(model)
    te = tool.local_to_te_names(local)
    assert len(te) == len(local)
    expected = set()
    for name in local:
        for old, new in (
            (".input_layernorm.", ".self_attention.linear_qkv.layer_norm_"),
            (".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_"),
        ):
            name = name.replace(old, new)
        expected.add(name)
    assert set(te) == expected
    bias = normalization == "LayerNorm"
    for i in range(config.num_layers):
        layer = f"decoder.layers.{i}."
        assert (layer + "self_attention.linear_qkv.layer_norm_weight") in te
        assert (layer + "mlp.linear_fc1.layer_norm_bias" in te) == bias
        assert (
            te[layer + "self_attention.linear_qkv.weight"]
            is local[layer + "self_attention.linear_qkv.weight"]
        )
        assert not any(k.startswith(layer + "input_layernorm") for k in te)
    # Outside the layers nothing changes: TE's final norm is decoder.final_layernorm too.
    assert "decoder.final_layernorm.weight" in te and "embedding.word_embeddings.weight" in te
    assert tool.te_to_local_names(te) == local
    assert tool.to_local_names(te, TE) == local and tool.from_local_names(local, TE) == te
    assert tool.to_local_names(local, "local") == local == tool.from_local_names(local, "local")
    with pytest.raises(KeyError, match="two parameters map to"):
        tool.local_to_te_names(
            {
                "decoder.layers.0.input_layernorm.weight": 1,
                "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": 2,
            }
        )


@pytest.mark.slow
def test_single_layout_on_cpu(tmp_path):
    """The harness's ``single`` layout (the checked spec on one device, loaded from the
    reference's weights through the renaming and the strict key check) on CPU/gloo with the
    local spec on both sides: equal to the reference to fp32 rounding."""
    tool = import_tool()
    cc = tool.CheckConfig.tiny_cpu(num_microbatches=2)
    rows = tool.run_check(cc, [tool.SINGLE], str(tmp_path))
    print(tool.format_table(rows))
    (row,) = rows
    assert "error" not in row, row.get("error")
    assert row["passed"] and row["max_rel_loss_diff"] < 1e-6, row
    assert (row["impl"], row["ref_impl"]) == ("local", "local")
