#!/usr/bin/env python
"""Parallel-equivalence check: a small hybrid S2 GPT trained a few steps under several
TP/PP/SP/CP layouts must match the single-device run (same seed, same initial weights, same data).

    # GPU host (NCCL): every layout its GPUs hold (CP2+TP2 needs 4)
    python tools/gpu_parallel_check.py                      # seq 8192, bf16, 4 steps
    python tools/gpu_parallel_check.py --layouts cp2 --seq-length 32768
    # CPU (gloo, megatron_s2 CPU mode), tiny model:
    python tools/gpu_parallel_check.py --cpu
    # The Transformer Engine spec (one GPU, then each layout) against the local spec's run:
    python tools/gpu_parallel_check.py --transformer-impl transformer_engine

The script launches each layout itself (torch.multiprocessing, one process per device):
the TP=1/PP=1 reference on one device first, then the parallel layouts (2 or 4 devices). Each run
assembles its process group, model, DDP and optimizer as the trainer does
(megatron_s2.training.build), starts from the reference's initial weights (loaded through
megatron_s2.unsharded's TP/PP-agnostic loader), trains with the trainer's step
(megatron_s2.training.step, Megatron-core's pipeline schedules), and records per-step loss and
grad norm plus the first step's gradients. A table with PASS/FAIL per layout is printed and
written as JSON to --out; exit status 1 on any FAIL.

``--transformer-impl transformer_engine`` builds the checked layouts with the TE spec (TE linears
with fused norms, TEDotProductAttention on dense layers, our S2 core attention) and compares them
with the reference built with ``--reference-impl`` (default: the local spec), adding the layout
``single`` (the TE spec on one device) so that a spec difference and a parallel one are told
apart. The weights travel in the local spec's names: TE's fused norms are renamed with the
local spec's own checkpoint key map (``input_layernorm.weight`` <->
``self_attention.linear_qkv.layer_norm_weight``). Without Transformer Engine, or with --cpu, the
TE mode is refused (exit status 2).

The functions are importable (the CPU tests in tests/plugin/test_megatron_parallel.py use them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ensure_importable() -> None:
    """Run from a checkout without `pip install -e .`: megatron_s2 from the repo root, s2attn
    from kernels/ (the package's import name differs from its folder)."""
    try:
        import s2attn  # noqa: F401
    except ImportError:
        import importlib.util

        init = os.path.join(REPO, "kernels", "__init__.py")
        spec = importlib.util.spec_from_file_location(
            "s2attn", init, submodule_search_locations=[os.path.dirname(init)]
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["s2attn"] = mod
        spec.loader.exec_module(mod)
    try:
        import megatron_s2  # noqa: F401
    except ImportError:
        sys.path.insert(0, REPO)


_ensure_importable()  # also runs in the spawned ranks, which re-import this module

DEFAULT_SCHEDULE = {
    # Strides >= the head count give every head its own phase, so a TP rank that used local
    # instead of global head indices would attend different blocks and fail the check.
    "s2": {"block_size": 64, "local_blocks": 4, "vert_stride": 8, "head_offset": 1},
    "dense_layers": {"pattern": "SD"},
    "overrides": {2: {"vert_stride": 16, "num_dense_heads": 2}},
}


@dataclass
class CheckConfig:
    """One model + data + training setup shared by all layouts of a check."""

    num_layers: int = 4
    hidden_size: int = 512
    num_attention_heads: int = 8
    num_query_groups: int = 4
    ffn_hidden_size: int = 1024
    vocab_size: int = 1024
    seq_length: int = 8192
    micro_batch_size: int = 1
    num_microbatches: int = 4
    steps: int = 4
    lr: float = 1e-3
    dtype: str = "bf16"  # bf16 | fp32
    seed: int = 1234
    schedule: dict = field(default_factory=lambda: json.loads(json.dumps(DEFAULT_SCHEDULE)))
    cpu: bool = False
    backend: str = "auto"  # s2_attention backend; the CPU check uses the PyTorch reference
    # model.transformer_impl of the checked layouts and of the reference (the TP=1/PP=1 run).
    transformer_impl: str = "local"
    reference_impl: str = "local"
    # Relative tolerances (fp32 CPU runs are exact to ~1e-5; bf16 GPU runs reduce differently).
    loss_rtol: float = 2e-2
    gnorm_rtol: float = 5e-2
    grad_rtol: float = 1e-1

    def model_config(self, transformer_impl: Optional[str] = None):
        """The model as the trainer's ``model`` section: RMSNorm, SwiGLU, RoPE, untied output;
        ``transformer_impl`` None = the checked layouts' (``self.transformer_impl``)."""
        from megatron_s2.training.run_config import ModelConfig

        return ModelConfig(
            transformer_impl=transformer_impl or self.transformer_impl,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            ffn_hidden_size=self.ffn_hidden_size,
            seq_length=self.seq_length,
            vocab_size=self.vocab_size,
        )

    def optimizer_config(self):
        """Adam at a constant ``lr`` (no warm-up, no weight decay, Megatron's default betas):
        the layouts are compared step by step, not trained."""
        from megatron_s2.training.run_config import OptimizerConfig

        return OptimizerConfig(
            lr=self.lr,
            min_lr=self.lr,
            weight_decay=0.0,
            adam_beta2=0.999,
            clip_grad=1.0,
            lr_warmup_iters=0,
            lr_decay_style="constant",
        )

    @classmethod
    def tiny_cpu(cls, **kw) -> CheckConfig:
        base = dict(
            num_layers=4,
            hidden_size=64,
            num_attention_heads=8,
            num_query_groups=4,
            ffn_hidden_size=128,
            vocab_size=128,
            seq_length=128,
            num_microbatches=4,
            steps=2,
            dtype="fp32",
            cpu=True,
            backend="reference",
            loss_rtol=1e-4,
            gnorm_rtol=1e-3,
            grad_rtol=1e-3,
            schedule={
                "s2": {"block_size": 16, "local_blocks": 2, "vert_stride": 8, "head_offset": 1},
                "dense_layers": {"pattern": "SD"},
                "overrides": {2: {"vert_stride": 2, "num_dense_heads": 2}},
            },
        )
        base.update(kw)
        return cls(**base)


@dataclass
class Layout:
    name: str
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    sp: bool = False
    cp: int = 1
    cp_comm: str = "auto"  # parallel.cp_comm_type

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp

    def parallel_config(self):
        """The layout as the trainer's ``parallel`` section (plain DDP: DP is 1 here)."""
        from megatron_s2.training.run_config import ParallelConfig

        return ParallelConfig(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp,
            sequence_parallel=self.sp,
            context_parallel_size=self.cp,
            cp_comm_type=self.cp_comm,
            use_distributed_optimizer=False,
        )


REFERENCE = Layout("tp1_pp1")
# The checked implementation on one device: against a reference of another implementation it
# shows the spec difference alone.
SINGLE = Layout("single")
GPU_LAYOUTS = [
    Layout("tp2_sp", tp=2, sp=True),
    Layout("pp2", pp=2),
    Layout("tp2", tp=2),
    Layout("pp2_vpp2", pp=2, vpp=2),
    Layout("cp2", cp=2),
    # Every layer on one CP communication: the default above mixes them (S2 all-gather, GQA
    # dense layers all-to-all).
    Layout("cp2_all_gather", cp=2, cp_comm="all_gather"),
    Layout("cp2_a2a", cp=2, cp_comm="a2a"),
    Layout("cp2_tp2_sp", cp=2, tp=2, sp=True),
    Layout("cp2_tp2_a2a", cp=2, tp=2, cp_comm="a2a"),
    Layout("cp2_pp2", cp=2, pp=2),
]


# ----------------------------------------------------------------- local <-> TE parameter names
_LAYER_PREFIX_RE = re.compile(r"^(decoder\.layers\.\d+\.)(.*)$")


def te_key_map() -> dict[str, str]:
    """Local-spec name prefix -> TE-spec name prefix inside a transformer layer: the local spec's
    ``sharded_state_dict_keys_map`` (the map that keeps its checkpoints loadable into the TE
    spec), e.g. ``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``."""
    from megatron_s2.specs import s2_layer_spec

    return dict(s2_layer_spec.submodules.sharded_state_dict_keys_map)


def _rename(state: dict, pairs: list[tuple[str, str]]) -> dict:
    out = {}
    for name, value in state.items():
        m = _LAYER_PREFIX_RE.match(name)
        if m:
            layer, rest = m.groups()
            for old, new in pairs:
                if rest.startswith(old):
                    name = layer + new + rest[len(old) :]
                    break
        if name in out:
            raise KeyError(f"two parameters map to {name!r}")
        out[name] = value
    return out


def local_to_te_names(state: dict) -> dict:
    """``state`` (unsharded names of the local spec) with the TE spec's names: each layer's
    norm weights (and biases) become the fused ``layer_norm_*`` of the following linear."""
    return _rename(state, list(te_key_map().items()))


def te_to_local_names(state: dict) -> dict:
    """The inverse of :func:`local_to_te_names`."""
    return _rename(state, [(new, old) for old, new in te_key_map().items()])


def to_local_names(state: dict, transformer_impl: str) -> dict:
    """``state`` of a model built with ``transformer_impl``, in the local spec's names."""
    return te_to_local_names(state) if transformer_impl == "transformer_engine" else dict(state)


def from_local_names(state: dict, transformer_impl: str) -> dict:
    """``state`` in the local spec's names, renamed for a model built with ``transformer_impl``."""
    return local_to_te_names(state) if transformer_impl == "transformer_engine" else dict(state)


# ---------------------------------------------------------------------------- one rank's run
def _runtime(rank: int, world: int, cc: CheckConfig):
    """Where rank ``rank`` of a ``world``-process check runs: the trainer's runtime with the
    check's own choice of device (``--cpu`` runs the CPU mode also where CUDA is present) and
    dtype."""
    from megatron_s2.training.build import Runtime
    from megatron_s2.training.parallel import DistributedEnv

    env = DistributedEnv(rank=rank, world_size=world, local_rank=rank, launched=True)
    return Runtime(env=env, gpu=not cc.cpu, bf16=cc.dtype == "bf16")


def _init_process(rank: int, world: int, port: int, cc: CheckConfig):
    """Start this spawned rank's process group (and CPU mode) as the trainer does; the model
    parallel groups are built per layout."""
    runtime = _runtime(rank, world, cc)
    if cc.cpu:
        # The ranks share the host's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    runtime.start_process()
    return runtime


def _setup_layout(cc: CheckConfig, layout: Layout):
    from megatron_s2.training.parallel import init_model_parallel

    init_model_parallel(layout.parallel_config(), seed=cc.seed)


def _batches(cc: CheckConfig, step: int) -> list[dict[str, torch.Tensor]]:
    """Deterministic micro batches (identical in every layout): noisy repeated motifs so the
    loss actually moves in a few steps."""
    g = torch.Generator().manual_seed(cc.seed * 1000 + step)
    positions = torch.arange(cc.seq_length).expand(cc.micro_batch_size, -1)
    out = []
    for _ in range(cc.num_microbatches):
        motif = torch.randint(0, cc.vocab_size, (cc.micro_batch_size, 97), generator=g)
        reps = (cc.seq_length + 1 + 96) // 97
        seq = motif.repeat(1, reps)[:, : cc.seq_length + 1]
        noise = torch.rand(seq.shape, generator=g) < 0.1
        seq = torch.where(noise, torch.randint(0, cc.vocab_size, seq.shape, generator=g), seq)
        out.append(
            {
                "tokens": seq[:, :-1].contiguous(),
                "labels": seq[:, 1:].contiguous(),
                "loss_mask": torch.ones(cc.micro_batch_size, cc.seq_length),
                "position_ids": positions,
            }
        )
    return out


def _run_rank(
    rank: int, world: int, port: int, cc: CheckConfig, layouts: list[Layout], workdir: str
):
    """Run ``layouts`` (all of ``world`` ranks) one after the other in this process."""
    layout = None
    try:
        runtime = _init_process(rank, world, port, cc)
        from megatron.core import parallel_state

        for layout in layouts:
            _setup_layout(cc, layout)
            try:
                _run_rank_inner(rank, cc, layout, workdir, runtime)
            finally:
                parallel_state.destroy_model_parallel()
    except Exception:
        name = layout.name if layout is not None else "init"
        with open(os.path.join(workdir, f"{name}.error.{rank}"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _run_rank_inner(rank, cc: CheckConfig, layout: Layout, workdir: str, runtime):
    """Train ``cc.steps`` steps of ``layout``, assembled as the trainer assembles its run
    (:func:`megatron_s2.training.build.build_run`) from the reference's initial weights; save
    this rank's losses, grad norms and first-step gradients."""
    from megatron_s2.training.build import build_run
    from megatron_s2.training.step import ForwardBackward, zero_grad
    from megatron_s2.unsharded import (
        load_unsharded_parameters,
        named_parameters_unsharded,
        unsharded_parameters,
    )

    reference = layout.name == REFERENCE.name
    impl = cc.reference_impl if reference else cc.transformer_impl
    # Files hold the local spec's parameter names, whichever spec wrote them.
    init_path = os.path.join(workdir, "init.pt")

    def init_weights(chunks: list) -> None:
        if reference:  # its initial weights are every layout's
            torch.save(to_local_names(unsharded_parameters(chunks[0]), impl), init_path)
            return
        init = from_local_names(torch.load(init_path), impl)
        if layout.world == 1:
            # One device holds every parameter: a key the renaming missed shows here, where a
            # sharded layout would just not ask for it.
            have = {name for name, _, _ in named_parameters_unsharded(chunks)}
            if have != set(init):
                raise KeyError(
                    f"{impl} model vs reference weights: missing {sorted(have - set(init))}, "
                    f"unused {sorted(set(init) - have)}"
                )
        load_unsharded_parameters(chunks, init)

    parts = build_run(
        cc.model_config(impl),
        layout.parallel_config(),
        cc.schedule,
        cc.vocab_size,
        runtime,
        optimizer=cc.optimizer_config(),
        train_iters=cc.steps,
        backend=cc.backend,
        init_weights=init_weights,
    )
    model, optimizer, scheduler = parts.model, parts.optimizer, parts.scheduler
    forward_backward = ForwardBackward(
        model,
        num_microbatches=cc.num_microbatches,
        seq_length=cc.seq_length,
        micro_batch_size=cc.micro_batch_size,
        device=runtime.device,
        context_parallel_size=layout.cp,
    )
    losses, gnorms = [], []
    grad_report = None
    for chunk in model:
        chunk.train()
    for step in range(cc.steps):
        zero_grad(model, optimizer)
        batches = _batches(cc, step)
        # Every rank gets the batch's loss (reduced on the last pipeline stage).
        loss = forward_backward([iter(batches) for _ in model]).loss
        if step == 0:
            grads = {}
            for name, p, _ in named_parameters_unsharded(model):
                g = getattr(p, "main_grad", None)
                grads[name] = (g if g is not None else p.grad).detach().float().cpu().clone()
            grad_report = to_local_names(grads, impl)
        _, gnorm, _ = optimizer.step()
        scheduler.step(increment=1)
        losses.append(loss)
        gnorms.append(float(gnorm))
    # What each core-attention class communicates by under CP (the setting's way through
    # Megatron's layers, seen at its end).
    cp_comm = {
        type(m).__name__: m.cp_comm
        for chunk in model
        for m in chunk.modules()
        if getattr(m, "cp_comm", None) is not None
    }
    torch.save(
        {
            "rank": rank,
            "losses": losses,
            "grad_norms": gnorms,
            "grads": grad_report,
            "cp_comm": cp_comm,
        },
        os.path.join(workdir, f"{layout.name}.rank{rank}.pt"),
    )


# ---------------------------------------------------------------------------- orchestration
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How a rank's start-up failure reads when the port was taken (torch's store: "EADDRINUSE";
# Python's socket: "[Errno 98] Address already in use"); compared case-insensitively.
_PORT_TAKEN = ("eaddrinuse", "address already in use")
_PORT_TRIES = 3


def _error_files(workdir: str, layouts: list[Layout]) -> list[str]:
    """This launch's rank error files: ``init.error.<rank>`` (start-up) and
    ``<layout>.error.<rank>`` for its layouts; other groups' files in ``workdir`` are theirs."""
    names = ("init", *(layout.name for layout in layouts))
    return sorted(
        f for f in os.listdir(workdir) if f.split(".error.")[0] in names and ".error." in f
    )


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def run_layouts(cc: CheckConfig, layouts: list[Layout], workdir: str) -> None:
    """Run layouts of one world size in one set of spawned processes (one per device), one after
    the other; raise with the ranks' tracebacks on failure.

    The port is found free here and bound by rank 0's store only after the ranks start, so
    another process (a parallel test's gloo sockets take ports from the same range) can take it
    in between. A launch whose every failing rank failed at start-up (before any layout ran)
    with the port taken is relaunched on a new port, up to three launches; any other failure is
    raised at once."""
    import torch.multiprocessing as mp

    world = layouts[0].world
    if any(layout.world != world for layout in layouts):
        raise ValueError("run_layouts: all layouts must use the same number of processes")
    for attempt in range(1, _PORT_TRIES + 1):
        for f in _error_files(workdir, layouts):  # an earlier launch's, not this one's
            os.remove(os.path.join(workdir, f))
        try:
            mp.spawn(
                _run_rank, args=(world, _free_port(), cc, layouts, workdir), nprocs=world, join=True
            )
            return
        except Exception as e:
            files = _error_files(workdir, layouts)
            errs = [_read(os.path.join(workdir, f)) for f in files]
            text = "\n".join(errs or [str(e)])
            port_taken = (
                files
                and all(f.startswith("init.error.") for f in files)
                and all(any(m in err.lower() for m in _PORT_TAKEN) for err in errs)
            )
            if port_taken and attempt < _PORT_TRIES:
                print(
                    f"run_layouts: the port was taken at start-up (launch {attempt} of at most "
                    f"{_PORT_TRIES}); relaunching on a new port",
                    file=sys.stderr,
                )
                continue
            launches = (
                f" (launch {attempt}; the earlier ones' port was taken)" if attempt > 1 else ""
            )
            raise RuntimeError(
                f"layouts {[layout.name for layout in layouts]} failed{launches}:\n" + text
            ) from e


def run_layout(cc: CheckConfig, layout: Layout, workdir: str) -> None:
    run_layouts(cc, [layout], workdir)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare(cc: CheckConfig, layout: Layout, workdir: str) -> dict:
    """Compare a finished layout with the reference; returns a row with ``passed``."""
    ref = torch.load(os.path.join(workdir, f"{REFERENCE.name}.rank0.pt"))
    full_ref_grads = ref["grads"]
    loss_err = gnorm_err = grad_err = 0.0
    losses = gnorms = None
    cp_comm = {}
    for rank in range(layout.world):
        r = torch.load(os.path.join(workdir, f"{layout.name}.rank{rank}.pt"))
        losses, gnorms = r["losses"], r["grad_norms"]
        cp_comm.update(r.get("cp_comm", {}))
        loss_err = max([loss_err] + [_rel(a, b) for a, b in zip(r["losses"], ref["losses"])])
        gnorm_err = max(
            [gnorm_err] + [_rel(a, b) for a, b in zip(r["grad_norms"], ref["grad_norms"])]
        )
        for name, g in r["grads"].items():
            expect = _slice_like(full_ref_grads[name], g, name, layout, rank, cc)
            denom = expect.abs().max().clamp_min(1e-8)
            grad_err = max(grad_err, float((g - expect).abs().max() / denom))
    passed = loss_err <= cc.loss_rtol and gnorm_err <= cc.gnorm_rtol and grad_err <= cc.grad_rtol
    return {
        "layout": layout.name,
        "tp": layout.tp,
        "pp": layout.pp,
        "vpp": layout.vpp,
        "sp": layout.sp,
        "cp": layout.cp,
        "cp_comm": cp_comm,
        "impl": cc.transformer_impl,
        "ref_impl": cc.reference_impl,
        "losses": losses,
        "ref_losses": ref["losses"],
        "grad_norms": gnorms,
        "ref_grad_norms": ref["grad_norms"],
        "max_rel_loss_diff": loss_err,
        "max_rel_gnorm_diff": gnorm_err,
        "max_rel_grad_diff_step0": grad_err,
        "passed": passed,
    }


def _slice_like(
    full: torch.Tensor, local: torch.Tensor, name: str, layout: Layout, rank: int, cc: CheckConfig
) -> torch.Tensor:
    """The part of a reference (unsharded) tensor that ``rank`` holds, found by shape: TP-split
    tensors are split along the one dimension whose size differs (gated fc1: per half)."""
    if full.shape == local.shape:
        return full
    tp_rank = rank % layout.tp  # Megatron's default order puts TP innermost
    dims = [d for d in range(full.dim()) if full.shape[d] != local.shape[d]]
    if len(dims) != 1:
        raise ValueError(
            f"{name}: cannot match reference {tuple(full.shape)} to {tuple(local.shape)}"
        )
    d = dims[0]
    if "linear_fc1." in name and d == 0:
        return torch.cat([h.chunk(layout.tp, 0)[tp_rank] for h in full.chunk(2, 0)], 0)
    return full.chunk(layout.tp, d)[tp_rank]


def run_check(cc: CheckConfig, layouts: list[Layout], workdir: Optional[str] = None) -> list[dict]:
    """Reference + layouts; returns one comparison row per layout. Layouts of the same world
    size share one launch (Megatron's parallel state is rebuilt between them)."""
    workdir = workdir or tempfile.mkdtemp(prefix="s2_parallel_check_")
    os.makedirs(workdir, exist_ok=True)
    run_layout(cc, REFERENCE, workdir)
    rows = {}
    for world in sorted({layout.world for layout in layouts}):
        group = [layout for layout in layouts if layout.world == world]
        t0 = time.time()
        error = None
        try:
            run_layouts(cc, group, workdir)
        except Exception as e:  # keep going: report every layout that finished
            error = str(e)
        for layout in group:
            try:
                row = compare(cc, layout, workdir)
            except Exception as e:
                row = {"layout": layout.name, "passed": False, "error": error or str(e)}
            row["seconds"] = round((time.time() - t0) / len(group), 1)
            rows[layout.name] = row
    return [rows[layout.name] for layout in layouts]


def format_table(rows: list[dict]) -> str:
    lines = [
        f"{'layout':<10} {'result':<6} {'max rel loss':>12} {'max rel gnorm':>13} "
        f"{'max rel grad@0':>14} {'seconds':>8}"
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['layout']:<10} {'FAIL':<6} error: {r['error'].splitlines()[-1][:80]}")
            continue
        lines.append(
            f"{r['layout']:<10} {'PASS' if r['passed'] else 'FAIL':<6} "
            f"{r['max_rel_loss_diff']:>12.2e} {r['max_rel_gnorm_diff']:>13.2e} "
            f"{r['max_rel_grad_diff_step0']:>14.2e} {r['seconds']:>8}"
        )
    for r in rows:
        if "losses" in r:
            lines.append(
                f"  {r['layout']}: losses {[f'{x:.5f}' for x in r['losses']]} "
                f"(ref {[f'{x:.5f}' for x in r['ref_losses']]})"
            )
    return "\n".join(lines)


def tolerances(dtype: str, cpu: bool):
    """(loss, grad-norm, first-step-gradient) relative tolerances.

    fp32 layouts differ only in reduction order (row-parallel all-reduces, pipeline-split
    backward), ~1e-6; on GPU the kernels may use TF32 dots in both runs alike, so allow 1e-3.
    bf16 rounding of differently-ordered sums moves the loss by ~1e-4..1e-3 and single
    gradient entries by a few percent of the largest one."""
    if dtype == "bf16":
        return 2e-2, 5e-2, 1e-1
    return (1e-4, 1e-3, 1e-3) if cpu else (1e-3, 5e-3, 2e-2)


TRANSFORMER_IMPLS = ("local", "transformer_engine")


def parse_args(argv=None):
    """Parse the command line into ``(args, cc, layouts)``: the check's :class:`CheckConfig`
    (tolerances set for its dtype) and the layouts asked for, before any device is touched.
    ``single`` is added in front when the layouts' spec differs from the reference's and no
    ``--layouts`` are given."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--cpu", action="store_true", help="tiny model on CPU/gloo (megatron_s2 CPU mode)"
    )
    choices = [SINGLE] + GPU_LAYOUTS
    ap.add_argument(
        "--layouts",
        default=None,
        help="comma-separated subset of: " + ",".join(layout.name for layout in choices),
    )
    ap.add_argument("--seq-length", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None)
    ap.add_argument(
        "--backend",
        choices=("auto", "triton", "reference"),
        default=None,
        help="s2_attention backend of the S2 layers",
    )
    ap.add_argument(
        "--transformer-impl",
        choices=TRANSFORMER_IMPLS,
        default="local",
        help="layer spec of the checked layouts (the trainer's model.transformer_impl)",
    )
    ap.add_argument(
        "--reference-impl",
        choices=TRANSFORMER_IMPLS,
        default="local",
        help="layer spec of the single-device reference (default: local, so the TE spec is "
        "checked against the local one)",
    )
    ap.add_argument("--out", default="parallel_check.json", help="JSON report path")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)

    cc = CheckConfig.tiny_cpu() if args.cpu else CheckConfig()
    if args.seq_length:
        cc.seq_length = args.seq_length
    if args.steps:
        cc.steps = args.steps
    if args.backend:
        cc.backend = args.backend
    if args.dtype:
        cc.dtype = args.dtype
    cc.transformer_impl, cc.reference_impl = args.transformer_impl, args.reference_impl
    cc.loss_rtol, cc.gnorm_rtol, cc.grad_rtol = tolerances(cc.dtype, args.cpu)
    layouts = list(GPU_LAYOUTS)
    if cc.transformer_impl != cc.reference_impl:
        layouts.insert(0, SINGLE)
    if args.layouts:
        wanted = args.layouts.split(",")
        layouts = [layout for layout in choices if layout.name in wanted]
        if len(layouts) != len(wanted):
            ap.error(f"--layouts: choose from {[layout.name for layout in choices]}")
    return args, cc, layouts


def check_impls(cc: CheckConfig) -> Optional[str]:
    """Why the specs of ``cc`` cannot run here (TE asked for with --cpu or without Transformer
    Engine), or None."""
    from megatron_s2.training.parallel import check_transformer_impl
    from megatron_s2.training.run_config import ConfigError

    try:
        for impl in {cc.transformer_impl, cc.reference_impl}:
            check_transformer_impl(impl, gpu=not cc.cpu)
    except ConfigError as e:
        return f"--transformer-impl/--reference-impl: {e}"
    return None


def main(argv=None) -> int:
    args, cc, layouts = parse_args(argv)
    problem = check_impls(cc)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if not args.cpu:
        n = torch.cuda.device_count()
        if not args.layouts:  # by default, every layout this host's GPUs can hold
            skipped = [layout.name for layout in layouts if layout.world > n]
            layouts = [layout for layout in layouts if layout.world <= n]
            if skipped:
                print(f"skipped (need more than {n} GPUs): {', '.join(skipped)}")
        needed = max([layout.world for layout in layouts], default=2)
        if n < needed:
            print(f"need {needed} GPUs, found {n}", file=sys.stderr)
            return 2
    rows = run_check(cc, layouts, args.workdir)
    print(f"config: {json.dumps({k: v for k, v in asdict(cc).items() if k != 'schedule'})}")
    print(f"schedule: {json.dumps(cc.schedule)}")
    print(f"layouts: {cc.transformer_impl} spec; reference (one device): {cc.reference_impl} spec")
    print(format_table(rows))
    with open(args.out, "w") as f:
        json.dump(
            {
                "config": asdict(cc),
                "rows": rows,
                "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
                "torch": torch.__version__,
            },
            f,
            indent=1,
            default=str,
        )
    ok = all(r["passed"] for r in rows)
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
