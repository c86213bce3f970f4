"""Per-token scores of whole sequences under the run's parallel layout: the log-likelihood of
each next token and the model's greedy choice, the measurements every long-context evaluation
is made of.

Sequences go through Megatron's pipeline schedule forward-only, by the trainer's own driver
(:func:`~..step.run_schedule`) with a forward step that keeps the logits
(:func:`score_step`), so a 128k evaluation fits wherever the run's training fitted. The greedy
token is exact under tensor parallelism (an argmax over the gathered vocabulary shards), and the
log-likelihood is Megatron's vocab-parallel cross-entropy, as in training.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from ..step import prepare_batch, run_schedule
from .model import EvalModel

__all__ = ["score_sequences", "score_step"]


def _tp_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the whole vocabulary of vocab-parallel ``logits [..., V/tp]`` (global ids)."""
    from megatron.core import parallel_state as ps

    best, ids = logits.max(dim=-1)
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return ids
    ids = ids + ps.get_tensor_model_parallel_rank() * logits.shape[-1]
    group = ps.get_tensor_model_parallel_group()
    bests = [torch.empty_like(best) for _ in range(tp)]
    all_ids = [torch.empty_like(ids) for _ in range(tp)]
    torch.distributed.all_gather(bests, best.contiguous(), group=group)
    torch.distributed.all_gather(all_ids, ids.contiguous(), group=group)
    # The lowest rank wins ties, as a single argmax over the full vocabulary would pick.
    winner = torch.stack(bests).argmax(dim=0, keepdim=True)
    return torch.stack(all_ids).gather(0, winner).squeeze(0)


def _scores(labels: torch.Tensor, positions: torch.Tensor, logits: torch.Tensor):
    """Loss function of the schedule: per-token ``[3, b, s_local]`` (nll, greedy id, position)
    in the report; the 3-tuple keeps Megatron's per-token convention."""
    from megatron.core import tensor_parallel

    greedy = _tp_argmax(logits)
    # Megatron's vocab-parallel CE, as the model computes its training loss (it shifts the
    # logits in place: the argmax is taken first). logits [b, s, V/tp] -> CE wants [s, b, V/tp].
    nll = tensor_parallel.vocab_parallel_cross_entropy(
        logits.float().transpose(0, 1).contiguous(), labels.transpose(0, 1).contiguous()
    ).transpose(0, 1)
    report = torch.stack([nll.double(), greedy.double(), positions.double()])
    return nll.sum(), torch.tensor(labels.numel(), dtype=torch.int), {"scores": report}


def score_step(device: torch.device, cp: int, data_iterator, model):
    """Megatron ``forward_step_func`` of the scoring: the next micro-batch (``tokens``,
    ``labels``, ``position_ids``, ``[b, s]`` each) through ``model`` for its logits, and
    :func:`_scores` as the loss function. Bind ``device`` and ``cp`` (the context-parallel size)
    with ``functools.partial``."""
    batch, _ = prepare_batch(next(data_iterator), device, cp)
    logits = model(batch["tokens"], batch["position_ids"], None)
    return logits, partial(_scores, batch["labels"], batch["position_ids"])


def score_sequences(
    em: EvalModel, sequences: np.ndarray, *, micro_batch_size: int = 1
) -> dict[str, np.ndarray]:
    """Per-token scores of ``sequences`` (int ``[n, L + 1]``: the model reads ``[:, :L]`` and
    predicts ``[:, 1:]``); collective over all ranks, every rank passes the same sequences.

    Returns, the same on every rank, arrays ``[n, L]``: ``nll`` (nats, -log p of token
    ``t + 1`` given tokens ``0..t``), ``greedy`` (the model's argmax id at ``t``), ``correct``
    (``greedy == token t + 1``). Data-parallel ranks split the sequences; each micro-batch goes
    through Megatron's schedule (:func:`~..step.run_schedule`, the trainer's own: pipeline
    stages, CP chunks and TP shards handled there).
    """
    from megatron.core import parallel_state as ps

    n, length = sequences.shape[0], sequences.shape[1] - 1
    mine = list(range(em.dp_rank, n, em.dp_size))
    batches = [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
    # One schedule call per micro-batch size: the pipeline exchanges activations of one shape,
    # so a short last micro-batch goes on its own.
    calls = [
        [b for b in batches if len(b) == micro_batch_size],
        [b for b in batches[-1:] if len(b) != micro_batch_size],
    ]
    calls = [c for c in calls if c]
    totals = torch.zeros(3, n, length, dtype=torch.float64, device=em.device)
    counts = torch.zeros(n, length, dtype=torch.float64, device=em.device)
    cp = em.cfg.parallel.context_parallel_size
    positions = torch.arange(length).unsqueeze(0)
    for group in calls:
        data = [
            {
                "tokens": torch.from_numpy(sequences[rows, :-1].astype(np.int64)),
                "labels": torch.from_numpy(sequences[rows, 1:].astype(np.int64)),
                "position_ids": positions.expand(len(rows), -1).contiguous(),
            }
            for rows in group
        ]
        reports = run_schedule(
            partial(score_step, em.device, cp),
            [iter(data) for _ in em.model],
            em.model,
            num_microbatches=len(data),
            seq_length=length,
            micro_batch_size=len(group[0]),
            forward_only=True,
        )
        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            continue
        for rows, report in zip(group, reports):
            scores = report["scores"]  # [3, b, s_local]
            pos = scores[2].long()
            for j, row in enumerate(rows):
                totals[:, row].index_add_(1, pos[j], scores[:, j])
                counts[row].index_add_(0, pos[j], torch.ones_like(scores[0, j]))
    # Every position is owned by its TP replicas of one DP rank's last stage: summing what each
    # rank holds over the world and dividing by the owners gives everyone the whole result.
    torch.distributed.all_reduce(totals)
    torch.distributed.all_reduce(counts)
    if bool((counts == 0).any()):
        raise RuntimeError("score_sequences: some token positions were scored by no rank")
    mean = (totals / counts).cpu().numpy()
    greedy = np.rint(mean[1]).astype(np.int64)
    return {
        "nll": mean[0],
        "greedy": greedy,
        "correct": greedy == sequences[:, 1:],
    }
