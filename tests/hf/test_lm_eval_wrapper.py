"""megatron_s2.hf.lm_eval: ``python -m megatron_s2.hf.lm_eval`` registers the ``"s2"`` attention
and hands lm-evaluation-harness's CLI the completed arguments.

lm-evaluation-harness is not a dependency: its CLI is replaced by a stand-in module that does
what its ``hf`` model does with the arguments (``from_pretrained(pretrained,
attn_implementation=...)`` then a forward), so registration and argument passing are tested
without it.
"""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.masking_utils import AttentionMaskInterface

from megatron_s2.hf import lm_eval as wrapper
from megatron_s2.hf.s2_attention import register, s2_attention_forward
from tests.hf.test_s2_attention import make_config, make_model, tokens

pytestmark = pytest.mark.version_independent

ADDED = "attn_implementation=s2"


@pytest.mark.parametrize(
    "argv, want",
    [
        (
            ["--model", "hf", "--model_args", "pretrained=/m,dtype=float32", "--tasks", "t"],
            [
                "--model",
                "hf",
                "--model_args",
                f"pretrained=/m,dtype=float32,{ADDED}",
                "--tasks",
                "t",
            ],
        ),
        # lm-eval 0.4.13: subcommand, default model, several values, the `=` form
        (
            ["run", "--model_args=pretrained=/m", "dtype=float32"],
            ["run", f"--model_args=pretrained=/m,{ADDED}", "dtype=float32"],
        ),
        (["--tasks", "t"], ["--tasks", "t", "--model_args", ADDED]),
        (
            ["-a", '{"pretrained": "/m"}'],
            ["-a", json.dumps({"pretrained": "/m", "attn_implementation": "s2"})],
        ),
        # the user's explicit choice, and other models, are left alone
        (
            ["--model_args", "pretrained=/m,attn_implementation=sdpa"],
            ["--model_args", "pretrained=/m,attn_implementation=sdpa"],
        ),
        (["--model", "vllm", "--model_args", "pretrained=/m"], None),
    ],
)
def test_model_args_completed(argv, want):
    assert wrapper.with_s2_model_args(argv) == (argv if want is None else want)


def test_model_args_parsed_in_both_forms():
    argv = ["--model_args", "pretrained=/a,dtype=bfloat16", "-a", '{"pretrained": "/b"}']
    assert wrapper.model_args(argv) == {"pretrained": "/b", "dtype": "bfloat16"}


def test_an_eod_first_export_gets_add_bos_token(tmp_path):
    """A checkpoint whose config.json flags train.eod_first (the export makes EOD its
    tokenizer's BOS) gets add_bos_token=True, so that the harness encodes every request behind
    EOD; a given add_bos_token wins; other checkpoints and models are left alone."""
    (tmp_path / "config.json").write_text(json.dumps({"s2_eod_first": True}))
    given = ["--model", "hf", "--model_args", f"pretrained={tmp_path}", "--tasks", "t"]
    want = ["--model", "hf", "--model_args", f"pretrained={tmp_path},add_bos_token=True"]
    assert wrapper.with_eod_first_model_args(given) == [*want, "--tasks", "t"]
    as_json = ["-a", json.dumps({"pretrained": str(tmp_path)})]
    completed = wrapper.with_eod_first_model_args(as_json)
    assert json.loads(completed[1]) == {"pretrained": str(tmp_path), "add_bos_token": True}
    own = ["--model_args", f"pretrained={tmp_path},add_bos_token=False"]
    assert wrapper.with_eod_first_model_args(own) == own
    vllm = ["--model", "vllm", "--model_args", f"pretrained={tmp_path}"]
    assert wrapper.with_eod_first_model_args(vllm) == vllm
    (tmp_path / "config.json").write_text(json.dumps({"s2_eod_first": False}))
    plain = ["--model_args", f"pretrained={tmp_path}"]
    assert wrapper.with_eod_first_model_args(plain) == plain
    hub = ["--model_args", "pretrained=org/name"]  # not a local checkpoint: nothing to read
    assert wrapper.with_eod_first_model_args(hub) == hub


@pytest.fixture
def fake_harness(monkeypatch):
    """A stand-in ``lm_eval.__main__`` recording the argv it ran with and loading the model
    the way the ``hf`` model does. ``seen["unregister"]()`` removes ``"s2"`` from transformers,
    so that only the wrapper can have registered it when the stand-in runs."""
    seen = {}

    def cli_evaluate():
        argv = sys.argv[1:]
        seen["argv"] = argv
        seen["registered"] = (
            AttentionInterface._global_mapping.get("s2") is s2_attention_forward
            and "s2" in AttentionMaskInterface._global_mapping
        )
        args = wrapper.model_args(argv)
        model = AutoModelForCausalLM.from_pretrained(
            args["pretrained"], attn_implementation=args["attn_implementation"]
        ).eval()
        with torch.no_grad():
            seen["logits"] = model(tokens(1, 80)).logits
        seen["implementation"] = model.config._attn_implementation

    module = types.ModuleType("lm_eval.__main__")
    module.cli_evaluate = cli_evaluate
    monkeypatch.setitem(sys.modules, "lm_eval", types.ModuleType("lm_eval"))
    monkeypatch.setitem(sys.modules, "lm_eval.__main__", module)

    def unregister():
        monkeypatch.delitem(AttentionInterface._global_mapping, "s2", raising=False)
        monkeypatch.delitem(AttentionMaskInterface._global_mapping, "s2", raising=False)

    seen["unregister"] = unregister
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    return seen


def test_wrapper_registers_and_runs_the_harness_with_s2(tmp_path, fake_harness):
    register()  # for the expected logits
    model = make_model(make_config("llama"), "s2")
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        want = model(tokens(1, 80)).logits
    fake_harness["unregister"]()
    wrapper.main(["--model", "hf", "--model_args", f"pretrained={tmp_path}", "--tasks", "t"])
    assert fake_harness["registered"]
    assert fake_harness["argv"] == [
        "--model",
        "hf",
        "--model_args",
        f"pretrained={tmp_path},{ADDED}",
        "--tasks",
        "t",
    ]
    assert fake_harness["implementation"] == "s2"
    assert torch.equal(fake_harness["logits"], want)


def test_wrapper_refuses_a_bad_checkpoint_before_the_harness(tmp_path, fake_harness):
    make_config("llama", {"dense_layers": {"pattern": "DDDSS"}}).save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match=r"dense_layers\.pattern"):
        wrapper.main(["--model_args", f"pretrained={tmp_path}"])
    assert "argv" not in fake_harness  # stopped before the harness ran
    make_config("llama", None).save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match="no 's2_attention' key"):
        wrapper.main(["--model_args", f"pretrained={tmp_path}"])


def test_wrapper_without_the_harness_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.setitem(sys.modules, "lm_eval.__main__", None)
    with pytest.raises(SystemExit, match=r'pip install "lm-eval\[hf\]"'):
        wrapper.main(["--model_args", "pretrained=some/hub-name", "--tasks", "t"])


# ------------------------------------------------------------------------ the real harness (opt-in)
TASK = """\
task: s2_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: acc
"""


def _word_model(path):
    """A tiny S2 Llama with a word-level tokenizer (one token per word, no special tokens
    added), saved to ``path``: what an export plus its tokenizer looks like."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(90)]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(
        [" ".join(words)], trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"])
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", pad_token="</s>"
    )
    register()
    model = make_model(make_config("llama"), "s2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer, words


def test_real_harness_scores_with_the_s2_attention(tmp_path):
    """lm-evaluation-harness itself (skipped where it is not installed: it is no dependency)
    on a local loglikelihood task: each logged log-likelihood equals the S2 model's own, the
    batch of 4 contexts of different lengths right-padded by the harness included."""
    pytest.importorskip("lm_eval")
    import random
    import subprocess

    model, tokenizer, words = _word_model(tmp_path / "model")
    rng = random.Random(0)
    docs = []
    for n in (40, 75, 110, 150, 63, 130):  # past the 32-token window: S2 differs from dense
        text = [rng.choice(words) for _ in range(n + 4)]
        docs.append({"context": " ".join(text[:n]), "continuation": " " + " ".join(text[n:])})
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "s2_tiny.yaml").write_text(TASK.format(data=data))
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "megatron_s2.hf.lm_eval", "--model", "hf"]
    cmd += ["--model_args", f"pretrained={tmp_path / 'model'},dtype=float32", "--tasks", "s2_tiny"]
    cmd += ["--include_path", str(tasks), "--batch_size", "4", "--device", "cpu"]
    cmd += ["--log_samples", "--output_path", str(tmp_path / "out")]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "'attn_implementation': 's2'" in run.stdout + run.stderr
    (samples,) = (tmp_path / "out").rglob("samples_s2_tiny_*.jsonl")
    logged = {}
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        logged[sample["doc"]["context"]] = float(sample["resps"][0][0][0])
    assert len(logged) == len(docs)
    for doc in docs:
        ids = tokenizer(doc["context"] + doc["continuation"], add_special_tokens=False).input_ids
        n = len(tokenizer(doc["context"], add_special_tokens=False).input_ids)
        with torch.no_grad():
            logp = model(torch.tensor([ids[:-1]])).logits[0].log_softmax(-1)
        want = sum(float(logp[i - 1, ids[i]]) for i in range(n, len(ids)))
        assert abs(logged[doc["context"]] - want) < 1e-3, (len(ids), logged[doc["context"]], want)
