"""A real-text corpus from the Python installation at hand: source and documentation files.

The corpus of issue 12 ("quality evidence on real data"): text that no one in this project wrote
and that every machine running the trainer already has, so nothing has to be downloaded or
carried to an offline GPU machine. Files are the ``.py``, ``.pyi``, ``.md``, ``.rst`` and ``.h``
files of the running interpreter's standard library and ``site-packages`` (or of the roots
given). One file is one document.

Steps of :func:`build_code_corpus`, each a pure function of the files found:

1. **Discover** (:func:`discover`): walk every root without following links, in sorted order;
   skip ``__pycache__``, hidden and ``*.dist-info`` / ``*.egg-info`` folders (package metadata
   repeats the README under another package name), the standard library's own ``site-packages``
   / ``dist-packages``, this project's packages (:data:`EXCLUDED_PACKAGES`) and editable-install
   finders. Files: the chosen suffixes, between ``min_bytes`` and ``max_bytes``, strict UTF-8
   without NUL bytes, not blank. A file's path is ``ROOT_NAME/relative/path`` (``stdlib/json/
   decoder.py``, ``site-packages/numpy/__init__.py``); its *package* is the first component
   below the root (a top-level module file's name without suffix).
2. **Deduplicate**: a file whose bytes equal an earlier file's (in path order) is dropped, so
   that vendored copies are seen once and no text is in both splits.
3. **Hold out packages** (:func:`assign_splits`): whole packages go to validation. The packages
   named in ``valid_packages`` first, then the others in the order of
   ``sha256("megatron-s2-holdout:" + package)``, each taken when it fits in what is left of
   ``valid_fraction`` of all bytes, until nothing more fits. A package never spans both splits.
4. **Manifest**: ``manifest.jsonl``, one line per file considered (kept, duplicate, or skipped by
   a content filter): ``path``, ``package``, ``split`` (``train``, ``valid`` or ``skip``),
   ``bytes``, ``sha256``, and ``reason`` / ``duplicate_of`` for dropped files.
5. **Tokenizer**: byte-level BPE trained with Hugging Face ``tokenizers`` on the training split
   only (``<|endoftext|>`` = EOD, ``<pad>``), saved as ``tokenizer/`` with ``tokenizer.json``
   and ``tokenizer_config.json``: what ``data.tokenizer`` and :func:`load_tokenizer` read.
   Literal ``<|endoftext|>`` text inside a file is encoded as ordinary text, never as EOD.
6. **Indexed datasets** (megatron-core's ``IndexedDatasetBuilder``, one document per file, EOD
   appended; no HF ``datasets`` needed): ``train``, ``valid`` and ``train_valid`` (the training
   documents, then the validation documents). The trainer reads ``train_valid`` with
   ``data.split=N_TRAIN,N_VALID,0``, which Megatron splits exactly at the package boundary
   (checked here with Megatron's own split functions); the exact override line is in
   ``corpus.json`` with the sizes.

CLI: ``python tools/build_code_corpus.py --out data/code``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from megatron_s2.training.tokenizer import load_tokenizer

__all__ = [
    "DEFAULT_SUFFIXES",
    "EXCLUDED_PACKAGES",
    "EOD_TOKEN",
    "PAD_TOKEN",
    "CorpusFile",
    "default_roots",
    "discover",
    "assign_splits",
    "tokenizer_sample",
    "train_tokenizer",
    "build_code_corpus",
    "main",
]

log = logging.getLogger(__name__)

DEFAULT_SUFFIXES = (".py", ".pyi", ".md", ".rst", ".h")
DEFAULT_MIN_BYTES = 1
DEFAULT_MAX_BYTES = 4 << 20
DEFAULT_VALID_FRACTION = 0.03
DEFAULT_VOCAB_SIZE = 32768
# This project's own code (when installed into site-packages) is not "text no one here wrote".
EXCLUDED_PACKAGES = ("megatron_s2", "s2attn")
EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<pad>"
HOLDOUT_SALT = "megatron-s2-holdout:"
# Folders never entered (besides hidden ones and the other roots nested inside a root).
_SKIP_DIRS = ("__pycache__",)
_SKIP_DIR_SUFFIXES = (".dist-info", ".egg-info")
# Tokens per document above which a document counts as long in the statistics.
LONG_DOCUMENT_TOKENS = 32768
# Text handed to the tokenizer per batch (its Rust thread pool splits a batch by documents).
_BATCH_BYTES = 16 << 20


@dataclass
class CorpusFile:
    """One file considered for the corpus (a manifest line)."""

    path: str  # ROOT_NAME/relative/path, '/'-separated
    package: str
    bytes: int
    sha256: str
    split: str = "train"  # train | valid | skip
    reason: Optional[str] = None  # why a file is skipped
    duplicate_of: Optional[str] = None
    source: Optional[str] = field(default=None, repr=False)  # absolute path; not in the manifest

    def manifest_record(self) -> dict:
        rec = {
            "path": self.path,
            "package": self.package,
            "split": self.split,
            "bytes": self.bytes,
            "sha256": self.sha256,
        }
        if self.reason is not None:
            rec["reason"] = self.reason
        if self.duplicate_of is not None:
            rec["duplicate_of"] = self.duplicate_of
        return rec


# ---- discovery ---------------------------------------------------------------------------------
def default_roots() -> list[tuple[str, str]]:
    """``[(name, path)]``: the running interpreter's standard library and site-packages.

    ``stdlib`` is ``sysconfig``'s ``stdlib`` path, ``site-packages`` its ``purelib``; a distinct
    ``platlib`` (e.g. ``lib64`` on some distributions) is added as ``site-packages-platlib``.
    """
    paths = sysconfig.get_paths()
    roots = [("stdlib", paths["stdlib"]), ("site-packages", paths["purelib"])]
    if os.path.realpath(paths["platlib"]) != os.path.realpath(paths["purelib"]):
        roots.append(("site-packages-platlib", paths["platlib"]))
    return [(n, p) for n, p in roots if os.path.isdir(p)]


def parse_root(spec: str) -> tuple[str, str]:
    """``NAME=PATH``, the name of a default root (``stdlib``, ``site-packages``), or a bare path
    (named after its last component)."""
    name, sep, path = spec.partition("=")
    defaults = dict(default_roots())
    if not sep and spec in defaults:
        return spec, defaults[spec]
    if not sep:
        path = spec
        name = os.path.basename(os.path.normpath(spec))
    if not name or "/" in name or not path:
        raise ValueError(f"--root {spec!r}: expected NAME=PATH with a NAME without '/'")
    return name, path


def _package_of(first: str, is_file: bool) -> str:
    if is_file:
        return first.split(".", 1)[0] or first
    return first


def _walk(root: str, skip_real: set[str]) -> Iterator[tuple[str, str]]:
    """(relative path, absolute path) of every regular file under ``root``, sorted, no links."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        keep = []
        for d in sorted(dirnames):
            full = os.path.join(dirpath, d)
            if (
                d in _SKIP_DIRS
                or d.startswith(".")
                or d.endswith(_SKIP_DIR_SUFFIXES)
                or os.path.islink(full)
                or os.path.realpath(full) in skip_real
            ):
                continue
            keep.append(d)
        dirnames[:] = keep
        for f in sorted(filenames):
            full = os.path.join(dirpath, f)
            if f.startswith(".") or os.path.islink(full) or not os.path.isfile(full):
                continue
            yield os.path.relpath(full, root).replace(os.sep, "/"), full


def discover(
    roots: Sequence[tuple[str, str]],
    *,
    suffixes: Sequence[str] = DEFAULT_SUFFIXES,
    min_bytes: int = DEFAULT_MIN_BYTES,
    max_bytes: int = DEFAULT_MAX_BYTES,
    packages: Optional[Sequence[str]] = None,
    exclude_packages: Sequence[str] = EXCLUDED_PACKAGES,
) -> list[CorpusFile]:
    """Every candidate file under ``roots`` in path order, hashed and filtered.

    Returns kept files (``split="train"`` for now) and files dropped by a content filter
    (``split="skip"`` with ``reason``: ``too-small``, ``too-large``, ``not-utf8``, ``binary``
    (a NUL byte), ``blank``, ``duplicate``). Files of another suffix, of skipped folders or of
    packages not selected are not listed at all.
    """
    names = [n for n, _ in roots]
    if len(set(names)) != len(names):
        raise ValueError(f"root names must differ, got {names}")
    suffixes = tuple(s if s.startswith(".") else "." + s for s in suffixes)
    selected = set(packages) if packages else None
    excluded = set(exclude_packages)
    real_roots = {os.path.realpath(p) for _, p in roots}
    out: list[CorpusFile] = []
    for name, root in roots:
        if not os.path.isdir(root):
            raise FileNotFoundError(f"root {name}={root}: not a directory")
        # Other roots nested inside this one (site-packages inside the stdlib folder), and the
        # standard library's own package folders, belong to no stdlib package.
        skip_real = (real_roots - {os.path.realpath(root)}) | {
            os.path.realpath(os.path.join(root, d)) for d in ("site-packages", "dist-packages")
        }
        for rel, full in _walk(root, skip_real):
            if not rel.endswith(suffixes):
                continue
            first, _, rest = rel.partition("/")
            package = _package_of(first, is_file=not rest)
            if package in excluded or first.startswith("__editable__"):
                continue
            if selected is not None and package not in selected:
                continue
            with open(full, "rb") as f:
                data = f.read()
            rec = CorpusFile(
                path=f"{name}/{rel}",
                package=package,
                bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
                source=full,
            )
            rec.reason = _content_problem(data, min_bytes, max_bytes)
            if rec.reason is not None:
                rec.split = "skip"
            out.append(rec)
    out.sort(key=lambda r: r.path)
    _mark_duplicates(out)
    return out


def _content_problem(data: bytes, min_bytes: int, max_bytes: int) -> Optional[str]:
    if len(data) < min_bytes:
        return "too-small"
    if len(data) > max_bytes:
        return "too-large"
    if b"\x00" in data:
        return "binary"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "not-utf8"
    if not text.strip():
        return "blank"
    return None


def _mark_duplicates(files: list[CorpusFile]) -> None:
    first: dict[str, str] = {}
    for rec in files:
        if rec.split == "skip":
            continue
        if rec.sha256 in first:
            rec.split, rec.reason, rec.duplicate_of = "skip", "duplicate", first[rec.sha256]
        else:
            first[rec.sha256] = rec.path


# ---- hold-out ----------------------------------------------------------------------------------
def holdout_key(package: str) -> str:
    return hashlib.sha256((HOLDOUT_SALT + package).encode("utf-8")).hexdigest()


def assign_splits(
    files: list[CorpusFile],
    valid_fraction: float = DEFAULT_VALID_FRACTION,
    valid_packages: Sequence[str] = (),
) -> list[str]:
    """Mark whole packages as validation; return the validation packages in selection order.

    ``valid_packages`` are taken first (each must exist). Then, in the order of
    ``sha256("megatron-s2-holdout:" + package)``, every package whose bytes fit in what is left
    of ``valid_fraction`` x (bytes of all kept files) is taken. Kept files are unique by content
    (:func:`discover` drops exact duplicates), so no validation text is also training text.
    """
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    kept = [r for r in files if r.split != "skip"]
    # Duplicates of a kept file count with the package of their kept copy only.
    sizes: dict[str, int] = {}
    for r in files:
        sizes.setdefault(r.package, 0)
        if r.split != "skip":
            sizes[r.package] += r.bytes
    missing = [p for p in valid_packages if p not in sizes]
    if missing:
        raise ValueError(f"valid_packages {missing}: no such package among the files found")
    chosen = list(dict.fromkeys(valid_packages))
    budget = valid_fraction * sum(r.bytes for r in kept) - sum(sizes[p] for p in chosen)
    for package in sorted(sizes, key=holdout_key):
        if package in chosen or sizes[package] == 0:
            continue
        if sizes[package] <= budget:
            chosen.append(package)
            budget -= sizes[package]
    valid = set(chosen)
    for r in kept:
        r.split = "valid" if r.package in valid else "train"
    return chosen


def write_manifest(files: Sequence[CorpusFile], path: str) -> str:
    """Write ``manifest.jsonl``; return its sha256."""
    h = hashlib.sha256()
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in files:
            line = json.dumps(r.manifest_record(), sort_keys=True, ensure_ascii=False) + "\n"
            f.write(line)
            h.update(line.encode("utf-8"))
    return h.hexdigest()


def read_manifest(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---- tokenizer ---------------------------------------------------------------------------------
def _read_text(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8")


def _text_batches(files: Sequence[CorpusFile]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for r in files:
        batch.append(_read_text(r.source))
        size += r.bytes
        if size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def tokenizer_sample(
    files: Sequence[CorpusFile], max_bytes: Optional[int] = None
) -> list[CorpusFile]:
    """``files`` (all when ``max_bytes`` is None), else those taken in the order of
    ``sha256(path)`` while their bytes fit in ``max_bytes``, returned in path order."""
    if max_bytes is None:
        return list(files)
    taken, left = set(), max_bytes
    for r in sorted(files, key=lambda r: hashlib.sha256(r.path.encode("utf-8")).hexdigest()):
        if r.bytes <= left:
            taken.add(r.path)
            left -= r.bytes
    if not taken:
        raise ValueError(f"tokenizer_sample_bytes={max_bytes} holds no training file")
    return [r for r in files if r.path in taken]


def train_tokenizer(
    files: Sequence[CorpusFile], out_dir: str, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> str:
    """Train a byte-level BPE on ``files`` (the training split) and save it in ``out_dir``.

    GPT-2's byte-level pre-tokenizer (no prefix space), 256 byte symbols always in the vocabulary,
    merges seen at least twice, special tokens ``<|endoftext|>`` (id 0, the EOD) and ``<pad>``
    (id 1). Writes ``tokenizer.json`` and ``tokenizer_config.json`` (``eos_token``/``pad_token``,
    read by :func:`load_tokenizer`). Returns ``out_dir``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 258:
        raise ValueError(f"vocab_size must be >= 258 (256 bytes + 2 specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOD_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_text_batches(files), trainer=trainer, length=len(files))
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOD_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_prefix_space": False,
        "model_max_length": 1 << 30,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1, sort_keys=True)
        f.write("\n")
    return out_dir


def _encoder(spec: str):
    """``texts -> list of id lists`` for ``spec``, with special-token text encoded as text."""
    tok = load_tokenizer(spec)
    inner = getattr(tok, "_tok", None)
    if inner is None:
        return tok, tok.encode_batch
    from tokenizers import Tokenizer

    path = Path(tok.spec)
    raw = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    # '<|endoftext|>' written in a source file is text, not a document boundary.
    raw.encode_special_tokens = True

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in raw.encode_batch(texts, add_special_tokens=False)]

    return tok, encode_batch


# ---- indexed datasets --------------------------------------------------------------------------
@dataclass
class SplitStats:
    files: int = 0
    bytes: int = 0
    documents: int = 0
    tokens: int = 0  # EOD included
    long_documents: int = 0  # over LONG_DOCUMENT_TOKENS tokens (EOD included)
    max_document_tokens: int = 0
    packages: int = 0


class _Writer:
    """An ``IndexedDatasetBuilder`` that renames its files into place on ``finish``."""

    def __init__(self, prefix: str, dtype, builder_cls):
        self.prefix = prefix
        self.tmp = f"{prefix}.tmp{os.getpid()}"
        self.builder = builder_cls(self.tmp + ".bin", dtype=dtype)
        self.meta: dict = {}  # what writing_indexed_dataset writes beside the files

    def add(self, doc: np.ndarray) -> None:
        self.builder.add_document(doc, [doc.size])

    def finish(self, meta: dict) -> None:
        self.builder.finalize(self.tmp + ".idx")
        os.replace(self.tmp + ".bin", self.prefix + ".bin")
        os.replace(self.tmp + ".idx", self.prefix + ".idx")
        with open(self.prefix + ".meta.json", "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)

    def abort(self) -> None:
        try:
            self.builder.data_file.close()
        except Exception:
            pass
        for ext in (".bin", ".idx"):
            try:
                os.remove(self.tmp + ext)
            except FileNotFoundError:
                pass


@contextlib.contextmanager
def writing_indexed_dataset(prefix: str, vocab_size: int):
    """Yield a :class:`_Writer` for the Megatron indexed dataset ``prefix`` (ids in the smallest
    dtype that holds ``vocab_size``; the parent folder made). When the block ends its files are
    renamed into place with ``writer.meta`` as ``prefix.meta.json``; if it raises they are
    removed and nothing appears under ``prefix``."""
    from .preprocess import _import_megatron_writer

    dtype_cls, builder_cls = _import_megatron_writer()
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    writer = _Writer(prefix, dtype_cls.optimal_dtype(vocab_size), builder_cls)
    try:
        yield writer
        writer.finish(writer.meta)
    except BaseException:
        writer.abort()
        raise


def _check_exact_split(n_train: int, n_valid: int) -> str:
    """The ``data.split`` that makes Megatron's split of ``train_valid`` fall exactly between the
    training and the validation documents (verified with megatron-core's own functions)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    split = f"{n_train},{n_valid},0"
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    n = n_train + n_valid
    ranges = [
        (int(round(b[0] * float(n))), int(round(b[1] * float(n)))) if b is not None else None
        for b in matrix
    ]
    if ranges[0] != (0, n_train) or (n_valid and ranges[1] != (n_train, n)):
        raise RuntimeError(f"data.split {split} does not split at the hold-out: {ranges}")
    return split


# ---- driver ------------------------------------------------------------------------------------
def build_code_corpus(
    out_dir: str,
    roots: Optional[Sequence[tuple[str, str]]] = None,
    *,
    suffixes: Sequence[str] = DEFAULT_SUFFIXES,
    min_bytes: int = DEFAULT_MIN_BYTES,
    max_bytes: int = DEFAULT_MAX_BYTES,
    packages: Optional[Sequence[str]] = None,
    exclude_packages: Sequence[str] = EXCLUDED_PACKAGES,
    valid_fraction: float = DEFAULT_VALID_FRACTION,
    valid_packages: Sequence[str] = (),
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    tokenizer: Optional[str] = None,
    tokenizer_sample_bytes: Optional[int] = None,
) -> dict:
    """Build the corpus in ``out_dir`` (see the module docstring); return the summary that is
    also written to ``out_dir/corpus.json``.

    ``tokenizer``: use this tokenizer (``"byte"`` or a local HF tokenizer path) instead of
    training one. ``tokenizer_sample_bytes``: train the BPE on a deterministic sample of the
    training files only (:func:`tokenizer_sample`), to bound its time and memory.
    """
    t0 = time.time()
    roots = list(roots) if roots else default_roots()
    roots = [(n, os.path.abspath(os.path.expanduser(p))) for n, p in roots]
    files = discover(
        roots,
        suffixes=suffixes,
        min_bytes=min_bytes,
        max_bytes=max_bytes,
        packages=packages,
        exclude_packages=exclude_packages,
    )
    valid_pkgs = assign_splits(files, valid_fraction, valid_packages)
    train_files = [r for r in files if r.split == "train"]
    valid_files = [r for r in files if r.split == "valid"]
    if not train_files:
        raise ValueError(f"no training files found under {roots} with suffixes {list(suffixes)}")
    if valid_fraction > 0 and not valid_files:
        log.warning(
            "no package fits in valid_fraction=%s: the validation split is empty", valid_fraction
        )
    os.makedirs(out_dir, exist_ok=True)
    manifest_sha = write_manifest(files, os.path.join(out_dir, "manifest.jsonl"))
    t_discover = time.time() - t0

    if tokenizer is None:
        tokenizer = train_tokenizer(
            tokenizer_sample(train_files, tokenizer_sample_bytes),
            os.path.join(out_dir, "tokenizer"),
            vocab_size,
        )
    t_tokenizer = time.time() - t0 - t_discover
    tok, encode_batch = _encoder(tokenizer)

    from megatron_s2.training.preprocess import _import_megatron_writer

    DType, IndexedDatasetBuilder = _import_megatron_writer()
    dtype = DType.optimal_dtype(tok.vocab_size)
    eod = np.array([tok.eod], dtype=dtype)
    stats = {"train": SplitStats(), "valid": SplitStats()}
    prefixes = {s: os.path.join(out_dir, s) for s in ("train", "valid", "train_valid")}
    writers = {
        s: _Writer(p, dtype, IndexedDatasetBuilder)
        for s, p in prefixes.items()
        if s != "valid" or valid_files
    }
    try:
        for split, split_files in (("train", train_files), ("valid", valid_files)):
            st = stats[split]
            st.packages = len({r.package for r in split_files})
            for batch_files, texts in _batches_with_files(split_files):
                for r, ids in zip(batch_files, encode_batch(texts)):
                    doc = np.concatenate([np.asarray(ids, dtype=dtype), eod])
                    writers[split].add(doc)
                    writers["train_valid"].add(doc)
                    st.files += 1
                    st.bytes += r.bytes
                    st.documents += 1
                    st.tokens += int(doc.size)
                    st.long_documents += int(doc.size > LONG_DOCUMENT_TOKENS)
                    st.max_document_tokens = max(st.max_document_tokens, int(doc.size))
        data_split = _check_exact_split(stats["train"].documents, stats["valid"].documents)
        for split, w in writers.items():
            docs = (
                stats["train"].documents + stats["valid"].documents
                if split == "train_valid"
                else stats[split].documents
            )
            toks = (
                stats["train"].tokens + stats["valid"].tokens
                if split == "train_valid"
                else stats[split].tokens
            )
            w.finish(
                {
                    "tokenizer": str(getattr(tok, "spec", tokenizer)),
                    "vocab_size": int(tok.vocab_size),
                    "eod": int(tok.eod),
                    "append_eod": True,
                    "dtype": np.dtype(dtype).name,
                    "documents": docs,
                    "empty_documents_skipped": 0,
                    "missing_text_skipped": 0,
                    "tokens": toks,
                    "inputs": [os.path.join(out_dir, "manifest.jsonl")],
                    "split": split,
                }
            )
    except BaseException:
        for w in writers.values():
            w.abort()
        raise

    skipped: dict[str, int] = {}
    for r in files:
        if r.split == "skip":
            skipped[r.reason] = skipped.get(r.reason, 0) + 1
    import tokenizers

    blend = prefixes["train_valid"]
    summary = {
        "roots": [{"name": n, "path": p} for n, p in roots],
        "python": sys.version.split()[0],
        "tokenizers": tokenizers.__version__,
        "settings": {
            "suffixes": list(suffixes),
            "min_bytes": min_bytes,
            "max_bytes": max_bytes,
            "packages": sorted(packages) if packages else None,
            "exclude_packages": list(exclude_packages),
            "valid_fraction": valid_fraction,
            "valid_packages": list(valid_packages),
            "vocab_size": vocab_size,
            "tokenizer_sample_bytes": tokenizer_sample_bytes,
            "holdout_salt": HOLDOUT_SALT,
        },
        "manifest_sha256": manifest_sha,
        "tokenizer": str(getattr(tok, "spec", tokenizer)),
        "tokenizer_vocab_size": int(tok.vocab_size),
        "eod": int(tok.eod),
        "valid_packages": valid_pkgs,
        "splits": {s: asdict(v) for s, v in stats.items()},
        "skipped_files": dict(sorted(skipped.items())),
        "prefixes": prefixes if valid_files else {"train": prefixes["train"], "train_valid": blend},
        "data_split": data_split,
        "overrides": (
            f"data.demo=false data.blend=[{blend}] data.split={data_split} "
            f"data.tokenizer={getattr(tok, 'spec', tokenizer)}"
        ),
        "seconds": {
            "discover": round(t_discover, 1),
            "tokenizer": round(t_tokenizer, 1),
            "total": round(time.time() - t0, 1),
        },
    }
    with open(os.path.join(out_dir, "corpus.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    return summary


def _batches_with_files(
    files: Sequence[CorpusFile],
) -> Iterator[tuple[list[CorpusFile], list[str]]]:
    batch: list[CorpusFile] = []
    size = 0
    for r in files:
        batch.append(r)
        size += r.bytes
        if size >= _BATCH_BYTES:
            yield batch, [_read_text(b.source) for b in batch]
            batch, size = [], 0
    if batch:
        yield batch, [_read_text(b.source) for b in batch]


def format_summary(summary: dict) -> str:
    lines = []
    for name, st in summary["splits"].items():
        lines.append(
            f"{name:5s}: {st['packages']} packages, {st['files']} files, "
            f"{st['bytes'] / 1e6:.1f} MB, {st['tokens']} tokens "
            f"({st['bytes'] / max(1, st['tokens']):.2f} bytes/token), "
            f"{st['long_documents']} documents over {LONG_DOCUMENT_TOKENS} tokens "
            f"(longest {st['max_document_tokens']})"
        )
    skipped = ", ".join(f"{k} {v}" for k, v in summary["skipped_files"].items()) or "none"
    lines.append(f"skipped files: {skipped}")
    lines.append(f"validation packages: {', '.join(summary['valid_packages']) or '(none)'}")
    lines.append(
        f"tokenizer: {summary['tokenizer']} (vocabulary {summary['tokenizer_vocab_size']}"
        f", EOD {summary['eod']})"
    )
    lines.append(f"train with: {summary['overrides']}")
    lines.append(f"took {summary['seconds']['total']}s")
    return "\n".join(lines)


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="build_code_corpus",
        description="Build a corpus of the Python sources and docs installed on this machine "
        "(manifest, BPE tokenizer, Megatron indexed datasets with a package-level hold-out).",
    )
    p.add_argument("--out", "-o", required=True, help="output directory")
    p.add_argument(
        "--root",
        action="append",
        default=None,
        metavar="NAME=PATH",
        help="a folder to read (repeatable): NAME=PATH, or 'stdlib' / 'site-packages' for this "
        "interpreter's (sysconfig stdlib, purelib); default: all of this interpreter's",
    )
    p.add_argument(
        "--packages",
        default=None,
        help="comma-separated top-level packages to keep (default: all)",
    )
    p.add_argument(
        "--exclude-packages",
        default=",".join(EXCLUDED_PACKAGES),
        help=f"comma-separated packages to leave out (default: {','.join(EXCLUDED_PACKAGES)})",
    )
    p.add_argument(
        "--suffixes",
        default=",".join(DEFAULT_SUFFIXES),
        help=f"comma-separated file suffixes (default: {','.join(DEFAULT_SUFFIXES)})",
    )
    p.add_argument("--min-bytes", type=int, default=DEFAULT_MIN_BYTES)
    p.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    p.add_argument(
        "--valid-fraction",
        type=float,
        default=DEFAULT_VALID_FRACTION,
        help=f"bytes held out as whole packages (default: {DEFAULT_VALID_FRACTION})",
    )
    p.add_argument(
        "--valid-packages",
        default="",
        help="comma-separated packages always held out (before the hash-ordered fill)",
    )
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument(
        "--tokenizer-sample-bytes",
        type=int,
        default=None,
        help="train the BPE on a deterministic sample of this many bytes of the training files "
        "(default: all of them)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="use this tokenizer ('byte' or a local HF tokenizer) instead of training one",
    )
    return p


def _csv(s: Optional[str]) -> list[str]:
    return [x for x in (s or "").split(",") if x]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        summary = build_code_corpus(
            args.out,
            [parse_root(r) for r in args.root] if args.root else None,
            suffixes=_csv(args.suffixes),
            min_bytes=args.min_bytes,
            max_bytes=args.max_bytes,
            packages=_csv(args.packages) or None,
            exclude_packages=_csv(args.exclude_packages),
            valid_fraction=args.valid_fraction,
            valid_packages=_csv(args.valid_packages),
            vocab_size=args.vocab_size,
            tokenizer=args.tokenizer,
            tokenizer_sample_bytes=args.tokenizer_sample_bytes,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"build_code_corpus: error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
