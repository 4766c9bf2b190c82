"""Helpers shared by the cpu benchmarks: host timing and a description of the machine."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time

import numpy as np

from tiledispatch import backends
from tiledispatch.generator import toolchains


def median_ms(fn, repeat: int, warmup: int = 1) -> float:
    """Median wall milliseconds of fn over repeat calls, after warmup calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def machine() -> dict:
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    blas = {}
    try:
        cfg = np.show_config(mode="dicts")
        blas = {"name": cfg["Build Dependencies"]["blas"]["name"], "version": cfg["Build Dependencies"]["blas"]["version"]}
    except Exception:  # older numpy has no dict form
        pass
    return {"cpu": model, "cores": os.cpu_count(), "arch": backends.get("cpu").detect_arch(), "python": platform.python_version(),
            "numpy": np.__version__, "blas": blas, "compiler": toolchains.get("cpu").toolchain().identity,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def write_report(path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
