#!/usr/bin/env python3
"""Build the code corpus: this machine's Python sources and docs -> tokenizer + indexed datasets.

Examples:
    python tools/build_code_corpus.py --out data/code                  # stdlib + site-packages
    python tools/build_code_corpus.py --out data/code-stdlib --root stdlib --vocab-size 8192

Writes OUT/manifest.jsonl, OUT/tokenizer/, OUT/{train,valid,train_valid}.{bin,idx,meta.json} and
OUT/corpus.json (sizes and the data.* overrides to train on it). Needs `tokenizers` and
megatron-core, not HF `datasets`. See docs/code_corpus.md and
``megatron_s2.training.code_corpus``.
"""

import os
import sys

# Runnable from a checkout without installing the package.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_s2.training.code_corpus import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
