"""Throw-away Slurm clusters on this machine (munged + slurmctld + slurmd) for launcher tests.

``MiniSlurm``: one node, this host, on 127.0.0.1. ``TwoNodeSlurm``: two nodes, each slurmd in a
network namespace of its own (``ip netns``) with its own address, so that a job spans two nodes
that reach each other only over the network, as on a real cluster (see its docstring).

Everything lives under one directory: munge key and socket, slurm.conf, state, spool and logs.
The daemons run in the foreground as children of this process, so ``stop()`` ends exactly the
processes it started and leaves any system munged/slurm alone. Clients find the cluster through
``SLURM_CONF`` (see ``env()``).

No cgroups: containers and sandboxes often lack a writable cgroup hierarchy, so processes are
tracked by parent pid (proctrack/linuxproc) and tasks are not bound (task/none).

Manual use (root)::

    python -m tests.helpers.slurm_cluster /tmp/slurm-test           # one node; prints the env
    python -m tests.helpers.slurm_cluster --two-nodes /tmp/slurm-2  # two nodes; waits for ^C
"""

from __future__ import annotations

import fcntl
import os
import random
import shlex
import shutil
import signal
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


def install_packages(
    timeout: float = 600, packages: tuple[str, ...] = PACKAGES, missing=missing_binaries
) -> None:
    """apt-get install ``packages`` (default: Slurm and munge) unless ``missing()`` is empty
    (needs root and apt).

    Under a lock: two pytest-xdist workers (test_slurm and the documented sbatch commands) may
    both find Slurm missing, and apt-get fails at once on the other's dpkg lock."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    with open(Path(tempfile.gettempdir()) / "megatron-s2-slurm-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not missing():  # the other worker installed them while this one waited
            return
        for cmd in (
            ["apt-get", "update", "-q"],
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages],
        ):
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            if r.returncode != 0:
                raise ClusterError(
                    f"{' '.join(cmd)} failed ({r.returncode}):\n"
                    f"{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
                )


# Set (to anything but 0) to keep a root test run from apt-get installing Slurm and munge: the
# Slurm tests then skip where they are missing.
NO_APT_VARIABLE = "MEGATRON_S2_TEST_NO_APT"


def slurm_unavailable() -> Optional[str]:
    """Why a Slurm cluster cannot be started here (a reason to skip), or None once the binaries
    are there (apt-get installing them if needed, which needs root)."""
    if not sys.platform.startswith("linux"):
        return "a Slurm test cluster needs Linux"
    if os.geteuid() != 0:
        return "a Slurm test cluster needs root (it starts munged/slurmctld/slurmd, may apt-get)"
    if missing_binaries():
        if shutil.which("apt-get") is None:
            return f"Slurm binaries {missing_binaries()} missing and apt-get is not available"
        if os.environ.get(NO_APT_VARIABLE, "") not in ("", "0"):
            # The README names this opt-out next to its test command.
            return f"Slurm binaries {missing_binaries()} missing and {NO_APT_VARIABLE} is set"
        try:
            install_packages()
        except (ClusterError, OSError, subprocess.TimeoutExpired) as exc:
            return f"could not apt-get install {' '.join(PACKAGES)} (offline?): {exc}"
    return None


# What a test process may carry that a user's shell would not, and that the launchers would take
# as settings: sbatch exports the submitting environment to the job (--export=ALL). A test that
# starts a gloo world in-process (tests.helpers.megatron) leaves MASTER_ADDR=127.0.0.1 and the
# port of its still-listening store in os.environ; with pytest-xdist the next test file of that
# worker may be a Slurm test, whose job then rendezvoused on 127.0.0.1 (two nodes: never met)
# or on a port already in use (torchrun's store: EADDRINUSE).
LAUNCHER_LEFTOVERS = (
    "TRITON_INTERPRET",  # conftest's, for the kernel tests; the trainer would crawl
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NPROC_PER_NODE",
    "RUN_DIR",
    "PYTHON",
)


def user_shell_env(base: Optional[dict] = None) -> dict:
    """``base`` (default ``os.environ``) as a user's shell would have it before a launcher runs:
    without ``LAUNCHER_LEFTOVERS``, ``SLURM_*`` (except ``SLURM_CONF``, which names the test
    cluster) and ``TORCHELASTIC_*``; the test's interpreter first on PATH (the launchers run
    ``python3``, or ``PYTHON`` where that is another one). A copy; ``base`` is not changed."""
    env = dict(os.environ if base is None else base)
    for key in list(env):
        if key.startswith(("SLURM_", "TORCHELASTIC_")) and key != "SLURM_CONF":
            del env[key]
    for key in LAUNCHER_LEFTOVERS:
        env.pop(key, None)
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    if not os.path.exists(os.path.join(bindir, "python3")):
        env["PYTHON"] = sys.executable
    return env


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
        # Job ids of their own: launch/slurm.sbatch derives its rendezvous port from the job id,
        # and two test clusters on this host (two pytest workers) that both started at job 1
        # would start their first jobs on the same port at the same time.
        self.first_job_id = random.randrange(1000, 1_000_000)

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
FirstJobId={self.first_job_id}
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
# A job starts as soon as it may: a requeued one is held cred_expire seconds, and then waited
# for the scheduler's next periodic pass (main loop every 60 s, backfill every 30 s by default):
# up to a minute of an idle node in the requeue tests.
SchedulerParameters=sched_interval=1,bf_interval=1
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
        self._write_conf()
        self._start_munged(timeout)
        # -i: ignore stale state from a previous cluster in this directory.
        self._spawn(
            "slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], self.env()
        )
        self._wait_for_controller(timeout)
        self._spawn("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf)], self.env())
        self._wait(self._node_idle, timeout, f"node {self.host} to become idle")
        return self

    def _start_munged(self, timeout: float) -> None:
        key = self._write_munge_key()
        self.munge_socket.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(self.munge_socket.parent, 0o755)
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

    def _wait_for_controller(self, timeout: float) -> None:
        self._wait(
            lambda: self._run(["scontrol", "ping"]).stdout.count("UP") > 0, timeout, "slurmctld"
        )

    def _spawn(self, name: str, cmd: list[str], env: Optional[dict] = None) -> None:
        out = open(self.root / "log" / f"{name}.stdout", "ab")
        self.procs[name] = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env or os.environ, start_new_session=True
        )
        out.close()

    def client(self, cmd: list[str]) -> list[str]:
        """``cmd`` (sbatch, scontrol, ...) as it has to be run to reach this cluster's controller
        (with ``env()``): here unchanged; ``TwoNodeSlurm`` runs it inside the first node."""
        return list(cmd)

    def _run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.client(cmd), env=self.env(), capture_output=True, text=True, timeout=30, **kw
        )

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

    def cancel_all(self, timeout: float = 90) -> list[str]:
        """Cancel every job of this cluster that has not ended and wait up to ``timeout`` s until
        none is left pending or running; the ids it found (array tasks as ``<id>_<task>``).

        For a test's teardown: a test that fails or times out while its job runs must not leave
        the job holding the nodes (the module's next test would wait on it, PENDING for
        Resources). Never raises."""
        try:
            jobs = self._run(["squeue", "-h", "-o", "%i"]).stdout.split()
            if not jobs:
                return []
            # Without --full: the job is ended as by a user's scancel (SIGTERM to its steps,
            # SIGKILL after KillWait), the batch shell included.
            self._run(["scancel", *jobs])
            deadline = time.time() + timeout
            while time.time() < deadline and self._run(["squeue", "-h", "-o", "%i"]).stdout.split():
                time.sleep(1)
            return jobs
        except (subprocess.TimeoutExpired, OSError):
            return []

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
        for name in reversed(list(self.procs)):
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


class TwoNodeSlurm(MiniSlurm):
    """Two Slurm nodes, ``s2n0`` and ``s2n1``, on this machine: each slurmd runs in a network
    namespace of its own, created for this cluster, with one address there (10.213.0.1 and .2 on
    a veth pair between the two namespaces, which exists nowhere else); the controller runs on
    the first node, as on a small cluster's head node. A job's processes on the two nodes share
    the file system but reach each other only through those addresses, so a launcher that
    rendezvouses on 127.0.0.1, binds to the wrong address or mixes up node ranks fails here as it
    would between two machines.

    The Debian/Ubuntu Slurm packages are built without ``--enable-multiple-slurmd`` (slurmctld
    stops with "Duplicated NodeHostName" for two nodes on one host), hence the namespaces.

    Name resolution: each node's daemons (and so every process of a job) see their own
    ``/etc/hosts``, bind-mounted in a private mount namespace, that maps both node names and this
    machine's host name to the node's own address, as a node's resolver would; the real
    ``/etc/hosts`` is not touched. Clients (sbatch, scontrol, scancel) must run on the first node:
    ``client(cmd)``. Needs root with CAP_NET_ADMIN and CAP_SYS_ADMIN (``ip netns``).
    """

    SUBNET = "10.213.0"
    IFNAME = "s2eth"

    def __init__(self, root: str | os.PathLike, cpus: int = 1):
        super().__init__(root, cpus)
        self.nodes = ["s2n0", "s2n1"]
        self.addrs = [f"{self.SUBNET}.{i + 1}" for i in range(len(self.nodes))]
        self.host = self.nodes[0]
        # Namespace names are global on the machine: unique per cluster so that two test runs
        # (two pytest workers, two worktrees) cannot delete each other's.
        tag = f"{os.getpid()}x{time.monotonic_ns() % 10**6}"
        self.netns = [f"s2t{tag}{n}" for n in self.nodes]
        self._made_netns: list[str] = []

    # -------------------------------------------------------------- setup
    @staticmethod
    def unavailable() -> Optional[str]:
        """Why network namespaces cannot be used here (a reason to skip), or None; apt-get
        installs iproute2 if ``ip`` is missing. Call after ``slurm_unavailable()`` (root)."""
        if shutil.which("ip") is None and shutil.which("apt-get") is not None:
            try:  # slim images lack iproute2; root is checked before this is called
                install_packages(packages=("iproute2",), missing=lambda: not shutil.which("ip"))
            except (ClusterError, OSError, subprocess.TimeoutExpired) as exc:
                return f"could not apt-get install iproute2 (offline?): {exc}"
        if shutil.which("ip") is None:
            return "the two-node Slurm cluster needs iproute2 (`ip netns`)"
        probe = f"s2probe{os.getpid()}"
        r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if r.returncode != 0:
            return f"cannot create a network namespace (ip netns add: {r.stderr.strip()})"
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
        return None

    def _sh(self, *cmd: str) -> None:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise ClusterError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")

    def _make_network(self) -> None:
        for ns in self.netns:
            self._sh("ip", "netns", "add", ns)
            self._made_netns.append(ns)
        # Both ends are created inside the namespaces, so no interface ever exists outside them.
        a, b = self.netns
        veth = f"ip -n {a} link add {self.IFNAME} type veth peer name {self.IFNAME} netns {b}"
        self._sh(*veth.split())
        for ns, addr in zip(self.netns, self.addrs):
            self._sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", self.IFNAME)
            self._sh("ip", "-n", ns, "link", "set", self.IFNAME, "up")
            self._sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _write_hosts(self) -> None:
        real_host = socket.gethostname()
        for i, node in enumerate(self.nodes):
            lines = ["127.0.0.1 localhost"]
            for j, (other, addr) in enumerate(zip(self.nodes, self.addrs)):
                # The machine's own name resolves to the node's address, as on a real node;
                # gloo binds to the address of the host name.
                lines.append(f"{addr} {other}" + (f" {real_host}" if i == j else ""))
            (self.root / f"hosts.{node}").write_text("\n".join(lines) + "\n")

    def _write_conf(self) -> None:
        for d in ("state", "log", "run", *(f"spool/{n}" for n in self.nodes)):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        r = self.root
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={a} CPUs={self.cpus} State=UNKNOWN"
            for n, a in zip(self.nodes, self.addrs)
        )
        # slurmctld insists on running on the host named in SlurmctldHost: this machine's name,
        # with the first node's address. Each node has its own network, so the standard ports
        # are free there; the two slurmd share the file system, so their spool, pid and log
        # files are per node (%n).
        conf = f"""\
ClusterName=s2two
FirstJobId={self.first_job_id}
SlurmctldHost={socket.gethostname().split(".")[0]}({self.addrs[0]})
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
# A job starts as soon as it may: a requeued one is held cred_expire seconds, and then waited
# for the scheduler's next periodic pass (main loop every 60 s, backfill every 30 s by default):
# up to a minute of an idle node in the requeue tests.
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MinJobAge=3600
# Short: a step whose tasks are told to stop is SIGKILLed after this many seconds.
KillWait=10
SlurmdTimeout=60
{nodes}
PartitionName=debug Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
"""
        self.conf.write_text(conf)

    def on_node(self, i: int, cmd: list[str]) -> list[str]:
        """``cmd`` run on node ``i``: in its network namespace, with its /etc/hosts."""
        hosts = self.root / f"hosts.{self.nodes[i]}"
        # nsenter, not `ip netns exec`: that one also remounts /sys, which hides the cgroup file
        # system slurmd needs. The bind mount lives in a private mount namespace (unshare), so
        # only the command and its children see it.
        return [
            "nsenter",
            f"--net=/run/netns/{self.netns[i]}",
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            'mount --bind "$0" /etc/hosts && exec "$@"',
            str(hosts),
            *cmd,
        ]

    def client(self, cmd: list[str]) -> list[str]:
        return self.on_node(0, cmd)

    def start(self, timeout: float = 60) -> TwoNodeSlurm:
        try:
            return self._start(timeout)
        except BaseException:
            # Namespaces and daemons outlive this process: never leave them behind.
            self.stop()
            raise

    def _start(self, timeout: float) -> TwoNodeSlurm:
        self.root.mkdir(parents=True, exist_ok=True)
        self._write_conf()
        self._write_hosts()
        self._make_network()
        # munged stays outside: Slurm reaches it through its socket file, on the shared file system.
        self._start_munged(timeout)
        env = self.env()
        slurmctld = [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)]
        self._spawn("slurmctld", self.on_node(0, slurmctld), env)
        self._wait_for_controller(timeout)
        for i, node in enumerate(self.nodes):
            slurmd = [_which("slurmd"), "-D", "-N", node, "-f", str(self.conf)]
            self._spawn(f"slurmd-{node}", self.on_node(i, slurmd), env)
        self._wait(self._node_idle, timeout, f"nodes {self.nodes} to become idle")
        return self

    def _node_idle(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.split("\n")
        states = dict(line.split()[:2] for line in out if len(line.split()) >= 2)
        return all(states.get(n, "").lower().startswith("idle") for n in self.nodes)

    # -------------------------------------------------------------- use
    def node_pids(self, i: int) -> list[int]:
        """The processes running on node ``i`` (in its network namespace)."""
        r = subprocess.run(
            ["ip", "netns", "pids", self.netns[i]], capture_output=True, text=True, timeout=30
        )
        return [int(p) for p in r.stdout.split()]

    # -------------------------------------------------------------- teardown
    def stop(self) -> None:
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            # End the jobs first: their processes are children of slurmstepd, not of this one.
            try:
                self._run(["scancel", "--full", "--user=root"])
            except (subprocess.TimeoutExpired, OSError):
                pass
        super().stop()
        # What is left in the namespaces was started through this cluster (job steps): end it
        # by pid before the namespaces go.
        for i, ns in enumerate(self._made_netns):
            for pid in self.node_pids(i):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
        self._made_netns.clear()


if __name__ == "__main__":
    two = "--two-nodes" in sys.argv[1:]
    args = [a for a in sys.argv[1:] if a != "--two-nodes"]
    root = args[0] if args else "/tmp/s2-minislurm"
    c = (TwoNodeSlurm if two else MiniSlurm)(root).start()
    run_on = f"; clients run on {c.nodes[0]}: {shlex.join(c.client(['sinfo']))}" if two else ""
    print(
        f"export SLURM_CONF={c.conf}   # node {c.host}, {c.cpus} CPUs; ^C stops the cluster{run_on}"
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        c.stop()
