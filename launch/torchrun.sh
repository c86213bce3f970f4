#!/usr/bin/env bash
# Single-node launcher: one torchrun, NPROC_PER_NODE trainer processes.
#
#   launch/torchrun.sh CONFIG.yaml [key.sub=value ...]
#   NPROC_PER_NODE=2 launch/torchrun.sh configs/demo.yaml train.train_iters=50
#
# Knobs (environment variables) are documented in launch/README.md. Everything after the config
# is passed to the trainer as config overrides.
set -euo pipefail

usage() {
    echo "usage: $0 CONFIG.yaml [key.sub=value ...]   (env knobs: see launch/README.md)" >&2
    exit 2
}
[[ $# -ge 1 ]] || usage
case "$1" in -h|--help) usage ;; esac
CONFIG=$1
shift
if [[ ! -f "$CONFIG" ]]; then
    echo "$0: config file '$CONFIG' not found" >&2
    exit 2
fi

# Default to one process per visible GPU; a CPU-only host runs one process unless told otherwise.
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
        IFS=, read -r -a _devs <<<"$CUDA_VISIBLE_DEVICES"
        NPROC_PER_NODE=${#_devs[@]}
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        NPROC_PER_NODE=$(nvidia-smi -L | grep -c '^GPU')
    else
        NPROC_PER_NODE=1
    fi
fi
if ! [[ "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]]; then
    echo "$0: NPROC_PER_NODE must be a positive integer, got '$NPROC_PER_NODE'" >&2
    exit 2
fi

PYTHON=${PYTHON:-python3}

# check_config NAME WORLD_SIZE CONFIG [override ...]: load the run config and check it for this
# world size before any process starts. A config that cannot run here (e.g. a global batch not
# divisible by micro batch x data-parallel size) is then one config error and exit code 2, instead
# of the same error from every rank followed by torchrun's ChildFailedError traceback.
check_config() {
    "$PYTHON" - "$@" <<'PY'
import sys

name, world, config, args = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
try:
    from megatron_s2.training.run_config import ConfigError, load_config
except ImportError as e:
    print(f"{name}: {sys.executable} cannot import megatron_s2 ({e}): install it "
          "(pip install -e .) or set PYTHON to an interpreter that has it", file=sys.stderr)
    sys.exit(2)
try:
    cfg = load_config(config, [a for a in args if not a.startswith("-")])
    cfg.schedule()
    cfg.validate(world_size=world)
except ConfigError as e:
    print(f"megatron-s2-train: config error: {e}", file=sys.stderr)
    print(f"{name}: config check for {world} process(es) failed; no trainer started",
          file=sys.stderr)
    sys.exit(2)
PY
}

# NVLink SHARP (NVLS) multicast buffers have hung and failed allocation on shared/virtualized
# nodes; plain ring/tree collectives are the safe default. Set NCCL_NVLS_ENABLE=1 to opt in.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
# Megatron orders TP/SP communication and compute kernels assuming a single hardware queue.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# torchrun waits this long after forwarding SIGTERM before SIGKILLing the workers; the trainer
# needs it to write its final checkpoint (torchrun's own default, 30 s, is too short for big models).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-300}

overrides=()
[[ -n "${RUN_DIR:-}" ]] && overrides+=("logging.run_dir=$RUN_DIR")
check_config "$0" "$NPROC_PER_NODE" "$CONFIG" "${overrides[@]}" "$@" || exit $?

# A free port chosen by --standalone lets several single-node jobs share a machine.
exec "$PYTHON" -m torch.distributed.run \
    --standalone \
    --nnodes=1 \
    --nproc-per-node="$NPROC_PER_NODE" \
    ${TORCHRUN_ARGS:-} \
    -m megatron_s2.training --config "$CONFIG" "${overrides[@]}" "$@"
