"""Where a trained model looks when it retrieves: per layer and head, the share of attention
that the position predicting a retrieval answer puts on the needle.

A retrieval head (an induction-style head that copies the needle's value) puts most of its
attention on the needle; a layer whose heads cannot reach the needle (an S2 layer whose local
window and stripes miss it) puts none there. Run on a hybrid and on its dense twin, this shows
in which layers each model retrieves, e.g. whether a hybrid's retrieval heads sit in its S2
layers (``docs/long_context_eval.md``, run J).

The attention weights are recomputed from each core attention's own query and key (after
RoPE, as the layer received them) for the one query row that predicts the answer's first token,
with the layer's softmax scale, its learned sinks (``attention.s2.sinks`` / ``dense_layers.sinks``:
one more logit per head with a zero value, which takes its share of the weight) and, for S2
layers, its pattern; the weights are checked against
the layer's output at that row (``sum_k w_k v_k``), so a mask or scale that differs from what
the kernel did shows as ``max_output_error``. One process (TP = PP = CP = 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch

from ..run_config import ConfigError
from .model import EvalModel
from .scoring import score_sequences
from .tasks import get_task, haystack_stream, heldout_documents, make_trial

PROBE = "--attention-probe"


def check_probe_layout(cfg) -> None:
    """The probe reads whole heads and sequences in one process: raise :class:`ConfigError`
    naming ``--attention-probe`` for any model or context parallelism."""
    par = cfg.parallel
    sizes = {
        "tensor_model_parallel_size": par.tensor_model_parallel_size,
        "pipeline_model_parallel_size": par.pipeline_model_parallel_size,
        "context_parallel_size": par.context_parallel_size,
    }
    split = {k: v for k, v in sizes.items() if v != 1}
    if split:
        raise ConfigError(
            f"{PROBE} runs in one process with whole heads and sequences; the run has "
            + ", ".join(f"parallel.{k}={v}" for k, v in split.items())
            + " (set them to 1 for the probe: the weights load at any layout)"
        )


def core_attention_layers(model) -> list[tuple[int, torch.nn.Module]]:
    """``(layer index, core attention module)`` of every attention layer of ``model`` (one
    chunk), 0-based in depth order: the index the attention schedule uses (a ``GPTModel``'s
    layer; in a ``HybridModel`` the attention layers are counted, its MLP layers skipped)."""
    found = []
    for name, module in model.named_modules():
        if name.endswith("self_attention.core_attention"):
            parts = name.split(".")
            found.append((int(parts[parts.index("layers") + 1]), module))
    return [(index, module) for index, (_, module) in enumerate(sorted(found, key=lambda t: t[0]))]


def needle_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    row: int,
    scale: float,
    pattern=None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention weights of query row ``row`` over keys ``0 .. row``: query ``[s, np, hn]``, key
    ``[s, ng, hn]`` (one sequence, Megatron's order) -> ``[np, row + 1]`` float64, causal, and
    restricted to ``pattern``'s blocks (an :class:`s2attn.S2Pattern` for this rank's heads) when
    given. ``sinks`` ``[np]``: each head's sink logit joins the softmax (its weight is left
    out, so a row then sums to less than 1)."""
    q = query[row].double()  # [np, hn]
    k = key[: row + 1].double().repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    scores = torch.einsum("hd,khd->hk", q, k) * scale
    if pattern is not None:
        b = pattern.block_size
        blocks = pattern.block_mask(1, row // b + 1, row // b, 0)[:, 0]  # [np, key blocks]
        allowed = blocks[:, torch.arange(row + 1) // b]
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.detach().to(scores.device, torch.float64)[:, None]
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[:, :-1]


class _Capture:
    """The probe's hooks on every core attention for one forward pass of one sequence: query
    row ``row``'s attention mass on the key positions ``span`` (the asked needle), and on the
    ``others`` spans together (a multi-needle task's other needles), per layer and head."""

    def __init__(self, layers: list, row: int, span: slice, others: Sequence[slice] = ()):
        self.layers, self.row, self.span, self.others = layers, row, span, list(others)
        self.mass = {}  # layer -> [np] needle mass
        self.others_mass = {}  # layer -> [np] mass on the other needles
        self.output_error = 0.0
        self.handles = []

    def __enter__(self):
        for index, module in self.layers:
            self.handles.append(
                module.register_forward_hook(self._hook(index, module), with_kwargs=True)
            )
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _hook(self, index, module):
        def hook(mod, args, kwargs, output):
            query, key, value = (
                args[i] if len(args) > i else kwargs[n]
                for i, n in enumerate(("query", "key", "value"))
            )
            if query.dim() != 4 or query.shape[1] != 1:
                raise ValueError(f"{PROBE}: expects one [s, 1, heads, dim] sequence a pass")
            q, k, v = query[:, 0], key[:, 0], value[:, 0]
            scale = getattr(module, "softmax_scale", None) or q.shape[-1] ** -0.5
            # A dense layer with sinks runs a dense pattern: every earlier key, as without one.
            pattern = module.pattern if _is_s2(module) else None
            w = needle_weights(q, k, self.row, scale, pattern, getattr(module, "sinks", None))
            self.mass[index] = w[:, self.span].sum(-1).cpu()
            if self.others:
                self.others_mass[index] = sum(w[:, o].sum(-1) for o in self.others).cpu()
            # The weights must reproduce what the layer computed at this row.
            rep = q.shape[1] // k.shape[1]
            vv = v[: self.row + 1].double().repeat_interleave(rep, dim=1)  # [row + 1, np, hn]
            mine = torch.einsum("hk,khd->hd", w, vv)
            got = output[0] if isinstance(output, tuple) else output
            got = got[self.row, 0].double().view(q.shape[1], -1)
            err = float((mine - got).abs().max() / got.abs().max().clamp_min(1e-30))
            self.output_error = max(self.output_error, err)

        return hook


def needle_spans(task, tokenizer, trial) -> tuple[slice, list[slice]]:
    """The token positions of a trial's asked needle and of its other needles (a multi-needle
    task's; none otherwise): ``(span, [span, ...])`` into ``trial.tokens``."""

    def span(key: str, value: str, at: int) -> slice:
        return slice(at, at + len(tokenizer.encode(task.needle.format(key=key, value=value))))

    return span(trial.key, trial.value, trial.needle_at), [span(*o) for o in trial.others]


def probe_prompt(
    task,
    tokenizer,
    stream,
    length: int,
    depth: float,
    index: int,
    *,
    seed: int = 0,
    prefix_eod: bool = False,
) -> tuple[np.ndarray, int, slice, list[slice]]:
    """One probe prompt: ``(tokens, row, span, others)``, ``tokens`` int64 ``[length + 1]``
    (the trial with its answer), ``row`` the position that predicts the answer's first token,
    ``span`` and ``others`` the asked and the other needles' positions in ``tokens``
    (:func:`needle_spans`). ``prefix_eod``: ``tokens`` start with the end-of-document token and
    the trial is built one token shorter from the same draws (the same needle and value), as
    the retrieval evaluation's ``prefix_eod`` does."""
    by = 1 if prefix_eod else 0
    trial = make_trial(
        task, tokenizer, stream, length - by, depth, index, seed=seed, draw_length=length
    )
    span, others = needle_spans(task, tokenizer, trial)
    tokens = np.concatenate([np.asarray([tokenizer.eod] * by, dtype=np.int64), trial.tokens])
    return (
        tokens,
        trial.answer_at + by - 1,
        slice(span.start + by, span.stop + by),
        [slice(o.start + by, o.stop + by) for o in others],
    )


def probe_needle_attention(
    em: EvalModel,
    task_name: str,
    length: int,
    depths: Sequence[float],
    trials: int,
    *,
    seed: int = 0,
    documents: Optional[list] = None,
    multikey_needles: Optional[int] = None,
    prefix_eod: bool = False,
) -> dict:
    """Per layer and depth, the needle's share of attention at the position that predicts the
    answer's first token, over ``trials`` prompts of ``task_name`` at ``length`` tokens (the
    retrieval evaluation's own prompts, ``multikey_needles`` as its option). ``em``: a
    one-process :class:`~.model.EvalModel`.

    Returns ``{"layers": [{"layer", "kind", "mean_head", "top_head"}], ...}`` where
    ``mean_head[d]`` is the mass averaged over heads and trials at depth ``depths[d]`` and
    ``top_head[d]`` the strongest head's mass averaged over trials (a retrieval head: near 1);
    ``max_output_error`` is the largest relative error of the weights' output against the
    layers' own. For a task with several needles (``multikey``) each layer also has
    ``others_mean_head`` and ``others_top_head``: the same on the other needles' tokens
    together (the distractors; ``others_top_head`` is the mass on them of the head that puts
    the most on the asked needle, so that a head which finds *a* needle but not the asked one
    shows), fractions of the head's attention. ``prefix_eod`` (a model trained with
    ``train.eod_first``): every prompt starts with the end-of-document token, its trial built
    one token shorter from the same draws, as the retrieval evaluation's ``prefix_eod`` does;
    the result records it.
    """
    check_probe_layout(em.cfg)
    task = get_task(task_name, multikey_needles)
    if task.filler == "corpus" and documents is None:
        documents = heldout_documents(em.cfg)
    tok = em.tokenizer
    stream = haystack_stream(task, tok, documents or [], 2 * length + 2)
    layers = core_attention_layers(em.model[0])
    mean = np.zeros((len(layers), len(depths)))
    top = np.zeros((len(layers), len(depths)))
    others_mean = np.zeros((len(layers), len(depths)))
    others_top = np.zeros((len(layers), len(depths)))
    error = 0.0

    for di, depth in enumerate(depths):
        for i in range(trials):
            tokens, row, span, others = probe_prompt(
                task, tok, stream, length, depth, i, seed=seed, prefix_eod=prefix_eod
            )
            with _Capture(layers, row, span, others) as cap:
                score_sequences(em, tokens[None])
            for li, (index, _) in enumerate(layers):
                mass = cap.mass[index]
                mean[li, di] += float(mass.mean()) / trials
                top[li, di] += float(mass.max()) / trials
                if others:
                    other = cap.others_mass[index]
                    others_mean[li, di] += float(other.mean()) / trials
                    others_top[li, di] += float(other[int(mass.argmax())]) / trials
            error = max(error, cap.output_error)
    several = task.needles > 1

    def layer_entry(li: int, index: int, module) -> dict:
        entry = {
            "layer": index,
            "kind": "S2" if _is_s2(module) else "dense",
            "mean_head": mean[li].tolist(),
            "top_head": top[li].tolist(),
        }
        if several:
            entry.update(others_mean_head=others_mean[li].tolist(),
                         others_top_head=others_top[li].tolist())  # fmt: skip
        return entry

    return {
        "task": task_name,
        "length": length,
        "depths": list(depths),
        "trials": trials,
        "seed": seed,
        "prefix_eod": bool(prefix_eod),
        "max_output_error": error,
        "layers": [layer_entry(li, index, module) for li, (index, module) in enumerate(layers)],
    }


def _is_s2(module) -> bool:
    """Whether a core attention is an S2 layer (a dense layer with sinks runs the S2 module
    with a dense pattern and says so)."""
    return getattr(module, "pattern", None) is not None and not getattr(
        module, "dense_layer", False
    )


def probe_table(result: dict) -> str:
    """Markdown: a row per layer, the strongest head's needle mass (mean over heads in
    brackets) at each depth."""
    head = "| layer | kind | " + " | ".join(f"depth {d:g}" for d in result["depths"]) + " |"
    rows = [head, "|---|---|" + "---|" * len(result["depths"])]
    for layer in result["layers"]:
        cells = [f"{t:.2f} ({m:.2f})" for t, m in zip(layer["top_head"], layer["mean_head"])]
        rows.append(f"| {layer['layer']} | {layer['kind']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
