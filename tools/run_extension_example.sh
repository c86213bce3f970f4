#!/usr/bin/env bash
# The worked context-extension example end to end on one GPU, or on several of one machine
# with DEVICES (docs/long_context_eval.md, "Worked example"):
#   1. the code corpus of this interpreter's own sources (tools/build_code_corpus.py) and, in its
#      tokenizer, the key-value recall corpus (tools/make_demo_corpus.py --tokenizer): long
#      documents whose statements are queried thousands of tokens later, blended into both
#      studies at KV_WEIGHT, and the retrieval training documents (tools/make_retrieval_corpus.py:
#      passkey and needle trials in the evaluation's formats, a training seed, needle haystacks
#      from the code corpus's training part; trials as long as each RETRIEVAL_SPECS entry
#      says, BASE_TAG's for the base study and EXTEND_TAG's for the extension) at RETRIEVAL_WEIGHT, so that the models learn the question-answer
#      format and the evaluation measures how far back they find it,
#   2. configs/studies/code-125m-4k-base.yaml: the dense model and its S2 hybrid at 4k,
#   3. megatron-s2-eval-long-context on each 4k model as soon as its training finished (the
#      sweep's --after: in the point's own slot, its GPU with DEVICES, before that slot's next
#      point starts, so that no evaluation shares a GPU with a training run, whose tokens/s is a
#      result, and a run cut off later, a GPU lease ending, keeps the finished points'
#      evaluations and, with RESULTS_DIR, their copies): retrieval (TASKS) over LENGTHS x five
#      depths, and loss by token position on held-out code (the kv corpus left out of the blend);
#      after the study, the runs still without an evaluation (trained before, or whose evaluation
#      failed) side by side on the GPU, or one per GPU with DEVICES (the catch-up); only then
#      the extension, whose tokens/s is a result,
#   4. each extension study (EXTEND_STUDIES; default configs/studies/code-125m-extend-16k.yaml,
#      the three 16k extensions): its points, each alone on its GPU, each evaluated the same way
#      as soon as it has trained, then the catch-up,
#   5. per study, one loss-by-position plot and retrieval_summary.md (tools/compare_retrieval.py:
#      its runs side by side).
#
#   tools/run_extension_example.sh     (from the checkout's root: the studies' paths are relative)
#
# Resumable: run it again and the finished studies' points and evaluations are skipped. Exit
# status: non-zero if a step failed, an evaluation during a sweep included (the sweep's exit code
# 3), even where the catch-up then redid it.
# Environment: BASE_STUDY (code-125m-4k-base), SEEDS (unset: every seed; e.g. 1,2), SETTINGS
# (unset: every arm; e.g. dense,hybrid-DS: the sweeps' --settings), BASE_SETTINGS (unset:
# SETTINGS; the base study's arms where they differ, e.g. dense for SETTINGS=dense,
# dense-to-hybrid-DS, whose extension loads the dense base), BASE_TAG (4k: the
# RETRIEVAL_SPECS tag blended into the base study; a comma list, e.g. 4kmq,4kpack, shares
# RETRIEVAL_WEIGHT evenly among its corpora), EXTEND_TAG (16k: the same for the extensions),
# RESULTS_DIR (unset; a folder: the
# evaluator's JSON of every run copied to RESULTS_DIR/<study>/<arm>/seed<k>/), PYTHON (python), CORPUS (data/code), KV_PREFIX (data/kv/kv_code), KV_WEIGHT (0.1),
# RETRIEVAL_PREFIX (data/retrieval/retrieval_code; _<TAG> of each RETRIEVAL_SPECS entry is
# appended), RETRIEVAL_WEIGHT
# (0.2; 0 leaves the retrieval documents out, as run E of the docs did with KV_WEIGHT 0.3),
# RETRIEVAL_SPECS (one TAG:MIN:MAX:DOCS[:QUERIES[:NEEDLES[:PACK]]] per corpus: trial lengths in
# tokens, document count, and optionally this corpus's own RETRIEVAL_QUERIES and
# RETRIEVAL_NEEDLES (empty: the defaults) and PACK, documents of PACK tokens each packed with
# whole trials, so that every training sample starts with one (make_retrieval_corpus.py
# --pack-to; DOCS then counts the packed documents); default "4k:256:4096:8000 16k:256:16384:2000"), RETRIEVAL_TASKS (passkey,needle),
# RETRIEVAL_NEEDLES (unset: the writer's 4; needles in a multikey document, 2-64) and
# RETRIEVAL_QUERIES (1; questions a multikey document asks, each followed by its answer, at most
# RETRIEVAL_NEEDLES: more answers per training token; passkey and needle documents ask one) for
# tools/make_retrieval_corpus.py --multikey-needles / --queries, RETRIEVAL_HAYSTACK (code: the
# needle and multikey documents hide their needles in the code corpus's training part,
# --haystack-corpus/--haystack-split with the corpus's data.blend and data.split, varied real
# code like the evaluation's held-out haystacks and never those; filler: the writer's one fixed
# filler text, the corpora of runs H and J; passkey keeps its filler either way),
# RETRIEVAL_DEPTH_DISTRIBUTION (unset: the writer's uniform; log-uniform or arcsine, its
# --depth-distribution: where the fact sits in its trial) (a corpus already
# written is kept: give another RETRIEVAL_PREFIX when changing them), WORKERS
# (processes writing trials: nproc), BASE_OVERRIDES and EXTEND_OVERRIDES (extra key=value
# overrides for every point of the base / extension study, space-separated, e.g.
# BASE_OVERRIDES=train.train_iters=1000), BASE_NPROC (unset: the base study's nproc_per_node;
# e.g. 1 to train a two-process base on one GPU, the same global batch with its micro-batches
# accumulated: the sweep's --nproc-per-node), EXTEND_STUDIES (the extension studies, names in
# configs/studies/, space-separated, run one after another; default code-125m-extend-16k;
# code-125m-extend-16k-remedies tries what closes the hybrid's retrieval gap; none: the base
# study alone, e.g. a base judged at its own length first, with only BASE_TAG's corpora
# written), EXTEND_MIN_ACCURACY
# (unset: always extend; else extend
# only if a 4k model's passkey exact-match accuracy, mean over its cells up to 4096 tokens,
# reaches it: an extension of models that do not retrieve at their own length cannot answer the
# example's question; decided after the base study's catch-up, from every 4k evaluation),
# DEVICES (GPU ids, e.g. 0,1: each study runs as many points at once as there are ids, one GPU
# each, through the sweep's --devices, each point's evaluation on its GPU; default one after
# another), LENGTHS (4096,8192,16384), BASE_LENGTHS (unset: LENGTHS; the base study's own, e.g.
# 4096 alone where lengths beyond the base's are known to score nothing), TASKS
# (kv-filler,passkey,needle), TRIALS (10), POSITION_SEQUENCES (64), PROBE_LENGTH (unset; one
# of LENGTHS: every evaluation whose lengths include it also runs --attention-probe at it,
# which layers look at the needle), PROBE_TASKS (unset: the first of TASKS; with PROBE_LENGTH,
# a comma list of TASKS to probe, e.g. passkey,multikey: --probe-tasks, each task after the
# first into attention_probe_<task>.json), PREFIX_EOD (unset; also: each evaluation is followed by a
# retrieval-only one of the same grid with every prompt behind the EOD token, --prefix-eod, into
# <run>/long_context_eval_eod/ and RESULTS_DIR/<study>-eod/), ZONE_DEPTHS (unset; e.g.
# 0,0.002,0.01,0.05: each extension-study run of an arm in ZONE_ARMS (dense) is evaluated once
# more, retrieval only, at these needle depths, at ZONE_LENGTHS (unset: LENGTHS; each one of
# LENGTHS) on ZONE_TASKS (unset: TASKS), into <run>/long_context_eval_zone/ and
# RESULTS_DIR/<study>-zone/: where near the context's start retrieval fails). Progress, one line per step, in
# STATUS (example_status.log). Measured
# on one H200: 18 minutes in all (corpora 2, base 8, extension 7, evaluations 2).
#
#   tools/run_extension_example.sh --evaluate-run RUN STUDY [OPTION ...]   (the sweeps' --after)
#
# evaluates one run (skipped if evaluated already; OPTIONs go to the evaluator), on the GPUs it is
# given, and copies its results to RESULTS_DIR, with the settings above from the environment it
# inherits; not for use by hand.
set -uo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
ROOT=$(dirname "$0")/..
PYTHON=${PYTHON:-python}
CORPUS=${CORPUS:-data/code}
KV_PREFIX=${KV_PREFIX:-data/kv/kv_code}
KV_WEIGHT=${KV_WEIGHT:-0.1}
RETRIEVAL_PREFIX=${RETRIEVAL_PREFIX:-data/retrieval/retrieval_code}
RETRIEVAL_WEIGHT=${RETRIEVAL_WEIGHT:-0.2}
RETRIEVAL_SPECS=${RETRIEVAL_SPECS:-4k:256:4096:8000 16k:256:16384:2000}
RETRIEVAL_TASKS=${RETRIEVAL_TASKS:-passkey,needle}
RETRIEVAL_QUERIES=${RETRIEVAL_QUERIES:-1}
RETRIEVAL_NEEDLES=${RETRIEVAL_NEEDLES:-}
RETRIEVAL_HAYSTACK=${RETRIEVAL_HAYSTACK:-code}
PREFIX_EOD=${PREFIX_EOD:-}
ZONE_DEPTHS=${ZONE_DEPTHS:-}
ZONE_ARMS=${ZONE_ARMS:-dense}
LENGTHS=${LENGTHS:-4096,8192,16384}
RETRIEVAL_DEPTH_DISTRIBUTION=${RETRIEVAL_DEPTH_DISTRIBUTION:-}
WORKERS=${WORKERS:-$(nproc 2>/dev/null || echo 1)}
read -r -a BASE_EXTRA <<< "${BASE_OVERRIDES:-}"
read -r -a EXTEND_EXTRA <<< "${EXTEND_OVERRIDES:-}"
DEVICES=${DEVICES:-}
DEVICES=${DEVICES// /}  # "0, 1" as "0,1": the ids become CUDA_VISIBLE_DEVICES as they are
SWEEP_DEVICES=()
[[ -n "$DEVICES" ]] && SWEEP_DEVICES=(--devices "$DEVICES")
STATUS=${STATUS:-example_status.log}
# The base study (configs/studies/NAME.yaml) and, with SEEDS (e.g. "1" or "1,2"), only those seeds
# of studies that have a seeds list (the extension then loads the base run of the same seed:
# `{seed}` in its checkpoint.load_dir).
BASE_NAME=${BASE_STUDY:-code-125m-4k-base}
BASE=$ROOT/configs/studies/$BASE_NAME.yaml
SEED_ARGS=()
[[ -n "${SEEDS:-}" ]] && SEED_ARGS=(--seeds "$SEEDS")
# SETTINGS (e.g. dense,hybrid-DS): only these arms of the base and extension studies;
# BASE_SETTINGS, where the base study's arms differ (an extension arm that loads another arm's
# base, e.g. dense-to-hybrid-DS from dense: BASE_SETTINGS=dense).
BASE_SEED_ARGS=("${SEED_ARGS[@]}")
[[ -n "${SETTINGS:-}" ]] && SEED_ARGS+=(--settings "$SETTINGS")
BASE_SETTINGS=${BASE_SETTINGS:-${SETTINGS:-}}
[[ -n "$BASE_SETTINGS" ]] && BASE_SEED_ARGS+=(--settings "$BASE_SETTINGS")
# The retrieval corpus (a RETRIEVAL_SPECS tag) blended into the extension studies.
EXTEND_TAG=${EXTEND_TAG:-16k}
BASE_TAG=${BASE_TAG:-4k}
# Extension studies (configs/studies/NAME.yaml), run one after another from the same 4k models;
# none: the base study alone.
read -r -a EXTEND_NAMES <<< "${EXTEND_STUDIES:-code-125m-extend-16k}"
BASE_ONLY=0
[[ ${EXTEND_NAMES[*]-} == none ]] && { EXTEND_NAMES=(); BASE_ONLY=1; }
BASE_NPROC_ARGS=()
[[ -n "${BASE_NPROC:-}" ]] && BASE_NPROC_ARGS=(--nproc-per-node "$BASE_NPROC")
status=0
note() { echo "$(date +%T) $*" | tee -a "$STATUS"; }
read_corpus() {  # OVERRIDES: the code corpus's own overrides; CODE: the corpus in them
    read -r -a OVERRIDES < <("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['overrides'])" "$CORPUS/corpus.json")
    CODE=$(printf '%s\n' "${OVERRIDES[@]}" | sed -n 's/^data.blend=\[\(.*\)\]$/\1/p')
}
evaluate() {  # RUN STUDY [extra options]: held-out code only, for the loss by position.
    local run=$1 study=$2 lengths=$LENGTHS rc=0
    [[ $2 == "$BASE_NAME" && -n ${BASE_LENGTHS:-} ]] && lengths=$BASE_LENGTHS
    shift 2
    # Both protocols' evaluations: the run's checkpoint, the grid, the options given.
    local evaluator=("$PYTHON" -m megatron_s2.training.evaluation.long_context
        --checkpoint "$run/checkpoints" --lengths "$lengths"
        --tasks "${TASKS:-kv-filler,passkey,needle}" --trials "${TRIALS:-10}" "$@") probe=()
    # The probe where its length is evaluated: not on a base evaluated at 4k alone.
    [[ -n ${PROBE_LENGTH:-} && ,$lengths, == *,$PROBE_LENGTH,* ]] && probe=(--attention-probe "$PROBE_LENGTH")
    [[ ${#probe[@]} -gt 0 && -n ${PROBE_TASKS:-} ]] && probe+=(--probe-tasks "$PROBE_TASKS")
    if [[ ! -f "$run/long_context_eval/loss_by_position.json" ]]; then
        "${evaluator[@]}" --position-sequences "${POSITION_SEQUENCES:-64}" "${probe[@]}" \
            "data.blend=[$CODE]" > "$run/long_context_eval.log" 2>&1
        rc=$?
        note "evaluated $run (exit $rc; output in $run/long_context_eval.log)"
    fi
    if ((rc == 0)) && [[ $PREFIX_EOD == also && ! -f "$run/long_context_eval_eod/retrieval.json" ]]; then
        # The same trials once more (their needles and values), each behind the EOD token.
        "${evaluator[@]}" --prefix-eod --skip-position --output-dir "$run/long_context_eval_eod" \
            "data.blend=[$CODE]" > "$run/long_context_eval_eod.log" 2>&1
        rc=$?
        note "evaluated $run with --prefix-eod (exit $rc; output in $run/long_context_eval_eod.log)"
    fi
    if ((rc == 0)) && [[ -n $ZONE_DEPTHS && $study != "$BASE_NAME" && ,$ZONE_ARMS, == *,$(arm_of "$run"),* &&
        ! -f "$run/long_context_eval_zone/retrieval.json" ]]; then
        # The first tokens' zone: the same run, retrieval only, at the depths near 0.
        "$PYTHON" -m megatron_s2.training.evaluation.long_context --checkpoint "$run/checkpoints" \
            --lengths "${ZONE_LENGTHS:-$lengths}" --depths "$ZONE_DEPTHS" \
            --tasks "${ZONE_TASKS:-${TASKS:-kv-filler,passkey,needle}}" --trials "${TRIALS:-10}" \
            --skip-position --output-dir "$run/long_context_eval_zone" "$@" \
            "data.blend=[$CODE]" > "$run/long_context_eval_zone.log" 2>&1
        rc=$?
        note "evaluated $run at depths $ZONE_DEPTHS (exit $rc; output in $run/long_context_eval_zone.log)"
    fi
    return $rc
}
arm_of() {  # RUN: the arm of a sweep's run directory (its point name without ",seed=<k>")
    local point
    point=$(basename "${1%/}")
    echo "${point%%,seed=*}"
}
copy_results() {  # STUDY RUN: with RESULTS_DIR, RUN's evaluator JSON to RESULTS_DIR/<study>/<arm>/seed<k>/
    local study=$1 run=${2%/} point arm seed extra
    [[ -n "${RESULTS_DIR:-}" && -f "$run/long_context_eval/retrieval.json" ]] || return 0
    point=$(basename "$run")
    arm=$(arm_of "$run")
    seed=seed0  # a run without a seed
    [[ $point == *,seed=* ]] && seed=seed${point##*,seed=}
    mkdir -p "$RESULTS_DIR/$study/$arm/$seed" &&
        cp "$run"/long_context_eval/*.json "$RESULTS_DIR/$study/$arm/$seed/" || return
    # The EOD-prefixed evaluation and the zone near the start (ZONE_DEPTHS, its own depths) are
    # study directories of their own: tables never mix protocols or depth grids.
    for extra in eod zone; do
        [[ -f "$run/long_context_eval_$extra/retrieval.json" ]] || continue
        mkdir -p "$RESULTS_DIR/$study-$extra/$arm/$seed" &&
            cp "$run/long_context_eval_$extra/retrieval.json" "$RESULTS_DIR/$study-$extra/$arm/$seed/" ||
            return
    done
}
if [[ ${1:-} == --evaluate-run ]]; then
    # The sweeps' --after (below): the run just trained, on the GPU its point had; its results
    # copied at once, so that they outlive a run cut off later.
    run=$2 study=$3
    shift 3
    read_corpus
    evaluate "$run" "$study" "$@"
    rc=$?
    copy_results "$study" "$run" || rc=$((rc ? rc : 1))
    exit "$rc"
fi
after() {  # STUDY [extra options]: the sweep's --after that evaluates each point of STUDY
    printf 'bash %q --evaluate-run {run} %q' "$SELF" "$1"
    shift
    if (($#)); then printf ' %q' "$@"; fi
}
# Before any work: a misspelt setting would otherwise stop the script later.
if [[ $RETRIEVAL_HAYSTACK != code && $RETRIEVAL_HAYSTACK != filler ]]; then
    note "RETRIEVAL_HAYSTACK must be code or filler, got '$RETRIEVAL_HAYSTACK'"
    exit 2
fi
case $RETRIEVAL_DEPTH_DISTRIBUTION in
    "" | uniform | log-uniform | arcsine) ;;
    *)
        note "RETRIEVAL_DEPTH_DISTRIBUTION must be uniform, log-uniform or arcsine, got" \
            "'$RETRIEVAL_DEPTH_DISTRIBUTION'"
        exit 2
        ;;
esac
if [[ -n ${PROBE_LENGTH:-} && ,$LENGTHS, != *,$PROBE_LENGTH,* ]]; then
    # Probed only where evaluated (the base with BASE_LENGTHS may skip it; the extension not).
    note "PROBE_LENGTH must be one of LENGTHS ($LENGTHS), got '$PROBE_LENGTH'"
    exit 2
fi
each_one_of() {  # NAME LIST ALLOWED_NAME ALLOWED: every item of the comma list LIST is one of ALLOWED, else exit 2
    local item items
    IFS=, read -r -a items <<< "$2"
    for item in "${items[@]}"; do
        if [[ ,$4, != *,$item,* ]]; then
            note "$1: '$item' is not one of $3 ($4)"
            exit 2
        fi
    done
}
if [[ -n ${PROBE_TASKS:-} ]]; then
    # Checked here, before any training: the evaluator would refuse it only after the runs.
    if [[ -z ${PROBE_LENGTH:-} ]]; then
        note "PROBE_TASKS needs PROBE_LENGTH (the probe's length, one of LENGTHS)"
        exit 2
    fi
    each_one_of PROBE_TASKS "$PROBE_TASKS" TASKS "${TASKS:-kv-filler,passkey,needle}"
fi
if [[ -n $PREFIX_EOD && $PREFIX_EOD != also ]]; then
    note "PREFIX_EOD must be empty or also, got '$PREFIX_EOD'"
    exit 2
fi
if [[ -n $ZONE_DEPTHS ]]; then
    IFS=, read -r -a zone_list <<< "$ZONE_DEPTHS"
    for d in "${zone_list[@]}"; do
        # A decimal in [0, 1] (0, 0.002, .5, 1, 1.0), checked in the shell: before any work.
        if ! [[ $d =~ ^(0|0?\.[0-9]+|1|1\.0*)$ ]]; then
            note "ZONE_DEPTHS: '$d' is not a needle depth in [0, 1] (e.g. ZONE_DEPTHS=0,0.002,0.01,0.05)"
            exit 2
        fi
    done
    each_one_of ZONE_LENGTHS "${ZONE_LENGTHS:-$LENGTHS}" LENGTHS "$LENGTHS"
    each_one_of ZONE_TASKS "${ZONE_TASKS:-${TASKS:-kv-filler,passkey,needle}}" TASKS \
        "${TASKS:-kv-filler,passkey,needle}"
elif [[ -n ${ZONE_LENGTHS:-}${ZONE_TASKS:-} ]]; then
    note "ZONE_LENGTHS and ZONE_TASKS need ZONE_DEPTHS (the needle depths to evaluate, e.g. 0,0.002,0.01)"
    exit 2
fi
if ! (( ${#EXTEND_NAMES[@]} || BASE_ONLY )); then
    note "EXTEND_STUDIES names no study (give study names, or none for the base study alone)"
    exit 2
fi
if (( BASE_ONLY )) && [[ -n ${ZONE_DEPTHS}${EXTEND_MIN_ACCURACY:-} ]]; then
    note "ZONE_DEPTHS and EXTEND_MIN_ACCURACY act on the extension studies; EXTEND_STUDIES=none" \
        "runs none: leave them unset"
    exit 2
fi
if [[ -n "${BASE_NPROC:-}" && ! $BASE_NPROC =~ ^[1-9][0-9]*$ ]]; then
    note "BASE_NPROC: '$BASE_NPROC' is not a number of processes >= 1 (e.g. BASE_NPROC=1)"
    exit 2
fi
for study in "$BASE_NAME" "${EXTEND_NAMES[@]}"; do
    if [[ ! -f "$ROOT/configs/studies/$study.yaml" ]]; then
        note "EXTEND_STUDIES: no study $study (configs/studies/$study.yaml); there are:" \
            "$(cd "$ROOT/configs/studies" && ls -- *.yaml | sed 's/[.]yaml$//' | paste -sd' ' -)"
        exit 2
    fi
done

if [[ ! -f "$CORPUS/corpus.json" ]]; then
    "$PYTHON" "$ROOT"/tools/build_code_corpus.py --out "$CORPUS" || exit
    note "code corpus built in $CORPUS"
fi
read_corpus
if [[ ! -f "$KV_PREFIX.idx" ]]; then
    # 8k-64k characters: in the code tokenizer 2k-16k tokens, so that a query can be far from
    # its definition at every training length.
    "$PYTHON" "$ROOT"/tools/make_demo_corpus.py --tokenizer "$CORPUS/tokenizer" --output-prefix "$KV_PREFIX" \
        --num-docs 1000 --min-chars 8000 --max-chars 64000 --seed 1 || exit
    note "key-value corpus written to $KV_PREFIX"
fi
with_retrieval=$("$PYTHON" -c "import sys; print(int(float(sys.argv[1]) > 0))" "$RETRIEVAL_WEIGHT")
HAYSTACK_ARGS=()
if [[ $RETRIEVAL_HAYSTACK == code ]]; then
    # The corpus the runs train on, its training part only (the run's own split): the
    # evaluation's haystacks are its held-out part.
    read -r -a code_prefixes <<< "${CODE//,/ }"
    code_split=$(printf '%s\n' "${OVERRIDES[@]}" | sed -n 's/^data.split=//p' | tail -n 1)
    HAYSTACK_ARGS=(--haystack-corpus "${code_prefixes[@]}" --haystack-split "$code_split")
fi
if [[ $with_retrieval == 1 ]]; then
    # One corpus per study, trials at most the study's sequence length (plus the answer's last
    # token and EOD): most then fit in one sample; one cut across samples trains no answer.
    for spec in $RETRIEVAL_SPECS; do
        # Optional fifth and sixth fields: this corpus's own queries and needles (a short-trial
        # corpus cannot hold the many needles of a one-sample one in the same study).
        IFS=: read -r tag min_tokens max_tokens num_docs queries needles pack <<< "$spec"
        # A base-only run (EXTEND_STUDIES=none) writes the base study's corpora alone.
        if (( BASE_ONLY )) && [[ ,$BASE_TAG, != *,$tag,* ]]; then
            continue
        fi
        queries=${queries:-$RETRIEVAL_QUERIES}
        needles=${needles:-$RETRIEVAL_NEEDLES}
        # A corpus written before (cached by RETRIEVAL_PREFIX) is kept only if it was written
        # as asked now: the writer's --reuse compares its own metadata, and refuses otherwise.
        had=0
        [[ -f "${RETRIEVAL_PREFIX}_$tag.idx" ]] && had=1
        err=$(mktemp)
        "$PYTHON" "$ROOT"/tools/make_retrieval_corpus.py --tokenizer "$CORPUS/tokenizer" \
            --output-prefix "${RETRIEVAL_PREFIX}_$tag" --tasks "$RETRIEVAL_TASKS" \
            --queries "$queries" ${needles:+--multikey-needles "$needles"} \
            ${pack:+--pack-to "$pack"} \
            ${RETRIEVAL_DEPTH_DISTRIBUTION:+--depth-distribution "$RETRIEVAL_DEPTH_DISTRIBUTION"} \
            --min-tokens "$min_tokens" --max-tokens "$max_tokens" --num-docs "$num_docs" \
            --workers "$WORKERS" --seed 1 "${HAYSTACK_ARGS[@]}" --reuse 2> "$err"
        rc=$?
        cat "$err" >&2
        why=$(tail -n 1 "$err")
        rm -f "$err"
        if [[ $rc != 0 ]]; then
            if [[ $had == 1 ]]; then
                note "RETRIEVAL_SPECS $tag: ${why#make_retrieval_corpus: error: }; or give" \
                    "another RETRIEVAL_PREFIX"
            fi
            exit "$rc"
        fi
        if [[ $had == 1 ]]; then
            note "retrieval training documents in ${RETRIEVAL_PREFIX}_$tag reused (written before" \
                "with these settings)"
        else
            note "retrieval training documents written to ${RETRIEVAL_PREFIX}_$tag"
        fi
    done
fi
# After the corpus's own overrides, which name the code corpus alone.
CODE_WEIGHT=$("$PYTHON" -c "import sys; print(round(1 - float(sys.argv[1]) - float(sys.argv[2]), 6))" \
    "$KV_WEIGHT" "$RETRIEVAL_WEIGHT")
blend() {  # TAGS: the study's data.blend override (TAGS: its retrieval corpora, a comma list)
    local parts="[$CODE_WEIGHT, $CODE], [$KV_WEIGHT, $KV_PREFIX]" tags tag share
    if [[ $with_retrieval == 1 ]]; then
        IFS=, read -r -a tags <<< "$1"
        share=$("$PYTHON" -c "import sys; print(round(float(sys.argv[1]) / int(sys.argv[2]), 6))" \
            "$RETRIEVAL_WEIGHT" "${#tags[@]}")
        for tag in "${tags[@]}"; do
            parts+=", [$share, ${RETRIEVAL_PREFIX}_$tag]"
        done
    fi
    echo "data.blend=[$parts]"
}

# Lengths above the 4k the models were trained at: that is the "before extension" column.
"$PYTHON" -m megatron_s2.training.sweep run "$BASE" "${OVERRIDES[@]}" "$(blend "$BASE_TAG")" "${BASE_EXTRA[@]}" \
    --after "$(after "$BASE_NAME" --allow-extrapolation)" "${SWEEP_DEVICES[@]}" "${BASE_SEED_ARGS[@]}" \
    "${BASE_NPROC_ARGS[@]}" || status=$?
note "base study done (exit $status)"
evaluate_study() {  # STUDY [extra options]: the catch-up, side by side on the GPU(s)
    local study=$1 pids=() pid ids=() i=0
    shift
    [[ -n "$DEVICES" ]] && IFS=, read -r -a ids <<< "$DEVICES"
    for run in sweeps/"$study"/runs/*/; do
        if (( ${#ids[@]} )); then
            CUDA_VISIBLE_DEVICES=${ids[i % ${#ids[@]}]} evaluate "${run%/}" "$study" "$@" &
        else
            evaluate "${run%/}" "$study" "$@" &
        fi
        pids+=($!)
        i=$((i + 1))
    done
    for pid in "${pids[@]}"; do
        wait "$pid" || status=$?
    done
}
# The 4k runs the sweep's --after did not evaluate (trained before, or their evaluation failed).
# Before the extension, not beside it: the extension's tokens/s (S2 vs dense) is a result, and an
# evaluation sharing the GPU would distort it.
evaluate_study "$BASE_NAME" --allow-extrapolation
if [[ -n "${EXTEND_MIN_ACCURACY:-}" ]]; then
    # Prints the best 4k model's passkey accuracy up to 4096 tokens; fails below the threshold.
    if ! best=$("$PYTHON" -c '
import json, sys
scores = []
for path in sys.argv[2:]:
    try:
        cells = json.load(open(path))["tasks"]["passkey"]["cells"]
    except (OSError, KeyError, ValueError):
        continue
    acc = [c["accuracy"] for c in cells if c["length"] <= 4096]
    if acc:
        scores.append(sum(acc) / len(acc))
best = max(scores, default=0.0)
print(best)
sys.exit(best < float(sys.argv[1]))' "$EXTEND_MIN_ACCURACY" \
        sweeps/"$BASE_NAME"/runs/*/long_context_eval/retrieval.json); then
        note "extension skipped: the best 4k model's passkey accuracy up to 4096 tokens is $best," \
            "below EXTEND_MIN_ACCURACY=$EXTEND_MIN_ACCURACY"
        exit "$status"
    fi
fi
for study in "${EXTEND_NAMES[@]}"; do
    "$PYTHON" -m megatron_s2.training.sweep run "$ROOT/configs/studies/$study.yaml" "${OVERRIDES[@]}" \
        "$(blend "$EXTEND_TAG")" "${EXTEND_EXTRA[@]}" --after "$(after "$study")" \
        "${SWEEP_DEVICES[@]}" "${SEED_ARGS[@]}" || status=$?
    note "extension study $study done (exit $status)"
    evaluate_study "$study"
done
for study in "$BASE_NAME" "${EXTEND_NAMES[@]}"; do
    "$PYTHON" "$ROOT"/tools/plot_loss_by_position.py --out "sweeps/$study/loss_by_position.png" \
        sweeps/$study/runs/*/long_context_eval/loss_by_position.json || status=$?
    # The study's runs side by side: retrieval per length, by depth at 8k, loss by position.
    "$PYTHON" "$ROOT"/tools/compare_retrieval.py --depth-table 8192 sweeps/"$study"/runs/*/ \
        > "sweeps/$study/retrieval_summary.md" || status=$?
done
if [[ -n "${RESULTS_DIR:-}" ]]; then
    # The evaluator's own files of every evaluated run, as RESULTS_DIR/<study>/<arm>/seed<k>/
    # (a run without a seed: seed0), for the docs and tools/retrieval_tables.py.
    # The sweeps' --after copied each run as it was evaluated; these are the catch-up's.
    for study in "$BASE_NAME" "${EXTEND_NAMES[@]}"; do
        for run in sweeps/"$study"/runs/*/; do
            copy_results "$study" "$run" || status=$?
        done
        # The sweep's table beside the arms, so that `tools/retrieval_tables.py
        # RESULTS_DIR/<study> --goal` finds its tokens/s (this lease's runs only).
        if [[ -f sweeps/$study/results.csv && -d $RESULTS_DIR/$study ]]; then
            cp "sweeps/$study/results.csv" "$RESULTS_DIR/$study/" || status=$?
        fi
    done
    note "evaluator outputs and the studies' results.csv copied to $RESULTS_DIR"
fi
note "all done (exit $status): sweeps/$BASE_NAME${EXTEND_NAMES[*]:+ $(printf 'sweeps/%s ' "${EXTEND_NAMES[@]}")}"
exit "$status"
