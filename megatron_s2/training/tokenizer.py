"""Tokenizers for preprocessing and training.

``load_tokenizer(spec)`` is the single entry point:

* ``"byte"``: a built-in byte-level tokenizer (UTF-8 bytes 0..255 plus ``<eod>`` and ``<pad>``).
  It needs no files and no network, which is what the built-in demo relies on.
* a local path to a Hugging Face tokenizer: either a ``tokenizer.json`` file or a directory that
  contains one (as written by ``tokenizers.Tokenizer.save`` or ``save_pretrained``). The
  end-of-document token is taken from ``tokenizer_config.json`` (``eos_token``) when present, else
  from a short list of conventional names; pass ``eod_token=`` to choose it explicitly.

Every tokenizer exposes ``.vocab_size``, ``.eod``, ``.pad``, ``.encode(text) -> list[int]``,
``.decode(ids) -> str`` and ``.spec`` (the string that reloads it). The module imports no torch so
that preprocessing workers start quickly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Optional

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "padded_vocab_size",
]

# Tried in order when a tokenizer does not say which token ends a document. The names cover GPT-2
# style BPE, Llama/SentencePiece, BERT-style and the Llama-3 family.
_EOD_CANDIDATES = (
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "[EOS]",
    "<|eot_id|>",
    "<eod>",
)
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")


def padded_vocab_size(vocab_size: int, multiple: int = 128, tp: int = 1) -> int:
    """Round ``vocab_size`` up to a multiple of ``multiple * tp``.

    Megatron splits the embedding and output layer across tensor-parallel ranks, so the padded size
    must divide by ``tp``; a multiple of 128 also keeps the output GEMM on fast tile shapes. The
    extra rows are never produced by the tokenizer.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if multiple <= 0 or tp <= 0:
        raise ValueError(f"multiple and tp must be positive, got multiple={multiple}, tp={tp}")
    step = multiple * tp
    return ((vocab_size + step - 1) // step) * step


class ByteTokenizer:
    """UTF-8 byte tokenizer: ids 0..255 are bytes, then ``<eod>`` (256) and ``<pad>`` (257).

    ``vocab_size`` is the number of ids the tokenizer can produce (258); the model pads it (see
    ``padded_vocab_size``). Decoding skips special ids and replaces invalid UTF-8 so that sampled
    byte sequences always decode.
    """

    spec = "byte"
    eod = 256
    pad = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=258, eod=256, pad=257)"


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a local ``tokenizer.json``.

    Args:
        path: ``tokenizer.json`` or a directory containing it.
        eod_token: token string that ends a document; default: ``eos_token`` from
            ``tokenizer_config.json`` next to the file, else the first of the conventional names
            (``<|endoftext|>``, ``</s>``, ...) that is in the vocabulary.
    """

    def __init__(self, path: str | os.PathLike, eod_token: Optional[str] = None):
        from tokenizers import Tokenizer

        path = Path(path).expanduser()
        if path.is_dir():
            file = path / "tokenizer.json"
            if not file.is_file():
                raise FileNotFoundError(
                    f"tokenizer: directory {path} has no tokenizer.json; save the tokenizer with "
                    "`tokenizers.Tokenizer.save(...)` or `save_pretrained(...)` of a fast "
                    "tokenizer, or use tokenizer='byte'"
                )
        elif path.is_file():
            file = path
        else:
            raise FileNotFoundError(
                f"tokenizer: {str(path)!r} is neither 'byte' nor an existing tokenizer.json "
                "file or directory (only local tokenizers are supported; download one first)"
            )
        self.spec = str(path)
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise ValueError(f"tokenizer: cannot load {file}: {exc}") from exc

        config = _read_tokenizer_config(file.parent)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        if eod_token is None:
            eod_token = _token_content(config.get("eos_token"))
            if eod_token is not None and eod_token not in vocab:
                eod_token = None
            if eod_token is None:
                eod_token = next((t for t in _EOD_CANDIDATES if t in vocab), None)
            if eod_token is None:
                raise ValueError(
                    f"tokenizer: cannot tell which token of {file} ends a document "
                    "(no eos_token in tokenizer_config.json and none of "
                    f"{list(_EOD_CANDIDATES)} in the vocabulary); "
                    "pass eod_token= (CLI: --eod-token)"
                )
        elif eod_token not in vocab:
            raise ValueError(
                f"tokenizer: eod_token {eod_token!r} is not in the vocabulary of {file}"
            )
        self.eod_token = eod_token
        self.eod = vocab[eod_token]
        pad_token = _token_content(config.get("pad_token"))
        if pad_token not in vocab:
            pad_token = next((t for t in _PAD_CANDIDATES if t in vocab), None)
        # Without a pad token, padding with EOD is harmless: padded positions are loss-masked.
        self.pad = vocab[pad_token] if pad_token is not None else self.eod
        # get_vocab_size counts added tokens; some saved tokenizers have ids beyond it, so take
        # the larger value to be safe for the embedding size.
        self.vocab_size = max(
            self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1
        )

    def encode(self, text: str) -> list[int]:
        # Special tokens such as BOS would otherwise be inserted per document; the document
        # boundary is marked with EOD alone.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.spec!r}, vocab_size={self.vocab_size}, eod={self.eod})"


def _read_tokenizer_config(directory: Path) -> dict:
    cfg = directory / "tokenizer_config.json"
    if not cfg.is_file():
        return {}
    try:
        return json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer: malformed {cfg}: {exc}") from exc


def _token_content(value) -> Optional[str]:
    # transformers writes special tokens either as a string or as {"content": ..., ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(spec="byte", eod_token: Optional[str] = None):
    """Return a tokenizer for ``spec``: ``"byte"``, a local HF tokenizer path, or a tokenizer
    object.

    Objects that already have ``encode``/``decode``/``eod``/``vocab_size`` are returned unchanged.
    """
    if spec is None:
        raise ValueError("tokenizer: no tokenizer given; use 'byte' or a local tokenizer path")
    if not isinstance(spec, (str, os.PathLike)):
        missing = [a for a in ("encode", "decode", "eod", "vocab_size") if not hasattr(spec, a)]
        if missing:
            raise TypeError(f"tokenizer: object {spec!r} lacks {missing}")
        return spec
    if str(spec) == "byte":
        if eod_token is not None:
            raise ValueError(
                "tokenizer: eod_token cannot be chosen for the byte tokenizer (it is <eod>=256)"
            )
        return ByteTokenizer()
    return HFTokenizer(spec, eod_token=eod_token)
