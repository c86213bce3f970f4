"""``train.pack_documents``: micro-batches as packed documents (THD), on the CPU.

* the pack builder alone (document starts, ``cu_seqlens``, positions; Megatron's own reset
  positions as the reference convention);
* a tiny hybrid GPTModel (S2 and dense layers, RoPE) built by the trainer's building blocks and
  run through the trainer's ``forward_step``: every token's loss of a packed micro-batch, and
  the gradients, equal those of running each document alone as its own sequence from position
  0, while the same tokens unpacked do not (the control that makes the check bite);
* the settings' validation and the real trainer CLI with the option on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_s2.training.data import pack_documents  # noqa: E402
from megatron_s2.training.run_config import (  # noqa: E402
    DEMO_CONFIG,
    ConfigError,
    RunConfig,
    load_config,
    resume_changes,
)

EOD = 9


def _batch(tokens: list[list[int]]) -> dict:
    t = torch.tensor(tokens, dtype=torch.long)
    b, s = t.shape
    return {
        "tokens": t,
        "labels": t + 100,
        "loss_mask": torch.rand(b, s),
        "position_ids": torch.arange(s).expand(b, -1).clone(),
        "attention_mask": torch.ones(b, 1, s, s, dtype=torch.bool),
    }


def _megatron_reset_positions(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """What Megatron's GPTDataset computes with reset_position_ids=True, sample by sample."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    return torch.stack(
        [_get_ltor_masks_and_position_ids(row, eod, True, False, False, False)[2] for row in tokens]
    )


# ---- (a) the pack builder ------------------------------------------------------------------
def test_pack_splits_at_eod_and_sample_boundaries():
    E = EOD
    batch = _batch(
        [
            [1, 2, E, 3, 4, 5, E, 6],  # EODs at odd places: documents of 3, 4, 1
            [7, 1, 2, 3, 4, 5, 6, 7],  # no EOD: the whole sample
            [1, E, E, 2, 3, 4, 5, E],  # consecutive EODs (a one-token document), EOD last
            [E, 1, 2, 3, 4, 5, 6, 7],  # EOD first
        ]
    )
    pack = pack_documents(batch, E)
    assert pack.cu_seqlens.dtype == torch.int32
    assert pack.cu_seqlens.tolist() == [0, 3, 7, 8, 16, 18, 19, 24, 25, 32]
    assert pack.num_documents == 9
    assert pack.max_seqlen == 8 and isinstance(pack.max_seqlen, int)
    expected_positions = [
        [0, 1, 2, 0, 1, 2, 3, 0],
        [0, 1, 2, 3, 4, 5, 6, 7],
        [0, 1, 0, 0, 1, 2, 3, 4],
        [0, 0, 1, 2, 3, 4, 5, 6],
    ]
    assert pack.batch["position_ids"].tolist() == [sum(expected_positions, [])]
    # Megatron's own reset convention (the dataset's positions with reset_position_ids=true).
    megatron = _megatron_reset_positions(batch["tokens"], E)
    assert pack.batch["position_ids"].tolist() == [megatron.view(-1).tolist()]
    for key in ("tokens", "labels", "loss_mask"):
        assert pack.batch[key].shape == (1, 32)
        assert torch.equal(pack.batch[key], batch[key].reshape(1, -1)), key
    assert set(pack.batch) == {"tokens", "labels", "loss_mask", "position_ids"}


def test_pack_one_sample_without_eod_is_one_document():
    pack = pack_documents(_batch([[1, 2, 3, 4, 5]]), EOD)
    assert pack.cu_seqlens.tolist() == [0, 5]
    assert pack.max_seqlen == 5
    assert pack.batch["position_ids"].tolist() == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize("seed", range(5))
def test_pack_random_batches_match_megatron_positions(seed):
    gen = torch.Generator().manual_seed(seed)
    b, s = 3, 37
    tokens = torch.randint(0, 6, (b, s), generator=gen)  # EOD (5) about every 6th token
    pack = pack_documents({"tokens": tokens}, 5)
    cu = pack.cu_seqlens.tolist()
    lengths = [y - x for x, y in zip(cu[:-1], cu[1:])]
    assert cu[0] == 0 and cu[-1] == b * s and min(lengths) >= 1
    assert pack.max_seqlen == max(lengths)
    flat = tokens.view(-1).tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        assert start // s == (end - 1) // s, "a document crosses samples"
        # Only a document's last token may be EOD, and it is, unless the sample ends first.
        assert 5 not in flat[start : end - 1]
        assert flat[end - 1] == 5 or end % s == 0
    positions = _megatron_reset_positions(tokens, 5).view(1, -1)
    assert torch.equal(pack.batch["position_ids"], positions)


def test_pack_refuses_device_tensors_and_wrong_shapes():
    with pytest.raises(ValueError, match="on the host"):
        pack_documents({"tokens": torch.zeros(2, 4, dtype=torch.long, device="meta")}, EOD)
    with pytest.raises(ValueError, match=r"\[b, s\]"):
        pack_documents({"tokens": torch.zeros(8, dtype=torch.long)}, EOD)


# ---- settings ------------------------------------------------------------------------------
def _cfg(*overrides: str) -> RunConfig:
    return load_config(DEMO_CONFIG, list(overrides))


def test_pack_documents_setting_and_its_checks():
    assert _cfg().train.pack_documents is False
    cfg = _cfg("train.pack_documents=true", "train.reset_position_ids=true")
    assert cfg.train.pack_documents is True
    with pytest.raises(ConfigError, match="train.pack_documents.*train.reset_position_ids=true"):
        _cfg("train.pack_documents=true")
    with pytest.raises(ConfigError) as err:
        _cfg(
            "train.pack_documents=true",
            "train.reset_position_ids=true",
            "parallel.context_parallel_size=2",
        )
    assert "train.pack_documents" in str(err.value)
    assert "parallel.context_parallel_size" in str(err.value)
    assert "not supported together yet" in str(err.value)
    with pytest.raises(ConfigError, match="train.pack_documents must be of type bool"):
        _cfg("train.pack_documents=packed")
    with pytest.raises(ConfigError, match="unknown key.*train.pack_document\\b"):
        _cfg("train.pack_document=true")


def test_pack_documents_is_a_plan_setting_on_resume():
    saved = _cfg().to_dict()
    cfg = _cfg("train.pack_documents=true", "train.reset_position_ids=true")
    changes = resume_changes(saved, cfg, own=True)
    assert {c.key for c in changes.plan} == {"train.pack_documents", "train.reset_position_ids"}
    assert not changes.refused and not changes.other


def test_forward_backward_refuses_packing_with_context_parallelism():
    from megatron_s2.training.step import ForwardBackward

    with pytest.raises(ValueError, match="not supported together yet"):
        ForwardBackward(
            [],
            num_microbatches=1,
            seq_length=8,
            micro_batch_size=1,
            device=torch.device("cpu"),
            context_parallel_size=2,
            pack_eod=EOD,
        )


# ---- (b) a packed micro-batch equals its documents run alone --------------------------------
# In a subprocess: RoPE needs the trainer's CPU mode, which patches torch process-wide.
MODEL_SCRIPT = textwrap.dedent("""
    import json
    import torch
    from megatron_s2.training.cpu_mode import enable_cpu_mode
    enable_cpu_mode()
    from megatron_s2.schedule import AttentionSchedule
    from megatron_s2.training import parallel
    from megatron_s2.training.run_config import ModelConfig, ParallelConfig
    from megatron_s2.training.step import forward_step

    EOD, VOCAB, SEQ = 100, 128, 128
    torch.distributed.init_process_group("gloo", rank=0, world_size=1,
                                         store=torch.distributed.HashStore())
    parallel.init_model_parallel(ParallelConfig(), seed=5)
    model_cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=8,
                            num_query_groups=4, ffn_hidden_size=128, seq_length=SEQ,
                            rotary_base=100.0)
    # Layers S2, dense, S2, dense; documents longer than the local window reach the stripes.
    schedule = AttentionSchedule.from_dict({
        "s2": {"block_size": 16, "local_blocks": 1, "vert_stride": 2, "head_offset": 1},
        "dense_layers": {"pattern": "SD"},
    })
    config = parallel.transformer_config(model_cfg, ParallelConfig(), schedule, bf16=False,
                                         backend="reference")
    (model,) = parallel.build_model_chunks(model_cfg, config, VOCAB, gpu=False)
    model.eval()
    # The attention layers (a HybridModel's MLP layers have none; model.model_class=auto).
    kinds = [type(l.self_attention.core_attention).__name__ for l in model.decoder.layers
             if hasattr(l.self_attention, "core_attention")]

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, EOD, (2, SEQ), generator=gen)
    # Sample 0: documents of 50, 1 (consecutive EODs) and 77 tokens. Sample 1: 67 and 61
    # tokens, the last ending in an EOD that starts nothing.
    for row, col in ((0, 49), (0, 50), (1, 66), (1, 127)):
        tokens[row, col] = EOD
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    loss_mask = (torch.rand(2, SEQ, generator=gen) > 0.2).float()
    batch = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
             "position_ids": torch.arange(SEQ).expand(2, -1).clone()}
    cpu = torch.device("cpu")

    def run(b, **kw):
        model.zero_grad()
        out, loss_fn = forward_step(cpu, 1, False, iter([b]), model, **kw)
        loss, num_tokens, _ = loss_fn(out)
        loss.backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        return out.detach(), float(loss), int(num_tokens), grads

    packed, packed_loss, packed_tokens, packed_grads = run(batch, pack_eod=EOD)
    plain = run(batch)[0]
    docs = [(0, 0, 50), (0, 50, 51), (0, 51, 128), (1, 0, 67), (1, 67, 128)]
    result = {"kinds": kinds, "packed_shape": list(packed.shape), "plain_shape": list(plain.shape),
              "docs": []}
    alone_loss, alone_tokens = 0.0, 0
    alone_grads = [torch.zeros_like(g) for g in packed_grads]
    for row, a, b in docs:
        n = b - a
        doc = {"tokens": tokens[row:row + 1, a:b], "labels": labels[row:row + 1, a:b],
               "loss_mask": loss_mask[row:row + 1, a:b],
               "position_ids": torch.arange(n)[None]}
        out, loss, num_tokens, grads = run(doc)
        alone_loss += loss
        alone_tokens += num_tokens
        alone_grads = [x + g for x, g in zip(alone_grads, grads)]
        start = row * SEQ + a
        result["docs"].append({
            "length": n,
            "packed_vs_alone": float((packed[0, start:start + n] - out[0]).abs().max()),
            "unpacked_vs_alone": float((plain[row, a:b] - out[0]).abs().max()),
        })
    result["loss"] = [packed_loss, alone_loss]
    result["tokens"] = [packed_tokens, alone_tokens]
    result["grad_diff"] = max(float((x - y).abs().max()) for x, y in zip(packed_grads, alone_grads))
    result["grad_scale"] = max(float(y.abs().max()) for y in alone_grads)
    print("RESULT", json.dumps(result))
""")


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # The trainer's CPU mode runs the PyTorch reference attention; the interpreter is far slower.
    env.pop("TRITON_INTERPRET", None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    return env


@pytest.fixture(scope="module")
def packed_model_result():
    """The per-document comparison of MODEL_SCRIPT (maximum absolute differences)."""
    proc = subprocess.run(
        [sys.executable, "-c", MODEL_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_packed_micro_batch_equals_each_document_alone(packed_model_result):
    r = packed_model_result
    assert r["kinds"] == ["S2CoreAttention", "FusedDenseAttention"] * 2
    assert r["packed_shape"] == [1, 256] and r["plain_shape"] == [2, 128]
    for doc in r["docs"]:
        assert doc["packed_vs_alone"] < 1e-5, doc
    # The loss function's 3-tuple: the same token-loss sum and token count.
    assert r["tokens"][0] == r["tokens"][1]
    assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-6)
    assert r["grad_diff"] <= 1e-5 * max(1.0, r["grad_scale"]), r


def test_unpacked_micro_batch_attends_across_documents(packed_model_result):
    """The control: without packing, every document after a sample's first sees the documents
    before it and continues their positions, so its losses differ from running it alone."""
    docs = packed_model_result["docs"]
    first_of_sample = [docs[0], docs[3]]
    later = [docs[1], docs[2], docs[4]]
    for doc in first_of_sample:
        assert doc["unpacked_vs_alone"] < 1e-5, doc
    for doc in later:
        assert doc["unpacked_vs_alone"] > 1e-3, doc


# ---- (c) the trainer with the option on -----------------------------------------------------


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """A demo corpus of short documents (20-200 bytes): several per 128-token sample."""
    from megatron_s2.training.demo_corpus import ensure_demo_data

    d = tmp_path_factory.mktemp("short_docs")
    return ensure_demo_data(str(d), num_docs=300, min_chars=20, max_chars=200)


def _train(tmp_path, prefix, name, *overrides, check=True, two_processes=False):
    """The trainer CLI (tests/training/test_trainer.py's runner and its tiny model) on the corpus
    ``prefix``; returns the process and every record of its metrics.jsonl."""
    from tests.training.test_trainer import TWO_PROCESSES, run_trainer

    proc, _ = run_trainer(
        tmp_path,
        os.path.dirname(prefix),
        "data.demo=false",
        f"data.blend=[{prefix}]",
        "data.split=90,10,0",
        "optimizer.lr_warmup_iters=1",
        *overrides,
        name=name,
        check=check,
        launcher=TWO_PROCESSES if two_processes else None,
    )
    path = tmp_path / name / "metrics.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return proc, records


def test_trainer_run_with_packed_documents(tmp_path, short_documents):
    proc, records = _train(
        tmp_path,
        short_documents,
        "packed",
        "train.train_iters=4",
        "train.eval_interval=4",
        "train.eval_iters=1",
        "train.pack_documents=true",
        "train.reset_position_ids=true",
        "train.eod_mask_loss=true",
    )
    assert "packed into one sequence of documents split at EOD (id 256" in proc.stdout
    train = [r["loss"] for r in records if r["kind"] == "train"]
    valid = [r["loss"] for r in records if r["kind"] == "valid"]
    assert len(train) == 4 and len(valid) == 1
    assert all(x == x for x in train + valid)  # not NaN
    assert train[-1] < train[0], train
    # The same first step unpacked: attention across documents gives another loss.
    _, plain = _train(
        tmp_path,
        short_documents,
        "plain",
        "train.train_iters=1",
        "optimizer.lr_warmup_iters=0",
        "train.eval_interval=0",
        "train.eod_mask_loss=true",
    )
    assert abs(plain[0]["loss"] - train[0]) > 1e-5, (plain[0]["loss"], train[0])


def test_trainer_refuses_packing_with_context_parallelism(tmp_path, short_documents):
    proc, _ = _train(
        tmp_path,
        short_documents,
        "cp",
        "train.pack_documents=true",
        "train.reset_position_ids=true",
        "parallel.context_parallel_size=2",
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "train.pack_documents=true and parallel.context_parallel_size=2" in proc.stderr
    assert "not supported together yet" in proc.stderr


@pytest.mark.slow
def test_packed_checkpoint_resumes_under_pipeline_parallelism(tmp_path, short_documents):
    """Pipeline stages exchange the packed [b * s, 1, h] activations: a packed run's checkpoint
    resumed at PP=2 gives the one-process run's next loss (the weights load at any layout; the
    optimizer state restarts there, so only the first resumed step is compared)."""
    packed = ("train.pack_documents=true", "train.reset_position_ids=true", "train.eval_interval=0")
    common = ("train.train_iters=2", "checkpoint.save_interval=1", "model.num_layers=4", *packed)
    _, one = _train(tmp_path, short_documents, "one", *common)
    ckpt = tmp_path / "pp2" / "checkpoints"
    ckpt.mkdir(parents=True)
    shutil.copytree(tmp_path / "one" / "checkpoints" / "iter_0000001", ckpt / "iter_0000001")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    proc, pp2 = _train(
        tmp_path,
        short_documents,
        "pp2",
        *common,
        "parallel.pipeline_model_parallel_size=2",
        two_processes=True,
    )
    assert "resumed from" in proc.stdout
    loss_one = next(r["loss"] for r in one if r["kind"] == "train" and r["iteration"] == 2)
    loss_pp2 = next(r["loss"] for r in pp2 if r["kind"] == "train" and r["iteration"] == 2)
    assert loss_pp2 == pytest.approx(loss_one, rel=1e-5)
