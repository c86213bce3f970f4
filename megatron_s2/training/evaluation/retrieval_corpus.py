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
passkey training set-up). ``needle`` and ``multikey``, by default, in the demo corpus's filler
sentences: one fixed text about a document long, so that every document's haystack is nearly
the same text (a model can memorise it), and not what the evaluation uses, which hides them in
held-out code of the run's corpus. The 4k probe of issue 50 learnt no lookup, and on the
multi-key task its models did not even answer with a number in a code haystack. With
``--haystack-corpus PREFIX --haystack-split SPLIT`` their haystacks are instead windows of the
TRAINING part of a corpus (:func:`training_haystack`; e.g. the code corpus the run trains on,
with the run's ``data.split``): varied real text, never the held-out documents the evaluation
reads (filler ``"corpus"``, as the evaluation's tasks). The held-out tasks
(:data:`~.tasks.HELDOUT_TASKS`, ``code-value``) are refused: they measure retrieval the model
was never drilled on.

Where the fact sits. Run J of ``docs/long_context_eval.md`` trained on trials of 128-1024
tokens, so every passkey lay within 1k tokens of its question, inside the S2 layers' local
window, and nothing taught the dense layers to reach further. By default every document is now
one training sequence long (``--seq-length``, or ``--max-tokens`` with ``--min-tokens`` equal to
it) and the distance between the fact and the question is drawn uniformly over the document
(``--depth-distribution``), so the distances cover the whole training context.

How many answers a document teaches. A trial supervises one answer (5-7 tokens) per up to a
training sequence of haystack, and the 4k probe of issue 50 (85M tokens, 60% such documents)
never formed the lookup. ``--queries Q`` makes each ``multikey`` document ask Q of its
``--multikey-needles`` N needles one after another, each question followed by its answer
(:func:`~.tasks.make_multi_query_trial`): Q answers in the same document length, the asked
needles' depths drawn like the single question's. Training only: the evaluation still asks one
question a trial.

Where a trial starts. Megatron cuts training samples out of the concatenated documents at
any offset, so short trials packed several to a sample seldom start at a sample's first token,
and a fact in a context's first tokens is rarely drilled: the second 4k probe of issue 50
retrieved 73-85% at 1k-4k but only 35-65% with the needle at depth 0, at 1k as at 4k.
``--pack-to P`` writes documents of exactly P tokens (P = the run's ``model.seq_length``: one
training sample each, as ``--seq-length`` does), each a run of whole trials, every trial followed
by its EOD and the last one cut to fill the document: every sample then starts with a trial.

Command line: ``tools/make_retrieval_corpus.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import multiprocessing
import os
import random
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from typing import Optional

import numpy as np

from ..run_config import ConfigError
from .tasks import (
    HELDOUT_TASKS,
    TASKS,
    check_multikey_needles,
    haystack_stream,
    join_documents,
    make_multi_query_trial,
    make_trial,
    split_documents,
    split_parts,
)

__all__ = [
    "TRAINING_TASKS",
    "TRAINING_MULTIKEY_RANGE",
    "DEPTH_DISTRIBUTIONS",
    "HAYSTACK_TOKENS",
    "training_task",
    "training_haystack",
    "write_retrieval_dataset",
    "main",
]

# Each training task, with the haystack its documents use (see the module docstring).
TRAINING_TASKS = {
    "passkey": TASKS["passkey"],
    "needle": replace(TASKS["needle"], filler="kv-filler"),
    "multikey": replace(TASKS["multikey"], filler="kv-filler"),
}
# How the distance between the fact and the question is drawn (_depth).
DEPTH_DISTRIBUTIONS = ("uniform", "log-uniform", "arcsine")
# Needles a multikey training document may hold: more than the evaluation's MULTIKEY_RANGE, so
# that a 4k document can ask dozens of questions (--queries <= needles); the writer's length
# check refuses a count that leaves no haystack.
TRAINING_MULTIKEY_RANGE = (2, 64)
# Default cap on the tokens of a --haystack-corpus haystack (--haystack-tokens): 16M tokens,
# 64 MiB as int32, thousands of code files (the code corpus's training part is about 40k
# files): enough that documents rarely share a window, small enough for every worker.
HAYSTACK_TOKENS = 16 * 2**20


def training_task(name: str, multikey_needles: Optional[int] = None, corpus: bool = False):
    """The :class:`~.tasks.Task` whose documents this corpus writes for ``name`` (a multi-needle
    task with ``multikey_needles`` needles, in :data:`TRAINING_MULTIKEY_RANGE`); with ``corpus``
    (a ``--haystack-corpus`` is given) ``needle`` and ``multikey`` take their haystack from it
    (filler ``"corpus"``, as the evaluation's), ``passkey`` keeps its repeated filler. Raises
    :class:`ConfigError` naming ``--tasks`` for a held-out or unknown task and
    ``--multikey-needles`` for a count out of range."""
    if name in HELDOUT_TASKS:
        raise ConfigError(
            f"--tasks: {name!r} is a held-out evaluation task, never written into training "
            f"documents; training tasks: {', '.join(TRAINING_TASKS)}"
        )
    if name not in TRAINING_TASKS:
        raise ConfigError(f"--tasks: unknown {name!r}; known: {', '.join(TRAINING_TASKS)}")
    task = TRAINING_TASKS[name]
    # A held-out task smuggled in under another name would defeat the point of holding it out.
    assert not task.held_out, name
    if task.needles > 1 and multikey_needles is not None:
        check_multikey_needles(multikey_needles, TRAINING_MULTIKEY_RANGE)
        task = replace(task, needles=int(multikey_needles))
    if corpus and task.filler != "passkey":
        task = replace(task, filler="corpus")
    return task


def training_haystack(
    prefixes: Sequence[str],
    split: str,
    tokenizer,
    max_tokens: int = HAYSTACK_TOKENS,
    seed: int = 0,
) -> tuple[np.ndarray, dict]:
    """The haystack of ``needle`` and ``multikey`` training documents under ``--haystack-corpus``:
    documents of the TRAINING part of the Megatron indexed datasets ``prefixes`` under the run's
    ``data.split`` string ``split`` (Megatron's split bounds, as :func:`~.tasks.heldout_documents`
    takes the validation part: :func:`~.tasks.split_documents`), so that no held-out document,
    which the evaluation hides its needles in, is ever in a training haystack.

    Which documents: the training documents of all prefixes in an order drawn from ``seed``,
    taken until their tokens reach ``max_tokens`` (the last one cut), so that they are spread
    over the whole training part, not its first files; then, in corpus order, EOD dropped and
    joined by newlines as the evaluation's haystack (:func:`~.tasks.join_documents`).
    Returns ``(stream, info)``: ``stream`` ``[min(max_tokens, training tokens)]`` token ids,
    int32 when ``tokenizer.vocab_size`` fits (always for real tokenizers), else int64; ``info``
    for the corpus's ``.meta.json``.

    Memory: 4 bytes a token, 64 MiB at the default 16M (:data:`HAYSTACK_TOKENS`); while it is
    built, about as much again for the documents' copies. The writer's worker processes
    memory-map one saved copy, so the cost does not grow with ``--workers``. Raises
    :class:`ConfigError` naming ``--haystack-corpus`` for a missing or unreadable prefix or ids
    beyond the tokenizer's vocabulary (another tokenizer's corpus), and ``--haystack-split``
    for a split that Megatron cannot parse, that has no training part or that leaves no
    training documents. A training part smaller than ``max_tokens`` gives a shorter stream
    (the writer refuses one shorter than a document).
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    matrix = split_parts(split, "--haystack-split")
    if matrix[0] is None:
        raise ConfigError(
            f"--haystack-split {split!r} has no training part (its first weight is 0): the "
            f"haystack comes from the training part only, the held-out parts are the evaluation's"
        )
    datasets, candidates = [], []
    for k, prefix in enumerate(prefixes):
        missing = [ext for ext in (".idx", ".bin") if not os.path.isfile(prefix + ext)]
        if missing:
            raise ConfigError(
                f"--haystack-corpus {prefix!r}: no indexed dataset there (missing "
                f"{' and '.join(prefix + ext for ext in missing)}); give a Megatron dataset "
                f"prefix, e.g. data/code/train_valid"
            )
        try:
            dataset = IndexedDataset(prefix)
            sizes = np.asarray(dataset.sequence_lengths, dtype=np.int64)
        except Exception as exc:  # Megatron raises assertions on a damaged index
            raise ConfigError(
                f"--haystack-corpus {prefix!r}: unreadable indexed dataset: "
                f"{type(exc).__name__} {exc}"
            ) from None
        train = split_documents(matrix[0], len(dataset))
        datasets.append(dataset)
        # (corpus, document, tokens with EOD) of every training document.
        candidates.append(
            np.stack(
                [np.full(len(train), k), np.arange(train.start, train.stop), sizes[train]], axis=1
            ).reshape(-1, 3)
        )
    candidates = np.concatenate(candidates)
    candidates = candidates[candidates[:, 2] > 0]
    if not candidates.size:
        raise ConfigError(
            f"--haystack-split {split!r} leaves no training documents in --haystack-corpus "
            f"{list(prefixes)}"
        )
    # A seed of its own (not the trials' random.Random): numpy's generator draws the
    # permutation of a million documents at once.
    digest = hashlib.sha256(f"retrieval-haystack-{seed}".encode()).digest()
    order = np.random.default_rng(int.from_bytes(digest[:8], "little")).permutation(len(candidates))
    # A document's EOD becomes the newline after it: the sizes with EOD count the joined tokens.
    take = int(np.searchsorted(np.cumsum(candidates[order, 2]), max_tokens)) + 1
    chosen = candidates[np.sort(order[:take])]  # corpus order: neighbouring files stay adjacent
    dtype = np.int32 if tokenizer.vocab_size <= np.iinfo(np.int32).max else np.int64
    stream = join_documents(
        [np.asarray(datasets[k][i], dtype=dtype) for k, i, _ in chosen], tokenizer, dtype
    )[:max_tokens]
    top = int(stream.max()) if stream.size else -1
    if top >= tokenizer.vocab_size:
        raise ConfigError(
            f"--haystack-corpus {list(prefixes)}: token id {top} is beyond the tokenizer's "
            f"vocabulary ({tokenizer.vocab_size}): a corpus of another tokenizer than --tokenizer"
        )
    info = {
        "corpus": [os.fspath(p) for p in prefixes],
        "split": split,
        "max_tokens": max_tokens,
        "documents": int(len(chosen)),
        "tokens": int(stream.size),
    }
    return stream, info


def _lengths(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    # Log-uniform between lo and hi (when a range is asked for): as many documents in each
    # doubling of the length; with lo == hi (the default) every document is hi tokens.
    if lo == hi:
        return [hi] * n
    return [int(round(math.exp(rng.uniform(math.log(lo), math.log(hi))))) for _ in range(n)]


def _pack_lengths(rng: random.Random, lo: int, hi: int, size: int) -> list[int]:
    """Trial lengths, each in ``[lo, hi]`` and drawn as :func:`_lengths` does, whose
    documents (a trial of ``L`` tokens takes ``L + 2``: the answer's last token and EOD) fill
    exactly ``size`` tokens. A draw that would leave less than a shortest trial's room is
    replaced by the length that fills the rest, or, where that is above ``hi``, by the one that
    leaves exactly a shortest trial. Needs ``size >= hi + 2`` and ``hi >= 2 * lo + 2``
    (:func:`write_retrieval_dataset` checks both)."""
    out, room = [], size
    while True:
        length = _lengths(rng, 1, lo, hi)[0]
        if room - length - 2 >= lo + 2:
            out.append(length)
            room -= length + 2
        elif room - 2 <= hi:
            out.append(room - 2)
            return out
        else:
            out.append(room - lo - 4)
            room = lo + 2


def _depth(u: float, length: int, distribution: str) -> float:
    """The needle depth (fraction of the haystack; 1 = next to the question) for a uniform draw
    ``u`` in [0, 1), so that the fact-question distance is ``distribution`` over
    [0, ``length``) tokens.

    ``uniform`` (the default): every distance is as likely, so half the trials put the fact
    more than half the document back, and at 4k-32k documents 75-97% lie beyond S2's 1k local
    window: the range the dense layers must learn to reach, and the depths the evaluation scores
    alike (its grid is uniform in depth). ``log-uniform``: as many trials in each doubling of
    the distance (1-2, ..., 2k-4k tokens): near facts dominate (at 4k half lie within 64 tokens),
    a curriculum-like mix for a model that does not yet copy at all; it under-teaches the far
    range that the uniform draw is there to cover. ``arcsine``: the depth is Beta(1/2, 1/2)
    distributed, ``sin(pi u / 2)^2``, U-shaped: in the middle about two thirds of a uniform
    draw's density (2 / pi), at the edges far more (6.4% of depths below 0.01 against 1%),
    where a fact opens its document (the evaluation's depth 0, the weakest cell under the
    uniform draw) or sits next to its question.
    """
    if distribution == "uniform":
        return u
    if distribution == "arcsine":
        return math.sin(math.pi * u / 2) ** 2
    distance = math.exp(u * math.log(max(2, length)))  # in [1, length)
    return min(1.0, max(0.0, 1.0 - distance / length))


def write_retrieval_dataset(
    output_prefix: str | os.PathLike,
    tokenizer: str,
    *,
    tasks: Sequence[str] = ("passkey", "needle"),
    num_docs: int = 4000,
    min_tokens: Optional[int] = None,
    max_tokens: Optional[int] = None,
    seq_length: Optional[int] = None,
    depth_distribution: str = "uniform",
    multikey_needles: Optional[int] = None,
    queries: int = 1,
    seed: int = 0,
    workers: int = 1,
    haystack_corpus: Optional[Sequence[str] | str] = None,
    haystack_split: Optional[str] = None,
    haystack_tokens: Optional[int] = None,
    pack_to: Optional[int] = None,
    reuse: bool = False,
) -> dict:
    """Write ``num_docs`` retrieval documents as a Megatron indexed dataset
    ``output_prefix.bin/.idx`` (+ ``.meta.json``), tokenized with ``tokenizer`` (``byte`` or a
    local HF tokenizer directory, e.g. ``data/code/tokenizer``).

    Document ``i`` is task ``tasks[i % len(tasks)]``: a trial at length ``L`` (haystack with the
    needle, question and answer: ``L + 1`` tokens, as the evaluation builds it) and EOD. ``L``:
    ``seq_length - 2`` for a run of that ``model.seq_length`` (each document is then exactly
    one training sample: Megatron's samples start every ``seq_length`` tokens, so documents of
    that length never straddle two), else ``max_tokens`` (default 16384), or drawn
    log-uniformly from ``[min_tokens, max_tokens]`` when ``min_tokens`` is given below it. The
    fact-question distance is drawn by ``depth_distribution`` over the whole trial
    (:func:`_depth`). ``multikey_needles``: needles per ``multikey`` document (default
    :data:`~.tasks.MULTIKEY_NEEDLES`, up to :data:`TRAINING_MULTIKEY_RANGE`). ``queries`` (Q):
    questions per document of a multi-needle task (``multikey``): Q distinct needles asked one
    after another after the haystack, each question followed by its answer
    (:func:`~.tasks.make_multi_query_trial`), every asked needle's distance drawn by
    ``depth_distribution``; the document keeps its length (the haystack gives up the room).
    Single-needle tasks in the list keep one question. Q = 1 (the default) writes the documents
    this writer always wrote, byte for byte. Returns ``{"documents", "tokens"}`` (EOD
    included). ``workers`` > 1 makes the trials in that many processes (the documents are the
    same for any count).

    ``haystack_corpus`` (one or more indexed dataset prefixes, e.g. ``data/code/train_valid``)
    with ``haystack_split`` (the run's ``data.split``): ``needle`` and ``multikey`` documents,
    multi-question ones included, hide their needles in windows of up to ``haystack_tokens``
    (default :data:`HAYSTACK_TOKENS`) tokens of the corpus's training part
    (:func:`training_haystack`, its documents drawn from ``seed``; memory there); ``passkey``
    keeps its filler. Without them the documents are those this writer always wrote, byte
    for byte; with them ``.meta.json`` gets ``"haystack"``.

    ``pack_to`` (P, tokens): each of the ``num_docs`` documents is instead a run of whole
    trials (lengths from ``[min_tokens, max_tokens]``, :func:`_pack_lengths`), each with its
    EOD, exactly P tokens in all: with P = ``model.seq_length`` every training sample starts
    with a trial (see the module docstring). Trial ``j`` overall is task
    ``tasks[j % len(tasks)]``. ``.meta.json`` gets ``"pack_to"`` and ``"trials"``; without
    ``pack_to`` the documents are unchanged, byte for byte.

    Raises :class:`ConfigError` naming the option, before writing anything, for an empty,
    unknown or held-out task, fewer than one document or worker, a length range the tasks do
    not fit in, an unknown depth distribution or needle count, ``--queries`` below 1, above the
    needle count, or above 1 with no multi-needle task, one of ``--haystack-corpus`` and
    ``--haystack-split`` without the other (or ``--haystack-tokens`` without them), a
    ``--haystack-tokens`` below the document length (``max_tokens + 2``), and the errors of
    :func:`training_haystack`; and for ``pack_to`` with ``seq_length``, or below
    ``max_tokens + 2`` (a document must hold the longest trial), or with ``max_tokens`` below
    ``2 * min_tokens + 2`` (the last trial of a document could not be filled in range).

    ``reuse``: when ``output_prefix`` already holds a dataset, keep it if its ``.meta.json``
    records exactly the settings asked now (every field the writer records from its arguments:
    tasks, seed, lengths, depth distribution, needles, queries, tokenizer, documents, packing
    and the haystack's corpus, split and cap) and return its ``{"documents", "tokens",
    "reused": True}`` without reading the tokenizer or the corpus; raise :class:`ConfigError`
    naming each differing field (written and asked) otherwise, or when the ``.meta.json`` is
    missing. A study script that caches corpora by prefix calls the writer with it every time.
    """
    if not tasks:
        raise ConfigError("--tasks is empty: give at least one of " + ", ".join(TRAINING_TASKS))
    chosen = [training_task(t, multikey_needles) for t in tasks]
    if num_docs < 1:
        raise ConfigError(f"--num-docs must be >= 1, got {num_docs}")
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    _check_queries(queries, chosen)
    if depth_distribution not in DEPTH_DISTRIBUTIONS:
        raise ConfigError(
            f"--depth-distribution: unknown {depth_distribution!r}; allowed: "
            + ", ".join(DEPTH_DISTRIBUTIONS)
        )
    if seq_length is not None:
        if max_tokens is not None:
            raise ConfigError(
                "--seq-length and --max-tokens: give one (--seq-length S writes trials of "
                "S - 2 tokens, one training sample each with the answer's last token and EOD)"
            )
        if seq_length < 3:
            raise ConfigError(f"--seq-length must be >= 3 (a training sequence), got {seq_length}")
        max_tokens = seq_length - 2
    max_tokens = 16384 if max_tokens is None else max_tokens
    min_tokens = max_tokens if min_tokens is None else min_tokens
    if not 1 <= min_tokens <= max_tokens:
        raise ConfigError(
            f"--min-tokens/--max-tokens: need 1 <= min <= max, got {min_tokens}, {max_tokens}"
        )
    corpus = _check_haystack_options(haystack_corpus, haystack_split, haystack_tokens, max_tokens)
    _check_pack(pack_to, seq_length, min_tokens, max_tokens)
    uses_corpus = bool(corpus) and any(
        training_task(n, None, True).filler == "corpus" for n in tasks
    )
    cap = HAYSTACK_TOKENS if haystack_tokens is None else haystack_tokens
    # What .meta.json records of the arguments (the counts it adds come from the writing).
    settings = {
        "generator": "retrieval-train-v2",
        "tasks": list(tasks),
        "seed": seed,
        "min_tokens": min_tokens,
        "max_tokens": max_tokens,
        "depth_distribution": depth_distribution,
        "multikey_needles": max(t.needles for t in chosen),
        "queries": queries,
        "tokenizer": str(tokenizer),
        "documents": num_docs,
    }
    if pack_to is not None:
        settings["pack_to"] = pack_to
    haystack_settings = {"corpus": corpus, "split": haystack_split, "max_tokens": cap}
    if reuse and os.path.isfile(os.fspath(output_prefix) + ".idx"):
        return _reused(
            os.fspath(output_prefix), settings, haystack_settings if uses_corpus else None
        )
    from ..code_corpus import writing_indexed_dataset

    haystack = haystack_meta = None
    if corpus:
        from ..tokenizer import load_tokenizer

        # Read (and so checked) even for passkey alone, which then does not use it.
        haystack, haystack_meta = training_haystack(
            corpus, haystack_split, load_tokenizer(tokenizer), cap, seed
        )
        if haystack.size < max_tokens + 2:
            raise ConfigError(
                f"--haystack-corpus {corpus}: its training part under --haystack-split "
                f"{haystack_split!r} holds {haystack.size} tokens, less than one document "
                f"({max_tokens + 2}); give a larger corpus"
            )
        if not uses_corpus:
            haystack = haystack_meta = None
    # This process makes the trials itself (workers == 1) or only checks and writes them.
    init = (tokenizer, list(tasks), max_tokens, seed, multikey_needles, bool(corpus))
    _init_worker(*init, haystack=haystack)
    tok, streams = _WORKER["tok"], _WORKER["streams"]
    for task in chosen:
        # The shortest trial must hold the needles, questions and answers: say so before writing.
        asks = _asks(task, queries)
        try:
            _trial(task, tok, streams[task.name], min_tokens, (0.5,) * asks, 0, "check")
        except ConfigError:
            what = (
                f"{task.needles} needles and {asks} questions with their answers"
                if asks > 1
                else "needle, question and answer"
            )
            fix = " or fewer --queries / --multikey-needles" if asks > 1 else ""
            raise ConfigError(
                f"--min-tokens: {min_tokens} tokens leave no room for a haystack around task "
                f"{task.name}'s {what}; use a larger --min-tokens (or --seq-length){fix}"
            ) from None
    rng = random.Random(f"retrieval-train-{seed}")
    if pack_to is None:
        lengths = _lengths(rng, num_docs, min_tokens, max_tokens)
        groups = [1] * num_docs  # trials per document
    else:
        lengths, groups = [], []
        for _ in range(num_docs):
            part = _pack_lengths(rng, min_tokens, max_tokens, pack_to)
            lengths += part
            groups.append(len(part))
    # Drawn here, in document order, so that the documents do not depend on ``workers``: one
    # depth per question (one per document for Q = 1: the draws this writer always made).
    jobs = []
    for i, length in enumerate(lengths):
        asks = _asks(chosen[i % len(chosen)], queries)
        depths = tuple(_depth(rng.random(), length, depth_distribution) for _ in range(asks))
        jobs.append((i, length, depths))
    tokens = 0
    with contextlib.ExitStack() as stack:
        writer = stack.enter_context(
            writing_indexed_dataset(os.fspath(output_prefix), tok.vocab_size)
        )
        docs = map(_document, jobs)
        if workers > 1:
            shared = None
            if haystack is not None:
                # One copy for all processes: the workers memory-map it (the page cache holds it
                # once) instead of each building its own; this process maps it too.
                folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="haystack-"))
                shared = os.path.join(folder, "haystack.npy")
                np.save(shared, haystack)
                haystack = None
                _use_haystack(np.load(shared, mmap_mode="r"))
            ctx = multiprocessing.get_context("spawn")
            pool = stack.enter_context(ctx.Pool(workers, _init_worker, (*init, shared)))
            docs = pool.imap(_document, jobs, chunksize=64)
        docs = iter(docs)
        for count in groups:
            doc = np.concatenate([next(docs) for _ in range(count)])
            writer.add(doc)
            tokens += doc.size
        stats = {"documents": num_docs, "tokens": tokens}
        writer.meta = {**settings, **stats}
        if haystack_meta is not None:
            writer.meta["haystack"] = haystack_meta
        if pack_to is not None:
            writer.meta["trials"] = len(lengths)
    _WORKER.clear()  # the haystack's memory (or its mapping of a removed file) goes with it
    return stats


def _reused(prefix: str, settings: dict, haystack: Optional[dict]) -> dict:
    """The dataset at ``prefix`` kept as it is when its ``.meta.json`` holds ``settings`` and,
    for a corpus haystack, ``haystack``'s fields under its ``"haystack"`` (none without one):
    ``{"documents", "tokens", "reused": True}``; :class:`ConfigError` naming every difference."""
    again = "remove it or give another --output-prefix"
    try:
        with open(prefix + ".meta.json", encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"--reuse: {prefix}.idx exists but its .meta.json cannot be read ({exc}), so how it "
            f"was written is unknown; {again}"
        ) from None
    diff = [f"{k} {meta.get(k)!r}, asked {v!r}" for k, v in settings.items() if meta.get(k) != v]
    written = meta.get("haystack")
    if haystack is None and written is not None:
        diff.append(f"haystack from {written.get('corpus')!r}, asked the filler")
    elif haystack is not None:
        written = written or {}
        diff += [
            f"haystack {k} {written.get(k)!r}, asked {v!r}"
            for k, v in haystack.items()
            if written.get(k) != v
        ]
    if diff:
        raise ConfigError(
            f"--output-prefix {prefix} was written with other settings (written "
            f"{'; '.join(diff)}); {again}"
        )
    return {"documents": meta["documents"], "tokens": meta["tokens"], "reused": True}


# What _document needs, set once per process: the tokenizer and haystacks are too costly to
# send with each document.
_WORKER: dict = {}


def _init_worker(
    tokenizer: str,
    tasks: list[str],
    max_tokens: int,
    seed: int,
    multikey_needles=None,
    corpus: bool = False,
    haystack=None,
) -> None:
    """Set :data:`_WORKER` up for this process: the tokenizer, the tasks (with ``corpus``, the
    ``--haystack-corpus`` ones) and each task's haystack stream; ``haystack``: the corpus
    stream (an array, or in a worker the path of its saved copy, memory-mapped)."""
    from ..code_corpus import _encoder

    tok, _ = _encoder(tokenizer)
    chosen = [training_task(t, multikey_needles, corpus) for t in tasks]
    # The corpus tasks' stream is the haystack, set below (not built per task).
    streams = {
        t.name: haystack_stream(t, tok, [], max_tokens + 1) for t in chosen if t.filler != "corpus"
    }
    _WORKER.update(tok=tok, tasks=chosen, streams=streams, seed=seed)
    if haystack is not None:
        _use_haystack(np.load(haystack, mmap_mode="r") if isinstance(haystack, str) else haystack)


def _use_haystack(stream: np.ndarray) -> None:
    # The corpus haystack, one array shared by every task that hides its needles in it.
    for t in _WORKER["tasks"]:
        if t.filler == "corpus":
            _WORKER["streams"][t.name] = stream


def _check_haystack_options(corpus, split, tokens, max_tokens: int) -> list[str]:
    """The ``--haystack-corpus`` prefixes (``[]`` without one), after checking that it and
    ``--haystack-split`` come together, and ``--haystack-tokens`` only with them, an integer
    of at least the document length ``max_tokens + 2``; :class:`ConfigError` naming the
    option otherwise."""
    corpus = [corpus] if isinstance(corpus, (str, os.PathLike)) else list(corpus or [])
    corpus = [os.fspath(c) for c in corpus]
    if corpus and split is None:
        raise ConfigError(
            "--haystack-corpus needs --haystack-split: the run's data.split (e.g. "
            "'39166,708,0'), so that only its training part is used"
        )
    if split is not None and not corpus:
        raise ConfigError("--haystack-split needs --haystack-corpus (the corpus it splits)")
    if tokens is None:
        return corpus
    if not corpus:
        raise ConfigError("--haystack-tokens needs --haystack-corpus (it caps that haystack)")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < max_tokens + 2:
        raise ConfigError(
            f"--haystack-tokens must be an integer of at least the document length "
            f"{max_tokens + 2} (trial + answer's last token + EOD), got {tokens!r}"
        )
    return corpus


def _check_pack(pack_to, seq_length, min_tokens: int, max_tokens: int) -> None:
    # --pack-to: refused before anything is written (see write_retrieval_dataset).
    if pack_to is None:
        return
    if isinstance(pack_to, bool) or not isinstance(pack_to, int):
        raise ConfigError(f"--pack-to must be an integer (tokens a document), got {pack_to!r}")
    if seq_length is not None:
        raise ConfigError(
            "--pack-to and --seq-length: give one (--pack-to P packs trials of --min-tokens to "
            "--max-tokens into documents of P tokens; --seq-length writes one trial a document)"
        )
    if pack_to < max_tokens + 2:
        raise ConfigError(
            f"--pack-to must be at least --max-tokens + 2 = {max_tokens + 2} (a document holds "
            f"the longest trial with its answer's last token and EOD), got {pack_to}"
        )
    if max_tokens < 2 * min_tokens + 2:
        raise ConfigError(
            f"--pack-to needs --max-tokens >= 2 * --min-tokens + 2 = {2 * min_tokens + 2} (the "
            f"last trial of a document is cut to fill it and must stay in range), got "
            f"--min-tokens {min_tokens} --max-tokens {max_tokens}"
        )


def _check_queries(queries, chosen) -> None:
    """Raise :class:`ConfigError` naming ``--queries`` unless it is an integer >= 1, and, above
    1, at most the needle count of every multi-needle task of ``chosen`` with at least one such
    task among them."""
    if isinstance(queries, bool) or not isinstance(queries, int) or queries < 1:
        raise ConfigError(
            f"--queries must be an integer >= 1 (questions a document), got {queries!r}"
        )
    if queries == 1:
        return
    multi = [t for t in chosen if t.needles > 1]
    if not multi:
        accept = ", ".join(n for n, t in TRAINING_TASKS.items() if t.needles > 1)
        raise ConfigError(
            f"--queries {queries}: only multi-needle tasks ask several questions ({accept}); "
            f"--tasks {','.join(t.name for t in chosen)} has none"
        )
    for t in multi:
        if queries > t.needles:
            raise ConfigError(
                f"--queries {queries} is more than task {t.name}'s {t.needles} needles "
                f"(--multikey-needles): each question asks a different needle"
            )


def _asks(task, queries: int) -> int:
    # Questions in one document of ``task``: single-needle tasks ask one whatever --queries says.
    return queries if task.needles > 1 else 1


def _trial(task, tok, stream, length: int, depths: tuple, index: int, seed: str) -> np.ndarray:
    """The tokens of one document's trial (no EOD): :func:`~.tasks.make_trial` for one
    question, exactly as before ``--queries``; :func:`~.tasks.make_multi_query_trial` for
    more."""
    if len(depths) == 1:
        return make_trial(task, tok, stream, length, depths[0], index, seed=seed).tokens
    return make_multi_query_trial(task, tok, stream, length, depths, index, seed=seed).tokens


def _document(job: tuple[int, int, tuple]) -> np.ndarray:
    """Document ``i``: its trial at ``length`` tokens and needle ``depths`` (one per
    question), then EOD."""
    i, length, depths = job
    w = _WORKER
    task = w["tasks"][i % len(w["tasks"])]
    tokens = _trial(
        task, w["tok"], w["streams"][task.name], length, depths, i, f"train-{w['seed']}"
    )
    return np.append(tokens, w["tok"].eod).astype(np.int64)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``tools/make_retrieval_corpus.py``); exit code 2 on bad input."""
    p = argparse.ArgumentParser(
        prog="make_retrieval_corpus",
        description="Write passkey/needle/multikey retrieval training documents (the long-context "
        "evaluation's formats, a training seed) as a Megatron indexed dataset to blend in.",
    )
    p.add_argument("--tokenizer", required=True, help="byte, or a local HF tokenizer directory")
    p.add_argument("--output-prefix", required=True, help="dataset prefix (.bin/.idx written)")
    p.add_argument(
        "--tasks",
        default="passkey,needle",
        help=f"comma list of {', '.join(TRAINING_TASKS)} (held out, refused: "
        f"{', '.join(HELDOUT_TASKS)})",
    )
    p.add_argument("--num-docs", type=int, default=4000, help="documents (default 4000)")
    p.add_argument(
        "--seq-length",
        type=int,
        help="the training run's model.seq_length: trials of SEQ_LENGTH - 2 tokens, each "
        "document exactly one training sample (instead of --max-tokens)",
    )
    p.add_argument("--max-tokens", type=int, help="trial length (default 16384; or --seq-length)")
    p.add_argument(
        "--min-tokens",
        type=int,
        help="shortest trial: lengths drawn log-uniformly from [min, max] (default: all max)",
    )
    p.add_argument(
        "--depth-distribution",
        default="uniform",
        help="where the fact sits in its trial: uniform (default), log-uniform (near facts "
        "favoured) or arcsine (U-shaped: more facts at the trial's start and end)",
    )
    p.add_argument(
        "--multikey-needles",
        type=int,
        help="needles in a multikey document (default 4, from {} to {})".format(
            *TRAINING_MULTIKEY_RANGE
        ),
    )
    p.add_argument(
        "--queries",
        type=int,
        default=1,
        help="questions in a multikey document, each followed by its answer (default 1; at most "
        "--multikey-needles): more answers per training token; passkey and needle ask one",
    )
    p.add_argument(
        "--haystack-corpus",
        nargs="+",
        action="extend",
        metavar="PREFIX",
        help="indexed dataset prefix(es), e.g. data/code/train_valid: needle and multikey "
        "haystacks from their training part (passkey keeps its filler); with --haystack-split",
    )
    p.add_argument(
        "--haystack-split",
        metavar="SPLIT",
        help="the run's data.split, e.g. 39166,708,0: only its training part is used (the "
        "held-out parts are the evaluation's haystacks)",
    )
    p.add_argument(
        "--haystack-tokens",
        type=int,
        help=f"cap on the haystack's tokens, documents drawn from --seed over the whole training "
        f"part (default {HAYSTACK_TOKENS}: {HAYSTACK_TOKENS * 4 // 2**20} MiB as int32)",
    )
    p.add_argument(
        "--pack-to",
        type=int,
        metavar="P",
        help="documents of exactly P tokens (the run's model.seq_length), each a run of whole "
        "trials of --min-tokens to --max-tokens, so that every training sample starts with a "
        "trial; --num-docs counts these documents",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--reuse",
        action="store_true",
        help="if --output-prefix already holds a dataset written with these same settings (its "
        ".meta.json), keep it and exit 0; one written otherwise is an error naming the "
        "differences (default: write anew)",
    )
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
            seq_length=args.seq_length,
            depth_distribution=args.depth_distribution,
            multikey_needles=args.multikey_needles,
            queries=args.queries,
            seed=args.seed,
            workers=args.workers,
            haystack_corpus=args.haystack_corpus,
            haystack_split=args.haystack_split,
            haystack_tokens=args.haystack_tokens,
            pack_to=args.pack_to,
            reuse=args.reuse,
        )
    except (ConfigError, OSError) as exc:
        print(f"make_retrieval_corpus: error: {exc}", file=sys.stderr)
        return 2
    how = "reused, written before with these settings: " if stats.get("reused") else ""
    print(f"{args.output_prefix}: {how}{stats['documents']} documents, {stats['tokens']} tokens")
    return 0
