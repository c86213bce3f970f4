"""megatron-s2-hf: tiny random Llama, Mistral and Qwen2 models made with ``transformers`` (no
download) are imported; our model's logits equal ``transformers``' (fp32, TP=PP=1, TP=2, PP=2);
import -> export gives back every tensor bit for bit; bad input is refused before anything is
written; an imported model trains as an S2 hybrid and exports with its schedule."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_s2.hf import convert
from megatron_s2.hf.cli import EXIT_BAD_INPUT
from megatron_s2.hf.cli import main as hf_main
from megatron_s2.hf.mapping import (
    HFConfigError,
    hf_config,
    hf_to_megatron,
    local_names,
    megatron_to_hf,
    model_settings,
    te_names,
)

transformers = pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = (2, 64)
FAMILIES = ("llama", "mistral", "qwen2")


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("TRITON_INTERPRET", None)  # dense layers only: no kernels to interpret
    env.pop("RANK", None)
    return env


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _config(family: str, **kw):
    """A tiny config of ``family``: 2 layers, hidden 64, 8 heads in 4 KV groups."""
    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
    )
    if family == "llama":
        # Llama 3.2's RoPE: base 500k, llama3 scaling; tied embeddings.
        base |= dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            max_position_embeddings=16384,
            tie_word_embeddings=True,
        )
        cls = transformers.LlamaConfig
    elif family == "mistral":
        # A head size that is not hidden / heads (Megatron's kv_channels).
        base |= dict(head_dim=16, sliding_window=None, rope_theta=1e6, rms_norm_eps=1e-6)
        cls = transformers.MistralConfig
    else:
        # A large norm epsilon, so that a lost model.norm_epsilon shows in the logits.
        base |= dict(
            rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
            rms_norm_eps=0.05,
        )
        cls = transformers.Qwen2Config
    return cls(**(base | kw))


def _random_model(config):
    """A model of ``config`` with O(1) random weights (norm weights around 1, biases nonzero),
    so that a wrong mapping shows in the logits."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def _tokenizer(path: str, vocab: int) -> None:
    """A word-level tokenizer of ``vocab`` entries with ``</s>`` as end of document."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"</s>": 0} | {f"w{i}": i for i in range(1, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>"}, f)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """``{family: dir}``: ``dir/hf`` the saved model (llama sharded, with a tokenizer),
    ``dir/tokens.pt`` and ``dir/ref.pt`` transformers' logits; then the worker's imports,
    logits and exports beside them."""
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for family in FAMILIES:
        d = root / family
        model = _random_model(_config(family))
        shard = {"max_shard_size": "20KB"} if family == "llama" else {}
        model.save_pretrained(d / "hf", **shard)
        if family == "llama":
            _tokenizer(str(d / "hf"), 256)
        tokens = torch.randint(0, 256, TOKENS, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ref = model(tokens).logits
        torch.save(tokens, d / "tokens.pt")
        torch.save(ref, d / "ref.pt")
        dirs[family] = d
    _run("-m", "tests.hf.hf_worker", "convert", *map(str, dirs.values()))
    return dirs


def _tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out |= load_file(os.path.join(directory, name))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(families, family):
    d = families[family]
    ours, ref = torch.load(d / "ours_tp1_pp1.pt"), torch.load(d / "ref.pt")
    assert ours.shape == ref.shape == (*TOKENS, 256)
    assert ref.abs().mean() > 0.1  # logits of O(1): a wrong mapping cannot hide in them
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_logits_equal_transformers_at_tp2_and_pp2_and_those_checkpoints_export(families):
    _run("-m", "tests.hf.hf_worker", "layouts", *map(str, families.values()))
    for family, d in families.items():
        ref = torch.load(d / "ref.pt")
        for layout in ("tp2_pp1", "tp1_pp2"):
            ours = torch.load(d / f"ours_{layout}.pt")
            torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5, msg=f"{family} {layout}")
    # Checkpoints saved at TP=2 and at PP=2 export to the same tensors (Megatron reshards).
    _run("-m", "tests.hf.hf_worker", "export", *map(str, families.values()))
    for family, d in families.items():
        before = _tensors(d / "hf")
        for layout in ("tp2_pp1", "tp1_pp2"):
            after = _tensors(d / f"exported_{layout}")
            assert sorted(after) == sorted(before), (family, layout)
            for k, t in before.items():
                assert after[k].dtype == t.dtype and torch.equal(after[k], t), (family, layout, k)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_import_export_round_trip_is_bit_exact(families, family):
    d = families[family]
    before, after = _tensors(d / "hf"), _tensors(d / "exported")
    assert sorted(before) == sorted(after)
    for k, t in before.items():
        assert (after[k].dtype, after[k].shape) == (t.dtype, t.shape), k
        assert torch.equal(after[k], t), k
    # Sharded above the limit, with transformers' index file.
    index = json.loads((d / "exported" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(before)
    assert len(set(index["weight_map"].values())) > 1
    config = json.loads((d / "exported" / "config.json").read_text())
    assert "s2_attention" not in config and "attn_implementation" not in config
    # transformers loads the export and computes the same logits.
    model = transformers.AutoModelForCausalLM.from_pretrained(d / "exported").eval()
    with torch.no_grad():
        logits = model(torch.load(d / "tokens.pt")).logits
    torch.testing.assert_close(logits, torch.load(d / "ref.pt"), atol=0, rtol=0)
    if family == "llama":  # the tokenizer travels with the model
        assert (d / "exported" / "tokenizer.json").read_bytes() == (
            d / "hf" / "tokenizer.json"
        ).read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_run_yaml_is_the_models_run_config(families, family):
    from megatron_s2.training.run_config import load_config

    d = families[family]
    cfg = load_config(d / "imported" / "run.yaml", ["data.blend=[x]"])
    hf = json.loads((d / "hf" / "config.json").read_text())
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups) == (
        2,
        64,
        8,
        4,
    )
    assert (m.ffn_hidden_size, m.vocab_size, m.norm_epsilon) == (96, 256, hf["rms_norm_eps"])
    assert m.untie_embeddings_and_output_weights == (family != "llama")
    assert m.add_qkv_bias == (family == "qwen2")
    assert cfg.attention is None  # all dense unless --s2-pattern
    assert cfg.checkpoint.load_dir == str(d / "imported" / "checkpoints")
    assert cfg.checkpoint.reset_iteration and not cfg.checkpoint.load_optimizer
    expected = {
        "llama": ("llama3", 500000.0),
        "mistral": ("none", 1e6),
        "qwen2": ("position_interpolation", 1e4),
    }[family]
    assert (m.rope_scaling, m.rotary_base) == expected
    if family == "llama":
        assert m.rope_scaling_factor == 8.0
        assert cfg.data.tokenizer == str(d / "imported" / "hf")
    else:
        assert cfg.data.tokenizer == "byte"
        assert m.kv_channels == (16 if family == "mistral" else None)


# ---- mapping: pure functions -------------------------------------------------------------------


def test_te_names_move_the_norms_into_the_linears():
    from megatron_s2.specs import _flavour_modules

    local = [
        "embedding.word_embeddings.weight",
        "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.11.pre_mlp_layernorm.weight",
        "decoder.layers.11.mlp.linear_fc1.weight",
        "decoder.final_layernorm.weight",
    ]
    te = te_names(local)
    assert te[1] == "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    assert te[3] == "decoder.layers.11.mlp.linear_fc1.layer_norm_weight"
    assert [a == b for a, b in zip(local, te)] == [True, False, True, False, True, True]
    assert local_names(te) == local == local_names(local)
    # The same renaming as the local spec's checkpoint key map (local and TE checkpoints are
    # interchangeable): each entry maps a local prefix to a TE prefix.
    keys = _flavour_modules(False, False, "test")
    for old, new in (keys.attn_keys | keys.mlp_keys).items():
        assert te_names([f"decoder.layers.3.{old}weight"]) == [f"decoder.layers.3.{new}weight"]


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_config_inverts_model_settings(family):
    config = _config(family).to_dict()
    settings = model_settings(config)
    again = hf_config(settings, family=family, template=config)
    assert model_settings(again) == settings
    assert model_settings(hf_config(settings, family=family)) == settings


# ---- bad input: a clear error, nothing written -------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A sharded tiny Llama (no Megatron needed: only the plans run)."""
    d = tmp_path_factory.mktemp("bad") / "llama"
    _random_model(_config("llama")).save_pretrained(d, max_shard_size="20KB")
    return d


def _edited(src, tmp_path, **changes):
    """A copy of the model directory ``src`` with ``config.json`` keys changed (None deletes)."""
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _refused(hf_dir, tmp_path, *words, **kw):
    out = tmp_path / "out"
    with pytest.raises(HFConfigError) as e:
        convert.plan_import(hf_dir, out, **kw)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert not out.exists()
    return str(e.value)


def test_moe_is_refused(llama_dir, tmp_path):
    d = _edited(llama_dir, tmp_path, num_local_experts=8)
    _refused(d, tmp_path, "config.json", "num_local_experts=8", "mixture-of-experts")


def test_sliding_window_is_refused(llama_dir, tmp_path):
    d = _edited(llama_dir, tmp_path, model_type="mistral", sliding_window=4096)
    _refused(d, tmp_path, "config.json", "sliding_window=4096", "must be null")


def test_unknown_model_type_is_refused(llama_dir, tmp_path):
    d = _edited(llama_dir, tmp_path, model_type="gpt2")
    _refused(d, tmp_path, "config.json", "'gpt2'", "llama, mistral, qwen2")


def test_unsupported_rope_scaling_is_refused(llama_dir, tmp_path):
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    d = _edited(llama_dir, tmp_path, rope_parameters=rope)
    _refused(d, tmp_path, "config.json", "'yarn'", "linear, llama3")
    rope = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "high_freq_factor": 2.0}
    d2 = tmp_path / "again"
    d2.mkdir()
    _refused(_edited(llama_dir, d2, rope_parameters=rope), d2, "high_freq_factor")


def test_missing_shard_is_refused(llama_dir, tmp_path):
    d = _edited(llama_dir, tmp_path)
    shard = sorted(p for p in os.listdir(d) if p.startswith("model-0000"))[1]
    os.remove(d / shard)
    _refused(d, tmp_path, "model.safetensors.index.json", shard, "missing")


def test_shape_mismatch_is_refused(llama_dir, tmp_path):
    d = _edited(llama_dir, tmp_path, intermediate_size=128)
    _refused(d, tmp_path, "gate_proj", "[96, 64]", "[128, 64]", "config.json")


def test_s2_pattern_that_does_not_fit_is_refused(llama_dir, tmp_path):
    # 8 heads: 3 dense heads per S2 layer do not divide them (the schedule's own check).
    _refused(
        llama_dir,
        tmp_path,
        "attention",
        "num_dense_heads",
        s2_pattern="DS",
        s2_settings={"block_size": 16, "num_dense_heads": 3},
    )
    _refused(llama_dir, tmp_path, "attention", "pattern", s2_pattern="DX")


def test_s2_pattern_with_holes_beyond_the_training_length_is_refused(llama_dir, tmp_path):
    # 8 heads, a stripe every 16th block: 8 of the 16 phases. At 256 tokens the 16-block local
    # window covers everything (the trainer accepts it), but export would refuse the model
    # (transformers runs it at any length), so the import refuses it before training.
    s2 = {"block_size": 16, "local_blocks": 16, "vert_stride": 16}
    msg = _refused(
        llama_dir,
        tmp_path,
        "--s2-settings",
        "--seq-length 256",
        "export",
        "8 of every 16 key blocks unseen",
        "'{vert_stride: 8}'",
        seq_length=256,
        s2_pattern="DS",
        s2_settings=s2,
    )
    assert "config.json" in msg
    # A stride of at most the heads covers every block at any length: accepted.
    plan = convert.plan_import(
        llama_dir,
        tmp_path / "ok",
        seq_length=256,
        s2_pattern="DS",
        s2_settings=s2 | {"vert_stride": 8},
    )
    assert plan.run_config["attention"]["s2"]["vert_stride"] == 8


def test_nonempty_out_dir_is_refused_and_the_cli_exits_2(llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert hf_main(["import", str(llama_dir), str(out)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert str(out) in err and "not empty" in err
    assert os.listdir(out) == ["keep.txt"]
    assert hf_main(["import", str(tmp_path / "nothing"), str(tmp_path / "o2")]) == EXIT_BAD_INPUT
    assert "is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()


# ---- the Llama-3.2-1B extension example ----------------------------------------------------------

# Llama-3.2-1B's config.json, the keys the import reads (the published values).
LLAMA_32_1B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
EXAMPLE = os.path.join(REPO, "configs", "extend", "llama-3.2-1b-s2-32k.yaml")


def test_llama_32_1b_example_has_the_imported_shape_and_loads(capsys):
    from megatron_s2.training import cli
    from megatron_s2.training.run_config import load_config

    cfg = load_config(EXAMPLE)
    imported = model_settings(LLAMA_32_1B)
    model = cfg.model
    for key, value in imported.items():
        assert getattr(model, key) == value, key
    assert model.seq_length == 32768 and cfg.schedule().layer_kinds(16).count("dense") == 8
    assert cfg.checkpoint.load_dir and cfg.checkpoint.reset_iteration
    assert not cfg.checkpoint.load_optimizer
    # The trainer's own check of the whole config (fp32: this machine has no GPU).
    assert cli.main(["--config", EXAMPLE, "--print-config", "train.precision=fp32"]) == 0
    assert "llama-3.2-1b-s2-32k" in capsys.readouterr().out


def test_s2_pattern_goes_into_run_yaml(llama_dir, tmp_path):
    plan = convert.plan_import(
        llama_dir, tmp_path / "out", s2_pattern="DS", s2_settings={"block_size": 16}
    )
    assert plan.run_config["attention"] == {
        "dense_layers": {"pattern": "DS"},
        "s2": {"block_size": 16},
    }
    assert not (tmp_path / "out").exists()  # a plan writes nothing


def test_run_yaml_has_a_continual_pretraining_learning_rate(llama_dir, tmp_path):
    """run.yaml trains a pretrained model: its learning rate is the Llama recipe's, not the
    trainer's from-scratch default (1e-3), which the docs' command would otherwise use."""
    from megatron_s2.training.run_config import OptimizerConfig, RunConfig, load_config

    plan = convert.plan_import(llama_dir, tmp_path / "out")
    run = json.loads(json.dumps(plan.run_config)) | {"data": {"blend": ["x"]}}
    cfg = RunConfig.from_dict(run)
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr) == (2.0e-5, 2.0e-6)
    assert cfg.optimizer.lr < OptimizerConfig().lr / 10
    # The example recipe for a real Llama uses the same rates.
    example = load_config(EXAMPLE).optimizer
    assert (example.lr, example.min_lr) == (cfg.optimizer.lr, cfg.optimizer.min_lr)


def test_te_import_names(llama_dir):
    index = convert.read_tensor_index(llama_dir)
    settings = model_settings(json.loads((llama_dir / "config.json").read_text()))
    hf = {k: torch.zeros(s) for k, (_, s, _) in index.items()}
    local = hf_to_megatron(hf, settings)
    te = hf_to_megatron(hf, settings, transformer_impl="transformer_engine")
    assert list(te) == te_names(local) and "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in te
    assert "decoder.layers.1.pre_mlp_layernorm.weight" not in te
    assert megatron_to_hf(te, settings).keys() == megatron_to_hf(local, settings).keys()


def test_export_refuses_bad_input(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert hf_main(["export", str(empty), str(tmp_path / "out")]) == EXIT_BAD_INPUT
    assert "no intact checkpoint" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    assert hf_main(["export", str(empty), str(busy)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "OUT_HF_DIR" in err and "not empty" in err
    assert not (tmp_path / "out").exists()
    # A path that is not there says so (not "no intact checkpoint"), with where it looked.
    assert (
        hf_main(["export", str(tmp_path / "runs" / "typo"), str(tmp_path / "out")])
        == EXIT_BAD_INPUT
    )
    err = capsys.readouterr().err
    assert "does not exist" in err and "RUN_OR_CHECKPOINT" in err and "typo" in err
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_schedule_with_holes_beyond_the_trained_length(
    families, tmp_path, monkeypatch
):
    """A run may train a hybrid whose stripes leave key blocks unseen only beyond its
    model.seq_length; transformers runs the export at any length, so export refuses it (as
    load_s2_model would) unless --allow-coverage-holes, and writes every schedule setting."""
    from megatron_s2.hf import convert as conv
    from megatron_s2.training.evaluation import model as eval_model

    saved = eval_model.saved_config

    def with_holes(root, iteration):
        run, vocab = saved(root, iteration)
        # 8 heads, a stripe every 16th block: 8 of the 16 phases are never covered.
        run = {**run, "attention": {"dense_layers": {"pattern": "DS"}, "s2": {"vert_stride": 16}}}
        return run, vocab

    monkeypatch.setattr(eval_model, "saved_config", with_holes)
    src = families["llama"] / "imported"
    with pytest.raises(HFConfigError, match="--allow-coverage-holes"):
        conv.plan_export(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    plan = conv.plan_export(src, tmp_path / "out", allow_coverage_holes=True)
    assert plan.hybrid and plan.s2_attention["allow_coverage_holes"] is True
    assert plan.s2_attention["s2"]["vert_stride"] == 16
    assert plan.s2_attention["s2"]["block_size"] == 64  # the default, written out


@pytest.mark.parametrize(
    "attention, named",
    [
        ({"dense_layers": {"pattern": "DS"}, "s2": {"sinks": True}}, "attention.s2.sinks: true"),
        (
            {"dense_layers": {"pattern": "DS", "position_embedding": "nope"}},
            "attention.dense_layers.position_embedding: nope",
        ),
        ({"dense_layers": {"pattern": "D", "rotary_base": 80000.0}}, "rotary_base: 80000"),
        ({"dense_layers": {"pattern": "D", "sinks": True}}, "attention.dense_layers.sinks: true"),
    ],
)
def test_export_refuses_levers_the_exported_model_cannot_run(
    families, tmp_path, monkeypatch, attention, named
):
    """A run trained with learned sinks or with the dense layers' own position encoding cannot
    be written as a Hugging Face model that computes the same (the sinks' weights have no
    place there; transformers gives every layer the model's RoPE): export refuses it, naming
    the setting, before writing anything, an all-dense schedule included."""
    from megatron_s2.hf import convert as conv
    from megatron_s2.training.evaluation import model as eval_model

    saved = eval_model.saved_config

    def with_lever(root, iteration):
        run, vocab = saved(root, iteration)
        return {**run, "attention": attention}, vocab

    monkeypatch.setattr(eval_model, "saved_config", with_lever)
    with pytest.raises(HFConfigError, match=named.replace(".", r"\.")) as info:
        conv.plan_export(families["llama"] / "imported", tmp_path / "out")
    assert "cannot run" in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_an_eod_first_run_exports_a_model_that_reads_behind_eod(families, tmp_path):
    """A run trained with train.eod_first (every sample behind the EOD token) exports the same
    weights as without it, with config.json naming EOD as the model's BOS and flagging it, and a
    tokenizer with which transformers puts EOD in front of every text while the trainer's own
    encoding (add_special_tokens=False) is unchanged; importing the export continues training
    with train.eod_first, importing the plain export without it."""
    from megatron_s2.hf import convert as conv
    from megatron_s2.training.tokenizer import HFTokenizer

    d = families["llama"]
    plain, eod = d / "exported", d / "exported_eod_first"
    a, b = _tensors(plain), _tensors(eod)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    config = json.loads((eod / "config.json").read_text())
    assert config["bos_token_id"] == 0 and config["s2_eod_first"] is True  # </s> is id 0
    assert "s2_eod_first" not in json.loads((plain / "config.json").read_text())
    text = "w3 w17 w4 w3"
    ids = HFTokenizer(eod).encode(text)  # what the trainer reads from the exported files
    assert ids == [3, 17, 4, 3]
    tok = transformers.AutoTokenizer.from_pretrained(eod)
    assert tok(text).input_ids == [0, *ids]
    assert tok(text, add_special_tokens=False).input_ids == ids
    assert tok.bos_token_id == 0
    assert transformers.AutoTokenizer.from_pretrained(plain)(text).input_ids == ids
    # generate() starts an empty prompt from the generation config's BOS: the EOD token too.
    generation = json.loads((eod / "generation_config.json").read_text())
    assert generation["bos_token_id"] == 0
    assert json.loads((plain / "generation_config.json").read_text()).get("bos_token_id") != 0
    model = transformers.AutoModelForCausalLM.from_pretrained(eod).eval()
    assert model.generate(max_new_tokens=2, do_sample=False)[0, 0].item() == 0
    again = conv.plan_import(eod, tmp_path / "again", seq_length=64)
    assert again.run_config["train"] == {"eod_first": True}
    assert "train" not in conv.plan_import(plain, tmp_path / "plain", seq_length=64).run_config


@pytest.mark.parametrize("tokenizer, found", [("byte", (256, None)), ("/no/such/tok", None)])
def test_an_eod_first_export_names_the_eod_token_or_refuses(
    families, tmp_path, monkeypatch, capsys, tokenizer, found
):
    """The EOD id of an eod_first run comes from its tokenizer as the trainer loads it (the
    byte tokenizer's 256, no tokenizer files, which the CLI says); a tokenizer that cannot be
    loaded is refused before anything is written (exit 2), rather than exporting a model whose
    users would not know which token to put first."""
    from megatron_s2.hf import cli
    from megatron_s2.hf import convert as conv
    from megatron_s2.training.evaluation import model as eval_model

    saved = eval_model.saved_config

    def eod_first(root, iteration):
        run, vocab = saved(root, iteration)
        return {**run, "train": {"eod_first": True}, "data": {"tokenizer": tokenizer}}, vocab

    monkeypatch.setattr(eval_model, "saved_config", eod_first)
    if found is None:
        with pytest.raises(HFConfigError, match="train.eod_first: true") as info:
            conv.plan_export(families["llama"] / "imported", tmp_path / "out")
        assert "data.tokenizer=/no/such/tok cannot be loaded" in str(info.value)
        assert not (tmp_path / "out").exists()
        assert cli.main(["export", str(families["llama"] / "imported"), str(tmp_path / "o")]) == 2
        assert "train.eod_first: true" in capsys.readouterr().err
    else:
        plan = conv.plan_export(families["llama"] / "imported", tmp_path / "out")
        assert plan.eod_first and (plan.eod, plan.eod_token) == found
        monkeypatch.setattr(conv, "run_export", lambda plan: ["config.json"])
        assert cli.main(["export", str(families["llama"] / "imported"), str(tmp_path / "o")]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "reads every input behind EOD (id 256, config.json's bos_token_id)" in out
        assert "no tokenizer was exported (byte tokenizer): put it first yourself" in out


def test_import_without_a_tokenizer_says_the_byte_tokenizer_does_not_fit(llama_dir, tmp_path):
    """A model without tokenizer.json gets data.tokenizer: byte; with a vocabulary below the
    byte tokenizer's 258 the trainer would refuse the pair, so import says so up front."""
    res = subprocess.run(
        [sys.executable, "-m", "megatron_s2.hf.cli", "import", str(llama_dir), str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    assert "has no tokenizer.json" in res.stdout
    assert "vocabulary (256) is smaller than the byte tokenizer's (258)" in res.stdout


def test_export_says_when_the_imported_config_json_is_not_found(
    llama_dir, tmp_path, monkeypatch, capsys
):
    """The run config's paths (checkpoint.load_dir, data.tokenizer) are relative to where the
    trainer ran: exported from another directory, the imported config.json (token ids, dtype,
    original context) is not found, and the CLI says so and how to give it, rather than
    writing transformers' defaults silently. No checkpoint is read: the run is faked."""
    from megatron_s2.hf import cli
    from megatron_s2.hf import convert as conv
    from megatron_s2.training.evaluation import model as eval_model

    hf = json.loads((llama_dir / "config.json").read_text())
    run = {
        "model": model_settings(hf) | {"seq_length": 128},
        "data": {"tokenizer": "byte"},
        "checkpoint": {"load_dir": os.path.join("imports", "m", "checkpoints")},
    }
    monkeypatch.setattr(eval_model, "resolve_checkpoint", lambda root: (root, 3))
    monkeypatch.setattr(eval_model, "saved_config", lambda root, it: (run, None))
    monkeypatch.setattr(conv, "run_export", lambda plan: ["config.json"])
    trained_in = tmp_path / "work"
    (trained_in / "imports" / "m" / "hf").mkdir(parents=True)
    shutil.copy(llama_dir / "config.json", trained_in / "imports" / "m" / "hf" / "config.json")
    # The run directories exist (their checkpoints are faked above) where export is run.
    (trained_in / "runs" / "r").mkdir(parents=True)
    (tmp_path / "elsewhere" / "runs" / "r").mkdir(parents=True)

    # From the directory the run was trained in: found, and named.
    monkeypatch.chdir(trained_in)
    plan = conv.plan_export("runs/r", tmp_path / "out1")
    assert plan.template_path == Path("imports/m/hf/config.json")
    assert plan.template["max_position_embeddings"] == hf["max_position_embeddings"]
    assert cli.main(["export", "runs/r", str(tmp_path / "out2")]) == 0
    assert "imports/m/hf/config.json's, with the run's shape" in capsys.readouterr().out

    # From elsewhere: not found; the note names where it looked and the way out.
    monkeypatch.chdir(tmp_path / "elsewhere")
    plan = conv.plan_export("runs/r", tmp_path / "out3")
    assert plan.template is None and plan.template_path is None
    assert plan.template_looked_at == (Path("imports/m/hf/config.json"),)
    assert cli.main(["export", "runs/r", str(tmp_path / "out4")]) == 0
    out = capsys.readouterr().out
    assert "config.json was not found" in out and "imports/m/hf/config.json" in out
    assert str(tmp_path / "elsewhere") in out and "--hf-config" in out
