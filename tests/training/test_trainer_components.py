"""The trainer's components decide for themselves when they act (no training, no Megatron run)."""

import os
import signal

import pytest

from megatron_s2.training import checkpointing
from megatron_s2.training.checkpointing import Checkpointer, checkpoint_path
from megatron_s2.training.evaluation.validation import Evaluator
from megatron_s2.training.metrics import MetricsLogger, ThroughputMeter
from megatron_s2.training.preemption import Preemption
from megatron_s2.training.run_config import CheckpointConfig, LoggingConfig, TrainConfig


def _when(decide, last=30):
    return [i for i in range(1, last + 1) if decide(i)]


def test_logger_logs_first_every_interval_and_last_iteration(tmp_path):
    log = MetricsLogger.from_config(
        LoggingConfig(log_interval=10), str(tmp_path / "x"), 25, 0, enabled=False
    )
    # Iteration 1 too: the summary quotes the first loss, which metrics.jsonl must hold.
    assert _when(log.should_log, 25) == [1, 10, 20, 25]
    assert _when(MetricsLogger(str(tmp_path), 3, 0, enabled=False).should_log, 3) == [1, 2, 3]


def test_evaluator_runs_every_interval_and_at_the_end_when_it_has_data():
    def evaluator(dataset="valid", **kw):
        train = TrainConfig(**{"train_iters": 12, "eval_interval": 5, "eval_iters": 2, **kw})
        return Evaluator(train, dataset, forward_backward=None, dp_rank=0, dp_size=1)

    assert _when(evaluator().should_run, 12) == [5, 10, 12]
    assert _when(evaluator(dataset=None).should_run) == []
    assert _when(evaluator(eval_iters=0).should_run) == []
    assert _when(evaluator(eval_interval=0).should_run) == []


@pytest.fixture
def fake_checkpoint_io(monkeypatch):
    """save/load without Megatron: saves are recorded, loads read the tracker's iteration."""
    saved = []

    def save(root, iteration, *args, **kwargs):
        saved.append(iteration)
        return checkpoint_path(root, iteration)

    def load(root, *args, **kwargs):
        it = checkpointing.latest_iteration(root)
        return it, 4 * it

    monkeypatch.setattr(checkpointing, "save_checkpoint", save)
    monkeypatch.setattr(checkpointing, "load_checkpoint", load)
    monkeypatch.setattr(checkpointing, "verify_checkpoint", lambda path: None)
    return saved


def _checkpointer(directory, **kw):
    return Checkpointer(
        CheckpointConfig(**kw),
        str(directory),
        model=[],
        optimizer=None,
        scheduler=None,
        run_config={},
    )


def _write_tracker(directory, iteration):
    os.makedirs(directory, exist_ok=True)
    (directory / checkpointing.TRACKER).write_text(str(iteration))


def test_checkpointer_save_interval_and_end(tmp_path, fake_checkpoint_io):
    ckpt = _checkpointer(tmp_path / "c", save_interval=4)
    assert ckpt.load() is None
    assert _when(ckpt.should_save, 10) == [4, 8]
    assert _when(_checkpointer(tmp_path / "c").should_save, 10) == []
    # Nothing trained yet: nothing to save at the end.
    assert not ckpt.should_save_at_end(0)
    assert ckpt.should_save_at_end(10)
    ckpt.save(10, consumed_samples=40)
    assert ckpt.last_checkpoint == checkpoint_path(str(tmp_path / "c"), 10)
    assert not ckpt.should_save_at_end(10)  # already saved by the interval
    assert not _checkpointer(tmp_path / "c", save_at_end=False).should_save_at_end(10)
    assert fake_checkpoint_io == [10]


def test_checkpointer_resumes_own_checkpoints_before_load_dir(tmp_path, fake_checkpoint_io):
    own, other = tmp_path / "own", tmp_path / "other"
    _write_tracker(other, 6)
    ckpt = _checkpointer(own, load_dir=str(other))
    point = ckpt.load()
    assert (point.iteration, point.consumed_samples) == (6, 24)
    assert point.path == checkpoint_path(str(other), 6)
    # Resumed and finished at once (iteration 6 >= train_iters): no copy into the own directory.
    assert not ckpt.should_save_at_end(6)
    assert ckpt.should_save_at_end(7)
    _write_tracker(own, 9)
    assert _checkpointer(own, load_dir=str(other)).load().iteration == 9
    assert _checkpointer(own, resume=False).load() is None


def test_preemption_simulated_and_real_sigterm():
    hook = Preemption(simulate_at=3)
    assert [hook.requested(i) for i in (1, 2, 3, 4)] == [False, False, True, True]
    assert hook.signal == "sigterm"
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    real = Preemption()
    real.install()
    try:
        assert not real.requested(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert real.requested(2) and real.signal == "sigterm"
    finally:
        real.uninstall()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_preemption_ctrl_c_stops_gracefully_then_aborts(capsys):
    """The first SIGINT only sets the flag (like SIGTERM); the second raises KeyboardInterrupt."""
    # As in a terminal: under a runner that started pytest as a background job SIGINT arrives
    # ignored, and install() rightly leaves it so (the next test).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    p = Preemption()
    p.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert p.requested(5) and p.signal == "sigint"
        assert "Ctrl-C again to abort" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        p.uninstall()
        restored = signal.signal(signal.SIGINT, before)
    assert restored is signal.default_int_handler


def test_preemption_leaves_an_ignored_sigint_ignored():
    """A shell's background job ignores SIGINT: Ctrl-C in the terminal is not meant for it."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        p = Preemption()
        p.install()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        p.uninstall()
    finally:
        signal.signal(signal.SIGINT, before)


def test_throughput_leaves_out_pauses_and_the_warm_up_window():
    now = [0.0]
    meter = ThroughputMeter(
        tokens_per_iteration=100, flops_per_iteration=4e12, world_size=2, clock=lambda: now[0]
    )
    meter.start()
    # Window 1 (warm-up): 2 iterations in 10 s.
    for _ in range(2):
        now[0] += 5.0
        meter.step()
    first = meter.close_window()
    assert first.seconds_per_iteration == 5.0 and first.tokens_per_s == 20.0
    # Window 2: 2 iterations of 1 s around a 100 s evaluation that does not count.
    now[0] += 1.0
    meter.step()
    with meter.paused():
        now[0] += 100.0
    now[0] += 1.0
    meter.step()
    second = meter.close_window()
    assert second.seconds_per_iteration == 1.0
    assert second.tflops_per_gpu == pytest.approx(2.0)
    # A SIGTERM stop between records: its iteration counts in the run's mean, the save not.
    now[0] += 2.0
    meter.step()
    with meter.paused():
        now[0] += 50.0
    meter.finish()
    mean = meter.mean()
    assert mean.seconds_per_iteration == pytest.approx(4.0 / 3)
    assert mean.tokens_per_s == pytest.approx(75.0)


def test_throughput_without_iterations_is_zero():
    meter = ThroughputMeter(100, 1e12, 1, clock=lambda: 0.0)
    meter.finish()
    assert meter.mean().tokens_per_s == 0.0


def test_coverage_note_names_a_schedule_with_holes_beyond_the_training_length():
    from megatron_s2.training.run_config import RunConfig
    from megatron_s2.training.trainer import coverage_beyond_length_note

    def cfg(vert_stride, **attention):
        s2 = {"block_size": 16, "local_blocks": 16, "vert_stride": vert_stride}
        model = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 256}
        return RunConfig.from_dict(
            {
                "model": model,
                "data": {"demo": True},
                "attention": {"dense_layers": {"pattern": "DS"}, "s2": s2, **attention},
            }
        )

    # 4 heads, a stripe every 8th block: 4 of the 8 phases. The 16-block window spans all 256
    # tokens, so the run is valid, and the note says what fails later.
    note = coverage_beyond_length_note(cfg(8))
    assert "256 tokens" in note and "megatron-s2-hf export" in note
    assert "4 of every 8 key blocks unseen" in note
    # A stride of at most the heads covers every block at any length; holes declared intended
    # are not noted either.
    assert coverage_beyond_length_note(cfg(4)) == ""
    assert coverage_beyond_length_note(cfg(8, allow_coverage_holes=True)) == ""
