#!/usr/bin/env python3
"""Generate the synthetic key-value recall demo corpus and its byte-level indexed dataset.

    python tools/make_demo_corpus.py --data-dir data/demo --seed 0

Prints the dataset prefix to pass as the trainer's data path. The trainer's built-in demo calls
``megatron_s2.training.demo_corpus.ensure_demo_data`` itself, so running this is optional.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_s2.training.demo_corpus import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
