"""Save and resume with Megatron's ``dist_checkpointing`` (``torch_dist`` format).

Layout under the checkpoint directory::

    iter_0000100/                 one dist_checkpointing checkpoint per save
    latest_checkpointed_iteration.txt

The tracker file is written (atomically, by rank 0) only after every rank finished saving, so a
crash or a NaN stop during a save never points a resume at a half-written checkpoint: the last
good checkpoint stays the one that is loaded. Before a resume, :func:`find_checkpoint` checks the
checkpoint the tracker names (``metadata.json``, ``common.pt`` and ``.metadata`` readable, every
shard file as long as ``.metadata`` says) and falls back to the newest intact older one, saying
what was wrong; with a garbled or missing tracker it takes the newest intact ``iter_*``.

A failed save (full disk, read-only folder) raises :class:`CheckpointError` naming the
checkpoint, the free space and the last complete checkpoint, and removes the partial folder.

A checkpoint holds the model (sharded, so it loads at another TP/PP size), the optimizer (the
distributed optimizer in ``dp_reshardable`` format: it loads at another DP size but the same
TP/PP/CP), the LR scheduler, the iteration, the consumed samples (the data position) and the RNG
states of every model-parallel rank. When TP/PP/VPP/CP changed, the model and the LR schedule
are loaded and the optimizer state restarts (logged). Megatron's ``fully_reshardable`` optimizer
format would carry it across, but in megatron-core 0.16.1 it cannot be loaded into torch's AdamW
(the path used without Apex/Transformer Engine: ``KeyError: 'step'``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import queue
import random
import shutil
import signal
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch

from .cpu_mode import cpu_mode_enabled
from .errors import CheckpointError
from .run_config import CheckpointConfig
from .run_dir import human_bytes

__all__ = [
    "latest_iteration",
    "save_checkpoint",
    "load_checkpoint",
    "checkpoint_path",
    "verify_checkpoint",
    "find_checkpoint",
    "estimate_checkpoint_bytes",
    "read_checkpoint_config",
    "stored_run_dir",
    "TRACKER",
    "Checkpointer",
    "ResumeCandidate",
    "find_resume",
    "ResumePoint",
]

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
# Distributed-optimizer state format (see the module docstring).
OPTIMIZER_FORMAT = "dp_reshardable"
# The parallel sizes that shard the model (and so the optimizer state); DP is not among them.
MODEL_LAYOUT_KEYS = ("tp", "pp", "vpp", "cp")
# The optimizer format of a checkpoint that holds the model weights alone (no optimizer state,
# no LR schedule): what megatron_s2.hf's import writes.
WEIGHTS_ONLY = "none"


# Bytes per parameter of the optimizer state in a checkpoint: Adam's two fp32 moments and the
# fp32 main copy of the weights (saved also when the model itself is fp32).
OPTIMIZER_BYTES_PER_PARAM = 12
# A checkpoint's size beyond its tensors (metadata, RNG states, alignment): a safety margin.
CHECKPOINT_OVERHEAD = 1.1
CHECKPOINT_OVERHEAD_BYTES = 4 * 2**20


def checkpoint_path(root: str, iteration: int) -> str:
    """Directory of the checkpoint of ``iteration`` under ``root``."""
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> Optional[int]:
    """Iteration the tracker file under ``root`` names (the newest complete save), or None."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, errors="replace") as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path}: expected an iteration number, found {text[:40]!r}") from None


def _iteration_dirs(root: str) -> list[int]:
    """Iterations of the ``iter_NNNNNNN`` folders under ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    return sorted(
        (int(d[5:]) for d in os.listdir(root) if d.startswith("iter_") and d[5:].isdigit()),
        reverse=True,
    )


def verify_checkpoint(path: str) -> Optional[str]:
    """What is wrong with the checkpoint folder ``path``, or None when it looks intact.

    Checks that the files a complete ``torch_dist`` save writes are there and readable
    (``metadata.json`` is written last), that ``common.pt`` loads, and that every shard file
    ``.metadata`` lists exists and is as long as its entries need (a truncated shard, e.g. from
    a full disk, is found here instead of failing inside the load). Reads no tensor data.
    """
    if not os.path.isdir(path):
        return "the folder does not exist"
    for name in ("metadata.json", ".metadata"):
        if not os.path.isfile(os.path.join(path, name)):
            return f"{name} is missing (an incomplete save?)"
    try:
        with open(os.path.join(path, "metadata.json")) as f:
            json.load(f)
    except (OSError, ValueError) as e:
        return f"metadata.json is unreadable ({type(e).__name__}: {e})"
    # megatron-core 0.16 writes the common (non-sharded) state to common.pt; 0.19 stores it in
    # the shard files under common_state/ keys instead.
    common = os.path.join(path, "common.pt")
    if os.path.isfile(common):
        try:
            torch.load(common, map_location="cpu", weights_only=False)
        except Exception as e:  # EOFError, UnpicklingError, RuntimeError (zip), OSError
            return f"common.pt is unreadable ({type(e).__name__}: {e})"
    try:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(path).read_metadata()
        storage = metadata.storage_data
    except Exception as e:
        return f".metadata is unreadable ({type(e).__name__}: {e})"
    if not os.path.isfile(common) and not any(
        str(key).startswith("common_state/") for key in metadata.state_dict_metadata
    ):
        return "common.pt is missing (an incomplete save?)"
    needed: dict[str, int] = {}
    for info in storage.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"shard {name} is missing"
        have = os.path.getsize(file)
        if have < size:
            return f"shard {name} is truncated ({have} of {size} bytes)"
        try:
            with open(file, "rb") as f:
                f.seek(size - 1)
                f.read(1)
        except OSError as e:
            return f"shard {name} is unreadable ({e})"
    return None


def find_checkpoint(root: str) -> tuple[Optional[int], list[str]]:
    """The newest intact checkpoint under ``root``: ``(iteration or None, problems)``.

    Starts at the iteration the tracker names and falls back to older ``iter_*`` folders; newer
    folders than the tracker's are unfinished saves and are skipped. Without a readable tracker
    every ``iter_*`` folder is a candidate, newest first. ``problems`` says, one entry per
    skipped checkpoint (or garbled tracker), what was wrong; it is empty when the tracker's
    checkpoint is intact.
    """
    problems = []
    try:
        tracked = latest_iteration(root)
    except ValueError as e:
        tracked = None
        problems.append(str(e))
    on_disk = _iteration_dirs(root)
    if tracked is not None:
        candidates = [tracked] + [it for it in on_disk if it < tracked]
    else:
        candidates = on_disk
    for it in candidates:
        path = checkpoint_path(root, it)
        problem = verify_checkpoint(path)
        if problem is None:
            return it, problems
        problems.append(f"{path}: {problem}")
    return None, problems


def estimate_checkpoint_bytes(num_params: int, param_bytes: int, with_optimizer: bool) -> int:
    """Disk space one checkpoint of ``num_params`` parameters (all ranks) takes, with margin."""
    per_param = param_bytes + (OPTIMIZER_BYTES_PER_PARAM if with_optimizer else 0)
    return int(num_params * per_param * CHECKPOINT_OVERHEAD) + CHECKPOINT_OVERHEAD_BYTES


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
    # In CPU mode torch.cuda.get_rng_state() returns the CPU generator's state (cpu_mode maps
    # it), which a GPU run could not load ("RNG state is wrong size"): a checkpoint written in CPU
    # mode on a machine with a GPU (e.g. `megatron-s2-hf import`) carries no CUDA state.
    if torch.cuda.is_available() and torch.version.cuda is not None and not cpu_mode_enabled():
        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if (
        "cuda" in state
        and torch.cuda.is_available()
        and torch.version.cuda is not None
        and not cpu_mode_enabled()
    ):
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


def _free_space(path: str) -> str:
    try:
        return human_bytes(shutil.disk_usage(path).free)
    except OSError:
        return "unknown"


def _error_text(error: BaseException) -> str:
    """``Type: message`` of the error that really happened: torch's CheckpointException wraps
    each rank's failure with its traceback; the last line of the first one says it."""
    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))
        if isinstance(error, tuple):  # (exception, traceback summary)
            error = error[0]
    lines = [ln.strip() for ln in str(error).strip().splitlines() if ln.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}".rstrip(": ")


def file_size_limit() -> Optional[int]:
    """This process's file-size limit in bytes (``ulimit -f``, RLIMIT_FSIZE), None if none."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft


def _hit_file_size_limit(error: BaseException) -> bool:
    """Whether ``error`` is a write stopped by the file-size limit: ``EFBIG`` from a plain
    write (the checkpoint shards), or torch.save's zip writer's ``unexpected pos`` (common.pt),
    which is how that writer reports a short write; only while a limit is set."""
    if file_size_limit() is None:
        return False
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, tuple):  # a torch CheckpointException failure: (exception, traceback)
            todo.extend(x for x in e if isinstance(x, BaseException))
            continue
        if isinstance(e, OSError) and e.errno == errno.EFBIG:
            return True
        if "unexpected pos" in str(e) or "File too large" in str(e):
            return True
        todo.extend([e.__cause__, e.__context__, *(getattr(e, "failures", None) or {}).values()])
    return False


def _save_failed(root: str, path: str, error: BaseException) -> str:
    try:
        last = latest_iteration(root)
    except ValueError:
        last = None
    last_text = (
        f"the last complete checkpoint is {checkpoint_path(root, last)} ({TRACKER} still names it)"
        if last is not None
        else "no checkpoint of this run was completed"
    )
    if _hit_file_size_limit(error):
        # Not a full disk: the free space would point at the wrong cause.
        limit = file_size_limit()
        return (
            f"saving checkpoint {path} failed: a file of it reached this process's file-size "
            f"limit (ulimit -f: {human_bytes(limit)}). Raise the limit (ulimit -f unlimited, "
            f"or the job's setting) and resume; {last_text}. The partial folder was removed."
        )
    return (
        f"saving checkpoint {path} failed ({_error_text(error)}). Free space there: "
        f"{_free_space(root)}; {last_text}. The partial folder was removed."
    )


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def helpers_ignore_stop_signals():
    """Processes that multiprocessing spawns in this block ignore SIGINT and SIGTERM for life.

    A terminal's Ctrl-C reaches the whole process group, and Slurm's SIGTERM every process of a
    job step. megatron-core's checkpoint writer spawns a helper (a ``multiprocessing`` Manager
    for its results queue) at a process's first save; a stop signal caught while that helper
    imports killed it, and the save the signal asked for failed (found in CI, EOFError). The
    trainer's own handlers turn these signals into a graceful stop, so the helpers must not act
    on them. Blocking the signal would not do: a spawned interpreter starts with an empty signal
    mask. An ignored disposition does survive exec, so for just the fork/exec of each spawn
    (milliseconds; a signal landing in them is lost) this process ignores both signals. Outside
    the main thread handlers cannot change: no-op. Forked children need nothing: they inherit
    the trainer's handlers.
    """
    from multiprocessing import util

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    spawn = util.spawnv_passfds

    def spawn_ignoring_stop_signals(path, args, passfds):
        previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        # None: a handler not set from Python, which could not be put back afterwards.
        settable = [s for s, h in previous.items() if h is not None]
        for s in settable:
            signal.signal(s, signal.SIG_IGN)
        try:
            return spawn(path, args, passfds)
        finally:
            for s in settable:
                signal.signal(s, previous[s])

    util.spawnv_passfds = spawn_ignoring_stop_signals
    try:
        yield
    finally:
        util.spawnv_passfds = spawn


@contextlib.contextmanager
def _cpu_mode_write_results_in_process():
    """In CPU mode, the checkpoint writer's results go through a plain in-process queue.

    megatron-core (0.16.1 to 0.19.x) hands the torch_dist writer's results to the finishing step
    through ``filesystem_async._results_queue``, a queue of a ``multiprocessing`` Manager that it
    spawns at a process's first save. The first ``put`` makes that fresh interpreter import
    torch to unpickle the results (torch ``WriteResult`` objects): about 3 s on every CPU
    process's first save, measured with the demo config, where the save itself takes 0.2 s, and
    CI runs many short trainer processes. The trainer saves synchronously, so the results are
    put and taken by this very process (``AsyncRequest.execute_sync``) and a ``queue.Queue``
    carries them as well. What is written does not change (same writers, files, fsync and
    metadata). A fresh queue per save, and megatron-core's own is put back afterwards. GPU
    runs keep megatron-core's queue.
    """
    if not cpu_mode_enabled():
        yield
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):  # a megatron-core that has none
        yield
        return
    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = previous


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
    extra: Optional[dict] = None,
) -> str:
    """Save a checkpoint of ``iteration`` (collective: call on every rank); return its path.

    ``optimizer`` and ``scheduler`` None save the model weights alone (an imported model,
    :mod:`megatron_s2.hf`): such a checkpoint loads with ``load_optimizer=False`` only.
    ``extra``: more common (unsharded) entries, e.g. the padded vocabulary size. Raises
    :class:`CheckpointError` (message: where, free space, last complete checkpoint) when the
    save fails; the tracker then still names the last complete checkpoint.
    """
    from megatron.core import dist_checkpointing

    path = checkpoint_path(root, iteration)
    try:
        if _is_rank0():
            # A directory left by a save that crashed midway is not a checkpoint: start afresh.
            if os.path.isdir(path):
                shutil.rmtree(path)
            os.makedirs(path)
        _barrier()
        with_optimizer = optimizer is not None
        sd = _sharded_state_dict(
            model, optimizer, is_loading=False, with_optimizer=with_optimizer, with_rng=True
        )
        if scheduler is not None:
            sd["opt_param_scheduler"] = scheduler.state_dict()
        sd["iteration"] = iteration
        sd["consumed_samples"] = consumed_samples
        sd["parallel"] = _parallel_layout()
        # "none": weights only; load_checkpoint's format check then asks for load_optimizer=false.
        sd["optimizer_format"] = OPTIMIZER_FORMAT if with_optimizer else WEIGHTS_ONLY
        sd["config"] = config
        sd.update(extra or {})
        with helpers_ignore_stop_signals(), _cpu_mode_write_results_in_process():
            dist_checkpointing.save(sd, path)
        _barrier()
        if _is_rank0():
            tmp = os.path.join(root, TRACKER + ".tmp")
            with open(tmp, "w") as f:
                f.write(str(iteration))
            os.replace(tmp, os.path.join(root, TRACKER))
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        message = _save_failed(root, path, e)
        if _is_rank0():
            shutil.rmtree(path, ignore_errors=True)
        raise CheckpointError(message) from e
    if _is_rank0() and keep_last:
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


def _set_optimizer_hyperparameters(optimizer, config) -> None:
    """Put the values of ``config`` (the run's ``optimizer`` section) into every param group:
    loading the optimizer state restores the checkpoint's param groups, whose ``max_lr`` and
    ``min_lr`` the scheduler reads (over its own) and whose betas and epsilon Adam uses. The
    learning rate and weight decay themselves are set by the scheduler."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in getattr(opt, "optimizer", opt).param_groups:
            group["max_lr"], group["min_lr"] = config.lr, config.min_lr
            if "betas" in group:
                group["betas"] = (config.adam_beta1, config.adam_beta2)
            if "eps" in group:
                group["eps"] = config.adam_eps


def read_checkpoint_config(path: str) -> tuple[Optional[dict], Optional[int]]:
    """The run config stored in the checkpoint ``path`` and its padded vocabulary size (None
    for checkpoints written before it was stored)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(path)
    return common.get("config"), common.get("padded_vocab_size")


def stored_run_dir(root: str) -> Optional[str]:
    """The run directory (absolute; a relative one as seen from here) that the run config
    stored in the newest checkpoint under ``root`` names: ``logging.run_dir``, else
    ``runs/<name>``. None when there is no checkpoint, or it cannot be read (a damaged one is
    reported when the run looks for one to resume)."""
    try:
        iterations = _iteration_dirs(root)
        if not iterations:
            return None
        saved, _ = read_checkpoint_config(checkpoint_path(root, max(iterations)))
    except Exception:
        return None
    if not isinstance(saved, dict):
        return None
    run_dir = (saved.get("logging") or {}).get("run_dir")
    if not run_dir and saved.get("name"):
        run_dir = os.path.join("runs", str(saved["name"]))
    return os.path.realpath(run_dir) if run_dir else None


def load_checkpoint(
    root: str,
    model: list,
    optimizer,
    scheduler,
    *,
    iteration: Optional[int] = None,
    load_optimizer: bool = True,
    load_scheduler: Optional[bool] = None,
    schedule_from_config: bool = False,
    optimizer_config=None,
) -> tuple[int, int]:
    """Load the newest (or the given) checkpoint under ``root`` into model/optimizer/scheduler.

    Returns ``(iteration, consumed_samples)``; ``(0, 0)`` when there is no checkpoint.
    ``load_optimizer=False`` loads the model only and restarts optimizer and LR schedule.
    ``load_scheduler``: load the LR schedule's state (default: with the optimizer); False keeps
    the scheduler as built (a fresh schedule from step 0).

    ``schedule_from_config``: the scheduler keeps the LR/WD schedule it was built with (the
    run config's) and takes only its step count from the checkpoint; otherwise Megatron's
    default restores the checkpoint's schedule (``use_checkpoint_opt_param_scheduler``).
    ``optimizer_config`` (the run's ``optimizer`` section): its peak/minimum LR, Adam betas and
    epsilon replace the checkpoint's in the loaded param groups.
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
    load_scheduler = load_optimizer if load_scheduler is None else load_scheduler
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
    saved_optimizer = (common.get("config") or {}).get("optimizer")
    if load_optimizer and saved_optimizer:
        # megatron-core 0.19 matches saved param groups by their hyperparameters (max_lr and
        # min_lr among them): load under the checkpoint's values, then put the run's back.
        _set_optimizer_hyperparameters(optimizer, SimpleNamespace(**saved_optimizer))
    sd = _sharded_state_dict(
        model, optimizer, is_loading=True, with_optimizer=load_optimizer, with_rng=same_model_layout
    )
    fresh = _parameters_new_to_checkpoint(sd, path, load_optimizer)
    # With fp32 parameters the optimizer's main params are views of leaf tensors that require
    # grad: every in-place copy of the load must run without autograd.
    try:
        with torch.no_grad():
            state = dist_checkpointing.load(sd, path)
            for key, chunk in zip(_model_keys(len(model)), model):
                # Parameters the checkpoint lacks keep their initial values (strict otherwise).
                _unwrap(chunk).load_state_dict(state[key] | fresh.get(key, {}), strict=True)
            if load_optimizer:
                optimizer.load_state_dict(state["optimizer"])
                _restore_adam_steps(optimizer)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(
            f"loading checkpoint {path} failed ({_error_text(e)}). Its files passed the "
            f"start-up checks, so their contents are damaged: move the folder aside and the "
            f"newest intact older checkpoint is used"
        ) from e
    if optimizer is not None and not load_optimizer:
        # A bf16 (or fp16) optimizer steps its fp32 main copy of the weights, made when it was
        # built, and copies that back into the model: without this refresh the first step of a
        # start from another run's weights (checkpoint.load_optimizer=false, or a new TP/PP/CP
        # layout) would put the fresh model's random weights back (Megatron-LM does the same).
        optimizer.reload_model_params()
    if load_optimizer and optimizer_config is not None:
        _set_optimizer_hyperparameters(optimizer, optimizer_config)
    if load_scheduler:
        if schedule_from_config:
            scheduler.override_opt_param_scheduler = True
            scheduler.use_checkpoint_opt_param_scheduler = False
        scheduler.load_state_dict(state["opt_param_scheduler"])
    if same_model_layout and state.get("rng_state") is not None:
        _set_rng_state(state["rng_state"])
    return int(state["iteration"]), int(state["consumed_samples"])


# Parameters a run may add to another run's weights, by the end of their state-dict names: a lever
# turned on when a run starts from a checkpoint trained without it (attention.s2.sinks or
# attention.dense_layers.sinks, e.g. on the dense -> S2 hybrid extension). They start at their
# initial values; any other parameter the checkpoint lacks is still an error.
NEW_PARAMETER_SUFFIXES = (".sinks",)


def _parameters_new_to_checkpoint(sd: dict, path: str, load_optimizer: bool) -> dict:
    """Take the parameters of :data:`NEW_PARAMETER_SUFFIXES` that the checkpoint at ``path``
    lacks out of ``sd`` (the sharded state dict to load) and return them, ``{model key:
    {state-dict name: tensor}}``, so that the model keeps their initial values; logged. Raises
    ``ValueError`` where the optimizer state is to be loaded too: it has no state for them."""
    from megatron.core import dist_checkpointing

    candidates = [
        (key, name)
        for key in sd
        if key.startswith("model")
        for name in sd[key]
        if name.endswith(NEW_PARAMETER_SUFFIXES)
    ]
    if not candidates:
        return {}
    saved = dist_checkpointing.load_tensors_metadata(path)
    fresh: dict = {}
    for key, name in candidates:
        tensor = sd[key][name]
        if getattr(tensor, "key", name) in saved:
            continue
        fresh.setdefault(key, {})[name] = tensor.data
        del sd[key][name]
    if not fresh:
        return {}
    names = sorted({n for part in fresh.values() for n in part})
    if load_optimizer:
        raise ValueError(
            f"checkpoint {path} has no {', '.join(sorted(set(NEW_PARAMETER_SUFFIXES)))} "
            f"parameters ({len(names)} of this model's, e.g. {names[0]}: a setting that adds "
            f"them, attention.s2.sinks or attention.dense_layers.sinks, is on now and was off "
            f"there), so its optimizer state "
            f"cannot be loaded; start from its weights with checkpoint.load_optimizer=false"
        )
    # A warning: the run's log shows it (a lever's parameters not loaded is worth seeing).
    logger.warning(
        "checkpoint %s has no %s: these %d parameters start at their initial values (%s%s)",
        path,
        ", ".join(NEW_PARAMETER_SUFFIXES),
        len(names),
        ", ".join(names[:3]),
        ", ..." if len(names) > 3 else "",
    )
    return fresh


@dataclass(frozen=True)
class ResumeCandidate:
    """The checkpoint a run will resume from, found (and checked) before anything is built.

    ``own``: it is the run's own checkpoint, not another run's (``checkpoint.load_dir``).
    ``problems``: newer checkpoints (or the tracker) that were skipped and why.
    """

    root: str
    iteration: int
    own: bool
    problems: tuple = ()

    @property
    def path(self) -> str:
        return checkpoint_path(self.root, self.iteration)

    def starts_fresh(self, config: CheckpointConfig) -> bool:
        """Whether a run with checkpoint section ``config`` takes only this checkpoint's weights
        (and optionally optimizer state) and starts at iteration 0: another run's checkpoint
        under ``checkpoint.reset_iteration``."""
        return config.reset_iteration and not self.own


@dataclass(frozen=True)
class ResumePoint:
    """Where a run resumed: the checkpoint loaded and the training state it held."""

    path: str
    iteration: int
    consumed_samples: int
    # checkpoint.reset_iteration: only the weights (and optionally the optimizer state) were
    # taken; the run starts at iteration 0 with a fresh LR schedule.
    reset: bool = False


def find_resume(config: CheckpointConfig, directory: str) -> Optional[ResumeCandidate]:
    """The checkpoint a run with checkpoint section ``config`` and own checkpoint directory
    ``directory`` resumes from (see :meth:`Checkpointer.find`); no collectives."""
    if not config.resume:
        return None
    for root, own in ((directory, True), (config.load_dir, False)):
        if not root:
            continue
        iteration, problems = find_checkpoint(root)
        if iteration is not None:
            return ResumeCandidate(root, iteration, own, tuple(problems))
        if problems:
            raise CheckpointError(
                f"no intact checkpoint in {root}:\n  "
                + "\n  ".join(problems)
                + "\nMove the damaged folders aside, or start over with --restart."
            )
    return None


class Checkpointer:
    """The run's checkpoints: what to resume from, when to save, where saves go.

    Args:
        config: the run config's ``checkpoint`` section.
        directory: the run's own checkpoint directory (``checkpoint.dir`` or its default).
        model, optimizer, scheduler: what a checkpoint holds (model chunks, Megatron optimizer,
            ``OptimizerParamScheduler``).
        run_config: the run config as a mapping, stored in every checkpoint.
        optimizer_config: the run's ``optimizer`` section: on a resume its values (the
            scheduler's LR/WD schedule, Adam's betas and epsilon) replace the checkpoint's.
        padded_vocab_size: stored in every checkpoint (a resume compares it).
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
        optimizer_config=None,
        padded_vocab_size: Optional[int] = None,
    ):
        self.config = config
        self.directory = directory
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.run_config = run_config
        self.optimizer_config = optimizer_config
        self.padded_vocab_size = padded_vocab_size
        self.last_checkpoint: Optional[str] = None
        self._start_iteration = 0

    def find(self) -> Optional[ResumeCandidate]:
        """The checkpoint to resume from (no collectives, nothing loaded); None when there is
        none or ``checkpoint.resume`` is off.

        The run's own checkpoints win over ``checkpoint.load_dir``: a preempted run that started
        from another run's checkpoint must resume from where it got to. A damaged newest
        checkpoint is skipped for the newest intact one (``problems`` says why); a directory
        with checkpoints but none intact raises :class:`CheckpointError`.
        """
        return find_resume(self.config, self.directory)

    def load(self, candidate: Optional[ResumeCandidate] = None) -> Optional[ResumePoint]:
        """Load ``candidate`` (default: :meth:`find`'s) into model, optimizer and scheduler
        (collective); None when there is nothing to resume from."""
        if candidate is None:
            candidate = self.find()
            if candidate is None:
                return None
        reset = candidate.starts_fresh(self.config)
        iteration, consumed = load_checkpoint(
            candidate.root,
            self.model,
            self.optimizer,
            self.scheduler,
            iteration=candidate.iteration,
            # checkpoint.load_optimizer is about the start from another run: a run's own
            # checkpoint (a preempted extension run requeued) must bring back its Adam state and
            # LR schedule, or every resume would restart the warm-up.
            load_optimizer=self.config.load_optimizer or candidate.own,
            load_scheduler=False if reset else None,
            schedule_from_config=True,
            optimizer_config=self.optimizer_config,
        )
        self.last_checkpoint = checkpoint_path(candidate.root, iteration)
        if reset:
            iteration, consumed = 0, 0
        self._start_iteration = iteration
        return ResumePoint(self.last_checkpoint, iteration, consumed, reset=reset)

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
        extra = {}
        if self.padded_vocab_size is not None:
            extra["padded_vocab_size"] = self.padded_vocab_size
        self.last_checkpoint = save_checkpoint(
            self.directory,
            iteration,
            self.model,
            self.optimizer,
            self.scheduler,
            consumed_samples=consumed_samples,
            config=self.run_config,
            keep_last=self.config.keep_last,
            extra=extra,
        )
        return self.last_checkpoint
