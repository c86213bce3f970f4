"""Pretraining loop for S2 hybrid GPT models, built from Megatron-core's parts.

    megatron-s2-train [--config RUN.yaml] [key.sub=value ...]
    python -m megatron_s2.training ...                 (same)
    torchrun --nproc-per-node N -m megatron_s2.training --config RUN.yaml

Without ``--config`` it runs the built-in demo (``configs/demo.yaml``): it generates a synthetic
corpus, trains a tiny S2 hybrid and prints a summary. See ``docs/training.md``.

The pieces are Megatron-core's: ``parallel_state`` for TP/PP/CP/DP groups, ``GPTModel`` with our
specs (:func:`megatron_s2.model.build_gpt_model`), ``Float16Module`` for bf16, Megatron
``DistributedDataParallel`` and the distributed optimizer, ``get_forward_backward_func`` for
(interleaved) pipeline schedules, ``finalize_model_grads``, ``OptimizerParamScheduler``, gradient
clipping inside the optimizer, ``dist_checkpointing``. This module only wires them together and
adds the loop: logging, evaluation, checkpoints, SIGTERM and NaN handling.

Without CUDA the trainer runs in the explicit CPU mode (:mod:`megatron_s2.training.cpu_mode`): gloo, fp32,
PyTorch reference attention. A GPU run uses NCCL, bf16 and the Triton kernels.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import random
import signal
import sys
from dataclasses import dataclass
from functools import partial
from typing import Optional

import numpy as np
import torch

from .run_config import ConfigError, RunConfig, load_config

logger = logging.getLogger("megatron_s2.training")

# Exit codes of main(): a NaN stop differs from a crash so launchers can tell them apart.
EXIT_OK = 0
EXIT_CONFIG_ERROR = 2
EXIT_NAN = 3


class NonFiniteLossError(RuntimeError):
    """The loss became NaN/inf; the run stopped without stepping the optimizer."""


@dataclass
class RunResult:
    """What a run did (returned by :func:`train`)."""

    iteration: int
    losses: dict  # iteration -> train loss (every iteration of this process)
    valid_losses: dict
    stopped_by: str  # "done", "sigterm"
    tokens_per_s: float
    tflops_per_gpu: float
    run_dir: str
    last_checkpoint: Optional[str]


# ------------------------------------------------------------------------------------- setup

def _init_distributed(cfg: RunConfig, gpu: bool) -> None:
    """Process group + Megatron's model-parallel groups + seeds."""
    from megatron.core import parallel_state, tensor_parallel

    single = "RANK" not in os.environ  # a plain `python -m megatron_s2.training`: a world of one
    rank = 0 if single else int(os.environ["RANK"])
    world = 1 if single else int(os.environ["WORLD_SIZE"])
    local_rank = 0 if single else int(os.environ.get("LOCAL_RANK", "0"))
    cfg.validate(world_size=world)
    if gpu:
        torch.cuda.set_device(local_rank)
    if not torch.distributed.is_initialized():
        # A world of one needs no rendezvous: an in-process store avoids picking a free port
        # (racy when several runs start at once).
        store = torch.distributed.HashStore() if single else None
        torch.distributed.init_process_group(
            backend="nccl" if gpu else "gloo", rank=rank, world_size=world, store=store,
            timeout=datetime.timedelta(minutes=30))
    p = cfg.parallel
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size)
    # Same init on every data-parallel replica; pipeline stages differ (Megatron-LM's convention).
    seed = cfg.train.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _is_rank0() -> bool:
    return torch.distributed.get_rank() == 0


def transformer_config(cfg: RunConfig, bf16: bool):
    """Megatron ``TransformerConfig`` of the run."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    m, p = cfg.model, cfg.parallel
    dtype = torch.bfloat16 if bf16 else torch.float32
    recompute = {}
    if m.recompute == "selective":
        recompute = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif m.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=m.recompute_num_layers)
    vpp = p.virtual_pipeline_model_parallel_size
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        ffn_hidden_size=m.ffn_size,
        normalization=m.normalization,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        add_bias_linear=False,
        init_method_std=m.init_method_std,
        hidden_dropout=m.hidden_dropout,
        # Megatron's default is 0.1; the S2 kernels have no attention dropout.
        attention_dropout=0.0,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=p.context_parallel_size,
        sequence_parallel=p.sequence_parallel,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # Fusions that need Apex/TE stay off: the pip wheel ships neither.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        # Loss = sum over tokens / all tokens of the global batch (3-tuple loss convention);
        # correct under CP and with uneven loss masks.
        calculate_per_token_loss=True,
        # Megatron-LM's defaults for interleaved pipelines; the core defaults train wrong.
        overlap_p2p_comm=vpp is not None,
        batch_p2p_comm=vpp is None,
        **recompute,
    )


def _build_model(cfg: RunConfig, tconfig, schedule, vocab_size: int, gpu: bool, bf16: bool) -> list:
    """Model chunks (one per virtual pipeline stage) wrapped in Float16Module and Megatron DDP."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from ..model import build_gpt_model

    vpp = cfg.parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        model = build_gpt_model(
            tconfig, schedule, vocab_size, cfg.model.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            use_te=False, vp_stage=stage,
            position_embedding_type="rope", rotary_base=cfg.model.rotary_base,
            share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights)
        for param in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if gpu:
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    if bf16:
        chunks = [Float16Module(tconfig, c) for c in chunks]
    p = cfg.parallel
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        use_distributed_optimizer=p.use_distributed_optimizer,
        average_in_collective=False,
    )
    # Only the first chunk's buckets overlap with the backward (Megatron-LM does the same).
    return [DistributedDataParallel(tconfig, ddp_config, c, disable_bucketing=i > 0)
            for i, c in enumerate(chunks)]


def _build_optimizer(cfg: RunConfig, model: list, bf16: bool):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o = cfg.optimizer
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
        clip_grad=o.clip_grad, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        overlap_param_gather=cfg.parallel.overlap_param_gather), model)
    decay = o.lr_decay_iters or cfg.train.train_iters
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.lr_warmup_iters,
        lr_decay_steps=decay, lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay,
        end_wd=o.weight_decay, wd_incr_steps=decay, wd_incr_style="constant")
    return opt, sched


def _wire_ddp_hooks(tconfig, model: list, cfg: RunConfig) -> None:
    """Hand Megatron's schedules the DDP/optimizer hooks (as Megatron-LM's training loop does)."""
    from megatron.core.distributed import finalize_model_grads

    tconfig.finalize_model_grads_func = finalize_model_grads
    no_sync = [m.no_sync for m in model]
    tconfig.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
    if cfg.parallel.overlap_grad_reduce:
        sync = [m.start_grad_sync for m in model]
        tconfig.grad_sync_func = sync[0] if len(model) == 1 else sync
    if cfg.parallel.overlap_param_gather:
        sync = [m.start_param_sync for m in model]
        tconfig.param_sync_func = sync[0] if len(model) == 1 else sync


# ------------------------------------------------------------------------------- one step

def _loss_func(loss_mask: torch.Tensor, nan: bool, output_tensor: torch.Tensor):
    """3-tuple loss: (sum of token losses, token count, report) — Megatron divides by the total
    token count of the global batch in ``finalize_model_grads``."""
    mask = loss_mask.view(-1).float()
    loss = torch.sum(output_tensor.float().view(-1) * mask)
    if nan:
        loss = loss * float("nan")
    num_tokens = mask.sum().to(torch.int)
    # Clone: the schedule scales the returned loss in place.
    report = torch.stack([loss.detach().clone(), num_tokens.detach().float()])
    return loss, num_tokens, {"lm loss": report}


def _forward_step(device, cp: int, nan_flag: list, data_iterator, model):
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = next(data_iterator)
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()
             if k in ("tokens", "labels", "loss_mask", "position_ids")}
    if cp > 1:
        batch = get_batch_on_this_cp_rank(batch)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"], nan_flag[0])


def _reduce_loss(losses: list, device) -> tuple[float, float]:
    """(mean loss, tokens) of a step over micro-batches and data-parallel ranks, on every rank."""
    from megatron.core import parallel_state as ps

    total = torch.zeros(2, dtype=torch.float64, device=device)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        for item in losses:
            total += item["lm loss"].to(device=device, dtype=torch.float64)
        torch.distributed.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.broadcast(total, src=ps.get_pipeline_model_parallel_last_rank(),
                                    group=ps.get_pipeline_model_parallel_group())
    loss_sum, tokens = total.tolist()
    return (loss_sum / tokens if tokens > 0 else float("nan")), tokens


# -------------------------------------------------------------------------------- the loop

class _StopFlag:
    """SIGTERM (slurm preemption) sets it; ranks agree on it at the end of every iteration."""

    def __init__(self):
        self.set = False
        self._previous = None

    def install(self) -> None:
        def handler(signum, frame):
            self.set = True
        try:
            self._previous = signal.signal(signal.SIGTERM, handler)
        except ValueError:  # not the main thread (e.g. an embedding application)
            self._previous = None

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def agreed(self, device) -> bool:
        t = torch.tensor([1.0 if self.set else 0.0], device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())


def train(cfg: RunConfig) -> RunResult:
    """Run (or resume) the training described by ``cfg``; collective over all ranks."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from . import checkpointing
    from .data import build_datasets, micro_batches
    from .metrics import MetricsLogger, StepTimer, memory_gib, model_flops_per_iteration, plot_loss_curve
    from .tokenizer import load_tokenizer, padded_vocab_size

    gpu = torch.cuda.is_available()
    if not gpu:
        from .cpu_mode import enable_cpu_mode

        enable_cpu_mode()
    if cfg.train.precision == "bf16" and not gpu:
        raise ConfigError("train.precision=bf16 needs a GPU; CPU mode trains in fp32")
    bf16 = gpu and cfg.train.precision in ("auto", "bf16")
    schedule = cfg.schedule()
    _init_distributed(cfg, gpu)
    world = torch.distributed.get_world_size()
    rank0 = _is_rank0()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    if rank0:
        mode = (f"GPU mode: {torch.cuda.get_device_name()} x {world}, NCCL, "
                f"{'bf16' if bf16 else 'fp32'}, Triton S2 kernels") if gpu else \
            f"CPU mode: {world} process(es), gloo, fp32, " + (
                "Triton interpreter attention (TRITON_INTERPRET=1: slow)"
                if os.environ.get("TRITON_INTERPRET") == "1" else "PyTorch reference attention")
        print(f"[megatron-s2] {mode}", flush=True)

    run_dir, ckpt_dir = cfg.run_dir, cfg.checkpoint_dir
    if rank0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            import yaml

            yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)

    # ---- data (needs torch.distributed: the builder synchronises its cache) ----
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if cfg.data.demo:
        from .demo_corpus import ensure_demo_data

        if rank0:
            print(f"[megatron-s2] demo corpus in {cfg.data.demo_dir} (generated on first use)", flush=True)
        extra = {"num_docs": cfg.data.demo_num_docs} if cfg.data.demo_num_docs else {}
        prefixes, weights = [ensure_demo_data(cfg.data.demo_dir, seed=0, **extra)], None
    else:
        prefixes, weights = cfg.blend()
    vocab_size = cfg.model.vocab_size or padded_vocab_size(
        tokenizer.vocab_size, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tensor_model_parallel_size)
    if vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size ({vocab_size}) is smaller than the tokenizer's "
                          f"vocabulary ({tokenizer.vocab_size})")
    t = cfg.train
    num_mb = cfg.num_microbatches(world)
    dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    datasets = build_datasets(
        prefixes, weights, tokenizer=tokenizer, seq_length=cfg.model.seq_length, seed=t.seed,
        split=cfg.data.split, train_samples=t.train_iters * t.global_batch_size,
        valid_samples=t.eval_iters * t.global_batch_size if t.eval_interval and t.eval_iters else 0,
        cache_dir=cfg.data.cache_dir, reset_position_ids=t.reset_position_ids,
        eod_mask_loss=t.eod_mask_loss)

    # ---- model, optimizer, checkpoint ----
    tconfig = transformer_config(cfg, bf16)
    model = _build_model(cfg, tconfig, schedule, vocab_size, gpu, bf16)
    optimizer, scheduler = _build_optimizer(cfg, model, bf16)
    _wire_ddp_hooks(tconfig, model, cfg)
    n_params = sum(p.numel() for m in model for p in m.parameters())
    iteration, consumed = 0, 0
    last_ckpt = None
    if cfg.checkpoint.resume:
        # The run's own checkpoints win over load_dir: a preempted run that started from
        # another run's checkpoint must resume from where it got to.
        load_root = ckpt_dir
        if checkpointing.latest_iteration(ckpt_dir) is None and cfg.checkpoint.load_dir:
            load_root = cfg.checkpoint.load_dir
        if checkpointing.latest_iteration(load_root) is not None:
            iteration, consumed = checkpointing.load_checkpoint(
                load_root, model, optimizer, scheduler, load_optimizer=cfg.checkpoint.load_optimizer)
            last_ckpt = checkpointing.checkpoint_path(load_root, iteration)
            if rank0:
                print(f"[megatron-s2] resumed from {last_ckpt} (iteration {iteration}, "
                      f"{consumed} samples consumed)", flush=True)
    if iteration >= t.train_iters and rank0:
        print(f"[megatron-s2] nothing to do: iteration {iteration} >= train.train_iters "
              f"({t.train_iters})", flush=True)

    vpp = cfg.parallel.virtual_pipeline_model_parallel_size
    # Interleaved pipelines call next() once per model chunk: one iterator per chunk over the
    # same samples.
    train_iters_ = [micro_batches(datasets.train, consumed, t.micro_batch_size, dp_rank, dp_size,
                                  t.num_workers) for _ in range(vpp or 1)]
    train_iter = train_iters_[0] if vpp is None else train_iters_

    flops_per_iter = model_flops_per_iteration(cfg, vocab_size, schedule)
    log = MetricsLogger(run_dir, t.train_iters, iteration, enabled=rank0,
                        progress_bar=cfg.logging.progress_bar, tensorboard=cfg.logging.tensorboard)
    if rank0:
        log.print(f"[megatron-s2] {cfg.name}: {n_params / 1e6:.2f}M parameters on this rank, "
                  f"world {world} (TP {cfg.parallel.tensor_model_parallel_size}, PP "
                  f"{cfg.parallel.pipeline_model_parallel_size}, CP {cfg.parallel.context_parallel_size}, "
                  f"DP {dp_size}), {num_mb} micro-batches of {t.micro_batch_size} x "
                  f"{cfg.model.seq_length} tokens per step\n"
                  + schedule.summary(cfg.model.num_layers, cfg.model.num_attention_heads,
                                     cfg.model.num_query_groups or cfg.model.num_attention_heads,
                                     cfg.model.seq_length))

    fwd_bwd = get_forward_backward_func()
    nan_flag = [False]
    step = partial(_forward_step, device, cfg.parallel.context_parallel_size, nan_flag)
    stop = _StopFlag()
    stop.install()

    def save(it: int) -> str:
        path = checkpointing.save_checkpoint(
            ckpt_dir, it, model, optimizer, scheduler, consumed_samples=consumed,
            config=cfg.to_dict(), keep_last=cfg.checkpoint.keep_last)
        log.print(f"[megatron-s2] saved checkpoint {path}")
        return path

    def evaluate(it: int) -> float:
        for m in model:
            m.eval()
        iters = [micro_batches(datasets.valid, 0, t.micro_batch_size, dp_rank, dp_size, cycle=True)
                 for _ in range(vpp or 1)]
        total = tokens = 0.0
        with torch.no_grad():
            for _ in range(t.eval_iters):
                losses = fwd_bwd(forward_step_func=step, data_iterator=iters[0] if vpp is None else iters,
                                 model=model, num_microbatches=num_mb, seq_length=cfg.model.seq_length,
                                 micro_batch_size=t.micro_batch_size, forward_only=True)
                loss, ntok = _reduce_loss(losses, device)
                total += loss * ntok
                tokens += ntok
        for m in model:
            m.train()
        val = total / tokens
        log.log({"iteration": it, "loss": val, "ppl": math.exp(min(val, 50.0))}, prefix="valid")
        log.print(f"[megatron-s2] validation at iteration {it}: loss {val:.4f}")
        return val

    losses_by_iter, valid_by_iter = {}, {}
    stopped_by = "done"
    timer = StepTimer()
    window_iters, window_time = 0, 0.0
    tok_s = tflops = 0.0
    windows = []  # (iterations, seconds) per log interval, for the run's mean throughput
    try:
        for m in model:
            m.train()
        while iteration < t.train_iters:
            nan_flag[0] = cfg.debug.nan_at_iter == iteration + 1
            for m in model:
                m.zero_grad_buffer()
            optimizer.zero_grad()
            losses = fwd_bwd(forward_step_func=step, data_iterator=train_iter, model=model,
                             num_microbatches=num_mb, seq_length=cfg.model.seq_length,
                             micro_batch_size=t.micro_batch_size, forward_only=False)
            loss, _ = _reduce_loss(losses, device)
            if not math.isfinite(loss):
                raise NonFiniteLossError(
                    f"loss is {loss} at iteration {iteration + 1}: stopping before the optimizer step "
                    f"(weights untouched). Last good checkpoint: "
                    f"{last_ckpt or 'none (no checkpoint was saved yet)'}. Try a lower optimizer.lr, "
                    f"a longer optimizer.lr_warmup_iters or a smaller optimizer.clip_grad.")
            _, grad_norm, _ = optimizer.step()
            if grad_norm is not None and not math.isfinite(grad_norm):
                # The step already used it: stop before a checkpoint can store the damage.
                raise NonFiniteLossError(
                    f"gradient norm is {grad_norm} at iteration {iteration + 1} (loss {loss:.4f}): "
                    f"stopping without saving. Last good checkpoint: "
                    f"{last_ckpt or 'none (no checkpoint was saved yet)'}.")
            scheduler.step(increment=1)
            iteration += 1
            consumed += t.global_batch_size
            losses_by_iter[iteration] = loss
            lr = optimizer.param_groups[0]["lr"]
            window_iters += 1
            log.advance(1, loss=f"{loss:.4f}")

            if iteration % cfg.logging.log_interval == 0 or iteration == t.train_iters:
                window_time += timer.lap()
                per_iter = window_time / window_iters
                tok_s = t.global_batch_size * cfg.model.seq_length / per_iter
                tflops = flops_per_iter / per_iter / world / 1e12
                windows.append((window_iters, window_time))
                mem_key, mem = memory_gib()
                gn = float(grad_norm) if grad_norm is not None else float("nan")
                log.log({"iteration": iteration, "loss": loss, "lr": lr, "grad_norm": gn,
                         "tokens_per_s": tok_s, "tflops_per_gpu": tflops, mem_key: mem,
                         "consumed_samples": consumed, "step_time_s": per_iter})
                log.print(f"iter {iteration:6d}/{t.train_iters} | loss {loss:.4f} | lr {lr:.3e} | "
                          f"grad norm {gn:.3f} | {tok_s:,.0f} tok/s | {tflops:.2f} TFLOP/s/GPU | "
                          f"{mem_key.split('_')[0]} mem {mem:.2f} GiB")
                window_iters, window_time = 0, 0.0

            if t.eval_interval and t.eval_iters and datasets.valid is not None and (
                    iteration % t.eval_interval == 0 or iteration == t.train_iters):
                # Bank the training time so far; evaluation does not count as throughput.
                window_time += timer.lap()
                valid_by_iter[iteration] = evaluate(iteration)
                timer.lap()

            if cfg.debug.sigterm_at_iter == iteration:
                stop.set = True
            if stop.agreed(device):
                window_time += timer.lap()
                stopped_by = "sigterm"
                log.print(f"[megatron-s2] SIGTERM: saving a checkpoint at iteration {iteration} and stopping")
                last_ckpt = save(iteration)
                break
            if cfg.checkpoint.save_interval and iteration % cfg.checkpoint.save_interval == 0:
                window_time += timer.lap()
                last_ckpt = save(iteration)
                timer.lap()
        else:
            if cfg.checkpoint.save_at_end and last_ckpt != checkpointing.checkpoint_path(ckpt_dir, iteration) \
                    and losses_by_iter:
                last_ckpt = save(iteration)
    finally:
        stop.uninstall()
        log.close()
        # Shut data-loader workers down now (they ignore SIGTERM, see megatron_s2.training.data).
        for it in train_iters_:
            it.close()
    if window_iters:  # a run that stopped between log intervals (time up to its last iteration)
        windows.append((window_iters, window_time))

    # The first interval holds warm-up (allocator, first-call overheads): leave it out when
    # there are others.
    steady = windows[1:] or windows
    run_iters, run_time = sum(w[0] for w in steady), sum(w[1] for w in steady)
    mean_tok_s = t.global_batch_size * cfg.model.seq_length * run_iters / run_time if run_time else tok_s
    mean_tflops = flops_per_iter * run_iters / run_time / world / 1e12 if run_time else tflops
    result = RunResult(iteration=iteration, losses=losses_by_iter, valid_losses=valid_by_iter,
                       stopped_by=stopped_by, tokens_per_s=mean_tok_s, tflops_per_gpu=mean_tflops,
                       run_dir=run_dir, last_checkpoint=last_ckpt)
    if rank0:
        _summary(cfg, result, plot_loss_curve)
    return result


def _summary(cfg: RunConfig, r: RunResult, plot_loss_curve) -> None:
    jsonl = os.path.join(r.run_dir, "metrics.jsonl")
    png = None
    if cfg.logging.plot and os.path.exists(jsonl):
        png = plot_loss_curve(jsonl, os.path.join(r.run_dir, "loss.png"), title=cfg.name)
    losses = sorted(r.losses.items())
    summary = {
        "name": cfg.name, "iteration": r.iteration, "stopped_by": r.stopped_by,
        "first_loss": losses[0][1] if losses else None, "final_loss": losses[-1][1] if losses else None,
        "final_valid_loss": r.valid_losses[max(r.valid_losses)] if r.valid_losses else None,
        "tokens_per_s": r.tokens_per_s, "tflops_per_gpu": r.tflops_per_gpu,
        "metrics": jsonl, "loss_curve": png, "last_checkpoint": r.last_checkpoint,
    }
    with open(os.path.join(r.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    lines = [f"[megatron-s2] {cfg.name}: {r.stopped_by} at iteration {r.iteration}"]
    if losses:
        lines.append(f"  train loss      {losses[0][1]:.4f} (iter {losses[0][0]}) -> {losses[-1][1]:.4f} "
                     f"(iter {losses[-1][0]})")
    if r.valid_losses:
        lines.append(f"  valid loss      {summary['final_valid_loss']:.4f}")
    lines.append(f"  throughput      {r.tokens_per_s:,.0f} tokens/s, {r.tflops_per_gpu:.3f} model TFLOP/s per GPU")
    lines.append(f"  metrics         {jsonl} (TensorBoard: {os.path.join(r.run_dir, 'tensorboard')})")
    if png:
        lines.append(f"  loss curve      {png}")
    if r.last_checkpoint:
        lines.append(f"  checkpoint      {r.last_checkpoint}")
    print("\n".join(lines), flush=True)


# ------------------------------------------------------------------------------ entry point

def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-s2-train",
        description="Pretrain an S2 hybrid GPT with Megatron-core. Without --config: the built-in demo.",
        epilog="Overrides: any config key as key.sub=value, e.g. train.train_iters=50 "
               "parallel.tensor_model_parallel_size=2 attention.s2.vert_stride=16")
    p.add_argument("--config", "-c", default=None, help="run config YAML (default: configs/demo.yaml)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    return p


def _quiet_known_warnings() -> None:
    """Hide warnings that every run of the pip wheel prints and that need no action."""
    import warnings

    for msg in (r"Transformer Engine and Apex are not installed", r"Apex is not installed",
                r"full scope is deprecated", r"The \.grad attribute of a Tensor that is not a leaf"):
        warnings.filterwarnings("ignore", message=msg)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")


def main(argv: Optional[list[str]] = None) -> int:
    """Console entry point; returns the process exit code."""
    args = build_arg_parser().parse_args(argv)
    _quiet_known_warnings()
    # Megatron logs every parameter and its whole config at INFO; the trainer prints its own summary.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            import yaml

            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            return EXIT_OK
        train(cfg)
        return EXIT_OK
    except ConfigError as e:
        print(f"megatron-s2-train: config error: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG_ERROR
    except NonFiniteLossError as e:
        print(f"megatron-s2-train: {e}", file=sys.stderr, flush=True)
        return EXIT_NAN
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":  # torch_dist checkpoint saving spawns processes: keep this guard
    sys.exit(main())
