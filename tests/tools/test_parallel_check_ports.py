"""Port choice for the CPU parallel checks: CI once failed a whole layout group with EADDRINUSE,
the port found free having been taken before rank 0's store bound it. tools/gpu_parallel_check
relaunches such a group on a new port (up to three launches) and raises anything else at once;
the tests' free_port draws from a slice of its own per xdist worker, below the ephemeral range
and clear of the Slurm launcher's rendezvous ports."""

import os
import socket

import pytest

import tests.helpers.megatron as helpers
from tests.helpers.megatron import free_port, import_tool

PORT_ERROR = (
    "torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
    "network address. port: 34135, useIpv6: false, code: -98, name: EADDRINUSE, message: "
    "address already in use"
)
PY_PORT_ERROR = "OSError: [Errno 98] Address already in use"


class FakeSpawn:
    """Stands in for torch.multiprocessing.spawn: each launch writes the given rank error file
    (``(name, text)``: ``init`` for a start-up failure, a layout's name for one inside it) as a
    failing rank does, then raises; ``None`` is a clean launch."""

    def __init__(self, workdir, outcomes):
        self.workdir, self.outcomes, self.ports = workdir, list(outcomes), []

    def __call__(self, fn, args, nprocs, join):
        self.ports.append(args[1])
        # This group's earlier launches' error files must be gone before this one starts.
        assert not [f for f in os.listdir(self.workdir) if f.startswith(("init.", "tp2."))]
        outcome = self.outcomes.pop(0)
        if outcome is None:
            return None
        name, text = outcome
        with open(os.path.join(self.workdir, f"{name}.error.0"), "w") as f:
            f.write(text)
        raise RuntimeError("process 0 terminated with exit code 1")


@pytest.fixture
def tool(monkeypatch):
    module = import_tool()
    ports = iter(range(20000, 20010))  # a new one per launch, to see that each gets its own
    monkeypatch.setattr(module, "_free_port", lambda: next(ports))
    return module


def _run(tool, monkeypatch, tmp_path, outcomes):
    import torch.multiprocessing as mp

    spawn = FakeSpawn(str(tmp_path), outcomes)
    monkeypatch.setattr(mp, "spawn", spawn)
    layouts = [layout for layout in tool.GPU_LAYOUTS if layout.name == "tp2"]
    cc = tool.CheckConfig.tiny_cpu()
    return spawn, lambda: tool.run_layouts(cc, layouts, str(tmp_path))


@pytest.mark.parametrize("message", [PORT_ERROR, PY_PORT_ERROR])
def test_taken_port_at_start_up_is_relaunched_on_a_new_port(tool, monkeypatch, tmp_path, message):
    (tmp_path / "cp2.error.0").write_text("another group's")  # not this launch's: kept
    spawn, run = _run(tool, monkeypatch, tmp_path, [("init", message)] * 2 + [None])
    run()
    assert spawn.ports == [20000, 20001, 20002] and not spawn.outcomes
    assert (tmp_path / "cp2.error.0").read_text() == "another group's"


def test_port_taken_three_times_is_raised_with_the_ranks_error(tool, monkeypatch, tmp_path):
    (tmp_path / "cp2.error.0").write_text("another group's")
    spawn, run = _run(tool, monkeypatch, tmp_path, [("init", PORT_ERROR)] * 3)
    with pytest.raises(RuntimeError, match="EADDRINUSE") as e:
        run()
    assert "['tp2'] failed (launch 3; the earlier ones' port was taken)" in str(e.value)
    assert "another group's" not in str(e.value)
    assert len(spawn.ports) == 3


@pytest.mark.parametrize(
    "outcome",
    [
        ("init", "AssertionError: loss mismatch"),
        # The port error inside a layout (after start-up) is that layout's failure: raised.
        ("tp2", PORT_ERROR),
    ],
)
def test_other_failures_are_not_relaunched(tool, monkeypatch, tmp_path, outcome):
    spawn, run = _run(tool, monkeypatch, tmp_path, [outcome, None])
    with pytest.raises(RuntimeError, match="loss mismatch|EADDRINUSE") as e:
        run()
    assert "['tp2'] failed:" in str(e.value)
    assert len(spawn.ports) == 1


@pytest.mark.parametrize(
    "worker,count,low,size",
    [
        ("gw0", 2, 5000, 5000),
        ("gw1", 2, 10000, 5000),
        ("gw3", 4, 12500, 2500),
        ("gw11", 12, 14163, 833),
    ],
)
def test_free_port_is_in_the_workers_slice_and_bindable(monkeypatch, worker, count, low, size):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
    for _ in range(5):
        port = free_port()
        assert low <= port < low + size
        # Below Linux's default ephemeral range and launch/slurm.sbatch's 15000-29999.
        assert port < 15000
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_port_without_xdist_uses_the_whole_range(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert helpers._port_slice() == range(5000, 15000)


def test_free_port_skips_ports_in_use(monkeypatch):
    """With every port of a 64-port slice but one held, free_port finds that one. The slice is
    the first 64 ports of this worker's own, so no other worker's ports are held."""
    own = helpers._port_slice()
    small = range(own.start, own.start + 64)
    monkeypatch.setattr(helpers, "_port_slice", lambda: small)
    held = []
    try:
        for port in small:
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
