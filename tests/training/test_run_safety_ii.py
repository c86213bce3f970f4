"""Run safety II (issue 53): what a new user still tripped on.

Another run's ``checkpoint.dir``; ``name=.``/``..``; what the README's test command installs;
Ctrl-C on the sweep; messages that named the wrong cause (file-size limit, too-long names,
``--config DIR``, an empty YAML); the demo's warm-up under ``train.train_iters=N``,
``--print-config`` and ``--help``'s example, duplicate YAML keys, the logged learning rate.
None of them trains a model.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from megatron_s2.training import checkpointing, cli, run_dir, trainer
from megatron_s2.training.errors import RunDirError
from megatron_s2.training.run_config import ConfigError, load_config
from megatron_s2.training.run_dir import acquire_lock, check_writable, open_run_directory
from tests.training.test_run_safety import _fake_checkpoint
from tests.training.test_trainer import _env

REPO = Path(__file__).resolve().parents[2]


def _release(locks):
    for lock in locks:
        lock.release()


# ------------------------------------------------- 3. another run's checkpoint.dir
def _finished_run(root, name="A"):
    """A run directory as a run leaves it: config.yaml, its (released) lock, a checkpoint."""
    os.makedirs(root / "checkpoints")
    (root / "config.yaml").write_text(yaml.safe_dump({"name": name}))
    acquire_lock(str(root)).release()
    _fake_checkpoint(root / "checkpoints", 4)


def _assert_names_the_options(message, checkpoint_dir, owner):
    assert f"checkpoint.dir {checkpoint_dir} belongs to another run" in message
    assert owner in message
    assert f"checkpoint.load_dir={checkpoint_dir}" in message
    assert "--restart" in message and "fresh checkpoint.dir" in message
    assert "name=" not in message  # the name is not what to change


def test_another_runs_checkpoints_folder_is_refused(tmp_path):
    """The issue's case: a new run B given run A's default checkpoint folder would resume A's
    weights and save into A's run directory."""
    a = tmp_path / "runs" / "A"
    _finished_run(a)
    ckpt = str(a / "checkpoints")
    with pytest.raises(RunDirError) as e:
        open_run_directory(str(tmp_path / "runs" / "B"), ckpt, restart=False)
    _assert_names_the_options(str(e.value), ckpt, f"run 'A' in {a}")
    # Nothing was written into A's folder (no lock of B's there).
    assert sorted(os.listdir(ckpt)) == ["iter_0000004", "latest_checkpointed_iteration.txt"]
    # A itself resumes as always.
    _release(open_run_directory(str(a), ckpt, restart=False)[1])


def test_a_lock_of_an_older_version_still_tells_the_run_directory(tmp_path):
    """Run directories locked before lock files named their run: the folder with the lock and
    a config.yaml is the owner."""
    a = tmp_path / "A"
    _finished_run(a)
    (a / run_dir.LOCK_FILE).write_text("pid 1 on host since 2026-01-01T00:00:00\n")
    with pytest.raises(RunDirError, match="belongs to another run"):
        open_run_directory(str(tmp_path / "B"), str(a / "checkpoints"), restart=False)


def test_an_external_checkpoint_dir_belongs_to_the_run_that_claimed_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    a, b = tmp_path / "A", tmp_path / "B"
    _release(open_run_directory(str(a), str(ckpt), restart=False)[1])
    _fake_checkpoint(ckpt, 2)
    with pytest.raises(RunDirError) as e:
        open_run_directory(str(b), str(ckpt), restart=False)
    _assert_names_the_options(str(e.value), str(ckpt), str(a))
    _release(open_run_directory(str(a), str(ckpt), restart=False)[1])  # its own: resumes
    # --restart takes the folder over: A's checkpoints are moved aside, B owns it from then on.
    info, locks = open_run_directory(str(b), str(ckpt), restart=True)
    _release(locks)
    assert str(ckpt) in dict(info.moved_aside)
    _release(open_run_directory(str(b), str(ckpt), restart=False)[1])
    with pytest.raises(RunDirError, match="belongs to another run"):
        open_run_directory(str(a), str(ckpt), restart=False)


def test_checkpoints_without_a_lock_are_told_by_their_stored_config(tmp_path, monkeypatch):
    """An external folder of checkpoints and nothing else: the run config stored in its newest
    checkpoint names the run (``runs/<name>``, as seen from the current directory)."""
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "ckpt"
    os.makedirs(ckpt)
    _fake_checkpoint(ckpt, 4)  # stores the config {"name": "x"}
    stored = {"stored_owner": checkpointing.stored_run_dir}
    with pytest.raises(RunDirError, match=re.escape(str(tmp_path / "runs" / "x"))):
        open_run_directory("runs/B", str(ckpt), restart=False, **stored)
    _release(open_run_directory("runs/x", str(ckpt), restart=False, **stored)[1])


def test_cli_refuses_another_runs_checkpoint_dir_before_any_work(tmp_path):
    """Through the real command line: exit 4, the message, and no run directory for B."""
    a = tmp_path / "runs" / "A"
    _finished_run(a)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_s2.training",
            "name=B",
            "checkpoint.dir=runs/A/checkpoints",
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == cli.EXIT_RUN_DIR, r.stderr[-3000:]
    assert "checkpoint.dir runs/A/checkpoints belongs to another run (run 'A'" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "runs" / "B" / "config.yaml").exists()
    assert not (tmp_path / "data").exists()  # the demo corpus was not generated


def test_the_lock_of_a_checkpoint_dir_names_checkpoint_dir_in_its_hint(tmp_path):
    held = acquire_lock(str(tmp_path / "ckpt"), "checkpoint directory", str(tmp_path / "A"))
    try:
        with pytest.raises(RunDirError, match="in use by a live run") as e:
            acquire_lock(str(tmp_path / "ckpt"), "checkpoint directory")
        assert "another checkpoint.dir=" in str(e.value) and "name=" not in str(e.value)
    finally:
        held.release()


# ------------------------------------------------------------------ 4. name=. and name=..
@pytest.mark.parametrize("name", [".", "..", "a/b", "", "x" * 240])
def test_a_name_that_is_not_one_folder_name_is_refused_at_load(name):
    with pytest.raises(ConfigError, match=r"^name "):
        load_config(None, [f"name={name}"] if name else ["name=''"])


def test_cli_name_dot_dot_is_a_config_error_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(trainer, "train", lambda cfg, restart: pytest.fail("trainer started"))
    assert cli.main(["name=..", "--restart"]) == cli.EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "config error: name must be one folder name" in err and "logging.run_dir" in err
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------- 5. what the test command installs
def test_readme_says_what_the_test_command_installs():
    readme = (REPO / "README.md").read_text()
    command = readme.index('pip install -e ".[test]" && python -m pytest')
    after = readme[command : command + 2500]
    for needed in ("numpy<2.4", "apt-get install", "slurm-wlm", "munge", "root"):
        assert needed in after, needed
    from tests.helpers.slurm_cluster import NO_APT_VARIABLE

    assert f"{NO_APT_VARIABLE}=1" in after


# ----------------------------------------------------------------------- 6. sweep Ctrl-C
FAKE_TRAINER = """
import signal, sys, time
def stop(*_):
    print("fake trainer: Ctrl-C, checkpoint saved", flush=True)
    sys.exit(0)
signal.signal(signal.SIGINT, stop)
print("fake trainer: training", flush=True)
time.sleep(120)
"""

SWEEP_WITH_FAKE_TRAINER = """
import sys
from megatron_s2.training import sweep
def point_command(study, point, *, restart=False, devices=None):
    env = dict(__import__("os").environ, CUDA_VISIBLE_DEVICES=",".join(devices or []))
    return [sys.executable, {trainer!r}], env
sweep.point_command = point_command
sys.exit(sweep.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("devices", [None, "0,1"])
def test_ctrl_c_on_the_sweep_waits_for_the_trainer_and_exits_130(tmp_path, devices):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it): the running point's
    trainer saves and stops, the sweep copies its last lines, starts no further point, prints
    one line and exits 130, without a traceback. With --devices the points run in threads."""
    (tmp_path / "trainer.py").write_text(FAKE_TRAINER)
    script = tmp_path / "sweep.py"
    script.write_text(SWEEP_WITH_FAKE_TRAINER.format(trainer=str(tmp_path / "trainer.py")))
    study = {"name": "s", "output_dir": str(tmp_path / "out")}
    study["grid"] = {"train.seed": [1, 2, 3] if devices is None else [1, 2, 3, 4, 5]}
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    argv = [sys.executable, str(script), "run", str(tmp_path / "study.yaml")]
    proc = subprocess.Popen(
        argv + (["--devices", devices] if devices else []),
        cwd=REPO,
        env=dict(_env(), PYTHONPATH=os.pathsep.join(sys.path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # SIGINT as a terminal's foreground job has it (pytest may run as a background job).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        logs = tmp_path / "out" / "logs"
        running = 1 if devices is None else 2
        deadline = time.time() + 120
        while time.time() < deadline:
            texts = [p.read_text() for p in logs.glob("*.log")] if logs.is_dir() else []
            if sum("fake trainer: training" in t for t in texts) >= running:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines() == [
        "megatron-s2-sweep: interrupted; the running point(s) saved a checkpoint where they "
        "could; run the same command again to resume"
    ]
    texts = [p.read_text() for p in logs.glob("*.log")]
    assert len(texts) == running  # no point started after the Ctrl-C
    assert all("fake trainer: Ctrl-C, checkpoint saved" in t for t in texts), texts


# ------------------------------------------------------- 9. messages naming the right cause
def test_a_too_long_name_is_not_reported_as_permissions(tmp_path):
    with pytest.raises(RunDirError) as e:
        check_writable(str(tmp_path / ("x" * 300)), "run directory")
    message = str(e.value)
    assert "too long" in message and "permission" not in message.lower(), message


FILE_SIZE_LIMIT = """
import resource, sys, torch
from megatron_s2.training import checkpointing
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))
root = sys.argv[1]
try:
    torch.save({"w": torch.zeros(1 << 16)}, root + "/common.pt")  # as a checkpoint's common.pt
except RuntimeError as e:
    error = e
try:
    with open(root + "/shard", "wb") as f:  # as a checkpoint's shard files
        f.write(b"x" * (1 << 17))
except OSError as e:
    shard_error = e
print(checkpointing._save_failed(root, root + "/iter_0000002", error))
print(checkpointing._save_failed(root, root + "/iter_0000002", shard_error))
"""


def test_a_file_size_limit_is_not_reported_as_free_space(tmp_path):
    """``ulimit -f``: torch.save fails with a raw 'unexpected pos', a plain write with EFBIG;
    the save's message names the limit, not the free space."""
    r = subprocess.run(
        [sys.executable, "-c", FILE_SIZE_LIMIT, str(tmp_path)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2, r.stdout
    for line in lines:
        assert "file-size limit (ulimit -f: 64.0 KiB)" in line, line
        assert "Free space" not in line and "unexpected pos" not in line, line


def test_config_directory_and_empty_yaml_get_their_own_messages(tmp_path, capsys):
    with pytest.raises(ConfigError, match="is a directory; give one run config YAML file"):
        load_config(REPO / "configs")
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=r"empty\.yaml is empty") as e:
        load_config(tmp_path / "empty.yaml")
    assert "data.blend is empty" not in str(e.value)
    assert cli.main(["--config", str(tmp_path)]) == cli.EXIT_CONFIG_ERROR
    assert "is a directory" in capsys.readouterr().err


# ------------------------------- 10. short demo runs, --print-config, --help, YAML, the lr
def test_the_demo_runs_short_with_train_iters_alone():
    """The docs' way to a shorter run: the demo's warm-up is a fraction of the run (Megatron's
    --lr-warmup-fraction), so it stays shorter than any run length."""
    assert load_config(None, []).optimizer.warmup_steps(250) == 20  # the demo as before
    for iters in (20, 5, 1):
        cfg = load_config(None, [f"train.train_iters={iters}"])
        assert 0 <= cfg.optimizer.warmup_steps(iters) < iters
    # An explicit warm-up replaces the file's fraction, and is checked against the run.
    assert load_config(None, ["optimizer.lr_warmup_iters=2"]).optimizer.warmup_steps(250) == 2
    with pytest.raises(ConfigError, match=r"optimizer.lr_warmup_iters \(20\) must be smaller"):
        load_config(None, ["train.train_iters=20", "optimizer.lr_warmup_iters=20"])
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, ["optimizer.lr_warmup_iters=2", "optimizer.lr_warmup_fraction=0.1"])
    # checkpoint.on_resume=keep on a checkpoint that set the warm-up in iterations keeps those.
    saved = load_config(None, ["optimizer.lr_warmup_iters=20"]).to_dict()
    kept = load_config(None, []).keeping(saved, ["optimizer.lr_warmup_iters"]).optimizer
    assert (kept.lr_warmup_iters, kept.lr_warmup_fraction) == (20, None)


def test_scheduler_gets_the_fractional_warm_up():
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    cfg = load_config(None, ["train.train_iters=20"])
    o = cfg.optimizer
    opt = SimpleNamespace(param_groups=[{"params": [torch.zeros(1)], "lr": 0.0}])
    s = OptimizerParamScheduler(
        opt, 0.0, o.lr, o.min_lr, o.warmup_steps(20), 20, o.lr_decay_style, 0.0, 0.0, 20, "constant"
    )
    s.step(1)
    assert opt.param_groups[0]["lr"] == pytest.approx(o.lr / 1.6)


@pytest.mark.parametrize(
    "override, error",
    [
        ("attention.s2.vert_stride=16", "key blocks unseen"),
        ("parallel.tensor_model_parallel_size=2", "world size 1 is not divisible"),
    ],
)
def test_print_config_checks_what_the_trainer_checks(override, error, capsys):
    assert cli.main(["--print-config", override]) == cli.EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "config error" in err and error in err
    assert cli.main(["--print-config"]) == cli.EXIT_OK


def test_helps_own_example_is_a_config_the_trainer_takes(capsys):
    epilog = cli.build_arg_parser().epilog
    example = epilog.split("e.g.", 1)[1].split()
    assert example and all("=" in item for item in example)
    cfg = load_config(None, example)
    cfg.schedule()  # what the trainer checks before it starts, on one process
    cfg.validate(world_size=1)
    assert cli.main(["--print-config", *example]) == cli.EXIT_OK, capsys.readouterr().err


def test_duplicate_yaml_keys_are_refused_with_the_key_and_lines(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            name: a
            data: {demo: true}
            train:
              train_iters: 50
              seed: 1
              train_iters: 500
            """
        )
    )
    with pytest.raises(ConfigError, match=r"key 'train_iters' appears twice .*lines 4 and 6"):
        load_config(path)


def test_the_logged_lr_is_the_one_the_step_used(monkeypatch):
    """Megatron's scheduler moves the LR on for the next step right after each step: the record
    of iteration N must hold the LR step N used (0 at the first warm-up step)."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_s2.training import trainer

    opt = SimpleNamespace(
        param_groups=[{"params": [torch.zeros(1)], "lr": 0.0}],
        step=lambda: (True, 1.0, None),
    )
    sched = OptimizerParamScheduler(opt, 0.0, 1.0, 0.1, 2, 10, "linear", 0.0, 0.0, 10, "constant")
    used = []
    monkeypatch.setattr(trainer, "zero_grad", lambda model, optimizer: None)

    def forward_backward(data, poison_loss):
        used.append(opt.param_groups[0]["lr"])
        return SimpleNamespace(loss=1.0)

    fake = SimpleNamespace(
        iteration=0,
        model=[],
        optimizer=opt,
        scheduler=sched,
        train_data=None,
        forward_backward=forward_backward,
        checkpointer=SimpleNamespace(last_checkpoint=None),
        cfg=SimpleNamespace(
            debug=SimpleNamespace(nan_at_iter=None), train=SimpleNamespace(global_batch_size=4)
        ),
        consumed_samples=0,
        losses={},
        throughput=SimpleNamespace(step=lambda: None),
        metrics=SimpleNamespace(advance=lambda *a, **k: None),
    )
    logged = [trainer.Trainer.train_step(fake).lr for _ in range(4)]
    assert logged == pytest.approx(used) and logged == pytest.approx([0.0, 0.5, 1.0, 0.8875])
