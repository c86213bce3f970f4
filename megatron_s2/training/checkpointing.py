"""Save and resume with Megatron's ``dist_checkpointing`` (``torch_dist`` format).

Layout under the checkpoint directory::

    iter_0000100/                 one dist_checkpointing checkpoint per save
    latest_checkpointed_iteration.txt

The tracker file is written (atomically, by rank 0) only after every rank finished saving, so a
crash or a NaN stop during a save never points a resume at a half-written checkpoint: the last
good checkpoint stays the one that is loaded.

A checkpoint holds the model (sharded, so it loads at another TP/PP size), the optimizer (the
distributed optimizer in ``dp_reshardable`` format: it loads at another DP size but the same
TP/PP/CP), the LR scheduler, the iteration, the consumed samples (the data position) and the RNG
states of every model-parallel rank. When TP/PP/VPP/CP changed, the model and the LR schedule
are loaded and the optimizer state restarts (logged). Megatron's ``fully_reshardable`` optimizer
format would carry it across, but in megatron-core 0.16.1 it cannot be loaded into torch's AdamW
(the path used without Apex/Transformer Engine: ``KeyError: 'step'``).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .run_config import CheckpointConfig

__all__ = [
    "latest_iteration",
    "save_checkpoint",
    "load_checkpoint",
    "checkpoint_path",
    "TRACKER",
    "Checkpointer",
    "ResumePoint",
]

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
# Distributed-optimizer state format (see the module docstring).
OPTIMIZER_FORMAT = "dp_reshardable"
# The parallel sizes that shard the model (and so the optimizer state); DP is not among them.
MODEL_LAYOUT_KEYS = ("tp", "pp", "vpp", "cp")


def checkpoint_path(root: str, iteration: int) -> str:
    """Directory of the checkpoint of ``iteration`` under ``root``."""
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> Optional[int]:
    """Iteration of the newest complete checkpoint under ``root``, or None."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path}: expected an iteration number, found {text!r}") from None


def _parallel_layout() -> dict:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


def _metadata() -> dict:
    from megatron.core import parallel_state as ps

    # The distributed optimizer's default format fails in 0.16.1 ("flattened_range is not
    # supported"); these are the settings Megatron-LM itself uses.
    return {
        "distrib_optim_sharding_type": OPTIMIZER_FORMAT,
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
    }


def _unwrap(chunk):
    # DDP and Float16Module keep the model in `.module`; their state dicts nest it under a
    # "module." prefix, so save and load the GPTModel itself.
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _model_keys(n_chunks: int) -> list[str]:
    return ["model"] if n_chunks == 1 else [f"model{i}" for i in range(n_chunks)]


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.version.cuda is not None:
        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and torch.version.cuda is not None:
        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(state: Optional[dict]):
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    # One RNG state per (PP, TP) rank; data-parallel replicas hold copies (DP rank 0's is saved).
    return ShardedObject(
        "rng_state",
        state,
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
    )


def _init_empty_optimizer_state(optimizer) -> None:
    """Give a fresh torch Adam(W) zero moments and ``step`` before loading into it.

    Without Apex/TE, megatron-core 0.16.1's distributed optimizer reads ``step`` from the inner
    torch optimizer's state when it builds the sharded state dict, which a fresh optimizer does
    not have yet (its own dummy init is only wired up for Megatron-FSDP). The values are
    overwritten by the load.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW) or inner.state:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }


def _restore_adam_steps(optimizer) -> None:
    """Set every torch Adam(W) parameter's ``step`` to its group's loaded ``step``.

    In 0.16.1 without Apex/TE the distributed optimizer loads ``step`` into the param groups but
    its dp_reshardable parameter-state load leaves the per-parameter ``step`` at its dummy value,
    which would restart Adam's bias correction (the resumed loss curve would drift). Each
    parameter gets its own tensor: AdamW increments them in place.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                st = inner.state.get(p)
                if st is not None and "step" in st:
                    st["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


def _sharded_state_dict(
    model, optimizer, is_loading: bool, with_optimizer: bool, with_rng: bool
) -> dict:
    md = _metadata()
    sd = {}
    for key, chunk in zip(_model_keys(len(model)), model):
        sd[key] = _unwrap(chunk).sharded_state_dict(metadata=md)
    if with_optimizer:
        if is_loading:
            _init_empty_optimizer_state(optimizer)
        sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=md)
    if with_rng:
        sd["rng_state"] = _rng_sharded_object(None if is_loading else _rng_state())
    return sd


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _is_rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def save_checkpoint(
    root: str,
    iteration: int,
    model: list,
    optimizer,
    scheduler,
    *,
    consumed_samples: int,
    config: dict,
    keep_last: Optional[int] = None,
) -> str:
    """Save a checkpoint of ``iteration`` (collective: call on every rank); return its path."""
    from megatron.core import dist_checkpointing

    path = checkpoint_path(root, iteration)
    if _is_rank0():
        # A directory left by a save that crashed midway is not a checkpoint: start it afresh.
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.makedirs(path)
    _barrier()
    sd = _sharded_state_dict(model, optimizer, is_loading=False, with_optimizer=True, with_rng=True)
    sd["opt_param_scheduler"] = scheduler.state_dict()
    sd["iteration"] = iteration
    sd["consumed_samples"] = consumed_samples
    sd["parallel"] = _parallel_layout()
    sd["optimizer_format"] = OPTIMIZER_FORMAT
    sd["config"] = config
    dist_checkpointing.save(sd, path)
    _barrier()
    if _is_rank0():
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
        if keep_last:
            _prune(root, keep_last, keep=iteration)
    _barrier()
    return path


def _prune(root: str, keep_last: int, keep: int) -> None:
    iters = sorted(
        int(d[5:])
        for d in os.listdir(root)
        if d.startswith("iter_") and d[5:].isdigit() and int(d[5:]) <= keep
    )
    for it in iters[:-keep_last]:
        shutil.rmtree(checkpoint_path(root, it), ignore_errors=True)


def load_checkpoint(
    root: str,
    model: list,
    optimizer,
    scheduler,
    *,
    iteration: Optional[int] = None,
    load_optimizer: bool = True,
) -> tuple[int, int]:
    """Load the newest (or the given) checkpoint under ``root`` into model/optimizer/scheduler.

    Returns ``(iteration, consumed_samples)``; ``(0, 0)`` when there is no checkpoint.
    ``load_optimizer=False`` loads the model only and restarts optimizer and LR schedule.
    """
    from megatron.core import dist_checkpointing

    if iteration is None:
        iteration = latest_iteration(root)
        if iteration is None:
            return 0, 0
    path = checkpoint_path(root, iteration)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    common = dist_checkpointing.load_common_state_dict(path)
    saved, now = common["parallel"], _parallel_layout()
    same_model_layout = all(saved[k] == now[k] for k in MODEL_LAYOUT_KEYS)
    if load_optimizer and common.get("optimizer_format", OPTIMIZER_FORMAT) != OPTIMIZER_FORMAT:
        raise ValueError(
            f"checkpoint {path}: optimizer format {common['optimizer_format']!r} "
            f"is not {OPTIMIZER_FORMAT!r}; load it with "
            f"checkpoint.load_optimizer=false"
        )
    load_scheduler = load_optimizer
    if load_optimizer and not same_model_layout:
        logger.warning(
            "checkpoint %s was saved at TP/PP/VPP/CP %s and is loaded at %s: the dp_reshardable "
            "optimizer state cannot follow, so the model and the LR schedule are loaded and the "
            "optimizer state restarts",
            path,
            [saved[k] for k in MODEL_LAYOUT_KEYS],
            [now[k] for k in MODEL_LAYOUT_KEYS],
        )
        load_optimizer = False
    sd = _sharded_state_dict(
        model, optimizer, is_loading=True, with_optimizer=load_optimizer, with_rng=same_model_layout
    )
    # With fp32 parameters the optimizer's main params are views of leaf tensors that require
    # grad: every in-place copy of the load must run without autograd.
    with torch.no_grad():
        state = dist_checkpointing.load(sd, path)
        for key, chunk in zip(_model_keys(len(model)), model):
            _unwrap(chunk).load_state_dict(state[key], strict=True)
        if load_optimizer:
            optimizer.load_state_dict(state["optimizer"])
            _restore_adam_steps(optimizer)
    if load_scheduler:
        scheduler.load_state_dict(state["opt_param_scheduler"])
    if same_model_layout and state.get("rng_state") is not None:
        _set_rng_state(state["rng_state"])
    return int(state["iteration"]), int(state["consumed_samples"])


@dataclass(frozen=True)
class ResumePoint:
    """Where a run resumed: the checkpoint loaded and the training state it held."""

    path: str
    iteration: int
    consumed_samples: int


class Checkpointer:
    """The run's checkpoints: what to resume from, when to save, where saves go.

    Args:
        config: the run config's ``checkpoint`` section.
        directory: the run's own checkpoint directory (``checkpoint.dir`` or its default).
        model, optimizer, scheduler: what a checkpoint holds (model chunks, Megatron optimizer,
            ``OptimizerParamScheduler``).
        run_config: the run config as a mapping, stored in every checkpoint.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        directory: str,
        *,
        model: list,
        optimizer,
        scheduler,
        run_config: dict,
    ):
        self.config = config
        self.directory = directory
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.run_config = run_config
        self.last_checkpoint: Optional[str] = None
        self._start_iteration = 0

    def load(self) -> Optional[ResumePoint]:
        """Load the checkpoint to resume from (collective); None when there is none or
        ``checkpoint.resume`` is off.

        The run's own checkpoints win over ``checkpoint.load_dir``: a preempted run that started
        from another run's checkpoint must resume from where it got to.
        """
        if not self.config.resume:
            return None
        root = self.directory
        if latest_iteration(root) is None and self.config.load_dir:
            root = self.config.load_dir
        if latest_iteration(root) is None:
            return None
        iteration, consumed = load_checkpoint(
            root,
            self.model,
            self.optimizer,
            self.scheduler,
            load_optimizer=self.config.load_optimizer,
        )
        self.last_checkpoint = checkpoint_path(root, iteration)
        self._start_iteration = iteration
        return ResumePoint(self.last_checkpoint, iteration, consumed)

    def should_save(self, iteration: int) -> bool:
        """Save after ``iteration``? Every ``checkpoint.save_interval`` iterations (0 = never)."""
        return bool(self.config.save_interval) and iteration % self.config.save_interval == 0

    def should_save_at_end(self, iteration: int) -> bool:
        """Save when the run finishes at ``iteration``? With ``checkpoint.save_at_end``, unless
        this process trained nothing or ``iteration`` is already saved here."""
        return (
            self.config.save_at_end
            and iteration != self._start_iteration
            and self.last_checkpoint != checkpoint_path(self.directory, iteration)
        )

    def save(self, iteration: int, consumed_samples: int) -> str:
        """Save the state after ``iteration`` (collective); returns the checkpoint's path."""
        self.last_checkpoint = save_checkpoint(
            self.directory,
            iteration,
            self.model,
            self.optimizer,
            self.scheduler,
            consumed_samples=consumed_samples,
            config=self.run_config,
            keep_last=self.config.keep_last,
        )
        return self.last_checkpoint
