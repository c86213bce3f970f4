"""The shell commands of README.md, docs/*.md and launch/README.md, run as written on the CPU.

Extracted:

* every command of a ```bash / ```sh / ```shell / ```console block (continuation lines joined,
  comments dropped);
* inline code spans in the prose that call the trainer or a launcher with arguments
  (``megatron-s2-train name=demo-dense ...``, ``NPROC_PER_NODE=2 launch/torchrun.sh ...``);
  synopses (with ``...``, ``<...>`` or ``[...]``) and bare program names are not commands.

Each command gets one of three plans:

* **run**: executed with bash in a scratch directory that looks like the checkout (``launch/``
  and ``configs/`` linked from the repo, the demo corpus pre-generated in ``data/demo``, and small
  stand-ins for the placeholder configs ``RUN.yaml`` and ``my_run.yaml``). A run longer than
  ``MAX_DOC_ITERS`` steps gets ``train.train_iters=2 optimizer.lr_warmup_iters=1`` appended;
  shorter documented runs run exactly as written. Slurm commands are submitted to the
  single-machine cluster of ``tests/tools/test_slurm.py``.
* **config-only**: GPU-scale runs. The run config with the command's overrides is loaded and
  checked for the command's world size.
* **skip**: needs downloads, GPUs, several nodes or another checkout.

Every trainer command that is not skipped is also config-checked as written (full length, its
world size), so the shortened run cannot hide a documented value that does not fit.

Marking. Before a block's opening fence: ``<!-- cpu-test: skip (reason) -->`` or
``<!-- cpu-test: config-only (reason) -->``. Single lines of a block, and inline commands, are
marked in ``LINE_MODES`` below. An unmarked command that this file cannot run (an unknown
program, more than ``MAX_PROCESSES`` processes, several nodes, a GPU-scale model) fails
``test_every_command_has_a_plan``.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest
import torch
import yaml

# The single-machine Slurm cluster of tests/tools/test_slurm.py (skips without root or Slurm).
from tests.helpers.slurm_cluster import user_shell_env
from tests.tools.test_slurm import slurm  # noqa: F401

# Independent of the megatron-core version: CI runs this module in its first suite only.
pytestmark = pytest.mark.version_independent

REPO = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(str(REPO / "docs/*.md")))]
DOCS.append("launch/README.md")

SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh"}
MARKER = re.compile(r"^<!--\s*cpu-test:\s*(skip|config-only)\s*\((.+)\)\s*-->\s*$")
MODES = ("skip", "config-only")

# Single lines of mixed blocks and inline commands: command text -> (mode, reason).
LINE_MODES = {
    "megatron-s2-train --config configs/gpt-125m-s2.yaml train.train_iters=100": (
        "config-only",
        "a 125M model on 16 x 8192 tokens a step: a GPU run",
    ),
    "torchrun --nproc-per-node 8 -m megatron_s2.training --config configs/gpt-1.3b-s2.yaml": (
        "config-only",
        "8 GPUs",
    ),
    "launch/torchrun.sh configs/gpt-125m-s2.yaml": (
        "config-only",
        "one process per GPU of a 125M model; the NPROC_PER_NODE=2 demo line runs this launcher",
    ),
}

# Limits of what runs here (2 CPU cores): processes per command, and the model's training
# FLOPs per step (the demo: ~2e10).
MAX_PROCESSES = 4
MAX_STEP_FLOPS = 1e12
# Documented runs up to this many steps run as written; longer ones are cut to SHORT_RUN.
MAX_DOC_ITERS = 20
SHORT_ITERS = 2
SHORT_RUN = [f"train.train_iters={SHORT_ITERS}", "optimizer.lr_warmup_iters=1"]
# Placeholder configs in the docs; the scratch directory has small demo-based stand-ins
# (micro-batch 1 so that they fit any data-parallel size up to MAX_PROCESSES).
PLACEHOLDERS = ("RUN.yaml", "my_run.yaml")

CUDA = torch.cuda.is_available()


# ---- extraction ---------------------------------------------------------------------------------
@dataclass
class Command:
    doc: str
    line: int
    text: str  # as written: continuations joined, trailing comment removed
    inline: bool = False
    mode: Optional[str] = None  # "skip" / "config-only" / None (run)
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def strip_comment(line: str) -> str:
    """``line`` without a trailing shell comment (a ``#`` starting a word, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
            elif ch == "\\" and quote == '"':
                continue
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def block_commands(lines: list[str]) -> list[tuple[int, str]]:
    """(offset of the first line, command) for each command of a shell block."""
    out, buf, start = [], [], None
    for i, raw in enumerate(lines):
        line = strip_comment(raw)
        if not buf and not line.strip():
            continue
        if start is None:
            start = i
        if line.endswith("\\"):
            buf.append(line[:-1].strip())
            continue
        buf.append(line.strip())
        joined = " ".join(buf)
        if joined.count("(") > joined.count(")"):  # an array assignment NAME=( ... ) goes on
            continue
        text = " ".join(x for x in buf if x)
        out.append((start, text))
        buf, start = [], None
    if buf:
        out.append((start, " ".join(buf)))
    return out


UNTAGGED = "(an untagged code block with shell commands: tag it ```bash)"
# The trainer or a launcher, with arguments (a bare program name in prose is a reference).
INLINE_COMMAND = re.compile(
    r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:"
    r"(?:megatron-s2-train|python3? -m megatron_s2\.training|launch/torchrun\.sh)\s+\S"
    r"|torchrun\s.*-m megatron_s2\.training|sbatch\s.*launch/slurm\.sbatch)"
)


def is_synopsis(text: str) -> bool:
    return "..." in text or "<" in text or " [" in text


def extract(doc: str) -> list[Command]:
    """The commands of one document."""
    lines = (REPO / doc).read_text().split("\n")
    cmds: list[Command] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not fence:
            for span in re.findall(r"`([^`\n]+)`", lines[i]):
                span = span.strip()
                if INLINE_COMMAND.match(span) and not is_synopsis(span):
                    cmds.append(Command(doc, i + 1, span, inline=True))
            i += 1
            continue
        lang, ticks = fence.group(3).lower(), fence.group(2)
        end = next(
            (j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(ticks)), len(lines)
        )
        body = lines[i + 1 : end]
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.match(lines[k].strip()) if k >= 0 else None
        if lang in SHELL_LANGS:
            for off, text in block_commands(body):
                cmd = Command(doc, i + 2 + off, text)
                if marker:
                    cmd.mode, cmd.reason = marker.group(1), marker.group(2)
                cmds.append(cmd)
        elif not lang and any(INLINE_COMMAND.match(x.strip()) for x in body):
            # An untagged block of commands would escape this test: it must be tagged.
            cmds.append(Command(doc, i + 1, UNTAGGED))
        i = end + 1
    for cmd in cmds:
        if cmd.mode is None and cmd.text in LINE_MODES:
            cmd.mode, cmd.reason = LINE_MODES[cmd.text]
    return cmds


def stray_markers() -> list[str]:
    """Markers that are not right before a shell block (they would mark nothing)."""
    out = []
    for doc in DOCS:
        lines = (REPO / doc).read_text().split("\n")
        for i, line in enumerate(lines):
            if "cpu-test" not in line:
                continue
            nxt = next((x.strip() for x in lines[i + 1 :] if x.strip()), "")
            lang = nxt.lstrip("`~").strip().lower()
            if (
                not MARKER.match(line.strip())
                or not nxt.startswith("```")
                or lang not in SHELL_LANGS
            ):
                out.append(f"{doc}:{i + 1}: {line.strip()}")
    return out


def all_commands() -> list[Command]:
    return [c for doc in DOCS for c in extract(doc)]


COMMANDS = all_commands()


# ---- what a command does ------------------------------------------------------------------------
@dataclass
class Plan:
    runner: str  # trainer | torchrun | torchrun.sh | sbatch
    env: dict
    config: Optional[str]  # None: the built-in demo
    overrides: list[str]
    world: int
    nodes: int = 1
    print_config: bool = False
    sbatch_opts: dict = field(default_factory=dict)


class NoPlan(ValueError):
    """This file does not know how to run the command."""


def default_nproc() -> int:
    """What the launchers start without NPROC_PER_NODE on this host."""
    devs = os.environ.get("CUDA_VISIBLE_DEVICES")
    if devs:
        return len(devs.split(","))
    return torch.cuda.device_count() or 1


def _trainer_args(args: list[str]) -> tuple[Optional[str], list[str], bool]:
    config, overrides, print_config = None, [], False
    it = iter(args)
    for a in it:
        if a in ("--config", "-c"):
            config = next(it, None)
            if config is None:
                raise NoPlan("--config without a file")
        elif a.startswith("--config="):
            config = a.split("=", 1)[1]
        elif a == "--print-config":
            print_config = True
        elif a.startswith("-") or "=" not in a:
            raise NoPlan(f"unknown trainer argument {a!r}")
        else:
            overrides.append(a)
    return config, overrides, print_config


def _int(value: str, what: str) -> int:
    if not re.fullmatch(r"[1-9][0-9]*", value or ""):
        raise NoPlan(f"{what} must be a positive integer here, got {value!r}")
    return int(value)


def plan_for(cmd: Command) -> Plan:
    """How to run ``cmd``; raises NoPlan for commands this file cannot run."""
    try:
        tokens = shlex.split(cmd.text)
    except ValueError as e:
        raise NoPlan(f"cannot parse: {e}") from None
    if not tokens or any(t in ("&&", "||", "|", ";", "&") for t in tokens):
        raise NoPlan("not a single command")
    env = {}
    while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):
        k, v = tokens.pop(0).split("=", 1)
        env[k] = v
    if not tokens:
        raise NoPlan("only variable assignments")
    prog, args = tokens[0], tokens[1:]
    if prog in ("python", "python3") and args[:2] == ["-m", "megatron_s2.training"]:
        prog, args = "megatron-s2-train", args[2:]
    if prog in ("python", "python3") and args[:2] == ["-m", "torch.distributed.run"]:
        prog, args = "torchrun", args[2:]
    if prog == "megatron-s2-train":
        config, overrides, pc = _trainer_args(args)
        return Plan("trainer", env, config, overrides, 1, print_config=pc)
    if prog == "torchrun":
        nproc, nnodes, rest = 1, 1, list(args)
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            opt = rest.pop(0)
            name, _, value = opt.partition("=")
            if name in ("--nproc-per-node", "--nproc_per_node", "--nnodes"):
                value = value or (rest.pop(0) if rest else "")
                n = _int(value, name)
                nproc, nnodes = (n, nnodes) if name != "--nnodes" else (nproc, n)
            elif name != "--standalone":
                raise NoPlan(f"unknown torchrun option {opt!r}")
        if rest[:2] != ["-m", "megatron_s2.training"]:
            raise NoPlan("torchrun of something other than megatron_s2.training")
        config, overrides, pc = _trainer_args(rest[2:])
        return Plan("torchrun", env, config, overrides, nproc * nnodes, nnodes, pc)
    if prog == "bash" and args and args[0].startswith("launch/"):
        prog, args = args[0], args[1:]
    if prog == "launch/torchrun.sh":
        if not args:
            raise NoPlan("launch/torchrun.sh without a config")
        nproc = _int(env["NPROC_PER_NODE"], "NPROC_PER_NODE") if "NPROC_PER_NODE" in env else None
        return Plan("torchrun.sh", env, args[0], args[1:], nproc or default_nproc())
    if prog == "sbatch":
        opts, rest = {}, list(args)
        while rest and rest[0].startswith("-"):
            opt = rest.pop(0)
            name, eq, value = opt.partition("=")
            if not eq and name in ("-N", "-p", "-t", "-c", "-n"):
                value = rest.pop(0) if rest else ""
            opts[name] = value
        if not rest or rest[0] != "launch/slurm.sbatch":
            raise NoPlan("sbatch of something other than launch/slurm.sbatch")
        nodes = _int(opts.get("--nodes", opts.get("-N", "1")), "--nodes")
        if "NPROC_PER_NODE" not in env:
            raise NoPlan("sbatch without NPROC_PER_NODE: one process per allocated GPU")
        nproc = _int(env["NPROC_PER_NODE"], "NPROC_PER_NODE")
        if len(rest) < 2:
            raise NoPlan("launch/slurm.sbatch without a config")
        return Plan("sbatch", env, rest[1], rest[2:], nodes * nproc, nodes, sbatch_opts=opts)
    raise NoPlan(f"no way to run {prog!r} here")


def _override(overrides: list[str], key: str) -> Optional[str]:
    value = None
    for o in overrides:
        k, _, v = o.partition("=")
        if k.strip() == key:
            value = v
    return value


def load_checked(plan: Plan, overrides: list[str], where: Path):
    """The run config of ``plan`` with ``overrides``, checked as the trainer checks it."""
    from megatron_s2.training.run_config import load_config

    path = None if plan.config is None else where / plan.config
    cfg = load_config(path, overrides)
    cfg.schedule()
    cfg.validate(world_size=plan.world)
    return cfg


def step_flops(cfg) -> float:
    """Rough training FLOPs of one step: 6 x parameters x tokens + attention scores."""
    m = cfg.model
    h, layers = m.hidden_size, m.num_layers
    params = layers * (4 * h * h + (3 if m.swiglu else 2) * h * m.ffn_size)
    tokens = cfg.train.global_batch_size * m.seq_length
    return 6.0 * params * tokens + 6.0 * layers * tokens * m.seq_length * h


def run_overrides(plan: Plan) -> list[str]:
    """What the test appends to a command it runs."""
    if plan.print_config:
        return []
    iters = _override(plan.overrides, "train.train_iters")
    if iters is not None and iters.isdigit() and int(iters) <= MAX_DOC_ITERS:
        return []
    return list(SHORT_RUN)


def problems_of(cmd: Command, where: Path) -> Optional[str]:
    """Why ``cmd`` cannot be handled as marked (None: fine)."""
    if cmd.mode == "skip":
        return None
    if cmd.text == UNTAGGED:
        return "tag the block"
    try:
        plan = plan_for(cmd)
    except NoPlan as e:
        return f"{e}"
    if cmd.mode == "config-only":
        return None
    if plan.world > MAX_PROCESSES:
        return f"{plan.world} processes (this test runs up to {MAX_PROCESSES})"
    if plan.nodes > 1:
        return f"{plan.nodes} nodes"
    if plan.runner == "sbatch" and "--gpus-per-node" in plan.sbatch_opts:
        return "asks for GPUs"
    try:
        cfg = load_checked(plan, plan.overrides + run_overrides(plan), where)
    except Exception as e:  # reported by test_config_as_written too
        return f"config does not load: {e}"
    if step_flops(cfg) > MAX_STEP_FLOPS:
        return f"GPU-scale model ({step_flops(cfg):.1e} FLOPs a step)"
    return None


# ---- the scratch checkout -----------------------------------------------------------------------
def write_placeholders(where: Path) -> None:
    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    demo["train"]["micro_batch_size"] = 1
    for name in PLACEHOLDERS:
        (where / name).write_text(yaml.safe_dump(demo, sort_keys=False))


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Placeholder configs and the demo corpus, made once."""
    from megatron_s2.training.demo_corpus import ensure_demo_data

    root = tmp_path_factory.mktemp("doc_commands")
    write_placeholders(root)
    ensure_demo_data(str(root / "data" / "demo"))
    return root


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    """Where the config check resolves relative config paths: configs/ and the placeholders."""
    root = tmp_path_factory.mktemp("doc_configs")
    write_placeholders(root)
    (root / "configs").symlink_to(REPO / "configs")
    return root


def scratch(shared: Path, cmd: Command) -> Path:
    d = shared / re.sub(r"[^\w.-]+", "_", cmd.id)
    d.mkdir()
    for name in ("launch", "configs"):
        (d / name).symlink_to(REPO / name)
    (d / "data").symlink_to(shared / "data")
    for name in PLACEHOLDERS:
        (d / name).write_text((shared / name).read_text())
    return d


def shell_env(base: Optional[dict] = None) -> dict:
    """A user's shell: the test's interpreter first on PATH, no test or launcher leftovers."""
    return user_shell_env(base)


def run_bash(line: str, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``bash -c line`` in its own process group, killed as a whole on timeout."""
    p = subprocess.Popen(
        ["bash", "-c", line],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(
            f"timed out after {timeout:.0f}s: {line}\n{out[-3000:]}\n{err[-3000:]}"
        ) from None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def check_run_dir(run_dir: Path, iters: int, world: int, overrides: list[str], log: str) -> None:
    summary = run_dir / "summary.json"
    assert summary.is_file(), f"no {summary}\n{log}"
    s = json.loads(summary.read_text())
    assert s["iteration"] == iters and s["stopped_by"] == "done", (s, log)
    if _override(overrides, "checkpoint.save_at_end") in ("false", "False"):
        return
    ckpt = run_dir / "checkpoints" / f"iter_{iters:07d}"
    ranks = {p.name.split("_")[2] for p in ckpt.glob("__*_*.distcp")}
    assert ranks == {str(r) for r in range(world)}, (sorted(ranks), world, log)


# ---- tests --------------------------------------------------------------------------------------
def test_every_command_has_a_plan(config_dir):
    """Each documented command is marked or runnable here; LINE_MODES has no stale entries."""
    assert len(COMMANDS) >= 10, [c.id for c in COMMANDS]
    problems = [
        f"{c.id}: {c.text}\n    -> {p}" for c in COMMANDS if (p := problems_of(c, config_dir))
    ]
    assert not problems, (
        "documented commands this test cannot run; make them runnable on a CPU or mark them "
        "(<!-- cpu-test: skip (reason) --> or <!-- cpu-test: config-only (reason) --> before "
        "the block, or LINE_MODES in this file):\n" + "\n".join(problems)
    )
    stray = stray_markers()
    assert not stray, f"cpu-test markers that are malformed or not before a shell block: {stray}"
    texts = {c.text for c in COMMANDS}
    stale = sorted(t for t in LINE_MODES if t not in texts)
    assert not stale, f"LINE_MODES entries that no document has any more: {stale}"
    runners = {plan_for(c).runner for c in COMMANDS if c.mode is None}
    assert {"trainer", "torchrun.sh", "sbatch"} <= runners, runners


def _config_commands():
    return [c for c in COMMANDS if c.mode != "skip" and c.text != UNTAGGED]


@pytest.mark.parametrize("cmd", _config_commands(), ids=lambda c: c.id)
def test_config_as_written(cmd, config_dir):
    """The command's run config with its own overrides fits its world size, at full length."""
    try:
        plan = plan_for(cmd)
    except NoPlan as e:
        pytest.skip(f"no plan ({e}): test_every_command_has_a_plan reports it")
    load_checked(plan, plan.overrides, config_dir)


def test_runs_other_than_the_demo_do_not_resume_it(config_dir):
    """A documented trainer command that changes the demo's settings has a run directory of its
    own. The docs' first command is the demo; a later command that left out ``name=`` would
    resume the finished demo in ``runs/demo`` and answer "nothing to do" (issue 53, item 8:
    the packing override). Continuing the demo to more steps is a resume, and allowed."""
    from megatron_s2.training.run_config import load_config

    demo = load_config(None, [])
    same_place = []
    for cmd in _config_commands():
        try:
            plan = plan_for(cmd)
        except NoPlan:
            continue  # test_every_command_has_a_plan reports it
        # The Slurm script names each job's run directory, --print-config trains nothing, and
        # the placeholders stand for the reader's own config (their stand-ins are demo-based).
        if plan.runner == "sbatch" or plan.print_config or plan.config in PLACEHOLDERS:
            continue
        cfg = load_checked(plan, plan.overrides, config_dir)
        if cfg.to_dict() == demo.to_dict() or cfg.train.train_iters > demo.train.train_iters:
            continue
        if demo.run_dir in (cfg.run_dir, os.path.dirname(cfg.checkpoint_dir)):
            same_place.append(f"{cmd.id}: {cmd.text}")
    assert not same_place, (
        f"commands that change the demo's settings but train in its run directory "
        f"({demo.run_dir}); after the demo they do nothing: give them a name=\n"
        + "\n".join(same_place)
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c.id)
def test_documented_command_runs(cmd, shared, request):
    if cmd.mode == "skip":
        pytest.skip(cmd.reason)
    if cmd.mode == "config-only":
        pytest.skip(f"config-only: {cmd.reason} (test_config_as_written checks it)")
    if CUDA:
        pytest.skip("the CPU versions of the commands: this host has CUDA")
    try:
        plan = plan_for(cmd)
    except NoPlan as e:
        pytest.skip(f"no plan ({e}): test_every_command_has_a_plan reports it")
    extra = run_overrides(plan)
    line = cmd.text + ("" if not extra else " " + shlex.join(extra))
    cwd = scratch(shared, cmd)
    iters = int(_override(plan.overrides + extra, "train.train_iters") or 0)
    if plan.runner == "sbatch":
        run_sbatch(request.getfixturevalue("slurm"), line, plan, cwd, iters, extra)
        return
    r = run_bash(line, cwd, shell_env(), timeout=420)
    log = f"$ {line}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert r.returncode == 0, log
    assert "Traceback" not in r.stdout + r.stderr, log
    if plan.print_config:
        printed = yaml.safe_load(r.stdout)
        assert isinstance(printed, dict) and "train" in printed, log
        return
    if not iters:
        from megatron_s2.training.run_config import load_config

        path = None if plan.config is None else cwd / plan.config
        iters = load_config(path, plan.overrides + extra).train.train_iters
    summaries = list(cwd.glob("runs/*/summary.json"))
    assert len(summaries) == 1, (summaries, log)
    check_run_dir(summaries[0].parent, iters, plan.world, plan.overrides + extra, log)


def run_sbatch(cluster, line: str, plan: Plan, cwd: Path, iters: int, extra: list[str]) -> None:
    cpus = plan.sbatch_opts.get("--cpus-per-task") or plan.sbatch_opts.get("-c")
    if cpus and int(cpus) > cluster.cpus:
        pytest.skip(f"needs {cpus} CPUs per task, the test cluster has {cluster.cpus}")
    env = shell_env(cluster.env())
    try:
        socket.gethostbyname(cluster.host)
    except OSError:
        env["MASTER_ADDR"] = "127.0.0.1"  # the documented override, as test_slurm.py does
    r = run_bash(line, cwd, env, timeout=60)
    assert r.returncode == 0, f"$ {line}\n{r.stdout}\n{r.stderr}"
    m = re.search(r"Submitted batch job (\d+)", r.stdout)
    assert m, r.stdout
    job = m.group(1)
    final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
    deadline = time.time() + 400
    info = {}
    try:
        while time.time() < deadline:
            info = cluster.job_info(job)
            if info.get("JobState") in final:
                break
            time.sleep(1)
    finally:
        # A job still running after the wait (or a Ctrl-C) would hold the node for the next one.
        cluster.cancel_all()
    name = info.get("JobName", "s2-pretrain")
    out = cwd / f"slurm-{name}-{job}.out"
    log = f"$ {line}\n{info}\n" + (out.read_text(errors="replace")[-6000:] if out.exists() else "")
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", (
        log + "\n" + cluster.logs()
    )
    check_run_dir(cwd / "runs" / f"{name}-{job}", iters, plan.world, plan.overrides + extra, log)


def test_launchers_refuse_a_config_that_does_not_fit_the_world_size(tmp_path):
    """A config that cannot run at the launcher's world size is one config error (exit 2), checked
    before torchrun or srun start: no per-rank errors, no torchrun traceback."""
    env = shell_env()
    demo = REPO / "configs" / "demo.yaml"
    for cmd, extra_env in (
        ([str(REPO / "launch" / "torchrun.sh"), str(demo)], {"NPROC_PER_NODE": "3"}),
        (
            ["bash", str(REPO / "launch" / "slurm.sbatch"), str(demo)],
            {"NPROC_PER_NODE": "3", "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "t"},
        ),
    ):
        r = subprocess.run(
            cmd, cwd=tmp_path, env=dict(env, **extra_env), capture_output=True, text=True
        )
        out = r.stdout + r.stderr
        assert r.returncode == 2, out
        assert (
            "megatron-s2-train: config error: train.global_batch_size (4) must be divisible by "
            "train.micro_batch_size x data-parallel size (2 x 3)" in r.stderr
        ), out
        assert "no trainer started" in r.stderr, out
        assert "Traceback" not in out and "ChildFailedError" not in out, out
        assert out.count("config error") == 1, out
    assert not (tmp_path / "runs").exists()  # the Slurm script stopped before making its run dir
    # The warm-up check, as a too-short Slurm run with an explicit warm-up would hit it (the
    # demo's own warm-up is a fraction of the run: train.train_iters=20 alone is fine):
    short = ["train.train_iters=20", "optimizer.lr_warmup_iters=20"]
    r = subprocess.run(
        ["bash", str(REPO / "launch" / "slurm.sbatch"), str(demo), *short],
        cwd=tmp_path,
        env=dict(env, NPROC_PER_NODE="2", SLURM_JOB_ID="8", SLURM_JOB_NAME="t"),
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "optimizer.lr_warmup_iters (20) must be smaller" in r.stderr
