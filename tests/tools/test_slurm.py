"""The launchers, run for real.

``test_sbatch_demo_with_requeue`` starts a single-machine Slurm cluster (munged, slurmctld,
slurmd; tests/helpers/slurm_cluster.py), submits the CPU demo via ``launch/slurm.sbatch`` as one
node x 2 trainer processes, sends the time-limit warning signal mid-run, and checks that the
trainer checkpointed, the job was requeued under the same id, resumed from that checkpoint and
completed, with both ranks taking part. It needs root and apt-get (installs ``slurm-wlm`` and
``munge`` when missing) and skips otherwise.
"""

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Independent of the megatron-core version: CI runs this module in its first suite only.
pytestmark = pytest.mark.version_independent

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "launch" / "slurm.sbatch"
TORCHRUN = REPO / "launch" / "torchrun.sh"
CONFIG = REPO / "configs" / "demo.yaml"

from tests.helpers.slurm_cluster import (  # noqa: E402
    ClusterError,
    MiniSlurm,
    slurm_unavailable,
    user_shell_env,
)

ITERS = 16


def clean_env(base=None):
    """The environment a user's shell would have (``user_shell_env``): e.g. conftest turns on
    TRITON_INTERPRET for the kernel tests, which would make the trainer run the (very slow) Triton
    interpreter, and an in-process gloo world of an earlier test leaves MASTER_ADDR/MASTER_PORT."""
    return user_shell_env(base)


def demo_overrides(data_dir, iters=ITERS):
    """Small, fast settings that hold whatever the demo config's defaults become."""
    return [
        f"train.train_iters={iters}",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.eval_interval=0",
        "optimizer.lr_warmup_iters=1",
        "logging.log_interval=1",
        "logging.plot=false",
        "logging.progress_bar=false",
        "checkpoint.save_interval=0",
        f"data.demo_dir={data_dir}",
    ]


def rank_logs(run_dir, restart, rank, stream="stdout"):
    """torchrun's per-rank log of ``restart`` (see launch/slurm.sbatch), or None."""
    hits = sorted(
        Path(run_dir).glob(f"logs/restart{restart}/node0/*/attempt_0/{rank}/{stream}.log")
    )
    return hits[-1].read_text(errors="replace") if hits else None


# ---- fast checks (no cluster) -------------------------------------------------------------------
def test_launchers_reject_bad_usage(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run(["bash", str(SBATCH), str(CONFIG)], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "submit this script with sbatch" in r.stderr
    r = subprocess.run(
        ["bash", str(SBATCH), str(tmp_path / "none.yaml")],
        capture_output=True,
        text=True,
        env=dict(env, SLURM_JOB_ID="1"),
    )
    assert r.returncode == 2 and "config file" in r.stderr and "not found" in r.stderr
    r = subprocess.run(["bash", str(TORCHRUN)], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "usage" in r.stderr
    r = subprocess.run(
        ["bash", str(TORCHRUN), str(tmp_path / "none.yaml")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 2 and "not found" in r.stderr
    r = subprocess.run(
        ["bash", str(TORCHRUN), str(CONFIG)],
        capture_output=True,
        text=True,
        env=dict(env, NPROC_PER_NODE="two"),
    )
    assert r.returncode == 2 and "NPROC_PER_NODE" in r.stderr


def fake_allocation(tmp_path, job_id: int, nodes=("n0", "n1")) -> dict:
    """The environment of launch/slurm.sbatch's batch shell on the first of ``nodes`` without a
    cluster: stub ``scontrol`` (the node list) and ``srun`` (prints its command line and exits
    0, so no trainer starts) first on PATH."""
    bin_dir = tmp_path / "fake-slurm-bin"
    bin_dir.mkdir(exist_ok=True)
    stubs = {
        "scontrol": "#!/bin/sh\nprintf '%s\\n' " + " ".join(nodes) + "\n",
        "srun": '#!/bin/sh\necho "srun $*"\n',
    }
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = user_shell_env()
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        SLURM_JOB_ID=str(job_id),
        SLURM_JOB_NAME="fake",
        SLURM_JOB_NUM_NODES=str(len(nodes)),
        SLURM_JOB_NODELIST=",".join(nodes),
        SLURMD_NODENAME=nodes[0],
        NPROC_PER_NODE="1",
    )
    return env


def test_sbatch_rendezvous_address_and_port(tmp_path):
    """launch/slurm.sbatch's rendezvous: the first node by name on a free port derived from the
    job id; a busy port is skipped, a busy MASTER_PORT or a loopback MASTER_ADDR on several nodes
    (leftovers of a single-machine run that sbatch passes on) is refused before srun."""
    import random

    def run(env):
        return subprocess.run(
            ["bash", str(SBATCH), str(CONFIG)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )

    # A port of the script's range held by a listening socket, as a store of another job would.
    busy = socket.socket()
    for _ in range(50):
        job = random.randrange(1, 15000)
        try:
            busy.bind(("", 15000 + job))
            break
        except OSError:
            continue
    busy.listen()
    port = 15000 + job
    with busy:
        r = run(fake_allocation(tmp_path, job))
        out = r.stdout + r.stderr
        assert r.returncode == 0, out
        assert f"rendezvous port {port} is in use on n0: trying the next" in r.stderr, out
        chosen = int(re.search(r"2 node\(s\) x 1 process\(es\), rendezvous n0:(\d+)", out)[1])
        assert port < chosen < port + 100, out
        # srun gets the address and port as the arguments $3 and $4 of its command.
        assert f" n0 {chosen} s2-{job}-0 " in r.stdout, r.stdout

        # An explicit MASTER_PORT that is busy: refused, naming the variable and the node.
        r = run(dict(fake_allocation(tmp_path, job), MASTER_PORT=str(port)))
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"MASTER_PORT={port} is already in use on n0" in r.stderr, r.stderr
        assert "srun" not in r.stdout

    # Free again: an explicit MASTER_PORT as given (the job id's own port when free: the Slurm
    # tests check it on a real cluster).
    r = run(dict(fake_allocation(tmp_path, job), MASTER_PORT=str(port)))
    assert r.returncode == 0 and f"rendezvous n0:{port}," in r.stdout, r.stdout + r.stderr

    # A loopback MASTER_ADDR cannot serve two nodes (the failure of a leaked test environment).
    for addr in ("127.0.0.1", "localhost"):
        r = run(dict(fake_allocation(tmp_path, job), MASTER_ADDR=addr))
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"MASTER_ADDR={addr} is a loopback address" in r.stderr, r.stderr
        assert "first node, n0" in r.stderr and "srun" not in r.stdout
    # On one node it is the documented override where node names do not resolve.
    r = run(dict(fake_allocation(tmp_path, job, nodes=("n0",)), MASTER_ADDR="127.0.0.1"))
    assert r.returncode == 0 and "rendezvous 127.0.0.1:" in r.stdout, r.stdout + r.stderr
    # And MASTER_PORT must be a port.
    r = run(dict(fake_allocation(tmp_path, job), MASTER_PORT="70000"))
    assert r.returncode == 2 and "MASTER_PORT must be a TCP port" in r.stderr, r.stderr


def test_torchrun_launcher_passes_run_dir_to_the_check_and_the_trainer(tmp_path):
    """``RUN_DIR`` becomes ``logging.run_dir`` for the config check and for the trainer that
    launch/torchrun.sh starts. The launcher's real two-process run of the demo is the
    documented command's (launch/README.md, tests/tools/test_documented_commands.py); here
    ``PYTHON`` is a wrapper that logs each call's arguments, runs the check with the real
    interpreter and prints the torchrun command instead of starting it."""
    calls = tmp_path / "calls.log"
    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {calls}\n'
        'if [ "$1 $2" = "-m torch.distributed.run" ]; then echo "TORCHRUN $*"; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    run_dir = tmp_path / "run"
    env = dict(clean_env(), NPROC_PER_NODE="2", RUN_DIR=str(run_dir), PYTHON=str(wrapper))
    r = subprocess.run(
        ["bash", str(TORCHRUN), str(CONFIG), "train.train_iters=3"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("TORCHRUN ")]
    assert "--nproc-per-node=2" in line and "-m megatron_s2.training" in line
    override = f"logging.run_dir={run_dir} train.train_iters=3"
    assert line.endswith(f"--config {CONFIG} {override}"), line
    check, started = calls.read_text().splitlines()
    assert check == f"- {TORCHRUN} 2 {CONFIG} {override}", check  # the config check
    assert started == line.removeprefix("TORCHRUN ")
    assert not run_dir.exists()  # nothing trained


# ---- the real Slurm path ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)
    cluster = MiniSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except ClusterError:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()


@pytest.fixture
def slurm_jobs_cancelled(slurm):
    """The module's cluster; the jobs a test leaves pending or running are cancelled when it ends,
    passed or not, so that a failed or timed-out test's job does not hold the node for the next
    test (or the module's teardown)."""
    yield slurm
    slurm.cancel_all()


def _wait_for(cond, timeout, what, cluster, job):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(1)
    info = cluster.job_info(job)
    raise AssertionError(
        f"timed out waiting for {what}; job state {info.get('JobState')}\n{cluster.logs()}"
    )


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.usefixtures("slurm_jobs_cancelled")
def test_sbatch_demo_with_requeue(slurm, tmp_path, demo_dir):
    submit_dir = tmp_path / "submit"
    submit_dir.mkdir()
    env = dict(clean_env(slurm.env()), NPROC_PER_NODE="2", SHUTDOWN_TIMEOUT="120")
    try:
        socket.gethostbyname(slurm.host)
    except OSError:
        # The script's rendezvous host is the node name; where this container's own name does
        # not resolve, use the documented override.
        env["MASTER_ADDR"] = "127.0.0.1"
    r = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=1",
            f"--cpus-per-task={slurm.cpus}",
            "--job-name=s2ci",
            str(SBATCH),
            str(CONFIG),
            *demo_overrides(demo_dir),  # the session's corpus (the lock is test_data_prep's)
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=submit_dir,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    run_dir = submit_dir / "runs" / f"s2ci-{job}"
    out_file = submit_dir / f"slurm-s2ci-{job}.out"

    # Once the trainer is stepping, send what Slurm sends 120 s before the time limit.
    _wait_for(
        lambda: re.search(r"iter\s+2/", rank_logs(run_dir, 0, 0) or ""),
        180,
        "the first run to reach iteration 2",
        slurm,
        job,
    )
    sig = subprocess.run(
        ["scancel", "--signal=USR1", "--batch", job], env=env, capture_output=True, text=True
    )
    assert sig.returncode == 0, sig.stderr

    final = {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
    }

    def finished():
        info = slurm.job_info(job)
        return info if info.get("JobState") in final and info.get("Restarts") == "1" else None

    info = _wait_for(finished, 240, "the requeued job to finish", slurm, job)
    output = out_file.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (
        f"{info}\n{output[-4000:]}"
    )

    # First run: the trainer caught SIGTERM, checkpointed and stopped; the script requeued.
    first = rank_logs(run_dir, 0, 0)
    assert "SIGTERM: saving a checkpoint" in first, first[-3000:]
    assert "requeueing job" in output
    stopped_at = int(re.search(r"saving a checkpoint at iteration (\d+)", first).group(1))
    assert 2 <= stopped_at < ITERS
    # Second run (same job id, same run dir): resumed from that checkpoint and finished.
    second = rank_logs(run_dir, 1, 0)
    assert second is not None, output[-4000:]
    assert "resumed from" in second and re.search(rf"iter\s+{ITERS}/{ITERS}", second), second[
        -3000:
    ]
    assert not re.search(rf"iter\s+{stopped_at}/", second)  # no iteration was repeated
    # Both ranks ran in both attempts and wrote their shards of the final checkpoint.
    for restart in (0, 1):
        for rank in (0, 1):
            assert rank_logs(run_dir, restart, rank, "stderr") is not None, (restart, rank)
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    shards = [p.name for p in (ckpt / f"iter_{ITERS:07d}").glob("*.distcp")]
    assert any(s.startswith("__0_") for s in shards) and any(
        s.startswith("__1_") for s in shards
    ), shards


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.usefixtures("slurm_jobs_cancelled")
def test_sweep_as_job_array(slurm, tmp_path, demo_dir):
    """megatron-s2-sweep --slurm: a 2-point study (plus an invalid point, not submitted) as one
    job array through launch/slurm.sbatch, each task in its own run directory; the table is
    written from both runs, and a second submission submits nothing."""
    import csv

    import yaml

    study = tmp_path / "study.yaml"
    study.write_text(
        yaml.safe_dump(
            {
                "name": "s2array",
                "base": str(CONFIG),
                "overrides": [
                    *demo_overrides(demo_dir, iters=3),
                    "model.num_layers=2",
                    "model.hidden_size=64",
                    "model.seq_length=128",
                ],
                "points": [
                    {"attention.s2.vert_stride": 2, "attention.s2.local_blocks": 2},
                    {"attention.s2.vert_stride": 8},  # 4 heads leave stripe phases uncovered
                    {"attention.dense_layers.pattern": "D"},
                ],
                "output_dir": str(tmp_path / "out"),
                "nproc_per_node": 1,
            },
            sort_keys=False,
        )
    )
    env = clean_env(slurm.env())
    try:
        socket.gethostbyname(slurm.host)
    except OSError:
        env["MASTER_ADDR"] = "127.0.0.1"
    sweep = [sys.executable, "-m", "megatron_s2.training.sweep", "run", str(study), "--slurm"]
    r = subprocess.run(
        [*sweep, "--sbatch-args", "--nodes=1 --cpus-per-task=1 --wait"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=400,
    )
    out = r.stdout + r.stderr
    logs = "\n".join(
        p.read_text(errors="replace")[-2000:] for p in (tmp_path / "out" / "logs").glob("*")
    )
    assert r.returncode == 0, out[-3000:] + logs + slurm.logs()
    assert "--array=0,2" in out and "vert_stride=8: config error, skipped" in out
    with open(tmp_path / "out" / "results.csv") as f:
        rows = {row["point"]: row for row in csv.DictReader(f)}
    assert [rows[p]["status"] for p in rows] == ["finished", "invalid", "finished"], rows
    for name in ("vert_stride=2,local_blocks=2", "pattern=D"):
        run_dir = tmp_path / "out" / "runs" / name
        assert rank_logs(run_dir, 0, 0) is not None  # launched by slurm.sbatch into its run dir
        assert (
            run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
        ).read_text().strip() == "3"
        assert float(rows[name]["wall_time_s"]) > 0  # the task's session, written by the script
        assert "slurm" in (run_dir / "sweep_sessions.jsonl").read_text()
    assert not (tmp_path / "out" / "runs" / "vert_stride=8").exists()
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 0
    r = subprocess.run(sweep, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and "nothing to submit" in r.stdout, r.stdout + r.stderr
