"""Per-layer attention schedules: which layers are S2 and with which settings.

One YAML mapping describes a model's attention (the trainer's run config embeds the same mapping
under its ``attention:`` key)::

    s2:                      # defaults for every S2 layer
      block_size: 64         # tokens per block: 16, 32, 64 or 128
      local_blocks: 16       # local window in blocks, diagonal block included
      vert_stride: 8         # vertical stripe stride in blocks (1 = dense)
      head_offset: 1         # stripe phase: 0 (authors' library) or 1 (Phi-3-small / vLLM)
      head_step: null        # per-head phase step; null = max(1, vert_stride // num_heads)
      num_dense_heads: 0     # heads of an S2 layer that attend densely; must divide the heads
      homo_head: false       # all heads share head 0's stripes
    dense_layers:
      pattern: "DS"          # tiled over the layers: char i is layer i; D = dense, S = S2
      indices: [0, -1]       # more dense layers (0-based; negative counts from the end)
    overrides:               # per-layer changes of any s2 key (0-based layer index)
      3: {vert_stride: 16}

**Layer indices in YAML are 0-based** (like the pattern string and Python lists), while
Megatron's ``layer_number`` is 1-based and global: :meth:`AttentionSchedule.layer_pattern` takes
the Megatron number. Everything unspecified is S2 with the ``s2`` defaults. An override on a dense
layer is an error (it would silently do nothing).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from s2attn import S2Pattern, SUPPORTED_BLOCK_SIZES

__all__ = ["S2Settings", "AttentionSchedule", "ScheduleError", "SCHEDULE_ENV_VAR"]

SCHEDULE_ENV_VAR = "MEGATRON_S2_SCHEDULE"

_TOP_KEYS = ("s2", "dense_layers", "overrides")
_DENSE_KEYS = ("pattern", "indices")


class ScheduleError(ValueError):
    """An invalid attention schedule; the message names the offending key."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class S2Settings:
    """The S2 pattern settings of one layer (see :class:`s2attn.S2Pattern`)."""

    block_size: int = 64
    local_blocks: int = 16
    vert_stride: int = 8
    head_offset: int = 0
    head_step: Optional[int] = None
    num_dense_heads: int = 0
    homo_head: bool = False

    @classmethod
    def keys(cls) -> tuple:
        return tuple(f.name for f in dataclasses.fields(cls))

    def updated(self, values: Mapping[str, Any], where: str) -> "S2Settings":
        """A copy with ``values`` applied; each key and value checked, errors name ``where.key``."""
        if not isinstance(values, Mapping):
            raise ScheduleError(f"{where} must be a mapping of S2 settings, got {type(values).__name__}")
        for key, value in values.items():
            name = f"{where}.{key}"
            if key not in self.keys():
                raise ScheduleError(f"unknown key {name}; allowed keys: {', '.join(self.keys())}")
            if key == "block_size":
                if value not in SUPPORTED_BLOCK_SIZES or not _is_int(value):
                    raise ScheduleError(f"{name} must be one of {SUPPORTED_BLOCK_SIZES}, got {value!r}")
            elif key == "homo_head":
                if not isinstance(value, bool):
                    raise ScheduleError(f"{name} must be true or false, got {value!r}")
            elif key == "head_step" and value is None:
                pass
            else:
                minimum = {"local_blocks": 1, "vert_stride": 1, "head_step": 1}.get(key, 0)
                if not _is_int(value) or value < minimum:
                    raise ScheduleError(f"{name} must be an integer >= {minimum}, got {value!r}")
        return dataclasses.replace(self, **dict(values))

    def pattern(self, num_heads: int, num_kv_heads: int) -> S2Pattern:
        """The full-model (all global heads) pattern of a layer with these settings."""
        return S2Pattern(num_heads=num_heads, num_kv_heads=num_kv_heads, **dataclasses.asdict(self))


@dataclass
class AttentionSchedule:
    """Which layers use S2 attention and with which settings.

    Build it with :meth:`from_yaml` / :meth:`from_dict`; check it against a model with
    :meth:`validate`. Layer indices (``dense_indices``, ``overrides``) are 0-based and may be
    negative (counted from the last layer); they are resolved against ``num_layers`` on use.
    """

    s2: S2Settings = field(default_factory=S2Settings)
    dense_pattern: str = ""
    dense_indices: List[int] = field(default_factory=list)
    overrides: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    source: Optional[str] = None  # where it came from, for messages

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]], prefix: str = "attention",
                  source: Optional[str] = None) -> "AttentionSchedule":
        """Parse and check the mapping described in the module docstring.

        ``prefix`` names the mapping in error messages (``attention.s2.vert_stride ...``).
        Model-dependent checks (layer ranges, heads, TP) are in :meth:`validate`.
        """
        d = {} if d is None else d
        if not isinstance(d, Mapping):
            raise ScheduleError(f"{prefix} must be a mapping, got {type(d).__name__}")
        for key in d:
            if key not in _TOP_KEYS:
                raise ScheduleError(f"unknown key {prefix}.{key}; allowed keys: {', '.join(_TOP_KEYS)}")
        s2 = S2Settings().updated(d.get("s2") or {}, f"{prefix}.s2")

        dense = d.get("dense_layers") or {}
        if not isinstance(dense, Mapping):
            raise ScheduleError(f"{prefix}.dense_layers must be a mapping with keys {_DENSE_KEYS}, "
                                f"got {type(dense).__name__}")
        for key in dense:
            if key not in _DENSE_KEYS:
                raise ScheduleError(f"unknown key {prefix}.dense_layers.{key}; allowed keys: "
                                    f"{', '.join(_DENSE_KEYS)}")
        pattern = dense.get("pattern") or ""
        if not isinstance(pattern, str) or set(pattern.upper()) - {"S", "D"}:
            raise ScheduleError(f"{prefix}.dense_layers.pattern must be a string of 'S' (S2) and "
                                f"'D' (dense) characters, got {pattern!r}")
        indices = dense.get("indices") or []
        if not isinstance(indices, (list, tuple)) or not all(_is_int(i) for i in indices):
            raise ScheduleError(f"{prefix}.dense_layers.indices must be a list of integer layer "
                                f"indices (0-based), got {indices!r}")

        raw_over = d.get("overrides") or {}
        if not isinstance(raw_over, Mapping):
            raise ScheduleError(f"{prefix}.overrides must be a mapping of layer index -> S2 settings, "
                                f"got {type(raw_over).__name__}")
        overrides: Dict[int, Dict[str, Any]] = {}
        for k, v in raw_over.items():
            try:
                idx = int(k)
                if isinstance(k, (bool, float)):
                    raise ValueError
            except (TypeError, ValueError):
                raise ScheduleError(f"{prefix}.overrides key {k!r} must be an integer layer index "
                                    f"(0-based)") from None
            s2.updated(v, f"{prefix}.overrides.{k}")  # type/range check of each key now
            overrides[idx] = dict(v)
        return cls(s2=s2, dense_pattern=pattern.upper(), dense_indices=list(indices),
                   overrides=overrides, source=source)

    @classmethod
    def from_yaml(cls, path: str, prefix: str = "attention") -> "AttentionSchedule":
        """Load a schedule file (the mapping of the module docstring at the top level)."""
        import yaml

        with open(path) as f:
            d = yaml.safe_load(f)
        return cls.from_dict(d, prefix=prefix, source=str(path))

    @classmethod
    def from_env(cls) -> Optional["AttentionSchedule"]:
        """The schedule named by ``$MEGATRON_S2_SCHEDULE`` (a YAML path), or None if unset."""
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
    def all_s2(cls, **s2_settings) -> "AttentionSchedule":
        """Every layer S2 with the given settings."""
        return cls.from_dict({"s2": s2_settings})

    @classmethod
    def all_dense(cls) -> "AttentionSchedule":
        """Every layer dense (a baseline through the same code path)."""
        return cls.from_dict({"dense_layers": {"pattern": "D"}})

    def to_dict(self) -> Dict[str, Any]:
        """The mapping :meth:`from_dict` reads (round-trips)."""
        out: Dict[str, Any] = {"s2": dataclasses.asdict(self.s2)}
        dense: Dict[str, Any] = {}
        if self.dense_pattern:
            dense["pattern"] = self.dense_pattern
        if self.dense_indices:
            dense["indices"] = list(self.dense_indices)
        if dense:
            out["dense_layers"] = dense
        if self.overrides:
            out["overrides"] = {int(k): dict(v) for k, v in self.overrides.items()}
        return out

    # ------------------------------------------------------------------ per-layer queries
    def _resolve(self, idx: int, num_layers: int, where: str) -> int:
        if not -num_layers <= idx < num_layers:
            raise ScheduleError(f"{where}: layer index {idx} is out of range for {num_layers} layers "
                                f"(0-based indices 0..{num_layers - 1}, or negative from the end)")
        return idx % num_layers

    def dense_layer_indices(self, num_layers: int) -> List[int]:
        """Sorted 0-based indices of the dense layers of a ``num_layers``-layer model."""
        dense = set()
        if self.dense_pattern:
            if len(self.dense_pattern) > num_layers:
                raise ScheduleError(
                    f"attention.dense_layers.pattern {self.dense_pattern!r} is longer than the "
                    f"model's {num_layers} layers")
            dense |= {i for i in range(num_layers)
                      if self.dense_pattern[i % len(self.dense_pattern)] == "D"}
        for i in self.dense_indices:
            dense.add(self._resolve(i, num_layers, "attention.dense_layers.indices"))
        return sorted(dense)

    def layer_settings(self, index: int, num_layers: int) -> Optional[S2Settings]:
        """S2 settings of 0-based layer ``index``, or None if the layer is dense."""
        if index in self.dense_layer_indices(num_layers):
            return None
        settings = self.s2
        for k, v in self.overrides.items():
            if self._resolve(k, num_layers, "attention.overrides") == index:
                settings = settings.updated(v, f"attention.overrides.{k}")
        return settings

    def layer_pattern(self, layer_number: int, num_heads: int, num_kv_heads: Optional[int] = None,
                      num_layers: Optional[int] = None) -> Optional[S2Pattern]:
        """Full-model S2 pattern of Megatron layer ``layer_number`` (1-based, global), or None
        for a dense layer. ``num_layers`` is needed when the schedule uses negative indices or a
        pattern string; without it the largest index the schedule mentions bounds the model."""
        if num_layers is None:
            num_layers = max([layer_number, len(self.dense_pattern)]
                             + [abs(i) + (i >= 0) for i in self.dense_indices]
                             + [abs(i) + (i >= 0) for i in self.overrides])
        if not 1 <= layer_number <= num_layers:
            raise ScheduleError(f"layer_number {layer_number} is out of range 1..{num_layers}")
        settings = self.layer_settings(layer_number - 1, num_layers)
        if settings is None:
            return None
        return settings.pattern(num_heads, num_kv_heads or num_heads)

    # ------------------------------------------------------------------ validation and reports
    def validate(self, num_layers: int, num_attention_heads: int,
                 num_query_groups: Optional[int] = None, tensor_model_parallel_size: int = 1,
                 seq_length: Optional[int] = None) -> None:
        """Check the schedule against a model; raise :class:`ScheduleError` naming the key.

        Checks: layer indices in range, no override on a dense layer, every S2 layer's pattern
        constructible (dense heads divide the heads, ...), heads and GQA groups divisible by the
        TP size (a group split across ranks cannot be computed by one rank), and ``seq_length`` a
        multiple of every S2 layer's block size.
        """
        groups = num_query_groups or num_attention_heads
        tp = tensor_model_parallel_size
        if num_attention_heads % tp:
            raise ScheduleError(f"num_attention_heads ({num_attention_heads}) must be divisible by "
                                f"tensor_model_parallel_size ({tp})")
        if num_attention_heads % groups:
            raise ScheduleError(f"num_attention_heads ({num_attention_heads}) must be a multiple of "
                                f"num_query_groups ({groups})")
        if (groups >= tp and groups % tp) or (groups < tp and tp % groups):
            raise ScheduleError(
                f"num_query_groups ({groups}) and tensor_model_parallel_size ({tp}) do not fit: a "
                f"GQA group would be split across TP ranks; use a group count divisible by the TP "
                f"size (or dividing it, so Megatron replicates the groups)")
        # With groups < TP Megatron hands each rank one replicated KV head.
        rank_groups = max(groups, tp)
        dense = self.dense_layer_indices(num_layers)
        for k in self.overrides:
            idx = self._resolve(k, num_layers, f"attention.overrides.{k}")
            if idx in dense:
                raise ScheduleError(f"attention.overrides.{k}: layer {idx} is a dense layer "
                                    f"(attention.dense_layers); an S2 override would have no effect")
        for i in range(num_layers):
            settings = self.layer_settings(i, num_layers)
            if settings is None:
                continue
            where = (f"attention.overrides.{i}" if any(self._resolve(k, num_layers, "") == i
                                                       for k in self.overrides) else "attention.s2")
            try:
                settings.pattern(num_attention_heads, groups)
                settings.pattern(num_attention_heads, rank_groups).for_tp_rank(0, tp)
            except ValueError as e:
                raise ScheduleError(f"{where} (layer {i}): {e}") from None
            if seq_length is not None and seq_length % settings.block_size:
                raise ScheduleError(
                    f"{where}.block_size ({settings.block_size}) must divide the sequence length "
                    f"({seq_length}) (layer {i})")

    def layer_kinds(self, num_layers: int) -> List[str]:
        """``'S2'`` or ``'dense'`` per 0-based layer."""
        dense = set(self.dense_layer_indices(num_layers))
        return ["dense" if i in dense else "S2" for i in range(num_layers)]

    def attention_pairs(self, num_layers: int, num_heads: int, num_kv_heads: Optional[int],
                        seq_length: int) -> List[int]:
        """Attended (query, key) token pairs per layer for one sequence, summed over all heads;
        dense layers count the full causal triangle."""
        causal = seq_length * (seq_length + 1) // 2 * num_heads
        out = []
        for i in range(num_layers):
            settings = self.layer_settings(i, num_layers)
            out.append(causal if settings is None
                       else settings.pattern(num_heads, num_kv_heads or num_heads).attended_pairs(seq_length))
        return out

    def summary(self, num_layers: int, num_heads: int, num_kv_heads: Optional[int] = None,
                seq_length: Optional[int] = None) -> str:
        """Table of the effective per-layer schedule (and density at ``seq_length``)."""
        kv = num_kv_heads or num_heads
        header = ["layer", "kind", "block", "local", "stride", "offset", "step", "dense_heads", "homo"]
        if seq_length:
            header.append(f"density@{seq_length}")
        rows = []
        pairs = self.attention_pairs(num_layers, num_heads, kv, seq_length) if seq_length else None
        causal = seq_length * (seq_length + 1) // 2 * num_heads if seq_length else None
        for i in range(num_layers):
            s = self.layer_settings(i, num_layers)
            if s is None:
                row = [str(i), "dense"] + ["-"] * 7
            else:
                p = s.pattern(num_heads, kv)
                row = [str(i), "S2", str(s.block_size), str(s.local_blocks), str(s.vert_stride),
                       str(s.head_offset), str(p.head_step), str(s.num_dense_heads),
                       "y" if s.homo_head else "n"]
            if seq_length:
                row.append(f"{pairs[i] / causal:.3f}")
            rows.append(row)
        widths = [max(len(r[c]) for r in rows + [header]) for c in range(len(header))]
        fmt = lambda r: "  ".join(x.rjust(w) for x, w in zip(r, widths))  # noqa: E731
        lines = [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
        if seq_length:
            total = sum(pairs) / (causal * num_layers)
            lines.append(f"model attention density at {seq_length} tokens: {total:.3f} "
                         f"(attended pairs / dense causal pairs over all layers)")
        return "\n".join(lines)

    def copy(self) -> "AttentionSchedule":
        return copy.deepcopy(self)


_ENV_CACHE: Dict[str, AttentionSchedule] = {}
