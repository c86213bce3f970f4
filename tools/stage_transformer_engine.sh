#!/usr/bin/env bash
# Carry NVIDIA Transformer Engine (TE 2.20.2, torch binding built there) to a lent GPU machine,
# which has no package index. Same conventions as tools/stage_flash_attn4.sh.
#
# Here (a machine with pip and the package index), once; the files stay in the git-ignored .whl/:
#   tools/stage_transformer_engine.sh download  # -> .whl/te/wheels/ (TE) and .whl/te/deps/
#   tools/stage_transformer_engine.sh pack      # -> .whl/te/call1 ... callN (< 64 MiB each)
#   tools/stage_transformer_engine.sh sizes     # what each call carries
#   tools/stage_transformer_engine.sh rehearse  # join + checksum + pip --target here (no GPU)
# There, in back-to-back device calls (a machine stays warm ~30 s after a call, and /tmp
# survives only while it stays warm; N is 5 for TE 2.20.2):
#   calls 1..N-1, carry [".whl/te/callK"]:  bash tools/stage_transformer_engine.sh device-stash
#       (call 1 also installs megatron-core 0.19.2 and the trainer's wheels into /tmp/site)
#   call N, carry [".whl/te/callN"]:        bash tools/stage_transformer_engine.sh device-install
#       (joins the parts, installs the wheels with pip --target, and starts the build of the
#        torch binding in the background under setsid; log in /tmp/te-build/build.log)
#   then, in the same call or the next:     bash tools/stage_transformer_engine.sh device-wait 480
#       (polls the build; exit 0 built and installed, 1 failed, 3 still running: call it again)
#   then:  eval "$(bash tools/stage_transformer_engine.sh device-env)"
#          bash tools/stage_flash_attn4.sh device-project        # our package, offline
#          bash tools/stage_transformer_engine.sh device-check   # TE Linear + attention, bf16
#   optional: bash tools/stage_transformer_engine.sh device-export  # the built wheel -> $OUT
# Every later command in the same warm machine starts with the device-env line.
#
# Megatron-LM's pretrain_gpt.py with the TE spec (megatron-core 0.19's wheel ships
# megatron.training; the launcher files at the repository's root are all that is missing):
#   here:  tools/stage_transformer_engine.sh megatron-lm CHECKOUT   # a Megatron-LM checkout at
#          the tag core_v0.19.0 -> .whl/te/mlm/ (pretrain_gpt.py, gpt_builders.py, model_provider.py)
#   there, carry [".whl/te/mlm"], after the staging calls (the step sets device-env itself):
#          bash tools/stage_transformer_engine.sh device-pretrain-gpt [ITERS]
#
# Why N calls: the core library wheel (transformer-engine-cu13, one 343 MB libtransformer_engine.so)
# is 276.5 MB; xz gains only ~4% on it (CUDA fat binaries are compressed already), so it travels
# as the original wheel split into N equal parts, one a call, each waiting in /tmp for the last
# call. The joined file is checked against the wheel's sha256, and pip checks its RECORD hashes.
# The torch binding (transformer-engine-torch) has no wheel: its sdist is a torch CppExtension
# (33 C++ files, no .cu), compiled there with the machine's g++ and ninja against its torch, CUDA
# toolkit headers and the cuDNN/NCCL headers of torch's nvidia-* wheels.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELF=$REPO/tools/stage_transformer_engine.sh
TE=${TE_DIR:-$REPO/.whl/te}  # TE_DIR: the rehearsal's stand-in for a device checkout
WHEELS=$TE/wheels
DEPS=$TE/deps
BUILT=$TE/built
MCORE=$TE/mcore
MANIFEST=te-parts.txt
TE_VERSION=2.20.2
CORE_WHEEL=transformer_engine_cu13-$TE_VERSION-py3-none-manylinux_2_28_x86_64.whl
META_WHEEL=transformer_engine-$TE_VERSION-py3-none-any.whl
TORCH_SDIST=transformer_engine_torch-$TE_VERSION.tar.gz
# A call may carry 64 MiB (67108864 bytes) with the working tree (~1.5 MB) beside it. The core
# wheel is cut into the fewest parts of at most PART_MAX bytes, all of one size; the last call
# also carries the small files (~4.5 MB).
PART_MAX=58000000
CALL_LIMIT=67108864
# Device side: where parts wait, where the packages go (not site-packages: a fresh machine each
# session, and --target keeps the image's own packages untouched), where the binding is built.
STASH=${TE_STASH:-/tmp/te-parts}
TE_SITE=${TE_SITE:-/tmp/tesite}
BUILD=${TE_BUILD:-/tmp/te-build}
TRAIN_SITE=${TRAIN_SITE:-/tmp/site}
PY=${TE_PYTHON:-python3}

# Versions that go together (torch 2.11+cu130, Python 3.12 there; megatron-core 0.19.2 sets no
# upper bound on TE and checks features up to 2.14). One version of each: two stop a --no-deps
# install. transformer-engine-torch is the sdist (source only on the index).
PACKAGES=(transformer-engine==$TE_VERSION transformer-engine-cu13==$TE_VERSION)
# Runtime needs the machines lack (their image has torch, einops, onnx, onnxscript, packaging,
# pyyaml). typing-extensions: pydantic 2.14 needs >= 4.16. Left out on purpose:
# nvidia-cudnn-frontend (its Python API serves only TE's SM100 fused grouped MLP; it would pull
# nvidia-cutlass-dsl) and importlib-metadata (Python 3.12 has importlib.metadata).
DEP_PACKAGES=(pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0
  typing-inspection==0.4.5 typing-extensions==4.16.0 nvdlfw-inspect==0.2.2)
# For the TE-spec runs: megatron-core 0.19.2 (the version the TE spec is for; the machines have
# none) and the trainer's missing wheels. They ride in call 1 and go to $TRAIN_SITE.
MCORE_PACKAGES=(megatron-core==0.19.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
# PLATFORMS and pip_download
. "$REPO/tools/device_wheels.sh"

die() { echo "stage_transformer_engine: $*" >&2; exit 1; }

cmd_download() {
  pip_download "$WHEELS" "${PACKAGES[@]}"
  pip_download "$DEPS" "${DEP_PACKAGES[@]}"
  pip_download "$MCORE" "${MCORE_PACKAGES[@]}"
  # The sdist as the index serves it, checked against the index's sha256: pip download would
  # also run its metadata step, which imports torch and needs a CUDA build of it.
  python3 - "$WHEELS" "$TE_VERSION" <<'PY'
import hashlib, os, re, sys, urllib.parse, urllib.request
dest, version = sys.argv[1], sys.argv[2]
index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
name = f"transformer_engine_torch-{version}.tar.gz"
page = urllib.request.urlopen(f"{index}/transformer-engine-torch/", timeout=120).read().decode()
links = [h.replace("&amp;", "&") for h in re.findall(r'href="([^"]+)"', page) if name in h]
if not links:
    sys.exit(f"stage_transformer_engine: {name} is not on {index}")
url, _, sha = links[0].partition("#sha256=")
url = urllib.parse.urljoin(f"{index}/transformer-engine-torch/", url)
data = urllib.request.urlopen(url, timeout=300).read()
if sha and hashlib.sha256(data).hexdigest() != sha:
    sys.exit(f"stage_transformer_engine: {name}: sha256 differs from the index's")
with open(os.path.join(dest, name), "wb") as f:
    f.write(data)
PY
  ls -l "$WHEELS" "$DEPS" "$MCORE"
}

cmd_pack() {
  local core=$WHEELS/$CORE_WHEEL size n per d i
  [ -f "$core" ] && [ -f "$WHEELS/$META_WHEEL" ] && [ -f "$WHEELS/$TORCH_SDIST" ] \
    || die "missing files in $WHEELS: run download first"
  [ "$(ls "$DEPS"/*.whl 2>/dev/null | wc -l)" -eq "${#DEP_PACKAGES[@]}" ] \
    || die "expected ${#DEP_PACKAGES[@]} wheels in $DEPS: run download first"
  size=$(stat -c %s "$core")
  n=$(( (size + PART_MAX - 1) / PART_MAX ))
  per=$(( (size + n - 1) / n ))
  rm -rf "$TE"/call[0-9]* "$TE/split"
  mkdir -p "$TE/split"
  split -b "$per" -a 2 "$core" "$TE/split/$CORE_WHEEL.part-"
  local parts=("$TE/split/$CORE_WHEEL".part-*)
  [ "${#parts[@]}" -eq "$n" ] || die "split gave ${#parts[@]} parts, expected $n"
  {
    echo "# $CORE_WHEEL $size $(sha256sum "$core" | cut -d' ' -f1)"
    i=1
    for p in "${parts[@]}"; do
      echo "call$i $(basename "$p") $(stat -c %s "$p") $(sha256sum "$p" | cut -d' ' -f1)"
      i=$((i + 1))
    done
  } > "$TE/split/$MANIFEST"
  (cd "$WHEELS" && sha256sum "$CORE_WHEEL") > "$TE/split/$CORE_WHEEL.sha256"
  i=1
  for p in "${parts[@]}"; do
    d=$TE/call$i
    mkdir -p "$d"
    mv "$p" "$d/"
    cp "$TE/split/$MANIFEST" "$d/"
    i=$((i + 1))
  done
  if [ -n "$(ls "$MCORE"/*.whl 2>/dev/null)" ]; then
    mkdir -p "$TE/call1/mcore"
    cp "$MCORE"/*.whl "$TE/call1/mcore/"
  fi
  d=$TE/call$n
  cp "$TE/split/$CORE_WHEEL.sha256" "$WHEELS/$META_WHEEL" "$WHEELS/$TORCH_SDIST" "$d/"
  mkdir -p "$d/deps"
  cp "$DEPS"/*.whl "$d/deps/"
  rm -rf "$TE/split"
  cmd_sizes
}

cmd_sizes() {
  local repo total d
  repo=$(cd "$REPO" && { git ls-files -z; git ls-files -z -o --exclude-standard; } \
    | xargs -0 -r stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
  for d in "$WHEELS" "$DEPS" "$MCORE" "$TE"/call[0-9]*; do
    [ -d "$d" ] || continue
    echo "== ${d#"$REPO"/}"
    find "$d" -type f -printf '%12s  %P\n' | sort -k2
  done
  for d in "$TE"/call[0-9]*; do
    [ -d "$d" ] || continue
    total=$(( $(du -sb "$d" | cut -f1) + repo ))
    printf '%s + working tree: %d bytes of %d (%s)\n' "${d#"$REPO"/}" "$total" "$CALL_LIMIT" \
      "$([ "$total" -lt "$CALL_LIMIT" ] && echo fits || echo 'TOO LARGE')"
  done
}

# ---- device side (also runs here for the rehearsal, with TE_* overrides) --------------------
manifest() {  # the manifest from a carried call folder or the stash
  local m
  for m in "$TE"/call[0-9]*/"$MANIFEST" "$STASH/$MANIFEST"; do
    [ -f "$m" ] && { echo "$m"; return 0; }
  done
  return 1
}

cmd_device_stash() {
  local found=0 f m
  mkdir -p "$STASH"
  for f in "$TE"/call[0-9]*/"$CORE_WHEEL".part-* "$TE"/call[0-9]*/"$MANIFEST" \
    "$BUILT"/*; do
    [ -f "$f" ] || continue
    cp "$f" "$STASH/"
    case $f in *.part-*) found=1 ;; esac
  done
  [ "$found" -eq 1 ] || [ -n "$(ls "$BUILT" 2>/dev/null)" ] \
    || die "no part of $CORE_WHEEL under .whl/te/call*/: carry .whl/te/callK"
  m=$(manifest) || die "no $MANIFEST: carry .whl/te/callK (made by pack)"
  if ls "$TE"/call[0-9]*/mcore/*.whl >/dev/null 2>&1; then
    # shellcheck disable=SC2046  # one word per wheel path
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$TRAIN_SITE" $(ls "$TE"/call[0-9]*/mcore/*.whl)
    echo "installed $(ls "$TE"/call[0-9]*/mcore/ | paste -sd' ' -) into $TRAIN_SITE"
  fi
  echo "stashed in $STASH:"
  ls -l "$STASH"
  report_parts "$m" brief || true
}

report_parts() {  # MANIFEST [brief] -> what is still missing; 1 if something is
  local call name size sha missing=0 have=0 total=0 todo=""
  while read -r call name size sha; do
    case $call in '#'*) continue ;; esac
    total=$((total + 1))
    if [ -f "$STASH/$name" ] || [ -f "$TE/$call/$name" ]; then
      have=$((have + 1))
      [ -n "${2:-}" ] || echo "  have $name ($call)"
    else
      todo="$todo $call"
      [ -n "${2:-}" ] || echo "  MISSING $name: carried by $call (carry .whl/te/$call, run device-stash)"
      missing=1
    fi
  done < "$1"
  echo "parts: $have of $total here${todo:+; still to come from:$todo}"
  return $missing
}

cmd_device_install() {
  local m last call name size sha src joined=$STASH/$CORE_WHEEL
  m=$(manifest) || die "no $MANIFEST here: carry the last .whl/te/callN"
  last=$(awk '!/^#/ {c=$1} END {print c}' "$m")
  [ -f "$TE/$last/$META_WHEEL" ] && [ -f "$TE/$last/$TORCH_SDIST" ] \
    || die "carry .whl/te/$last (the last call: it has the small wheels and the sdist)"
  mkdir -p "$STASH"
  report_parts "$m" || die "parts missing (the machine went cold since an earlier call, or a call was left out): run the calls named above again, then this one"
  : > "$joined"
  while read -r call name size sha; do
    case $call in '#'*) continue ;; esac
    src=$STASH/$name
    [ -f "$src" ] || src=$TE/$call/$name
    [ "$(stat -c %s "$src")" = "$size" ] || die "$name has $(stat -c %s "$src") bytes, expected $size"
    cat "$src" >> "$joined"
  done < "$m"
  (cd "$STASH" && sha256sum -c "$TE/$last/$CORE_WHEEL.sha256") \
    || die "the joined parts do not match $CORE_WHEEL's sha256 (a part is stale: pack again)"
  mkdir -p "$TE_SITE" "$BUILD"
  # One pip call for all: the meta and core wheels share the package folder transformer_engine/,
  # which pip --target merges only within one call (a later --upgrade call would replace it).
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$TE_SITE" "$joined" "$TE/$last/$META_WHEEL" "$TE/$last"/deps/*.whl
  rm -f "$joined" "$STASH/$CORE_WHEEL".part-*
  cp "$TE/$last/$TORCH_SDIST" "$BUILD/"
  echo "installed transformer-engine $TE_VERSION (core + meta + deps) into $TE_SITE"
  if ls "$STASH"/transformer_engine_torch-*.whl >/dev/null 2>&1; then
    echo "a built torch binding was carried: installing it, no build"
    install_binding "$(ls "$STASH"/transformer_engine_torch-*.whl | head -1)"
    # device-wait's answer for a carried binding: nothing to wait for, installed.
    echo ok > "$BUILD/status"
    echo "carried: nothing was built" > "$BUILD/build.log"
    return 0
  fi
  cmd_device_build_start
}

cmd_device_build_start() {
  [ -f "$BUILD/$TORCH_SDIST" ] || die "no $BUILD/$TORCH_SDIST: run device-install first"
  if [ -f "$BUILD/pid" ] && kill -0 "$(cat "$BUILD/pid")" 2>/dev/null; then
    echo "a build is already running (pid $(cat "$BUILD/pid")); see device-wait"
    return 0
  fi
  rm -f "$BUILD/status"
  if [ -n "${TE_SKIP_BUILD:-}" ]; then  # the rehearsal: no compiler run here
    echo "TE_SKIP_BUILD set: the build of the torch binding is skipped"
    return 0
  fi
  # setsid: the build runs on after this call returns (until the machine goes back).
  setsid nohup bash "$SELF" device-build > "$BUILD/build.log" 2>&1 < /dev/null &
  echo $! > "$BUILD/pid"
  echo "building transformer-engine-torch $TE_VERSION in the background (pid $(cat "$BUILD/pid"));"
  echo "log: $BUILD/build.log; poll with: bash tools/stage_transformer_engine.sh device-wait 480"
}

cmd_device_build() {  # the build itself, in the foreground (device-build-start runs it detached)
  local rc=0 sp inc bin
  echo "== build start $(date -u +%FT%TZ) on $(nproc) cores"
  sp=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  bin=$(dirname "$(command -v "$PY")")
  # ninja (a pip package there) must be on PATH for torch's BuildExtension to compile in parallel.
  export PATH="$bin:$PATH"
  # cudnn.h and nccl.h (and, without a toolkit, the CUDA headers) come from torch's nvidia-*
  # wheels: search them after the -I folders the build names.
  inc=$(ls -d "$sp"/nvidia/*/include 2>/dev/null | paste -sd: -)
  export CPLUS_INCLUDE_PATH=$inc${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}
  [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda
  export NVTE_FRAMEWORK=pytorch
  export NVTE_PYTORCH_FORCE_BUILD=TRUE   # else setup.py first tries to download a wheel
  export NVTE_NO_LOCAL_VERSION=1         # version 2.20.2, as TE's import-time check requires
  export NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-90}
  export MAX_JOBS=${MAX_JOBS:-$(nproc)}
  echo "python $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)')"
  echo "nvcc: $(command -v nvcc || echo none) $(nvcc --version 2>/dev/null | tail -1)"
  echo "ninja: $(command -v ninja || echo none), g++: $(g++ --version 2>/dev/null | head -1)"
  echo "CUDA_HOME=${CUDA_HOME:-} MAX_JOBS=$MAX_JOBS NVTE_CUDA_ARCHS=$NVTE_CUDA_ARCHS"
  echo "CPLUS_INCLUDE_PATH=$CPLUS_INCLUDE_PATH"
  rm -rf "$BUILD/dist"
  local t0=$SECONDS
  "$PY" -m pip wheel -v --no-build-isolation --no-deps --no-index -w "$BUILD/dist" \
    "$BUILD/$TORCH_SDIST" || rc=$?
  echo "== pip wheel exit $rc after $((SECONDS - t0)) s"
  if [ "$rc" -eq 0 ]; then
    install_binding "$(ls "$BUILD"/dist/transformer_engine_torch-*.whl | head -1)" || rc=$?
  fi
  if [ "$rc" -eq 0 ]; then echo ok > "$BUILD/status"; else echo "failed $rc" > "$BUILD/status"; fi
  echo "== build end $(date -u +%FT%TZ): $(cat "$BUILD/status")"
  return "$rc"
}

install_binding() {  # WHEEL -> merged into $TE_SITE/transformer_engine/ (see device-install)
  local whl=$1 tmp=$BUILD/binding-site
  [ -f "$whl" ] || die "no built wheel $whl"
  rm -rf "$tmp"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$tmp" "$whl"
  cp -a "$tmp"/. "$TE_SITE"/
  rm -rf "$tmp"
  echo "installed $(basename "$whl") into $TE_SITE"
}

cmd_device_wait() {  # [SECONDS]: exit 0 built, 1 failed, 3 still running after SECONDS
  local limit=${1:-0} t0=$SECONDS st
  [ -d "$BUILD" ] || die "no $BUILD: run device-install first (the machine may have gone cold)"
  while :; do
    st=$(cat "$BUILD/status" 2>/dev/null || true)
    if [ -n "$st" ]; then break; fi
    if ! { [ -f "$BUILD/pid" ] && kill -0 "$(cat "$BUILD/pid")" 2>/dev/null; }; then
      tail -n 40 "$BUILD/build.log" 2>/dev/null || true
      die "no build is running and none finished: run device-install (or device-build-start)"
    fi
    if [ $((SECONDS - t0)) -ge "$limit" ]; then
      tail -n 5 "$BUILD/build.log" 2>/dev/null || true
      echo "still building after $((SECONDS - t0)) s of waiting: call device-wait again"
      return 3
    fi
    sleep 10
  done
  grep -E '^== |^\[[0-9]+/[0-9]+\]' "$BUILD/build.log" | tail -n 5 || true
  if [ "$st" = ok ]; then
    echo "torch binding built and installed"
    return 0
  fi
  echo "BUILD FAILED ($st); the log's errors:"
  grep -n -iE 'error|fatal' "$BUILD/build.log" | head -n 40 || true
  tail -n 40 "$BUILD/build.log"
  return 1
}

cmd_device_env() {
  local cudnn
  echo "export PYTHONPATH=$TE_SITE:$TRAIN_SITE\${PYTHONPATH:+:\$PYTHONPATH}"
  # TE's core library links libcudnn.so.9, which the loader found in the system's cache: on the
  # lent machines an older cuDNN (9.14) than the one torch bundles (9.19), and torch then refused
  # it ("cuDNN version incompatibility"). Torch's own comes first: CUDNN_HOME for TE's loader,
  # LD_LIBRARY_PATH for the linked one.
  cudnn=$("$PY" -c 'import nvidia.cudnn as c; print(list(c.__path__)[0])' 2>/dev/null) || true
  [ -z "$cudnn" ] || echo "export CUDNN_HOME=$cudnn LD_LIBRARY_PATH=$cudnn/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
}

cmd_device_check() {
  eval "$(cmd_device_env)"
  "$PY" - <<'EOF'
import importlib.metadata as md

import torch
import torch.nn.functional as F

import transformer_engine
import transformer_engine.pytorch as te

for dist in ("transformer-engine", "transformer-engine-cu13", "transformer-engine-torch"):
    print(f"{dist} {md.version(dist)}")
print(f"transformer_engine from {transformer_engine.__file__}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
      f"{torch.cuda.get_device_name()}")
torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


lin = te.Linear(256, 512, bias=True, params_dtype=dt, device=dev)
x = torch.randn(64, 256, device=dev, dtype=dt, requires_grad=True)
y = lin(x)
g = torch.randn_like(y)
y.backward(g)
xr = x.detach().clone().requires_grad_(True)
w = lin.weight.detach().clone().requires_grad_(True)
yr = F.linear(xr, w, lin.bias.detach())
yr.backward(g)
errs = {"linear out": rel(y, yr), "linear dx": rel(x.grad, xr.grad), "linear dW": rel(lin.weight.grad, w.grad)}

s, b, h, hkv, d = 256, 2, 8, 2, 64
attn = te.DotProductAttention(h, d, num_gqa_groups=hkv, attention_dropout=0.0,
                              attn_mask_type="causal", qkv_format="sbhd")
q = torch.randn(s, b, h, d, device=dev, dtype=dt, requires_grad=True)
k = torch.randn(s, b, hkv, d, device=dev, dtype=dt, requires_grad=True)
v = torch.randn(s, b, hkv, d, device=dev, dtype=dt, requires_grad=True)
o = attn(q, k, v)  # [s, b, h * d]
go = torch.randn_like(o)
o.backward(go)
qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
rep = h // hkv
ref = F.scaled_dot_product_attention(
    qr.permute(1, 2, 0, 3), kr.permute(1, 2, 0, 3).repeat_interleave(rep, 1),
    vr.permute(1, 2, 0, 3).repeat_interleave(rep, 1), is_causal=True)
ref = ref.permute(2, 0, 1, 3).reshape(s, b, h * d)
ref.backward(go)
errs.update({"attention out": rel(o, ref), "attention dq": rel(q.grad, qr.grad),
             "attention dk": rel(k.grad, kr.grad), "attention dv": rel(v.grad, vr.grad)})
bad = {n: e for n, e in errs.items() if not e < 2e-2}
for n, e in errs.items():
    print(f"  {n:14s} max rel err vs torch {e:.2e}")
try:
    import megatron.core
    from megatron_s2.specs import HAVE_TE
    print(f"megatron-core {megatron.core.__version__}: megatron_s2.specs.HAVE_TE = {HAVE_TE}")
except ImportError as e:
    print(f"megatron_s2 / megatron-core not importable here ({e}); HAVE_TE not checked")
if bad:
    raise SystemExit(f"device-check FAILED: {bad}")
print("device-check: TE Linear and DotProductAttention forward/backward OK (bf16, CUDA)")
EOF
}

cmd_device_export() {  # the built binding wheel -> $OUT (<= 15 MiB pieces), to skip later builds
  local whl
  whl=$(ls "$BUILD"/dist/transformer_engine_torch-*.whl 2>/dev/null | head -1) \
    || die "no built wheel in $BUILD/dist"
  [ -n "${OUT:-}" ] || die "OUT is not set (only a device call has it)"
  (cd "$(dirname "$whl")" && sha256sum "$(basename "$whl")") > "$OUT/$(basename "$whl").sha256"
  split -b 15000000 -a 1 "$whl" "$OUT/$(basename "$whl").part-"
  ls -l "$OUT"
  echo "here: cat the parts into .whl/te/built/$(basename "$whl"), check the sha256, and carry"
  echo ".whl/te/built with call 1: device-stash keeps it, device-install then skips the build"
}

MLM=$TE/mlm
MLM_FILES=(pretrain_gpt.py gpt_builders.py model_provider.py)
MLM_TAG=core_v0.19.0

cmd_megatron_lm() {  # CHECKOUT: Megatron-LM's launcher files -> .whl/te/mlm/
  local src=${1:-} f tag
  [ -n "$src" ] && [ -f "$src/pretrain_gpt.py" ] \
    || die "megatron-lm CHECKOUT: a Megatron-LM checkout (git checkout $MLM_TAG), got '${src}'"
  tag=$(git -C "$src" describe --tags --exact-match 2>/dev/null || echo unknown)
  [ "$tag" = "$MLM_TAG" ] \
    || echo "warning: $src is at '$tag', not $MLM_TAG (the version megatron-core 0.19.2 pairs with)"
  mkdir -p "$MLM"
  for f in "${MLM_FILES[@]}"; do
    cp "$src/$f" "$MLM/" || die "no $f in $src"
  done
  echo "$tag" > "$MLM/TAG"
  ls -l "$MLM"
}

cmd_device_pretrain_gpt() {  # [ITERS]: Megatron-LM's own loop with the TE spec, mock data
  local iters=${1:-200} f ds
  for f in "${MLM_FILES[@]}"; do
    [ -f "$MLM/$f" ] || die "no $MLM/$f: run 'megatron-lm CHECKOUT' here and carry .whl/te/mlm"
  done
  eval "$(cmd_device_env)"
  # Megatron-LM's start-up runs `make -C megatron/core/datasets` to build the dataset helpers; the
  # wheel ships them built (helpers_cpp*.so) but no Makefile, and make without one fails the run.
  ds=$("$PY" -c 'import os, megatron.core.datasets as d; print(os.path.dirname(d.__file__))')
  ls "$ds"/helpers_cpp*.so >/dev/null 2>&1 || die "no built dataset helpers in $ds"
  [ -f "$ds/Makefile" ] || printf 'default:\n\t@echo "dataset helpers: prebuilt in the wheel"\n' > "$ds/Makefile"
  export MEGATRON_S2_SCHEDULE=$REPO/configs/attention/phi3_small.yaml
  [ -f "$MEGATRON_S2_SCHEDULE" ] || die "no $MEGATRON_S2_SCHEDULE"
  # The 125M hybrid's shape (configs/gpt-125m-s2.yaml) at 4k; TE's default flags, plus the two
  # attention flags every S2 spec needs (docs/megatron.md) and --no-gradient-accumulation-fusion:
  # without Apex the output layer's fusion (a Megatron-core ColumnParallelLinear) stops step 1.
  (cd "$MLM" && "$PY" -m torch.distributed.run --nproc-per-node 1 pretrain_gpt.py \
    --spec megatron_s2.specs s2_layer_spec_te \
    --attention-dropout 0.0 --no-create-attention-mask-in-dataloader --no-gradient-accumulation-fusion \
    --num-layers 12 --hidden-size 768 --num-attention-heads 12 \
    --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope \
    --micro-batch-size 4 --global-batch-size 32 --bf16 \
    --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 20 --train-iters "$iters" \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 \
    --log-interval 10 --eval-interval 100 --eval-iters 2 --log-throughput)
}

# ---- rehearsal here (no GPU, no compiler): each call's carry in a stand-in checkout ---------
cmd_rehearse() {
  local py=${TE_PYTHON:-/work/venv312/bin/python} tmp n k d out
  n=$(ls -d "$TE"/call[0-9]* 2>/dev/null | wc -l)
  [ "$n" -gt 0 ] || die "run pack first"
  tmp=$(mktemp -d /tmp/te-rehearse.XXXXXX)
  echo "rehearsal in $tmp ($n calls; Python $py)"
  export TE_PYTHON=$py TE_STASH=$tmp/stash TE_SITE=$tmp/site TE_BUILD=$tmp/build TE_SKIP_BUILD=1 \
    TRAIN_SITE=$tmp/trainsite
  carry() {  # K...: the stand-in checkout holds exactly these call folders (hard links)
    rm -rf "$tmp/repo"
    mkdir -p "$tmp/repo/te"
    for k in "$@"; do cp -al "$TE/call$k" "$tmp/repo/te/call$k"; done
  }
  expect_fail() {  # WHAT PATTERN STEP...: the step must fail and say PATTERN
    local what=$1 pat=$2; shift 2
    if out=$(TE_DIR=$tmp/repo/te bash "$SELF" "$@" 2>&1); then
      echo "$out"; die "rehearsal: $what did not fail"
    fi
    echo "$out" | grep -q -- "$pat" || { echo "$out"; die "rehearsal: $what failed without '$pat'"; }
    echo "ok: $what fails: $(echo "$out" | grep -- "$pat" | head -1)"
  }
  # 1. clear failures
  carry
  expect_fail "device-stash with nothing carried" "no part of" device-stash
  expect_fail "device-install with nothing carried" "no te-parts.txt" device-install
  carry 1
  expect_fail "device-install without the last call's folder" "carry .whl/te/call" device-install
  expect_fail "device-wait before any install" "run device-install first" device-wait
  # 2. a call left out: stash 1..n-2, then the last call
  for k in $(seq 1 $((n - 2))); do carry "$k"; TE_DIR=$tmp/repo/te bash "$SELF" device-stash >/dev/null; done
  carry "$n"
  expect_fail "device-install with call $((n - 1)) left out" "MISSING.*call$((n - 1))" device-install
  # 3. a stale part: wrong bytes in the stash
  carry "$((n - 1))"; TE_DIR=$tmp/repo/te bash "$SELF" device-stash >/dev/null
  cp "$TE_STASH/$(awk '$1=="call1" {print $2}' "$TE/call1/$MANIFEST")" "$tmp/part1.bak"
  printf 'x' | dd of="$TE_STASH/$(awk '$1=="call1" {print $2}' "$TE/call1/$MANIFEST")" bs=1 seek=1000 conv=notrunc 2>/dev/null
  carry "$n"
  expect_fail "device-install with a corrupted part" "do not match" device-install
  # 4. the real sequence, with a stand-in for the built binding carried in call 1 (an empty .so:
  #    checks the merge into the site folder and TE's version and library look-ups, not the code)
  rm -rf "$TE_STASH" "$TE_SITE" "$TE_BUILD" "$TRAIN_SITE"
  mkdir -p "$tmp/fake"
  "$py" - "$tmp/fake" "$TE_VERSION" <<'PYEOF'
import sys, zipfile
out, v = sys.argv[1], sys.argv[2]
name = f"transformer_engine_torch-{v}"
files = {f"transformer_engine/wheel_lib/transformer_engine_torch.cpython-312-x86_64-linux-gnu.so": "",
         f"{name}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: transformer_engine_torch\nVersion: {v}\n",
         f"{name}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: rehearsal\nRoot-Is-Purelib: false\nTag: cp312-cp312-linux_x86_64\n"}
files[f"{name}.dist-info/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{name}.dist-info/RECORD,,\n"
with zipfile.ZipFile(f"{out}/{name}-cp312-cp312-linux_x86_64.whl", "w") as z:
    for f, t in files.items():
        z.writestr(f, t)
PYEOF
  for k in $(seq 1 $((n - 1))); do
    carry "$k"
    if [ "$k" -eq 1 ]; then mkdir -p "$tmp/repo/te/built"; cp "$tmp/fake"/*.whl "$tmp/repo/te/built/"; fi
    TE_DIR=$tmp/repo/te bash "$SELF" device-stash | tail -n 1
  done
  carry "$n"
  TE_DIR=$tmp/repo/te bash "$SELF" device-install
  [ -z "$(ls "$TE_STASH"/*.part-* 2>/dev/null)" ] || die "rehearsal: parts left in the stash"
  NVTE_PROJECT_BUILDING=1 PYTHONPATH=$TE_SITE "$py" - <<'PYEOF'
import importlib.metadata as md
import transformer_engine.common as c  # NVTE_PROJECT_BUILDING: no CUDA library is loaded
print("dists:", {d: md.version(d) for d in ("transformer-engine", "transformer-engine-cu13",
                                           "transformer-engine-torch", "pydantic", "nvdlfw-inspect")})
assert c.get_te_core_package_info()[1:] == ("transformer-engine-cu13", md.version("transformer-engine"))
assert c._is_package_installed_from_wheel("transformer_engine")
c.sanity_checks_for_pypi_installation()
print("core lib:", c._get_shared_object_file("core"))
print("torch binding:", c._get_shared_object_file("torch"))
import pydantic, nvdlfw_inspect.api  # noqa: F401  the runtime needs import
print("rehearsal: TE's install checks pass on the --target folder")
PYEOF
  if [ -d "$TE/call1/mcore" ]; then
    PYTHONPATH=$TRAIN_SITE "$py" -c 'import importlib.metadata as md; print("train site: megatron-core", md.version("megatron-core"), "datasets", md.version("datasets"))'
  fi
  echo "device-env: $(TE_DIR=$tmp/repo/te bash "$SELF" device-env)"
  # 5. the build launcher (skipped compile) and its wait
  rm -f "$TE_BUILD/status"
  TE_DIR=$tmp/repo/te bash "$SELF" device-build-start
  expect_fail "device-wait with no build running" "no build is running" device-wait
  rm -rf "$tmp"
  echo "rehearsal passed"
}

case "${1:-}" in
  download) cmd_download ;;
  pack) cmd_pack ;;
  sizes) cmd_sizes ;;
  rehearse) cmd_rehearse ;;
  device-stash) cmd_device_stash ;;
  device-install) cmd_device_install ;;
  device-build-start) cmd_device_build_start ;;
  device-build) cmd_device_build ;;
  device-wait) cmd_device_wait "${2:-0}" ;;
  device-env) cmd_device_env ;;
  device-check) cmd_device_check ;;
  device-export) cmd_device_export ;;
  megatron-lm) cmd_megatron_lm "${2:-}" ;;
  device-pretrain-gpt) cmd_device_pretrain_gpt "${2:-}" ;;
  *)
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
    [ -n "${1:-}" ] && die "unknown step ${1}"
    exit 2
    ;;
esac
