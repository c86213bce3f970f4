"""A run's model loaded for evaluation: :func:`load_eval_model` and the checks of what it may be
asked (:func:`check_lengths`).

The model is the run's own (its run config and a checkpoint of it), assembled by :mod:`..build`
as the trainer assembles it, under the run's parallel layout (TP/PP/CP; the rest of the world is
data parallel and splits the sequences), and loaded with the checkpoint's weights only.

Lengths: an S2 layer needs whole blocks, so every length must be a multiple of the block sizes
(and of ``2 x CP x block`` under context parallelism); other lengths are refused (not padded, so
that a reported length is what the model read). A length above ``model.seq_length`` is refused
unless extrapolation is allowed explicitly (RoPE takes any position, but the model never saw it).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ...parallel_lengths import sequence_multiple
from ..errors import CheckpointError
from ..run_config import ConfigError, RunConfig

__all__ = [
    "PREFIX",
    "EvalModel",
    "load_eval_model",
    "check_lengths",
    "resolve_checkpoint",
    "saved_config",
    "trained_tokens",
]

# What the evaluation's own lines on stdout start with.
PREFIX = "[megatron-s2 eval]"


@dataclass
class EvalModel:
    """A run's model loaded for evaluation on this rank.

    ``model``: this rank's model chunks (eval mode); ``vocab_size``: the padded vocabulary;
    ``length_unit``: what every evaluated length must be a multiple of (S2 blocks, CP chunks);
    ``dp_rank``/``dp_size``: this rank's share of the sequences.
    """

    cfg: RunConfig
    model: list
    tokenizer: object
    checkpoint: str
    iteration: int
    vocab_size: int
    device: torch.device
    length_unit: int
    dp_rank: int
    dp_size: int
    # Tokens the run trained on from random weights (see trained_tokens); None: unknown.
    trained_tokens: Optional[int] = None

    @property
    def rank0(self) -> bool:
        return torch.distributed.get_rank() == 0


def _length_unit(cfg: RunConfig) -> int:
    """The multiple every evaluated length must be (the plugin's rule for this layout)."""
    blocks = cfg.schedule().block_sizes(cfg.model.num_layers)
    return sequence_multiple(cfg.parallel.context_parallel_size, blocks)


def check_lengths(
    cfg: RunConfig, lengths: Sequence[int], *, allow_extrapolation: bool, what: str = "--lengths"
) -> None:
    """Raise :class:`ConfigError` naming ``what`` (the option) and the setting that refuses a
    length: none given, not a multiple of the S2 blocks / CP chunks, or above
    ``model.seq_length`` without ``allow_extrapolation``."""
    if not lengths:
        raise ConfigError(f"{what} is empty: give at least one context length in tokens")
    unit = _length_unit(cfg)
    seq = cfg.model.seq_length
    for length in lengths:
        if length < 1:
            raise ConfigError(f"{what}: lengths must be >= 1 token, got {length}")
        if length % unit:
            raise ConfigError(
                f"{what}: {length} is not a multiple of {unit} tokens, which the run's attention "
                f"needs (attention S2 block sizes "
                f"{cfg.schedule().block_sizes(cfg.model.num_layers)}, "
                f"parallel.context_parallel_size={cfg.parallel.context_parallel_size}); use e.g. "
                f"{max(unit, length // unit * unit)}"
            )
        if length > seq and not allow_extrapolation:
            raise ConfigError(
                f"{what}: {length} exceeds model.seq_length={seq}, the length the run was "
                f"trained at; RoPE (model.rotary_base={cfg.model.rotary_base:g}) takes longer "
                f"positions, but the model never saw them: pass --allow-extrapolation to "
                f"evaluate there anyway"
            )


def resolve_checkpoint(path: str) -> tuple[str, int]:
    """``(root, iteration)`` of a checkpoint directory (its newest intact checkpoint) or of one
    ``iter_NNNNNNN`` folder; raises :class:`~..errors.CheckpointError` when there is none."""
    from ..checkpointing import find_checkpoint, verify_checkpoint

    path = os.path.normpath(path)
    name = os.path.basename(path)
    if name.startswith("iter_") and name[5:].isdigit():
        problem = verify_checkpoint(path)
        if problem:
            raise CheckpointError(f"checkpoint {path}: {problem}")
        return os.path.dirname(path), int(name[5:])
    iteration, problems = find_checkpoint(path)
    if iteration is None:
        detail = ("; ".join(problems)) if problems else "no iter_* checkpoint there"
        raise CheckpointError(f"no intact checkpoint in {path} ({detail})")
    return path, iteration


def saved_config(root: str, iteration: int) -> tuple[Optional[dict], Optional[int]]:
    """The run config stored in checkpoint ``iteration`` under ``root`` and its padded
    vocabulary size (None each where the checkpoint predates them)."""
    from ..checkpointing import checkpoint_path, read_checkpoint_config

    return read_checkpoint_config(checkpoint_path(root, iteration))


def trained_tokens(path: str, saved: Optional[dict]) -> Optional[int]:
    """Tokens the run of the checkpoint at ``path`` trained on since its random initialisation:
    its consumed samples x its ``model.seq_length`` (``saved``: the run config stored in the
    checkpoint). None where that is unknown: a checkpoint without its config or sample count,
    or a run that started from another run's weights (``checkpoint.load_dir``), whose own count
    leaves out the tokens of the run it started from."""
    from megatron.core import dist_checkpointing

    if not saved or (saved.get("checkpoint") or {}).get("load_dir"):
        return None
    samples = dist_checkpointing.load_common_state_dict(path).get("consumed_samples")
    seq_length = (saved.get("model") or {}).get("seq_length")
    if samples is None or seq_length is None:
        return None
    return int(samples) * int(seq_length)


def _check_checkpoint_matches(
    cfg: RunConfig, saved: Optional[dict], saved_vocab: Optional[int], vocab: int, path: str
) -> list:
    """Refuse a checkpoint whose weights have another shape than ``cfg``'s model (the error
    lists each setting with both values); return the other differences that change what the
    weights mean (attention, RoPE base, seq length, tokenizer), which an evaluation may vary."""
    from ..run_config import format_changes, resume_changes

    if saved_vocab is not None and saved_vocab != vocab:
        raise ConfigError(
            f"checkpoint {path} does not match the config: its padded vocabulary has "
            f"{saved_vocab} entries, the config's {vocab} (data.tokenizer, model.vocab_size, "
            f"model.make_vocab_size_divisible_by x parallel.tensor_model_parallel_size)"
        )
    if saved is None:
        return []
    changes = resume_changes(saved, cfg, own=False)
    if changes.refused:
        raise ConfigError(
            f"checkpoint {path} does not match the config: its weights have another shape:\n"
            f"{format_changes(changes.refused, 'checkpoint', 'config')}\n"
            f"Evaluate with the run's own config (leave out --config to use the one stored in "
            f"the checkpoint)."
        )
    return changes.noted


def load_eval_model(
    cfg: Optional[RunConfig],
    checkpoint: Optional[str] = None,
    *,
    max_length: Optional[int] = None,
) -> EvalModel:
    """Build the run's model for this rank and load a checkpoint's weights (collective).

    Args:
        cfg: the run config; None: the one stored in the checkpoint (``checkpoint`` needed).
        checkpoint: a checkpoint directory (its newest intact checkpoint) or one
            ``iter_NNNNNNN`` folder; None: ``cfg``'s checkpoint directory.
        max_length: the longest length that will be evaluated: the S2 layers are checked at it
            (default ``model.seq_length``). Lengths are checked by :func:`check_lengths`.

    Starts torch.distributed from torchrun's variables (a world of one without them) and
    Megatron's groups for ``cfg.parallel``; without CUDA in the explicit CPU mode (fp32, gloo).
    Raises :class:`ConfigError` when the checkpoint's shape differs from ``cfg``'s.
    """
    from ..build import Runtime, build_run, load_weights, model_vocab_size
    from ..checkpointing import checkpoint_path
    from ..tokenizer import load_tokenizer

    if cfg is None and checkpoint is None:
        raise ConfigError("give a run config (--config) or a checkpoint (--checkpoint), or both")
    root, iteration = resolve_checkpoint(checkpoint or cfg.checkpoint_dir)
    path = checkpoint_path(root, iteration)
    saved, saved_vocab = saved_config(root, iteration)
    if cfg is None:
        if saved is None:
            raise ConfigError(f"checkpoint {path} stores no run config: pass --config")
        cfg = RunConfig.from_dict(saved)
    runtime = Runtime.detect(cfg.train.precision)
    p = cfg.parallel
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    model_parallel *= p.context_parallel_size
    if runtime.env.world_size % model_parallel:
        raise ConfigError(
            f"world size {runtime.env.world_size} is not divisible by "
            f"parallel.tensor_model_parallel_size x pipeline_model_parallel_size x "
            f"context_parallel_size = {model_parallel}"
        )
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    vocab = model_vocab_size(cfg.model, p, tokenizer)
    noted = _check_checkpoint_matches(cfg, saved, saved_vocab, vocab, path)
    if noted and runtime.env.rank == 0:
        from ..run_config import format_changes

        print(
            f"{PREFIX} evaluating {path} with settings that differ from its run's:\n"
            + format_changes(noted, "checkpoint", "evaluation"),
            flush=True,
        )
    runtime.check(cfg.model)
    # Only now, with the inputs checked: CPU mode patches torch for the whole process.
    runtime.start(p, seed=cfg.train.seed)
    # The S2 layers check the sequence length they are built for: the longest one evaluated.
    model_section = replace(cfg.model, seq_length=max(max_length or 0, cfg.model.seq_length))
    parts = build_run(model_section, p, cfg.schedule(), vocab, runtime)
    load_weights(parts, root, iteration)
    return EvalModel(
        cfg=cfg,
        model=parts.model,
        tokenizer=tokenizer,
        checkpoint=path,
        iteration=iteration,
        vocab_size=vocab,
        device=runtime.device,
        length_unit=_length_unit(cfg),
        dp_rank=parts.dp_rank,
        dp_size=parts.dp_size,
        trained_tokens=trained_tokens(path, saved),
    )
