"""The loss by token position on held-out documents (:func:`evaluate_loss_by_position`):
whether later tokens gain from the longer context.

Per-token loss on held-out documents at least ``length + 1`` tokens long (or windows of the
concatenated held-out stream), averaged in position bins.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..run_config import ConfigError
from .model import EvalModel
from .scoring import score_sequences
from .tasks import heldout_documents

__all__ = ["evaluate_loss_by_position"]


def evaluate_loss_by_position(
    em: EvalModel,
    length: int,
    *,
    num_sequences: int = 16,
    bins: int = 16,
    concat: bool = False,
    micro_batch_size: int = 1,
    documents: Optional[list] = None,
    prefix_eod: bool = False,
) -> dict:
    """Mean loss per position bin over held-out sequences of ``length`` (collective).

    Sequences are the first ``length + 1`` tokens of held-out documents that long (``concat``:
    consecutive windows of the held-out documents concatenated with their EODs, as in
    training). Positions ``0..length-1`` (the token predicted at ``t`` is ``t + 1``) fall into
    ``bins`` equal bins. Returns ``{"length", "num_sequences", "bins": [{"start", "end",
    "loss", "tokens"}], "loss"}`` (losses in nats per token). Raises :class:`ConfigError`
    naming the option when no held-out document is long enough. ``prefix_eod`` (a model trained
    with ``train.eod_first``): each sequence is the end-of-document token followed by
    ``length`` tokens of text, so that position 0 predicts the text's first token after EOD, as
    a document's first token follows an EOD in training; the result records it.
    """
    if bins < 1 or bins > length:
        raise ConfigError(f"--bins must be in [1, {length}] (the length), got {bins}")
    if num_sequences < 1:
        raise ConfigError(f"--position-sequences must be >= 1, got {num_sequences}")
    docs = documents if documents is not None else heldout_documents(em.cfg)
    # Tokens of text a sequence takes: all length + 1, or length behind the EOD.
    text = length if prefix_eod else length + 1
    if concat:
        stream = np.concatenate(docs)
        count = min(num_sequences, (stream.size - 1) // length)
        seqs = [stream[i * length : i * length + text] for i in range(count)]
    else:
        seqs = [d[:text] for d in docs if d.size >= length + 1][:num_sequences]
    if prefix_eod:
        eod = np.asarray([em.tokenizer.eod], dtype=np.int64)
        seqs = [np.concatenate([eod, s.astype(np.int64)]) for s in seqs]
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
        "prefix_eod": bool(prefix_eod),
        "bins": table,
        "loss": float(nll.mean()),
    }
