"""Per-layer attention schedules: which layers are S2 and with which settings.

One YAML mapping describes a model's attention (the trainer's run config embeds the same mapping
under its ``attention:`` key)::

    s2:                      # defaults for every S2 layer
      block_size: 64         # tokens per block: 16, 32, 64 or 128
      local_blocks: 16       # local window in blocks, diagonal block included
      vert_stride: 8         # vertical stripe stride in blocks (1 = dense)
      head_offset: 1         # stripe phase 0..vert_stride-1: 0 (authors' library), 1 (Phi-3-small)
      head_step: null        # per-head phase step; null = max(1, vert_stride // num_heads)
      num_dense_heads: 0     # heads of an S2 layer that attend densely; must divide the heads
      homo_head: false       # all heads share head 0's stripes
      sinks: false           # a learned per-head sink logit on every S2 layer (gpt-oss style)
    dense_layers:
      pattern: "DS"          # tiled over the layers: char i is layer i; D = dense, S = S2
      indices: [0, -1]       # more dense layers (0-based; negative counts from the end)
      position_embedding: rope  # rope, or nope: no position encoding on the dense layers
      rotary_base: null      # the dense layers' own RoPE base; null = the model's
      sinks: false           # a learned per-head sink logit on every dense layer
    overrides:               # per-layer changes of any s2 key (0-based layer index)
      3: {vert_stride: 16}
    allow_coverage_holes: false  # true: allow S2 layers whose heads together miss key blocks

**Layer indices in YAML are 0-based** (like the pattern string and Python lists), while
Megatron's ``layer_number`` is 1-based and global: :meth:`AttentionSchedule.layer_pattern` takes
the Megatron number. Everything unspecified is S2 with the ``s2`` defaults. An override on a dense
layer is an error (it would silently do nothing).

The ``s2`` keys are :meth:`s2attn.S2Pattern.setting_names` (``S2Pattern`` owns the schema
and its checks, so a new S2 setting becomes a schedule key without an edit here) plus the S2
layers' module settings (:data:`S2_LAYER_KEYS`: ``sinks``), which are not part of the pattern and
apply to every S2 layer (not per override).

**Levers for retrieval** (what the strongest public hybrids do; docs/long_context_eval.md):
``dense_layers.position_embedding: nope`` drops RoPE on the dense layers (Command A, Llama 4);
``dense_layers.rotary_base`` gives them their own RoPE base while the S2 layers keep the model's
(Gemma 3, MiMo-V2-Flash); ``s2.sinks: true`` adds a learned sink logit per head to every S2 layer
(gpt-oss, MiMo-V2-Flash), ``dense_layers.sinks: true`` to every dense layer (gpt-oss has them in
all layers; a dense layer with sinks runs on s2attn's kernel with a dense pattern, whose
log-sum-exp and its gradient the sinks need). :meth:`AttentionSchedule.layer_position` answers per
layer.

**Union coverage.** The paper's rule is that the heads of an S2 layer together attend every key
block. :meth:`AttentionSchedule.validate` computes every S2 layer's coverage at the training
length (or, without one, at a length where every stripe phase shows) and refuses holes unless
``allow_coverage_holes: true`` (ablations may want them).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from s2attn import S2Pattern
from s2attn.pattern import check_setting, check_settings

from .config_hints import colon_hint
from .parallel_lengths import context_parallel_unit

_DEFAULT_BLOCK_SIZE = next(
    f.default for f in dataclasses.fields(S2Pattern) if f.name == "block_size"
)

__all__ = [
    "AttentionSchedule",
    "ScheduleError",
    "SCHEDULE_ENV_VAR",
    "DEFAULT_S2_SETTINGS",
    "POSITION_EMBEDDINGS",
]

logger = logging.getLogger(__name__)

SCHEDULE_ENV_VAR = "MEGATRON_S2_SCHEDULE"

# Keys of a schedule mapping and of its dense_layers section (the sweep tool checks study axes
# against them before any run).
SCHEDULE_KEYS = ("s2", "dense_layers", "overrides", "allow_coverage_holes")
DENSE_LAYER_KEYS = ("pattern", "indices", "position_embedding", "rotary_base", "sinks")
# Settings of the S2 layers' module that are not S2Pattern settings (no effect on which keys a
# query attends): allowed under ``s2`` only, for every S2 layer alike.
S2_LAYER_KEYS = ("sinks",)
# attention.dense_layers.position_embedding: RoPE (the model's, or dense_layers.rotary_base) or
# none at all (NoPE).
POSITION_EMBEDDINGS = ("rope", "nope")

# The schedule's defaults are S2Pattern's own (block 64, local 16, stride 8, phase 0).
DEFAULT_S2_SETTINGS: dict[str, Any] = S2Pattern(num_heads=1).settings() | {"head_step": None}


class ScheduleError(ValueError):
    """An invalid attention schedule; the message names the offending key."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _checked_settings(values: Any, where: str, extra: tuple = ()) -> dict[str, Any]:
    """``values`` as a dict of S2 settings, each key and value checked by ``S2Pattern``'s rules;
    errors name ``where.key`` (``extra``: more keys allowed there, named in the message only:
    the caller has taken them out)."""
    if not isinstance(values, Mapping):
        raise ScheduleError(
            f"{where} must be a mapping of S2 settings, got {type(values).__name__}"
        )
    names = S2Pattern.setting_names()
    for key, value in values.items():
        if key not in names:
            raise ScheduleError(
                f"unknown key {where}.{key}; allowed keys: {', '.join((*names, *extra))}"
                + colon_hint([key])
            )
        try:
            check_setting(key, value)
        except ValueError as e:
            raise ScheduleError(f"{where}.{e}") from None
    return dict(values)


@dataclass
class AttentionSchedule:
    """Which layers use S2 attention and with which settings.

    Build it with :meth:`from_yaml` / :meth:`from_dict`; check it against a model with
    :meth:`validate`. Layer indices (``dense_indices``, ``overrides``) are 0-based and may be
    negative (counted from the last layer); they are resolved against ``num_layers`` on use.
    ``s2`` and each override hold :class:`s2attn.S2Pattern` settings.
    """

    s2: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_S2_SETTINGS))
    dense_pattern: str = ""
    dense_indices: list[int] = field(default_factory=list)
    overrides: dict[int, dict[str, Any]] = field(default_factory=dict)
    allow_coverage_holes: bool = False
    # The levers of the module docstring: dense layers' position encoding and RoPE base (None:
    # the model's), learned sinks on the S2 layers and on the dense layers.
    dense_position_embedding: str = "rope"
    dense_rotary_base: Optional[float] = None
    sinks: bool = False
    dense_sinks: bool = False
    source: Optional[str] = None  # where it came from, for messages
    # Model shapes this schedule was validated against: a schedule travels from the run config
    # through the Megatron config to every layer, and is checked once per shape.
    _validated: set = field(default_factory=set, repr=False, compare=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls, d: Optional[Mapping[str, Any]], prefix: str = "attention", source: Optional[str] = None
    ) -> AttentionSchedule:
        """Parse and check the mapping described in the module docstring.

        ``prefix`` names the mapping in error messages (``attention.s2.vert_stride ...``).
        Model-dependent checks (layer ranges, heads, TP, coverage) are in :meth:`validate`.
        """
        d = {} if d is None else d
        if not isinstance(d, Mapping):
            raise ScheduleError(f"{prefix} must be a mapping, got {type(d).__name__}")
        for key in d:
            if key not in SCHEDULE_KEYS:
                raise ScheduleError(
                    f"unknown key {prefix}.{key}; allowed keys: {', '.join(SCHEDULE_KEYS)}"
                    + colon_hint([key])
                )
        raw_s2 = d.get("s2") or {}
        sinks = False
        if isinstance(raw_s2, Mapping) and "sinks" in raw_s2:
            raw_s2 = {k: v for k, v in raw_s2.items() if k != "sinks"}
            sinks = d["s2"]["sinks"]
            if not isinstance(sinks, bool):
                raise ScheduleError(f"{prefix}.s2.sinks must be true or false, got {sinks!r}")
        s2 = dict(DEFAULT_S2_SETTINGS) | _checked_settings(raw_s2, f"{prefix}.s2", S2_LAYER_KEYS)

        dense = d.get("dense_layers") or {}
        if not isinstance(dense, Mapping):
            raise ScheduleError(
                f"{prefix}.dense_layers must be a mapping with keys {DENSE_LAYER_KEYS}, "
                f"got {type(dense).__name__}"
            )
        for key in dense:
            if key not in DENSE_LAYER_KEYS:
                raise ScheduleError(
                    f"unknown key {prefix}.dense_layers.{key}; allowed keys: "
                    f"{', '.join(DENSE_LAYER_KEYS)}" + colon_hint([key])
                )
        pattern = dense.get("pattern") or ""
        if not isinstance(pattern, str) or set(pattern.upper()) - {"S", "D"}:
            raise ScheduleError(
                f"{prefix}.dense_layers.pattern must be a string of 'S' (S2) and "
                f"'D' (dense) characters, got {pattern!r}"
            )
        indices = dense.get("indices") or []
        if not isinstance(indices, (list, tuple)) or not all(_is_int(i) for i in indices):
            raise ScheduleError(
                f"{prefix}.dense_layers.indices must be a list of integer layer "
                f"indices (0-based), got {indices!r}"
            )
        position, rotary_base = _dense_position(dense, f"{prefix}.dense_layers")
        dense_sinks = dense.get("sinks", False)
        if not isinstance(dense_sinks, bool):
            raise ScheduleError(
                f"{prefix}.dense_layers.sinks must be true or false, got {dense_sinks!r}"
            )

        raw_over = d.get("overrides") or {}
        if not isinstance(raw_over, Mapping):
            raise ScheduleError(
                f"{prefix}.overrides must be a mapping of layer index -> S2 settings, "
                f"got {type(raw_over).__name__}"
            )
        overrides: dict[int, dict[str, Any]] = {}
        for k, v in raw_over.items():
            try:
                idx = int(k)
                if isinstance(k, (bool, float)):
                    raise ValueError
            except (TypeError, ValueError):
                raise ScheduleError(
                    f"{prefix}.overrides key {k!r} must be an integer layer index (0-based)"
                ) from None
            if isinstance(v, Mapping) and any(key in S2_LAYER_KEYS for key in v):
                raise ScheduleError(
                    f"{prefix}.overrides.{k}: {', '.join(S2_LAYER_KEYS)} is set for every S2 "
                    f"layer at once, under {prefix}.s2, not per layer"
                )
            overrides[idx] = _checked_settings(v, f"{prefix}.overrides.{k}")
        # Cross-setting rules on each layer's complete settings, named where they were set.
        for where, values in [(f"{prefix}.s2", s2)] + [
            (f"{prefix}.overrides.{k}", s2 | v) for k, v in overrides.items()
        ]:
            try:
                check_settings(values)
            except ValueError as e:
                raise ScheduleError(f"{where}.{e}") from None
        holes = d.get("allow_coverage_holes", False)
        if not isinstance(holes, bool):
            raise ScheduleError(
                f"{prefix}.allow_coverage_holes must be true or false, got {holes!r}"
            )
        return cls(
            s2=s2,
            dense_pattern=pattern.upper(),
            dense_indices=list(indices),
            overrides=overrides,
            allow_coverage_holes=holes,
            dense_position_embedding=position,
            dense_rotary_base=rotary_base,
            sinks=sinks,
            dense_sinks=dense_sinks,
            source=source,
        )

    @classmethod
    def from_yaml(cls, path: str, prefix: str = "attention") -> AttentionSchedule:
        """Load a schedule file (the mapping of the module docstring at the top level)."""
        import yaml

        with open(path) as f:
            d = yaml.safe_load(f)
        return cls.from_dict(d, prefix=prefix, source=str(path))

    @classmethod
    def from_env(cls) -> Optional[AttentionSchedule]:
        """The schedule named by ``$MEGATRON_S2_SCHEDULE`` (a YAML path), or None if unset.

        The documented fallback for Megatron-LM's ``pretrain_gpt.py --spec``, whose plain
        ``TransformerConfig`` cannot carry a schedule; read here and nowhere else."""
        path = os.environ.get(SCHEDULE_ENV_VAR)
        if not path:
            return None
        if not os.path.isfile(path):
            raise ScheduleError(f"{SCHEDULE_ENV_VAR}={path!r} is not a file")
        cached = _ENV_CACHE.get(path)
        if cached is None:
            cached = _ENV_CACHE[path] = cls.from_yaml(path)
        return cached

    @classmethod
    def coerce(cls, schedule: Any) -> AttentionSchedule:
        """An :class:`AttentionSchedule` from a schedule, its mapping, or a YAML path."""
        if isinstance(schedule, AttentionSchedule):
            return schedule
        if isinstance(schedule, Mapping):
            return cls.from_dict(schedule)
        if isinstance(schedule, (str, os.PathLike)):
            return cls.from_yaml(str(schedule))
        raise ScheduleError(
            f"a schedule must be an AttentionSchedule, a mapping or a YAML path, "
            f"got {type(schedule).__name__}"
        )

    @classmethod
    def all_s2(cls, **s2_settings) -> AttentionSchedule:
        """Every layer S2 with the given settings."""
        return cls.from_dict({"s2": s2_settings})

    @classmethod
    def all_dense(cls) -> AttentionSchedule:
        """Every layer dense (a baseline through the same code path)."""
        return cls.from_dict({"dense_layers": {"pattern": "D"}})

    def to_dict(self) -> dict[str, Any]:
        """The mapping :meth:`from_dict` reads (round-trips)."""
        out: dict[str, Any] = {"s2": dict(self.s2)}
        if self.sinks:
            out["s2"]["sinks"] = True
        dense: dict[str, Any] = {}
        if self.dense_pattern:
            dense["pattern"] = self.dense_pattern
        if self.dense_indices:
            dense["indices"] = list(self.dense_indices)
        if self.dense_position_embedding != "rope":
            dense["position_embedding"] = self.dense_position_embedding
        if self.dense_rotary_base is not None:
            dense["rotary_base"] = self.dense_rotary_base
        if self.dense_sinks:
            dense["sinks"] = True
        if dense:
            out["dense_layers"] = dense
        if self.overrides:
            out["overrides"] = {int(k): dict(v) for k, v in self.overrides.items()}
        if self.allow_coverage_holes:
            out["allow_coverage_holes"] = True
        return out

    # ------------------------------------------------------------------ per-layer queries
    def _resolve(self, idx: int, num_layers: int, where: str) -> int:
        if not -num_layers <= idx < num_layers:
            raise ScheduleError(
                f"{where}: layer index {idx} is out of range for {num_layers} layers "
                f"(0-based indices 0..{num_layers - 1}, or negative from the end)"
            )
        return idx % num_layers

    def dense_layer_indices(self, num_layers: int) -> list[int]:
        """Sorted 0-based indices of the dense layers of a ``num_layers``-layer model."""
        dense = set()
        if self.dense_pattern:
            if len(self.dense_pattern) > num_layers:
                raise ScheduleError(
                    f"attention.dense_layers.pattern {self.dense_pattern!r} is longer than the "
                    f"model's {num_layers} layers"
                )
            dense |= {
                i
                for i in range(num_layers)
                if self.dense_pattern[i % len(self.dense_pattern)] == "D"
            }
        for i in self.dense_indices:
            dense.add(self._resolve(i, num_layers, "attention.dense_layers.indices"))
        return sorted(dense)

    def _override_key(self, index: int, num_layers: int) -> Optional[int]:
        """The ``overrides`` key that applies to 0-based layer ``index``, if any (last wins)."""
        found = None
        for k in self.overrides:
            if self._resolve(k, num_layers, f"attention.overrides.{k}") == index:
                found = k
        return found

    def _where(self, index: int, num_layers: int) -> str:
        """The YAML key that sets layer ``index``'s S2 settings, for messages."""
        k = self._override_key(index, num_layers)
        return "attention.s2" if k is None else f"attention.overrides.{k}"

    def layer_settings(self, index: int, num_layers: int) -> Optional[dict[str, Any]]:
        """S2 settings (``S2Pattern`` keyword arguments) of 0-based layer ``index``, or None if
        the layer is dense."""
        if index in self.dense_layer_indices(num_layers):
            return None
        settings = dict(self.s2)
        for k, v in self.overrides.items():
            if self._resolve(k, num_layers, f"attention.overrides.{k}") == index:
                settings.update(v)
        return settings

    def layer_pattern(
        self,
        layer_number: int,
        num_heads: int,
        num_kv_heads: Optional[int] = None,
        num_layers: Optional[int] = None,
    ) -> Optional[S2Pattern]:
        """Full-model S2 pattern of Megatron layer ``layer_number`` (1-based, global), or None
        for a dense layer. ``num_layers`` is needed when the schedule uses negative indices or a
        pattern string; without it the largest index the schedule mentions bounds the model."""
        if num_layers is None:
            num_layers = max(
                [layer_number, len(self.dense_pattern)]
                + [abs(i) + (i >= 0) for i in self.dense_indices]
                + [abs(i) + (i >= 0) for i in self.overrides]
            )
        if not 1 <= layer_number <= num_layers:
            raise ScheduleError(f"layer_number {layer_number} is out of range 1..{num_layers}")
        settings = self.layer_settings(layer_number - 1, num_layers)
        if settings is None:
            return None
        return S2Pattern(num_heads=num_heads, num_kv_heads=num_kv_heads or num_heads, **settings)

    def layer_position(self, index: int, num_layers: int) -> tuple[str, Optional[float]]:
        """``(position_embedding, rotary_base)`` of 0-based layer ``index``: ``("rope", None)``
        (the model's RoPE) for S2 layers; the ``dense_layers`` settings for dense ones
        (``"nope"``: no position encoding; a base: RoPE with that base instead of the model's)."""
        if self.layer_settings(index, num_layers) is not None:
            return "rope", None
        return self.dense_position_embedding, self.dense_rotary_base

    def has_position_levers(self) -> bool:
        """Whether dense layers differ from the model's RoPE (NoPE or their own base)."""
        return self.dense_position_embedding != "rope" or self.dense_rotary_base is not None

    def levers_set(self, prefix: str = "attention") -> list[str]:
        """The settings beyond the layers' attention patterns that this schedule turns on, as
        ``<prefix>.<key>: <value>`` strings (empty when every one is at its default): learned
        sinks on the S2 layers, the dense layers' position encoding, RoPE base and sinks. A
        consumer that runs only the patterns (the Hugging Face export) refuses a schedule with
        any."""
        out = []
        if self.sinks:
            out.append(f"{prefix}.s2.sinks: true")
        if self.dense_position_embedding != "rope":
            out.append(f"{prefix}.dense_layers.position_embedding: {self.dense_position_embedding}")
        if self.dense_rotary_base is not None:
            out.append(f"{prefix}.dense_layers.rotary_base: {self.dense_rotary_base:g}")
        if self.dense_sinks:
            out.append(f"{prefix}.dense_layers.sinks: true")
        return out

    def layer_description(self, index: int, num_layers: int) -> dict[str, Any]:
        """Everything the schedule sets for 0-based layer ``index``, as one comparable mapping:
        the S2 settings and ``sinks`` of an S2 layer, the position encoding and ``sinks`` of a
        dense one (what a resumed run compares with its checkpoint's schedule)."""
        settings = self.layer_settings(index, num_layers)
        if settings is None:
            position, base = self.layer_position(index, num_layers)
            return {
                "kind": "dense",
                "position_embedding": position,
                "rotary_base": base,
                "sinks": self.dense_sinks,
            }
        return {"kind": "S2", **settings, "sinks": self.sinks}

    def describe_levers(self) -> str:
        """The levers in words for the schedule table (empty when none is set)."""
        parts = []
        if self.dense_position_embedding == "nope":
            parts.append("NoPE on the dense layers (no position encoding)")
        elif self.dense_rotary_base is not None:
            parts.append(
                f"RoPE base {self.dense_rotary_base:g} on the dense layers (S2 layers: the model's)"
            )
        if self.sinks:
            parts.append("learned attention sinks on the S2 layers")
        if self.dense_sinks:
            parts.append("learned attention sinks on the dense layers")
        return "; ".join(parts)

    def block_sizes(self, num_layers: int) -> list[int]:
        """The distinct block sizes of the layers that run s2attn's block kernel, ascending: the
        S2 layers' and, with ``dense_layers.sinks``, the dense layers' (:meth:`dense_block_size`);
        empty for an all-dense model without sinks."""
        sizes = set()
        for i in range(num_layers):
            settings = self.layer_settings(i, num_layers)
            if settings is not None:
                sizes.add(settings.get("block_size", _DEFAULT_BLOCK_SIZE))
            elif self.dense_sinks:
                sizes.add(self.dense_block_size())
        return sorted(sizes)

    def dense_block_size(self) -> int:
        """The block size of a dense layer with sinks (its dense pattern on s2attn's kernel):
        the ``s2`` section's, so that it adds no length rule of its own to a hybrid."""
        return int(self.s2.get("block_size", _DEFAULT_BLOCK_SIZE))

    def dense_sink_pattern(self, num_heads: int, num_kv_heads: Optional[int]) -> S2Pattern:
        """The full-model pattern a dense layer with sinks runs: every head attends every
        earlier key (stripe stride 1), in :meth:`dense_block_size` blocks."""
        return S2Pattern(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads or num_heads,
            block_size=self.dense_block_size(),
            vert_stride=1,
        )

    def context_parallel_unit(self, num_layers: int, context_parallel_size: int) -> int:
        """What the sequence length must be a multiple of under ``context_parallel_size``: Megatron
        splits it in ``2 x CP`` chunks, and an S2 layer's chunks must start on its block
        boundaries (its pattern is laid out in absolute blocks):
        :func:`megatron_s2.parallel_lengths.context_parallel_unit` of this schedule's blocks."""
        return context_parallel_unit(context_parallel_size, self.block_sizes(num_layers))

    def layer_kinds(self, num_layers: int) -> list[str]:
        """``'S2'`` or ``'dense'`` per 0-based layer."""
        dense = set(self.dense_layer_indices(num_layers))
        return ["dense" if i in dense else "S2" for i in range(num_layers)]

    # ------------------------------------------------------------------ validation
    def validate(
        self,
        num_layers: int,
        num_attention_heads: int,
        num_query_groups: Optional[int] = None,
        tensor_model_parallel_size: int = 1,
        seq_length: Optional[int] = None,
    ) -> None:
        """Check the schedule against a model; raise :class:`ScheduleError` naming the key.

        Checks: layer indices in range, no override on a dense layer, every S2 layer's pattern
        constructible (dense heads divide the heads, ...), heads and GQA groups divisible by the
        TP size (a group split across ranks cannot be computed by one rank), ``seq_length`` a
        multiple of every S2 layer's block size, and union coverage (:func:`coverage_length`)
        unless ``allow_coverage_holes``. Free when repeated for the same model shape.
        """
        groups = num_query_groups or num_attention_heads
        tp = tensor_model_parallel_size
        shape = (num_layers, num_attention_heads, groups, tp, seq_length)
        if shape in self._validated:
            return
        if num_attention_heads % tp:
            raise ScheduleError(
                f"num_attention_heads ({num_attention_heads}) must be divisible by "
                f"tensor_model_parallel_size ({tp})"
            )
        if num_attention_heads % groups:
            raise ScheduleError(
                f"num_attention_heads ({num_attention_heads}) must be a multiple of "
                f"num_query_groups ({groups})"
            )
        if (groups >= tp and groups % tp) or (groups < tp and tp % groups):
            raise ScheduleError(
                f"num_query_groups ({groups}) and tensor_model_parallel_size ({tp}) do not fit: a "
                f"GQA group would be split across TP ranks; use a group count divisible by the TP "
                f"size (or dividing it, so Megatron replicates the groups)"
            )
        # With groups < TP Megatron hands each rank one replicated KV head.
        rank_groups = max(groups, tp)
        dense = self.dense_layer_indices(num_layers)
        # A lever on layers the model does not have would silently do nothing.
        if self.has_position_levers() and not dense:
            raise ScheduleError(
                "attention.dense_layers.position_embedding / rotary_base apply to dense layers, "
                f"and this schedule has none among the {num_layers} layers; add dense layers "
                "(attention.dense_layers.pattern or indices) or remove the setting"
            )
        if self.sinks and len(dense) == num_layers:
            raise ScheduleError(
                "attention.s2.sinks applies to S2 layers, and every layer of this schedule is "
                "dense; set attention.s2.sinks: false or make some layers S2"
            )
        if self.dense_sinks and not dense:
            raise ScheduleError(
                "attention.dense_layers.sinks applies to dense layers, and this schedule has none "
                f"among the {num_layers} layers; set attention.dense_layers.sinks: false or add "
                "dense layers (attention.dense_layers.pattern or indices)"
            )
        if self.dense_sinks and seq_length is not None and seq_length % self.dense_block_size():
            raise ScheduleError(
                f"attention.s2.block_size ({self.dense_block_size()}) must divide the sequence "
                f"length ({seq_length}): the dense layers with sinks "
                f"(attention.dense_layers.sinks) run in blocks of that size"
            )
        for k in self.overrides:
            idx = self._resolve(k, num_layers, f"attention.overrides.{k}")
            if idx in dense:
                raise ScheduleError(
                    f"attention.overrides.{k}: layer {idx} is a dense layer "
                    f"(attention.dense_layers); an S2 override would have no effect"
                )
        for i in range(num_layers):
            settings = self.layer_settings(i, num_layers)
            if settings is None:
                continue
            where = self._where(i, num_layers)
            try:
                pattern = S2Pattern(num_heads=num_attention_heads, num_kv_heads=groups, **settings)
                pattern.with_heads(num_attention_heads, rank_groups).for_tp_rank(0, tp)
            except ValueError as e:
                raise ScheduleError(f"{where} (layer {i}): {e}") from None
            if seq_length is not None and seq_length % pattern.block_size:
                raise ScheduleError(
                    f"{where}.block_size ({pattern.block_size}) must divide the sequence length "
                    f"({seq_length}) (layer {i})"
                )
            if not self.allow_coverage_holes:
                _check_coverage(pattern, seq_length, where, i)
        self._validated.add(shape)

    # ------------------------------------------------------------------ reports
    def attention_pairs(
        self, num_layers: int, num_heads: int, num_kv_heads: Optional[int], seq_length: int
    ) -> list[int]:
        """Attended (query, key) token pairs per layer for one sequence, summed over all heads;
        dense layers count the full causal triangle."""
        causal = seq_length * (seq_length + 1) // 2 * num_heads
        out = []
        for i in range(num_layers):
            p = self.layer_pattern(i + 1, num_heads, num_kv_heads, num_layers)
            out.append(causal if p is None else p.attended_pairs(seq_length))
        return out

    def summary(
        self,
        num_layers: int,
        num_heads: int,
        num_kv_heads: Optional[int] = None,
        seq_length: Optional[int] = None,
    ) -> str:
        """Table of the effective per-layer schedule: settings, union coverage (at
        ``seq_length``, else at :func:`coverage_length`) and density at ``seq_length``."""
        kv = num_kv_heads or num_heads
        header = [
            "layer",
            "kind",
            "block",
            "local",
            "stride",
            "offset",
            "step",
            "dense_heads",
            "homo",
            "coverage",
        ]
        if seq_length:
            header.append(f"density@{seq_length}")
        rows = []
        pairs = self.attention_pairs(num_layers, num_heads, kv, seq_length) if seq_length else None
        causal = seq_length * (seq_length + 1) // 2 * num_heads if seq_length else None
        for i in range(num_layers):
            p = self.layer_pattern(i + 1, num_heads, kv, num_layers)
            if p is None:
                row = [str(i), "dense"] + ["-"] * 7 + ["full"]
            else:
                report = p.coverage(seq_length or coverage_length(p))
                cov = (
                    "full"
                    if report.complete
                    else f"{len(report.uncovered_blocks)}/{report.num_blocks} unseen"
                )
                row = [
                    str(i),
                    "S2",
                    str(p.block_size),
                    str(p.local_blocks),
                    str(p.vert_stride),
                    str(p.head_offset),
                    str(p.head_step),
                    str(p.num_dense_heads),
                    "y" if p.homo_head else "n",
                    cov,
                ]
            if seq_length:
                row.append(f"{pairs[i] / causal:.3f}")
            rows.append(row)
        widths = [max(len(r[c]) for r in rows + [header]) for c in range(len(header))]
        fmt = lambda r: "  ".join(x.rjust(w) for x, w in zip(r, widths))  # noqa: E731
        lines = [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
        levers = self.describe_levers()
        if levers:
            lines.append(f"levers: {levers}")
        if seq_length:
            total = sum(pairs) / (causal * num_layers)
            lines.append(
                f"model attention density at {seq_length} tokens: {total:.3f} "
                f"(attended pairs / dense causal pairs over all layers)"
            )
        return "\n".join(lines)

    def log_summary(
        self,
        num_layers: int,
        num_heads: int,
        num_kv_heads: Optional[int] = None,
        seq_length: Optional[int] = None,
    ) -> None:
        """Log :meth:`summary` once per model shape, on rank 0, to logger ``megatron_s2.schedule``
        (whichever path built the model: ``build_gpt_model`` or ``pretrain_gpt.py --spec``)."""
        key = ("logged", num_layers, num_heads, num_kv_heads, seq_length)
        if key in self._validated:
            return
        self._validated.add(key)
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        logger.info(
            "S2 attention schedule%s:\n%s",
            f" ({self.source})" if self.source else "",
            self.summary(num_layers, num_heads, num_kv_heads, seq_length),
        )

    def copy(self) -> AttentionSchedule:
        return copy.deepcopy(self)


def _dense_position(dense: Mapping, where: str) -> tuple[str, Optional[float]]:
    """``(position_embedding, rotary_base)`` of a ``dense_layers`` mapping, checked; errors
    name ``where.key`` and the allowed values."""
    position = dense.get("position_embedding", "rope")
    if position not in POSITION_EMBEDDINGS:
        raise ScheduleError(
            f"{where}.position_embedding must be one of {', '.join(POSITION_EMBEDDINGS)} "
            f"(rope: rotary embeddings; nope: no position encoding), got {position!r}"
        )
    base = dense.get("rotary_base")
    if base is None:
        return position, None
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 0:
        raise ScheduleError(
            f"{where}.rotary_base must be a number > 0 (the dense layers' RoPE base) or null "
            f"(the model's), got {base!r}"
        )
    if position != "rope":
        raise ScheduleError(
            f"{where}.rotary_base ({base}) needs {where}.position_embedding: rope; with "
            f"{position!r} the dense layers have no rotary embedding"
        )
    return position, float(base)


def coverage_length(pattern: S2Pattern) -> int:
    """Tokens at which every stripe phase's hole (if any) is visible: past one local window plus
    a full stride of blocks, so a length-free check equals the check at any longer length."""
    return (pattern.local_blocks + pattern.vert_stride + 1) * pattern.block_size


def _check_coverage(pattern: S2Pattern, seq_length: Optional[int], where: str, layer: int) -> None:
    length = seq_length or coverage_length(pattern)
    report = pattern.coverage(length)
    if report.complete:
        return
    phases = {pattern.phase(h) for h in range(pattern.num_heads)}
    unseen = (
        f"{len(report.uncovered_blocks)} of {report.num_blocks} key blocks unseen at "
        f"{seq_length} tokens"
        if seq_length
        else f"{pattern.vert_stride - len(phases)} of every {pattern.vert_stride} key blocks "
        f"unseen beyond the local window"
    )
    # Only the fixes that close the holes here: head_step=1 (with homo_head off) gives one phase
    # per head, so it covers exactly when there are at least vert_stride heads.
    if pattern.vert_stride > pattern.num_heads:
        fixes = [f"vert_stride <= num_heads ({pattern.num_heads})"]
    elif not pattern.homo_head:
        fixes = ["head_step=1"]
    elif pattern.head_step == 1:
        fixes = ["homo_head: false"]
    else:
        fixes = ["head_step=1 with homo_head: false"]
    fixes.append("dense heads (num_dense_heads)")
    raise ScheduleError(
        f"{where} (layer {layer}): the {pattern.num_heads} heads together leave {unseen} "
        f"(e.g. blocks {report.uncovered_blocks[:4]}): vert_stride={pattern.vert_stride} with "
        f"head_step={pattern.head_step}{', homo_head' if pattern.homo_head else ''} gives only "
        f"{len(phases)} of {pattern.vert_stride} stripe phases. Use {', '.join(fixes)}, or set "
        f"attention.allow_coverage_holes: true if the holes are intended"
    )


_ENV_CACHE: dict[str, AttentionSchedule] = {}
