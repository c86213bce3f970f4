"""tools/docs_raw_tables.py: every measurement table of the docs that names a committed raw
output is that raw output's table, verbatim (so a doc edit or a new raw file cannot leave the
two apart), and every such table says where its raw output is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import docs_raw_tables  # noqa: E402

pytestmark = pytest.mark.version_independent


@pytest.mark.parametrize("name", sorted(docs_raw_tables.TABLES))
def test_doc_table_is_recomputed_from_its_raw_output(name):
    t = docs_raw_tables.TABLES[name]
    rebuilt = t.build()
    doc = (REPO / t.doc).read_text()
    assert rebuilt in doc, f"{t.doc}: the table '{name}' differs from {t.raw}:\n{rebuilt}"
    # The line right under the table names the raw outputs it was rebuilt from.
    after = doc[doc.index(rebuilt) + len(rebuilt) :].lstrip("\n").splitlines()[0]
    assert after.startswith("Raw output"), after
    for raw in t.raw:
        assert (REPO / raw).is_file(), raw
        link = Path(raw).relative_to(Path(t.doc).parent).as_posix()
        assert f"]({link})" in after, (link, after)


def test_every_table_is_found_once_in_its_raw_output():
    # A builder that matched two tables of a results file would raise LookupError instead.
    for name, t in docs_raw_tables.TABLES.items():
        assert t.build().count("\n|---") == 1, name


def test_cli_check_passes_and_show_prints_the_table():
    tool = REPO / "tools" / "docs_raw_tables.py"
    done = subprocess.run([sys.executable, str(tool), "check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"{len(docs_raw_tables.TABLES)} tables match their raw output")
    shown = subprocess.run(
        [sys.executable, str(tool), "show", "quality-attention"], capture_output=True, text=True
    )
    assert shown.returncode == 0
    assert shown.stdout.strip() == docs_raw_tables.quality_attention()


def test_range_loss_weights_bins_by_tokens():
    bins = [
        {"start": 0, "end": 2, "loss": 1.0, "tokens": 3},
        {"start": 2, "end": 4, "loss": 2.0, "tokens": 1},
        {"start": 4, "end": 6, "loss": 9.0, "tokens": 1},
    ]
    assert docs_raw_tables.range_loss({"bins": bins}, 0, 4) == pytest.approx(1.25)
    # Without token counts (the stride study's file) the bins weigh alike.
    plain = [{k: v for k, v in b.items() if k != "tokens"} for b in bins]
    assert docs_raw_tables.range_loss(plain, 0, 4) == pytest.approx(1.5)


def test_find_table_prefers_a_whole_heading(tmp_path):
    md = tmp_path / "r.md"
    md.write_text(
        "## run: dense\n\n### acc table\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
        "## run: dense-to-hybrid\n\n### acc table\n\n| a | b |\n|---|---|\n| 3 | 4 |\n"
    )
    tables = docs_raw_tables.read_md_tables(md)
    assert docs_raw_tables.find_table(tables, "run: dense", "acc").rows == [["1", "2"]]
    assert docs_raw_tables.find_table(tables, "run: dense-to-hybrid", "acc").rows == [["3", "4"]]
    with pytest.raises(LookupError):
        docs_raw_tables.find_table(tables, "acc")
