"""Plain helpers shared by the tests (no fixtures or hooks: those are in ``tests/conftest.py``).

- ``kernels``: s2attn inputs, token masks, fp64 references and error checks;
- ``megatron``: tiny Megatron configs, a one-process gloo world, importing ``tools/`` scripts;
- ``slurm_cluster``: throw-away Slurm clusters on this machine, one node or two nodes in network
  namespaces of their own (``python -m tests.helpers.slurm_cluster [--two-nodes] DIR`` starts one
  by hand).
"""
