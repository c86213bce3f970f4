#!/usr/bin/env bash
# One documented GPU study on a lent machine that keeps nothing after its lease (the device
# tool's machines: a call of at most 10 minutes, the machine warm ~30 s between calls, at most
# 64 MiB back a call). The study runs detached from the call that starts it; later calls poll it
# and bring back its results only (never checkpoints).
#
#   tools/lease.sh start JOB [ARG]   stage the trainer's wheels (tools/stage_flash_attn4.sh
#                                    device-trainer; carry .whl/train and .whl/mc016), then JOB
#                                    in the background; returns at once
#   tools/lease.sh poll SECONDS [EVERY]
#                                    wait until JOB ends or SECONDS pass (checking every EVERY
#                                    seconds, default 30), print its status, and pack
#                                    results/ and sweeps/ without checkpoints, data shards or
#                                    TensorBoard files into $OUT/r.tgz (written whole, then
#                                    renamed: a poll cut off mid-pack leaves the last archive)
#   tools/lease.sh jobs              the jobs
#
# JOBs, each the command its doc gives:
#   retrieval-hybrid-ds SEED   docs/long_context_eval.md, "Next leases" step 3: hybrid-DS
#                              trained from scratch on the long base (two GPUs), extended to
#                              32k and evaluated, about 20 minutes
#   retrieval-eod-first SEED   docs/long_context_eval.md, "Next leases" step 4b: the long base's
#                              twin and switch with EOD at every sample's first position
#                              (train.eod_first), about 22 minutes
#   retrieval-eod-first-screen SEED
#                              step 4b's screen where only one H200 is lent: the long base's
#                              twin with EOD first, its 4k base alone on one GPU, evaluated at
#                              4k (about 22 minutes)
#   retrieval-eod-first-one-gpu SEED
#                              step 4b's decision where only one H200 is lent: the twin with
#                              EOD first alone, its base and its 32k extension on one GPU,
#                              evaluated at 4k, 16k and 32k (about 27 minutes)
#   quality-reruns             docs/quality.md: the 100M study's reruns, GPU 0 SSSD then DS
#                              seed 1, GPU 1 dense then DS seed 2 (on a one-GPU machine all
#                              four in turn on GPU 0: dense, SSSD, DS seed 1, DS seed 2); runs
#                              finished in earlier leases (committed under
#                              docs/quality/<study>/reruns/) are carried in and not trained again
#   gpu-tests                  pytest -m gpu tests/plugin tests/training
#
# Environment: LEASE_STAGE=0 skips the staging (a machine that has the trainer's packages),
# LEASE_GPU_TEST (pytest arguments, e.g. "-m gpu tests/plugin tests/training") runs
# before the job, which does not start if they fail, PYTHON (python3), LEASE_GPUS (the GPU
# count; nvidia-smi's by default).
# Status: results/lease/status.log (a line a step, with the time), each step's output in
# results/lease/*.log, results/lease/DONE at the end (holding the job's exit status).
set -uo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/.."
LEASE=results/lease
export PYTHON=${PYTHON:-python3}

note() { echo "$(date -u +%T) $*" >> "$LEASE/status.log"; }
die() { echo "lease.sh: $*" >&2; exit 2; }

# retrieval SEED BASE_STUDY EXTEND_STUDY SETTINGS [BASE_SETTINGS [CHANGE...]]: the long base's
# command of docs/long_context_eval.md ("Next leases"), on two GPUs; an empty BASE_SETTINGS
# trains every arm's own base (an arm trained as a hybrid from the start); each CHANGE, an
# env(1) argument (NAME=VALUE, or -u NAME), replaces one of the command's settings.
retrieval() {
    [[ ${1:-} =~ ^[0-9]+$ ]] || die "a retrieval job needs a seed (a number), got '${1:-}'"
    local seed=$1 base=$2 extend=$3 settings=$4 base_settings=${5:-}
    shift $(( $# < 5 ? $# : 5 ))
    STATUS=$LEASE/status.log PYTHON=$PYTHON RETRIEVAL_TASKS=passkey,multikey \
    RETRIEVAL_WEIGHT=0.6 KV_WEIGHT=0.1 \
    RETRIEVAL_SPECS="4kmq:4094:4094:40000:16:32 4kpack:128:1024:24000:1:4:4096 32kmq:32766:32766:600:16:32 32kpack:512:8192:400:1:4:32768" \
    BASE_STUDY=$base BASE_TAG=4kmq,4kpack EXTEND_STUDIES=$extend EXTEND_TAG=32kmq,32kpack \
    SEEDS=$seed SETTINGS=$settings BASE_SETTINGS=$base_settings LENGTHS=4096,8192,16384,32768 \
    BASE_LENGTHS=4096 TASKS=passkey,multikey,code-value,needle TRIALS=20 DEVICES=0,1 \
    PROBE_LENGTH=32768 PROBE_TASKS=passkey,multikey RESULTS_DIR=results \
    env "$@" tools/run_extension_example.sh
}

job_retrieval_hybrid_ds() {  # SEED: step 3, hybrid-DS trained from scratch on the long base
    retrieval "${1:-}" retrieval-125m-4k-base-long retrieval-125m-extend-32k-longbase hybrid-DS
}

job_retrieval_eod_first_screen() {  # SEED: step 4b's screen at 4k where one H200 is lent
    # The long base's twin with EOD first, alone: its 4k base on one GPU (the two-process base's
    # global batch, micro-batches accumulated), only the 4k corpora of the long base's command
    # written, evaluated at 4k (with the probe there), no extension.
    retrieval "${1:-}" retrieval-125m-4k-base-long-eodfirst none dense dense -u EXTEND_TAG \
        RETRIEVAL_SPECS="4kmq:4094:4094:40000:16:32 4kpack:128:1024:24000:1:4:4096" \
        BASE_NPROC=1 LENGTHS=4096 DEVICES=0 PROBE_LENGTH=4096
}

job_retrieval_eod_first() {  # SEED: step 4b, the twin and the switch with EOD first
    retrieval "${1:-}" retrieval-125m-4k-base-long-eodfirst \
        retrieval-125m-extend-32k-longbase-eodfirst dense,dense-to-hybrid-DSDSDSDSSSDD dense
}

job_retrieval_eod_first_one_gpu() {  # SEED: step 4b's decision where only one H200 is lent
    # The twin alone, base and extension on one GPU (the base's two processes as accumulated
    # micro-batches, ~18 minutes): what the rule decides on (its depth-0 passkey at 16k and
    # 32k), with 8k and code-value left out to keep the whole inside one lease (~27 minutes).
    retrieval "${1:-}" retrieval-125m-4k-base-long-eodfirst \
        retrieval-125m-extend-32k-longbase-eodfirst dense dense \
        BASE_NPROC=1 DEVICES=0 LENGTHS=4096,16384,32768 TASKS=passkey,multikey,needle \
        PROBE_TASKS=passkey
}

# carry_runs FROM TO: the finished runs (summary.json at hand) of a committed study folder
# into a sweep's runs/, so that the sweep trains only what is missing.
carry_runs() {
    local from=$1 to=$2 r
    mkdir -p "$to"
    for r in "$from"/*/; do
        [[ -f $r/summary.json ]] && cp -r "$r" "$to"/
    done
    return 0
}

# quality_part GPU PART SELECTION...: on GPU, the 100M study's reruns of each SELECTION (sweep
# arguments) in turn into sweeps/<study>-rerun-PART; a sweep trains only its missing points.
quality_part() {
    local gpu=$1 part=$2 s=code-125m-16k-seeds-100m sel rc=0
    shift 2
    for sel in "$@"; do
        EVAL_DEVICES=$gpu OUTPUT_DIR=sweeps/$s-rerun-$part SWEEP_ARGS="--devices $gpu $sel" \
            POSITION_SEQUENCES=32 tools/run_code_study.sh "configs/studies/$s.yaml" \
            >> "$LEASE/rerun-$part.log" 2>&1 || rc=$?
        note "reruns $sel (GPU $gpu) exit $rc"
    done
    return $rc
}

job_quality_reruns() {
    local s=code-125m-16k-seeds-100m part parts=(a b) gpus rc=0
    gpus=$(gpu_count)
    (( gpus == 1 )) && parts=(a)
    "$PYTHON" tools/build_code_corpus.py --out data/code > "$LEASE/corpus.log" 2>&1 || return 1
    note "code corpus built"
    # Every finished rerun goes into each folder (each sweep's results.csv then holds them
    # all); the two sweeps train disjoint points, so they never train the same run.
    for part in "${parts[@]}"; do
        mkdir -p "sweeps/$s-rerun-$part"
        cp "docs/quality/$s/corpus.json" "sweeps/$s-rerun-$part/"
        carry_runs "docs/quality/$s/reruns/runs" "sweeps/$s-rerun-$part/runs"
    done
    # Two runs a GPU (about 10 minutes each with the loss by position): the eight reruns'
    # last four after the first lease (2026-12-01) trained dense and SSSD seeds 1-2. One GPU
    # (the kind lent may be a single H200) takes them in turn, about two a lease; what a
    # lease's end cuts off has no summary.json and is trained again by the next.
    if (( gpus == 1 )); then
        quality_part 0 a "--settings dense" "--settings hybrid-SSSD" \
            "--settings hybrid-DS --seeds 1" "--settings hybrid-DS --seeds 2"
        return
    fi
    quality_part 1 a "--settings dense" "--settings hybrid-DS --seeds 2" &
    quality_part 0 b "--settings hybrid-SSSD" "--settings hybrid-DS --seeds 1" || rc=$?
    wait $! || rc=$?
    return $rc
}

gpu_count() {  # the GPUs this machine has (LEASE_GPUS overrides, for tests)
    if [[ -n ${LEASE_GPUS:-} ]]; then echo "$LEASE_GPUS"; return; fi
    nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true
}

job_gpu_tests() {
    "$PYTHON" -m pytest -q -m gpu tests/plugin tests/training > "$LEASE/gpu-tests.log" 2>&1
}

run_job() {  # JOB [ARG]: the whole lease, in the background
    local job=$1 rc=0
    shift
    note "lease.sh $job $* starts"
    if [[ ${LEASE_STAGE:-1} != 0 ]]; then
        if ! bash tools/stage_flash_attn4.sh device-trainer > "$LEASE/stage.log" 2>&1; then
            note "SETUP_FAILED: staging (results/lease/stage.log)"
            echo 1 > "$LEASE/DONE"
            return
        fi
        eval "$(bash tools/stage_flash_attn4.sh device-env)"
        note "staged"
    fi
    if [[ -n ${LEASE_GPU_TEST:-} ]]; then
        # shellcheck disable=SC2086  # pytest arguments, one word each
        "$PYTHON" -m pytest -q $LEASE_GPU_TEST > "$LEASE/gpu-test.log" 2>&1 || rc=$?
        note "gpu test: $(tail -n 1 "$LEASE/gpu-test.log")"
        if (( rc != 0 )); then
            note "SETUP_FAILED: gpu test exit $rc (results/lease/gpu-test.log)"
            echo "$rc" > "$LEASE/DONE"
            return
        fi
    fi
    "job_${job//-/_}" "$@" || rc=$?
    note "job $job exit $rc"
    echo "$rc" > "$LEASE/DONE"
}

poll() {  # SECONDS [EVERY]
    local until=$((SECONDS + ${1:?poll SECONDS}))
    while (( SECONDS < until )) && [[ ! -f $LEASE/DONE ]]; do sleep "${2:-30}"; done
    tail -n 30 "$LEASE/status.log" 2>/dev/null
    command -v nvidia-smi > /dev/null \
        && nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader
    [[ -f $LEASE/DONE ]] && echo "LEASE_DONE exit $(cat "$LEASE/DONE")"
    [[ -n ${OUT:-} ]] || { echo "no \$OUT: nothing packed"; return 0; }
    local dirs=()
    for d in results sweeps; do [[ -d $d ]] && dirs+=("$d"); done
    tar czf "$OUT/r.tgz.part" --exclude=checkpoints --exclude='*.bin' --exclude='*.idx' \
        --exclude=tensorboard --exclude='*.distcp' "${dirs[@]}" \
        && mv "$OUT/r.tgz.part" "$OUT/r.tgz" && ls -l "$OUT/r.tgz"
}

JOBS="retrieval-hybrid-ds retrieval-eod-first retrieval-eod-first-screen retrieval-eod-first-one-gpu quality-reruns gpu-tests"
case ${1:-} in
    start)
        job=${2:-}
        [[ " $JOBS " == *" $job "* ]] || die "unknown job '$job'; jobs: $JOBS"
        [[ $job != retrieval-* || ${3:-} =~ ^[0-9]+$ ]] \
            || die "$job needs a seed (a number), got '${3:-}'"
        [[ -e $LEASE ]] && die "$LEASE exists: a lease ran here already (remove it to start again)"
        mkdir -p "$LEASE"
        shift
        setsid nohup bash "$SELF" _run "$@" > "$LEASE/lease.log" 2>&1 < /dev/null &
        sleep 1
        cat "$LEASE/status.log" 2> /dev/null || echo "started: $LEASE/status.log"
        ;;
    _run) shift; run_job "$@" ;;
    poll) shift; poll "$@" ;;
    jobs) echo "$JOBS" ;;
    *)
        sed -n '2,/^set -uo/p' "$SELF" | sed '$d; s/^# \{0,1\}//'
        [[ -z ${1:-} ]] || die "unknown command '$1'"
        exit 2
        ;;
esac
