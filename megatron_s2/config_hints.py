"""Hints appended to config error messages, in a module that imports neither torch nor Megatron:
the run config's key check (:mod:`megatron_s2.training.run_config`) uses it while loading, before
the trainer imports anything heavy, so that a mistyped key is reported at once."""

from __future__ import annotations

__all__ = ["colon_hint"]


def colon_hint(keys) -> str:
    """A hint to append to an "unknown key" message when a rejected key holds a ':': YAML reads
    ``{vert_stride:16}`` (no space after the colon) as one key named ``vert_stride:16``, which is
    what users typing flow mappings on a command line most often get wrong. Empty otherwise."""
    for key in keys:
        if ":" in str(key):
            name, _, value = str(key).partition(":")
            return (
                f" (YAML needs a space after ':': {key!r} was read as one key; write "
                f"{{{name}: {value}}})"
            )
    return ""
