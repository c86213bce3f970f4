"""``python -m megatron_s2.training`` = ``megatron-s2-train``."""

import sys

from .cli import main

if __name__ == "__main__":  # torch_dist checkpoint saving spawns processes: keep this guard
    sys.exit(main())
