"""A Ctrl-C or SIGTERM during a checkpoint save must not kill the helper process the save
spawns (megatron-core's writer starts a ``multiprocessing`` Manager at a process's first save;
one caught in its start-up failed the save in CI). ``helpers_ignore_stop_signals`` makes
spawned helpers ignore both signals, while this process still receives them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.version_independent

# The parent, in its own process group (as a terminal's foreground job or a Slurm step): a thread
# sends SIGINT and SIGTERM to the whole group every 20 ms while the main thread starts a spawned
# Manager, as megatron-core's writer does; then the Manager must still serve a queue.
SCRIPT = textwrap.dedent(
    """
    import multiprocessing, os, signal, threading, time
    from megatron_s2.training.checkpointing import helpers_ignore_stop_signals

    seen = set()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda signum, frame: seen.add(signal.Signals(signum).name))
    done = threading.Event()

    def pester():
        while not done.is_set():
            for s in (signal.SIGINT, signal.SIGTERM):
                os.killpg(os.getpgrp(), s)
            time.sleep(0.02)

    if __name__ == "__main__":
        thread = threading.Thread(target=pester, daemon=True)
        thread.start()
        try:
            with helpers_ignore_stop_signals():
                manager = multiprocessing.get_context("spawn").Manager()
            queue = manager.Queue()
            time.sleep(0.3)  # signals after the start-up too
            queue.put(7)
            alive = queue.get(timeout=10) == 7
        except Exception as e:
            alive = False
            print("error", type(e).__name__, e, flush=True)
        done.set()
        thread.join()
        print("helper alive", alive, "parent saw", sorted(seen), flush=True)
    """
)


def _run_parent(script: str) -> subprocess.CompletedProcess:
    """``script`` run with ``python -c`` in its own session (process group), from the
    checkout's root."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
        cwd=root,
    )


def test_helpers_spawned_in_a_save_survive_stop_signals_and_the_parent_still_sees_them():
    r = _run_parent(SCRIPT)
    assert "helper alive True" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "parent saw ['SIGINT', 'SIGTERM']" in r.stdout, r.stdout


def test_without_it_the_helper_dies():
    """The control: the same signals kill a Manager spawned outside the block."""
    script = SCRIPT.replace("with helpers_ignore_stop_signals():", "if True:")
    r = _run_parent(script)
    assert "helper alive False" in r.stdout, r.stdout + r.stderr[-3000:]
