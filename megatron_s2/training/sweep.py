"""Ablation studies: many runs of one base config, their results in one table and two plots.

    megatron-s2-sweep run STUDY.yaml                  # every point, one after another, here
    megatron-s2-sweep run STUDY.yaml --devices 0,1,2,3  # here, one point per GPU at a time
    megatron-s2-sweep run STUDY.yaml --after 'CMD {run}'  # CMD after each point, in its slot
    megatron-s2-sweep run STUDY.yaml --slurm --sbatch-args "--nodes=1 --gpus-per-node=8"
    megatron-s2-sweep collect STUDY.yaml              # table and plots of what has run so far
    megatron-s2-sweep list STUDY.yaml                 # the points, their state and validity

A study YAML (``docs/sweeps.md``)::

    name: s2-stride-window
    base: ../gpt-125m-s2.yaml          # run config, relative to this file (default: the demo)
    overrides: {train.train_iters: 300}  # every point (mapping, or a list of key=value)
    grid:                              # the cross product of these axes ...
      attention.s2.vert_stride: [4, 8, 16]
      attention.s2.local_blocks: [4, 8, 16]
    points:                            # ... and/or explicit points
      - {attention.dense_layers.pattern: D}
    output_dir: sweeps/s2-stride-window  # default sweeps/<name>, relative to the current dir
    nproc_per_node: 1                  # trainer processes per point (> 1: launch/torchrun.sh)
    equal_tokens: null                 # where "loss at equal tokens" is read (default: the
                                       # smallest final token count of the points)
    seeds: [1, 2, 3]                   # every point once per seed (train.seed; a grid axis
                                       # of its own, named last: "...,seed=2"; the same as
                                       # train.seed: [1, 2, 3] under grid)
    reference: dense                   # the setting others are compared with in summary.md

Each point is the base config with the study's overrides and the point's values (dotted config
keys, values as in YAML), named after the values (``vert_stride=8,local_blocks=16``; with
``seeds``, one point per setting and seed, ``...,seed=2``), run in
``<output_dir>/runs/<point>`` by the trainer's own command line. A point whose config does not
load or validate (``load_config``, ``RunConfig.schedule()``, ``RunConfig.validate``) is reported
with the config error and skipped. Running again skips finished points (``summary.json`` at
``train.train_iters``) and resumes interrupted ones from their checkpoints (the trainer's own
resume; a point interrupted before its first checkpoint starts over with ``--restart``).

``--after CMD`` runs the shell command CMD (bash) after each point whose training finished, in
the point's slot (its ``--devices`` group, as ``CUDA_VISIBLE_DEVICES``) before that slot's next
point starts, and for finished points whose CMD has not succeeded yet (a resumed study catches
up); ``{run}`` and ``{point}`` in CMD become the run directory and the point's name,
shell-quoted. Output in ``<run dir>/after.log``, the outcome in ``<run dir>/after.json``: a rerun
skips a CMD that succeeded after the run's last training, and retries one that failed.

Exit codes: 0 every valid point finished (or was submitted) and its ``--after`` succeeded; 1 a
point failed; 2 a study error (unreadable YAML, unknown key, no valid point, a bad ``--after``);
3 every point finished but an ``--after`` command failed; 130 Ctrl-C (the running points'
trainers and ``--after`` commands get it from the terminal too, checkpoint and stop; the sweep
waits for them, starts no other point and prints one line; running it again resumes).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import itertools
import json
import math
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from .run_config import (
    DEMO_CONFIG,
    ConfigError,
    DuplicateKeyError,
    RunConfig,
    SettingChange,
    _in,
    format_changes,
    load_config,
    resume_changes,
    yaml_load,
)
from .run_dir import LOCK_FILE
from .seed_stats import CPU_MEMORY, CPU_NOTE, trained_on_cpu

__all__ = [
    "StudyError",
    "Study",
    "Point",
    "load_study",
    "expand_points",
    "point_state",
    "stale_settings",
    "adoption_changes",
    "adopt_runs",
    "point_command",
    "run_local",
    "check_after",
    "after_command",
    "device_groups",
    "submit_slurm",
    "collect",
    "main",
]

PROG = "megatron-s2-sweep"
REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "launch" / "slurm.sbatch"
TORCHRUN = REPO / "launch" / "torchrun.sh"

EXIT_OK, EXIT_FAILED, EXIT_STUDY_ERROR = 0, 1, 2
# Every point trained but an --after command failed: the training results stand (the table is
# whole), what the command makes of them (an evaluation) is missing.
EXIT_AFTER_FAILED = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as the trainer

STUDY_KEYS = (
    "name",
    "base",
    "overrides",
    "grid",
    "points",
    "output_dir",
    "nproc_per_node",
    "equal_tokens",
    "seeds",
    "reference",
)
# The seed setting a study's ``seeds`` list expands over (one run per point and seed).
SEED_KEY = "train.seed"
# Settings recorded in every row of the table even when no point varies them, so that a table
# read on its own says at what length and with which seed each run trained.
RECORDED_KEYS = ("model.seq_length", SEED_KEY)
# Written by whoever runs a point (this module, or launch/slurm.sbatch for array tasks): one
# JSON line per session with its start, end and exit code; the table's wall time is their sum.
SESSIONS = "sweep_sessions.jsonl"
# ``run --after``: the command's output and its record (command, exit code, start, end, the
# run's iteration) in the point's run directory; the record lets a rerun skip what succeeded.
AFTER_LOG = "after.log"
AFTER_RECORD = "after.json"
# ``adopt``: where an adopted run came from, in the run directory it was copied to.
ADOPTED = "adopted.json"
# What may differ between an adopted run and the point it stands for: where its output went and
# how it was logged and fed, not what it computed.
ADOPT_IGNORED = (
    "logging",
    "train.num_workers",
    "checkpoint.save_interval",
    "checkpoint.save_at_end",
    "checkpoint.keep_last",
)
# ... except the logging interval: the learning-curve and speed records the table reads.
ADOPT_COMPARED = ("logging.log_interval",)
AFTER_FIELDS = {"run": "the run directory", "point": "the point's name"}
# A field is {word} not preceded by "$" (${VAR} is the shell's; {a,b}, {1..3} and {} are not
# words); {{word}} is a literal {word}, for a command that needs one (awk '{{print}}').
_AFTER_FIELD = re.compile(r"(\{\{\w+\}\})|(?<!\$)\{(\w+)\}")
# Characters kept in point names (they become directory and run names).
_SAFE = re.compile(r"[^A-Za-z0-9._=,+-]")
_MAX_NAME = 120


class StudyError(ValueError):
    """The study YAML cannot be used; the message names the key."""


@dataclass
class Point:
    """One run of the study: the base config with ``values`` (dotted key -> value)."""

    index: int
    name: str
    values: dict
    overrides: list = field(default_factory=list)  # all overrides after the base YAML
    run_dir: str = ""
    config: Optional[RunConfig] = None
    error: Optional[str] = None  # the config error of an invalid point
    setting: str = ""  # the name without its seed: the points one summary row averages

    @property
    def valid(self) -> bool:
        return self.error is None


@dataclass
class Study:
    """A parsed study file; ``points`` are expanded and validated by :func:`load_study`."""

    path: str
    name: str
    base: str
    overrides: list
    axes: list  # the dotted keys the points set (table columns), in order
    output_dir: str
    nproc_per_node: Optional[int] = None
    equal_tokens: Optional[float] = None
    points: list = field(default_factory=list)
    seeds: Optional[list] = None  # the study's ``seeds`` (None: each point runs once)
    reference: Optional[str] = None  # the setting (point name without its seed) compared against

    def point_dir(self, name: str) -> str:
        return os.path.join(self.output_dir, "runs", name)


# ---- the study file ----------------------------------------------------------------------------
def _attention_key(parts: list, key: str, where: str) -> None:
    """Check the part of a dotted key inside ``attention`` against the schedule's schema."""
    from s2attn.pattern import S2Pattern

    from ..schedule import DENSE_LAYER_KEYS, S2_LAYER_KEYS, SCHEDULE_KEYS

    settings = S2Pattern.setting_names()
    s2_keys = (*settings, *S2_LAYER_KEYS)  # sinks: under s2 only, not per override

    def bad(allowed, upto):
        raise StudyError(
            f"{where}: unknown config key {key!r} ({'.'.join(['attention', *parts[:upto]])}); "
            f"allowed there: {', '.join(str(a) for a in allowed)}"
        )

    if not parts:
        return
    if parts[0] not in SCHEDULE_KEYS:
        bad(SCHEDULE_KEYS, 1)
    if parts[0] == "s2" and len(parts) > 1:
        if parts[1] not in s2_keys or len(parts) > 2:
            bad(s2_keys, 2)
    elif parts[0] == "dense_layers" and len(parts) > 1:
        if parts[1] not in DENSE_LAYER_KEYS or len(parts) > 2:
            bad(DENSE_LAYER_KEYS, 2)
    elif parts[0] == "overrides" and len(parts) > 1:
        if not re.fullmatch(r"-?[0-9]+", parts[1]):
            raise StudyError(f"{where}: {key!r}: attention.overrides keys are layer indices")
        if len(parts) > 2 and (parts[2] not in settings or len(parts) > 3):
            bad(settings, 3)
    elif parts[0] == "allow_coverage_holes" and len(parts) > 1:
        bad([], 1)


def check_config_key(key: str, where: str) -> None:
    """Raise :class:`StudyError` unless the dotted ``key`` names a run-config setting."""
    if not isinstance(key, str) or not key or any(not p for p in key.split(".")):
        raise StudyError(f"{where}: {key!r} is not a dotted config key like train.train_iters")
    parts = key.split(".")
    cls: Any = RunConfig
    for i, part in enumerate(parts):
        if cls is None:
            raise StudyError(
                f"{where}: unknown config key {key!r}: {'.'.join(parts[:i])} is a value, not a "
                f"section"
            )
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            raise StudyError(
                f"{where}: unknown config key {key!r} ({'.'.join(parts[: i + 1])}); allowed "
                f"there: {', '.join(names)}"
            )
        if cls is RunConfig and part == "attention":
            _attention_key(parts[i + 1 :], key, where)
            return
        tp = typing.get_type_hints(cls)[part]
        cls = tp if dataclasses.is_dataclass(tp) else None


def _dump(value: Any) -> str:
    """``value`` as a one-line YAML flow value (what an override ``key=value`` parses back)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    text = text.removesuffix("...").strip()
    if "\n" in text:
        raise StudyError(f"value {value!r} does not fit on one line")
    return text


def _mapping_of_keys(raw: Any, where: str) -> dict:
    """A mapping of dotted keys (or a list of ``key=value`` strings) as {key: value}."""
    if raw is None:
        return {}
    if isinstance(raw, list) and all(isinstance(x, str) for x in raw):
        out = {}
        for item in raw:
            key, sep, value = item.partition("=")
            if not sep:
                raise StudyError(f"{where}: {item!r} must look like key.sub=value")
            out[key.strip()] = yaml.safe_load(value) if value.strip() else None
        return out
    if not isinstance(raw, dict):
        raise StudyError(
            f"{where} must be a mapping of dotted config keys to values (or a list of "
            f"key=value), got {type(raw).__name__}"
        )
    return dict(raw)


def _short_keys(keys: list) -> dict:
    """Each dotted key's shortest suffix that no other key shares (``vert_stride``)."""
    out = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            suffix = ".".join(parts[-n:])
            if not any(k != key and k.split(".")[-n:] == parts[-n:] for k in keys):
                out[key] = suffix
                break
        else:
            out[key] = key
    return out


def point_name(values: dict, short: dict) -> str:
    """``vert_stride=8,local_blocks=16``, made safe as a file and run name."""
    if not values:
        return "base"
    text = ",".join(f"{short[k]}={_dump(v)}" for k, v in values.items())
    name = _SAFE.sub("_", text).lstrip(".") or "point"
    if len(name) > _MAX_NAME:
        import hashlib

        name = name[: _MAX_NAME - 9] + "-" + hashlib.sha1(text.encode()).hexdigest()[:8]
    return name


def expand_points(grid: Any, points: Any) -> list[tuple[Optional[str], dict]]:
    """(explicit name or None, {key: value}) of every point: the grid's cross product (the
    first axis varies slowest), then the explicit points."""
    out = []
    if grid is not None:
        if not isinstance(grid, dict) or not grid:
            raise StudyError("grid must be a non-empty mapping of config keys to lists of values")
        for key, values in grid.items():
            if not isinstance(values, list) or not values:
                raise StudyError(f"grid.{key} must be a non-empty list of values, got {values!r}")
        keys = list(grid)
        for combo in itertools.product(*(grid[k] for k in keys)):
            out.append((None, dict(zip(keys, combo))))
    if points is not None:
        if not isinstance(points, list):
            raise StudyError(f"points must be a list of mappings, got {type(points).__name__}")
        for i, p in enumerate(points):
            if not isinstance(p, dict):
                raise StudyError(f"points[{i}] must be a mapping of config keys to values")
            p = dict(p)
            name = p.pop("name", None)
            if name is not None and not isinstance(name, str):
                raise StudyError(f"points[{i}].name must be a string, got {name!r}")
            out.append((name, p))
    if not out:
        raise StudyError("the study has no points: give grid and/or points")
    return out


SEED_FIELD = "{seed}"


def _with_seed(overrides: list, seed: Optional[int]) -> list:
    """``overrides`` with every ``{seed}`` replaced by the point's seed: a value that depends on
    the seed, e.g. an extension study's ``checkpoint.load_dir`` of the base run with the same
    seed (``.../runs/dense,seed={seed}/checkpoints``). Raises StudyError for ``{seed}`` in a
    study without ``seeds``."""
    if seed is None:
        for item in overrides:
            if SEED_FIELD in item:
                raise StudyError(
                    f"{item!r} uses {SEED_FIELD} but the study has no seeds list; add "
                    f"'seeds: [...]' or give the value itself"
                )
        return overrides
    return [item.replace(SEED_FIELD, str(seed)) for item in overrides]


def only_seeds(study: Study, seeds: Sequence[int]) -> list:
    """The points of ``study`` whose seed is in ``seeds`` (``run --seeds``: a study's seeds
    spread over several machines or leases). Raises StudyError for a seed the study lacks."""
    if study.seeds is None:
        raise StudyError("--seeds needs a study with a seeds list")
    unknown = [s for s in seeds if s not in study.seeds]
    if unknown:
        raise StudyError(
            f"--seeds {','.join(map(str, unknown))}: not among the study's seeds {study.seeds}"
        )
    return [p for p in study.points if p.values.get(SEED_KEY) in seeds]


def split_settings(study: Study, raw: str) -> list:
    """``run --settings``'s comma list as setting names. A grid point's setting holds commas
    itself (``vert_stride=4,local_blocks=8``), so the list is read left to right taking the
    longest run of pieces that names a setting of ``study``; a piece that starts none is kept
    alone (:func:`only_settings` then refuses it, listing the settings)."""
    known = {p.setting for p in study.points}
    pieces = [x for x in raw.split(",") if x]
    names, i = [], 0
    while i < len(pieces):
        end = next((j for j in range(len(pieces), i, -1) if ",".join(pieces[i:j]) in known), i + 1)
        names.append(",".join(pieces[i:end]))
        i = end
    return names


def only_settings(study: Study, settings: Sequence[str]) -> list:
    """The points of ``study`` whose setting (the point's name without its seed) is in
    ``settings`` (``run --settings``: a study's arms spread over several machines or leases).
    Raises StudyError for a setting the study lacks, listing its settings."""
    known = list(dict.fromkeys(p.setting for p in study.points))
    unknown = [s for s in settings if s not in known]
    if unknown:
        raise StudyError(
            f"--settings {','.join(unknown)}: not a setting of the study; its settings: "
            f"{', '.join(known)}"
        )
    return [p for p in study.points if p.setting in settings]


def _seeds(raw: Any) -> Optional[list]:
    """The study's ``seeds``: None, or a non-empty list of distinct integers >= 0."""
    if raw is None:
        return None
    if (
        not isinstance(raw, list)
        or not raw
        or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in raw)
    ):
        raise StudyError(f"seeds must be a non-empty list of integers >= 0, got {raw!r}")
    if len(set(raw)) != len(raw):
        raise StudyError(f"seeds has a value twice: {raw}; each seed runs once per point")
    return list(raw)


def load_study(
    path: str | os.PathLike,
    output_dir: Optional[str] = None,
    world_size: Optional[int] = None,
    extra_overrides: Sequence[str] = (),
    nproc_per_node: Optional[int] = None,
) -> Study:
    """Parse ``path``, expand and validate its points. Raises :class:`StudyError`.

    ``output_dir`` overrides the study's. ``world_size``: the processes each point will run on
    (for the data-parallel checks); default the study's ``nproc_per_node`` when set.
    ``extra_overrides``: ``key=value`` strings from the command line, applied to every point
    after the study's ``overrides`` and before the point's own values (machine-specific settings
    such as a corpus built on this machine, kept out of the study file). ``nproc_per_node``
    (``--nproc-per-node`` of run, collect, list and adopt; adopt's ``--from`` study keeps its
    own) replaces the study's own: a two-process study on a one-GPU
    machine trains the same global batch in one process, its micro-batches accumulated (the
    points' configs are checked at that size)."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a study YAML" if path.is_dir() else "does not exist"
        raise StudyError(f"study file {str(path)!r} {what}")
    try:
        d = yaml_load(path.read_text()) or {}
    except DuplicateKeyError as e:
        raise StudyError(f"{path}: {e.problem}") from None
    except yaml.YAMLError as e:
        raise StudyError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(d, dict):
        raise StudyError(f"{path}: the top level must be a mapping")
    unknown = sorted(set(map(str, d)) - set(STUDY_KEYS))
    if unknown:
        raise StudyError(
            f"{path}: unknown key(s) {', '.join(unknown)}; allowed keys: {', '.join(STUDY_KEYS)}"
        )
    name = d.get("name", path.stem)
    if not isinstance(name, str) or not name or _SAFE.search(name):
        raise StudyError(f"name must be a non-empty string of [A-Za-z0-9._=,+-], got {name!r}")
    base = d.get("base")
    if base is None:
        base_path = DEMO_CONFIG
    elif isinstance(base, str):
        base_path = (path.parent / base).resolve()
        if not base_path.is_file():
            raise StudyError(f"base: run config {str(base_path)!r} does not exist")
    else:
        raise StudyError(f"base must be the path of a run config, got {base!r}")
    # The study's own process count, then the command line's in its place.
    nproc = d.get("nproc_per_node")
    for value, where in ((nproc, "nproc_per_node"), (nproc_per_node, "--nproc-per-node")):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise StudyError(f"{where} must be an integer >= 1, got {value!r}")
    if nproc_per_node is not None:
        nproc = nproc_per_node
    equal = d.get("equal_tokens")
    if equal is not None and (
        not isinstance(equal, (int, float)) or isinstance(equal, bool) or equal <= 0
    ):
        raise StudyError(f"equal_tokens must be a number > 0, got {equal!r}")
    out = output_dir or d.get("output_dir") or os.path.join("sweeps", name)
    if not isinstance(out, str):
        raise StudyError(f"output_dir must be a path, got {out!r}")

    seeds = _seeds(d.get("seeds"))
    grid = d.get("grid")
    seed_grid = isinstance(grid, dict) and SEED_KEY in grid
    if seed_grid:
        # train.seed as a grid axis is the seeds list under another name: it becomes the seeds
        # axis (named last, grouped into settings, paired by seed in summary.md) rather than
        # a plain axis that would make every seed a setting of its own, never summarized.
        if seeds is not None:
            raise StudyError(
                f"{SEED_KEY} is set in grid and the study has seeds: {seeds}; give the seeds "
                f"in one place (the study's seeds list)"
            )
        try:
            seeds = _seeds(grid[SEED_KEY])
        except StudyError as e:
            raise StudyError(f"grid.{SEED_KEY} (the study's seeds): {e}") from None
        grid = {k: v for k, v in grid.items() if k != SEED_KEY} or None
    reference = d.get("reference")
    if reference is not None and not isinstance(reference, str):
        raise StudyError(f"reference must be a point's name (a string), got {reference!r}")

    common = _mapping_of_keys(d.get("overrides"), "overrides")
    for key in common:
        check_config_key(key, "overrides")
    cli: dict = {}
    for item in extra_overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise StudyError(f"command-line override {item!r} is not of the form key=value")
        check_config_key(key, "command line")
        cli[key] = value
    if seed_grid and grid is None and d.get("points") is None:
        raw_points = [(None, {})]  # seeds alone: the base config ("base,seed=k")
    else:
        raw_points = expand_points(grid, d.get("points"))
    axes: list = []
    for i, (_, values) in enumerate(raw_points):
        for key in values:
            check_config_key(key, f"points[{i}]" if grid is None else "grid/points")
            if key not in axes:
                axes.append(key)
    if seeds is not None:
        # One seed setting per run: a second source would make the seed axis lie.
        for where, keys in (("grid/points", axes), ("overrides", common), ("command line", cli)):
            if SEED_KEY in keys:
                raise StudyError(
                    f"{SEED_KEY} is set in {where} and the study has seeds: {seeds}; give the "
                    f"seeds in one place (the study's seeds list)"
                )
        axes.append(SEED_KEY)
    for key in ("name", "logging.run_dir"):
        if key in axes or key in common or key in cli:
            raise StudyError(f"{key} is set by the sweep for each point; leave it out of the study")
    short = _short_keys(axes)

    study = Study(
        path=str(path),
        name=name,
        base=str(base_path),
        overrides=[
            *(f"{k}={_dump(v)}" for k, v in common.items()),
            *(f"{k}={v}" for k, v in cli.items()),
        ],
        axes=axes,
        output_dir=os.path.abspath(out),
        nproc_per_node=nproc,
        equal_tokens=equal,
        seeds=seeds,
        reference=reference,
    )
    expanded = []
    for explicit, values in raw_points:
        setting = _SAFE.sub("_", explicit) if explicit else point_name(values, short)
        for seed in seeds if seeds is not None else [None]:
            if seed is None:
                expanded.append((setting, setting, values))
            else:
                # The seed last: the summary groups a setting's seeds by the name before it.
                expanded.append((f"{setting},seed={seed}", setting, {**values, SEED_KEY: seed}))
    if reference is not None and reference not in {setting for _, setting, _ in expanded}:
        raise StudyError(
            f"reference {reference!r} is not a point of the study; its points: "
            f"{', '.join(dict.fromkeys(setting for _, setting, _ in expanded))}"
        )
    seen: dict = {}
    for i, (pname, setting, values) in enumerate(expanded):
        if pname in seen:
            raise StudyError(
                f"points {seen[pname]} and {i} have the same name {pname!r} (the same values?)"
            )
        seen[pname] = i
        run_dir = study.point_dir(pname)
        overrides = [
            *study.overrides,
            *(f"{k}={_dump(v)}" for k, v in values.items()),
            f"name={pname}",
            f"logging.run_dir={run_dir}",
        ]
        overrides = _with_seed(overrides, values.get(SEED_KEY) if seeds is not None else None)
        point = Point(i, pname, values, overrides, run_dir, setting=setting)
        try:
            cfg = load_config(study.base, overrides)
            cfg.schedule()
            cfg.validate(world_size=world_size or nproc)
            if cfg.checkpoint.dir is not None:
                raise ConfigError(
                    f"checkpoint.dir is set ({cfg.checkpoint.dir}): every point would write "
                    f"its checkpoints there; leave it unset so that each point checkpoints in "
                    f"its own run directory"
                )
            point.config = cfg
        except ConfigError as e:
            point.error = str(e)
        study.points.append(point)
    return study


# ---- the state of a point's run directory ------------------------------------------------------
def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _locked(run_dir: str) -> bool:
    """Is a live trainer holding the run directory's lock?"""
    import fcntl

    path = os.path.join(run_dir, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops a lock this process took
    return False


def _has_checkpoint(checkpoint_dir: str) -> bool:
    return os.path.isdir(checkpoint_dir) and any(
        n.startswith("iter_") or n == "latest_checkpointed_iteration.txt"
        for n in os.listdir(checkpoint_dir)
    )


def point_state(point: Point) -> str:
    """``invalid``, ``running`` (a live trainer holds it), ``finished`` (its summary is at
    ``train.train_iters``), ``interrupted`` (a previous run that did not finish) or ``new``."""
    if not point.valid:
        return "invalid"
    run_dir = point.run_dir
    if _locked(run_dir):
        return "running"
    summary = _read_json(os.path.join(run_dir, "summary.json"))
    if summary and (summary.get("iteration") or 0) >= point.config.train.train_iters:
        return "finished"
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if (
        summary is not None
        or (os.path.isfile(metrics) and os.path.getsize(metrics) > 0)
        or _has_checkpoint(point.config.checkpoint_dir)
    ):
        return "interrupted"
    return "new"


def stale_settings(point: Point) -> list:
    """The settings a finished point was trained with that differ from what the study asks of
    it now, where they decide its result: those a resume of the run would refuse or apply
    (:func:`~.run_config.resume_changes`: the model's shape and meaning, attention, tokenizer,
    data blend and split, optimizer and schedule, seed, steps), read from the trainer's
    ``config.yaml`` in its run folder; how the run executed (parallel layout, workers,
    logging) does not count. ``[]`` when they agree, for a point not finished, or without a
    readable ``config.yaml`` (a run folder carried without it) to compare with."""
    if not point.valid or point_state(point) != "finished":
        return []
    stored = _stored_config(point.run_dir)
    if stored is None:
        return []
    changes = resume_changes(stored, point.config, own=True)
    return changes.refused + changes.plan


def _stored_config(run_dir: str) -> Optional[dict]:
    """The run config the trainer wrote into ``run_dir`` (``config.yaml``), or None where there
    is no readable one (a run folder carried without it)."""
    try:
        with open(os.path.join(run_dir, "config.yaml")) as f:
            stored = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
    return stored if isinstance(stored, dict) else None


def _adopted_record(point: Point) -> Optional[dict]:
    """The point's :data:`ADOPTED` record (where its run was copied from), or None."""
    return _read_json(os.path.join(point.run_dir, ADOPTED)) if point.valid else None


def refuse_stale(study: Study) -> bool:
    """Print, for every finished point of ``study`` trained with other settings than it asks
    now (:func:`stale_settings`), what differs; True if there was one. Such a point would
    otherwise be skipped as finished and its old results reported as this study's."""
    found = False
    for point in study.points:
        changes = stale_settings(point)
        if changes:
            found = True
            print(
                f"{PROG}: study error: point {point.name} finished with other settings than "
                f"the study asks now (its run folder {point.run_dir}):\n"
                + format_changes(changes, old="the run", new="the study")
                + "\nIts results are not this study's: move that run folder aside (or give "
                "another --output-dir) and run again",
                file=sys.stderr,
                flush=True,
            )
    return found


# ---- adopting another study's runs ------------------------------------------------------------
def _with_defaults(stored: dict) -> dict:
    """``stored`` (a ``config.yaml``) over the run config's defaults: a key that a config written
    by another version does not hold counts as its default, so that it is compared too."""

    def merge(base: Any, over: Any) -> Any:
        if not (isinstance(base, dict) and isinstance(over, dict)):
            return over
        return {**base, **{k: merge(base.get(k), v) for k, v in over.items()}}

    return merge(RunConfig().to_dict(), stored)


def _adopt_ignored(key: str) -> bool:
    """A setting that may differ between an adopted run and its point (:data:`ADOPT_IGNORED`)."""
    return _in(key, ADOPT_IGNORED) and key not in ADOPT_COMPARED


def adoption_changes(source: dict, point: Point) -> list:
    """The settings in which a finished run's config ``source`` (a run config mapping: the
    trainer's ``config.yaml``, keys it lacks taken as their defaults, or its study point's
    resolved config) differs from what ``point`` asks, where they decide what the run computed:
    everything :func:`stale_settings` compares, plus how it executed (parallel layout,
    micro-batch size, precision, recomputation: other numerics), the initialisation scale and
    the weights it started from (``checkpoint.load_dir``, ``checkpoint.reset_iteration``). Only
    :data:`ADOPT_IGNORED` (logging outputs, data workers, when checkpoints were saved) and where
    the run lives may differ. ``[]``: the run is the point's, trained."""
    source = _with_defaults(source)
    changes = resume_changes(source, point.config, own=True)
    found = [c for c in changes.refused + changes.plan + changes.other if not _adopt_ignored(c.key)]
    # resume_changes leaves these out (no effect on a resume); a new run starts from them.
    asked = point.config.to_dict()
    for key in ("model.init_method_std", "checkpoint.load_dir", "checkpoint.reset_iteration"):
        section, name = key.split(".")
        old, new = source[section].get(name), asked[section].get(name)
        if key == "checkpoint.load_dir" and old and new:
            old, new = os.path.normpath(old), os.path.normpath(new)
        if old != new:
            found.append(SettingChange(key, old, new))
    return found


def _copy_run(source_dir: str, target_dir: str) -> None:
    """Copy a run folder. The files of its saved steps (``checkpoints/iter_*/``: written once,
    never rewritten in place) are hard-linked where the filesystem allows; every other file is
    copied, since a resumed target rewrites or appends to them (the checkpoints' tracker file,
    its metrics), and through a link it would change the source's."""
    checkpoints = os.path.join(source_dir, "checkpoints")

    def link_or_copy(src: str, dst: str) -> None:
        rel = os.path.relpath(src, checkpoints)
        if not rel.startswith(os.pardir) and os.path.dirname(rel).startswith("iter_"):
            try:
                os.link(src, dst)
                return
            except OSError:
                pass
        shutil.copy2(src, dst)

    # The trainer's lock names the source run's process: not the copy's.
    shutil.copytree(
        source_dir,
        target_dir,
        copy_function=link_or_copy,
        ignore=shutil.ignore_patterns(LOCK_FILE, ADOPTED),
    )


def _finished_runs(source: Study, runs_dir: Optional[str]) -> list:
    """``source``'s finished runs as (point with its run folder, config mapping, compared with
    what, the step its summary is at): the config is the run's own ``config.yaml`` where
    readable, else the point as resolved now."""
    found = []
    for sp in source.points:
        if not sp.valid:
            continue
        run_dir = os.path.join(runs_dir, sp.name) if runs_dir else sp.run_dir
        run = dataclasses.replace(sp, run_dir=run_dir)
        if point_state(run) != "finished":
            continue
        step = (_read_json(os.path.join(run_dir, "summary.json")) or {}).get("iteration") or 0
        stored = _stored_config(run_dir)
        if stored is not None:
            found.append((run, stored, "its config.yaml", step))
        else:
            found.append((run, sp.config.to_dict(), "its study point as resolved now", step))
    return found


def _adopted_sources(study: Study) -> set:
    """The source runs (absolute folders) that points of ``study`` adopted already."""
    taken = set()
    for point in study.points:
        record = _adopted_record(point)
        if record and record.get("from"):
            taken.add(record["from"])
    return taken


def _adopt_one(run: Point, point: Point, source: Study, how: str) -> None:
    """Copy ``run`` into ``point``'s run folder with its :data:`ADOPTED` record, whole or not
    at all: into a folder beside it first, renamed into place once complete (a copy that
    failed midway must not leave the point looking finished)."""
    partial = point.run_dir.rstrip(os.sep) + ".adopting"
    if os.path.lexists(partial):
        shutil.rmtree(partial)  # a previous adopt that failed midway: ours
    try:
        _copy_run(run.run_dir, partial)
        record = {
            "from": os.path.abspath(run.run_dir),
            "study": os.path.abspath(source.path),
            "point": run.name,
            "compared_with": how,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        with open(os.path.join(partial, ADOPTED), "w") as f:
            json.dump(record, f, indent=1)
        if os.path.isdir(point.run_dir):
            os.rmdir(point.run_dir)  # empty (adopt_runs refuses a folder with files)
        os.rename(partial, point.run_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def adopt_runs(
    study: Study, source: Study, runs_dir: Optional[str] = None, dry_run: bool = False
) -> int:
    """Take ``source``'s finished runs as ``study``'s points where they trained exactly what a
    point asks (:func:`adoption_changes` empty, on as many processes, to the point's last
    step), so that an arm two studies share (the dense reference, a grid's default point)
    trains once. Each point of ``study`` not started yet gets a copy of the first such run not
    adopted already in its run directory, with :data:`ADOPTED` saying where it came from and
    what it was compared with; ``run`` then skips it as finished and ``collect`` reports it. A
    source run is compared with its own ``config.yaml`` where it has one (what it trained
    with), else with ``source``'s point as the study file resolves it now. ``runs_dir``: where
    ``source``'s run folders are (default: its ``output_dir/runs``; e.g. a committed copy of
    them). The machine a run trained on is not compared. Prints one line per adopted point;
    returns the exit code (2: nothing to adopt from, or a point's folder in the way, or a copy
    failed; the other points are adopted all the same)."""
    if (source.nproc_per_node or 1) != (study.nproc_per_node or 1):
        print(
            f"{PROG}: study error: {source.name} runs {source.nproc_per_node or 1} process(es) a "
            f"point, {study.name} {study.nproc_per_node or 1} (nproc_per_node): its runs "
            "computed otherwise and at another speed, none is adopted",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_STUDY_ERROR
    candidates = _finished_runs(source, runs_dir)
    if not candidates:
        where = runs_dir or os.path.join(source.output_dir, "runs")
        print(f"{PROG}: no finished run of {source.name} in {where}", file=sys.stderr, flush=True)
        return EXIT_STUDY_ERROR
    taken = _adopted_sources(study)
    adopted, failed = 0, False
    for point in study.points:
        if not point.valid or point_state(point) != "new":
            continue
        match = next(
            (
                (run, how)
                for run, cfg, how, step in candidates
                if os.path.abspath(run.run_dir) not in taken
                and step >= point.config.train.train_iters
                and not adoption_changes(cfg, point)
            ),
            None,
        )
        if match is None:
            continue
        run, how = match
        if os.path.isdir(point.run_dir) and os.listdir(point.run_dir):
            print(
                f"{PROG}: point {point.name}: its run folder {point.run_dir} holds files of no "
                f"finished run: move it aside to adopt {run.run_dir} there",
                file=sys.stderr,
                flush=True,
            )
            failed = True
            continue
        taken.add(os.path.abspath(run.run_dir))
        if not dry_run:
            try:
                _adopt_one(run, point, source, how)
            except (OSError, shutil.Error) as e:
                print(
                    f"{PROG}: point {point.name}: copying {run.run_dir} failed ({e}); the point "
                    "is left as it was",
                    file=sys.stderr,
                    flush=True,
                )
                failed = True
                continue
        adopted += 1
        verb = "would adopt" if dry_run else "adopted"
        _say(f"point {point.name}: {verb} {run.run_dir} ({source.name}'s {run.name}: the same "
             f"settings, compared with {how})")  # fmt: skip
    valid = [p for p in study.points if p.valid]
    left = sum(1 for p in valid if point_state(p) != "finished") - (adopted if dry_run else 0)
    before = len(_adopted_sources(study)) - (0 if dry_run else adopted)
    _say(f"{adopted} point(s) {'would be ' if dry_run else ''}adopted from {source.name}"
         + (f" ({before} adopted before)" if before else "")
         + f"; {left} of {study.name}'s {len(valid)} valid points left to train")  # fmt: skip
    return EXIT_STUDY_ERROR if failed else EXIT_OK


# ---- running -------------------------------------------------------------------------------
def _slot_env(devices: Optional[Sequence[str]]) -> dict:
    """The environment of a process run for a point: this one's, without a caller's ``RUN_DIR``
    (not this run's), seeing only ``devices`` (GPU ids) when given."""
    env = dict(os.environ)
    env.pop("RUN_DIR", None)
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    return env


class _CtrlC:
    """The Ctrl-Cs (SIGINT) that reached the sweep while :func:`run_local` runs points, counted.

    Python's own handler raises KeyboardInterrupt wherever the main thread happens to be: one
    that landed after a process (a point's trainer, an ``--after`` command) had started but
    before the ``try`` that waits for it escaped that block, and the sweep exited without
    waiting for the process, passing a further Ctrl-C on or recording how it ended (its
    sessions file, ``after.json``); one in a ``finally`` could cut a record short. This handler
    only counts; the code that starts and waits for processes looks at the count where acting
    on it is safe (:func:`_start_logged`, :func:`_wait_through_ctrl_c`, the loop of
    :func:`run_local`, which starts nothing once :attr:`pressed`).

    Not :class:`~megatron_s2.training.preemption.Preemption`: that is the trainer's (a second
    Ctrl-C raises there, and it catches SIGTERM too)."""

    def __init__(self) -> None:
        self.count = 0

    @property
    def pressed(self) -> bool:
        return self.count > 0

    def _on_sigint(self, signum, frame) -> None:
        self.count += 1

    @contextlib.contextmanager
    def counting(self):
        """Count the Ctrl-Cs in this block; the previous handler is back after it. An ignored
        SIGINT stays ignored (a shell's background job: Ctrl-C in the terminal is not meant for
        it); outside the main thread (which alone gets signals and may set handlers), and with
        a handler not set from Python (which could not be put back), nothing changes."""
        previous = signal.getsignal(signal.SIGINT)
        if (
            previous in (signal.SIG_IGN, None)
            or threading.current_thread() is not threading.main_thread()
        ):
            yield self
            return
        signal.signal(signal.SIGINT, self._on_sigint)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def _start_logged(
    log,
    argv: list,
    env: dict,
    devices: Optional[Sequence[str]],
    shown: str,
    ctrl_c: _CtrlC,
    **popen,
) -> Optional[subprocess.Popen]:
    """Write the GPU ids (with ``devices``) and the command ``shown`` to the open file ``log``,
    then start ``argv`` with its output (stderr too) piped as text for :func:`_follow`, bytes
    that are not UTF-8 replaced; ``popen``: further ``subprocess.Popen`` arguments. None, and
    nothing written or started, once Ctrl-C was pressed (one may come after the caller last
    looked, while it prepared the command); a Ctrl-C that came while it started is passed on
    to it (see below)."""
    if ctrl_c.pressed:
        return None
    if devices:
        log.write(f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}\n")
    log.write(f"$ {shown}\n")
    log.flush()
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        **popen,
    )
    if ctrl_c.pressed:
        # The caller saw none before starting it, so this one came while it started: a
        # terminal's may have reached the process group before the process was in it, and
        # ``kill -INT`` reaches the sweep alone; either way nothing is to run on after a Ctrl-C.
        proc.send_signal(signal.SIGINT)
    return proc


def point_command(
    study: Study, point: Point, *, restart: bool = False, devices: Optional[Sequence[str]] = None
) -> tuple[list, dict]:
    """(argv, environment) that trains ``point``: the trainer's CLI, or ``launch/torchrun.sh``
    with ``nproc_per_node`` > 1; ``devices`` (GPU ids) become its ``CUDA_VISIBLE_DEVICES``."""
    env = _slot_env(devices)
    extra = ["--restart"] if restart else []
    nproc = study.nproc_per_node or 1
    if nproc > 1:
        env.update(NPROC_PER_NODE=str(nproc), PYTHON=env.get("PYTHON", sys.executable))
        argv = ["bash", str(TORCHRUN), study.base, *point.overrides, *extra]
    else:
        argv = [
            sys.executable,
            "-m",
            "megatron_s2.training",
            "--config",
            study.base,
            *point.overrides,
            *extra,
        ]
    return argv, env


def device_groups(study: Study, devices: Sequence[str]) -> list[list[str]]:
    """Split GPU ids into one group per concurrent point (``nproc_per_node`` ids each)."""
    devices = [d.strip() for d in devices if d.strip()]
    nproc = study.nproc_per_node or 1
    if not devices or len(set(devices)) != len(devices) or len(devices) % nproc:
        raise StudyError(
            f"--devices {','.join(devices) or '(empty)'}: give distinct GPU ids, a multiple of "
            f"the processes a point, nproc_per_node ({nproc}) from the study or "
            f"--nproc-per-node, of them"
        )
    return [devices[i : i + nproc] for i in range(0, len(devices), nproc)]


def _say(msg: str) -> None:
    print(f"[{PROG}] {msg}", flush=True)


def report_invalid(study: Study) -> None:
    for p in study.points:
        if not p.valid:
            _say(f"point {p.name}: config error, skipped: {p.error}")


def _run_one(
    study: Study,
    point: Point,
    restart: bool,
    ctrl_c: _CtrlC,
    devices: Optional[Sequence[str]] = None,
    echo: bool = True,
) -> int:
    """Train ``point`` in a subprocess, its output in ``<output_dir>/logs/<point>.log`` (and on
    the console with ``echo``); append the session to the run's sessions file. Returns the exit
    code; whether Ctrl-C was pressed meanwhile, ``ctrl_c`` says."""
    argv, env = point_command(study, point, restart=restart, devices=devices)
    os.makedirs(os.path.join(study.output_dir, "logs"), exist_ok=True)
    log_path = os.path.join(study.output_dir, "logs", f"{point.name}.log")
    start = time.time()
    with open(log_path, "a") as log:
        proc = _start_logged(log, argv, env, devices, shlex.join(argv), ctrl_c)
        if proc is None:
            return EXIT_INTERRUPTED  # not started: nothing to record
        try:
            _follow(proc, log, echo, ctrl_c)
        finally:
            _record_session(
                point.run_dir, start, time.time(), proc.poll(), "local", study.nproc_per_node or 1
            )
    sys.stdout.flush()
    return proc.returncode


def _follow(proc: subprocess.Popen, log, echo: bool, ctrl_c: _CtrlC) -> None:
    """Copy ``proc``'s output to the open file ``log`` (and to the console with ``echo``) until
    it ends, passing Ctrl-Cs on as :func:`_wait_through_ctrl_c` does."""

    def copy_output() -> None:
        for line in proc.stdout:
            if echo:
                sys.stdout.write(line)
            log.write(line)
            log.flush()  # a log to follow while the process runs (tail -f)

    # Copied by a thread: a read blocks until the process prints, and the wait below must look
    # for Ctrl-Cs to pass on meanwhile.
    reader = threading.Thread(target=copy_output, daemon=True)
    reader.start()
    _wait_through_ctrl_c(proc, ctrl_c)
    reader.join()


# How often a wait looks for a Ctrl-C to pass on (the handler only counts them: see _CtrlC).
_CTRL_C_POLL_S = 0.1


def _wait_through_ctrl_c(proc: subprocess.Popen, ctrl_c: _CtrlC) -> None:
    """Wait for ``proc`` to end, passing on every Ctrl-C after the first.

    A terminal's Ctrl-C reaches the trainer too (same process group): it finishes its
    iteration, checkpoints and stops, so the first one only waits (one that came while the
    process started, :func:`_start_logged` passed on). A further one is passed on (the trainer
    aborts on its second; where the first reached the sweep alone, as ``kill -INT`` sends it,
    this is the trainer's first)."""
    passed_on = 1  # the Ctrl-Cs counted up to here are not to pass on
    while True:
        try:
            proc.wait(timeout=_CTRL_C_POLL_S)
            return
        except subprocess.TimeoutExpired:
            pass
        while passed_on < ctrl_c.count and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            passed_on += 1


def _record_session(
    run_dir: str, start: float, end: float, code, how: str, processes: int = 1
) -> None:
    """Append one training session of a point to its run's sessions file: wall-clock start
    and end (Unix seconds), the exit code, how it ran and on how many trainer processes (a
    study's ``nproc_per_node``, or ``--nproc-per-node``: a run's tokens/s is of that many)."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, SESSIONS), "a") as f:
            record = {"start": round(start, 3), "end": round(end, 3), "exit_code": code}
            f.write(json.dumps(record | {"how": how, "processes": processes}) + "\n")
    except OSError:
        pass


# ---- --after: a command after each finished point -----------------------------------------------
def check_after(template: str) -> None:
    """Raise :class:`StudyError` (naming ``--after``) unless ``template`` is a non-empty bash
    command whose ``{...}`` fields are all known (``AFTER_FIELDS``) and which parses."""
    if not template.strip():
        raise StudyError(
            "--after: the command is empty; give a shell command, e.g. --after 'du -sh {run}'"
        )
    unknown = sorted(
        {m.group(2) for m in _AFTER_FIELD.finditer(template) if m.group(2)} - set(AFTER_FIELDS)
    )
    if unknown:
        fields = ", ".join(f"{{{k}}} ({v})" for k, v in AFTER_FIELDS.items())
        raise StudyError(
            f"--after: unknown field(s) {', '.join(f'{{{k}}}' for k in unknown)} in "
            f"{template!r}; the fields are {fields}, each replaced shell-quoted (${{VAR}} is "
            f"left to the shell; write {{{{word}}}} for a literal {{word}})"
        )
    # Parsed (not run) now, with a stand-in point: a missing quote fails here, not after the
    # first point's training.
    probe = after_command(template, Point(0, "point", {}, run_dir="/run"))
    try:
        r = subprocess.run(["bash", "-n", "-c", probe], capture_output=True, text=True)
    except OSError as e:
        raise StudyError(f"--after: cannot run bash to check the command: {e}") from None
    if r.returncode != 0:
        raise StudyError(f"--after: {template!r} is not a valid bash command: {r.stderr.strip()}")


def after_command(template: str, point: Point) -> str:
    """The ``--after`` command for ``point``: ``{run}`` and ``{point}`` in ``template`` replaced
    by its run directory and name, shell-quoted (so unquoted in the template: ``{run}/x``);
    ``{{word}}`` becomes ``{word}``. ``template`` is checked by :func:`check_after`."""
    values = {"run": point.run_dir, "point": point.name}

    def field(m: re.Match) -> str:
        if m.group(1):
            return m.group(1)[1:-1]
        return shlex.quote(values[m.group(2)])

    return _AFTER_FIELD.sub(field, template)


def _summary_iteration(point: Point) -> Optional[int]:
    summary = _read_json(os.path.join(point.run_dir, "summary.json"))
    return summary.get("iteration") if summary else None


def _after_succeeded(point: Point, command: str) -> bool:
    """Did ``command`` succeed after the run's current training (the iteration its summary is
    at: a point trained further since, by a raised ``train_iters``, gets it again)?"""
    record = _read_json(os.path.join(point.run_dir, AFTER_RECORD))
    return (
        record is not None
        and record.get("exit_code") == 0
        and record.get("command") == command
        and record.get("iteration") == _summary_iteration(point)
    )


def _run_after(
    point: Point,
    command: str,
    ctrl_c: _CtrlC,
    devices: Optional[Sequence[str]] = None,
    echo: bool = True,
) -> int:
    """Run ``command`` with bash in the sweep's directory, seeing ``devices`` as the point did;
    output appended to ``<run dir>/after.log`` (and on the console with ``echo``), the outcome
    written to ``<run dir>/after.json``. Returns its exit code; whether Ctrl-C was pressed
    meanwhile, ``ctrl_c`` says (as :func:`_run_one`)."""
    env = _slot_env(devices)
    iteration = _summary_iteration(point)
    start = time.time()
    with open(os.path.join(point.run_dir, AFTER_LOG), "a") as log:
        log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        # stdin closed: a command that reads it would otherwise hold the sweep forever.
        proc = _start_logged(
            log, ["bash", "-c", command], env, devices, command, ctrl_c, stdin=subprocess.DEVNULL
        )
        if proc is None:
            return EXIT_INTERRUPTED  # not run: no after.json, so a later sweep runs it
        try:
            _follow(proc, log, echo, ctrl_c)
        finally:
            code = proc.poll()
            log.write(f"# exit code {code}\n")
            record = {
                "command": command,
                "exit_code": code,
                "start": round(start, 3),
                "end": round(time.time(), 3),
                "iteration": iteration,
                "devices": ",".join(devices) if devices else None,
            }
            tmp = os.path.join(point.run_dir, AFTER_RECORD + ".tmp")
            with open(tmp, "w") as f:
                json.dump(record, f, indent=1)
            os.replace(tmp, os.path.join(point.run_dir, AFTER_RECORD))  # never half written
    sys.stdout.flush()
    return proc.returncode


def _start_state(point: Point) -> Optional[bool]:
    """Whether ``point`` must start over (``--restart``), or None if it is not to run now."""
    state = point_state(point)
    if state in ("invalid", "finished", "running"):
        if state == "finished":
            adopted = _adopted_record(point)
            how = f"adopted from {adopted.get('from')}" if adopted else "finished"
            _say(f"point {point.name}: {how}, not rerun ({point.run_dir})")
        elif state == "running":
            _say(f"point {point.name}: a live run holds {point.run_dir}; skipped")
        return None
    if state == "interrupted":
        if _has_checkpoint(point.config.checkpoint_dir):
            _say(f"point {point.name}: interrupted, resuming from its checkpoint")
            return False
        _say(
            f"point {point.name}: interrupted before its first checkpoint, starting over "
            f"(the partial run is moved aside)"
        )
        return True
    _say(f"point {point.name}: running in {point.run_dir}")
    return False


def run_local(
    study: Study, devices: Optional[Sequence[str]] = None, after: Optional[str] = None
) -> int:
    """Run every valid point that is not finished; return the exit code.

    Without ``devices`` the points run one after another, each on what the trainer sees. With
    GPU ids, as many points run at once as there are groups of ``nproc_per_node`` ids, each
    seeing only its group (``CUDA_VISIBLE_DEVICES``); their output then goes to their logs only.
    ``after``: a bash command (``--after``, checked by :func:`check_after`) run in a point's
    slot right after its training finished, and for finished points whose command has not
    succeeded yet, before the slot's next point; a failed one leaves the point finished and
    makes the exit code ``EXIT_AFTER_FAILED`` (unless a point failed: ``EXIT_FAILED``).
    """
    report_invalid(study)
    groups = device_groups(study, devices) if devices else [None]
    failed = []
    after_failed = []
    for point in study.points:
        if point.valid and point_state(point) == "running":
            failed.append(point.name)
    todo: queue.Queue = queue.Queue()
    for point in study.points:
        todo.put(point)
    concurrent = len(groups) > 1

    ctrl_c = _CtrlC()  # once pressed, no further point (nor --after command) starts

    def run_after(point: Point, group: Optional[list]) -> None:
        if ctrl_c.pressed:
            return
        command = after_command(after, point)
        if _after_succeeded(point, command):
            _say(f"point {point.name}: --after succeeded before, not rerun")
            return
        where = f" on GPU {','.join(group)}" if group else ""
        _say(f"point {point.name}: --after{where}, output in {point.run_dir}/{AFTER_LOG}")
        code = _run_after(point, command, ctrl_c, devices=group, echo=not concurrent)
        if ctrl_c.pressed and not concurrent:
            return  # as after a point's training (see worker)
        if code != 0:
            _say(f"point {point.name}: --after failed (exit code {code}); see its {AFTER_LOG}")
            after_failed.append(point.name)
        elif concurrent:
            _say(f"point {point.name}: --after done")

    def worker(group: Optional[list]) -> None:
        while not ctrl_c.pressed:
            try:
                point = todo.get_nowait()
            except queue.Empty:
                return
            restart = _start_state(point)
            if restart is None:
                # Finished in an earlier session (or by another sweep): its command catches up.
                if after is not None and point_state(point) == "finished":
                    run_after(point, group)
                continue
            if concurrent:
                gpus = ",".join(group)
                _say(f"point {point.name}: on GPU {gpus}, log in {study.output_dir}/logs")
            code = _run_one(study, point, restart, ctrl_c, devices=group, echo=not concurrent)
            if ctrl_c.pressed and not concurrent:
                # One point at a time its output, the trainer's own Ctrl-C lines too, was on the
                # console, and main() says the sweep was interrupted; with several at once each
                # slot says how its point ended (their output is in their logs only).
                return
            if code != 0 or point_state(point) != "finished":
                _say(f"point {point.name}: failed (exit code {code}); see its log")
                failed.append(point.name)
                continue
            if concurrent:
                _say(f"point {point.name}: finished")
            # Not after a Ctrl-C that this trainer outlived (run_after starts nothing then).
            if after is not None:
                run_after(point, group)

    # From before the first process starts to after the last has ended, a Ctrl-C is counted,
    # not raised (see _CtrlC): each slot waits for its process, passes further Ctrl-Cs on and
    # records how it ended, then starts nothing more.
    with ctrl_c.counting():
        if concurrent:
            threads = [threading.Thread(target=worker, args=(g,), daemon=True) for g in groups]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            worker(groups[0])
    if ctrl_c.pressed:
        # Every process the sweep started has ended and is recorded: main() says the sweep
        # was interrupted and exits 130, as for a Ctrl-C anywhere else.
        raise KeyboardInterrupt
    if failed:
        _say(f"{len(failed)} point(s) did not finish: {', '.join(failed)}")
    if after_failed:
        _say(
            f"--after failed for {len(after_failed)} point(s): {', '.join(after_failed)} (see "
            f"{AFTER_LOG} in their run directories; running again retries them)"
        )
    if failed:
        return EXIT_FAILED
    return EXIT_AFTER_FAILED if after_failed else EXIT_OK


def submit_slurm(study: Study, sbatch_args: list, sbatch_script: str = str(SBATCH)) -> int:
    """Submit the valid, unfinished points as one Slurm job array through ``slurm.sbatch``:
    array task ``i`` trains point ``i`` (its run directory and overrides are in
    ``<output_dir>/slurm/tasks/<i>.args``, read by the script through ``SWEEP_TASKS``)."""
    report_invalid(study)
    tasks_dir = os.path.join(study.output_dir, "slurm", "tasks")
    logs = os.path.join(study.output_dir, "logs")
    os.makedirs(tasks_dir, exist_ok=True)
    os.makedirs(logs, exist_ok=True)
    todo = []
    for point in study.points:
        state = point_state(point)
        if state in ("invalid", "finished", "running"):
            if state != "invalid":
                _say(f"point {point.name}: {state}, not submitted")
            continue
        args = list(point.overrides)
        if state == "interrupted" and not _has_checkpoint(point.config.checkpoint_dir):
            args.append("--restart")  # nothing to resume: start over
        with open(os.path.join(tasks_dir, f"{point.index}.args"), "w") as f:
            f.write("\n".join([point.run_dir, *args]) + "\n")
        todo.append(point)
    if not todo:
        _say("nothing to submit")
        return EXIT_OK
    env = dict(os.environ, SWEEP_TASKS=tasks_dir)
    env.pop("RUN_DIR", None)
    env.setdefault("PYTHON", sys.executable)
    if study.nproc_per_node:
        env["NPROC_PER_NODE"] = str(study.nproc_per_node)
    argv = [
        "sbatch",
        "--parsable",
        f"--array={','.join(str(p.index) for p in todo)}",
        f"--job-name={study.name}",
        f"--output={os.path.join(logs, 'slurm-%A_%a.out')}",
        *sbatch_args,
        sbatch_script,
        study.base,
    ]
    _say(f"submitting {len(todo)} point(s): {shlex.join(argv)}")
    r = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True)
    job = (r.stdout or "").strip().split(";")[0]
    if job:
        with open(os.path.join(study.output_dir, "slurm", "jobs.jsonl"), "a") as f:
            f.write(json.dumps({"job": job, "points": [p.name for p in todo]}) + "\n")
        _say(f"job array {job}: task i trains point i ({', '.join(p.name for p in todo)})")
    if r.returncode != 0:
        _say(f"sbatch exited with {r.returncode}")
        return EXIT_FAILED
    return EXIT_OK


# ---- collecting ------------------------------------------------------------------------------
COLUMNS = (
    "point",
    "status",
    # the axes come here
    "final_train_loss",
    "final_train_iteration",
    "final_valid_loss",
    "final_valid_iteration",
    "loss_at_equal_tokens",
    "equal_tokens",
    "tokens",
    "tokens_per_s",
    "tflops_per_gpu",
    "peak_memory_gib",
    "memory",
    "attention_density",
    "union_coverage",
    "wall_time_s",
    "run_dir",
    "error",
)


def attention_stats(cfg: RunConfig) -> tuple[float, float]:
    """(model attention density, union coverage) at the run's sequence length.

    Density: attended (query, key) pairs over the dense causal pairs, all layers. Coverage: the
    smallest fraction, over the S2 layers, of key blocks that the union of the layer's heads
    reaches from every later query (1.0: no holes)."""
    m = cfg.model
    sched = cfg.schedule()
    heads, groups, n, s = m.num_attention_heads, m.query_groups, m.num_layers, m.seq_length
    causal = s * (s + 1) // 2 * heads
    density = sum(sched.attention_pairs(n, heads, groups, s)) / (causal * n)
    coverage = 1.0
    for i in range(n):
        p = sched.layer_pattern(i + 1, heads, groups, n)
        if p is not None:
            report = p.coverage(s)
            coverage = min(coverage, 1.0 - len(report.uncovered_blocks) / report.num_blocks)
    return density, coverage


def _records(run_dir: str) -> list:
    from .metrics import read_jsonl

    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        return read_jsonl(path)
    except (OSError, ValueError):
        return []


def throughput(train: list) -> tuple[Optional[float], Optional[float]]:
    """(tokens/s, model TFLOP/s per GPU) of the logged training windows after the first (the
    warm-up), weighted by their time: what the trainer's summary reports for a run without
    resumes. Each record covers the iterations since the previous one."""
    tokens = flops = seconds = 0.0
    for prev, r in zip(train, train[1:]):
        n = r["iteration"] - prev["iteration"]
        t = n * r.get("step_time_s", 0.0)
        tokens += r.get("tokens_per_s", 0.0) * t
        flops += r.get("tflops_per_gpu", 0.0) * t
        seconds += t
    if not seconds and train:  # one window only: it is all there is
        r = train[-1]
        return r.get("tokens_per_s"), r.get("tflops_per_gpu")
    if not seconds:
        return None, None
    return tokens / seconds, flops / seconds


def loss_at_tokens(curve: list, tokens: float) -> Optional[float]:
    """Training loss at ``tokens`` on the (tokens, loss) ``curve``, interpolated linearly between
    the logged records around it; None outside the curve."""
    if not curve or tokens < curve[0][0] or tokens > curve[-1][0]:
        return None
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= tokens <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    return curve[-1][1]


def _wall_time(run_dir: str) -> Optional[float]:
    path = os.path.join(run_dir, SESSIONS)
    try:
        with open(path) as f:
            sessions = [json.loads(ln) for ln in f if ln.strip()]
    except (OSError, ValueError):
        return None
    return sum(s["end"] - s["start"] for s in sessions) if sessions else None


def _last_exit(run_dir: str):
    try:
        with open(os.path.join(run_dir, SESSIONS)) as f:
            lines = [ln for ln in f if ln.strip()]
        return json.loads(lines[-1]).get("exit_code") if lines else None
    except (OSError, ValueError):
        return None


def curves(point: Point) -> tuple[list, list]:
    """(tokens, loss) of the training and of the validation records of a point's run."""
    recs = _records(point.run_dir)
    seq = point.config.model.seq_length if point.config else 1
    gbs = point.config.train.global_batch_size if point.config else 1

    def tokens(r):
        samples = r.get("consumed_samples")
        return (samples if samples is not None else r["iteration"] * gbs) * seq

    train = sorted((tokens(r), r["loss"]) for r in recs if r.get("kind") == "train")
    # Validation records carry no sample count: the iteration's.
    valid = sorted(
        (r["iteration"] * gbs * seq, r["loss"]) for r in recs if r.get("kind") == "valid"
    )
    return train, valid


def recorded_columns(study: Study) -> list:
    """The settings in every table row that no point varies (``RECORDED_KEYS`` less the axes)."""
    return [k for k in RECORDED_KEYS if k not in study.axes]


def _setting_value(cfg: RunConfig, key: str) -> Any:
    """The value of the dotted run-config ``key`` in ``cfg`` (e.g. ``model.seq_length``, or
    ``attention.dense_layers.pattern`` inside the ``attention`` mapping). AttributeError when
    ``cfg`` has no such key."""
    value: Any = cfg
    for part in key.split("."):
        if isinstance(value, dict):
            if part not in value:
                raise AttributeError(f"{key}: no {part!r} in the config")
            value = value[part]
        else:
            value = getattr(value, part)
    return value


def _axis_value(point: Point, key: str) -> str:
    """The table cell of axis ``key`` for ``point``: the point's own value, or where the point
    leaves the key alone (a grid over other axes beside explicit points) the value its config
    has, so that a column such as ``attention.dense_layers.pattern`` is never blank for a
    point that ran with a schedule; empty only when the config cannot say."""
    if key in point.values:
        return _dump(point.values[key])
    if point.config is None:
        return ""
    try:
        return _dump(_setting_value(point.config, key))
    except (AttributeError, StudyError, yaml.YAMLError):
        return ""


def collect(study: Study) -> list[dict]:
    """One row per point (see COLUMNS; the axes after ``status``), read from the runs'
    ``metrics.jsonl`` and sessions files and the points' configs."""
    rows = []
    finals = []
    for point in study.points:
        # The run folder relative to the table's own folder (runs/<point>): a committed table
        # stays true in any clone, where the machine's absolute path would not exist.
        run_dir = os.path.relpath(point.run_dir, study.output_dir)
        row: dict = {"point": point.name, "run_dir": run_dir, "error": point.error or ""}
        row["setting"] = point.setting or point.name
        row.update({k: _axis_value(point, k) for k in study.axes})
        for key in recorded_columns(study):
            if key not in study.axes:
                row[key] = _setting_value(point.config, key) if point.config else ""
        state = point_state(point)
        recs = _records(point.run_dir) if point.valid else []
        train = [r for r in recs if r.get("kind") == "train" and "loss" in r]
        valid = [r for r in recs if r.get("kind") == "valid" and "loss" in r]
        if state == "interrupted":
            code = _last_exit(point.run_dir)
            state = "failed" if code not in (None, 0) else "partial"
        elif state == "new":
            state = "not run"
        row["status"] = state
        if point.valid:
            row["attention_density"], row["union_coverage"] = attention_stats(point.config)
        if train:
            row["final_train_loss"] = train[-1]["loss"]
            row["final_train_iteration"] = train[-1]["iteration"]
            row["tokens_per_s"], row["tflops_per_gpu"] = throughput(train)
            mem = [(k, r[k]) for r in train for k in ("gpu_mem_gib", "cpu_rss_gib") if k in r]
            if mem:
                row["memory"] = {"gpu_mem_gib": "gpu peak", "cpu_rss_gib": CPU_MEMORY}[mem[-1][0]]
                row["peak_memory_gib"] = max(v for _, v in mem)
            tc, _ = curves(point)
            row["tokens"] = tc[-1][0]
            finals.append(tc[-1][0])
        if valid:
            row["final_valid_loss"] = valid[-1]["loss"]
            row["final_valid_iteration"] = valid[-1]["iteration"]
        row["wall_time_s"] = _wall_time(point.run_dir) if point.valid else None
        adopted = _adopted_record(point)
        if adopted:
            row["adopted_from"] = adopted.get("from", "")
        rows.append(row)
    equal = study.equal_tokens or (min(finals) if finals else None)
    for point, row in zip(study.points, rows):
        if equal is not None and "final_train_loss" in row:
            row["equal_tokens"] = equal
            row["loss_at_equal_tokens"] = loss_at_tokens(curves(point)[0], equal)
    return rows


def _fmt(value: Any, key: str) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, float):
        if key in ("tokens_per_s", "wall_time_s", "equal_tokens", "tokens"):
            return f"{value:,.0f}"
        if key in ("tflops_per_gpu", "peak_memory_gib", "attention_density", "union_coverage"):
            return f"{value:.3f}"
        return f"{value:.4f}"
    if isinstance(value, int) and key in ("tokens", "equal_tokens"):
        return f"{value:,}"
    return str(value)


def write_tables(study: Study, rows: list) -> tuple[str, str]:
    """``results.csv`` (every column, full precision) and ``results.md`` in the output dir."""
    os.makedirs(study.output_dir, exist_ok=True)
    columns = [
        *COLUMNS[:2],
        "setting",
        *study.axes,
        *recorded_columns(study),
        *COLUMNS[2:],
    ]
    adopted = [r for r in rows if r.get("adopted_from")]
    # A column only then: the tables of studies without adopted runs keep their columns.
    if adopted:
        columns.insert(columns.index("run_dir"), "adopted_from")
    csv_path = os.path.join(study.output_dir, "results.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for row in rows:
            w.writerow({c: "" if row.get(c) is None else row.get(c, "") for c in columns})
    equal = next((r["equal_tokens"] for r in rows if r.get("equal_tokens")), None)
    md_cols = [
        ("point", "point"),
        ("status", "status"),
        *((k, k) for k in study.axes),
        ("final_train_loss", "train loss"),
        ("final_valid_loss", "valid loss"),
        ("loss_at_equal_tokens", f"train loss @ {_fmt(equal, 'tokens')} tokens"),
        ("tokens_per_s", "tokens/s"),
        ("tflops_per_gpu", "model TFLOP/s/GPU"),
        ("peak_memory_gib", "peak mem GiB"),
        ("attention_density", "attn density"),
        ("union_coverage", "union coverage"),
        ("wall_time_s", "wall s"),
    ]
    lines = [
        f"# {study.name}",
        "",
        f"Base config `{study.base}`, {len(rows)} points; attention density "
        f"and coverage at each run's sequence length.",
        "",
        "| " + " | ".join(h for _, h in md_cols) + " |",
        "|" + "---|" * len(md_cols),
    ]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(k), k) for k, _ in md_cols) + " |")
    if adopted:
        lines += ["", "Adopted (trained by another study, copied here by `megatron-s2-sweep "
                  "adopt`: its speed and wall time are that run's):", ""]  # fmt: skip
        lines += [f"- `{r['point']}` from `{r['adopted_from']}`" for r in adopted]
    if trained_on_cpu(rows):
        lines += ["", CPU_NOTE]
    errors = [r for r in rows if r.get("error")]
    if errors:
        lines += ["", "Skipped (config errors):", ""]
        lines += [f"- `{r['point']}`: {r['error']}" for r in errors]
    md_path = os.path.join(study.output_dir, "results.md")
    with open(md_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return csv_path, md_path


def pareto_front(xy: list) -> list:
    """Indices of the (x, y) points no other point beats on both (lower is better), by x."""
    order = sorted(range(len(xy)), key=lambda i: (xy[i][0], xy[i][1]))
    front, best = [], math.inf
    for i in order:
        if xy[i][1] < best:
            front.append(i)
            best = xy[i][1]
    return front


def write_plots(study: Study, rows: list) -> tuple[Optional[str], Optional[str]]:
    """``pareto.png`` (final loss vs attention density, the front joined) and
    ``loss_curves.png`` (every point's loss against tokens); None where nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r.get("final_train_loss") is not None]
    use_valid = bool(done) and all(r.get("final_valid_loss") is not None for r in done)
    key = "final_valid_loss" if use_valid else "final_train_loss"
    pareto_path = curves_path = None
    if done:
        xy = [(r["attention_density"], r[key]) for r in done]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.scatter(*zip(*xy), zorder=3)
        for r, (x, y) in zip(done, xy):
            ax.annotate(r["point"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        front = pareto_front(xy)
        ax.plot(
            [xy[i][0] for i in front],
            [xy[i][1] for i in front],
            "r--o",
            mfc="none",
            ms=10,
            label="Pareto front",
        )
        ax.margins(x=0.2, y=0.1)
        ax.set_xlabel("attention density (attended / dense causal pairs)")
        ax.set_ylabel(("validation" if use_valid else "training") + " loss (final)")
        ax.set_title(f"{study.name}: loss vs attention density")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        pareto_path = os.path.join(study.output_dir, "pareto.png")
        fig.savefig(pareto_path, dpi=100)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(8, 5))
        names = {r["point"] for r in done}
        for point in study.points:
            if point.name not in names:
                continue
            train, valid = curves(point)
            (line,) = ax.plot(*zip(*train), label=point.name, lw=1)
            if valid:
                ax.plot(*zip(*valid), "o", color=line.get_color(), ms=4)
        ax.set_xlabel("tokens")
        ax.set_ylabel("loss (nats/token; dots: validation)")
        ax.set_title(f"{study.name}: loss curves")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        curves_path = os.path.join(study.output_dir, "loss_curves.png")
        fig.savefig(curves_path, dpi=100)
        plt.close(fig)
    return pareto_path, curves_path


def collect_and_write(study: Study) -> list:
    """Collect every point's results and write the tables and plots; with ``seeds`` also the
    per-setting summary (``summary.csv``, ``summary.md``, ``frontier.png``)."""
    rows = collect(study)
    csv_path, md_path = write_tables(study, rows)
    pareto, loss = write_plots(study, rows)
    _say(f"table {csv_path}, {md_path}")
    if pareto:
        _say(f"plots {pareto}, {loss}")
    if study.seeds is not None:
        from .seed_stats import write_summary

        written = write_summary(
            rows, study.output_dir, reference=study.reference, title=study.name, axes=study.axes
        )
        _say("seed summary " + ", ".join(written))
    return rows


# ---- command line ----------------------------------------------------------------------------
def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Ablation sweeps of megatron-s2-train runs (docs/sweeps.md).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run (or submit) the points that have not finished")
    collect_p = sub.add_parser("collect", help="write the table and plots only")
    list_p = sub.add_parser("list", help="the points, their state and config errors")
    adopt = sub.add_parser(
        "adopt",
        help="copy another study's finished runs that trained exactly what a point asks into "
        "the point's run folder (a reference arm shared by two studies trains once)",
    )
    for q in (run, collect_p, list_p, adopt):
        q.add_argument("study", help="study YAML")
        q.add_argument("--output-dir", default=None, help="default: the study's output_dir")
        q.add_argument(
            "--nproc-per-node",
            type=int,
            default=None,
            metavar="N",
            help="trainer processes a point, instead of the study's nproc_per_node (e.g. 1 for a "
            "two-process study on one GPU: the same global batch, micro-batches accumulated)",
        )
        q.add_argument(
            "overrides",
            nargs="*",
            metavar="key.sub=value",
            help="run config overrides for every point, after the study's overrides and before "
            "the point's values (give the same ones to every run/collect/list of a study)",
        )
    run.add_argument(
        "--slurm",
        action="store_true",
        help="submit one Slurm job array through launch/slurm.sbatch instead of running here",
    )
    run.add_argument(
        "--sbatch-args",
        default="",
        help='options for sbatch, one string (e.g. "--nodes=1 --gpus-per-node=8 --wait"; '
        "with --wait the table is written when the array has finished)",
    )
    run.add_argument(
        "--devices",
        default=None,
        metavar="IDS",
        help="GPU ids of this machine, e.g. 0,1,2,3: run as many points at once as there are "
        "groups of nproc_per_node ids, each on its own group (default: one after another)",
    )
    for q, verb in ((run, "run"), (list_p, "list")):
        q.add_argument(
            "--seeds",
            default=None,
            metavar="K,...",
            help=f"{verb} only the points of these seeds (of the study's seeds list)"
            + ("; the table and summary still cover every finished point" if q is run else ""),
        )
        q.add_argument(
            "--settings",
            default=None,
            metavar="NAME,...",
            help=f"{verb} only the points of these settings (point names without the seed; a "
            "grid point's own commas are fine: vert_stride=4,local_blocks=8,dense is two "
            "settings); with --seeds, the points that match both",
        )
    run.add_argument(
        "--after",
        default=None,
        metavar="CMD",
        help="a bash command run after each point whose training finished, in its slot (same "
        "CUDA_VISIBLE_DEVICES) before the slot's next point, and for finished points whose "
        "command has not succeeded yet; {run} and {point} become the run directory and point "
        "name, shell-quoted; output in <run dir>/after.log, outcome in <run dir>/after.json "
        "(a rerun skips what succeeded)",
    )
    run.add_argument("--sbatch-script", default=str(SBATCH), help=argparse.SUPPRESS)
    adopt.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="STUDY",
        help="the other study's YAML (its points resolved with the same overrides)",
    )
    adopt.add_argument(
        "--from-runs",
        default=None,
        metavar="DIR",
        help="where the other study's run folders are (default: its output_dir/runs), e.g. a "
        "committed copy",
    )
    adopt.add_argument("--dry-run", action="store_true", help="say what would be adopted")
    return p


def _chosen(study: Study, args: argparse.Namespace) -> Optional[Study]:
    """``study`` with only the points ``--seeds`` and ``--settings`` choose (all without
    them); None after printing the study error for a bad choice."""
    if not (args.seeds or args.settings):
        return study
    keep = {p.name for p in study.points}
    try:
        if args.seeds:
            try:
                seeds = [int(x) for x in args.seeds.split(",")]
            except ValueError:
                raise StudyError(
                    f"--seeds takes seeds separated by commas, e.g. 1,2; got {args.seeds!r}"
                ) from None
            keep &= {p.name for p in only_seeds(study, seeds)}
        if args.settings:
            keep &= {p.name for p in only_settings(study, split_settings(study, args.settings))}
    except StudyError as e:
        print(f"{PROG}: study error: {e}", file=sys.stderr, flush=True)
        return None
    return dataclasses.replace(study, points=[p for p in study.points if p.name in keep])


def main(argv: Optional[list] = None) -> int:
    """Console entry point; returns the exit code (130 after Ctrl-C)."""
    parser = build_arg_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may also follow the options (`run STUDY --devices 0,1 data.blend=...`, as the
    # study files' comments write them): argparse takes the positionals in one block.
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]
    try:
        return _main(args)
    except KeyboardInterrupt:
        # The running points' trainers got the Ctrl-C too and have saved and stopped by now
        # (_run_one waits for them); a rerun of the same command resumes them.
        print(
            f"\n{PROG}: interrupted; the running point(s) saved a checkpoint where they could; "
            f"run the same command again to resume",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_INTERRUPTED


def _main(args: argparse.Namespace) -> int:
    after = getattr(args, "after", None)  # run's option only
    if after is not None:
        try:
            if args.slurm:
                raise StudyError(
                    "--after runs its command here, after each point; with --slurm the points "
                    "train in array tasks elsewhere: run the command on each finished run once "
                    "the array has ended (e.g. with --sbatch-args --wait)"
                )
            check_after(after)
        except StudyError as e:
            print(f"{PROG}: study error: {e}", file=sys.stderr, flush=True)
            return EXIT_STUDY_ERROR
    try:
        study = load_study(
            args.study,
            args.output_dir,
            extra_overrides=args.overrides,
            nproc_per_node=args.nproc_per_node,
        )
    except StudyError as e:
        print(f"{PROG}: study error: {e}", file=sys.stderr, flush=True)
        return EXIT_STUDY_ERROR
    if args.command == "list":
        chosen = _chosen(study, args)
        if chosen is None:
            return EXIT_STUDY_ERROR
        for p in chosen.points:
            state = point_state(p)
            if state == "finished" and stale_settings(p):
                state = "stale"  # finished with other settings: `run` refuses it
            note = f"  ({p.error})" if p.error else ""
            adopted = _adopted_record(p)
            if adopted:
                note = f"  (adopted: {adopted.get('from')})"
            print(f"{p.index:3d}  {state:11s}  {p.name}{note}")
        return EXIT_OK
    if args.command == "adopt":
        try:
            source = load_study(args.source, extra_overrides=args.overrides)
        except StudyError as e:
            print(f"{PROG}: study error (--from): {e}", file=sys.stderr, flush=True)
            return EXIT_STUDY_ERROR
        return adopt_runs(study, source, args.from_runs, dry_run=args.dry_run)
    if args.command == "collect":
        collect_and_write(study)
        return EXIT_OK
    everything = study
    study = _chosen(study, args)
    if study is None:
        return EXIT_STUDY_ERROR
    if not any(p.valid for p in study.points):
        report_invalid(study)
        print(f"{PROG}: study error: no point has a valid config", file=sys.stderr, flush=True)
        return EXIT_STUDY_ERROR
    if refuse_stale(study):
        return EXIT_STUDY_ERROR
    if args.slurm and args.devices is not None:
        print(
            f"{PROG}: study error: --devices is for runs here; with --slurm the array "
            "tasks get their GPUs from Slurm",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_STUDY_ERROR
    if args.slurm:
        sbatch_args = shlex.split(args.sbatch_args)
        code = submit_slurm(study, sbatch_args, args.sbatch_script)
        if "--wait" in sbatch_args or "-W" in sbatch_args:
            collect_and_write(everything)
            if any(point_state(p) not in ("finished", "invalid") for p in study.points):
                code = EXIT_FAILED
        return code
    devices = args.devices.split(",") if args.devices is not None else None
    if devices is not None:
        try:
            device_groups(study, devices)
        except StudyError as e:
            print(f"{PROG}: study error: {e}", file=sys.stderr, flush=True)
            return EXIT_STUDY_ERROR
    code = run_local(study, devices, after)
    collect_and_write(everything)
    return code


if __name__ == "__main__":
    sys.exit(main())
