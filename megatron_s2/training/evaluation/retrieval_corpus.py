"""Retrieval training documents in the long-context evaluation's own formats.

A model learns to look a statement up from far back only if its training data rewards it. The
worked example's 125M models, trained on code and the key-value corpus, never did: 0% in every
cell, the dense model included (``docs/long_context_eval.md``), so "does the S2 hybrid retrieve
as well as its dense twin" could not be asked of them. This corpus holds whole retrieval
documents, haystack + needle + question + answer, made by the evaluation's own
:func:`~.tasks.make_trial` under a training seed (a string, while the evaluation's
seeds are integers: no evaluation trial is repeated here). Blended into a run
(``data.blend``), it teaches the question-answer format; how far back a model can then find the
answer is what the evaluation measures.

Haystacks: ``passkey`` in its repeated filler sentences, as the evaluation does (the classic
passkey training set-up); ``needle`` in the demo corpus's filler sentences, while the
evaluation hides the needle in held-out code, a haystack these documents never show.

Command line: ``tools/make_retrieval_corpus.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Optional

import numpy as np

from ..run_config import ConfigError
from .tasks import TASKS, haystack_stream, make_trial

__all__ = ["TRAINING_TASKS", "training_task", "write_retrieval_dataset", "main"]

# Each training task, with the haystack its documents use (see the module docstring).
TRAINING_TASKS = {
    "passkey": TASKS["passkey"],
    "needle": replace(TASKS["needle"], filler="kv-filler"),
}


def training_task(name: str):
    """The :class:`~.tasks.Task` whose documents this corpus writes for ``name``."""
    if name not in TRAINING_TASKS:
        raise ConfigError(f"--tasks: unknown {name!r}; known: {', '.join(TRAINING_TASKS)}")
    return TRAINING_TASKS[name]


def _lengths(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    # Log-uniform: with the defaults as many documents under 1k tokens as between 4k and 16k, so
    # that a short training context still sees whole documents while a long one sees far needles.
    return [int(round(math.exp(rng.uniform(math.log(lo), math.log(hi))))) for _ in range(n)]


def write_retrieval_dataset(
    output_prefix: str | os.PathLike,
    tokenizer: str,
    *,
    tasks: Sequence[str] = ("passkey", "needle"),
    num_docs: int = 4000,
    min_tokens: int = 256,
    max_tokens: int = 16384,
    seed: int = 0,
    workers: int = 1,
) -> dict:
    """Write ``num_docs`` retrieval documents as a Megatron indexed dataset
    ``output_prefix.bin/.idx`` (+ ``.meta.json``), tokenized with ``tokenizer`` (``byte`` or a
    local HF tokenizer directory, e.g. ``data/code/tokenizer``).

    Document ``i`` is task ``tasks[i % len(tasks)]``: a trial at length ``L`` (haystack with the
    needle at a uniform depth, question and answer: ``L + 1`` tokens, as the evaluation builds
    it) and EOD, with ``L`` drawn log-uniformly from ``[min_tokens, max_tokens]``. Returns
    ``{"documents", "tokens"}`` (EOD included). ``workers`` > 1 makes the trials in that many
    processes (the documents are the same for any count). Raises :class:`ConfigError` for an
    empty or unknown task list, fewer than one document or worker, or a length range the tasks
    do not fit in.
    """
    if not tasks:
        raise ConfigError("--tasks is empty: give at least one of " + ", ".join(TRAINING_TASKS))
    chosen = [training_task(t) for t in tasks]
    if num_docs < 1:
        raise ConfigError(f"--num-docs must be >= 1, got {num_docs}")
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    if not 1 <= min_tokens <= max_tokens:
        raise ConfigError(
            f"--min-tokens/--max-tokens: need 1 <= min <= max, got {min_tokens}, {max_tokens}"
        )
    from ..code_corpus import writing_indexed_dataset

    # This process makes the trials itself (workers == 1) or only checks and writes them.
    _init_worker(tokenizer, list(tasks), max_tokens, seed)
    tok, streams = _WORKER["tok"], _WORKER["streams"]
    for task in chosen:
        # The shortest trial must hold the needle, question and answer: say so before writing.
        try:
            make_trial(task, tok, streams[task.name], min_tokens, 0.5, 0, seed="check")
        except ConfigError:
            raise ConfigError(
                f"--min-tokens: {min_tokens} tokens leave no room for a haystack around task "
                f"{task.name}'s needle, question and answer; use a larger --min-tokens"
            ) from None
    rng = random.Random(f"retrieval-train-{seed}")
    lengths = _lengths(rng, num_docs, min_tokens, max_tokens)
    # Drawn here, in document order, so that the documents do not depend on ``workers``.
    jobs = [(i, length, rng.random()) for i, length in enumerate(lengths)]
    tokens = 0
    with contextlib.ExitStack() as stack:
        writer = stack.enter_context(
            writing_indexed_dataset(os.fspath(output_prefix), tok.vocab_size)
        )
        docs = map(_document, jobs)
        if workers > 1:
            init = (tokenizer, list(tasks), max_tokens, seed)
            ctx = multiprocessing.get_context("spawn")
            pool = stack.enter_context(ctx.Pool(workers, _init_worker, init))
            docs = pool.imap(_document, jobs, chunksize=64)
        for doc in docs:
            writer.add(doc)
            tokens += doc.size
        stats = {"documents": num_docs, "tokens": tokens}
        writer.meta = {
            "generator": "retrieval-train-v1",
            "tasks": list(tasks),
            "seed": seed,
            "min_tokens": min_tokens,
            "max_tokens": max_tokens,
            "tokenizer": str(tokenizer),
            **stats,
        }
    return stats


# What _document needs, set once per process: the tokenizer and haystacks are too costly to
# send with each document.
_WORKER: dict = {}


def _init_worker(tokenizer: str, tasks: list[str], max_tokens: int, seed: int) -> None:
    from ..code_corpus import _encoder

    tok, _ = _encoder(tokenizer)
    chosen = [training_task(t) for t in tasks]
    streams = {t.name: haystack_stream(t, tok, [], max_tokens + 1) for t in chosen}
    _WORKER.update(tok=tok, tasks=chosen, streams=streams, seed=seed)


def _document(job: tuple[int, int, float]) -> np.ndarray:
    """Document ``i``: its trial at ``length`` tokens and needle ``depth``, then EOD."""
    i, length, depth = job
    w = _WORKER
    task = w["tasks"][i % len(w["tasks"])]
    trial = make_trial(
        task, w["tok"], w["streams"][task.name], length, depth, i, seed=f"train-{w['seed']}"
    )
    return np.append(trial.tokens, w["tok"].eod).astype(np.int64)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="make_retrieval_corpus",
        description="Write passkey/needle retrieval training documents (the long-context "
        "evaluation's formats, a training seed) as a Megatron indexed dataset to blend in.",
    )
    p.add_argument("--tokenizer", required=True, help="byte, or a local HF tokenizer directory")
    p.add_argument("--output-prefix", required=True, help="dataset prefix (.bin/.idx written)")
    p.add_argument("--tasks", default="passkey,needle", help="comma list of passkey, needle")
    p.add_argument("--num-docs", type=int, default=4000, help="documents (default 4000)")
    p.add_argument("--min-tokens", type=int, default=256, help="shortest trial (default 256)")
    p.add_argument("--max-tokens", type=int, default=16384, help="longest trial (default 16384)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--workers", type=int, default=1, help="processes making trials (default 1; same output)"
    )
    args = p.parse_args(argv)
    try:
        stats = write_retrieval_dataset(
            args.output_prefix,
            args.tokenizer,
            tasks=[t for t in args.tasks.split(",") if t],
            num_docs=args.num_docs,
            min_tokens=args.min_tokens,
            max_tokens=args.max_tokens,
            seed=args.seed,
            workers=args.workers,
        )
    except (ConfigError, OSError) as exc:
        print(f"make_retrieval_corpus: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.output_prefix}: {stats['documents']} documents, {stats['tokens']} tokens")
    return 0
