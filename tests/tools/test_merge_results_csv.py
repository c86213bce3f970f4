"""tools/merge_results_csv.py: a lease's sweep table merged into a study's committed one."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.version_independent
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "merge_results_csv.py")
COLUMNS = ["point", "status", "train.seed", "final_valid_loss", "tokens_per_s", "run_dir"]


def _write(path, rows, columns=COLUMNS):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)


def _row(point, status, loss="", seed="1"):
    return {"point": point, "status": status, "train.seed": seed, "final_valid_loss": loss,
            "tokens_per_s": "100.5" if loss else "", "run_dir": f"/x/{point}"}  # fmt: skip


def _run(*args):
    return subprocess.run([sys.executable, TOOL, *map(str, args)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_finished_rows_replace_their_points_and_the_rest_stays(tmp_path):
    committed, new = tmp_path / "results.csv", tmp_path / "lease.csv"
    _write(committed, [_row("dense,seed=1", "finished", "1.20"), _row("dense,seed=2", "not run"),
                       _row("hybrid-DS,seed=1", "not run")])  # fmt: skip
    # The lease trained hybrid-DS seed 1 and a point new to the table; dense seed 1 it did not
    # run, dense seed 2 failed there.
    _write(new, [_row("dense,seed=1", "not run"), _row("dense,seed=2", "failed"),
                 _row("hybrid-DS,seed=1", "finished", "1.19"),
                 _row("hybrid-DS,seed=2", "finished", "1.21", seed="2")])  # fmt: skip
    done = _run(committed, new)
    assert done.returncode == 0, done.stderr
    assert "hybrid-DS,seed=1: not run -> finished" in done.stdout
    assert "hybrid-DS,seed=2: added" in done.stdout
    with open(committed, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["point"] for r in rows] == ["dense,seed=1", "dense,seed=2", "hybrid-DS,seed=1",
                                          "hybrid-DS,seed=2"]  # fmt: skip
    assert rows[0] == _row("dense,seed=1", "finished", "1.20")  # kept, not the lease's not run
    assert rows[1]["status"] == "not run"  # a failure elsewhere does not overwrite
    assert rows[2] == _row("hybrid-DS,seed=1", "finished", "1.19")
    # Merging again changes nothing.
    before = committed.read_bytes()
    assert _run(committed, new).returncode == 0
    assert committed.read_bytes() == before


def test_a_carried_run_keeps_the_committed_cells_the_lease_left_empty(tmp_path):
    """A run carried into a later lease comes back finished with the cells its files cannot
    give (here tokens_per_s) empty: the committed row stays whole; a value that differs (two
    runs of the point) is still refused."""
    committed, new = tmp_path / "results.csv", tmp_path / "lease.csv"
    full = _row("dense,seed=1", "finished", "1.20")
    _write(committed, [full])
    _write(new, [{**full, "tokens_per_s": ""}])
    done = _run(committed, new)
    assert done.returncode == 0, done.stderr
    assert "dense,seed=1: unchanged (kept the committed tokens_per_s)" in done.stdout
    with open(committed, newline="") as f:
        assert list(csv.DictReader(f)) == [full]
    _write(new, [{**full, "tokens_per_s": "", "final_valid_loss": "1.30"}])
    clash = _run(committed, new)
    assert clash.returncode == 2 and "finished in both tables" in clash.stderr


def test_conflicts_and_other_tables_are_refused_and_nothing_is_written(tmp_path):
    committed, new = tmp_path / "results.csv", tmp_path / "lease.csv"
    _write(committed, [_row("dense,seed=1", "finished", "1.20")])
    before = committed.read_bytes()
    _write(new, [_row("dense,seed=1", "finished", "1.25")])
    done = _run(committed, new)
    assert done.returncode == 2
    assert "point 'dense,seed=1' is finished in both tables with different values" in done.stderr
    assert "final_valid_loss" in done.stderr and "--replace" in done.stderr
    assert committed.read_bytes() == before
    assert _run(committed, new, "--replace").returncode == 0
    with open(committed, newline="") as f:
        assert next(csv.DictReader(f))["final_valid_loss"] == "1.25"
    # Another sweep's columns.
    _write(new, [{**_row("dense,seed=1", "finished", "1.2"), "checkpoint.load_dir": "x"}],
           columns=COLUMNS + ["checkpoint.load_dir"])  # fmt: skip
    before = committed.read_bytes()
    done = _run(committed, new)
    assert done.returncode == 2 and "['checkpoint.load_dir']" in done.stderr
    assert committed.read_bytes() == before
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    done = _run(committed, tmp_path / "bad.csv")
    assert done.returncode == 2 and "no point and status column" in done.stderr
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".results-")]


def test_merge_keeps_the_committed_recipe_table():
    """The committed retrieval study tables are what the tool makes of their base version and
    a lease's table: merging one of them into itself leaves it byte for byte."""
    spec = importlib.util.spec_from_file_location("merge_results_csv", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = os.path.join(REPO, "docs/long_context/results/retrieval-125m-extend-32k/results.csv")
    columns, rows = mod.read_table(path)
    merged, changes = mod.merge(rows, rows)
    assert merged == rows and all(c.endswith("unchanged") for c in changes) and changes


@pytest.mark.parametrize("adopted_in", ["new", "committed"])
def test_the_adopted_from_column_may_be_in_one_table_only(tmp_path, adopted_in):
    """A sweep writes adopted_from only when a point was adopted: a table with it merges with
    one without it; the merged table has the column in the sweep's place, empty where a row
    had none. Any other column in one table only is still refused."""
    committed, new = tmp_path / "results.csv", tmp_path / "lease.csv"
    with_col = [*COLUMNS[:-1], "adopted_from", COLUMNS[-1]]
    old_rows = [_row("dense,seed=1", "finished", "1.20"), _row("dense,seed=2", "not run")]
    new_rows = [_row("dense,seed=1", "not run"), _row("dense,seed=2", "finished", "1.22", "2")]
    if adopted_in == "new":
        new_rows[1]["adopted_from"] = "/other/dense,seed=2"
        _write(committed, old_rows)
        _write(new, new_rows, with_col)
    else:
        old_rows[0]["adopted_from"] = "/other/dense,seed=1"
        _write(committed, old_rows, with_col)
        _write(new, new_rows)
    done = _run(committed, new)
    assert done.returncode == 0, done.stderr
    with open(committed, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == with_col
        rows = {r["point"]: r for r in reader}
    assert rows["dense,seed=2"]["final_valid_loss"] == "1.22"
    adopted = {p: r["adopted_from"] for p, r in rows.items()}
    assert adopted == ({"dense,seed=1": "", "dense,seed=2": "/other/dense,seed=2"}
                       if adopted_in == "new" else
                       {"dense,seed=1": "/other/dense,seed=1", "dense,seed=2": ""})  # fmt: skip
    _write(new, [_row("dense,seed=1", "finished", "1.20")], [*COLUMNS, "other"])
    done = _run(committed, new)
    assert done.returncode == 2 and "the tables' columns differ" in done.stderr
