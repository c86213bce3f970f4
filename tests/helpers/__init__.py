"""Plain helpers shared by the tests (no fixtures or hooks: those are in ``tests/conftest.py``).

- ``kernels``: s2attn inputs, token masks, fp64 references and error checks;
- ``megatron``: tiny Megatron configs, a one-process gloo world, importing ``tools/`` scripts;
- ``benchmark``: stand-ins for tools/benchmark.py's GPU parts (the power sampler);
- ``imports``: the import graph of s2attn and megatron_s2 read from the source (AST);
- ``slurm_cluster``: throw-away Slurm clusters on this machine, one node or two nodes in network
  namespaces of their own (``python -m tests.helpers.slurm_cluster [--two-nodes] DIR`` starts one
  by hand), and ``user_shell_env``: the environment a user's shell would hand the launchers,
  without what the test process carries (an in-process gloo world's MASTER_ADDR/MASTER_PORT);
- ``study_scripts``: the sweep's ``--after`` for the study scripts' stand-in sweeps.
"""
