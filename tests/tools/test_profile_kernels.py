"""tools/profile_kernels.py on the CPU: the table read from an ncu ``--page raw --csv`` log, and
the argument checks (the profiling itself needs a GPU and Nsight Compute)."""

from __future__ import annotations

import pytest

from tests.helpers.megatron import import_tool

pytestmark = pytest.mark.version_independent

tool = import_tool("profile_kernels")

HEADER = [
    "ID",
    "Kernel Name",
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread",
    "launch__shared_mem_per_block_dynamic",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_barrier_not_issued_per_issue_active.ratio",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
]
UNITS = [
    "",
    "",
    "nsecond",
    "%",
    "%",
    "register/thread",
    "byte",
    "ratio",
    "ratio",
    "ratio",
    "ratio",
    "ratio",
    "%",
]


def _log(tmp_path, rows, units=True):
    import csv

    path = tmp_path / "ncu.csv"
    with open(path, "w", newline="") as f:
        f.write("==PROF== Connected to process 123\n")
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(HEADER)
        if units:
            w.writerow(UNITS)
        for r in rows:
            w.writerow(r)
    return path


def test_table_has_one_row_per_kernel_with_converted_units(tmp_path):
    rows = [
        [
            "0",
            "_attn_fwd_kernel",
            "14,770,000",
            "71.5",
            "55.25",
            "173",
            "135,290",
            "1.2",
            "3.4",
            "0.5",
            "2.0",
            "9.0",
            "61.04",
        ],
        [
            "1",
            "cudnn_generated_fort_native_sdpa(int, float)",
            "56,950,000",
            "88.0",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
        ],
    ]
    table = tool.table(str(_log(tmp_path, rows)))
    lines = table.splitlines()
    assert lines[0].startswith(
        "| kernel | time ms | SM % | memory % | L2 % | DRAM % | tensor pipe %"
    )
    assert len(lines) == 4
    fwd = [c.strip() for c in lines[2].split("|")[1:-1]]
    want = ["_attn_fwd_kernel", "14.77", "71.5", "-", "61.0", "-", "55.2", "-", "173", "132", "-"]
    assert fwd[:11] == want
    # The three largest stalls, largest first; the "_not_issued" variants are left out.
    assert fwd[11] == "barrier 3.4, math_pipe_throttle 2.0, long_scoreboard 1.2"
    cudnn = [c.strip() for c in lines[3].split("|")[1:-1]]
    assert cudnn[0] == "cudnn_generated_fort_native_sdpa" and cudnn[1] == "56.95"
    assert cudnn[-1] == "-"


def test_log_without_units_row_and_empty_log(tmp_path):
    rows = [["0", "k", "1000000", "50", "", "", "", "", "", "", "", "", ""]]
    lines = tool.table(str(_log(tmp_path, rows, units=False))).splitlines()
    assert len(lines) == 3 and "| k |" in lines[2]
    empty = tmp_path / "empty.csv"
    empty.write_text("==PROF== Disconnected\n")
    assert tool.table(str(empty)).startswith("(no kernels")


def test_bad_cases_are_refused_before_any_gpu_work():
    with pytest.raises(SystemExit, match="--cases: choose from s2,s2dense,cudnn"):
        tool.main(["run", "--cases", "s2,flash"])
