"""megatron_s2.hf.s2_attention: an exported S2 hybrid run in ``transformers`` (CPU, fp32).

Tiny random Llama (MQA) and Qwen2 (QKV bias, GQA 4/2) models made from a config, no download.
The reference is the same model's eager attention with an explicit boolean mask per layer: the
S2 token mask (``tests.helpers.kernels.token_mask``, from ``S2Pattern.block_mask``) on S2 layers,
the causal mask on dense ones, so it shares no code with the function under test beyond the
schedule's pattern.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    AttentionInterface,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

from megatron_s2.hf import s2_attention as hf_s2
from megatron_s2.hf.s2_attention import (
    S2ConfigError,
    S2InputError,
    load_s2_model,
    register,
    s2_attention_forward,
)
from megatron_s2.schedule import AttentionSchedule
from tests.helpers.kernels import token_mask

pytestmark = pytest.mark.version_independent

BLOCK = 16
# Layer 0 and 2 dense ("DS"), layer 1 S2 with the defaults below, layer 3 an override with
# dense heads and another stride: per-layer settings reach the right layer. Local window
# 2 blocks = 32 tokens, so lengths past it differ from dense attention.
SCHEDULE = {
    "s2": {"block_size": BLOCK, "local_blocks": 2, "vert_stride": 4, "head_offset": 1},
    "dense_layers": {"pattern": "DS"},
    "overrides": {3: {"vert_stride": 2, "num_dense_heads": 2, "head_offset": 0}},
}
WINDOW = 2 * BLOCK
LENGTHS = [16, 37, 64, 100, 150]


def make_config(family: str, schedule=SCHEDULE, layers: int = 4):
    """A tiny config of ``family`` with ``s2_attention`` as the export writes it (JSON: the
    override's layer index a string). A larger init than the default makes attention peaked
    enough that a wrong mask shows far above the tolerance."""
    mapping = None if schedule is None else _as_json(schedule)
    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=512,
        initializer_range=0.15,
    )
    if mapping is not None:
        common["s2_attention"] = mapping
    if family == "llama":
        return LlamaConfig(num_key_value_heads=1, **common)
    return Qwen2Config(num_key_value_heads=2, **common)  # Qwen2: QKV bias


def _as_json(schedule):
    import json

    return json.loads(json.dumps(schedule))


def make_model(config, implementation: str, seed: int = 0):
    cls = LlamaForCausalLM if isinstance(config, LlamaConfig) else Qwen2ForCausalLM
    torch.manual_seed(seed)
    # A copy per model: _from_config records the implementation on the config object.
    return cls._from_config(copy.deepcopy(config), attn_implementation=implementation).eval()


def twin(model, implementation: str):
    """The same weights under another attention implementation."""
    other = make_model(model.config, implementation)
    other.load_state_dict(model.state_dict())
    return other


# ------------------------------------------------------------------------ the independent reference
REFERENCE = "s2_test_masked_eager"


def masked_eager_attention(module, query, key, value, attention_mask, scaling, **kwargs):
    """Eager attention with this layer's explicit mask: S2 token mask or causal (no cache)."""
    assert attention_mask is None, "the reference runs unpadded batches only"
    config = module.config
    seq = query.shape[2]
    schedule = AttentionSchedule.from_dict(config.s2_attention)
    pattern = schedule.layer_pattern(
        module.layer_idx + 1,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.num_hidden_layers,
    )
    pos = torch.arange(seq)
    allowed = (
        (pos[None, :] <= pos[:, None])[None]
        if pattern is None
        else token_mask(pattern, seq, seq)  # (heads, seq, seq)
    )
    additive = torch.zeros(allowed.shape, dtype=query.dtype).masked_fill(~allowed, float("-inf"))
    return eager_attention_forward(module, query, key, value, additive[None], scaling=scaling)


@pytest.fixture(scope="module", autouse=True)
def registered():
    register()
    AttentionInterface.register(REFERENCE, masked_eager_attention)
    AttentionMaskInterface.register(REFERENCE, sdpa_mask)


def tokens(batch: int, seq: int, seed: int = 1):
    return torch.randint(0, 97, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------ equivalence
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_s2_logits_equal_masked_eager_reference(family):
    model = make_model(make_config(family), "s2")
    reference = twin(model, REFERENCE)
    dense = twin(model, "sdpa")
    with torch.no_grad():
        for seq in LENGTHS:
            x = tokens(2, seq, seed=seq)
            got, want = model(x).logits, reference(x).logits
            # fp32 sums in another order (the kernel's blocks against one masked softmax): up to
            # 1.3e-5 on logits of ~5 on some CPUs (qwen2, seq 150; the same with Triton 3.6 and
            # 3.9), far below the S2-against-dense gap (> 1) that the comparison must catch.
            torch.testing.assert_close(
                got, want, atol=1e-5, rtol=1e-5, msg=lambda m, seq=seq: f"seq {seq}: {m}"
            )
            # Within the local window S2 is dense attention; past it, it must differ (so a
            # function that silently ran dense attention fails the comparison above).
            base = dense(x).logits
            torch.testing.assert_close(got[:, :WINDOW], base[:, :WINDOW], atol=1e-5, rtol=0)
            if seq > WINDOW:
                assert (got[:, WINDOW:] - base[:, WINDOW:]).abs().max() > 1e-2, seq


def test_all_dense_schedule_is_sdpa_exactly():
    config = make_config("qwen2", {"dense_layers": {"pattern": "D"}})
    model = make_model(config, "s2")
    sdpa = twin(model, "sdpa")
    x = tokens(2, 100)
    with torch.no_grad():
        assert torch.equal(model(x).logits, sdpa(x).logits)
    # Dense layers take padded batches as SDPA does.
    mask = torch.ones_like(x)
    mask[0, :7] = 0
    with torch.no_grad():
        assert torch.equal(
            model(x, attention_mask=mask).logits, sdpa(x, attention_mask=mask).logits
        )


def test_gradients_flow_through_s2_layers():
    model = make_model(make_config("llama"), "s2")
    reference = twin(model, REFERENCE)
    x = tokens(1, 70)
    for m in (model, reference):
        m(x, labels=x).loss.backward()
    got = model.model.layers[1].self_attn.q_proj.weight.grad
    want = reference.model.layers[1].self_attn.q_proj.weight.grad
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------ generation with a cache
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_generation_equals_full_forward(cache):
    """Each decode step's logits equal the full forward's at that position: the query is put at
    its absolute position (prompt 45, not a block multiple; 40 steps cross three blocks)."""
    model = make_model(make_config("qwen2"), "s2")
    prompt, steps = 45, 40
    extra = {} if cache == "dynamic" else {"cache_implementation": "static"}
    with torch.no_grad():
        out = model.generate(
            tokens(1, prompt),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **extra,
        )
        full = model(out.sequences).logits
    stepped = torch.stack(out.logits, dim=1)
    torch.testing.assert_close(stepped, full[:, prompt - 1 : prompt - 1 + steps], atol=1e-5, rtol=0)


def test_decode_step_through_the_triton_kernel(monkeypatch):
    """The decode path's call (queries padded back to a block boundary, keys longer than the
    queries) through the Triton kernel, under the interpreter here, equals the reference."""
    model = make_model(make_config("llama"), "s2")
    x = tokens(1, 38)
    with torch.no_grad():
        prefill = model(x[:, :37], use_cache=True)
        want = model(x[:, 37:], cache=prefill.cache).logits
        full = model(x).logits[:, 37:]
    real = hf_s2.s2attn.s2_attention
    calls = []

    def triton(*args, **kwargs):
        calls.append(kwargs["q_start"])
        return real(*args, **(kwargs | {"backend": "triton"}))

    monkeypatch.setattr(hf_s2.s2attn, "s2_attention", triton)
    with torch.no_grad():
        prefill = model(x[:, :37], use_cache=True)
        got = model(x[:, 37:], cache=prefill.cache).logits
    assert calls == [0, 0, 32, 32], calls  # 2 S2 layers: prefill, then the step at block 2
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------ refused inputs
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_refused_on_s2_layers(side):
    model = make_model(make_config("llama"), "s2")
    x = tokens(2, 50)
    mask = torch.ones_like(x)
    if side == "left":
        mask[0, :5] = 0
    else:
        mask[0, -5:] = 0
    with pytest.raises(S2InputError, match="padded batch"):
        model(x, attention_mask=mask)
    # An all-ones mask is no padding: accepted, same logits as without it.
    with torch.no_grad():
        torch.testing.assert_close(
            model(x, attention_mask=torch.ones_like(x)).logits, model(x).logits, atol=0, rtol=0
        )


def test_left_padded_generation_refused():
    model = make_model(make_config("llama"), "s2")
    x = tokens(2, 20)
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    with pytest.raises(S2InputError, match="padded"):
        model.generate(x, attention_mask=mask, max_new_tokens=2, do_sample=False)


def test_packed_position_ids_refused():
    model = make_model(make_config("llama"), "s2")
    x = tokens(1, 40)
    position_ids = torch.cat([torch.arange(20), torch.arange(20)])[None]
    with pytest.raises(S2InputError, match="packed"):
        model(x, position_ids=position_ids)


def test_mask_verdict_is_not_reused_for_another_mask():
    """The causal-mask check is cached for the mask object every layer shares; a new mask (even
    where a freed one's memory is reused) or one changed in place is checked again."""
    check = hf_s2._check_mask
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    additive = torch.zeros(6, 6).masked_fill(~causal, torch.finfo(torch.float32).min)
    for mask in (causal[None, None], additive[None, None]):  # bool and additive masks
        check(mask.clone(), 0, 6, 6)  # accepted, then freed
        padded = mask.clone()
        padded[..., 0] = padded[..., 5]  # key 0 masked for every query, like a left pad
        with pytest.raises(S2InputError, match="padded"):
            check(padded, 0, 6, 6)
    mask = causal[None, None].clone()
    check(mask, 0, 6, 6)
    mask[0, 0, 5, 0] = False  # changed in place: a new version
    with pytest.raises(S2InputError, match="padded"):
        check(mask, 0, 6, 6)


def test_attention_dropout_refused_in_training_mode():
    config = make_config("llama")
    config.attention_dropout = 0.1
    model = make_model(config, "s2").train()
    with pytest.raises(S2InputError, match="dropout"):
        model(tokens(1, 20))


# ------------------------------------------------------------------------ loading
def test_load_s2_model_round_trip(tmp_path):
    model = make_model(make_config("qwen2"), "s2")
    model.save_pretrained(tmp_path)
    loaded = load_s2_model(tmp_path, dtype=torch.float32)
    assert loaded.config._attn_implementation == "s2"
    assert loaded.config.s2_attention == _as_json(SCHEDULE)
    x = tokens(1, 90)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    with pytest.raises(ValueError, match="attn_implementation must be 's2'"):
        load_s2_model(tmp_path, attn_implementation="sdpa")


@pytest.mark.parametrize(
    "schedule, named",
    [
        (None, "no 's2_attention' key"),
        ({"dense_layers": {"pattern": "DSDSD"}}, "dense_layers.pattern"),
        ({"dense_layers": {"indices": [4]}}, "dense_layers.indices"),
        ({"s2": {"num_dense_heads": 3}}, "num_dense_heads"),
        ({"s2": {"block_size": 48}}, "s2_attention.s2.block_size"),
        ({"s2": {"vert_stride": 16}}, "allow_coverage_holes"),
        ({"overrides": {9: {"vert_stride": 2}}}, "attention.overrides.9"),
        ({"window": 3}, "unknown key s2_attention.window"),
    ],
)
def test_bad_config_refused_before_loading(tmp_path, schedule, named):
    # Only config.json: if the check let it through, loading would fail on the missing weights.
    make_config("llama", schedule).save_pretrained(tmp_path)
    with pytest.raises(S2ConfigError, match=named.replace(".", r"\.")) as info:
        load_s2_model(tmp_path)
    if schedule is not None:
        assert "4 layers, 4 heads, 1 KV heads" in str(info.value)


@pytest.mark.parametrize(
    "lever, named",
    [
        ({"s2": {**SCHEDULE["s2"], "sinks": True}}, "s2_attention.s2.sinks: true"),
        (
            {"dense_layers": {"pattern": "DS", "position_embedding": "nope"}},
            "s2_attention.dense_layers.position_embedding: nope",
        ),
        (
            {"dense_layers": {"pattern": "DS", "rotary_base": 80000.0}},
            "s2_attention.dense_layers.rotary_base: 80000",
        ),
        (
            {"dense_layers": {"pattern": "DS", "sinks": True}},
            "s2_attention.dense_layers.sinks: true",
        ),
    ],
)
def test_levers_this_attention_does_not_run_are_refused_before_loading(tmp_path, lever, named):
    """Learned sinks and the dense layers' own positions change what a layer computes; running
    the patterns without them would be another model, so a config.json naming one (the export
    refuses such runs; this is a hand-edited file) is refused before any weight loads."""
    make_config("llama", SCHEDULE | lever).save_pretrained(tmp_path)
    with pytest.raises(S2ConfigError, match=named.replace(".", r"\.")) as info:
        load_s2_model(tmp_path)
    assert "cannot be loaded as it was trained" in str(info.value)
    hf_s2.check_config(make_config("llama", SCHEDULE))  # the same schedule without it passes


def test_register_is_idempotent():
    register()
    register()
    assert AttentionInterface()["s2"] is s2_attention_forward
    assert AttentionMaskInterface()["s2"] is sdpa_mask


# ------------------------------------------------------------------------ GPU: the kernel
@pytest.mark.gpu
def test_cuda_kernel_matches_cpu_reference_bf16():
    """On CUDA the S2 layers run the Triton kernel: bf16 logits against the CPU reference."""
    model = make_model(make_config("qwen2"), "s2")
    x = tokens(2, 300)
    with torch.no_grad():
        want = model(x).logits
        gpu = model.to("cuda", torch.bfloat16)
        got = gpu(x.cuda()).logits.float().cpu()
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
