"""Text -> Megatron indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``).

Inputs are read with Hugging Face ``datasets``: local json/jsonl, parquet, csv and text files
(single files, directories, or glob patterns, optionally compressed), an in-memory
``datasets.Dataset``, or a Hub dataset name when online. Each record becomes one document: its
tokens followed by the tokenizer's EOD token. Documents are written with Megatron-core's
``IndexedDatasetBuilder`` so that ``IndexedDataset`` / ``GPTDataset`` read them directly.

Tokenization runs in ``workers`` processes; batches come back in input order, so the output is
byte-identical for any worker count.

Input problems are errors naming the file (and line, where the format has lines) before anything
is written: no input records at all, a record without the text field or with null there
(``skip_missing_text=True`` / ``--skip-missing-text`` skips and counts such records instead,
separately from empty ones), text that is not UTF-8, JSON that does not parse. An empty input
file next to others is skipped with a warning.

CLI: ``python tools/prepare_data.py --input data/*.jsonl --output-prefix data/corpus`` (same as
``python -m megatron_s2.training.preprocess``).
"""

from __future__ import annotations

import argparse
import bz2
import contextlib
import csv
import glob
import gzip
import io
import json
import logging
import multiprocessing
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from megatron_s2.training.tokenizer import load_tokenizer

__all__ = ["preprocess", "resolve_inputs", "PreprocessStats", "SUPPORTED_SUFFIXES", "main"]

log = logging.getLogger(__name__)

# File suffix -> datasets builder name.
SUPPORTED_SUFFIXES = {
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".txt": "text",
    ".text": "text",
}
# datasets/fsspec decompress these transparently; the format comes from the suffix before them.
_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_FORMATS = sorted(set(SUPPORTED_SUFFIXES.values()))
# Keep batches small enough for a smooth progress bar and bounded worker memory, large enough to
# amortize inter-process pickling.
_BATCH_DOCS = 1024
_BATCH_CHARS = 4 << 20


@dataclass
class _Source:
    """A group of consecutive local files of one format, or a Hub dataset, or a Dataset object."""

    kind: str  # a datasets builder name, "hub" or "dataset"
    files: list[str] = field(default_factory=list)
    name: Optional[str] = None
    obj: object = None

    def describe(self) -> str:
        if self.kind == "hub":
            return f"hub dataset {self.name!r}"
        if self.kind == "dataset":
            return "in-memory dataset"
        return self.files[0] if len(self.files) == 1 else f"{len(self.files)} {self.kind} files"


@dataclass
class PreprocessStats:
    documents: int = 0
    # Records whose text tokenizes to nothing (skipped, as Megatron's own preprocessing does).
    empty_documents: int = 0
    # Records without the text field (or with null there), skipped with skip_missing_text=True.
    missing_text: int = 0
    tokens: int = 0
    seconds: float = 0.0


def _file_format(path: str, input_format: Optional[str]) -> str:
    if input_format is not None:
        return input_format
    lower = path.lower()
    for comp in _COMPRESSION_SUFFIXES:
        if lower.endswith(comp):
            lower = lower[: -len(comp)]
            break
    suffix = os.path.splitext(lower)[1]
    if suffix not in SUPPORTED_SUFFIXES:
        raise ValueError(
            f"input {path!r}: cannot infer the format from suffix {suffix or '(none)'!r}; "
            f"supported suffixes are {sorted(SUPPORTED_SUFFIXES)} "
            f"(optionally + {list(_COMPRESSION_SUFFIXES)}), "
            f"or pass input_format= one of {_FORMATS} (CLI: --input-format)"
        )
    return SUPPORTED_SUFFIXES[suffix]


def _looks_like_path(s: str) -> bool:
    """True for strings that cannot be Hub dataset names ("owner/name" or "name")."""
    if s.startswith((".", "/", "~")) or s.count("/") > 1 or "\\" in s:
        return True
    return _has_supported_suffix(s)


def _offline() -> bool:
    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
        for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    )


def resolve_inputs(inputs, input_format: Optional[str] = None) -> list[_Source]:
    """Expand ``inputs`` into ordered sources; raise with a clear message for anything unreadable.

    Directories contribute their supported files (sorted, recursively); glob patterns are expanded
    and sorted. A string that is not a local path is taken as a Hub dataset name unless the
    environment is offline (``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1``).
    """
    if input_format is not None and input_format not in _FORMATS:
        raise ValueError(f"input_format must be one of {_FORMATS}, got {input_format!r}")
    if inputs is None:
        raise ValueError(
            "inputs: nothing to preprocess (pass files, directories, globs or a dataset name)"
        )
    if isinstance(inputs, (str, os.PathLike)) or _is_dataset(inputs):
        inputs = [inputs]
    inputs = list(inputs)
    if not inputs:
        raise ValueError("inputs: empty list; pass files, directories, globs or a dataset name")

    sources: list[_Source] = []

    def add_file(path: str) -> None:
        fmt = _file_format(path, input_format)
        if sources and sources[-1].kind == fmt:
            sources[-1].files.append(path)
        else:
            sources.append(_Source(kind=fmt, files=[path]))

    for item in inputs:
        if _is_dataset(item):
            sources.append(_Source(kind="dataset", obj=item))
            continue
        if not isinstance(item, (str, os.PathLike)):
            raise TypeError(
                "inputs: expected paths, dataset names or datasets.Dataset, "
                f"got {type(item).__name__}"
            )
        s = os.path.expanduser(os.fspath(item))
        if os.path.isfile(s):
            add_file(s)
        elif os.path.isdir(s):
            found = sorted(
                str(p)
                for p in Path(s).rglob("*")
                if p.is_file()
                and not p.name.startswith(".")
                and (input_format is not None or _has_supported_suffix(p.name))
            )
            if not found:
                raise FileNotFoundError(
                    f"input directory {s!r} contains no files with a supported suffix "
                    f"{sorted(SUPPORTED_SUFFIXES)}"
                )
            for f in found:
                add_file(f)
        elif glob.has_magic(s):
            found = sorted(f for f in glob.glob(s, recursive=True) if os.path.isfile(f))
            if not found:
                raise FileNotFoundError(f"input pattern {s!r} matches no files")
            for f in found:
                add_file(f)
        elif _looks_like_path(s):
            raise FileNotFoundError(f"input file {s!r} does not exist")
        elif _offline():
            raise FileNotFoundError(
                f"input {s!r} is not a local file, and the Hub is off "
                "(HF_DATASETS_OFFLINE/HF_HUB_OFFLINE set); "
                "download the dataset or point --input at local files"
            )
        else:
            sources.append(_Source(kind="hub", name=s))
    return sources


def _has_supported_suffix(name: str) -> bool:
    try:
        _file_format(name, None)
        return True
    except ValueError:
        return False


def _is_dataset(obj) -> bool:
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a hard dependency
        return False
    return isinstance(obj, (datasets.Dataset, datasets.IterableDataset))


def _load_source(
    src: _Source,
    split: str,
    hub_config: Optional[str],
    text_sample_by: str,
    cache_dir: Optional[str],
):
    """The source as a ``datasets`` dataset; None when it holds no records."""
    import datasets

    if src.kind == "dataset":
        return src.obj
    try:
        if src.kind == "hub":
            return datasets.load_dataset(src.name, hub_config, split=split, cache_dir=cache_dir)
        kwargs = {}
        if src.kind == "text":
            kwargs["sample_by"] = text_sample_by
        # Local files always form a single "train" split; `split` only selects Hub splits.
        return datasets.load_dataset(
            src.kind, data_files=src.files, split="train", cache_dir=cache_dir, **kwargs
        )
    except Exception as exc:
        if "corresponds to no data" in str(exc):  # datasets' words for a file without records
            return None
        if _caused_by(exc, UnicodeDecodeError):
            raise ValueError(_utf8_error(src, _caused_by(exc, UnicodeDecodeError))) from exc
        located = _locate_bad_json(src) if src.kind == "json" else None
        if located:
            raise ValueError(f"cannot read {located}") from exc
        if isinstance(exc, (FileNotFoundError, ValueError, TypeError)):
            raise ValueError(f"cannot read {src.describe()}: {exc}") from exc
        # pyarrow / json decoding errors carry no file name; add it.
        # datasets wraps the parser's error (which names the problem) in a generic one.
        cause = exc.__cause__ or exc.__context__
        detail = f"{type(exc).__name__}: {exc}" + (
            f" ({type(cause).__name__}: {cause})" if cause else ""
        )
        raise ValueError(f"cannot read {src.describe()} as {src.kind}: {detail}") from exc


def _caused_by(exc: BaseException, kind: type) -> Optional[BaseException]:
    """``exc`` or the first exception of its cause/context chain that is a ``kind``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


# ---- locating a problem in the input files (error paths only) ----------------------------------
def _open_binary(path: str):
    """``path`` opened for reading bytes, decompressed like datasets does; None when the
    compression needs a module that is not installed."""
    lower = path.lower()
    if lower.endswith(".gz"):
        return gzip.open(path, "rb")
    if lower.endswith(".bz2"):
        return bz2.open(path, "rb")
    if lower.endswith(".xz"):
        import lzma

        return lzma.open(path, "rb")
    if lower.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            return None
        return zstandard.open(path, "rb")
    if lower.endswith(".lz4"):
        try:
            import lz4.frame
        except ImportError:
            return None
        return lz4.frame.open(path, "rb")
    return open(path, "rb")


def _utf8_error(src: _Source, exc: BaseException) -> str:
    """The message for input that is not UTF-8: the first bad file and line, when found."""
    for path in src.files:
        try:
            f = _open_binary(path)
            if f is None:
                continue
            with f:
                for lineno, line in enumerate(f, 1):
                    try:
                        line.decode("utf-8")
                    except UnicodeDecodeError as bad:
                        hint = (
                            ""
                            if path.lower().endswith(_COMPRESSION_SUFFIXES)
                            else f", e.g. `iconv -f latin1 -t utf-8 {path}` for Latin-1 text"
                        )
                        return (
                            f"{path}:{lineno}: not valid UTF-8 (byte 0x{line[bad.start]:02x} at "
                            f"column {bad.start + 1}); convert the file to UTF-8{hint}"
                        )
        except OSError:
            continue
    return f"{src.describe()}: not valid UTF-8 ({exc}); convert the input to UTF-8"


def _skip_space(text) -> tuple[str, int]:
    """Read past leading whitespace: the first other character and the lines skipped."""
    skipped = 0
    first = text.read(1)
    while first.isspace():
        skipped += first == "\n"
        first = text.read(1)
    return first, skipped


def _locate_bad_json(src: _Source) -> Optional[str]:
    """'FILE:LINE: invalid JSON (...)' for the first JSON-lines record that does not parse."""
    for path in src.files:
        try:
            f = _open_binary(path)
            if f is None:
                continue
            with f:
                text = io.TextIOWrapper(f, encoding="utf-8", errors="replace", newline="")
                first, skipped = _skip_space(text)
                if first == "[":  # one JSON array: json reports the line itself
                    try:
                        json.loads(first + text.read())
                    except json.JSONDecodeError as exc:
                        return (
                            f"{path}:{exc.lineno + skipped}: invalid JSON ({exc.msg} at column "
                            f"{exc.colno})"
                        )
                    continue
                lineno = 1 + skipped
                line = first + text.readline()
                while line:
                    if line.strip():
                        try:
                            json.loads(line)
                        except json.JSONDecodeError as exc:
                            return (
                                f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})"
                            )
                    lineno += 1
                    line = text.readline()
        except OSError:
            continue
    return None


def _locate_row(src: _Source, row: int) -> str:
    """Where record ``row`` (0-based, counted over the whole source) comes from: 'FILE:LINE'
    for JSON lines and CSV, 'FILE: record N' for JSON arrays and parquet."""
    try:
        offset = 0
        for path in src.files:
            if src.kind == "parquet":
                import pyarrow.parquet as pq

                count = pq.ParquetFile(path).metadata.num_rows
                if row < offset + count:
                    return f"{path}: record {row - offset + 1}"
                offset += count
                continue
            f = _open_binary(path)
            if f is None:
                break
            with f:
                text = io.TextIOWrapper(f, encoding="utf-8", errors="replace", newline="")
                if src.kind == "csv":
                    reader = csv.reader(text)
                    next(reader, None)  # the header
                    for _ in reader:
                        if offset == row:
                            return f"{path}:{reader.line_num}"
                        offset += 1
                    continue
                first, skipped = _skip_space(text)
                if first == "[":
                    count = len(json.loads(first + text.read()))
                    if row < offset + count:
                        return f"{path}: record {row - offset + 1} of its JSON array"
                    offset += count
                    continue
                lineno, line = 1 + skipped, first + text.readline()
                while line:
                    if line.strip():  # datasets skips blank lines
                        if offset == row:
                            return f"{path}:{lineno}"
                        offset += 1
                    lineno += 1
                    line = text.readline()
    except Exception:  # locating is best effort; the row number below is still right
        pass
    return f"{src.describe()}: row {row + 1}"


def _is_empty_file(path: str, kind: str) -> bool:
    """True for an input file without records: no bytes, or only whitespace (text formats)."""
    if os.path.getsize(path) == 0:
        return True
    if kind == "parquet":
        return False
    f = _open_binary(path)
    if f is None:
        return False
    with f:
        head = f.read(1 << 16)
        return len(head) < (1 << 16) and not head.strip()


def _iter_batches(
    ds, src: _Source, text_key: str, stats: PreprocessStats, skip_missing_text: bool
) -> Iterator[list[str]]:
    """Yield lists of document texts, validating the column and value types on the way.

    A record without the text field (or with null there) is an error naming its file and line,
    unless ``skip_missing_text``: then it is counted in ``stats.missing_text``. In CSV an empty
    cell reads as null and counts as an empty document.
    """
    key = "text" if src.kind == "text" else text_key
    columns = ds.column_names
    if columns is not None and key not in columns:
        raise ValueError(
            f"{src.describe()}: no column {key!r} (columns: {list(columns)}); pass text_key= "
            "(CLI: --text-key) naming the column that holds the text"
        )
    batch: list[str] = []
    chars = 0
    row = 0
    records = iter(ds.iter(batch_size=_BATCH_DOCS) if hasattr(ds, "iter") else _chunks(ds))
    while True:
        try:
            record = next(records)
        except StopIteration:
            break
        except UnicodeDecodeError as exc:  # pyarrow decodes the JSON strings only now
            raise ValueError(_utf8_error(src, exc)) from exc
        if key not in record:
            raise ValueError(
                f"{src.describe()}: no column {key!r} (columns: {list(record)}); pass text_key="
            )
        for value in record[key]:
            if value is None and src.kind == "csv":
                value = ""
            elif value is None:
                if not skip_missing_text:
                    raise ValueError(
                        f"{_locate_row(src, row)}: record has no {key!r} field (or it is null); "
                        f"fix the record, pick the text column with text_key= (CLI: --text-key), "
                        f"or pass skip_missing_text=True (CLI: --skip-missing-text) to skip and "
                        f"count such records"
                    )
                stats.missing_text += 1
                row += 1
                continue
            elif not isinstance(value, str):
                raise ValueError(
                    f"{_locate_row(src, row)}: column {key!r} holds {type(value).__name__}, "
                    "expected a string; pick a text column with text_key= (CLI: --text-key)"
                )
            row += 1
            batch.append(value)
            chars += len(value)
            if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


def _chunks(ds) -> Iterator[dict]:
    # IterableDataset in older datasets versions has no .iter(); build the column batches by hand.
    buf: dict = {}
    n = 0
    for ex in ds:
        for k, v in ex.items():
            buf.setdefault(k, []).append(v)
        n += 1
        if n == _BATCH_DOCS:
            yield buf
            buf, n = {}, 0
    if n:
        yield buf


@contextlib.contextmanager
def _datasets_progress(enabled: bool):
    """Silence datasets' own "Generating train split" bars when our progress bar is off."""
    from datasets import utils as ds_logging

    was_disabled = ds_logging.are_progress_bars_disabled()
    if not enabled and not was_disabled:
        ds_logging.disable_progress_bars()
    try:
        yield
    finally:
        if not enabled and not was_disabled:
            ds_logging.enable_progress_bars()


def _drop_empty_files(sources: list[_Source]) -> list[_Source]:
    """Leave out input files without records (datasets fails on them with StopIteration or
    'corresponds to no data'); an error naming them when no file is left."""
    kept, empty = [], []
    for src in sources:
        if src.files:
            files = [f for f in src.files if not _is_empty_file(f, src.kind)]
            empty += [f for f in src.files if f not in files]
            if not files:
                continue
            src = _Source(kind=src.kind, files=files)
        kept.append(src)
    if not kept:
        listed = ", ".join(empty[:5]) + (", ..." if len(empty) > 5 else "")
        names = empty[0] if len(empty) == 1 else f"{len(empty)} files ({listed})"
        raise ValueError(
            f"input {names} {'is' if len(empty) == 1 else 'are'} empty (no records): nothing "
            f"to preprocess; check the --input path"
        )
    for path in empty:
        log.warning("skipping empty input file %s (no records)", path)
    return kept


# The pip wheel of megatron-core warns on import that Transformer Engine and Apex are missing;
# writing an indexed dataset needs neither.
_IMPORT_WARNINGS = r"(Transformer Engine and Apex are not installed|Apex is not installed)"


def _import_megatron_writer():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_IMPORT_WARNINGS)
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    return DType, IndexedDatasetBuilder


# ---- worker side -------------------------------------------------------------------------------
_WORKER_TOKENIZER = None
_WORKER_DTYPE = None


def _init_worker(spec, eod_token, dtype) -> None:
    global _WORKER_TOKENIZER, _WORKER_DTYPE
    # The Rust tokenizer's own thread pool would oversubscribe the CPUs next to our processes.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER_TOKENIZER = load_tokenizer(spec, eod_token=eod_token)
    _WORKER_DTYPE = dtype


def _encode_batch(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Encode a batch; return the concatenated ids and per-document lengths (no EOD yet).

    Flat numpy arrays pickle far faster than lists of Python ints on the way back to the parent.
    """
    tok = _WORKER_TOKENIZER
    if hasattr(tok, "encode_batch"):
        encoded = tok.encode_batch(texts)
    else:
        encoded = [tok.encode(t) for t in texts]
    lengths = np.fromiter((len(e) for e in encoded), dtype=np.int64, count=len(encoded))
    flat = np.fromiter(
        (i for e in encoded for i in e), dtype=_WORKER_DTYPE, count=int(lengths.sum())
    )
    return flat, lengths


# ---- driver ------------------------------------------------------------------------------------
def _is_index_cache(path: str) -> bool:
    """Whether the directory ``path`` holds nothing but Megatron's sample-index cache of the
    dataset that ``path`` is the prefix of.

    Without a ``path_to_cache`` (the trainer's ``data.cache_dir`` unset) Megatron's
    ``GPTDataset`` writes its indices to ``<prefix>/cache/GPTDataset_indices``, so a corpus
    that has been trained on has a directory of the prefix's own name beside its ``.bin``/
    ``.idx``. Re-writing the corpus there (after a damaged copy, or the demo's regeneration)
    is what the prefix is for, not a directory given by mistake. The cached indices are
    keyed by the corpus's fingerprint (``data.DatasetTokenizer``), so the old ones are never
    read for the new corpus.
    """
    try:
        if os.listdir(path) != ["cache"]:
            return False
        cache = os.path.join(path, "cache")
        return os.path.isdir(cache) and all(e.endswith("_indices") for e in os.listdir(cache))
    except OSError:
        return False


def preprocess(
    inputs,
    output_prefix: str | os.PathLike,
    tokenizer="byte",
    text_key: str = "text",
    workers: int = 1,
    append_eod: bool = True,
    *,
    eod_token: Optional[str] = None,
    input_format: Optional[str] = None,
    split: str = "train",
    hub_config: Optional[str] = None,
    text_sample_by: str = "line",
    cache_dir: Optional[str] = None,
    progress: bool = True,
    stats: Optional[PreprocessStats] = None,
    skip_missing_text: bool = False,
) -> str:
    """Tokenize ``inputs`` and write the Megatron indexed dataset ``output_prefix.{bin,idx}``.

    Args:
        inputs: a path, directory, glob, Hub dataset name or ``datasets.Dataset``, or a list of them
            (processed in order).
        output_prefix: path prefix of the output files (parent directories are created).
        tokenizer: ``"byte"`` or a local Hugging Face tokenizer path (see ``load_tokenizer``).
        text_key: column holding the document text (json/jsonl/parquet/csv/Hub); text files
            always use their lines (or whole files, see ``text_sample_by``).
        workers: tokenizer processes; the output is identical for any value.
        append_eod: end every document with the tokenizer's EOD token, so that packed training
            sequences see document boundaries.
        eod_token: EOD token string of an HF tokenizer when it cannot be inferred.
        input_format: force the datasets builder (json, parquet, csv, text) for all local files.
        split: Hub split to read (local files are one split).
        hub_config: Hub dataset configuration name.
        text_sample_by: for text files, one document per ``"line"``, ``"paragraph"`` or
            ``"document"`` (whole file).
        cache_dir: datasets cache directory (default: the HF cache).
        progress: show a tqdm progress bar on stderr.
        stats: optional ``PreprocessStats`` filled in with counts.
        skip_missing_text: skip records without ``text_key`` (or null there) and count them in
            ``stats.missing_text``; by default such a record is an error naming its file and
            line.

    Returns:
        ``output_prefix`` as a string. The ``.idx`` file is renamed into place last, so a present
        ``.idx`` means a complete dataset. A ``PREFIX.meta.json`` records the tokenizer and counts.

    Empty documents are skipped (as Megatron's own preprocessing does). Input files without
    any record (empty or blank) are skipped with a warning; when no input has a record, that is
    an error naming the files. Input that is not UTF-8 is an error naming the file and line.
    """
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    if text_sample_by not in ("line", "paragraph", "document"):
        raise ValueError(
            f"text_sample_by must be 'line', 'paragraph' or 'document', got {text_sample_by!r}"
        )
    if not isinstance(text_key, str) or not text_key:
        raise ValueError(f"text_key must be a non-empty column name, got {text_key!r}")
    if output_prefix is None or str(output_prefix) == "":
        raise ValueError("output_prefix is required")
    output_prefix = os.path.expanduser(os.fspath(output_prefix))
    if output_prefix.endswith((".bin", ".idx")):
        raise ValueError(
            f"output_prefix {output_prefix!r} should not include .bin/.idx; give the common prefix"
        )
    if os.path.isdir(output_prefix) and not _is_index_cache(output_prefix):
        raise ValueError(
            f"output_prefix {output_prefix!r} is a directory; give a file prefix inside it, "
            f"e.g. {output_prefix}/corpus"
        )

    tok = load_tokenizer(tokenizer, eod_token=eod_token)
    spec = getattr(tok, "spec", tokenizer)
    sources = _drop_empty_files(resolve_inputs(inputs, input_format=input_format))
    # Imported only now: megatron.core takes seconds to import, input errors should not wait for it.
    DType, IndexedDatasetBuilder = _import_megatron_writer()

    dtype = DType.optimal_dtype(tok.vocab_size)
    stats = stats if stats is not None else PreprocessStats()
    t0 = time.time()

    parent = os.path.dirname(output_prefix)
    if parent:
        os.makedirs(parent, exist_ok=True)
    tmp = f"{output_prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    eod = np.array([tok.eod], dtype=dtype)

    pool = None
    if workers > 1:
        if not isinstance(spec, (str, os.PathLike)):
            raise ValueError(
                "workers > 1 needs a tokenizer given by spec ('byte' or a path), not an object"
            )
        methods = multiprocessing.get_all_start_methods()
        # fork avoids re-importing torch/datasets per worker and needs no __main__ guard.
        ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(spec, eod_token, dtype))
    else:
        global _WORKER_TOKENIZER, _WORKER_DTYPE
        _WORKER_TOKENIZER, _WORKER_DTYPE = tok, dtype

    try:
        from tqdm.auto import tqdm

        for src in sources:
            with _datasets_progress(progress):
                ds = _load_source(src, split, hub_config, text_sample_by, cache_dir)
            if ds is None:
                log.warning("skipping %s: no records", src.describe())
                continue
            try:
                total = len(ds)
            except TypeError:
                total = None
            bar = tqdm(
                total=total,
                desc=f"tokenizing {src.describe()}",
                unit="doc",
                disable=not progress,
                dynamic_ncols=True,
                mininterval=0.5,
            )
            batches = _iter_batches(ds, src, text_key, stats, skip_missing_text)
            results = (
                pool.imap(_encode_batch, batches)
                if pool is not None
                else map(_encode_batch, batches)
            )
            for flat, lengths in results:
                offset = 0
                for n in lengths.tolist():
                    if n == 0:
                        stats.empty_documents += 1
                        continue
                    doc = flat[offset : offset + n]
                    offset += n
                    if append_eod:
                        doc = np.concatenate([doc, eod])
                    builder.add_document(doc, [doc.size])
                    stats.documents += 1
                    stats.tokens += int(doc.size)
                bar.update(len(lengths))
                bar.set_postfix(tokens=stats.tokens, refresh=False)
            bar.close()
        if stats.documents == 0:
            where = ", ".join(s.describe() for s in sources)
            if stats.empty_documents == 0 and stats.missing_text == 0:
                raise ValueError(f"{where}: no records, nothing to preprocess")
            raise ValueError(
                f"{where}: no non-empty documents ({stats.empty_documents} empty"
                + (f", {stats.missing_text} without {text_key!r}" if stats.missing_text else "")
                + f"); check text_key={text_key!r} and the input files"
            )
        builder.finalize(tmp + ".idx")
        os.replace(tmp + ".bin", output_prefix + ".bin")
        os.replace(tmp + ".idx", output_prefix + ".idx")
    except BaseException:
        try:
            builder.data_file.close()
        except Exception:
            pass
        for ext in (".bin", ".idx"):
            try:
                os.remove(tmp + ext)
            except FileNotFoundError:
                pass
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()

    stats.seconds = time.time() - t0
    meta = {
        "tokenizer": str(spec),
        "vocab_size": int(tok.vocab_size),
        "eod": int(tok.eod),
        "append_eod": bool(append_eod),
        "dtype": np.dtype(dtype).name,
        "documents": stats.documents,
        "empty_documents_skipped": stats.empty_documents,
        "missing_text_skipped": stats.missing_text,
        "tokens": stats.tokens,
        "inputs": [s.describe() if s.kind in ("hub", "dataset") else s.files for s in sources],
    }
    with open(output_prefix + ".meta.json", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    log.info(
        "wrote %s.{bin,idx}: %d documents, %d tokens (%d empty skipped) in %.1fs",
        output_prefix,
        stats.documents,
        stats.tokens,
        stats.empty_documents,
        stats.seconds,
    )
    return output_prefix


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prepare_data",
        description="Tokenize text (json/jsonl/parquet/csv/text files, or a HF Hub dataset "
        "when online) into a Megatron indexed dataset PREFIX.bin/PREFIX.idx.",
    )
    p.add_argument(
        "--input",
        "-i",
        nargs="+",
        required=True,
        help="files, directories, glob patterns, or a Hub dataset name (processed in order)",
    )
    p.add_argument(
        "--output-prefix",
        "-o",
        required=True,
        help="output path prefix (writes PREFIX.bin/.idx/.meta.json)",
    )
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="'byte' (built-in, no download) or a local HF tokenizer.json / directory "
        "(default: byte)",
    )
    p.add_argument(
        "--eod-token",
        default=None,
        help="end-of-document token of an HF tokenizer when not inferable",
    )
    p.add_argument("--text-key", default="text", help="column holding the text (default: text)")
    p.add_argument(
        "--skip-missing-text",
        action="store_true",
        help="skip records without the text field (or null there) and report their count; by "
        "default such a record is an error naming its file and line",
    )
    p.add_argument(
        "--workers",
        "-j",
        type=int,
        default=max(1, min(8, os.cpu_count() or 1)),
        help="tokenizer processes (default: min(8, CPUs))",
    )
    p.add_argument(
        "--no-append-eod",
        dest="append_eod",
        action="store_false",
        help="do not end documents with the EOD token",
    )
    p.add_argument(
        "--input-format",
        choices=_FORMATS,
        default=None,
        help="force the reader for all local files instead of inferring it from the suffix",
    )
    p.add_argument("--split", default="train", help="Hub dataset split (default: train)")
    p.add_argument("--hub-config", default=None, help="Hub dataset configuration name")
    p.add_argument(
        "--text-sample-by",
        choices=["line", "paragraph", "document"],
        default="line",
        help="documents in text files: one per line (default), paragraph or whole file",
    )
    p.add_argument("--cache-dir", default=None, help="datasets cache directory")
    p.add_argument(
        "--no-progress", dest="progress", action="store_false", help="hide the progress bar"
    )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_arg_parser().parse_args(argv)
    stats = PreprocessStats()
    try:
        prefix = preprocess(
            args.input,
            args.output_prefix,
            tokenizer=args.tokenizer,
            text_key=args.text_key,
            workers=args.workers,
            append_eod=args.append_eod,
            eod_token=args.eod_token,
            input_format=args.input_format,
            split=args.split,
            hub_config=args.hub_config,
            text_sample_by=args.text_sample_by,
            cache_dir=args.cache_dir,
            progress=args.progress,
            stats=stats,
            skip_missing_text=args.skip_missing_text,
        )
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"prepare_data: error: {exc}", file=sys.stderr)
        return 2
    missing = f", {stats.missing_text} without {args.text_key!r}" if stats.missing_text else ""
    print(
        f"wrote {prefix}.bin / {prefix}.idx: {stats.documents} documents, {stats.tokens} tokens "
        f"({stats.empty_documents} empty{missing} skipped) in {stats.seconds:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
