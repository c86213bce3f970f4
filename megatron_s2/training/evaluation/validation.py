"""Validation loss on the held-out split, every ``train.eval_interval`` iterations and at the end.

Every evaluation reads the same ``train.eval_iters`` global batches from the start of the
validation split, so the validation curve compares like with like.
"""

from __future__ import annotations

from ..data import chunk_micro_batches
from ..run_config import TrainConfig
from ..step import ForwardBackward

__all__ = ["Evaluator"]


class Evaluator:
    """Decides when to evaluate and computes the validation loss.

    Args:
        train: the run's ``train`` section (``eval_interval``, ``eval_iters``, ``train_iters``,
            ``micro_batch_size``); ``eval_interval`` or ``eval_iters`` 0 turns evaluation off.
        dataset: the validation dataset, or None when the split has none.
        forward_backward: runs one global batch of the model being trained.
        dp_rank, dp_size: this rank's data-parallel position.
    """

    def __init__(
        self,
        train: TrainConfig,
        dataset,
        forward_backward: ForwardBackward,
        *,
        dp_rank: int,
        dp_size: int,
    ):
        self.interval = train.eval_interval
        self.iters = train.eval_iters
        self.train_iters = train.train_iters
        self.micro_batch_size = train.micro_batch_size
        self.dataset = dataset
        self.forward_backward = forward_backward
        self.dp_rank, self.dp_size = dp_rank, dp_size

    @property
    def enabled(self) -> bool:
        """Whether this run evaluates at all."""
        return bool(self.interval and self.iters and self.dataset is not None)

    def should_run(self, iteration: int) -> bool:
        """Evaluate after ``iteration``? Every ``eval_interval`` iterations and after the last."""
        return self.enabled and (iteration % self.interval == 0 or iteration == self.train_iters)

    def run(self) -> float:
        """Mean validation loss per token over ``eval_iters`` global batches (collective)."""
        model = self.forward_backward.model
        for chunk in model:
            chunk.eval()
        iterators = chunk_micro_batches(
            len(model),
            self.dataset,
            0,
            self.micro_batch_size,
            self.dp_rank,
            self.dp_size,
            cycle=True,
        )
        loss_sum = tokens = 0.0
        try:
            # forward_only: the schedule runs without autograd (step.run_schedule).
            for _ in range(self.iters):
                batch = self.forward_backward(iterators, forward_only=True)
                loss_sum += batch.loss * batch.tokens
                tokens += batch.tokens
        finally:
            for it in iterators:
                it.close()
            for chunk in model:
                chunk.train()
        return loss_sum / tokens
