"""S2 block-sparse attention patterns.

A pattern says, for every **global** query head, which key blocks each query block attends to.
Token ``t`` lies in block ``t // block_size``. Query block ``i`` of sparse head ``h`` attends key
block ``j`` iff::

    j <= i  and  (i - j < local_blocks  or  (j + phase(h)) % vert_stride == 0)
    phase(h) = h * head_step + head_offset          (h = 0 for every head if homo_head)

Inside the diagonal block the mask is token-level causal. Vertical stripes sit at **absolute**
key blocks, so a key block that later queries stop attending is never attended again (the
pattern is KV-cache efficient).

Phase rule (per *query* head, also under GQA). ``head_step`` defaults to
``max(1, vert_stride // num_heads)``, the Phi-3-small/vLLM convention, so with ``head_offset=1``
checkpoints of those models are reproduced exactly. With ``num_heads >= vert_stride`` the step
is 1 and the heads take every residue modulo ``vert_stride``: together they attend every key
block from every later query block. Phases are assigned per query head rather than per KV group
on purpose: per-group phases would need ``num_kv_heads >= vert_stride`` for the union to have no
holes (8 KV heads with stride 16 would leave half the blocks unseen), per-head phases need only
``num_heads >= vert_stride``. The heads of one KV group take consecutive phases, so each group
covers ``min(group_size, vert_stride)`` distinct residues. :meth:`S2Pattern.coverage` reports
both the model-level and the per-group holes.

Dense heads (head-level hybrid): ``num_dense_heads`` heads attend causally to everything. They
are spread evenly over the heads (head ``h`` is dense iff ``h % (num_heads // num_dense_heads)
== 0``) so tensor-parallel ranks get equal work.

A pattern can be restricted to a contiguous range of global heads (a tensor-parallel rank's
heads) with :meth:`S2Pattern.head_range`; its rows are exactly those rows of the full pattern.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)

# Tile layouts (s2attn.layout) of S2-rule patterns, keyed by the pattern's values.
_SHARED_LAYOUT_CACHES: dict = {}


_SETTING = {"setting": True}

# Smallest allowed value of each integer setting (block_size has its own list).
_SETTING_MINIMUM = {
    "local_blocks": 1,
    "vert_stride": 1,
    "head_offset": 0,
    "num_dense_heads": 0,
    "head_step": 1,
}


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_settings(settings: dict) -> None:
    """Cross-setting checks of one layer's complete S2 settings (each value already passed
    :func:`check_setting`); ``ValueError("<name> must be ...")`` naming the setting.

    ``head_offset`` is a stripe phase, ``0..vert_stride-1`` (0 and 1, the two published
    conventions, always): phases are taken modulo ``vert_stride``, so a larger value would
    silently act as another phase."""
    offset, stride = settings["head_offset"], settings["vert_stride"]
    if offset >= max(2, stride):
        raise ValueError(
            f"head_offset must be a stripe phase 0..{max(2, stride) - 1} (0 = the authors' "
            f"library, 1 = Phi-3-small/vLLM; phases repeat every vert_stride={stride}), got "
            f"{offset}, which would act as {offset % stride}"
        )


def check_setting(name: str, value) -> None:
    """Check one S2 setting's type and range; ``ValueError("<name> must be ...")`` otherwise.

    The message starts with the setting's name so callers can prefix where it came from
    (``attention.s2.``, ``S2Pattern: ``).
    """
    if name not in S2Pattern.setting_names():
        raise ValueError(
            f"unknown S2 setting {name!r}; allowed: {', '.join(S2Pattern.setting_names())}"
        )
    if name == "block_size":
        if isinstance(value, bool) or value not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {value!r}")
    elif name == "homo_head":
        if not isinstance(value, bool):
            raise ValueError(f"homo_head must be true or false, got {value!r}")
    elif not (name == "head_step" and value is None):
        _check_int(name, value, _SETTING_MINIMUM[name])


@dataclass(frozen=True)
class CoverageReport:
    """Which key blocks no head reaches from distant queries.

    ``uncovered_blocks`` lists key blocks ``j`` (of ``num_blocks``) that some query block
    ``i >= j`` attends with no head at all (for the S2 rule: blocks beyond every query's local
    window whose residue no sparse head has). ``group_uncovered_blocks[g]`` is the same list for
    the heads of KV group ``g`` alone (informational: with fewer heads per group than
    ``vert_stride`` a group cannot cover everything by itself).
    """

    num_blocks: int
    uncovered_blocks: list
    group_uncovered_blocks: list

    @property
    def complete(self) -> bool:
        return not self.uncovered_blocks

    def __repr__(self) -> str:
        # A 128k pattern has thousands of blocks: show counts and a few examples, not all of them.
        groups = sum(1 for g in self.group_uncovered_blocks if g)
        return (
            f"CoverageReport(num_blocks={self.num_blocks}, "
            f"uncovered={len(self.uncovered_blocks)} {_few(self.uncovered_blocks)}, "
            f"groups_with_holes={groups}/{len(self.group_uncovered_blocks)})"
        )


def _few(blocks: list, n: int = 4) -> str:
    if len(blocks) <= 2 * n:
        return str(list(blocks))
    return (
        "[" + ", ".join(map(str, blocks[:n])) + ", ..., " + ", ".join(map(str, blocks[-n:])) + "]"
    )


@dataclass(frozen=True, eq=False)
class S2Pattern:
    """Causal S2 block-sparse attention pattern over global heads (see module docstring).

    Args:
        num_heads: total number of query heads of the attention layer (all TP ranks).
        num_kv_heads: number of key/value heads (GQA groups); ``None`` means ``num_heads``.
        block_size: tokens per block, one of 16, 32, 64, 128.
        local_blocks: blocks of the local window, diagonal block included (>= 1).
        vert_stride: stride of the vertical stripes in blocks (>= 1; 1 means dense).
        head_offset: phase of the stripes, ``0..vert_stride-1``; 0 (authors' library) or 1
            (Phi-3-small / vLLM).
        num_dense_heads: heads that attend densely (causal); must divide ``num_heads``.
        homo_head: all heads share head 0's stripes.
        head_step: per-head phase step; default ``max(1, vert_stride // num_heads)``.
        head_start, head_end: the global heads this object covers (a TP rank's range).
        user_mask: optional ``(num_heads, nb, nb)`` bool block mask over *global* heads, replacing
            the S2 rule (ablations); must be causal with the diagonal present. Sequences up to
            ``nb * block_size`` tokens.
    """

    num_heads: int
    num_kv_heads: Optional[int] = None
    # The S2 settings (``_SETTING``): what a schedule sets per layer, independent of the model's
    # head counts. Adding a field here with that metadata makes it a schedule key everywhere.
    block_size: int = field(default=64, metadata=_SETTING)
    local_blocks: int = field(default=16, metadata=_SETTING)
    vert_stride: int = field(default=8, metadata=_SETTING)
    head_offset: int = field(default=0, metadata=_SETTING)
    num_dense_heads: int = field(default=0, metadata=_SETTING)
    homo_head: bool = field(default=False, metadata=_SETTING)
    head_step: Optional[int] = field(default=None, metadata=_SETTING)
    head_start: int = 0
    head_end: Optional[int] = None
    user_mask: Optional[torch.Tensor] = field(default=None, repr=False)

    def __post_init__(self):
        try:
            _check_int("num_heads", self.num_heads, 1)
            if self.num_kv_heads is None:
                object.__setattr__(self, "num_kv_heads", self.num_heads)
            _check_int("num_kv_heads", self.num_kv_heads, 1)
            for name, value in self.settings().items():
                check_setting(name, value)
            check_settings(self.settings())
        except ValueError as e:
            raise ValueError(f"S2Pattern: {e}") from None
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"S2Pattern: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.num_dense_heads and self.num_heads % self.num_dense_heads:
            raise ValueError(
                f"S2Pattern: num_dense_heads ({self.num_dense_heads}) must divide num_heads "
                f"({self.num_heads}) so dense heads can be spread evenly"
            )
        if self.head_step is None:
            object.__setattr__(self, "head_step", max(1, self.vert_stride // self.num_heads))
        if self.head_end is None:
            object.__setattr__(self, "head_end", self.num_heads)
        if not (0 <= self.head_start < self.head_end <= self.num_heads):
            raise ValueError(
                f"S2Pattern: head range [{self.head_start}, {self.head_end}) must lie within "
                f"[0, {self.num_heads}) and be non-empty"
            )
        g = self.group_size
        if self.head_start % g or self.head_end % g:
            raise ValueError(
                f"S2Pattern: head range [{self.head_start}, {self.head_end}) splits a GQA group "
                f"of {g} query heads; ranges must start and end on multiples of {g}"
            )
        if self.user_mask is not None:
            self._validate_user_mask(self.user_mask)
        # Kernel layouts depend only on these values, so equal S2 patterns (every S2 layer of a
        # model built from one schedule) share one cache instead of each layer building and
        # holding its own copy. A user mask's tensor is no safe key: it keeps a private cache.
        cache = (
            {}
            if self.user_mask is not None
            else _SHARED_LAYOUT_CACHES.setdefault(
                tuple(
                    getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "user_mask"
                ),
                {},
            )
        )
        object.__setattr__(self, "_cache", cache)

    # ------------------------------------------------------------------ settings
    @classmethod
    def setting_names(cls) -> tuple:
        """Names of the S2 settings: the fields a schedule may set per layer."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("setting"))

    def settings(self) -> dict:
        """``{name: value}`` of the S2 settings (``head_step`` resolved to its value)."""
        return {name: getattr(self, name) for name in self.setting_names()}

    def with_heads(self, num_heads: int, num_kv_heads: Optional[int] = None) -> S2Pattern:
        """The same S2 settings for a layer with other head counts (all global heads)."""
        if self.user_mask is not None:
            raise ValueError("S2Pattern.with_heads: a user-mask pattern has fixed heads")
        return S2Pattern(num_heads=num_heads, num_kv_heads=num_kv_heads, **self.settings())

    # ------------------------------------------------------------------ construction helpers
    def _validate_user_mask(self, m: torch.Tensor) -> None:
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or m.dim() != 3:
            raise ValueError(
                "S2Pattern: user_mask must be a bool tensor of shape (num_heads, nb, nb)"
            )
        if m.shape[0] != self.num_heads or m.shape[1] != m.shape[2]:
            raise ValueError(
                f"S2Pattern: user_mask shape {tuple(m.shape)} must be "
                f"(num_heads={self.num_heads}, nb, nb)"
            )
        nb = m.shape[1]
        upper = torch.triu(torch.ones(nb, nb, dtype=torch.bool, device=m.device), diagonal=1)
        if (m & upper).any():
            raise ValueError(
                "S2Pattern: user_mask is not causal (a key block j > query block i is set)"
            )
        if not m.diagonal(dim1=1, dim2=2).all():
            raise ValueError(
                "S2Pattern: user_mask must attend the diagonal block of every query block"
            )

    @classmethod
    def from_block_mask(
        cls, mask: torch.Tensor, block_size: int, num_kv_heads: Optional[int] = None
    ):
        """Pattern from an arbitrary causal ``(num_heads, nb, nb)`` bool block mask."""
        mask = mask.to(torch.bool).cpu().contiguous()
        return cls(
            num_heads=mask.shape[0],
            num_kv_heads=num_kv_heads,
            block_size=block_size,
            user_mask=mask,
        )

    def head_range(self, start: int, end: int) -> S2Pattern:
        """The same pattern restricted to global heads ``[start, end)`` (e.g. a TP rank's)."""
        if not (self.head_start <= start < end <= self.head_end):
            raise ValueError(
                f"S2Pattern.head_range: [{start}, {end}) is not inside "
                f"[{self.head_start}, {self.head_end})"
            )
        return dataclasses.replace(self, head_start=start, head_end=end)

    def for_tp_rank(self, rank: int, world_size: int) -> S2Pattern:
        """Heads of tensor-parallel rank ``rank``, split the way Megatron splits them."""
        if self.num_heads % world_size or self.num_kv_heads % world_size:
            raise ValueError(
                f"S2Pattern: num_heads ({self.num_heads}) and num_kv_heads ({self.num_kv_heads}) "
                f"must be divisible by the tensor-parallel size ({world_size})"
            )
        n = self.num_heads // world_size
        return self.head_range(rank * n, (rank + 1) * n)

    # ------------------------------------------------------------------ properties
    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def local_num_heads(self) -> int:
        return self.head_end - self.head_start

    @property
    def local_num_kv_heads(self) -> int:
        return self.local_num_heads // self.group_size

    @property
    def heads(self) -> range:
        return range(self.head_start, self.head_end)

    @property
    def is_user_mask(self) -> bool:
        return self.user_mask is not None

    @property
    def max_seq_len(self) -> Optional[int]:
        return None if self.user_mask is None else self.user_mask.shape[1] * self.block_size

    def is_dense_head(self, h: int) -> bool:
        """Whether global head ``h`` attends densely (causal) under the S2 rule."""
        if self.user_mask is not None:
            return False
        if self.vert_stride == 1:
            return True
        return bool(self.num_dense_heads) and h % (self.num_heads // self.num_dense_heads) == 0

    def phase(self, h: int) -> int:
        """Stripe phase of global head ``h``: key block j is vertical iff (j + phase) % V == 0."""
        return ((0 if self.homo_head else h * self.head_step) + self.head_offset) % self.vert_stride

    def head_params(self, device=None):
        """Per local head: (is_dense bool tensor, residue int tensor) where vertical key blocks
        are those with ``j % vert_stride == residue``."""
        hs = list(self.heads)
        dense = torch.tensor([self.is_dense_head(h) for h in hs], dtype=torch.bool, device=device)
        res = torch.tensor(
            [(-self.phase(h)) % self.vert_stride for h in hs], dtype=torch.int64, device=device
        )
        return dense, res

    @property
    def is_kv_cache_efficient(self) -> bool:
        """True if no head re-attends a key block that a later query dropped.

        Always true for the S2 rule (stripes at absolute positions); checked for user masks: in
        every column the attended rows (from the diagonal down) must form one prefix interval.
        """
        if self.user_mask is None:
            return True
        m = self.user_mask[self.head_start : self.head_end].to(torch.int8)
        # Along each column from the diagonal down, the mask may only switch 1 -> 0 once.
        # Strictly below the diagonal: the causal 0 -> 1 step onto the diagonal is no re-attend.
        below = torch.tril(torch.ones(m.shape[1], m.shape[2], dtype=torch.bool), diagonal=-1)
        d = m[:, 1:, :] - m[:, :-1, :]
        rises = (d > 0) & below[1:, :]
        return not bool(rises.any())

    # ------------------------------------------------------------------ masks and counts
    def block_mask(
        self,
        num_q_blocks: int,
        num_k_blocks: Optional[int] = None,
        q_block_start: int = 0,
        k_block_start: int = 0,
    ) -> torch.Tensor:
        """Bool ``(local_heads, num_q_blocks, num_k_blocks)`` block mask at absolute block offsets.

        For tests, plots and small sequences: at 128k with block 16 this is gigabytes; the
        kernels never build it.
        """
        nk = num_q_blocks if num_k_blocks is None else num_k_blocks
        i = torch.arange(q_block_start, q_block_start + num_q_blocks)[:, None]
        j = torch.arange(k_block_start, k_block_start + nk)[None, :]
        if self.user_mask is not None:
            nb = self.user_mask.shape[1]
            if i.max() >= nb or j.max() >= nb:
                raise ValueError(
                    f"S2Pattern: user_mask covers {nb} blocks ({nb * self.block_size} tokens); "
                    f"blocks up to {max(int(i.max()), int(j.max()))} were requested"
                )
            return self.user_mask[self.head_start : self.head_end][:, i, j]
        dense, res = self.head_params()
        causal = j <= i
        local = (i - j) < self.local_blocks
        vert = (j % self.vert_stride)[None] == res[:, None, None]
        return causal[None] & (local[None] | vert | dense[:, None, None])

    def check_seq_len(self, seq_len: int, name: str = "seq_len") -> None:
        if seq_len < 1:
            raise ValueError(f"S2Pattern: {name} must be >= 1, got {seq_len}")
        if self.max_seq_len is not None and seq_len > self.max_seq_len:
            raise ValueError(
                f"S2Pattern: {name}={seq_len} exceeds the user mask's {self.max_seq_len} tokens"
            )

    def attended_pairs(self, seq_len: int) -> int:
        """Number of attended (query, key) token pairs summed over local heads, causal, for one
        sequence of ``seq_len`` tokens. Used for density and effective TFLOP/s."""
        self.check_seq_len(seq_len)
        # Shared by equal patterns: every S2 layer of a schedule asks for the same count.
        key = ("attended_pairs", seq_len)
        if key not in self._cache:
            self._cache[key] = self._count_attended_pairs(seq_len)
        return self._cache[key]

    def _count_attended_pairs(self, seq_len: int) -> int:
        B = self.block_size
        nb = math.ceil(seq_len / B)
        sizes = torch.full((nb,), B, dtype=torch.int64)
        sizes[-1] = seq_len - (nb - 1) * B
        total = 0
        # Row by row over block rows keeps memory O(heads * nb) even at 128k.
        chunk = max(1, 4_000_000 // max(1, nb * self.local_num_heads))
        for i0 in range(0, nb, chunk):
            i1 = min(nb, i0 + chunk)
            m = self.block_mask(i1 - i0, nb, i0, 0)  # (H, r, nb)
            offd = m.clone()
            rows = torch.arange(i0, i1)
            offd[:, torch.arange(i1 - i0), rows] = False
            total += int((offd.to(torch.int64).sum(0) * sizes[i0:i1, None] * sizes[None, :]).sum())
            diag = sizes[i0:i1]
            total += self.local_num_heads * int((diag * (diag + 1) // 2).sum())
        return total

    def density(self, seq_len: int) -> float:
        """Attended fraction of the causal token triangle (1.0 = dense causal)."""
        causal = seq_len * (seq_len + 1) // 2 * self.local_num_heads
        return self.attended_pairs(seq_len) / causal

    def coverage(self, seq_len: int) -> CoverageReport:
        """Report key blocks that no head (and no head of each KV group) reaches from every
        later query block, for a sequence of ``seq_len`` tokens over the local heads."""
        self.check_seq_len(seq_len)
        nb = math.ceil(seq_len / self.block_size)
        groups = [
            list(range(s, s + self.group_size))
            for s in range(self.head_start, self.head_end, self.group_size)
        ]
        if self.user_mask is None:

            def holes(heads):
                if any(self.is_dense_head(h) for h in heads):
                    return []
                res = {(-self.phase(h)) % self.vert_stride for h in heads}
                # A block j is reached from rows i < j + L by the local window; later rows need a
                # stripe, and such rows exist only if j + L <= nb - 1.
                return [
                    j
                    for j in range(nb)
                    if j + self.local_blocks < nb and j % self.vert_stride not in res
                ]

            allh = list(self.heads)
            return CoverageReport(nb, holes(allh), [holes(g) for g in groups])
        m = self.block_mask(nb, nb)

        def holes_mask(sel):
            any_h = m[sel].any(0)  # (nb, nb)
            lower = torch.tril(torch.ones(nb, nb, dtype=torch.bool))
            ok = (any_h | ~lower).all(0)
            return [int(j) for j in torch.nonzero(~ok).flatten()]

        base = self.head_start
        return CoverageReport(
            nb,
            holes_mask(slice(None)),
            [holes_mask(slice(g[0] - base, g[-1] + 1 - base)) for g in groups],
        )

    def describe(self) -> str:
        if self.user_mask is not None:
            return f"user block mask ({self.user_mask.shape[1]} blocks of {self.block_size})"
        return (
            f"S2(block={self.block_size}, local={self.local_blocks}, stride={self.vert_stride}, "
            f"offset={self.head_offset}, step={self.head_step}, dense_heads={self.num_dense_heads}"
            f"{', homo' if self.homo_head else ''})"
        )
