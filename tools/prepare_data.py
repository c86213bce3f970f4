#!/usr/bin/env python3
"""Tokenize text into a Megatron indexed dataset (PREFIX.bin / PREFIX.idx).

Examples:
    python tools/prepare_data.py --input data/raw/*.jsonl --output-prefix data/corpus_text_document
    python tools/prepare_data.py --input books.parquet --text-key content \
        --tokenizer /models/llama3/ --workers 16 --output-prefix data/books
    python tools/prepare_data.py --input notes.txt --text-sample-by paragraph -o data/notes
    python tools/prepare_data.py --input scraped.jsonl --skip-missing-text -o data/scraped

Records without the text field are an error naming the file and line unless --skip-missing-text
(then they are skipped and counted); input that is not UTF-8 is named the same way.

See ``megatron_s2.training.preprocess`` for the Python API and ``--help`` for every option.
"""

import os
import sys

# Runnable from a checkout without installing the package.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_s2.training.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
