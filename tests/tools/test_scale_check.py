"""tools/scale_check.py and tools/scale_tables.py on the CPU: the planned command matrix, the
refusals of bad options, the metric and profile readers, the resumable run loop (with a fake
trainer), the kernel-share arithmetic of megatron_s2/training/profiling.py, and the tables and
the 8/16-GPU estimate on a fake JSON."""

from __future__ import annotations

import json
import os
import random
import shlex

import pytest

from megatron_s2.training import profiling
from tests.helpers.megatron import import_tool

scale = import_tool("scale_check")
tables = import_tool("scale_tables")


def _args(*argv):
    return scale.parse_args(list(argv))[1]


def _by_name(runs):
    return {p.name: p for p in runs}


def _overrides(p) -> dict:
    """The ``key=value`` overrides of a planned run's argv (later ones win, as in the trainer)."""
    out = {}
    for item in p.run.argv:
        if "=" in item and not item.startswith("-"):
            key, _, value = item.partition("=")
            out[key] = value
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """The default plan of every part (one parse of the 7B configs for the module)."""
    out = tmp_path_factory.mktemp("scale")
    return _by_name(scale.plan(_args("--out-dir", str(out)), python="python"))


def test_default_matrix_runs_every_model_layout_and_length(matrix):
    speed = [p for p in matrix.values() if p.part == "speed"]
    got = {(p.model, p.layout.name, p.seq) for p in speed}
    want = {
        (m, lay, seq)
        for seq, lays in ((32768, ("tp2cp2", "tp4")), (131072, ("tp2cp2", "tp4", "cp4")))
        for lay in lays
        for m in ("ds", "s2", "dense")
    }
    assert got == want and len(speed) == 15
    assert [p.seq for p in speed] == [131072] * 9 + [32768] * 6  # the goal's length first
    assert {p.name for p in matrix.values() if p.part == "te"} == {
        "te-ds-tp2cp2-32k",
        "te-ds-tp2cp2-128k",
    }
    assert [p.name for p in matrix.values() if p.part in ("equivalence", "resume")] == [
        "eq-init-32k",
        "eq-tp2cp2-32k",
        "eq-tp4-32k",
        "eq-cp4-32k",
        "resume-tp4-32k",
    ]


def test_each_layout_gets_its_parallel_overrides(matrix):
    for name, tp, cp, sp in (
        ("speed-ds-tp2cp2-32k", "2", "2", "true"),
        ("speed-dense-tp4-128k", "4", "1", "true"),
        ("speed-s2-cp4-128k", "1", "4", "false"),
    ):
        p = matrix[name]
        o = _overrides(p)
        assert o["parallel.tensor_model_parallel_size"] == tp
        assert o["parallel.context_parallel_size"] == cp
        assert o["parallel.sequence_parallel"] == sp
        assert o["parallel.use_distributed_optimizer"] == "true"
        assert o["train.global_batch_size"] == "1" and o["data.demo"] == "true"
        assert o["debug.profile_step"] == o["train.train_iters"] == str(p.steps)
        assert p.exclude == (p.steps,)
        argv = list(p.run.argv)
        assert argv[:6] == [
            "python",
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "4",
        ]
        assert argv[6:8] == ["-m", "megatron_s2.training"]
    # The models: the all-S2 override, the dense twin's config and its dense kernel choice.
    assert _overrides(matrix["speed-s2-tp4-32k"])["attention.dense_layers.pattern"] == "S"
    assert "attention.dense_layers.pattern" not in _overrides(matrix["speed-ds-tp4-32k"])
    dense = matrix["speed-dense-tp2cp2-128k"]
    assert dense.run.argv[dense.run.argv.index("--config") + 1].endswith("gpt-7b-dense.yaml")
    assert _overrides(dense)["model.dense_attention"] == "auto"
    # The recomputation the memory estimate allows: selective at 32k, full at 128k.
    assert _overrides(matrix["speed-ds-tp4-32k"])["model.recompute"] == "selective"
    assert _overrides(matrix["speed-ds-tp2cp2-128k"])["model.recompute"] == "full"
    te = _overrides(matrix["te-ds-tp2cp2-32k"])
    assert te["model.transformer_impl"] == "transformer_engine"
    assert te["model.recompute"] == _overrides(matrix["speed-ds-tp2cp2-32k"])["model.recompute"]


def test_equivalence_runs_share_one_start_and_the_resume_loads_the_reference(matrix):
    init = _overrides(matrix["eq-init-32k"])
    assert init["train.train_iters"] == "1" and init["checkpoint.save_at_end"] == "true"
    # Its one step is a warm-up step at LR 0: the checkpoint holds the initial weights.
    assert init["optimizer.lr_warmup_iters"] == "2"
    init_ckpt = os.path.join(matrix["eq-init-32k"].run.run_dir, "checkpoints")
    for name in ("eq-tp2cp2-32k", "eq-tp4-32k", "eq-cp4-32k"):
        o = _overrides(matrix[name])
        assert o["checkpoint.load_dir"] == init_ckpt
        assert o["checkpoint.reset_iteration"] == "true"
        assert o["checkpoint.load_optimizer"] == "false"
        assert o["train.train_iters"] == str(scale.EQUIV_STEPS)
        assert o["model.recompute"] == "full" and o["train.seed"] == str(scale.SEED)
        assert o["model.dense_attention"] == "sdpa"
        assert "debug.profile_step" not in o
        assert matrix[name].after == ("eq-init-32k",)
    ref = _overrides(matrix["eq-tp2cp2-32k"])
    assert ref["checkpoint.save_interval"] == str(scale.RESUME_AT)
    assert ref["checkpoint.save_at_end"] == "false"
    resume = matrix["resume-tp4-32k"]
    o = _overrides(resume)
    assert o["checkpoint.load_dir"] == os.path.join(
        matrix["eq-tp2cp2-32k"].run.run_dir, "checkpoints"
    )
    assert o["checkpoint.reset_iteration"] == "false"
    assert o["parallel.tensor_model_parallel_size"] == "4"
    assert resume.after == ("eq-tp2cp2-32k",)


def test_dry_run_prints_every_command_and_the_estimate(capsys, tmp_path):
    code = scale.main(
        ["--dry-run", "--parts", "speed", "--seqs", "32768", "--out-dir", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0
    commands = [line for line in out.splitlines() if not line.startswith("#")]
    assert len(commands) == 6
    for line in commands:
        argv = shlex.split(line)
        assert "megatron_s2.training" in argv and "--restart" in argv
    assert "# 6 runs, estimate" in out and "speed-ds-tp2cp2-32k" in out
    assert not os.listdir(tmp_path)  # nothing ran, nothing was written


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--layouts", "tp3"], ["--layouts", "tp3", "tp4", "tp2cp2", "cp4"]),
        (["--layouts", "pp2"], ["--layouts", "'pp2' is not a layout"]),
        (["--layouts", "tp8"], ["--layouts", "not --gpus (4)"]),
        (["--models", "ds,moe"], ["--models", "moe", "ds, s2, dense"]),
        (["--parts", "speed,bogus"], ["--parts", "bogus", "equivalence"]),
        (["--recompute", "some"], ["--recompute", "selective"]),
        (["--equiv-layouts", "tp2"], ["--equiv-layouts", "tp2 uses 2 x 1 = 2 GPUs"]),
        (["--gpus", "2", "--layouts", "tp2"], ["--equiv-layouts", "tp2cp2 uses 2 x 2"]),
        (["--resume-layout", "tp2cp2"], ["--resume-layout (tp2cp2) must differ"]),
        (["--te-layout", "tp3cp2"], ["--te-layout", "tp3cp2 uses 3 x 2 = 6 GPUs"]),
        (["--equiv-layouts", "tp2cp2,tp4,tp4"], ["--equiv-layouts", "repeats"]),
        (["--steps", "3"], ["--steps (3) must exceed --warmup-steps (2) + 1"]),
    ],
)
def test_bad_options_are_refused_naming_the_option(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        scale.main(["--dry-run", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)


@pytest.mark.parametrize(
    "argv, words",
    [
        # 32000 is no multiple of 2 x CP x block = 512 (the S2 blocks per CP chunk).
        (["--seqs", "32000", "--layouts", "cp4"], ["model.seq_length (32000)", "multiple of 512"]),
        # Sequence parallelism splits each CP part's tokens over TP: 4 x 1 does not divide 32770.
        (["--seqs", "32770", "--layouts", "tp4"], ["model.seq_length (32770)", "divisible by"]),
        # 32 heads over three TP ranks.
        (
            ["--gpus", "3", "--layouts", "tp3"],
            ["num_attention_heads (32)", "tensor_model_parallel"],
        ),
        # Eight GPUs as CP 8: 16 chunks of 2080 tokens cut the 64-token S2 blocks.
        (["--gpus", "8", "--layouts", "cp8", "--seqs", "33280"], ["multiple of 1024"]),
    ],
)
def test_layouts_the_model_or_length_cannot_take_are_refused_before_any_run(
    argv, words, capsys, tmp_path
):
    with pytest.raises(SystemExit) as exc:
        scale.main(["--dry-run", "--parts", "speed", "--models", "ds", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--layouts/--seqs/--models" in err
    for word in words:
        assert word in err, (word, err)


# ---------------------------------------------------------------------------- reading a run
def _write_run(run_dir, n=8, profile_at=8, ranks=4, seed=0):
    """A fake finished run: ``n`` train records (random speeds, a slow profiled last step) and
    the profile summaries of ``ranks`` ranks. Returns (records, rank summaries)."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(run_dir, "profile"))
    recs = []
    for i in range(1, n + 1):
        tps = 10.0 if i == profile_at else rng.uniform(1000, 2000)
        recs.append(
            {
                "kind": "train",
                "iteration": i,
                "loss": 10 - i * rng.uniform(0.1, 0.2),
                "lr": 1e-4 * i,
                "tokens_per_s": tps,
                "tflops_per_gpu": tps / 10,
                "gpu_mem_gib": 40 + rng.random(),
                "gpu_mem_gib_max_rank": 50 + rng.random(),
            }
        )
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    summaries = []
    for rank in range(ranks):
        events = [(f"_s2_fwd_kernel_{rank}", rng.uniform(1, 9) * 1e3)]
        events += [("ncclDevKernel_AllGather_RING_LL", rng.uniform(1, 9) * 1e3)]
        events += [("nvjet_tst_128x256", rng.uniform(1, 9) * 1e3), ("elementwise", 500.0)]
        s = {
            "iteration": profile_at,
            "rank": rank,
            "wall_ms": 100.0 + rank,
            "peak_mem_gib": 60.0 + rank,
            **profiling.kernel_shares(events),
        }
        summaries.append(s)
        with open(os.path.join(run_dir, "profile", f"step{profile_at}.rank{rank}.json"), "w") as f:
            json.dump(s, f)
    return recs, summaries


def test_metrics_and_profile_of_a_run_are_read(tmp_path):
    run_dir = str(tmp_path / "run")
    recs, summaries = _write_run(run_dir)
    e2e = import_tool("e2e_benchmark")
    got = e2e.read_result(run_dir, warmup_steps=2, exclude_iterations=(8,))
    kept = sorted(r["tokens_per_s"] for r in recs[2:7])
    assert got["median_tokens_per_s"] == pytest.approx(kept[2])
    assert got["median_tflops_per_gpu"] == pytest.approx(kept[2] / 10)
    assert got["measured_steps"] == 5
    assert got["peak_mem_gib_max_rank"] == pytest.approx(
        max(r["gpu_mem_gib_max_rank"] for r in recs)
    )
    assert got["peak_mem_gib"] == pytest.approx(max(r["gpu_mem_gib"] for r in recs))
    prof = scale.read_profile(run_dir, 8)
    assert prof["ranks"] == 4
    for c in ("attention", "communication", "gemm", "other"):
        want = sum(s["share"][c] for s in summaries) / 4
        assert prof["share"][c] == pytest.approx(want)
        assert prof["max_share"][c] == pytest.approx(max(s["share"][c] for s in summaries))
    assert prof["peak_mem_gib"] == 63.0 and prof["wall_ms"] == pytest.approx(101.5)
    assert scale.read_profile(run_dir, 7) is None
    steps = scale.read_steps(run_dir)
    assert steps["losses"]["3"] == recs[2]["loss"] and steps["lrs"]["8"] == recs[7]["lr"]


def test_kernel_shares_classify_by_name_against_a_reference():
    names = {
        "_s2_fwd_kernel": "attention",
        "_s2_dkdv_gluon_kernel": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16": "attention",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel": "attention",
        "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90": "attention",
        "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL": "communication",
        "ncclKernel_AllGather_RING_LL_Sum_int8_t": "communication",
        "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_NNT": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n": "gemm",
        "cutlass3x_sm90_tensorop_gemm": "gemm",
        "void at::native::vectorized_elementwise_kernel<4>": "other",
        "multi_tensor_apply_kernel": "other",
    }
    rng = random.Random(7)
    events = [(n, rng.uniform(0, 1e4)) for n in names for _ in range(rng.randint(1, 3))]
    rng.shuffle(events)
    got = profiling.kernel_shares(events, top=3)
    total = sum(us for _, us in events)
    assert got["total_kernel_ms"] == pytest.approx(total / 1e3)
    for c in ("attention", "communication", "gemm", "other"):
        want = sum(us for n, us in events if names[n] == c)
        assert got["ms"][c] == pytest.approx(want / 1e3)
        assert got["share"][c] == pytest.approx(want / total)
    per_name = {}
    for n, us in events:
        per_name[n] = per_name.get(n, 0.0) + us
    top = sorted(per_name, key=per_name.get, reverse=True)[:3]
    assert [k["name"] for k in got["top_kernels"]] == top
    assert [k["class"] for k in got["top_kernels"]] == [names[n] for n in top]
    empty = profiling.kernel_shares([])
    assert empty["total_kernel_ms"] == 0 and empty["share"]["attention"] is None
    with pytest.raises(ValueError, match="negative"):
        profiling.kernel_shares([("x", -1.0)])


def test_kernel_events_keep_the_cuda_entries_of_key_averages():
    from torch.autograd import DeviceType

    class Avg:
        def __init__(self, key, device_type, us, annotation=False):
            self.key, self.device_type, self.self_device_time_total = key, device_type, us
            self.is_user_annotation = annotation

    averages = [
        Avg("_s2_fwd_kernel", DeviceType.CUDA, 120.0),
        Avg("aten::mm", DeviceType.CPU, 999.0),
        Avg("ncclDevKernel_AllReduce", DeviceType.CUDA, 30.0),
        Avg("idle", DeviceType.CUDA, 0.0),
        Avg("ProfilerStep#3", DeviceType.CUDA, 500.0, annotation=True),
    ]
    assert profiling.kernel_events(averages) == [
        ("_s2_fwd_kernel", 120.0),
        ("ncclDevKernel_AllReduce", 30.0),
    ]


# ------------------------------------------------------------------------ the resumable loop
def _loop_args(tmp_path, *extra):
    return _args(
        "--out-dir",
        str(tmp_path / "runs"),
        "--seqs",
        "32768",
        "--models",
        "ds",
        "--layouts",
        "tp4",
        "--equiv-layouts",
        "tp2cp2,tp4",
        "--json",
        str(tmp_path / "scale.json"),
        "--copy-json",
        str(tmp_path / "out" / "scale.json"),
        *extra,
    )


def test_run_loop_writes_after_every_run_resumes_and_honours_dependencies(tmp_path, monkeypatch):
    args = _loop_args(tmp_path)
    runs = scale.plan(args, python="python")
    calls = []

    def fake_execute(run, warmup, timeout, exclude):
        calls.append(run.name)
        if len(calls) > 1:  # every earlier run is in the JSON already
            written = json.load(open(tmp_path / "scale.json"))
            assert set(calls[:-1]) <= {r["name"] for r in written["runs"]}
        if run.name == "eq-tp4-32k":
            return {"model": run.model, "seq": run.seq, "error": "exit code 1: boom"}
        return {"model": run.model, "seq": run.seq, "median_tokens_per_s": 4000.0}

    monkeypatch.setattr(scale.e2e_benchmark, "execute", fake_execute)
    doc = scale.load_document(args.json)
    doc["transformer_engine"] = "not installed: no TE here"
    doc["dense_attention"] = "fa4"
    assert scale.execute_all(runs, args, doc) == 0
    # TE is not installed: recorded without running; everything else ran in order.
    assert calls == [
        "speed-ds-tp4-32k",
        "speed-ds-tp2cp2-32k",
        "eq-init-32k",
        "eq-tp2cp2-32k",
        "eq-tp4-32k",
        "resume-tp4-32k",
    ]
    got = {r["name"]: r for r in json.load(open(tmp_path / "out" / "scale.json"))["runs"]}
    assert got["speed-ds-tp4-32k"]["dense_attention"] == "fa4"
    assert got["te-ds-tp2cp2-32k"]["error"].startswith("not installed")
    assert got["speed-ds-tp4-32k"]["tokens_per_s_per_gpu"] == 1000.0
    assert got["eq-tp4-32k"]["error"] == "exit code 1: boom"
    # A second call runs nothing again, --retry-failed only the failed runs (TE still refused).
    calls.clear()
    doc = scale.load_document(args.json)
    doc["transformer_engine"] = "not installed: no TE here"
    assert scale.execute_all(runs, args, doc) == 0 and calls == []
    args.retry_failed = True
    scale.execute_all(runs, args, doc)
    assert calls == ["eq-tp4-32k"]


def test_time_budget_leaves_runs_for_the_next_call_and_failed_inputs_block(tmp_path, monkeypatch):
    args = _loop_args(tmp_path, "--parts", "equivalence", "--time-budget", "1")
    runs = scale.plan(args, python="python")
    monkeypatch.setattr(scale.e2e_benchmark, "execute", lambda *a: pytest.fail("ran"))
    doc = scale.load_document(args.json)
    # Nothing fits one second; the runs after eq-init wait for it rather than fail.
    assert scale.execute_all(runs, args, doc) == len(runs)
    assert doc["runs"] == []
    args.time_budget = None
    monkeypatch.setattr(
        scale.e2e_benchmark, "execute", lambda run, *a: {"model": "ds", "error": "OOM"}
    )
    scale.execute_all(runs, args, doc)
    got = {r["name"]: r for r in doc["runs"]}
    assert got["eq-init-32k"]["error"] == "OOM"
    assert got["eq-tp2cp2-32k"]["error"].startswith("skipped: needs eq-init-32k")
    assert got["resume-tp4-32k"]["error"].startswith("skipped: needs eq-tp2cp2-32k")


def test_a_json_of_another_tool_is_refused(tmp_path):
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"results": []}))
    with pytest.raises(scale.ScaleCheckError, match="not a scale_check JSON"):
        scale.load_document(str(path))


# ------------------------------------------------------------------------------ the tables
def _speed(model, layout, seq, tps, *, tp, cp, comm=0.2, attn=0.4, mem=70.0, **kw):
    return {
        "name": f"speed-{model}-{layout}-{seq // 1024}k",
        "part": "speed",
        "model": model,
        "layout": layout,
        "tp": tp,
        "cp": cp,
        "gpus": tp * cp,
        "seq": seq,
        "recompute": "full",
        "median_tokens_per_s": tps * tp * cp,
        "tokens_per_s_per_gpu": tps,
        "median_tflops_per_gpu": 300.0,
        "peak_mem_gib_max_rank": mem,
        "measured_steps": 3,
        "profile": {"share": {"attention": attn, "communication": comm, "gemm": 0.3}},
        **kw,
    }


def _eq(layout, losses, part="equivalence", lrs=None, name=None):
    return {
        "name": name or f"eq-{layout}-32k",
        "part": part,
        "layout": layout,
        "losses": {str(i): v for i, v in losses.items()},
        "lrs": {str(i): v for i, v in (lrs or {}).items()},
    }


def _doc():
    ref = {i: 10.0 - 0.3 * i for i in range(1, 11)}
    lrs = {i: 1e-5 * i for i in range(1, 11)}
    return {
        "tool": "scale_check",
        "device": "NVIDIA H200",
        "gpus": 4,
        "model_params": 7_000_000_000,
        "equivalence_rtol": 2e-2,
        "lr_rtol": 1e-6,
        "equivalence_reference": "tp2cp2",
        "transformer_engine": "not installed: no TE",
        "runs": [
            _speed("dense", "tp4", 131072, 1000.0, tp=4, cp=1),
            _speed("ds", "tp4", 131072, 1600.0, tp=4, cp=1),
            _speed("s2", "tp4", 131072, 2600.0, tp=4, cp=1),
            _speed("ds", "tp2cp2", 131072, 1500.0, tp=2, cp=2, comm=0.3),
            {"name": "speed-dense-cp4-128k", "part": "speed", "model": "dense",
             "layout": "cp4", "seq": 131072, "error": "exit code 1: CUDA out of memory"},
            {"name": "eq-init-32k", "part": "equivalence", "layout": "tp2cp2", "losses": {}},
            _eq("tp2cp2", ref, lrs=lrs),
            _eq("tp4", {i: v * (1 + 1e-3) for i, v in ref.items()}),
            _eq("cp4", {i: v * (1 + (5e-2 if i == 9 else 0)) for i, v in ref.items()}),
            _eq("tp4", {i: ref[i] * (1 + 1e-3) for i in range(7, 11)}, part="resume",
                lrs={i: lrs[i] for i in range(7, 11)}, name="resume-tp4-32k"),
        ],
    }  # fmt: skip


def _row(text, prefix):
    line = next(line for line in text.splitlines() if line.startswith(prefix))
    return [c.strip() for c in line.strip("|").split("|")]


def test_speed_table_compares_with_the_dense_twin_and_lists_failures():
    text = tables.format_speed(_doc())
    s2 = _row(text, "| 131072 | tp4 | full | all-S2")
    assert s2[4:] == ["2,600", "2.60x", "300", "70.0", "40%", "20%", "3"]
    ds = _row(text, "| 131072 | tp2cp2 | full | DS hybrid")
    assert ds[5] == ""  # no dense twin at TP2 x CP2
    assert _row(text, "| 131072 | cp4")[4] == "failed"
    doc = _doc()
    doc["runs"][0]["dense_attention"] = "cudnn (FlashAttention-4: not installed)"
    assert _row(tables.format_speed(doc), "| 131072 | tp4 | full | dense")[3] == "dense (cudnn)"
    assert "- failed: speed-dense-cp4-128k: exit code 1: CUDA out of memory" in text


def test_equivalence_and_resume_verdicts():
    s = tables.equivalence_summary(_doc())
    assert s["reference"] == "eq-tp2cp2-32k"
    assert s["layouts"]["tp4"]["passed"] and s["layouts"]["tp4"]["iterations"] == 10
    assert s["layouts"]["tp4"]["max_rel_loss_diff"] == pytest.approx(1e-3)
    assert not s["layouts"]["cp4"]["passed"]
    assert s["layouts"]["cp4"]["max_rel_loss_diff"] == pytest.approx(5e-2)
    r = s["resume"]
    assert r["first_iteration"] == 7 and r["passed"] and r["rel_lr_diff"] == 0
    assert r["rel_loss_diff"] == pytest.approx(1e-3) and len(r["later_rel_loss_diffs"]) == 3
    doc = _doc()
    doc["runs"][-1]["lrs"]["7"] *= 1.01  # another LR schedule after the resume: caught
    assert not tables.equivalence_summary(doc)["resume"]["passed"]
    text = tables.format_equivalence(_doc())
    assert "| tp4 | 10 | 1.0e-03 | PASS |" in text and "| cp4 | 10 | 5.0e-02 | FAIL |" in text
    assert "Resume at tp4" in text and "PASS" in text


def test_te_table_says_not_installed():
    assert "not installed: no TE" in tables.format_te(_doc())
    doc = _doc()
    doc["runs"].append(
        _speed("ds", "tp2cp2", 131072, 1650.0, tp=2, cp=2)
        | {"part": "te", "name": "te-ds-tp2cp2-128k", "losses": {"1": 10.5}}
    )
    row = _row(tables.format_te(doc), "| 131072 | tp2cp2")
    assert row[2:5] == ["1,500", "1,650", "1.10x"]


def test_estimate_follows_its_stated_model():
    doc = _doc()
    rows = {e["name"]: e for e in tables.estimate(doc, intra_gbps=400.0, inter_gbps=40.0)}
    assert "speed-dense-cp4-128k" not in rows  # failed runs have nothing to scale
    e = rows["speed-ds-tp2cp2-128k"]
    step = 131072 / (1500.0 * 4)
    assert e["step_s"] == pytest.approx(step) and e["comm_s"] == pytest.approx(0.3 * step)
    per_gpu_bytes = 6 * 7e9 / 2  # fp32 gradients + bf16 parameters of one TP shard

    def ring(n, gbps):
        return (n - 1) / n * per_gpu_bytes / (gbps * 1e9)

    want = {
        "8 GPUs, one node": step - ring(2, 400) + ring(4, 400),
        "8 GPUs, two nodes of 4": step - ring(2, 400) + ring(4, 40),
        "16 GPUs, two nodes of 8": step - ring(2, 400) + ring(8, 40),
    }
    for s in e["scenarios"]:
        assert s["step_s"] == pytest.approx(want[s["scenario"]])
        assert s["tokens_per_s_per_gpu"] == pytest.approx(131072 / (want[s["scenario"]] * 4))
    tp4 = rows["speed-ds-tp4-128k"]["scenarios"][0]  # CP 1: no exchange measured before
    assert tp4["step_s"] == pytest.approx(131072 / (1600.0 * 4) + 1 / 2 * 6 * 7e9 / 4 / 400e9)
    text = tables.format_estimate(doc, 400.0, 40.0)
    assert text.startswith("Estimate, not a measurement") and "40 GB/s" in text


def test_tables_command_prints_every_table(tmp_path, capsys):
    path = tmp_path / "scale.json"
    path.write_text(json.dumps(_doc()))
    assert tables.main([str(path)]) == 0
    out = capsys.readouterr().out
    for heading in (
        "**Speed**",
        "**Equivalence and resume**",
        "**Transformer Engine",
        "(estimate)",
    ):
        assert heading in out
    with pytest.raises(SystemExit):
        tables.main([str(path), "--tables", "speed,nope"])
    assert "--tables" in capsys.readouterr().err


# ------------------------------------------------------------- the whole check, tiny, on gloo
TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
    "attention.s2.block_size=16",
    "attention.s2.local_blocks=2",
    "attention.s2.vert_stride=2",
    "train.precision=fp32",
]


@pytest.mark.slow
def test_tiny_check_on_two_cpu_processes(tmp_path, monkeypatch, capsys, demo_dir):
    """The check end to end at tiny width on 2 gloo processes (the trainer's CPU mode): a
    profiled speed run at CP 2, then the equivalence of TP 2 and CP 2 from one checkpoint and
    the resume of TP 2's checkpoint at CP 2, compared by scale_tables. fp32 on the CPU: the two
    layouts agree to ~1e-7, far inside the bf16 tolerance."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the reference attention, not Triton
    over = [f"--override={o}" for o in TINY]
    over += [f"--override=data.demo_dir={demo_dir}"]  # the session's corpus: generated once
    over += [f"--override=data.cache_dir={tmp_path / 'cache'}"]
    path = tmp_path / "scale.json"
    argv = ["--gpus", "2", "--parts", "speed,equivalence", "--models", "ds", "--seqs", "256"]
    argv += ["--layouts", "cp2", "--steps", "4", "--warmup-steps", "1"]
    argv += ["--equiv-layouts", "tp2,cp2", "--resume-layout", "cp2", "--equiv-seq", "256"]
    argv += ["--out-dir", str(tmp_path / "runs"), "--json", str(path), *over]
    assert scale.main(argv) == 0, capsys.readouterr().out[-3000:]
    doc = json.loads(path.read_text())
    runs = {r["name"]: r for r in doc["runs"]}
    assert set(runs) == {
        "speed-ds-cp2-256",
        "eq-init-256",
        "eq-tp2-256",
        "eq-cp2-256",
        "resume-cp2-256",
    }
    speed = runs["speed-ds-cp2-256"]
    assert speed["measured_steps"] == 2 and speed["tokens_per_s_per_gpu"] > 0
    assert speed["profile"]["ranks"] == 2 and speed["peak_mem_gib_max_rank"] > 0
    s = tables.equivalence_summary(doc)
    assert s["layouts"]["cp2"]["passed"] and s["layouts"]["cp2"]["iterations"] == 10
    assert s["layouts"]["cp2"]["max_rel_loss_diff"] < 1e-4
    assert s["resume"]["passed"] and s["resume"]["first_iteration"] == scale.RESUME_AT + 1
    # The checkpoints went once their users had run.
    assert not (tmp_path / "runs" / "eq-init-256" / "checkpoints").exists()
    assert not (tmp_path / "runs" / "eq-tp2-256" / "checkpoints").exists()
    # A second call finds everything done.
    assert scale.main(argv) == 0
    assert len(json.loads(path.read_text())["runs"]) == 5


def test_docs_tables_renders_the_scale_kind():
    docs_tables = import_tool("docs_tables")
    doc = _doc() | {"date": "2026-11-29", "torch": "2.11", "commands": [["tools/scale_check.py"]]}
    lines = docs_tables.render("scale", [("results/scale.json", doc)])
    assert lines[0].startswith("Raw output [`scale.json`](results/scale.json), device NVIDIA H200")
    assert "command 1 `python tools/scale_check.py`" in lines[0]
    assert lines[2:] == tables.format_all(doc).split("\n")


def test_a_run_past_its_timeout_is_killed_with_its_children(tmp_path):
    """e2e_benchmark.execute (which runs every trainer launch of the check) kills the whole
    process group at the timeout: a launcher's children must not outlive it on their GPUs."""
    import sys
    import time

    e2e = import_tool("e2e_benchmark")
    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    run = e2e.Run("ds", 256, str(tmp_path / "run"), (sys.executable, "-c", parent))
    t0 = time.monotonic()
    got = e2e.execute(run, 0, timeout=5)
    assert got["error"].startswith("timed out after 5 s") and time.monotonic() - t0 < 30
    pid = int(pid_file.read_text())
    for _ in range(50):  # the kill is delivered asynchronously
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the launcher's child {pid} survived the timeout")


def test_a_run_cut_by_the_budget_is_left_for_the_next_call(tmp_path, monkeypatch):
    args = _loop_args(tmp_path, "--parts", "equivalence", "--time-budget", "300")
    runs = scale.plan(args, python="python")
    first = runs[0]
    assert first.estimate_s < 300 < scale.run_timeout(first, None)
    seen = []

    def fake_execute(run, warmup, timeout, exclude):
        seen.append((run.name, timeout))
        return {"error": f"timed out after {timeout:.0f} s: step 1"}

    monkeypatch.setattr(scale.e2e_benchmark, "execute", fake_execute)
    doc = scale.load_document(args.json)
    assert scale.execute_all(runs, args, doc) == 1  # the loop stops: the budget is spent
    assert len(seen) == 1 and seen[0][0] == "eq-init-32k" and seen[0][1] <= 300
    assert doc["runs"] == []  # not recorded as failed: it runs again in full next time
    # Without a budget the run's own timeout applies, and a timeout there is a failure.
    args.time_budget = None
    seen.clear()
    scale.execute_all(runs, args, doc)
    assert seen[0] == ("eq-init-32k", scale.run_timeout(first, None))
    assert {r["name"]: r for r in doc["runs"]}["eq-init-32k"]["error"].startswith("timed out")


def test_a_finished_run_whose_checkpoints_are_gone_runs_again(tmp_path, monkeypatch):
    args = _loop_args(tmp_path, "--parts", "equivalence")
    runs = scale.plan(args, python="python")
    calls = []

    def fake_execute(run, warmup, timeout, exclude):
        calls.append(run.name)
        os.makedirs(os.path.join(run.run_dir, "checkpoints"))
        return {"model": run.model, "seq": run.seq}

    monkeypatch.setattr(scale.e2e_benchmark, "execute", fake_execute)
    doc = scale.load_document(args.json)
    doc["runs"] = [{"name": "eq-init-32k", "part": "equivalence"}]  # done, but no checkpoint
    stale = tmp_path / "runs" / "eq-tp2cp2-32k"
    (stale / "checkpoints" / "iter_0000006").mkdir(parents=True)  # an earlier attempt's
    scale.execute_all(runs, args, doc)
    assert calls == ["eq-init-32k", "eq-tp2cp2-32k", "eq-tp4-32k", "resume-tp4-32k"]
    assert not (stale / "checkpoints" / "iter_0000006").exists()
    # Every user of a checkpoint finished: the checkpoints went.
    assert not (tmp_path / "runs" / "eq-init-32k" / "checkpoints").exists()
    assert not (stale / "checkpoints").exists()


def test_goal_per_layout_at_128k():
    doc = _doc()
    doc["runs"][0]["peak_mem_gib_max_rank"] = 115.0  # dense at TP4: above 120 GB
    rows = {g["layout"]: g for g in tables.goal(doc)}
    tp4 = rows["tp4"]
    assert tp4["ratios"]["s2"] == pytest.approx(2.6) and tp4["ratio_ok"]["s2"]
    assert tp4["ratios"]["ds"] == pytest.approx(1.6) and tp4["ratio_ok"]["ds"]
    assert tp4["max_mem_gib"] == 115.0 and tp4["mem_ok"] is False
    # TP2 x CP2 has no dense twin: no ratios; CP4 only a failed run: nothing at all.
    assert rows["tp2cp2"]["ratios"] == {"s2": None, "ds": None}
    assert rows["cp4"]["max_mem_gib"] is None
    row = _row(tables.format_goal(doc), "| tp4")
    assert row[1:] == ["2.60x (met)", "1.60x (met)", "115.0 (not met)"]
