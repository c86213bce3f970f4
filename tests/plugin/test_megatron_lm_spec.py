"""Megatron-LM's ``pretrain_gpt.py --spec megatron_s2.specs s2_layer_spec`` path, as users run it.

Megatron-LM itself (``megatron.training``) is not a pip package, so the test does what its
``gpt_builders.gpt_builder`` does with the pieces it uses from megatron-core: the config is
Megatron-LM's argument defaults with the flags of ``docs/megatron.md`` applied
(``core_transformer_config_from_args`` copies arguments onto ``TransformerConfig`` fields by
name), the spec is loaded with ``megatron.core.transformer.spec_utils.import_module`` from the
``--spec`` words, and ``GPTModel`` is built with RoPE and trained one step. The flags are read
from the documentation, so the documented command is what is tested.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.megatron import REPO

pytest.importorskip("megatron.core")

DOC = os.path.join(REPO, "docs", "megatron.md")

# Megatron-LM's argument defaults (megatron/training/arguments.py, core_v0.16.1 and core_v0.19.0)
# for the TransformerConfig fields that the documented flags change.
MEGATRON_LM_DEFAULTS = {
    "transformer_impl": "transformer_engine",
    "attention_dropout": 0.1,
    "persist_layer_norm": True,  # = not --no-persist-layer-norm
    "apply_rope_fusion": True,
    "gradient_accumulation_fusion": True,
}
# Flag -> (TransformerConfig field, value it sets).
FLAG_FIELDS = {
    "--transformer-impl": ("transformer_impl", str),
    "--attention-dropout": ("attention_dropout", float),
    "--no-persist-layer-norm": ("persist_layer_norm", False),
    "--no-rope-fusion": ("apply_rope_fusion", False),
    "--no-gradient-accumulation-fusion": ("gradient_accumulation_fusion", False),
}
# Flags that act outside the model config: Megatron-LM's dataloader builds no S x S mask.
DATA_FLAGS = {"--no-create-attention-mask-in-dataloader"}


def documented_flags() -> list:
    """The words of the ``S2_LOCAL_FLAGS=( ... )`` array in docs/megatron.md."""
    with open(DOC) as f:
        text = f.read()
    m = re.search(r"S2_LOCAL_FLAGS=\((.*?)\n\)", text, re.S)
    assert m, "docs/megatron.md has no S2_LOCAL_FLAGS=( ... ) block"
    words = []
    for line in m.group(1).splitlines():
        words += line.split("#")[0].split()
    return words


def split_flags(words: list) -> tuple:
    """(spec words, {flag: value or None}) from the documented words."""
    assert words[0] == "--spec", words
    spec, rest = words[1:3], words[3:]
    flags, i = {}, 0
    while i < len(rest):
        flag = rest[i]
        has_value = i + 1 < len(rest) and not rest[i + 1].startswith("--")
        flags[flag] = rest[i + 1] if has_value else None
        i += 2 if has_value else 1
    return spec, flags


def config_kwargs(flags: dict) -> dict:
    kw = dict(MEGATRON_LM_DEFAULTS)
    for flag, value in flags.items():
        if flag in DATA_FLAGS:
            continue
        assert flag in FLAG_FIELDS, f"documented flag {flag} is not modelled by this test"
        field, effect = FLAG_FIELDS[flag]
        kw[field] = effect(value) if callable(effect) else effect
    return kw


SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from megatron_s2.training.cpu_mode import enable_cpu_mode
    enable_cpu_mode()  # RoPE and the CUDA RNG tracker are CUDA-only in megatron-core
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import import_module

    spec_words, kw = json.loads(sys.argv[1])
    torch.distributed.init_process_group("gloo", rank=0, world_size=1,
                                         store=torch.distributed.HashStore())
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    # A tiny GQA hybrid; what pretrain_gpt.py derives from the model flags.
    config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=8,
                               num_query_groups=4, ffn_hidden_size=128, normalization="RMSNorm",
                               gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                               add_bias_linear=False, hidden_dropout=0.0, **kw)
    spec = import_module(tuple(spec_words))
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=128,
                     max_sequence_length=256, position_embedding_type="rope",
                     rotary_base=1000000)
    kinds = [type(l.self_attention.core_attention).__name__ for l in model.decoder.layers]
    tok = torch.randint(0, 128, (2, 256))
    pos = torch.arange(256)[None].expand(2, -1)
    loss = model(tok, pos, None, labels=tok).float().mean()
    loss.backward()
    assert torch.isfinite(loss)
    print("KINDS", json.dumps(kinds))
""")


def run_builder(spec, kw, tmp_path):
    import json

    sched = tmp_path / "schedule.yaml"
    sched.write_text(
        "s2: {block_size: 16, local_blocks: 2, vert_stride: 8, head_offset: 1}\n"
        "dense_layers: {pattern: SD}\n"
    )
    env = dict(os.environ, MEGATRON_S2_SCHEDULE=str(sched))
    env.pop("TRITON_INTERPRET", None)  # the S2 layers run the reference on CPU: fast
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps([spec, kw])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
    )


def test_documented_local_spec_command_builds_and_trains(tmp_path):
    spec, flags = split_flags(documented_flags())
    assert spec == ["megatron_s2.specs", "s2_layer_spec"]
    proc = run_builder(spec, config_kwargs(flags), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        'KINDS ["S2CoreAttention", "FusedDenseAttention", "S2CoreAttention", '
        '"FusedDenseAttention"]' in proc.stdout
    )


@pytest.mark.parametrize(
    "flag, error",
    [
        (
            "--attention-dropout",
            r"attention dropout \(0\.1\) is not implemented for S2 layers.*"
            r"--attention-dropout 0\.0",
        ),
        ("--no-persist-layer-norm", r"persist_layer_norm"),
        ("--no-rope-fusion", r"apply_rope_fusion|rope"),
        ("--no-gradient-accumulation-fusion", r"gradient_accumulation_fusion"),
    ],
)
def test_each_documented_flag_is_needed(flag, error, tmp_path):
    """Without the flag Megatron-LM's default applies and the build or first step fails."""
    spec, flags = split_flags(documented_flags())
    assert flag in flags
    del flags[flag]
    proc = run_builder(spec, config_kwargs(flags), tmp_path)
    assert proc.returncode != 0
    assert re.search(error, proc.stderr), proc.stderr[-2000:]
