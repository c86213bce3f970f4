"""One run directory, one run: the lock, starting over, and the start-up checks.

A run owns ``<run_dir>`` (metrics, TensorBoard, ``config.yaml``, ``summary.json``, and by
default ``checkpoints/``) for as long as it is alive:

* **Lock.** Rank 0 holds an exclusive ``flock`` on ``<run_dir>/.lock`` (and on
  ``<checkpoint dir>/.lock`` when the checkpoints live elsewhere) from start-up to exit. A second
  run in the same directory stops at once, naming the holder (pid, host, start time). The kernel
  releases the lock when the holding process ends, however it ends, so there are no stale locks:
  a leftover ``.lock`` file of a dead run is simply taken over. (``flock`` on NFS works between
  hosts on Linux >= 2.6.12, where the kernel maps it to a POSIX lock.)
* **Starting over is explicit.** A directory that holds a previous run (records in
  ``metrics.jsonl``, ``summary.json`` or checkpoints) is resumed from its newest intact
  checkpoint; when there is none to resume from (or ``checkpoint.resume=false``) the run refuses
  to start instead of mixing two runs' files. ``--restart`` moves the previous run aside to
  ``<run_dir>.old-<timestamp>`` (its external checkpoint directory likewise) and starts afresh.
* **A checkpoint directory belongs to one run.** A new run given another run's
  ``checkpoint.dir`` (its ``checkpoints/``, or an external folder it saved into) is refused
  before anything is written: it would resume that run's weights and save into its folder. The
  lock files name their run directory, and so tell whose a folder is after the run ended;
  ``checkpoint.load_dir`` is the way to start from another run's weights.
* **Start-up checks**, before anything trains: the run and checkpoint directories can be created
  and written (a probe file is written and removed: a read-only or full file system fails
  here, not at the first save), and the checkpoint directory's file system has room for one
  checkpoint (estimated from the parameter count: weights plus Adam state).

Failures raise :class:`RunDirError` (exit code 4 in the CLI). Only rank 0 touches the file
system; :func:`on_rank0` hands its result, or its error, to every rank.
"""

from __future__ import annotations

import datetime
import errno
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, TypeVar

from .errors import CheckpointError, RunDirError

__all__ = [
    "RunLock",
    "LOCK_FILE",
    "acquire_lock",
    "previous_run",
    "move_aside",
    "check_writable",
    "checkpoint_dir_owner",
    "check_free_space",
    "on_rank0",
    "human_bytes",
    "RunDirectory",
    "open_run_directory",
]

LOCK_FILE = ".lock"
T = TypeVar("T")


def human_bytes(n: float) -> str:
    """``n`` bytes as B/KiB/MiB/GiB/TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _is_relative_to(path: str, parent: str) -> bool:
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


# ---------------------------------------------------------------------------------------- lock
@dataclass
class RunLock:
    """An exclusive ``flock`` on a directory's lock file, held until :meth:`release`."""

    path: str
    fd: Optional[int]

    def release(self) -> None:
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def acquire_lock(
    directory: str, what: str = "run directory", run_dir: Optional[str] = None
) -> RunLock:
    """Lock ``directory`` (created if missing) for this process, or raise :class:`RunDirError`
    naming the live process that holds it. The lock file then names this process and the run
    directory ``run_dir`` (default: ``directory``), which stays readable after the run ended:
    :func:`checkpoint_dir_owner` reads it."""
    import fcntl

    path = os.path.join(directory, LOCK_FILE)
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise RunDirError(_not_writable(what, directory, e)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
            os.close(fd)
            raise RunDirError(f"{what} {directory}: cannot lock {path}: {e}") from None
        with open(path, errors="replace") as f:
            holder = f.read().strip() or "another process"
        os.close(fd)
        other = "checkpoint.dir=" if what == "checkpoint directory" else "name=/logging.run_dir="
        raise RunDirError(
            f"{what} {directory} is in use by a live run ({holder}). Two runs in one directory "
            f"would interleave their metrics and delete each other's checkpoints: wait for it "
            f"to finish, stop it, or use another {other}"
        ) from None
    started = datetime.datetime.now().isoformat(timespec="seconds")
    owner = os.path.realpath(run_dir or directory)
    os.ftruncate(fd, 0)
    os.write(
        fd,
        f"pid {os.getpid()} on {socket.gethostname()} since {started}{RUN_MARK}{owner}\n".encode(),
    )
    return RunLock(path, fd)


# Between the holder and the run directory in a lock file's line.
RUN_MARK = "; run "


def _lock_owner(path: str) -> Optional[str]:
    """The run directory a lock file names (None: unreadable, or written before lock files
    named their run)."""
    try:
        with open(path, errors="replace") as f:
            text = f.read().strip()
    except OSError:
        return None
    _, mark, owner = text.rpartition(RUN_MARK)
    return owner or None if mark else None


def _looks_like_run_dir(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "config.yaml"))


def checkpoint_dir_owner(
    checkpoint_dir: str,
    run_dir: str,
    stored_owner: Optional[Callable[[str], Optional[str]]] = None,
) -> Optional[str]:
    """The run directory of *another* run that ``checkpoint_dir`` belongs to, or None (it is
    this run's, in ``run_dir`` or claimed by it before, or nobody's yet).

    Read from, in order: the lock file of the checkpoint directory or of the nearest folder
    above it that has one (it names the run that last held it: a run's own ``checkpoints/``
    has none, its run directory's does; locks written before they named their run count for
    the folder they are in when it is a run directory), else ``stored_owner(checkpoint_dir)``
    (the trainer passes :func:`.checkpointing.stored_run_dir`: the run directory the config
    stored in the newest checkpoint names; this module does not read checkpoints)."""
    if _is_relative_to(checkpoint_dir, run_dir):
        return None
    ours = os.path.realpath(run_dir)
    start = directory = os.path.realpath(checkpoint_dir)
    owner = None
    while True:
        lock = os.path.join(directory, LOCK_FILE)
        if os.path.isfile(lock):
            owner = _lock_owner(lock)
            if owner is None and directory != start and _looks_like_run_dir(directory):
                owner = directory
            break
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    if owner is None and stored_owner is not None:
        owner = stored_owner(checkpoint_dir)
    return owner if owner is not None and owner != ours else None


def _run_name(run_dir: str) -> Optional[str]:
    """The ``name`` in ``<run_dir>/config.yaml``, if it can be read."""
    try:
        import yaml

        with open(os.path.join(run_dir, "config.yaml")) as f:
            name = (yaml.safe_load(f) or {}).get("name")
        return str(name) if name else None
    except Exception:
        return None


def _owned_by_another_run(checkpoint_dir: str, owner: str) -> str:
    name = _run_name(owner)
    run = f"run '{name}' in {owner}" if name else f"the run in {owner}"
    return (
        f"checkpoint.dir {checkpoint_dir} belongs to another run ({run}): this run would resume "
        f"that run's weights and write its checkpoints into that run's folder. Give this run "
        f"a fresh checkpoint.dir (or leave it unset: <run dir>/checkpoints); to start from "
        f"those weights use checkpoint.load_dir={checkpoint_dir} instead; or take the folder "
        f"over with --restart (moves its checkpoints aside to "
        f"{checkpoint_dir.rstrip(os.sep)}.old-<time>)"
    )


# ------------------------------------------------------------------------- a previous run
def previous_run(run_dir: str, checkpoint_dir: str) -> list[str]:
    """What of a previous run ``run_dir`` and ``checkpoint_dir`` hold (empty: nothing, so a run
    can start there). ``config.yaml``, the lock file and launcher logs do not count."""
    found = []
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append("metrics.jsonl")
    if os.path.isfile(os.path.join(run_dir, "summary.json")):
        found.append("summary.json")
    if os.path.isdir(checkpoint_dir) and any(
        d.startswith("iter_") or d.startswith("latest_checkpointed_iteration")
        for d in os.listdir(checkpoint_dir)
    ):
        found.append(f"checkpoints in {checkpoint_dir}")
    return found


def move_aside(path: str) -> str:
    """Rename ``path`` to ``<path>.old-<YYYYmmdd-HHMMSS>`` (a free name); returns the new path."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    target = f"{path.rstrip(os.sep)}.old-{stamp}"
    n = 1
    while os.path.exists(target):
        n += 1
        target = f"{path.rstrip(os.sep)}.old-{stamp}-{n}"
    os.rename(path, target)
    return target


# -------------------------------------------------------------------------- start-up checks
def check_writable(directory: str, what: str) -> None:
    """Create ``directory`` if needed and write (then remove) a probe file in it; raise
    :class:`RunDirError` when either fails (read-only file system, no permission, a path
    through a regular file, full disk)."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
        try:
            os.write(fd, b"megatron-s2 write probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise RunDirError(_not_writable(what, directory, e)) from None


def _not_writable(what: str, directory: str, error: OSError) -> str:
    if error.errno == errno.ENAMETOOLONG:
        # Not a permission problem: the path itself cannot exist on this file system.
        return (
            f"{what} {directory} cannot be created: a name in the path is too long for the "
            f"file system ({error.strerror}; a file name has at most 255 bytes). Use a shorter "
            f"name=, logging.run_dir or checkpoint.dir"
        )
    return (
        f"{what} {directory} is not writable ({error.strerror or error}): checked at start-up, "
        f"since a run that cannot save its checkpoints would lose its training. Fix its "
        f"permissions or mount, or point the run elsewhere (logging.run_dir, checkpoint.dir)"
    )


def check_free_space(directory: str, needed: int, what: str = "checkpoint directory") -> None:
    """Raise :class:`RunDirError` when the file system of ``directory`` has less than
    ``needed`` bytes free."""
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise RunDirError(
            f"{what} {directory} has {human_bytes(free)} free, but one checkpoint of this model "
            f"(weights and Adam state) needs about {human_bytes(needed)}: free some space or set "
            f"checkpoint.dir to a larger file system"
        )


# ---------------------------------------------------------------------- the run directory
@dataclass(frozen=True)
class RunDirectory:
    """What :func:`open_run_directory` did (picklable: every rank gets a copy)."""

    run_dir: str
    checkpoint_dir: str
    moved_aside: tuple = ()  # (old path, new path) pairs moved by --restart


def open_run_directory(
    run_dir: str,
    checkpoint_dir: str,
    *,
    restart: bool,
    stored_owner: Optional[Callable[[str], Optional[str]]] = None,
) -> tuple[RunDirectory, list]:
    """Lock the run (and an external checkpoint) directory, refuse an external checkpoint
    directory of another run (:func:`checkpoint_dir_owner`, with ``stored_owner``) unless
    ``restart``, move a previous run aside when ``restart``, and check both directories are
    writable. Rank 0 only; returns the description and the locks to release at exit."""
    locks = [acquire_lock(run_dir)]
    external = not _is_relative_to(checkpoint_dir, run_dir)
    try:
        if external:
            # Before its lock is taken: the lock file names the run that held it last.
            owner = None if restart else checkpoint_dir_owner(checkpoint_dir, run_dir, stored_owner)
            if owner is not None:
                raise RunDirError(_owned_by_another_run(checkpoint_dir, owner))
            locks.append(acquire_lock(checkpoint_dir, "checkpoint directory", run_dir))
        moved = []
        if restart and previous_run(run_dir, checkpoint_dir):
            # Move while holding the locks (a live run cannot be moved away from under itself),
            # then lock the fresh directories.
            for lock in reversed(locks):
                directory = os.path.dirname(lock.path)
                moved.append((directory, move_aside(directory)))
            old = locks
            locks = [acquire_lock(run_dir)]
            if external:
                locks.append(acquire_lock(checkpoint_dir, "checkpoint directory", run_dir))
            for lock in old:
                lock.release()
        check_writable(run_dir, "run directory")
        check_writable(checkpoint_dir, "checkpoint directory")
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return RunDirectory(run_dir, checkpoint_dir, tuple(moved)), locks


# ---------------------------------------------------------------------- rank-0 decisions
# Errors that on_rank0 re-raises on the other ranks as the same type.
def _known_errors() -> dict:
    from .run_config import ConfigError

    return {cls.__name__: cls for cls in (RunDirError, CheckpointError, ConfigError)}


def on_rank0(fn: Callable[[], T]) -> T:
    """Run ``fn`` on global rank 0 and give every rank its result, or raise its error on every
    rank (same type for the trainer's own errors, RuntimeError otherwise). Collective."""
    import torch  # here, not at the top: the sweep reads this module without torch

    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank0 = not dist or torch.distributed.get_rank() == 0
    payload, error = None, None
    if rank0:
        try:
            payload = ("ok", fn())
        except Exception as e:
            error = e
            payload = ("error", type(e).__name__, str(e))
    if dist:
        box = [payload]
        torch.distributed.broadcast_object_list(box, src=0)
        payload = box[0]
    if error is not None:
        raise error
    if payload[0] == "error":
        cls = _known_errors().get(payload[1], RuntimeError)
        raise cls(payload[2])
    return payload[1]
