"""The application's own error classes, in a module that imports nothing of the application.

Each is raised by one part of the run and caught by the command lines (``cli.py``, the
long-context evaluation), which map them to exit codes; ``run_dir.on_rank0`` re-raises them on
every rank by name. Keeping them here lets any module raise or catch them without importing
the module that usually raises them (which is how ``checkpointing`` and ``run_dir`` used to
import each other).

``ConfigError`` (a bad run-config value) lives with its owner, :mod:`.run_config`.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "NonFiniteLossError", "RunDirError"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names it and what to do."""


class RunDirError(RuntimeError):
    """The run directory cannot be used: locked by a live run, holds another run, not writable,
    or too little free space. The message says which and what to do."""


class NonFiniteLossError(RuntimeError):
    """The loss became NaN/inf; the run stopped without stepping the optimizer."""
