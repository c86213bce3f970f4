"""Long-context evaluation of a trained run: the command ``megatron-s2-eval-long-context``
(also ``tools/eval_long_context.py``, ``python -m megatron_s2.training.evaluation.long_context``):
retrieval over a grid of lengths x needle depths (:mod:`.retrieval`), the loss by token position
on held-out documents (:mod:`.loss_by_position`) and, on request, where the model attends when it
retrieves (:mod:`.attention_probe`).

:func:`run` checks every input first (lengths, grid, probe layout: errors name the option),
then loads the run's model (:func:`~.model.load_eval_model`) and writes the tables, plots and
JSON (:mod:`.report`) on rank 0; see ``docs/long_context_eval.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Optional

import torch

from ..errors import CheckpointError
from ..known_warnings import quiet_known_warnings
from ..run_config import ConfigError, RunConfig, apply_overrides, load_config
from .attention_probe import check_probe_layout, probe_needle_attention, probe_table
from .loss_by_position import evaluate_loss_by_position
from .model import PREFIX, check_lengths, load_eval_model, resolve_checkpoint, saved_config
from .report import plot_loss_by_position, plot_retrieval, retrieval_table, write
from .retrieval import at_chance_note, evaluate_retrieval
from .tasks import (
    MULTIKEY_NEEDLES,
    MULTIKEY_RANGE,
    TASKS,
    check_grid,
    default_tasks,
    heldout_documents,
)

__all__ = ["build_arg_parser", "run", "main"]


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
    p.add_argument(
        "--multikey-needles",
        type=int,
        help=f"needles in a multikey haystack (default {MULTIKEY_NEEDLES}, from "
        f"{MULTIKEY_RANGE[0]} to {MULTIKEY_RANGE[1]})",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prefix-eod",
        action="store_true",
        help="start every retrieval prompt with the end-of-document token, as a document starts "
        "inside Megatron's packed training stream (a BOS for models without one); the prompt "
        "keeps its length. retrieval.json records it (prefix_eod)",
    )
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
    p.add_argument(
        "--probe-tasks",
        metavar="TASKS",
        help="with --attention-probe: the tasks whose prompts it probes, a comma list of the "
        "evaluation's --tasks (default: the first); the first's result is attention_probe.json, "
        "each other's attention_probe_<task>.json (a multi-needle task's also gives the "
        "attention on its other needles)",
    )
    p.add_argument("--skip-retrieval", action="store_true")
    p.add_argument("--skip-position", action="store_true")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--output-dir", help="default: <run dir>/long_context_eval")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="run config overrides")
    return p


def _probe_tasks(raw: Optional[str], tasks: list, probing: bool) -> list:
    """``--probe-tasks`` checked against the evaluation's tasks: the tasks to probe, in order
    (default: the first task when probing, none otherwise). Raises :class:`ConfigError`
    naming the option and the allowed values."""
    if raw is None:
        return tasks[:1] if probing else []
    if not probing:
        raise ConfigError("--probe-tasks needs --attention-probe LENGTH (the probe's length)")
    chosen = [t.strip() for t in raw.split(",") if t.strip()]
    unknown = [t for t in chosen if t not in tasks]
    if not chosen or unknown or len(set(chosen)) != len(chosen):
        raise ConfigError(
            f"--probe-tasks: {raw!r} must name distinct tasks of this evaluation's --tasks "
            f"({', '.join(tasks)})"
        )
    return chosen


def _config_from_args(args) -> RunConfig:
    """``--config`` with the overrides, else the checkpoint's stored config with them."""
    if args.config:
        return load_config(args.config, args.overrides)
    if not args.checkpoint:
        raise ConfigError("give a run config (--config) or a checkpoint (--checkpoint), or both")
    root, iteration = resolve_checkpoint(args.checkpoint)
    saved, _ = saved_config(root, iteration)
    if saved is None:
        raise ConfigError(f"{args.checkpoint} stores no run config: pass --config")
    return RunConfig.from_dict(apply_overrides(saved, args.overrides))


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
    probe_tasks = _probe_tasks(args.probe_tasks, tasks, bool(probe))
    # A model trained with EOD at every sample's first token (train.eod_first) reads every
    # prompt and held-out sequence behind it, as it was trained.
    eod_first = cfg.train.eod_first
    prefix_eod = args.prefix_eod or eod_first
    if args.prefix_eod and not eod_first and (args.skip_retrieval or probe):
        # It changes the retrieval prompts alone: where it would be ignored, say so first.
        raise ConfigError(
            "--prefix-eod applies to the retrieval prompts only: drop --skip-retrieval and "
            "--attention-probe from this evaluation (the probe reads plain prompts), or "
            "--prefix-eod"
        )
    if not args.skip_retrieval or probe:
        check_grid(tasks, depths, args.trials, args.multikey_needles)
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
    note = at_chance_note(em.trained_tokens)
    if note and (not args.skip_retrieval or probe):
        # At the top, before the tables: on the demo they are all zeros, as they should be.
        say(f"{PREFIX} {note}", flush=True)
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
            multikey_needles=args.multikey_needles,
            prefix_eod=prefix_eod,
        )
        retrieval.update(checkpoint=em.checkpoint, iteration=em.iteration)
        result["retrieval"] = retrieval
        if em.rank0:
            md = []
            if prefix_eod:
                why = "train.eod_first" if eod_first else "--prefix-eod"
                md += [f"Every prompt starts with the end-of-document token ({why}).", ""]
            for task in tasks:
                md += [
                    f"## {task}: greedy exact-match accuracy",
                    "",
                    retrieval_table(retrieval, task),
                    "",
                    f"## {task}: greedy exact match with its 95% Wilson score interval",
                    "",
                    retrieval_table(retrieval, task, "interval"),
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
            files += [write(out_dir, "retrieval.md", text)]
            files += [write(out_dir, "retrieval.json", retrieval)]
    for n, task in enumerate(probe_tasks):
        found = probe_needle_attention(
            em, task, probe[0], depths, args.trials, seed=args.seed, documents=documents,
            multikey_needles=args.multikey_needles, prefix_eod=eod_first,
        )  # fmt: skip
        found.update(checkpoint=em.checkpoint, iteration=em.iteration)
        if n == 0:
            result["attention_probe"] = found
        result.setdefault("attention_probes", {})[task] = found
        text = (
            f"## {task} at {probe[0]} tokens: attention on the needle from the position "
            "predicting the answer, strongest head (mean over heads)\n\n" + probe_table(found)
        )
        say(text, flush=True)
        # The first task's files keep the names they had before --probe-tasks existed.
        stem = "attention_probe" if n == 0 else f"attention_probe_{task}"
        files += [write(out_dir, f"{stem}.md", text)]
        files += [write(out_dir, f"{stem}.json", found)]
    if not args.skip_position:
        position = evaluate_loss_by_position(
            em,
            pos_length,
            num_sequences=args.position_sequences,
            bins=args.bins,
            concat=args.concat_docs,
            micro_batch_size=args.micro_batch_size,
            documents=documents,
            prefix_eod=eod_first,
        )
        position.update(checkpoint=em.checkpoint, iteration=em.iteration)
        result["loss_by_position"] = position
        if em.rank0:
            files += [write(out_dir, "loss_by_position.json", position)]
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
    args = build_arg_parser().parse_args(argv)
    # The trainer's filter: Megatron's import-time and deprecation warnings, printed by every
    # rank, would otherwise bury a one-line error (Megatron is imported lazily, after this).
    quiet_known_warnings()
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
