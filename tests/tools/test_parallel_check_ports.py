"""Port choice for the CPU parallel checks: CI once failed a whole layout group with EADDRINUSE,
the port found free having been taken before rank 0's store bound it. tools/gpu_parallel_check
relaunches such a group on a new port (up to three launches) and raises anything else at once;
the tests' free_port draws from a slice of its own per xdist worker, below the ephemeral range."""

import os
import socket

import pytest

from tests.helpers.megatron import free_port, import_tool

PORT_ERROR = (
    "torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
    "network address. port: 34135, useIpv6: false, code: -98, name: EADDRINUSE, message: "
    "address already in use"
)


class FakeSpawn:
    """Stands in for torch.multiprocessing.spawn: each launch writes the given rank error (or
    none) into the workdir as a failing rank does, then raises; ``None`` is a clean launch."""

    def __init__(self, workdir, outcomes):
        self.workdir, self.outcomes, self.ports = workdir, list(outcomes), []

    def __call__(self, fn, args, nprocs, join):
        self.ports.append(args[1])
        # Earlier launches' error files must be gone before this one starts.
        assert not [f for f in os.listdir(self.workdir) if ".error." in f]
        outcome = self.outcomes.pop(0)
        if outcome is None:
            return None
        with open(os.path.join(self.workdir, "init.error.0"), "w") as f:
            f.write(outcome)
        raise RuntimeError("process 0 terminated with exit code 1")


@pytest.fixture
def tool():
    return import_tool()


def _run(tool, monkeypatch, tmp_path, outcomes):
    import torch.multiprocessing as mp

    spawn = FakeSpawn(str(tmp_path), outcomes)
    monkeypatch.setattr(mp, "spawn", spawn)
    layouts = [layout for layout in tool.GPU_LAYOUTS if layout.name == "tp2"]
    cc = tool.CheckConfig.tiny_cpu()
    return spawn, lambda: tool.run_layouts(cc, layouts, str(tmp_path))


def test_taken_port_is_retried_on_a_new_launch(tool, monkeypatch, tmp_path):
    spawn, run = _run(tool, monkeypatch, tmp_path, [PORT_ERROR, PORT_ERROR, None])
    run()
    assert len(spawn.ports) == 3 and not spawn.outcomes


def test_port_taken_three_times_is_raised_with_the_ranks_error(tool, monkeypatch, tmp_path):
    spawn, run = _run(tool, monkeypatch, tmp_path, [PORT_ERROR] * 3)
    with pytest.raises(RuntimeError, match="EADDRINUSE") as e:
        run()
    assert "['tp2'] failed" in str(e.value)
    assert len(spawn.ports) == 3


def test_other_failures_are_not_retried(tool, monkeypatch, tmp_path):
    spawn, run = _run(tool, monkeypatch, tmp_path, ["AssertionError: loss mismatch", None])
    with pytest.raises(RuntimeError, match="loss mismatch"):
        run()
    assert len(spawn.ports) == 1


@pytest.mark.parametrize("worker,low", [("gw0", 12000), ("gw1", 14000), ("gw3", 18000)])
def test_free_port_is_in_the_workers_slice_and_bindable(monkeypatch, worker, low):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    for _ in range(5):
        port = free_port()
        assert low <= port < low + 2000
        assert port < 32768  # below Linux's default ephemeral range
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_port_skips_a_port_in_use(monkeypatch):
    """With every port of the slice but one held, free_port finds that one."""
    import tests.helpers.megatron as helpers

    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw5")
    monkeypatch.setattr(helpers, "_PORT_SLICE", 64)
    low = 12000 + 5 * 64  # the slices shrink with it
    held = []
    try:
        for port in range(low, low + 64):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
        free = held.pop(7)
        expect = free.getsockname()[1]
        free.close()
        assert free_port() == expect
    finally:
        for s in held:
            s.close()
