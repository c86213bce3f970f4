"""Synthetic key-value recall corpus for the built-in demo (no download).

Each document interleaves three kinds of statements:

* definitions ``let qzk=4821;`` binding a fresh three-letter key to a four-digit value,
* filler sentences drawn from a small vocabulary (locally predictable, carry no keys),
* queries ``qzk?4821;`` asking for the value of a key defined *anywhere earlier* in the document.

The digits of a query answer are predictable only by finding the key's definition, which is
often hundreds to thousands of tokens back. A model whose attention cannot reach that far
(or whose sparse pattern misses it) plateaus on those tokens, so S2 vs dense differences show up
in the loss. Documents are generated from ``random.Random(seed)`` and are identical across
platforms and Python versions for a given seed and generator version.

``ensure_demo_data(data_dir, seed=0)`` writes ``kv_recall_v1_seed{seed}.jsonl`` and the byte-level
Megatron indexed dataset next to it, and returns the dataset prefix; it does nothing when an
intact dataset already exists (a damaged one, e.g. truncated by a full disk or an interrupted copy,
is regenerated), and is safe to call from several processes at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shutil
import string
import sys
from collections.abc import Iterator, Sequence
from typing import Optional

__all__ = [
    "generate_document",
    "filler_text",
    "generate_corpus",
    "write_corpus_jsonl",
    "ensure_demo_data",
    "demo_prefix",
    "write_kv_dataset",
    "main",
]

log = logging.getLogger(__name__)

# Bump when the generated text changes, so that stale cached datasets are not reused.
GENERATOR_VERSION = 1
# Documents of the default corpus (~2 MB of text).
DEFAULT_NUM_DOCS = 1200

_WORDS = (
    "the a river stone light slowly under over across quiet green old small bright cold wind "
    "field north south morning evening walks carries holds finds keeps turns near far along "
    "between house road tree hill cloud water fire sound rain path garden window door market "
    "bird song leaf winter summer long short warm dark open closed every some many few"
).split()


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 12))]
    return " ".join(words).capitalize() + "."


def filler_text(min_chars: int, seed: int = 0) -> str:
    """At least ``min_chars`` characters of the corpus's filler sentences alone, one per line
    (no definitions, no queries): the haystack of the ``kv-filler`` retrieval task, text of
    the kind a model trained on this corpus has read around its statements."""
    rng = random.Random(f"kv-filler-v{GENERATOR_VERSION}-{seed}")
    parts, size = [], 0
    while size < min_chars:
        parts.append(_sentence(rng))
        size += len(parts[-1]) + 1
    return "\n".join(parts) + "\n"


def generate_document(rng: random.Random, target_chars: int) -> str:
    """One document of roughly ``target_chars`` characters (see the module docstring)."""
    defined: list[tuple[str, str]] = []
    used = set()
    parts = []
    size = 0
    # Front-load a block of definitions: queries near the end then need the longest reach.
    initial = rng.randint(4, 10)
    while size < target_chars:
        r = rng.random()
        if len(defined) < initial or r < 0.15:
            key = "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
            if key in used:
                continue
            used.add(key)
            value = "".join(rng.choice(string.digits) for _ in range(4))
            defined.append((key, value))
            piece = f"let {key}={value};"
        elif r < 0.55:
            piece = _sentence(rng)
        else:
            key, value = rng.choice(defined)
            piece = f"{key}?{value};"
        parts.append(piece)
        size += len(piece) + 1
    return "\n".join(parts)


def generate_corpus(
    seed: int = 0, num_docs: int = DEFAULT_NUM_DOCS, min_chars: int = 768, max_chars: int = 2560
) -> Iterator[str]:
    """Yield ``num_docs`` documents with lengths drawn uniformly from ``[min_chars, max_chars]``."""
    if num_docs < 1:
        raise ValueError(f"num_docs must be >= 1, got {num_docs}")
    if not 1 <= min_chars <= max_chars:
        raise ValueError(
            f"need 1 <= min_chars <= max_chars, got min_chars={min_chars}, max_chars={max_chars}"
        )
    rng = random.Random(f"kv-recall-v{GENERATOR_VERSION}-{seed}")
    for _ in range(num_docs):
        yield generate_document(rng, rng.randint(min_chars, max_chars))


def write_corpus_jsonl(path: str, seed: int = 0, **kwargs) -> int:
    """Write the corpus as jsonl (``{"id": i, "text": ...}`` per line); return the byte count."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for i, doc in enumerate(generate_corpus(seed=seed, **kwargs)):
            f.write(json.dumps({"id": i, "text": doc}) + "\n")
    os.replace(tmp, path)
    return os.path.getsize(path)


def demo_prefix(data_dir: str | os.PathLike, seed: int = 0) -> str:
    """The indexed-dataset prefix that ``ensure_demo_data`` writes for ``seed``."""
    return os.path.join(
        os.fspath(data_dir), f"kv_recall_v{GENERATOR_VERSION}_seed{seed}_text_document"
    )


@contextlib.contextmanager
def _locked(path: str):
    # Several ranks (or several jobs sharing a data dir) may call ensure_demo_data at once; the
    # first one generates, the rest wait and then find the finished files.
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_demo_data(
    data_dir: str | os.PathLike,
    seed: int = 0,
    *,
    force: bool = False,
    progress: bool = False,
    **corpus_kwargs,
) -> str:
    """Generate and preprocess the demo corpus under ``data_dir`` unless present; return the prefix.

    The prefix ends in ``_text_document`` and holds byte-tokenizer ids (vocab 258, EOD 256) with
    one EOD-terminated document per generated record. ``corpus_kwargs`` (``num_docs``,
    ``min_chars``, ``max_chars``) change the corpus; non-default values get their own prefix.
    """
    from megatron_s2.training.preprocess import preprocess

    data_dir = os.path.expanduser(os.fspath(data_dir))
    os.makedirs(data_dir, exist_ok=True)
    prefix = demo_prefix(data_dir, seed)
    if corpus_kwargs:
        tag = "_".join(f"{k}{v}" for k, v in sorted(corpus_kwargs.items()))
        prefix = prefix.replace("_text_document", f"_{tag}_text_document")
    num_docs = corpus_kwargs.get("num_docs", DEFAULT_NUM_DOCS)
    if not force and _damage(prefix, num_docs) is None:
        return prefix
    with _locked(prefix + ".lock"):
        # Re-check: another process may have finished while we waited for the lock.
        problem = None if force else _damage(prefix, num_docs)
        if not force and problem is None:
            return prefix
        if problem is not None and any(os.path.exists(prefix + e) for e in (".bin", ".idx")):
            log.warning("demo corpus %s is damaged (%s); regenerating it", prefix, problem)
        jsonl = prefix[: -len("_text_document")] + ".jsonl"
        write_corpus_jsonl(jsonl, seed=seed, **corpus_kwargs)
        cache = os.path.join(data_dir, f".hf_cache_{os.getpid()}")
        try:
            preprocess(
                jsonl,
                prefix,
                tokenizer="byte",
                text_key="text",
                workers=1,
                cache_dir=cache,
                progress=progress,
            )
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return prefix


def write_kv_dataset(
    output_prefix: str | os.PathLike,
    tokenizer: str,
    seed: int = 0,
    *,
    num_docs: int = DEFAULT_NUM_DOCS,
    min_chars: int = 768,
    max_chars: int = 2560,
) -> dict:
    """Write the key-value recall corpus tokenized with ``tokenizer`` (``byte`` or a local HF
    tokenizer directory, e.g. the code corpus's ``data/code/tokenizer``) as a Megatron indexed
    dataset ``output_prefix.bin/.idx``, one EOD-terminated document per generated record.

    This is the synthetic retrieval component of a real-data blend (``data.blend='[[0.8, code],
    [0.2, kv]]'``): with a real corpus's tokenizer its ids live in that corpus's vocabulary.
    Tokenizes in this process with the tokenizer alone (no HF ``datasets``), so it runs where
    only ``tokenizers`` and megatron-core are installed. Returns ``{"documents", "tokens"}``
    (tokens with EOD)."""
    import numpy as np

    from megatron_s2.training.code_corpus import _encoder, writing_indexed_dataset

    tok, encode_batch = _encoder(tokenizer)
    docs = tokens = 0
    batch: list[str] = []
    with writing_indexed_dataset(os.fspath(output_prefix), tok.vocab_size) as writer:

        def flush() -> None:
            nonlocal docs, tokens
            for ids in encode_batch(batch):
                doc = np.asarray(list(ids) + [tok.eod], dtype=np.int64)
                writer.add(doc)
                docs += 1
                tokens += doc.size
            batch.clear()

        for text in generate_corpus(seed, num_docs, min_chars, max_chars):
            batch.append(text)
            if len(batch) == 256:
                flush()
        flush()
        stats = {"documents": docs, "tokens": tokens}
        writer.meta = {
            "generator": f"kv-recall-v{GENERATOR_VERSION}",
            "seed": seed,
            "num_docs": num_docs,
            "min_chars": min_chars,
            "max_chars": max_chars,
            "tokenizer": str(tokenizer),
            **stats,
        }
    return stats


def _damage(prefix: str, num_docs: int) -> Optional[str]:
    """None if ``prefix`` is an intact demo dataset of ``num_docs`` documents, else what is
    wrong (missing files, a truncated or corrupt ``.bin``/``.idx``, another document count)."""
    from megatron_s2.training.data import CorpusError, check_indexed_dataset
    from megatron_s2.training.tokenizer import ByteTokenizer

    for ext in (".bin", ".idx"):
        if not os.path.exists(prefix + ext):
            return f"{prefix}{ext} is missing"
    tok = ByteTokenizer()
    try:
        index = check_indexed_dataset(prefix, vocab_size=tok.vocab_size, eod=tok.eod)
    except CorpusError as exc:
        return exc.problem
    if index.num_documents != num_docs:
        return f"{prefix}.idx holds {index.num_documents} documents, expected {num_docs}"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="make_demo_corpus",
        description="Generate the synthetic key-value recall corpus and its byte-level Megatron "
        "indexed dataset.",
    )
    p.add_argument("--data-dir", default="data/demo", help="output directory (default: data/demo)")
    p.add_argument("--seed", type=int, default=0, help="corpus seed (default: 0)")
    p.add_argument(
        "--num-docs", type=int, default=None, help="documents to generate (default: 1200, ~2 MB)"
    )
    p.add_argument("--force", action="store_true", help="regenerate even if the dataset exists")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenize with this tokenizer (a local HF tokenizer directory, e.g. data/code/"
        "tokenizer) into --output-prefix, to blend with a real corpus; default: the demo's "
        "byte-level dataset in --data-dir",
    )
    p.add_argument("--output-prefix", default=None, help="with --tokenizer: the dataset prefix")
    p.add_argument("--min-chars", type=int, default=None, help="shortest document (default 768)")
    p.add_argument("--max-chars", type=int, default=None, help="longest document (default 2560)")
    args = p.parse_args(argv)
    kwargs = {} if args.num_docs is None else {"num_docs": args.num_docs}
    for name in ("min_chars", "max_chars"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    if (args.tokenizer is None) != (args.output_prefix is None):
        p.error("--tokenizer and --output-prefix go together")
    if args.tokenizer is not None:
        try:
            stats = write_kv_dataset(args.output_prefix, args.tokenizer, args.seed, **kwargs)
        except (ValueError, OSError) as exc:
            print(f"make_demo_corpus: error: {exc}", file=sys.stderr)
            return 2
        print(f"{args.output_prefix}: {stats['documents']} documents, {stats['tokens']} tokens")
        return 0
    try:
        prefix = ensure_demo_data(
            args.data_dir, seed=args.seed, force=args.force, progress=True, **kwargs
        )
    except ValueError as exc:
        print(f"make_demo_corpus: error: {exc}", file=sys.stderr)
        return 2
    print(prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
