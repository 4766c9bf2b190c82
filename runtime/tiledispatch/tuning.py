"""Measured selection (autotune): time the best-ranked few candidates on the caller's data (measure) and
remember the winner (the ranking's pick unless another is faster beyond noise: Registry._confirmed_winner), per device, in a persistent JSON file; later selections for the same problem,
device and candidate set take the remembered kernel without timing anything.

The file is $TD_TUNING_CACHE, else ~/.cache/tiledispatch/tuning.json ("none" keeps records in memory
only). Records are keyed by the device's identity, the problem's full description and a digest of the
candidate kernels' names, so a different GPU, bundle or problem never reuses a record.

The file is never trusted: one that is not a regular file (a FIFO, a directory, a device) is neither
read nor replaced; unreadable JSON, a wrong schema and any part of the wrong structure are ignored. Each
such problem, and a file that cannot be written, is reported once per TuningCache, and the records are
kept in memory. A write is a read-modify-write under an exclusive flock on a sidecar "<file>.lock": the
records other processes wrote since are merged, and the new file is written to a temporary file in the
same directory, fsynced and renamed over the old one, so readers (who take no lock) see either file whole.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import statistics
import tempfile
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
    """What a tuning record is valid for: the identity the driver of a backend whose kernels run on `device`
    gives (the GPU's name and SM count, or the CPU's model and core count)."""
    from . import backends

    return next(b.driver for b in backends.all_backends().values() if b.device == device).identity()


def problem_key(problem, kernel_names) -> str:
    digest = hashlib.sha256("\n".join(sorted(kernel_names)).encode()).hexdigest()[:16]
    return f"{problem} | candidates {digest}"


LOCK_TIMEOUT_S = 10.0  # a writer that holds the lock longer is stuck: keep the record in memory instead


class TuningCache:
    """{device identity: {problem key: record}} in one JSON file, read lazily, merged on write."""

    def __init__(self, path: Optional[Path]):
        self.path = Path(path) if path is not None else None
        self._records: Optional[dict] = None
        self._reported: set = set()

    def _report(self, what: str, message: str) -> None:
        """Warn about one kind of problem with the file once: a bad file must not flood every call."""
        if what not in self._reported:
            self._reported.add(what)
            warnings.warn(f"{self.path}: {message}", stacklevel=4)

    def _is_regular(self) -> Optional[bool]:
        """True for a regular file (or a link to one), False for anything else, None when absent."""
        try:
            return stat.S_ISREG(os.stat(self.path).st_mode)
        except (FileNotFoundError, NotADirectoryError):  # nothing recorded yet
            return None
        except OSError as e:  # e.g. no permission to search a parent, a loop of links
            self._report("unreadable", f"unreadable tuning cache ({e}); ignoring it")
            return None

    def _read(self) -> tuple[dict, bool]:
        """(the file's valid records, whether the file may be replaced); problems are reported once,
        never raised. A path that is not a regular file is neither read nor replaced."""
        if self.path is None:
            return {}, False
        regular = self._is_regular()
        if regular is None:
            return {}, True
        try:
            if regular:
                # O_NONBLOCK: should the path become a FIFO after the stat, the open still returns at once
                fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                with os.fdopen(fd, "rb") as f:
                    regular = stat.S_ISREG(os.fstat(f.fileno()).st_mode)
                    text = f.read() if regular else b""
        except OSError as e:
            self._report("unreadable", f"unreadable tuning cache ({e}); ignoring it")
            return {}, True
        if not regular:
            self._report("not regular", "the tuning cache is not a regular file; ignoring it (records are kept "
                                        "in memory)")
            return {}, False
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested too deeply
            self._report("unreadable", f"unreadable tuning cache ({e}); ignoring it")
            return {}, True
        return self._valid(data), True

    def _valid(self, data) -> dict:
        """The parts of a parsed file with the right structure; the rest is reported (once) and dropped."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("devices"), dict):
            found = f"schema {data.get('schema')!r}" if isinstance(data, dict) else type(data).__name__
            self._report("structure", f"unreadable tuning cache (expected an object with schema {SCHEMA} and a "
                                      f"'devices' object, found {found}); ignoring it")
            return {}
        devices, bad = {}, []
        for device, records in data["devices"].items():
            if not isinstance(records, dict):
                bad.append(f"the records of {device!r} are not an object")
                continue
            kept = {key: rec for key, rec in records.items()
                    if isinstance(rec, dict) and isinstance(rec.get("kernel"), str)}
            if len(kept) < len(records):
                bad.append(f"{len(records) - len(kept)} record(s) of {device!r} without a kernel name")
            if kept:
                devices[device] = kept
        if bad:
            self._report("structure", f"tuning cache of the wrong structure ({'; '.join(bad)}); ignoring those parts")
        return devices

    def records(self) -> dict:
        if self._records is None:
            self._records = self._read()[0]
        return self._records

    def get(self, device: str, key: str) -> Optional[dict]:
        return self.records().get(device, {}).get(key)

    def put(self, device: str, key: str, record: dict) -> None:
        self.records().setdefault(device, {})[key] = record
        if self.path is None:
            return
        try:
            merged = self._locked_update(device, key, record)
        except OSError as e:
            self._report("unwritable", f"cannot save tuning records ({e}); they are kept in memory for this "
                                       f"process only")
            return
        if merged is not None:  # what other processes recorded is visible here from now on
            for dev, records in merged.items():
                self._records.setdefault(dev, {}).update(records)

    def _locked_update(self, device: str, key: str, record: dict) -> Optional[dict]:
        """Under the lock: read the file, add the record, write it back. None when the path is not a
        regular file (it is left alone)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(self.path.with_name(self.path.name + ".lock"),
                       os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        try:
            _lock(lock)
            merged, replaceable = self._read()
            if not replaceable:
                return None
            merged.setdefault(device, {})[key] = record
            _write_atomically(self.path, json.dumps({"schema": SCHEMA, "devices": merged}, indent=1,
                                                    sort_keys=True) + "\n")
            return merged
        finally:
            os.close(lock)  # releases the flock


def _lock(fd: int) -> None:
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the lock was held by another process for over {LOCK_TIMEOUT_S:g} s") from None
            time.sleep(0.005)


def _write_atomically(path: Path, text: str) -> None:
    """A temporary file in the same directory, fsynced, then renamed over path (and the rename fsynced)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename's durability; some filesystems cannot fsync a directory
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def record(winner: str, measured: dict) -> dict:
    """A tuning record: the winner and each candidate's times (measure()'s): "times_ms" at the caller's pace,
    and on a GPU "gpu_times_ms" queued."""
    out = {"kernel": winner, "times_ms": {k: round(m["paced"], 6) for k, m in measured.items()}}
    queued = {k: round(m["queued"], 6) for k, m in measured.items() if "queued" in m}
    if queued:
        out["gpu_times_ms"] = queued
    out["when"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return out


def measure(launch: Callable[[], None], device: str, stream: Optional[int]) -> dict:
    """Milliseconds per launch in the steady states a caller runs, each the median of batches of back-to-back
    launches on the caller's data: "paced", as a loop of calls runs them, the host's cost per launch included (a
    host-bound caller waits on it, whatever the kernel; cuda.time_paced on a GPU); on a GPU also "queued", each batch queued behind a delay
    (cuda.time_queued): the GPU's time alone, as a busy stream or a CUDA graph runs them. Kernels differ in both:
    a TMA kernel's launch costs the host more than an older kernel's, and on a problem of a few microseconds it
    can be faster on the GPU and slower in a loop of calls."""
    if device == "cuda":
        from . import cuda

        return {how: statistics.median(timer(launch, stream=stream or 0))
                for how, timer in (("paced", cuda.time_paced), ("queued", cuda.time_queued))}
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
    return {"paced": statistics.median(samples)}
