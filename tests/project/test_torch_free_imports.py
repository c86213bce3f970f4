"""The sweep's, the run config's and the statistics' modules import without torch or Megatron.

``megatron-s2-sweep collect`` (and the sweep's ``--help``), the config checks and the tables
in ``tools/`` run in processes that train nothing; importing torch costs them about 2.5 s each
(more than the rest of their work), and the study scripts start several such processes a run.
The trainer's command line loads the run config before it imports the trainer, so ``--help``
and a config that fails to load (an unknown key, a value of the wrong type) answer in a
fraction of a second. The package keeps torch and Megatron behind the first call that needs
them: ``megatron_s2``'s names load lazily, ``flash_attention4`` and ``run_dir`` import torch
inside their functions.
"""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.megatron import REPO

# The modules of the command-line tools that never touch a tensor.
TORCH_FREE = (
    "megatron_s2",
    "megatron_s2.parallel_lengths",
    "megatron_s2.flash_attention4",
    "megatron_s2.config_hints",
    "megatron_s2.training.run_config",
    "megatron_s2.training.run_dir",
    "megatron_s2.training.cli",
    "megatron_s2.training.errors",
    "megatron_s2.training.sweep",
    "megatron_s2.training.seed_stats",
    "megatron_s2.training.metrics",
    "megatron_s2.training.evaluation.retrieval_stats",
)


def _python(code: str) -> str:
    """``python -c code`` in a fresh interpreter (the checkout's root as cwd): its stdout."""
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _loaded_after(modules, *, probe=("torch", "megatron", "triton", "s2attn")) -> list[str]:
    code = (
        "import importlib, sys\n"
        f"for m in {list(modules)!r}: importlib.import_module(m)\n"
        f"print(','.join(p for p in {list(probe)!r} if p in sys.modules))\n"
    )
    return [p for p in _python(code).split(",") if p]


def test_the_sweep_and_config_modules_import_without_torch_or_megatron():
    assert _loaded_after(TORCH_FREE) == []


def test_the_plugins_names_still_load_on_first_use():
    # The probe itself: a name that needs torch does load it (the lazy names are not broken).
    code = (
        "import sys, megatron_s2\n"
        "from megatron_s2 import AttentionSchedule, ScheduleError, SCHEDULE_ENV_VAR\n"
        "assert SCHEDULE_ENV_VAR == 'MEGATRON_S2_SCHEDULE'\n"
        "assert issubclass(ScheduleError, Exception)\n"
        "assert AttentionSchedule.__module__ == 'megatron_s2.schedule'\n"
        "print('torch' in sys.modules)\n"
    )
    assert _python(code) == "True"


def test_the_trainer_reports_a_config_that_fails_to_load_before_importing_torch():
    # An unknown key (the colon hint's path too) and a value of the wrong type: exit 2 with the
    # message, and nothing heavy imported; a loadable config does go on to import the trainer.
    code = (
        "import sys\n"
        "from megatron_s2.training.cli import EXIT_CONFIG_ERROR, main\n"
        "for bad in ('train.bogus=1', 'train={seed:3}', 'train.train_iters=abc'):\n"
        "    assert main(['--config', 'configs/demo.yaml', bad]) == EXIT_CONFIG_ERROR, bad\n"
        "print(','.join(p for p in ('torch', 'megatron', 's2attn') if p in sys.modules))\n"
    )
    assert _python(code) == ""
    code = (
        "import sys\n"
        "from megatron_s2.training.cli import main\n"
        "assert main(['--config', 'configs/demo.yaml', '--print-config']) == 0\n"
        "print('torch' in sys.modules)\n"
    )
    assert _python(code).splitlines()[-1] == "True"  # after the printed config
