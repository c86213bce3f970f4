"""Training and validation data through Megatron's GPT dataset and blending builders.

Indexed datasets (``.bin/.idx``, written by :mod:`megatron_s2.training.preprocess`) are blended
and split by Megatron's ``BlendedMegatronDatasetBuilder`` into
:class:`~megatron.core.datasets.gpt_dataset.GPTDataset` samples of ``seq_length + 1`` tokens.
Documents are concatenated with their EOD tokens the Megatron way (a sample may span documents;
``train.reset_position_ids`` / ``train.eod_mask_loss`` change how boundaries are treated).

Sample order is a pure function of the number of samples consumed so far: step ``i`` reads global
samples ``[i * global_batch, (i + 1) * global_batch)``, and data-parallel rank ``r`` takes its slice
of every micro-batch. Resuming therefore only needs ``consumed_samples`` (stored in checkpoints),
and it continues the same sample stream even at a different data-parallel size.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch

from .run_config import ConfigError

__all__ = ["DatasetTokenizer", "build_datasets", "micro_batches", "chunk_micro_batches", "Datasets"]


class DatasetTokenizer:
    """The few tokenizer attributes Megatron's datasets read, plus the identity used in cache keys.

    Megatron hashes the tokenizer's ``unique_identifiers`` into the names of its cached sample
    indices, so two tokenizers never share a cache.
    """

    def __init__(self, tokenizer):
        self.vocab_size = tokenizer.vocab_size
        self.eod = tokenizer.eod
        pad = getattr(tokenizer, "pad", None)
        # Tokenizers without a pad token report EOD as pad; Megatron would mask EOD labels as
        # padding, so it only gets a pad id that is really distinct.
        if pad is not None and pad != tokenizer.eod:
            self.pad = pad
        self.unique_identifiers = {
            "class": type(tokenizer).__name__,
            "spec": str(getattr(tokenizer, "spec", type(tokenizer).__name__)),
            "vocab_size": tokenizer.vocab_size,
            "eod": tokenizer.eod,
        }


@dataclass
class Datasets:
    train: object
    valid: Optional[object]


def build_datasets(
    prefixes: list[str],
    weights: Optional[list[float]],
    *,
    tokenizer,
    seq_length: int,
    seed: int,
    split: str,
    train_samples: int,
    valid_samples: int,
    cache_dir: Optional[str] = None,
    reset_position_ids: bool = False,
    eod_mask_loss: bool = False,
) -> Datasets:
    """Build the blended train/valid GPT datasets (call on every rank, after torch.distributed).

    ``weights`` None weighs corpora by their size. Raises :class:`ConfigError` naming a prefix
    whose ``.bin``/``.idx`` is missing, or a split that leaves a needed part empty.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise ConfigError(
                    f"data.blend: {prefix + ext} does not exist (prefixes name .bin/.idx pairs "
                    f"written by tools/prepare_data.py, without the extension)"
                )
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=split,
        path_to_cache=cache_dir,
        tokenizer=DatasetTokenizer(tokenizer),
        reset_position_ids=reset_position_ids,
        # The S2 kernels take no dense mask: documents in one sample attend across EOD, as in
        # Megatron's default pretraining; a dense [s, s] mask would also cost s^2 memory.
        reset_attention_mask=False,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=False,
    )
    # Every rank builds (rank 0 first writes the index cache, the builder synchronises the rest):
    # our batches are small and reading them on every rank avoids a broadcast per micro-batch.
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, valid_samples, 0], lambda: True, config
    ).build()
    if train is None:
        raise ConfigError(f"data.split {split!r} leaves no training data")
    if valid_samples > 0 and valid is None:
        raise ConfigError(
            f"data.split {split!r} leaves no validation data but "
            f"train.eval_iters > 0; give the valid split a weight or set "
            f"train.eval_iters=0"
        )
    return Datasets(train=train, valid=valid)


class _MicroBatchSampler(torch.utils.data.Sampler):
    """Index lists of this rank's micro-batches, starting after ``consumed`` global samples."""

    def __init__(
        self, total: int, consumed: int, micro_batch_size: int, dp_rank: int, dp_size: int
    ):
        self.total, self.consumed = total, consumed
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self):
        stride = self.mbs * self.dp_size
        start = self.consumed
        while start + stride <= self.total:
            first = start + self.dp_rank * self.mbs
            yield list(range(first, first + self.mbs))
            start += stride

    def __len__(self):
        return max(0, (self.total - self.consumed) // (self.mbs * self.dp_size))


def _ignore_sigterm(_worker_id: int) -> None:
    # Slurm signals every process of a job step: a loader worker killed by that SIGTERM would
    # crash the trainer before its graceful-stop checkpoint. Workers exit when their loader is
    # shut down (the trainer closes its iterators), not on the signal.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def micro_batches(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    cycle: bool = False,
) -> Iterator[dict]:
    """Iterate this data-parallel rank's micro-batches (dicts of CPU tensors).

    ``cycle`` restarts from sample 0 when the dataset is exhausted (used for validation, which
    reads the same held-out samples at every evaluation).
    """
    while True:
        sampler = _MicroBatchSampler(
            len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size
        )
        if len(sampler) == 0:
            raise ValueError(
                f"dataset of {len(dataset)} samples has no micro-batch left after "
                f"{consumed_samples} consumed samples"
            )
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=num_workers,
            persistent_workers=False,
            worker_init_fn=_ignore_sigterm if num_workers else None,
        )
        yield from loader
        if not cycle:
            return
        consumed_samples = 0


def chunk_micro_batches(
    num_chunks: int,
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    cycle: bool = False,
) -> list[Iterator[dict]]:
    """One :func:`micro_batches` iterator per model chunk, all over the same samples: an
    interleaved pipeline schedule calls ``next()`` once per chunk for every micro-batch."""
    return [
        micro_batches(
            dataset,
            consumed_samples,
            micro_batch_size,
            dp_rank,
            dp_size,
            num_workers=num_workers,
            cycle=cycle,
        )
        for _ in range(num_chunks)
    ]
