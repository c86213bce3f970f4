"""Subprocess side of the Hugging Face tests: imports, our model's logits, exports.

Run as ``python -m tests.hf.hf_worker convert DIR...`` (one process: for every ``DIR/hf`` it
imports to ``DIR/imported``, writes our logits at TP=PP=1 to ``DIR/ours_tp1_pp1.pt`` for the
tokens in ``DIR/tokens.pt``, exports to ``DIR/exported``, and where ``DIR/hf`` has a tokenizer
once more as a ``train.eod_first`` run to ``DIR/exported_eod_first``) or ``python -m
tests.hf.hf_worker layouts DIR...`` (two gloo processes: the logits at TP=2 and at PP=2 from the
imported checkpoint, ``DIR/ours_tp2_pp1.pt`` and ``DIR/ours_tp1_pp2.pt``, and the weights saved
at those layouts, ``DIR/saved_tp2_pp1``, ``DIR/saved_tp1_pp2``), or ``... export DIR...`` (one
process: those saved checkpoints exported, ``DIR/exported_tp2_pp1``, ``DIR/exported_tp1_pp2``).
CPU mode patches torch for the whole process, hence the subprocesses; the reference logits come
from ``transformers`` in the test process."""

from __future__ import annotations

import os
import sys

import torch

from megatron_s2.training.cpu_mode import enable_cpu_mode


def _unwrap(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def our_logits(
    run_yaml: str, tokens: torch.Tensor, tp: int, pp: int, save_to: str | None = None
) -> torch.Tensor:
    """Logits ``[b, s, vocab]`` of the imported checkpoint named by ``run_yaml``, loaded at
    TP=``tp``, PP=``pp`` over the running world (collective; rank 0 of the last stage returns
    them, other ranks None). ``save_to``: also save the loaded weights there, at this layout
    (a weights-only checkpoint, as the import writes)."""
    from megatron.core import parallel_state as ps

    from megatron_s2.training.build import Runtime, build_run, load_weights
    from megatron_s2.training.parallel import DistributedEnv, init_model_parallel
    from megatron_s2.training.run_config import load_config

    cfg = load_config(
        run_yaml,
        [
            "data.blend=[unused]",
            f"parallel.tensor_model_parallel_size={tp}",
            f"parallel.pipeline_model_parallel_size={pp}",
            f"model.seq_length={tokens.shape[1]}",
        ],
    )
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    init_model_parallel(cfg.parallel, seed=0)
    runtime = Runtime(env=DistributedEnv(), gpu=False, bf16=False)
    parts = build_run(cfg.model, cfg.parallel, cfg.schedule(), cfg.model.vocab_size, runtime)
    load_weights(parts, cfg.checkpoint.load_dir, 0)
    if save_to is not None:
        from megatron_s2.training.checkpointing import read_checkpoint_config, save_checkpoint

        saved, vocab = read_checkpoint_config(os.path.join(cfg.checkpoint.load_dir, "iter_0000000"))
        save_checkpoint(
            save_to,
            0,
            parts.model,
            None,
            None,
            consumed_samples=0,
            config=saved,
            extra={"padded_vocab_size": vocab},
        )
    (chunk,) = [_unwrap(c) for c in parts.model]
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    with torch.no_grad():
        if pp > 1:
            hidden = torch.empty(s, b, cfg.model.hidden_size)
            if ps.is_pipeline_first_stage():
                out = chunk(tokens, pos, None)
                torch.distributed.send(out.contiguous(), ps.get_pipeline_model_parallel_next_rank())
                return None
            torch.distributed.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            chunk.set_input_tensor(hidden)
        out = chunk(tokens, pos, None)
    if tp > 1:
        parts_ = [torch.empty_like(out) for _ in range(tp)]
        torch.distributed.all_gather(
            parts_, out.contiguous(), group=ps.get_tensor_model_parallel_group()
        )
        out = torch.cat(parts_, dim=-1)
    return out if ps.get_tensor_model_parallel_rank() == 0 else None


def convert(dirs: list[str]) -> None:
    """Import, our logits at TP=PP=1, export: for every directory (see the module docstring)."""
    from megatron_s2.hf import convert as conv

    for d in dirs:
        plan = conv.plan_import(os.path.join(d, "hf"), os.path.join(d, "imported"), seq_length=64)
        run_yaml = conv.run_import(plan)
        tokens = torch.load(os.path.join(d, "tokens.pt"))
        torch.save(our_logits(str(run_yaml), tokens, 1, 1), os.path.join(d, "ours_tp1_pp1.pt"))
        export = conv.plan_export(
            os.path.join(d, "imported"), os.path.join(d, "exported"), max_shard_bytes=40_000
        )
        conv.run_export(export)
        if os.path.isfile(os.path.join(d, "hf", "tokenizer.json")):
            _export_eod_first(conv, d)


def _export_eod_first(conv, d: str) -> None:
    """The import exported as if its run had trained with ``train.eod_first: true`` (its saved
    run config given the setting) to ``DIR/exported_eod_first``."""
    from megatron_s2.training.evaluation import model as eval_model

    saved = eval_model.saved_config

    def with_eod_first(root, iteration):
        run, vocab = saved(root, iteration)
        return {**run, "train": {**(run.get("train") or {}), "eod_first": True}}, vocab

    eval_model.saved_config = with_eod_first
    try:
        plan = conv.plan_export(os.path.join(d, "imported"), os.path.join(d, "exported_eod_first"))
    finally:
        eval_model.saved_config = saved
    conv.run_export(plan)


def _cpu_mode() -> None:
    import megatron.core.distributed  # noqa: F401  (before CPU mode patches torch)

    enable_cpu_mode()
    torch.set_num_threads(1)


def _layouts(rank: int, port: int, dirs: list[str]) -> None:
    _cpu_mode()  # spawned: this process did not run the __main__ block
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    for d in dirs:
        tokens = torch.load(os.path.join(d, "tokens.pt"))
        for tp, pp in ((2, 1), (1, 2)):
            save_to = os.path.join(d, f"saved_tp{tp}_pp{pp}")
            out = our_logits(os.path.join(d, "imported", "run.yaml"), tokens, tp, pp, save_to)
            if out is not None:
                torch.save(out, os.path.join(d, f"ours_tp{tp}_pp{pp}.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _cpu_mode()
    mode, *paths = sys.argv[1:]
    if mode == "convert":
        convert(paths)
    elif mode == "export":
        from megatron_s2.hf import convert as conv

        for d in paths:  # the checkpoints the layouts saved, each exported in this one process
            for layout in ("tp2_pp1", "tp1_pp2"):
                plan = conv.plan_export(
                    os.path.join(d, f"saved_{layout}"), os.path.join(d, f"exported_{layout}")
                )
                conv.run_export(plan)
    else:
        from tests.helpers.megatron import free_port

        torch.multiprocessing.spawn(_layouts, args=(free_port(), paths), nprocs=2)
