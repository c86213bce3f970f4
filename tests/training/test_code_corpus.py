"""The code corpus of issue 12 (tools/build_code_corpus.py), on a few packages of the local stdlib.

Built twice (identical bytes), with a package-level hold-out; checked: file filters, manifest,
splits, deduplication, the tokenizer through ``load_tokenizer``, the indexed datasets through
megatron-core's ``IndexedDataset`` (one document per file, decoding back to the file, one EOD at
its end), Megatron's split of ``train_valid`` at the hold-out, and a short trainer run on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import warnings

import numpy as np
import pytest

from megatron_s2.training import code_corpus as cc
from megatron_s2.training.tokenizer import load_tokenizer
from tests.training.test_trainer import read_metrics, run_trainer

STDLIB = sysconfig.get_paths()["stdlib"]
# Small packages of every CPython 3.11+ stdlib; "json" is held out explicitly, the hash-ordered
# fill may add more.
PACKAGES = ["json", "email", "collections", "logging", "importlib", "tomllib", "textwrap"]
VOCAB = 512


def _build(out):
    return cc.build_code_corpus(
        str(out),
        [("stdlib", STDLIB)],
        packages=PACKAGES,
        valid_fraction=0.15,
        valid_packages=["json"],
        vocab_size=VOCAB,
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("code_corpus") / "a"
    summary = _build(out)
    return out, summary


def _indexed(prefix):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    return IndexedDataset(str(prefix))


def _manifest(out):
    return cc.read_manifest(os.path.join(out, "manifest.jsonl"))


def test_rebuild_is_byte_identical(corpus, tmp_path):
    out, summary = corpus
    other = tmp_path / "b"
    summary2 = _build(other)
    for name in (
        "manifest.jsonl",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
        "train.bin",
        "train.idx",
        "valid.bin",
        "valid.idx",
        "train_valid.bin",
        "train_valid.idx",
    ):
        assert (out / name).read_bytes() == (other / name).read_bytes(), name
    assert summary2["manifest_sha256"] == summary["manifest_sha256"]
    assert summary2["splits"] == summary["splits"]


def test_manifest_lists_the_files_with_a_package_level_holdout(corpus):
    out, summary = corpus
    recs = _manifest(out)
    paths = [r["path"] for r in recs]
    assert paths == sorted(paths) and len(set(paths)) == len(paths)
    assert {r["package"] for r in recs} <= set(PACKAGES)
    # Every .py of json is listed, under the root name, with its size and hash.
    json_dir = os.path.join(STDLIB, "json")
    expected = sorted(f"stdlib/json/{f}" for f in os.listdir(json_dir) if f.endswith(".py"))
    assert [p for p in paths if p.startswith("stdlib/json/")] == expected
    for r in recs[:20]:
        with open(os.path.join(STDLIB, r["path"].split("/", 1)[1]), "rb") as f:
            data = f.read()
        assert r["bytes"] == len(data)
        assert r["sha256"] == hashlib.sha256(data).hexdigest()
    # Whole packages per split.
    split_of = {}
    for r in recs:
        if r["split"] == "skip":
            assert r["reason"], r
            continue
        assert split_of.setdefault(r["package"], r["split"]) == r["split"], r
    valid = sorted(p for p, s in split_of.items() if s == "valid")
    assert "json" in valid and sorted(summary["valid_packages"]) == valid
    assert any(s == "train" for s in split_of.values())
    kept = [r for r in recs if r["split"] != "skip"]
    valid_bytes = sum(r["bytes"] for r in kept if r["split"] == "valid")
    json_bytes = sum(r["bytes"] for r in kept if r["package"] == "json")
    assert valid_bytes <= max(0.15 * sum(r["bytes"] for r in kept), json_bytes)
    assert summary["splits"]["valid"]["bytes"] == valid_bytes
    assert len({r["sha256"] for r in kept}) == len(kept)  # no text twice
    assert summary["splits"]["train"]["files"] + summary["splits"]["valid"]["files"] == len(kept)


def test_tokenizer_loads_and_datasets_hold_one_document_per_file(corpus):
    out, summary = corpus
    tok = load_tokenizer(str(out / "tokenizer"))
    assert tok.vocab_size == VOCAB and tok.eod == 0 and tok.pad == 1
    assert summary["eod"] == 0 and summary["tokenizer_vocab_size"] == VOCAB
    kept = [r for r in _manifest(out) if r["split"] != "skip"]
    order = [r for r in kept if r["split"] == "train"] + [r for r in kept if r["split"] == "valid"]
    n_train = sum(r["split"] == "train" for r in kept)
    train, valid, both = (_indexed(out / s) for s in ("train", "valid", "train_valid"))
    assert (len(train), len(valid), len(both)) == (n_train, len(kept) - n_train, len(kept))
    assert summary["data_split"] == f"{n_train},{len(kept) - n_train},0"
    tokens = 0
    for i, r in enumerate(order):
        doc = both[i]
        part = train[i] if i < n_train else valid[i - n_train]
        assert np.array_equal(doc, part)
        assert doc[-1] == tok.eod and int((doc == tok.eod).sum()) == 1, r["path"]
        with open(os.path.join(STDLIB, r["path"].split("/", 1)[1]), encoding="utf-8") as f:
            assert tok.decode(doc[:-1].tolist()) == f.read(), r["path"]
        tokens += doc.size
    st = summary["splits"]
    assert tokens == st["train"]["tokens"] + st["valid"]["tokens"]
    meta = json.loads((out / "train_valid.meta.json").read_text())
    assert (meta["vocab_size"], meta["eod"], meta["tokens"]) == (VOCAB, 0, tokens)

    from megatron_s2.training.data import check_indexed_dataset

    for s in ("train", "valid", "train_valid"):
        check_indexed_dataset(str(out / s), vocab_size=tok.vocab_size, eod=tok.eod)


def test_validation_text_is_not_in_training(corpus):
    out, _ = corpus
    tok = load_tokenizer(str(out / "tokenizer"))
    train = _indexed(out / "train")
    train_text = "\n".join(tok.decode(train[i].tolist()) for i in range(len(train)))
    valid_files = [r for r in _manifest(out) if r["split"] == "valid"]
    assert valid_files
    for r in valid_files:
        with open(os.path.join(STDLIB, r["path"].split("/", 1)[1]), encoding="utf-8") as f:
            text = f.read()
        assert text not in train_text, r["path"]
    # json's distinctive code is nowhere in training.
    assert "class JSONDecodeError" not in train_text
    assert "def _make_iterencode" not in train_text


def test_megatron_split_of_train_valid_falls_at_the_holdout(corpus):
    out, summary = corpus
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    from megatron_s2.training.data import _split_range

    n_train = summary["splits"]["train"]["documents"]
    n = n_train + summary["splits"]["valid"]["documents"]
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(summary["data_split"]))
    assert _split_range(matrix[0], n) == (0, n_train)
    assert _split_range(matrix[1], n) == (n_train, n)
    # The wrong default split would cut elsewhere: the check can fail.
    default = convert_split_vector_to_split_matrix(parse_and_normalize_split("98,2,0"))
    assert _split_range(default[0], n) != (0, n_train)


def _tree(root, files):
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def test_filters_duplicates_and_holdout_rule(tmp_path):
    root = tmp_path / "lib"
    code = b"def f(x):\n    return x + 1\n"
    _tree(
        root,
        {
            "alpha/__init__.py": b"",  # too small
            "alpha/core.py": code,
            "alpha/notes.md": b"# Alpha\n\nSome text.\n",
            "alpha/data.json": b"{}",  # other suffix: not listed
            "alpha/__pycache__/core.cpython-311.pyc": b"\x00",
            "alpha/blank.py": b"\n\n   \n",
            "alpha/latin.py": "x = 'caf\u00e9'\n".encode("latin-1"),
            "alpha/nul.h": b"int x;\x00\n",
            "alpha/big.rst": b"x" * 2000,  # too large below
            "beta/copy.py": code,  # duplicate of alpha/core.py
            "beta/own.pyi": b"def g() -> int: ...\n",
            "gamma.py": b"print('gamma')\n",
            "alpha-1.0.dist-info/METADATA.md": b"# not read\n",
            ".hidden/x.py": b"x = 1\n",
            "megatron_s2/x.py": b"ours = 1\n",
            "__editable___x_finder.py": b"MAPPING = {}\n",
            "site-packages/delta/x.py": b"nested = 1\n",  # another root's folder
        },
    )
    os.symlink(root / "gamma.py", root / "link.py")
    files = cc.discover([("lib", str(root))], max_bytes=1000)
    got = {r.path: (r.package, r.split, r.reason) for r in files}
    assert got == {
        "lib/alpha/__init__.py": ("alpha", "skip", "too-small"),
        "lib/alpha/big.rst": ("alpha", "skip", "too-large"),
        "lib/alpha/blank.py": ("alpha", "skip", "blank"),
        "lib/alpha/core.py": ("alpha", "train", None),
        "lib/alpha/latin.py": ("alpha", "skip", "not-utf8"),
        "lib/alpha/notes.md": ("alpha", "train", None),
        "lib/alpha/nul.h": ("alpha", "skip", "binary"),
        "lib/beta/copy.py": ("beta", "skip", "duplicate"),
        "lib/beta/own.pyi": ("beta", "train", None),
        "lib/gamma.py": ("gamma", "train", None),
    }
    assert files[[r.path for r in files].index("lib/beta/copy.py")].duplicate_of == (
        "lib/alpha/core.py"
    )
    # Packages selected, hold-out by hash order within the byte budget, explicit packages first.
    assert [r.path for r in cc.discover([("lib", str(root))], packages=["gamma"])] == [
        "lib/gamma.py"
    ]
    assert cc.assign_splits(files, 0.0) == []
    assert cc.assign_splits(files, 0.0, ["beta"]) == ["beta"]
    assert {r.package for r in files if r.split == "valid"} == {"beta"}
    sizes = {"alpha": len(code) + 21, "beta": 20, "gamma": 15}
    total = sum(sizes.values())
    for fraction in (0.1, 0.3, 0.5, 0.9):
        chosen, budget = [], fraction * total
        for p in sorted(sizes, key=cc.holdout_key):
            if sizes[p] <= budget:
                chosen.append(p)
                budget -= sizes[p]
        assert cc.assign_splits(files, fraction) == chosen, fraction
    with pytest.raises(ValueError, match="no such package"):
        cc.assign_splits(files, 0.1, ["nope"])
    kept = [r for r in files if r.split != "skip"]
    assert cc.tokenizer_sample(kept) == kept
    sample = cc.tokenizer_sample(kept, 40)
    assert 0 < sum(r.bytes for r in sample) <= 40 and len(sample) < len(kept)
    assert [r.path for r in sample] == sorted(r.path for r in sample)
    assert cc.tokenizer_sample(kept, 40) == sample
    with pytest.raises(ValueError, match="holds no training file"):
        cc.tokenizer_sample(kept, 5)


def test_special_token_text_is_not_a_document_boundary(tmp_path):
    root = tmp_path / "lib"
    _tree(
        root,
        {
            f"pkg{i}/m.py": f"EOS = '<|endoftext|>'  # {i}\nprint(EOS * {i})\n".encode()
            for i in range(6)
        },
    )
    summary = cc.build_code_corpus(
        str(tmp_path / "out"), [("lib", str(root))], valid_packages=["pkg0"], vocab_size=300
    )
    assert summary["valid_packages"][0] == "pkg0"
    tok = load_tokenizer(str(tmp_path / "out" / "tokenizer"))
    ds = _indexed(tmp_path / "out" / "train_valid")
    assert len(ds) == 6
    for i in range(6):
        doc = ds[i]
        assert int((doc == tok.eod).sum()) == 1 and doc[-1] == tok.eod
        assert "<|endoftext|>" in tok.decode(doc.tolist())


def test_cli_prints_stats_and_rejects_bad_roots(tmp_path, capsys):
    root = tmp_path / "lib"
    _tree(root, {f"p{i}/m.py": f"x = {i}\n".encode() * 20 for i in range(4)})
    args = ["--out", str(tmp_path / "out"), "--root", f"lib={root}", "--vocab-size", "300"]
    args += ["--tokenizer-sample-bytes", "300"]
    assert cc.main([*args, "--valid-packages", "p1", "--valid-fraction", "0"]) == 0
    out = capsys.readouterr().out
    assert "train: 3 packages, 3 files" in out and "valid: 1 packages, 1 files" in out
    assert "data.split=3,1,0" in out and "validation packages: p1" in out
    assert cc.main(["--out", str(tmp_path / "o2"), "--root", f"x={tmp_path / 'missing'}"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert cc.parse_root("stdlib") == ("stdlib", STDLIB)


def test_tool_runs_without_hf_datasets(tmp_path):
    """The device has no ``datasets``/``dill``/``multiprocess``/``tqdm``: the tool needs none."""
    root = tmp_path / "lib"
    _tree(root, {f"p{i}/m.py": f"y = {i}\n".encode() * 20 for i in range(3)})
    tool = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "tools",
        "build_code_corpus.py",
    )
    blocked = ["datasets", "dill", "multiprocess", "tqdm", "pyarrow"]
    code = (
        "import runpy, sys\n"
        f"for m in {blocked!r}: sys.modules[m] = None\n"
        f"sys.argv = [{tool!r}, '--out', {str(tmp_path / 'out')!r}, '--root', "
        f"{'lib=' + str(root)!r}, '--vocab-size', '300', '--valid-packages', 'p2']\n"
        f"runpy.run_path({tool!r}, run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "data.split=2,1,0" in proc.stdout
    assert (tmp_path / "out" / "train_valid.idx").is_file()


def test_trainer_trains_and_validates_on_the_corpus(corpus, tmp_path):
    out, summary = corpus
    proc, recs = run_trainer(
        tmp_path,
        str(tmp_path / "unused-demo"),
        "data.demo=false",
        f"data.blend=[{out / 'train_valid'}]",
        f"data.split={summary['data_split']}",
        f"data.tokenizer={out / 'tokenizer'}",
        "train.train_iters=3",
        "train.eval_interval=3",
        "train.eval_iters=1",
    )
    assert sorted(recs) == [1, 2, 3]
    assert all(np.isfinite(recs[i]["loss"]) for i in recs)
    # A 512-token vocabulary: the untrained model starts near ln(512).
    assert abs(recs[1]["loss"] - np.log(VOCAB)) < 1.0, recs[1]["loss"]
    assert set(read_metrics(tmp_path / "t", "valid")) == {3}
