"""The sequence-length rules of the parallel layouts, in one place.

Every layer that splits the sequence puts a rule on its length:

* sequence parallelism hands each tensor-parallel rank ``1 / TP`` of the tokens of its
  context-parallel part, so the length must be a multiple of ``TP x CP``;
* context parallelism splits the sequence into ``2 x CP`` chunks (rank ``r`` holds chunks ``r``
  and ``2 x CP - 1 - r``: :mod:`megatron_s2.context_parallel`), so the length must be a multiple
  of ``2 x CP``;
* an S2 layer under context parallelism lays its pattern out in absolute blocks, so each chunk
  must be a whole number of its blocks: a multiple of ``2 x CP x block_size`` for every S2
  layer's block size;
* packed sequences (THD) cannot be split that way yet: packing and context parallelism are
  refused together.

:func:`check_parallel_lengths` and :func:`check_packed_sequences` are the only code that decides
these rules; the model config (:class:`~megatron_s2.config.S2TransformerConfig`), the core
attention layers, the run config and the training step call them. They raise
:class:`ParallelLengthError`, a ``ValueError`` whose fields say which rule failed, so that a
caller with its own names for the settings (the run config's ``model.seq_length``,
``parallel.context_parallel_size``, ...) can restate it in those names.

This module imports neither torch nor Megatron: the run config checks a layout before anything
heavy loads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Optional

__all__ = [
    "ParallelLengthError",
    "SEQUENCE_PARALLEL",
    "CONTEXT_PARALLEL",
    "CONTEXT_PARALLEL_BLOCKS",
    "PACKED_CONTEXT_PARALLEL",
    "context_parallel_unit",
    "check_parallel_lengths",
    "check_packed_sequences",
]

# The rules, as ParallelLengthError.rule names them.
SEQUENCE_PARALLEL = "sequence_parallel"  # length % (TP x CP) under sequence parallelism
CONTEXT_PARALLEL = "context_parallel"  # length % (2 x CP)
CONTEXT_PARALLEL_BLOCKS = "context_parallel_blocks"  # length % (2 x CP x every S2 block size)
PACKED_CONTEXT_PARALLEL = "packed_context_parallel"  # packed sequences with CP > 1


class ParallelLengthError(ValueError):
    """A sequence length (or packing) that a parallel layout cannot split.

    Fields: ``rule`` (one of the rule constants of this module), ``seq_length`` (tokens; None
    for the packing rule), ``multiple`` (what the length must be a multiple of; None for the
    packing rule), ``tensor_parallel``, ``context_parallel`` (the sizes) and ``block_sizes`` (the
    S2 layers' distinct block sizes that took part, ascending).
    """

    def __init__(
        self,
        message: str,
        *,
        rule: str,
        seq_length: Optional[int],
        multiple: Optional[int],
        tensor_parallel: int,
        context_parallel: int,
        block_sizes: tuple[int, ...] = (),
    ):
        super().__init__(message)
        self.rule = rule
        self.seq_length = seq_length
        self.multiple = multiple
        self.tensor_parallel = tensor_parallel
        self.context_parallel = context_parallel
        self.block_sizes = block_sizes


def context_parallel_unit(context_parallel_size: int, block_sizes: Iterable[int] = ()) -> int:
    """What a sequence length must be a multiple of under ``context_parallel_size`` (tokens):
    ``2 x CP`` (Megatron's chunks), and ``2 x CP x b`` for every S2 block size ``b`` (each chunk
    starts on a block boundary of every S2 layer)."""
    unit = 2 * context_parallel_size
    for block in block_sizes:
        unit = math.lcm(unit, 2 * context_parallel_size * block)
    return unit


def sequence_multiple(context_parallel_size: int, block_sizes: Iterable[int] = ()) -> int:
    """The multiple (tokens) every sequence length of a run must be: the CP unit
    (:func:`context_parallel_unit`) under context parallelism, else the least common multiple of
    the S2 block sizes (1 with dense layers only)."""
    if context_parallel_size > 1:
        return context_parallel_unit(context_parallel_size, block_sizes)
    unit = 1
    for block in block_sizes:
        unit = math.lcm(unit, block)
    return unit


def check_parallel_lengths(
    seq_length: int,
    *,
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
    block_sizes: Iterable[int] = (),
    seq_name: str = "seq_length",
    where: str = "",
) -> None:
    """Raise :class:`ParallelLengthError` if a sequence of ``seq_length`` tokens cannot be split
    by the layout: ``tp`` (tensor-parallel size), ``cp`` (context-parallel size),
    ``sequence_parallel``, ``block_sizes`` (the S2 layers' block sizes, empty for dense layers
    only).

    Checked in this order, the first failure raised: the sequence-parallel rule
    (``seq_length % (tp * cp)``), then with ``cp > 1`` Megatron's chunks (``% (2 * cp)``), then
    the S2 blocks (``% (2 * cp * b)`` for every ``b``). The message names ``seq_name`` (how the
    caller calls the length: ``s2_seq_length`` in a model config) and the allowed multiple;
    ``where`` (e.g. a module's name) prefixes it.
    """
    prefix = f"{where}: " if where else ""
    blocks = tuple(sorted(set(block_sizes)))

    def error(message: str, rule: str, multiple: int, used_blocks=()) -> ParallelLengthError:
        return ParallelLengthError(
            prefix + message,
            rule=rule,
            seq_length=seq_length,
            multiple=multiple,
            tensor_parallel=tp,
            context_parallel=cp,
            block_sizes=tuple(used_blocks),
        )

    if sequence_parallel and seq_length % (tp * cp):
        raise error(
            f"sequence_parallel: {seq_name} ({seq_length}) must be a multiple of "
            f"tensor_model_parallel_size x context_parallel_size = {tp * cp} (each "
            f"context-parallel rank's tokens are split over the tensor-parallel ranks)",
            SEQUENCE_PARALLEL,
            tp * cp,
        )
    if cp <= 1:
        return
    if seq_length % (2 * cp):
        raise error(
            f"context_parallel_size={cp}: {seq_name} ({seq_length}) must be a multiple of "
            f"2 x context_parallel_size = {2 * cp} (Megatron splits the sequence into "
            f"2 x context_parallel_size chunks, two per rank)",
            CONTEXT_PARALLEL,
            2 * cp,
        )
    unit = context_parallel_unit(cp, blocks)
    if seq_length % unit:
        # Quote only the block sizes the chunks cut: a layer whose blocks fit is not the cause.
        failing = tuple(b for b in blocks if seq_length % (2 * cp * b))
        sizes = ", ".join(str(b) for b in failing)
        if len(blocks) == 1:
            multiple = f"2 x context_parallel_size x block_size = {unit}"
        else:
            multiple = (
                f"2 x context_parallel_size x each S2 block_size (their least common multiple: "
                f"{unit})"
            )
        raise error(
            f"context_parallel_size={cp}: {seq_name} ({seq_length}) splits into 2 x "
            f"context_parallel_size chunks of {seq_length // (2 * cp)} tokens, not a whole "
            f"number of S2 blocks (block_size ({sizes})); the sequence length must be a "
            f"multiple of {multiple}",
            CONTEXT_PARALLEL_BLOCKS,
            unit,
            blocks,
        )


def check_packed_sequences(cp: int, *, where: str = "") -> None:
    """Raise :class:`ParallelLengthError` (rule ``PACKED_CONTEXT_PARALLEL``) if packed
    sequences (THD ``packed_seq_params``, one pack of documents per micro-batch) would run
    under context parallelism (``cp > 1``): the ``2 x CP`` chunk split does not follow document
    boundaries, and is not supported yet. ``where`` prefixes the message."""
    if cp > 1:
        prefix = f"{where}: " if where else ""
        raise ParallelLengthError(
            f"{prefix}packed sequences (THD packed_seq_params) and context_parallel_size={cp} "
            f"are not supported together yet; use context_parallel_size=1 or unpacked sequences",
            rule=PACKED_CONTEXT_PARALLEL,
            seq_length=None,
            multiple=None,
            tensor_parallel=1,
            context_parallel=cp,
        )
