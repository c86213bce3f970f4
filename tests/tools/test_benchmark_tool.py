"""The GPU benchmarks' pure-Python parts on the CPU: tools/benchmark.py (pair counts, rows,
fractions of the best dense rate, table) and tools/e2e_benchmark.py (trainer commands, results).

Pair counts are checked against s2attn's reference attention (with all logits 0 every attended
key has weight 1, so ``exp(lse)`` counts a query's keys) and against the S2 rule written out here;
the Flex BlockMask against the same reference token by token.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from s2attn import S2Pattern
from s2attn.reference import s2_attention_reference
from tests.helpers.benchmark import fake_power_sampler
from tests.helpers.megatron import import_tool

bench = import_tool("benchmark")
timing = import_tool("gpu_timing")
e2e = import_tool("e2e_benchmark")

PATTERNS = {
    "mha": S2Pattern(num_heads=4, block_size=16, local_blocks=2, vert_stride=3, head_offset=0),
    "gqa-phase1": S2Pattern(
        num_heads=4, num_kv_heads=2, block_size=16, local_blocks=3, vert_stride=4, head_offset=1
    ),
    "dense-heads": S2Pattern(
        num_heads=4, block_size=32, local_blocks=5, vert_stride=3, num_dense_heads=2
    ),
}
# Lengths below, at and well past the local window and the stripe period, and no multiples of
# the block size.
SEQS = (5, 97, 300)


def reference_pairs(pattern: S2Pattern, seq: int, batch: int = 1) -> int:
    """Attended pairs of ``batch`` sequences as s2attn's reference attention masks them."""
    H, Hkv = pattern.num_heads, pattern.num_kv_heads
    q = torch.zeros(batch, seq, H, 4, dtype=torch.float64)
    kv = torch.randn(batch, seq, Hkv, 4, dtype=torch.float64)
    _, lse = s2_attention_reference(q, kv, kv, pattern, return_lse=True)
    return int(torch.exp(lse).sum().round())


def rule_pairs(pattern: S2Pattern, seq: int) -> int:
    """The S2 rule of the module docstring of s2attn.pattern, written out token by token."""
    B, L, V, H = pattern.block_size, pattern.local_blocks, pattern.vert_stride, pattern.num_heads
    step = max(1, V // H)
    every = H // pattern.num_dense_heads if pattern.num_dense_heads else None
    total = 0
    for h in range(H):
        phase = h * step + pattern.head_offset
        for t in range(seq):
            for s in range(t + 1):
                i, j = t // B, s // B
                dense = every is not None and h % every == 0
                total += dense or i - j < L or (j + phase) % V == 0
    return total


# ---- pair counts -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", PATTERNS)
@pytest.mark.parametrize("seq", SEQS)
def test_s2_rows_credit_the_reference_masks_pairs(name, seq):
    pat, batch = PATTERNS[name], 2
    want = reference_pairs(pat, seq, batch)
    assert want == rule_pairs(pat, seq) * batch
    for row in ("s2attn", "varlen", "flex", "flex-fa4"):
        assert bench.row_pairs(row, pat, seq, batch) == want, row
    # Sparse means fewer pairs than the triangle once past the local window.
    if seq > pat.local_blocks * pat.block_size and not pat.num_dense_heads:
        assert want < bench.dense_causal_pairs(seq, pat.num_heads, batch)


@pytest.mark.parametrize("seq", SEQS)
def test_dense_rows_credit_the_causal_triangle(seq):
    pat, batch = PATTERNS["gqa-phase1"], 3
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    want = int(causal.sum()) * pat.num_heads * batch
    assert bench.dense_causal_pairs(seq, pat.num_heads, batch) == want
    for row in (*bench.DENSE_BASELINES, "s2dense"):
        assert bench.row_pairs(row, pat, seq, batch) == want, row
    # Our dense-pattern row really is dense causal in the reference, not only in its count.
    assert reference_pairs(bench.dense_pattern(pat), seq, batch) == want


def test_dense_pattern_computes_dense_causal_attention():
    pat = bench.dense_pattern(PATTERNS["gqa-phase1"])
    assert (pat.num_heads, pat.num_kv_heads, pat.block_size) == (4, 2, 16)
    q = torch.randn(2, 150, 4, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 150, 2, 8, dtype=torch.float64) for _ in range(2))
    out = s2_attention_reference(q, k, v, pat)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def test_varlen_mixed_counts_each_document_alone():
    pat = PATTERNS["mha"]
    lens = bench.mixed_lengths(600, 300, pat.block_size, seed=3)
    assert sum(lens) == 600 and len(lens) > 1
    want = sum(reference_pairs(pat, n) for n in lens)
    assert bench.row_pairs("varlen-mixed", pat, 300, 2, lens) == want
    # Fewer pairs than two 300-token sequences: nothing crosses a document boundary.
    assert want < bench.row_pairs("varlen", pat, 300, 2)
    with pytest.raises(ValueError, match="unknown row"):
        bench.row_pairs("cudnn-typo", pat, 300, 2)


def test_tflops_counts_four_d_flops_per_pair_and_backward_two_and_a_half_times():
    # 1e6 pairs at d=128 in 2 ms: 4*128*1e6 FLOPs / 2e-3 s = 0.256 TFLOP/s forward.
    assert bench.tflops(10**6, 128, 2.0, False) == pytest.approx(0.256)
    assert bench.tflops(10**6, 128, 2.0, True) == pytest.approx(0.256 * 3.5)


# ---- the Flex rows run the identical pattern --------------------------------------------------
@pytest.mark.parametrize("name", ["gqa-phase1", "dense-heads"])
@pytest.mark.parametrize("seq", [300, 700])
def test_flex_block_mask_attends_exactly_the_s2_pairs(name, seq):
    """Token by token: full 128-blocks attend everything, partial ones what mask_mod allows,
    others nothing (FlexAttention's semantics, shared by its Triton and FLASH backends)."""
    pat = PATTERNS[name]
    bm = bench.flex_block_mask(pat, seq, torch.device("cpu"))
    H, F = pat.num_heads, bench.FLEX_BLOCK
    nb = -(-seq // F)

    def blocks(num, ind):
        out = torch.zeros(H, nb, nb, dtype=torch.bool)
        for h in range(H):
            for i in range(nb):
                out[h, i, ind[0, h, i, : num[0, h, i]].long()] = True
        return out

    full = blocks(bm.full_kv_num_blocks, bm.full_kv_indices)
    part = blocks(bm.kv_num_blocks, bm.kv_indices)
    assert not (full & part).any()
    h = torch.arange(H)[:, None, None]
    t = torch.arange(seq)[None, :, None]
    s = torch.arange(seq)[None, None, :]
    blk_full, blk_part = full[h, t // F, s // F], part[h, t // F, s // F]
    allowed = blk_full | (blk_part & bm.mask_mod(0, h, t, s))
    # Per query, as the reference counts them (exp(lse) with zero logits).
    q = torch.zeros(1, seq, H, 4, dtype=torch.float64)
    kv = torch.randn(1, seq, pat.num_kv_heads, 4, dtype=torch.float64)
    _, lse = s2_attention_reference(q, kv, kv, pat, return_lse=True)
    assert torch.equal(allowed.sum(-1), torch.exp(lse[0]).round().long())
    assert int(allowed.sum()) == rule_pairs(pat, seq)
    # Full blocks exist where a whole 128 x 128 tile is attended (dense heads, local band), so
    # both kinds of block are exercised.
    if name == "dense-heads" and seq == 700:
        assert full.any() and part.any()


# ---- rows: names, availability, plan -----------------------------------------------------------
def test_parse_rows_keeps_order_drops_repeats_and_names_unknown_rows():
    assert bench.parse_rows("fa4, cudnn,,fa4") == ["fa4", "cudnn"]
    assert set(bench.parse_rows(bench.DEFAULT_ROWS)) >= {"s2dense", "flex", "flex-fa4", "fa4"}
    with pytest.raises(ValueError, match=r"\['cudn'\]"):
        bench.parse_rows("flex,cudn")


def test_unavailable_rows_without_flash_attn_4():
    calls = []

    def missing(name):
        calls.append(name)
        raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")

    rows = ["s2dense", "flex", "flex-fa4", "cudnn", "fa4"]
    out = bench.unavailable_rows(rows, missing, backends=("TRITON", "FLASH"))
    assert sorted(out) == ["fa4", "flex-fa4"]
    assert all(
        "flash_attn.cute does not import" in r and "stage_flash_attn4" in r for r in out.values()
    )
    assert calls == ["flash_attn.cute"]
    # Rows that need no FA4 never import it (the import is slow where it works).
    calls.clear()
    assert bench.unavailable_rows(["flex", "cudnn"], missing) == {}
    assert calls == []


def test_unavailable_rows_with_flash_attn_4_but_an_older_flex():
    imported = []
    out = bench.unavailable_rows(["flex-fa4", "fa4"], imported.append, backends=())
    assert list(out) == ["flex-fa4"] and "BACKEND='FLASH'" in out["flex-fa4"]
    assert imported == ["flash_attn.cute"]
    assert bench.unavailable_rows(["flex-fa4", "fa4"], imported.append, ("FLASH",)) == {}


def test_this_torch_reports_its_flex_backends():
    from torch.nn.attention.flex_attention import FlexKernelOptions

    has = "BACKEND" in FlexKernelOptions.__annotations__
    assert ("FLASH" in bench.flex_backends()) == has


def test_plan_rows_splits_in_order():
    run, skipped = bench.plan_rows(
        ["s2dense", "fa4", "cudnn", "flex-fa4"], {"fa4": "x", "flex-fa4": "y"}
    )
    assert run == ["s2dense", "cudnn"]
    assert skipped == [("fa4", "x"), ("flex-fa4", "y")]


def test_extra_cases_carry_their_own_dense_baselines():
    args = bench.build_arg_parser().parse_args(["--seqs", "8192", "--extra", "--rows", "flex"])
    cases = bench.build_cases(args, bench.parse_rows(args.rows))
    assert [(c[0], c[1], c[2]) for c in cases] == [
        (8192, 128, 64),
        (32768, 64, 64),
        (32768, 128, 16),
    ]
    assert cases[0][3] == ["flex"]
    for _, _, _, rows, _ in cases[1:]:
        assert {"cudnn", "fa4", "flex", "flex-fa4"} <= set(rows)


def test_list_rows_runs_without_a_gpu(capsys):
    bench.main(["--list-rows", "--rows", "s2dense,cudnn"])
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["s2dense", "cudnn"]
    assert all(line.endswith("available") for line in out)


# ---- fractions and the table -------------------------------------------------------------------
def timed(row, name, fwd_tf, fb_tf, batch=4):
    # Times consistent with the rates for 1e9 pairs at d=128.
    pairs = 10**9
    return dict(
        row=row,
        name=name,
        seq=32768,
        batch=batch,
        d=128,
        block=64,
        pairs=pairs,
        fwd_ms=4 * 128 * pairs / (fwd_tf * 1e12) * 1e3,
        fwdbwd_ms=4 * 128 * pairs * 3.5 / (fb_tf * 1e12) * 1e3,
        fwd_tflops=fwd_tf,
        fwdbwd_tflops=fb_tf,
    )


def case_records():
    return [
        {"row": "flex-fa4", "name": "flex FA4 (same S2)", "seq": 32768, "batch": 4, "d": 128,
         "block": 64, "skipped": "flash_attn.cute does not import"},
        timed("s2attn", "s2attn", 360.0, 280.0),
        # Our dense-pattern row is faster than cuDNN here but never counts as "best dense".
        timed("s2dense", "s2attn dense (V=1)", 700.0, 650.0),
        timed("flex", "flex (same S2)", 200.0, 190.0),
        {"row": "flash", "name": "sdpa flash dense", "seq": 32768, "batch": 4, "d": 128,
         "block": 64, "error": "out of memory"},
        timed("cudnn", "sdpa cudnn dense", 600.0, 560.0),
        timed("fa4", "fa4 dense", 590.0, 610.0),
    ]  # fmt: skip


def test_best_dense_and_fractions():
    rs = case_records()
    assert bench.best_dense(rs)["row"] == "fa4"  # by fwd+bwd
    assert bench.best_dense(rs, "fwd_tflops")["row"] == "cudnn"
    ours = rs[1]
    assert bench.fraction_of_best_dense(ours, rs) == pytest.approx(280 / 610)
    assert bench.fraction_of_best_dense(ours, rs, "fwd_tflops") == pytest.approx(360 / 600)
    assert bench.fraction_of_best_dense(rs[0], rs) is None  # skipped
    no_dense = [r for r in rs if r["row"] not in bench.DENSE_BASELINES]
    assert bench.best_dense(no_dense) is None
    assert bench.fraction_of_best_dense(ours, no_dense) is None


def parse_table(text):
    rows = [line for line in text.splitlines() if line.startswith("| 32768")]
    return {
        cells[4]: cells for cells in ([c.strip() for c in r.strip("|").split("|")] for r in rows)
    }


def test_summarize_prints_every_row_its_fraction_and_a_footer():
    rs = case_records()
    text = bench.summarize({(32768, 128, 64, 0.177): rs})
    table = parse_table(text)
    assert list(table) == [r["name"] for r in rs]
    header = [c.strip() for c in text.splitlines()[0].strip("|").split("|")]
    col = {name: i for i, name in enumerate(header)}
    assert len(header) == 11 and all(len(c) == 11 for c in table.values())
    ours_ms = rs[1]["fwdbwd_ms"]
    for r in rs:
        cells = table[r["name"]]
        if "fwdbwd_tflops" not in r:
            assert cells[col["fwd ms"]] == ("skipped" if "skipped" in r else "failed")
            continue
        assert float(cells[col["fwd+bwd TF/s"]]) == round(r["fwdbwd_tflops"])
        frac = cells[col["of best dense (fwd+bwd TF/s)"]]
        assert frac == f"{100 * r['fwdbwd_tflops'] / 610:.0f}%"
        speedup = cells[col["s2attn speedup (fwd+bwd)"]]
        assert speedup == ("" if r["name"] == "s2attn" else f"{r['fwdbwd_ms'] / ours_ms:.2f}x")
    assert table["s2attn"][col["of best dense (fwd+bwd TF/s)"]] == "46%"
    footer = text.split("\n\n")[1]
    assert "best dense fwd+bwd fa4 dense 610 TF/s, fwd sdpa cudnn dense 600 TF/s" in footer
    assert "s2attn: fwd+bwd 280 TF/s = 46% of best dense, fwd 360 TF/s = 60%" in footer
    # per product run: 280 * 9 / 7 = 360 TF/s, 59% of the best dense kernel's 610
    assert "per product run (9 against 7) 360 TF/s = 59%" in footer
    assert "s2attn dense (V=1): fwd+bwd 650 TF/s = 107% of best dense" in footer
    assert "skipped flex FA4 (same S2): flash_attn.cute does not import" in text


def test_summarize_without_dense_baselines_says_so():
    rs = [timed("s2attn", "s2attn", 300.0, 250.0), timed("flex", "flex (same S2)", 100.0, 90.0)]
    text = bench.summarize({(32768, 128, 16, 0.138): rs})
    assert all(c[-1] == "" for c in parse_table(text).values())
    assert "no dense baseline ran" in text


# ---- the end-to-end row -----------------------------------------------------------------------
def trainer_config(argv):
    """The run config that ``argv`` (a trainer command) resolves to, as the trainer's CLI does."""
    from megatron_s2.training.cli import build_arg_parser
    from megatron_s2.training.run_config import load_config

    argv = list(argv)
    assert argv[1:3] == ["-m", "megatron_s2.training"]
    args = build_arg_parser().parse_intermixed_args(argv[3:])
    assert args.restart  # a benchmark run never resumes an older run's checkpoint
    cfg = load_config(args.config, args.overrides)
    cfg.validate(world_size=1)
    return cfg


def test_e2e_commands_resolve_to_the_1p3b_twins_at_each_length(tmp_path):
    runs = e2e.plan_runs([32768, 131072], ["s2", "dense"], steps=6, out_dir=str(tmp_path))
    assert [(r.model, r.seq) for r in runs] == [
        ("s2", 32768), ("dense", 32768), ("s2", 131072), ("dense", 131072)
    ]  # fmt: skip
    dirs = set()
    for run in runs:
        cfg = trainer_config(run.argv)
        m, t = cfg.model, cfg.train
        assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (24, 2048, 16)
        assert m.seq_length == run.seq and m.recompute == "full"
        assert (t.micro_batch_size, t.global_batch_size, t.train_iters) == (1, 1, 6)
        assert t.eval_interval == 0 and cfg.checkpoint.save_at_end is False
        assert cfg.checkpoint.save_interval == 0 and cfg.data.demo
        assert cfg.logging.log_interval == 1
        assert cfg.run_dir == run.run_dir and run.run_dir.startswith(str(tmp_path))
        dirs.add(run.run_dir)
        kinds = cfg.schedule().layer_kinds(m.num_layers)
        if run.model == "s2":
            assert kinds == ["dense", "S2"] * 12  # the 1:1 hybrid
        else:
            assert kinds == ["dense"] * 24
    assert len(dirs) == 4


def test_e2e_overrides_come_last_and_win(tmp_path):
    (run,) = e2e.plan_runs(
        [32768], ["dense"], steps=4, out_dir=str(tmp_path), overrides=["model.num_layers=2"]
    )
    assert trainer_config(run.argv).model.num_layers == 2


def test_e2e_dry_run_prints_commands_and_runs_nothing(tmp_path, capsys):
    assert e2e.main(["--dry-run", "--seqs", "32768", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("-m megatron_s2.training") == 2
    assert "configs/gpt-1.3b-s2.yaml" in out and "configs/gpt-1.3b-dense.yaml" in out
    assert not os.listdir(tmp_path)


def write_run(run_dir, speeds, mem=40.0, summary_speed=None):
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for i, tps in enumerate(speeds, 1):
            rec = {"kind": "train", "iteration": i, "loss": 5.0, "tokens_per_s": tps}
            f.write(json.dumps({**rec, "gpu_mem_gib": mem + i}) + "\n")
        f.write(json.dumps({"kind": "valid", "iteration": 2, "loss": 4.0}) + "\n")
    if summary_speed is not None:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump({"iteration": len(speeds), "tokens_per_s": summary_speed}, f)


def test_e2e_reads_median_after_warmup_and_the_summary(tmp_path):
    d = str(tmp_path / "r")
    write_run(d, [100.0, 900.0, 1000.0, 1200.0, 1100.0, 5.0], summary_speed=1040.0)
    got = e2e.read_result(d, warmup_steps=2)
    assert got["median_tokens_per_s"] == pytest.approx(1050.0)  # of 1000, 1200, 1100, 5
    assert got["summary_tokens_per_s"] == 1040.0
    assert got["steps"] == 6 and got["measured_steps"] == 4
    assert got["peak_mem_gib"] == pytest.approx(46.0) and got["mem_kind"] == "gpu_mem_gib"
    with pytest.raises(ValueError, match="no training step after"):
        e2e.read_result(d, warmup_steps=6)


def test_e2e_table_puts_the_twins_side_by_side():
    results = [
        dict(model="s2", seq=32768, median_tokens_per_s=20800.0, summary_tokens_per_s=20000.0,
             peak_mem_gib=50.0),
        dict(model="dense", seq=32768, median_tokens_per_s=17600.0, summary_tokens_per_s=17000.0,
             peak_mem_gib=52.0),
        dict(model="s2", seq=131072, error="exit code 1: CUDA out of memory"),
        dict(model="dense", seq=131072, median_tokens_per_s=7400.0, summary_tokens_per_s=7300.0,
             peak_mem_gib=70.0),
    ]  # fmt: skip
    text = e2e.format_table(results)
    lines = [
        line
        for line in text.splitlines()
        if line.startswith("| 32768") or line.startswith("| 131072")
    ]
    first = [c.strip() for c in lines[0].strip("|").split("|")]
    assert first[:4] == ["32768", "20,800", "17,600", f"{20800 / 17600:.2f}x"]
    second = [c.strip() for c in lines[1].strip("|").split("|")]
    assert second[1] == "failed" and second[2] == "7,400" and second[3] == ""
    assert "CUDA out of memory" in text
    assert first[4:] == ["20,000 / 17,000", "50.0 / 52.0"]
    assert second[4:] == ["/ 7,300", "/ 70.0"]


def test_baseline_package_is_a_second_copy_that_computes_the_same(tmp_path):
    """--baseline: another copy of s2attn imports beside this one (its own module objects and
    pattern class) and, being the same code here, gives the same attention on the same inputs."""
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    copy = tmp_path / "kernels"
    shutil.copytree(os.path.join(root, "kernels"), copy)
    base = bench.load_baseline(str(copy))
    assert base.__name__ == bench.BASELINE_PACKAGE
    assert base.S2Pattern is not S2Pattern
    pattern = PATTERNS["gqa-phase1"]
    bp = bench.baseline_pattern(base, pattern)
    assert isinstance(bp, base.S2Pattern) and repr(bp) == repr(pattern)
    import s2attn

    q = torch.randn(1, 70, 4, 16)
    k, v = torch.randn(1, 70, 2, 16), torch.randn(1, 70, 2, 16)
    torch.testing.assert_close(
        base.s2_attention(q, k, v, bp), s2attn.s2_attention(q, k, v, pattern)
    )
    with pytest.raises(SystemExit, match="no __init__.py"):
        bench.load_baseline(str(tmp_path))


def test_kernel_timing_script_needs_a_baseline_package(tmp_path):
    """tools/run_kernel_timing.sh refuses, before any GPU work, a folder that is no package."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "tools", "run_kernel_timing.sh")
    run = subprocess.run(["bash", script, str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 2 and "no s2attn package" in run.stderr
    run = subprocess.run(["bash", script], capture_output=True, text=True)
    assert run.returncode != 0 and "usage" in run.stderr


def test_sweep_adds_wide_key_tiles_only_where_a_block_holds_them():
    from s2attn.config import kernel_config

    for block, wide in ((64, 0), (128, 2)):
        pattern = S2Pattern(num_heads=4, block_size=block, local_blocks=2, vert_stride=2)
        base = kernel_config(pattern, 128, "cuda")
        configs = bench.sweep_configs(base, block_size=block)
        got = [c for c in configs if c.block_n == 128]
        assert len(got) == wide
        assert {c.tma for c in got} == ({True, False} if wide else set())
        assert all(c.fwd == bench.PassConfig(128, 8, 3) for c in got)
        labels = [bench.config_label(c, base) for c in got]
        assert all(label.startswith("s2attn bn=128") for label in labels)
        assert bench.sweep_configs(base, "bn=128", block) == got


def test_sweep_times_the_tl_forward_and_the_gluon_backward_passes_where_gluon_runs():
    import dataclasses

    from s2attn.config import kernel_config

    pattern = S2Pattern(num_heads=4, block_size=64, local_blocks=2, vert_stride=2)
    plain = kernel_config(pattern, 128, "cuda")  # no GPU here: the Gluon flags off
    for dkdv, dq in ((True, False), (False, False), (True, True)):
        base = dataclasses.replace(plain, gluon_fwd=True, gluon_dkdv=dkdv, gluon_dq=dq)
        configs = bench.sweep_configs(base, block_size=64)
        labels = [bench.config_label(c, base) for c in configs]
        assert configs[0] == dataclasses.replace(base, gluon_fwd=False)
        assert labels[0] == "s2attn gluon_fwd=False"
        assert configs[1] == dataclasses.replace(base, gluon_dkdv=not dkdv)
        assert labels[1] == f"s2attn gluon_dkdv={not dkdv}"
        assert configs[2] == dataclasses.replace(base, gluon_dq=not dq)
        assert labels[2] == f"s2attn gluon_dq={not dq}"
        both = f"s2attn gluon_dkdv={not dkdv},gluon_dq={not dq}"
        assert (both in labels) == (dkdv == dq)  # both at once where they agree
        assert all(c.gluon_fwd for c in configs[1:])
        assert bench.sweep_configs(base, "gluon_d", block_size=128)  # 64-key tiles
        assert bench.sweep_configs(base, "gluon_d", block_size=16)  # gathered tiles
        assert not bench.sweep_configs(base, "gluon_d", block_size=256)
    off = dataclasses.replace(base, gluon_fwd=False)
    assert len(bench.sweep_configs(off, block_size=64)) == len(configs) - 4  # nothing to add


def test_rows_are_timed_round_by_round():
    """``time_rows`` runs every row once a round, in order in even rounds and reversed in odd
    ones: each row as often, and no row always first (timed in blocks, the first block after a
    compile ran 4-7% faster on the H100 for identical kernels)."""
    assert timing.round_order(2, 4) == [0, 1, 1, 0, 0, 1, 1, 0]
    order = timing.round_order(3, 6)
    assert order == [0, 1, 2, 2, 1, 0] * 3
    assert all(order.count(i) == 6 for i in range(3))
    firsts = order[::3]
    assert firsts.count(0) == firsts.count(2) == 3
    assert timing.round_order(0, 5) == []


def test_timed_records_keep_the_row_order_and_report_a_failing_row(monkeypatch, capsys):
    """Rows are timed together (one ``time_rows`` call for the forwards, one for the forward +
    backward calls, without the rows whose first call failed) and recorded in their order."""
    calls = []

    def fake_time_rows(fns):
        calls.append(len(fns))
        return [float(fn()) for fn in fns]

    monkeypatch.setattr(bench, "time_rows", fake_time_rows)
    summary = dict(
        power_w_median=690.0, power_w_max=699.0, power_limit_w=700.0, sm_mhz_median=1410.0,
        sm_mhz_min=1350.0, samples=12,
    )  # fmt: skip

    monkeypatch.setattr(bench, "PowerSampler", fake_power_sampler(summary))

    def fails():
        raise RuntimeError("out of memory at this size")

    shape = dict(seq=1024, batch=1, d=64, block=64)
    pending = [
        ("s2attn", "s2attn", 10**6, lambda: 2.0, lambda: 7.0),
        ("base-s2attn", "base s2attn", 10**6, fails, fails),
        ("cudnn", "sdpa cudnn dense", 2 * 10**6, lambda: 3.0, lambda: 9.0),
    ]
    got = bench.timed_records(pending, shape)
    assert [r["row"] for r in got] == ["s2attn", "base-s2attn", "cudnn"]
    assert calls == [2, 2]
    assert (got[0]["fwd_ms"], got[0]["fwdbwd_ms"]) == (2.0, 7.0)
    assert (got[2]["fwd_ms"], got[2]["fwdbwd_ms"]) == (3.0, 9.0)
    assert "out of memory" in got[1]["error"] and "fwd_ms" not in got[1]
    assert got[2]["fwd_tflops"] == bench.tflops(2 * 10**6, 64, 3.0, False)
    printed = capsys.readouterr().out
    assert "base s2attn: failed (RuntimeError" in printed
    # the GPU's power and clock while the rows were timed: printed and kept with each record
    assert "power median 690 W, max 699 of 700 W; SM clock median 1410 MHz, min 1350" in printed
    assert got[0]["gpu_power"] == summary == got[2]["gpu_power"]


def test_power_sampler_reads_nvidia_smi_lines_and_survives_without_it(tmp_path):
    """``PowerSampler`` runs ``nvidia-smi`` in the background for the timed span and keeps the
    lines that carry power, limit and SM clock; without the command there is no summary and
    no error."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        'echo "$@" > "$(dirname "$0")/args"\n'
        'printf "650.5, 700.00, 1500\\n[N/A], 700.00, 1400\\n698.0, 700.00, 1350\\n"\n'
        "sleep 30\n"
    )
    fake.chmod(0o755)
    with timing.PowerSampler("3", interval_ms=100, command=str(fake)) as sampler:
        import time

        time.sleep(0.5)
    got = sampler.summary()
    assert got == dict(
        power_w_median=674.25, power_w_max=698.0, power_limit_w=700.0, sm_mhz_median=1425.0,
        sm_mhz_min=1350.0, samples=2,
    )  # fmt: skip
    args = (tmp_path / "args").read_text().split()
    assert "--id=3" in args and "-lms=100" in args
    assert "--query-gpu=power.draw,power.limit,clocks.sm" in args
    with timing.PowerSampler(command=str(tmp_path / "missing")) as none:
        pass
    assert none.summary() is None
    assert "not sampled" in timing.describe_power(None)
    assert timing.parse_power_samples("1, 2\n3, 4, x\n5, 6, 7\n") == [(5.0, 6.0, 7.0)]


# ---- --passes ----------------------------------------------------------------------------------
def test_passes_option_parses_and_names_what_it_cannot_time(monkeypatch):
    assert bench.build_arg_parser().parse_args(["--passes"]).passes
    assert not bench.build_arg_parser().parse_args([]).passes
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert bench.passes_unsupported(64, "cuda") is None
    assert bench.passes_unsupported(128, "cuda") is None
    assert bench.passes_unsupported(16, "cuda") is None  # gathered key tiles
    assert "block 8" in bench.passes_unsupported(8, "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "sm_90" in bench.passes_unsupported(64, "cuda")


def test_pass_records_stay_out_of_the_table():
    rs = case_records()
    passes = [
        dict(row="pass", name=f"s2attn {n}", seq=32768, batch=4, d=128, block=64, ms=1.0,
             tflops=500.0, kernel="s2attn", pass_name=n)
        for n in bench.PASS_PRODUCTS
    ]  # fmt: skip
    assert bench.summarize({(32768, 128, 64, 0.177): rs + passes}) == bench.summarize(
        {(32768, 128, 64, 0.177): rs}
    )


def test_tensor_peak_at_a_clock_and_the_pass_cells():
    """The tensor-core peak scales with the SM clock (an H100 SXM's 989 TF/s at 1830 MHz);
    GPUs without a known rate get none, and a pass's cell then shows no share."""
    assert timing.tensor_peak_tflops(1830, 132, (9, 0)) == pytest.approx(989.43, abs=0.01)
    assert timing.tensor_peak_tflops(1485, 132, (9, 0)) == pytest.approx(802.90, abs=0.01)
    assert timing.tensor_peak_tflops(1410, 108, (8, 0)) is None
    rec = dict(pass_name="dkdv", ms=19.91, tflops=626.0, peak_tflops=839.0)
    assert bench.pass_cell(rec) == "dkdv   19.91 ms  626 TF/s (75% of peak)"
    assert bench.pass_cell(dict(rec, peak_tflops=None)) == "dkdv   19.91 ms  626 TF/s"
    assert bench.pass_peak(None, "cuda") is None
    assert bench.pass_peak(dict(sm_mhz_median=1500.0), "cpu") is None
    assert bench.OUR_PRODUCTS == 9 and bench.CREDITED_PRODUCTS == 7
