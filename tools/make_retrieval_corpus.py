#!/usr/bin/env python3
"""Write passkey/needle/multikey retrieval training documents as a Megatron indexed dataset.

    python tools/make_retrieval_corpus.py --tokenizer data/code/tokenizer \
        --output-prefix data/retrieval/retrieval_code_4k --seq-length 4096 \
        --tasks passkey,needle,multikey

Every document one training sample of a 4096-token run, the fact-question distance uniform over
it (--depth-distribution uniform, the default). The held-out task code-value is refused.

See megatron_s2/training/evaluation/retrieval_corpus.py and docs/long_context_eval.md.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_s2.training.evaluation.retrieval_corpus import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
