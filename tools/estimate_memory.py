#!/usr/bin/env python
"""Per-GPU memory estimate of a run config: weights, gradients, optimizer state, activations,
logits, the CP K/V gather, for the pipeline stage that holds the most.

    python tools/estimate_memory.py --config configs/extend/gpt-1.3b-s2-128k.yaml --gpus 8
    python tools/estimate_memory.py --config configs/gpt-125m-s2.yaml --gpus 1 \
        model.seq_length=32768

An estimate, for choosing a layout before a GPU is spent on it, not a measurement:

* weights bf16 (2 B/param) or fp32 (4), gradient buffer fp32 (4: ``grad_reduce_in_fp32``),
  Adam state 12 B/param (fp32 master, m, v) divided over data x context parallel ranks with the
  distributed optimizer;
* activations per layer and token of ``hidden`` width: ``ACT_BYTES`` bytes with no or selective
  recompute (flash-style attention keeps no ``s x s`` scores), fitted to the 125M hybrid at 8k
  (micro batch 2, no recompute, byte vocabulary: 10.7 GiB on an H100,
  docs/notebook/2026-11-benchmarks-training-multi-gpu.md);
  with full recompute each layer keeps its bf16 input, and one layer at a time runs with the
  full working set, which is not alive together with the logits (the peak is the larger of the
  two); divided by TP under sequence parallelism, by CP always; 1F1B keeps up to ``PP``
  micro-batches in flight on the first stage;
* logits ``[s / CP, b, vocab / TP]`` at ``LOGIT_BYTES`` per element: the bf16 output and the
  fp32 copy that Megatron's cross entropy works in (its gradient is computed in place there).
  Checked against three measurements with a 32k vocabulary: the 125M model at 4k, micro batch
  8 (25.8 GiB, H100; estimate 24.9), and the 1.3B hybrid at 128k with full recompute on one
  GPU (66.7 GiB, H200; estimate 66.8) and with CP 2 (38.3 GiB; estimate 41.0; docs/quality.md,
  docs/context_parallel.md);
* with CP, one layer's gathered K/V (bf16, whole sequence) and its gradient;
* ``OVERHEAD_GIB`` for the CUDA context, workspace and allocator fragmentation.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# Fitted: (10.7 GiB - weights/grads/optimizer - overhead) / (s * b * h * layers) of the 125M run.
ACT_BYTES = 52.0
LOGIT_BYTES = 6.0
OVERHEAD_GIB = 1.5
GIB = 2**30


@dataclass
class Estimate:
    """GiB per GPU, by component."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    cp_kv: float
    overhead: float = OVERHEAD_GIB

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.activations
            + self.logits
            + self.cp_kv
            + self.overhead
        )


def _layer_params(m) -> int:
    h, d = m.hidden_size, m.kv_channels or m.hidden_size // m.num_attention_heads
    qkv = h * d * (m.num_attention_heads + 2 * m.query_groups)
    proj = m.num_attention_heads * d * h
    mlp = (3 if m.swiglu else 2) * h * m.ffn_size
    return qkv + proj + mlp + 2 * h


def estimate(cfg, world_size: int, vocab_size: int) -> Estimate:
    """Per-GPU memory of ``cfg`` (a ``RunConfig``) on ``world_size`` GPUs, for its most loaded
    pipeline stage (the first: embeddings and the most micro-batches in flight)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp, pp, cp = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.context_parallel_size,
    )
    dp = cfg.data_parallel_size(world_size)
    layers = m.num_layers // pp
    embed = vocab_size * m.hidden_size
    params = (layers * _layer_params(m) + embed * (2 if pp == 1 else 1)) / tp
    bf16 = t.precision != "fp32"
    weights = params * (2 if bf16 else 4)
    gradients = params * 4
    optimizer = params * 12 / (dp * cp if p.use_distributed_optimizer else 1)
    tokens = m.seq_length / cp * t.micro_batch_size
    width = m.hidden_size / (tp if p.sequence_parallel else 1)
    in_flight = min(pp, cfg.num_microbatches(world_size)) if pp > 1 else 1
    logits = LOGIT_BYTES * tokens * vocab_size / tp if pp == 1 else 0.0
    if m.recompute == "full":
        kept = 2 * tokens * width * layers * in_flight
        working = ACT_BYTES * tokens * m.hidden_size / tp
        # The recomputed layer's working set lives in the backward, after the logits are freed.
        activations = kept + max(working - logits, 0.0)
    else:
        activations = ACT_BYTES * tokens * width * layers * in_flight
    kv_heads = max(m.query_groups // tp, 1)
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    cp_kv = 2 * 2 * 2 * m.seq_length * t.micro_batch_size * kv_heads * d if cp > 1 else 0.0
    return Estimate(*(x / GIB for x in (weights, gradients, optimizer, activations, logits, cp_kv)))


def _vocab(cfg) -> int:
    """The run's padded vocabulary, as the trainer computes it."""
    from megatron_s2.training.tokenizer import load_tokenizer, padded_vocab_size

    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    return padded_vocab_size(
        load_tokenizer(cfg.data.tokenizer).vocab_size,
        cfg.model.make_vocab_size_divisible_by,
        cfg.parallel.tensor_model_parallel_size,
    )


def format_estimate(e: Estimate) -> str:
    parts = ("weights", "gradients", "optimizer", "activations", "logits", "cp_kv", "overhead")
    return ", ".join(f"{k} {getattr(e, k):.1f}" for k in parts) + f" -> {e.total:.1f} GiB"


def main(argv=None) -> int:
    from megatron_s2.training.run_config import load_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--gpus", type=int, required=True, help="world size")
    ap.add_argument(
        "--vocab-size", type=int, default=None, help="padded vocabulary (default: the tokenizer's)"
    )
    ap.add_argument("overrides", nargs="*", help="key.sub=value, as for the trainer")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    cfg.schedule()
    cfg.validate(world_size=args.gpus)
    vocab = args.vocab_size or _vocab(cfg)
    result = format_estimate(estimate(cfg, args.gpus, vocab))
    print(f"{cfg.name} on {args.gpus} GPUs (vocab {vocab}): {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
