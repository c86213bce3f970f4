"""Tokenizers, preprocessing to Megatron indexed datasets, and the synthetic demo corpus.

Every round-trip reads the output back with Megatron-core's own ``IndexedDataset``.
"""

import json
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_s2.training.demo_corpus import demo_prefix, ensure_demo_data, generate_corpus
from megatron_s2.training.preprocess import PreprocessStats, preprocess
from megatron_s2.training.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    padded_vocab_size,
)

IndexedDataset = pytest.importorskip("megatron.core.datasets.indexed_dataset").IndexedDataset

REPO = Path(__file__).resolve().parents[2]

DOCS = [
    "hello world",
    "ünïcödé ✓ and emoji 🙂",
    "",  # empty documents are skipped, as in Megatron's preprocess_data
    "line one\nline two",
    "x" * 5000,
] + [f"document {i}: " + "abc " * (i % 13) for i in range(300)]


def read_back(prefix):
    """Documents of an indexed dataset as lists of ints (one sequence per document)."""
    ds = IndexedDataset(str(prefix))
    doc_idx = ds.document_indices
    assert doc_idx[0] == 0 and len(doc_idx) == len(ds) + 1
    # One sequence per document: document boundaries are sequence boundaries.
    assert list(doc_idx) == list(range(len(ds) + 1))
    return [ds[i].tolist() for i in range(len(ds))]


def expected(tok, texts, append_eod=True):
    out = []
    for t in texts:
        ids = tok.encode(t)
        if ids:
            out.append(ids + ([tok.eod] if append_eod else []))
    return out


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, key: t}) + "\n")
    return str(path)


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "hf_cache")


# ---- tokenizers --------------------------------------------------------------------------------
def test_byte_tokenizer_roundtrip():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eod, tok.pad) == (258, 256, 257)
    text = "key=value ✓ 🙂\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eod, tok.pad]) == text  # special ids are dropped
    assert tok.decode([0xF0, 0x9F]) == "\ufffd"  # truncated UTF-8 still decodes


def test_padded_vocab_size():
    assert padded_vocab_size(258) == 384
    assert padded_vocab_size(258, multiple=8, tp=2) == 272
    assert padded_vocab_size(256, multiple=128) == 256
    with pytest.raises(ValueError, match="vocab_size"):
        padded_vocab_size(0)


def build_hf_tokenizer(directory, eos="<|endoftext|>", config=None):
    """Train a tiny BPE tokenizer with the `tokenizers` library and save it like save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<pad>"] + ([eos] if eos else [])
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([d for d in DOCS if d] * 3, trainer=trainer)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_hf_tokenizer_from_local_path(tmp_path):
    d = build_hf_tokenizer(tmp_path / "tok")
    for spec in (str(d), str(d / "tokenizer.json")):
        tok = load_tokenizer(spec)
        assert isinstance(tok, HFTokenizer)
        assert tok.eod == tok._tok.token_to_id("<|endoftext|>")
        assert tok.pad == tok._tok.token_to_id("<pad>")
        assert tok.vocab_size >= 258
        text = "hello world, ünïcödé"
        assert tok.decode(tok.encode(text)) == text
        assert tok.eod not in tok.encode(text)


def test_hf_tokenizer_eod_choice(tmp_path):
    # tokenizer_config.json's eos_token (either form transformers writes) wins over the defaults.
    d = build_hf_tokenizer(tmp_path / "cfg", config={"eos_token": {"content": "<pad>"}})
    assert load_tokenizer(str(d)).eod == load_tokenizer(str(d))._tok.token_to_id("<pad>")
    # An explicit token wins over everything.
    d2 = build_hf_tokenizer(tmp_path / "plain")
    tok = load_tokenizer(str(d2), eod_token="<unk>")
    assert tok.eod == tok._tok.token_to_id("<unk>")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        load_tokenizer(str(d2), eod_token="<nope>")
    # Nothing recognisable: the error names the option to set.
    d3 = build_hf_tokenizer(tmp_path / "noeos", eos=None)
    with pytest.raises(ValueError, match="eod_token"):
        load_tokenizer(str(d3))


def test_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither 'byte' nor"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path / "empty"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot load"):
        load_tokenizer(str(bad))
    with pytest.raises(ValueError, match="byte tokenizer"):
        load_tokenizer("byte", eod_token="</s>")


# ---- preprocessing round trips ----------------------------------------------------------------
@pytest.mark.parametrize("workers", [1, 3])
def test_roundtrip_byte_jsonl(tmp_path, cache, workers):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    stats = PreprocessStats()
    prefix = preprocess(
        src,
        tmp_path / "out" / "corpus",
        workers=workers,
        cache_dir=cache,
        progress=False,
        stats=stats,
    )
    assert prefix == str(tmp_path / "out" / "corpus")
    tok = ByteTokenizer()
    want = expected(tok, DOCS)
    assert read_back(prefix) == want
    assert stats.documents == len(want) and stats.empty_documents == 1
    assert stats.tokens == sum(map(len, want))
    # Every document ends with exactly one EOD and contains no other.
    for doc in read_back(prefix):
        assert doc[-1] == tok.eod and tok.eod not in doc[:-1]
    meta = json.loads(Path(prefix + ".meta.json").read_text())
    assert meta["tokenizer"] == "byte" and meta["documents"] == len(want)
    assert IndexedDataset(prefix).index.dtype == np.uint16


def test_output_identical_for_any_worker_count(tmp_path, cache):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS * 8)  # several batches
    a = preprocess(src, tmp_path / "a", workers=1, cache_dir=cache, progress=False)
    b = preprocess(src, tmp_path / "b", workers=4, cache_dir=cache, progress=False)
    for ext in (".bin", ".idx"):
        assert Path(a + ext).read_bytes() == Path(b + ext).read_bytes()


def test_no_eod(tmp_path, cache):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    prefix = preprocess(src, tmp_path / "noeod", append_eod=False, cache_dir=cache, progress=False)
    assert read_back(prefix) == expected(ByteTokenizer(), DOCS, append_eod=False)


def test_roundtrip_hf_tokenizer_multiprocess(tmp_path, cache):
    d = build_hf_tokenizer(tmp_path / "tok")
    src = write_jsonl(tmp_path / "in.jsonl", DOCS * 4)
    prefix = preprocess(
        src, tmp_path / "hf", tokenizer=str(d), workers=2, cache_dir=cache, progress=False
    )
    tok = load_tokenizer(str(d))
    assert read_back(prefix) == expected(tok, DOCS * 4)


def test_input_formats(tmp_path, cache):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [d for d in DOCS if d and "\n" not in d][:50]
    src = tmp_path / "in"
    src.mkdir()
    jsonl = write_jsonl(src / "a.jsonl", texts[:10], key="body")
    json_array = src / "b.json"
    json_array.write_text(json.dumps([{"body": t} for t in texts[10:20]]))
    parquet = src / "c.parquet"
    pq.write_table(pa.table({"body": texts[20:30], "n": list(range(10))}), parquet)
    txt = src / "d.txt"
    txt.write_text("\n".join(texts[30:40]) + "\n")
    tok = ByteTokenizer()

    # Each format alone, and all of them in one call (order preserved).
    for path, part in (
        (jsonl, texts[:10]),
        (json_array, texts[10:20]),
        (parquet, texts[20:30]),
        (txt, texts[30:40]),
    ):
        prefix = preprocess(
            str(path),
            tmp_path / f"out_{Path(path).suffix[1:]}",
            text_key="body",
            cache_dir=cache,
            progress=False,
        )
        assert read_back(prefix) == expected(tok, part), path
    prefix = preprocess(
        [jsonl, str(json_array), str(parquet), str(txt)],
        tmp_path / "mixed",
        text_key="body",
        workers=2,
        cache_dir=cache,
        progress=False,
    )
    assert read_back(prefix) == expected(tok, texts[:40])

    # A glob expands sorted (a.jsonl, b.json); text files can also be one document per file.
    prefix = preprocess(
        str(src / "*.json*"), tmp_path / "globbed", text_key="body", cache_dir=cache, progress=False
    )
    assert read_back(prefix) == expected(tok, texts[:20])
    prefix = preprocess(
        str(txt), tmp_path / "whole", text_sample_by="document", cache_dir=cache, progress=False
    )
    assert read_back(prefix) == expected(tok, [txt.read_text()])


def test_directory_input(tmp_path, cache):
    raw = tmp_path / "raw"
    (raw / "sub").mkdir(parents=True)
    write_jsonl(raw / "2.jsonl", ["second"])
    write_jsonl(raw / "sub" / "3.jsonl", ["third"])
    write_jsonl(raw / "1.jsonl", ["first"])
    (raw / "README.md").write_text("not data")  # unsupported suffixes in a directory are ignored
    prefix = preprocess(str(raw), tmp_path / "out", cache_dir=cache, progress=False)
    assert read_back(prefix) == expected(ByteTokenizer(), ["first", "second", "third"])


def test_in_memory_dataset(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["alpha", "beta"]})
    prefix = preprocess(ds, tmp_path / "mem", progress=False)
    assert read_back(prefix) == expected(ByteTokenizer(), ["alpha", "beta"])


# ---- errors -----------------------------------------------------------------------------------
def test_errors_name_the_problem(tmp_path, cache, monkeypatch):
    good = write_jsonl(tmp_path / "good.jsonl", ["abc"])
    out = tmp_path / "o"

    def run(inputs, **kw):
        kw.setdefault("cache_dir", cache)
        return preprocess(inputs, kw.pop("prefix", out), progress=False, **kw)

    with pytest.raises(FileNotFoundError, match="does not exist"):
        run(str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match="matches no files"):
        run(str(tmp_path / "*.parquet"))
    (tmp_path / "data.xyz").write_text("x")
    with pytest.raises(ValueError, match=r"suffix '\.xyz'.*--input-format"):
        run(str(tmp_path / "data.xyz"))
    with pytest.raises(
        ValueError, match=r"no column 'body' \(columns: \['id', 'text'\]\).*text_key"
    ):
        run(good, text_key="body")
    with pytest.raises(ValueError, match=r"good.jsonl:1: column 'id' holds int"):
        run(good, text_key="id")
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        run(good, workers=0)
    with pytest.raises(ValueError, match="no non-empty documents"):
        run(write_jsonl(tmp_path / "empty.jsonl", ["", ""]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(ValueError, match="bad.jsonl"):
        run(str(bad))
    with pytest.raises(ValueError, match="should not include .bin"):
        run(good, prefix=str(out) + ".bin")
    with pytest.raises(ValueError, match="is a directory"):
        run(good, prefix=tmp_path)
    with pytest.raises(FileNotFoundError, match="neither 'byte' nor"):
        run(good, tokenizer=str(tmp_path / "no_tokenizer"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="not a local file.*HF_DATASETS_OFFLINE"):
        run("someone/some_dataset")
    # Failures never leave a dataset (or temporary files) behind.
    assert not list(tmp_path.glob("o*"))


def test_cli(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS[:20], key="body")
    out = tmp_path / "cli" / "corpus"
    cmd = [
        sys.executable,
        str(REPO / "tools" / "prepare_data.py"),
        "--input",
        src,
        "--output-prefix",
        str(out),
        "--text-key",
        "body",
        "--workers",
        "2",
        "--cache-dir",
        str(tmp_path / "c"),
        "--no-progress",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "documents" in r.stdout
    assert read_back(out) == expected(ByteTokenizer(), DOCS[:20])


def test_cli_errors(tmp_path, capsys):
    from megatron_s2.training.preprocess import main

    assert (
        main(["--input", str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "o")]) == 2
    )
    assert "prepare_data: error: input file" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: required option missing
        main(["--input", "x.jsonl"])
    assert "--output-prefix" in capsys.readouterr().err


# ---- demo corpus --------------------------------------------------------------------------------
_STMT = re.compile(
    r"^(?:let (?P<dk>[a-z]{3})=(?P<dv>\d{4});|(?P<qk>[a-z]{3})\?(?P<qv>\d{4});|[A-Z][a-z ]*\.)$"
)


def test_demo_corpus_is_deterministic_and_answerable():
    a = list(generate_corpus(seed=0, num_docs=30))
    assert a == list(generate_corpus(seed=0, num_docs=30))
    assert a != list(generate_corpus(seed=1, num_docs=30))
    far = 0
    for doc in a:
        table, pos = {}, 0
        for line in doc.split("\n"):
            m = _STMT.match(line)
            assert m, f"unexpected line {line!r}"
            if m["dk"]:
                assert m["dk"] not in table  # keys are unique within a document
                table[m["dk"]] = (m["dv"], pos)
            elif m["qk"]:
                value, defined_at = table[m["qk"]]  # queried keys were defined earlier
                assert value == m["qv"]
                far += pos - defined_at > 512
            pos += len(line) + 1
    assert far > 50  # many lookups reach beyond a 512-byte window


def test_ensure_demo_data(tmp_path):
    prefix = ensure_demo_data(tmp_path, seed=0)
    assert prefix == demo_prefix(tmp_path, 0)
    size = os.path.getsize(prefix[: -len("_text_document")] + ".jsonl")
    assert 1_000_000 <= size <= 3_000_000
    docs = read_back(prefix)
    assert len(docs) == 1200 and all(d[-1] == 256 for d in docs)
    assert ByteTokenizer().decode(docs[0]) == next(generate_corpus(seed=0))
    mtime = os.path.getmtime(prefix + ".bin")
    assert ensure_demo_data(tmp_path, seed=0) == prefix  # present: not regenerated
    assert os.path.getmtime(prefix + ".bin") == mtime
    assert not list(tmp_path.glob(".hf_cache*"))


def _ensure_small(path, q):
    q.put(ensure_demo_data(path, seed=3, num_docs=40))


def test_ensure_demo_data_concurrent(tmp_path):
    # Two ranks starting together: one generates under the lock, the other reuses its output.
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ensure_small, args=(str(tmp_path), q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    a, b = q.get(timeout=5), q.get(timeout=5)
    assert a == b
    assert len(read_back(a)) == 40


def test_make_demo_corpus_cli(tmp_path, capsys):
    from megatron_s2.training.demo_corpus import main

    assert main(["--data-dir", str(tmp_path), "--seed", "5", "--num-docs", "20"]) == 0
    prefix = capsys.readouterr().out.strip().splitlines()[-1]
    assert prefix.startswith(str(tmp_path)) and len(read_back(prefix)) == 20
    assert main(["--data-dir", str(tmp_path), "--num-docs", "0"]) == 2
    assert "num_docs" in capsys.readouterr().err
