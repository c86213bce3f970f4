"""Training and validation data through Megatron's GPT dataset and blending builders.

Indexed datasets (``.bin/.idx``, written by :mod:`megatron_s2.training.preprocess`) are blended
and split by Megatron's ``BlendedMegatronDatasetBuilder`` into
:class:`~megatron.core.datasets.gpt_dataset.GPTDataset` samples of ``seq_length + 1`` tokens.
Documents are concatenated with their EOD tokens the Megatron way (a sample may span documents;
``train.reset_position_ids`` / ``train.eod_mask_loss`` change how boundaries are treated).
With ``train.pack_documents`` each micro-batch becomes one packed sequence of documents
(:func:`pack_documents`), split at the EOD token the datasets use (:attr:`Datasets.eod`).

Sample order is a pure function of the number of samples consumed so far: step ``i`` reads global
samples ``[i * global_batch, (i + 1) * global_batch)``, and data-parallel rank ``r`` takes its slice
of every micro-batch. Resuming therefore only needs ``consumed_samples`` (stored in checkpoints),
and it continues the same sample stream even at a different data-parallel size.

Before Megatron's builder runs, :func:`build_datasets` checks every corpus and the split
(:func:`check_corpora`): a truncated, swapped or corrupt ``.bin``/``.idx`` pair, a corpus written
with another tokenizer, and a split Megatron cannot build (an empty or token-less part loops
forever in ``GPTDataset``; a blend without weights asserts or runs short) raise
:class:`~.run_config.ConfigError` naming the file or setting and what to do. Splits the run does
not read are not built (validation when ``train.eval_iters=0``, the test split always).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import signal
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .run_config import ConfigError

__all__ = [
    "DatasetTokenizer",
    "CorpusError",
    "CorpusIndex",
    "check_indexed_dataset",
    "plan_splits",
    "check_corpora",
    "build_datasets",
    "EodFirst",
    "micro_batches",
    "chunk_micro_batches",
    "Datasets",
    "DocumentPack",
    "pack_documents",
]

log = logging.getLogger(__name__)


class DatasetTokenizer:
    """The few tokenizer attributes Megatron's datasets read, plus the identity used in cache keys.

    Megatron hashes the tokenizer's ``unique_identifiers`` into the names of its cached sample
    indices, so two tokenizers never share a cache. ``corpora`` (prefix -> fingerprint of its
    ``.idx``/``.bin``, see :attr:`CorpusIndex.fingerprint`) goes into the same identity: Megatron's
    own cache key names the data only by path, so a corpus re-written in place (e.g. by
    ``tools/prepare_data.py`` after a truncated copy) would otherwise reuse sample indices built
    for the old documents.
    """

    def __init__(self, tokenizer, corpora: Optional[dict] = None):
        self.vocab_size = tokenizer.vocab_size
        self.eod = tokenizer.eod
        pad = getattr(tokenizer, "pad", None)
        # Tokenizers without a pad token report EOD as pad; Megatron would mask EOD labels as
        # padding, so it only gets a pad id that is really distinct.
        if pad is not None and pad != tokenizer.eod:
            self.pad = pad
        self.unique_identifiers = {
            "class": type(tokenizer).__name__,
            "spec": str(getattr(tokenizer, "spec", type(tokenizer).__name__)),
            "vocab_size": tokenizer.vocab_size,
            "eod": tokenizer.eod,
        }
        if corpora:
            self.unique_identifiers["corpora"] = dict(corpora)


@dataclass
class Datasets:
    train: object
    valid: Optional[object]
    # The EOD id the datasets were built with (their position ids and EOD loss mask use it), so
    # that packing splits documents where the datasets see them end.
    eod: Optional[int] = None


# ---- up-front checks of the corpora --------------------------------------------------------------
class CorpusError(ConfigError):
    """A ``.bin``/``.idx`` pair that is missing, truncated or otherwise unusable (the CLI reports
    it like a config error: exit code 2, no traceback). ``problem`` is what is wrong, without
    the advice on what to do."""

    def __init__(self, message: str, problem: Optional[str] = None):
        super().__init__(message)
        self.problem = problem or message


class _Damaged(Exception):
    """Raised inside the structural checks; becomes a CorpusError with advice."""


# Megatron's index format (megatron/core/datasets/indexed_dataset.py, version 1): header, version
# (u64), dtype code (u8), sequence count (u64), document count (u64), then int32 sequence lengths,
# int64 sequence byte offsets into the .bin, int64 document boundaries (sequence indices).
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER_BYTES = 34
_IDX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
_IDX_NON_TOKEN_DTYPES = {6: "float64", 7: "float32"}
# Elements per chunk when validating the index arrays (bounded memory for huge corpora).
_CHECK_CHUNK = 1 << 22
# Tokens read from each end of the .bin to check the ids against the tokenizer's vocabulary.
_TOKEN_SAMPLE = 1 << 20
# The .idx is hashed whole up to this size, else its size, head and tail (cache fingerprint).
_FINGERPRINT_BYTES = 16 << 20
# More repetitions of a split than this cannot be meant (Megatron counts epochs one by one in
# Python and its document index holds epochs x documents entries).
MAX_EPOCHS = 1_000_000
_MAX_DOCUMENT_INDEX = (1 << 31) - 1
# Above this many repetitions of the training data a warning is printed.
WARN_EPOCHS = 100


def _redo(prefix: str) -> str:
    return (
        f"re-create it with tools/prepare_data.py --output-prefix {prefix} (or point data.blend "
        f"at an intact copy)"
    )


@dataclass
class CorpusIndex:
    """What the up-front checks read from one ``PREFIX.idx`` (arrays are read-only memmaps)."""

    prefix: str
    dtype: np.dtype
    sequence_lengths: np.ndarray
    num_tokens: int
    fingerprint: str

    @property
    def num_documents(self) -> int:
        """Sequences in the index: Megatron splits and samples by sequence, and
        ``tools/prepare_data.py`` writes one sequence per document."""
        return int(self.sequence_lengths.shape[0])


def check_indexed_dataset(
    prefix: str, *, vocab_size: Optional[int] = None, eod: Optional[int] = None
) -> CorpusIndex:
    """Check that ``prefix.bin``/``prefix.idx`` form an intact Megatron indexed dataset.

    Checks the index header, version and token dtype, that the index's size matches its sequence
    and document counts, that the sequence offsets are consistent with the lengths and that the
    ``.bin`` holds exactly the tokens the index describes (a truncated or swapped file fails
    here), that the document boundaries are well formed and the corpus is not empty. With
    ``vocab_size``/``eod`` (the training tokenizer's) it also compares them with
    ``prefix.meta.json`` when present and checks the token ids at both ends of the ``.bin``.

    Reads the index in bounded chunks (no full copy) and at most a few MiB of the ``.bin``.
    Raises :class:`CorpusError` naming the file and what to do.
    """
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    for path in (bin_path, idx_path):
        if not os.path.isfile(path):
            raise CorpusError(
                f"data.blend: {path} does not exist (prefixes name .bin/.idx pairs written by "
                f"tools/prepare_data.py, without the extension)"
            )
    try:
        dtype, lengths, num_tokens, fingerprint = _read_index(prefix)
    except _Damaged as exc:
        raise CorpusError(f"{exc}; {_redo(prefix)}", problem=str(exc)) from None
    if vocab_size is not None:
        _check_tokenizer_match(prefix, dtype, num_tokens, vocab_size, eod)
    return CorpusIndex(
        prefix=prefix,
        dtype=dtype,
        sequence_lengths=lengths,
        num_tokens=num_tokens,
        fingerprint=fingerprint,
    )


def _read_index(prefix: str):
    """Structural checks of the pair (see :func:`check_indexed_dataset`); raises _Damaged."""
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    idx_size = os.path.getsize(idx_path)
    bin_size = os.path.getsize(bin_path)
    with open(idx_path, "rb") as f:
        head = f.read(_IDX_HEADER_BYTES)
    if len(head) < _IDX_HEADER_BYTES or head[:9] != _IDX_MAGIC:
        what = "is truncated" if len(head) < _IDX_HEADER_BYTES else "has no Megatron index header"
        raise _Damaged(
            f"{idx_path} {what} ({idx_size} bytes): not a Megatron indexed dataset index"
        )
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise _Damaged(f"{idx_path}: index version {version} is not supported (expected 1)")
    if code not in _IDX_DTYPES:
        kind = _IDX_NON_TOKEN_DTYPES.get(code, f"unknown code {code}")
        raise _Damaged(f"{idx_path}: token dtype {kind} is not an integer token type")
    dtype = np.dtype(_IDX_DTYPES[code])
    expected_idx = _IDX_HEADER_BYTES + 12 * n_seq + 8 * n_doc
    # Multimodal indices append one int8 mode per sequence; Megatron's GPT path ignores them.
    if idx_size not in (expected_idx, expected_idx + n_seq):
        state = "truncated" if idx_size < expected_idx else "longer than its header describes"
        raise _Damaged(
            f"{idx_path} is {state}: its header announces {n_seq} sequences and {n_doc} document "
            f"boundaries ({expected_idx} bytes), the file has {idx_size} bytes"
        )
    if n_seq == 0:
        raise _Damaged(f"{idx_path}: the corpus holds no documents")
    lengths = np.memmap(
        idx_path, dtype=np.int32, mode="r", offset=_IDX_HEADER_BYTES, shape=(n_seq,)
    )
    pointers = np.memmap(
        idx_path, dtype=np.int64, mode="r", offset=_IDX_HEADER_BYTES + 4 * n_seq, shape=(n_seq,)
    )
    docs = np.memmap(
        idx_path, dtype=np.int64, mode="r", offset=_IDX_HEADER_BYTES + 12 * n_seq, shape=(n_doc,)
    )
    itemsize = dtype.itemsize
    position = 0  # byte offset of the next sequence
    for start in range(0, n_seq, _CHECK_CHUNK):
        stop = min(n_seq, start + _CHECK_CHUNK)
        chunk = lengths[start:stop].astype(np.int64)
        if chunk.min() < 0:
            bad = start + int(np.argmax(chunk < 0))
            raise _Damaged(f"{idx_path} is corrupt: sequence {bad} has length {int(lengths[bad])}")
        ends = position + np.cumsum(chunk * itemsize)
        starts = np.concatenate(([position], ends[:-1]))
        mismatch = np.flatnonzero(pointers[start:stop] != starts)
        if mismatch.size:
            bad = start + int(mismatch[0])
            raise _Damaged(
                f"{idx_path} is corrupt: sequence {bad} starts at byte {int(pointers[bad])} of "
                f"the .bin, its predecessors' lengths put it at {int(starts[mismatch[0]])}"
            )
        position = int(ends[-1])
    if bin_size != position:
        state = "truncated" if bin_size < position else "longer than its index describes"
        raise _Damaged(
            f"{bin_path} is {state}: {idx_path} describes {n_seq} documents of "
            f"{position // itemsize} {dtype.name} tokens ({position} bytes), the .bin has "
            f"{bin_size} bytes (a partial copy, or a .bin/.idx pair from different runs)"
        )
    if n_doc < 2 or docs[0] != 0 or docs[-1] != n_seq:
        raise _Damaged(
            f"{idx_path} is corrupt: its document boundaries must run from 0 to the sequence "
            f"count {n_seq}, found {n_doc} boundaries"
            + (f" from {int(docs[0])} to {int(docs[-1])}" if n_doc else "")
        )
    for start in range(0, n_doc, _CHECK_CHUNK):
        chunk = docs[start : min(n_doc, start + _CHECK_CHUNK + 1)]
        if np.any(np.diff(chunk) < 0):
            raise _Damaged(f"{idx_path} is corrupt: its document boundaries are not in order")
    num_tokens = position // itemsize
    return dtype, lengths, num_tokens, _fingerprint(idx_path, idx_size, bin_size)


def _check_tokenizer_match(
    prefix: str, dtype: np.dtype, num_tokens: int, vocab_size: int, eod: Optional[int]
) -> None:
    """The corpus's token ids must fit the training tokenizer (else the embedding lookup fails at
    the first step, on a GPU as an opaque device-side assert)."""
    meta_path = prefix + ".meta.json"
    meta = None
    if os.path.isfile(meta_path):
        try:
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            meta = None  # informational only: the token check below still runs
    if isinstance(meta, dict):
        written = (meta.get("vocab_size"), meta.get("eod"))
        if written[0] is not None and (
            written[0] != vocab_size or (eod is not None and written[1] != eod)
        ):
            raise CorpusError(
                f"{prefix}: written with tokenizer {meta.get('tokenizer')!r} (vocabulary "
                f"{written[0]}, EOD {written[1]}, see {meta_path}), but data.tokenizer has "
                f"vocabulary {vocab_size}, EOD {eod}; set data.tokenizer to the tokenizer that "
                f"prepared the corpus, or re-run tools/prepare_data.py --tokenizer ..."
            )
    if num_tokens == 0:
        return
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r", shape=(num_tokens,))
    for part in (tokens[:_TOKEN_SAMPLE], tokens[max(0, num_tokens - _TOKEN_SAMPLE) :]):
        if part.size == 0:
            continue
        low, high = int(part.min()), int(part.max())
        if low < 0 or high >= vocab_size:
            bad = high if high >= vocab_size else low
            raise CorpusError(
                f"{prefix}.bin holds token id {bad}, outside the vocabulary of data.tokenizer "
                f"(0..{vocab_size - 1}): the corpus was prepared with another tokenizer, or the "
                f"file is corrupt; set data.tokenizer to the tokenizer that prepared it, or "
                f"re-run tools/prepare_data.py"
            )


def _fingerprint(idx_path: str, idx_size: int, bin_size: int) -> str:
    h = hashlib.sha256(f"{idx_size}:{bin_size}:".encode())
    with open(idx_path, "rb") as f:
        if idx_size <= _FINGERPRINT_BYTES:
            h.update(f.read())
        else:
            h.update(f.read(_FINGERPRINT_BYTES // 2))
            f.seek(idx_size - _FINGERPRINT_BYTES // 2)
            h.update(f.read())
    return h.hexdigest()[:16]


def _rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _split_range(bookends, num_docs: int) -> tuple[int, int]:
    # Exactly Megatron's rounding (BlendedMegatronDatasetBuilder._build_megatron_dataset_splits).
    return int(round(bookends[0] * float(num_docs))), int(round(bookends[1] * float(num_docs)))


def _min_documents(matrix, needed: list[int]) -> Optional[int]:
    """The smallest corpus size that gives every needed split at least one document."""
    for n in range(1, 100_001):
        if all(
            matrix[i] is not None and _split_range(matrix[i], n)[1] > _split_range(matrix[i], n)[0]
            for i in needed
        ):
            return n
    return None


def _suggest_split(num_docs: int, needed: list[int]) -> Optional[str]:
    """A 'train,valid,0' split that gives every needed part a document of a corpus this size."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
    )

    for valid in range(1, 51) if 1 in needed else [0]:
        matrix = convert_split_vector_to_split_matrix([(100 - valid) / 100, valid / 100, 0.0])
        ranges = [_split_range(matrix[i], num_docs) for i in needed if matrix[i] is not None]
        if len(ranges) == len(needed) and all(end > beg for beg, end in ranges):
            return f"{100 - valid},{valid},0"
    return None


_SPLIT_NAMES = ("train", "valid", "test")


def plan_splits(
    corpora: list[CorpusIndex],
    weights: Optional[list[float]],
    *,
    split: str,
    seq_length: int,
    train_samples: int,
    valid_samples: int,
) -> list[Optional[tuple[float, float]]]:
    """Check up front that Megatron's builder can build the needed splits; return the split
    matrix to build (Megatron's ``split_matrix`` with the splits this run does not read set to
    None: the test split always, the validation split when ``valid_samples`` is 0).

    Megatron's ``GPTDataset`` counts epochs until they hold the requested samples, so a split
    with zero tokens loops forever (any corpus of fewer than ~25 documents at ``data.split
    98,2,0``), and a blend without weights asserts on a corpus contributing no sample. Those
    cases, a split given no weight, a blend without weights that is too short for the run, and
    absurd repetition counts raise :class:`ConfigError` naming the corpus, the setting and what
    to do. Pure arithmetic on the index (no Megatron dataset is built).
    """
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    needed = [0] + ([1] if valid_samples > 0 else [])
    sizes = [train_samples, valid_samples]
    if matrix[0] is None:
        raise ConfigError(f"data.split {split!r} gives the training part no weight")
    if valid_samples > 0 and matrix[1] is None:
        raise ConfigError(
            f"data.split {split!r} leaves no validation data but train.eval_iters > 0; give the "
            f'valid split a weight (e.g. data.split="98,2,0") or set train.eval_iters=0'
        )
    if weights is not None:
        total = float(sum(weights))
        weights = [w / total for w in weights]
    unweighted_blend = weights is None and len(corpora) > 1
    repeated = []
    for i in needed:
        name = _SPLIT_NAMES[i]
        samples_one_pass = 0
        for k, corpus in enumerate(corpora):
            n = corpus.num_documents
            beg, end = _split_range(matrix[i], n)
            tokens = int(corpus.sequence_lengths[beg:end].sum(dtype=np.int64))
            if end <= beg or tokens == 0:
                counts = ", ".join(
                    f"{_split_range(matrix[j], n)[1] - _split_range(matrix[j], n)[0]} {nm}"
                    for j, nm in enumerate(_SPLIT_NAMES)
                    if matrix[j] is not None
                )
                what = "no documents" if end <= beg else f"{end - beg} documents but no tokens"
                fixes = []
                least = _min_documents(matrix, needed)
                if end <= beg and least is not None:
                    fixes.append(f"use a corpus of at least {least} documents")
                other = _suggest_split(n, needed) if end <= beg else None
                fixes.append(
                    f"give the {name} part a larger data.split weight"
                    + (f" (e.g. data.split={other})" if other else "")
                )
                if i == 1:
                    fixes.append("set train.eval_iters=0 to train without validation")
                raise ConfigError(
                    f"data.split {split!r} leaves {what} for {name} in {corpus.prefix} ({n} "
                    f"documents: {counts}), so Megatron's dataset builder would never finish; "
                    + "; or ".join(fixes)
                )
            if unweighted_blend:
                # One pass over every corpus (Megatron's rule for a blend without weights).
                own = (tokens - 1) // seq_length
                if own == 0:
                    raise ConfigError(
                        f"data.blend: the {name} part of {corpus.prefix} ({end - beg} documents, "
                        f"{tokens} tokens) holds no sample of model.seq_length + 1 = "
                        f"{seq_length + 1} tokens, and a blend without weights reads each corpus "
                        f"once; give the blend weights ([[weight, prefix], ...]: corpora are "
                        f"then repeated as needed) or leave this corpus out"
                    )
                samples_one_pass += own
                continue
            requested = (
                sizes[i]
                if weights is None
                else math.ceil(math.ceil(sizes[i] * weights[k]) * 1.005)  # Megatron's surplus
            )
            epochs = max(1, -(-(requested * seq_length + 1) // tokens))
            if epochs > MAX_EPOCHS or epochs * (end - beg) > _MAX_DOCUMENT_INDEX:
                raise ConfigError(
                    f"{corpus.prefix}: its {name} part ({end - beg} documents, {tokens} tokens) "
                    f"would have to be repeated {epochs} times for {requested} samples of "
                    f"{seq_length + 1} tokens; use a larger corpus or fewer train.train_iters"
                )
            if i == 0 and epochs > WARN_EPOCHS:
                repeated.append((corpus.prefix, end - beg, tokens, epochs))
        if unweighted_blend and samples_one_pass < sizes[i]:
            need = (
                "train.train_iters x train.global_batch_size"
                if i == 0
                else "train.eval_iters x train.global_batch_size"
            )
            raise ConfigError(
                f"data.blend without weights reads each corpus once: its {name} part holds "
                f"{samples_one_pass} samples of {seq_length + 1} tokens, but {need} = "
                f"{sizes[i]}; give the blend weights ([[weight, prefix], ...]: corpora are then "
                f"repeated as needed), add data, or lower {need.split(' x ')[0]}"
            )
    if _rank0():
        for prefix, docs, tokens, epochs in repeated:
            log.warning(
                "the training part of %s (%d documents, %d tokens) is repeated %d times in this "
                "run",
                prefix,
                docs,
                tokens,
                epochs,
            )
    return [matrix[i] if i in needed else None for i in range(len(matrix))]


def check_corpora(
    prefixes: list[str],
    weights: Optional[list[float]],
    *,
    tokenizer,
    seq_length: int,
    split: str,
    train_samples: int,
    valid_samples: int,
) -> tuple[list[CorpusIndex], list[Optional[tuple[float, float]]]]:
    """All up-front data checks (:func:`check_indexed_dataset` on every prefix, then
    :func:`plan_splits`); :func:`build_datasets` runs them before Megatron's builder."""
    if not prefixes:
        raise ConfigError("data.blend is empty")
    corpora = [
        check_indexed_dataset(p, vocab_size=tokenizer.vocab_size, eod=tokenizer.eod)
        for p in prefixes
    ]
    matrix = plan_splits(
        corpora,
        weights,
        split=split,
        seq_length=seq_length,
        train_samples=train_samples,
        valid_samples=valid_samples,
    )
    return corpora, matrix


def build_datasets(
    prefixes: list[str],
    weights: Optional[list[float]],
    *,
    tokenizer,
    seq_length: int,
    seed: int,
    split: str,
    train_samples: int,
    valid_samples: int,
    cache_dir: Optional[str] = None,
    reset_position_ids: bool = False,
    eod_mask_loss: bool = False,
    eod_first: bool = False,
) -> Datasets:
    """Build the blended train/valid GPT datasets (call on every rank, after torch.distributed).

    ``weights`` None weighs corpora by their size. First runs :func:`check_corpora`: every
    ``.bin``/``.idx`` pair is checked for damage and for the tokenizer, and the split is checked
    to be buildable, so that no run hangs in Megatron's builder or fails at its first step; a
    problem raises :class:`ConfigError` (:class:`CorpusError` for a damaged file) naming the file
    or setting. Only the needed splits are built: no validation data when ``valid_samples`` is 0
    (``train.eval_iters=0`` or ``train.eval_interval=0``), never the test split. ``eod_first``
    (``train.eod_first``): both splits start every sample with EOD (:class:`EodFirst`).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    corpora, matrix = check_corpora(
        prefixes,
        weights,
        tokenizer=tokenizer,
        seq_length=seq_length,
        split=split,
        train_samples=train_samples,
        valid_samples=valid_samples,
    )
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
    dataset_tokenizer = DatasetTokenizer(tokenizer, {c.prefix: c.fingerprint for c in corpora})
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=split,
        path_to_cache=cache_dir,
        tokenizer=dataset_tokenizer,
        reset_position_ids=reset_position_ids,
        # No dense mask: it would cost s^2 memory per sample and the S2 kernels take none.
        # Documents are kept apart by packing instead (train.pack_documents, pack_documents).
        reset_attention_mask=False,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=False,
    )
    # Splits this run does not read are not built at all (the train part's bounds are unchanged).
    config.split_matrix = matrix
    # Every rank builds (rank 0 first writes the index cache, the builder synchronises the rest):
    # our batches are small and reading them on every rank avoids a broadcast per micro-batch.
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, valid_samples, 0], lambda: True, config
    ).build()
    # Safety nets: plan_splits already rules these out.
    if train is None or len(train) < train_samples:
        raise ConfigError(
            f"data.split {split!r} leaves too little training data: "
            f"{0 if train is None else len(train)} of {train_samples} samples"
        )
    if valid_samples > 0 and (valid is None or len(valid) == 0):
        raise ConfigError(
            f"data.split {split!r} leaves no validation data but "
            f"train.eval_iters > 0; give the valid split a weight or set "
            f"train.eval_iters=0"
        )
    if eod_first:
        eod = dataset_tokenizer.eod
        train = EodFirst(train, eod, eod_mask_loss=eod_mask_loss)
        valid = EodFirst(valid, eod, eod_mask_loss=eod_mask_loss) if valid is not None else None
    return Datasets(train=train, valid=valid, eod=dataset_tokenizer.eod)


class EodFirst(torch.utils.data.Dataset):
    """A GPT dataset whose every sample starts with the EOD token (``train.eod_first``).

    Item ``i`` is the wrapped dataset's sample moved one token right behind ``eod``: ``tokens``
    ``[eod, t0, ..., t(s-2)]``, ``labels`` ``[t0, t1, ..., t(s-1)]`` (position 0 predicts the
    sample's first token from the EOD, as a document's first token follows an EOD inside the
    packed stream), ``loss_mask`` likewise moved, its new first entry 1 (0 where
    ``eod_mask_loss`` and ``t0`` is EOD, Megatron's rule for an EOD label); position ids are
    unchanged. Nothing of the sample's start is lost, which matters where documents start
    exactly at a sample's first token (the retrieval corpora's trials, a needle at depth 0
    among them); its last label, ``t(s)``, is left out. Tensors ``[seq_length]``.
    """

    def __init__(self, dataset, eod: int, *, eod_mask_loss: bool = False):
        self.dataset, self.eod, self.eod_mask_loss = dataset, int(eod), eod_mask_loss

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index) -> dict:
        sample = dict(self.dataset[index])
        tokens, labels, mask = sample["tokens"], sample["labels"], sample["loss_mask"]
        first = tokens[:1]
        first_masked = self.eod_mask_loss and int(first) == self.eod
        sample.update(
            tokens=torch.cat([torch.full_like(first, self.eod), tokens[:-1]]),
            labels=torch.cat([first, labels[:-1]]),
            loss_mask=torch.cat([torch.full_like(mask[:1], 0 if first_masked else 1), mask[:-1]]),
        )
        return sample


class _MicroBatchSampler(torch.utils.data.Sampler):
    """Index lists of this rank's micro-batches, starting after ``consumed`` global samples."""

    def __init__(
        self, total: int, consumed: int, micro_batch_size: int, dp_rank: int, dp_size: int
    ):
        self.total, self.consumed = total, consumed
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self):
        stride = self.mbs * self.dp_size
        start = self.consumed
        while start + stride <= self.total:
            first = start + self.dp_rank * self.mbs
            yield list(range(first, first + self.mbs))
            start += stride

    def __len__(self):
        return max(0, (self.total - self.consumed) // (self.mbs * self.dp_size))


def _ignore_sigterm(_worker_id: int) -> None:
    # Slurm signals every process of a job step: a loader worker killed by that SIGTERM would
    # crash the trainer before its graceful-stop checkpoint. Workers exit when their loader is
    # shut down (the trainer closes its iterators), not on the signal.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def micro_batches(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    cycle: bool = False,
) -> Iterator[dict]:
    """Iterate this data-parallel rank's micro-batches (dicts of CPU tensors).

    ``cycle`` restarts from sample 0 when the dataset is exhausted (used for validation, which
    reads the same held-out samples at every evaluation).
    """
    while True:
        sampler = _MicroBatchSampler(
            len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size
        )
        if len(sampler) == 0:
            raise ValueError(
                f"dataset of {len(dataset)} samples has no micro-batch left after "
                f"{consumed_samples} consumed samples"
            )
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=num_workers,
            persistent_workers=False,
            worker_init_fn=_ignore_sigterm if num_workers else None,
        )
        yield from loader
        if not cycle:
            return
        consumed_samples = 0


def chunk_micro_batches(
    num_chunks: int,
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    cycle: bool = False,
) -> list[Iterator[dict]]:
    """One :func:`micro_batches` iterator per model chunk, all over the same samples: an
    interleaved pipeline schedule calls ``next()`` once per chunk for every micro-batch."""
    return [
        micro_batches(
            dataset,
            consumed_samples,
            micro_batch_size,
            dp_rank,
            dp_size,
            num_workers=num_workers,
            cycle=cycle,
        )
        for _ in range(num_chunks)
    ]


# ---- packed documents (train.pack_documents) ---------------------------------------------------
# The micro-batch fields a pack flattens; others (an attention mask) are dropped.
PACKED_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass(frozen=True)
class DocumentPack:
    """One micro-batch as a single sequence of documents (Megatron's THD layout).

    ``batch``: ``tokens``, ``labels``, ``loss_mask``, ``position_ids``, each ``[1, b * s]``
    (positions restart at 0 at every document). Document ``i`` is tokens
    ``cu_seqlens[i]:cu_seqlens[i + 1]``; ``cu_seqlens`` is int32 ``[num_docs + 1]`` on the host,
    ``max_seqlen`` the longest document (a Python int).
    """

    batch: dict
    cu_seqlens: torch.Tensor
    max_seqlen: int

    @property
    def num_documents(self) -> int:
        return self.cu_seqlens.numel() - 1


def pack_documents(batch: dict, eod: int) -> DocumentPack:
    """Pack a micro-batch of ``[b, s]`` CPU tensors into one ``[1, b * s]`` sequence of documents.

    A document starts at every sample's first token and at the token after each EOD (an EOD
    ends its document; an EOD as a sample's last token starts nothing). So consecutive EODs make
    one-token documents, and no document is empty. Labels and the loss mask are flattened
    unchanged, so the per-token losses and their sum (the 3-tuple loss) cover the same tokens as
    the unpacked batch; ``train.eod_mask_loss`` has already masked them in the dataset.

    Everything is computed on the host, before the batch goes to the device: ``max_seqlen`` is a
    Python int and nothing reads device memory back. ``eod``: the id the datasets were built
    with (:attr:`Datasets.eod`).
    """
    tokens = batch["tokens"]
    if tokens.dim() != 2:
        raise ValueError(f"pack_documents: tokens must be [b, s], got shape {tuple(tokens.shape)}")
    if tokens.device.type != "cpu":
        # On a GPU the lengths below would be read back per micro-batch (a device sync).
        raise ValueError("pack_documents: pack the micro-batch on the host, before moving it")
    b, s = tokens.shape
    total = b * s
    first = torch.zeros((b, s), dtype=torch.bool)
    first[:, 0] = True
    first[:, 1:] = tokens[:, :-1] == eod
    starts = first.view(-1).nonzero().view(-1)
    cu_seqlens = torch.empty(starts.numel() + 1, dtype=torch.int32)
    cu_seqlens[:-1] = starts
    cu_seqlens[-1] = total
    lengths = cu_seqlens.diff()
    max_seqlen = int(lengths.max())
    positions = torch.arange(total) - torch.repeat_interleave(starts, lengths.long())
    packed = {k: batch[k].reshape(1, total) for k in PACKED_KEYS if k in batch}
    packed["position_ids"] = positions.view(1, total)
    return DocumentPack(packed, cu_seqlens, max_seqlen)
