"""What a long-context evaluation reads: the run's held-out documents and the retrieval prompts
built from them.

A retrieval trial is ``length + 1`` tokens of the run's tokenizer: a haystack, a needle (a
key-value statement) at a depth fraction of it, a question and the answer (:func:`make_trial`).
Tasks (:data:`TASKS`): ``passkey`` (Mohtashami & Jaggi's repeated filler sentences),
``needle`` (a "special magic number" sentence in held-out text of the run's corpus), ``kv``
(the demo corpus's ``let key=value;`` statements in held-out demo text: what a model trained on
it can retrieve), ``kv-filler`` (the same statement in the demo corpus's filler sentences),
``multikey`` (several key-value sentences with distinct keys at different depths, one asked for)
and ``code-value`` (a constant defined once as a Python statement in held-out code and printed
at the end: held out, never written into training documents, :data:`HELDOUT_TASKS`).

Nothing here runs a model: the retrieval training corpus (:mod:`.retrieval_corpus`) writes
its documents with the same functions, and its multi-question documents with
:func:`make_multi_query_trial` (several needles asked one after another: more answers per
training token; training only, the evaluation asks one question a trial).
"""

from __future__ import annotations

import random
import string
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from ..run_config import ConfigError, RunConfig, check_split

__all__ = [
    "PASSKEY_FILLER",
    "Task",
    "TASKS",
    "HELDOUT_TASKS",
    "MULTIKEY_NEEDLES",
    "MULTIKEY_RANGE",
    "get_task",
    "Trial",
    "default_tasks",
    "split_parts",
    "split_documents",
    "heldout_documents",
    "haystack_stream",
    "join_documents",
    "make_trial",
    "Question",
    "MultiQueryTrial",
    "make_multi_query_trial",
    "check_grid",
]

# Mohtashami & Jaggi (2023), "Landmark Attention": the passkey test's filler.
PASSKEY_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
# Fresh keys are drawn until one does not occur in the haystack (an ambiguous needle otherwise).
KEY_ATTEMPTS = 100
# multikey: needles in one haystack by default, and the range a caller may ask for (one needle is
# the `needle` task; past 16 the needles crowd short haystacks out).
MULTIKEY_NEEDLES = 4
MULTIKEY_RANGE = (2, 16)
# Distractor needles are redrawn this often to land on a boundary no other needle took.
DEPTH_ATTEMPTS = 20


def _run_prefixes(cfg: RunConfig) -> list[str]:
    """The corpora of the run, as the trainer finds them (the demo corpus is generated if
    missing)."""
    if cfg.data.demo:
        from ..demo_corpus import ensure_demo_data

        extra = {"num_docs": cfg.data.demo_num_docs} if cfg.data.demo_num_docs else {}
        return [ensure_demo_data(cfg.data.demo_dir, seed=0, **extra)]
    return cfg.blend()[0]


def split_parts(split: str, option: str = "data.split") -> list:
    """Megatron's split matrix of the ``data.split`` string ``split`` (e.g. ``"39166,708,0"``):
    per part (train, valid, test) its ``(begin, end)`` fractions of a corpus's documents, or
    None where the part weighs 0. Raises :class:`ConfigError` naming ``option`` (the setting
    the string came from) unless it is three non-negative weights, not all 0."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    check_split(split, option)
    return convert_split_vector_to_split_matrix(parse_and_normalize_split(split))


def split_documents(part, num_documents: int) -> range:
    """The document indices of one part of :func:`split_parts` (a ``(begin, end)`` pair) in a
    corpus of ``num_documents`` documents, with Megatron's rounding of split bounds
    (``BlendedMegatronDatasetBuilder``): what a run trains on (part 0) or validates on
    (part 1), exactly."""
    n = float(num_documents)
    return range(int(round(part[0] * n)), int(round(part[1] * n)))


def heldout_documents(cfg: RunConfig) -> list[np.ndarray]:
    """The held-out documents of the run's corpora (token id arrays, EOD included): the
    validation part of ``data.split`` (the test part when validation has no weight), in
    corpus order. Raises :class:`ConfigError` naming ``data.split`` when neither has any."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    matrix = split_parts(cfg.data.split)
    part = matrix[1] if matrix[1] is not None else matrix[2]
    if part is None:
        raise ConfigError(
            f"data.split {cfg.data.split!r} holds nothing out (validation and test weigh 0): the "
            f"evaluation reads held-out documents; give the valid part a weight"
        )
    docs = []
    for prefix in _run_prefixes(cfg):
        dataset = IndexedDataset(prefix)
        docs.extend(
            np.asarray(dataset[i], dtype=np.int64) for i in split_documents(part, len(dataset))
        )
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
    ``needles``: key-value needles in one haystack (distinct keys; the first is asked for).
    ``key_alphabet``: the letters keys are drawn from. ``value_first_nonzero``: the value's first
    digit is 1-9 (a Python integer literal). ``top_level``: a boundary must also be followed by
    a line that starts in column 0 (a top-level statement boundary of code). ``held_out``: never
    in training documents (:mod:`.retrieval_corpus` refuses it).
    """

    name: str
    needle: str
    question: str
    answer: str
    filler: str
    boundary: str
    key_letters: int
    value_digits: int
    needles: int = 1
    key_alphabet: str = string.ascii_lowercase
    value_first_nonzero: bool = False
    top_level: bool = False
    held_out: bool = False


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
    # Several needles of one format with distinct keys (RULER's multi-key needle): the model has
    # to find the asked key's value among look-alikes, not the one number in the haystack.
    "multikey": Task(
        "multikey",
        needle="The value of key {key} is {value}.\n",
        question="What is the value of key {key}? The value of key {key} is",
        answer=" {value}",
        filler="corpus",
        boundary="\n",
        key_letters=6,
        value_digits=6,
        needles=MULTIKEY_NEEDLES,
    ),
    # Held out: a module constant defined once, between two top-level statements of held-out
    # code, and printed at the end with the value as a doctest-style comment. The answer is its
    # digits (no leading zero: a valid literal), scored by exact match as every task. No
    # training document has this form (retrieval_corpus refuses the task; a test checks its
    # template's text is absent from them), so it measures retrieval the model was not drilled on.
    "code-value": Task(
        "code-value",
        needle="MAX_{key} = {value}\n",
        question="print(MAX_{key})  # ->",
        answer=" {value}",
        filler="corpus",
        boundary="\n",
        key_letters=8,
        value_digits=5,
        key_alphabet=string.ascii_uppercase,
        value_first_nonzero=True,
        top_level=True,
        held_out=True,
    ),
}
# Tasks that no training document may hold.
HELDOUT_TASKS = tuple(name for name, task in TASKS.items() if task.held_out)


def get_task(name: str, multikey_needles: Optional[int] = None) -> Task:
    """The :class:`Task` ``name`` of :data:`TASKS`; ``multikey_needles`` sets the needle count
    of a multi-needle task (default :data:`MULTIKEY_NEEDLES`). Raises :class:`ConfigError`
    naming ``--tasks`` or ``--multikey-needles`` and the allowed values."""
    if name not in TASKS:
        raise ConfigError(f"--tasks: unknown {name!r}; known: {', '.join(TASKS)}")
    task = TASKS[name]
    if multikey_needles is None or task.needles == 1:
        return task
    check_multikey_needles(multikey_needles)
    return replace(task, needles=int(multikey_needles))


def check_multikey_needles(n, allowed: tuple[int, int] = MULTIKEY_RANGE) -> None:
    """Raise :class:`ConfigError` naming ``--multikey-needles`` unless ``n`` is an integer in
    ``allowed`` (both ends included; the evaluation's :data:`MULTIKEY_RANGE` by default)."""
    lo, hi = allowed
    if isinstance(n, bool) or not isinstance(n, int) or not lo <= n <= hi:
        raise ConfigError(
            f"--multikey-needles must be an integer from {lo} to {hi} (needles in one haystack), "
            f"got {n!r}"
        )


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
        unit = join_documents(documents, tokenizer)
    if unit.size == 0:
        raise ConfigError(f"task {task.name}: the filler text tokenizes to nothing")
    return np.resize(unit, max(min_tokens, unit.size))


def join_documents(documents: Sequence[np.ndarray], tokenizer, dtype=np.int64) -> np.ndarray:
    """The ``documents`` (token id arrays) as one haystack: each without its EOD tokens (so that a
    needle and its question are in one document) and followed by the newline's tokens, in
    ``dtype`` (``[sum of sizes less EOD + newlines]``; the evaluation's int64, or int32 to halve a
    large training haystack)."""
    newline = np.asarray(tokenizer.encode("\n"), dtype=dtype)
    parts = []
    for doc in documents:
        parts += [np.asarray(doc[doc != tokenizer.eod], dtype=dtype), newline]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


@dataclass(frozen=True)
class Trial:
    """One retrieval prompt: ``tokens`` (``[length + 1]``; the model reads ``[:length]``) with the
    asked needle at token ``needle_at`` (``depth`` = haystack tokens before it / haystack
    tokens, after snapping to a boundary), the question at ``question_at`` and the answer in
    ``tokens[answer_at:]``; the model predicts answer token ``i`` at position ``i - 1``.
    ``distance``: tokens between the asked needle's end and the question. ``others``: the other
    needles of a multi-needle task, ``(key, value, token offset)`` each."""

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
    question_at: int = 0
    distance: int = 0
    others: tuple = ()


def _starts_line(text: str) -> bool:
    # A line starting in column 0 that is not the closing bracket of a multi-line expression.
    return bool(text) and not text[0].isspace() and text[0] not in ")]}"


def _ends_unit(text: str, task: Task) -> bool:
    """Whether a token whose text is ``text`` ends a unit (sentence, line) of ``task``'s
    haystack, so that a needle may follow it."""
    if text.endswith(task.boundary):
        return True
    # Byte-level BPE merges a line's end with the next line's indentation ("\n        "), so in
    # indented code a token ending in the newline itself is rare (thousands of tokens apart in
    # a class body) and needles snapped far from their depth, a third of them to the
    # haystack's start. Such a token ends a line too: the needle then follows the indentation
    # (and the next line, whose indentation it took, starts in column 0). Not for top-level
    # tasks, whose needle must be a column-0 statement.
    if task.boundary == "\n" and not task.top_level and "\n" in text:
        return not text[text.rindex("\n") + 1 :].strip(" \t")
    return False


def _boundaries(tokenizer, ids: np.ndarray, task: Task) -> np.ndarray:
    """Per token of ``ids``: whether a needle may follow it: its text ends a unit of the
    haystack (:func:`_ends_unit`: ends with ``task.boundary``, or for a line boundary, a newline
    followed by indentation only), and for a ``top_level`` task the next token starts a column-0
    line (not a parse: a decorator's line may precede such a point; the last token counts, as
    the question, a column-0 line, follows it)."""
    uniq = np.unique(ids)
    text = {int(t): tokenizer.decode([int(t)]) for t in uniq}
    ends = {t: _ends_unit(s, task) for t, s in text.items()}
    ok = np.fromiter((ends[int(t)] for t in ids), bool, count=ids.size)
    if task.top_level and ids.size:
        nxt = np.fromiter((_starts_line(text[int(t)]) for t in ids[1:]), bool, count=ids.size - 1)
        ok[:-1] &= nxt
    return ok


def _digits(rng: random.Random, task: Task) -> str:
    value = "".join(rng.choice(string.digits) for _ in range(task.value_digits))
    if task.value_first_nonzero and value[0] == "0":
        value = rng.choice("123456789") + value[1:]
    return value


def _snap(ok: np.ndarray, target: int, nearest: bool = False) -> int:
    """The insertion point for haystack token ``target``: after the last boundary token before
    it (0, the haystack's start, if none); with ``nearest``, after the boundary token closest
    to it on either side (for ``top_level`` tasks, whose haystack starts mid-line: the
    haystack's last token is always such a boundary)."""
    hits = np.flatnonzero(ok[:target]) if not nearest else np.flatnonzero(ok)
    if nearest and hits.size:
        return int(hits[np.argmin(np.abs(hits + 1 - target))]) + 1
    return int(hits[-1]) + 1 if target and hits.size else 0


def make_trial(
    task: Task,
    tokenizer,
    stream: np.ndarray,
    length: int,
    depth: float,
    index: int,
    *,
    seed: int = 0,
    draw_length: Optional[int] = None,
) -> Trial:
    """The trial ``index`` of ``task`` at ``length`` tokens and needle ``depth`` (0 = the start
    of the context, 1 = just before the question), deterministic in ``seed``.

    ``draw_length`` (default ``length``): the length whose draws (value, keys, haystack start)
    the trial takes, so that a trial built shorter for a prompt prefix (the evaluation's
    ``--prefix-eod``) asks the same needle as the trial at ``draw_length``: the two are paired.

    The haystack is a window of ``stream`` (:func:`haystack_stream`) ending at a boundary;
    the asked needle goes after the last boundary at or before ``depth`` of it (for a
    ``top_level`` task, the nearest: the realised depth is in the trial), the other
    needles of a multi-needle task (``task.needles`` > 1; distinct keys and values) at depths
    drawn uniformly, each on a boundary no other needle took where the haystack has enough. The
    keys are drawn until none occurs in the haystack. Raises :class:`ConfigError` naming
    ``--lengths`` when the length leaves no room for a haystack.
    """
    drawn = length if draw_length is None else draw_length
    rng = random.Random(f"{seed}-{task.name}-{drawn}-{depth!r}-{index}")
    b = _build(task, tokenizer, stream, length, [depth], rng)
    return Trial(
        task=task.name,
        length=length,
        target_depth=depth,
        depth=b.at[0] / b.room,
        index=index,
        key=b.keys[0],
        value=b.values[0],
        tokens=b.tokens,
        needle_at=b.offsets[0],
        answer_at=b.answer_at[0],
        question_at=b.question_at[0],
        distance=b.question_at[0] - b.offsets[0] - b.needle_sizes[0],
        others=tuple((b.keys[j], b.values[j], b.offsets[j]) for j in range(1, task.needles)),
    )


@dataclass(frozen=True)
class Question:
    """One question of a :class:`MultiQueryTrial`: the asked needle's ``key`` and ``value``,
    its ``target_depth`` and realised ``depth`` (haystack fractions, as in :class:`Trial`), the
    needle at token ``needle_at``, the question at ``question_at``, its answer in
    ``tokens[answer_at:answer_end]``; ``distance``: tokens between the needle's end and the
    question."""

    key: str
    value: str
    target_depth: float
    depth: float
    needle_at: int
    question_at: int
    answer_at: int
    answer_end: int
    distance: int


@dataclass(frozen=True)
class MultiQueryTrial:
    """A training document of several questions (:func:`make_multi_query_trial`): ``tokens``
    (``[length + 1]``, as a :class:`Trial`'s), the ``questions`` in the order they are asked,
    and the needles never asked, ``(key, value, token offset)`` each, in ``others``."""

    task: str
    length: int
    index: int
    tokens: np.ndarray
    questions: tuple
    others: tuple = ()


def make_multi_query_trial(
    task: Task,
    tokenizer,
    stream: np.ndarray,
    length: int,
    depths: Sequence[float],
    index: int,
    *,
    seed: str = "train",
) -> MultiQueryTrial:
    """A training document that asks ``len(depths)`` (Q) of a multi-needle task's
    ``task.needles`` (N) needles, ``length + 1`` tokens like :func:`make_trial`'s trial.

    The haystack and the N needles are placed as :func:`make_trial` places them: needle ``j`` <
    Q at ``depths[j]`` (the asked ones), the other N - Q at uniform depths. After the haystack
    the Q questions follow in an order drawn from the seed, each followed at once by its answer
    and each but the last by ``task.boundary`` (for ``multikey`` a newline), so that every
    question starts as the evaluation's single question does: after a boundary. The haystack
    is shorter by the extra questions and answers, so the document has exactly
    :func:`make_trial`'s length. Training only: the evaluation asks one question
    (:func:`make_trial`), and nothing here changes its trials. Deterministic in ``seed``
    (the writer passes a training seed string). Raises :class:`ConfigError` naming
    ``--queries`` for Q < 1 or Q > N, or a task of one needle, and ``--lengths`` when the
    length leaves no room for a haystack.
    """
    queries = len(depths)
    if task.needles < 2:
        raise ConfigError(
            f"--queries: task {task.name} has one needle; several questions need a multi-needle "
            f"task (multikey)"
        )
    if not 1 <= queries <= task.needles:
        raise ConfigError(
            f"--queries must be from 1 to the needle count {task.needles} (each question asks "
            f"a different needle), got {queries}"
        )
    rng = random.Random(f"{seed}-{task.name}-q{queries}-{length}-{tuple(depths)!r}-{index}")
    b = _build(task, tokenizer, stream, length, list(depths), rng)
    questions = tuple(
        Question(
            key=b.keys[j],
            value=b.values[j],
            target_depth=depths[j],
            depth=b.at[j] / b.room,
            needle_at=b.offsets[j],
            question_at=b.question_at[j],
            answer_at=b.answer_at[j],
            answer_end=b.answer_end[j],
            distance=b.question_at[j] - b.offsets[j] - b.needle_sizes[j],
        )
        for j in b.order
    )
    others = tuple((b.keys[j], b.values[j], b.offsets[j]) for j in range(queries, task.needles))
    return MultiQueryTrial(
        task=task.name,
        length=length,
        index=index,
        tokens=b.tokens,
        questions=questions,
        others=others,
    )


@dataclass(frozen=True)
class _Built:
    # What _build placed; per needle j (0..N-1): keys, values, at (haystack insertion point),
    # offsets, needle_sizes; per asked needle j (0..Q-1): question_at, answer_at, answer_end;
    # order: the asked needles in the order their questions come.
    tokens: np.ndarray
    room: int
    keys: list
    values: list
    at: list
    offsets: list
    needle_sizes: list
    order: list
    question_at: list
    answer_at: list
    answer_end: list


def _build(task: Task, tokenizer, stream, length: int, depths: list, rng) -> _Built:
    """The tokens of a trial that asks needles ``0 .. len(depths) - 1`` (at ``depths``) of
    ``task``, from ``rng`` (:func:`make_trial` and :func:`make_multi_query_trial`). One asked
    needle draws exactly what :func:`make_trial` always drew: the same trials as before the
    multi-query documents."""
    queries = len(depths)
    value = _digits(rng, task)
    start = rng.randrange(max(1, stream.size - length))
    keys: list[str] = []
    values = [value]
    # Between an answer and the next question: a boundary, which the single question follows.
    separator = np.asarray(tokenizer.encode(task.boundary), dtype=np.int64)
    for _ in range(KEY_ATTEMPTS):
        # One needle draws exactly what the single-needle tasks always drew: same prompts.
        keys = ["".join(rng.choice(task.key_alphabet) for _ in range(task.key_letters))]
        while len(keys) < task.needles:
            k = "".join(rng.choice(task.key_alphabet) for _ in range(task.key_letters))
            if all(k not in o and o not in k for o in keys):
                keys.append(k)
        while len(values) < task.needles:
            v = _digits(rng, task)
            if v not in values:
                values.append(v)
        needles = [
            np.asarray(tokenizer.encode(task.needle.format(key=k, value=v)), dtype=np.int64)
            for k, v in zip(keys, values)
        ]
        fills = [{"key": keys[j], "value": values[j]} for j in range(queries)]
        questions = [
            np.asarray(tokenizer.encode(task.question.format(**f)), dtype=np.int64) for f in fills
        ]
        answers = [
            np.asarray(tokenizer.encode(task.answer.format(**f)), dtype=np.int64) for f in fills
        ]
        asked = sum(q.size + a.size for q, a in zip(questions, answers))
        room = length + 1 - sum(n.size for n in needles) - asked - (queries - 1) * separator.size
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
        cut = _boundaries(tokenizer, window, task)[room:]
        if task.top_level and not cut.any():
            # Indented code all the way: the question ends the last whole line instead.
            cut = _boundaries(tokenizer, window[room:], replace(task, top_level=False))
        end = room + (int(np.argmax(cut)) + 1 if cut.any() else 0)
        haystack = window[end - room : end]
        text = tokenizer.decode(haystack.tolist()) if keys[0] else ""
        if not any(k and k in text for k in keys):
            break
    else:
        raise ConfigError(f"task {task.name}: no key absent from the haystack was found")
    ok = _boundaries(tokenizer, haystack, task)
    at = [_snap(ok, int(round(d * room)), task.top_level) for d in depths]
    for _ in range(queries, task.needles):
        for _ in range(DEPTH_ATTEMPTS):
            other = _snap(ok, int(round(rng.random() * room)), task.top_level)
            if other not in at:
                break
        at.append(other)
    # The questions in an order of their own (one question: no draw, as before).
    order = list(range(queries))
    if queries > 1:
        rng.shuffle(order)
    # Needles in haystack order; at one point in the order drawn (the asked one first).
    parts, offsets, prev = [], [0] * task.needles, 0
    for j in sorted(range(task.needles), key=lambda j: (at[j], j)):
        parts.append(haystack[prev : at[j]])
        offsets[j] = sum(p.size for p in parts)
        parts.append(needles[j])
        prev = at[j]
    parts.append(haystack[prev:])
    question_at, answer_at, answer_end = [0] * queries, [0] * queries, [0] * queries
    size = sum(p.size for p in parts)
    for n, j in enumerate(order):
        if n:
            parts.append(separator)
            size += separator.size
        question_at[j] = size
        answer_at[j] = size + questions[j].size
        answer_end[j] = size = answer_at[j] + answers[j].size
        parts += [questions[j], answers[j]]
    tokens = np.concatenate(parts)
    return _Built(
        tokens=tokens,
        room=room,
        keys=keys,
        values=values,
        at=at,
        offsets=offsets,
        needle_sizes=[n.size for n in needles],
        order=order,
        question_at=question_at,
        answer_at=answer_at,
        answer_end=answer_end,
    )


def check_grid(
    tasks: Sequence[str],
    depths: Sequence[float],
    trials: int,
    multikey_needles: Optional[int] = None,
) -> None:
    """Raise :class:`ConfigError` naming the option when the retrieval grid is empty or holds
    an unknown task, a depth outside [0, 1], fewer than one trial or a multi-key needle count
    outside :data:`MULTIKEY_RANGE`."""
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
    if multikey_needles is not None:
        check_multikey_needles(multikey_needles)
