# Shared by tools/stage_flash_attn4.sh and tools/stage_transformer_engine.sh (sourced, not run):
# downloading wheels here for the lent GPU machines (cp312, x86-64 Linux; they have no index).

# pip matches a manylinux tag exactly, so every glibc level a wheel may be tagged with is named.
PLATFORMS=(manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64
  manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64
  manylinux_2_35_x86_64 manylinux1_x86_64)

pip_download() {  # DEST PACKAGE...
  local dest=$1; shift
  local plat=()
  for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
  mkdir -p "$dest"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d "$dest" "$@"
}
