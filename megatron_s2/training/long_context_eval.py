"""Long-context evaluation of a trained run: retrieval over a grid of lengths x needle depths,
and the loss by token position on held-out documents.

The model is the run's own (its run config and a checkpoint of it), built with the trainer's
building blocks (:mod:`.parallel`) and loaded with :func:`~.checkpointing.load_checkpoint`
(weights only), under the run's parallel layout (TP/PP/CP; the rest of the world is data
parallel and splits the sequences). Sequences go through Megatron's pipeline schedule
(``forward_only``), so a 128k evaluation fits wherever the run's training fitted.

Retrieval (:func:`make_trial`, :func:`evaluate_retrieval`). A trial is ``length + 1`` tokens of
the run's tokenizer: a haystack, a needle (a key-value statement) at a depth fraction of it, a
question and the answer. The model reads the first ``length`` tokens; the answer is scored

* by its log-likelihood (sum over the answer tokens, nats), and
* by greedy exact match: every answer token is the argmax of the model's prediction at its
  position. With teacher forcing this is exactly greedy decoding of the answer (while the
  greedy tokens match, the prefix is the same), in one forward pass instead of one per token.

Tasks (:data:`TASKS`): ``passkey`` (Mohtashami & Jaggi's repeated filler sentences),
``needle`` (a "special magic number" sentence in held-out text of the run's corpus) and ``kv``
(the demo corpus's ``let key=value;`` statements in held-out demo text: what a model trained
on it can retrieve).

Loss by position (:func:`evaluate_loss_by_position`): per-token loss on held-out documents at
least ``length + 1`` tokens long (or windows of the concatenated held-out stream), averaged in
position bins: whether later tokens gain from the longer context.

Lengths: an S2 layer needs whole blocks, so every length must be a multiple of the block sizes
(and of ``2 x CP x block`` under context parallelism); other lengths are refused (not padded, so
that a reported length is what the model read). A length above ``model.seq_length`` is refused
unless extrapolation is allowed explicitly (RoPE takes any position, but the model never saw it).

Command line: ``tools/eval_long_context.py`` / ``megatron-s2-eval-long-context`` (:func:`main`);
see ``docs/long_context_eval.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import string
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Optional

import numpy as np
import torch

from .attention_probe import check_probe_layout, probe_needle_attention, probe_table
from .run_config import ConfigError, RunConfig, apply_overrides, load_config

__all__ = [
    "EvalModel",
    "Task",
    "TASKS",
    "Trial",
    "load_eval_model",
    "check_lengths",
    "heldout_documents",
    "haystack_stream",
    "make_trial",
    "score_sequences",
    "default_tasks",
    "check_grid",
    "evaluate_retrieval",
    "retrieval_table",
    "plot_retrieval",
    "evaluate_loss_by_position",
    "plot_loss_by_position",
    "main",
]

PREFIX = "[megatron-s2 eval]"
# Mohtashami & Jaggi (2023), "Landmark Attention": the passkey test's filler.
PASSKEY_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
# Fresh keys are drawn until one does not occur in the haystack (an ambiguous needle otherwise).
KEY_ATTEMPTS = 100


# ------------------------------------------------------------------------------ the model
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

    @property
    def rank0(self) -> bool:
        return torch.distributed.get_rank() == 0


def _length_unit(cfg: RunConfig) -> int:
    sched = cfg.schedule()
    n, cp = cfg.model.num_layers, cfg.parallel.context_parallel_size
    if cp > 1:
        return sched.context_parallel_unit(n, cp)
    unit = 1
    for block in sched.block_sizes(n):
        unit = math.lcm(unit, block)
    return unit


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


def _resolve_checkpoint(path: str) -> tuple[str, int]:
    """``(root, iteration)`` of a checkpoint directory (its newest intact checkpoint) or of one
    ``iter_NNNNNNN`` folder."""
    from .checkpointing import CheckpointError, find_checkpoint, verify_checkpoint

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


def _saved_config(root: str, iteration: int) -> tuple[Optional[dict], Optional[int]]:
    from .checkpointing import checkpoint_path, read_checkpoint_config

    return read_checkpoint_config(checkpoint_path(root, iteration))


def _check_checkpoint_matches(
    cfg: RunConfig, saved: Optional[dict], saved_vocab: Optional[int], vocab: int, path: str
) -> list:
    """Refuse a checkpoint whose weights have another shape than ``cfg``'s model (the error
    lists each setting with both values); return the other differences that change what the
    weights mean (attention, RoPE base, seq length, tokenizer), which an evaluation may vary."""
    from .run_config import format_changes, resume_changes

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
    from megatron.core import parallel_state as ps

    from . import parallel
    from .checkpointing import checkpoint_path, load_checkpoint
    from .tokenizer import load_tokenizer, padded_vocab_size

    if cfg is None and checkpoint is None:
        raise ConfigError("give a run config (--config) or a checkpoint (--checkpoint), or both")
    root, iteration = _resolve_checkpoint(checkpoint or cfg.checkpoint_dir)
    path = checkpoint_path(root, iteration)
    saved, saved_vocab = _saved_config(root, iteration)
    if cfg is None:
        if saved is None:
            raise ConfigError(f"checkpoint {path} stores no run config: pass --config")
        cfg = RunConfig.from_dict(saved)
    env = parallel.DistributedEnv.from_environment()
    p = cfg.parallel
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    model_parallel *= p.context_parallel_size
    if env.world_size % model_parallel:
        raise ConfigError(
            f"world size {env.world_size} is not divisible by parallel.tensor_model_parallel_size"
            f" x pipeline_model_parallel_size x context_parallel_size = {model_parallel}"
        )
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    vocab = cfg.model.vocab_size or padded_vocab_size(
        tokenizer.vocab_size, cfg.model.make_vocab_size_divisible_by, p.tensor_model_parallel_size
    )
    noted = _check_checkpoint_matches(cfg, saved, saved_vocab, vocab, path)
    if noted and env.rank == 0:
        from .run_config import format_changes

        print(
            f"{PREFIX} evaluating {path} with settings that differ from its run's:\n"
            + format_changes(noted, "checkpoint", "evaluation"),
            flush=True,
        )
    # Only now, with the inputs checked: CPU mode patches torch for the whole process.
    gpu = torch.cuda.is_available()
    if not gpu:
        # As in the trainer: Megatron's distributed package must be imported before CPU mode.
        import megatron.core.distributed  # noqa: F401

        from .cpu_mode import enable_cpu_mode

        enable_cpu_mode()
    bf16 = parallel.use_bf16(cfg.train.precision, gpu=gpu)
    parallel.init_process_group(env, gpu=gpu)
    parallel.init_model_parallel(p, seed=cfg.train.seed)
    # The S2 layers check the sequence length they are built for: the longest one evaluated.
    model_section = replace(cfg.model, seq_length=max(max_length or 0, cfg.model.seq_length))
    config = parallel.transformer_config(model_section, p, cfg.schedule(), bf16=bf16)
    chunks = parallel.build_model_chunks(model_section, config, vocab, gpu=gpu)
    if bf16:
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(config, c) for c in chunks]
    load_checkpoint(root, chunks, None, None, iteration=iteration, load_optimizer=False)
    for chunk in chunks:
        chunk.eval()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    return EvalModel(
        cfg=cfg,
        model=chunks,
        tokenizer=tokenizer,
        checkpoint=path,
        iteration=iteration,
        vocab_size=vocab,
        device=device,
        length_unit=_length_unit(cfg),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
    )


# ---------------------------------------------------------------------------- scoring
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


def _forward_step(device, cp: int, data_iterator, model):
    from ..context_parallel import batch_on_this_cp_rank

    batch = {k: v.to(device) for k, v in next(data_iterator).items()}
    if cp > 1:
        # Megatron's zigzag split; position ids travel along to say where each row belongs.
        batch = batch_on_this_cp_rank(batch)
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
    through Megatron's schedule (pipeline stages, CP chunks and TP shards handled there).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

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
        iterators = [iter(data) for _ in em.model]
        with torch.no_grad():
            reports = get_forward_backward_func()(
                forward_step_func=partial(_forward_step, em.device, cp),
                data_iterator=iterators[0] if len(iterators) == 1 else iterators,
                model=em.model if len(em.model) > 1 else em.model[0],
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


# ------------------------------------------------------------------------ held-out text
def _run_prefixes(cfg: RunConfig) -> list[str]:
    """The corpora of the run, as the trainer finds them (the demo corpus is generated if
    missing)."""
    if cfg.data.demo:
        from .demo_corpus import ensure_demo_data

        extra = {"num_docs": cfg.data.demo_num_docs} if cfg.data.demo_num_docs else {}
        return [ensure_demo_data(cfg.data.demo_dir, seed=0, **extra)]
    return cfg.blend()[0]


def heldout_documents(cfg: RunConfig) -> list[np.ndarray]:
    """The held-out documents of the run's corpora (token id arrays, EOD included): the
    validation part of ``data.split`` (the test part when validation has no weight), in
    corpus order. Raises :class:`ConfigError` naming ``data.split`` when neither has any."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(cfg.data.split))
    part = matrix[1] if matrix[1] is not None else matrix[2]
    if part is None:
        raise ConfigError(
            f"data.split {cfg.data.split!r} holds nothing out (validation and test weigh 0): the "
            f"evaluation reads held-out documents; give the valid part a weight"
        )
    docs = []
    for prefix in _run_prefixes(cfg):
        dataset = IndexedDataset(prefix)
        n = len(dataset)
        # Megatron's rounding of split bounds (BlendedMegatronDatasetBuilder).
        begin, end = int(round(part[0] * n)), int(round(part[1] * n))
        docs.extend(np.asarray(dataset[i], dtype=np.int64) for i in range(begin, end))
    docs = [d for d in docs if d.size]
    if not docs:
        raise ConfigError(
            f"data.split {cfg.data.split!r} leaves no held-out documents in {_run_prefixes(cfg)}"
        )
    return docs


# --------------------------------------------------------------------------- retrieval
@dataclass(frozen=True)
class Task:
    """A retrieval task: templates with ``{key}``/``{value}`` and where the haystack comes from.

    ``filler``: ``"passkey"`` (the repeated passkey sentences), ``"corpus"`` (held-out text of
    the run) or ``"kv-filler"`` (the demo corpus's filler sentences, :func:`filler_text`).
    ``boundary``: text a haystack token must end with for the needle to follow it.
    """

    name: str
    needle: str
    question: str
    answer: str
    filler: str
    boundary: str
    key_letters: int
    value_digits: int


TASKS = {
    "passkey": Task(
        "passkey",
        needle=" The pass key is {value}. Remember it. {value} is the pass key.",
        question=" What is the pass key? The pass key is",
        answer=" {value}",
        filler="passkey",
        boundary=".",
        key_letters=0,
        value_digits=5,
    ),
    "needle": Task(
        "needle",
        needle="The special magic number for {key} is: {value}.\n",
        question="What is the special magic number for {key}? The special magic number for "
        "{key} is:",
        answer=" {value}",
        filler="corpus",
        boundary="\n",
        key_letters=6,
        value_digits=7,
    ),
    "kv": Task(
        "kv",
        needle="let {key}={value};\n",
        question="{key}?",
        answer="{value}",
        filler="corpus",
        boundary="\n",
        key_letters=3,
        value_digits=4,
    ),
    # The demo corpus's statement in its own filler sentences: for a run whose blend includes
    # that corpus (make_demo_corpus --tokenizer) next to real text.
    "kv-filler": Task(
        "kv-filler",
        needle="let {key}={value};\n",
        question="{key}?",
        answer="{value}",
        filler="kv-filler",
        boundary="\n",
        key_letters=3,
        value_digits=4,
    ),
}


def default_tasks(cfg: RunConfig) -> list[str]:
    """``kv`` and ``passkey`` for a demo-corpus run (its statements are what it learnt),
    ``passkey`` and ``needle`` otherwise."""
    return ["kv", "passkey"] if cfg.data.demo else ["passkey", "needle"]


def haystack_stream(task: Task, tokenizer, documents: Sequence[np.ndarray], min_tokens: int):
    """Filler tokens for ``task``, at least ``min_tokens`` long (repeated as needed): the passkey
    sentences, the demo corpus's filler sentences (``kv-filler``), or the held-out ``documents``
    joined by newlines (their EOD tokens dropped, so that a needle and its question are in one
    document)."""
    if task.filler == "passkey":
        unit = np.asarray(tokenizer.encode(PASSKEY_FILLER), dtype=np.int64)
    elif task.filler == "kv-filler":
        from .demo_corpus import filler_text

        # Whole sentences, never repeated: about 2 characters a token or more for any tokenizer.
        unit = np.asarray(tokenizer.encode(filler_text(2 * min_tokens + 4096)), dtype=np.int64)
    else:
        newline = np.asarray(tokenizer.encode("\n"), dtype=np.int64)
        parts = []
        for doc in documents:
            parts += [doc[doc != tokenizer.eod], newline]
        unit = np.concatenate(parts)
    if unit.size == 0:
        raise ConfigError(f"task {task.name}: the filler text tokenizes to nothing")
    return np.resize(unit, max(min_tokens, unit.size))


@dataclass(frozen=True)
class Trial:
    """One retrieval prompt: ``tokens`` (``[length + 1]``; the model reads ``[:length]``) with the
    needle at token ``needle_at`` (``depth`` = ``needle_at`` / haystack tokens, after snapping
    to a boundary) and the answer in ``tokens[answer_at:]``; the model predicts answer token
    ``i`` at position ``i - 1``."""

    task: str
    length: int
    target_depth: float
    depth: float
    index: int
    key: str
    value: str
    tokens: np.ndarray
    needle_at: int
    answer_at: int


def _boundaries(tokenizer, ids: np.ndarray, boundary: str) -> np.ndarray:
    """Per token of ``ids``: whether its text ends with ``boundary`` (a needle may follow)."""
    uniq = np.unique(ids)
    ends = {int(t): tokenizer.decode([int(t)]).endswith(boundary) for t in uniq}
    return np.fromiter((ends[int(t)] for t in ids), dtype=bool, count=ids.size)


def make_trial(
    task: Task,
    tokenizer,
    stream: np.ndarray,
    length: int,
    depth: float,
    index: int,
    *,
    seed: int = 0,
) -> Trial:
    """The trial ``index`` of ``task`` at ``length`` tokens and needle ``depth`` (0 = the start
    of the context, 1 = just before the question), deterministic in ``seed``.

    The haystack is a window of ``stream`` (:func:`haystack_stream`) ending at a boundary;
    the needle goes after the last boundary at or before ``depth`` of it. The key is drawn until
    it does not occur in the haystack. Raises :class:`ConfigError` naming ``--lengths`` when the
    length leaves no room for a haystack.
    """
    rng = random.Random(f"{seed}-{task.name}-{length}-{depth!r}-{index}")
    value = "".join(rng.choice(string.digits) for _ in range(task.value_digits))
    start = rng.randrange(max(1, stream.size - length))
    key = ""
    for _ in range(KEY_ATTEMPTS):
        key = "".join(rng.choice(string.ascii_lowercase) for _ in range(task.key_letters))
        fill = {"key": key, "value": value}
        needle = np.asarray(tokenizer.encode(task.needle.format(**fill)), dtype=np.int64)
        question = np.asarray(tokenizer.encode(task.question.format(**fill)), dtype=np.int64)
        answer = np.asarray(tokenizer.encode(task.answer.format(**fill)), dtype=np.int64)
        room = length + 1 - needle.size - question.size - answer.size
        if room < 1:
            raise ConfigError(
                f"--lengths: {length} tokens leave no room for a haystack around task "
                f"{task.name}'s needle, question and answer "
                f"({length + 1 - room} tokens); use longer lengths"
            )
        window = stream[start : start + room + length]
        if window.size < room + length:
            window = np.resize(stream, room + length)
        # The haystack ends at a boundary, so the question follows a whole statement.
        cut = _boundaries(tokenizer, window[room:], task.boundary)
        end = room + (int(np.argmax(cut)) + 1 if cut.any() else 0)
        haystack = window[end - room : end]
        if not key or key not in tokenizer.decode(haystack.tolist()):
            break
    else:
        raise ConfigError(f"task {task.name}: no key absent from the haystack was found")
    target = int(round(depth * room))
    ok = _boundaries(tokenizer, haystack[:target], task.boundary)
    at = int(np.flatnonzero(ok)[-1]) + 1 if target and ok.any() else 0
    tokens = np.concatenate([haystack[:at], needle, haystack[at:], question, answer])
    return Trial(
        task=task.name,
        length=length,
        target_depth=depth,
        depth=at / room,
        index=index,
        key=key,
        value=value,
        tokens=tokens,
        needle_at=at,
        answer_at=tokens.size - answer.size,
    )


def check_grid(tasks: Sequence[str], depths: Sequence[float], trials: int) -> None:
    """Raise :class:`ConfigError` naming the option when the retrieval grid is empty or holds
    an unknown task, a depth outside [0, 1] or fewer than one trial."""
    if not depths:
        raise ConfigError("--depths is empty: give at least one needle depth in [0, 1]")
    if not tasks:
        raise ConfigError("--tasks is empty: give at least one of " + ", ".join(TASKS))
    if trials < 1:
        raise ConfigError(f"--trials must be >= 1, got {trials}")
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise ConfigError(f"--depths: {d} is outside [0, 1] (a fraction of the context)")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ConfigError(f"--tasks: unknown {unknown}; known: {', '.join(TASKS)}")


def evaluate_retrieval(
    em: EvalModel,
    tasks: Sequence[str],
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int,
    *,
    seed: int = 0,
    micro_batch_size: int = 1,
    documents: Optional[list] = None,
) -> dict:
    """Every task over ``lengths`` x ``depths`` with ``trials`` prompts each (collective).

    Returns ``{"tasks": {task: {"cells": [...], "trials": [...]}}, ...}``: a cell per (length,
    depth) with ``accuracy`` (greedy exact match, fraction of trials), ``token_accuracy`` and
    ``log_likelihood`` (mean over trials of the answer's summed log-probability, nats); a trial
    record per prompt (its answer, the greedy answer text, ``log_likelihood``, ``exact``).
    """
    check_grid(tasks, depths, trials)
    tok = em.tokenizer
    out = {"tasks": {}}
    for name in tasks:
        task = TASKS[name]
        if task.filler == "corpus" and documents is None:
            documents = heldout_documents(em.cfg)
        stream = haystack_stream(task, tok, documents or [], 2 * max(lengths) + 2)
        cells, records = [], []
        for length in lengths:
            prompts = [
                make_trial(task, tok, stream, length, d, i, seed=seed)
                for d in depths
                for i in range(trials)
            ]
            scores = score_sequences(
                em, np.stack([p.tokens for p in prompts]), micro_batch_size=micro_batch_size
            )
            for row, p in enumerate(prompts):
                span = slice(p.answer_at - 1, length)  # the positions that predict the answer
                greedy = scores["greedy"][row, span]
                records.append(
                    {
                        "length": length,
                        "depth": p.target_depth,
                        "needle_depth": p.depth,
                        "trial": p.index,
                        "key": p.key,
                        "answer": tok.decode(p.tokens[p.answer_at :].tolist()),
                        "greedy": tok.decode(greedy.tolist()),
                        "log_likelihood": -float(scores["nll"][row, span].sum()),
                        "token_accuracy": float(scores["correct"][row, span].mean()),
                        "exact": bool(scores["correct"][row, span].all()),
                    }
                )
        for length in lengths:
            for d in depths:
                cell = [r for r in records if r["length"] == length and r["depth"] == d]
                cells.append(
                    {
                        "length": length,
                        "depth": d,
                        "accuracy": float(np.mean([r["exact"] for r in cell])),
                        "token_accuracy": float(np.mean([r["token_accuracy"] for r in cell])),
                        "log_likelihood": float(np.mean([r["log_likelihood"] for r in cell])),
                        "trials": len(cell),
                    }
                )
        out["tasks"][name] = {"cells": cells, "trials": records}
    out.update(lengths=list(lengths), depths=list(depths), trials_per_cell=trials, seed=seed)
    return out


def retrieval_table(result: dict, task: str, metric: str = "accuracy") -> str:
    """A markdown table of one task's ``metric``: a row per depth, a column per length."""
    cells = {(c["length"], c["depth"]): c[metric] for c in result["tasks"][task]["cells"]}
    lengths, depths = result["lengths"], result["depths"]
    fmt = "{:.2f}" if metric != "log_likelihood" else "{:.3f}"
    lines = [
        "| depth \\ length | " + " | ".join(str(n) for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for d in depths:
        lines.append(f"| {d:g} | " + " | ".join(fmt.format(cells[(n, d)]) for n in lengths) + " |")
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_retrieval(result: dict, task: str, path: str, title: str = "") -> str:
    """Heatmap PNG of one task's greedy exact-match accuracy (depth rows x length columns)."""
    plt = _pyplot()
    lengths, depths = result["lengths"], result["depths"]
    cells = {(c["length"], c["depth"]): c["accuracy"] for c in result["tasks"][task]["cells"]}
    grid = np.array([[cells[(n, d)] for n in lengths] for d in depths])
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.5 * len(depths)))
    im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="accuracy (greedy exact match)")
    ax.set_title(title or task)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --------------------------------------------------------------------- loss by position
def evaluate_loss_by_position(
    em: EvalModel,
    length: int,
    *,
    num_sequences: int = 16,
    bins: int = 16,
    concat: bool = False,
    micro_batch_size: int = 1,
    documents: Optional[list] = None,
) -> dict:
    """Mean loss per position bin over held-out sequences of ``length`` (collective).

    Sequences are the first ``length + 1`` tokens of held-out documents that long (``concat``:
    consecutive windows of the held-out documents concatenated with their EODs, as in
    training). Positions ``0..length-1`` (the token predicted at ``t`` is ``t + 1``) fall into
    ``bins`` equal bins. Returns ``{"length", "num_sequences", "bins": [{"start", "end",
    "loss", "tokens"}], "loss"}`` (losses in nats per token). Raises :class:`ConfigError`
    naming the option when no held-out document is long enough.
    """
    if bins < 1 or bins > length:
        raise ConfigError(f"--bins must be in [1, {length}] (the length), got {bins}")
    if num_sequences < 1:
        raise ConfigError(f"--position-sequences must be >= 1, got {num_sequences}")
    docs = documents if documents is not None else heldout_documents(em.cfg)
    if concat:
        stream = np.concatenate(docs)
        count = min(num_sequences, (stream.size - 1) // length)
        seqs = [stream[i * length : i * length + length + 1] for i in range(count)]
    else:
        seqs = [d[: length + 1] for d in docs if d.size >= length + 1][:num_sequences]
    if not seqs:
        longest = max(d.size for d in docs)
        raise ConfigError(
            f"--position-length {length}: no held-out document has {length + 1} tokens (the "
            f"longest has {longest}); use a shorter length or --concat-docs (windows of the "
            f"concatenated documents)"
        )
    scores = score_sequences(em, np.stack(seqs), micro_batch_size=micro_batch_size)
    nll = scores["nll"]
    edges = np.linspace(0, length, bins + 1).round().astype(int)
    table = [
        {
            "start": int(a),
            "end": int(b),
            "loss": float(nll[:, a:b].mean()),
            "tokens": int(nll[:, a:b].size),
        }
        for a, b in zip(edges[:-1], edges[1:])
    ]
    return {
        "length": length,
        "num_sequences": len(seqs),
        "concat": concat,
        "bins": table,
        "loss": float(nll.mean()),
    }


def plot_loss_by_position(result: dict, path: str, title: str = "") -> str:
    """PNG of the mean loss per position bin (x: bin centre in tokens)."""
    plt = _pyplot()
    centres = [(b["start"] + b["end"]) / 2 for b in result["bins"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(centres, [b["loss"] for b in result["bins"]], "o-")
    ax.set_xlabel("token position")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or f"loss by position ({result['num_sequences']} held-out sequences)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- command line
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-s2-eval-long-context",
        description="Long-context evaluation of a trained run: passkey / needle retrieval over "
        "lengths x depths (table, heatmap) and the loss by token position (JSON, PNG).",
    )
    p.add_argument("--config", "-c", help="run config YAML (default: the checkpoint's own)")
    p.add_argument(
        "--checkpoint",
        help="checkpoint directory (its newest intact checkpoint) or an iter_NNNNNNN folder "
        "(default: the config's checkpoint directory)",
    )
    p.add_argument("--lengths", help="context lengths, comma-separated (default: L/4, L/2, L)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1]")
    p.add_argument("--trials", type=int, default=5, help="prompts per (length, depth)")
    p.add_argument("--tasks", help=f"of {', '.join(TASKS)} (default: kv,passkey on the demo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--allow-extrapolation",
        action="store_true",
        help="allow lengths above model.seq_length",
    )
    p.add_argument(
        "--position-length", type=int, help="loss-by-position length (default: the longest)"
    )
    p.add_argument("--position-sequences", type=int, default=16)
    p.add_argument("--bins", type=int, default=16, help="position bins")
    p.add_argument(
        "--concat-docs", action="store_true", help="loss by position on concatenated documents"
    )
    p.add_argument(
        "--attention-probe",
        type=int,
        metavar="LENGTH",
        help="also measure, per layer and head, the attention on the needle of the first task's "
        "prompts at LENGTH tokens (one process; docs/long_context_eval.md)",
    )
    p.add_argument("--skip-retrieval", action="store_true")
    p.add_argument("--skip-position", action="store_true")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--output-dir", help="default: <run dir>/long_context_eval")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="run config overrides")
    return p


def _config_from_args(args) -> RunConfig:
    """``--config`` with the overrides, else the checkpoint's stored config with them."""
    if args.config:
        return load_config(args.config, args.overrides)
    if not args.checkpoint:
        raise ConfigError("give a run config (--config) or a checkpoint (--checkpoint), or both")
    root, iteration = _resolve_checkpoint(args.checkpoint)
    saved, _ = _saved_config(root, iteration)
    if saved is None:
        raise ConfigError(f"{args.checkpoint} stores no run config: pass --config")
    return RunConfig.from_dict(apply_overrides(saved, args.overrides))


def _write(out_dir: str, name: str, content) -> str:
    """Write ``content`` (text, or a JSON-able object) to ``out_dir/name``; returns the path."""
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        if isinstance(content, str):
            f.write(content)
        else:
            json.dump(content, f, indent=1)
    return path


def run(args) -> dict:
    """The evaluation the parsed ``args`` ask for (collective); writes its files on rank 0 and
    returns ``{"retrieval": ..., "loss_by_position": ..., "files": [...]}``."""
    cfg = _config_from_args(args)
    seq = cfg.model.seq_length
    lengths = _ints(args.lengths) if args.lengths is not None else [seq // 4, seq // 2, seq]
    lengths = sorted(set(lengths)) if lengths else []
    check_lengths(cfg, lengths, allow_extrapolation=args.allow_extrapolation)
    depths = _floats(args.depths)
    if args.tasks is None:
        tasks = default_tasks(cfg)
    else:
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    probe = [args.attention_probe] if args.attention_probe is not None else []
    if not args.skip_retrieval or probe:
        check_grid(tasks, depths, args.trials)
    pos_length = args.position_length or max(lengths)
    check_lengths(
        cfg, [pos_length], allow_extrapolation=args.allow_extrapolation, what="--position-length"
    )
    if probe:
        check_probe_layout(cfg)
        check_lengths(
            cfg, probe, allow_extrapolation=args.allow_extrapolation, what="--attention-probe"
        )
    em = load_eval_model(cfg, args.checkpoint, max_length=max(lengths + [pos_length] + probe))
    out_dir = args.output_dir or os.path.join(em.cfg.run_dir, "long_context_eval")
    say = print if em.rank0 else (lambda *a, **k: None)
    say(
        f"{PREFIX} {em.checkpoint} (iteration {em.iteration}), world "
        f"{torch.distributed.get_world_size()} (TP {cfg.parallel.tensor_model_parallel_size}, "
        f"PP {cfg.parallel.pipeline_model_parallel_size}, CP "
        f"{cfg.parallel.context_parallel_size}, DP {em.dp_size})",
        flush=True,
    )
    files, result = [], {"checkpoint": em.checkpoint, "iteration": em.iteration}
    if em.rank0:
        os.makedirs(out_dir, exist_ok=True)
    corpus = not args.skip_position or (
        not args.skip_retrieval and any(TASKS[t].filler == "corpus" for t in tasks)
    )
    documents = heldout_documents(em.cfg) if corpus else None
    if not args.skip_retrieval:
        retrieval = evaluate_retrieval(
            em,
            tasks,
            lengths,
            depths,
            args.trials,
            seed=args.seed,
            micro_batch_size=args.micro_batch_size,
            documents=documents,
        )
        retrieval.update(checkpoint=em.checkpoint, iteration=em.iteration)
        result["retrieval"] = retrieval
        if em.rank0:
            md = []
            for task in tasks:
                md += [
                    f"## {task}: greedy exact-match accuracy",
                    "",
                    retrieval_table(retrieval, task),
                    "",
                    f"## {task}: answer log-likelihood (nats)",
                    "",
                    retrieval_table(retrieval, task, "log_likelihood"),
                    "",
                ]
                png = os.path.join(out_dir, f"retrieval_{task}.png")
                files.append(plot_retrieval(retrieval, task, png, f"{task} ({cfg.name})"))
            text = "\n".join(md)
            say(text, flush=True)
            files += [_write(out_dir, "retrieval.md", text)]
            files += [_write(out_dir, "retrieval.json", retrieval)]
    if probe:
        found = probe_needle_attention(
            em, tasks[0], probe[0], depths, args.trials, seed=args.seed, documents=documents
        )
        found.update(checkpoint=em.checkpoint, iteration=em.iteration)
        result["attention_probe"] = found
        text = (
            f"## {tasks[0]} at {probe[0]} tokens: attention on the needle from the position "
            "predicting the answer, strongest head (mean over heads)\n\n" + probe_table(found)
        )
        say(text, flush=True)
        files += [_write(out_dir, "attention_probe.md", text)]
        files += [_write(out_dir, "attention_probe.json", found)]
    if not args.skip_position:
        position = evaluate_loss_by_position(
            em,
            pos_length,
            num_sequences=args.position_sequences,
            bins=args.bins,
            concat=args.concat_docs,
            micro_batch_size=args.micro_batch_size,
            documents=documents,
        )
        position.update(checkpoint=em.checkpoint, iteration=em.iteration)
        result["loss_by_position"] = position
        if em.rank0:
            files += [_write(out_dir, "loss_by_position.json", position)]
            files += [os.path.join(out_dir, "loss_by_position.png")]
            plot_loss_by_position(position, files[-1])
            first, last = position["bins"][0], position["bins"][-1]
            say(
                f"{PREFIX} loss by position ({position['num_sequences']} held-out sequences of "
                f"{pos_length} tokens): {first['loss']:.4f} at {first['start']}-{first['end']}, "
                f"{last['loss']:.4f} at {last['start']}-{last['end']}, mean "
                f"{position['loss']:.4f}",
                flush=True,
            )
    result["files"] = files
    say(f"{PREFIX} wrote " + ", ".join(files), flush=True)
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point; exit code 2 on a config or input error, 4 on a checkpoint error."""
    from .checkpointing import CheckpointError

    args = build_arg_parser().parse_args(argv)
    # A caller's process group (an in-process test) is left alone; ours is shut down.
    started = not torch.distributed.is_initialized()
    try:
        run(args)
    except ConfigError as e:
        print(f"megatron-s2-eval-long-context: error: {e}", file=sys.stderr, flush=True)
        return 2
    except CheckpointError as e:
        print(f"megatron-s2-eval-long-context: error: {e}", file=sys.stderr, flush=True)
        return 4
    finally:
        if started and torch.distributed.is_initialized():
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()  # no stale groups for a later run here
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
