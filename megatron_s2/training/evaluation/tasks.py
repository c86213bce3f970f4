"""What a long-context evaluation reads: the run's held-out documents and the retrieval prompts
built from them.

A retrieval trial is ``length + 1`` tokens of the run's tokenizer: a haystack, a needle (a
key-value statement) at a depth fraction of it, a question and the answer (:func:`make_trial`).
Tasks (:data:`TASKS`): ``passkey`` (Mohtashami & Jaggi's repeated filler sentences),
``needle`` (a "special magic number" sentence in held-out text of the run's corpus), ``kv``
(the demo corpus's ``let key=value;`` statements in held-out demo text: what a model trained on
it can retrieve) and ``kv-filler`` (the same statement in the demo corpus's filler sentences).

Nothing here runs a model: the retrieval training corpus (:mod:`.retrieval_corpus`) writes
its documents with the same functions.
"""

from __future__ import annotations

import random
import string
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..run_config import ConfigError, RunConfig

__all__ = [
    "PASSKEY_FILLER",
    "Task",
    "TASKS",
    "Trial",
    "default_tasks",
    "heldout_documents",
    "haystack_stream",
    "make_trial",
    "check_grid",
]

# Mohtashami & Jaggi (2023), "Landmark Attention": the passkey test's filler.
PASSKEY_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
# Fresh keys are drawn until one does not occur in the haystack (an ambiguous needle otherwise).
KEY_ATTEMPTS = 100


def _run_prefixes(cfg: RunConfig) -> list[str]:
    """The corpora of the run, as the trainer finds them (the demo corpus is generated if
    missing)."""
    if cfg.data.demo:
        from ..demo_corpus import ensure_demo_data

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
        from ..demo_corpus import filler_text

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
