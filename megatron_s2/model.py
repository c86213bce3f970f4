"""One-call model builders for an :class:`S2TransformerConfig`: ``GPTModel`` and the choice of
model class.

* :func:`build_gpt_model` -- a Megatron-core ``GPTModel`` with S2 attention.
* :func:`model_config` / :func:`build_model` -- the one place where a run's model class is
  decided: :func:`model_config` makes the config of the chosen class (``"gpt"``: an
  :class:`S2TransformerConfig`; ``"hybrid"``: an
  :class:`~megatron_s2.hybrid.S2HybridTransformerConfig` of the GPT model's hybrid twin,
  pattern ``"*-" * num_layers``), and :func:`build_model` builds the model that config
  describes. The application (``megatron_s2.training``) goes through these two only.

megatron-core 0.19 deprecates ``GPTModel`` in favour of ``HybridModel``; 0.16.1 has no
``HybridModel``. ``"auto"`` picks ``HybridModel`` where it exists (its losses equal the GPT
model's: ``tests/training/test_trainer_model_class.py``), else ``GPTModel``.
"""

from __future__ import annotations

import inspect
import logging
from importlib import metadata
from typing import TYPE_CHECKING, Optional

# Megatron is imported where a model is built: the run config checks a model class
# (model_class_problem) without loading megatron-core.
if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

    from .config import S2TransformerConfig

__all__ = [
    "build_gpt_model",
    "MODEL_CLASSES",
    "HYBRID_MIN_CORE_VERSION",
    "model_class_problem",
    "hybrid_model_available",
    "resolve_model_class",
    "model_config",
    "build_model",
]

logger = logging.getLogger(__name__)

# The values of a run's model-class setting: the two classes, or "auto" (resolve_model_class).
MODEL_CLASSES = ("gpt", "hybrid", "auto")
# The first megatron-core release with megatron.core.models.hybrid.HybridModel.
HYBRID_MIN_CORE_VERSION = "0.19"


def build_gpt_model(
    config: S2TransformerConfig,
    vocab_size: int,
    max_sequence_length: int,
    pre_process: bool = True,
    post_process: bool = True,
    use_te: bool = False,
    vp_stage: Optional[int] = None,
    qk_layernorm: bool = False,
    **gpt_kwargs,
) -> GPTModel:
    """Build a Megatron-core ``GPTModel`` whose attention follows ``config.s2_schedule``.

    Args:
        config: an :class:`S2TransformerConfig` (schedule, true GQA groups, training sequence
            length and kernel backend are its fields, validated when it was built).
        vocab_size, max_sequence_length, pre_process, post_process: as for ``GPTModel``.
        use_te: Transformer Engine flavour (TE linears/norms, TE attention on dense layers).
        vp_stage: virtual pipeline stage of this model chunk (also passed to ``GPTModel``).
        qk_layernorm: normalize queries and keys per head.
        gpt_kwargs: passed to ``GPTModel`` (``position_embedding_type``, ``rotary_base``, ...).
    Returns:
        the ``GPTModel`` for this rank's pipeline (and virtual pipeline) stage.
    """
    from megatron.core.models.gpt import GPTModel

    from .config import S2TransformerConfig
    from .specs import get_s2_decoder_block_spec

    if not isinstance(config, S2TransformerConfig):
        raise TypeError(
            f"build_gpt_model needs a megatron_s2.S2TransformerConfig (the attention "
            f"schedule is one of its fields), got {type(config).__name__}"
        )
    from .attention import check_position_levers, rotary_options

    # GPTModel's default position embedding is learned absolute positions.
    check_position_levers(
        config.s2_schedule, gpt_kwargs.get("position_embedding_type", "learned_absolute")
    )
    spec = get_s2_decoder_block_spec(
        config,
        use_te=use_te,
        vp_stage=vp_stage,
        qk_layernorm=qk_layernorm,
        rotary=rotary_options(gpt_kwargs),
    )
    if vp_stage is not None and "vp_stage" in inspect.signature(GPTModel.__init__).parameters:
        gpt_kwargs["vp_stage"] = vp_stage
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        **gpt_kwargs,
    )


def _core_version() -> Optional[tuple[int, int]]:
    """``(major, minor)`` of the installed megatron-core from its package metadata (no import of
    megatron); None when it is not installed as a package (e.g. a source checkout)."""
    try:
        major, minor = metadata.version("megatron-core").split(".")[:2]
        return int(major), int(minor)
    except (metadata.PackageNotFoundError, ValueError):
        return None


def model_class_problem(model_class: str, *, gpt_only: Optional[str] = None) -> Optional[str]:
    """Why ``model_class`` cannot be built here (None: it can), in words for a setting's error;
    cheap (package metadata only), so a run config is checked before any work.

    ``gpt_only``: a setting of the run only ``GPTModel`` supports (refuses ``"hybrid"``).
    """
    allowed = (
        f"allowed: {', '.join(MODEL_CLASSES)} (gpt: GPTModel; hybrid: HybridModel, megatron-core "
        f">= {HYBRID_MIN_CORE_VERSION}; auto: hybrid where megatron-core has it, else gpt)"
    )
    if model_class not in MODEL_CLASSES:
        return f"{model_class!r} is not a model class; {allowed}"
    if model_class != "hybrid":
        return None
    version = _core_version()
    if version is not None and version < tuple(map(int, HYBRID_MIN_CORE_VERSION.split("."))):
        return (
            f"HybridModel needs megatron-core >= {HYBRID_MIN_CORE_VERSION}, the installed one "
            f"is {metadata.version('megatron-core')}; {allowed}. Use gpt or auto here, or "
            f"upgrade megatron-core ({HYBRID_MIN_CORE_VERSION} needs Python >= 3.12)"
        )
    if gpt_only is not None:
        return f"HybridModel does not support {gpt_only}; use gpt or auto ({allowed})"
    return None


def hybrid_model_available() -> bool:
    """Whether the installed megatron-core has ``HybridModel`` (0.19 and later)."""
    from .hybrid import HAVE_HYBRID

    return HAVE_HYBRID


def resolve_model_class(model_class: str, *, gpt_only: Optional[str] = None) -> str:
    """``"gpt"`` or ``"hybrid"``: the class a model-class setting builds here.

    ``"auto"`` is ``"hybrid"`` where megatron-core has ``HybridModel`` and ``gpt_only`` is None,
    else ``"gpt"``; ``gpt_only`` names a setting only ``GPTModel`` supports (e.g. Llama 3 RoPE
    scaling). ``"gpt"`` and ``"hybrid"`` are returned as they are: whether they can be built is
    :func:`model_config`'s check.
    """
    if model_class not in MODEL_CLASSES:
        raise ValueError(
            f"model class {model_class!r} is not one of {', '.join(MODEL_CLASSES)} (megatron-core "
            f">= {HYBRID_MIN_CORE_VERSION} for hybrid)"
        )
    if model_class != "auto":
        return model_class
    return "hybrid" if hybrid_model_available() and gpt_only is None else "gpt"


def _gpt_twin_pattern(num_layers: int, chunks: int) -> str:
    """``"*-" * num_layers`` cut into ``chunks`` equal ``|``-separated pipeline segments: each
    segment holds the same GPT layers as the GPT model's even pipeline split."""
    if num_layers % chunks:
        raise ValueError(
            f"num_layers ({num_layers}) must be divisible by the pipeline chunks "
            f"(pipeline x virtual pipeline = {chunks}) for the hybrid model class"
        )
    return "|".join(["*-" * (num_layers // chunks)] * chunks)


def model_config(
    model_class: str, *, gpt_only: Optional[str] = None, **fields
) -> S2TransformerConfig:
    """The model config of ``model_class`` (``"gpt"``, ``"hybrid"`` or ``"auto"``) from the
    fields of a GPT model's :class:`S2TransformerConfig`.

    ``"gpt"``: ``S2TransformerConfig(**fields)``. ``"hybrid"``: the ``HybridModel`` twin, an
    :class:`~megatron_s2.hybrid.S2HybridTransformerConfig` with ``hybrid_layer_pattern`` =
    ``"*-" * num_layers`` (cut into one ``|`` segment per pipeline chunk when pipelined) and
    ``num_layers`` = ``2 * num_layers`` hybrid layers (``recompute_num_layers`` doubled too),
    and ``gpt_checkpoint_keys`` set (checkpoints of either class load into the other); the
    schedule indexes the attention layers, so it applies unchanged. ``"auto"``:
    :func:`resolve_model_class` (``gpt_only`` names a setting of the run that only
    ``GPTModel`` supports). Raises
    :class:`~megatron_s2.hybrid.HybridModelUnavailable` for ``"hybrid"`` on a megatron-core
    without ``HybridModel``.
    """
    if resolve_model_class(model_class, gpt_only=gpt_only) == "gpt":
        from .config import S2TransformerConfig

        logger.info("model class: gpt (GPTModel)")
        return S2TransformerConfig(**fields)
    if gpt_only is not None:
        raise ValueError(f"model class hybrid: HybridModel does not support {gpt_only}")
    from .hybrid import S2HybridTransformerConfig

    chunks = fields.get("pipeline_model_parallel_size", 1) * (
        fields.get("virtual_pipeline_model_parallel_size") or 1
    )
    pattern = _gpt_twin_pattern(fields.pop("num_layers"), chunks)
    if fields.get("recompute_num_layers"):
        # Megatron's full recomputation counts hybrid layers: a GPT layer is two of them.
        fields["recompute_num_layers"] *= 2
    logger.info(
        "model class: hybrid (HybridModel, hybrid_layer_pattern %r: the GPT model's twin, "
        "checkpointed under its keys)",
        pattern,
    )
    # num_layers 0: taken from the pattern (2 hybrid layers per GPT layer).
    return S2HybridTransformerConfig(
        hybrid_layer_pattern=pattern, num_layers=0, gpt_checkpoint_keys=True, **fields
    )


def build_model(config: S2TransformerConfig, vocab_size: int, max_sequence_length: int, **kwargs):
    """Build the model ``config`` describes: a ``HybridModel`` for an
    :class:`~megatron_s2.hybrid.S2HybridTransformerConfig` (:func:`model_config` of
    ``"hybrid"``), else a ``GPTModel``. The config's class is the one owner of the choice.

    Args:
        config: the model config (:func:`model_config`).
        vocab_size, max_sequence_length: as for ``GPTModel`` / ``HybridModel``.
        kwargs: :func:`build_gpt_model`'s keyword arguments (``pre_process``, ``use_te``,
            ``vp_stage``, ``position_embedding_type``, ``rotary_base``,
            ``seq_len_interpolation_factor``, ...). The ``HybridModel`` of
            :func:`model_config` saves its checkpoints under the GPT model's keys
            (``S2HybridTransformerConfig.gpt_checkpoint_keys``), so a run resumes across the
            two classes.
    Returns:
        this rank's model chunk: ``(input_ids [b, s], position_ids [b, s], attention_mask,
        labels=[b, s])`` -> per-token loss ``[b, s]`` for either class.
    """
    from .hybrid import S2HybridTransformerConfig, build_hybrid_model

    if isinstance(config, S2HybridTransformerConfig):
        return build_hybrid_model(config, vocab_size, max_sequence_length, **kwargs)
    return build_gpt_model(config, vocab_size, max_sequence_length, **kwargs)
