"""Retrieval over a grid of context lengths x needle depths (:func:`evaluate_retrieval`).

Each trial (:mod:`.tasks`) is scored in one forward pass (:mod:`.scoring`): the answer's
log-likelihood (sum over its tokens, nats), and greedy exact match: every answer token is the
argmax of the model's prediction at its position. With teacher forcing this is exactly greedy
decoding of the answer (while the greedy tokens match, the prefix is the same), in one forward
pass instead of one per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np

from .model import EvalModel
from .retrieval_stats import CONFIDENCE, wilson_interval
from .scoring import score_sequences
from .tasks import check_grid, get_task, haystack_stream, heldout_documents, make_trial

__all__ = ["evaluate_retrieval", "at_chance_note", "CHANCE_BELOW_TOKENS", "EXPECTATIONS_DOC"]

# Below this many training tokens retrieval is expected at chance. In the CPU probes of the
# demo's shape (docs/notebook/2026-11-long-context.md), models that read passkey trials and
# nothing else first copied answers between 4M and 8M tokens (0% exact at 4.1M); the 125M runs
# of docs/long_context_eval.md (run H) were at 0% after 65M tokens and retrieved after 131M.
# The demo trains 0.5M tokens.
CHANCE_BELOW_TOKENS = 4_000_000
# Where the docs say what to expect from such a run and which runs retrieve.
EXPECTATIONS_DOC = 'docs/long_context_eval.md, "What to expect on the demo"'


def at_chance_note(trained_tokens: Optional[int]) -> Optional[str]:
    """One line saying that retrieval is expected at chance, for a run that trained fewer than
    :data:`CHANCE_BELOW_TOKENS` tokens (``trained_tokens``; None, unknown, gives None too):
    the demo is such a run, and its all-zero tables are what to expect, not a failure."""
    if trained_tokens is None or trained_tokens >= CHANCE_BELOW_TOKENS:
        return None
    return (
        f"note: this run trained {trained_tokens:,} tokens, too few to learn a lookup: retrieval "
        f"is expected at chance (0.00 in every cell); here the loss by position shows the use "
        f"of context. What to expect, and which runs retrieve: {EXPECTATIONS_DOC}"
    )


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
    multikey_needles: Optional[int] = None,
    prefix_eod: bool = False,
) -> dict:
    """Every task over ``lengths`` x ``depths`` with ``trials`` prompts each (collective);
    ``multikey_needles``: needles of a multi-needle task (default
    :data:`~.tasks.MULTIKEY_NEEDLES`).

    ``prefix_eod``: every prompt starts with the tokenizer's end-of-document token, the way a
    document starts inside Megatron's packed training stream (after the previous document's
    EOD; the role a BOS token plays for Llama-style models), and its trial is built one token
    shorter (from the same draws: each trial pairs with the plain one, the same needle and
    value), so that prompts keep their ``length``. Without it a needle at depth 0 is the
    prompt's very first tokens, a position training samples almost never start a document at.

    Returns ``{"tasks": {task: {"cells": [...], "by_length": [...], "trials": [...]}}, ...}``:
    a cell per (length, depth) with ``accuracy`` (greedy exact match, fraction of trials),
    ``correct`` (trials exactly right), ``ci_low``/``ci_high`` (the accuracy's Wilson score
    interval at ``interval.level``, 0.95), ``token_accuracy`` and ``log_likelihood`` (mean over
    trials of the answer's summed log-probability, nats); ``by_length``: the same exact-match
    fields per length over all its depths' trials; a trial record per prompt (its answer, the
    greedy answer text, ``log_likelihood``, ``exact``, the needle's real depth, its
    ``distance`` to the question in tokens, the task's ``needles``).
    """
    check_grid(tasks, depths, trials, multikey_needles)
    tok = em.tokenizer
    prefix = np.asarray([tok.eod] if prefix_eod else [], dtype=np.int64)
    out = {"tasks": {}}
    for name in tasks:
        task = get_task(name, multikey_needles)
        if task.filler == "corpus" and documents is None:
            documents = heldout_documents(em.cfg)
        stream = haystack_stream(task, tok, documents or [], 2 * max(lengths) + 2)
        cells, records = [], []
        for length in lengths:
            # One token of each prompt goes to the EOD prefix: the trial is built shorter, from
            # the draws of the full length (the same needle and value: paired with the plain
            # protocol's trial).
            prompts = [
                make_trial(
                    task, tok, stream, length - prefix.size, d, i, seed=seed, draw_length=length
                )
                for d in depths
                for i in range(trials)
            ]
            batch = np.stack([np.concatenate([prefix, p.tokens]) for p in prompts])
            scores = score_sequences(em, batch, micro_batch_size=micro_batch_size)
            for row, p in enumerate(prompts):
                answer_at = p.answer_at + prefix.size  # in the prompt, after the prefix
                span = slice(answer_at - 1, length)  # the positions that predict the answer
                greedy = scores["greedy"][row, span]
                records.append(
                    {
                        "length": length,
                        "depth": p.target_depth,
                        "needle_depth": p.depth,
                        "trial": p.index,
                        "distance": p.distance,
                        "needles": task.needles,
                        "key": p.key,
                        "answer": tok.decode(batch[row, answer_at:].tolist()),
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
                        **_exact_match(cell),
                        "token_accuracy": float(np.mean([r["token_accuracy"] for r in cell])),
                        "log_likelihood": float(np.mean([r["log_likelihood"] for r in cell])),
                        "trials": len(cell),
                    }
                )
        by_length = [
            {"length": n, **_exact_match([r for r in records if r["length"] == n])} for n in lengths
        ]
        out["tasks"][name] = {"cells": cells, "by_length": by_length, "trials": records}
    out.update(
        lengths=list(lengths),
        depths=list(depths),
        trials_per_cell=trials,
        seed=seed,
        interval={"method": "wilson", "level": CONFIDENCE},
        multikey_needles=get_task("multikey", multikey_needles).needles,
        prefix_eod=bool(prefix_eod),
    )
    return out


def _exact_match(records: list) -> dict:
    """Exact match over ``records`` (trial records): ``accuracy``, ``correct``, ``trials`` and
    the Wilson interval ``ci_low``/``ci_high``."""
    k = sum(bool(r["exact"]) for r in records)
    low, high = wilson_interval(k, len(records))
    return {
        "accuracy": k / len(records),
        "correct": k,
        "trials": len(records),
        "ci_low": low,
        "ci_high": high,
    }
