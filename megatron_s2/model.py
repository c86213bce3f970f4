"""One-call ``GPTModel`` builder for an :class:`S2TransformerConfig`."""

from __future__ import annotations

import inspect
from typing import Optional

from megatron.core.models.gpt import GPTModel

from .config import S2TransformerConfig
from .specs import get_s2_decoder_block_spec


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
    if not isinstance(config, S2TransformerConfig):
        raise TypeError(
            f"build_gpt_model needs a megatron_s2.S2TransformerConfig (the attention "
            f"schedule is one of its fields), got {type(config).__name__}"
        )
    spec = get_s2_decoder_block_spec(
        config, use_te=use_te, vp_stage=vp_stage, qk_layernorm=qk_layernorm
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
