"""Kernel count and cold build time of every preselected set (issue #20 item 5), and the table of preselected/README.md.

    python3 bench/benchmarks/preselected_build.py counts                       # kernels per set and target
    python3 bench/benchmarks/preselected_build.py measure [--archs sm90a,sm80] [--jobs 16] [--budget 540] \\
        [--state build/preselected_build] [--out bench/results/preselected_build.json] [--sets a,b]
    python3 bench/benchmarks/preselected_build.py table [--results bench/results/preselected_build.json]

measure: each set with cutlass kernels for the arch, smallest first, built cold (a build directory and a kernel
cache of its own under --state, both empty at its first attempt) with scons -jJOBS, as `scons kernels=SET
backend=cutlass arch=ARCH` builds it for a user. A set whose build does not finish within what is left of --budget
seconds goes on at the next call: its attempt stored each kernel it finished in the set's cache as it finished it,
and the next attempt fetches those instead of compiling them again, so its cold time is the sum of its attempts
(cold_seconds). Exit 3 until every set is done. The JSON is rewritten after each attempt. Run it on the GPU machine (16
cores) after `source bench/gpu_env.sh && td_setup` (nvcc and the CUTLASS headers); it needs no GPU.
table: rewrites the table between the markers of preselected/README.md from the sets (counts) and the results
(cold times); tests/integration/test_suites.py checks that the README holds what this writes.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "runtime"))

from tiledispatch.generator import kernelset  # noqa: E402

PRESELECTED = REPO / "preselected"
README = PRESELECTED / "README.md"
RESULTS = REPO / "bench" / "results" / "preselected_build.json"  # the machine is recorded inside
TARGETS = ("cutlass/sm90a", "cutlass/sm80", "ck_tile/gfx90a", "ck_tile/gfx942", "ck_tile/gfx950", "cpu/x86v4")
BEGIN, END = "<!-- preselected-table: bench/benchmarks/preselected_build.py table -->", "<!-- /preselected-table -->"
SUMMARY = re.compile(r"(\d+) kernel\(s\): (\d+) compiled, (\d+) from cache, (\d+) up to date, (\d+) failed")


@functools.cache
def counts() -> dict[str, dict[str, int]]:
    """set -> {target: kernels} for every preselected set and the targets it has kernels for."""
    out = {}
    for path in sorted(PRESELECTED.glob("*.yaml")):
        per = {}
        for target in TARGETS:
            backend, arch = target.split("/")
            n = len(kernelset.expand_file(path, backend, arch))
            if n:
                per[target] = n
        out[path.stem] = per
    return out


def read_results(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"machine": {}, "sets": {}}


def build(set_name: str, arch: str, jobs: int, build_dir: Path, cache_dir: Path, seconds: float) -> dict:
    """One attempt: scons in the set's own build directory with the set's own kernel cache, killed (with its
    compilers) at `seconds`. The cache is what carries a cut-off attempt's work to the next: SCons records which
    targets are up to date only when it exits, so after a kill the build directory's libraries alone would all be
    compiled again, while the cache receives each kernel as it is built."""
    cmd = [sys.executable, "-m", "SCons", "-Q", "-C", str(REPO), f"kernels={set_name}", "backend=cutlass",
           f"arch={arch}", f"build_dir={build_dir}", f"cache_dir={cache_dir}", f"bundle={set_name}", f"-j{jobs}"]
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=max(1.0, seconds))
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # scons and every nvcc it started
        log, _ = proc.communicate()
        rc = None
    attempt = {"seconds": round(time.time() - start, 1), "rc": rc}
    m = SUMMARY.search(log or "")
    if m:
        attempt.update(zip(("kernels", "compiled", "cached", "up_to_date", "failed"), map(int, m.groups())))
    else:
        attempt["compiled"] = len(re.findall(r"\] compiled ", log or ""))
    if rc not in (0, None):
        attempt["log_tail"] = (log or "")[-3000:]
    return attempt


def cold_seconds(attempts: list) -> float:
    """A set's cold build time from its attempts: their sum, from the last attempt that compiled every kernel of the
    set on (that one built nothing on the attempts before it: results of this script from before the per-set cache
    have such attempts, whose cut-off predecessors' work was lost)."""
    start = max((i for i, x in enumerate(attempts) if x.get("kernels") and x.get("compiled") == x["kernels"]),
                default=0)
    return round(sum(x["seconds"] for x in attempts[start:]), 1)


def measure(a) -> int:
    results = read_results(a.out)
    results["machine"] = {"cpu": _cpu_model(), "cpu_count": os.cpu_count(), "jobs": a.jobs, "nvcc": _nvcc(),
                          "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)}
    deadline = time.time() + a.budget
    wanted = a.sets.split(",") if a.sets else None
    todo = sorted(((n.get(f"cutlass/{arch}", 0), name, arch) for name, n in counts().items()
                   for arch in a.archs.split(",") if n.get(f"cutlass/{arch}") and (wanted is None or name in wanted)))
    for kernels, name, arch in todo:
        entry = results["sets"].setdefault(f"{name} cutlass/{arch}", {"kernels": kernels, "attempts": []})
        if entry.get("cold_seconds") is not None:
            continue
        left = deadline - time.time()
        if left < 30:
            break
        build_dir, cache_dir = a.state / f"{name}_{arch}", a.state / f"{name}_{arch}.cache"
        if not entry["attempts"]:  # a cold build starts from nothing
            shutil.rmtree(build_dir, ignore_errors=True)
            shutil.rmtree(cache_dir, ignore_errors=True)
        attempt = build(name, arch, a.jobs, build_dir, cache_dir, left)
        entry["attempts"].append(attempt)
        if attempt["rc"] == 0:
            entry["cold_seconds"] = cold_seconds(entry["attempts"])
        print(f"{name} cutlass/{arch}: {kernels} kernels, attempt {attempt}"
              + (f" -> cold build {entry['cold_seconds']} s" if "cold_seconds" in entry else ""), flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=1) + "\n")
        if attempt["rc"] is None:  # cut off: this call's budget is spent
            break
    left = [k for k, e in results["sets"].items() if e.get("cold_seconds") is None]
    print("every set is built" if not left else f"not finished: {', '.join(left)}: run measure again")
    return 3 if left else 0


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


def _nvcc() -> str:
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
        return out.splitlines()[-1] if out else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def render_table(results: dict) -> str:
    """The README's table: kernels per target, and the cold build time of the cutlass ones where measured."""
    sets = counts()
    shown = [t for t in TARGETS if any(t in n for n in sets.values())]
    described = kernelset.available_sets()
    machine = results.get("machine") or {}
    cpu = f"{machine['cpu']}, " if machine.get("cpu") else ""
    where = (f"{cpu}{machine.get('cpu_count')} cores, -j{machine.get('jobs')}, {machine.get('nvcc', '')}".rstrip(", ")
             if machine else "not measured yet")
    lines = [f"| set | {' | '.join(shown)} | cold build, cutlass/sm90a | cold build, cutlass/sm80 | what |",
             "|---|" + "---:|" * (len(shown) + 2) + "---|"]
    for name, n in sets.items():
        cells = [str(n.get(t, "-")) for t in shown]
        for arch in ("sm90a", "sm80"):
            entry = results.get("sets", {}).get(f"{name} cutlass/{arch}", {})
            cold, built, now = entry.get("cold_seconds"), entry.get("kernels"), n.get(f"cutlass/{arch}")
            if now is None:
                cells.append("-")
            elif cold is None:
                cells.append("not measured")
            else:  # a set that changed since its build was timed says so
                stale = f" ({built} of {now} kernels)" if built not in (None, now) else ""
                cells.append(f"{cold / 60:.1f} min{stale}")
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {described.get(name, '')} |")
    return "\n".join([BEGIN, "", f"Cold builds: {where}.", "", *lines, "", END])


def write_table(results_path: Path) -> None:
    text = README.read_text()
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    README.write_text(text[:start] + render_table(read_results(results_path)) + text[stop:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("counts", "measure", "table"))
    ap.add_argument("--archs", default="sm90a,sm80")
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--budget", type=float, default=540, help="seconds this call may build")
    ap.add_argument("--state", type=Path, default=REPO / "build" / "preselected_build")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--sets", default="", help="only these sets")
    a = ap.parse_args(argv)
    if a.command == "counts":
        for name, n in counts().items():
            print(f"{name:26s} " + ", ".join(f"{t} {k}" for t, k in n.items()))
        return 0
    if a.command == "measure":
        return measure(a)
    write_table(a.results)
    print(f"wrote the table of {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
