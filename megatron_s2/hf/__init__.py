"""Hugging Face checkpoints in and out of the trainer (``megatron-s2-hf``).

* :mod:`.mapping` -- ``config.json`` -> the run config's model section, and the tensor names and
  layouts of the two state dicts (pure functions, no Megatron).
* :mod:`.convert` -- ``import`` (HF directory -> trainer checkpoint + run.yaml) and ``export``
  (trainer checkpoint -> safetensors + config.json), through the trainer's own model and
  checkpoint format.
* :mod:`.cli` -- the ``megatron-s2-hf`` command.

This package sits beside the application (:mod:`megatron_s2.training`), whose checkpoints it
reads and writes; the plugin never imports it.
"""
