"""tools/run_extension_example.sh's orchestration, with a stand-in interpreter (the real steps are
tested in test_code_corpus.py, test_demo_corpus.py, test_sweep.py, test_context_extension.py and
test_long_context_eval.py): the key-value corpus is blended into both studies at KV_WEIGHT and
the retrieval training documents (one corpus per study) at RETRIEVAL_WEIGHT, the
4k models are evaluated before the extension trains (not beside it: its tokens/s is a result),
every run is evaluated once on held-out code alone, through the sweeps' ``--after`` as each
point finishes (its results copied to RESULTS_DIR at once, so that a cut keeps them) or by the
catch-up after a sweep, and a second run redoes nothing."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# How the study scripts run the long-context evaluation.
EVAL_MODULE = ["-m", "megatron_s2.training.evaluation.long_context"]

pytestmark = pytest.mark.version_independent

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "run_extension_example.sh"
# Its environment settings (the header lists them), which the tests set themselves.
SCRIPT_KNOBS = {
    "PYTHON", "CORPUS", "KV_PREFIX", "KV_WEIGHT", "RETRIEVAL_PREFIX", "RETRIEVAL_WEIGHT",
    "RETRIEVAL_SPECS", "RETRIEVAL_TASKS", "WORKERS", "BASE_OVERRIDES", "EXTEND_OVERRIDES",
    "EXTEND_STUDIES", "EXTEND_MIN_ACCURACY", "DEVICES", "LENGTHS", "TASKS", "TRIALS",
    "POSITION_SEQUENCES", "STATUS", "PROBE_LENGTH", "BASE_STUDY", "SEEDS", "EXTEND_TAG",
    "RESULTS_DIR", "SETTINGS", "RETRIEVAL_QUERIES", "RETRIEVAL_NEEDLES", "RETRIEVAL_HAYSTACK",
    "BASE_TAG", "PREFIX_EOD", "BASE_LENGTHS", "RETRIEVAL_DEPTH_DISTRIBUTION", "PROBE_TASKS",
    "ZONE_DEPTHS", "ZONE_ARMS", "ZONE_LENGTHS", "ZONE_TASKS", "BASE_NPROC",
}  # fmt: skip
POINTS = {
    "code-125m-4k-base": ["dense", "hybrid-DS"],
    "code-125m-extend-16k": ["dense", "hybrid-DS", "dense-to-hybrid"],
    "code-125m-extend-16k-remedies": [
        "hybrid-DS-long",
        "dense",
        "hybrid-DS",
        "hybrid-DS-local32",
        "hybrid-DS-more-dense",
    ],
}

# Logs each call with its start and end; plays the corpus builders, the sweeps (their runs'
# summary.json, then their --after as the sweep runs it; with FAKE_CUT=STUDY that study's sweep
# trains its first point, runs its --after and then the machine "goes": the script is killed),
# the evaluations and the plot; runs the script's inline Python for real.
FAKE = textwrap.dedent(
    """\
    #!{python}
    import json, os, signal, subprocess, sys, time
    sys.path.insert(0, {repo!r})
    args = sys.argv[1:]
    start = time.time()
    points = {points!r}
    def log():
        with open(os.environ["FAKE_LOG"], "a") as f:
            f.write(json.dumps({{"args": args, "start": start, "end": time.time(),
                                "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}}) + "\\n")
    tool = os.path.basename(args[0]) if args else ""
    if tool == "build_code_corpus.py":
        out = args[args.index("--out") + 1]
        os.makedirs(out)
        overrides = ("data.demo=false data.blend=[data/code/train_valid] data.split=9,1,0 "
                     "data.tokenizer=data/code/tokenizer")
        json.dump({{"overrides": overrides}}, open(os.path.join(out, "corpus.json"), "w"))
    elif tool in ("make_demo_corpus.py", "make_retrieval_corpus.py"):
        prefix = args[args.index("--output-prefix") + 1]
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        # The writer's --reuse, played: one written before with other arguments is refused.
        if "--reuse" in args and os.path.exists(prefix + ".idx"):
            written = json.load(open(prefix + ".meta.json"))["args"]
            if written != args:
                print(f"make_retrieval_corpus: error: --output-prefix {{prefix}} was written "
                      f"with other settings (written {{written}}); remove it", file=sys.stderr)
                log()
                sys.exit(2)
        else:
            open(prefix + ".idx", "w").close()
            json.dump({{"args": args}}, open(prefix + ".meta.json", "w"))
    elif args[:3] == ["-m", "megatron_s2.training.sweep", "run"]:
        from tests.helpers.study_scripts import run_after
        name = os.path.basename(args[3])[: -len(".yaml")]
        time.sleep(1.0)  # long enough for the evaluations beside it to start
        cut = os.environ.get("FAKE_CUT") == name
        runs = [f"sweeps/{{name}}/runs/{{p}}" for p in points[name]][: 1 if cut else None]
        for run in runs:
            os.makedirs(f"{{run}}/checkpoints", exist_ok=True)
            open(f"{{run}}/summary.json", "w").write("{{}}")
        # The sweep's table (its points and status), as `run` writes it.
        open(f"sweeps/{{name}}/results.csv", "w").write(
            "point,status\\n" + "".join(f"{{p}},finished\\n" for p in points[name]))
        code = run_after(args, runs)
        if cut:
            os.kill(os.getppid(), signal.SIGKILL)
            sys.exit(137)
        log()
        sys.exit(code)
    elif args[:2] == ["-m", "megatron_s2.training.evaluation.long_context"]:
        run = os.path.dirname(args[args.index("--checkpoint") + 1])
        out = (args[args.index("--output-dir") + 1] if "--output-dir" in args
               else os.path.join(run, "long_context_eval"))
        os.makedirs(out, exist_ok=True)
        if "--skip-position" not in args:
            open(os.path.join(out, "loss_by_position.json"), "w").write("{{}}")
        acc = float(os.environ.get("FAKE_ACCURACY", "0"))
        cells = [{{"length": n, "depth": 0.5, "accuracy": acc if n <= 4096 else 0.0,
                   "token_accuracy": 0.0, "log_likelihood": -11.5, "trials": 10}}
                 for n in (2048, 4096, 8192)]
        json.dump({{"tasks": {{"passkey": {{"cells": cells}}}},
                   "prefix_eod": "--prefix-eod" in args}},
                  open(os.path.join(out, "retrieval.json"), "w"))
    elif tool == "plot_loss_by_position.py":
        pass
    else:
        sys.exit(subprocess.call([{python!r}, *args]))
    log()
    """
)


def _run(tmp_path, log, returncode=0, **extra):
    # The script's own knobs come from the test alone, not from the caller's environment.
    env = {k: v for k, v in os.environ.items() if k not in SCRIPT_KNOBS and k[:5] != "FAKE_"}
    env.update(PYTHON=str(tmp_path / "python"), FAKE_LOG=str(log), KV_WEIGHT="0.25")
    env.update(extra)
    r = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == returncode, r.stdout + r.stderr
    return [json.loads(x) for x in log.read_text().splitlines()]


def _write_fake(tmp_path, points=POINTS):
    fake = tmp_path / "python"
    fake.write_text(FAKE.format(python=sys.executable, repo=str(REPO), points=points))
    fake.chmod(0o755)


def _run_dir(tmp_path, call):
    """The run an evaluator call evaluated, relative to the script's directory (the sweep gives
    its --after absolute run directories, the catch-up relative ones)."""
    run = Path(call["args"][call["args"].index("--checkpoint") + 1]).parent
    return run.relative_to(tmp_path) if run.is_absolute() else run


def _writers_by_tag(calls):
    """The retrieval writer's calls, as {RETRIEVAL_SPECS tag: its argument list} (the tag is
    the suffix of its --output-prefix)."""
    return {
        c["args"][c["args"].index("--output-prefix") + 1].rsplit("_", 1)[1]: c["args"]
        for c in calls
        if os.path.basename(c["args"][0]) == "make_retrieval_corpus.py"
    }


def _assert_code_haystack(args):
    """A retrieval writer's arguments ask for the code corpus as haystack: the fake corpus's
    data.blend and data.split (RETRIEVAL_HAYSTACK=code)."""
    at = args.index("--haystack-corpus")
    assert args[at : at + 4] == [
        "--haystack-corpus",
        "data/code/train_valid",
        "--haystack-split",
        "9,1,0",
    ]


def _after_of(sweep_call):
    """The --after command of a sweep call, split: [bash, script, --evaluate-run, {run}, ...]."""
    args = sweep_call["args"]
    return shlex.split(args[args.index("--after") + 1])


@pytest.mark.parametrize("through_after", [True, False], ids=["sweep-after", "catch-up"])
def test_example_script_blends_evaluates_every_run_once_and_resumes(tmp_path, through_after):
    """Each run evaluated once: by the sweep's --after as its point finishes or, where the sweep
    did not (FAKE_NO_AFTER: points trained before the script passed it), after the sweep.

    With the default settings (one run, checked several ways; these were separate runs of the
    same settings): every retrieval writer gets the code haystack (RETRIEVAL_HAYSTACK's default,
    code) and no --depth-distribution (RETRIEVAL_DEPTH_DISTRIBUTION unset: the writer's
    uniform), and is asked with --reuse. Every retrieval corpus is asked of the writer with
    --reuse, so that one already on disk (cached by RETRIEVAL_PREFIX) is kept when written as
    asked now; when the writer refuses it (written otherwise: here another depth distribution),
    the script stops before any training, saying which RETRIEVAL_SPECS entry and why. The
    writer's own comparison is tested with it
    (test_retrieval_corpus.py::test_reuse_keeps_a_corpus_written_with_the_same_settings)."""
    _write_fake(tmp_path)
    log = tmp_path / "calls.jsonl"
    calls = _run(tmp_path, log, **({} if through_after else {"FAKE_NO_AFTER": "1"}))
    status = (tmp_path / "example_status.log").read_text()
    assert "retrieval training documents written to data/retrieval/retrieval_code_4k" in status
    writers = _writers_by_tag(calls)
    assert sorted(writers) == ["16k", "4k"]
    for args in writers.values():
        _assert_code_haystack(args)
        assert "--depth-distribution" not in args
        assert args[-1] == "--reuse"

    tools = [os.path.basename(c["args"][0]) for c in calls]
    assert tools.count("build_code_corpus.py") == 1
    (kv,) = [c for c in calls if os.path.basename(c["args"][0]) == "make_demo_corpus.py"]
    assert kv["args"][kv["args"].index("--tokenizer") + 1] == "data/code/tokenizer"

    sweeps = {
        Path(c["args"][3]).stem: c
        for c in calls
        if c["args"][:3] == ["-m", "megatron_s2.training.sweep", "run"]
    }
    # One retrieval corpus per study, trials no longer than its sequence, in the code tokenizer.
    retrieval = {
        c["args"][c["args"].index("--output-prefix") + 1]: c
        for c in calls
        if os.path.basename(c["args"][0]) == "make_retrieval_corpus.py"
    }
    assert sorted(retrieval) == [
        "data/retrieval/retrieval_code_16k",
        "data/retrieval/retrieval_code_4k",
    ]
    for prefix, c in retrieval.items():
        assert c["args"][c["args"].index("--tokenizer") + 1] == "data/code/tokenizer"
        assert c["args"][c["args"].index("--tasks") + 1] == "passkey,needle"
        # One question a document and the writer's own needle count unless asked otherwise.
        assert c["args"][c["args"].index("--queries") + 1] == "1"
        assert "--multikey-needles" not in c["args"]
        max_tokens = c["args"][c["args"].index("--max-tokens") + 1]
        assert max_tokens == {"4k": "4096", "16k": "16384"}[prefix.rsplit("_", 1)[1]]
    assert sorted(sweeps) == ["code-125m-4k-base", "code-125m-extend-16k"]
    for name, c in sweeps.items():
        tag = "4k" if name == "code-125m-4k-base" else "16k"
        assert c["args"][4:] == [
            "data.demo=false",
            "data.blend=[data/code/train_valid]",
            "data.split=9,1,0",
            "data.tokenizer=data/code/tokenizer",
            # after the corpus's own blend, so that it wins; code gets what the others leave
            "data.blend=[[0.55, data/code/train_valid], [0.25, data/kv/kv_code], "
            f"[0.2, data/retrieval/retrieval_code_{tag}]]",
            "--after",
            c["args"][-1],
        ]
        # --after: this script again, on the run the sweep names, of this study
        bash, script, *rest = _after_of(c)
        assert bash == "bash" and Path(script).resolve() == SCRIPT.resolve()
        extra = ["--allow-extrapolation"] if tag == "4k" else []
        assert rest == ["--evaluate-run", "{run}", name, *extra]
    extension = sweeps["code-125m-extend-16k"]
    assert sweeps["code-125m-4k-base"]["end"] <= extension["start"]

    eval_calls = [c for c in calls if c["args"][:2] == EVAL_MODULE]
    evals = {_run_dir(tmp_path, c): c for c in eval_calls}
    expected = {
        Path("sweeps") / s / "runs" / p
        for s, ps in POINTS.items()
        if not s.endswith("remedies")
        for p in ps
    }
    assert set(evals) == expected and len(eval_calls) == len(expected)  # each run once
    for run, c in evals.items():
        assert c["args"][-1] == "data.blend=[data/code/train_valid]"  # held-out code only
        assert "--attention-probe" not in c["args"]  # only with PROBE_LENGTH
        before_extension = run.parts[1] == "code-125m-4k-base"
        assert ("--allow-extrapolation" in c["args"]) == before_extension
        sweep = sweeps[run.parts[1]]
        # inside its point's sweep (right after the point), else after it
        assert (c["end"] <= sweep["end"]) == through_after
        assert c["start"] >= sweep["start"]
        if before_extension:
            # not beside the extension: its tokens/s is a result
            assert c["end"] <= extension["start"]
        assert (tmp_path / run / "long_context_eval.log").exists()
    plots = [c for c in calls if os.path.basename(c["args"][0]) == "plot_loss_by_position.py"]
    assert len(plots) == 2
    # the real tools/compare_retrieval.py, on the stand-in evaluations
    summary = (tmp_path / "sweeps" / "code-125m-extend-16k" / "retrieval_summary.md").read_text()
    assert "| dense-to-hybrid | 0% (-11.5) | 0% (-11.5) | 0% (-11.5) |" in summary
    assert "all done (exit 0)" in (tmp_path / "example_status.log").read_text()

    # Again: the corpora exist and every run has its evaluation; the sweeps are asked again
    # (they skip finished points themselves), and the retrieval writer only checks its corpora
    # against their settings (--reuse).
    log.write_text("")
    calls = _run(tmp_path, log)
    tools = [os.path.basename(c["args"][0]) for c in calls]
    assert not {"build_code_corpus.py", "make_demo_corpus.py"} & set(tools)
    again = _writers_by_tag(calls)
    assert sorted(again) == sorted(writers)
    assert all(a[-1] == "--reuse" for a in again.values())
    status = (tmp_path / "example_status.log").read_text()
    assert "reused (written before with these settings)" in status
    assert "retrieval training documents in data/retrieval/retrieval_code_4k reused" in status
    assert not [c for c in calls if c["args"][:2] == EVAL_MODULE]

    # The corpora asked otherwise (another depth distribution): refused before any training.
    log.write_text("")
    refused = _run(tmp_path, log, returncode=2, RETRIEVAL_DEPTH_DISTRIBUTION="arcsine")
    status = (tmp_path / "example_status.log").read_text()
    assert (
        "RETRIEVAL_SPECS 4k: --output-prefix data/retrieval/retrieval_code_4k was written with "
        "other settings (written ["
    ) in status, status
    assert "or give another RETRIEVAL_PREFIX" in status
    assert not [c for c in refused if c["args"][:2] == ["-m", "megatron_s2.training.sweep"]]


def test_example_script_without_retrieval_documents_blends_code_and_kv_only(tmp_path):
    """RETRIEVAL_WEIGHT=0 is run E's blend: no retrieval corpus is written or blended."""
    _write_fake(tmp_path)
    log = tmp_path / "calls.jsonl"
    calls = _run(tmp_path, log, RETRIEVAL_WEIGHT="0")
    tools = [os.path.basename(c["args"][0]) for c in calls]
    assert "make_retrieval_corpus.py" not in tools
    sweeps = [c for c in calls if c["args"][:3] == ["-m", "megatron_s2.training.sweep", "run"]]
    assert len(sweeps) == 2
    run_e_blend = "data.blend=[[0.75, data/code/train_valid], [0.25, data/kv/kv_code]]"
    blends = [[a for a in c["args"] if a.startswith("data.blend=")][-1] for c in sweeps]
    assert blends == [run_e_blend, run_e_blend]


@pytest.mark.parametrize("accuracy, extends", [("0.0", False), ("0.3", True)])
def test_example_script_extends_only_models_that_retrieve(tmp_path, accuracy, extends):
    """EXTEND_MIN_ACCURACY: the extension (and its device time) only for base models whose
    passkey accuracy up to their own 4k reaches it."""
    _write_fake(tmp_path)
    log = tmp_path / "calls.jsonl"
    calls = _run(tmp_path, log, EXTEND_MIN_ACCURACY="0.2", FAKE_ACCURACY=accuracy)
    studies = [
        Path(c["args"][3]).stem
        for c in calls
        if c["args"][:3] == ["-m", "megatron_s2.training.sweep", "run"]
    ]
    status = (tmp_path / "example_status.log").read_text()
    if extends:
        assert studies == ["code-125m-4k-base", "code-125m-extend-16k"]
        assert "all done (exit 0)" in status
    else:
        assert studies == ["code-125m-4k-base"]
        assert "extension skipped" in status and "EXTEND_MIN_ACCURACY=0.2" in status


@pytest.mark.parametrize("through_after", [True, False], ids=["sweep-after", "catch-up"])
def test_example_script_spreads_points_and_evaluations_over_devices(tmp_path, through_after):
    """DEVICES=0,1: both studies get the sweep's --devices (a point per GPU) and the evaluations
    of a study go round the GPUs, one process each: through the sweep's --after each on its
    point's GPU, in the catch-up each on a GPU of its own."""
    _write_fake(tmp_path)
    log = tmp_path / "calls.jsonl"
    extra = {} if through_after else {"FAKE_NO_AFTER": "1"}
    calls = _run(tmp_path, log, DEVICES="0, 1", **extra)  # spaces as a user may type them
    sweeps = [c for c in calls if c["args"][:3] == ["-m", "megatron_s2.training.sweep", "run"]]
    assert len(sweeps) == 2
    for c in sweeps:
        assert c["args"][-2:] == ["--devices", "0,1"]
    for study in ("code-125m-4k-base", "code-125m-extend-16k"):
        points = POINTS[study]
        gpus = [
            c["gpus"]
            for c in calls
            if c["args"][:2] == EVAL_MODULE
            and f"/{study}/" in c["args"][c["args"].index("--checkpoint") + 1]
        ]
        assert len(gpus) == len(points)
        assert sorted(gpus) == sorted(["0", "1", "0"][: len(points)])


def test_example_script_runs_the_extension_studies_it_is_given(tmp_path):
    """EXTEND_STUDIES: each extension study from the same 4k models, one after another, each
    evaluated after its own training and plotted."""
    _write_fake(tmp_path)
    log = tmp_path / "calls.jsonl"
    studies = ["code-125m-extend-16k", "code-125m-extend-16k-remedies"]
    calls = _run(tmp_path, log, EXTEND_STUDIES=" ".join(studies))
    sweeps = [c for c in calls if c["args"][:3] == ["-m", "megatron_s2.training.sweep", "run"]]
    assert [Path(c["args"][3]).stem for c in sweeps] == ["code-125m-4k-base", *studies]
    assert all(Path(c["args"][3]).is_file() for c in sweeps)  # the studies exist
    for sweep, study in zip(sweeps[1:], studies):
        evals = [
            c
            for c in calls
            if c["args"][:2] == EVAL_MODULE
            and f"/{study}/" in c["args"][c["args"].index("--checkpoint") + 1]
        ]
        assert len(evals) == len(POINTS[study])
        # each right after its point, inside the study's sweep (the sweep's --after)
        assert all(sweep["start"] <= c["start"] and c["end"] <= sweep["end"] for c in evals)
    plots = [c for c in calls if os.path.basename(c["args"][0]) == "plot_loss_by_position.py"]
    assert sorted(c["args"][c["args"].index("--out") + 1] for c in plots) == sorted(
        f"sweeps/{s}/loss_by_position.png" for s in ["code-125m-4k-base", *studies]
    )


def test_extend_studies_none_runs_the_base_study_alone_at_the_given_process_count(tmp_path):
    """EXTEND_STUDIES=none with BASE_NPROC=1: a base judged at its own length before any
    extension (a two-process base on one GPU): the base sweep alone, with --nproc-per-node 1,
    each of its runs evaluated once, its results copied, no extension and its corpus unbuilt."""
    _write_fake(tmp_path)
    log = tmp_path / "calls.jsonl"
    # The default RETRIEVAL_SPECS hold a 4k and a 16k corpus: only the base's (BASE_TAG 4k).
    base_only = {"EXTEND_STUDIES": "none"}
    calls = _run(tmp_path, log, BASE_NPROC="1", RESULTS_DIR="results", **base_only)
    sweeps = [c for c in calls if c["args"][:3] == ["-m", "megatron_s2.training.sweep", "run"]]
    assert [Path(c["args"][3]).stem for c in sweeps] == ["code-125m-4k-base"]
    args = sweeps[0]["args"]
    assert args[args.index("--nproc-per-node") + 1] == "1"
    evals = [c for c in calls if c["args"][:2] == EVAL_MODULE]
    assert sorted(str(_run_dir(tmp_path, c)) for c in evals) == [
        f"sweeps/code-125m-4k-base/runs/{p}" for p in POINTS["code-125m-4k-base"]
    ]
    assert sorted(_writers_by_tag(calls)) == ["4k"]
    for arm in POINTS["code-125m-4k-base"]:
        assert (
            tmp_path / "results" / "code-125m-4k-base" / arm / "seed0" / "retrieval.json"
        ).is_file()
    status = (tmp_path / "example_status.log").read_text().splitlines()
    assert status[-1].endswith("all done (exit 0): sweeps/code-125m-4k-base")
    # Without BASE_NPROC the sweep keeps the study's own process count (no option).
    calls = _run(tmp_path, tmp_path / "again.jsonl", **base_only)
    (sweep,) = [c for c in calls if c["args"][:3] == ["-m", "megatron_s2.training.sweep", "run"]]
    assert "--nproc-per-node" not in sweep["args"]


def test_example_script_refuses_an_unknown_extension_study_before_any_work(tmp_path):
    _write_fake(tmp_path)
    log = tmp_path / "calls.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in SCRIPT_KNOBS}
    env.update(
        PYTHON=str(tmp_path / "python"),
        FAKE_LOG=str(log),
        EXTEND_STUDIES="code-125m-extend-16k-remedis",
    )
    r = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2
    assert "no study code-125m-extend-16k-remedis" in r.stdout
    assert "code-125m-extend-16k-remedies" in r.stdout  # the studies there are, listed
    assert not log.exists()  # nothing ran


def test_a_retrieval_spec_may_set_its_own_queries_and_needles(tmp_path):
    """RETRIEVAL_QUERIES and RETRIEVAL_NEEDLES reach every retrieval corpus's writer as
    --queries and --multikey-needles (multi-question multikey documents), and RETRIEVAL_SPECS'
    optional fifth and sixth fields override them for that corpus alone (a short-trial corpus
    next to a many-needle one). One run for both: 4kshort sets neither field, so it gets the
    settings' values (not the defaults: 1 question, no --multikey-needles)."""
    _write_fake(tmp_path)
    calls = _run(
        tmp_path,
        tmp_path / "calls.jsonl",
        RETRIEVAL_TASKS="passkey,multikey",
        RETRIEVAL_SPECS="4kmq:4094:4094:40:16:32 4kshort:128:1024:60 16k:256:16384:20:2",
        RETRIEVAL_QUERIES="8",
        RETRIEVAL_NEEDLES="16",
    )
    writers = _writers_by_tag(calls)
    assert sorted(writers) == ["16k", "4kmq", "4kshort"]
    for args in writers.values():
        assert args[args.index("--tasks") + 1] == "passkey,multikey"

    def value(args, option):
        return args[args.index(option) + 1]

    got = {
        tag: tuple(value(a, o) for o in ("--queries", "--multikey-needles", "--num-docs"))
        for tag, a in writers.items()
    }
    assert got == {
        "4kmq": ("16", "32", "40"),
        "4kshort": ("8", "16", "60"),
        "16k": ("2", "16", "20"),
    }


def test_packed_corpora_and_tag_lists_share_the_retrieval_weight(tmp_path):
    """RETRIEVAL_SPECS' seventh field gives that corpus's writer --pack-to (the others none),
    and BASE_TAG / EXTEND_TAG as comma lists blend each of their corpora at an even share of
    RETRIEVAL_WEIGHT into the base study and the extensions."""
    _write_fake(tmp_path)
    calls = _run(
        tmp_path,
        tmp_path / "calls.jsonl",
        RETRIEVAL_TASKS="passkey,multikey",
        RETRIEVAL_SPECS="4kmq:4094:4094:40:16:32 4kpack:128:1024:60:2::4096 "
        "16kpack:256:4096:20:::16384",
        RETRIEVAL_WEIGHT="0.6",
        KV_WEIGHT="0.1",
        BASE_TAG="4kmq,4kpack",
        EXTEND_TAG="16kpack",
    )
    writers = _writers_by_tag(calls)
    pack = {
        t: a[a.index("--pack-to") + 1] if "--pack-to" in a else None for t, a in writers.items()
    }
    assert pack == {"4kmq": None, "4kpack": "4096", "16kpack": "16384"}
    # empty fields: the defaults (RETRIEVAL_QUERIES 1, the writer's own needle count)
    assert writers["4kpack"][writers["4kpack"].index("--queries") + 1] == "2"
    assert "--multikey-needles" not in writers["4kpack"]
    assert writers["16kpack"][writers["16kpack"].index("--queries") + 1] == "1"
    sweeps = {
        Path(c["args"][3]).stem: [a for a in c["args"] if a.startswith("data.blend=")][-1]
        for c in calls
        if c["args"][:3] == ["-m", "megatron_s2.training.sweep", "run"]
    }
    head = "data.blend=[[0.3, data/code/train_valid], [0.1, data/kv/kv_code], "
    assert sweeps["code-125m-4k-base"] == head + (
        "[0.3, data/retrieval/retrieval_code_4kmq], [0.3, data/retrieval/retrieval_code_4kpack]]"
    )
    assert sweeps["code-125m-extend-16k"] == head + "[0.6, data/retrieval/retrieval_code_16kpack]]"


@pytest.mark.parametrize("haystack", ["code", "filler"])
def test_example_script_gives_the_retrieval_writer_the_code_haystack(tmp_path, haystack):
    """RETRIEVAL_HAYSTACK=code: every retrieval corpus's writer gets the code corpus (the
    corpus's data.blend) and the run's data.split as --haystack-corpus/--haystack-split, so that
    its needle and multikey haystacks are training code; filler: neither option (the writer's
    filler text, as runs H and J). Unset (the default, code):
    test_example_script_blends_evaluates_every_run_once_and_resumes, on its default run."""
    _write_fake(tmp_path)
    calls = _run(tmp_path, tmp_path / "calls.jsonl", RETRIEVAL_HAYSTACK=haystack)
    writers = [c for c in calls if os.path.basename(c["args"][0]) == "make_retrieval_corpus.py"]
    assert len(writers) == 2
    for c in writers:
        args = c["args"]
        if haystack == "filler":
            assert not [a for a in args if a.startswith("--haystack")]
            continue
        _assert_code_haystack(args)


def test_example_script_refuses_an_unknown_haystack_before_any_work(tmp_path):
    _write_fake(tmp_path)
    log = tmp_path / "calls.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in SCRIPT_KNOBS}
    env.update(PYTHON=str(tmp_path / "python"), FAKE_LOG=str(log), RETRIEVAL_HAYSTACK="kode")
    r = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2
    assert "RETRIEVAL_HAYSTACK must be code or filler, got 'kode'" in r.stdout
    assert not log.exists()  # nothing ran


def test_example_script_probes_attention_when_asked(tmp_path):
    _write_fake(tmp_path)
    calls = _run(tmp_path, tmp_path / "calls.jsonl", PROBE_LENGTH="8192")
    evals = [c for c in calls if c["args"][:2] == EVAL_MODULE]
    assert evals
    for c in evals:
        at = c["args"].index("--attention-probe")
        assert c["args"][at + 1] == "8192"
        assert "--probe-tasks" not in c["args"]  # the evaluator's default: the first task
    # PROBE_TASKS: passed on with the probe, wherever the probe runs (a fresh checkout: the
    # first one's evaluations are done and would be skipped).
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    _write_fake(fresh)
    calls = _run(fresh, fresh / "calls.jsonl", PROBE_LENGTH="8192", TASKS="passkey,multikey",
                 PROBE_TASKS="passkey,multikey")  # fmt: skip
    evals = [c for c in calls if c["args"][:2] == EVAL_MODULE]
    assert evals
    for c in evals:
        at = c["args"].index("--probe-tasks")
        assert c["args"][at + 1] == "passkey,multikey"
        assert "--attention-probe" in c["args"]


def test_example_script_runs_given_seeds_of_a_base_study_and_collects_results(tmp_path):
    """BASE_STUDY, SEEDS, EXTEND_TAG and RESULTS_DIR (issue 50's studies: one or two seeds of
    every arm per GPU lease): both sweeps get --seeds, the extension blends the EXTEND_TAG
    corpus, and each evaluated run's JSON lands in RESULTS_DIR/<study>/<arm>/seed<k>/."""
    points = {
        "code-125m-extend-16k-remedies": ["dense,seed=2", "hybrid-DS,seed=2"],
        "code-125m-extend-16k": ["dense,seed=2", "hybrid-DS,seed=2"],
    }
    _write_fake(tmp_path, points)
    log = tmp_path / "calls.jsonl"
    calls = _run(
        tmp_path,
        log,
        BASE_STUDY="code-125m-extend-16k-remedies",  # any study file that exists
        SEEDS="2",
        SETTINGS="dense,hybrid-DS",
        EXTEND_TAG="32k",
        RETRIEVAL_SPECS="4k:128:4096:10 32k:256:32768:10",
        RESULTS_DIR="results",
    )
    sweeps = [c for c in calls if c["args"][:3] == ["-m", "megatron_s2.training.sweep", "run"]]
    assert [Path(c["args"][3]).stem for c in sweeps] == [
        "code-125m-extend-16k-remedies",
        "code-125m-extend-16k",
    ]
    for c in sweeps:
        assert c["args"][-4:] == ["--seeds", "2", "--settings", "dense,hybrid-DS"]
    blend = [a for a in sweeps[1]["args"] if a.startswith("data.blend=")][-1]
    assert blend.endswith("[0.2, data/retrieval/retrieval_code_32k]]")
    for study in points:
        for arm in ("dense", "hybrid-DS"):
            got = tmp_path / "results" / study / arm / "seed2" / "retrieval.json"
            assert json.loads(got.read_text())["tasks"]["passkey"]["cells"]
        # The sweep's table beside the arms, for retrieval_tables.py --goal's tokens/s.
        table = (tmp_path / "results" / study / "results.csv").read_text()
        assert table == (tmp_path / "sweeps" / study / "results.csv").read_text()
        assert "dense,seed=2,finished" in table


def test_example_script_keeps_each_evaluation_when_cut_off(tmp_path):
    """The GPU lease ends during the extension study (FAKE_CUT: its sweep has trained and
    evaluated its first point, then the script is killed): every run finished before the cut
    has its evaluation, and RESULTS_DIR its copy, since the sweeps' --after made them as each
    point finished; a rerun evaluates only what the cut left out."""
    _write_fake(tmp_path)
    log = tmp_path / "calls.jsonl"
    _run(
        tmp_path, log, returncode=-signal.SIGKILL, FAKE_CUT="code-125m-extend-16k", RESULTS_DIR="r"
    )
    base, extension = POINTS["code-125m-4k-base"], POINTS["code-125m-extend-16k"]
    kept = [("code-125m-4k-base", p) for p in base] + [("code-125m-extend-16k", extension[0])]
    for study, point in kept:
        run = tmp_path / "sweeps" / study / "runs" / point
        assert (run / "long_context_eval" / "loss_by_position.json").exists()
        assert json.loads((tmp_path / "r" / study / point / "seed0" / "retrieval.json").read_text())
    assert not (tmp_path / "r" / "code-125m-extend-16k" / extension[1]).exists()
    status = (tmp_path / "example_status.log").read_text()
    assert f"evaluated {tmp_path}/sweeps/code-125m-extend-16k/runs/{extension[0]} (exit 0" in status
    assert "all done" not in status

    log.write_text("")
    calls = _run(tmp_path, log, RESULTS_DIR="r")
    again = sorted(str(_run_dir(tmp_path, c)) for c in calls if c["args"][:2] == EVAL_MODULE)
    assert again == [f"sweeps/code-125m-extend-16k/runs/{p}" for p in sorted(extension[1:])]
    for point in extension:
        assert (
            tmp_path / "r" / "code-125m-extend-16k" / point / "seed0" / "retrieval.json"
        ).exists()


def test_prefix_eod_also_evaluates_every_run_behind_the_eod_token_once(tmp_path):
    """PREFIX_EOD=also: after each run's evaluation, a retrieval-only one of the same grid with
    --prefix-eod into <run>/long_context_eval_eod/, copied to RESULTS_DIR/<study>-eod/ (a
    study directory of its own); a second run of the script redoes neither."""
    _write_fake(tmp_path)
    log = tmp_path / "calls.jsonl"
    calls = _run(tmp_path, log, PREFIX_EOD="also", RESULTS_DIR="r", LENGTHS="4096,8192")
    evals = [c for c in calls if c["args"][:2] == EVAL_MODULE]
    runs = [f"sweeps/{study}/runs/{p}" for study in ("code-125m-4k-base", "code-125m-extend-16k")
            for p in POINTS[study]]  # fmt: skip
    plain = [c for c in evals if "--prefix-eod" not in c["args"]]
    eod = [c for c in evals if "--prefix-eod" in c["args"]]
    assert sorted(str(_run_dir(tmp_path, c)) for c in plain) == sorted(runs)
    assert sorted(str(_run_dir(tmp_path, c)) for c in eod) == sorted(runs)
    for c in eod:
        args, run = c["args"], tmp_path / _run_dir(tmp_path, c)
        assert "--skip-position" in args and "--attention-probe" not in args
        assert args[args.index("--lengths") + 1] == "4096,8192"
        assert (
            Path(args[args.index("--output-dir") + 1]).resolve()
            == (run / "long_context_eval_eod").resolve()
        )
        # After the run's own evaluation, and with the base runs' --allow-extrapolation.
        first = next(p for p in plain if _run_dir(tmp_path, p) == _run_dir(tmp_path, c))
        assert first["end"] <= c["start"]
        assert ("--allow-extrapolation" in args) == ("4k-base" in str(run))
    for study in ("code-125m-4k-base", "code-125m-extend-16k"):
        for point in POINTS[study]:
            got = json.loads((tmp_path / "r" / f"{study}-eod" / point / "seed0" / "retrieval.json")
                             .read_text())  # fmt: skip
            assert got["prefix_eod"] is True
            mine = json.loads((tmp_path / "r" / study / point / "seed0" / "retrieval.json")
                              .read_text())  # fmt: skip
            assert mine["prefix_eod"] is False
    log.write_text("")
    again = _run(tmp_path, log, PREFIX_EOD="also", RESULTS_DIR="r", LENGTHS="4096,8192")
    assert not [c for c in again if c["args"][:2] == EVAL_MODULE]


@pytest.mark.parametrize("arms", [None, "dense,hybrid-DS"])
def test_zone_depths_evaluate_the_extensions_chosen_arms_near_the_start_once(tmp_path, arms):
    """ZONE_DEPTHS: after its own evaluation, each extension-study run of an arm in ZONE_ARMS
    (default dense; never a base run) is evaluated once more, retrieval only, at those depths,
    ZONE_LENGTHS and ZONE_TASKS, into <run>/long_context_eval_zone/, copied to
    RESULTS_DIR/<study>-zone/; a second run of the script redoes nothing (run with two arms
    only: the skip is the same for one)."""
    _write_fake(tmp_path)
    log = tmp_path / "calls.jsonl"
    env = dict(ZONE_DEPTHS="0,0.002,0.01", ZONE_LENGTHS="4096", ZONE_TASKS="passkey",
               TASKS="passkey,multikey", LENGTHS="4096,8192", RESULTS_DIR="r")  # fmt: skip
    if arms:
        env["ZONE_ARMS"] = arms
    calls = _run(tmp_path, log, **env)
    evals = [c for c in calls if c["args"][:2] == EVAL_MODULE]
    zone = [c for c in evals if "--depths" in c["args"]]
    chosen = (arms or "dense").split(",")
    study = "code-125m-extend-16k"
    assert sorted(str(_run_dir(tmp_path, c)) for c in zone) == sorted(
        f"sweeps/{study}/runs/{p}" for p in chosen
    )
    for c in zone:
        args, run = c["args"], tmp_path / _run_dir(tmp_path, c)
        assert args[args.index("--depths") + 1] == "0,0.002,0.01"
        assert args[args.index("--lengths") + 1] == "4096"
        assert args[args.index("--tasks") + 1] == "passkey"
        assert "--skip-position" in args and "--attention-probe" not in args
        assert (
            Path(args[args.index("--output-dir") + 1]).resolve()
            == (run / "long_context_eval_zone").resolve()
        )
        first = next(
            p for p in evals if p is not c and _run_dir(tmp_path, p) == _run_dir(tmp_path, c)
        )
        assert first["end"] <= c["start"]
    for arm in POINTS[study]:
        copied = tmp_path / "r" / f"{study}-zone" / arm / "seed0" / "retrieval.json"
        assert copied.exists() == (arm in chosen), arm
        assert (tmp_path / "r" / study / arm / "seed0" / "retrieval.json").exists()
    assert not (tmp_path / "r" / "code-125m-4k-base-zone").exists()
    if arms:
        log.write_text("")
        again = _run(tmp_path, log, **env)
        assert not [c for c in again if c["args"][:2] == EVAL_MODULE]


@pytest.mark.parametrize(
    "env, message",
    [
        ({"PREFIX_EOD": "yes"}, "PREFIX_EOD must be empty or also, got 'yes'"),
        (
            {"LENGTHS": "4096,8192", "PROBE_LENGTH": "16384"},
            "PROBE_LENGTH must be one of LENGTHS (4096,8192), got '16384'",
        ),
        ({"PROBE_TASKS": "passkey"}, "PROBE_TASKS needs PROBE_LENGTH"),
        ({"ZONE_DEPTHS": "0,1.5"}, "ZONE_DEPTHS: '1.5' is not a needle depth in [0, 1]"),
        (
            {"ZONE_DEPTHS": "0", "LENGTHS": "4096,8192", "ZONE_LENGTHS": "4096,16384"},
            "ZONE_LENGTHS: '16384' is not one of LENGTHS (4096,8192)",
        ),
        (
            {"ZONE_DEPTHS": "0", "TASKS": "passkey", "ZONE_TASKS": "multikey"},
            "ZONE_TASKS: 'multikey' is not one of TASKS (passkey)",
        ),
        ({"ZONE_TASKS": "passkey"}, "ZONE_LENGTHS and ZONE_TASKS need ZONE_DEPTHS"),
        (
            {"PROBE_LENGTH": "8192", "TASKS": "passkey,multikey", "PROBE_TASKS": "passkey,kv"},
            "PROBE_TASKS: 'kv' is not one of TASKS (passkey,multikey)",
        ),
        ({"BASE_NPROC": "0"}, "BASE_NPROC: '0' is not a number of processes >= 1"),
        ({"BASE_NPROC": "two"}, "BASE_NPROC: 'two' is not a number of processes >= 1"),
        ({"EXTEND_STUDIES": " "}, "EXTEND_STUDIES names no study (give study names, or none"),
        (
            {"EXTEND_STUDIES": "none", "ZONE_DEPTHS": "0"},
            "ZONE_DEPTHS and EXTEND_MIN_ACCURACY act on the extension studies",
        ),
        (
            {"EXTEND_STUDIES": "none", "EXTEND_MIN_ACCURACY": "0.5"},
            "ZONE_DEPTHS and EXTEND_MIN_ACCURACY act on the extension studies",
        ),
    ],
)
def test_example_script_refuses_bad_settings_before_any_work(tmp_path, env, message):
    """Evaluation settings, process counts and study lists are checked before anything runs."""
    _write_fake(tmp_path)
    log = tmp_path / "calls.jsonl"
    log.write_text("")
    _run(tmp_path, log, returncode=2, **env)
    assert log.read_text() == ""
    assert message in (tmp_path / "example_status.log").read_text()


@pytest.mark.parametrize("through_after", [True, False], ids=["sweep-after", "catch-up"])
def test_base_lengths_apply_to_the_base_study_alone(tmp_path, through_after):
    """BASE_LENGTHS: the base study's evaluations (both protocols) at those lengths, the
    extension's at LENGTHS, whether the sweep's --after or the catch-up evaluates them; a
    PROBE_LENGTH outside an evaluation's lengths (32k, the base at 4k) is not probed there."""
    _write_fake(tmp_path)
    log = tmp_path / "calls.jsonl"
    extra = {} if through_after else {"FAKE_NO_AFTER": "1"}
    calls = _run(tmp_path, log, LENGTHS="4096,32768", BASE_LENGTHS="4096", PREFIX_EOD="also",
                 PROBE_LENGTH="32768", **extra)  # fmt: skip
    evals = [c for c in calls if c["args"][:2] == EVAL_MODULE]
    assert len(evals) == 2 * (
        len(POINTS["code-125m-4k-base"]) + len(POINTS["code-125m-extend-16k"])
    )
    for c in evals:
        lengths = c["args"][c["args"].index("--lengths") + 1]
        base = "code-125m-4k-base" in str(_run_dir(tmp_path, c))
        assert lengths == ("4096" if base else "4096,32768"), c["args"]
        # The probe at 32k where 32k is evaluated: the extension's first evaluation alone.
        probed = not base and "--prefix-eod" not in c["args"]
        assert ("--attention-probe" in c["args"]) == probed, c["args"]


def test_retrieval_depth_distribution_reaches_every_writer_and_is_checked_first(tmp_path):
    """RETRIEVAL_DEPTH_DISTRIBUTION goes to every retrieval writer as --depth-distribution (unset:
    none, the writer's uniform: test_example_script_blends_evaluates_every_run_once_and_resumes,
    on its default run); a value the writer does not know is refused before any work."""
    _write_fake(tmp_path)
    log = tmp_path / "calls.jsonl"
    calls = _run(tmp_path, log, RETRIEVAL_DEPTH_DISTRIBUTION="arcsine")
    writers = _writers_by_tag(calls)
    assert writers and all(
        a[a.index("--depth-distribution") + 1] == "arcsine" for a in writers.values()
    )
    log.write_text("")
    _run(tmp_path, log, returncode=2, RETRIEVAL_DEPTH_DISTRIBUTION="edges")
    assert log.read_text() == ""
    status = (tmp_path / "example_status.log").read_text()
    assert "RETRIEVAL_DEPTH_DISTRIBUTION must be uniform, log-uniform or arcsine, got 'edges'" in (
        status
    )


def test_base_settings_choose_the_base_studys_arms_alone(tmp_path):
    """BASE_SETTINGS: the base study's --settings where they differ from the extension's (an
    extension arm that loads another arm's base, dense-to-hybrid from dense); unset, both
    studies get SETTINGS."""
    _write_fake(tmp_path)
    log = tmp_path / "calls.jsonl"

    def settings_by_study(calls):
        return {
            Path(c["args"][3]).stem: c["args"][c["args"].index("--settings") + 1]
            for c in calls
            if c["args"][:3] == ["-m", "megatron_s2.training.sweep", "run"]
        }

    calls = _run(tmp_path, log, SETTINGS="dense,dense-to-hybrid", BASE_SETTINGS="dense")
    assert settings_by_study(calls) == {
        "code-125m-4k-base": "dense",
        "code-125m-extend-16k": "dense,dense-to-hybrid",
    }
    (tmp_path / "sweeps").rename(tmp_path / "sweeps-1")
    log.write_text("")
    calls = _run(tmp_path, log, SETTINGS="dense")
    assert settings_by_study(calls) == {
        "code-125m-4k-base": "dense",
        "code-125m-extend-16k": "dense",
    }
