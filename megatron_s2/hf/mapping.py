"""Hugging Face <-> Megatron: the model settings of a ``config.json`` and the tensor names and
layouts of the two state dicts. Pure functions over dicts and tensors: no Megatron, no files.

Families: ``llama`` (Llama 2/3/3.1/3.2), ``mistral`` (without sliding-window attention) and
``qwen2`` (QKV biases). Their decoder is the same: pre-norm RMSNorm, rotary embeddings
(``rotate_half`` layout, which Megatron's non-interleaved RoPE also uses, so no permutation of
the query/key rows), GQA, a SwiGLU MLP without biases.

Layouts (``h`` hidden size, ``d`` head size, ``q`` query heads, ``g`` KV groups, ``f`` FFN size):

* Megatron's ``linear_qkv.weight`` is ``[(q + 2g) * d, h]``, grouped per KV group: for each of
  the ``g`` groups its ``q/g`` query heads, then its key head, then its value head. Hugging Face
  keeps ``q_proj`` ``[q*d, h]``, ``k_proj``/``v_proj`` ``[g*d, h]`` (biases alike).
* Megatron's ``linear_fc1.weight`` is ``[2f, h]``: ``gate_proj`` rows, then ``up_proj`` rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Optional

import torch

# config.json's flag of a model trained with train.eod_first (every input read behind EOD).
EOD_FIRST_KEY = "s2_eod_first"

__all__ = [
    "FAMILIES",
    "HFConfigError",
    "model_settings",
    "hf_shapes",
    "hf_to_megatron",
    "iter_hf_to_megatron",
    "megatron_to_hf",
    "te_names",
    "local_names",
    "hf_config",
]

# model_type of config.json -> the architecture transformers builds for it.
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# config.json keys that mark a mixture-of-experts model (Mixtral, Qwen2-MoE, ...).
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
# Megatron-core's Llama 3 RoPE scaling has these constants built in (RotaryEmbedding
# ._apply_scaling); only the factor is a setting (model.rope_scaling_factor).
LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Local-spec names of the norms fused into the next linear by Transformer Engine's spec.
_TE_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


class HFConfigError(ValueError):
    """A Hugging Face checkpoint this converter cannot take (or a malformed one)."""


def _get(config: Mapping, key: str, where: str, default: Any = ...):
    if key in config and config[key] is not None:
        return config[key]
    if default is ...:
        raise HFConfigError(f"{where}: '{key}' is missing")
    return default


def _rope(config: Mapping, where: str) -> dict:
    """``rotary_base``, ``rope_scaling`` and ``rope_scaling_factor`` of the run config from the
    RoPE settings of ``config``: transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling``."""
    params = dict(config.get("rope_parameters") or {})
    if not params:
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", 10000.0))
    out = {"rotary_base": theta, "rope_scaling": "none"}
    if kind == "default":
        return out
    factor = float(params.get("factor", 0.0))
    if kind == "linear":
        if factor <= 1.0:
            raise HFConfigError(f"{where}: rope scaling 'linear' needs a factor > 1, got {factor}")
        return out | {"rope_scaling": "position_interpolation", "rope_scaling_factor": factor}
    if kind == "llama3":
        fixed = {k: float(params.get(k, v)) for k, v in LLAMA3_FIXED.items()}
        wrong = {k: v for k, v in fixed.items() if v != LLAMA3_FIXED[k]}
        if wrong or factor <= 1.0:
            raise HFConfigError(
                f"{where}: rope scaling 'llama3' with {wrong or {'factor': factor}}: "
                f"Megatron-core's Llama 3 scaling has factor > 1 and fixed {LLAMA3_FIXED}"
            )
        return out | {"rope_scaling": "llama3", "rope_scaling_factor": factor}
    raise HFConfigError(
        f"{where}: rope scaling {kind!r} is not supported (supported: default, linear, llama3; "
        f"the trainer's model.rope_scaling takes none, position_interpolation, llama3)"
    )


def model_settings(config: Mapping, where: str = "config.json") -> dict:
    """The run config's ``model`` section (a mapping of :class:`ModelConfig` fields) for the
    Hugging Face ``config`` (the parsed ``config.json``; ``where`` names it in errors).

    Raises :class:`HFConfigError` naming the setting for what the trainer cannot run: an unknown
    ``model_type``, mixture of experts, sliding-window attention, biases other than Qwen2's QKV
    ones, an activation other than SiLU, an unsupported RoPE scaling.
    """
    family = config.get("model_type")
    if family not in FAMILIES:
        raise HFConfigError(
            f"{where}: model_type {family!r} is not supported (supported: {', '.join(FAMILIES)})"
        )
    moe = [k for k in MOE_KEYS if config.get(k)]
    if moe:
        raise HFConfigError(
            f"{where}: a mixture-of-experts model ({', '.join(f'{k}={config[k]}' for k in moe)}) "
            f"is not supported: dense Llama-family models only"
        )
    window = config.get("sliding_window")
    uses_window = window is not None and (family != "qwen2" or config.get("use_sliding_window"))
    layer_types = set(config.get("layer_types") or ["full_attention"])
    if uses_window or layer_types != {"full_attention"}:
        raise HFConfigError(
            f"{where}: sliding-window attention (sliding_window={window}"
            + (
                f", use_sliding_window={config.get('use_sliding_window')}"
                if family == "qwen2"
                else ""
            )
            + f", layer_types={sorted(layer_types)}) is not supported: every layer must attend "
            f"to the whole context (sliding_window must be null)"
        )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(f"{where}: hidden_act {act!r} is not supported (only 'silu': SwiGLU)")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise HFConfigError(
                f"{where}: {key}=true is not supported (biases on the output projection or the "
                f"MLP; only Qwen2's QKV biases are)"
            )
    hidden = int(_get(config, "hidden_size", where))
    heads = int(_get(config, "num_attention_heads", where))
    groups = int(_get(config, "num_key_value_heads", where, heads))
    head_dim = config.get("head_dim") or None
    if head_dim is None and hidden % heads:
        raise HFConfigError(f"{where}: hidden_size {hidden} is not divisible by {heads} heads")
    if heads % groups:
        raise HFConfigError(
            f"{where}: num_attention_heads {heads} is not divisible by num_key_value_heads {groups}"
        )
    settings = {
        "num_layers": int(_get(config, "num_hidden_layers", where)),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "kv_channels": int(head_dim) if head_dim else None,
        "ffn_hidden_size": int(_get(config, "intermediate_size", where)),
        # The exact vocabulary: no padding, so every embedding row maps one to one.
        "vocab_size": int(_get(config, "vocab_size", where)),
        "normalization": "RMSNorm",
        "norm_epsilon": float(_get(config, "rms_norm_eps", where)),
        "swiglu": True,
        "add_qkv_bias": family == "qwen2",
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
    }
    if settings["kv_channels"] == hidden // heads and not hidden % heads:
        settings["kv_channels"] = None  # the default: keeps the run config short
    return settings | _rope(config, where)


def _head_dim(s: Mapping) -> int:
    return s.get("kv_channels") or s["hidden_size"] // s["num_attention_heads"]


def hf_shapes(settings: Mapping) -> dict[str, tuple[int, ...]]:
    """``{Hugging Face tensor name: shape}`` of a model with the run-config ``settings``
    (:func:`model_settings`); ``lm_head.weight`` only when the embeddings are untied."""
    h, d = settings["hidden_size"], _head_dim(settings)
    q, g, f = (
        settings["num_attention_heads"],
        settings["num_query_groups"],
        settings["ffn_hidden_size"],
    )
    v = settings["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if settings["untie_embeddings_and_output_weights"]:
        shapes["lm_head.weight"] = (v, h)
    for i in range(settings["num_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q * d, h),
            p + "self_attn.k_proj.weight": (g * d, h),
            p + "self_attn.v_proj.weight": (g * d, h),
            p + "self_attn.o_proj.weight": (h, q * d),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
        if settings.get("add_qkv_bias"):
            shapes |= {
                p + "self_attn.q_proj.bias": (q * d,),
                p + "self_attn.k_proj.bias": (g * d,),
                p + "self_attn.v_proj.bias": (g * d,),
            }
    return shapes


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Megatron's grouped QKV rows from HF's three projections (weights ``[rows, h]`` or
    biases ``[rows]``): per KV group its query heads, its key head, its value head."""
    rest = q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, heads: int, groups: int, d: int):
    """Inverse of :func:`_fuse_qkv`: HF's ``(q, k, v)`` from Megatron's grouped rows."""
    rest = qkv.shape[1:]
    per = heads // groups
    x = qkv.reshape(groups, (per + 2) * d, *rest)
    q, k, v = torch.split(x, [per * d, d, d], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


def iter_hf_to_megatron(
    hf: Mapping[str, torch.Tensor], settings: Mapping
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(local-spec Megatron name, tensor)`` pairs of the Hugging Face tensors ``hf``, one at a
    time: each reads only the ``hf`` entries it needs, so ``hf`` may load lazily and a large
    model never has to be in memory twice."""
    g = settings["num_query_groups"]
    embedding = hf["model.embed_tokens.weight"]
    if embedding.shape[0] != settings["vocab_size"]:
        raise ValueError(
            f"model.embed_tokens.weight has {embedding.shape[0]} rows, the vocabulary "
            f"{settings['vocab_size']}"
        )
    yield "embedding.word_embeddings.weight", embedding
    yield "decoder.final_layernorm.weight", hf["model.norm.weight"]
    if settings["untie_embeddings_and_output_weights"]:
        yield "output_layer.weight", hf["lm_head.weight"]
    for i in range(settings["num_layers"]):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = p + "self_attn."
        yield m + "input_layernorm.weight", hf[p + "input_layernorm.weight"]
        yield (
            m + "self_attention.linear_qkv.weight",
            _fuse_qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], g),
        )
        if settings.get("add_qkv_bias"):
            yield (
                m + "self_attention.linear_qkv.bias",
                _fuse_qkv(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], g),
            )
        yield m + "self_attention.linear_proj.weight", hf[a + "o_proj.weight"]
        yield m + "pre_mlp_layernorm.weight", hf[p + "post_attention_layernorm.weight"]
        yield (
            m + "mlp.linear_fc1.weight",
            torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], dim=0),
        )
        yield m + "mlp.linear_fc2.weight", hf[p + "mlp.down_proj.weight"]


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], settings: Mapping, transformer_impl: str = "local"
) -> dict[str, torch.Tensor]:
    """The Megatron ``GPTModel`` state dict (unsharded: TP=PP=1, every layer in one chunk) of
    the Hugging Face tensors ``hf``; ``transformer_impl`` ``"transformer_engine"`` gives the TE
    spec's names (:func:`te_names`). Tensors keep their dtype; fused ones are new tensors."""
    out = dict(iter_hf_to_megatron(hf, settings))
    if transformer_impl == "transformer_engine":
        out = dict(zip(te_names(out), out.values()))
    return out


def megatron_to_hf(meg: Mapping[str, torch.Tensor], settings: Mapping) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of an unsharded Megatron state dict (local or TE spec names;
    Megatron's ``_extra_state`` entries and an ``output_layer.weight`` of tied embeddings are
    left out). Inverse of :func:`hf_to_megatron`."""
    meg = dict(zip(local_names(meg), meg.values()))
    heads, g, d = settings["num_attention_heads"], settings["num_query_groups"], _head_dim(settings)
    out = {
        "model.embed_tokens.weight": meg["embedding.word_embeddings.weight"],
        "model.norm.weight": meg["decoder.final_layernorm.weight"],
    }
    if settings["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = meg["output_layer.weight"]
    for i in range(settings["num_layers"]):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = p + "self_attn."
        out[p + "input_layernorm.weight"] = meg[m + "input_layernorm.weight"]
        qkv = _split_qkv(meg[m + "self_attention.linear_qkv.weight"], heads, g, d)
        for name, t in zip(("q_proj", "k_proj", "v_proj"), qkv):
            out[a + name + ".weight"] = t
        if settings.get("add_qkv_bias"):
            qkv = _split_qkv(meg[m + "self_attention.linear_qkv.bias"], heads, g, d)
            for name, t in zip(("q_proj", "k_proj", "v_proj"), qkv):
                out[a + name + ".bias"] = t
        out[a + "o_proj.weight"] = meg[m + "self_attention.linear_proj.weight"]
        out[p + "post_attention_layernorm.weight"] = meg[m + "pre_mlp_layernorm.weight"]
        gate, up = meg[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[p + "mlp.gate_proj.weight"] = gate.contiguous()
        out[p + "mlp.up_proj.weight"] = up.contiguous()
        out[p + "mlp.down_proj.weight"] = meg[m + "mlp.linear_fc2.weight"]
    return out


def te_names(keys: Iterable[str]) -> list[str]:
    """The Transformer Engine spec's names of local-spec state-dict ``keys``: TE fuses each
    layer's pre-attention and pre-MLP norms into the next linear
    (``decoder.layers.N.input_layernorm.weight`` ->
    ``decoder.layers.N.self_attention.linear_qkv.layer_norm_weight``, ``pre_mlp_layernorm`` ->
    ``mlp.linear_fc1.layer_norm_weight``); every other name is the same in both specs."""
    return [_rename(k, _TE_NORMS) for k in keys]


def local_names(keys: Iterable[str]) -> list[str]:
    """Inverse of :func:`te_names`: local-spec names of TE or local state-dict ``keys``."""
    return [_rename(k, {te: local for local, te in _TE_NORMS.items()}) for k in keys]


def _rename(key: str, table: Mapping[str, str]) -> str:
    head, sep, tail = key.partition("decoder.layers.")
    if not sep:
        return key
    layer, _, name = tail.partition(".")
    return f"{head}decoder.layers.{layer}.{table.get(name, name)}"


def hf_config(
    settings: Mapping,
    *,
    family: str,
    template: Optional[Mapping] = None,
    max_position_embeddings: Optional[int] = None,
    dtype: str = "float32",
) -> dict:
    """A ``config.json`` mapping for the run-config model ``settings`` (:func:`model_settings`'s
    inverse): ``template`` (the imported model's own ``config.json``) with its shape, norm and
    RoPE keys replaced, else a fresh one of ``family``. ``max_position_embeddings``: the
    context length to record (None keeps the template's)."""
    if family not in FAMILIES:
        raise HFConfigError(f"family {family!r} is not one of {', '.join(FAMILIES)}")
    out = dict(template or {})
    h, heads = settings["hidden_size"], settings["num_attention_heads"]
    rope: dict[str, Any] = {"rope_theta": float(settings.get("rotary_base", 10000.0))}
    kind = settings.get("rope_scaling", "none")
    if kind == "none":
        rope["rope_type"] = "default"
    elif kind == "position_interpolation":
        rope |= {"rope_type": "linear", "factor": float(settings["rope_scaling_factor"])}
    else:
        rope |= {"rope_type": "llama3", "factor": float(settings["rope_scaling_factor"])}
        rope |= LLAMA3_FIXED
    for old in ("rope_theta", "rope_scaling"):
        out.pop(old, None)
    out |= {
        "architectures": [FAMILIES[family]],
        "model_type": family,
        "hidden_size": h,
        "num_hidden_layers": settings["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": settings.get("num_query_groups") or heads,
        "head_dim": settings.get("kv_channels") or h // heads,
        "intermediate_size": settings.get("ffn_hidden_size") or 4 * h,
        "vocab_size": settings["vocab_size"],
        "rms_norm_eps": float(settings.get("norm_epsilon", 1e-5)),
        "hidden_act": "silu",
        "tie_word_embeddings": not settings["untie_embeddings_and_output_weights"],
        "rope_parameters": rope,
        "dtype": dtype,
    }
    out.pop("torch_dtype", None)
    if max_position_embeddings is not None:
        out["max_position_embeddings"] = int(max_position_embeddings)
    out.setdefault("max_position_embeddings", 2048)
    if family == "qwen2":
        out |= {"use_sliding_window": False, "sliding_window": None}
    elif family == "mistral":
        out["sliding_window"] = None
    else:
        out |= {"attention_bias": False, "mlp_bias": False}
    return out


def dtype_name(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``: the name config.json's ``dtype`` uses."""
    return str(dtype).removeprefix("torch.")


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()
