"""Seeded comparisons of sweep results: a mean and a 95% interval per setting, and a difference
to the reference setting that is called a difference only when its interval excludes zero.

Input rows are the sweep's table rows (``megatron-s2-sweep collect`` writes them as
``results.csv``; :func:`read_results` reads that file back), one per run: the ``setting`` (the
point's name without its seed), ``train.seed``, ``final_valid_loss`` and ``tokens_per_s``.
The intervals are Student-t intervals from scipy (``scipy.stats``): of the mean over a setting's
seeds, and of the difference to the reference, paired by seed where both ran the same seeds
(the same seed gives both the same data order and validation batches, so pairing removes that
part of the spread), Welch's otherwise.

The rule applied in every table (``docs/quality.md``): a difference whose 95% interval contains
zero is reported as "no difference", never as better or worse.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

__all__ = [
    "CONFIDENCE",
    "Estimate",
    "SettingSummary",
    "mean_interval",
    "difference_interval",
    "verdict",
    "read_results",
    "summarize",
    "position_rows",
    "summary_markdown",
    "write_summary",
    "SpeedModel",
    "fit_speed_model",
    "speed_rows",
    "speed_model_markdown",
]

CONFIDENCE = 0.95
SEED_KEY = "train.seed"
LOSS = "final_valid_loss"
SPEED = "tokens_per_s"
# What a sweep writes in a row's ``memory`` column for a run trained in CPU mode (the trainer's
# resident set size stands in for GPU memory): its speeds measure the CPU reference paths.
CPU_MEMORY = "cpu rss"
CPU_NOTE = (
    "Trained in CPU mode: tokens/s, TFLOP/s and wall times measure the CPU reference paths, "
    "not the GPU kernels; do not compare speeds."
)


def trained_on_cpu(rows: Iterable[dict]) -> bool:
    """Whether any of a sweep's rows (results.csv) is a run trained in CPU mode, whose speed
    columns (and so the speed-ups, the Pareto front and the frontier plot's x axis) mean
    nothing for the GPU kernels."""
    return any(r.get("memory") == CPU_MEMORY for r in rows)


DENSITY = "attention_density"
LENGTH = "model.seq_length"


@dataclass(frozen=True)
class Estimate:
    """A mean with the half-width of its ``CONFIDENCE`` interval (None with fewer than 2 values)."""

    mean: float
    half_width: Optional[float]
    n: int

    @property
    def low(self) -> Optional[float]:
        return None if self.half_width is None else self.mean - self.half_width

    @property
    def high(self) -> Optional[float]:
        return None if self.half_width is None else self.mean + self.half_width

    def text(self, fmt: str = "{:.4f}") -> str:
        """``2.8568 ± 0.0123`` (the ± is the interval's half-width), or the mean alone; a sign
        in ``fmt`` (``{:+.2f}``) applies to the mean only."""
        if self.half_width is None:
            return fmt.format(self.mean)
        return f"{fmt.format(self.mean)} ± {fmt.replace('+', '').format(self.half_width)}"


def _t_half_width(sd: float, n: int, level: float) -> float:
    from scipy import stats

    return float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)


def mean_interval(values: Sequence[float], level: float = CONFIDENCE) -> Estimate:
    """Mean of ``values`` and the half-width of its Student-t ``level`` interval."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("mean_interval needs at least one value")
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return Estimate(mean, None, n)
    return Estimate(mean, _t_half_width(_sample_sd(values), n, level), n)


def _sample_sd(values: Sequence[float]) -> float:
    """Sample standard deviation (n - 1 in the denominator) of at least two values."""
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def difference_interval(
    values: dict, reference: dict, level: float = CONFIDENCE, relative: bool = True
) -> tuple[Optional[Estimate], str]:
    """The difference ``values - reference`` (in % of the reference's mean if ``relative``)
    with its ``level`` interval, and how it was computed ("paired", "Welch" or "").

    ``values`` and ``reference`` map seed -> value. With at least 2 seeds in common the seeds
    are paired (the differences of the same seed); otherwise Welch's interval of the difference
    of the two means (each needs 2 values). None when neither is possible."""
    from scipy import stats

    common = [s for s in values if s in reference]
    ref_mean = sum(reference.values()) / len(reference) if reference else float("nan")
    scale = 100.0 / ref_mean if relative else 1.0
    if len(common) >= 2:
        diffs = [(values[s] - reference[s]) * scale for s in common]
        return mean_interval(diffs, level), "paired"
    a, b = list(values.values()), list(reference.values())
    if len(a) >= 2 and len(b) >= 2:
        res = stats.ttest_ind(a, b, equal_var=False)
        ci = res.confidence_interval(confidence_level=level)
        mean = (sum(a) / len(a) - sum(b) / len(b)) * scale
        return Estimate(mean, (ci.high - ci.low) / 2 * abs(scale), min(len(a), len(b))), "Welch"
    return None, ""


def verdict(diff: Optional[Estimate], lower_is_better: bool = True) -> str:
    """The differences-within-noise rule: "no difference" when the interval contains zero,
    else "lower" / "higher" (and whether that is better); "one seed" without an interval."""
    if diff is None or diff.half_width is None:
        return "one seed: no interval"
    if diff.low <= 0.0 <= diff.high:
        return "no difference"
    lower = diff.mean < 0
    better = lower == lower_is_better
    return f"{'lower' if lower else 'higher'} ({'better' if better else 'worse'})"


def _number(value) -> Optional[float]:
    if value is None or value == "":
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _finished(row: dict) -> bool:
    """Whether a results.csv row is a finished run (a row without a status counts as one)."""
    return row.get("status", "finished") == "finished"


def read_results(path: str | os.PathLike) -> list[dict]:
    """The rows of a sweep's ``results.csv`` (strings, as written)."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@dataclass
class SettingSummary:
    """One setting over its seeds: loss and speed with intervals, and against the reference."""

    setting: str
    seeds: list
    values: dict  # the setting's other table columns (e.g. the schedule, the length)
    loss: Estimate
    speed: Optional[Estimate]
    loss_diff: Optional[Estimate] = None  # % of the reference's mean loss
    loss_diff_method: str = ""
    speedup: Optional[float] = None  # mean tokens/s over the reference's
    verdict: str = ""


def _setting_of(row: dict) -> str:
    setting = row.get("setting") or ""
    if setting:
        return setting
    name = row.get("point", "")
    return name.rsplit(",seed=", 1)[0] if ",seed=" in name else name


def summarize(
    rows: Iterable[dict],
    reference: Optional[str] = None,
    columns: Sequence[str] = (),
    loss_key: str = LOSS,
) -> list[SettingSummary]:
    """One :class:`SettingSummary` per setting with a finished run that has a ``loss_key``
    value (default the final validation loss), in the rows' order; ``columns``: table columns
    copied from the setting's first row.

    Raises ValueError if ``reference`` names no such setting."""
    groups: dict = {}
    for row in rows:
        loss = _number(row.get(loss_key))
        if loss is None or not _finished(row):
            continue
        seed = row.get(SEED_KEY, "")
        groups.setdefault(_setting_of(row), []).append((seed, loss, _number(row.get(SPEED)), row))
    if reference is not None and reference not in groups:
        raise ValueError(
            f"reference {reference!r} has no finished run with a validation loss; settings "
            f"with one: {', '.join(groups) or 'none'}"
        )
    out = []
    for setting, runs in groups.items():
        speeds = [s for _, _, s, _ in runs if s is not None]
        out.append(
            SettingSummary(
                setting=setting,
                seeds=[seed for seed, _, _, _ in runs],
                values={c: runs[0][3].get(c, "") for c in columns},
                loss=mean_interval([loss for _, loss, _, _ in runs]),
                speed=mean_interval(speeds) if speeds else None,
            )
        )
    if reference is not None:
        ref = next(s for s in out if s.setting == reference)
        ref_losses = {seed: loss for seed, loss, _, _ in groups[reference]}
        for s in out:
            if s is ref:
                continue
            mine = {seed: loss for seed, loss, _, _ in groups[s.setting]}
            s.loss_diff, s.loss_diff_method = difference_interval(mine, ref_losses)
            s.verdict = verdict(s.loss_diff)
            if s.speed is not None and ref.speed is not None:
                s.speedup = s.speed.mean / ref.speed.mean
    return out


def position_rows(
    runs_dirs: str | Sequence[str], window: int, adopted: Optional[dict] = None
) -> list[dict]:
    """Rows (setting, ``train.seed``, ``loss_in_window``, ``loss_beyond_window``) of every run
    under ``runs_dirs`` (a sweep's ``runs/`` folder, or a copy holding each run's
    ``loss_by_position.json`` directly or in ``long_context_eval/``; several folders: a point's
    curve from the first that has one): the mean loss per token (nats) of the positions before
    ``window`` tokens and of those at or after it, weighted by the tokens in each bin. A bin
    that straddles ``window`` is left out of both.

    ``adopted``: {point name: run folder} for points whose run is kept elsewhere (adopted from
    another study, whose folder has that study's name for it); read under the point's name
    where no folder of ``runs_dirs`` holds a curve for it."""
    import json

    def curve_file(folder: str) -> Optional[str]:
        for path in (
            os.path.join(folder, "loss_by_position.json"),
            os.path.join(folder, "long_context_eval", "loss_by_position.json"),
        ):
            if os.path.isfile(path):
                return path
        return None

    adopted = adopted or {}
    dirs = [runs_dirs] if isinstance(runs_dirs, (str, os.PathLike)) else list(runs_dirs)
    rows = []
    for name in sorted(set().union(*(os.listdir(d) for d in dirs)) | set(adopted)):
        folders = [os.path.join(d, name) for d in dirs]
        if name in adopted:
            folders.append(adopted[name])
        path = next((f for f in map(curve_file, folders) if f is not None), None)
        if path is None:
            continue
        with open(path) as f:
            bins = json.load(f)["bins"]
        parts: dict = {"in": [0.0, 0], "beyond": [0.0, 0]}
        for b in bins:
            side = "in" if b["end"] <= window else "beyond" if b["start"] >= window else None
            if side:
                parts[side][0] += b["loss"] * b["tokens"]
                parts[side][1] += b["tokens"]
        setting, _, seed = name.rpartition(",seed=")
        rows.append(
            {
                "point": name,
                "status": "finished",
                "setting": setting or name,
                SEED_KEY: seed if setting else "",
                "loss_in_window": parts["in"][0] / parts["in"][1] if parts["in"][1] else "",
                "loss_beyond_window": (
                    parts["beyond"][0] / parts["beyond"][1] if parts["beyond"][1] else ""
                ),
            }
        )
    return rows


def per_seed_markdown(rows: Sequence[dict], reference: str) -> str:
    """Every finished run (rows of a sweep's results.csv, in their order) as one table row: its
    setting, seed, final validation loss, tokens/s and its difference to ``reference``'s run of
    the same seed in % of the reference's mean loss over its seeds (so the values
    :func:`difference_interval` pairs; empty where the reference has no run of that
    seed), then the reference's noise band: its seeds' spread (max - min) and standard
    deviation, both in % of its mean. ValueError if ``reference`` has no finished run."""
    done = [r for r in rows if _finished(r) and _number(r.get(LOSS)) is not None]
    ref = {r.get(SEED_KEY, ""): _number(r[LOSS]) for r in done if _setting_of(r) == reference}
    if not ref:
        raise ValueError(f"reference {reference!r} has no finished run with a validation loss")
    mean = sum(ref.values()) / len(ref)
    lines = [
        f"| setting | seed | valid loss | tokens/s "
        f"| vs {reference}'s same seed (% of {reference}'s mean) |",
        "|---|---|---|---|---|",
    ]
    for r in done:
        seed, loss, speed = r.get(SEED_KEY, ""), _number(r[LOSS]), _number(r.get(SPEED))
        diff = ""
        if _setting_of(r) != reference and seed in ref:
            diff = f"{(loss - ref[seed]) * 100.0 / mean:+.2f}%"
        speed_text = f"{speed:,.0f}" if speed is not None else ""
        lines.append(f"| {_setting_of(r)} | {seed} | {loss:.4f} | {speed_text} | {diff} |")
    values = list(ref.values())
    spread = (max(values) - min(values)) * 100 / mean
    band = f"{reference} over {len(values)} seed(s): spread {spread:.2f}%"
    if len(values) > 1:
        sd = _sample_sd(values)
        band += f", standard deviation {sd * 100 / mean:.2f}% of its mean loss {mean:.4f}"
    text = "\n".join(lines) + f"\n\nNoise band: {band}.\n"
    ratios = speed_ratios(done, reference)
    if ratios:
        text += (
            f"\nSpeed vs {reference}, paired by seed (tokens/s over {reference}'s run of the "
            f"same seed):\n"
        )
        for setting, est, seeds in ratios:
            text += f"- {setting}: {est.mean:.3f}x"
            if est.half_width is not None:
                text += f" ± {est.half_width:.3f} (95% interval [{est.low:.3f}, {est.high:.3f}])"
            text += f", seeds {','.join(seeds)}\n"
    return text


def speed_ratios(rows: Sequence[dict], reference: str) -> list[tuple[str, Estimate, list]]:
    """(setting, Estimate, seeds) per setting other than ``reference``: the mean over seeds of
    the tokens/s ratio of each finished run to ``reference``'s run of the same seed (unitless,
    x), with its Student-t 95% interval; seeds without both runs' tokens/s are left out, and so
    is a setting with none. Pairing removes what a seed shares across settings (its host in a
    lease, its data order)."""
    speed: dict = {}
    for r in rows:
        value = _number(r.get(SPEED))
        if _finished(r) and value is not None:
            speed.setdefault(_setting_of(r), {})[r.get(SEED_KEY, "")] = value
    ref = speed.get(reference, {})
    out = []
    for setting, mine in speed.items():
        seeds = [s for s in mine if s in ref]
        if setting != reference and seeds:
            out.append((setting, mean_interval([mine[s] / ref[s] for s in seeds]), seeds))
    return out


def pareto_fastest(summaries: Sequence[SettingSummary]) -> list[int]:
    """Indices of the settings no other setting beats on both mean loss (lower) and mean
    tokens/s (higher), fastest first."""
    idx = [i for i, s in enumerate(summaries) if s.speed is not None]
    idx.sort(key=lambda i: (-summaries[i].speed.mean, summaries[i].loss.mean))
    front, best = [], math.inf
    for i in idx:
        if summaries[i].loss.mean < best:
            front.append(i)
            best = summaries[i].loss.mean
    return front


def summary_markdown(
    summaries: Sequence[SettingSummary],
    reference: Optional[str],
    columns: Sequence[str] = (),
    loss_name: str = "valid loss",
) -> str:
    """The summary table: per setting its seeds, the mean ``loss_name`` and tokens/s with 95%
    intervals, and against the reference the loss difference (its interval) and the verdict."""
    head = ["setting", *columns, "seeds", f"{loss_name} (95% CI)", "tokens/s (95% CI)"]
    if reference is not None:
        head += [f"speed vs {reference}", f"loss vs {reference} (95% CI)", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    front = set(pareto_fastest(summaries))
    for i, s in enumerate(summaries):
        name = f"**{s.setting}**" if i in front else s.setting
        cells = [name, *(str(s.values.get(c, "")) for c in columns)]
        cells.append(",".join(str(x) for x in s.seeds))
        cells.append(s.loss.text())
        cells.append(s.speed.text("{:,.0f}") if s.speed else "")
        if reference is not None:
            if s.setting == reference:
                cells += ["1.00x", "(reference)", ""]
            else:
                cells.append(f"{s.speedup:.2f}x" if s.speedup is not None else "")
                if s.loss_diff is None:
                    cells.append("")
                else:
                    cells.append(f"{s.loss_diff.text('{:+.2f}')}% ({s.loss_diff_method})")
                cells.append(s.verdict)
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Intervals: Student-t {CONFIDENCE:.0%} over seeds; differences paired by seed where "
        "both ran the same seeds (Welch's otherwise). A difference whose interval contains 0 "
        "is 'no difference'. Bold: the Pareto front (no other setting is both faster and lower "
        "in mean loss).",
    ]
    return "\n".join(lines) + "\n"


def write_frontier_plot(summaries: Sequence[SettingSummary], path: str, title: str) -> str:
    """``path``: mean validation loss (95% interval bars) against mean tokens/s, one point per
    setting, the Pareto front joined.

    The settings are named in a legend beside the axes, each with its own colour and marker:
    labels written next to the points overlap where the points do (a stride x window grid puts
    several settings within 1% of each other in speed), and the legend stays readable."""
    import matplotlib.pyplot as plt

    fig = frontier_figure(summaries, title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def frontier_figure(summaries: Sequence[SettingSummary], title: str):
    """The matplotlib figure that :func:`write_frontier_plot` saves (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [s for s in summaries if s.speed is not None]
    markers = "osD^vP*Xh<>p"
    colors = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, s in enumerate(pts):
        ax.errorbar(
            s.speed.mean,
            s.loss.mean,
            yerr=s.loss.half_width,
            xerr=s.speed.half_width,
            fmt=markers[i % len(markers)],
            color=colors[i % len(colors)],
            capsize=3,
            zorder=3,
            label=s.setting,
        )
    front = [summaries[i] for i in pareto_fastest(summaries)]
    if front:
        ax.plot(
            [s.speed.mean for s in front],
            [s.loss.mean for s in front],
            "r--o",
            mfc="none",
            ms=14,
            label="Pareto front (means)",
        )
    if pts:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_xlabel("training tokens/s (mean over seeds)")
    ax.set_ylabel(f"validation loss (mean, {CONFIDENCE:.0%} interval)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


SUMMARY_COLUMNS = ("attention.dense_layers.pattern", "model.seq_length")


def write_summary(
    rows: Sequence[dict],
    out_dir: str,
    reference: Optional[str] = None,
    title: str = "",
    axes: Sequence[str] = (),
) -> list[str]:
    """Write ``summary.csv``, ``summary.md`` and ``frontier.png`` into ``out_dir`` from the
    sweep's rows; returns the paths written (none without a finished run). ``axes``: the
    study's keys that its points vary (a grid's), shown after :data:`SUMMARY_COLUMNS` (the
    seed aside: it is what the summary averages over)."""
    # (the seed is what the summary averages over; checkpoint.* says where a run loaded from)
    extra = [a for a in axes if a not in SUMMARY_COLUMNS and a != SEED_KEY]
    wanted = [*SUMMARY_COLUMNS, *(a for a in extra if not a.startswith("checkpoint."))]
    # Columns of the settings summarized: a key set only by a point that did not run (a config
    # error) would be an empty column.
    finished = [r for r in rows if _finished(r)]
    columns = [c for c in wanted if any(r.get(c) not in (None, "") for r in finished)]
    try:
        summaries = summarize(rows, reference, columns)
    except ValueError:
        # The reference has not finished yet: the per-setting intervals are still worth having.
        summaries, reference = summarize(rows, None, columns), None
    if not summaries:
        return []
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, "summary.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "setting",
                *columns,
                "seeds",
                "n",
                "valid_loss_mean",
                "valid_loss_ci95",
                "tokens_per_s_mean",
                "tokens_per_s_ci95",
                "speedup",
                "loss_diff_pct",
                "loss_diff_pct_ci95",
                "loss_diff_method",
                "verdict",
            ]
        )
        for s in summaries:
            w.writerow(
                [
                    s.setting,
                    *(s.values.get(c, "") for c in columns),
                    " ".join(str(x) for x in s.seeds),
                    s.loss.n,
                    s.loss.mean,
                    "" if s.loss.half_width is None else s.loss.half_width,
                    "" if s.speed is None else s.speed.mean,
                    "" if s.speed is None or s.speed.half_width is None else s.speed.half_width,
                    "" if s.speedup is None else s.speedup,
                    "" if s.loss_diff is None else s.loss_diff.mean,
                    ""
                    if s.loss_diff is None or s.loss_diff.half_width is None
                    else s.loss_diff.half_width,
                    s.loss_diff_method,
                    s.verdict,
                ]
            )
    cpu = trained_on_cpu(rows)
    md_path = os.path.join(out_dir, "summary.md")
    with open(md_path, "w") as f:
        f.write(f"# {title} over seeds\n\n" if title else "")
        f.write(summary_markdown(summaries, reference, columns))
        if cpu:
            f.write(f"\n{CPU_NOTE}\n")
    plot_title = f"{title} (CPU mode: speeds not comparable)" if cpu else title
    plot = write_frontier_plot(summaries, os.path.join(out_dir, "frontier.png"), plot_title)
    return [csv_path, md_path, plot]


# ---- speed model -----------------------------------------------------------------------------
# At one sequence length and model shape, a training step's time per token is the attention's,
# which scales with the pairs attended (the model's attention density: attended pairs over the
# dense causal pairs, all layers), plus everything else (projections, MLP, norms, optimizer,
# communication), which no attention setting changes. So seconds per token is linear in the
# density; two settings on one host fix the line, and it predicts every other setting's
# tokens/s on that host before it is run. It holds as far as the S2 kernels run the pairs they
# attend at the dense kernel's rate; a setting far off the line says where they do not.


@dataclass(frozen=True)
class SpeedModel:
    """Seconds per training token as ``base + attention * density``.

    ``base``: seconds per token of everything but attention; ``attention``: of dense attention
    in every layer (density 1); both fitted by least squares to per-setting means of
    ``1 / tokens_per_s`` (``settings`` of them, at ``seq_length`` tokens)."""

    base: float
    attention: float
    settings: int
    seq_length: Optional[int] = None

    def tokens_per_s(self, density: float) -> float:
        """Predicted training tokens/s at ``density`` (0-1, the model's attention density)."""
        return 1.0 / (self.base + self.attention * density)

    @property
    def attention_share(self) -> float:
        """The share of a dense model's step time that is attention (density 1)."""
        return self.attention / (self.base + self.attention)


@dataclass
class SpeedRow:
    """One setting: its density, measured tokens/s over its finished seeds (None if none), the
    model's prediction, and ``status``: ``measured``, ``not run`` (no run started) or ``no
    tokens/s`` (runs, but none finished with a throughput)."""

    setting: str
    density: float
    measured: Optional[Estimate]
    predicted: float
    status: str = "measured"

    @property
    def residual(self) -> Optional[float]:
        """Measured over predicted tokens/s, in %, or None without a measurement."""
        if self.measured is None:
            return None
        return 100.0 * (self.measured.mean / self.predicted - 1.0)


@dataclass
class _DensityGroup:
    density: float
    speeds: list  # tokens/s of the setting's finished runs
    statuses: set


def _density_groups(rows: Sequence[dict]) -> tuple[dict, Optional[int]]:
    """(setting -> :class:`_DensityGroup` in the rows' order, the rows' sequence length or None).

    Raises ValueError if the rows have no ``attention_density`` column or value, one setting has
    two densities, a finished run's tokens/s is not positive, or the rows mix lengths."""
    if not any(_number(row.get(DENSITY)) is not None for row in rows):
        raise ValueError(
            f"no {DENSITY} in these rows: the speed model needs the sweep's {DENSITY} column "
            f"(megatron-s2-sweep collect writes it for every point)"
        )
    groups: dict = {}
    lengths = set()
    for row in rows:
        density = _number(row.get(DENSITY))
        if density is None:
            continue
        setting = _setting_of(row)
        length = _number(row.get(LENGTH))
        if length is not None:
            lengths.add(int(length))
        group = groups.setdefault(setting, _DensityGroup(density, [], set()))
        if abs(group.density - density) > 1e-9:
            raise ValueError(
                f"setting {setting!r} has two attention densities: {group.density} and {density}"
            )
        group.statuses.add(row.get("status", "finished"))
        speed = _number(row.get(SPEED))
        if speed is not None and _finished(row):
            if speed <= 0:
                raise ValueError(f"{row.get('point', setting)}: {SPEED} {speed} is not positive")
            group.speeds.append(speed)
    if len(lengths) > 1:
        raise ValueError(
            f"the rows mix sequence lengths ({', '.join(map(str, sorted(lengths)))}); the speed "
            f"model holds at one length: give one study's rows"
        )
    return groups, (lengths.pop() if lengths else None)


def fit_speed_model(rows: Iterable[dict]) -> SpeedModel:
    """Fit :class:`SpeedModel` to a sweep's rows (``attention_density``, ``tokens_per_s``,
    finished runs): one point per setting, the mean over its seeds of seconds per token.

    Raises ValueError with fewer than two distinct densities among the finished settings, and
    when the fitted line is not a speed model (attention or the rest not taking time: the runs
    do not follow it, e.g. they ran on different hosts)."""
    groups, length = _density_groups(list(rows))
    measured = {k: g for k, g in groups.items() if g.speeds}
    points = [
        (g.density, sum(1.0 / v for v in g.speeds) / len(g.speeds)) for g in measured.values()
    ]
    if len({round(d, 9) for d, _ in points}) < 2:
        raise ValueError(
            f"the speed model needs finished runs (with {SPEED} and {DENSITY}) of at least two "
            f"settings of different attention density; found {', '.join(measured) or 'none'}"
        )
    from scipy import stats

    fit = stats.linregress([d for d, _ in points], [t for _, t in points])
    model = SpeedModel(
        base=float(fit.intercept),
        attention=float(fit.slope),
        settings=len(points),
        seq_length=length,
    )
    if model.attention <= 0 or model.base <= 0:
        raise ValueError(
            f"the fitted line is not a speed model ({model.base * 1e6:.4f} us + "
            f"{model.attention * 1e6:.4f} us x density: denser settings must not be faster and "
            f"the rest of a step must take time); these runs do not follow it (another host or "
            f"length among them?)"
        )
    return model


def speed_rows(rows: Iterable[dict], model: SpeedModel) -> list[SpeedRow]:
    """Every setting of ``rows`` with an attention density (run or not) against ``model``.

    Raises ValueError if the rows have no densities or are at another sequence length than the
    model was fitted."""
    groups, length = _density_groups(list(rows))
    if model.seq_length is not None and length is not None and length != model.seq_length:
        raise ValueError(
            f"the speed model was fitted at {model.seq_length} tokens, these rows are at {length}"
        )
    return [
        SpeedRow(
            setting=setting,
            density=g.density,
            measured=mean_interval(g.speeds) if g.speeds else None,
            predicted=model.tokens_per_s(g.density),
            status=(
                "measured"
                if g.speeds
                else ("not run" if g.statuses == {"not run"} else "no tokens/s")
            ),
        )
        for setting, g in groups.items()
    ]


def speed_model_markdown(table: Sequence[SpeedRow], model: SpeedModel, fitted_on: str) -> str:
    """The model's line and a markdown table: setting, density, seeds, measured tokens/s (95%
    interval), predicted, and measured against predicted in %."""
    us = 1e6
    lines = [
        f"Speed model, fitted on {model.settings} settings of {fitted_on}: seconds per token = "
        f"{model.base * us:.4f} us + {model.attention * us:.4f} us x attention density "
        f"(attention {100 * model.attention_share:.1f}% of a dense step"
        + (f" at {model.seq_length} tokens" if model.seq_length else "")
        + ")",
        "",
        "| setting | attention density | seeds | tokens/s measured (95% CI) | tokens/s predicted "
        "| measured vs predicted |",
        "|---|---|---|---|---|---|",
    ]
    for r in table:
        measured = r.measured.text("{:,.0f}") if r.measured else r.status
        # round(..) + 0.0: a residual that rounds to zero prints as +0.0, not -0.0.
        residual = f"{round(r.residual, 1) + 0.0:+.1f}%" if r.residual is not None else ""
        seeds = r.measured.n if r.measured else 0
        lines.append(
            f"| {r.setting} | {r.density:.3f} | {seeds} | {measured} | {r.predicted:,.0f} "
            f"| {residual} |"
        )
    return "\n".join(lines) + "\n"
