"""A real two-node Slurm job on this machine, through ``launch/slurm.sbatch``.

The cluster (tests/helpers/slurm_cluster.py, ``TwoNodeSlurm``) has two nodes, ``s2n0`` and
``s2n1``, each slurmd in a network namespace of its own with its own address: the two trainer
processes of a job share the file system but meet only over the network, through the rendezvous
on the first node, as on two machines. The job is the tiny demo on 2 nodes x 1 gloo process (CPU
mode), and the reference is the same run as 2 processes on one node (``launch/torchrun.sh``).

* ``test_two_node_job_matches_one_node``: the job completes; each node's torchrun has the node
  rank of its Slurm node id and the rank-0 output comes from the first node; both ranks wrote
  their checkpoint shards; the losses equal the one-node run's.
* ``test_node_failure_ends_the_job_and_resume_continues``: mid-run, after a checkpoint, every
  trainer process of the second node is killed (the node's trainer dies, slurmd lives on). The
  job must end within a bounded time as FAILED, with srun naming the node and the script saying
  how to continue; ``RUN_DIR=... sbatch`` again resumes from the last checkpoint and finishes
  with the one-node run's losses.

Needs root, Slurm (apt-get installs ``slurm-wlm`` and ``munge`` when missing) and network
namespaces (``ip netns``: CAP_NET_ADMIN and CAP_SYS_ADMIN); skips otherwise. All traffic stays on
the veth pair between the two namespaces (and loopback). 1 to 2.5 minutes on 2 cores (four
trainer starts: the one-node reference, the two-node job, the failed job and its resume).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.slurm_cluster import TwoNodeSlurm, slurm_unavailable
from tests.tools.test_slurm import clean_env

# Independent of the megatron-core version (a launcher test): CI's first suite only.
pytestmark = [pytest.mark.version_independent, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "launch" / "slurm.sbatch"
TORCHRUN = REPO / "launch" / "torchrun.sh"
CONFIG = REPO / "configs" / "demo.yaml"

# Long enough that the failure test finds the run between its first checkpoint and its end.
ITERS = 24
SAVE_EVERY = 4
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


def overrides(data_dir: Path, cache_dir: Path) -> list[str]:
    """A tiny S2 hybrid (seconds per run on 2 cores); 4 sequences per step as micro-batches of 2,
    so 2 data-parallel ranks see the same global batches wherever they run."""
    return [
        "model.num_layers=2",
        "model.hidden_size=64",
        "model.num_attention_heads=4",
        "model.seq_length=128",
        "attention.s2.local_blocks=2",
        "attention.s2.vert_stride=2",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        f"train.train_iters={ITERS}",
        "train.eval_interval=0",
        "optimizer.lr_warmup_iters=2",
        "logging.log_interval=1",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        f"checkpoint.save_interval={SAVE_EVERY}",
        f"data.demo_dir={data_dir}",
        f"data.cache_dir={cache_dir}",
    ]


def losses(run_dir: Path) -> dict[int, float]:
    """Train loss by iteration from the run's metrics.jsonl."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return {r["iteration"]: r["loss"] for r in recs if r["kind"] == "train"}


def node_log(run_dir: Path, job: str, node: int, stream="stdout") -> str | None:
    """torchrun's log of local rank 0 on ``node`` in job ``job`` (launch/slurm.sbatch's layout:
    the rendezvous id is s2-<job id>-<restart count>), or None."""
    hits = list(run_dir.glob(f"logs/restart0/node{node}/s2-{job}-0_*/attempt_0/0/{stream}.log"))
    return hits[0].read_text(errors="replace") if hits else None


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = slurm_unavailable() or TwoNodeSlurm.unavailable()
    if reason:
        pytest.skip(reason)
    c = TwoNodeSlurm(tmp_path_factory.mktemp("slurm2")).start()  # stops itself if start fails
    yield c
    c.stop()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The demo corpus and Megatron's index cache, shared by all runs of this module."""
    from megatron_s2.training.demo_corpus import ensure_demo_data

    root = tmp_path_factory.mktemp("mn_data")
    ensure_demo_data(str(root / "demo"))
    return overrides(root / "demo", root / "cache")


@pytest.fixture(scope="module")
def one_node(tmp_path_factory, data):
    """The reference: the same run as 2 gloo processes on one node (launch/torchrun.sh)."""
    cwd = tmp_path_factory.mktemp("one_node")
    run_dir = cwd / "run"
    env = dict(clean_env(), NPROC_PER_NODE="2", RUN_DIR=str(run_dir), OMP_NUM_THREADS="1")
    r = subprocess.run(
        ["bash", str(TORCHRUN), str(CONFIG), *data],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ref = losses(run_dir)
    assert sorted(ref) == list(range(1, ITERS + 1))
    return ref


@pytest.fixture(autouse=True)
def cancel_jobs_after(cluster):
    """Whatever a test leaves pending or running is cancelled when it ends, passed or not: a job
    still running after a failure or a timeout would hold both nodes and the next test's job
    would wait behind it (PENDING, Resources)."""
    yield
    cluster.cancel_all()


def submit(
    cluster: TwoNodeSlurm, cwd: Path, data: list[str], run_dir: str | None = None, **env_vars
) -> str:
    """sbatch the tiny run as 2 nodes x 1 process from a user's environment (``clean_env``: no
    leftovers of this test process) plus ``env_vars``; the job id."""
    env = dict(clean_env(cluster.env()), NPROC_PER_NODE="1", OMP_NUM_THREADS="1", **env_vars)
    if run_dir:
        env["RUN_DIR"] = run_dir
    cmd = ["sbatch", "--parsable", "--nodes=2", "--cpus-per-task=1", "--job-name=s2two"]
    r = subprocess.run(
        cluster.client([*cmd, str(SBATCH), str(CONFIG), *data]),
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip().split(";")[0]


def wait_until(cond, timeout: float, what: str, cluster: TwoNodeSlurm, job: str, out: Path):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.5)
    text = out.read_text(errors="replace")[-4000:] if out.exists() else "(no job output)"
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {what}; job {cluster.job_info(job)}\n"
        f"{text}\n{cluster.logs()}"
    )


def finished(cluster: TwoNodeSlurm, job: str):
    """The job's final scontrol record, or None while it is pending or running."""
    info = cluster.job_info(job)
    return info if info.get("JobState") in FINAL else None


def trainer_pids(cluster: TwoNodeSlurm, node: int) -> dict[int, dict]:
    """The job processes on ``node`` (torchrun and its trainer workers): pid -> environment."""
    found = {}
    for pid in cluster.node_pids(node):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # exited meanwhile
            continue
        if b"torch.distributed.run" in cmd or b"megatron_s2.training" in cmd:
            found[pid] = dict(e.decode(errors="replace").split("=", 1) for e in env if b"=" in e)
    return found


# ---- tests --------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_loopback_rendezvous_is_refused(cluster, data, tmp_path):
    """A MASTER_ADDR of 127.0.0.1 in the submitting environment (here as a test process that ran
    a gloo world leaves it) would make each node look for the store on itself until the
    rendezvous timeout: the job ends at once with the script's error instead, before any
    trainer starts."""
    job = submit(cluster, tmp_path, data, MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    out = tmp_path / f"slurm-s2two-{job}.out"
    info = wait_until(lambda: finished(cluster, job), 120, "the job to end", cluster, job, out)
    output = out.read_text(errors="replace")
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", f"{info}\n{output}"
    assert "MASTER_ADDR=127.0.0.1 is a loopback address, which the other 1 node(s)" in output
    assert "first node, s2n0" in output and "node 0 of 2" not in output, output
    assert not (tmp_path / "runs" / f"s2two-{job}" / "logs").exists()


@pytest.mark.timeout(600)
def test_two_node_job_matches_one_node(cluster, data, one_node, tmp_path):
    job = submit(cluster, tmp_path, data)
    run_dir = tmp_path / "runs" / f"s2two-{job}"
    out = tmp_path / f"slurm-s2two-{job}.out"
    info = wait_until(lambda: finished(cluster, job), 300, "the job to end", cluster, job, out)
    output = out.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (
        f"{info}\n{output[-5000:]}\n{cluster.logs()}"
    )
    assert info["NodeList"] == "s2n[0-1]" and info["NumNodes"] == "2", info

    # Rendezvous on the first node of the allocation, by name (resolved on each node).
    port = 15000 + int(job) % 15000
    assert f"2 node(s) x 1 process(es), rendezvous s2n0:{port}" in output, output[:2000]
    # Node rank = Slurm node id, each node one process, global rank = node rank here.
    assert "node 0 of 2 (s2n0): node rank 0, global ranks 0-0" in output, output[:2000]
    assert "node 1 of 2 (s2n1): node rank 1, global ranks 1-1" in output, output[:2000]
    # Rank 0 (the one that prints) ran on the first node; the second node's process ran too.
    first = node_log(run_dir, job, 0)
    assert "world 2 (TP 1, PP 1, CP 1, DP 2)" in first, first[-3000:]
    assert re.search(rf"iter\s+{ITERS}/{ITERS}", first), first[-3000:]
    assert node_log(run_dir, job, 1, stream="stderr") is not None
    assert not re.search(r"iter\s+\d+/", node_log(run_dir, job, 1)), "rank 1 printed as rank 0"
    # Both ranks wrote their shards of the final checkpoint.
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    shards = {p.name.split("_")[2] for p in (ckpt / f"iter_{ITERS:07d}").glob("__*_*.distcp")}
    assert shards == {"0", "1"}, shards

    # Data parallelism over two nodes is the same computation as over two local processes.
    two = losses(run_dir)
    assert sorted(two) == sorted(one_node)
    for it, loss in one_node.items():
        assert two[it] == pytest.approx(loss, abs=1e-5), (it, two[it], loss)


@pytest.mark.timeout(600)
def test_node_failure_ends_the_job_and_resume_continues(cluster, data, one_node, tmp_path):
    job = submit(cluster, tmp_path, data)
    run_dir = tmp_path / "runs" / f"s2two-{job}"
    out = tmp_path / f"slurm-s2two-{job}.out"
    last = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"

    # Both nodes' trainers started (the first minute is start-up: imports, model, data).
    def both_started():
        if finished(cluster, job):
            return None
        procs = [trainer_pids(cluster, node) for node in (0, 1)]
        workers = [[p for p, e in found.items() if "LOCAL_RANK" in e] for found in procs]
        return procs if all(len(w) == 1 for w in workers) else None

    procs = wait_until(both_started, 240, "both trainers to start", cluster, job, out)
    # Each node's processes carry the node rank of their Slurm node id.
    for node, found in enumerate(procs):
        workers = [e for e in found.values() if "LOCAL_RANK" in e]
        assert [(w["GROUP_RANK"], w["RANK"], w["WORLD_SIZE"]) for w in workers] == [
            (str(node), str(node), "2")
        ], workers
        assert all(w["MASTER_ADDR"] == "s2n0" for w in workers), workers

    # The tiny run takes a few seconds once it steps, too fast to catch between its first
    # checkpoint and its end by polling. So the second node's worker runs in short slices
    # (SIGSTOP/SIGCONT; the first node's rank then waits at its next collective) until the first
    # checkpoint is written, and is still stopped, a few iterations later at most, when it dies.
    worker1 = next(p for p, e in procs[1].items() if "LOCAL_RANK" in e)
    deadline = time.time() + 240
    try:
        while not last.exists():
            assert time.time() < deadline and not finished(cluster, job), (
                f"no checkpoint: {cluster.job_info(job)}\n{out.read_text(errors='replace')[-3000:]}"
            )
            os.kill(worker1, signal.SIGCONT)
            time.sleep(0.25)
            os.kill(worker1, signal.SIGSTOP)
            time.sleep(0.05)
        # The second node's trainer dies (torchrun and its worker at once, as in a crash).
        for pid in procs[1]:
            os.kill(pid, signal.SIGKILL)
    except BaseException:
        os.kill(worker1, signal.SIGCONT)  # leave nothing frozen for the cluster's teardown
        raise
    killed_at = time.time()
    info = wait_until(
        lambda: finished(cluster, job), 120, "the failed job to end", cluster, job, out
    )
    took = time.time() - killed_at
    output = out.read_text(errors="replace")
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", f"{info}\n{output[-4000:]}"
    # Bounded: srun stops the surviving node (--kill-on-bad-exit), no waiting for a timeout.
    assert took < 90, f"the job took {took:.0f}s to end after the node failed"
    assert re.search(r"srun: error: s2n1: task 1: Killed", output), output[-4000:]
    stopped = int(last.read_text())
    assert SAVE_EVERY <= stopped < ITERS, stopped
    assert "[slurm.sbatch] error: the job failed" in output, output[-4000:]
    hint = f"RUN_DIR={run_dir} sbatch"
    assert f"last checkpoint (iteration {stopped})" in output and hint in output, output[-4000:]

    # Submitting again with the run directory continues from that checkpoint.
    job2 = submit(cluster, tmp_path, data, run_dir=str(run_dir))
    out2 = tmp_path / f"slurm-s2two-{job2}.out"
    info = wait_until(lambda: finished(cluster, job2), 300, "the resumed job", cluster, job2, out2)
    output = out2.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (
        f"{info}\n{output[-5000:]}"
    )
    resumed = node_log(run_dir, job2, 0)
    assert "resumed from" in resumed and f"(iteration {stopped}," in resumed, resumed[-3000:]
    assert not re.search(rf"iter\s+{stopped}/", resumed)  # no iteration repeated
    assert re.search(rf"iter\s+{ITERS}/{ITERS}", resumed), resumed[-3000:]
    # The interrupted and resumed halves together are the uninterrupted run.
    both = losses(run_dir)
    assert sorted(both) == sorted(one_node)
    for it, loss in one_node.items():
        assert both[it] == pytest.approx(loss, abs=1e-5), (it, both[it], loss)
