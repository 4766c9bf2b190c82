#!/usr/bin/env bash
# Install what the ck_tile compile check needs, without ROCm (recipe: shared/reference/cktile_compile_check.md).
#   clang-19 + libamdhip64-dev   Debian packages (clang-19's resource dir holds the __clang_hip_* headers)
#   CK Tile headers              amd-aiter wheel, aiter_meta/3rdparty/composable_kernel/include
#   HIP 7.1 headers              triton wheel, triton/backends/amd/include
#   clang 22 (for gfx950)        ziglang wheel (`zig clang`)
# Idempotent: each piece is skipped when already there. Everything goes to $TD_CK_CHECK_DIR (default
# ~/.cache/tiledispatch/ck_check, about 200 MB: cache it in CI), never into the repository. The wheels
# (430 MB) are deleted once unpacked unless TD_CK_KEEP_WHEELS=1.
# Prints the environment variables that check_toolchain() of templates/ck_tile/toolchain.py reads.
set -euo pipefail

AITER_WHEEL_VERSION=0.1.7.post2.dev18
TRITON_WHEEL_VERSION=3.9.0
ZIG_WHEEL_VERSION=0.17.1
DIR="${TD_CK_CHECK_DIR:-$HOME/.cache/tiledispatch/ck_check}"
mkdir -p "$DIR/wheels"

if ! command -v clang-19 >/dev/null || [ ! -e /usr/include/hip/hip_runtime.h ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends clang-19 libamdhip64-dev
fi

# unpack <wheel glob> <folder or file inside the wheel> <destination>: only that part, then a stamp
unpack() {
  local pattern="$1" inner="$2" dest="$3"
  [ -f "$dest/.unpacked" ] && return 0
  local wheel
  wheel=$(ls "$DIR"/wheels/$pattern 2>/dev/null | head -1)
  if [ -z "$wheel" ]; then echo "wheel $pattern missing in $DIR/wheels" >&2; exit 1; fi
  rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
  python3 - "$wheel" "$inner" "$dest.tmp" <<'PY'
import sys, zipfile, os
wheel, inner, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        if (info.filename == inner or info.filename.startswith(inner + "/")) and not info.is_dir():
            z.extract(info, dest)
            mode = info.external_attr >> 16
            if mode & 0o111:
                os.chmod(os.path.join(dest, info.filename), 0o755)
PY
  rm -rf "$dest"
  if [ -d "$dest.tmp/$inner" ]; then mv "$dest.tmp/$inner" "$dest"; else mkdir -p "$dest" && mv "$dest.tmp/$inner" "$dest/"; fi
  rm -rf "$dest.tmp"
  touch "$dest/.unpacked"
}

need_download=0
for d in ck triton_hip zig; do [ -f "$DIR/$d/.unpacked" ] || need_download=1; done
if [ "$need_download" = 1 ]; then
  python3 -m pip download --no-deps --only-binary :all: --python-version 3.11 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux1_x86_64 --platform linux_x86_64 -q -d "$DIR/wheels" \
    "amd-aiter==$AITER_WHEEL_VERSION" "triton==$TRITON_WHEEL_VERSION" "ziglang==$ZIG_WHEEL_VERSION"
fi
unpack "amd_aiter-*.whl" aiter_meta/3rdparty/composable_kernel/include "$DIR/ck"
unpack "triton-*.whl" triton/backends/amd/include "$DIR/triton_hip"
unpack "ziglang-*.whl" ziglang/zig "$DIR/zig"     # the driver alone: zig's own lib/ is not needed here
[ "${TD_CK_KEEP_WHEELS:-0}" = 1 ] || rm -rf "$DIR/wheels"
# a small record of what was unpacked: it enters the check's toolchain identity
printf 'amd-aiter==%s\ntriton==%s\nziglang==%s\n' "$AITER_WHEEL_VERSION" "$TRITON_WHEEL_VERSION" "$ZIG_WHEEL_VERSION" \
  > "$DIR/versions.txt"

echo "TD_CK_CHECK_DIR=$DIR"
echo "TD_CK_TILE_INCLUDE=$DIR/ck"
echo "TD_HIP71_INCLUDE=$DIR/triton_hip"
echo "TD_ZIG=$DIR/zig/zig"
echo "TD_CLANG19=$(command -v clang-19)"
