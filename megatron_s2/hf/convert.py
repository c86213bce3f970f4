"""Import a Hugging Face checkpoint into a trainer checkpoint + run config, and export a trainer
checkpoint back to Hugging Face safetensors + ``config.json``.

Both directions go through the trainer's own model (:mod:`megatron_s2.training.build`, one CPU
process, fp32) and checkpoint format (:mod:`megatron_s2.training.checkpointing`, Megatron's
dist-checkpointing): an imported checkpoint loads at any TP/PP layout (Megatron reshards it), and
an export reads a checkpoint saved at any layout. Every input is checked before anything is
written (:func:`plan_import`, :func:`plan_export`); the conversion itself
(:func:`run_import`, :func:`run_export`) starts Megatron in CPU mode, which patches torch for the
whole process.

Import writes::

    OUT_DIR/run.yaml                       the run config: model shape, RoPE, attention, tokenizer
    OUT_DIR/checkpoints/iter_0000000/      the weights (no optimizer state), tracker beside it
    OUT_DIR/hf/                            config.json and the tokenizer files of HF_DIR
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

from .mapping import (
    EOD_FIRST_KEY,
    FAMILIES,
    HFConfigError,
    dtype_name,
    hf_config,
    hf_shapes,
    iter_hf_to_megatron,
    megatron_to_hf,
    model_settings,
    nbytes,
)

__all__ = [
    "ImportPlan",
    "ExportPlan",
    "plan_import",
    "run_import",
    "plan_export",
    "run_export",
    "TOKENIZER_FILES",
    "DEFAULT_MAX_SHARD_BYTES",
]

# Files of a Hugging Face tokenizer (and generation defaults) copied along with the weights.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
# run.yaml's learning rates: continual pretraining of a pretrained model (the Llama-3.2-1B
# recipe's, configs/extend/llama-3.2-1b-s2-32k.yaml). The trainer's defaults (1e-3 down to 1e-4)
# are for small models trained from scratch and would undo much of what the imported weights know.
CONTINUAL_LR = 2.0e-5
CONTINUAL_MIN_LR = 2.0e-6
# transformers' own default shard size for save_pretrained.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that are recomputed, not learned (old Llama exports).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _fail(message: str):
    raise HFConfigError(message)


def _check_out_dir(path: Path, what: str) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        _fail(f"{what} {path} already exists and is not empty: give a new or empty directory")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        _fail(f"{path} does not exist")
    except (OSError, ValueError) as e:
        _fail(f"{path} cannot be read as JSON ({e})")
    if not isinstance(data, dict):
        _fail(f"{path}: the top level must be a JSON object")
    return data


def _write_json(path: Path, data: dict) -> None:
    """``data`` as ``transformers`` writes its JSON files: indented, a newline at the end."""
    path.write_text(json.dumps(data, indent=2) + "\n")


def read_tensor_index(hf_dir: Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """``{tensor name: (file, shape, safetensors dtype)}`` of the checkpoint in ``hf_dir``
    (``model.safetensors``, or the shards named by ``model.safetensors.index.json``), read from
    the file headers only. Raises :class:`HFConfigError` naming a missing or unreadable file."""
    from safetensors import safe_open

    index_path, single = hf_dir / INDEX_FILE, hf_dir / SINGLE_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            _fail(f"{index_path}: no 'weight_map' of tensor names to shard files")
        files = sorted(set(weight_map.values()))
    elif single.is_file():
        files = [SINGLE_FILE]
    else:
        _fail(
            f"{hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors checkpoints "
            f"are supported; save with save_pretrained(..., safe_serialization=True))"
        )
    missing = [f for f in files if not (hf_dir / f).is_file()]
    if missing:
        _fail(f"{index_path}: shard file(s) missing from {hf_dir}: {', '.join(missing)}")
    tensors = {}
    for name in files:
        try:
            with safe_open(str(hf_dir / name), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    tensors[key] = (hf_dir / name, tuple(sl.get_shape()), sl.get_dtype())
        except Exception as e:  # safetensors raises its own SafetensorError on bad headers
            _fail(f"{hf_dir / name} cannot be read as safetensors ({e})")
    return tensors


def check_tensors(index: dict, settings: dict, where: Path) -> list[str]:
    """Compare the checkpoint's tensors with the shapes ``config.json`` implies; raise naming
    the first differences, return the ignored extra names (recomputed buffers, a tied
    ``lm_head.weight``)."""
    expected = hf_shapes(settings)
    missing = sorted(set(expected) - set(index))
    if missing:
        _fail(
            f"{where}: {len(missing)} tensor(s) that config.json implies are not in the "
            f"checkpoint, e.g. {', '.join(missing[:3])}"
        )
    wrong = [
        f"{k}: {list(index[k][1])} in {index[k][0].name}, config.json implies {list(s)}"
        for k, s in expected.items()
        if tuple(index[k][1]) != s
    ]
    if wrong:
        _fail(f"{where}: tensor shapes do not match config.json: " + "; ".join(wrong[:3]))
    extra = sorted(set(index) - set(expected))
    ignorable = [
        k
        for k in extra
        if k.endswith(_IGNORED_SUFFIXES)
        or (k == "lm_head.weight" and not settings["untie_embeddings_and_output_weights"])
    ]
    unknown = sorted(set(extra) - set(ignorable))
    if unknown:
        _fail(
            f"{where}: tensor(s) this converter does not know (an architecture it does not "
            f"support?): {', '.join(unknown[:5])}"
        )
    return ignorable


@dataclass
class ImportPlan:
    """A checked import: what will be read and written."""

    hf_dir: Path
    out_dir: Path
    hf_config: dict
    settings: dict
    index: dict
    run_config: dict
    tokenizer_files: list = field(default_factory=list)


def _attention_section(pattern: Optional[str], s2_settings: Optional[dict]) -> Optional[dict]:
    if pattern is None:
        if s2_settings:
            _fail("--s2-settings needs --s2-pattern (which layers are S2)")
        return None
    section: dict[str, Any] = {"dense_layers": {"pattern": pattern}}
    if s2_settings:
        section["s2"] = dict(s2_settings)
    return section


def _check_exportable(cfg, seq_length: int, heads: int, where: Path) -> None:
    """Refuse an ``--s2-pattern`` schedule (of the run config ``cfg``) that holds at the training
    length ``seq_length`` (tokens) but leaves key blocks unseen beyond it. ``export`` refuses
    such a schedule (transformers runs an export at any length), so without this check the user
    would learn it only after training; raises :class:`HFConfigError` naming the flags."""
    reason = cfg.coverage_holes_beyond_length()
    if reason is not None:
        _fail(
            f"--s2-pattern for {where}: the S2 layers cover every key block at --seq-length "
            f"{seq_length} but not beyond it, and megatron-s2-hf export refuses such a model "
            f"(transformers runs it at any length): {reason}. Give --s2-settings that cover every "
            f"block (e.g. --s2-settings '{{vert_stride: {heads}}}': a stride of at most the "
            f"model's {heads} heads), or import without --s2-pattern and set the attention "
            f"section in the training run (with attention.allow_coverage_holes: true, then "
            f"export --allow-coverage-holes)"
        )


def plan_import(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    seq_length: int = 4096,
    s2_pattern: Optional[str] = None,
    s2_settings: Optional[dict] = None,
    transformer_impl: str = "local",
    name: Optional[str] = None,
) -> ImportPlan:
    """Check everything an import needs (no file written): ``hf_dir``'s ``config.json``
    (family, shape, RoPE), its tensors (files, names, shapes), the run config it becomes
    (``seq_length`` the training length; ``s2_pattern`` the layers made S2, ``D``/``S`` tiled
    over the layers; ``s2_settings`` the S2 settings), and that ``out_dir`` is new or empty.
    Raises :class:`HFConfigError` (or the run config's ``ConfigError``) naming the file or
    setting."""
    from ..training.run_config import ConfigError, RunConfig

    hf_dir, out_dir = Path(hf_dir).resolve(), Path(out_dir).resolve()
    if not hf_dir.is_dir():
        _fail(f"{hf_dir} is not a directory (give a local Hugging Face model directory)")
    _check_out_dir(out_dir, "OUT_DIR")
    config_path = hf_dir / "config.json"
    config = _read_json(config_path)
    settings = model_settings(config, str(config_path))
    index = read_tensor_index(hf_dir)
    check_tensors(index, settings, hf_dir)
    tokenizer_files = [f for f in TOKENIZER_FILES if (hf_dir / f).is_file()]
    has_tokenizer = "tokenizer.json" in tokenizer_files
    run = {
        "name": name or hf_dir.name,
        "model": dict(settings) | {"seq_length": seq_length, "transformer_impl": transformer_impl},
        "attention": _attention_section(s2_pattern, s2_settings),
        "data": {"tokenizer": str(out_dir / "hf") if has_tokenizer else "byte"},
        # An export of a train.eod_first model: continued pretraining keeps reading behind EOD.
        **({"train": {"eod_first": True}} if config.get(EOD_FIRST_KEY) else {}),
        "optimizer": {"lr": CONTINUAL_LR, "min_lr": CONTINUAL_MIN_LR},
        "checkpoint": {
            "load_dir": str(out_dir / "checkpoints"),
            "reset_iteration": True,
            "load_optimizer": False,
        },
    }
    # data.blend is the user's (the run.yaml's first override); a stand-in lets the rest of the
    # config, the S2 schedule against the model's heads and layers included, be checked now.
    probe = json.loads(json.dumps(run))
    probe["data"]["blend"] = ["your/data_text_document"]
    try:
        cfg = RunConfig.from_dict(probe)
        cfg.schedule()
    except ConfigError as e:
        raise HFConfigError(f"the run config for {config_path} is not valid: {e}") from None
    if s2_pattern is not None:
        _check_exportable(cfg, seq_length, settings["num_attention_heads"], config_path)
    return ImportPlan(hf_dir, out_dir, config, settings, index, run, tokenizer_files)


def _start_cpu_world():
    """CPU mode, a gloo world of one and Megatron's groups at TP=PP=1 (this process only)."""
    from megatron.core import parallel_state as ps

    from ..training.build import Runtime
    from ..training.parallel import DistributedEnv
    from ..training.run_config import ParallelConfig

    runtime = Runtime(env=DistributedEnv(), gpu=False, bf16=False)
    if torch.distributed.is_initialized() and ps.model_parallel_is_initialized():
        # A second conversion in this process (tests, scripts): the world of one is up.
        if torch.distributed.get_world_size() != 1 or ps.get_tensor_model_parallel_world_size() > 1:
            raise RuntimeError("megatron_s2.hf converts in a world of one process (TP=PP=1)")
        return runtime
    runtime.start(ParallelConfig(), seed=0)
    return runtime


def _build(model_section: dict, vocab: int, runtime):
    """The unsharded model (TP=PP=1, fp32, eval mode) of a run-config model section."""
    from ..training.build import build_run
    from ..training.run_config import ModelConfig, ParallelConfig, RunConfig

    model = ModelConfig(**model_section)
    # The model is built with the local spec whatever the run config says: its checkpoint keys
    # are the TE spec's too (megatron_s2.specs), and TE may not be installed here.
    # (and every layer dense: the S2 layers have the same weights, and no forward runs here).
    # GPTModel whatever model.model_class says: the mapping speaks its state-dict names, and its
    # checkpoints load into the HybridModel twin and back (megatron_s2.model).
    model = dataclasses.replace(
        model, transformer_impl="local", dense_attention="auto", model_class="gpt"
    )
    cfg = RunConfig(model=model, attention=None)
    parts = build_run(model, ParallelConfig(), cfg.schedule(), vocab, runtime)
    (chunk,) = parts.model
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return parts, chunk


class _LazyTensors(Mapping):
    """``{name: tensor}`` of a :func:`read_tensor_index`, each read from its file on access."""

    def __init__(self, index: dict):
        self.index = index

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self.index[name][0]
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self):
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


def _weights_of(chunk) -> dict[str, torch.Tensor]:
    return {k: v for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}


RUN_YAML_HEADER = """\
# Written by `megatron-s2-hf import` from {hf_dir}.
# Train (continual pretraining) with your data:
#   megatron-s2-train --config {run_yaml} data.blend=[path/to/prefix_text_document] \\
#       name=<run name> model.seq_length=<length> attention.dense_layers.pattern=DS
# The model section is the imported model's shape: keep it. checkpoint.load_dir starts the run
# from the imported weights (iteration 0, new optimizer). optimizer: a continual-pretraining
# learning rate (the trainer's default, 1e-3, is for training from scratch); tune it for your run.
"""


def run_import(plan: ImportPlan) -> Path:
    """Write the checkpoint, ``run.yaml`` and ``hf/`` of a checked :class:`ImportPlan`; returns
    the run.yaml path. Starts Megatron in CPU mode in this process."""

    from ..training.checkpointing import save_checkpoint

    runtime = _start_cpu_world()
    settings = plan.settings
    parts, chunk = _build(plan.run_config["model"], settings["vocab_size"], runtime)
    own = _weights_of(chunk)
    done = set()
    with torch.no_grad():
        # One tensor at a time, read from its file when the mapping asks for it.
        for k, t in iter_hf_to_megatron(_LazyTensors(plan.index), settings):
            if k not in own:
                raise RuntimeError(f"internal: the mapped tensor {k} is not in the model")
            own[k].copy_(t)
            done.add(k)
    if done != set(own):
        raise RuntimeError(f"internal: model tensors left unset: {sorted(set(own) - done)[:3]}")
    out = plan.out_dir
    out.mkdir(parents=True, exist_ok=True)
    hf_out = out / "hf"
    hf_out.mkdir()
    for f in plan.tokenizer_files:
        shutil.copy2(plan.hf_dir / f, hf_out / f)
    _write_json(hf_out / "config.json", plan.hf_config)
    save_checkpoint(
        plan.run_config["checkpoint"]["load_dir"],
        0,
        parts.model,
        None,
        None,
        consumed_samples=0,
        config=plan.run_config,
        extra={"padded_vocab_size": settings["vocab_size"]},
    )
    run_yaml = out / "run.yaml"
    header = RUN_YAML_HEADER.format(hf_dir=plan.hf_dir, run_yaml=run_yaml)
    body = yaml.safe_dump(plan.run_config, sort_keys=False, default_flow_style=False)
    run_yaml.write_text(header + body)
    return run_yaml


# ---- export -------------------------------------------------------------------------------------


@dataclass
class ExportPlan:
    """A checked export: the checkpoint to read and what the Hugging Face directory gets."""

    root: str
    iteration: int
    out_dir: Path
    run_config: dict
    settings: dict
    family: str
    template: Optional[dict]
    dtype: torch.dtype
    max_shard_bytes: int
    tokenizer_dir: Optional[Path]
    hybrid: bool
    s2_attention: Optional[dict] = None  # the schedule written to config.json, every setting
    template_path: Optional[Path] = None  # the imported config.json read as the template
    template_looked_at: tuple = ()  # where it was looked for (None found: the CLI says so)
    # train.eod_first: the model reads every input behind its EOD token (id eod, string
    # eod_token; None for the byte tokenizer, which has no tokenizer files to export).
    eod_first: bool = False
    eod: Optional[int] = None
    eod_token: Optional[str] = None


def _checkpoint_root(path: Path) -> Path:
    """The checkpoint directory of a run directory (``checkpoints/`` in it), else ``path``."""
    sub = path / "checkpoints"
    if not path.name.startswith("iter_") and sub.is_dir():
        return sub
    return path


def _template(run: dict, given: Optional[str]) -> tuple[Optional[dict], Optional[Path], list]:
    """The imported model's ``config.json``: ``given``, else the one beside the run's HF
    tokenizer, else the one of the import its ``checkpoint.load_dir`` came from. Returns
    ``(config or None, its path or None, the paths looked at)``; the run config's relative
    paths resolve against the current directory, so the caller can say where it looked."""
    candidates = [Path(given)] if given else []
    tok = (run.get("data") or {}).get("tokenizer")
    if tok and tok != "byte":
        tok = Path(tok)
        candidates.append((tok if tok.is_dir() else tok.parent) / "config.json")
    load_dir = (run.get("checkpoint") or {}).get("load_dir")
    if load_dir:
        candidates.append(Path(load_dir).parent / "hf" / "config.json")
    for path in candidates:
        if path.is_file():
            cfg = _read_json(path)
            if cfg.get("model_type") in FAMILIES:
                return cfg, path, candidates
        elif given and path == Path(given):
            _fail(f"--hf-config {given} does not exist")
    return None, None, candidates


def plan_export(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "auto",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    hf_config_path: Optional[str] = None,
    allow_coverage_holes: bool = False,
) -> ExportPlan:
    """Check an export (nothing written): ``source`` is a run directory, a checkpoint directory
    or one ``iter_NNNNNNN`` folder; ``dtype`` ``auto`` is the imported model's (its
    ``config.json``), else float32; ``allow_coverage_holes`` records that a hybrid's stripe
    holes beyond the trained length are intended (else such a schedule is refused). Raises
    :class:`HFConfigError` or the trainer's ``CheckpointError`` naming the path."""
    from ..schedule import AttentionSchedule, ScheduleError
    from ..training.evaluation.model import resolve_checkpoint, saved_config
    from ..training.run_config import ModelConfig

    out_dir = Path(out_dir).resolve()
    _check_out_dir(out_dir, "OUT_HF_DIR")
    if max_shard_bytes < 1:
        _fail(f"--max-shard-size must be positive, got {max_shard_bytes}")
    if not Path(source).exists():
        _fail(
            f"RUN_OR_CHECKPOINT {source} does not exist (give a run directory, its checkpoints/ "
            f"directory or one iter_NNNNNNN folder; relative to {Path.cwd()})"
        )
    root, iteration = resolve_checkpoint(str(_checkpoint_root(Path(source))))
    run, vocab = saved_config(root, iteration)
    if not run or "model" not in run:
        _fail(f"checkpoint {root} (iteration {iteration}) stores no run config to export from")
    model = ModelConfig(**run["model"])
    if model.normalization != "RMSNorm" or not model.swiglu:
        _fail(
            f"checkpoint {root}: model.normalization={model.normalization}, model.swiglu="
            f"{model.swiglu}: a Llama-family export needs RMSNorm and SwiGLU"
        )
    settings = {f.name: getattr(model, f.name) for f in dataclasses.fields(ModelConfig)}
    settings |= {
        "num_query_groups": model.query_groups,
        "ffn_hidden_size": model.ffn_size,
        "vocab_size": vocab or model.vocab_size,
    }
    if not settings["vocab_size"]:
        _fail(f"checkpoint {root}: its vocabulary size is not recorded (model.vocab_size)")
    template, template_path, looked_at = _template(run, hf_config_path)
    family = (template or {}).get("model_type") or ("qwen2" if model.add_qkv_bias else "llama")
    if model.add_qkv_bias != (family == "qwen2"):
        family = "qwen2" if model.add_qkv_bias else "llama"
    if dtype == "auto":
        dtype = (template or {}).get("dtype") or (template or {}).get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        _fail(f"--dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    attention = run.get("attention")
    hybrid = False
    s2_attention = None
    if attention is not None:
        if allow_coverage_holes:
            attention = {**attention, "allow_coverage_holes": True}
        schedule = AttentionSchedule.from_dict(attention, prefix="attention")
        levers = schedule.levers_set()
        if levers:
            # The exported model runs the S2 patterns through megatron_s2.hf.s2_attention and
            # the dense layers through transformers' own attention with the model's RoPE: the
            # sinks' weights and the dense layers' own positions would be dropped, and the
            # export would silently compute something else than the model trained.
            _fail(
                f"checkpoint {root}: its attention section sets {', '.join(levers)}, which the "
                f"exported Hugging Face model cannot run (it has no learned sinks and gives "
                f"every layer the model's RoPE); such a run cannot be exported yet"
            )
        hybrid = any(k != "dense" for k in schedule.layer_kinds(model.num_layers))
        if hybrid:
            # transformers runs an export at any length, so the schedule must hold at every
            # length (the loader's check, megatron_s2.hf.s2_attention), not only at the
            # model.seq_length the run trained at: refuse here rather than write a model that
            # load_s2_model then refuses.
            try:
                schedule.validate(model.num_layers, model.num_attention_heads, model.query_groups)
            except ScheduleError as e:
                _fail(
                    f"checkpoint {root}: its attention section holds at model.seq_length="
                    f"{model.seq_length} but not at every length, as an exported model must "
                    f"(transformers runs it at any length): {e}. If the holes are intended, "
                    f"export with --allow-coverage-holes"
                )
            # Every setting written out, defaults included: the export reads the same if a
            # default changes later.
            s2_attention = schedule.to_dict()
    tok = (run.get("data") or {}).get("tokenizer")
    tokenizer_dir = None
    if tok and tok != "byte":
        tok = Path(tok)
        tokenizer_dir = tok if tok.is_dir() else tok.parent
    eod_first = bool((run.get("train") or {}).get("eod_first"))
    eod = eod_token = None
    if eod_first:
        eod, eod_token = _eod_of(tok, root)
    return ExportPlan(
        root,
        iteration,
        out_dir,
        run,
        settings,
        family,
        template,
        DTYPES[dtype],
        max_shard_bytes,
        tokenizer_dir,
        hybrid,
        s2_attention,
        template_path,
        tuple(looked_at),
        eod_first,
        eod,
        eod_token,
    )


def _eod_of(tok, root: Path) -> tuple[int, Optional[str]]:
    """(id, string) of the EOD token a ``train.eod_first`` run put in front of every sample:
    the trainer's tokenizer's (``data.tokenizer``, loaded as the trainer does); None for
    the byte tokenizer. An export without it would write a model that HF users feed without
    the token it was trained to read first, so a tokenizer that is not found is an error."""
    from ..training.tokenizer import load_tokenizer

    spec = "byte" if not tok or tok == "byte" else str(tok)
    try:
        tokenizer = load_tokenizer(spec)
    except (FileNotFoundError, ValueError) as e:
        _fail(
            f"checkpoint {root} trained with train.eod_first: true (every input read behind the "
            f"EOD token), and its tokenizer data.tokenizer={spec} cannot be loaded to name that "
            f"token ({e}); export from the directory the run was trained in"
        )
    return int(tokenizer.eod), getattr(tokenizer, "eod_token", None)


def prepend_eod(directory: Path, eod_token: str, eod: int) -> None:
    """Make the Hugging Face tokenizer in ``directory`` (``tokenizer.json``, and
    ``tokenizer_config.json`` if there) put ``eod_token`` (id ``eod``) in front of every text
    it encodes with special tokens, as a ``train.eod_first`` model reads its inputs:
    ``tokenizer(text).input_ids`` is then ``[eod, *ids]`` where ``ids`` is what the trainer's
    tokenizer gives (``add_special_tokens=False``, which keeps giving ``ids``). The token is the
    tokenizer's BOS from then on (``bos_token``, ``add_bos_token``), which lm-evaluation-harness
    and generation read."""
    from tokenizers import Tokenizer, processors

    path = directory / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    template = processors.TemplateProcessing(
        single=f"{eod_token} $A",
        pair=f"{eod_token} $A $B:1",
        special_tokens=[(eod_token, eod)],
    )
    # The trainer never ran the tokenizer's own post-processor (its special tokens, a Llama
    # BOS say, are in no training sample), so it is replaced; a byte-level step only trims
    # offsets and adds no token, so it is kept in front, also from the Sequence an earlier
    # export wrote (a model imported from an export and exported again).
    steps = (json.loads(tok.to_str()).get("post_processor") or {},)
    if steps[0].get("type") == "Sequence":
        steps = tuple(steps[0].get("processors") or ())
    keep = [
        processors.ByteLevel(
            add_prefix_space=s.get("add_prefix_space", True),
            trim_offsets=s.get("trim_offsets", True),
            use_regex=s.get("use_regex", True),
        )
        for s in steps
        if s.get("type") == "ByteLevel"
    ]
    tok.post_processor = processors.Sequence([*keep, template]) if keep else template
    tok.save(str(path))
    for name, update in (
        ("tokenizer_config.json", {"bos_token": eod_token, "add_bos_token": True}),
        ("special_tokens_map.json", {"bos_token": eod_token}),
    ):
        config_path = directory / name
        if config_path.is_file() or name == "tokenizer_config.json":
            config = _read_json(config_path) if config_path.is_file() else {}
            _write_json(config_path, config | update)


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Tensor names in order, cut into files of at most ``limit`` bytes (a larger tensor gets
    a file of its own), as transformers' save_pretrained does."""
    shards, size = [[]], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_safetensors(tensors: dict[str, torch.Tensor], out: Path, limit: int) -> list[str]:
    """Write ``tensors`` to ``out`` as ``model.safetensors``, or as
    ``model-0000i-of-0000n.safetensors`` shards of at most ``limit`` bytes with
    ``model.safetensors.index.json``; returns the files written."""
    from safetensors.torch import save_file

    shards = _shards(tensors, limit)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file({k: tensors[k].contiguous() for k in shards[0]}, str(out / SINGLE_FILE), meta)
        return [SINGLE_FILE]
    files, weight_map = [], {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in names}, str(out / fname), meta)
        files.append(fname)
        weight_map |= dict.fromkeys(names, fname)
    total = sum(nbytes(tuple(t.shape), t.dtype) for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(out / INDEX_FILE, index)
    return files + [INDEX_FILE]


def run_export(plan: ExportPlan) -> list[str]:
    """Load a checked :class:`ExportPlan`'s checkpoint into the unsharded model (Megatron
    reshards any TP/PP layout) and write the Hugging Face directory; returns its files.
    Starts Megatron in CPU mode in this process."""
    from ..training.build import load_weights

    runtime = _start_cpu_world()
    run, settings = plan.run_config, plan.settings
    model_section = dict(run["model"]) | {"vocab_size": settings["vocab_size"]}
    parts, chunk = _build(model_section, settings["vocab_size"], runtime)
    load_weights(parts, plan.root, plan.iteration)
    hf = {
        k: t.detach().to(plan.dtype)
        for k, t in megatron_to_hf(_weights_of(chunk), settings).items()
    }
    template = plan.template
    seq = int(run["model"].get("seq_length") or 0)
    max_pos = max(seq, int((template or {}).get("max_position_embeddings") or 0)) or None
    config = hf_config(
        settings,
        family=plan.family,
        template=template,
        max_position_embeddings=max_pos,
        dtype=dtype_name(plan.dtype),
    )
    # The template's S2 keys and EOD-first flag (an import of an earlier export) are this
    # run's to set, below.
    for key in ("s2_attention", "attn_implementation", "attn_implementation_hint", EOD_FIRST_KEY):
        config.pop(key, None)
    if plan.hybrid:
        # The S2 schedule, every setting; megatron_s2.hf.s2_attention reads it.
        config["s2_attention"] = plan.s2_attention
        # transformers reads this key as the model's attention: a plain from_pretrained of the
        # hybrid then fails loudly ("s2" is not registered) instead of running every layer
        # dense, a model that was never trained; load_s2_model registers "s2", and an explicit
        # attn_implementation= still wins.
        config["attn_implementation"] = "s2"
    if plan.eod_first:
        # What the model reads first (train.eod_first): generation and lm-evaluation-harness
        # start from bos_token_id; megatron_s2.hf.lm_eval and a later import read the flag.
        config["bos_token_id"] = plan.eod
        config[EOD_FIRST_KEY] = True
    out = plan.out_dir
    out.mkdir(parents=True, exist_ok=True)
    files = write_safetensors(hf, out, plan.max_shard_bytes)
    _write_json(out / "config.json", config)
    files.append("config.json")
    if plan.tokenizer_dir is not None:
        for f in TOKENIZER_FILES:
            if (plan.tokenizer_dir / f).is_file():
                shutil.copy2(plan.tokenizer_dir / f, out / f)
                files.append(f)
        if plan.eod_first and (out / "tokenizer.json").is_file():
            prepend_eod(out, plan.eod_token, plan.eod)
            if "tokenizer_config.json" not in files:
                files.append("tokenizer_config.json")
    generation = out / "generation_config.json"
    if plan.eod_first and generation.is_file():
        # generate() starts an empty prompt from the generation config's bos_token_id, which
        # an imported model's file names as its own BOS.
        _write_json(generation, _read_json(generation) | {"bos_token_id": plan.eod})
    return files
