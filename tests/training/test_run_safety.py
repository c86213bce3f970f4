"""Run safety without training (issue 9): what a resume may change, the run-directory lock,
starting over, the start-up checks, checkpoint verification and fallback, the summary.

The same behaviour through the real CLI is in ``tests/training/test_run_safety_cli.py``.
"""

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from megatron_s2.training import checkpointing, run_dir
from megatron_s2.training.checkpointing import (
    TRACKER,
    find_checkpoint,
    find_resume,
    verify_checkpoint,
)
from megatron_s2.training.errors import CheckpointError, RunDirError
from megatron_s2.training.run_config import (
    CheckpointConfig,
    ConfigError,
    format_changes,
    load_config,
    resume_changes,
)
from megatron_s2.training.run_dir import (
    acquire_lock,
    check_free_space,
    check_writable,
    open_run_directory,
    previous_run,
)


def _keys(changes):
    return [c.key for c in changes]


# ----------------------------------------------------------------- what a resume may change
def test_resume_changes_sort_settings_into_refused_plan_and_run():
    saved = load_config().to_dict()
    now = load_config(
        None,
        [
            "model.hidden_size=256",
            "attention.s2.vert_stride=8",
            "data.tokenizer=gpt2",
            "optimizer.lr=1e-2",
            "train.train_iters=300",
            "checkpoint.save_interval=50",
            "train.num_workers=2",
            "parallel.use_distributed_optimizer=false",
            "logging.run_dir=elsewhere",
            "checkpoint.on_resume=keep",
        ],
    )
    changes = resume_changes(saved, now, own=True)
    # Derived shapes are compared resolved: 256 hidden means other kv_channels and FFN width.
    assert _keys(changes.refused) == [
        "model.hidden_size",
        "model.kv_channels",
        "model.ffn_hidden_size",
        "attention.s2.vert_stride",
        "data.tokenizer",
    ]
    assert _keys(changes.plan) == [
        "checkpoint.save_interval",
        "optimizer.lr",
        "train.train_iters",
    ]
    assert _keys(changes.other) == ["parallel.use_distributed_optimizer", "train.num_workers"]
    assert not changes.noted
    table = format_changes(changes.refused)
    assert "checkpoint" in table.splitlines()[0] and "now" in table.splitlines()[0]
    line = next(ln for ln in table.splitlines() if "model.hidden_size" in ln)
    assert line.split() == ["model.hidden_size", "128", "256"]


def test_resume_changes_same_pattern_written_differently_is_no_change():
    saved = load_config().to_dict()  # dense_layers: {pattern: "DS"} over 4 layers
    same = load_config(
        None,
        [
            "attention.dense_layers={indices: [0, 2]}",
            "attention.s2.head_step=null",
            "model.num_query_groups=4",  # None means one group per head: the same model
        ],
    )
    changes = resume_changes(saved, same, own=True)
    assert not changes.refused and not changes.plan and not changes.other


def test_resume_changes_from_another_runs_weights_allow_a_new_attention_pattern():
    """checkpoint.load_dir starts a new run from another run's weights: the attention pattern
    may change (dense -> S2), the shapes may not."""
    dense = load_config(None, ["attention={dense_layers: {pattern: D}}"]).to_dict()
    s2 = load_config()
    changes = resume_changes(dense, s2, own=False)
    assert not changes.refused and changes.noted
    assert all(k.startswith("attention") for k in _keys(changes.noted))
    assert _keys(resume_changes(dense, s2, own=True).refused) == _keys(changes.noted)
    wider = load_config(None, ["model.num_layers=8"])
    assert "model.num_layers" in _keys(resume_changes(dense, wider, own=False).refused)


def test_keep_takes_the_checkpoints_plan():
    saved = load_config().to_dict()
    now = load_config(None, ["optimizer.lr=1e-2", "train.train_iters=300", "logging.plot=false"])
    changes = resume_changes(saved, now, own=True)
    kept = now.keeping(saved, _keys(changes.plan))
    assert kept.optimizer.lr == saved["optimizer"]["lr"]
    assert kept.train.train_iters == saved["train"]["train_iters"]
    assert kept.logging.plot is False  # not a plan setting: as given now


def test_keep_that_no_longer_fits_is_a_config_error():
    saved = load_config(None, ["train.global_batch_size=4"]).to_dict()
    now = load_config(None, ["train.global_batch_size=12", "train.micro_batch_size=3"])
    with pytest.raises(ConfigError, match="checkpoint.on_resume=keep: the checkpoint's values"):
        now.keeping(saved, ["train.global_batch_size"])


# ---------------------------------------------------------------------------------- lock
def test_lock_is_exclusive_and_released(tmp_path):
    first = acquire_lock(str(tmp_path / "run"))
    assert f"pid {os.getpid()}" in open(first.path).read()
    with pytest.raises(RunDirError, match=r"is in use by a live run \(pid \d+ on .* since"):
        acquire_lock(str(tmp_path / "run"))
    first.release()
    acquire_lock(str(tmp_path / "run")).release()


HOLD_LOCK = """
import sys, time
from megatron_s2.training.run_dir import acquire_lock
lock = acquire_lock(sys.argv[1])
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_lock_between_processes_and_after_the_holder_died(tmp_path):
    """Another live process holds the lock: refused, naming its pid. Killed (no cleanup at all),
    its lock file stays behind but the kernel released the lock: a new run takes it over."""
    directory = str(tmp_path / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, directory, "60"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirError, match=f"pid {holder.pid} on"):
            acquire_lock(directory)
    finally:
        holder.kill()
        holder.wait()
    assert os.path.exists(os.path.join(directory, run_dir.LOCK_FILE))  # stale file
    acquire_lock(directory).release()


# --------------------------------------------------------------------- starting over
def _previous_run(root):
    os.makedirs(root / "checkpoints" / "iter_0000004")
    (root / "checkpoints" / TRACKER).write_text("4")
    (root / "metrics.jsonl").write_text('{"kind": "train", "iteration": 1, "loss": 5.0}\n')
    (root / "summary.json").write_text("{}")


def test_previous_run_ignores_config_lock_and_launcher_logs(tmp_path):
    root = tmp_path / "r"
    os.makedirs(root / "logs")
    (root / "config.yaml").write_text("name: r\n")
    (root / run_dir.LOCK_FILE).write_text("")
    (root / "metrics.jsonl").write_text("")
    assert previous_run(str(root), str(root / "checkpoints")) == []
    _previous_run(root)
    found = previous_run(str(root), str(root / "checkpoints"))
    assert found[:2] == ["metrics.jsonl", "summary.json"] and "checkpoints" in found[2]


def test_restart_moves_the_previous_run_aside(tmp_path):
    root, external = tmp_path / "r", tmp_path / "ckpt"
    _previous_run(root)
    os.makedirs(external)
    (external / TRACKER).write_text("9")
    info, locks = open_run_directory(str(root), str(external), restart=True)
    try:
        moved = dict(info.moved_aside)
        assert set(moved) == {str(root), str(external)}
        for old, new in moved.items():
            assert os.path.basename(new).startswith(os.path.basename(old) + ".old-")
        assert os.path.isfile(os.path.join(moved[str(root)], "summary.json"))
        assert (tmp_path / os.path.basename(moved[str(external)]) / TRACKER).read_text() == "9"
        assert sorted(os.listdir(root)) == [run_dir.LOCK_FILE]  # a fresh directory, locked
        assert sorted(os.listdir(external)) == [run_dir.LOCK_FILE]
        with pytest.raises(RunDirError, match="in use by a live run"):
            open_run_directory(str(root), str(external), restart=True)
    finally:
        for lock in locks:
            lock.release()
    # Nothing to move: --restart in a fresh directory just starts.
    info, locks = open_run_directory(
        str(tmp_path / "new"), str(tmp_path / "new" / "c"), restart=True
    )
    assert info.moved_aside == ()
    for lock in locks:
        lock.release()


# ------------------------------------------------------------------- start-up checks
def test_not_writable_through_a_regular_file(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(RunDirError, match=r"checkpoint directory .*file/ckpt is not writable"):
        check_writable(str(tmp_path / "file" / "ckpt"), "checkpoint directory")


def test_not_writable_when_the_probe_write_fails(tmp_path, monkeypatch):
    """An existing directory on a read-only file system: makedirs succeeds, the probe does not
    (as root, chmod cannot make a directory read-only, so the file system's answer is faked)."""

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(run_dir.tempfile, "mkstemp", read_only)
    with pytest.raises(RunDirError, match=r"is not writable \(Read-only file system\)"):
        check_writable(str(tmp_path), "checkpoint directory")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare")
def test_not_writable_on_a_real_read_only_mount(tmp_path):
    """A real read-only bind mount in a private mount namespace (skipped where not allowed)."""
    target = tmp_path / "ro"
    os.makedirs(target)
    code = (
        "from megatron_s2.training.errors import RunDirError\n"
        "from megatron_s2.training.run_dir import check_writable\n"
        "try:\n"
        f"    check_writable({str(target)!r}, 'checkpoint directory')\n"
        "except RunDirError as e:\n"
        "    print(e)\n"
    )
    mount = f"mount --bind -o ro {target} {target}"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"{mount} && touch {target}/x"])
    if probe.returncode == 0 or not os.path.isdir(target):
        pytest.skip("no private read-only mounts here")
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'{mount} && exec "$0" -c "$1"', sys.executable, code],
        capture_output=True,
        text=True,
    )
    if "Operation not permitted" in out.stderr or "permission denied" in out.stderr.lower():
        pytest.skip("no private read-only mounts here")
    assert "is not writable (Read-only file system)" in out.stdout, out.stderr


def test_free_space_for_one_checkpoint(tmp_path, monkeypatch):
    need = checkpointing.estimate_checkpoint_bytes(10_000_000, 4, with_optimizer=True)
    assert need >= 10_000_000 * 16  # fp32 weights + main copy + two Adam moments
    real = shutil.disk_usage

    def disk_usage(path, free):
        return real(path)._replace(free=free)

    monkeypatch.setattr(run_dir.shutil, "disk_usage", lambda p: disk_usage(p, need - 1))
    with pytest.raises(RunDirError, match=r"has .* free, but one checkpoint .* needs about"):
        check_free_space(str(tmp_path), need)
    monkeypatch.setattr(run_dir.shutil, "disk_usage", lambda p: disk_usage(p, need))
    check_free_space(str(tmp_path), need)


# ---------------------------------------------------- checkpoint verification and fallback
METADATA_JSON = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


def _fake_checkpoint(root, iteration):
    """A torch_dist-style checkpoint: DCP shards + .metadata, common.pt, metadata.json."""
    import torch.distributed.checkpoint as dcp

    path = checkpointing.checkpoint_path(str(root), iteration)
    os.makedirs(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving as one process"
        dcp.save({"w": torch.arange(2000.0), "b": torch.ones(10)}, checkpoint_id=path)
    torch.save({"iteration": iteration, "config": {"name": "x"}}, os.path.join(path, "common.pt"))
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(METADATA_JSON, f)
    (root / TRACKER).write_text(str(iteration))
    return path


def _shard(path):
    return next(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".distcp"))


def _truncate(path):
    os.truncate(_shard(path), 598)


def _remove_metadata(path):
    os.remove(os.path.join(path, ".metadata"))


def _empty_common(path):
    open(os.path.join(path, "common.pt"), "wb").close()


@pytest.mark.parametrize(
    "damage, problem",
    [
        (_truncate, r"shard __0_0.distcp is truncated \(598 of \d+ bytes\)"),
        (_remove_metadata, r"\.metadata is missing \(an incomplete save\?\)"),
        (_empty_common, r"common\.pt is unreadable \(EOFError"),
    ],
    ids=["truncated-shard", "missing-metadata", "empty-common"],
)
def test_damaged_newest_checkpoint_falls_back_to_the_intact_one(tmp_path, damage, problem):
    _fake_checkpoint(tmp_path, 2)
    newest = _fake_checkpoint(tmp_path, 4)
    assert verify_checkpoint(newest) is None
    assert find_checkpoint(str(tmp_path)) == (4, [])
    damage(newest)
    iteration, problems = find_checkpoint(str(tmp_path))
    assert iteration == 2
    assert len(problems) == 1 and problems[0].startswith(newest + ": ")
    assert re.search(problem, problems[0]), problems[0]
    candidate = find_resume(CheckpointConfig(), str(tmp_path))
    assert candidate.iteration == 2 and candidate.own and candidate.problems == tuple(problems)


def test_garbage_or_missing_tracker_takes_the_newest_intact_checkpoint(tmp_path):
    _fake_checkpoint(tmp_path, 2)
    _fake_checkpoint(tmp_path, 4)
    (tmp_path / TRACKER).write_bytes(b"\x00\x17garbage")
    iteration, problems = find_checkpoint(str(tmp_path))
    assert iteration == 4 and "expected an iteration number" in problems[0]
    os.remove(tmp_path / TRACKER)
    assert find_checkpoint(str(tmp_path)) == (4, [])


def test_unfinished_newer_save_is_ignored_and_no_intact_checkpoint_is_an_error(tmp_path):
    path = _fake_checkpoint(tmp_path, 2)
    os.makedirs(checkpointing.checkpoint_path(str(tmp_path), 3))  # a save that crashed
    assert find_checkpoint(str(tmp_path)) == (2, [])
    _truncate(path)
    with pytest.raises(CheckpointError, match=r"no intact checkpoint in .*\n  .*iter_0000002: "):
        find_resume(CheckpointConfig(), str(tmp_path))


def test_save_failure_names_the_last_good_checkpoint(tmp_path, monkeypatch):
    """A save that fails (here: as on a full disk) raises CheckpointError with the free space
    and the last complete checkpoint, and leaves no partial folder."""
    from megatron.core import dist_checkpointing

    (tmp_path / TRACKER).write_text("2")

    def full_disk(sd, path, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(dist_checkpointing, "save", full_disk)
    monkeypatch.setattr(checkpointing, "_sharded_state_dict", lambda *a, **k: {})
    monkeypatch.setattr(checkpointing, "_parallel_layout", lambda: {})

    class Scheduler:
        def state_dict(self):
            return {}

    with pytest.raises(CheckpointError) as e:
        checkpointing.save_checkpoint(
            str(tmp_path), 4, [], None, Scheduler(), consumed_samples=0, config={}
        )
    msg = str(e.value)
    assert "saving checkpoint" in msg and "iter_0000004 failed (RuntimeError:" in msg
    assert "Free space there:" in msg and "iter_0000002" in msg
    assert not os.path.exists(checkpointing.checkpoint_path(str(tmp_path), 4))
    assert (tmp_path / TRACKER).read_text() == "2"


def _locate(cfg):
    """What the trainer decides on rank 0 before building anything (no Megatron needed)."""
    from types import SimpleNamespace

    from megatron_s2.training.trainer import Trainer

    return Trainer._locate_checkpoint(SimpleNamespace(cfg=cfg))


def test_a_new_run_is_refused_over_a_previous_one(tmp_path):
    run = tmp_path / "r"
    os.makedirs(run / "checkpoints")
    args = [f"logging.run_dir={run}"]
    assert _locate(load_config(None, args)) == (None, None, None)  # fresh: a new run

    _fake_checkpoint(run / "checkpoints", 4)
    candidate, saved, vocab = _locate(load_config(None, args))
    assert candidate.own and candidate.iteration == 4 and saved == {"name": "x"}
    with pytest.raises(RunDirError, match=r"holds a previous run \(checkpoints in .*\) and "):
        _locate(load_config(None, [*args, "checkpoint.resume=false"]))

    # Another run's weights (load_dir) start a new run only in a directory without a run.
    other = tmp_path / "other"
    os.makedirs(other)
    _fake_checkpoint(other, 6)
    fresh = [f"logging.run_dir={tmp_path / 'fresh'}", f"checkpoint.load_dir={other}"]
    assert not _locate(load_config(None, fresh))[0].own
    shutil.rmtree(run / "checkpoints")
    (run / "metrics.jsonl").write_text('{"kind": "train", "iteration": 1, "loss": 5.0}\n')
    with pytest.raises(RunDirError, match="but no checkpoint of its own to resume from"):
        _locate(load_config(None, [*args, f"checkpoint.load_dir={other}"]))


def test_a_load_dir_without_a_checkpoint_is_refused(tmp_path):
    """checkpoint.load_dir names another run's weights: where none are (that run failed or
    never ran, e.g. an extension whose base was not trained), the run is refused before
    anything is built instead of starting from random weights; with a checkpoint of its own
    (a resume) the load_dir is not needed."""
    from megatron_s2.training.errors import CheckpointError

    for missing in (tmp_path / "absent", tmp_path / "empty"):
        if missing.name == "empty":
            os.makedirs(missing)
        args = [f"logging.run_dir={tmp_path / 'ext'}", f"checkpoint.load_dir={missing}"]
        with pytest.raises(CheckpointError, match="holds no checkpoint .*random weights"):
            _locate(load_config(None, args))
    assert not (tmp_path / "ext").exists()  # nothing written
    # Its own checkpoint: a resume, load_dir or not.
    _fake_checkpoint(tmp_path / "ext" / "checkpoints", 3)
    candidate, _, _ = _locate(load_config(None, args))
    assert candidate.own and candidate.iteration == 3
    # checkpoint.resume=false loads nothing at all: not refused for the missing weights.
    fresh = [f"logging.run_dir={tmp_path / 'new'}", f"checkpoint.load_dir={tmp_path / 'absent'}"]
    assert _locate(load_config(None, [*fresh, "checkpoint.resume=false"])) == (None, None, None)


# ---------------------------------------------------------------------------- the summary
def test_summary_quotes_the_losses_metrics_jsonl_holds(tmp_path, capsys):
    """Across a resume, and with records every 10 iterations, the summary's first and last
    losses are records of metrics.jsonl (what the plot shows)."""
    from megatron_s2.training.trainer import RunResult, write_summary

    records = [(1, 5.8), (10, 4.0), (20, 3.0), (25, 2.9)]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for it, loss in records:
            f.write(json.dumps({"kind": "train", "iteration": it, "loss": loss}) + "\n")
        f.write(json.dumps({"kind": "valid", "iteration": 20, "loss": 3.1}) + "\n")
    # This process resumed at 20: it saw iterations 21-25 only.
    result = RunResult(
        iteration=25,
        losses={i: 9.0 for i in range(21, 26)},
        valid_losses={},
        stopped_by="done",
        tokens_per_s=1.0,
        tflops_per_gpu=0.0,
        run_dir=str(tmp_path),
        last_checkpoint=None,
        resumed_from="ckpt/iter_0000020",
    )
    write_summary(result, "x", plot=False)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["first_loss"], summary["first_loss_iteration"]) == (5.8, 1)
    assert (summary["final_loss"], summary["final_loss_iteration"]) == (2.9, 25)
    assert (summary["final_valid_loss"], summary["final_valid_iteration"]) == (3.1, 20)
    out = capsys.readouterr().out
    assert "5.8000 (iter 1) -> 2.9000 (iter 25)" in out and "this session" in out
    # No GPU here: the speed is a CPU process's, not a GPU's.
    assert "model TFLOP/s per process (CPU mode)" in out and "per GPU" not in out


def test_on_rank0_passes_results_and_errors_without_a_process_group():
    assert run_dir.on_rank0(lambda: 3) == 3
    with pytest.raises(RunDirError, match="boom"):
        run_dir.on_rank0(lambda: (_ for _ in ()).throw(RunDirError("boom")))
