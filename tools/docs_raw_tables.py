"""Recompute the measurement tables of docs/ from the raw outputs committed next to them.

    python tools/docs_raw_tables.py list                  # every table: name, doc, raw files
    python tools/docs_raw_tables.py show quality-attention
    python tools/docs_raw_tables.py check                 # every table must appear in its doc

Each table of a user doc that reports a measurement names its raw output (CSV or JSON written by
the sweep or the long-context evaluation, or the markdown tables the evaluation wrote for every
run) in a "Raw output:" line under it. This tool rebuilds the table, row by row, from that raw
output alone, and ``check`` (and ``tests/tools/test_docs_raw_tables.py``) fails when the doc's
table is not the rebuilt one verbatim, so the doc and its raw output cannot drift apart. Only
the stdlib is used, so the check runs anywhere.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


# ---------------------------------------------------------------------------------------------
# Formatting: the doc tables' conventions, in one place so that every table uses the same ones.


def f4(x: float) -> str:
    """A loss with four decimals (``2.8993``)."""
    return f"{x:.4f}"


def f3(x: float) -> str:
    """A loss with three decimals (``4.454``)."""
    return f"{x:.3f}"


def thousands(x: float) -> str:
    """A rate rounded to an integer with thousands separators (``237,103``)."""
    return f"{round(x):,}"


def rel(a: float, b: float) -> str:
    """``a`` relative to ``b`` in percent, signed, two decimals (``-1.47%``)."""
    return f"{(a / b - 1) * 100:+.2f}%"


def ratio(a: float, b: float) -> str:
    """``a / b`` as a speed-up factor (``1.16x``)."""
    return f"{a / b:.2f}x"


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table: a header row, the ``|---|`` rule, then one line per row."""

    def line(cells: list[str]) -> str:
        # An empty cell is written "| |", as the docs have it.
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"

    return "\n".join([line(header), "|" + "---|" * len(header)] + [line(r) for r in rows])


# ---------------------------------------------------------------------------------------------
# Readers of the raw outputs.


def read_csv(path: Path, key: str = "point") -> dict[str, dict[str, str]]:
    """A sweep's ``results.csv``: one dict per row, keyed by its point name."""
    with open(path, newline="") as f:
        return {row[key]: row for row in csv.DictReader(f)}


def read_json(path: Path) -> dict:
    """A JSON raw output (loss by position of several runs, keyed by run)."""
    with open(path) as f:
        return json.load(f)


def bins_of(entry: dict | list) -> list[dict]:
    """The position bins (``start``, ``end``, ``loss`` and maybe ``tokens``) of one run."""
    return entry["bins"] if isinstance(entry, dict) else entry


def bin_loss(entry: dict | list, start: int) -> float:
    """The mean loss of the bin that starts at ``start``."""
    (b,) = [b for b in bins_of(entry) if b["start"] == start]
    return float(b["loss"])


def range_loss(entry: dict | list, lo: int, hi: int) -> float:
    """Token-weighted mean loss over the bins inside ``[lo, hi)`` (equal weights without counts)."""
    inside = [b for b in bins_of(entry) if lo <= b["start"] and b["end"] <= hi]
    weights = [float(b.get("tokens", 1)) for b in inside]
    return sum(w * float(b["loss"]) for w, b in zip(weights, inside)) / sum(weights)


@dataclass
class MdTable:
    """One markdown table of a results file: the headings above it (outermost first) and cells."""

    headings: tuple[str, ...]
    header: list[str]
    rows: list[list[str]]

    def column(self, name: str) -> int:
        """Index of the column whose header is ``name``."""
        return self.header.index(name)

    def row(self, first_cell: str) -> list[str]:
        """The row whose first cell is ``first_cell``."""
        (r,) = [r for r in self.rows if r[0] == first_cell]
        return r


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def read_md_tables(path: Path) -> list[MdTable]:
    """Every table of a markdown results file with the chain of headings it sits under.

    A heading of level n replaces the chain's entries of level >= n, as in an outline.
    """
    chain: list[tuple[int, str]] = []
    tables: list[MdTable] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            chain = [(lv, h) for lv, h in chain if lv < level] + [(level, line[level:].strip())]
        elif line.startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            header = _cells(line)
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            tables.append(MdTable(tuple(h for _, h in chain), header, rows))
            continue
        i += 1
    return tables


def find_table(tables: list[MdTable], *parts: str) -> MdTable:
    """The one table under a heading for every one of ``parts``.

    A part that is a whole heading somewhere in the file matches only that heading (so that
    ``...: dense`` does not also find ``...: dense-to-hybrid``); any other part matches the
    headings that start with it (``passkey: greedy exact-match`` for its accuracy table).
    """
    whole = {h for t in tables for h in t.headings}

    def matches(part: str, heading: str) -> bool:
        return heading == part if part in whole else heading.startswith(part)

    hits = [t for t in tables if all(any(matches(p, h) for h in t.headings) for p in parts)]
    if len(hits) != 1:
        raise LookupError(f"{len(hits)} tables under headings with {parts!r}, expected 1")
    return hits[0]


def depth_means(t: MdTable) -> dict[str, float]:
    """Mean over the depths (rows) of a ``depth \\ length`` table, per length column."""
    return {
        length: sum(float(r[j]) for r in t.rows) / len(t.rows)
        for j, length in enumerate(t.header)
        if j > 0
    }


def all_cells_mean(t: MdTable) -> float:
    """Mean of every cell of a ``depth \\ length`` table."""
    values = [float(c) for r in t.rows for c in r[1:]]
    return sum(values) / len(values)


# ---------------------------------------------------------------------------------------------
# The tables. Each builder returns the markdown table exactly as the doc carries it.

QUALITY = DOCS / "quality"
LONG = DOCS / "long_context"


def quality_attention() -> str:
    """docs/quality.md, "Result": dense vs 1:1 hybrid vs all-S2 at 100M tokens (H100)."""
    runs = read_csv(QUALITY / "code-125m-attention.csv")
    dense = float(runs["dense"]["final_valid_loss"])
    models = [
        ("dense", "dense", "all dense"),
        ("hybrid-DS", "hybrid (`DS`)", "dense, S2, dense, S2, ..."),
        ("all-s2", "all-S2 (`S`)", "all S2"),
    ]
    rows = []
    for point, label, layers in models:
        r = runs[point]
        valid = float(r["final_valid_loss"])
        rows.append(
            [
                label,
                layers,
                f"{float(r['attention_density']):.3f}",
                f4(valid),
                "" if point == "dense" else rel(valid, dense),
                f4(float(r["final_train_loss"])),
                thousands(float(r["tokens_per_s"])),
                f"{float(r['tflops_per_gpu']):.1f}",
                f"{float(r['peak_memory_gib']):.1f} GiB",
                f"{round(float(r['wall_time_s']))} s",
            ]
        )
    header = [
        "model",
        "attention (12 layers)",
        "attention density at 4k",
        "valid loss",
        "vs dense",
        "train loss (last step)",
        "tokens/s",
        "model TFLOP/s",
        "peak memory",
        "wall",
    ]
    return table(header, rows)


def quality_loss_by_position() -> str:
    """docs/quality.md, "Loss by token position": five bins and the whole 4k, three models."""
    runs = read_json(QUALITY / "code-125m-loss-by-position.json")
    dense, hybrid, s2 = runs["dense"], runs["hybrid-DS"], runs["all-s2"]
    rows = []
    for start in (0, 768, 1792, 2816, 3840):
        d, h, s = (bin_loss(x, start) for x in (dense, hybrid, s2))
        rows.append([f"{start}-{start + 256}", f4(d), f4(h), rel(h, d), f4(s), rel(s, d)])
    d, h, s = (float(x["loss"]) for x in (dense, hybrid, s2))
    rows.append(["all 4096", f4(d), f4(h), rel(h, d), f4(s), rel(s, d)])
    return table(["positions", "dense", "hybrid", "vs dense", "all-S2", "vs dense"], rows)


def quality_stride_window() -> str:
    """docs/quality.md, "Stride x local window": the 7 points at 25M tokens (2x H200)."""
    runs = read_csv(QUALITY / "code-125m-stride-window.csv")
    positions = read_json(QUALITY / "stride-window-loss-by-position.json")
    dense_valid = float(runs["dense"]["final_valid_loss"])
    dense_mean = range_loss(positions["dense"], 0, 4096)
    rows = []
    for stride in (4, 8, 12):
        for local in (4, 16):
            point = f"vert_stride={stride},local_blocks={local}"
            default = " (the default)" if (stride, local) == (8, 16) else ""
            rows.append((point, f"stride {stride}, local {local}{default}"))
    rows.append(("dense", "dense"))
    out = []
    for point, label in rows:
        r, p = runs[point], positions[point]
        valid = float(r["final_valid_loss"])
        mean = range_loss(p, 0, 4096)
        out.append(
            [
                label,
                f"{float(r['attention_density']):.3f}",
                f4(valid),
                "" if point == "dense" else rel(valid, dense_valid),
                f4(bin_loss(p, 0)),
                f4(bin_loss(p, 3840)),
                "" if point == "dense" else rel(mean, dense_mean),
                thousands(float(r["tokens_per_s"])),
            ]
        )
    header = [
        "point",
        "density at 4k",
        "valid loss, step 190",
        "vs dense",
        "loss by position, 0-256",
        "3840-4096",
        "mean over 4k vs dense",
        "tokens/s",
    ]
    return table(header, out)


# Run E: the worked extension example's first complete run (docs/long_context/example_results.md).
RUN_E_RUNS = [
    ("code-125m-4k-base", "dense", "4k base, dense"),
    ("code-125m-4k-base", "hybrid-DS", "4k base, hybrid-DS"),
    ("code-125m-extend-16k", "dense", "16k extension, dense -> dense"),
    ("code-125m-extend-16k", "hybrid-DS", "16k extension, hybrid-DS -> hybrid-DS"),
    ("code-125m-extend-16k", "dense-to-hybrid", "16k extension, dense -> hybrid-DS"),
]


# The retrieval and loss-by-position tables name the extensions by the model they end as.
RUN_E_LABELS = {
    ("code-125m-4k-base", "dense"): "4k base, dense",
    ("code-125m-4k-base", "hybrid-DS"): "4k base, hybrid-DS",
    ("code-125m-extend-16k", "dense"): "16k extension, dense",
    ("code-125m-extend-16k", "hybrid-DS"): "16k extension, hybrid-DS",
    ("code-125m-extend-16k", "dense-to-hybrid"): "16k extension, dense -> hybrid-DS",
}


def _tokens_of(t: MdTable) -> str:
    """The study's token count from its ``train loss @ N tokens`` column, in millions."""
    (col,) = [h for h in t.header if h.startswith("train loss @ ")]
    n = int(col.removeprefix("train loss @ ").removesuffix(" tokens").replace(",", ""))
    return f"{n / 1e6:.1f}M"


def run_e_training() -> str:
    """docs/long_context_eval.md, run E: tokens, density, speed, memory, valid loss per run."""
    tables = read_md_tables(LONG / "example_results.md")
    rows = []
    for study, point, label in RUN_E_RUNS:
        t = _study_table(tables, study)
        r = t.row(point)
        tps = float(r[t.column("tokens/s")].replace(",", ""))
        dense_tps = float(t.row("dense")[t.column("tokens/s")].replace(",", ""))
        speed = thousands(tps) + ("" if point == "dense" else f" ({ratio(tps, dense_tps)})")
        rows.append(
            [
                label,
                _tokens_of(t),
                r[t.column("attn density")],
                speed,
                str(round(float(r[t.column("model TFLOP/s/GPU")]))),
                f"{float(r[t.column('peak mem GiB')]):.1f} GiB",
                r[t.column("valid loss")],
            ]
        )
    header = [
        "run",
        "tokens",
        "attention density",
        "tokens/s",
        "model TFLOP/s",
        "peak memory",
        "valid loss",
    ]
    return table(header, rows)


def _study_table(tables: list[MdTable], study: str) -> MdTable:
    """A study's results table: the one directly under the heading that is the study's name."""
    hits = [t for t in tables if t.headings and t.headings[-1] == study and "point" in t.header]
    if len(hits) != 1:
        raise LookupError(f"{len(hits)} results tables of study {study!r}, expected 1")
    return hits[0]


def run_e_retrieval() -> str:
    """docs/long_context_eval.md, run E: exact match over all cells, then the answer's mean
    log-likelihood at each length, per task."""
    tables = read_md_tables(LONG / "example_results.md")
    rows = []
    for (study, point), label in RUN_E_LABELS.items():
        cells = [label]
        for task in ("passkey", "needle", "kv-filler"):
            run = f"{study} / {point}: retrieval"
            acc = all_cells_mean(find_table(tables, run, f"{task}: greedy exact-match"))
            ll = depth_means(find_table(tables, run, f"{task}: answer log-likelihood"))
            cells.append(" / ".join([f"{acc * 100:.0f}%"] + [f"{v:.1f}" for v in ll.values()]))
        rows.append(cells)
    return table(["model", "passkey", "needle", "kv-filler"], rows)


def _position_ranges(entry: dict) -> list[str]:
    """Loss over 0-1k, 1k-4k, 4k-8k, 8k-16k and all positions, three decimals."""
    k = 1024
    ranges = [(0, k), (k, 4 * k), (4 * k, 8 * k), (8 * k, 16 * k)]
    return [f3(range_loss(entry, lo, hi)) for lo, hi in ranges] + [f3(float(entry["loss"]))]


def run_e_loss_by_position() -> str:
    """docs/long_context_eval.md, run E: loss by position ranges on 41 held-out 16k files."""
    runs = read_json(LONG / "loss_by_position.json")
    # The same runs as the retrieval table, named as there.
    rows = [
        [label] + _position_ranges(runs[f"{study}/{point}"])
        for (study, point), label in RUN_E_LABELS.items()
    ]
    return table(["model", "bin 0-1k", "1k-4k", "4k-8k", "8k-16k", "all"], rows)


RUN_H_RUNS = [
    ("4k base, 2,000 steps: dense", "4k base, dense"),
    ("4k base, 2,000 steps: hybrid-DS", "4k base, hybrid-DS"),
    ("16k extension (150 steps): dense", "16k extension, dense"),
    ("16k extension (150 steps): hybrid-DS", "16k extension, hybrid-DS"),
    ("16k extension (150 steps): dense-to-hybrid", "16k extension, dense -> hybrid-DS"),
]


def run_h_passkey() -> str:
    """docs/long_context_eval.md, run H: passkey exact match (log-likelihood) per length."""
    tables = read_md_tables(LONG / "run_h_results.md")
    rows = []
    for run, label in RUN_H_RUNS:
        acc = depth_means(find_table(tables, run, "passkey: greedy exact-match"))
        ll = depth_means(find_table(tables, run, "passkey: answer log-likelihood"))
        rows.append([label] + [f"{acc[n] * 100:.0f}% ({ll[n]:.1f})" for n in acc])
    return table(["model", "1k", "2k", "4k", "8k", "16k"], rows)


def run_h_depths_8k() -> str:
    """docs/long_context_eval.md, run H: the extensions' passkey exact match by depth at 8k."""
    tables = read_md_tables(LONG / "run_h_results.md")
    rows = []
    for run, label in RUN_H_RUNS[2:]:
        t = find_table(tables, run, "passkey: greedy exact-match")
        j = t.column("8192")
        rows.append([label] + [f"{float(r[j]):.2f}" for r in t.rows])
    return table(["model", "depth 0", "0.25", "0.5", "0.75", "1"], rows)


RUN_J_REMEDIES = [
    ("dense", "dense -> dense (the reference)"),
    ("hybrid-DS", "hybrid-DS (run H's hybrid)"),
    ("hybrid-DS-local32", "larger local window: 32 blocks (2k tokens)"),
    ("hybrid-DS-long", "longer extension: 300 steps (39M tokens)"),
    ("hybrid-DS-more-dense", "more dense layers: 3 and 7 as well (8 of 12)"),
]


def run_j_remedies() -> str:
    """docs/long_context_eval.md, run J: each remedy's passkey exact match, valid loss, speed."""
    tables = read_md_tables(LONG / "run_j_results.md")
    study = _study_table(tables, "code-125m-extend-16k-remedies")
    passkey = find_table(tables, "code-125m-extend-16k-remedies", "passkey: exact match, mean")
    dense_tps = float(study.row("dense")[study.column("tokens/s")].replace(",", ""))
    rows = []
    for point, label in RUN_J_REMEDIES:
        r = study.row(point)
        tps = float(r[study.column("tokens/s")].replace(",", ""))
        speed = thousands(tps) + ("" if point == "dense" else f" ({ratio(tps, dense_tps)})")
        exact = [c.split()[0] for c in passkey.row(point)[1:]]
        rows.append([label] + exact + [r[study.column("valid loss")], speed])
    header = [
        "16k extension (passkey exact match, mean of five depths, 100 trials a length)",
        "1k",
        "2k",
        "4k",
        "8k",
        "16k",
        "valid loss",
        "tokens/s",
    ]
    return table(header, rows)


def run_j_depths_4k() -> str:
    """docs/long_context_eval.md, run J: the extensions' passkey exact match by depth at 4k."""
    tables = read_md_tables(LONG / "run_j_results.md")
    t = find_table(tables, "code-125m-extend-16k-remedies", "passkey at 4k")
    order = ["dense", "hybrid-DS", "hybrid-DS-long", "hybrid-DS-more-dense", "hybrid-DS-local32"]
    return table(["at 4k tokens", "0", "0.25", "0.5", "0.75", "1"], [t.row(p) for p in order])


CORPUS = DOCS / "code_corpus"


def code_corpus_sizes() -> str:
    """docs/code_corpus.md, "Sizes": the standard-library corpus's splits at both vocabularies."""
    small = read_json(CORPUS / "stdlib-vocab8192.json")["splits"]
    large = read_json(CORPUS / "stdlib-vocab32768.json")["splits"]

    def tokens(split: dict) -> str:
        return f"{split['tokens'] / 1e6:.2f} M ({split['bytes'] / split['tokens']:.2f} B/token)"

    rows = []
    for name in ("train", "valid"):
        a, b = small[name], large[name]
        # The file list and hold-out do not depend on the vocabulary; only the tokens do.
        assert (a["files"], a["bytes"], a["packages"]) == (b["files"], b["bytes"], b["packages"])
        longest = f"{round(b['max_document_tokens'] / 1000)}k"
        rows.append(
            [
                name,
                str(a["packages"]),
                f"{a['files']:,}",
                f"{a['bytes'] / 1e6:.1f}",
                tokens(a),
                tokens(b),
                f"{b['long_documents']} (longest {longest})",
            ]
        )
    header = [
        "",
        "packages",
        "files",
        "MB",
        "tokens, vocab 8192",
        "tokens, vocab 32768",
        "documents over 32k tokens (32768)",
    ]
    return table(header, rows)


HF = DOCS / "hf"


def hf_roundtrip_steps() -> str:
    """docs/training.md, "The GPU acceptance check": each step of the H200 run, its wall time."""
    r = read_json(HF / "hf_check_h200.json")
    train = r["steps"]["train"]
    what = {
        "build": "a random 125M-shaped Llama made and saved by `transformers`",
        "import": "`megatron-s2-hf import --s2-pattern DS` (CPU mode)",
        "train": (
            f"{train['iterations']} steps of 2 x 16,384 tokens, bf16: loss "
            f"{train['first_loss']:.2f} -> {train['last_loss']:.2f}, "
            f"{thousands(train['tokens_per_s_median_steady'])} tokens/s, "
            f"peak {train['peak_memory_gib']:.1f} GiB"
        ),
        "export": "`megatron-s2-hf export` in bf16",
        "ours": "our logits of a fresh 16,384-token batch (hybrid and all-dense twin)",
        "compare": "the export in `transformers` (`s2` and `sdpa` attention), same batch",
    }
    rows = [
        [f"`{name}`", what[name], f"{step['wall_s']:.1f} s"] for name, step in r["steps"].items()
    ]
    rows.append(["", f"**{r['verdict']}**", f"{r['total_wall_s']:.1f} s"])
    return table(["step", "what", "wall"], rows)


def hf_roundtrip_logits() -> str:
    """docs/training.md, "The GPU acceptance check": the three pairs of logits compared."""
    c = read_json(HF / "hf_check_h200.json")["comparison"]
    pairs = [
        ("s2_vs_ours", "export with the `s2` attention vs ours (under test)"),
        ("dense_vs_ours_dense", "export with `sdpa` (all dense) vs our all-dense twin (noise)"),
        ("dense_vs_ours", "export with `sdpa` (all dense) vs ours (what S2 changes)"),
    ]
    rows = []
    for key, label in pairs:
        d = c[key]
        rows.append(
            [
                label,
                f"{d['mean_abs_diff']:.4f}",
                f"{100 * d['mean_abs_diff_over_std']:.2f}%",
                f"{d['prefix_mean_abs_diff']:.4f}",
                f"{d['tail_mean_abs_diff']:.4f}",
                f"{d['max_abs_diff']:.3f}",
                f"{100 * d['top1_agreement']:.2f}%",
            ]
        )
    header = [
        "logits compared (16,384 tokens, bf16)",
        "mean abs diff",
        "of std(ours)",
        "inside the window (first 1,024)",
        "past the window",
        "max abs diff",
        "top-1 agreement",
    ]
    return table(header, rows)


PROBE = LONG / "results" / "retrieval-125m-4k-probe"


def _probe_hits(task: dict) -> str:
    """Correct out of all trials of one task of a retrieval.json, with the largest upper end of
    the per-length Wilson 95% intervals."""
    by_len = task["by_length"]
    correct = sum(b["correct"] for b in by_len)
    n = sum(b["trials"] for b in by_len)
    return f"{correct}/{n} (<= {100 * max(b['ci_high'] for b in by_len):.1f}% a length)"


def retrieval_probe_4k() -> str:
    """docs/long_context_eval.md, "Step 1, the 4k probe": the three recipes run on one H200."""
    runs = read_csv(PROBE / "results.csv")
    recipes = {
        "dense-full": ("dense", "one-sample documents (4,094 tokens, fact anywhere)"),
        "dense-mixed": ("dense", "trials of 128-4,094 tokens, several a sample"),
        "hybrid-DS-mixed": ("`DS`", "trials of 128-4,094 tokens, several a sample"),
    }
    rows = []
    for arm, (layers, recipe) in recipes.items():
        r = read_json(PROBE / arm / "seed0" / "retrieval.json")["tasks"]
        cells = r["passkey"]["cells"]
        ll = sum(c["log_likelihood"] for c in cells) / len(cells)
        rows.append(
            [
                f"`{arm}`",
                layers,
                recipe,
                f4(float(runs[arm]["final_valid_loss"])),
                _probe_hits(r["passkey"]),
                _probe_hits(r["multikey"]),
                _probe_hits(r["code-value"]),
                f"{ll:.2f}",
            ]
        )
    header = [
        "point",
        "layers",
        "retrieval documents (60% of tokens)",
        "valid loss",
        "passkey exact match, 1k-4k",
        "multikey",
        "code-value (held out)",
        "passkey answer log-likelihood (nats)",
    ]
    return table(header, rows)


PROBE2 = LONG / "results" / "retrieval-125m-4k-probe2"
PROBE2_RECIPES = {
    "dense-mq": "4,094-token documents: 32 needles in training code, 16 asked in turn",
    "dense-mq-short": "half of those, half short trials (128-1,024 tokens, several a sample)",
}


def _ci(entry: dict) -> str:
    """A retrieval.json cell's or length's exact match with its 95% interval, as fractions:
    ``0.85 [0.77, 0.91]``."""
    return f"{entry['accuracy']:.2f} [{entry['ci_low']:.2f}, {entry['ci_high']:.2f}]"


def _pooled_ci(stats, entries: list[dict]) -> str:
    """Retrieval.json cells or lengths (``correct`` of ``trials``) pooled into one exact match
    with its Wilson 95% interval, as :func:`_ci` prints it."""
    k = sum(e["correct"] for e in entries)
    n = sum(e["trials"] for e in entries)
    lo, hi = stats.wilson_interval(k, n)
    return _ci({"accuracy": k / n, "ci_low": lo, "ci_high": hi})


def retrieval_probe2_4k() -> str:
    """docs/long_context_eval.md, "the second 4k probe": exact match per task and length."""
    runs = read_csv(PROBE2 / "results.csv")
    rows = []
    for arm, recipe in PROBE2_RECIPES.items():
        tasks = read_json(PROBE2 / arm / "seed0" / "retrieval.json")["tasks"]
        for name in ("passkey", "multikey", "code-value"):
            cells = tasks[name]["cells"]
            ll = sum(c["log_likelihood"] for c in cells) / len(cells)
            by_len = [_ci(b) for b in tasks[name]["by_length"]]
            first = name == "passkey"
            rows.append(
                [
                    f"`{arm}`" if first else "",
                    recipe if first else "",
                    f4(float(runs[arm]["final_valid_loss"])) if first else "",
                    name,
                    *by_len,
                    f"{ll:.2f}",
                ]
            )
    lengths = [b["length"] for b in tasks["passkey"]["by_length"]]
    header = [
        "point",
        "retrieval documents (60% of tokens)",
        "valid loss",
        "task",
        *(f"{n:,} tokens" for n in lengths),
        "answer log-likelihood (nats)",
    ]
    return table(header, rows)


def retrieval_probe2_depths() -> str:
    """docs/long_context_eval.md: the retrieving probe-2 model's passkey and multikey exact match
    by needle depth (rows) and length (columns), each cell with its Wilson 95% interval."""
    return _depth_table(read_json(PROBE2 / "dense-mq-short" / "seed0" / "retrieval.json")["tasks"])


RECIPE = LONG / "results"
RECIPE_STAGES = {
    "retrieval-125m-4k-base": "4k base (2,000 steps, 131M tokens at 4k)",
    "retrieval-125m-extend-32k": "after the 32k extension (200 steps, 26M tokens at 32k)",
}


RECIPE_ARMS = ("dense", "hybrid-DS")


def retrieval_recipe_lengths() -> str:
    """docs/long_context_eval.md, the recipe's arms (seed 1 each): exact match per task and
    length before and after the 32k extension, with each run's valid loss and tokens/s; a
    length a run was not evaluated at (a base evaluated at 4k only) is ``not run``."""
    rows, lengths = [], set()
    for study, stage in RECIPE_STAGES.items():
        runs = read_csv(RECIPE / study / "results.csv")
        for arm in RECIPE_ARMS:
            run = runs[f"{arm},seed=1"]
            tasks = read_json(RECIPE / study / arm / "seed1" / "retrieval.json")["tasks"]
            for name in ("passkey", "multikey", "code-value"):
                by_len = {b["length"]: _ci(b) for b in tasks[name]["by_length"]}
                lengths |= set(by_len)
                first = name == "passkey"
                head = [
                    stage if first and arm == RECIPE_ARMS[0] else "",
                    arm if first else "",
                    f4(float(run["final_valid_loss"])) if first else "",
                    thousands(float(run["tokens_per_s"])) if first else "",
                    name,
                ]
                rows.append((head, by_len))
    columns = sorted(lengths)
    header = ["stage", "arm, seed 1", "valid loss", "tokens/s", "task"]
    return table(
        header + [f"{n:,} tokens" for n in columns],
        [head + [by_len.get(n, "not run") for n in columns] for head, by_len in rows],
    )


def _stats():
    """megatron_s2's retrieval statistics (imported here: the other tables need no package)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from megatron_s2.training.evaluation import retrieval_stats

    return retrieval_stats


def _paired(entry: tuple[float, float, float, int]) -> str:
    """A paired difference in points with its interval: ``-3.0 [-9.7, +3.4]``."""
    d, lo, hi, _ = entry
    return f"{d:+.1f} [{lo:+.1f}, {hi:+.1f}]"


def _paired_cells(stats, result: dict, reference: dict, task: str, lengths, depths=None) -> list:
    """RESULT minus REFERENCE over the same trials of ``task`` (at ``depths``; None: all): one
    :func:`_paired` cell per length of ``lengths``, then the lengths pooled."""
    counts = stats.paired_counts(result, reference, task, depths)
    cells = [_paired(stats.counts_difference(counts[n])) for n in lengths]
    return cells + [_paired(stats.counts_difference(stats.pool_counts(counts)))]


def retrieval_recipe_difference() -> str:
    """docs/long_context_eval.md: the extended hybrid-DS minus the extended dense twin (seed 1
    each) per task and length, in points, over the same 100 trials a length (Newcombe's paired
    95% interval: the evaluation's noise only, not the training run's)."""
    stats = _stats()
    study = RECIPE / "retrieval-125m-extend-32k"
    hybrid = read_json(study / "hybrid-DS" / "seed1" / "retrieval.json")
    dense = read_json(study / "dense" / "seed1" / "retrieval.json")
    rows, lengths = [], None
    for name in ("passkey", "multikey"):
        diff = stats.paired_trial_difference(hybrid, dense, name)
        lengths = lengths or sorted(diff)
        rows.append([name, *(_paired(diff[n]) for n in lengths)])
    return table(["hybrid-DS - dense, seed 1", *(f"{n:,} tokens" for n in lengths)], rows)


def retrieval_recipe_loss_by_position() -> str:
    """docs/long_context_eval.md: the extended dense twin's and hybrid-DS's loss per token on
    held-out code at 32k by position range (token-weighted over the evaluator's bins; seed 1
    each, the same 20 sequences), and the hybrid relative to the twin."""
    runs = {
        arm: read_json(
            RECIPE / "retrieval-125m-extend-32k" / arm / "seed1" / "loss_by_position.json"
        )
        for arm in RECIPE_ARMS
    }
    dense, hybrid = runs["dense"], runs["hybrid-DS"]
    rows = []
    for lo, hi in ((0, 2048), (2048, 4096), (4096, 8192), (8192, 16384), (16384, 32768)):
        d, h = range_loss(dense, lo, hi), range_loss(hybrid, lo, hi)
        rows.append([f"{lo:,}-{hi:,}", f4(d), f4(h), rel(h, d)])
    d, h = float(dense["loss"]), float(hybrid["loss"])
    rows.append(["all 32,768", f4(d), f4(h), rel(h, d)])
    return table(["positions", "dense twin", "hybrid-DS", "vs dense"], rows)


def retrieval_recipe_goal() -> str:
    """docs/long_context_eval.md: issue 50's goal per hybrid arm of the extension study, as
    ``tools/retrieval_tables.py <study> --goal`` prints it (the table alone)."""
    stats = _stats()
    study = RECIPE / "retrieval-125m-extend-32k"
    arms = stats.read_arm_results(study)
    speed = stats.study_tokens_per_s(study / "results.csv", arms)
    return stats.goal_markdown(arms, speed).split("\n\n")[0]


def retrieval_recipe_depth0() -> str:
    """docs/long_context_eval.md: depth 0 after the extension, the plain prompt against the
    EOD-prefixed one (the same needles): each arm's exact match per length and pooled over the
    lengths with Wilson intervals, and the hybrid's EOD minus plain over the same trials
    (points, Newcombe's paired interval; 20 trials a length, 80 pooled); the same difference
    for the hybrid's 4k base (evaluated at 4k only)."""
    stats = _stats()
    plain = RECIPE / "retrieval-125m-extend-32k"
    eod = RECIPE / "retrieval-125m-extend-32k-eod"
    runs = {
        "dense, plain": read_json(plain / "dense" / "seed1" / "retrieval.json"),
        "hybrid-DS, plain": read_json(plain / "hybrid-DS" / "seed1" / "retrieval.json"),
        "hybrid-DS, EOD first": read_json(eod / "hybrid-DS" / "seed1" / "retrieval.json"),
    }
    base_plain = read_json(
        RECIPE / "retrieval-125m-4k-base" / "hybrid-DS" / "seed1" / "retrieval.json"
    )
    base_eod = read_json(
        RECIPE / "retrieval-125m-4k-base-eod" / "hybrid-DS" / "seed1" / "retrieval.json"
    )
    rows, lengths = [], None
    for name in ("passkey", "multikey"):
        for label, res in runs.items():
            cells = {c["length"]: c for c in res["tasks"][name]["cells"] if c["depth"] == 0}
            lengths = lengths or sorted(cells)
            pooled = _pooled_ci(stats, [cells[n] for n in lengths])
            rows.append([name if label == "dense, plain" else "", label,
                         *(_ci(cells[n]) for n in lengths), pooled])  # fmt: skip
        diffs = _paired_cells(
            stats, runs["hybrid-DS, EOD first"], runs["hybrid-DS, plain"], name, lengths, [0.0]
        )
        rows.append(["", "hybrid-DS, EOD - plain (points)", *diffs])
        # The same test on the 4k base before the extension (evaluated at 4k only).
        base = stats.paired_trial_difference(base_eod, base_plain, name, depths=[0.0])
        cells = [_paired(base[n]) if n in base else "not run" for n in lengths]
        rows.append(["", "hybrid-DS 4k base, EOD - plain (points)", *cells, ""])
    header = ["task", "depth 0, seed 1", *(f"{n:,} tokens" for n in lengths), "all four"]
    return table(header, rows)


def retrieval_recipe_probe() -> str:
    """docs/long_context_eval.md: the extended hybrid-DS's attention probe at 32k: per layer,
    the attention its top head (and the mean head) puts on the needle's tokens from the
    question, at each needle depth (fractions of the head's attention)."""
    probe = read_json(
        RECIPE / "retrieval-125m-extend-32k" / "hybrid-DS" / "seed1" / "attention_probe.json"
    )
    rows = [
        [str(layer["layer"]), layer["kind"],
         *(f"{top:.2f} ({mean:.2f})" for top, mean in zip(layer["top_head"], layer["mean_head"]))]
        for layer in probe["layers"]
    ]  # fmt: skip
    depths = [f"depth {d:g}" for d in probe["depths"]]
    return table(["layer", "attention", *depths], rows)


def retrieval_recipe_depths() -> str:
    """docs/long_context_eval.md: the extended dense twin's passkey and multikey exact match by
    needle depth (rows) and length (columns), each cell with its Wilson 95% interval."""
    tasks = read_json(RECIPE / "retrieval-125m-extend-32k" / "dense" / "seed1" / "retrieval.json")
    return _depth_table(tasks["tasks"])


def _depth_table(tasks: dict, names: tuple[str, ...] = ("passkey", "multikey")) -> str:
    """Exact match of one retrieval.json's ``tasks`` (those in ``names``) by depth x length."""
    lengths = [b["length"] for b in tasks[names[0]]["by_length"]]
    rows = []
    for name in names:
        cells = {(c["depth"], c["length"]): c for c in tasks[name]["cells"]}
        for depth in sorted({d for d, _ in cells}):
            row = [name if depth == 0 else "", f"{depth:g}"]
            for n in lengths:
                row.append(_ci(cells[(depth, n)]))
            rows.append(row)
    return table(["task", "needle depth", *(f"{n:,} tokens" for n in lengths)], rows)


ARCSINE_BASE = RECIPE / "retrieval-125m-4k-base-arcsine"
ARCSINE_EXTEND = RECIPE / "retrieval-125m-extend-32k-arcsine"


def _other_depths(evaluation: dict) -> list[float]:
    """The needle depths of a retrieval.json other than 0 (fractions of the context)."""
    return [float(d) for d in evaluation["depths"] if float(d) != 0.0]


def _pooled_paired(stats, result: dict, reference: dict, task: str, depths, lengths=None) -> str:
    """RESULT minus REFERENCE over the same trials at ``depths`` pooled over the lengths (and
    only ``lengths`` when given): points with Newcombe's paired 95% interval, and the trials."""
    counts = stats.paired_counts(result, reference, task, depths, lengths)
    d, lo, hi, n = stats.counts_difference(stats.pool_counts(counts))
    return f"{d:+.1f} [{lo:+.1f}, {hi:+.1f}] ({n})"


def retrieval_arcsine_decision() -> str:
    """docs/long_context_eval.md: the arcsine depth draw's dense twin (seed 1) against the
    uniform recipe's (seed 1) over the same trials, pooled over the lengths: the 4k base at 4k
    (the arcsine base was evaluated there only) and the 32k extension at 4k-32k; at depth 0
    (the cell the lever aims at) and at the other depths; points, paired 95% intervals."""
    stats = _stats()
    pairs = {
        "4k base (at 4k)": (
            read_json(ARCSINE_BASE / "dense" / "seed1" / "retrieval.json"),
            read_json(RECIPE / "retrieval-125m-4k-base" / "dense" / "seed1" / "retrieval.json"),
            [4096],
        ),
        "after the 32k extension (4k-32k)": (
            read_json(ARCSINE_EXTEND / "dense" / "seed1" / "retrieval.json"),
            read_json(RECIPE / "retrieval-125m-extend-32k" / "dense" / "seed1" / "retrieval.json"),
            None,
        ),
    }
    rows = []
    for stage, (arcsine, uniform, lengths) in pairs.items():
        for task in ("passkey", "multikey"):
            rows.append([
                stage if task == "passkey" else "", task,
                _pooled_paired(stats, arcsine, uniform, task, [0.0], lengths),
                _pooled_paired(stats, arcsine, uniform, task, _other_depths(arcsine), lengths),
            ])  # fmt: skip
    header = ["dense twin, arcsine - uniform", "task", "depth 0 (trials)", "depths 0.25-1 (trials)"]
    return table(header, rows)


def _conversion_table(
    study: Path, arm: str, seed: int, tasks: tuple[str, ...] = ("passkey", "multikey")
) -> str:
    """A dense base extended as the dense twin and as ``arm`` (a ``dense-to-*`` switch) in
    ``study``, seed ``seed``: each arm's exact match per task and length (all depths, Wilson 95%
    intervals), then the switch minus the twin over the same trials at each needle depth, per
    length (20 trials) and pooled over the lengths (80), and over every depth (100 a length,
    400 pooled); points, Newcombe's paired 95% interval."""
    stats = _stats()
    dense = read_json(study / "dense" / f"seed{seed}" / "retrieval.json")
    hybrid = read_json(study / arm / f"seed{seed}" / "retrieval.json")
    rows, lengths = [], None
    for task in tasks:
        for label, res in (("dense twin", dense), (arm, hybrid)):
            by_len = {b["length"]: b for b in res["tasks"][task]["by_length"]}
            lengths = lengths or sorted(by_len)
            pooled = _pooled_ci(stats, [by_len[n] for n in lengths])
            rows.append([task if label == "dense twin" else "", label,
                         *(_ci(by_len[n]) for n in lengths), pooled])  # fmt: skip
        every = [(f"depth {d:g}", [float(d)]) for d in dense["depths"]] + [("every depth", None)]
        for label, depths in every:
            cells = _paired_cells(stats, hybrid, dense, task, lengths, depths)
            rows.append(["", f"hybrid - twin, {label} (points)", *cells])
    header = ["task", f"seed {seed}", *(f"{n:,} tokens" for n in lengths), "all four"]
    return table(header, rows)


def retrieval_arcsine_conversion() -> str:
    """docs/long_context_eval.md: the arcsine dense base (seed 1) extended to 32k as the dense
    twin and as dense-to-hybrid-DS (:func:`_conversion_table`)."""
    return _conversion_table(ARCSINE_EXTEND, "dense-to-hybrid-DS", 1)


def retrieval_heldout_loglik() -> str:
    """docs/long_context_eval.md: the held-out code-value task, where exact match is 0 in every
    run, by the right answer's log-likelihood (nats, summed over its tokens, mean over a
    length's 100 trials): each twin's, and each hybrid's minus its twin's over the same trials
    with the paired t 95% interval (one seed a row; the evaluation's noise only)."""
    stats = _stats()
    pairs = (
        ("uniform recipe, seed 1", RECIPE / "retrieval-125m-extend-32k", "hybrid-DS", 1),
        ("arcsine base, seed 1", ARCSINE_EXTEND, "dense-to-hybrid-DS", 1),
        ("long base, seed 1", LONG_EXTEND, KEEP_LOOKUP, 1),
        ("long base, seed 2", LONG_EXTEND, KEEP_LOOKUP, 2),
        ("long base, seed 3", LONG_EXTEND, KEEP_LOOKUP, 3),
    )
    rows, lengths = [], None
    for label, study, arm, seed in pairs:
        twin = read_json(study / "dense" / f"seed{seed}" / "retrieval.json")
        hybrid = read_json(study / arm / f"seed{seed}" / "retrieval.json")
        means = stats.answer_loglik_means(twin, "code-value")
        lengths = lengths or sorted(means)
        diff = stats.paired_loglik_difference(hybrid, twin, "code-value")
        rows.append([label, "dense twin", *(f"{means[n]:.2f}" for n in lengths)])
        rows.append(["", f"{arm} - twin",
                     *(f"{diff[n][0]:+.2f} [{diff[n][1]:+.2f}, {diff[n][2]:+.2f}]"
                       for n in lengths)])  # fmt: skip
    header = ["extension", "code-value answer log-likelihood (nats)"]
    return table(header + [f"{n:,} tokens" for n in lengths], rows)


def retrieval_arcsine_runs() -> str:
    """docs/long_context_eval.md: the arcsine lease's runs (:func:`_seed1_runs_table`)."""
    return _seed1_runs_table(
        (
            (ARCSINE_BASE, "4k base", ("dense",)),
            (ARCSINE_EXTEND, "32k extension", ("dense", "dense-to-hybrid-DS")),
        )
    )


def _seed1_runs_table(stages) -> str:
    """One lease's runs (seed 1) from its studies' results.csv; ``stages``: ``(study, label,
    arms)`` each, the twin ``dense`` first: valid loss (each stage on its own validation blend)
    and training tokens/s, each arm's against the stage's twin."""
    rows = []
    for study, label, arms in stages:
        runs = read_csv(study / "results.csv")
        twin = float(runs["dense,seed=1"]["tokens_per_s"])
        for arm in arms:
            run = runs[f"{arm},seed=1"]
            speed = float(run["tokens_per_s"])
            rows.append([label if arm == "dense" else "", arm, f4(float(run["final_valid_loss"])),
                         thousands(speed), ratio(speed, twin)])  # fmt: skip
    return table(["stage", "arm, seed 1", "valid loss", "tokens/s", "vs dense"], rows)


def _probe_pair_table(study: Path, arm: str, seed: int) -> str:
    """The attention probe at 32k of a dense base extended as the dense twin and as ``arm``
    in ``study``, seed ``seed``: per layer and needle depth, the share of its attention the top
    head puts on the needle's tokens, twin / hybrid."""
    probes = [
        read_json(study / name / f"seed{seed}" / "attention_probe.json") for name in ("dense", arm)
    ]
    rows = []
    for twin, hybrid in zip(probes[0]["layers"], probes[1]["layers"]):
        shares = zip(twin["top_head"], hybrid["top_head"])
        kinds = f"{twin['kind']} / {hybrid['kind']}"
        rows.append([str(twin["layer"]), kinds, *(f"{a:.2f} / {b:.2f}" for a, b in shares)])
    depths = [f"depth {d:g}" for d in probes[0]["depths"]]
    return table(["layer", "attention, twin / hybrid", *depths], rows)


def retrieval_arcsine_probe() -> str:
    """docs/long_context_eval.md: the attention probe at 32k of the arcsine base extended as
    the dense twin and as dense-to-hybrid-DS (:func:`_probe_pair_table`)."""
    return _probe_pair_table(ARCSINE_EXTEND, "dense-to-hybrid-DS", 1)


UNIFORM_EXTEND = RECIPE / "retrieval-125m-extend-32k"
UNIFORM_BASE = RECIPE / "retrieval-125m-4k-base"
# The switch that keeps the twin's lookup layers (10 and 11) dense, run on seed 2's base.
KEEP_LOOKUP = "dense-to-hybrid-DSDSDSDSSSDD"


def _seeds_runs_table(stages) -> str:
    """Runs of several seeds from their studies' results.csv; ``stages``: ``(study, label,
    ((arm, seed), ...))`` each: valid loss (each stage on its own validation blend) and training
    tokens/s against the same seed's twin (``dense``)."""
    rows = []
    for study, label, arms in stages:
        runs = read_csv(study / "results.csv")
        for i, (arm, seed) in enumerate(arms):
            run = runs[f"{arm},seed={seed}"]
            speed = float(run["tokens_per_s"])
            twin = float(runs[f"dense,seed={seed}"]["tokens_per_s"])
            loss = f4(float(run["final_valid_loss"]))
            rows.append([label if i == 0 else "", arm, str(seed), loss, thousands(speed),
                         ratio(speed, twin)])  # fmt: skip
    return table(["stage", "arm", "seed", "valid loss", "tokens/s", "vs the seed's twin"], rows)


def retrieval_seed2_runs() -> str:
    """docs/long_context_eval.md: the uniform recipe's dense runs of seeds 1 and 2 and the
    switch of seed 2's base (:func:`_seeds_runs_table`)."""
    return _seeds_runs_table(
        (
            (UNIFORM_BASE, "4k base", (("dense", 1), ("dense", 2))),
            (UNIFORM_EXTEND, "32k extension", (("dense", 1), ("dense", 2), (KEEP_LOOKUP, 2))),
        )
    )


def retrieval_longbase_seeds_runs() -> str:
    """docs/long_context_eval.md: the long base's runs of seeds 1 and 2, the base on two GPUs
    and each extension on one (:func:`_seeds_runs_table`)."""
    arms = tuple((arm, k) for arm in ("dense", KEEP_LOOKUP) for k in (1, 2))
    return _seeds_runs_table(
        (
            (LONG_BASE, "4k base, 4,000 steps (two GPUs)", (("dense", 1), ("dense", 2))),
            (LONG_EXTEND, "32k extension, 200 steps (one GPU each)", arms),
        )
    )


def _twin_seeds_table(base: Path, extend: Path) -> str:
    """A recipe's dense twin, seeds 1 and 2, on the same trials (the evaluator's seed is
    fixed): each seed's exact match per task and length (Wilson 95% intervals) and seed 2 minus
    seed 1 (points, Newcombe's paired 95% interval over the length's 100 trials; pooled over the
    lengths both seeds were evaluated at), for the 4k base ``base`` (at 4k) and after the 32k
    extension ``extend``. The spread one training seed makes, not a recipe's difference; a
    length a seed was not evaluated at is ``not run``."""
    stats = _stats()
    rows = []
    extended = read_json(extend / "dense" / "seed1" / "retrieval.json")
    columns = sorted(b["length"] for b in extended["tasks"]["passkey"]["by_length"])
    for study, stage, lengths in (
        (base, "4k base", [4096]),
        (extend, "after the 32k extension", None),
    ):
        seeds = {k: read_json(study / "dense" / f"seed{k}" / "retrieval.json") for k in (1, 2)}
        for task in ("passkey", "multikey"):
            counts = stats.paired_counts(seeds[2], seeds[1], task, lengths=lengths)
            for k in (1, 2):
                by_len = {b["length"]: b for b in seeds[k]["tasks"][task]["by_length"]}
                cells = [_ci(by_len[n]) if n in by_len else "not run" for n in columns]
                pooled = _pooled_ci(stats, [by_len[n] for n in sorted(counts)])
                first = task == "passkey" and k == 1
                rows.append([stage if first else "", task if k == 1 else "", f"seed {k}",
                             *cells, pooled])  # fmt: skip
            diff = [
                _paired(stats.counts_difference(counts[n])) if n in counts else "not run"
                for n in columns
            ]
            pooled = _paired(stats.counts_difference(stats.pool_counts(counts)))
            rows.append(["", "", "seed 2 - seed 1 (points)", *diff, pooled])
    header = [
        "stage",
        "task",
        "dense twin",
        *(f"{n:,} tokens" for n in columns),
        "lengths both ran",
    ]
    return table(header, rows)


def retrieval_twin_seeds() -> str:
    """docs/long_context_eval.md: the uniform (2,000-step) recipe's dense twin, seeds 1 and 2
    (:func:`_twin_seeds_table`; seed 2's 4k base was evaluated at 4k only)."""
    return _twin_seeds_table(UNIFORM_BASE, UNIFORM_EXTEND)


def retrieval_longbase_twin_seeds() -> str:
    """docs/long_context_eval.md: the long base's dense twin, seeds 1 and 2
    (:func:`_twin_seeds_table`)."""
    return _twin_seeds_table(LONG_BASE, LONG_EXTEND)


def retrieval_seed2_conversion() -> str:
    """docs/long_context_eval.md: seed 2's dense base extended as the twin and as the switch
    that keeps layers 10 and 11 dense (:func:`_conversion_table`)."""
    return _conversion_table(UNIFORM_EXTEND, KEEP_LOOKUP, 2)


def retrieval_seed2_probe() -> str:
    """docs/long_context_eval.md: the passkey attention probe at 32k of seed 2's twin and
    switch (:func:`_probe_pair_table`)."""
    return _probe_pair_table(UNIFORM_EXTEND, KEEP_LOOKUP, 2)


def retrieval_seed2_probe_multikey() -> str:
    """docs/long_context_eval.md: the multi-key attention probe at 32k of seed 2's twin and
    switch: per layer and depth of the asked needle, the twin's top head's share of attention
    on the asked needle and that head's share on the three others together, then the switch's
    top head's share on the asked needle."""
    probes = [
        read_json(UNIFORM_EXTEND / name / "seed2" / "attention_probe_multikey.json")
        for name in ("dense", KEEP_LOOKUP)
    ]
    rows = []
    for twin, hybrid in zip(probes[0]["layers"], probes[1]["layers"]):
        cells = zip(twin["top_head"], twin["others_top_head"], hybrid["top_head"])
        kinds = f"{twin['kind']} / {hybrid['kind']}"
        rows.append([str(twin["layer"]), kinds,
                     *(f"{a:.2f} / {o:.2f} / {h:.2f}" for a, o, h in cells)])  # fmt: skip
    depths = [f"depth {d:g}" for d in probes[0]["depths"]]
    header = [
        "layer",
        "attention, twin / switch (cells: twin asked / others, switch asked)",
        *depths,
    ]
    return table(header, rows)


LONG_BASE = RECIPE / "retrieval-125m-4k-base-long"
LONG_EXTEND = RECIPE / "retrieval-125m-extend-32k-longbase"


def retrieval_longbase_decision() -> str:
    """docs/long_context_eval.md: the long base's dense twin (4,000 base steps, seed 1) against
    the 2,000-step twin's seed 1 over the same trials: per task, each one's exact match pooled
    over the lengths (Wilson 95% intervals) and long minus 2,000-step (points, Newcombe's paired
    95% interval), for the 4k base at 4k (100 trials) and after the 32k extension at 4k-32k
    (400). The rule set before the run reads this table."""
    stats = _stats()
    rows = []
    for stage, long_study, study, lengths in (
        ("4k base (at 4k)", LONG_BASE, UNIFORM_BASE, [4096]),
        ("after the 32k extension (4k-32k)", LONG_EXTEND, UNIFORM_EXTEND, None),
    ):
        long_run = read_json(long_study / "dense" / "seed1" / "retrieval.json")
        short_run = read_json(study / "dense" / "seed1" / "retrieval.json")
        for task in ("passkey", "multikey"):
            counts = stats.paired_counts(long_run, short_run, task, lengths=lengths)
            pooled = []
            for run in (long_run, short_run):
                by_len = {b["length"]: b for b in run["tasks"][task]["by_length"]}
                pooled.append(_pooled_ci(stats, [by_len[n] for n in sorted(counts)]))
            diff = _paired(stats.counts_difference(stats.pool_counts(counts)))
            rows.append([stage if task == "passkey" else "", task, *pooled, diff])
    header = ["dense twin, seed 1", "task", "4,000-step base", "2,000-step base",
              "long - 2,000-step (points)"]  # fmt: skip
    return table(header, rows)


def retrieval_longbase_runs() -> str:
    """docs/long_context_eval.md: the long base's lease, the base on two GPUs and each
    extension on one (:func:`_seed1_runs_table`)."""
    return _seed1_runs_table(
        (
            (LONG_BASE, "4k base, 4,000 steps (two GPUs)", ("dense",)),
            (LONG_EXTEND, "32k extension, 200 steps (one GPU each)", ("dense", KEEP_LOOKUP)),
        )
    )


def retrieval_longbase_conversion() -> str:
    """docs/long_context_eval.md: the long base (seed 1) extended as the twin and as the switch
    that keeps layers 10 and 11 dense (:func:`_conversion_table`)."""
    return _conversion_table(LONG_EXTEND, KEEP_LOOKUP, 1)


def retrieval_longbase_depths() -> str:
    """docs/long_context_eval.md: the long base's extended dense twin (seed 1), passkey and
    multikey exact match by needle depth and length, Wilson 95% intervals."""
    return _depth_table(read_json(LONG_EXTEND / "dense" / "seed1" / "retrieval.json")["tasks"])


def retrieval_longbase_probe() -> str:
    """docs/long_context_eval.md: the passkey attention probe at 32k of the long base's twin
    and switch, seed 1 (:func:`_probe_pair_table`)."""
    return _probe_pair_table(LONG_EXTEND, KEEP_LOOKUP, 1)


def retrieval_longbase_goal() -> str:
    """docs/long_context_eval.md: issue 50's goal for the long base's switch, as
    ``tools/retrieval_tables.py <study> --goal`` prints it (the table alone)."""
    stats = _stats()
    arms = stats.read_arm_results(LONG_EXTEND)
    speed = stats.study_tokens_per_s(LONG_EXTEND / "results.csv", arms)
    return stats.goal_markdown(arms, speed).split("\n\n")[0]


def retrieval_longbase_seed2_depths() -> str:
    """docs/long_context_eval.md: the long base's extended dense twin, seed 2, by needle depth
    and length (:func:`_depth_table`)."""
    return _depth_table(read_json(LONG_EXTEND / "dense" / "seed2" / "retrieval.json")["tasks"])


def retrieval_longbase_seed2_conversion() -> str:
    """docs/long_context_eval.md: the long base's seed 2 extended as the twin and as the
    switch that keeps layers 10 and 11 dense (:func:`_conversion_table`)."""
    return _conversion_table(LONG_EXTEND, KEEP_LOOKUP, 2)


def retrieval_longbase_seed2_probe() -> str:
    """docs/long_context_eval.md: the passkey attention probe at 32k of the long base's twin
    and switch, seed 2 (:func:`_probe_pair_table`)."""
    return _probe_pair_table(LONG_EXTEND, KEEP_LOOKUP, 2)


def retrieval_longbase_needle() -> str:
    """docs/long_context_eval.md: the held-out ``needle`` task (never trained), first run on
    the long base's seed 2: the twin and the switch by length, and the switch minus the twin
    by depth (:func:`_conversion_table`)."""
    return _conversion_table(LONG_EXTEND, KEEP_LOOKUP, 2, tasks=("needle",))


LONG_SEEDS = (1, 2, 3)


def retrieval_longbase_seeds3_runs() -> str:
    """docs/long_context_eval.md: the long base's runs of seeds 1-3, the base on two GPUs and
    each extension on one (:func:`_seeds_runs_table`)."""
    arms = tuple((arm, k) for arm in ("dense", KEEP_LOOKUP) for k in LONG_SEEDS)
    return _seeds_runs_table(
        (
            (LONG_BASE, "4k base, 4,000 steps (two GPUs)", tuple(("dense", k) for k in LONG_SEEDS)),
            (LONG_EXTEND, "32k extension, 200 steps (one GPU each)", arms),
        )
    )


def retrieval_longbase_bar() -> str:
    """docs/long_context_eval.md: issue 50's bar for the long base's extended dense twin, per
    task: each seed's exact match per length (Wilson 95% intervals over its 100 trials), then
    the three seeds' trials pooled at depth 0 and at depths 0.25-1 (60 and 240 trials a length;
    pooling leaves the seeds' spread out, so these say where the twin fails, not by how much a
    seed may)."""
    stats = _stats()
    runs = {k: read_json(LONG_EXTEND / "dense" / f"seed{k}" / "retrieval.json") for k in LONG_SEEDS}
    lengths = [b["length"] for b in runs[1]["tasks"]["passkey"]["by_length"]]
    rows = []
    for task in ("passkey", "multikey"):
        for k in LONG_SEEDS:
            by_len = {b["length"]: b for b in runs[k]["tasks"][task]["by_length"]}
            rows.append([task if k == 1 else "", f"seed {k}", *(_ci(by_len[n]) for n in lengths)])
        for label, at_zero in (("seeds 1-3, depth 0", True), ("seeds 1-3, depths 0.25-1", False)):
            cells = []
            for n in lengths:
                picked = [
                    c
                    for r in runs.values()
                    for c in r["tasks"][task]["cells"]
                    if c["length"] == n and (float(c["depth"]) == 0.0) == at_zero
                ]
                cells.append(_pooled_ci(stats, picked))
            rows.append(["", label, *cells])
    return table(["task", "dense twin", *(f"{n:,} tokens" for n in lengths)], rows)


def retrieval_longbase_seed3_depths() -> str:
    """docs/long_context_eval.md: the long base's extended dense twin, seed 3, by needle depth
    and length (:func:`_depth_table`)."""
    return _depth_table(read_json(LONG_EXTEND / "dense" / "seed3" / "retrieval.json")["tasks"])


def retrieval_longbase_seed3_conversion() -> str:
    """docs/long_context_eval.md: the long base's seed 3 extended as the twin and as the
    switch that keeps layers 10 and 11 dense (:func:`_conversion_table`)."""
    return _conversion_table(LONG_EXTEND, KEEP_LOOKUP, 3)


def retrieval_longbase_seed3_probe() -> str:
    """docs/long_context_eval.md: the passkey attention probe at 32k of the long base's twin
    and switch, seed 3 (:func:`_probe_pair_table`)."""
    return _probe_pair_table(LONG_EXTEND, KEEP_LOOKUP, 3)


def retrieval_longbase_seed3_needle() -> str:
    """docs/long_context_eval.md: the held-out ``needle`` task on the long base's seed 3, as
    :func:`retrieval_longbase_needle` for seed 2."""
    return _conversion_table(LONG_EXTEND, KEEP_LOOKUP, 3, tasks=("needle",))


SINKS_BASE = RECIPE / "retrieval-125m-4k-base-long-sinks"
SINKS_EXTEND = RECIPE / "retrieval-125m-extend-32k-longbase-sinks"
# The sinks lease's seed (one seed: the rule set before it was decided by it).
SINKS_SEED = 3
# (label, study, arm) of the four extended models the sinks section compares, seed 3.
SINKS_MODELS = (
    ("twin, no sinks", LONG_EXTEND, "dense"),
    ("twin, sinks", SINKS_EXTEND, "dense"),
    ("switch, no sinks", LONG_EXTEND, KEEP_LOOKUP),
    ("switch, sinks", SINKS_EXTEND, KEEP_LOOKUP),
)


def _sinks_run(label: str) -> dict:
    """The retrieval.json (seed 3) of one of :data:`SINKS_MODELS`, by its label."""
    study, arm = next((s, a) for name, s, a in SINKS_MODELS if name == label)
    return read_json(study / arm / f"seed{SINKS_SEED}" / "retrieval.json")


def retrieval_sinks_runs() -> str:
    """docs/long_context_eval.md: the long base with learned sinks on every layer (seed 3)
    beside the sink-less long base of the same seed: valid loss (each stage on its own
    validation blend; the same blend with and without sinks) and training tokens/s, against the
    sink-less twin of the stage (the fused dense kernels)."""
    rows = []
    for label, sink_study, plain_study, arms in (
        ("4k base, 4,000 steps (two GPUs)", SINKS_BASE, LONG_BASE, ("dense",)),
        ("32k extension, 200 steps (one GPU each)", SINKS_EXTEND, LONG_EXTEND,
         ("dense", KEEP_LOOKUP)),
    ):  # fmt: skip
        twin = float(
            read_csv(plain_study / "results.csv")[f"dense,seed={SINKS_SEED}"]["tokens_per_s"]
        )
        for arm in arms:
            for sinks, study in (("no", plain_study), ("every layer", sink_study)):
                run = read_csv(study / "results.csv")[f"{arm},seed={SINKS_SEED}"]
                speed = float(run["tokens_per_s"])
                rows.append([label if arm == "dense" and sinks == "no" else "", arm, sinks,
                             f4(float(run["final_valid_loss"])), thousands(speed),
                             ratio(speed, twin)])  # fmt: skip
    header = ["stage", "arm, seed 3", "sinks", "valid loss", "tokens/s", "vs the sink-less twin"]
    return table(header, rows)


def retrieval_sinks_decision() -> str:
    """docs/long_context_eval.md: the rule set before the sinks lease, read off the extended
    twins of seed 3 with and without sinks (the same trials): per task, the twin with sinks at
    depth 0 and at depths 0.25-1 (exact match, Wilson 95% intervals, 20 and 80 trials a length)
    and its difference to the sink-less twin there (points, Newcombe's paired 95% interval),
    per length and pooled over the four."""
    stats = _stats()
    sinks, plain = _sinks_run("twin, sinks"), _sinks_run("twin, no sinks")
    lengths = [b["length"] for b in sinks["tasks"]["passkey"]["by_length"]]
    rows = []
    for task in ("passkey", "multikey"):
        for label, depths in (("depth 0", [0.0]), ("depths 0.25-1", _other_depths(sinks))):
            picked = [c for c in sinks["tasks"][task]["cells"] if float(c["depth"]) in depths]
            cells = [_pooled_ci(stats, [c for c in picked if c["length"] == n]) for n in lengths]
            rows.append([task if label == "depth 0" else "", f"twin with sinks, {label}",
                         *cells, _pooled_ci(stats, picked)])  # fmt: skip
            diffs = _paired_cells(stats, sinks, plain, task, lengths, depths)
            rows.append(["", f"with - without sinks, {label} (points)", *diffs])
    header = ["task", f"seed {SINKS_SEED}", *(f"{n:,} tokens" for n in lengths), "all four"]
    return table(header, rows)


def retrieval_sinks_switch() -> str:
    """docs/long_context_eval.md: the switch (layers 10 and 11 dense) extended from the base
    with sinks, seed 3: its exact match per task and length (every depth, Wilson 95%
    intervals), and its difference over the same trials to the sink-less switch, to its own
    twin (with sinks) and to the sink-less twin (points, Newcombe's paired 95% interval), per
    length and pooled over the four."""
    stats = _stats()
    switch = _sinks_run("switch, sinks")
    lengths = [b["length"] for b in switch["tasks"]["passkey"]["by_length"]]
    rows = []
    for task in ("passkey", "multikey", "needle"):
        by_len = {b["length"]: b for b in switch["tasks"][task]["by_length"]}
        rows.append([task, "switch with sinks", *(_ci(by_len[n]) for n in lengths),
                     _pooled_ci(stats, [by_len[n] for n in lengths])])  # fmt: skip
        for other in ("switch, no sinks", "twin, sinks", "twin, no sinks"):
            diffs = _paired_cells(stats, switch, _sinks_run(other), task, lengths)
            rows.append(["", f"- {other} (points)", *diffs])
    header = ["task", f"seed {SINKS_SEED}", *(f"{n:,} tokens" for n in lengths), "all four"]
    return table(header, rows)


def retrieval_sinks_probe() -> str:
    """docs/long_context_eval.md: the attention probe at 32k of the four extended models of
    seed 3 (:data:`SINKS_MODELS`) in their last two layers (both dense in every one of them):
    per needle depth, the share of its attention the layer's top head puts on the needle,
    passkey / multi-key prompts."""
    rows = []
    for label, study, arm in SINKS_MODELS:
        folder = study / arm / f"seed{SINKS_SEED}"
        passkey = read_json(folder / "attention_probe.json")
        multikey = read_json(folder / "attention_probe_multikey.json")
        for layer in (10, 11):
            p, m = passkey["layers"][layer], multikey["layers"][layer]
            if p["layer"] != layer or m["layer"] != layer:
                raise ValueError(f"{folder}: the probe's layer {layer} is not its entry {layer}")
            shares = (f"{a:.2f} / {b:.2f}" for a, b in zip(p["top_head"], m["top_head"]))
            rows.append([label if layer == 10 else "", str(layer), *shares])
    depths = [f"depth {d:g}" for d in passkey["depths"]]
    return table(["extended model, seed 3", "layer", *depths], rows)


def retrieval_sinks_goal() -> str:
    """docs/long_context_eval.md: issue 50's goal for the switch with sinks (one seed: the
    trials' intervals), its speed-up against the sink-less twin's tokens/s of the same seed,
    as ``tools/retrieval_tables.py <sinks study> --goal --speed-reference <long base's
    study>`` prints it (the table alone)."""
    stats = _stats()
    arms = stats.read_arm_results(SINKS_EXTEND)
    speed = stats.study_tokens_per_s(SINKS_EXTEND / "results.csv", arms)
    speed["dense"] = stats.study_tokens_per_s(
        LONG_EXTEND / "results.csv", {"dense": arms["dense"]}
    )["dense"]
    return stats.goal_markdown(arms, speed).split("\n\n")[0]


EODFIRST_SCREEN = RECIPE / "retrieval-125m-4k-base-long-eodfirst"


def retrieval_eodfirst_screen() -> str:
    """docs/long_context_eval.md: step 4b's one-GPU screen, the long base's twin trained with
    ``train.eod_first`` (seed 3, evaluated at 4k only) against the plain long base of the same
    seed over the same trials: per task, exact match at depth 0, at depths 0.25-1 and at all
    five (Wilson 95% intervals; 20, 80 and 100 trials), and the difference to the plain base
    there (points, Newcombe's paired 95% interval)."""
    stats = _stats()
    screen = read_json(EODFIRST_SCREEN / "dense" / "seed3" / "retrieval.json")
    plain = read_json(LONG_BASE / "dense" / "seed3" / "retrieval.json")
    lengths = [b["length"] for b in screen["tasks"]["passkey"]["by_length"]]
    if lengths != [4096]:
        raise ValueError(f"{EODFIRST_SCREEN}: the screen is evaluated at 4096 only, not {lengths}")
    groups = (("depth 0", [0.0]), ("depths 0.25-1", _other_depths(screen)), ("all", None))
    rows = []
    for task in ("passkey", "multikey", "needle", "code-value"):
        cells = screen["tasks"][task]["cells"]
        rows.append([task, "EOD first", *(
            _pooled_ci(stats, [c for c in cells if depths is None or float(c["depth"]) in depths])
            for _, depths in groups
        )])  # fmt: skip
        rows.append(["", "- plain base (points)", *(
            _pooled_paired(stats, screen, plain, task, depths) for _, depths in groups
        )])  # fmt: skip
    header = ["task", "4k base, seed 3, at 4,096 tokens", *(label for label, _ in groups)]
    return table(header, rows)


ZONE = RECIPE / "retrieval-125m-extend-32k-zone"


def retrieval_zone() -> str:
    """docs/long_context_eval.md: seed 2's dense twin by needle depth near the context's start
    (the zone evaluation: depths 0-0.05) and at the main evaluation's other depths (0.25-1), at
    4k and 32k: correct of 20 trials with Wilson 95% intervals, and where the passkey needle
    sits (the trials' realised ``needle_depth`` x the length, tokens, their range; the nominal
    depth is a fraction of the haystack, so the realised position is a few tokens less)."""
    zone = read_json(ZONE / "dense" / "seed2" / "retrieval.json")["tasks"]
    main = read_json(UNIFORM_EXTEND / "dense" / "seed2" / "retrieval.json")["tasks"]
    lengths = sorted({c["length"] for c in zone["passkey"]["cells"]})
    cells: dict[tuple[str, float, int], dict] = {}
    where: dict[tuple[float, int], list[float]] = {}
    for source in (main, zone):  # the zone's depth 0 repeats the main evaluation's trials
        for task in ("passkey", "multikey"):
            for c in source[task]["cells"]:
                if c["length"] in lengths:
                    cells[(task, float(c["depth"]), int(c["length"]))] = c
        for r in source["passkey"]["trials"]:
            if r["length"] in lengths:
                key = (float(r["depth"]), int(r["length"]))
                where.setdefault(key, []).append(r["needle_depth"] * r["length"])
    depths = sorted({d for _, d, _ in cells})
    rows = []
    for d in depths:
        spans = []
        for n in lengths:
            lo, hi = round(min(where[(d, n)])), round(max(where[(d, n)]))
            spans.append(f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}")
        rows.append([f"{d:g}", " / ".join(spans), *(_ci(cells[(t, d, n)])
                     for t in ("passkey", "multikey") for n in lengths)])  # fmt: skip
    header = ["needle depth", "passkey needle at (tokens, " + " / ".join(f"{n // 1024}k"
              for n in lengths) + ")", *(f"{t} {n:,}" for t in ("passkey", "multikey")
              for n in lengths)]  # fmt: skip
    return table(header, rows)


ONE_GPU_SPEED = QUALITY / "one-gpu-speed-16k"
# The speed runs' settings (attention.dense_layers.pattern) and the seeded studies' point names.
SPEED_SETTINGS = (("D", "dense"), ("SSSD", "hybrid-SSSD"), ("S", "all-s2"))
# The seeded 16k studies on the four-GPU host whose tokens/s the speed runs are set beside.
STUDIES_16K = ("code-125m-16k-seeds", "code-125m-16k-seeds-100m")
# Steps left out of a speed run's median: the first holds compilation and allocator warm-up.
SPEED_WARMUP_STEPS = 10


def speed_run_tokens_per_s(pattern: str) -> float:
    """Median tokens/s of one speed run's training steps after :data:`SPEED_WARMUP_STEPS`
    (its ``metrics.jsonl``; a step is 8 x 16,384 tokens)."""
    train, _ = _metrics(ONE_GPU_SPEED / pattern / "metrics.jsonl")
    rates = [r["tokens_per_s"] for i, r in train.items() if i > SPEED_WARMUP_STEPS]
    if not rates:
        raise ValueError(f"{pattern}: no training step after step {SPEED_WARMUP_STEPS}")
    return statistics.median(rates)


def _study_mean_tokens_per_s(study: str, setting: str) -> tuple[float, bool]:
    """Mean tokens/s over a seeded study's finished seeds of one setting (its results.csv), and
    whether they finished: where none did, the mean of its stopped runs (False)."""
    rows = read_csv(QUALITY / study / "results.csv").values()
    rows = [r for r in rows if r["setting"] == setting]
    finished = [r for r in rows if r["status"] == "finished"]
    rates = [float(r["tokens_per_s"]) for r in (finished or rows)]
    return sum(rates) / len(rates), bool(finished)


def quality_one_gpu_speed() -> str:
    """docs/quality.md: tokens/s at 16k of dense, SSSD and all-S2 trained alone on one H200
    (one call, 50 steps each) beside the seeded studies' means (the 48M study on the four-GPU
    host; the 100M study's all-S2 runs on the two-GPU host, the others on the four-GPU one)."""
    alone = {p: speed_run_tokens_per_s(p) for p, _ in SPEED_SETTINGS}
    rows = []
    for pattern, setting in SPEED_SETTINGS:
        speed = alone[pattern]
        row = [f"{setting} ({pattern})", thousands(speed), ratio(speed, alone["D"])]
        means = [_study_mean_tokens_per_s(study, setting) for study in STUDIES_16K]
        row += [thousands(m) + ("" if done else " (stopped runs)") for m, done in means]
        row += [rel(speed, m) for m, _ in means]
        rows.append(row)
    header = [
        "setting", "one H200 alone, tokens/s", "vs dense", "48M study (4x host)",
        "100M study", "alone vs 48M", "alone vs 100M",
    ]  # fmt: skip
    return table(header, rows)


RERUN_POINTS = ("all-s2,seed=1", "all-s2,seed=2", "all-s2,seed=3", "hybrid-DS,seed=3")


def _metrics(path: Path) -> tuple[dict, dict]:
    """({iteration: record} of the training steps, {iteration: loss} of the validations) of a
    run's metrics.jsonl."""
    train, valid = {}, {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line) if line.strip() else {}
            if rec.get("kind") == "train":
                train[rec["iteration"]] = rec
            elif rec.get("kind") == "valid" and "loss" in rec:
                valid[rec["iteration"]] = rec["loss"]
    return train, valid


def _rerun_cells(
    first: tuple[dict, dict], again: tuple[dict, dict]
) -> tuple[list[str], float, float]:
    """The step-by-step comparison of two runs of one point (their metrics.jsonl, as
    :func:`_metrics` reads it) over the steps both reached: [training losses equal, first step
    that differs, validation steps compared, largest validation difference], and each run's
    median tokens/s over the logged steps after step 20 (the first window holds compilation)."""
    first_t, first_v = first
    again_t, again_v = again
    steps = sorted(set(first_t) & set(again_t))
    differ = [i for i in steps if first_t[i]["loss"] != again_t[i]["loss"]]
    vsteps = sorted(set(first_v) & set(again_v))
    worst = max(abs(again_v[i] / first_v[i] - 1) * 100 for i in vsteps)
    fast = [i for i in steps if i > 20]
    a = statistics.median(first_t[i]["tokens_per_s"] for i in fast)
    b = statistics.median(again_t[i]["tokens_per_s"] for i in fast)
    cells = [
        f"{len(steps) - len(differ)} of {len(steps)} ({steps[0]}-{steps[-1]})",
        str(differ[0]) if differ else "none",
        f"{vsteps[0]}-{vsteps[-1]} ({len(vsteps)})",
        f"{worst:.2f}%" if worst else "none (equal)",
    ]
    return cells, a, b


def quality_rerun_noise() -> str:
    """docs/quality.md, "The noise band": the 100M study's four runs that the first lease (four
    GPUs) stopped and the second (two GPUs) trained again from step 0, the same seed and
    batches, step by step over the steps both reached: whether the losses repeat, and each
    host's median tokens/s."""
    root = QUALITY / "code-125m-16k-seeds-100m"
    rows = []
    for point in RERUN_POINTS:
        cells, a, b = _rerun_cells(
            _metrics(root / "first-lease-stopped" / point / "metrics.jsonl"),
            _metrics(root / "runs" / point / "metrics.jsonl"),
        )
        rows.append([point, *cells, thousands(a), thousands(b), rel(b, a)])
    header = [
        "run", "training losses equal (logged steps)", "first step that differs",
        "validation steps compared", "largest validation difference",
        "tokens/s, first lease (4x host)", "tokens/s, rerun (2x host)", "rerun vs first",
    ]  # fmt: skip
    return table(header, rows)


RERUNS = QUALITY / "code-125m-16k-seeds-100m" / "reruns" / "runs"

# The machine kind each rerun's lease had (tokens/s depend on the host by a few percent): the
# leases' status logs under reruns/lease-2026-12-01*/ name the job, and the runs'
# sweep_sessions.jsonl put them inside those leases' times.
RERUN_HOSTS = {
    "dense,seed=1": "2x",
    "dense,seed=2": "2x",
    "hybrid-SSSD,seed=1": "2x",
    "hybrid-SSSD,seed=2": "2x",
    "dense,seed=3": "1x",
    "hybrid-SSSD,seed=3": "1x",
    "hybrid-DS,seed=1": "1x",
    "hybrid-DS,seed=2": "1x",
}


def _finished_reruns() -> list[str]:
    """The 100M study's finished reruns (a summary.json at hand), in the study's order."""
    order = ("dense", "hybrid-SSSD", "hybrid-DS", "all-s2")
    names = [p.parent.name for p in RERUNS.glob("*/summary.json")]
    return sorted(names, key=lambda n: (order.index(n.split(",")[0]), n))


def quality_reruns_vs_committed() -> str:
    """docs/quality.md, "Reruns of the first lease's runs": each rerun of the 100M study
    (trained again from step 0 for its loss by position: the same point, seed and batches)
    against the committed run of that point, over all 763 steps: whether the losses repeat,
    the final validation losses and their difference (% of the committed run's), and each
    host's median tokens/s."""
    root = QUALITY / "code-125m-16k-seeds-100m"
    rows = []
    for point in _finished_reruns():
        first = _metrics(root / "runs" / point / "metrics.jsonl")
        again = _metrics(RERUNS / point / "metrics.jsonl")
        cells, a, b = _rerun_cells(first, again)
        # The final validation loss: the last validation's (the run's final_valid_loss).
        va, vb = (v[max(v)] for _, v in (first, again))
        if point not in RERUN_HOSTS:
            raise SystemExit(
                f"{point}: a rerun without its host in RERUN_HOSTS (which lease ran it?)"
            )
        rows.append(
            [point, *cells, f"{va:.4f}", f"{vb:.4f}", rel(vb, va), thousands(a),
             thousands(b), f"{RERUN_HOSTS[point]} H200"]
        )  # fmt: skip
    header = [
        "run", "training losses equal (logged steps)", "first step that differs",
        "validation steps compared", "largest validation difference",
        "final valid loss, committed", "rerun", "rerun vs committed",
        "tokens/s, committed (4x host)", "tokens/s, rerun", "rerun's host",
    ]  # fmt: skip
    return table(header, rows)


@dataclass(frozen=True)
class Table:
    """A doc table: where it is, what raw outputs it is computed from, and how."""

    doc: str
    raw: tuple[str, ...]
    build: Callable[[], str]


TABLES: dict[str, Table] = {
    "code-corpus-sizes": Table(
        "docs/code_corpus.md",
        ("docs/code_corpus/stdlib-vocab8192.json", "docs/code_corpus/stdlib-vocab32768.json"),
        code_corpus_sizes,
    ),
    "quality-attention": Table(
        "docs/quality.md", ("docs/quality/code-125m-attention.csv",), quality_attention
    ),
    "quality-loss-by-position": Table(
        "docs/quality.md",
        ("docs/quality/code-125m-loss-by-position.json",),
        quality_loss_by_position,
    ),
    "quality-one-gpu-speed": Table(
        "docs/quality.md",
        (
            *(f"docs/quality/one-gpu-speed-16k/{p}/metrics.jsonl" for p, _ in SPEED_SETTINGS),
            "docs/quality/code-125m-16k-seeds/results.csv",
            "docs/quality/code-125m-16k-seeds-100m/results.csv",
        ),
        quality_one_gpu_speed,
    ),
    "quality-rerun-noise": Table(
        "docs/quality.md",
        tuple(
            f"docs/quality/code-125m-16k-seeds-100m/{d}/{p}/metrics.jsonl"
            for p in RERUN_POINTS
            for d in ("first-lease-stopped", "runs")
        ),
        quality_rerun_noise,
    ),
    "quality-reruns-vs-committed": Table(
        "docs/quality.md",
        tuple(
            str(f.relative_to(REPO))
            for point in _finished_reruns()
            for f in (
                QUALITY / "code-125m-16k-seeds-100m" / "runs" / point / "metrics.jsonl",
                RERUNS / point / "metrics.jsonl",
            )
        ),
        quality_reruns_vs_committed,
    ),
    "quality-stride-window": Table(
        "docs/quality.md",
        (
            "docs/quality/code-125m-stride-window.csv",
            "docs/quality/stride-window-loss-by-position.json",
        ),
        quality_stride_window,
    ),
    "hf-roundtrip-steps": Table(
        "docs/training.md", ("docs/hf/hf_check_h200.json",), hf_roundtrip_steps
    ),
    "hf-roundtrip-logits": Table(
        "docs/training.md", ("docs/hf/hf_check_h200.json",), hf_roundtrip_logits
    ),
    "retrieval-probe-4k": Table(
        "docs/long_context_eval.md",
        (
            "docs/long_context/results/retrieval-125m-4k-probe/results.csv",
            "docs/long_context/results/retrieval-125m-4k-probe/dense-full/seed0/retrieval.json",
            "docs/long_context/results/retrieval-125m-4k-probe/dense-mixed/seed0/retrieval.json",
            "docs/long_context/results/retrieval-125m-4k-probe/hybrid-DS-mixed/seed0/retrieval.json",
        ),
        retrieval_probe_4k,
    ),
    "retrieval-probe2-4k": Table(
        "docs/long_context_eval.md",
        (
            "docs/long_context/results/retrieval-125m-4k-probe2/results.csv",
            "docs/long_context/results/retrieval-125m-4k-probe2/dense-mq/seed0/retrieval.json",
            "docs/long_context/results/retrieval-125m-4k-probe2/dense-mq-short/seed0/retrieval.json",
        ),
        retrieval_probe2_4k,
    ),
    "retrieval-probe2-depths": Table(
        "docs/long_context_eval.md",
        ("docs/long_context/results/retrieval-125m-4k-probe2/dense-mq-short/seed0/retrieval.json",),
        retrieval_probe2_depths,
    ),
    "retrieval-recipe-lengths": Table(
        "docs/long_context_eval.md",
        tuple(
            f"docs/long_context/results/{study}/{f}"
            for study in RECIPE_STAGES
            for f in ("results.csv", *(f"{arm}/seed1/retrieval.json" for arm in RECIPE_ARMS))
        ),
        retrieval_recipe_lengths,
    ),
    "retrieval-recipe-difference": Table(
        "docs/long_context_eval.md",
        tuple(
            f"docs/long_context/results/retrieval-125m-extend-32k/{arm}/seed1/retrieval.json"
            for arm in RECIPE_ARMS
        ),
        retrieval_recipe_difference,
    ),
    "retrieval-recipe-loss-by-position": Table(
        "docs/long_context_eval.md",
        tuple(
            f"docs/long_context/results/retrieval-125m-extend-32k/{arm}/seed1/loss_by_position.json"
            for arm in RECIPE_ARMS
        ),
        retrieval_recipe_loss_by_position,
    ),
    "retrieval-recipe-goal": Table(
        "docs/long_context_eval.md",
        (
            "docs/long_context/results/retrieval-125m-extend-32k/results.csv",
            *(
                f"docs/long_context/results/retrieval-125m-extend-32k/{arm}/seed{k}/retrieval.json"
                for arm, k in (("dense", 1), ("dense", 2), ("hybrid-DS", 1), (KEEP_LOOKUP, 2))
            ),
        ),
        retrieval_recipe_goal,
    ),
    "retrieval-recipe-depth0": Table(
        "docs/long_context_eval.md",
        (
            "docs/long_context/results/retrieval-125m-extend-32k/dense/seed1/retrieval.json",
            "docs/long_context/results/retrieval-125m-extend-32k/hybrid-DS/seed1/retrieval.json",
            "docs/long_context/results/retrieval-125m-extend-32k-eod/hybrid-DS/seed1/"
            "retrieval.json",
            "docs/long_context/results/retrieval-125m-4k-base/hybrid-DS/seed1/retrieval.json",
            "docs/long_context/results/retrieval-125m-4k-base-eod/hybrid-DS/seed1/retrieval.json",
        ),
        retrieval_recipe_depth0,
    ),
    "retrieval-recipe-probe": Table(
        "docs/long_context_eval.md",
        (
            "docs/long_context/results/retrieval-125m-extend-32k/hybrid-DS/seed1/"
            "attention_probe.json",
        ),
        retrieval_recipe_probe,
    ),
    "retrieval-recipe-depths": Table(
        "docs/long_context_eval.md",
        ("docs/long_context/results/retrieval-125m-extend-32k/dense/seed1/retrieval.json",),
        retrieval_recipe_depths,
    ),
    "retrieval-arcsine-decision": Table(
        "docs/long_context_eval.md",
        (
            "docs/long_context/results/retrieval-125m-4k-base-arcsine/dense/seed1/retrieval.json",
            "docs/long_context/results/retrieval-125m-4k-base/dense/seed1/retrieval.json",
            "docs/long_context/results/retrieval-125m-extend-32k-arcsine/dense/seed1/"
            "retrieval.json",
            "docs/long_context/results/retrieval-125m-extend-32k/dense/seed1/retrieval.json",
        ),
        retrieval_arcsine_decision,
    ),
    "retrieval-arcsine-conversion": Table(
        "docs/long_context_eval.md",
        tuple(
            f"docs/long_context/results/retrieval-125m-extend-32k-arcsine/{arm}/seed1/"
            "retrieval.json"
            for arm in ("dense", "dense-to-hybrid-DS")
        ),
        retrieval_arcsine_conversion,
    ),
    "retrieval-heldout-loglik": Table(
        "docs/long_context_eval.md",
        tuple(
            f"docs/long_context/results/{study}/{arm}/seed1/retrieval.json"
            for study, arm in (
                ("retrieval-125m-extend-32k", "dense"),
                ("retrieval-125m-extend-32k", "hybrid-DS"),
                ("retrieval-125m-extend-32k-arcsine", "dense"),
                ("retrieval-125m-extend-32k-arcsine", "dense-to-hybrid-DS"),
                ("retrieval-125m-extend-32k-longbase", "dense"),
                ("retrieval-125m-extend-32k-longbase", KEEP_LOOKUP),
            )
        )
        + tuple(
            f"docs/long_context/results/retrieval-125m-extend-32k-longbase/{arm}/seed{k}/retrieval.json"
            for k in (2, 3)
            for arm in ("dense", KEEP_LOOKUP)
        ),
        retrieval_heldout_loglik,
    ),
    "retrieval-arcsine-runs": Table(
        "docs/long_context_eval.md",
        (
            "docs/long_context/results/retrieval-125m-4k-base-arcsine/results.csv",
            "docs/long_context/results/retrieval-125m-extend-32k-arcsine/results.csv",
        ),
        retrieval_arcsine_runs,
    ),
    "retrieval-arcsine-probe": Table(
        "docs/long_context_eval.md",
        tuple(
            f"docs/long_context/results/retrieval-125m-extend-32k-arcsine/{arm}/seed1/"
            "attention_probe.json"
            for arm in ("dense", "dense-to-hybrid-DS")
        ),
        retrieval_arcsine_probe,
    ),
    "retrieval-seed2-runs": Table(
        "docs/long_context_eval.md",
        (
            "docs/long_context/results/retrieval-125m-4k-base/results.csv",
            "docs/long_context/results/retrieval-125m-extend-32k/results.csv",
        ),
        retrieval_seed2_runs,
    ),
    "retrieval-twin-seeds": Table(
        "docs/long_context_eval.md",
        tuple(
            f"docs/long_context/results/{study}/dense/seed{k}/retrieval.json"
            for study in ("retrieval-125m-4k-base", "retrieval-125m-extend-32k")
            for k in (1, 2)
        ),
        retrieval_twin_seeds,
    ),
    "retrieval-seed2-conversion": Table(
        "docs/long_context_eval.md",
        tuple(
            f"docs/long_context/results/retrieval-125m-extend-32k/{arm}/seed2/retrieval.json"
            for arm in ("dense", KEEP_LOOKUP)
        ),
        retrieval_seed2_conversion,
    ),
    "retrieval-seed2-probe": Table(
        "docs/long_context_eval.md",
        tuple(
            f"docs/long_context/results/retrieval-125m-extend-32k/{arm}/seed2/attention_probe.json"
            for arm in ("dense", KEEP_LOOKUP)
        ),
        retrieval_seed2_probe,
    ),
    "retrieval-seed2-probe-multikey": Table(
        "docs/long_context_eval.md",
        tuple(
            f"docs/long_context/results/retrieval-125m-extend-32k/{arm}/seed2/"
            "attention_probe_multikey.json"
            for arm in ("dense", KEEP_LOOKUP)
        ),
        retrieval_seed2_probe_multikey,
    ),
    "retrieval-zone": Table(
        "docs/long_context_eval.md",
        (
            "docs/long_context/results/retrieval-125m-extend-32k-zone/dense/seed2/retrieval.json",
            "docs/long_context/results/retrieval-125m-extend-32k/dense/seed2/retrieval.json",
        ),
        retrieval_zone,
    ),
    "retrieval-longbase-decision": Table(
        "docs/long_context_eval.md",
        tuple(
            f"docs/long_context/results/{study}/dense/seed1/retrieval.json"
            for study in (
                "retrieval-125m-4k-base-long",
                "retrieval-125m-4k-base",
                "retrieval-125m-extend-32k-longbase",
                "retrieval-125m-extend-32k",
            )
        ),
        retrieval_longbase_decision,
    ),
    "retrieval-longbase-runs": Table(
        "docs/long_context_eval.md",
        (
            "docs/long_context/results/retrieval-125m-4k-base-long/results.csv",
            "docs/long_context/results/retrieval-125m-extend-32k-longbase/results.csv",
        ),
        retrieval_longbase_runs,
    ),
    "retrieval-longbase-conversion": Table(
        "docs/long_context_eval.md",
        tuple(
            "docs/long_context/results/retrieval-125m-extend-32k-longbase/"
            f"{arm}/seed1/retrieval.json"
            for arm in ("dense", KEEP_LOOKUP)
        ),
        retrieval_longbase_conversion,
    ),
    "retrieval-longbase-depths": Table(
        "docs/long_context_eval.md",
        (
            "docs/long_context/results/retrieval-125m-extend-32k-longbase/dense/seed1/retrieval.json",
        ),
        retrieval_longbase_depths,
    ),
    "retrieval-longbase-probe": Table(
        "docs/long_context_eval.md",
        tuple(
            "docs/long_context/results/retrieval-125m-extend-32k-longbase/"
            f"{arm}/seed1/attention_probe.json"
            for arm in ("dense", KEEP_LOOKUP)
        ),
        retrieval_longbase_probe,
    ),
    "retrieval-longbase-seeds-runs": Table(
        "docs/long_context_eval.md",
        (
            "docs/long_context/results/retrieval-125m-4k-base-long/results.csv",
            "docs/long_context/results/retrieval-125m-extend-32k-longbase/results.csv",
        ),
        retrieval_longbase_seeds_runs,
    ),
    "retrieval-longbase-twin-seeds": Table(
        "docs/long_context_eval.md",
        tuple(
            f"docs/long_context/results/{study}/dense/seed{k}/retrieval.json"
            for study in ("retrieval-125m-4k-base-long", "retrieval-125m-extend-32k-longbase")
            for k in (1, 2)
        ),
        retrieval_longbase_twin_seeds,
    ),
    "retrieval-longbase-seed2-depths": Table(
        "docs/long_context_eval.md",
        (
            "docs/long_context/results/retrieval-125m-extend-32k-longbase/dense/seed2/retrieval.json",
        ),
        retrieval_longbase_seed2_depths,
    ),
    "retrieval-longbase-seed2-conversion": Table(
        "docs/long_context_eval.md",
        tuple(
            "docs/long_context/results/retrieval-125m-extend-32k-longbase/"
            f"{arm}/seed2/retrieval.json"
            for arm in ("dense", KEEP_LOOKUP)
        ),
        retrieval_longbase_seed2_conversion,
    ),
    "retrieval-longbase-seed2-probe": Table(
        "docs/long_context_eval.md",
        tuple(
            "docs/long_context/results/retrieval-125m-extend-32k-longbase/"
            f"{arm}/seed2/attention_probe.json"
            for arm in ("dense", KEEP_LOOKUP)
        ),
        retrieval_longbase_seed2_probe,
    ),
    "retrieval-longbase-needle": Table(
        "docs/long_context_eval.md",
        tuple(
            "docs/long_context/results/retrieval-125m-extend-32k-longbase/"
            f"{arm}/seed2/retrieval.json"
            for arm in ("dense", KEEP_LOOKUP)
        ),
        retrieval_longbase_needle,
    ),
    "retrieval-longbase-seeds3-runs": Table(
        "docs/long_context_eval.md",
        (
            "docs/long_context/results/retrieval-125m-4k-base-long/results.csv",
            "docs/long_context/results/retrieval-125m-extend-32k-longbase/results.csv",
        ),
        retrieval_longbase_seeds3_runs,
    ),
    "retrieval-longbase-bar": Table(
        "docs/long_context_eval.md",
        tuple(
            f"docs/long_context/results/retrieval-125m-extend-32k-longbase/dense/seed{k}/retrieval.json"
            for k in LONG_SEEDS
        ),
        retrieval_longbase_bar,
    ),
    "retrieval-longbase-seed3-depths": Table(
        "docs/long_context_eval.md",
        (
            "docs/long_context/results/retrieval-125m-extend-32k-longbase/dense/seed3/retrieval.json",
        ),
        retrieval_longbase_seed3_depths,
    ),
    "retrieval-longbase-seed3-conversion": Table(
        "docs/long_context_eval.md",
        tuple(
            "docs/long_context/results/retrieval-125m-extend-32k-longbase/"
            f"{arm}/seed3/retrieval.json"
            for arm in ("dense", KEEP_LOOKUP)
        ),
        retrieval_longbase_seed3_conversion,
    ),
    "retrieval-longbase-seed3-probe": Table(
        "docs/long_context_eval.md",
        tuple(
            "docs/long_context/results/retrieval-125m-extend-32k-longbase/"
            f"{arm}/seed3/attention_probe.json"
            for arm in ("dense", KEEP_LOOKUP)
        ),
        retrieval_longbase_seed3_probe,
    ),
    "retrieval-longbase-seed3-needle": Table(
        "docs/long_context_eval.md",
        tuple(
            "docs/long_context/results/retrieval-125m-extend-32k-longbase/"
            f"{arm}/seed3/retrieval.json"
            for arm in ("dense", KEEP_LOOKUP)
        ),
        retrieval_longbase_seed3_needle,
    ),
    "retrieval-longbase-goal": Table(
        "docs/long_context_eval.md",
        (
            "docs/long_context/results/retrieval-125m-extend-32k-longbase/results.csv",
            *(
                "docs/long_context/results/retrieval-125m-extend-32k-longbase/"
                f"{arm}/seed{k}/retrieval.json"
                for arm in ("dense", KEEP_LOOKUP)
                for k in LONG_SEEDS
            ),
        ),
        retrieval_longbase_goal,
    ),
    "retrieval-eodfirst-screen": Table(
        "docs/long_context_eval.md",
        tuple(
            f"docs/long_context/results/{study}/dense/seed3/retrieval.json"
            for study in ("retrieval-125m-4k-base-long", "retrieval-125m-4k-base-long-eodfirst")
        ),
        retrieval_eodfirst_screen,
    ),
    "retrieval-sinks-runs": Table(
        "docs/long_context_eval.md",
        tuple(
            f"docs/long_context/results/{study}/results.csv"
            for study in (
                "retrieval-125m-4k-base-long",
                "retrieval-125m-4k-base-long-sinks",
                "retrieval-125m-extend-32k-longbase",
                "retrieval-125m-extend-32k-longbase-sinks",
            )
        ),
        retrieval_sinks_runs,
    ),
    "retrieval-sinks-decision": Table(
        "docs/long_context_eval.md",
        tuple(
            f"docs/long_context/results/{study}/dense/seed3/retrieval.json"
            for study in (
                "retrieval-125m-extend-32k-longbase",
                "retrieval-125m-extend-32k-longbase-sinks",
            )
        ),
        retrieval_sinks_decision,
    ),
    "retrieval-sinks-switch": Table(
        "docs/long_context_eval.md",
        tuple(
            f"docs/long_context/results/{study}/{arm}/seed3/retrieval.json"
            for study in (
                "retrieval-125m-extend-32k-longbase",
                "retrieval-125m-extend-32k-longbase-sinks",
            )
            for arm in ("dense", KEEP_LOOKUP)
        ),
        retrieval_sinks_switch,
    ),
    "retrieval-sinks-probe": Table(
        "docs/long_context_eval.md",
        tuple(
            f"docs/long_context/results/{study}/{arm}/seed3/{probe}"
            for study in (
                "retrieval-125m-extend-32k-longbase",
                "retrieval-125m-extend-32k-longbase-sinks",
            )
            for arm in ("dense", KEEP_LOOKUP)
            for probe in ("attention_probe.json", "attention_probe_multikey.json")
        ),
        retrieval_sinks_probe,
    ),
    "retrieval-sinks-goal": Table(
        "docs/long_context_eval.md",
        (
            "docs/long_context/results/retrieval-125m-extend-32k-longbase-sinks/results.csv",
            "docs/long_context/results/retrieval-125m-extend-32k-longbase/results.csv",
            *(
                "docs/long_context/results/retrieval-125m-extend-32k-longbase-sinks/"
                f"{arm}/seed3/retrieval.json"
                for arm in ("dense", KEEP_LOOKUP)
            ),
        ),
        retrieval_sinks_goal,
    ),
    "run-e-training": Table(
        "docs/long_context_eval.md", ("docs/long_context/example_results.md",), run_e_training
    ),
    "run-e-retrieval": Table(
        "docs/long_context_eval.md", ("docs/long_context/example_results.md",), run_e_retrieval
    ),
    "run-e-loss-by-position": Table(
        "docs/long_context_eval.md",
        ("docs/long_context/loss_by_position.json",),
        run_e_loss_by_position,
    ),
    "run-h-passkey": Table(
        "docs/long_context_eval.md", ("docs/long_context/run_h_results.md",), run_h_passkey
    ),
    "run-h-depths-8k": Table(
        "docs/long_context_eval.md", ("docs/long_context/run_h_results.md",), run_h_depths_8k
    ),
    "run-j-remedies": Table(
        "docs/long_context_eval.md", ("docs/long_context/run_j_results.md",), run_j_remedies
    ),
    "run-j-depths-4k": Table(
        "docs/long_context_eval.md", ("docs/long_context/run_j_results.md",), run_j_depths_4k
    ),
}


def check(names: list[str]) -> list[str]:
    """The names of the tables whose rebuilt text is not verbatim in their doc."""
    stale = []
    for name in names:
        t = TABLES[name]
        if t.build() not in (REPO / t.doc).read_text():
            stale.append(name)
    return stale


def main(argv: list[str] | None = None) -> int:
    """Command line: ``list``, ``show NAME...`` or ``check [NAME...]`` (exit 1 on a stale table)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every table with its doc and raw outputs")
    show = sub.add_parser("show", help="print tables rebuilt from their raw outputs")
    show.add_argument("names", nargs="+", choices=sorted(TABLES))
    chk = sub.add_parser("check", help="fail when a doc's table differs from its raw output")
    # No ``choices`` here: argparse refuses an empty list against them (Python 3.11).
    chk.add_argument("names", nargs="*", help="default: every table")
    args = parser.parse_args(argv)
    unknown = [n for n in getattr(args, "names", []) if n not in TABLES]
    if unknown:
        parser.error(f"unknown tables {unknown}; `list` names them")
    if args.command == "list":
        for name, t in TABLES.items():
            print(f"{name}: {t.doc} <- {', '.join(t.raw)}")
        return 0
    if args.command == "show":
        print("\n\n".join(TABLES[n].build() for n in args.names))
        return 0
    names = args.names or list(TABLES)
    stale = check(names)
    for name in stale:
        t = TABLES[name]
        print(f"{name}: the table in {t.doc} is not the one {', '.join(t.raw)} gives:")
        print(t.build(), end="\n\n")
    if not stale:
        # The seeded studies' tables (tools/quality_tables.py's output) are checked by
        # tests/training/test_seed_stats.py, not here: say what this check covered.
        print(f"{len(names)} tables match their raw output ({', '.join(names)})")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
