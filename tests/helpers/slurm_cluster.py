"""A throw-away single-machine Slurm cluster (munged + slurmctld + slurmd) for launcher tests.

Everything lives under one directory: munge key and socket, slurm.conf, state, spool and logs.
The daemons run in the foreground as children of this process, so ``stop()`` ends exactly the
processes it started and leaves any system munged/slurm alone. Clients find the cluster through
``SLURM_CONF`` (see ``env()``).

No cgroups: containers and sandboxes often lack a writable cgroup hierarchy, so processes are
tracked by parent pid (proctrack/linuxproc) and tasks are not bound (task/none).

Manual use (root)::

    python -m tests.helpers.slurm_cluster /tmp/slurm-test   # starts, prints the env, waits for ^C
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

PACKAGES = ("slurm-wlm", "munge")
REQUIRED_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")


class ClusterError(RuntimeError):
    pass


def missing_binaries() -> list[str]:
    return [
        b
        for b in REQUIRED_BINARIES
        if shutil.which(b) is None and not Path("/usr/sbin", b).exists()
    ]


def install_packages(timeout: float = 600) -> None:
    """apt-get install the Slurm and munge packages (needs root and apt).

    Under a lock: two pytest-xdist workers (test_slurm and the documented sbatch commands) may
    both find Slurm missing, and apt-get fails at once on the other's dpkg lock."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    with open(Path(tempfile.gettempdir()) / "megatron-s2-slurm-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not missing_binaries():  # the other worker installed them while this one waited
            return
        for cmd in (
            ["apt-get", "update", "-q"],
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
        ):
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            if r.returncode != 0:
                raise ClusterError(
                    f"{' '.join(cmd)} failed ({r.returncode}):\n"
                    f"{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
                )


def _which(name: str) -> str:
    path = shutil.which(name) or str(Path("/usr/sbin", name))
    if not os.path.exists(path):
        raise ClusterError(f"{name} not found; install {' '.join(PACKAGES)}")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MiniSlurm:
    """One node (this host, ``cpus`` CPUs) in one partition ``debug``."""

    def __init__(self, root: str | os.PathLike, cpus: Optional[int] = None):
        self.root = Path(root).resolve()
        self.host = socket.gethostname().split(".")[0]
        self.cpus = cpus or max(1, min(2, os.cpu_count() or 1))
        self.conf = self.root / "slurm.conf"
        # Separate from the key's 0700 directory: clients need to traverse to the socket.
        self.munge_socket = self.root / "munge-run" / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}

    # -------------------------------------------------------------- setup
    def env(self) -> dict:
        """Environment for Slurm clients (sbatch, scontrol, ...) talking to this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def _write_munge_key(self) -> Path:
        key = self.root / "munge" / "munge.key"
        key.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(key.parent, 0o700)
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        return key

    def _write_conf(self) -> None:
        for d in ("state", "spool", "log", "run"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        r = self.root
        conf = f"""\
ClusterName=s2test
SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
# cred_expire also sets how long a requeued job is held before it may start again (default 120 s).
AuthInfo=socket={self.munge_socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# Keep finished jobs queryable with scontrol for a while (there is no accounting database).
MinJobAge=3600
KillWait=30
SlurmdTimeout=60
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
"""
        self.conf.write_text(conf)

    def start(self, timeout: float = 60) -> MiniSlurm:
        self.root.mkdir(parents=True, exist_ok=True)
        key = self._write_munge_key()
        self.munge_socket.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(self.munge_socket.parent, 0o755)
        self._write_conf()
        log = self.root / "log"
        self._spawn(
            "munged",
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={self.root}/run/munged.pid",
                f"--log-file={log}/munged.log",
                f"--seed-file={self.root}/munge/munged.seed",
            ],
        )
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged socket")
        env = self.env()
        # -i: ignore stale state from a previous cluster in this directory.
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], env)
        self._wait(
            lambda: self._run(["scontrol", "ping"]).stdout.count("UP") > 0, timeout, "slurmctld"
        )
        self._spawn("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf)], env)
        self._wait(self._node_idle, timeout, f"node {self.host} to become idle")
        return self

    def _spawn(self, name: str, cmd: list[str], env: Optional[dict] = None) -> None:
        out = open(self.root / "log" / f"{name}.stdout", "ab")
        self.procs[name] = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env or os.environ, start_new_session=True
        )
        out.close()

    def _run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=30, **kw)

    def _node_idle(self) -> bool:
        out = self._run(["sinfo", "-h", "-n", self.host, "-o", "%T"]).stdout.strip().lower()
        return out.startswith("idle")

    def _wait(self, cond, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise ClusterError(
                        f"{name} exited with {p.returncode} while waiting for {what}\n{self.logs()}"
                    )
            try:
                if cond():
                    return
            except (subprocess.TimeoutExpired, OSError):
                pass
            time.sleep(0.5)
        raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.logs()}")

    # -------------------------------------------------------------- use
    def job_info(self, job_id: str) -> dict:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, ...)."""
        out = self._run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        info = {}
        for tok in out.split():
            if "=" in tok:
                k, v = tok.split("=", 1)
                info.setdefault(k, v)
        return info

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            # Daemons also echo their log to stdout; show the echo only if the log file is missing.
            if f.suffix == ".stdout" and (f.with_suffix(".log")).exists() and f.stem != "munged":
                continue
            try:
                parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}")
            except OSError:
                pass
        return "\n".join(parts)

    # -------------------------------------------------------------- teardown
    def stop(self) -> None:
        # Reverse start order: slurmd first so it does not log a lost controller.
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        self.procs.clear()


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/s2-minislurm"
    c = MiniSlurm(root).start()
    print(f"export SLURM_CONF={c.conf}   # node {c.host}, {c.cpus} CPUs; ^C stops the cluster")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        c.stop()
