"""``megatron-s2-hf``: import a Hugging Face model for continual pretraining, export it back.

    megatron-s2-hf import HF_DIR OUT_DIR [--seq-length 8192] [--s2-pattern DS]
    megatron-s2-hf export RUN_OR_CHECKPOINT OUT_HF_DIR [--dtype bfloat16]

Exit codes: 0 done, 2 bad input (nothing written), 1 a failure while converting.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import yaml

__all__ = ["main", "EXIT_OK", "EXIT_BAD_INPUT", "EXIT_FAILED"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
PREFIX = "[megatron-s2-hf]"


def _size(text: str) -> int:
    """``5GB``, ``500MB``, ``10kB`` or a plain byte count -> bytes (decimal units, as
    transformers' ``max_shard_size``)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    t = text.strip().upper()
    for unit, scale in units.items():
        if t.endswith(unit) and t[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * scale)
    if t.isdigit():
        return int(t)
    raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB, 1000000)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-s2-hf",
        description="Hugging Face Llama-family checkpoints (llama, mistral, qwen2) in and out "
        "of megatron-s2-train.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser(
        "import",
        help="HF directory -> trainer checkpoint + run.yaml",
        description="Read a local Hugging Face model directory (config.json, safetensors, "
        "tokenizer) and write OUT_DIR/run.yaml, OUT_DIR/checkpoints and OUT_DIR/hf.",
    )
    imp.add_argument("hf_dir", metavar="HF_DIR")
    imp.add_argument("out_dir", metavar="OUT_DIR")
    imp.add_argument(
        "--seq-length", type=int, default=4096, help="model.seq_length of run.yaml (default 4096)"
    )
    imp.add_argument(
        "--s2-pattern",
        default=None,
        help="layers made S2 at load: attention.dense_layers.pattern, D/S tiled over the layers "
        "(e.g. DS); default: every layer dense",
    )
    imp.add_argument(
        "--s2-settings",
        default=None,
        help="S2 settings (attention.s2) as a YAML mapping, e.g. '{block_size: 64}'",
    )
    imp.add_argument(
        "--transformer-impl",
        default="local",
        choices=("local", "transformer_engine"),
        help="model.transformer_impl of run.yaml (the checkpoint loads into either)",
    )
    imp.add_argument("--name", default=None, help="the run name in run.yaml (default: HF_DIR's)")
    exp = sub.add_parser(
        "export",
        help="trainer checkpoint -> HF safetensors + config.json",
        description="Write a run's newest checkpoint (a run directory, a checkpoint directory "
        "or one iter_NNNNNNN folder) as a Hugging Face model directory.",
    )
    exp.add_argument("source", metavar="RUN_OR_CHECKPOINT")
    exp.add_argument("out_dir", metavar="OUT_HF_DIR")
    exp.add_argument(
        "--dtype",
        default="auto",
        help="auto (the imported model's dtype, else float32), float32, bfloat16 or float16",
    )
    exp.add_argument(
        "--max-shard-size", type=_size, default="5GB", help="safetensors shard limit (5GB)"
    )
    exp.add_argument(
        "--hf-config",
        default=None,
        help="the imported model's config.json as a template (default: found from the run)",
    )
    exp.add_argument(
        "--allow-coverage-holes",
        action="store_true",
        help="export a hybrid whose stripes leave key blocks unseen beyond the trained length "
        "(refused otherwise: transformers runs the export at any length)",
    )
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """Run the command; returns the exit code."""
    from ..training.errors import CheckpointError
    from ..training.known_warnings import quiet_known_warnings
    from ..training.run_config import ConfigError
    from . import convert
    from .mapping import HFConfigError

    args = _parser().parse_args(argv)
    quiet_known_warnings()
    try:
        if args.command == "import":
            s2 = yaml.safe_load(args.s2_settings) if args.s2_settings else None
            if s2 is not None and not isinstance(s2, dict):
                raise HFConfigError(
                    f"--s2-settings must be a YAML mapping, got {args.s2_settings!r}"
                )
            plan = convert.plan_import(
                args.hf_dir,
                args.out_dir,
                seq_length=args.seq_length,
                s2_pattern=args.s2_pattern,
                s2_settings=s2,
                transformer_impl=args.transformer_impl,
                name=args.name,
            )
        else:
            plan = convert.plan_export(
                args.source,
                args.out_dir,
                dtype=args.dtype,
                max_shard_bytes=args.max_shard_size,
                hf_config_path=args.hf_config,
                allow_coverage_holes=args.allow_coverage_holes,
            )
    except (HFConfigError, ConfigError, CheckpointError, yaml.YAMLError) as e:
        print(f"{PREFIX} error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.command == "import":
        run_yaml = convert.run_import(plan)
        print(f"{PREFIX} imported {plan.hf_dir} -> {plan.out_dir}")
        if plan.run_config["data"]["tokenizer"] == "byte":
            print(
                f"{PREFIX} note: {plan.hf_dir} has no tokenizer.json, so run.yaml's data.tokenizer "
                f"is 'byte'; set data.tokenizer to the model's tokenizer (the data must be "
                f"tokenized with it)"
            )
            from megatron_s2.training.tokenizer import ByteTokenizer

            vocab = plan.settings.get("vocab_size") or 0
            if vocab < ByteTokenizer.vocab_size:
                # The trainer would refuse this pair at its first load; say it here, where the
                # choice is made.
                print(
                    f"{PREFIX} note: the model's vocabulary ({vocab}) is smaller than the byte "
                    f"tokenizer's ({ByteTokenizer.vocab_size}): training with data.tokenizer="
                    f"byte will be refused; give the model's own tokenizer"
                )
        print(f"{PREFIX} train with: megatron-s2-train --config {run_yaml} data.blend=[...]")
    else:
        files = convert.run_export(plan)
        print(f"{PREFIX} exported {plan.root} (iteration {plan.iteration}) -> {plan.out_dir}")
        print(f"{PREFIX} files: {', '.join(files)}")
        if plan.eod_first:
            # The model was trained to read every input behind EOD: say where that now lives.
            how = (
                "the tokenizer puts it in front of every text it encodes with special tokens"
                if plan.eod_token is not None
                else "no tokenizer was exported (byte tokenizer): put it first yourself"
            )
            print(
                f"{PREFIX} note: the run trained with train.eod_first, so the model reads every "
                f"input behind EOD (id {plan.eod}, config.json's bos_token_id); {how}"
            )
        if plan.template_path is not None:
            print(f"{PREFIX} config.json: {plan.template_path}'s, with the run's shape")
        else:
            # Without the imported config.json, transformers' defaults stand in for what the
            # run config does not hold (token ids, the original dtype and context): a model
            # that loads but is not the imported one's. The run's relative paths are read
            # against this directory, so an export from elsewhere lands here.
            looked = ", ".join(str(p) for p in plan.template_looked_at) or "nowhere"
            print(
                f"{PREFIX} note: the imported model's config.json was not found (looked at: "
                f"{looked}; relative paths are read from {Path.cwd()}), so config.json holds "
                f"only the run's shape, and transformers' defaults for the rest (bos/eos token "
                f"ids, dtype, ...). For a model imported with megatron-s2-hf, remove "
                f"{plan.out_dir} and export again from the directory the run was trained in, "
                f"or with --hf-config IMPORT_DIR/hf/config.json"
            )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
