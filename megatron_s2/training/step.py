"""One global batch through Megatron's pipeline schedule: the forward step, the loss function and
the loss reduction over micro-batches and data-parallel ranks.

The loss follows Megatron's 3-tuple convention (``calculate_per_token_loss=True`` in the model
config): each micro-batch returns the sum of its token losses and its token count, and
``finalize_model_grads`` divides the gradients by the token count of the whole global batch.
That is exact under context parallelism and with uneven loss masks.

With packed documents (``train.pack_documents``) each micro-batch ``[b, s]`` goes to the model
as one THD sequence ``[1, b * s]`` with Megatron's ``PackedSeqParams``: attention and RoPE restart
at every document (:func:`~.data.pack_documents` builds the pack on the host). The loss covers
the same tokens, so the 3-tuple convention is unchanged.

:func:`run_schedule` is the one place the code base drives Megatron's pipeline schedule: the
training step and the validation loss (:class:`ForwardBackward`) and the long-context
evaluator's per-token scores (:mod:`.evaluation.scoring`) all go through it, with their own
forward steps built on :func:`prepare_batch`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch

from ..parallel_lengths import check_packed_sequences
from .data import pack_documents

__all__ = [
    "LOSS_KEY",
    "BATCH_KEYS",
    "loss_func",
    "forward_step",
    "packed_seq_params",
    "prepare_batch",
    "run_schedule",
    "reduce_loss",
    "StepLoss",
    "ForwardBackward",
    "zero_grad",
]

# Name of the loss report each micro-batch returns to the schedule.
LOSS_KEY = "lm loss"
# The sample fields the model consumes; the datasets also carry an attention mask we never use
# (the S2 kernels take no dense mask).
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def loss_func(loss_mask: torch.Tensor, poison: bool, output_tensor: torch.Tensor):
    """Megatron's 3-tuple loss of one micro-batch: ``(sum of token losses, token count,
    {LOSS_KEY: [loss sum, tokens]})``. ``poison`` makes the loss NaN (the NaN-stop test hook)."""
    mask = loss_mask.view(-1).float()
    loss = torch.sum(output_tensor.float().view(-1) * mask)
    if poison:
        loss = loss * float("nan")
    num_tokens = mask.sum().to(torch.int)
    # Clone: the schedule scales the returned loss in place.
    report = torch.stack([loss.detach().clone(), num_tokens.detach().float()])
    return loss, num_tokens, {LOSS_KEY: report}


def packed_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int, device: torch.device):
    """Megatron's THD ``PackedSeqParams`` for causal self-attention over packed documents.

    ``cu_seqlens``: int32 ``[num_docs + 1]`` (moved to ``device``), ``max_seqlen``: the longest
    document, a Python int (Megatron sizes RoPE by it, the kernels bound their grid by it)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )


def prepare_batch(
    batch: dict,
    device: torch.device,
    context_parallel_size: int,
    *,
    pack_eod: Optional[int] = None,
):
    """One micro-batch of host tensors (``[b, s]`` each) made ready for the model on this rank:
    packed into one THD sequence ``[1, b * s]`` when ``pack_eod`` is given (with its
    ``PackedSeqParams``), moved to ``device``, and cut to this rank's part of the sequence under
    context parallelism (Megatron's zigzag split: ``position_ids`` travel along and say where
    each kept token belongs). Returns ``(batch, packed_seq_params or None)``."""
    from ..context_parallel import batch_on_this_cp_rank

    params = None
    if pack_eod is not None:
        # On the host, from the loader's CPU tensors: no device read-back per micro-batch.
        pack = pack_documents(batch, pack_eod)
        batch = pack.batch
        params = packed_seq_params(pack.cu_seqlens, pack.max_seqlen, device)
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    if context_parallel_size > 1:
        batch = batch_on_this_cp_rank(batch)
    return batch, params


def forward_step(
    device: torch.device,
    context_parallel_size: int,
    poison: bool,
    data_iterator,
    model,
    *,
    pack_eod: Optional[int] = None,
):
    """Megatron ``forward_step_func``: the next micro-batch through ``model``.

    Bind the first three arguments (and ``pack_eod``) with ``functools.partial``; under context
    parallelism each rank keeps its part of the sequence. ``pack_eod`` (the datasets' EOD id)
    packs the micro-batch ``[b, s]`` into one sequence ``[1, b * s]`` of documents
    (:func:`~.data.pack_documents`); the output is then the per-token loss ``[1, b * s]``
    instead of ``[b, s]``, in the same token order."""
    batch = {k: v for k, v in next(data_iterator).items() if k in BATCH_KEYS}
    batch, params = prepare_batch(batch, device, context_parallel_size, pack_eod=pack_eod)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        None,
        labels=batch["labels"],
        packed_seq_params=params,
    )
    return output, partial(loss_func, batch["loss_mask"], poison)


def run_schedule(
    forward_step_func,
    data_iterators: list,
    model: list,
    *,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
) -> list:
    """One pass of Megatron's pipeline schedule for the current parallel layout (none, 1F1B or
    interleaved) over ``num_microbatches`` micro-batches of ``[micro_batch_size, seq_length]``
    (the shape the pipeline stages exchange activations of).

    ``forward_step_func(data_iterator, model)`` returns ``(output, loss_func)`` as Megatron
    expects; ``data_iterators`` and ``model`` hold one entry per virtual pipeline chunk. A
    ``forward_only`` pass runs without autograd. Returns the schedule's list of loss reports,
    one per micro-batch, on the last pipeline stage (empty elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    schedule = get_forward_backward_func()
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        return schedule(
            forward_step_func=forward_step_func,
            data_iterator=data_iterators[0] if len(data_iterators) == 1 else data_iterators,
            model=model,
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )


@dataclass(frozen=True)
class StepLoss:
    """Loss of one global batch, the same on every rank."""

    loss: float  # mean over its tokens (NaN without tokens)
    tokens: float


def reduce_loss(reports: list, device: torch.device) -> StepLoss:
    """Reduce the schedule's per-micro-batch reports over micro-batches and data-parallel ranks
    (on the last pipeline stage) and hand the result to every pipeline stage."""
    from megatron.core import parallel_state as ps

    total = torch.zeros(2, dtype=torch.float64, device=device)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        for item in reports:
            total += item[LOSS_KEY].to(device=device, dtype=torch.float64)
        torch.distributed.all_reduce(
            total, group=ps.get_data_parallel_group(with_context_parallel=True)
        )
    if ps.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.broadcast(
            total,
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
    loss_sum, tokens = total.tolist()
    return StepLoss(loss_sum / tokens if tokens > 0 else float("nan"), tokens)


class ForwardBackward:
    """Runs one global batch of ``model`` (its chunks, one per virtual pipeline stage) through
    Megatron's schedule for the current parallel layout (none, 1F1B or interleaved).

    ``pack_eod``: pack each micro-batch's documents into one THD sequence, split at this EOD id
    (``train.pack_documents``; the datasets' :attr:`~.data.Datasets.eod`); None: plain batches."""

    def __init__(
        self,
        model: list,
        *,
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        device: torch.device,
        context_parallel_size: int = 1,
        pack_eod: Optional[int] = None,
    ):
        if pack_eod is not None:
            check_packed_sequences(context_parallel_size, where="ForwardBackward")
        self.model = model
        self.num_microbatches = num_microbatches
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.device = device
        self.context_parallel_size = context_parallel_size
        self.pack_eod = pack_eod

    def __call__(
        self, data_iterators: list, *, forward_only: bool = False, poison_loss: bool = False
    ) -> StepLoss:
        """Forward (and, unless ``forward_only``, backward into the gradient buffers) over
        ``num_microbatches`` micro-batches; ``data_iterators`` holds one iterator per chunk.
        Returns the batch's loss on every rank."""
        step = partial(
            forward_step,
            self.device,
            self.context_parallel_size,
            poison_loss,
            pack_eod=self.pack_eod,
        )
        # Pipeline stages exchange activations of the shape the model runs: [b * s, 1, h] when
        # the micro-batch is one packed sequence.
        seq_length, micro_batch_size = self.seq_length, self.micro_batch_size
        if self.pack_eod is not None:
            seq_length, micro_batch_size = seq_length * micro_batch_size, 1
        reports = run_schedule(
            step,
            data_iterators,
            self.model,
            num_microbatches=self.num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )
        return reduce_loss(reports, self.device)


def zero_grad(model: list, optimizer) -> None:
    """Clear DDP's gradient buffers and the optimizer's gradients before a step."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
