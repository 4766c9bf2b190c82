#!/usr/bin/env python3
"""Compile-check ck_tile kernels without ROCm: render each key, then run the backend's check command
(front end + device LLVM IR for the key's own arch; not a build) in parallel.

    scripts/ck_check.py                          # every ck_tile config of every preselected set, every arch
    scripts/ck_check.py --sets fp16_rcr_essential --archs gfx942 -j 2
    scripts/ck_check.py --names <kernel name> ... # given kernels only
    scripts/ck_check.py --negative               # only the negative controls (they must fail)

The negative controls (illegal configs rendered with the rules bypassed) run with every full check:
a control that compiles means the check proves nothing, and the script fails.
Needs the pieces of .ci/install_ck_check.sh. Exit status 0 when every kernel passes and every control fails.
Cost: about 13 s of compiler CPU time per source (9-25 s); the preselected sets (79 kernels over the
three archs) take about 10 minutes on 2 cores. The same check runs through SCons, one arch at a time:
    scons kernels=$(scripts/ck_check.py --sets-for gfx942) backend=ck_tile arch=gfx942 check=1
"""
from __future__ import annotations

import argparse
import importlib
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from tiledispatch.generator import codegen, kernelset  # noqa: E402
from tiledispatch.generator import toolchains  # noqa: E402

ck_tile = toolchains.get("ck_tile")
from tiledispatch.generator import rules  # noqa: E402
from tiledispatch.spec.key import Algorithm, KernelKey, Signature, parse_kernel_name  # noqa: E402


@dataclass
class Result:
    name: str
    ok: bool
    seconds: float
    log: str = ""


def preselected_keys(sets=None, archs=None) -> dict[str, dict[str, list[KernelKey]]]:
    """set name -> arch -> its ck_tile keys; sets and archs without ck_tile kernels are left out.
    Default: every set in preselected/."""
    names = sets or sorted(p.stem for p in (kernelset.REPO_ROOT / "preselected").glob("*.yaml"))
    out: dict[str, dict[str, list[KernelKey]]] = {}
    for name in names:
        path = kernelset.find(name)
        for arch in archs or list(rules.archs("ck_tile")):
            keys = [e.key for e in kernelset.expand_file(path, "ck_tile", arch)]
            if keys:
                out.setdefault(name, {})[arch] = keys
    return out


def negative_controls(arch: str = "gfx942") -> list[tuple[KernelKey, str]]:
    """Illegal configs the rules reject; rendered anyway, each must fail the compile check."""
    base = KernelKey(Signature("gemm", "fp16", "fp16", "fp16", "fp32", "rcr"),
                     Algorithm((128, 128, 32), "compv3", (2, 2, 1), (32, 32, 16), "intrawave"), "ck_tile", arch)
    alg = base.algorithm
    return [
        (base.replace(algorithm=Algorithm((128, 128, 32), "compv3", (2, 2, 1), (32, 32, 12), "intrawave")),
         "warp tile 32x32x12: no such MFMA"),
        (base.replace(algorithm=Algorithm((128, 100, 32), "compv3", (2, 2, 1), (32, 32, 16), "intrawave")),
         "block tile N 100: not a multiple of waves x warp tile"),
        (base.replace(algorithm=Algorithm((256, 256, 128), "compv4", alg.warps, alg.mma, "intrawave")),
         "compv4 256x256x128 fp16: 256 KiB of LDS, more than any arch has (static_assert)"),
    ]


def render_unchecked(key: KernelKey) -> str:
    """Render without the legality rules: only for negative controls."""
    render_module = importlib.import_module("tiledispatch.generator.codegen")
    with mock.patch.object(render_module.rules, "check", return_value=[]):
        return codegen.render(key)


def check_one(key: KernelKey, workdir: Path, text: str | None = None) -> Result:
    """Render and check one key; Result.seconds is the compiler's CPU time (user + sys), which other
    load on the machine disturbs less than wall time."""
    try:
        text = codegen.render(key) if text is None else text
    except (ValueError, RuntimeError) as e:
        return Result(key.name, False, 0.0, f"render failed: {e}")
    src = workdir / codegen.source_name(key)
    src.write_text(text)
    stamp = workdir / f"{key.name}.check"
    cmd = ck_tile.check_command(key, ck_tile.check_toolchain(), str(src), str(stamp))
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        text_log = log.read()
    ok = proc.returncode == 0
    return Result(key.name, ok, usage.ru_utime + usage.ru_stime, "" if ok else text_log)


def check_keys(keys, jobs: int = 2, workdir: str | None = None, texts=None, progress=print) -> list[Result]:
    """Render and check `keys` with `jobs` parallel compiles; one Result per key, in order."""
    texts = texts or {}
    tmp = None if workdir else tempfile.TemporaryDirectory(prefix="ck_check_")
    wd = Path(workdir or tmp.name)
    wd.mkdir(parents=True, exist_ok=True)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:  # workers only shell out
            futures = [pool.submit(check_one, k, wd, texts.get(k.name)) for k in keys]
            results = []
            for i, f in enumerate(futures):
                r = f.result()
                results.append(r)
                if progress:
                    progress(f"[{i + 1}/{len(keys)}] {'ok  ' if r.ok else 'FAIL'} {r.seconds:5.1f} s CPU  {r.name}")
        return results
    finally:
        if tmp:
            tmp.cleanup()


def run_negative(jobs: int, workdir: str | None) -> list[Result]:
    """The controls' results; a control 'passes' (ok=True below) when its compile check FAILED."""
    controls = [(k, why) for arch in rules.archs("ck_tile") for k, why in negative_controls(arch)]
    texts = {k.name: render_unchecked(k) for k, _ in controls}
    for k, why in controls:
        assert rules.check(k), f"negative control {k.name} is legal: fix the control"
    results = check_keys([k for k, _ in controls], jobs, workdir, texts, progress=None)
    out = []
    for (k, why), r in zip(controls, results):
        first_error = next((ln for ln in r.log.splitlines() if "error" in ln), "")
        print(f"negative control {k.arch}: {why}: compile check {'FAILED as it must' if not r.ok else 'PASSED (wrong!)'}"
              + (f"\n    {first_error[:200]}" if first_error else ""))
        out.append(Result(k.name, not r.ok, r.seconds, r.log))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", help="comma-separated kernel sets (default: every preselected set with ck_tile groups)")
    ap.add_argument("--archs", help="comma-separated archs (default: gfx90a,gfx942,gfx950)")
    ap.add_argument("--names", nargs="*", help="check these kernel names only")
    ap.add_argument("--negative", action="store_true", help="run only the negative controls")
    ap.add_argument("--no-negative", action="store_true", help="skip the negative controls (quick local runs)")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--workdir", help="keep rendered sources here (default: a temporary directory)")
    ap.add_argument("--json", help="write a summary (counts, times, failures) to this file")
    ap.add_argument("--sets-for", metavar="ARCH",
                    help="print the comma-separated preselected sets with ck_tile kernels for ARCH and exit "
                         "(for `scons kernels=... backend=ck_tile arch=ARCH check=1`)")
    args = ap.parse_args(argv)
    if args.sets_for:
        print(",".join(s for s, per_arch in preselected_keys(archs=[args.sets_for]).items()))
        return 0
    try:
        ck_tile.check_toolchain()
    except RuntimeError as e:
        print(f"ck_check: {e}", file=sys.stderr)
        return 2

    start = time.time()
    negatives = [] if args.no_negative else run_negative(args.jobs, args.workdir)
    if args.negative:
        return 0 if all(r.ok for r in negatives) else 1

    if args.names:
        table = {"(names)": {"*": [parse_kernel_name(n) for n in args.names]}}
    else:
        table = preselected_keys(args.sets.split(",") if args.sets else None,
                                 args.archs.split(",") if args.archs else None)
    unique: dict[str, KernelKey] = {}
    for per_arch in table.values():
        for keys in per_arch.values():
            for k in keys:
                unique.setdefault(k.name, k)
    for set_name, per_arch in table.items():
        print(f"{set_name}: " + ", ".join(f"{a} {len(v)}" for a, v in per_arch.items()))
    print(f"checking {len(unique)} kernel(s) with {args.jobs} job(s)", flush=True)
    t0 = time.time()
    results = check_keys(list(unique.values()), args.jobs, args.workdir)
    wall = time.time() - t0
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"\nFAILED {r.name}\n" + "\n".join("    " + ln for ln in r.log.strip().splitlines()[-30:]))
    cpu = sum(r.seconds for r in results)
    print(f"\n{len(results) - len(failed)}/{len(results)} passed in {wall:.0f} s wall ({args.jobs} jobs); "
          f"compiler CPU time {cpu:.0f} s, {cpu / max(len(results), 1):.1f} s per source; negative controls: "
          f"{sum(r.ok for r in negatives)}/{len(negatives)} failed as they must; total {time.time() - start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "counts": {s: {a: len(v) for a, v in pa.items()} for s, pa in table.items()},
            "kernels": len(results), "failed": [r.name for r in failed], "wall_s": round(wall, 1),
            "cpu_s": round(cpu, 1), "per_source_cpu_s": round(cpu / max(len(results), 1), 2),
            "jobs": args.jobs,
            "negative_controls": {r.name: "failed as required" if r.ok else "PASSED (bad)" for r in negatives},
        }, indent=2))
    return 0 if not failed and all(r.ok for r in negatives) else 1


if __name__ == "__main__":
    sys.exit(main())
