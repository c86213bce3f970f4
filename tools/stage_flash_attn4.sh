#!/usr/bin/env bash
# Carry FlashAttention-4 (the `flash-attn-4` package, `flash_attn.cute`) to a lent GPU machine,
# which has no package index. Also installs the trainer's missing wheels there.
#
# Here (a machine with pip and the package index), once; the files stay in the git-ignored .whl/:
#   tools/stage_flash_attn4.sh download   # cp312 manylinux x86_64 wheels -> .whl/fa4/wheels/
#   tools/stage_flash_attn4.sh pack       # -> .whl/fa4/call1/ and .whl/fa4/call2/ (< 64 MiB each)
#   tools/stage_flash_attn4.sh sizes      # what each call carries
# There, in two back-to-back device calls (a machine stays warm ~30 s after a call, and /tmp
# survives only while it stays warm):
#   call 1, carry [".whl/fa4/call1"]:  bash tools/stage_flash_attn4.sh device-stash
#   call 2, carry [".whl/fa4/call2"]:  bash tools/stage_flash_attn4.sh device-install \
#                                        && eval "$(bash tools/stage_flash_attn4.sh device-env)"
# our package (editable, offline):   bash tools/stage_flash_attn4.sh device-project
# and, for the end-to-end runs, carry [".whl/train", ".whl/mc016"] and run
#   bash tools/stage_flash_attn4.sh device-trainer   (trainer wheels + device-project)
# Every later command in the same warm machine starts with the device-env line.
#
# Why the split: the cu13 libraries wheel of nvidia-cutlass-dsl is 92 MB, over the 64 MiB a
# device call may carry. Repacked as tar.xz it is ~59 MiB (62 MB), still too much next to the other
# wheels, so it travels in two parts over two calls; the first part waits in /tmp.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FA4=$REPO/.whl/fa4
WHEELS=$FA4/wheels
CALL1=$FA4/call1
CALL2=$FA4/call2
LIBS_TAR=cu13-libs.tar.xz
# Under the per-call limit (64 MiB = 67108864 bytes) with the repository beside it.
PART_BYTES=32000000
# Device side: where part one waits, and where the packages go (not site-packages: a fresh
# machine each session, and --target keeps the image's own packages untouched).
STASH=${FA4_STASH:-/tmp/fa4-parts}
FA4_SITE=${FA4_SITE:-/tmp/fa4site}
TRAIN_SITE=${TRAIN_SITE:-/tmp/site}

# Versions known to work together on the lent machines (torch 2.11+cu130, Python 3.12; see
# ../shared/notes/s2-design-notes.md). One version of each: two stop a --no-deps install.
PACKAGES=(
  flash-attn-4==4.0.0b36
  nvidia-cutlass-dsl==4.8.1
  nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1
  nvidia-cutlass-dsl-libs-cu13==4.8.1
  quack-kernels==0.6.5
  apache-tvm-ffi==0.1.15.post2
  torch-c-dlpack-ext==0.1.5
)
# The trainer's wheels that the machines lack (megatron-core 0.16.1 as CI tests it).
TRAIN_PACKAGES=(datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
MEGATRON_CORE=megatron-core==0.16.1
# PLATFORMS and pip_download
. "$REPO/tools/device_wheels.sh"

die() { echo "stage_flash_attn4: $*" >&2; exit 1; }

cmd_download() {
  pip_download "$WHEELS" "${PACKAGES[@]}"
  ls -l "$WHEELS"
}

cmd_download_trainer() {
  [ -n "$(ls "$REPO"/.whl/train/*.whl 2>/dev/null)" ] || pip_download "$REPO/.whl/train" "${TRAIN_PACKAGES[@]}"
  [ -n "$(ls "$REPO"/.whl/mc016/*.whl 2>/dev/null)" ] || pip_download "$REPO/.whl/mc016" "$MEGATRON_CORE"
  ls -l "$REPO"/.whl/train "$REPO"/.whl/mc016
}

cmd_pack() {
  local libs n
  libs=$(ls "$WHEELS"/nvidia_cutlass_dsl_libs_cu13-*.whl 2>/dev/null) || die "run download first"
  n=$(ls "$WHEELS"/*.whl | wc -l)
  [ "$n" -eq "${#PACKAGES[@]}" ] || die "expected ${#PACKAGES[@]} wheels in $WHEELS, found $n"
  rm -rf "$CALL1" "$CALL2" "$FA4/unpacked"
  mkdir -p "$CALL1" "$CALL2" "$FA4/unpacked"
  # The wheel's files as they would land in the install folder (a wheel is a zip of exactly
  # that), recompressed: xz -9e takes 92 MB to ~61 MiB where zip's deflate could not.
  python3 -m zipfile -e "$libs" "$FA4/unpacked"
  tar -C "$FA4/unpacked" -cf - . | xz -9e -T1 > "$FA4/$LIBS_TAR"
  rm -rf "$FA4/unpacked"
  (cd "$FA4" && sha256sum "$LIBS_TAR" > "$CALL2/$LIBS_TAR.sha256")
  split -b "$PART_BYTES" -a 2 "$FA4/$LIBS_TAR" "$FA4/$LIBS_TAR.part-"
  rm "$FA4/$LIBS_TAR"
  local parts=("$FA4/$LIBS_TAR".part-*)
  [ "${#parts[@]}" -eq 2 ] || die "expected 2 parts, got ${#parts[@]}: raise PART_BYTES or add a call"
  mv "${parts[0]}" "$CALL1/"
  mv "${parts[1]}" "$CALL2/"
  for w in "$WHEELS"/*.whl; do
    [ "$w" = "$libs" ] || cp "$w" "$CALL2/"
  done
  cmd_sizes
}

cmd_sizes() {
  local limit=67108864 repo total
  repo=$(cd "$REPO" && { git ls-files -z; git ls-files -z -o --exclude-standard; } \
    | xargs -0 -r stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
  for d in "$WHEELS" "$CALL1" "$CALL2"; do
    [ -d "$d" ] || continue
    echo "== ${d#"$REPO"/}"
    ls -l "$d" | awk 'NR > 1 {printf "%12d  %s\n", $5, $9}'
  done
  for d in "$CALL1" "$CALL2"; do
    [ -d "$d" ] || continue
    total=$(( $(du -sb "$d" | cut -f1) + repo ))
    printf '%s + working tree: %d bytes of %d (%s)\n' "${d#"$REPO"/}" "$total" "$limit" \
      "$([ "$total" -lt "$limit" ] && echo fits || echo 'TOO LARGE')"
  done
}

# ---- device side ---------------------------------------------------------------------------
cmd_device_stash() {
  local part
  part=$(ls "$CALL1"/$LIBS_TAR.part-* 2>/dev/null) || die "no $CALL1/$LIBS_TAR.part-*: carry .whl/fa4/call1"
  mkdir -p "$STASH"
  cp "$part" "$STASH/"
  ls -l "$STASH"
  echo "part one is in $STASH; make the next call (device-install) right away, while the machine is warm"
}

cmd_device_install() {
  local first second
  first=$(ls "$STASH"/$LIBS_TAR.part-* 2>/dev/null) \
    || die "no part one in $STASH: the machine went cold since device-stash; run call 1 again"
  second=$(ls "$CALL2"/$LIBS_TAR.part-* 2>/dev/null) || die "no part two: carry .whl/fa4/call2"
  mkdir -p "$FA4_SITE"
  cat "$first" "$second" > "$STASH/$LIBS_TAR"
  (cd "$STASH" && sha256sum -c "$CALL2/$LIBS_TAR.sha256") || die "the joined parts do not match"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$FA4_SITE" "$CALL2"/*.whl
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' \
    "$STASH/$LIBS_TAR" "$FA4_SITE"
  rm -f "$STASH/$LIBS_TAR"
  eval "$(cmd_device_env)"
  python3 -c 'import flash_attn.cute as f; print("flash_attn.cute imports:", f.flash_attn_func.__module__)'
}

cmd_device_env() {
  # The cutlass-dsl wheel puts dsl_packages on sys.path through a .pth file, which Python reads
  # only in site-packages, not on PYTHONPATH: name that folder too.
  echo "export PYTHONPATH=$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages:$TRAIN_SITE\${PYTHONPATH:+:\$PYTHONPATH}"
}

cmd_device_project() {
  # s2attn lives in kernels/ and imports only through the install's package map.
  python3 -c 'import s2attn' 2>/dev/null && return 0
  (cd "$REPO" && python3 -m pip install -q --no-index --no-build-isolation --no-deps -e .)
  python3 -c 'import s2attn; print("s2attn imports from", s2attn.__file__)'
}

cmd_device_trainer() {
  local wheels
  wheels=$(ls "$REPO"/.whl/mc016/*.whl "$REPO"/.whl/train/*.whl 2>/dev/null) \
    || die "carry .whl/train and .whl/mc016 (tools/stage_flash_attn4.sh download-trainer here)"
  # shellcheck disable=SC2086  # one word per wheel path
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$TRAIN_SITE" $wheels
  cmd_device_project
  eval "$(cmd_device_env)"
  python3 -c 'import megatron.core, s2attn, megatron_s2.training; print("trainer imports")'
}

case "${1:-}" in
  download) cmd_download ;;
  download-trainer) cmd_download_trainer ;;
  pack) cmd_pack ;;
  sizes) cmd_sizes ;;
  device-stash) cmd_device_stash ;;
  device-install) cmd_device_install ;;
  device-env) cmd_device_env ;;
  device-project) cmd_device_project ;;
  device-trainer) cmd_device_trainer ;;
  *)
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
    [ -n "${1:-}" ] && die "unknown step ${1}"
    exit 2
    ;;
esac
