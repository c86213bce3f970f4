"""Graceful stop on SIGTERM (Slurm preemption or time limit, ``scancel --signal=TERM``) and on
SIGINT (Ctrl-C).

The handlers only set a flag; the trainer asks :meth:`Preemption.should_stop` after every
iteration, all ranks agree (one rank's signal stops them all), and the trainer saves a
checkpoint and returns. A second Ctrl-C aborts at once (``KeyboardInterrupt``) without waiting
for the iteration or the save; the tracker then still names the last complete checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Optional

import torch

__all__ = ["Preemption", "STOP_REASONS"]

# What stopped a run early, by the code all ranks agree on (the largest wins).
STOP_REASONS = {1: "sigterm", 2: "sigint"}
_CODES = {name: code for code, name in STOP_REASONS.items()}


class Preemption:
    """SIGTERM/SIGINT flag of this process, agreed on by all ranks.

    Args:
        simulate_at: act as if SIGTERM arrived right after this iteration (the
            ``debug.sigterm_at_iter`` test hook); None = only the real signals.
    """

    def __init__(self, simulate_at: Optional[int] = None):
        self.simulate_at = simulate_at
        self.signal: Optional[str] = None  # "sigterm" or "sigint" once one arrived
        self.reason: Optional[str] = None  # what all ranks agreed stopped the run
        self._previous: dict = {}
        self._pid = os.getpid()

    @property
    def signalled(self) -> bool:
        return self.signal is not None

    def _on_sigterm(self, signum, frame) -> None:
        self.signal = self.signal or "sigterm"

    def _on_sigint(self, signum, frame) -> None:
        if os.getpid() != self._pid:
            # A data-loader worker forked after install() inherits this handler; Ctrl-C in a
            # terminal reaches it too. It must neither die (the trainer still needs batches to
            # finish the iteration) nor announce the stop again.
            return
        if self.signal == "sigint":
            # The second Ctrl-C: give up on the graceful stop.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.signal = "sigint"
        print(
            "\n[megatron-s2] Ctrl-C: finishing this iteration, then saving a checkpoint and "
            "stopping (Ctrl-C again to abort without saving)",
            file=sys.stderr,
            flush=True,
        )

    def install(self) -> None:
        """Catch SIGTERM and SIGINT from now on (a no-op outside the main thread, e.g. when
        embedded). An ignored SIGINT stays ignored (a shell's background job: Ctrl-C in the
        terminal is not meant for it)."""
        self._pid = os.getpid()
        for signum, handler in (
            (signal.SIGTERM, self._on_sigterm),
            (signal.SIGINT, self._on_sigint),
        ):
            if signum == signal.SIGINT and signal.getsignal(signum) == signal.SIG_IGN:
                continue
            try:
                self._previous[signum] = signal.signal(signum, handler)
            except ValueError:  # signal handlers can only be set from the main thread
                return

    def uninstall(self) -> None:
        """Restore the handlers that were there before :meth:`install`."""
        for signum, previous in self._previous.items():
            # None: the previous handler was not set from Python and cannot be put back.
            if previous is not None:
                signal.signal(signum, previous)
        self._previous = {}

    def requested(self, iteration: int) -> bool:
        """Whether this process wants to stop after ``iteration`` (no communication)."""
        if self.simulate_at == iteration and self.signal is None:
            self.signal = "sigterm"
        return self.signalled

    def should_stop(self, iteration: int, device: torch.device) -> bool:
        """Stop after ``iteration``? True on every rank when any rank was signalled
        (collective: call on every rank after every iteration); :attr:`reason` then says why."""
        code = _CODES[self.signal] if self.requested(iteration) else 0
        flag = torch.tensor([float(code)], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        code = int(flag.item())
        self.reason = STOP_REASONS.get(code)
        return code > 0
