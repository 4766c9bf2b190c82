# Helpers for one call on a lent GPU machine (source it from the repository root there):
#   source bench/gpu_env.sh && td_setup && td_build "fp16_rcr_full" sm90a 420 pool && ...
# td_setup installs the carried wheels (.whl: nvidia-cutlass headers, scons) and unpacks a carried
# kernel cache (every .dev/*.tar.xz); td_pack_cache returns the cache entries built here under $OUT, so
# the next call (or this machine's user) need not compile them again.
export PYTHONUNBUFFERED=1
TD_CACHE=${TD_CACHE:-/tmp/tdcache}  # both may be set before sourcing (a build kept in the repository's ignored
TD_BUILD=${TD_BUILD:-/tmp/tdbuild}  # build/ survives into the next call on the same warm machine)

td_setup() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
  export PYTHONPATH=/tmp/site
  mkdir -p "$TD_CACHE"
  for f in .dev/*.tar.xz; do [ -f "$f" ] && tar -xJf "$f" -C "$TD_CACHE"; done
  touch /tmp/td_marker
  nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  nvcc --version | tail -2
}

# td_build SETS ARCH SECONDS BUNDLE: build (or fetch from the cache) a bundle in $TD_BUILD/BUNDLE
td_build() {
  local start=$SECONDS
  timeout "$3" python3 -m SCons -Q "kernels=$1" backend=cutlass "arch=$2" "build_dir=$TD_BUILD" \
    "cache_dir=$TD_CACHE" "bundle=$4" -j"$(nproc)" > "/tmp/build_$4.log" 2>&1
  local rc=$?
  grep -E "compiled|FAILED|error|kernel\(s\)" "/tmp/build_$4.log" | grep -v "^\s*$" | tail -n 80
  echo "td_build $4: rc $rc in $((SECONDS - start)) s"
  return $rc
}

# td_pack_cache NAME: the cache entries written since td_setup, as $OUT/NAME.tar.xz (< 16 MiB each part)
td_pack_cache() {
  (cd "$TD_CACHE" && find . -type f -newer /tmp/td_marker -print0 | tar --null -T - -cf - | xz -T16 -6 > "$OUT/$1.tar.xz")
  split -b 15m -d "$OUT/$1.tar.xz" "$OUT/$1.tar.xz.part" && rm "$OUT/$1.tar.xz"
  ls -la "$OUT"
}

# td_pack_out NAME DIR: DIR as $OUT/NAME.tgz, split into parts below a call's 16 MiB limit on a returned file
# (a bigger file does not come back at all); here: cat NAME.tgz.part* | tar -xzf -
td_pack_out() {
  tar -czf "$OUT/$1.tgz" -C "$(dirname "$2")" "$(basename "$2")" || return 1
  split -b 15m -d "$OUT/$1.tgz" "$OUT/$1.tgz.part" && rm "$OUT/$1.tgz"
  ls -la "$OUT"
}

# td_partial_bundle ARCH BUNDLE: when a build ran out of time, a bundle of the kernels it finished
td_partial_bundle() {
  [ -f "$TD_BUILD/$2/manifest.json" ] && return 0
  python3 - "$1" "$2" "$TD_BUILD" <<'PY'
import shutil, sys
from pathlib import Path
sys.path.insert(0, "runtime")
from tiledispatch import bundle
from tiledispatch.spec.key import parse_kernel_name
arch, name = sys.argv[1], sys.argv[2]
root = Path(sys.argv[3])
out = root / name
(out / "kernels").mkdir(parents=True, exist_ok=True)
keys = []
for so in sorted((root / "lib").glob("*.so")):
    key = parse_kernel_name(so.stem)
    if key.backend == "cutlass" and key.arch == arch:
        shutil.copy(so, out / bundle.kernel_file(key))
        keys.append(key)
bundle.write_manifest(out, keys, backend="cutlass", arch=arch, toolchain={"partial": True}, kernel_sets=[name], origins={})
print(f"partial bundle {out}: {len(keys)} kernels")
PY
}
