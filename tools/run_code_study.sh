#!/usr/bin/env bash
# The quality study on real text, end to end on one GPU machine (docs/quality.md):
#   1. build the code corpus from this interpreter's own files (skipped if CORPUS/corpus.json
#      exists: the build is deterministic, see docs/code_corpus.md),
#   2. run a study with megatron-s2-sweep on it (resumable: run the script again),
#   3. megatron-s2-eval-long-context on every finished point: loss by token position on held-out
#      documents (at the run's own sequence length unless EVAL_ARGS gives --lengths), and
#      passkey / needle retrieval if EVAL_ARGS asks for it,
#   4. one plot of those curves and the study's table and plots.
#
#   tools/run_code_study.sh [STUDY] [BUILD OPTION ...]
#
# STUDY: default configs/studies/code-125m-attention.yaml. Environment: CORPUS (data/code),
# PYTHON (python), POSITION_SEQUENCES (64), EVAL_ARGS (options of megatron-s2-eval-long-context;
# default --skip-retrieval: loss by position only), SWEEP_ARGS (options of megatron-s2-sweep run,
# e.g. "--devices 0,1" for two points at a time), EVAL_DEVICES (e.g. 0,1: the evaluations one per
# GPU at a time, their output in each run's long_context_eval.log). Extra arguments go to
# tools/build_code_corpus.py.
set -euo pipefail
cd "$(dirname "$0")/.."
STUDY=${1:-configs/studies/code-125m-attention.yaml}
shift || true
CORPUS=${CORPUS:-data/code}
PYTHON=${PYTHON:-python}

if [[ ! -f "$CORPUS/corpus.json" ]]; then
    echo "== building the code corpus in $CORPUS"
    "$PYTHON" tools/build_code_corpus.py --out "$CORPUS" "$@"
fi
read -r -a OVERRIDES < <("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['overrides'])" "$CORPUS/corpus.json")
echo "== corpus overrides: ${OVERRIDES[*]}"

echo "== study $STUDY"
status=0
read -r -a sweep_args <<< "${SWEEP_ARGS:-}"
"$PYTHON" -m megatron_s2.training.sweep run "$STUDY" "${OVERRIDES[@]}" "${sweep_args[@]}" || status=$?

OUT=$("$PYTHON" - "$STUDY" "${OVERRIDES[@]}" <<'PY'
import sys
from megatron_s2.training.sweep import load_study
print(load_study(sys.argv[1], extra_overrides=sys.argv[2:]).output_dir)
PY
)
# The evaluations: one after another, or with EVAL_DEVICES (GPU ids, e.g. 0,1) one per GPU at a
# time, each in the background with its own CUDA_VISIBLE_DEVICES and its output in its run's
# long_context_eval.log.
IFS=, read -r -a eval_devices <<< "${EVAL_DEVICES:-}"
read -r -a eval_args <<< "${EVAL_ARGS:---skip-retrieval}"
evaluate() {  # RUN [GPU]
    local run=$1 gpu=${2:-}
    if [[ -n "$gpu" ]]; then
        CUDA_VISIBLE_DEVICES=$gpu "$PYTHON" -m megatron_s2.training.evaluation.long_context \
            --checkpoint "$run/checkpoints" "${eval_args[@]}" \
            --position-sequences "${POSITION_SEQUENCES:-64}" > "$run/long_context_eval.log" 2>&1
    else
        "$PYTHON" -m megatron_s2.training.evaluation.long_context --checkpoint "$run/checkpoints" \
            "${eval_args[@]}" --position-sequences "${POSITION_SEQUENCES:-64}"
    fi
}
pids=()
i=0
for run in "$OUT"/runs/*/; do
    run=${run%/}
    [[ -f "$run/summary.json" ]] || continue
    [[ -f "$run/long_context_eval/loss_by_position.json" ]] && continue
    echo "== evaluating: $(basename "$run")"
    if (( ${#eval_devices[@]} )); then
        if (( ${#pids[@]} >= ${#eval_devices[@]} )); then
            wait "${pids[0]}" || status=$?
            pids=("${pids[@]:1}")
        fi
        evaluate "$run" "${eval_devices[i % ${#eval_devices[@]}]}" &
        pids+=($!)
        i=$((i + 1))
    else
        evaluate "$run" || status=$?
    fi
done
for pid in "${pids[@]}"; do
    wait "$pid" || status=$?
done
curves=()
for run in "$OUT"/runs/*/; do
    run=${run%/}
    [[ -f "$run/long_context_eval/loss_by_position.json" ]] && curves+=("$run/long_context_eval/loss_by_position.json")
done
if (( ${#curves[@]} )); then
    "$PYTHON" tools/plot_loss_by_position.py --out "$OUT/loss_by_position.png" "${curves[@]}"
fi
exit "$status"
