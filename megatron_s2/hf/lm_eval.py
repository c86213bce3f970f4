"""``python -m megatron_s2.hf.lm_eval ARGS``: lm-evaluation-harness on an exported S2 hybrid.

``lm_eval --model hf`` loads the model in a process that never imports this package, so the
``"s2"`` attention would not exist there. This wrapper registers it (:func:`register`), adds
``attn_implementation=s2`` to the ``hf`` model's ``--model_args`` unless they name an attention
implementation already (and ``add_bos_token=True`` for a model trained with
``train.eod_first``, whose export made EOD the tokenizer's BOS), checks a local checkpoint's
``s2_attention`` before anything loads, and then runs lm-evaluation-harness's own command line
(``lm_eval.__main__.cli_evaluate``) with the remaining arguments unchanged::

    python -m megatron_s2.hf.lm_eval --model hf \\
        --model_args pretrained=OUT_HF_DIR,dtype=bfloat16 \\
        --tasks my_task --include_path my_tasks/ --batch_size 1

Needs ``pip install "lm-eval[hf]"`` (not a dependency of this package).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

from .mapping import EOD_FIRST_KEY
from .s2_attention import ATTN_IMPLEMENTATION, S2ConfigError, check_config, register

# lm-evaluation-harness's names of its transformers model (lm_eval/models/huggingface.py).
HF_MODELS = ("hf", "hf-auto", "huggingface")
MODEL_ARGS_FLAGS = ("--model_args", "-a")


def _option_values(argv: list[str], flags: tuple[str, ...]) -> list[tuple[int, int, str]]:
    """``(index, value index, value)`` of each first value given to one of ``flags``, as
    ``--flag value`` or ``--flag=value``."""
    found = []
    for i, arg in enumerate(argv):
        for flag in flags:
            if arg == flag and i + 1 < len(argv):
                found.append((i, i + 1, argv[i + 1]))
            elif arg.startswith(flag + "="):
                found.append((i, i, arg[len(flag) + 1 :]))
    return found


def _model_args_values(argv: list[str]) -> list[str]:
    """Every value given to ``--model_args`` (it takes one or more values)."""
    values = []
    for i, arg in enumerate(argv):
        if arg in MODEL_ARGS_FLAGS:
            j = i + 1
            while j < len(argv) and not argv[j].startswith("-"):
                values.append(argv[j])
                j += 1
        elif arg.startswith(tuple(f + "=" for f in MODEL_ARGS_FLAGS)):
            values.append(arg.split("=", 1)[1])
    return values


def model_name(argv: list[str]) -> str:
    """The ``--model`` argument (lm-evaluation-harness's default: ``hf``)."""
    found = _option_values(argv, ("--model",))
    return found[-1][2] if found else "hf"


def _with_model_arg(argv: list[str], key: str, value: str | bool) -> list[str]:
    """``argv`` with ``key=value`` added to the ``hf`` model's ``--model_args``; unchanged when
    the model is not lm-evaluation-harness's ``hf`` model or the model args set ``key`` already
    (a user's explicit choice wins). Both forms of model args are handled: ``key=value,...``
    (the key appended to the first value; the harness reads ``True`` there as a boolean) and a
    JSON object (``value`` as its JSON value)."""
    argv = list(argv)
    if model_name(argv) not in HF_MODELS:
        return argv
    if any(key in v for v in _model_args_values(argv)):
        return argv
    found = _option_values(argv, MODEL_ARGS_FLAGS)
    if not found:
        return argv + ["--model_args", f"{key}={value}"]
    i, j, given = found[0]
    if given.lstrip().startswith("{"):
        mapping = json.loads(given)
        mapping[key] = value
        new = json.dumps(mapping)
    else:
        new = f"{given.rstrip(',')},{key}={value}".lstrip(",")
    argv[j] = new if i != j else f"{argv[i].split('=', 1)[0]}={new}"
    return argv


def with_s2_model_args(argv: list[str]) -> list[str]:
    """``argv`` with ``attn_implementation=s2`` added to the ``hf`` model's ``--model_args``
    (see :func:`_with_model_arg`: a given ``attn_implementation`` wins)."""
    return _with_model_arg(argv, "attn_implementation", ATTN_IMPLEMENTATION)


def with_eod_first_model_args(argv: list[str]) -> list[str]:
    """``argv`` with ``add_bos_token=True`` added to the ``hf`` model's ``--model_args`` when
    the local ``pretrained`` checkpoint was trained with ``train.eod_first`` (its config.json's
    ``s2_eod_first``, written by the export): lm-evaluation-harness then encodes every request
    with the tokenizer's BOS, which the export made the EOD token the model reads first, and
    starts rolling log-likelihoods from it. A given ``add_bos_token`` wins."""
    path = model_args(argv).get("pretrained")
    if model_name(argv) not in HF_MODELS or not path:
        return argv
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return argv
    with open(config) as f:
        if not json.load(f).get(EOD_FIRST_KEY):
            return argv
    return _with_model_arg(argv, "add_bos_token", True)


def model_args(argv: list[str]) -> dict[str, str]:
    """The ``--model_args`` given, merged in order (``key=value,...`` or JSON objects); values
    as strings. For the wrapper's own checks only: lm-evaluation-harness parses them itself."""
    merged: dict[str, str] = {}
    for value in _model_args_values(argv):
        if value.lstrip().startswith("{"):
            try:
                mapping = json.loads(value)
            except json.JSONDecodeError:
                continue
            if isinstance(mapping, dict):
                merged.update({str(k): str(v) for k, v in mapping.items()})
            continue
        for item in value.split(","):
            key, sep, val = item.partition("=")
            if sep:
                merged[key.strip()] = val.strip().strip("'\"")
    return merged


def check_pretrained(argv: list[str]) -> None:
    """Check a local checkpoint's ``s2_attention`` when the ``hf`` model runs with the ``"s2"``
    attention, so a bad or missing schedule stops the run before lm-evaluation-harness loads
    anything (a hub name is checked by the first forward instead). Raises
    :class:`S2ConfigError`."""
    args = model_args(argv)
    if model_name(argv) not in HF_MODELS or args.get("attn_implementation") != ATTN_IMPLEMENTATION:
        return
    path = args.get("pretrained")
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return
    from transformers import AutoConfig

    check_config(AutoConfig.from_pretrained(path))


def main(argv: Optional[list[str]] = None) -> None:
    """Register ``"s2"``, complete and check the arguments, run lm-evaluation-harness's CLI."""
    argv = list(sys.argv[1:] if argv is None else argv)
    register()
    argv = with_eod_first_model_args(with_s2_model_args(argv))
    try:
        check_pretrained(argv)
    except S2ConfigError as e:
        raise SystemExit(f"megatron_s2.hf.lm_eval: {e}") from None
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as e:
        raise SystemExit(
            f"megatron_s2.hf.lm_eval: lm-evaluation-harness is not installed ({e}); "
            f'pip install "lm-eval[hf]"'
        ) from None
    # lm-evaluation-harness reads its arguments from sys.argv.
    sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
