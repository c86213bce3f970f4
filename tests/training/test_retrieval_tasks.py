"""The retrieval tasks' trial builders (megatron_s2.training.evaluation.tasks), CPU, no model:
the answer is the asked needle's value and ends the prompt, the needle sits at its depth, the
prompt decodes to its parts (and re-encodes to itself with the byte tokenizer), several seeds;
multikey's distinct needles; code-value's top-level statement; the grid's option checks."""

from __future__ import annotations

import ast
import glob
import hashlib
import os
import re
import sysconfig

import numpy as np
import pytest

from megatron_s2.training.evaluation import tasks as T
from megatron_s2.training.run_config import ConfigError
from megatron_s2.training.tokenizer import load_tokenizer

pytestmark = pytest.mark.version_independent

STDLIB = sysconfig.get_paths()["stdlib"]


def _code_docs(tok, package="json"):
    """Held-out-like code documents: a stdlib package's files, tokenized (EOD appended)."""
    files = sorted(glob.glob(os.path.join(STDLIB, package, "*.py")))
    return [np.asarray(tok.encode(open(f).read()) + [tok.eod], dtype=np.int64) for f in files]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A small byte-level BPE of the code corpus's kind (code_corpus.train_tokenizer)."""
    from megatron_s2.training import code_corpus as cc

    files = []
    for path in sorted(glob.glob(os.path.join(STDLIB, "email", "*.py")))[:12]:
        data = open(path, "rb").read()
        files.append(
            cc.CorpusFile(path, "email", len(data), hashlib.sha256(data).hexdigest(), source=path)
        )
    out = tmp_path_factory.mktemp("bpe")
    cc.train_tokenizer(files, str(out), vocab_size=600)
    return load_tokenizer(str(out))


def _tokenizers(bpe):
    return [("byte", load_tokenizer("byte")), ("bpe", bpe)]


def _check_trial(tok, task, trial, length, depth):
    """What every trial must satisfy; returns its decoded text."""
    fill = {"key": trial.key, "value": trial.value}
    needle = np.asarray(tok.encode(task.needle.format(**fill)))
    question = np.asarray(tok.encode(task.question.format(**fill)))
    answer = np.asarray(tok.encode(task.answer.format(**fill)))
    toks = trial.tokens
    assert toks.size == length + 1
    # The answer ends the prompt, the question before it, the needle at needle_at.
    assert np.array_equal(toks[trial.answer_at :], answer)
    assert trial.question_at == trial.answer_at - question.size
    assert np.array_equal(toks[trial.question_at : trial.answer_at], question)
    assert np.array_equal(toks[trial.needle_at : trial.needle_at + needle.size], needle)
    assert trial.distance == trial.question_at - trial.needle_at - needle.size
    assert len(trial.value) == task.value_digits and trial.value.isdigit()
    # The depth: haystack tokens before the needle over all haystack tokens, near the target
    # (snapped back to a boundary).
    others = sum(len(tok.encode(task.needle.format(key=k, value=v))) for k, v, _ in trial.others)
    room = length + 1 - needle.size - others - question.size - answer.size
    before = trial.needle_at - sum(
        len(tok.encode(task.needle.format(key=k, value=v)))
        for k, v, at in trial.others
        if at < trial.needle_at
    )
    assert trial.depth == pytest.approx(before / room)
    if not task.top_level:
        # Snapped back from the target token, round(depth * room) (code-value: to the nearest
        # line instead).
        assert trial.depth <= depth + 0.5 / room + 1e-9
    # The text round trip: the prompt decodes to the haystack around the needle, then the
    # question and the answer.
    text = tok.decode(toks.tolist())
    tail = task.question.format(**fill) + task.answer.format(**fill)
    assert text.endswith(tail)
    assert text.count(task.needle.format(**fill)) == 1
    if trial.key:
        assert text[: -len(tail)].count(trial.key) == 1  # the key nowhere but in its needle
    return text


@pytest.mark.parametrize("name", ["passkey", "needle", "multikey", "code-value", "kv"])
@pytest.mark.parametrize("seed", [0, 7, 123])
def test_trials_of_every_task(bpe, name, seed):
    task = T.get_task(name)
    for tok_name, tok in _tokenizers(bpe):
        stream = T.haystack_stream(task, tok, _code_docs(tok), 5000)
        for length, depth in [(700, 0.0), (1200, 0.5), (1500, 0.8), (900, 1.0)]:
            trial = T.make_trial(task, tok, stream, length, depth, seed % 5, seed=seed)
            _check_trial(tok, task, trial, length, depth)
            if tok_name == "byte":
                # Bytes round trip exactly: the text encodes back to the prompt.
                text = tok.decode(trial.tokens.tolist())
                assert tok.encode(text) == trial.tokens.tolist()
            else:
                # The scored answer tokens survive re-encoding the whole prompt's text.
                again = tok.encode(tok.decode(trial.tokens.tolist()))
                n = trial.tokens.size - trial.answer_at
                assert again[-n:] == trial.tokens[trial.answer_at :].tolist()
            # Deterministic in the seed, different across seeds.
            same = T.make_trial(task, tok, stream, length, depth, seed % 5, seed=seed)
            assert np.array_equal(same.tokens, trial.tokens)
        a = T.make_trial(task, tok, stream, 800, 0.5, 0, seed=seed)
        b = T.make_trial(task, tok, stream, 800, 0.5, 0, seed=seed + 1)
        assert (a.value, a.key) != (b.value, b.key)


def test_depth_is_where_the_needle_goes():
    """Over many trials the realised depth follows the target (a boundary at most a sentence
    back) and the distance to the question shrinks as the depth grows."""
    tok = load_tokenizer("byte")
    task = T.get_task("passkey")
    stream = T.haystack_stream(task, tok, [], 6000)
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        for i in range(4):
            trial = T.make_trial(task, tok, stream, 3000, depth, i, seed=5)
            assert depth - 0.04 <= trial.depth <= depth + 1e-9, (depth, trial.depth)
            assert abs(trial.distance - (1 - depth) * 3000) < 200


@pytest.mark.parametrize("needles", [2, 4, 8])
def test_multikey_needles_are_distinct_and_one_is_asked(needles):
    tok = load_tokenizer("byte")
    task = T.get_task("multikey", needles)
    assert task.needles == needles
    stream = T.haystack_stream(task, tok, _code_docs(tok), 8000)
    for i, depth in enumerate((0.0, 0.3, 0.6, 1.0)):
        trial = T.make_trial(task, tok, stream, 2500, depth, i, seed=3)
        text = _check_trial(tok, task, trial, 2500, depth)
        found = re.findall(r"The value of key ([a-z]{6}) is (\d{6})\.\n", text)
        assert len(found) == needles == len(trial.others) + 1
        keys = [k for k, _ in found]
        assert len(set(keys)) == needles and len({v for _, v in found}) == needles
        assert (trial.key, trial.value) in found
        # Each other needle where the trial says it is, at its own position.
        offsets = {trial.needle_at}
        for key, value, at in trial.others:
            piece = task.needle.format(key=key, value=value)
            assert tok.decode(trial.tokens[at : at + len(piece)].tolist()) == piece
            offsets.add(at)
        assert len(offsets) == needles
        assert re.search(rf"What is the value of key {trial.key}\?", text)


def test_code_value_is_a_top_level_statement_of_code():
    """code-value: ``MAX_<KEY> = <digits>`` between two top-level lines of code (the line
    after it starts in column 0), a valid Python literal, printed at the end."""
    tok = load_tokenizer("byte")
    task = T.get_task("code-value")
    assert task.held_out and "code-value" in T.HELDOUT_TASKS
    stream = T.haystack_stream(task, tok, _code_docs(tok), 10000)
    for i, depth in enumerate((0.1, 0.4, 0.7, 1.0)):
        trial = T.make_trial(task, tok, stream, 4000, depth, i, seed=9)
        text = _check_trial(tok, task, trial, 4000, depth)
        line = f"MAX_{trial.key} = {trial.value}\n"
        at = text.index(line)
        assert trial.value[0] != "0"
        assert ast.literal_eval(trial.value) == int(trial.value)
        assert at == 0 or text[at - 1] == "\n"
        after = text[at + len(line) :]
        assert after[:1] and not after[0].isspace() and after[0] not in ")]}"
        assert ast.parse(line).body[0].targets[0].id == f"MAX_{trial.key}"
        assert text.endswith(f"\nprint(MAX_{trial.key})  # -> {trial.value}")
        assert re.fullmatch(r"[A-Z]{8}", trial.key)


def test_single_needle_prompts_are_unchanged():
    """The single-needle tasks draw what they always drew: a fixed trial of each, as the
    evaluator built it before multikey existed (commit b92fae4), so that runs evaluated before
    and after compare on the same prompts."""
    tok = load_tokenizer("byte")
    digest = {}
    for name in ("passkey", "kv-filler"):
        task = T.get_task(name)
        stream = T.haystack_stream(task, tok, [], 2000)
        trial = T.make_trial(task, tok, stream, 900, 0.5, 2, seed=4)
        digest[name] = (trial.key, trial.value, trial.needle_at,
                        hashlib.sha256(trial.tokens.tobytes()).hexdigest()[:16])  # fmt: skip
    assert digest == EXPECTED_DIGESTS


# Recorded from the evaluator at commit b92fae4 (before the multi-needle tasks).
EXPECTED_DIGESTS = {
    "passkey": ("", "95364", 385, "f42de5825c3c3b1f"),
    "kv-filler": ("mbj", "5464", 437, "ca71788eea402757"),
}


NEEDLES = "--multikey-needles must be an integer from 2 to 16"
KNOWN = "passkey, needle, kv, kv-filler, multikey, code-value"


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: T.check_grid(["multikey"], [0.5], 2, 1), NEEDLES),
        (lambda: T.check_grid(["multikey"], [0.5], 2, 17), NEEDLES),
        (lambda: T.get_task("multikey", 0), NEEDLES),
        (lambda: T.get_task("nope"), f"--tasks: unknown 'nope'; known: {KNOWN}"),
        (lambda: T.check_grid(["passkey", "mk"], [0.5], 2), "--tasks: unknown ['mk']; known: "),
        (lambda: T.check_grid(["multikey"], [1.5], 2), "--depths: 1.5 is outside [0, 1]"),
    ],
)  # fmt: skip
def test_bad_values_name_the_option_and_allowed_values(call, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        call()


def test_too_short_for_many_needles_names_lengths():
    tok = load_tokenizer("byte")
    task = T.get_task("multikey", 16)
    stream = T.haystack_stream(task, tok, _code_docs(tok), 2000)
    with pytest.raises(ConfigError, match=re.escape("--lengths: 300 tokens leave no room")):
        T.make_trial(task, tok, stream, 300, 0.5, 0)


@pytest.mark.parametrize("name", ["needle", "multikey"])
def test_needles_in_bpe_code_sit_at_their_depth(bpe, name):
    # Byte-level BPE merges a newline with the next line's indentation; counting only tokens
    # that end in the newline itself, needles in indented code snapped far back (measured on
    # this corpus: mean depth error 0.28-0.31, 64-71% of the trials off by more than 0.1, a
    # third at the haystack's start). Every line end counts now.
    task = T.get_task(name)
    stream = T.haystack_stream(task, bpe, _code_docs(bpe, "email"), 5000)
    errors = []
    for i in range(120):
        depth = (i % 41) / 40
        trial = T.make_trial(task, bpe, stream, 2000, depth, i, seed=1)
        errors.append(abs(trial.depth - depth))
        # The needle follows a line end: its text starts a line (after indentation).
        before = bpe.decode(trial.tokens[: trial.needle_at].tolist())
        assert trial.needle_at == 0 or not before[before.rindex("\n") + 1 :].strip(" \t")
    errors = np.asarray(errors)
    assert errors.mean() < 0.03 and (errors > 0.1).mean() < 0.02, (errors.mean(), errors.max())


@pytest.mark.parametrize("name", ["passkey", "multikey"])
def test_probe_needle_spans_are_the_needles_tokens(bpe, name):
    """The attention probe's spans: the asked needle's tokens and each other needle's, exactly
    (decoded back to their needle text), in both tokenizers; none for one-needle tasks."""
    from megatron_s2.training.evaluation.attention_probe import needle_spans

    task = T.get_task(name, 3 if name == "multikey" else None)
    for _, tok in _tokenizers(bpe):
        stream = T.haystack_stream(task, tok, _code_docs(tok), 5000)
        for i, depth in enumerate((0.0, 0.5, 1.0)):
            trial = T.make_trial(task, tok, stream, 1500, depth, i, seed=11)
            span, others = needle_spans(task, tok, trial)
            asked = task.needle.format(key=trial.key, value=trial.value)
            assert tok.decode(trial.tokens[span].tolist()) == asked
            assert len(others) == task.needles - 1
            for (key, value, _), o in zip(trial.others, others):
                assert tok.decode(trial.tokens[o].tolist()) == task.needle.format(
                    key=key, value=value
                )
            taken = [set(range(s.start, s.stop)) for s in [span, *others]]
            assert sum(map(len, taken)) == len(set().union(*taken))  # no overlap


@pytest.mark.parametrize("name", ["passkey", "multikey"])
def test_probe_prompt_marks_the_needles_with_and_without_the_eod_prefix(bpe, name):
    """The attention probe's prompt (a model trained with train.eod_first reads it behind EOD):
    its spans hold exactly the needles' tokens and its row predicts the answer's first token,
    with the prefix as without; the prefixed prompt keeps the length and the same needle."""
    from megatron_s2.training.evaluation.attention_probe import probe_prompt

    task = T.get_task(name, 3 if name == "multikey" else None)
    for tok_name, tok in _tokenizers(bpe):
        stream = T.haystack_stream(task, tok, _code_docs(tok), 5000)
        for depth in (0.0, 0.5, 1.0):
            made = {}
            for prefix in (False, True):
                tokens, row, span, others = probe_prompt(
                    task, tok, stream, 900, depth, 1, seed=7, prefix_eod=prefix
                )
                assert tokens.size == 901 and tokens.dtype == np.int64, tok_name
                assert not prefix or tokens[0] == tok.eod
                trial = T.make_trial(
                    task, tok, stream, 900 - prefix, depth, 1, seed=7, draw_length=900
                )
                needle = tok.encode(task.needle.format(key=trial.key, value=trial.value))
                assert tokens[span].tolist() == needle, (tok_name, prefix, depth)
                assert len(others) == task.needles - 1
                for (key, value, _), o in zip(trial.others, others):
                    assert tokens[o].tolist() == tok.encode(
                        task.needle.format(key=key, value=value)
                    )
                answer = tok.encode(task.answer.format(key=trial.key, value=trial.value))
                assert tokens[row + 1 :].tolist() == answer
                made[prefix] = (trial.key, trial.value)
            assert made[True] == made[False]  # paired draws: the same needle and value
