"""tools/lease.sh, the detached GPU-lease runner, in a scratch copy of the checkout with stand-in
steps (the steps themselves are tested in test_run_code_study.py and
test_run_extension_example.py): bad jobs are refused before anything starts, a failing GPU test
stops the lease, the quality reruns carry each committed rerun into its own sweep and select the
documented points on the documented GPUs, and a poll packs results without checkpoints."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.version_independent

REPO = Path(__file__).resolve().parents[2]

# Stands in for run_code_study.sh: one JSON line a call with the settings the lease gave it.
FAKE_STUDY = textwrap.dedent(
    """\
    #!/usr/bin/env bash
    printf '{"study": "%s", "sweep": "%s", "out": "%s", "eval": "%s"}\\n' \\
        "$1" "$SWEEP_ARGS" "${OUTPUT_DIR:-}" "${EVAL_DEVICES:-}" >> "$FAKE_LOG"
    """
)

# Stands in for the interpreter: logs its arguments; fails when FAKE_FAIL is among them.
FAKE_PYTHON = textwrap.dedent(
    """\
    #!/usr/bin/env bash
    echo "python $*" >> "$FAKE_LOG"
    [[ " $* " == *" $FAKE_FAIL "* ]] && { echo "1 failed"; exit 1; }
    echo "1 passed"
    """
)


def _checkout(tmp_path: Path) -> Path:
    """A scratch checkout with tools/lease.sh and the stand-ins; returns its root."""
    root = tmp_path / "repo"
    (root / "tools").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "lease.sh", root / "tools" / "lease.sh")
    for path, text in (("tools/run_code_study.sh", FAKE_STUDY), ("fake_python", FAKE_PYTHON)):
        (root / path).write_text(text)
        (root / path).chmod(0o755)
    return root


def _lease(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {
        **os.environ,
        "LEASE_STAGE": "0",
        "PYTHON": str(root / "fake_python"),
        "FAKE_LOG": str(root / "fake.log"),
        "FAKE_FAIL": "never",
        **env,
    }
    return subprocess.run(
        ["bash", str(root / "tools" / "lease.sh"), *args],
        cwd=root,
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _wait_done(root: Path) -> str:
    done = root / "results" / "lease" / "DONE"
    for _ in range(200):
        if done.is_file():
            return done.read_text().strip()
        time.sleep(0.1)
    raise AssertionError((root / "results" / "lease" / "status.log").read_text())


def test_bad_jobs_are_refused_before_anything_starts(tmp_path):
    root = _checkout(tmp_path)
    bad = _lease(root, "start", "retrieval")
    assert bad.returncode == 2
    jobs = (
        "retrieval-hybrid-ds retrieval-eod-first retrieval-eod-first-screen "
        "retrieval-eod-first-one-gpu quality-reruns "
        "gpu-tests"
    )
    assert f"unknown job 'retrieval'; jobs: {jobs}" in bad.stderr
    no_seed = _lease(root, "start", "retrieval-hybrid-ds")
    assert no_seed.returncode == 2
    assert "retrieval-hybrid-ds needs a seed (a number), got ''" in no_seed.stderr
    assert not (root / "results").exists()


def test_a_failing_gpu_test_stops_the_lease_and_a_second_start_is_refused(tmp_path):
    root = _checkout(tmp_path)
    started = _lease(
        root, "start", "gpu-tests", LEASE_GPU_TEST="-m gpu first.py", FAKE_FAIL="first.py"
    )
    assert started.returncode == 0, started.stderr
    assert _wait_done(root) == "1"
    status = (root / "results" / "lease" / "status.log").read_text()
    assert "SETUP_FAILED: gpu test exit 1" in status
    calls = (root / "fake.log").read_text().splitlines()
    assert calls == ["python -m pytest -q -m gpu first.py"]  # the job itself never ran
    again = _lease(root, "start", "gpu-tests")
    assert again.returncode == 2 and "a lease ran here already" in again.stderr


def test_quality_reruns_carry_finished_runs_and_run_the_documented_points(tmp_path):
    root = _checkout(tmp_path)
    s = "code-125m-16k-seeds-100m"
    q = root / "docs" / "quality" / s
    q.mkdir(parents=True)
    (q / "corpus.json").write_text("{}")
    for run in ("dense,seed=1", "hybrid-SSSD,seed=1"):
        (q / "reruns" / "runs" / run).mkdir(parents=True)
        (q / "reruns" / "runs" / run / "summary.json").write_text("{}")
    (q / "reruns" / "runs" / "dense,seed=2").mkdir()  # cut off: no summary, not carried
    started = _lease(root, "start", "quality-reruns", LEASE_GPUS="2")
    assert started.returncode == 0, started.stderr
    assert _wait_done(root) == "0", (root / "results" / "lease" / "status.log").read_text()
    sweeps = root / "sweeps"
    for part in "ab":  # every finished rerun in both folders, the cut-off one in neither
        folder = sweeps / f"{s}-rerun-{part}"
        assert sorted(p.name for p in (folder / "runs").iterdir()) == [
            "dense,seed=1",
            "hybrid-SSSD,seed=1",
        ]
        assert (folder / "corpus.json").is_file()
    lines = (root / "fake.log").read_text().splitlines()
    assert lines[0] == "python tools/build_code_corpus.py --out data/code"
    calls = [json.loads(line) for line in lines[1:]]
    study = f"configs/studies/{s}.yaml"

    def gpu(device, part, *sweeps):
        out = f"sweeps/{s}-rerun-{part}"
        return [
            {"study": study, "sweep": f"--devices {device} {w}", "out": out, "eval": str(device)}
            for w in sweeps
        ]

    gpu1 = gpu(1, "a", "--settings dense", "--settings hybrid-DS --seeds 2")
    gpu0 = gpu(0, "b", "--settings hybrid-SSSD", "--settings hybrid-DS --seeds 1")
    # Each GPU's runs in its order (the two GPUs' calls interleave); nothing else.
    assert [c for c in calls if c["eval"] == "1"] == gpu1
    assert [c for c in calls if c["eval"] == "0"] == gpu0
    assert len(calls) == 4


def test_quality_reruns_on_one_gpu_run_every_point_in_turn(tmp_path):
    # A single H200 lent: the four reruns one after another on GPU 0, into one folder, the
    # finished reruns carried in (a sweep then trains only the missing seeds of a setting).
    root = _checkout(tmp_path)
    s = "code-125m-16k-seeds-100m"
    q = root / "docs" / "quality" / s
    (q / "reruns" / "runs" / "dense,seed=1").mkdir(parents=True)
    (q / "reruns" / "runs" / "dense,seed=1" / "summary.json").write_text("{}")
    (q / "corpus.json").write_text("{}")
    started = _lease(root, "start", "quality-reruns", LEASE_GPUS="1")
    assert started.returncode == 0, started.stderr
    assert _wait_done(root) == "0", (root / "results" / "lease" / "status.log").read_text()
    calls = [json.loads(line) for line in (root / "fake.log").read_text().splitlines()[1:]]
    out = f"sweeps/{s}-rerun-a"
    assert calls == [
        {"study": f"configs/studies/{s}.yaml", "sweep": f"--devices 0 {w}", "out": out, "eval": "0"}
        for w in (
            "--settings dense",
            "--settings hybrid-SSSD",
            "--settings hybrid-DS --seeds 1",
            "--settings hybrid-DS --seeds 2",
        )
    ]
    assert [p.name for p in (root / out / "runs").iterdir()] == ["dense,seed=1"]
    assert not (root / "sweeps" / f"{s}-rerun-b").exists()


def test_poll_packs_results_without_checkpoints(tmp_path):
    root = _checkout(tmp_path)
    run = root / "sweeps" / "study" / "runs" / "dense,seed=1"
    (run / "checkpoints" / "iter_0000010").mkdir(parents=True)
    (run / "checkpoints" / "iter_0000010" / "shard.distcp").write_text("weights")
    (run / "summary.json").write_text("{}")
    lease = root / "results" / "lease"
    lease.mkdir(parents=True)
    (lease / "status.log").write_text("12:00:00 job gpu-tests exit 0\n")
    (lease / "DONE").write_text("0\n")
    out = tmp_path / "out"
    out.mkdir()
    polled = _lease(root, "poll", "5", "1", OUT=str(out))
    assert polled.returncode == 0, polled.stderr
    assert "job gpu-tests exit 0" in polled.stdout and "LEASE_DONE exit 0" in polled.stdout
    with tarfile.open(out / "r.tgz") as tar:
        names = tar.getnames()
    assert "sweeps/study/runs/dense,seed=1/summary.json" in names
    assert "results/lease/status.log" in names
    assert not [n for n in names if "checkpoints" in n]
    assert not (out / "r.tgz.part").exists()


# Stands in for run_extension_example.sh: its settings (the environment it was given), as JSON.
FAKE_EXTENSION = textwrap.dedent(
    """\
    #!/usr/bin/env bash
    exec "$REAL_PYTHON" -c 'import json, os; print(json.dumps(dict(os.environ)))' > "$FAKE_LOG"
    """
)


def _retrieval_settings(tmp_path, job: str) -> dict:
    """The settings a retrieval job gives run_extension_example.sh (seed 2)."""
    root = _checkout(tmp_path / job)
    script = root / "tools" / "run_extension_example.sh"
    script.write_text(FAKE_EXTENSION)
    script.chmod(0o755)
    started = _lease(root, "start", job, "2", REAL_PYTHON=sys.executable)
    assert started.returncode == 0, started.stderr
    assert _wait_done(root) == "0", (root / "results" / "lease" / "status.log").read_text()
    env = json.loads((root / "fake.log").read_text())
    return {k: v for k, v in env.items() if k not in os.environ or os.environ[k] != v}


@pytest.fixture(scope="module")
def eod_first(tmp_path_factory) -> dict:
    """The settings of the two-GPU eod-first job (step 4b), which the one-GPU jobs are
    compared with: run once for the module."""
    return _retrieval_settings(tmp_path_factory.mktemp("eod-first"), "retrieval-eod-first")


def _changed(before: dict, after: dict) -> dict:
    """{setting: its value in ``after``} for every setting whose value differs from ``before``'s
    (None: unset), less the paths of the two scratch checkouts."""
    changed = {k: after.get(k) for k in set(before) | set(after) if after.get(k) != before.get(k)}
    for paths in ("STATUS", "FAKE_LOG", "OLDPWD", "PWD", "PYTHON"):
        changed.pop(paths, None)
    return changed


def test_retrieval_jobs_are_the_documented_commands(tmp_path, eod_first):
    # docs/long_context_eval.md's step-3 command, setting by setting (the seed is the job's).
    doc = (REPO / "docs" / "long_context_eval.md").read_text()
    block = next(b for b in doc.split("```bash")[1:] if "SETTINGS=hybrid-DS " in b.split("```")[0])
    words = shlex.split(block.split("```")[0].replace("\\\n", " "))
    documented = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("PYTHON="))
    assert len(documented) >= 15, documented
    documented["SEEDS"] = "2"
    hybrid = _retrieval_settings(tmp_path, "retrieval-hybrid-ds")
    for key, value in documented.items():
        assert hybrid.get(key) == value, key
    assert hybrid.get("BASE_SETTINGS", "") == ""  # every arm's own base
    # Step 4b: the long base's command with the eod-first studies, the twin and its switch.
    assert _changed(hybrid, eod_first) == {
        "BASE_STUDY": "retrieval-125m-4k-base-long-eodfirst",
        "EXTEND_STUDIES": "retrieval-125m-extend-32k-longbase-eodfirst",
        "SETTINGS": "dense,dense-to-hybrid-DSDSDSDSSSDD",
        "BASE_SETTINGS": "dense",
    }


def test_the_one_gpu_screen_is_the_eod_first_command_at_4k_alone(tmp_path, eod_first):
    # Step 4b's screen: the eod-first job's settings but for what makes it one GPU's 4k base
    # alone (the 4k corpora only, identical to the full command's; no extension; the base's
    # two processes as accumulated micro-batches; evaluated and probed at 4k).
    screen = _retrieval_settings(tmp_path, "retrieval-eod-first-screen")
    assert _changed(eod_first, screen) == {
        "RETRIEVAL_SPECS": "4kmq:4094:4094:40000:16:32 4kpack:128:1024:24000:1:4:4096",
        "EXTEND_STUDIES": "none",
        "EXTEND_TAG": None,
        "SETTINGS": "dense",
        "BASE_NPROC": "1",
        "LENGTHS": "4096",
        "DEVICES": "0",
        "PROBE_LENGTH": "4096",
    }
    four_k = [spec for spec in eod_first["RETRIEVAL_SPECS"].split() if spec.startswith("4k")]
    assert screen["RETRIEVAL_SPECS"].split() == four_k


def test_the_one_gpu_decision_is_the_eod_first_command_for_the_twin_alone(tmp_path, eod_first):
    # Step 4b on one H200: the eod-first job's settings but for the twin alone on GPU 0 (its
    # base's two processes as accumulated micro-batches), the lengths and tasks the rule reads
    # (the depth-0 passkey at 16k and 32k, the bar's 4k) and the probe on the passkey; the
    # corpora and the studies are the two-GPU command's.
    one = _retrieval_settings(tmp_path, "retrieval-eod-first-one-gpu")
    assert _changed(eod_first, one) == {
        "SETTINGS": "dense",
        "BASE_NPROC": "1",
        "DEVICES": "0",
        "LENGTHS": "4096,16384,32768",
        "TASKS": "passkey,multikey,needle",
        "PROBE_TASKS": "passkey",
    }
    assert one["PROBE_LENGTH"] == "32768" and one["BASE_LENGTHS"] == "4096"
