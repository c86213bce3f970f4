"""The building blocks of a Megatron-core run: process groups, the model config, the model
chunks in Megatron DDP, the optimizer and its LR schedule, and the checks of what a machine can
run.

Each block takes the config sections it needs (``ModelConfig``, ``ParallelConfig``,
``OptimizerConfig`` of :mod:`megatron_s2.training.run_config`), not a whole ``RunConfig``.
:mod:`.build` assembles them, in one order, for the trainer, the evaluator and
``tools/gpu_parallel_check.py``:

    init_model_parallel(parallel, seed=seed)
    config = transformer_config(model, parallel, schedule, bf16=bf16)
    model_chunks = wrap_model_chunks(build_model_chunks(model, config, vocab_size, gpu=gpu),
                                     config, parallel, bf16=bf16)
    optimizer, scheduler = build_optimizer(opt, parallel, model_chunks, bf16=bf16,
                                           train_iters=train_iters)
    connect_schedule_hooks(config, model_chunks, optimizer, parallel)

``transformer_config`` is the one place where the Megatron model config is made (its class,
GPT or hybrid, by ``model.model_class``: :func:`megatron_s2.model.model_config`), and
``build_model_chunks`` the one place where :func:`megatron_s2.model.build_model` is called.
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass

import numpy as np
import torch

from ..flash_attention4 import check_dense_backend
from .run_config import ConfigError, ModelConfig, OptimizerConfig, ParallelConfig

__all__ = [
    "DistributedEnv",
    "init_process_group",
    "init_model_parallel",
    "use_bf16",
    "transformer_config",
    "rope_scaling_kwargs",
    "fp8_kwargs",
    "check_transformer_impl",
    "check_dense_attention",
    "check_fp8",
    "build_model_chunks",
    "wrap_model_chunks",
    "build_optimizer",
    "connect_schedule_hooks",
]

# NCCL/gloo collectives wait this long before failing: long enough for a large checkpoint save
# or the first Triton compilation on a slow rank.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=30)
# Pipeline stages get different seeds (Megatron-LM's convention); data-parallel replicas the same.
PIPELINE_SEED_STRIDE = 100


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits in the launch: torchrun's variables, or a world of one."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launched: bool = False  # started by torchrun/srun (RANK is set)

    @classmethod
    def from_environment(cls) -> DistributedEnv:
        """Read ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``; a plain ``python -m`` is a world of one."""
        if "RANK" not in os.environ:
            return cls()
        return cls(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            launched=True,
        )


def init_process_group(env: DistributedEnv, *, gpu: bool) -> None:
    """Start torch.distributed (NCCL on GPU, gloo on CPU) unless it already runs."""
    if gpu:
        torch.cuda.set_device(env.local_rank)
    if torch.distributed.is_initialized():
        return
    # A world of one needs no rendezvous: an in-process store avoids picking a free port (racy
    # when several runs start at once).
    store = None if env.launched else torch.distributed.HashStore()
    torch.distributed.init_process_group(
        backend="nccl" if gpu else "gloo",
        rank=env.rank,
        world_size=env.world_size,
        store=store,
        timeout=PROCESS_GROUP_TIMEOUT,
    )


def init_model_parallel(parallel: ParallelConfig, *, seed: int) -> None:
    """Megatron's TP/PP/CP/DP groups for ``parallel`` (DP = the rest of the world) and the seeds
    of every RNG, Megatron's tensor-parallel tracker included."""
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
    )
    seed = seed + PIPELINE_SEED_STRIDE * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def use_bf16(precision: str, *, gpu: bool) -> bool:
    """Whether a run of ``train.precision`` trains in bf16 ("auto": on GPU only)."""
    if precision == "bf16" and not gpu:
        raise ConfigError("train.precision=bf16 needs a GPU; CPU mode trains in fp32")
    return gpu and precision in ("auto", "bf16")


def use_deterministic_algorithms() -> None:
    """Ask every library this process uses for its deterministic algorithms, before any GPU
    work (``train.deterministic``): PyTorch's strict mode (an operation without a deterministic
    implementation raises, naming itself; SDPA's flash backward takes its deterministic path),
    cuBLAS's fixed workspace that mode needs, cuDNN's deterministic choice and Transformer
    Engine's (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``, which Megatron's ``deterministic_mode``
    requires of TE attention). Megatron's ``deterministic_mode`` itself (FA4's deterministic
    backward, the embedding's) goes into the model config: :func:`transformer_config`."""
    import os

    # The workspace must be fixed before the first cuBLAS handle exists; an explicit choice of
    # the user's (":16:8" is the other allowed one) stays.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig,
    schedule,
    *,
    bf16: bool,
    backend: str = "auto",
    deterministic: bool = False,
):
    """The run's model config: an :class:`megatron_s2.config.S2TransformerConfig`, or its
    ``HybridModel`` twin's :class:`megatron_s2.hybrid.S2HybridTransformerConfig`
    (``model.model_class``).

    Args:
        model, parallel: the run config's sections.
        schedule: the attention schedule (``AttentionSchedule``, its mapping or a YAML path).
        bf16: bf16 parameters and pipeline communication (else fp32).
        backend: ``s2attn.s2_attention`` backend of the S2 layers.
        deterministic: Megatron's ``deterministic_mode`` (``train.deterministic``; with
            :func:`use_deterministic_algorithms` for the rest of the process).
    """
    import torch.nn.functional as F

    from ..model import model_config

    dtype = torch.bfloat16 if bf16 else torch.float32
    recompute = {}
    if model.recompute == "selective":
        recompute = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif model.recompute == "full":
        recompute = dict(
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=model.recompute_num_layers,
        )
    vpp = parallel.virtual_pipeline_model_parallel_size
    return model_config(
        model.model_class,
        gpt_only="model.rope_scaling=llama3" if model.rope_scaling == "llama3" else None,
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        ffn_hidden_size=model.ffn_size,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        add_bias_linear=False,
        add_qkv_bias=model.add_qkv_bias,
        init_method_std=model.init_method_std,
        hidden_dropout=model.hidden_dropout,
        # The S2 kernels have no attention dropout (Megatron's default is 0.1).
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=parallel.context_parallel_size,
        # "auto" leaves it to each layer (None: Megatron's TE attention takes its own default).
        cp_comm_type=None if parallel.cp_comm_type == "auto" else parallel.cp_comm_type,
        sequence_parallel=parallel.sequence_parallel,
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
        s2_schedule=schedule,
        s2_seq_length=model.seq_length,
        s2_backend=backend,
        dense_backend=model.dense_attention,
        deterministic_mode=deterministic,
        **recompute,
        **fp8_kwargs(model),
    )


def fp8_kwargs(model: ModelConfig) -> dict:
    """``TransformerConfig`` fields of ``model.fp8`` / ``model.fp8_recipe`` (Megatron-LM's
    ``--fp8-format`` / ``--fp8-recipe``); empty without FP8, so the config keeps Megatron's
    defaults.

    Megatron wraps each transformer layer's forward in TE's ``fp8_autocast``, which reaches only
    Transformer Engine modules: the TE linears run FP8 GEMMs, our S2 core attention (plain
    PyTorch/Triton) never sees FP8, and ``fp8_dot_product_attention=False`` keeps TE's dense
    attention in bf16 (S2 layers refuse it anyway). Embedding and output layer stay bf16.
    """
    if model.fp8 is None:
        return {}
    return dict(
        fp8=model.fp8,
        fp8_recipe=model.fp8_recipe,
        fp8_dot_product_attention=False,
        fp8_multi_head_attention=False,
    )


def rope_scaling_kwargs(model: ModelConfig) -> dict:
    """``GPTModel`` arguments of ``model.rope_scaling`` (Megatron-core's own RoPE scaling)."""
    if model.rope_scaling == "position_interpolation":
        # Positions are divided by the factor: a model trained at L reads L * factor tokens at
        # the position range it knows.
        return {"seq_len_interpolation_factor": model.rope_scaling_factor}
    if model.rope_scaling == "llama3":
        return {"rope_scaling": True, "rope_scaling_factor": model.rope_scaling_factor}
    return {}


def check_transformer_impl(impl: str, *, gpu: bool) -> None:
    """Refuse ``model.transformer_impl=transformer_engine`` where it cannot run (no CUDA, or
    Transformer Engine not importable), before any process group or GPU work."""
    if impl != "transformer_engine":
        return
    if not gpu:
        raise ConfigError(
            "model.transformer_impl=transformer_engine needs a CUDA GPU (Transformer Engine has "
            "no CPU kernels); CPU mode runs model.transformer_impl=local"
        )
    from ..specs import HAVE_TE

    if not HAVE_TE:
        raise ConfigError(
            "model.transformer_impl=transformer_engine: Transformer Engine is not installed here "
            "(or failed to import with this torch); install it (tools/stage_transformer_engine.sh "
            "on the lent GPU machines, docs/megatron.md) or use model.transformer_impl=local"
        )


def check_dense_attention(model: ModelConfig, *, gpu: bool) -> None:
    """Refuse ``model.dense_attention=fa4`` where FlashAttention-4 cannot run (CPU mode, or the
    package does not import), before any process group or GPU work."""
    if model.dense_attention != "fa4":
        return
    if not gpu:
        raise ConfigError(
            "model.dense_attention=fa4 needs a CUDA GPU (FlashAttention-4 has no CPU kernels); "
            "CPU mode runs model.dense_attention=auto"
        )
    try:  # the package's import check, the one S2TransformerConfig runs later
        check_dense_backend("model.dense_attention", model.dense_attention)
    except ValueError as e:
        raise ConfigError(str(e)) from None


# model.fp8_recipe -> the Transformer Engine function that says whether this GPU and TE build can
# run it: transformer_engine.pytorch.is_<name>_available in TE >= 2.8, else
# transformer_engine.pytorch.fp8.check_<name>_support.
_FP8_SUPPORT_CHECKS = {
    "delayed": "fp8",
    "tensorwise": "fp8",
    "blockwise": "fp8_block_scaling",
    "mxfp8": "mxfp8",
}


def _te_fp8_support(name: str):
    """``(available, reason)`` from Transformer Engine for ``name`` (a value of
    ``_FP8_SUPPORT_CHECKS``), or None when this TE version has neither check."""
    import transformer_engine.pytorch as te

    check = getattr(te, f"is_{name}_available", None)
    if check is not None:
        return check(return_reason=True)
    try:
        from transformer_engine.pytorch import fp8 as te_fp8
    except ImportError:
        return None
    check = getattr(te_fp8, f"check_{name}_support", None)
    return check() if check is not None else None


def check_fp8(model: ModelConfig, *, gpu: bool, bf16: bool) -> None:
    """Refuse ``model.fp8`` where it cannot run, before any process group or GPU work: no GPU
    (CPU mode), not bf16, no Transformer Engine, or a GPU/TE build without the recipe.

    The hardware-free checks (format, ``model.transformer_impl``, GEMM shapes) are in
    ``RunConfig.validate``; this adds what depends on the machine."""
    if model.fp8 is None:
        return
    what = f"model.fp8={model.fp8} (model.fp8_recipe={model.fp8_recipe})"
    if not gpu:
        raise ConfigError(
            f"{what} needs a CUDA GPU with Transformer Engine; CPU mode trains in fp32 with "
            f"model.transformer_impl=local: set model.fp8=null"
        )
    if not bf16:
        raise ConfigError(f"{what} needs bf16 training; set train.precision=bf16 (or auto)")
    check_transformer_impl(model.transformer_impl, gpu=gpu)
    support = _te_fp8_support(_FP8_SUPPORT_CHECKS[model.fp8_recipe])
    if support is not None and not support[0]:
        raise ConfigError(
            f"{what}: Transformer Engine cannot run this recipe on this GPU "
            f"({torch.cuda.get_device_name()}): {support[1]}. FP8 needs compute capability "
            f">= 8.9 (Ada, Hopper); mxfp8 needs Blackwell. Choose another model.fp8_recipe "
            f"(allowed: delayed, tensorwise, blockwise, mxfp8) or set model.fp8=null"
        )


def build_model_chunks(model: ModelConfig, config, vocab_size: int, *, gpu: bool) -> list:
    """This rank's model chunks (``GPTModel`` or ``HybridModel``, as ``config``'s class), one
    per virtual pipeline stage, unwrapped (fp32 or bf16 as ``config.params_dtype``), on the GPU
    when ``gpu``.

    ``config`` is the :func:`transformer_config` of the run; ``vocab_size`` the padded one.
    """
    from megatron.core import parallel_state, tensor_parallel

    from ..model import build_model

    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunk = build_model(
            config,
            vocab_size,
            model.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(
                ignore_virtual=False, vp_stage=stage
            ),
            post_process=parallel_state.is_pipeline_last_stage(
                ignore_virtual=False, vp_stage=stage
            ),
            use_te=model.transformer_impl == "transformer_engine",
            vp_stage=stage,
            position_embedding_type="rope",
            rotary_base=model.rotary_base,
            share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
            **rope_scaling_kwargs(model),
        )
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if gpu:
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    return chunks


def wrap_model_chunks(
    chunks: list, config, parallel: ParallelConfig, *, bf16: bool, ddp: bool = True
) -> list:
    """Wrap model chunks in ``Float16Module`` (bf16) and, unless ``ddp`` is False (a model that
    is not trained), in Megatron ``DistributedDataParallel``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    if bf16:
        chunks = [Float16Module(config, c) for c in chunks]
    if not ddp:
        return chunks
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=parallel.overlap_grad_reduce,
        overlap_param_gather=parallel.overlap_param_gather,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
        average_in_collective=False,
    )
    # Only the first chunk's buckets overlap with the backward (Megatron-LM does the same).
    return [
        DistributedDataParallel(config, ddp_config, c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]


def build_optimizer(
    optimizer: OptimizerConfig,
    parallel: ParallelConfig,
    model: list,
    *,
    bf16: bool,
    train_iters: int,
):
    """Megatron's Adam(W) (distributed when ``parallel`` says so, gradient clipping inside) and
    its ``OptimizerParamScheduler``; the LR decays over ``optimizer.lr_decay_iters``, else over
    ``train_iters``. Returns ``(optimizer, scheduler)``."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o = optimizer
    opt = get_megatron_optimizer(
        MegatronOptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=parallel.use_distributed_optimizer,
            overlap_param_gather=parallel.overlap_param_gather,
        ),
        model,
    )
    decay = o.lr_decay_iters or train_iters
    scheduler = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps(decay),
        lr_decay_steps=decay,
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
    )
    return opt, scheduler


def connect_schedule_hooks(config, model: list, optimizer, parallel: ParallelConfig) -> None:
    """Hand Megatron's pipeline schedules the DDP and optimizer hooks, as Megatron-LM's training
    loop does: gradient finalisation, no-sync for gradient accumulation, loss scaling and the
    overlapped grad-reduce / param-gather starts."""
    from megatron.core.distributed import finalize_model_grads

    def per_chunk(hooks: list):
        # The schedules take one callable without VPP and a list with it.
        return hooks[0] if len(hooks) == 1 else hooks

    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = per_chunk([m.no_sync for m in model])
    if parallel.overlap_grad_reduce:
        config.grad_sync_func = per_chunk([m.start_grad_sync for m in model])
    if parallel.overlap_param_gather:
        config.param_sync_func = per_chunk([m.start_param_sync for m in model])
