"""Reference tables of docs/benchmarks.md, generated from the benchmarks' committed raw output.

    python tools/docs_tables.py kernel-32k docs/benchmarks/results/DATE-DEVICE/benchmark.json
    python tools/docs_tables.py e2e docs/benchmarks/results/DATE-DEVICE/e2e.json
    python tools/docs_tables.py --check docs/benchmarks.md   # exit 1 where a table differs
    python tools/docs_tables.py --write docs/benchmarks.md   # (re)generate every marked table

A generated table sits in a document between two marker lines:

    <!-- table: KIND source=PATH -->
    ... the lines this tool generates ...
    <!-- /table -->

``KIND`` is ``kernel`` (every case of ``tools/benchmark.py --json``), ``kernel-32k``,
``kernel-128k``, ... (its cases at that sequence length, k = 1024 tokens), ``e2e``
(``tools/e2e_benchmark.py --json``) or ``scale`` (``tools/scale_check.py --json``, its tables
by ``tools/scale_tables.py``). ``PATH`` is relative to the document's folder; several
files, comma-separated, are read as one (e.g. the 32k and 128k runs of the end-to-end tool in
two device calls). The generated lines name the raw output (a link), the device, the date, the
command exactly as it ran (its ``argv``), then the table and, for kernels, one line per case
with the best dense kernel and the GPU's power and clock while the rows ran.

The numbers are the raw output's; what the tool computes is what tools/benchmark.py's own table
computes from them (the speed-up over s2attn, the fraction of the best dense kernel), so a
table here reads like the one the benchmark printed. ``--check`` regenerates each block and
compares it with the document's; a block whose source is not committed yet and that holds only
the line ``PENDING`` is reported as pending (``--allow-pending`` accepts it).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
import shlex
import sys
from typing import Optional

# The dense kernels of other people that tools/benchmark.py compares against (its
# DENSE_BASELINES; tests/tools/test_docs_tables.py checks that the two agree). Our own dense-pattern
# row is not one of them: it is what they measure.
DENSE_BASELINES = ("flash", "cudnn", "fa4")
# The line a marked block holds until its raw output is committed.
PENDING = "(filled by tools/docs_tables.py from the raw output)"
BEGIN = re.compile(r"^<!--\s*table:\s*(?P<kind>[\w-]+)\s+source=(?P<source>\S+)\s*-->\s*$")
END = re.compile(r"^<!--\s*/table\s*-->\s*$")
KERNEL_AT = re.compile(r"^kernel-(?P<k>\d+)k$")
E2E_LABELS = {"s2": "S2 hybrid", "dense": "dense"}


# ---- reading the raw output ---------------------------------------------------------------------
def load_sources(doc_dir: str, source: str) -> list[tuple[str, dict]]:
    """``[(path as written, parsed JSON)]`` of a marker's comma-separated ``source`` (paths
    relative to ``doc_dir``). OSError / ValueError when a file is missing or not JSON."""
    out = []
    for rel in source.split(","):
        with open(os.path.join(doc_dir, rel)) as f:
            out.append((rel, json.load(f)))
    return out


def command_of(argv: list) -> str:
    """The command line that produced a raw output, from its recorded ``argv`` (the script
    path first, as Python records it)."""
    return "python " + shlex.join(str(a) for a in argv)


def provenance(sources: list[tuple[str, dict]]) -> list[str]:
    """One line per raw output: link, device, date, torch version and the exact command."""
    lines = []
    for rel, doc in sources:
        parts = [f"Raw output [`{os.path.basename(rel)}`]({rel})"]
        parts.append(f"device {doc.get('device', 'not recorded')}")
        parts.append(f"date {doc.get('date', 'not recorded')}")
        if doc.get("torch"):
            parts.append(f"torch {doc['torch']}")
        if doc.get("argv"):
            parts.append(f"command `{command_of(doc['argv'])}`")
        # tools/scale_check.py resumes over several device calls: one command each.
        for i, argv in enumerate(doc.get("commands") or [], 1):
            parts.append(f"command {i} `{command_of(argv)}`")
        lines.append(", ".join(parts) + ".")
    return lines


# ---- kernel tables (tools/benchmark.py --json) --------------------------------------------------
def kernel_cases(records: list, seq: Optional[int] = None) -> dict:
    """The table's records grouped by case, ``{(seq, d, block): [record, ...]}`` in the raw
    output's order; ``--passes`` records (``row == "pass"``) left out, as the benchmark's own
    table leaves them; only cases at ``seq`` tokens when given."""
    cases: dict = {}
    for r in records:
        if r.get("row") == "pass" or (seq is not None and r["seq"] != seq):
            continue
        cases.setdefault((r["seq"], r["d"], r["block"]), []).append(r)
    return cases


def best_dense(records: list, rate: str) -> Optional[dict]:
    """The fastest dense baseline of one case by ``rate`` (``fwd_tflops`` or
    ``fwdbwd_tflops``), or None when none ran."""
    timed = [r for r in records if r.get("row") in DENSE_BASELINES and rate in r]
    return max(timed, key=lambda r: r[rate], default=None)


def fraction_of_best_dense(record: dict, records: list, rate: str) -> Optional[float]:
    """``record``'s rate over the best dense baseline's in its case (1.0: as fast per
    attended pair); None when either did not run."""
    best = best_dense(records, rate)
    if best is None or rate not in record:
        return None
    return record[rate] / best[rate]


def speedup(record: dict, records: list) -> Optional[float]:
    """``record``'s fwd+bwd time over the s2attn row's in the same case (how much faster
    s2attn is); None for the s2attn row itself or where either did not run."""
    ours = next((r for r in records if r.get("name") == "s2attn" and "fwdbwd_ms" in r), None)
    if ours is None or record is ours or "fwdbwd_ms" not in record:
        return None
    return record["fwdbwd_ms"] / ours["fwdbwd_ms"]


def _pct(x: Optional[float]) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


def describe_gpu(power: Optional[dict]) -> str:
    """The GPU's power draw and SM clock while a case's rows ran (tools/gpu_timing.py's
    PowerSampler summary: watts and MHz), or that they were not sampled."""
    if not power:
        return "power and clock not sampled"
    return (
        f"power median {power['power_w_median']:.0f} W of {power['power_limit_w']:.0f} W, "
        f"SM clock median {power['sm_mhz_median']:.0f} MHz (min {power['sm_mhz_min']:.0f})"
    )


def kernel_table(records: list, seq: Optional[int] = None) -> list[str]:
    """Markdown lines: one table row per record of the cases (at ``seq`` when given), then one
    line per case naming its best dense kernels and the GPU's power and clock."""
    lines = [
        "| seq x batch | d | block | kernel | fwd ms | fwd TF/s | fwd+bwd ms | fwd+bwd TF/s "
        "| s2attn speed-up (fwd+bwd time) | of best dense (fwd+bwd TF/s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    cases = kernel_cases(records, seq)
    if not cases:
        raise ValueError(f"no kernel case at seq {seq} in the raw output")
    for (s, d, block), rs in cases.items():
        for r in rs:
            head = f"| {s} x {r['batch']} | {d} | {block} | {r['name']} |"
            if "skipped" in r:
                lines.append(f"{head} skipped | | | | | |")
                notes.append(f"Skipped {r['name']}: {r['skipped']}.")
                continue
            if "fwdbwd_ms" not in r:
                lines.append(f"{head} failed | | | | | |")
                error = (r.get("error") or "").splitlines()[0:1]
                notes.append(f"Failed {r['name']} at {s}: {''.join(error)}.")
                continue
            sp = speedup(r, rs)
            lines.append(
                f"{head} {r['fwd_ms']:.2f} | {r['fwd_tflops']:.0f} | {r['fwdbwd_ms']:.2f} | "
                f"{r['fwdbwd_tflops']:.0f} | {'' if sp is None else f'{sp:.2f}x'} | "
                f"{_pct(fraction_of_best_dense(r, rs, 'fwdbwd_tflops'))} |"
            )
    lines.append("")
    for (s, d, block), rs in cases.items():
        batch = rs[0]["batch"]
        fb, f = best_dense(rs, "fwdbwd_tflops"), best_dense(rs, "fwd_tflops")
        best = (
            f"best dense fwd+bwd {fb['name']} {fb['fwdbwd_tflops']:.0f} TF/s, "
            f"fwd {f['name']} {f['fwd_tflops']:.0f} TF/s"
            if fb is not None
            else "no dense baseline ran"
        )
        power = next((r["gpu_power"] for r in rs if r.get("gpu_power")), None)
        lines.append(f"- {s} x {batch}, d {d}, block {block}: {best}; {describe_gpu(power)}.")
    return lines + ([""] + [f"- {n}" for n in dict.fromkeys(notes)] if notes else [])


# ---- end-to-end tables (tools/e2e_benchmark.py --json) ------------------------------------------
def e2e_table(records: list) -> list[str]:
    """Markdown lines: per sequence length the two models' median tokens/s side by side, the S2
    / dense ratio, the trainer's own summary.json figure, peak memory and the steps measured;
    then the runs that failed."""
    lines = [
        "| seq | S2 hybrid tokens/s | dense tokens/s | S2 / dense | summary.json tokens/s "
        "(S2 / dense) | peak memory GiB (S2 / dense) | steps measured (S2 / dense) |",
        "|---|---|---|---|---|---|---|",
    ]
    failed = []
    for seq in dict.fromkeys(r["seq"] for r in records):
        by = {r["model"]: r for r in records if r["seq"] == seq}
        ok = {m: r for m, r in by.items() if "error" not in r}
        failed += [f"{E2E_LABELS[m]} at {seq}: {r['error']}" for m, r in by.items() if m not in ok]

        def cell(model, key, fmt, by=by, ok=ok):
            if model not in by:
                return ""
            if model not in ok:
                return "failed" if key == "median_tokens_per_s" else ""
            value = ok[model].get(key)
            return "" if value is None else fmt.format(value)

        ratio = (
            f"{ok['s2']['median_tokens_per_s'] / ok['dense']['median_tokens_per_s']:.2f}x"
            if "s2" in ok and "dense" in ok
            else ""
        )

        def both(key, fmt, cell=cell):
            return " / ".join(cell(m, key, fmt) for m in E2E_LABELS)

        lines.append(
            f"| {seq} | {cell('s2', 'median_tokens_per_s', '{:,.0f}')} | "
            f"{cell('dense', 'median_tokens_per_s', '{:,.0f}')} | {ratio} | "
            f"{both('summary_tokens_per_s', '{:,.0f}')} | {both('peak_mem_gib', '{:.1f}')} | "
            f"{both('measured_steps', '{}')} |"
        )
    return lines + ([""] + [f"- Failed: {f}" for f in failed] if failed else [])


# ---- blocks of a document -----------------------------------------------------------------------
def render(kind: str, sources: list[tuple[str, dict]]) -> list[str]:
    """The lines of a block of ``kind`` from its parsed ``sources``: provenance, a blank line,
    the table. ValueError for an unknown kind or a seq with no case."""
    head = [x for line in provenance(sources) for x in (line, "")]
    if kind == "scale":
        return head + scale_table(sources)
    records = [r for _, doc in sources for r in doc["results"]]
    if kind == "e2e":
        table = e2e_table(records)
    elif kind == "kernel":
        table = kernel_table(records)
    elif m := KERNEL_AT.match(kind):
        table = kernel_table(records, int(m["k"]) * 1024)
    else:
        raise ValueError(f"unknown table kind {kind!r}: kernel, kernel-<N>k, e2e or scale")
    # one paragraph per raw output (consecutive lines would run together in markdown)
    return head + table


def scale_table(sources: list[tuple[str, dict]]) -> list[str]:
    """The tables of tools/scale_check.py's JSON (tools/scale_tables.py writes them: speed,
    equivalence and resume, TE, and the labelled 8/16-GPU estimate); several files are read as
    one (their runs together, the first file's machine facts)."""
    import scale_tables  # tools/ is on the path: this script's folder

    merged = dict(sources[0][1])
    merged["runs"] = [r for _, doc in sources for r in doc.get("runs", [])]
    return scale_tables.format_all(merged).split("\n")


@dataclasses.dataclass
class Block:
    """A marked table in a document: its kind and source, and the line numbers (0-based) of
    its begin and end markers."""

    kind: str
    source: str
    begin: int
    end: int


def find_blocks(lines: list[str]) -> list[Block]:
    """The marked blocks of a document's ``lines``; ValueError for a begin marker without an
    end, or an end without a begin (a half-marked table would never be checked)."""
    blocks, open_ = [], None
    for i, line in enumerate(lines):
        if m := BEGIN.match(line):
            if open_ is not None:
                raise ValueError(f"line {i + 1}: table begins inside the one at {open_[2] + 1}")
            open_ = (m["kind"], m["source"], i)
        elif END.match(line):
            if open_ is None:
                raise ValueError(f"line {i + 1}: <!-- /table --> without a table marker")
            blocks.append(Block(open_[0], open_[1], open_[2], i))
            open_ = None
        elif re.match(r"^\s*<!--\s*/?\s*table", line):  # a marker line, but not one of ours
            raise ValueError(f"line {i + 1}: malformed table marker: {line.strip()}")
    if open_ is not None:
        raise ValueError(f"line {open_[2] + 1}: table marker without <!-- /table -->")
    return blocks


def _content(lines: list[str], block: Block) -> list[str]:
    """A block's lines between its markers, without leading and trailing blank lines."""
    body = lines[block.begin + 1 : block.end]
    while body and not body[0].strip():
        body = body[1:]
    while body and not body[-1].strip():
        body = body[:-1]
    return body


@dataclasses.dataclass
class Problem:
    """What ``check`` found wrong with one block: ``kind`` is ``differs``, ``missing`` (its
    source does not load) or ``pending`` (no source yet, and the block says so)."""

    kind: str
    line: int  # 1-based line of the block's begin marker
    message: str


def generate(doc_path: str, block: Block) -> list[str]:
    """The lines ``block`` of the document at ``doc_path`` should hold."""
    return render(block.kind, load_sources(os.path.dirname(doc_path), block.source))


def check(doc_path: str) -> list[Problem]:
    """Every marked block of the document that does not hold what its source generates."""
    with open(doc_path) as f:
        lines = f.read().split("\n")
    problems = []
    for b in find_blocks(lines):
        have = _content(lines, b)
        where = f"{doc_path}:{b.begin + 1} ({b.kind} from {b.source})"
        try:
            want = generate(doc_path, b)
        except (OSError, ValueError, KeyError) as exc:
            kind = "pending" if have == [PENDING] else "missing"
            problems.append(Problem(kind, b.begin + 1, f"{where}: {type(exc).__name__}: {exc}"))
            continue
        if have != want:
            diff = difflib.unified_diff(have, want, "document", "generated", lineterm="")
            problems.append(Problem("differs", b.begin + 1, f"{where}:\n" + "\n".join(diff)))
    return problems


def write(doc_path: str) -> int:
    """Regenerate every marked block of the document in place; returns the number written.
    Raises (before writing anything) when a source does not load."""
    with open(doc_path) as f:
        lines = f.read().split("\n")
    blocks = find_blocks(lines)
    new = [(b, generate(doc_path, b)) for b in blocks]
    for b, want in reversed(new):  # from the end, so earlier line numbers stay valid
        # blank lines around the content keep the markers out of the table's markdown
        lines[b.begin + 1 : b.end] = ["", *want, ""]
    with open(doc_path, "w") as f:
        f.write("\n".join(lines))
    return len(new)


def main(argv=None) -> int:
    """Print a table, or check / write a document's marked tables; 0 when all is well."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("args", nargs="+", help="KIND SOURCE.json... or, with --check/--write, DOC.md")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="compare DOC's marked tables")
    mode.add_argument("--write", action="store_true", help="regenerate DOC's marked tables")
    ap.add_argument(
        "--allow-pending",
        action="store_true",
        help="with --check: blocks whose raw output is not committed yet are not an error",
    )
    args = ap.parse_args(argv)
    if args.check or args.write:
        if len(args.args) != 1:
            ap.error("--check and --write take one document")
        doc = args.args[0]
        if args.write:
            print(f"{doc}: {write(doc)} tables written")
            return 0
        problems = check(doc)
        for p in problems:
            print(f"{p.kind}: {p.message}")
        bad = [p for p in problems if not (args.allow_pending and p.kind == "pending")]
        print(f"{doc}: {len(problems)} tables not as generated, {len(bad)} of them errors")
        return 1 if bad else 0
    if len(args.args) < 2:
        ap.error("give a table KIND and at least one raw output file")
    kind, paths = args.args[0], args.args[1:]
    print("\n".join(render(kind, load_sources(".", ",".join(paths)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
