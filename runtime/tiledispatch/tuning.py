"""Measured selection (autotune): time the best-ranked few candidates once on the caller's data and
remember the winner, per device, in a persistent JSON file; later selections for the same problem,
device and candidate set take the remembered kernel without timing anything.

The file is $TD_TUNING_CACHE, else ~/.cache/tiledispatch/tuning.json ("none" keeps records in memory
only). Records are keyed by the device's identity, the problem's full description and a digest of the
candidate kernels' names, so a different GPU, bundle or problem never reuses a record. An unreadable
file is reported and ignored (never trusted); writes go through a temporary file and a rename.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

SCHEMA = 1


def default_path() -> Optional[Path]:
    value = os.environ.get("TD_TUNING_CACHE", "")
    if value.lower() == "none":
        return None
    return Path(value) if value else Path.home() / ".cache" / "tiledispatch" / "tuning.json"


def device_identity(device: str) -> str:
    """What a tuning record is valid for: the GPU's name and SM count, or the CPU's model and core count."""
    if device == "cuda":
        from . import cuda

        return f"cuda:{cuda.device_name()}:{cuda.multiprocessor_count()} SMs"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{device}:{model}:{os.cpu_count()} cpus"


def problem_key(problem, kernel_names) -> str:
    digest = hashlib.sha256("\n".join(sorted(kernel_names)).encode()).hexdigest()[:16]
    return f"{problem} | candidates {digest}"


class TuningCache:
    """{device identity: {problem key: record}} in one JSON file, read lazily, merged on write."""

    def __init__(self, path: Optional[Path]):
        self.path = path
        self._records: Optional[dict] = None

    def _read(self) -> dict:
        if self.path is None or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if data.get("schema") != SCHEMA or not isinstance(data.get("devices"), dict):
                raise ValueError(f"schema {data.get('schema')!r}, expected {SCHEMA}")
            return data["devices"]
        except (OSError, ValueError, AttributeError) as e:
            warnings.warn(f"{self.path}: unreadable tuning cache ({e}); ignoring it", stacklevel=3)
            return {}

    def records(self) -> dict:
        if self._records is None:
            self._records = self._read()
        return self._records

    def get(self, device: str, key: str) -> Optional[dict]:
        return self.records().get(device, {}).get(key)

    def put(self, device: str, key: str, record: dict) -> None:
        self.records().setdefault(device, {})[key] = record
        if self.path is None:
            return
        merged = self._read()  # another process may have written since we read
        merged.setdefault(device, {})[key] = record
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"schema": SCHEMA, "devices": merged}, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, self.path)
        except OSError as e:
            warnings.warn(f"{self.path}: cannot save the tuning record ({e}); it is kept for this process only",
                          stacklevel=3)


def record(winner: str, times_ms: dict) -> dict:
    return {"kernel": winner, "times_ms": {k: round(v, 6) for k, v in times_ms.items()},
            "when": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def time_ms(launch: Callable[[], None], device: str, stream: Optional[int]) -> float:
    """Milliseconds per launch, median of repeated single launches. On a GPU each launch starts with a
    cold L2 cache (cuda.time_cold_calls), as the benchmarks time kernels on rotated inputs: tuning on data
    that stays in L2 between repeats would favour kernels that only win when it does."""
    if device == "cuda":
        from . import cuda

        return statistics.median(cuda.time_cold_calls(lambda i: launch(), stream=stream or 0, calls=11))
    launch()
    t0 = time.perf_counter()
    launch()
    probe = (time.perf_counter() - t0) * 1e3
    calls = max(1, min(50, int(2.0 / max(probe, 1e-3))))
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            launch()
        samples.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(samples)
