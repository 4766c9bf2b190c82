"""Build-time benchmark of the SCons pipeline on the cpu backend.

Measures, for the kernels of the given sets: a cold build at -j1 and at -j2 (no cache), a no-op rebuild,
and a fresh build directory served from a warm CacheDir (time per kernel). Writes JSON.

    python bench/benchmarks/build_times.py [--sets fp16_rcr_fused,fp32_rcr_essential] [--out bench/results/build_times.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def scons(*args: str) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "SCons", "-Q", "-C", str(REPO), "backend=cpu", *args],
                          capture_output=True, text=True, check=True)
    return time.perf_counter() - start, proc.stdout


def counts(stdout: str) -> dict:
    m = re.search(r"(\d+) kernel\(s\): (\d+) compiled, (\d+) from cache, (\d+) up to date", stdout)
    return dict(zip(("kernels", "compiled", "cached", "up_to_date"), map(int, m.groups())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="fp16_rcr_fused,fp32_rcr_essential,bf16_rcr_essential,int8_rcr_essential")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "build_times.json")
    a = ap.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        kernels = f"kernels={a.sets}"
        for jobs in (1, 2):
            runs[f"cold_j{jobs}"] = scons(kernels, f"-j{jobs}", f"build_dir={tmp / f'j{jobs}'}", "cache_dir=none")
        runs["noop"] = scons(kernels, f"build_dir={tmp / 'j2'}", "cache_dir=none")
        runs["populate_cache"] = scons(kernels, f"build_dir={tmp / 'warm'}", f"cache_dir={tmp / 'cache'}")
        shutil.rmtree(tmp / "warm")
        runs["fresh_dir_warm_cache"] = scons(kernels, f"build_dir={tmp / 'fresh'}", f"cache_dir={tmp / 'cache'}")
    result = {name: {"seconds": round(t, 3), **counts(out)} for name, (t, out) in runs.items()}
    n = result["cold_j1"]["kernels"]
    summary = {
        "kernels": n,
        "speedup_j2": round(result["cold_j1"]["seconds"] / result["cold_j2"]["seconds"], 2),
        "noop_seconds": result["noop"]["seconds"],
        "cache_hit_seconds_per_kernel": round(result["fresh_dir_warm_cache"]["seconds"] / n, 3),
        "cold_seconds_per_kernel_j1": round(result["cold_j1"]["seconds"] / n, 3),
    }
    report = {"benchmark": "build_times", "date": time.strftime("%Y-%m-%d"), "sets": a.sets,
              "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                          "load_average_at_end": os.getloadavg()},
              "summary": summary, "runs": result,
              "note": "wall time of whole scons invocations, including reading SConstruct and expanding sets"}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
