"""Run safety of the data path (issue 9): nothing hangs in Megatron's dataset builder, damaged
``.bin``/``.idx`` pairs and unusable inputs are named before any work starts.

Every test that reaches Megatron's builder has a timeout: the failure these tests guard against is
an endless loop, which must fail CI rather than hang it.
"""

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_s2.training.data import (
    CorpusError,
    build_datasets,
    check_indexed_dataset,
    plan_splits,
)
from megatron_s2.training.demo_corpus import ensure_demo_data
from megatron_s2.training.preprocess import PreprocessStats, preprocess
from megatron_s2.training.run_config import ConfigError
from megatron_s2.training.tokenizer import ByteTokenizer

REPO = Path(__file__).resolve().parents[2]
TOK = ByteTokenizer()
# A subprocess of the trainer or prepare_data takes seconds; a hang would take forever.
SUBPROCESS_TIMEOUT = 240


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")
    return str(path)


def make_corpus(tmp_path, name, num_docs, chars=200):
    src = write_jsonl(
        tmp_path / f"{name}.jsonl",
        [f"doc {i} " + "lorem ipsum " * (chars // 12) for i in range(num_docs)],
    )
    return preprocess(src, tmp_path / name, cache_dir=str(tmp_path / "hf"), progress=False)


def build(prefixes, weights=None, *, cache_dir, split="98,2,0", train=16, valid=8, seq=64):
    return build_datasets(
        prefixes,
        weights,
        tokenizer=TOK,
        seq_length=seq,
        seed=1,
        split=split,
        train_samples=train,
        valid_samples=valid,
        cache_dir=str(cache_dir),
    )


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpora")
    return {
        "tiny": make_corpus(d, "tiny", 2),
        "small": make_corpus(d, "small", 40),
        "dir": d,
    }


def copy_corpus(prefix, dest):
    for ext in (".bin", ".idx", ".meta.json"):
        shutil.copy(prefix + ext, str(dest) + ext)
    return str(dest)


# ---- item 1: the split checks (pure arithmetic, no Megatron dataset) ---------------------------
@pytest.mark.timeout(60)
def test_empty_validation_split_is_an_error_naming_corpus_and_fixes(corpora):
    tiny = check_indexed_dataset(corpora["tiny"])
    with pytest.raises(ConfigError) as e:
        plan_splits([tiny], None, split="98,2,0", seq_length=64, train_samples=8, valid_samples=4)
    msg = str(e.value)
    for part in (
        corpora["tiny"],
        "data.split '98,2,0'",
        "no documents for valid",
        "2 documents",
        "at least 25 documents",
        "train.eval_iters=0",
        "never finish",
    ):
        assert part in msg, (part, msg)
    # Without evaluation the validation split is not built at all; the test split never is.
    matrix = plan_splits(
        [tiny], None, split="98,1,1", seq_length=64, train_samples=8, valid_samples=0
    )
    assert matrix[0] == pytest.approx((0.0, 0.98)) and matrix[1] is None and matrix[2] is None


@pytest.mark.timeout(60)
def test_split_checks(corpora, tmp_path):
    small = check_indexed_dataset(corpora["small"])
    tiny = check_indexed_dataset(corpora["tiny"])
    kw = dict(seq_length=64, train_samples=8)
    with pytest.raises(
        ConfigError,
        match=r"data.split '1,0,0' leaves no validation data.*"
        r"train.eval_iters=0",
    ):
        plan_splits([small], None, split="1,0,0", valid_samples=4, **kw)
    with pytest.raises(ConfigError, match="gives the training part no weight"):
        plan_splits([small], None, split="0,1,0", valid_samples=0, **kw)
    # A weighted blend builds every corpus's part with a sample count: an empty part would loop.
    with pytest.raises(ConfigError, match=rf"leaves no documents for valid in {corpora['tiny']}"):
        plan_splits([small, tiny], [0.5, 0.5], split="90,10,0", valid_samples=4, **kw)
    # A blend without weights reads each corpus once: a corpus without a sample trips an
    # assertion in Megatron's BlendedDataset, a too-short blend runs out in the middle of the run.
    with pytest.raises(ConfigError, match=r"holds no sample.*give the blend weights"):
        plan_splits(
            [small, tiny], None, split="1,0,0", seq_length=512, train_samples=8, valid_samples=0
        )
    with pytest.raises(ConfigError, match=r"reads each corpus once.*train.train_iters"):
        plan_splits(
            [small, small],
            None,
            split="1,0,0",
            seq_length=64,
            train_samples=10**6,
            valid_samples=0,
        )
    # A corpus that would have to be repeated absurdly often is refused, not looped over.
    with pytest.raises(ConfigError, match="repeated .* times"):
        plan_splits(
            [tiny], None, split="1,0,0", seq_length=4096, train_samples=10**7, valid_samples=0
        )
    # Enough documents: fine.
    plan_splits([small], None, split="90,10,0", valid_samples=4, **kw)


@pytest.mark.timeout(60)
def test_documents_without_tokens(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "hollow")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(60):
        builder.add_document(np.array([], dtype=np.uint16), [0])
    builder.finalize(prefix + ".idx")
    with pytest.raises(ConfigError, match=r"documents but no tokens for train in .*hollow"):
        build([prefix], cache_dir=tmp_path / "cache", valid=0)


# ---- item 1: the repro, end to end (subprocesses with a timeout) --------------------------------
def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # conftest's setting for the kernel tests
    env.pop("RANK", None)
    return env


@pytest.mark.timeout(3 * SUBPROCESS_TIMEOUT + 60)
def test_small_corpus_repro_does_not_hang(tmp_path):
    src = write_jsonl(tmp_path / "two.jsonl", ["the first document", "and a second one"])
    prefix = str(tmp_path / "two")
    prep = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "prepare_data.py"),
            "--input",
            src,
            "--output-prefix",
            prefix,
            "--cache-dir",
            str(tmp_path / "hf"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        env=_env(),
    )
    assert prep.returncode == 0, prep.stderr
    # The CLI prints no Transformer Engine / Apex import warnings.
    assert "Transformer Engine" not in prep.stderr and "Apex" not in prep.stderr, prep.stderr
    assert "Warning" not in prep.stderr, prep.stderr

    train = [
        sys.executable,
        "-m",
        "megatron_s2.training",
        "name=tiny",
        "data.demo=false",
        f"data.blend=[{prefix}]",
        "optimizer.lr_warmup_iters=1",
        f"data.cache_dir={tmp_path / 'cache'}",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        "checkpoint.save_at_end=false",
        "model.num_layers=2",
        "model.hidden_size=64",
        "model.seq_length=128",
    ]
    # Default evaluation: a clear config error before any work, not an endless loop.
    r = subprocess.run(
        train + ["train.train_iters=30", f"logging.run_dir={tmp_path / 'run1'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        env=_env(),
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "config error" in r.stderr and prefix in r.stderr and "train.eval_iters=0" in r.stderr
    # train.eval_iters=0 really skips the validation data: the run trains.
    r = subprocess.run(
        train
        + ["train.train_iters=3", "train.eval_iters=0", f"logging.run_dir={tmp_path / 'run2'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        env=_env(),
    )
    assert r.returncode == 0, r.stderr
    assert "done at iteration 3" in r.stdout


# ---- item 2: damaged .bin/.idx pairs -------------------------------------------------------------
def _damage_cases(prefix):
    """(name, function damaging the copy at prefix, expected message regex)."""
    n = json.loads(Path(prefix + ".meta.json").read_text())["documents"]

    def patch(path, offset, data):
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(data)

    def truncate(path, size):
        os.truncate(path, size)

    bin_, idx = prefix + ".bin", prefix + ".idx"
    bin_size, idx_size = os.path.getsize(bin_), os.path.getsize(idx)
    name = re.escape(prefix)
    return [
        ("bin truncated", lambda: truncate(bin_, bin_size // 2), rf"{name}\.bin is truncated"),
        ("bin empty", lambda: truncate(bin_, 0), rf"{name}\.bin is truncated"),
        ("bin longer", lambda: open(bin_, "ab").write(b"xx"), "longer than its index describes"),
        ("idx truncated", lambda: truncate(idx, idx_size - 8), rf"{name}\.idx is truncated"),
        ("idx header only", lambda: truncate(idx, 20), rf"{name}\.idx is truncated"),
        ("idx not an index", lambda: patch(idx, 0, b"NOTANIDX!"), "no Megatron index header"),
        ("float dtype", lambda: patch(idx, 17, bytes([7])), "float32 is not an integer"),
        ("uint8 dtype", lambda: patch(idx, 17, bytes([1])), "corrupt: sequence 1 starts at"),
        (
            "bad pointer",
            lambda: patch(idx, 34 + 4 * n + 8, struct.pack("<q", 3)),
            r"corrupt: sequence 1 starts at byte 3",
        ),
        (
            "negative length",
            lambda: patch(idx, 34, struct.pack("<i", -5)),
            "sequence 0 has length -5",
        ),
        (
            "document boundaries",
            lambda: patch(idx, 34 + 12 * n, struct.pack("<q", 1)),
            "document boundaries must run from 0",
        ),
    ]


@pytest.mark.timeout(60)
def test_damaged_pairs_are_named_before_training(corpora, tmp_path):
    intact = check_indexed_dataset(corpora["small"], vocab_size=TOK.vocab_size, eod=TOK.eod)
    assert intact.num_documents == 40
    assert intact.num_tokens == os.path.getsize(corpora["small"] + ".bin") // 2
    names = [c[0] for c in _damage_cases(corpora["small"])]
    for i, name in enumerate(names):
        prefix = copy_corpus(corpora["small"], tmp_path / f"c{i}")
        _, damage, pattern = _damage_cases(prefix)[i]
        damage()
        with pytest.raises(CorpusError, match=pattern) as e:
            check_indexed_dataset(prefix)
        assert "tools/prepare_data.py" in str(e.value), name
        # The trainer's entry point raises the same ConfigError before Megatron's builder runs.
        with pytest.raises(CorpusError, match=pattern):
            build([prefix], cache_dir=tmp_path / "cache")
    assert issubclass(CorpusError, ConfigError)  # the CLI: exit code 2, no traceback
    os.remove(copy_corpus(corpora["small"], tmp_path / "gone") + ".idx")
    with pytest.raises(CorpusError, match=r"gone\.idx does not exist"):
        build([str(tmp_path / "gone")], cache_dir=tmp_path / "cache")


@pytest.mark.timeout(60)
def test_corpus_from_another_tokenizer(corpora, tmp_path):
    prefix = copy_corpus(corpora["small"], tmp_path / "other")
    meta = json.loads(Path(prefix + ".meta.json").read_text())
    Path(prefix + ".meta.json").write_text(json.dumps(dict(meta, vocab_size=50304, eod=50256)))
    with pytest.raises(
        CorpusError,
        match=r"written with tokenizer.*vocabulary 50304.*"
        r"data.tokenizer",
    ):
        build([prefix], cache_dir=tmp_path / "cache")
    # Without the meta file the token ids themselves give it away.
    os.remove(prefix + ".meta.json")
    with open(prefix + ".bin", "r+b") as f:
        f.write(np.array([40000], dtype=np.uint16).tobytes())
    with pytest.raises(CorpusError, match="token id 40000, outside the vocabulary"):
        build([prefix], cache_dir=tmp_path / "cache")


@pytest.mark.timeout(120)
def test_rewritten_corpus_does_not_reuse_stale_cached_indices(tmp_path):
    # Megatron's cache key names a corpus by path only: after re-running prepare_data into the
    # same prefix (the fix for a damaged pair), stale sample indices would read past the end.
    prefix = make_corpus(tmp_path, "corpus", 120, chars=400)
    cache = tmp_path / "cache"
    first = build([prefix], cache_dir=cache, split="1,0,0", train=64, valid=0)
    _ = [first.train[i] for i in range(0, len(first.train), 7)]
    make_corpus(tmp_path, "corpus", 30, chars=100)
    second = build([prefix], cache_dir=cache, split="1,0,0", train=64, valid=0)
    for i in range(len(second.train)):
        second.train[i]  # would raise with indices built for the old corpus
    assert len(list(cache.rglob("*document_index.npy"))) == 2


@pytest.mark.timeout(120)
def test_build_without_validation_data(corpora, tmp_path):
    # The reported hang: the validation part of a 2-document corpus is empty. With no
    # evaluation it is not built and training data comes out.
    ds = build([corpora["tiny"]], cache_dir=tmp_path / "cache", train=32, valid=0)
    assert ds.valid is None and len(ds.train) >= 32
    assert ds.train[0]["tokens"].shape[0] == 64


# ---- item 2: the demo re-checks its own corpus -------------------------------------------------
@pytest.mark.timeout(120)
def test_demo_corpus_regenerated_when_damaged(tmp_path, caplog):
    prefix = ensure_demo_data(tmp_path, seed=2, num_docs=20)
    other = ensure_demo_data(tmp_path, seed=2, num_docs=10)  # an intact pair of another size
    good = {ext: Path(prefix + ext).read_bytes() for ext in (".bin", ".idx")}
    for damage in (
        lambda: os.truncate(prefix + ".bin", 100),
        lambda: os.truncate(prefix + ".idx", 50),
        lambda: os.remove(prefix + ".bin"),
        lambda: [shutil.copy(other + ext, prefix + ext) for ext in (".bin", ".idx")],
    ):
        damage()
        with caplog.at_level("WARNING"):
            assert ensure_demo_data(tmp_path, seed=2, num_docs=20) == prefix
        assert {ext: Path(prefix + ext).read_bytes() for ext in good} == good
    assert "is damaged" in caplog.text and "regenerating" in caplog.text
    check_indexed_dataset(prefix, vocab_size=TOK.vocab_size, eod=TOK.eod)


@pytest.mark.timeout(120)
def test_demo_corpus_regenerated_after_training_next_to_it(tmp_path, caplog):
    # Issue 53, item 2: without data.cache_dir Megatron caches its sample indices in
    # <prefix>/cache/, a directory of the prefix's own name. A demo corpus that had been
    # trained on and was then deleted or truncated could not be written again ("output_prefix
    # ... is a directory"); it is regenerated, and the next build reads the new files.
    prefix = ensure_demo_data(tmp_path, seed=4, num_docs=20)
    good = {ext: Path(prefix + ext).read_bytes() for ext in (".bin", ".idx")}

    def train_on_it():
        ds = build_datasets(
            [prefix],
            None,
            tokenizer=TOK,
            seq_length=64,
            seed=1,
            split="1,0,0",
            train_samples=16,
            valid_samples=0,
            cache_dir=None,  # Megatron's default: the cache goes to <prefix>/cache/
        )
        return [ds.train[i]["tokens"] for i in range(len(ds.train))]

    samples = train_on_it()
    assert (Path(prefix) / "cache" / "GPTDataset_indices").is_dir()  # Megatron's default place
    for damage in (lambda: os.remove(prefix + ".bin"), lambda: os.truncate(prefix + ".bin", 100)):
        damage()
        with caplog.at_level("WARNING"):
            assert ensure_demo_data(tmp_path, seed=4, num_docs=20) == prefix
        assert {ext: Path(prefix + ext).read_bytes() for ext in good} == good
        again = train_on_it()
        assert len(again) == len(samples)
        assert all(np.array_equal(a, b) for a, b in zip(again, samples))
    assert "regenerating" in caplog.text
    # A directory that is not Megatron's cache is still refused as an output prefix.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="is a directory"):
        preprocess(prefix[: -len("_text_document")] + ".jsonl", tmp_path / "mine", progress=False)


# ---- item 2: prepare_data's input errors ---------------------------------------------------------
def run_prep(tmp_path, inputs, out="out", **kw):
    kw.setdefault("cache_dir", str(tmp_path / "hf"))
    return preprocess(inputs, tmp_path / out, progress=False, **kw)


@pytest.mark.timeout(60)
def test_empty_inputs_are_named(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    for path in (empty, blank):
        with pytest.raises(ValueError, match=rf"input {path} is empty \(no records\)"):
            run_prep(tmp_path, str(path))
    with pytest.raises(ValueError, match=r"2 files .*empty.jsonl.*blank.txt.* are empty"):
        run_prep(tmp_path, [str(empty), str(blank)])
    # Next to a file with records, an empty file is skipped (and said so).
    good = write_jsonl(tmp_path / "good.jsonl", ["abc"])
    stats = PreprocessStats()
    run_prep(tmp_path, [good, str(empty)], out="written", stats=stats)
    assert stats.documents == 1
    # A header-only CSV has no records either.
    header = tmp_path / "header.csv"
    header.write_text("text,id\n")
    with pytest.raises(ValueError, match=r"header.csv: no records"):
        run_prep(tmp_path, str(header))
    assert not list(tmp_path.glob("out*"))


@pytest.mark.timeout(60)
def test_records_without_text_are_an_error_or_counted(tmp_path):
    src = tmp_path / "mixed.jsonl"
    src.write_text(
        '{"text": "one"}\n\n{"text": ""}\n{"title": "no text here"}\n{"text": null}\n'
        '{"text": "two"}\n'
    )
    with pytest.raises(
        ValueError,
        match=rf"{src}:4: record has no 'text' field.*"
        r"--skip-missing-text",
    ):
        run_prep(tmp_path, str(src))
    for workers in (1, 2):
        stats = PreprocessStats()
        prefix = run_prep(tmp_path, str(src), skip_missing_text=True, stats=stats, workers=workers)
        assert (stats.documents, stats.empty_documents, stats.missing_text) == (2, 1, 2)
        meta = json.loads(Path(prefix + ".meta.json").read_text())
        assert meta["missing_text_skipped"] == 2 and meta["empty_documents_skipped"] == 1
    # Records of a JSON array are named by their position.
    arr = tmp_path / "array.json"
    arr.write_text(json.dumps([{"text": "a"}, {"text": "b"}, {"id": 3}]))
    with pytest.raises(ValueError, match=rf"{arr}: record 3 of its JSON array: record has no"):
        run_prep(tmp_path, str(arr))
    # Only missing records: the error says so.
    with pytest.raises(ValueError, match="no non-empty documents .*2 without 'text'"):
        run_prep(
            tmp_path, write_jsonl(tmp_path / "none.jsonl", [None, None]), skip_missing_text=True
        )


@pytest.mark.timeout(60)
def test_non_utf8_input_names_file_and_line(tmp_path):
    jsonl = tmp_path / "latin.jsonl"
    jsonl.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    txt = tmp_path / "latin.txt"
    txt.write_bytes(b"fine\nalso fine\ncaf\xe9\n")
    for path, line in ((jsonl, 2), (txt, 3)):
        for workers in (1, 2):
            with pytest.raises(ValueError, match=rf"{path}:{line}: not valid UTF-8 \(byte 0xe9"):
                run_prep(tmp_path, str(path), workers=workers)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": broken}\n')
    with pytest.raises(ValueError, match=rf"{bad}:3: invalid JSON"):
        run_prep(tmp_path, str(bad))
    assert not list(tmp_path.glob("out*"))
