"""The retrieval training corpus (megatron_s2.training.evaluation.retrieval_corpus): whole
trials in the evaluation's formats, answers that are the needle's value, trial lengths in range,
a training seed, and clear errors."""

from __future__ import annotations

import re

import numpy as np
import pytest

from megatron_s2.training.evaluation.retrieval_corpus import main, write_retrieval_dataset
from megatron_s2.training.evaluation.tasks import PASSKEY_FILLER
from megatron_s2.training.run_config import ConfigError
from megatron_s2.training.tokenizer import load_tokenizer

pytestmark = pytest.mark.version_independent

PATTERNS = {
    "passkey": (
        r"The pass key is (\d{5})\. Remember it\. \1 is the pass key\.",
        r"What is the pass key\? The pass key is (\d{5})$",
    ),
    "needle": (
        r"The special magic number for ([a-z]{6}) is: (\d{7})\.\n",
        r"What is the special magic number for ([a-z]{6})\? The special magic number "
        r"for \1 is: (\d{7})$",
    ),
}


def _docs(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    # Copies: the views into the memory map die with the dataset object.
    return [np.array(ds[i]) for i in range(len(ds))]


def test_documents_are_whole_trials_with_the_needles_value_as_answer(tmp_path):
    tok = load_tokenizer("byte")
    prefix = str(tmp_path / "r")
    stats = write_retrieval_dataset(prefix, "byte", num_docs=12, min_tokens=300, max_tokens=3000)
    docs = _docs(prefix)
    assert stats == {"documents": 12, "tokens": sum(d.size for d in docs)}
    lengths = []
    for i, doc in enumerate(docs):
        assert doc[-1] == tok.eod and tok.eod not in doc[:-1]
        lengths.append(doc.size - 2)  # the trial reads L tokens, then its last answer token, EOD
        text = tok.decode(doc[:-1].tolist())
        task = ("passkey", "needle")[i % 2]
        needle, question = PATTERNS[task]
        found = re.findall(needle, text)
        assert len(found) == 1, (task, text[:200])
        asked = re.search(question, text)
        assert asked is not None
        if task == "passkey":
            assert asked.group(1) == found[0]
            assert PASSKEY_FILLER.strip()[:40] in text
        else:
            assert asked.groups() == found[0]
            assert "def " not in text and "import " not in text  # filler sentences, not code
    assert all(300 <= n <= 3000 for n in lengths)
    assert len(set(lengths)) > 6  # drawn, not one length
    # Depths are drawn too: the needle is not always at the same place.
    starts = {tok.decode(d[:-1].tolist()).find("pass key is") / d.size for d in docs[::2]}
    assert max(starts) - min(starts) > 0.2


def test_seeded_and_reproducible(tmp_path):
    a = write_retrieval_dataset(tmp_path / "a", "byte", num_docs=4, max_tokens=1024, seed=3)
    b = write_retrieval_dataset(tmp_path / "b", "byte", num_docs=4, max_tokens=1024, seed=3)
    write_retrieval_dataset(tmp_path / "c", "byte", num_docs=4, max_tokens=1024, seed=4)
    assert a == b
    da, db, dc = (_docs(str(tmp_path / n)) for n in "abc")
    assert all(np.array_equal(x, y) for x, y in zip(da, db))
    assert not all(x.size == z.size and np.array_equal(x, z) for x, z in zip(da, dc))


def test_workers_write_the_same_documents(tmp_path):
    kw = dict(num_docs=9, min_tokens=200, max_tokens=900, seed=5)
    one = write_retrieval_dataset(tmp_path / "one", "byte", **kw)
    three = write_retrieval_dataset(tmp_path / "three", "byte", workers=3, **kw)
    assert one == three
    d1, d3 = _docs(str(tmp_path / "one")), _docs(str(tmp_path / "three"))
    assert len(d1) == len(d3) == 9
    assert all(np.array_equal(x, y) for x, y in zip(d1, d3))


def test_one_task_only(tmp_path):
    write_retrieval_dataset(tmp_path / "p", "byte", tasks=["needle"], num_docs=3, max_tokens=800)
    tok = load_tokenizer("byte")
    for doc in _docs(str(tmp_path / "p")):
        assert "special magic number" in tok.decode(doc[:-1].tolist())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tasks": []}, "--tasks is empty"),
        ({"tasks": ["kv"]}, "--tasks: unknown 'kv'"),
        ({"num_docs": 0}, "--num-docs must be >= 1"),
        ({"workers": 0}, "--workers must be >= 1"),
        ({"min_tokens": 900, "max_tokens": 800}, "--min-tokens/--max-tokens"),
        ({"min_tokens": 8, "max_tokens": 8}, "--min-tokens: 8 tokens leave no room"),
    ],
)
def test_bad_input_names_the_option(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        write_retrieval_dataset(tmp_path / "x", "byte", **{"num_docs": 2, **kwargs})
    assert not (tmp_path / "x.bin").exists()


def test_cli(tmp_path, capsys):
    prefix = str(tmp_path / "cli")
    argv = ["--tokenizer", "byte", "--output-prefix", prefix, "--num-docs", "2"]
    assert main(argv + ["--max-tokens", "600"]) == 0
    assert "2 documents" in capsys.readouterr().out
    assert len(_docs(prefix)) == 2
    assert main(argv + ["--tasks", "nope"]) == 2
    assert "--tasks: unknown 'nope'" in capsys.readouterr().err
