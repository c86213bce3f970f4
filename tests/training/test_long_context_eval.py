"""Long-context evaluation (megatron_s2/training/evaluation/) on a tiny trained run, CPU.

The run is trained by the real trainer for a few steps; the evaluation runs as its command line
in a subprocess (CPU mode patches torch for the whole process), and its JSON is checked against
the model's own outputs computed another way: Megatron's loss (labels given to the model, no
pipeline schedule) for the log-likelihoods, and token-by-token greedy decoding for the greedy
answers.
"""

import json
import os
import subprocess
import sys

import pytest

from megatron_s2.training.evaluation.long_context import main
from megatron_s2.training.evaluation.model import PREFIX, trained_tokens
from megatron_s2.training.evaluation.retrieval import (
    CHANCE_BELOW_TOKENS,
    EXPECTATIONS_DOC,
    at_chance_note,
)
from tests.training.test_trainer import DEMO, REPO, _env, run_trainer

EVAL = [sys.executable, os.path.join(REPO, "tools", "eval_long_context.py")]
GRID = [
    "--tasks",
    "kv,passkey,kv-filler",
    "--lengths",
    "128,256",
    "--allow-extrapolation",
    "--depths",
    "0,0.5,1",
    "--trials",
    "2",
    "--bins",
    "8",
    "--position-sequences",
    "4",
    "--micro-batch-size",
    "2",
    # The probe on the first task's prompts, in the same run (test_attention_probe_*).
    "--attention-probe",
    "128",
]


def _eval_cli(run_dir, out, *args, launcher=(sys.executable,)):
    """The evaluation CLI on the run's checkpoint, writing to ``out``; asserts success and
    returns its stdout."""
    proc = subprocess.run(
        [*launcher, *EVAL[1:], "--checkpoint", str(run_dir / "checkpoints"), "--output-dir",
         str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=run_dir,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, demo_dir):
    """A tiny S2 hybrid (seq_length 128, 16-token blocks) trained 3 steps, checkpointed."""
    tmp = tmp_path_factory.mktemp("lce")
    run_trainer(tmp, demo_dir, "train.train_iters=3", "checkpoint.save_at_end=true")
    return tmp / "t"


@pytest.fixture(scope="module")
def evaluated(run_dir):
    """The evaluation CLI on the run's checkpoint (its stored config): stdout and outputs."""
    out = run_dir / "eval"
    return _eval_cli(run_dir, out, *GRID), out


def test_grid_table_and_files(evaluated):
    stdout, out = evaluated
    assert "| depth \\ length | 128 | 256 |" in stdout
    assert "kv: greedy exact-match accuracy" in stdout and "passkey" in stdout
    for name in (
        "retrieval_kv.png",
        "retrieval_passkey.png",
        "retrieval_kv-filler.png",
        "loss_by_position.png",
    ):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    result = json.loads((out / "retrieval.json").read_text())
    assert result["iteration"] == 3
    for task in ("kv", "passkey", "kv-filler"):
        cells = result["tasks"][task]["cells"]
        assert {(c["length"], c["depth"]) for c in cells} == {
            (n, d) for n in (128, 256) for d in (0.0, 0.5, 1.0)
        }
        trials = result["tasks"][task]["trials"]
        assert len(trials) == 12
        for t in trials:
            assert t["log_likelihood"] < 0
            # Exact match is the greedy answer being the answer, token by token.
            assert t["exact"] == (t["greedy"] == t["answer"])
            assert t["exact"] == (t["token_accuracy"] == 1.0)
        for c in cells:
            mine = [t for t in trials if (t["length"], t["depth"]) == (c["length"], c["depth"])]
            assert c["trials"] == 2
            assert c["accuracy"] == pytest.approx(sum(t["exact"] for t in mine) / 2)
            assert c["log_likelihood"] == pytest.approx(sum(t["log_likelihood"] for t in mine) / 2)
    # The needle sits where the depth puts it: the start, or the end of the haystack.
    kv = result["tasks"]["kv"]["trials"]
    assert all(t["needle_depth"] == 0.0 for t in kv if t["depth"] == 0.0)
    assert all(t["needle_depth"] > 0.9 for t in kv if t["depth"] == 1.0)
    position = json.loads((out / "loss_by_position.json").read_text())
    assert position["length"] == 256 and position["num_sequences"] == 4
    assert [b["start"] for b in position["bins"]] == list(range(0, 256, 32))
    assert sum(b["tokens"] for b in position["bins"]) == 4 * 256


# Rebuilds two trials and the loss-by-position sequences, and scores them without the
# evaluation's code path: the model's own loss (labels given) in one plain forward, and greedy
# decoding one token at a time (the prefix padded to the S2 block size: a causal model's
# logits at a position do not depend on what follows).
CHECK = r"""
import json, sys
import numpy as np
import torch
from megatron_s2.training.evaluation import tasks as L
from megatron_s2.training.evaluation.model import load_eval_model

ckpt, out = sys.argv[1], sys.argv[2]
em = load_eval_model(None, ckpt, max_length=256)
model, tok = em.model[0], em.tokenizer

def nll(tokens):
    t = torch.from_numpy(tokens[None].astype(np.int64))
    pos = torch.arange(t.shape[1] - 1)[None]
    with torch.no_grad():
        return model(t[:, :-1], pos, None, labels=t[:, 1:])[0].double().numpy()

def greedy(prefix, n):
    seq = list(prefix)
    for _ in range(n):
        padded = seq + [tok.eod] * (-len(seq) % em.length_unit)
        t = torch.tensor([padded])
        with torch.no_grad():
            logits = model(t, torch.arange(len(padded))[None], None)
        seq.append(int(logits[0, len(seq) - 1].argmax()))
    return seq[len(prefix):]

result = json.load(open(f"{out}/retrieval.json"))
docs = L.heldout_documents(em.cfg)
checked = []
for task, length, depth, index in (("kv", 128, 0.5, 1), ("passkey", 256, 1.0, 0)):
    spec = L.TASKS[task]
    stream = L.haystack_stream(spec, tok, docs, 2 * 256 + 2)
    trial = L.make_trial(spec, tok, stream, length, depth, index, seed=0)
    rec = next(r for r in result["tasks"][task]["trials"]
               if (r["length"], r["depth"], r["trial"]) == (length, depth, index))
    answer = trial.tokens[trial.answer_at:]
    ll = -nll(trial.tokens)[trial.answer_at - 1:].sum()
    decoded = greedy(trial.tokens[:trial.answer_at].tolist(), len(answer))
    checked.append({"task": task, "json_ll": rec["log_likelihood"], "ll": float(ll),
                    "answer": tok.decode(answer.tolist()), "json_answer": rec["answer"],
                    "first_greedy": tok.decode(decoded[:1]), "json_greedy": rec["greedy"],
                    "decoded_exact": decoded == answer.tolist(), "json_exact": rec["exact"]})
position = json.load(open(f"{out}/loss_by_position.json"))
seqs = [d[:257] for d in docs if d.size >= 257][:4]
per_token = np.stack([nll(s) for s in seqs])
checked.append({"first_bin": position["bins"][0]["loss"],
                "first_bin_now": float(per_token[:, :32].mean()),
                "mean": position["loss"], "mean_now": float(per_token.mean())})
print("CHECKED " + json.dumps(checked), flush=True)
# load_eval_model started torch.distributed (gloo); shut it down as the CLI's main() does,
# not by interpreter exit, where its threads may abort the process.
from megatron.core import parallel_state
parallel_state.destroy_model_parallel()
torch.distributed.destroy_process_group()
"""


def test_kv_filler_haystack_is_the_demo_corpus_filler_with_one_statement():
    """``kv-filler``: the demo corpus's filler sentences (no statements of their own, never the
    held-out documents), the needle once at its depth, the question and the answer last."""
    from megatron_s2.training.demo_corpus import filler_text
    from megatron_s2.training.evaluation import tasks as L
    from megatron_s2.training.tokenizer import load_tokenizer

    tok = load_tokenizer("byte")
    spec = L.TASKS["kv-filler"]
    stream = L.haystack_stream(spec, tok, [], 1000)
    assert stream.size >= 1000
    assert tok.decode(stream[:400].tolist()) == filler_text(400)[:400]
    for depth in (0.0, 0.5, 1.0):
        trial = L.make_trial(spec, tok, stream, 600, depth, 3, seed=1)
        text = tok.decode(trial.tokens.tolist())
        needle = f"let {trial.key}={trial.value};\n"
        assert text.count("let ") == 1 and text.count("?") == 1
        assert text.endswith(f"\n{trial.key}?{trial.value}")
        assert tok.decode(trial.tokens[trial.answer_at :].tolist()) == trial.value
        at = text.index(needle)
        assert abs(at / (len(text) - len(needle)) - depth) < 0.1, (depth, at)
        assert trial.tokens.size == 601


def test_scores_match_the_model_computed_another_way(run_dir, evaluated):
    _, out = evaluated
    proc = subprocess.run(
        [sys.executable, "-c", CHECK, str(run_dir / "checkpoints"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("CHECKED "))
    *trials, position = json.loads(line[len("CHECKED ") :])
    for t in trials:
        assert t["answer"] == t["json_answer"], t
        assert t["ll"] == pytest.approx(t["json_ll"], rel=1e-4, abs=1e-4), t
        assert t["json_greedy"].startswith(t["first_greedy"]), t
        assert t["decoded_exact"] == t["json_exact"], t
    assert position["first_bin"] == pytest.approx(position["first_bin_now"], rel=1e-5)
    assert position["mean"] == pytest.approx(position["mean_now"], rel=1e-5)


# ---- bad input: errors name the setting (in-process: they come before any model is built) ----
@pytest.fixture(autouse=True)
def _no_model_in_this_process(monkeypatch):
    """Bad input must be refused before CPU mode or a process group: in-process calls here
    would otherwise patch torch for the rest of the test session."""
    from megatron_s2.training import cpu_mode, parallel

    def built(*args, **kwargs):
        raise AssertionError("the evaluation went on to build the model")

    monkeypatch.setattr(cpu_mode, "enable_cpu_mode", built)
    monkeypatch.setattr(parallel, "init_process_group", built)


def _fails(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    return capsys.readouterr().err


def test_empty_grid(run_dir, capsys):
    ckpt = ["--checkpoint", str(run_dir / "checkpoints")]
    assert "--lengths is empty" in _fails(capsys, *ckpt, "--lengths", "")
    assert "--depths is empty" in _fails(capsys, *ckpt, "--lengths", "128", "--depths", "")
    assert "--trials must be >= 1" in _fails(capsys, *ckpt, "--lengths", "128", "--trials", "0")
    assert "--depths: 1.5 is outside [0, 1]" in _fails(
        capsys, *ckpt, "--lengths", "128", "--depths", "0,1.5"
    )
    assert "--tasks: unknown ['haystack']" in _fails(
        capsys, *ckpt, "--lengths", "128", "--tasks", "kv,haystack"
    )


def test_prefix_eod_where_it_would_be_ignored_is_refused(run_dir, capsys):
    ckpt = ["--checkpoint", str(run_dir / "checkpoints"), "--lengths", "128", "--prefix-eod"]
    for extra in (["--skip-retrieval"], ["--attention-probe", "128"]):
        err = _fails(capsys, *ckpt, *extra)
        assert "--prefix-eod applies to the retrieval prompts only" in err, err


def test_length_above_seq_length_or_off_the_blocks(run_dir, capsys):
    ckpt = ["--checkpoint", str(run_dir / "checkpoints")]
    err = _fails(capsys, *ckpt, "--lengths", "128,512")
    assert "512 exceeds model.seq_length=128" in err and "--allow-extrapolation" in err
    err = _fails(capsys, *ckpt, "--lengths", "100")
    assert "--lengths: 100 is not a multiple of 16" in err and "block sizes [16]" in err
    err = _fails(capsys, *ckpt, "--lengths", "128", "--position-length", "1024")
    assert "--position-length: 1024 exceeds model.seq_length=128" in err


def test_checkpoint_that_does_not_match_the_config(run_dir, capsys):
    from tests.training.test_trainer import TINY

    err = _fails(
        capsys,
        "--config",
        DEMO,
        "--checkpoint",
        str(run_dir / "checkpoints"),
        "--lengths",
        "128",
        *TINY,
        "model.hidden_size=32",
        f"data.demo_dir={run_dir}",
    )
    assert "does not match the config" in err
    assert "model.hidden_size" in err and "64" in err and "32" in err


@pytest.mark.parametrize(
    "layout, shown",
    [
        # Megatron's zigzag split; the scores are put back at their positions.
        (["parallel.context_parallel_size=2"], "CP 2"),
        # Logits sharded over the vocabulary: the argmax and log-softmax gather across TP. The
        # padded vocabulary is a multiple of make_vocab_size_divisible_by x TP; halving the
        # former keeps the checkpoint's (Megatron's rule, and the tool says so otherwise).
        (
            ["parallel.tensor_model_parallel_size=2", "model.make_vocab_size_divisible_by=32"],
            "TP 2",
        ),
        # Only the last stage has logits: scores come from there.
        (["parallel.pipeline_model_parallel_size=2"], "PP 2"),
    ],
)
def test_parallel_layouts_give_the_single_process_scores(run_dir, evaluated, layout, shown):
    """Two processes under each layout of training, from the single-process checkpoint."""
    from tests.training.test_trainer import TWO_PROCESSES

    _, single = evaluated
    out = run_dir / f"eval_{shown.replace(' ', '')}"
    grid = ["--tasks", "kv", "--lengths", "128,256", "--allow-extrapolation", "--depths", "0.5"]
    stdout = _eval_cli(
        run_dir, out, *grid, "--trials", "2", "--bins", "8", "--position-sequences", "4",
        *layout, launcher=TWO_PROCESSES,
    )  # fmt: skip
    assert shown in stdout
    ref = json.loads((single / "retrieval.json").read_text())["tasks"]["kv"]["trials"]
    got = json.loads((out / "retrieval.json").read_text())["tasks"]["kv"]["trials"]
    assert len(got) == 4
    for t in got:
        (r,) = [
            r
            for r in ref
            if (r["length"], r["depth"], r["trial"]) == (t["length"], 0.5, t["trial"])
        ]
        assert t["answer"] == r["answer"] and t["greedy"] == r["greedy"]
        assert t["log_likelihood"] == pytest.approx(r["log_likelihood"], rel=1e-5)
    ref_bins = json.loads((single / "loss_by_position.json").read_text())["bins"]
    got_bins = json.loads((out / "loss_by_position.json").read_text())["bins"]
    assert [b["loss"] for b in got_bins] == pytest.approx([b["loss"] for b in ref_bins], rel=1e-5)


# ---- the attention probe ----
def test_needle_weights_reproduce_the_reference_attention():
    """The probe's weights for one row, times V, give the reference S2 attention's output at
    that row (so mask, causality, GQA and scale are the kernels'); without the pattern they do
    not."""
    import torch

    from megatron_s2.training.evaluation.attention_probe import needle_weights
    from s2attn import S2Pattern, s2_attention_reference

    g = torch.Generator().manual_seed(7)
    pattern = S2Pattern(num_heads=4, num_kv_heads=2, block_size=16, local_blocks=2, vert_stride=3)
    s, d, scale = 160, 8, 0.3
    q, k, v = (torch.randn(1, s, h, d, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    ref = s2_attention_reference(q, k, v, pattern, scale)[0]  # [s, h, d]
    for row in (5, 47, 159):
        w = needle_weights(q[0], k[0], row, scale, pattern)
        out = torch.einsum("hk,khd->hd", w, v[0, : row + 1].repeat_interleave(2, dim=1))
        torch.testing.assert_close(out, ref[row], rtol=1e-10, atol=1e-10)
        assert torch.allclose(w.sum(-1), torch.ones(4, dtype=torch.float64))
    dense = needle_weights(q[0], k[0], 159, scale)
    out = torch.einsum("hk,khd->hd", dense, v[0].repeat_interleave(2, dim=1))
    assert (out - ref[159]).abs().max() > 1e-3  # the S2 mask matters at this row


def test_attention_probe_on_the_tiny_run(evaluated):
    """The CLI's probe on the trained hybrid: a row per layer, S2 and dense kinds as the
    schedule sets them, masses in [0, 1], and weights that reproduce every layer's output."""
    stdout, out = evaluated
    found = json.loads((out / "attention_probe.json").read_text())
    saved = json.loads((out / "retrieval.json").read_text())
    assert found["max_output_error"] < 1e-4, found["max_output_error"]
    assert found["task"] == "kv" and found["length"] == 128
    assert found["depths"] == [0.0, 0.5, 1.0] and found["trials"] == 2
    kinds = [layer["kind"] for layer in found["layers"]]
    assert [layer["layer"] for layer in found["layers"]] == list(range(len(kinds)))
    assert set(kinds) == {"S2", "dense"}, kinds  # the demo's hybrid schedule
    for layer in found["layers"]:
        for top, mean in zip(layer["top_head"], layer["mean_head"]):
            assert 0.0 <= mean <= top <= 1.0 + 1e-9, layer
    assert saved["tasks"]["kv"]["trials"]  # the retrieval evaluation ran alongside
    table = (out / "attention_probe.md").read_text()
    assert table.count("\n| ") == len(kinds) + 1 and "attention on the needle" in table
    assert "| layer | kind | depth 0 | depth 0.5 | depth 1 |" in stdout


def test_prefix_eod_on_the_tiny_run(run_dir, evaluated):
    """--prefix-eod through the CLI on a trained model (the real tokenizer's EOD): the file and
    the table say so, the prompts keep their length and every trial has its passkey answer
    (the positions themselves: test_retrieval_scores.py)."""
    out = run_dir / "eval-eod"
    args = ["--lengths", "128", "--depths", "0,1", "--trials", "2", "--tasks", "passkey"]
    stdout = _eval_cli(run_dir, out, *args, "--prefix-eod", "--skip-position")
    saved = json.loads((out / "retrieval.json").read_text())
    assert saved["prefix_eod"] is True and saved["lengths"] == [128]
    assert "Every prompt starts with the end-of-document token" in stdout
    assert not (out / "loss_by_position.json").exists()
    plain = json.loads((evaluated[1] / "retrieval.json").read_text())
    assert plain["prefix_eod"] is False
    records = saved["tasks"]["passkey"]["trials"]
    assert len(records) == 4 and all(r["length"] == 128 for r in records)
    assert all(r["answer"].strip().isdigit() for r in records), records


def test_a_model_trained_eod_first_reads_every_input_behind_eod(run_dir):
    """train.eod_first (given to the evaluator as the run's setting): the retrieval prompts
    are --prefix-eod's, trial for trial the same scores; the probe's prompts and the held-out
    sequences start with EOD too, and each file says so."""
    grid = ["--lengths", "128", "--depths", "0,1", "--trials", "2", "--tasks", "passkey"]
    out = run_dir / "eval-eod-first"
    stdout = _eval_cli(run_dir, out, *grid, "--attention-probe", "128", "--bins", "8",
                       "--position-sequences", "2", "train.eod_first=true")  # fmt: skip
    assert "Every prompt starts with the end-of-document token (train.eod_first)" in stdout
    # Not what this checkpoint trained with: the evaluation says so before its tables.
    assert "train.eod_first" in stdout.split("Every prompt starts")[0]
    first = json.loads((out / "retrieval.json").read_text())
    ref = run_dir / "eval-eod-ref"
    _eval_cli(run_dir, ref, *grid, "--prefix-eod", "--skip-position")
    flag = json.loads((ref / "retrieval.json").read_text())
    assert first["prefix_eod"] is True
    keys = ("answer", "greedy", "log_likelihood", "exact", "needle_depth")
    pairs = zip(first["tasks"]["passkey"]["trials"], flag["tasks"]["passkey"]["trials"])
    for a, b in pairs:
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    probe = json.loads((out / "attention_probe.json").read_text())
    assert probe["prefix_eod"] is True and probe["max_output_error"] < 1e-4
    position = json.loads((out / "loss_by_position.json").read_text())
    assert position["prefix_eod"] is True and position["length"] == 128
    assert sum(b["tokens"] for b in position["bins"]) == 2 * 128


def test_attention_probe_on_several_tasks(run_dir):
    """--probe-tasks passkey,multikey: the first task's probe as attention_probe.json (its
    layout unchanged), the multi-needle task's as attention_probe_multikey.json with the mass
    on its other needles; a head's masses on the asked and the other needles sum to at most 1,
    and the weights still reproduce every layer's output."""
    out = run_dir / "eval-probe-tasks"
    # 256 tokens (past the run's 128, as GRID): two multikey needles need the room.
    args = ["--lengths", "256", "--allow-extrapolation", "--depths", "0,1", "--trials", "2",
            "--tasks", "passkey,multikey", "--multikey-needles", "2", "--skip-position",
            "--attention-probe", "256", "--probe-tasks", "passkey,multikey"]  # fmt: skip
    stdout = _eval_cli(run_dir, out, *args)
    first = json.loads((out / "attention_probe.json").read_text())
    multi = json.loads((out / "attention_probe_multikey.json").read_text())
    assert first["task"] == "passkey" and multi["task"] == "multikey"
    assert "others_top_head" not in first["layers"][0]
    for found in (first, multi):
        assert found["max_output_error"] < 1e-4, found["max_output_error"]
        assert found["depths"] == [0.0, 1.0] and found["trials"] == 2
    for layer in multi["layers"]:
        for top, mean, otop, omean in zip(layer["top_head"], layer["mean_head"],
                                          layer["others_top_head"],
                                          layer["others_mean_head"]):  # fmt: skip
            assert 0.0 <= mean <= top <= 1.0 + 1e-9 and 0.0 <= omean <= 1.0 + 1e-9, layer
            assert 0.0 <= otop and top + otop <= 1.0 + 1e-9, layer  # the same head's attention
            assert mean + omean <= 1.0 + 1e-9, layer
    assert (out / "attention_probe_multikey.md").is_file()
    assert "## multikey at 256 tokens: attention on the needle" in stdout


def test_probe_tasks_are_checked_first(run_dir, capsys):
    ckpt = ["--checkpoint", str(run_dir / "checkpoints"), "--lengths", "128", "--tasks",
            "passkey,multikey"]  # fmt: skip
    err = _fails(capsys, *ckpt, "--probe-tasks", "passkey")
    assert "--probe-tasks needs --attention-probe LENGTH" in err
    err = _fails(capsys, *ckpt, "--attention-probe", "128", "--probe-tasks", "passkey,kv")
    assert (
        "--probe-tasks: 'passkey,kv' must name distinct tasks of this evaluation's --tasks "
        "(passkey, multikey)" in err
    )
    err = _fails(capsys, *ckpt, "--attention-probe", "128", "--probe-tasks", "passkey,passkey")
    assert "must name distinct tasks" in err


def test_attention_probe_needs_one_process(run_dir, capsys):
    ckpt = ["--checkpoint", str(run_dir / "checkpoints"), "--lengths", "128"]
    err = _fails(capsys, *ckpt, "--attention-probe", "128", "parallel.context_parallel_size=2")
    assert "--attention-probe runs in one process" in err
    assert "parallel.context_parallel_size=2" in err
    err = _fails(capsys, *ckpt, "--attention-probe", "1024")
    assert "--attention-probe: 1024 exceeds model.seq_length=128" in err


def test_config_error_is_one_line_without_megatron_warnings(run_dir):
    # Issue 53, item 7: the trainer's warning filter, in the evaluator. Without it Megatron's
    # import-time warnings (Transformer Engine and Apex missing, a deprecated default: 8 lines)
    # came before the one-line error, and before every table of a good run too.
    proc = subprocess.run(
        [*EVAL, "--checkpoint", str(run_dir / "checkpoints"), "--lengths", "100"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=run_dir,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "megatron-s2-eval-long-context: error: --lengths: 100 is not a multiple of 16 tokens, "
        "which the run's attention needs (attention S2 block sizes [16], "
        "parallel.context_parallel_size=1); use e.g. 96"
    ], proc.stderr
    assert proc.stdout == ""


def test_a_run_too_short_to_retrieve_says_so_at_the_top(evaluated):
    # Issue 53, item 1: on the demo every retrieval cell is 0.00, as it should be; the tool
    # says so before the tables, in the line after the checkpoint's, with the run's tokens
    # (3 steps x 4 sequences x 128 tokens here) and where the docs explain it.
    stdout, _ = evaluated
    lines = stdout.splitlines()
    assert lines[0].startswith(PREFIX) and "(iteration 3)" in lines[0], lines[:3]
    assert lines[1] == f"{PREFIX} {at_chance_note(3 * 4 * 128)}", lines[:3]
    assert "this run trained 1,536 tokens, too few to learn a lookup" in lines[1]
    assert "retrieval is expected at chance" in lines[1]
    title = EXPECTATIONS_DOC.split('"')[1]
    doc = open(os.path.join(REPO, "docs", "long_context_eval.md")).read()
    assert f"**{title}.**" in doc.split("## What the scores mean")[0]  # at the top of the doc


def test_the_chance_note_covers_the_demo_and_only_short_runs():
    from megatron_s2.training.run_config import load_config

    demo = load_config(DEMO, [])
    tokens = demo.train.train_iters * demo.train.global_batch_size * demo.model.seq_length
    assert tokens == 512_000 and "trained 512,000 tokens" in at_chance_note(tokens)
    assert at_chance_note(CHANCE_BELOW_TOKENS) is None and at_chance_note(None) is None
    # A run that started from another run's weights does not know its tokens: no note.
    saved = {"model": {"seq_length": 128}, "checkpoint": {"load_dir": "runs/base/checkpoints"}}
    assert trained_tokens("unused", saved) is None
