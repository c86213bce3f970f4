"""Run an exported S2 hybrid in Hugging Face ``transformers``: the ``"s2"`` attention function.

An exported checkpoint (``megatron-s2-hf export``) is a plain Llama / Mistral / Qwen2 checkpoint
whose ``config.json`` carries the run config's ``attention`` section under ``s2_attention``.
:func:`register` adds an attention function named ``"s2"`` to ``transformers``'
``AttentionInterface`` (and the matching mask function to its ``AttentionMaskInterface``), so::

    from megatron_s2.hf.s2_attention import load_s2_model
    model = load_s2_model("OUT_HF_DIR", dtype=torch.bfloat16)   # registers, checks, loads

runs every layer as trained: the layers the schedule marks dense through ``transformers``' own
SDPA function, the S2 layers through :func:`s2attn.s2_attention` (the Triton kernel on CUDA, the
PyTorch reference on the CPU). The schedule is parsed and checked by the project's own
:class:`megatron_s2.schedule.AttentionSchedule`, so its rules (pattern tiling, indices, per-layer
overrides, coverage) are exactly the trainer's.

What an S2 layer computes exactly, and what it refuses (``S2InputError``) instead of returning a
silently wrong result:

* one unpadded sequence per batch row, positions ``0..n-1`` (what the trainer saw): supported;
* generation with a KV cache (``DynamicCache`` or ``StaticCache``): supported exactly. S2's
  blocks sit at absolute positions, so each step's queries are placed at their absolute
  positions (read from ``position_ids``) against the keys ``0..`` of the cache;
* padded batches (any ``attention_mask`` with a masked token, left or right padding) and packed
  sequences (``position_ids`` restarting inside a row): refused on S2 layers, since the kernel's
  pattern is laid out from position 0 of each row and has no padding mask. Dense layers take
  them as SDPA does. Run such inputs one sequence per batch row (batch size 1);
* attention dropout, logit soft-capping, sliding windows, attention sinks, bidirectional
  attention: refused on S2 layers.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Optional

import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import s2attn
from s2attn import S2Pattern

from ..schedule import AttentionSchedule, ScheduleError

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CONFIG_KEY",
    "S2ConfigError",
    "S2InputError",
    "check_config",
    "layer_patterns",
    "load_s2_model",
    "register",
    "s2_attention_forward",
]

# The name users pass as ``attn_implementation`` and the config.json key the export writes.
ATTN_IMPLEMENTATION = "s2"
CONFIG_KEY = "s2_attention"

# kwargs of the attention call that change what attention computes; an S2 layer refuses them
# when set (value not None / not False), since the S2 kernel has no such feature.
_UNSUPPORTED_KWARGS = {
    "softcap": "logit soft-capping",
    "sliding_window": "a sliding window",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
}


class S2ConfigError(ValueError):
    """A checkpoint's ``s2_attention`` is missing or does not fit the model; the message names
    the setting."""


class S2InputError(ValueError):
    """An input an S2 layer cannot compute exactly (padding, packing, dropout, ...)."""


# ---------------------------------------------------------------------------------- the schedule
def _mapping_of(config) -> Mapping[str, Any]:
    mapping = getattr(config, CONFIG_KEY, None)
    if mapping is None:
        raise S2ConfigError(
            f"the model config has no {CONFIG_KEY!r} key: this is not a checkpoint written by "
            f"`megatron-s2-hf export` of an S2 hybrid (a dense export loads with the default "
            f"attention, without attn_implementation={ATTN_IMPLEMENTATION!r})"
        )
    if not isinstance(mapping, Mapping):
        raise S2ConfigError(
            f"config.json {CONFIG_KEY} must be a mapping (the run config's attention section), "
            f"got {type(mapping).__name__}"
        )
    return mapping


def _shape_of(config) -> tuple[int, int, int]:
    """(layers, query heads, KV heads) of a Llama-family config."""
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return layers, heads, kv_heads


@lru_cache(maxsize=32)
def _patterns(mapping_json: str, layers: int, heads: int, kv_heads: int):
    """Per-layer patterns of a schedule given as JSON text (hashable, so the parse is cached:
    every attention call of every layer asks for it)."""
    try:
        schedule = AttentionSchedule.from_dict(json.loads(mapping_json), prefix=CONFIG_KEY)
        levers = schedule.levers_set(prefix=CONFIG_KEY)
        if levers:
            # Running the patterns alone would silently compute another model (`megatron-s2-hf
            # export` refuses such runs; this guards a hand-edited config.json).
            raise S2ConfigError(
                f"config.json sets {', '.join(levers)}, which this attention does not "
                f"implement (no learned sinks; dense layers take transformers' attention with "
                f"the model's RoPE): the model cannot be loaded as it was trained"
            )
        schedule.validate(layers, heads, kv_heads)
        return tuple(schedule.layer_pattern(i + 1, heads, kv_heads, layers) for i in range(layers))
    except ScheduleError as e:
        raise S2ConfigError(
            f"config.json {CONFIG_KEY} (the run config's attention section) does not fit the "
            f"model ({layers} layers, {heads} heads, {kv_heads} KV heads): {e}"
        ) from None


def layer_patterns(config) -> tuple[Optional[S2Pattern], ...]:
    """The full-model :class:`s2attn.S2Pattern` of each layer (0-based), None for a dense layer.

    Parsed from ``config.s2_attention`` by :class:`megatron_s2.schedule.AttentionSchedule` and
    checked against the config's layers and heads (:meth:`AttentionSchedule.validate`: pattern
    length, indices, overrides on dense layers, heads, coverage). Raises :class:`S2ConfigError`
    naming the setting.
    """
    mapping = _mapping_of(config)
    try:
        text = json.dumps(mapping, sort_keys=True)
    except TypeError as e:
        raise S2ConfigError(f"config.json {CONFIG_KEY} is not plain JSON data: {e}") from None
    return _patterns(text, *_shape_of(config))


def check_config(config) -> None:
    """Raise :class:`S2ConfigError` unless ``config`` (a ``PretrainedConfig``) carries an S2
    schedule that fits its model: the check :func:`load_s2_model` runs before loading weights."""
    layer_patterns(config)


# ---------------------------------------------------------------------------------- the inputs
def _query_start(position_ids, q_len: int, k_len: int) -> int:
    """Absolute position of the first query: from ``position_ids`` ``(1 | batch, q_len)``, which
    must be ``P..P+q_len-1`` in every row (one unpadded, unpacked sequence per row); without
    them the queries are the last ``q_len`` of the ``k_len`` keys."""
    if position_ids is None:
        return k_len - q_len
    if position_ids.dim() != 2 or position_ids.shape[-1] != q_len:
        raise S2InputError(
            f"S2 attention: position_ids must be (batch, {q_len}) for {q_len} queries, got "
            f"{tuple(position_ids.shape)}"
        )
    start = int(position_ids[0, 0])
    expected = torch.arange(start, start + q_len, device=position_ids.device)
    if not bool((position_ids == expected).all()):
        raise S2InputError(
            "S2 attention: position_ids are not one run P, P+1, ... shared by every batch row: "
            "a padded or packed batch. S2 blocks are laid out from each row's position 0 and "
            "the S2 layers have no padding mask; run one unpadded sequence per row (batch "
            "size 1 for sequences of different lengths)"
        )
    return start


def _mask_is_causal(mask: torch.Tensor, q_start: int, q_len: int, k_len: int) -> bool:
    """Whether a 4-D mask ``(batch, 1 | heads, q_len, k_len)`` (bool: True = attend, or additive
    float: 0 = attend, large negative = masked) is exactly the causal mask of queries at
    ``q_start..`` over keys at ``0..k_len-1`` in every row: no padding, no other structure."""
    if mask.dim() != 4 or mask.shape[-2:] != (q_len, k_len):
        return False
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask == 0
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool((allowed | blocked).all()):  # an additive bias, not a mask
            return False
    qpos = torch.arange(q_start, q_start + q_len, device=mask.device)
    kpos = torch.arange(k_len, device=mask.device)
    return bool((allowed == (kpos[None, :] <= qpos[:, None])).all())


# The last mask checked and its verdict: every S2 layer of one forward gets the same mask object.
_checked_mask: dict[str, Any] = {}


def _check_mask(mask: Optional[torch.Tensor], q_start: int, q_len: int, k_len: int) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise S2InputError(
            f"S2 attention: the attention mask must be a tensor, got {type(mask).__name__}"
        )
    # The same tensor object (a weak reference: an id can be reused by a new tensor once the
    # old one is freed), unchanged in place, asked about the same positions.
    key = (mask._version, q_start, q_len, k_len)
    ref = _checked_mask.get("ref")
    if ref is None or ref() is not mask or _checked_mask.get("key") != key:
        _checked_mask.update(
            ref=weakref.ref(mask), key=key, ok=_mask_is_causal(mask, q_start, q_len, k_len)
        )
    if not _checked_mask["ok"]:
        raise S2InputError(
            "S2 attention: the attention mask is not the plain causal mask (a padded batch, "
            "left or right padding, or a custom mask). The S2 layers compute the S2 pattern "
            "from each row's position 0 with no padding mask, so they refuse it rather than "
            "return a wrong result; run one unpadded sequence per batch row (batch size 1 for "
            "sequences of different lengths)"
        )


# ---------------------------------------------------------------------------------- the function
def s2_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``"s2"`` attention function (``transformers``' AttentionInterface signature).

    Args:
        module: the attention module; ``module.config`` carries ``s2_attention`` and
            ``module.layer_idx`` (0-based) selects the layer's schedule entry.
        query: ``[batch, heads, q_len, head_dim]``; key, value: ``[batch, kv_heads, k_len,
            head_dim]`` (the KV cache's keys 0..k_len-1 during generation).
        attention_mask: the mask ``transformers``' SDPA mask function built (None, or 4-D).
        dropout, scaling, is_causal: as for SDPA; ``scaling`` multiplies ``q.k``.
        kwargs: the model's extra arguments; ``position_ids`` gives the queries' absolute
            positions.
    Returns:
        ``(out [batch, q_len, heads, head_dim] contiguous, None)`` like the SDPA function.
        Dense layers are the SDPA function itself; S2 layers raise :class:`S2InputError` for
        inputs they cannot compute exactly (module docstring).
    """
    config = getattr(module, "config", None)
    layer = getattr(module, "layer_idx", None)
    if config is None or layer is None:
        raise S2InputError(
            f"S2 attention: {type(module).__name__} has no config / layer_idx; the 's2' "
            f"attention runs the Llama-family attention modules of transformers"
        )
    pattern = layer_patterns(config)[layer]
    if pattern is None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )

    where = f"S2 attention (layer {layer})"
    if dropout:
        raise S2InputError(
            f"{where}: attention dropout {dropout} is not supported; set "
            f"config.attention_dropout=0 or call model.eval()"
        )
    if is_causal is False or getattr(module, "is_causal", True) is False:
        raise S2InputError(f"{where}: S2 attention is causal only; got a non-causal call")
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise S2InputError(f"{where}: {what} ({name}={kwargs[name]!r}) is not supported")
    b, heads, q_len, d = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    if heads != pattern.num_heads or kv_heads != pattern.num_kv_heads:
        raise S2InputError(
            f"{where}: got {heads} query / {kv_heads} KV heads but the config has "
            f"{pattern.num_heads} / {pattern.num_kv_heads} (transformers' tensor parallelism "
            f"splits heads; it is not supported with S2 layers)"
        )

    q_start = _query_start(kwargs.get("position_ids"), q_len, k_len)
    if q_start < 0 or q_start + q_len > k_len:
        raise S2InputError(
            f"{where}: queries at positions {q_start}..{q_start + q_len - 1} do not fit the "
            f"{k_len} keys (keys are expected at positions 0..{k_len - 1})"
        )
    _check_mask(attention_mask, q_start, q_len, k_len)

    # Keys past the last query are causally invisible (a StaticCache's unfilled slots).
    k = key[:, :, : q_start + q_len].transpose(1, 2)
    v = value[:, :, : q_start + q_len].transpose(1, 2)
    q = query.transpose(1, 2)  # [b, q_len, heads, d], a view
    # The kernel takes queries starting on a block boundary: a decode step's query at position
    # P is preceded by P % block_size zero queries (their rows are computed and dropped), so it
    # sees exactly its absolute S2 row.
    aligned = q_start - q_start % pattern.block_size
    pad = q_start - aligned
    if pad:
        q = torch.cat([q.new_zeros(b, pad, heads, d), q], dim=1)
    out = s2attn.s2_attention(
        q,
        k,
        v,
        pattern,
        softmax_scale=scaling,
        q_start=aligned,
        k_start=0,
        backend="auto" if query.is_cuda else "reference",
    )
    return out[:, pad:].contiguous(), None


# ---------------------------------------------------------------------------------- registration
def register() -> None:
    """Register ``"s2"`` with ``transformers``: the attention function and, for its masks, the
    SDPA mask function (so dense layers get exactly the masks SDPA gets, and S2 layers see a
    padded batch's mask and refuse it). Idempotent."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, s2_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def load_s2_model(path: str | os.PathLike, **kwargs):
    """``AutoModelForCausalLM.from_pretrained(path, attn_implementation="s2", **kwargs)`` for an
    exported S2 hybrid: registers ``"s2"``, reads the config (``kwargs["config"]`` if given)
    and checks its ``s2_attention`` against the model before any weight is loaded.

    Raises :class:`S2ConfigError` for a checkpoint without ``s2_attention`` or whose schedule
    does not fit the model, ``ValueError`` for ``attn_implementation`` other than ``"s2"``.
    """
    impl = kwargs.pop("attn_implementation", ATTN_IMPLEMENTATION)
    if impl != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"load_s2_model: attn_implementation must be {ATTN_IMPLEMENTATION!r} (the S2 layers "
            f"need it), got {impl!r}; use AutoModelForCausalLM.from_pretrained for other "
            f"implementations"
        )
    config = kwargs.pop("config", None)
    if config is None:
        config_kwargs = {
            k: kwargs[k]
            for k in ("trust_remote_code", "revision", "cache_dir", "local_files_only", "token")
            if k in kwargs
        }
        config = AutoConfig.from_pretrained(path, **config_kwargs)
    check_config(config)
    register()
    return AutoModelForCausalLM.from_pretrained(
        path, config=config, attn_implementation=ATTN_IMPLEMENTATION, **kwargs
    )
