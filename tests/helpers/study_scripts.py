"""The stand-in sweeps of the study scripts' tests (tests/tools/test_run_code_study.py,
test_run_extension_example.py): what ``megatron-s2-sweep run ... --after CMD`` does after its
points, with the sweep's own field substitution, so that the scripts' --after commands run as
the real sweep would run them."""

from __future__ import annotations

import os
import subprocess

from megatron_s2.training.sweep import EXIT_AFTER_FAILED, Point, after_command, check_after


def run_after(args: list, run_dirs: list) -> int:
    """Run the ``--after`` command of the sweep arguments ``args`` for each of ``run_dirs`` (the
    finished points, in order), one after another, the way the sweep does: through bash, the
    fields replaced by :func:`after_command`, with ``CUDA_VISIBLE_DEVICES`` the point's slot
    (point i: the i-th id of ``--devices``, round robin; unset without ``--devices``). Returns
    the sweep's exit code: 0, or ``EXIT_AFTER_FAILED`` if a command failed. Does nothing without
    ``--after``, or with ``FAKE_NO_AFTER`` set: a sweep of before ``--after``, or runs trained
    before the script passed it."""
    if "--after" not in args or os.environ.get("FAKE_NO_AFTER"):
        return 0
    template = args[args.index("--after") + 1]
    check_after(template)
    ids = args[args.index("--devices") + 1].split(",") if "--devices" in args else []
    code = 0
    for i, run in enumerate(run_dirs):
        run = os.path.abspath(run)  # the sweep's run directories are absolute
        env = dict(os.environ)
        if ids:
            env["CUDA_VISIBLE_DEVICES"] = ids[i % len(ids)]
        point = Point(i, os.path.basename(run), {}, run_dir=run)
        if subprocess.run(["bash", "-c", after_command(template, point)], env=env).returncode:
            code = EXIT_AFTER_FAILED
    return code
