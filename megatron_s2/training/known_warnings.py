"""Warnings that every run of the pip wheels prints and that need no action, filtered by both
command lines (``megatron-s2-train`` and ``megatron-s2-eval-long-context``).

Megatron warns at import that Transformer Engine and Apex are missing (the local fallbacks are
what a CPU or plain-PyTorch run uses), about its own deprecated defaults, and torch's distributed
checkpointing about APIs Megatron still calls. None of it is about the user's run, and before a
one-line config error it buries the error; each rank of a ``torchrun`` launch would print it all
again. Filters are installed before Megatron is first imported, which both entry points do lazily.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["KNOWN_WARNINGS", "QUIET_LOGGERS", "quiet_known_warnings"]

# Regular expressions matched against the start of the warning's message.
KNOWN_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
    r"The \.grad attribute of a Tensor that is not a leaf",
    r"`load_state_dict` is deprecated and will be removed",  # Megatron's own call, on resume
    # Reading a checkpoint's metadata before the process group exists (the evaluator checks a
    # checkpoint against its config first): torch assumes one process, which is right there.
    r"torch\.distributed is disabled, unavailable or uninitialized",
)
# torch's CUDA build on a machine without a CUDA runtime (CPU mode) logs at import that it found
# none; the message is about compiling C++ extensions, which neither command does.
QUIET_LOGGERS = ("torch.utils.cpp_extension",)


def quiet_known_warnings() -> None:
    """Ignore :data:`KNOWN_WARNINGS` and torch.distributed's FutureWarnings (deprecations inside
    the checkpoint code Megatron calls), and keep :data:`QUIET_LOGGERS` to errors, for the rest
    of this process."""
    for msg in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=msg)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
