#!/usr/bin/env python3
"""Toy CPU study (issue 50): do multi-question retrieval documents teach the lookup sooner?

    python tools/toy_retrieval_study.py                    # corpora, training, evaluations, table
    python tools/toy_retrieval_study.py --seeds 1          # one seed of each arm
    python tools/toy_retrieval_study.py --table-only       # the table from the results alone

Two arms, everything equal but the questions a ``multikey`` document asks: ``single`` (Q = 1,
the documents the writer has always made) and ``multi`` (Q = ``--queries``, each question
followed by its answer, ``tools/make_retrieval_corpus.py --queries``). Both blend the same
retrieval corpus shape (passkey + multikey documents, ``--needles`` needles, one training
sample long) at ``--weight`` with the demo corpus, train the demo's model shape (4 layers,
hidden 128, dense, byte tokenizer) from scratch for the same steps and tokens, and are
evaluated by the real evaluator
(``megatron_s2.training.evaluation.long_context``: passkey and multikey at ``--eval-lengths``,
five depths, ``--trials`` a cell) at every saved checkpoint. The evaluation's multikey
haystack (``--eval-haystack``): ``filler`` (default), fresh sentences of the demo corpus's
filler generator under another seed than the training documents' (whose haystacks are windows
of one fixed filler text, :func:`~megatron_s2.training.evaluation.tasks.haystack_stream`), or
``demo``, held-out demo documents (text the model read 1 - ``--weight`` of the time).

Layout: runs under ``--work`` (default /tmp/toy-multiquery/<shape>); the settings, the command, the
machine and the date to ``--out``/study.json; each evaluator output copied to
``--out``/<arm>/seed<k>/iter_<step>/retrieval.json and the last checkpoint's also to
``--out``/<arm>/seed<k>/retrieval.json (the layout tools/retrieval_tables.py reads); the table
(exact match with 95% Wilson intervals, answer tokens right, answer log-likelihood, by arm, seed,
step and length) to ``--out``/table.md. The two arms of a seed train side by side, one CPU
thread each. Finished steps are skipped when run again (same --work).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)

TASKS = ("passkey", "multikey")


def _args(argv):
    p = argparse.ArgumentParser(prog="toy_retrieval_study", description=__doc__.split("\n\n")[0])
    p.add_argument("--work", help="corpora and runs (default /tmp/toy-multiquery/seq<S>-n<N>-q<Q>)")
    p.add_argument(
        "--out",
        help="evaluator JSON per arm, seed and step, study.json (settings, command, machine) and "
        "table.md (default docs/long_context/results/toy-multiquery/seq<S>-n<N>-q<Q>)",
    )
    p.add_argument("--seeds", default="1,2", help="comma list of seeds (default 1,2)")
    p.add_argument("--queries", type=int, default=4, help="questions a multi-arm document asks")
    p.add_argument("--needles", type=int, default=8, help="needles in a multikey document")
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--weight", type=float, default=0.8, help="retrieval share of the blend")
    p.add_argument("--iters", type=int, default=450, help="training steps")
    p.add_argument("--save-interval", type=int, default=150, help="steps between checkpoints")
    p.add_argument("--global-batch", type=int, default=8, help="sequences a step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-lengths", default="512,1024")
    p.add_argument("--trials", type=int, default=20, help="prompts per (length, depth) cell")
    p.add_argument(
        "--eval-haystack",
        choices=("demo", "filler"),
        default="filler",
        help="the evaluation's multikey haystack: held-out demo documents, or fresh filler "
        "sentences of the kind the multikey training documents hide their needles in (default)",
    )
    p.add_argument("--table-only", action="store_true", help="only rewrite the table from --out")
    args = p.parse_args(argv)
    # One folder per study shape, so that another shape never reuses these corpora or runs.
    name = f"seq{args.seq_length}-n{args.needles}-q{args.queries}"
    if args.out is None:
        args.out = os.path.join(ROOT, "docs/long_context/results/toy-multiquery", name)
    if args.work is None:
        args.work = os.path.join("/tmp/toy-multiquery", name)
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    if not args.seeds:
        p.error("--seeds is empty")
    if not 0 < args.weight < 1:
        p.error(f"--weight must be in (0, 1) (the demo corpus takes the rest), got {args.weight}")
    if args.iters < 1 or not 1 <= args.save_interval <= args.iters:
        p.error("--iters >= 1 and 1 <= --save-interval <= --iters")
    return args


def _arms(args) -> dict:
    # Arm name -> questions a multikey document asks.
    return {"single": 1, "multi": args.queries}


def _corpus(args, arm: str, queries: int, seed: int) -> str:
    """The arm's retrieval corpus for ``seed`` (written once): enough one-sample documents for
    every retrieval sample of the run, so no document is read twice."""
    from megatron_s2.training.evaluation.retrieval_corpus import write_retrieval_dataset

    prefix = os.path.join(args.work, "corpus", f"{arm}_seed{seed}")
    if not os.path.exists(prefix + ".idx"):
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        docs = int(args.iters * args.global_batch * args.weight * 1.2) + 64
        write_retrieval_dataset(prefix, "byte", tasks=["passkey", "multikey"], num_docs=docs,
                                seq_length=args.seq_length, multikey_needles=args.needles,
                                queries=queries, seed=seed)  # fmt: skip
    return prefix


def _env():
    # One thread a process: the two arms of a seed share the machine's cores evenly.
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, ".shim"), ROOT] + [p for p in [env.get("PYTHONPATH")] if p]
    )
    return env


def _train_command(args, run: str, demo: str, corpus: str, seed: int) -> list:
    w = args.weight
    return [
        sys.executable, "-m", "megatron_s2.training",
        "--config", os.path.join(ROOT, "configs/demo.yaml"),
        f"name={os.path.basename(run)}", f"logging.run_dir={run}",
        "data.demo=false", f"data.blend=[[{1 - w:.6g}, {demo}], [{w:.6g}, {corpus}]]",
        "data.split=98,2,0", f"model.seq_length={args.seq_length}",
        "attention.dense_layers.pattern=D",
        f"train.micro_batch_size={min(4, args.global_batch)}",
        f"train.global_batch_size={args.global_batch}",
        f"train.train_iters={args.iters}", f"train.seed={1000 + seed}",
        f"optimizer.lr={args.lr}", f"optimizer.min_lr={args.lr / 10}",
        "train.eval_interval=0", f"checkpoint.save_interval={args.save_interval}",
        "logging.log_interval=25",
    ]  # fmt: skip


def _filler_corpus(work: str) -> str:
    """An indexed dataset of fresh filler sentences (byte tokenizer, documents of about 2k
    characters; generator seed 1, while the training haystacks use seed 0): the ``filler``
    evaluation haystack."""
    import numpy as np

    from megatron_s2.training.code_corpus import writing_indexed_dataset
    from megatron_s2.training.demo_corpus import filler_text
    from megatron_s2.training.tokenizer import load_tokenizer

    prefix = os.path.join(work, "filler", "filler_seed1")
    if not os.path.exists(prefix + ".idx"):
        tok = load_tokenizer("byte")
        lines = filler_text(1_000_000, seed=1).splitlines(keepends=True)
        with writing_indexed_dataset(prefix, tok.vocab_size) as writer:
            doc = []
            for line in lines:
                doc.append(line)
                if sum(map(len, doc)) >= 2000:
                    writer.add(np.array(tok.encode("".join(doc)) + [tok.eod], dtype=np.int64))
                    doc = []
            writer.meta = {"generator": "toy_retrieval_study filler", "seed": 1}
    return prefix


def _eval_command(args, checkpoint: str, out_dir: str, haystack: str) -> list:
    # The multikey haystack: the held-out documents of ``haystack`` alone (the retrieval corpus
    # would put other questions into it).
    return [
        sys.executable, "-m", "megatron_s2.training.evaluation.long_context",
        "--checkpoint", checkpoint, "--tasks", ",".join(TASKS),
        "--multikey-needles", str(args.needles), "--lengths", args.eval_lengths,
        "--trials", str(args.trials), "--skip-position", "--micro-batch-size", "4",
        "--output-dir", out_dir, f"data.blend=[{haystack}]",
    ]  # fmt: skip


def _run_all(jobs: list) -> None:
    """Run ``(command, log path)`` jobs side by side; raise naming the log of a failed one."""
    procs = []
    for cmd, log in jobs:
        with open(log, "w") as f:
            procs.append((subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(),
                                           cwd=ROOT), log))  # fmt: skip
    failed = [log for p, log in procs if p.wait() != 0]
    if failed:
        raise SystemExit(f"toy_retrieval_study: failed, see {', '.join(failed)}")


def _record(args, argv) -> None:
    """``--out``/study.json: what the table needs (tokens a step) and what a reader needs to
    redo the study: the settings, the command, the machine, the date."""
    import datetime
    import platform

    os.makedirs(args.out, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("table_only", "out", "work")}
    record = {
        "settings": settings,
        "tokens_per_step": args.global_batch * args.seq_length,
        "command": "python tools/toy_retrieval_study.py " + " ".join(argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, CPU mode (gloo)",
        "date": datetime.date.today().isoformat(),
    }
    with open(os.path.join(args.out, "study.json"), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


def _study(args) -> None:
    from megatron_s2.training.demo_corpus import ensure_demo_data

    os.makedirs(args.work, exist_ok=True)
    demo = ensure_demo_data(os.path.join(args.work, "demo"))
    haystack = demo if args.eval_haystack == "demo" else _filler_corpus(args.work)
    for seed in args.seeds:
        runs = {}
        jobs = []
        for arm, queries in _arms(args).items():
            corpus = _corpus(args, arm, queries, seed)
            run = os.path.join(args.work, "runs", f"{arm}_seed{seed}")
            runs[arm] = run
            if not os.path.exists(os.path.join(run, "summary.json")):
                cmd = _train_command(args, run, demo, corpus, seed)
                os.makedirs(run, exist_ok=True)
                jobs.append((cmd, os.path.join(args.work, f"train_{arm}_seed{seed}.log")))
        t0 = time.time()
        _run_all(jobs)
        print(f"seed {seed}: trained {', '.join(runs)} in {time.time() - t0:.0f} s", flush=True)
        evals = []
        for arm, run in runs.items():
            for ckpt in sorted(glob.glob(os.path.join(run, "checkpoints", "iter_*"))):
                out = os.path.join(run, "eval", os.path.basename(ckpt))
                if not os.path.exists(os.path.join(out, "retrieval.json")):
                    log = os.path.join(
                        args.work, f"eval_{arm}_seed{seed}_{os.path.basename(ckpt)}.log"
                    )
                    evals.append((_eval_command(args, ckpt, out, haystack), log, arm, out))
        t0 = time.time()
        # Two at a time: one a core.
        for i in range(0, len(evals), 2):
            _run_all([(cmd, log) for cmd, log, _, _ in evals[i : i + 2]])
        print(f"seed {seed}: {len(evals)} evaluations in {time.time() - t0:.0f} s", flush=True)
        for arm, run in runs.items():
            _collect(args, arm, seed, run)


def _collect(args, arm: str, seed: int, run: str) -> None:
    """Copy the run's evaluator files and its training summary into ``--out``."""
    dest = os.path.join(args.out, arm, f"seed{seed}")
    steps = sorted(glob.glob(os.path.join(run, "eval", "iter_*", "retrieval.json")))
    for path in steps:
        step_dir = os.path.join(dest, os.path.basename(os.path.dirname(path)))
        os.makedirs(step_dir, exist_ok=True)
        shutil.copy(path, os.path.join(step_dir, "retrieval.json"))
    if steps:
        shutil.copy(steps[-1], os.path.join(dest, "retrieval.json"))
    summary = os.path.join(run, "summary.json")
    if os.path.exists(summary):
        shutil.copy(summary, os.path.join(dest, "train_summary.json"))


def _table(args) -> str:
    """The markdown table of every evaluator file under ``--out``."""
    from megatron_s2.training.evaluation.retrieval_stats import wilson_interval

    rows = []
    for path in sorted(glob.glob(os.path.join(args.out, "*", "seed*", "iter_*", "retrieval.json"))):
        step_dir = os.path.dirname(path)
        seed_dir = os.path.dirname(step_dir)
        arm = os.path.basename(os.path.dirname(seed_dir))
        step = int(os.path.basename(step_dir).split("_")[1])
        data = json.load(open(path))
        for task in TASKS:
            if task not in data["tasks"]:
                continue
            # From the evaluator's per-length counts and per-cell means (the committed copies
            # leave the per-trial records out): a cell's means weighted by its trials.
            result = data["tasks"][task]
            for b in result["by_length"]:
                length, k, n = b["length"], b["correct"], b["trials"]
                cells = [c for c in result["cells"] if c["length"] == length]
                lo, hi = wilson_interval(k, n)
                tok = sum(c["token_accuracy"] * c["trials"] for c in cells) / n
                ll = sum(c["log_likelihood"] * c["trials"] for c in cells) / n
                rows.append((task, length, arm, os.path.basename(seed_dir), step, k, n, lo, hi,
                             tok, ll))  # fmt: skip
    order = {a: i for i, a in enumerate(_arms(args))}
    rows.sort(key=lambda r: (TASKS.index(r[0]), r[1], r[4], order.get(r[2], 9), r[3]))
    lines = [
        "| task | length | step (tokens) | arm | seed | exact match [95% Wilson] | answer tokens "
        "right | answer log-likelihood (nats) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    tokens_per_step = args.global_batch * args.seq_length
    recorded = os.path.join(args.out, "study.json")
    if os.path.exists(recorded):  # the study's own, whatever this command's options say
        tokens_per_step = json.load(open(recorded))["tokens_per_step"]
    for task, length, arm, seed, step, k, n, lo, hi, tok, ll in rows:
        lines.append(
            f"| {task} | {length} | {step} ({step * tokens_per_step / 1e6:.2f}M) | {arm} | "
            f"{seed[4:]} | {k}/{n} = {100 * k / n:.0f}% [{100 * lo:.0f}, {100 * hi:.0f}] | "
            f"{tok:.2f} | {ll:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    if not args.table_only:
        _record(args, argv)
        _study(args)
    os.makedirs(args.out, exist_ok=True)
    table = _table(args)
    print(table)
    path = os.path.join(args.out, "table.md")
    with open(path, "w") as f:
        f.write(table + "\n")
    runs = "" if args.table_only else f"; runs under {args.work}"
    print(f"toy_retrieval_study: evaluator files under {args.out}/<arm>/seed<k>/iter_<step>/, "
          f"table in {path}{runs}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
