#!/usr/bin/env python3
"""Long-context evaluation of a trained run: passkey / needle retrieval over context lengths x
needle depths (markdown table, heatmap PNG) and the loss by token position (JSON, PNG).

    python tools/eval_long_context.py --checkpoint runs/demo/checkpoints
    torchrun --nproc-per-node 8 tools/eval_long_context.py --config RUN.yaml --lengths 131072

Same as the console script ``megatron-s2-eval-long-context``; see docs/long_context_eval.md.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_s2.training.evaluation.long_context import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
