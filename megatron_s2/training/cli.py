"""Command line of the trainer.

    megatron-s2-train [--config RUN.yaml] [key.sub=value ...]
    python -m megatron_s2.training ...                 (same)
    torchrun --nproc-per-node N -m megatron_s2.training --config RUN.yaml

Without ``--config`` it runs the built-in demo (``configs/demo.yaml``): it generates a synthetic
corpus, trains a tiny S2 hybrid and prints a summary. See ``docs/training.md``.

Exit codes: 0 done, nothing to do, or stopped by SIGTERM / Ctrl-C after saving; 2 config error
(including settings a resume cannot change); 3 NaN/inf stop; 4 run directory or checkpoint
problem (in use by a live run, holds a previous run, not writable, too little space, no intact
checkpoint, a save that failed); 130 aborted by a second Ctrl-C (or Ctrl-C during setup).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

# torch, Megatron and the trainer are imported once the config has loaded: a typo in a key or a
# value is reported in a fraction of a second instead of after ~5 s of imports (also per rank
# under torchrun, and for every config-error check in the CPU tests).
from .errors import CheckpointError, NonFiniteLossError, RunDirError
from .known_warnings import quiet_known_warnings
from .run_config import ConfigError, load_config

__all__ = [
    "main",
    "build_arg_parser",
    "EXIT_OK",
    "EXIT_CONFIG_ERROR",
    "EXIT_NAN",
    "EXIT_RUN_DIR",
    "EXIT_INTERRUPTED",
]

# A NaN stop differs from a crash (1) so that launchers can tell them apart.
EXIT_OK = 0
EXIT_CONFIG_ERROR = 2
EXIT_NAN = 3
EXIT_RUN_DIR = 4
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention

PROG = "megatron-s2-train"


# --help's example overrides; a test checks the demo accepts them.
HELP_EXAMPLE = (
    "name=short",
    "train.train_iters=50",
    "optimizer.lr=1e-3",
    "attention.s2.vert_stride=2",
)


def build_arg_parser() -> argparse.ArgumentParser:
    """The argument parser of ``megatron-s2-train``."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Pretrain an S2 hybrid GPT with Megatron-core. Without --config: the built-in "
        "demo.",
        epilog=f"Overrides: any config key as key.sub=value, e.g. {' '.join(HELP_EXAMPLE)}",
    )
    p.add_argument(
        "--config", "-c", default=None, help="run config YAML (default: configs/demo.yaml)"
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="check the config as the trainer would (at the launcher's world size) and print it "
        "resolved; a config error exits 2",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="start over: move a previous run in the run directory aside to "
        "<run_dir>.old-<time> (an external checkpoint.dir likewise) and train from scratch",
    )
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """Console entry point; returns the process exit code."""
    # Options may come after the overrides (`megatron-s2-train train.train_iters=9 --restart`).
    args = build_arg_parser().parse_intermixed_args(argv)
    quiet_known_warnings()
    # Megatron logs every parameter and its whole config at INFO; the trainer prints its own
    # summary.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        from .trainer import check_config, train

        if args.print_config:
            import yaml

            # A config the trainer would refuse is refused here too (exit 2), not printed.
            check_config(cfg)
            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            return EXIT_OK
        train(cfg, restart=args.restart)
        return EXIT_OK
    except ConfigError as e:
        print(f"{PROG}: config error: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG_ERROR
    except NonFiniteLossError as e:
        print(f"{PROG}: {e}", file=sys.stderr, flush=True)
        return EXIT_NAN
    except (RunDirError, CheckpointError) as e:
        print(f"{PROG}: {e}", file=sys.stderr, flush=True)
        return EXIT_RUN_DIR
    except KeyboardInterrupt:
        # Ctrl-C during setup, or a second Ctrl-C: no traceback; the tracker still names the
        # last complete checkpoint.
        print(
            f"\n{PROG}: interrupted; no checkpoint was saved now (a resume starts from the last "
            f"complete one)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_INTERRUPTED
    finally:
        torch = sys.modules.get("torch")  # not imported: no process group to take down
        if torch is not None and torch.distributed.is_initialized():
            # Megatron's groups too: a caller that runs main() again in this process (a sweep, a
            # test, a notebook) must not find groups of the world destroyed here.
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()


if __name__ == "__main__":  # torch_dist checkpoint saving spawns processes: keep this guard
    sys.exit(main())
