"""tools/docs_tables.py on the CPU: docs/benchmarks.md's tables from the benchmarks' raw output.

The raw output is made by the benchmarks' own code: tools/benchmark.py's ``timed_records`` (its
GPU timing and power sampling replaced by fixed numbers), ``summarize`` and ``json_document``,
and tools/e2e_benchmark.py's ``main`` (its trainer runs replaced by fixed records). So the
schema the tables are read from is the one the tools write, and a change there shows here.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.benchmark import fake_power_sampler
from tests.helpers.megatron import REPO, import_tool

bench = import_tool("benchmark")
e2e = import_tool("e2e_benchmark")
tables = import_tool("docs_tables")

POWER = dict(
    power_w_median=690.0, power_w_max=699.0, power_limit_w=700.0, sm_mhz_median=1410.0,
    sm_mhz_min=1350.0, samples=12,
)  # fmt: skip
# Per case: (row, fwd ms, fwd+bwd ms); pairs from the benchmark's own pair counts below.
CASES = {
    32768: [("s2attn", 17.35, 69.64), ("s2dense", 50.0, 190.0), ("flex", 30.62, 115.49),
            ("cudnn", 58.59, 224.46), ("fa4", 52.0, 190.5)],
    131072: [("s2attn", 51.56, 207.76), ("cudnn", 260.93, 911.21), ("fa4", 240.0, 800.0)],
}  # fmt: skip


@pytest.fixture
def fake_gpu(monkeypatch):
    """tools/benchmark.py's timing without a GPU: each row's call returns its time in ms."""
    monkeypatch.setattr(bench, "time_rows", lambda fns: [float(fn()) for fn in fns])

    monkeypatch.setattr(bench, "PowerSampler", fake_power_sampler(POWER))
    monkeypatch.setattr(bench, "nvidia_smi_id", lambda: "0")


def kernel_raw_output(argv=("tools/benchmark.py", "--seqs", "32768", "131072")) -> dict:
    """A benchmark.json as tools/benchmark.py writes it, for the rows of ``CASES`` (heads 32,
    head_dim 128, block 64, 128k tokens a case), with a skipped row at 32k and a row that fails
    at 128k."""
    pattern = bench.S2Pattern(num_heads=32, block_size=64, local_blocks=16, vert_stride=8)
    results = {}
    for seq, rows in CASES.items():
        batch = 131072 // seq
        shape = dict(seq=seq, batch=batch, d=128, block=64)
        pending = [
            (row, bench.ROWS.get(row, row), bench.row_pairs(row, pattern, seq, batch),
             lambda f=f: f, lambda fb=fb: fb)
            for row, f, fb in rows
        ]  # fmt: skip
        if seq == 131072:

            def fails():
                raise RuntimeError("CUDA out of memory\nsecond line")

            pending.append(("flex", bench.ROWS["flex"], 1, fails, fails))
        recs = bench.timed_records(pending, shape)
        if seq == 32768:
            recs.append(
                dict(row="flex-fa4", name=bench.ROWS["flex-fa4"], **shape, skipped="no FA4")
            )
        results[(seq, 128, 64, pattern.density(seq))] = recs
    doc = bench.json_document(results, bench.summarize(results), "NVIDIA H200")
    doc["argv"] = list(argv)  # as run on the device, not pytest's
    return json.loads(json.dumps(doc))  # what a reader of the file gets


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def row_line(lines: list[str], seq: int, name: str) -> list[str]:
    (line,) = [x for x in lines if x.startswith(f"| {seq} x") and cells(x)[3] == name]
    return cells(line)


def test_kernel_table_recomputes_the_benchmarks_own_figures(fake_gpu, capsys):
    raw = kernel_raw_output()
    lines = tables.render("kernel", [("r/benchmark.json", raw)])
    assert lines[0].startswith(
        "Raw output [`benchmark.json`](r/benchmark.json), device NVIDIA H200"
    )
    assert "command `python tools/benchmark.py --seqs 32768 131072`" in lines[0]
    assert tables.DENSE_BASELINES == bench.DENSE_BASELINES
    for seq in CASES:
        case = [r for r in raw["results"] if r["seq"] == seq]
        ours = next(r for r in case if r["row"] == "s2attn")
        for r in case:
            if "fwdbwd_ms" not in r:
                continue
            got = row_line(lines, seq, r["name"])
            assert got[4:8] == [
                f"{r['fwd_ms']:.2f}", f"{r['fwd_tflops']:.0f}",
                f"{r['fwdbwd_ms']:.2f}", f"{r['fwdbwd_tflops']:.0f}",
            ]  # fmt: skip
            assert got[8] == ("" if r is ours else f"{r['fwdbwd_ms'] / ours['fwdbwd_ms']:.2f}x")
            frac = bench.fraction_of_best_dense(r, case)
            assert got[9] == f"{100 * frac:.0f}%"
            # the same TF/s the benchmark's own formula gives for the recorded pairs and time
            assert r["fwdbwd_tflops"] == bench.tflops(r["pairs"], 128, r["fwdbwd_ms"], True)
    # the figures the old table printed by hand: s2attn at 32k, 313 TF/s and 3.22x over cuDNN
    assert row_line(lines, 32768, "s2attn")[7] == "313"
    assert row_line(lines, 32768, "sdpa cudnn dense")[8] == "3.22x"
    assert row_line(lines, 32768, "flex FA4 (same S2)")[4] == "skipped"
    assert row_line(lines, 131072, "flex (same S2)")[4] == "failed"
    text = "\n".join(lines)
    assert "- Skipped flex FA4 (same S2): no FA4." in text
    assert "- Failed flex (same S2) at 131072: CUDA out of memory." in text
    best = bench.best_dense([r for r in raw["results"] if r["seq"] == 32768], "fwdbwd_tflops")
    assert (
        f"- 32768 x 4, d 128, block 64: best dense fwd+bwd {best['name']} "
        f"{best['fwdbwd_tflops']:.0f} TF/s" in text
    )
    assert "power median 690 W of 700 W, SM clock median 1410 MHz (min 1350)" in text


def test_kernel_table_of_one_length(fake_gpu):
    raw = kernel_raw_output()
    lines = tables.render("kernel-128k", [("b.json", raw)])
    rows = [x for x in lines if x.startswith("| 1") or x.startswith("| 3")]
    assert rows and all(x.startswith("| 131072 x 1 |") for x in rows)
    with pytest.raises(ValueError, match="no kernel case at seq 8192"):
        tables.render("kernel-8k", [("b.json", raw)])
    with pytest.raises(ValueError, match="unknown table kind"):
        tables.render("kernels", [("b.json", raw)])


def e2e_raw_output(tmp_path, monkeypatch) -> dict:
    """An e2e.json as tools/e2e_benchmark.py's main writes it, with each trainer run replaced
    by a fixed record (the 128k S2 run failing)."""
    speeds = {("s2", 32768): 20800.0, ("dense", 32768): 17600.0, ("dense", 131072): 7400.0}

    def execute(run, warmup_steps, timeout):
        out = {"model": run.model, "seq": run.seq, "run_dir": run.run_dir, "log": "x.log"}
        if (run.model, run.seq) not in speeds:
            return {**out, "error": "exit code 1: CUDA out of memory"}
        tps = speeds[(run.model, run.seq)]
        speed = dict(median_tokens_per_s=tps, summary_tokens_per_s=tps - 100)
        return {**out, **speed, "steps": 6, "measured_steps": 4, "peak_mem_gib": 50.25}

    monkeypatch.setattr(e2e, "execute", execute)
    path = tmp_path / "e2e.json"
    code = e2e.main(["--seqs", "32768", "131072", "--out-dir", str(tmp_path), "--json", str(path)])
    assert code == 1  # one run failed
    return json.loads(path.read_text())


def test_e2e_json_records_what_the_table_needs_and_the_table_reads_it(tmp_path, monkeypatch):
    raw = e2e_raw_output(tmp_path, monkeypatch)
    assert set(raw) == {"device", "date", "torch", "argv", "results"}
    assert raw["device"] == "CPU" and len(raw["date"]) == 10 and len(raw["results"]) == 4
    lines = tables.render("e2e", [("e2e.json", raw)])
    assert "device CPU" in lines[0] and f"date {raw['date']}" in lines[0]
    first = cells(next(x for x in lines if x.startswith("| 32768 ")))
    assert first == ["32768", "20,800", "17,600", f"{20800 / 17600:.2f}x", "20,700 / 17,500",
                     "50.2 / 50.2", "4 / 4"]  # fmt: skip
    # the same S2 / dense ratio as the tool's own table
    assert f"{20800 / 17600:.2f}x" in e2e.format_table(raw["results"])
    second = cells(next(x for x in lines if x.startswith("| 131072 ")))
    assert second[1:4] == ["failed", "7,400", ""]
    assert "- Failed: S2 hybrid at 131072: exit code 1: CUDA out of memory" in lines


def make_doc(tmp_path, raw: dict) -> str:
    """A document with two marked kernel tables backed by ``raw``, as yet unfilled."""
    results = tmp_path / "benchmarks" / "results" / "2026-11-28-h200"
    results.mkdir(parents=True)
    (results / "benchmark.json").write_text(json.dumps(raw, indent=1))
    src = "benchmarks/results/2026-11-28-h200/benchmark.json"
    doc = tmp_path / "benchmarks.md"
    doc.write_text(
        f"# B\n\n<!-- table: kernel-32k source={src} -->\n{tables.PENDING}\n<!-- /table -->\n\n"
        f"text between\n\n<!-- table: kernel-128k source={src} -->\nold\n<!-- /table -->\nend\n"
    )
    return str(doc)


def test_check_passes_on_written_tables_and_fails_on_a_changed_number(fake_gpu, tmp_path, capsys):
    doc = make_doc(tmp_path, kernel_raw_output())
    assert [p.kind for p in tables.check(doc)] == ["differs", "differs"]
    assert tables.main(["--write", doc]) == 0
    text = open(doc).read()
    assert "text between" in text and text.endswith("<!-- /table -->\nend\n")
    assert tables.check(doc) == []
    assert tables.main(["--check", doc]) == 0
    # one number edited by hand: the check names the line, shows the difference and fails
    row = next(x for x in text.split("\n") if x.startswith("| 32768 x 4 | 128 | 64 | s2attn |"))
    edited = row.replace("| 313 |", "| 314 |")
    assert edited != row
    open(doc, "w").write(text.replace(row, edited))
    (problem,) = tables.check(doc)
    assert problem.kind == "differs" and problem.line == 3
    assert f"-{edited}" in problem.message and f"+{row}" in problem.message
    capsys.readouterr()
    assert tables.main(["--check", doc]) == 1
    assert "| 314 |" in capsys.readouterr().out


def test_check_fails_where_the_raw_output_changed(fake_gpu, tmp_path):
    raw = kernel_raw_output()
    doc = make_doc(tmp_path, raw)
    tables.write(doc)
    raw["results"][0]["fwdbwd_tflops"] += 1.0
    path = tmp_path / "benchmarks/results/2026-11-28-h200/benchmark.json"
    path.write_text(json.dumps(raw))
    assert [p.kind for p in tables.check(doc)] == ["differs"]


def test_pending_and_missing_sources(tmp_path, capsys):
    doc = tmp_path / "d.md"
    doc.write_text(
        f"<!-- table: e2e source=results/e2e.json -->\n{tables.PENDING}\n<!-- /table -->\n"
        "<!-- table: e2e source=results/gone.json -->\n| 1 |\n<!-- /table -->\n"
    )
    assert [p.kind for p in tables.check(str(doc))] == ["pending", "missing"]
    assert tables.main(["--check", "--allow-pending", str(doc)]) == 1  # the missing one
    doc.write_text(doc.read_text().split("<!-- table: e2e source=results/gone")[0])
    assert tables.main(["--check", str(doc)]) == 1
    assert tables.main(["--check", "--allow-pending", str(doc)]) == 0


@pytest.mark.parametrize(
    "text, error",
    [
        ("<!-- table: e2e source=a.json -->\n", "without <!-- /table -->"),
        ("<!-- /table -->\n", "without a table marker"),
        ("<!-- table: e2e -->\n<!-- /table -->\n", "malformed table marker"),
        (
            "<!-- table: e2e source=a.json -->\n<!-- table: e2e source=b.json -->\n",
            "table begins inside",
        ),
    ],
)
def test_half_marked_tables_are_errors(text, error):
    with pytest.raises(ValueError, match=error):
        tables.find_blocks(text.split("\n"))


def test_the_reference_document_holds_what_its_raw_output_generates():
    """docs/benchmarks.md's marked tables equal what their committed raw output generates.
    A block whose raw output is not committed yet (it says so) skips this test, by name."""
    doc = os.path.join(REPO, "docs", "benchmarks.md")
    with open(doc) as f:
        blocks = tables.find_blocks(f.read().split("\n"))
    assert {b.kind for b in blocks} >= {"kernel-32k", "kernel-128k"}
    problems = tables.check(doc)
    # (a committed raw output beside a block still unfilled is "differs": it fails here)
    assert not [p.message for p in problems if p.kind != "pending"]
    if problems:
        pytest.skip("raw output not committed yet for: " + "; ".join(p.message for p in problems))
