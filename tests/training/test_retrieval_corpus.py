"""The retrieval training corpus (megatron_s2.training.evaluation.retrieval_corpus): whole
trials in the evaluation's formats, answers that are the needle's value, trial lengths in range,
a training seed, and clear errors."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
from scipy import stats

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


def _assert_refused(tmp_path, kwargs, message):
    """The writer, given ``kwargs`` (two documents unless they say otherwise), raises a
    ConfigError holding ``message`` and writes no dataset."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        write_retrieval_dataset(tmp_path / "x", "byte", **{"num_docs": 2, **kwargs})
    assert not (tmp_path / "x.bin").exists()


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
    _assert_refused(tmp_path, kwargs, message)


def test_cli(tmp_path, capsys):
    prefix = str(tmp_path / "cli")
    argv = ["--tokenizer", "byte", "--output-prefix", prefix, "--num-docs", "2"]
    assert main(argv + ["--max-tokens", "600"]) == 0
    assert "2 documents" in capsys.readouterr().out
    assert len(_docs(prefix)) == 2
    assert main(argv + ["--tasks", "nope"]) == 2
    assert "--tasks: unknown 'nope'" in capsys.readouterr().err


def _passkey_distances(docs, tok):
    """Per document: (fact-question distance, trial length) in tokens (the byte tokenizer: a
    character is a token), the distance from the passkey sentence's end to the question."""
    needle, question = PATTERNS["passkey"]
    out = []
    for doc in docs:
        text = tok.decode(doc[:-1].tolist())
        fact = re.search(needle, text)
        asked = re.search(question, text)
        out.append((asked.start() - fact.end(), doc.size - 2))
    return np.array(out)


def test_default_distances_cover_the_whole_document(tmp_path):
    """The point of issue 50: with the writer's defaults the fact is as often far from its
    question as near, over the whole document (old behaviour: log-uniform trial lengths from
    256 tokens, so few distances reached half the longest trial, and the study's 128-1024
    token trials kept every fact inside S2's 1k-token local window)."""
    tok = load_tokenizer("byte")
    prefix = str(tmp_path / "d")
    write_retrieval_dataset(prefix, "byte", tasks=["passkey"], num_docs=80, seed=11)
    dist = _passkey_distances(_docs(prefix), tok)
    longest = 16384  # the default --max-tokens: the training context the corpus is written for
    far = np.mean(dist[:, 0] > longest / 2)
    assert far >= 0.3, far  # the old writer: 0.04
    assert (dist[:, 1] == longest).all()  # every document as long as the context
    assert np.mean(dist[:, 0] > 1024) >= 0.8  # beyond a 1k local window
    assert dist[:, 0].max() > 0.9 * longest and dist[:, 0].min() < 0.1 * longest
    # Uniform over [0, L): a Kolmogorov-Smirnov test at a generous level (80 draws).
    from scipy import stats

    assert stats.kstest(dist[:, 0] / longest, "uniform").pvalue > 0.001


def test_seq_length_makes_each_document_one_training_sample(tmp_path):
    """``--seq-length S``: trials of S - 2 tokens, so trial + answer's last token + EOD is S
    tokens, and Megatron's samples (every S tokens, S + 1 read) start at a document's start."""
    prefix = str(tmp_path / "s")
    write_retrieval_dataset(
        prefix, "byte", tasks=["passkey", "needle", "multikey"], num_docs=9, seq_length=1500
    )
    docs = _docs(prefix)
    assert [d.size for d in docs] == [1500] * 9
    # Megatron's own sample index over these documents (shuffled, as GPTDataset orders them):
    # every sample starts at a document's first token, so no trial is cut.
    from megatron.core.datasets import helpers

    sizes = np.array([d.size for d in docs], dtype=np.int32)
    order = np.random.default_rng(0).permutation(len(docs)).astype(np.int32)
    index = helpers.build_sample_idx(sizes, order, 1500, 1, int(sizes.sum()), True, True)
    assert (index[:, 1] == 0).all() and list(index[:, 0]) == list(range(len(index)))
    dist = _passkey_distances(docs[::3], load_tokenizer("byte"))
    assert (dist[:, 0] < 1500).all()


def test_log_uniform_distances_favour_near_facts(tmp_path):
    tok = load_tokenizer("byte")
    kw = dict(tasks=["passkey"], num_docs=60, max_tokens=2048, seed=2)
    write_retrieval_dataset(tmp_path / "u", "byte", **kw)
    write_retrieval_dataset(tmp_path / "l", "byte", depth_distribution="log-uniform", **kw)
    uni = _passkey_distances(_docs(str(tmp_path / "u")), tok)[:, 0]
    log = _passkey_distances(_docs(str(tmp_path / "l")), tok)[:, 0]
    # Median of a log-uniform distance over [1, 2048) is about 45 tokens; uniform, about 1024.
    assert np.median(log) < 200 < 700 < np.median(uni)
    # Still some far ones: every doubling of the distance is as likely.
    assert np.mean(log > 1024) > 0.02


def test_arcsine_depths_follow_their_distribution():
    """``arcsine``: the depth for a uniform draw u is the Beta(1/2, 1/2) quantile, so its CDF
    is (2 / pi) asin(sqrt(x)) (Kolmogorov-Smirnov against it on random draws); a fact within the
    first 1% of its trial is ~6x as likely as under ``uniform``."""
    from megatron_s2.training.evaluation.retrieval_corpus import _depth

    rng = random.Random(5)
    depths = np.array([_depth(rng.random(), 4096, "arcsine") for _ in range(20000)])
    assert ((depths >= 0) & (depths <= 1)).all()
    assert stats.kstest(depths, stats.beta(0.5, 0.5).cdf).pvalue > 0.01
    # Against another law (uniform) the same test rejects: it can fail.
    assert stats.kstest(depths, "uniform").pvalue < 1e-6
    assert 0.055 < np.mean(depths < 0.01) < 0.075 and 0.055 < np.mean(depths > 0.99) < 0.075


def test_arcsine_documents_put_more_facts_at_the_start(tmp_path):
    """The writer with ``--depth-distribution arcsine``: more passkeys open their trial (the
    fact-question distance near the whole trial) than with the uniform draw, on the same seed."""
    tok = load_tokenizer("byte")
    kw = dict(tasks=["passkey"], num_docs=200, max_tokens=1024, seed=3)
    write_retrieval_dataset(tmp_path / "u", "byte", **kw)
    write_retrieval_dataset(tmp_path / "a", "byte", depth_distribution="arcsine", **kw)
    dist = {n: _passkey_distances(_docs(str(tmp_path / n)), tok)[:, 0] for n in ("u", "a")}
    # The longest distance is the fact at the trial's start; within 2% of the trial of it.
    top = max(d.max() for d in dist.values())
    start = {n: np.mean(d >= top - 20) for n, d in dist.items()}
    assert start["a"] > 2 * start["u"] and start["a"] > 0.05, start


def test_multikey_documents(tmp_path):
    """``multikey``: N needles of one format with distinct keys and values, the question asks
    one of them, and the answer is that key's value."""
    tok = load_tokenizer("byte")
    prefix = str(tmp_path / "m")
    write_retrieval_dataset(
        prefix, "byte", tasks=["multikey"], num_docs=6, max_tokens=1200, multikey_needles=6
    )
    for doc in _docs(prefix):
        text = tok.decode(doc[:-1].tolist())
        found = re.findall(r"The value of key ([a-z]{6}) is (\d{6})\.\n", text)
        assert len(found) == 6
        assert len({k for k, _ in found}) == 6 and len({v for _, v in found}) == 6
        asked = re.search(
            r"What is the value of key ([a-z]{6})\? The value of key \1 is (\d{6})$", text
        )
        assert asked is not None and tuple(asked.groups()) in found


def test_heldout_task_is_refused_and_never_written(tmp_path, capsys):
    """``code-value`` is held out: the writer refuses it (function and CLI), no training task
    carries it, and its template's text is in no training document of any training task."""
    from megatron_s2.training.evaluation.retrieval_corpus import TRAINING_TASKS, training_task
    from megatron_s2.training.evaluation.tasks import HELDOUT_TASKS, TASKS

    assert "code-value" in HELDOUT_TASKS
    for name in HELDOUT_TASKS:
        with pytest.raises(ConfigError, match="held-out evaluation task"):
            training_task(name)
        with pytest.raises(ConfigError, match=re.escape(f"--tasks: {name!r} is a held-out")):
            write_retrieval_dataset(tmp_path / "h", "byte", tasks=["passkey", name], num_docs=2)
        assert not (tmp_path / "h.bin").exists()
    assert not any(t.held_out for t in TRAINING_TASKS.values())
    argv = ["--tokenizer", "byte", "--output-prefix", str(tmp_path / "c"), "--num-docs", "2"]
    assert main(argv + ["--tasks", "code-value"]) == 2
    assert "held-out" in capsys.readouterr().err
    # Every training task's documents: none holds the held-out needle or question.
    prefix = str(tmp_path / "all")
    write_retrieval_dataset(prefix, "byte", tasks=list(TRAINING_TASKS), num_docs=6, max_tokens=2000)
    tok = load_tokenizer("byte")
    held = TASKS["code-value"]
    fixed = [held.needle.split("{key}")[0], held.question.split("{key}")[0], "  # ->"]
    for doc in _docs(prefix):
        text = tok.decode(doc[:-1].tolist())
        assert not any(f in text for f in fixed), fixed
        assert re.search(r"[A-Z_]{4,} = \d+", text) is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"depth_distribution": "normal"},
            "--depth-distribution: unknown 'normal'; allowed: uniform, log-uniform, arcsine",
        ),
        (
            {"tasks": ["multikey"], "multikey_needles": 1},
            "--multikey-needles must be an integer from 2 to 64",
        ),
        (
            {"tasks": ["multikey"], "multikey_needles": 65},
            "--multikey-needles must be an integer from 2 to 64",
        ),
        ({"seq_length": 2048, "max_tokens": 1000}, "--seq-length and --max-tokens: give one"),
        ({"seq_length": 2}, "--seq-length must be >= 3"),
    ],
)
def test_new_options_refuse_bad_values(tmp_path, kwargs, message):
    _assert_refused(tmp_path, kwargs, message)


def test_cli_new_options(tmp_path, capsys):
    prefix = str(tmp_path / "o")
    argv = ["--tokenizer", "byte", "--output-prefix", prefix, "--num-docs", "4"]
    opts = ["--tasks", "multikey,passkey", "--seq-length", "700", "--multikey-needles", "5",
            "--depth-distribution", "log-uniform"]  # fmt: skip
    assert main(argv + opts) == 0
    docs = _docs(prefix)
    assert [d.size for d in docs] == [700] * 4
    text = load_tokenizer("byte").decode(docs[0][:-1].tolist())
    assert len(re.findall(r"The value of key [a-z]+ is \d+\.\n", text)) == 5
    import json

    meta = json.load(open(prefix + ".meta.json"))
    assert meta["depth_distribution"] == "log-uniform" and meta["max_tokens"] == 698
    assert main(argv + ["--depth-distribution", "far"]) == 2
    err = capsys.readouterr().err
    assert "--depth-distribution: unknown 'far'; allowed: uniform, log-uniform, arcsine" in err


# --- multi-query documents (--queries) ---------------------------------------------------------

MULTIKEY_NEEDLE = r"The value of key ([a-z]{6}) is (\d{6})\.\n"
MULTIKEY_QUESTION = r"What is the value of key ([a-z]{6})\? The value of key \1 is (\d{6})"


def _heldout_code(tok):
    # Held-out "code" for the tasks whose haystack is the run's corpus (needle, kv, code-value):
    # top-level statements and indented lines, EOD-terminated like a corpus's documents.
    docs = []
    for d in range(6):
        lines = [f"import mod{d}\n"]
        for i in range(40):
            lines.append(f"def f{d}_{i}(x):\n    return x * {i} + {d}\n\nVALUE_{i} = {i * 7 + d}\n")
        docs.append(np.array(tok.encode("".join(lines)) + [tok.eod], dtype=np.int64))
    return docs


def test_evaluation_trials_are_unchanged():
    """The multi-query documents share make_trial's code: the evaluator's trials (get_task,
    haystack_stream, make_trial, as retrieval.evaluate_retrieval calls them) of every task, one
    and eight needles, are byte for byte those of the code before ``--queries`` (the digest
    was taken from commit 0d6395d)."""
    import hashlib

    from megatron_s2.training.evaluation.tasks import TASKS, get_task, haystack_stream, make_trial

    tok = load_tokenizer("byte")
    h = hashlib.sha256()
    for name in TASKS:
        for needles in (None, 8):
            task = get_task(name, needles)
            stream = haystack_stream(task, tok, _heldout_code(tok), 2 * 777 + 2)
            for seed in (0, 5):
                for length in (500, 777):
                    for depth in (0.0, 0.25, 0.5, 1.0):
                        for i in range(3):
                            t = make_trial(task, tok, stream, length, depth, i, seed=seed)
                            h.update(t.tokens.astype(np.int64).tobytes())
                            fields = (t.task, t.length, t.target_depth, t.depth, t.index, t.key,
                                      t.value, t.needle_at, t.answer_at, t.question_at,
                                      t.distance, t.others)  # fmt: skip
                            h.update(repr(fields).encode())
    assert h.hexdigest() == "8d19e24c99813507b1cfaef122cf3365c8dd3268f11698ac39d7a1bd32704674"


def test_default_queries_write_the_same_bytes(tmp_path):
    """``queries=1`` (the default, given or not) writes the .bin/.idx of the writer before
    ``--queries`` (digest from commit 0d6395d): one sample-long corpus of all three tasks and a
    log-uniform range of the default tasks."""
    for queries in ({}, {"queries": 1}):
        configs = [
            dict(
                tasks=["passkey", "needle", "multikey"],
                num_docs=6,
                seq_length=700,
                multikey_needles=5,
                seed=3,
            ),
            dict(
                num_docs=5,
                min_tokens=200,
                max_tokens=900,
                depth_distribution="log-uniform",
                seed=1,
            ),
        ]
        digest = _corpora_digest(tmp_path, configs, queries, (".bin", ".idx"))
        assert digest == "5a6f78b578713bd51660a33d61fcc2dad7591172309196f9c1b831c380847388"


def _corpora_digest(out, configs, extra, extensions):
    """SHA-256 over the files (``extensions``, in order) of one byte-tokenizer corpus per
    keyword set of ``configs`` (each with ``extra`` added), written under ``out``."""
    import hashlib

    h = hashlib.sha256()
    for k, kw in enumerate(configs):
        prefix = str(out / f"w{k}")
        write_retrieval_dataset(prefix, "byte", **kw, **extra)
        for ext in extensions:
            h.update(open(prefix + ext, "rb").read())
    return h.hexdigest()


def _asked(text):
    """The questions after a multikey document's haystack: ``[(key, answer), ...]`` in order,
    from the first question on (it follows a newline, as the evaluation's single question)."""
    first = text.index("What is the value of key")
    tail = text[first:]
    parts = tail.split("\n")
    asked = [re.fullmatch(MULTIKEY_QUESTION, q) for q in parts]
    assert all(asked), parts
    return text[:first], [m.groups() for m in asked]


def test_multi_query_documents_ask_distinct_needles_and_answer_each(tmp_path):
    """``--queries 8`` with 16 needles: every multikey document holds 16 distinct needles and
    then 8 distinct ones asked in turn, each question right after a newline and followed at once
    by that key's value; passkey documents in the same corpus keep one question; every
    document is one training sample."""
    tok = load_tokenizer("byte")
    prefix = str(tmp_path / "q")
    stats = write_retrieval_dataset(prefix, "byte", tasks=["passkey", "multikey"], num_docs=12,
                                    seq_length=2048, multikey_needles=16, queries=8)  # fmt: skip
    docs = _docs(prefix)
    assert [d.size for d in docs] == [2048] * 12 and stats["tokens"] == 12 * 2048
    in_haystack_order = []
    for i, doc in enumerate(docs):
        assert doc[-1] == tok.eod and tok.eod not in doc[:-1]
        text = tok.decode(doc[:-1].tolist())
        if i % 2 == 0:
            needle, question = PATTERNS["passkey"]
            assert len(re.findall(needle, text)) == 1 and re.search(question, text)
            assert text.count("What is the pass key?") == 1
            continue
        haystack, asked = _asked(text)
        assert haystack.endswith("\n")
        needles = dict(re.findall(MULTIKEY_NEEDLE, haystack))
        assert len(needles) == 16 and len(set(needles.values())) == 16
        assert len(asked) == 8 and len({k for k, _ in asked}) == 8
        assert all(needles[k] == v for k, v in asked)
        # Asked in an order of their own, not the needles' order in the haystack (8 questions
        # in haystack order by chance: 1 in 40,320).
        positions = [haystack.index(k) for k, _ in asked]
        in_haystack_order.append(positions == sorted(positions))
    assert len(in_haystack_order) == 6 and not any(in_haystack_order)


def test_multi_query_trial_positions():
    """make_multi_query_trial: each question's tokens, its answer's span and its needle are at
    the offsets the trial reports; the answer is the asked needle's value; a boundary token
    precedes every question; the trial is ``length + 1`` tokens as make_trial's."""
    from megatron_s2.training.evaluation.retrieval_corpus import training_task
    from megatron_s2.training.evaluation.tasks import haystack_stream, make_multi_query_trial

    tok = load_tokenizer("byte")
    rng = np.random.default_rng(7)
    task = training_task("multikey", 12)
    stream = haystack_stream(task, tok, [], 3000)
    for index in range(6):
        depths = tuple(float(d) for d in rng.random(5))
        t = make_multi_query_trial(task, tok, stream, 1500, depths, index, seed="t")
        assert t.tokens.size == 1501
        assert len(t.questions) == 5 and len(t.others) == 7
        assert sorted(q.target_depth for q in t.questions) == sorted(depths)
        prev_end = None
        for q in t.questions:
            asked = tok.decode(t.tokens[q.question_at : q.answer_at].tolist())
            assert asked == f"What is the value of key {q.key}? The value of key {q.key} is"
            assert tok.decode(t.tokens[q.answer_at : q.answer_end].tolist()) == f" {q.value}"
            needle = tok.decode(t.tokens[q.needle_at :].tolist())
            assert needle.startswith(f"The value of key {q.key} is {q.value}.\n")
            assert tok.decode(t.tokens[q.question_at - 1 : q.question_at].tolist()) == "\n"
            assert q.distance == q.question_at - q.needle_at - len(needle.split("\n")[0]) - 1
            assert abs(q.depth - q.target_depth) < 0.1  # snapped to a line end of the filler
            if prev_end is not None:
                assert q.question_at == prev_end + 1  # one newline between answer and question
            prev_end = q.answer_end
        assert prev_end == t.tokens.size  # the last answer ends the trial
        for key, value, at in t.others:
            assert tok.decode(t.tokens[at:].tolist()).startswith(
                f"The value of key {key} is {value}."
            )


def test_multi_query_distances_cover_the_document(tmp_path):
    """Every asked needle's depth is drawn uniformly, as the single question's: over 40
    documents x 8 questions, the asked needles lie all over the haystack (a KS test against
    uniform) and their distances to their questions reach from near to nearly the whole
    document."""
    tok = load_tokenizer("byte")
    prefix = str(tmp_path / "d")
    write_retrieval_dataset(prefix, "byte", tasks=["multikey"], num_docs=40, seq_length=2048,
                            multikey_needles=16, queries=8, seed=4)  # fmt: skip
    depths, distances = [], []
    for doc in _docs(prefix):
        text = tok.decode(doc[:-1].tolist())
        haystack, asked = _asked(text)
        for k, v in asked:
            at = haystack.index(f"The value of key {k} is {v}.\n")
            depths.append(at / len(haystack))
            end = at + len(f"The value of key {k} is {v}.\n")
            distances.append(text.index(f"What is the value of key {k}?") - end)
    depths, distances = np.array(depths), np.array(distances)
    assert depths.size == 320
    from scipy import stats

    # The needles take part of the haystack string: depths are within a needle or two of the
    # drawn fraction, so the test is loose; a skewed draw (e.g. all asked needles near the
    # question) fails it by far.
    assert stats.kstest(depths, "uniform").pvalue > 0.001
    assert np.mean(depths < 0.5) > 0.35 and np.mean(depths > 0.5) > 0.35
    assert distances.max() > 0.8 * 2048 and distances.min() < 0.2 * 2048


def test_multi_query_workers_write_the_same_documents(tmp_path):
    kw = dict(tasks=["multikey", "passkey"], num_docs=8, min_tokens=1200, max_tokens=1800,
              multikey_needles=10, queries=6, seed=9)  # fmt: skip
    one = write_retrieval_dataset(tmp_path / "one", "byte", **kw)
    two = write_retrieval_dataset(tmp_path / "two", "byte", workers=2, **kw)
    assert one == two
    d1, d2 = _docs(str(tmp_path / "one")), _docs(str(tmp_path / "two"))
    assert len(d1) == 8 and all(np.array_equal(x, y) for x, y in zip(d1, d2))
    # And they are multi-query documents, unlike the one-question corpus of the same seed.
    tok = load_tokenizer("byte")
    assert tok.decode(d1[0][:-1].tolist()).count("What is the value of key") == 6
    write_retrieval_dataset(tmp_path / "single", "byte", **{**kw, "queries": 1})
    single = _docs(str(tmp_path / "single"))
    assert tok.decode(single[0][:-1].tolist()).count("What is the value of key") == 1
    assert [d.size for d in single] == [d.size for d in d1]  # same lengths, drawn first


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tasks": ["multikey"], "queries": 0}, "--queries must be an integer >= 1"),
        ({"tasks": ["multikey"], "queries": 2.5}, "--queries must be an integer >= 1"),
        (
            {"tasks": ["multikey"], "queries": 5},
            "--queries 5 is more than task multikey's 4 needles (--multikey-needles)",
        ),
        (
            {"tasks": ["multikey"], "multikey_needles": 6, "queries": 7},
            "--queries 7 is more than task multikey's 6 needles",
        ),
        (
            {"tasks": ["passkey", "needle"], "queries": 2},
            "--queries 2: only multi-needle tasks ask several questions (multikey); "
            "--tasks passkey,needle has none",
        ),
        (
            {"tasks": ["multikey"], "multikey_needles": 16, "queries": 8, "max_tokens": 1022},
            "--min-tokens: 1022 tokens leave no room for a haystack around task multikey's 16 "
            "needles and 8 questions with their answers",
        ),
    ],
)
def test_queries_refuse_bad_values(tmp_path, kwargs, message):
    _assert_refused(tmp_path, kwargs, message)


def test_multi_query_trial_refuses_bad_values():
    from megatron_s2.training.evaluation.tasks import TASKS, get_task, make_multi_query_trial

    tok = load_tokenizer("byte")
    stream = np.arange(97, 123, dtype=np.int64)
    with pytest.raises(ConfigError, match="--queries: task passkey has one needle"):
        make_multi_query_trial(TASKS["passkey"], tok, stream, 500, (0.1, 0.2), 0)
    with pytest.raises(ConfigError, match="--queries must be from 1 to the needle count 4"):
        make_multi_query_trial(TASKS["multikey"], tok, stream, 500, (0.1,) * 5, 0)
    # The evaluation's needle range is unchanged (the training writer's is wider).
    with pytest.raises(ConfigError, match="--multikey-needles must be an integer from 2 to 16"):
        get_task("multikey", 40)


def test_cli_queries(tmp_path, capsys):
    import json

    prefix = str(tmp_path / "c")
    argv = ["--tokenizer", "byte", "--output-prefix", prefix, "--num-docs", "2",
            "--tasks", "multikey", "--seq-length", "2048", "--multikey-needles", "32"]  # fmt: skip
    assert main(argv + ["--queries", "8"]) == 0
    text = load_tokenizer("byte").decode(_docs(prefix)[0][:-1].tolist())
    assert text.count("What is the value of key") == 8
    assert json.load(open(prefix + ".meta.json"))["queries"] == 8
    assert main(argv + ["--queries", "33"]) == 2
    assert "--queries 33 is more than task multikey's 32 needles" in capsys.readouterr().err


# --- haystacks from a corpus's training part (--haystack-corpus) --------------------------------

TAG = re.compile(r"D(\d{3})L\d\d")


def _tagged_corpus(prefix, n=50, lines=30, offset=0):
    """An indexed dataset of ``n`` code-like documents (byte tokenizer, EOD-terminated), each
    line tagged with its document's number (``D007L12``), so that a haystack tells which
    documents it came from; ``offset`` shifts every id (a corpus of another tokenizer)."""
    from megatron_s2.training.code_corpus import writing_indexed_dataset

    tok = load_tokenizer("byte")
    with writing_indexed_dataset(str(prefix), tok.vocab_size + offset) as w:
        for d in range(n):
            text = "".join(f"value_{i} = D{d:03d}L{i:02d}\n" for i in range(lines))
            w.add(np.array(tok.encode(text) + [tok.eod], dtype=np.int64) + offset)
    return str(prefix)


def _tags(text):
    return {int(t) for t in TAG.findall(text)}


def test_corpus_haystacks_come_from_the_training_part_only(tmp_path):
    """needle and multikey documents (multi-question ones included) hide their needles in
    windows of the corpus's training part: only training documents occur, several different
    ones, drawn from all over the training part; passkey keeps its filler; the evaluator's
    held-out part (heldout_documents, data.split) is disjoint from every haystack."""
    import json

    from megatron_s2.training.evaluation.tasks import heldout_documents
    from megatron_s2.training.run_config import load_config

    tok = load_tokenizer("byte")
    corpus = _tagged_corpus(tmp_path / "code")  # 50 documents: train 0-39, valid 40-49
    prefix = str(tmp_path / "r")
    write_retrieval_dataset(
        prefix, "byte", tasks=["passkey", "needle", "multikey"], num_docs=15, seq_length=1002,
        multikey_needles=6, queries=3, seed=2, haystack_corpus=corpus, haystack_split="8,2,0",
        haystack_tokens=8000,
    )  # fmt: skip
    seen = set()
    for i, doc in enumerate(_docs(prefix)):
        assert doc.size == 1002 and doc[-1] == tok.eod and tok.eod not in doc[:-1]
        text = tok.decode(doc[:-1].tolist())
        tags = _tags(text)
        task = ("passkey", "needle", "multikey")[i % 3]
        if task == "passkey":
            assert not tags and PASSKEY_FILLER.strip()[:40] in text
            continue
        assert tags and max(tags) < 40, (task, sorted(tags))  # training documents only
        seen |= tags
        if task == "needle":
            needle, question = PATTERNS["needle"]
            assert len(re.findall(needle, text)) == 1
            assert re.search(question, text).groups() == re.findall(needle, text)[0]
        else:
            haystack, asked = _asked(text)
            needles = dict(re.findall(MULTIKEY_NEEDLE, haystack))
            assert len(needles) == 6 and len(asked) == 3
            assert all(needles[k] == v for k, v in asked)
        # No filler sentences: the haystack is the corpus's lines.
        assert "The grass is green" not in text
    assert len(seen) >= 6, sorted(seen)  # several documents, not one fixed text
    assert max(seen) >= 25, sorted(seen)  # spread over the training part, not its first files
    meta = json.load(open(prefix + ".meta.json"))
    assert meta["haystack"]["corpus"] == [corpus] and meta["haystack"]["split"] == "8,2,0"
    assert meta["haystack"]["tokens"] == 8000 and meta["haystack"]["max_tokens"] == 8000
    # The evaluator's held-out documents of a run on this corpus: disjoint from the haystacks.
    cfg = load_config(None, ["data.demo=false", f"data.blend=[{corpus}]", "data.split=8,2,0"])
    held = set().union(*(_tags(tok.decode(d[:-1].tolist())) for d in heldout_documents(cfg)))
    assert held == set(range(40, 50))
    assert not held & seen


def test_training_haystack_documents_follow_the_seed(tmp_path):
    """The haystack's documents: a seeded draw from the whole training part (several corpora
    pooled), in corpus order, EOD dropped and each followed by a newline, cut at the cap; int32;
    another seed draws other documents."""
    from megatron_s2.training.evaluation.retrieval_corpus import training_haystack

    tok = load_tokenizer("byte")
    a = _tagged_corpus(tmp_path / "a", n=40)
    b = _tagged_corpus(tmp_path / "b", n=40, lines=20)
    stream, info = training_haystack([a, b], "3,1,0", tok, 9000, seed=0)
    assert stream.dtype == np.int32 and stream.size == 9000 and tok.eod not in stream
    assert info["documents"] >= 9000 // 561 and info["tokens"] == 9000
    text = tok.decode(stream.tolist())
    # Whole documents one after another (the last one cut): each starts at its line 0.
    blocks = re.findall(r"value_0 = D(\d{3})L00\n", text)
    assert len(blocks) == info["documents"]
    numbers = [int(n) for n in blocks]
    assert all(n < 30 for n in numbers)  # the training part of both corpora: 30 of 40
    again, _ = training_haystack([a, b], "3,1,0", tok, 9000, seed=0)
    other, _ = training_haystack([a, b], "3,1,0", tok, 9000, seed=1)
    assert np.array_equal(stream, again) and not np.array_equal(stream, other)
    assert numbers != list(range(len(numbers)))  # not the first documents
    # Every training document when the cap exceeds the training part.
    whole, info = training_haystack([a], "3,1,0", tok, 10**6, seed=0)
    assert info["documents"] == 30 and whole.size == 30 * 561
    assert [int(n) for n in re.findall(r"value_0 = D(\d{3})L00\n", tok.decode(whole.tolist()))] == (
        list(range(30))
    )


def test_corpus_haystack_workers_write_the_same_documents(tmp_path):
    """The workers read one memory-mapped copy of the haystack: the same documents as one
    process."""
    corpus = _tagged_corpus(tmp_path / "code")
    kw = dict(tasks=["needle", "multikey"], num_docs=6, seq_length=900, seed=3,
              haystack_corpus=[corpus], haystack_split="8,2,0", haystack_tokens=6000)  # fmt: skip
    one = write_retrieval_dataset(tmp_path / "one", "byte", **kw)
    two = write_retrieval_dataset(tmp_path / "two", "byte", workers=2, **kw)
    assert one == two
    d1, d2 = _docs(str(tmp_path / "one")), _docs(str(tmp_path / "two"))
    assert len(d1) == 6 and all(np.array_equal(x, y) for x, y in zip(d1, d2))
    assert _tags(load_tokenizer("byte").decode(d1[0][:-1].tolist()))


def test_without_haystack_options_the_bytes_are_unchanged(tmp_path):
    """No --haystack-* option (given as None or left out): the .bin/.idx/.meta.json of the
    writer before them, byte for byte (digest from commit 2a5842b): filler haystacks, a
    multi-query corpus of all three tasks and a log-uniform range of two."""
    off = {"haystack_corpus": None, "haystack_split": None, "haystack_tokens": None}
    for given in ({}, off):
        configs = [
            dict(
                tasks=["passkey", "needle", "multikey"],
                num_docs=6,
                seq_length=600,
                multikey_needles=6,
                queries=3,
                seed=7,
            ),
            dict(tasks=["needle", "passkey"], num_docs=4, min_tokens=300, max_tokens=800, seed=2),
        ]
        digest = _corpora_digest(tmp_path, configs, given, (".bin", ".idx", ".meta.json"))
        assert digest == "6531bb47394fd01b7d4d44b373e130e2576be4b5ce21af02fd0cf6af2bcde4a2"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"haystack_corpus": "{corpus}"}, "--haystack-corpus needs --haystack-split"),
        ({"haystack_split": "8,2,0"}, "--haystack-split needs --haystack-corpus"),
        ({"haystack_tokens": 5000}, "--haystack-tokens needs --haystack-corpus"),
        (
            {"haystack_corpus": "{corpus}", "haystack_split": "8,2,0", "haystack_tokens": 1001},
            "--haystack-tokens must be an integer of at least the document length 1002",
        ),
        (
            {"haystack_corpus": "{tmp}/nope", "haystack_split": "8,2,0"},
            "/nope': no indexed dataset there (missing {tmp}/nope.idx and {tmp}/nope.bin)",
        ),
        (
            {"haystack_corpus": "{tmp}/junk", "haystack_split": "8,2,0"},
            "/junk': unreadable indexed dataset",
        ),
        (
            {"haystack_corpus": "{corpus}", "haystack_split": "0,1,0"},
            "--haystack-split '0,1,0' has no training part",
        ),
        (
            {"haystack_corpus": "{corpus}", "haystack_split": "9,1"},
            "--haystack-split must be three non-negative weights 'train,valid,test', got '9,1'",
        ),
        (
            {"haystack_corpus": "{corpus}", "haystack_split": "1,99,0"},  # round(0.5) = 0 docs
            "--haystack-split '1,99,0' leaves no training documents",
        ),
        (
            {"haystack_corpus": "{corpus}", "haystack_split": "1,49,0"},  # one 561-token doc
            "its training part under --haystack-split '1,49,0' holds 561 tokens, less than one "
            "document (1002)",
        ),
        (
            {"haystack_corpus": "{other}", "haystack_split": "8,2,0"},
            "is beyond the tokenizer's vocabulary (258): a corpus of another tokenizer",
        ),
    ],
)
def test_haystack_options_refuse_bad_values(tmp_path, kwargs, message):
    paths = {
        "tmp": str(tmp_path),
        "corpus": _tagged_corpus(tmp_path / "code"),
        "other": _tagged_corpus(tmp_path / "other", n=10, offset=300),
    }
    (tmp_path / "junk.idx").write_bytes(b"not an index")
    (tmp_path / "junk.bin").write_bytes(b"")
    kwargs = {k: v.format(**paths) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(ConfigError, match=re.escape(message.format(**paths))):
        write_retrieval_dataset(
            tmp_path / "x", "byte", tasks=["needle"], num_docs=2, seq_length=1002, **kwargs
        )
    assert not (tmp_path / "x.bin").exists()


def test_cli_haystack_options(tmp_path, capsys):
    import json

    corpus = _tagged_corpus(tmp_path / "code")
    prefix = str(tmp_path / "c")
    argv = ["--tokenizer", "byte", "--output-prefix", prefix, "--num-docs", "2",
            "--tasks", "needle", "--seq-length", "1002"]  # fmt: skip
    hay = ["--haystack-corpus", corpus, "--haystack-split", "8,2,0", "--haystack-tokens", "6000"]
    assert main(argv + hay) == 0
    assert json.load(open(prefix + ".meta.json"))["haystack"]["tokens"] == 6000
    text = load_tokenizer("byte").decode(_docs(prefix)[0][:-1].tolist())
    assert _tags(text) and max(_tags(text)) < 40
    assert main(argv + ["--haystack-split", "8,2,0"]) == 2
    assert "--haystack-split needs --haystack-corpus" in capsys.readouterr().err


# --- packed documents (--pack-to) ---------------------------------------------------------------


def _split_trials(doc, eod):
    """The trials of one packed document: the pieces between its EODs (each ends with one)."""
    ends = np.flatnonzero(doc == eod)
    assert ends.size and ends[-1] == doc.size - 1, "a packed document ends with a trial's EOD"
    return np.split(doc, ends[:-1] + 1)


@pytest.mark.parametrize("lo, hi, size", [(40, 300, 1024), (60, 122, 124), (10, 30, 5000)])
def test_pack_lengths_fill_the_document_in_range(lo, hi, size):
    """Every trial length in [lo, hi] and the trials' documents (L + 2 tokens each) exactly fill
    ``size``, over many seeds, including the edge where a document holds one longest trial."""
    import random

    from megatron_s2.training.evaluation.retrieval_corpus import _pack_lengths

    counts = set()
    for seed in range(300):
        lengths = _pack_lengths(random.Random(seed), lo, hi, size)
        assert all(lo <= n <= hi for n in lengths), lengths
        assert sum(n + 2 for n in lengths) == size
        counts.add(len(lengths))
    assert len(counts) > 1 or size == hi + 2  # the count varies with the draws


def test_packed_documents_start_every_sample_with_a_trial(tmp_path):
    """``--pack-to P``: documents of exactly P tokens, each whole trials in the evaluation's
    formats (the same checks as one-trial documents), tasks alternating over the trials, and
    Megatron's sample index starts every sample at a document's, hence a trial's, first token."""
    tok = load_tokenizer("byte")
    prefix = str(tmp_path / "p")
    stats = write_retrieval_dataset(
        prefix, "byte", tasks=["passkey", "needle"], num_docs=6, min_tokens=300,
        max_tokens=700, pack_to=2048, seed=3,
    )  # fmt: skip
    docs = _docs(prefix)
    assert [d.size for d in docs] == [2048] * 6 and stats["tokens"] == 6 * 2048
    trials = [t for d in docs for t in _split_trials(d, tok.eod)]
    assert len(trials) > 6
    for j, trial in enumerate(trials):
        assert 300 + 2 <= trial.size <= 700 + 2
        name = ("passkey", "needle")[j % 2]
        text = tok.decode(trial[:-1].tolist())
        needle, question = PATTERNS[name]
        found, asked = re.search(needle, text), re.search(question, text)
        assert found and asked, (name, text[-200:])
        assert found.groups()[-1] == asked.groups()[-1]
    import json

    meta = json.load(open(prefix + ".meta.json"))
    assert meta["pack_to"] == 2048 and meta["trials"] == len(trials)
    from megatron.core.datasets import helpers

    sizes = np.array([d.size for d in docs], dtype=np.int32)
    order = np.random.default_rng(0).permutation(len(docs)).astype(np.int32)
    index = helpers.build_sample_idx(sizes, order, 2048, 1, int(sizes.sum()), True, True)
    assert (index[:, 1] == 0).all()


def test_packed_documents_workers_and_default(tmp_path):
    """The packed documents do not depend on ``workers``, and leaving ``pack_to`` out writes the
    same bytes as before (one trial a document)."""
    kw = dict(tasks=["multikey", "passkey"], num_docs=4, min_tokens=300, max_tokens=800, seed=1)
    write_retrieval_dataset(tmp_path / "a", "byte", pack_to=2000, **kw)
    write_retrieval_dataset(tmp_path / "b", "byte", pack_to=2000, workers=2, **kw)
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
    write_retrieval_dataset(tmp_path / "c", "byte", **kw)
    assert (tmp_path / "c.bin").read_bytes() != (tmp_path / "a.bin").read_bytes()
    assert [d.size for d in _docs(str(tmp_path / "c"))] != [2000] * 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"pack_to": 1000, "seq_length": 1000}, "--pack-to and --seq-length: give one"),
        ({"pack_to": 500, "min_tokens": 100, "max_tokens": 600}, "--pack-to must be at least"),
        ({"pack_to": 4000, "min_tokens": 300, "max_tokens": 600}, "--max-tokens >= 2 * --min"),
        ({"pack_to": "4096", "min_tokens": 100, "max_tokens": 600}, "--pack-to must be an int"),
    ],
)
def test_pack_to_refuses_bad_values(tmp_path, kwargs, message):
    _assert_refused(tmp_path, kwargs, message)


def test_cli_pack_to(tmp_path, capsys):
    prefix = str(tmp_path / "o")
    argv = ["--tokenizer", "byte", "--output-prefix", prefix, "--num-docs", "3", "--tasks",
            "passkey", "--min-tokens", "200", "--max-tokens", "600"]  # fmt: skip
    assert main(argv + ["--pack-to", "1800"]) == 0
    assert [d.size for d in _docs(prefix)] == [1800] * 3
    assert main(argv + ["--pack-to", "300"]) == 2
    assert "--pack-to must be at least --max-tokens + 2 = 602" in capsys.readouterr().err


def test_reuse_keeps_a_corpus_written_with_the_same_settings(tmp_path, capsys):
    """--reuse: a dataset written with the same settings is kept untouched (not rewritten, no
    tokenizer or corpus read); one written otherwise is refused naming each differing field,
    also the haystack's; a dataset without its .meta.json is refused; without --reuse the
    writer writes anew as before. Every setting the writer records takes part."""
    import json
    import os

    corpus = _tagged_corpus(tmp_path / "code")
    prefix = str(tmp_path / "r")
    argv = ["--tokenizer", "byte", "--output-prefix", prefix, "--num-docs", "6", "--tasks",
            "passkey,multikey", "--seq-length", "1002", "--queries", "2",
            "--haystack-corpus", corpus, "--haystack-split", "8,2,0",
            "--haystack-tokens", "8000", "--seed", "3"]  # fmt: skip
    assert main(argv + ["--reuse"]) == 0  # nothing there yet: written
    assert "reused" not in capsys.readouterr().out
    written = {ext: os.stat(prefix + ext).st_mtime_ns for ext in (".bin", ".idx", ".meta.json")}
    meta = json.load(open(prefix + ".meta.json"))
    # The same settings (workers do not change the documents): kept as it is.
    assert main(argv + ["--reuse", "--workers", "2", "--tokenizer", "byte"]) == 0
    out = capsys.readouterr().out
    assert f"{prefix}: reused, written before with these settings: 6 documents, " in out
    assert {e: os.stat(prefix + e).st_mtime_ns for e in written} == written
    # Each recorded setting, changed alone, is a difference.
    for flag, value, field in [
        ("--seed", "4", "seed 3, asked 4"),
        ("--num-docs", "7", "documents 6, asked 7"),
        ("--queries", "1", "queries 2, asked 1"),
        ("--depth-distribution", "arcsine", "depth_distribution 'uniform', asked 'arcsine'"),
        ("--haystack-tokens", "9000", "haystack max_tokens 8000, asked 9000"),
        ("--haystack-split", "9,1,0", "haystack split '8,2,0', asked '9,1,0'"),
    ]:
        changed = list(argv)
        if flag in changed:
            changed[changed.index(flag) + 1] = value
        else:
            changed += [flag, value]
        assert main(changed + ["--reuse"]) == 2, flag
        err = capsys.readouterr().err
        assert f"--output-prefix {prefix} was written with other settings (written " in err
        assert field in err and "remove it or give another --output-prefix" in err, err
    assert {e: os.stat(prefix + e).st_mtime_ns for e in written} == written
    # Several fields at once, and the filler haystack asked where the corpus was used.
    no_corpus = argv[: argv.index("--haystack-corpus")] + ["--seed", "3", "--max-tokens", "900"]
    no_corpus.remove("--seq-length")
    no_corpus.remove("1002")
    assert main(no_corpus + ["--reuse"]) == 2
    err = capsys.readouterr().err
    assert "max_tokens 1000, asked 900" in err and "asked the filler" in err, err
    # Every key the writer records of its arguments is compared (none left out).
    assert {"generator", "tasks", "seed", "min_tokens", "max_tokens", "depth_distribution",
            "multikey_needles", "queries", "tokenizer", "documents", "haystack",
            "tokens"} == set(meta)  # fmt: skip
    # No .meta.json: how it was written is unknown.
    os.remove(prefix + ".meta.json")
    assert main(argv + ["--reuse"]) == 2
    assert ".meta.json cannot be read" in capsys.readouterr().err
    # Without --reuse: written anew.
    assert main(argv) == 0
    assert json.load(open(prefix + ".meta.json")) == meta
