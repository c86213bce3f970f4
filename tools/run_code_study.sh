#!/usr/bin/env bash
# The quality study on real text, end to end on one GPU machine (docs/quality.md):
#   1. build the code corpus from this interpreter's own files (skipped if CORPUS/corpus.json
#      exists: the build is deterministic, see docs/code_corpus.md); the study's output folder
#      keeps the corpus.json its runs trained on, and a corpus with another manifest_sha256 is
#      refused there (exit 2) before anything trains,
#   2. run a study with megatron-s2-sweep on it (resumable: run the script again), and
#   3. megatron-s2-eval-long-context on each point as soon as its training finished, through the
#      sweep's --after: in the point's own slot (its GPUs), before that slot's next point starts,
#      so that an evaluation never shares a GPU with a training run (whose tokens/s is a result)
#      and a run cut off later (a GPU lease ending) keeps the evaluations of the points finished
#      before: loss by token position on held-out documents (at the run's own sequence length
#      unless EVAL_ARGS gives --lengths), and passkey / needle retrieval if EVAL_ARGS asks for it;
#      output in each run's long_context_eval.log. After the sweep, every finished point still
#      without its curve is evaluated (the catch-up: runs trained before, a failed evaluation),
#   4. one plot of those curves and the study's table and plots.
#
#   tools/run_code_study.sh [STUDY] [BUILD OPTION ...]
#
# STUDY: default configs/studies/code-125m-attention.yaml. Environment: CORPUS (data/code),
# PYTHON (python), POSITION_SEQUENCES (64), EVAL_ARGS (options of megatron-s2-eval-long-context;
# default --skip-retrieval: loss by position only), SWEEP_ARGS (options of megatron-s2-sweep run,
# e.g. "--devices 0,1" for two points at a time; each point's evaluation runs on its GPUs),
# EVAL_DEVICES (e.g. 0,1: the catch-up evaluations one per GPU at a time, their output in each
# run's long_context_eval.log; default one after another, on the console), ADOPT_FROM (a study
# YAML: before the sweep, `megatron-s2-sweep adopt --from ADOPT_FROM` takes its finished runs that
# trained exactly what a point asks, so that a shared arm trains once; docs/sweeps.md) and
# ADOPT_RUNS (where those runs are, e.g. a committed copy; default its output_dir), OUTPUT_DIR (the
# study's runs, table and corpus record there instead of its output_dir: e.g. a rerun of some of a
# study's points beside the committed runs, not over them; passed to the sweep as --output-dir;
# a relative path is from the repository's root, as CORPUS).
# Extra arguments go to
# tools/build_code_corpus.py. Exit status: non-zero if a step failed, an evaluation during the
# sweep included (the sweep's own exit code 3), even where the catch-up then redid it.
#
#   tools/run_code_study.sh --evaluate-run RUN    (the sweep's --after, not for use by hand)
#
# evaluates one run (skipped if it has its curve), on the GPUs it is given, into
# RUN/long_context_eval.log, with the settings above from the environment it inherits.
set -euo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/.."
CORPUS=${CORPUS:-data/code}
PYTHON=${PYTHON:-python}
read -r -a eval_args <<< "${EVAL_ARGS:---skip-retrieval}"
evaluate() {  # RUN: the evaluator on the run's checkpoints, on the GPUs this process sees
    "$PYTHON" -m megatron_s2.training.evaluation.long_context --checkpoint "$1/checkpoints" \
        "${eval_args[@]}" --position-sequences "${POSITION_SEQUENCES:-64}"
}
# A run finished in an earlier GPU lease whose raw output (summary, metrics) was carried in to
# complete the study has no checkpoint here: they did not outlive that lease.
has_checkpoint() { compgen -G "$1/checkpoints/iter_*" > /dev/null; }
if [[ ${1:-} == --evaluate-run ]]; then
    run=$2
    if [[ -f "$run/long_context_eval/loss_by_position.json" ]]; then
        echo "$run: evaluated already"
        exit 0
    fi
    if ! has_checkpoint "$run"; then
        echo "$run: no checkpoint here (trained elsewhere, or saved none), not evaluated"
        exit 0
    fi
    echo "evaluating $run (GPUs: ${CUDA_VISIBLE_DEVICES:-all}); output in $run/long_context_eval.log"
    evaluate "$run" > "$run/long_context_eval.log" 2>&1  # set -e: its exit status is ours
    exit 0
fi
STUDY=${1:-configs/studies/code-125m-attention.yaml}
shift || true

if [[ ! -f "$CORPUS/corpus.json" ]]; then
    echo "== building the code corpus in $CORPUS"
    "$PYTHON" tools/build_code_corpus.py --out "$CORPUS" "$@"
fi
read -r -a OVERRIDES < <("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['overrides'])" "$CORPUS/corpus.json")
echo "== corpus overrides: ${OVERRIDES[*]}"

echo "== study $STUDY"
if [[ -n "${OUTPUT_DIR:-}" ]]; then
    OUT=$OUTPUT_DIR
    output_args=(--output-dir "$OUTPUT_DIR")
else
    OUT=$("$PYTHON" - "$STUDY" "${OVERRIDES[@]}" <<'PY'
import sys
from megatron_s2.training.sweep import load_study
print(load_study(sys.argv[1], extra_overrides=sys.argv[2:]).output_dir)
PY
)
    output_args=()
fi
echo "== output: $OUT"
# The corpus is part of a study's result: seed k of every point must train on the same files
# for the pairing by seed to hold, and the corpus is built from this machine's interpreter. So
# the study's folder keeps the corpus.json its runs trained on (written by the first run here),
# and a later run (another GPU lease or machine, the finished runs carried in with it) refuses a
# corpus with another file list before anything trains.
"$PYTHON" - "$CORPUS/corpus.json" "$OUT/corpus.json" <<'PY' || exit 2
import json, os, shutil, sys
built, recorded = sys.argv[1:]
if not os.path.exists(recorded):
    os.makedirs(os.path.dirname(recorded), exist_ok=True)
    shutil.copyfile(built, recorded)
    sys.exit(0)
with open(built) as f, open(recorded) as g:
    mine, theirs = json.load(f).get("manifest_sha256"), json.load(g).get("manifest_sha256")
if mine != theirs:
    sys.exit(
        f"run_code_study: the corpus in {os.path.dirname(built)} (manifest_sha256 {mine}) is "
        f"not the one this study's runs trained on ({recorded}: manifest_sha256 {theirs}); new "
        "runs would not pair by seed with them. Build the corpus from the interpreter the "
        "study used (docs/code_corpus.md, 'Checking a rebuild'), or start the study in a new "
        "output_dir."
    )
PY
status=0
if [[ -n "${ADOPT_FROM:-}" ]]; then
    adopt_args=(--from "$ADOPT_FROM")
    [[ -n "${ADOPT_RUNS:-}" ]] && adopt_args+=(--from-runs "$ADOPT_RUNS")
    "$PYTHON" -m megatron_s2.training.sweep adopt "$STUDY" "${OVERRIDES[@]}" "${adopt_args[@]}" \
        "${output_args[@]}" || status=$?
fi
read -r -a sweep_args <<< "${SWEEP_ARGS:-}"
# Each point evaluated as soon as it has trained (this script again, as --evaluate-run).
after="bash $(printf %q "$SELF") --evaluate-run {run}"
"$PYTHON" -m megatron_s2.training.sweep run "$STUDY" "${OVERRIDES[@]}" --after "$after" \
    "${output_args[@]}" "${sweep_args[@]}" || status=$?

# The catch-up: the finished points still without their curve (trained before this script passed
# --after, or their evaluation failed during the sweep), where their checkpoints are. One after
# another, or with EVAL_DEVICES (GPU ids, e.g. 0,1) one per GPU at a time, each in the background
# with its own CUDA_VISIBLE_DEVICES and its output in its run's long_context_eval.log.
IFS=, read -r -a eval_devices <<< "${EVAL_DEVICES:-}"
pids=()
i=0
for run in "$OUT"/runs/*/; do
    run=${run%/}
    [[ -f "$run/summary.json" ]] || continue
    [[ -f "$run/long_context_eval/loss_by_position.json" ]] && continue
    if ! has_checkpoint "$run"; then
        echo "== not evaluated: $(basename "$run") has no checkpoint here" \
            "(trained elsewhere, or saved none)"
        continue
    fi
    echo "== evaluating: $(basename "$run")"
    if (( ${#eval_devices[@]} )); then
        if (( ${#pids[@]} >= ${#eval_devices[@]} )); then
            wait "${pids[0]}" || status=$?
            pids=("${pids[@]:1}")
        fi
        CUDA_VISIBLE_DEVICES=${eval_devices[i % ${#eval_devices[@]}]} evaluate "$run" \
            > "$run/long_context_eval.log" 2>&1 &
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
