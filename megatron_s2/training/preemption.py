"""Graceful stop on SIGTERM (Slurm preemption or time limit, ``scancel --signal=TERM``).

The handler only sets a flag; the trainer asks :meth:`Preemption.should_stop` after every
iteration, all ranks agree (one rank's signal stops them all), and the trainer saves a
checkpoint and returns.
"""

from __future__ import annotations

import signal
from typing import Optional

import torch

__all__ = ["Preemption"]


class Preemption:
    """SIGTERM flag of this process, agreed on by all ranks.

    Args:
        simulate_at: act as if SIGTERM arrived right after this iteration (the
            ``debug.sigterm_at_iter`` test hook); None = only the real signal.
    """

    def __init__(self, simulate_at: Optional[int] = None):
        self.simulate_at = simulate_at
        self.signalled = False
        self._previous = None
        self._installed = False

    def install(self) -> None:
        """Catch SIGTERM from now on (a no-op outside the main thread, e.g. when embedded)."""

        def handler(signum, frame):
            self.signalled = True

        try:
            self._previous = signal.signal(signal.SIGTERM, handler)
            self._installed = True
        except ValueError:  # signal handlers can only be set from the main thread
            self._installed = False

    def uninstall(self) -> None:
        """Restore the SIGTERM handler that was there before :meth:`install`."""
        # None: the previous handler was not set from Python and cannot be put back.
        if self._installed and self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
        self._installed = False

    def requested(self, iteration: int) -> bool:
        """Whether this process wants to stop after ``iteration`` (no communication)."""
        if self.simulate_at == iteration:
            self.signalled = True
        return self.signalled

    def should_stop(self, iteration: int, device: torch.device) -> bool:
        """Stop after ``iteration``? True on every rank when any rank was signalled
        (collective: call on every rank after every iteration)."""
        flag = torch.tensor([1.0 if self.requested(iteration) else 0.0], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())
