"""Time every kernel of a bundle on every problem of a suite: the learned ranker's training data.

    python bench/sweeps/sweep.py BUNDLE gemm [--suite bench/suites/gemm.json] [--random 400] [--dtype fp16]
    python bench/sweeps/sweep.py BUNDLE conv --direction bwd_data [--suite bench/suites/conv.json] [--random 400]
        [--out bench/results/sweeps] [--scheduler tcp://HOST:8786] [--workers N] [--budget-s 540]

One command per op and direction. Problems: the suite files (a JSON list of problems, or an object holding
one under "problems", "layers" or "shapes", as bench/suites/*.json do; each as the problem's to_dict() writes it,
"filter" and "groups" also accepted; fields it leaves out take the command's --dtype / --layout / --direction and
the conv defaults stride 1, dilation 1, padding 0; a conv entry's "directions" says which sweeps take it, its
"uses" {model: count} which model families it belongs to) plus --random N log-uniform ones. Each
(problem, kernel) is timed as the public path runs it: the kernel's prepared call (Registry.plan, Plan.prepare)
launched back to back on the same operands, median of --repeats batches of about --batch-ms each (on a GPU
between CUDA events on the launch stream). A kernel whose td_can_run refuses the problem is recorded with its
reason, so a rerun asks it again no more than a timed one. A disturbed measurement (disturbed(): batches more than
SPREAD_LIMIT apart, or far shorter than asked for because the one-launch probe that sizes them was slowed by a
host stall) is taken again once on the spot; --retime-disturbed retimes the stored pairs whose every line of the
current binary is disturbed, and training prefers a pair's undisturbed lines.

Resumable: the results are appended, one JSON line per (problem, kernel), to a gzip store
(OUT/<op>[_<direction>]_<backend>_<arch>.jsonl.gz; each append is a complete gzip member, and a member cut
short by a crash is dropped when read), and a rerun times only the pairs the store lacks. Each line names the
kernel build it timed ("binary": the start of the kernel's build_id in the bundle's manifest, the hash of every
input of its build; the sha256 of its bytes for a bundle that records none: nvcc's bytes differ from one cold
build to the next), so a kernel whose build changed (its template, its flags, the toolchain) is timed again on
the next run, and training takes a pair's times from the newest binary stored (lines from before the stamps count
as an older binary). The problems already in the store are swept besides the suites and random draws, so a new
or rebuilt kernel is timed on all of them. Sharded through Dask
distributed: one task per problem, one single-threaded worker process per GPU (a local cluster over the
visible GPUs by default; --workers N on the cpu backend), or the workers of a running cluster
(--scheduler ADDR; start one worker per GPU on each host: `CUDA_VISIBLE_DEVICES=i
PYTHONPATH=REPO/bench/sweeps:REPO/runtime dask worker ADDR --nthreads 1 --nworkers 1`, with the bundle at the same
path). Every record names the machine it was timed
on; the store's "meta" lines describe each machine (GPU or CPU model, driver and library versions) and the
sources (git describe, the bundle's toolchain).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Iterable, Optional

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
sys.path.insert(0, str(REPO / "runtime"))

from tiledispatch.ops.conv import CONV_DIRECTIONS, ConvProblem  # noqa: E402
from tiledispatch.ops.gemm import GemmProblem  # noqa: E402
from tiledispatch.spec.key import Epilogue, parse_kernel_name  # noqa: E402

OPS = ("gemm", "conv")
RESULTS = BENCH / "results" / "sweeps"
MAX_FLOP = 2.2e12  # random problems are capped so that no single one dominates a run
BINARY_DIGITS = 16  # of a kernel's build_id (or sha256) in each stored line: enough to tell its builds apart


# -- problems ---------------------------------------------------------------------------------------
def problem_from_dict(d: dict, *, op: str, direction: Optional[str] = None, dtype: Optional[str] = None,
                      layout: Optional[str] = None):
    """A problem from its to_dict() form; fields it leaves out take the given defaults. ValueError naming what is
    wrong otherwise. Unknown fields (a suite's model name, counts) are ignored."""
    if not isinstance(d, dict):
        raise ValueError(f"a problem must be a JSON object, got {d!r}")
    if d.get("op", op) != op:
        raise ValueError(f"problem is {d.get('op')!r}, the sweep is {op}")
    epi = d.get("epilogue") or {}
    epilogue = Epilogue(epi.get("activation", "identity"), epi.get("bias", False), epi.get("residuals", 0))
    dt = d.get("dtype", dtype)
    try:
        if op == "gemm":
            return GemmProblem(d["m"], d["n"], d["k"], d.get("dtype_a", dt), d.get("dtype_b", dt),
                               d.get("dtype_c", dt), d.get("layout", layout or "rcr"), d.get("batch", 1), epilogue)
        rank = len(d["in_size"])
        per_dim = lambda name, default: d[name] if isinstance(d.get(name), list) else [d.get(name, default)] * rank  # noqa: E731
        pad = d.get("padding", 0)
        return ConvProblem(d.get("direction", direction), d["n"], d.get("g", d.get("groups", 1)), d["c"], d["k"],
                           tuple(d["in_size"]), tuple(d.get("filter_size", d.get("filter"))), tuple(per_dim("stride", 1)),
                           tuple(per_dim("dilation", 1)), tuple(per_dim("pad_lo", pad)), tuple(per_dim("pad_hi", pad)),
                           d.get("dtype_x", dt), d.get("dtype_w", dt), d.get("dtype_y", dt),
                           d.get("layout", layout or "nhwgc"), epilogue)
    except KeyError as e:
        raise ValueError(f"problem {d} lacks {e}") from None
    except Exception as e:  # the problem's own checks (InvalidInputError) say what is wrong
        raise ValueError(f"problem {d}: {e}") from None


def model_family(model: str) -> str:
    """The family of a model name, for leave-one-family-out validation: its leading letters (resnet50 and
    resnet18 -> resnet, vit_b_16 -> vit)."""
    return re.match(r"[A-Za-z]*", model).group(0).lower() or model


def load_suite(path: Path, *, op: str, direction: Optional[str], dtype: str, layout: Optional[str]) -> list[dict]:
    """The problems of a suite file for this op (and direction: conv entries that name other directions, in
    "direction" or "directions", are left out), each {"problem", "groups"}: the families of the models the entry
    comes from ("uses": {model: count}, or "model" / "family"), else the file's name. The file is a JSON list of
    problems or an object holding one under "problems", "layers" or "shapes"."""
    data = json.loads(Path(path).read_text())
    entries = data if isinstance(data, list) else next(
        (data[k] for k in ("problems", "layers", "shapes") if isinstance(data, dict) and k in data), None)
    if not isinstance(entries, list):
        raise SystemExit(f"{path}: expected a JSON list of problems or an object with a 'problems', 'layers' or "
                         f"'shapes' list")
    out = []
    for i, entry in enumerate(entries):
        if isinstance(entry, dict) and (entry.get("op", op) != op or (op == "conv" and (
                entry.get("direction", direction) != direction or direction not in entry.get("directions", [direction])))):
            continue
        try:
            problem = problem_from_dict(entry, op=op, direction=direction, dtype=dtype, layout=layout)
        except ValueError as e:
            raise SystemExit(f"{path}: problem {i}: {e}") from None
        models = list(entry.get("uses") or []) or [entry.get("model") or entry.get("family") or Path(path).stem]
        out.append({"problem": problem, "groups": sorted({model_family(str(m)) for m in models})})
    return out


def random_problems(op: str, count: int, seed: int, *, direction: Optional[str], dtype: str,
                    layout: Optional[str], max_flop: float = MAX_FLOP) -> list[dict]:
    """count log-uniform problems (GEMM: M 1..16384, N and K multiples of 8; conv: batch, channels, groups, image
    and filter sizes and stride drawn over the ranges networks use; 2D, and 1D or 3D in two draws of five),
    each of at most max_flop."""
    rng = random.Random(seed)
    # what the first, 2D-only generator did not draw (rank, channel rounding, 1D / 3D sizes) comes from a second
    # stream, so the first stream's draws stay in step: a 2D problem that neither changes is drawn as before (and
    # a rerun against a store skips it)
    rank_rng = random.Random(f"{seed}/rank")
    logu = lambda lo, hi, r=rng: round(2 ** r.uniform(math.log2(lo), math.log2(hi)))  # noqa: E731
    out, seen = [], set()
    while len(out) < count:
        if op == "gemm":
            d = {"m": logu(1, 16384), "n": 8 * logu(1, 2048), "k": 8 * logu(1, 2048)}
        else:
            g = rng.choice((1, 1, 1, 2, 4, 8, 32)) if rng.random() < 0.8 else 0  # 0: depthwise
            cg = 1 if g == 0 else logu(1, 512)
            kg = 1 if g == 0 else logu(1, 512)
            g = g or logu(8, 1024)
            size = logu(4, 224)
            f = rng.choice((1, 1, 3, 3, 3, 5, 7))
            d = {"n": logu(1, 64), "g": g, "c": g * cg, "k": g * kg, "in_size": [size, size],
                 "filter_size": [f, f], "stride": rng.choice((1, 1, 1, 2)), "dilation": 1, "padding": f // 2}
            rank = rank_rng.choice((1, 2, 2, 2, 3))
            # networks' channel counts: mostly multiples of 8 (what the TMA kernels take), some groups of 4
            shape = rank_rng.random()
            if g > 1 and cg > 1 and shape < 0.1:
                d.update(c=4 * g, k=4 * g)
            elif g == 1 and shape < 0.6:
                d.update(c=8 * max(1, round(cg / 8)), k=8 * max(1, round(kg / 8)))
            if rank == 1:  # sequences: audio and text lengths, some even filters (wav2vec2's 2 and 4)
                f = rank_rng.choice((f, f, f, 2, 4))
                d.update(in_size=[size * logu(1, 64, rank_rng)], filter_size=[f], padding=f // 2)
            elif rank == 3:  # video clips: a few frames, temporal filter 1 or 3
                depth, ft = logu(2, 16, rank_rng), rank_rng.choice((1, 3))
                pad = [ft // 2, f // 2, f // 2]
                d.update(in_size=[depth, size, size], filter_size=[ft, f, f], pad_lo=pad, pad_hi=pad,
                         stride=[1, d["stride"], d["stride"]])
        try:
            problem = problem_from_dict(d, op=op, direction=direction, dtype=dtype, layout=layout)
        except ValueError:
            continue
        if problem.flops() <= max_flop and str(problem) not in seen:
            seen.add(str(problem))
            out.append({"problem": problem, "groups": ["random"]})
    return out


# -- the store --------------------------------------------------------------------------------------
def store_path(out_dir: Path, op: str, direction: Optional[str], backend: str, arch: str) -> Path:
    return Path(out_dir) / f"{op}{'_' + direction if op == 'conv' else ''}_{backend}_{arch}.jsonl.gz"


def read_store(path: Path) -> tuple[list[dict], list[dict]]:
    """(meta lines, result lines) of a store; a gzip member cut short by a crash (the last append) is dropped,
    as is any line that is not a complete JSON object."""
    metas, rows = [], []
    if not Path(path).exists():
        return metas, rows
    raw = Path(path).read_bytes()
    text = bytearray()
    while raw:  # member by member: the good ones before a truncated one are kept
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            chunk = d.decompress(raw) + d.flush()
        except zlib.error:
            break
        if not d.eof:
            break
        text += chunk
        raw = d.unused_data
    for line in text.decode("utf-8", "replace").splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and "meta" in obj:
            metas.append(obj["meta"])
        elif isinstance(obj, dict) and "kernel" in obj and "problem_id" in obj:
            rows.append(obj)
    return metas, rows


def stored_problems(rows: list[dict], op: str, exclude: set) -> list[dict]:
    """The problems a store holds, besides those excluded (by problem id), as the sweep takes them: a kernel
    new to the bundle or rebuilt since is timed on every problem already trained on, not only on today's draw."""
    found: dict = {}
    for r in rows:
        if r["problem_id"] not in exclude:
            entry = found.setdefault(r["problem_id"], {"problem": r["problem"], "groups": set()})
            entry["groups"].update(r.get("groups") or [])
    return [{"problem": problem_from_dict(e["problem"], op=op), "groups": sorted(e["groups"])} for e in found.values()]


def append_store(path: Path, lines: Iterable[dict]) -> None:
    """Append the lines as one gzip member, flushed to disk before returning."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = gzip.compress("".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode())
    with open(path, "ab") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())


def problem_id(problem) -> str:
    return str(problem)


# -- one worker's job -------------------------------------------------------------------------------
_REGISTRIES: dict = {}  # per worker process: bundle dirs -> loaded registry


def _registry(bundles: tuple[str, ...]):
    if bundles not in _REGISTRIES:
        import tiledispatch as td

        regs = [td.load(b) for b in bundles]
        reg = regs[0]
        for other in regs[1:]:  # one bundle per backend/arch: merged kernel lists
            if (other.backend, other.arch) != (reg.backend, reg.arch):
                raise ValueError(f"bundles of different backends or arches ({reg.backend}/{reg.arch}, "
                                 f"{other.backend}/{other.arch}): sweep them separately")
            reg.kernels = reg.kernels + [k for k in other.kernels if k.name not in {j.name for j in reg.kernels}]
        _REGISTRIES[bundles] = reg
    return _REGISTRIES[bundles]


def machine(device: str) -> dict:
    """What the timings were taken on: the accelerator (or CPU) and the libraries that ran the kernels."""
    import numpy as np

    out = {"host": platform.node(), "python": platform.python_version(), "numpy": np.__version__,
           "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                       platform.processor()), "cores": os.cpu_count(),
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    if device == "cuda":
        import torch

        from tiledispatch import cuda

        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                   cuda_torch=torch.version.cuda, cudart=cuda.versions(),
                   visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    return out


def _operands(problem, device: str, seed: int) -> dict:
    """Random operands (never zero) and the output, as the public calls take them."""
    import numpy as np

    from tiledispatch.spec.dtypes import numpy_dtype

    rng = np.random.default_rng(seed)
    if problem.op == "gemm":
        shapes = {"a": (problem.batch, problem.m, problem.k), "b": (problem.batch, problem.k, problem.n),
                  "out": (problem.batch, problem.m, problem.n)}
        dtypes = {"a": problem.dtype_a, "b": problem.dtype_b, "out": problem.dtype_c}
        layouts = dict(zip(("a", "b", "out"), problem.layout))
    else:
        shapes, dtypes = problem.shapes(), {"x": problem.dtype_x, "w": problem.dtype_w, "y": problem.dtype_y}
        layouts = {}
    tensors = {}
    for role, shape in shapes.items():
        column_major = layouts.get(role) == "c"  # stored as the transpose of a row-major array
        stored = shape[:-2] + shape[:-3:-1] if column_major else shape
        if device == "cuda":  # drawn on the GPU: the host would take seconds for the suites' largest operands
            import torch

            gen = torch.Generator(device="cuda").manual_seed(seed + len(tensors))
            values = torch.empty(stored, dtype=torch.float32, device="cuda").uniform_(0.5, 1.0, generator=gen)
        else:
            values = rng.uniform(0.5, 1.0, stored).astype(np.float32)
        if np.issubdtype(numpy_dtype(dtypes[role]), np.integer):
            values = (values * 4).round()
        values = (values.to(getattr(torch, _TORCH[dtypes[role]])) if device == "cuda"
                  else values.astype(numpy_dtype(dtypes[role])))
        tensors[role] = values.swapaxes(-1, -2) if column_major else values
    return tensors


_TORCH = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "int8": "int8", "int32": "int32",
          "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


# How a store's lines on a GPU were timed: "queued", each batch queued behind a delay on the stream, so that the
# GPU runs its launches back to back. Without it (lines before this field), a kernel shorter than the host's launch
# (about 8-14 us through the prepared call on an H100 / H200) was timed at the host's pace: every such kernel
# measured alike, its ranking noise. Lines of another method count as untimed, as another binary's do.
GPU_TIMING = "queued"


def timing_method(device: str) -> Optional[str]:
    return GPU_TIMING if device == "cuda" else None


def _timer(device: str, stream):
    """fn, calls -> (milliseconds per call of `calls` back-to-back calls, whether the host fell behind the GPU).

    On a GPU, the runtime's queued timing (tiledispatch.cuda.QueuedTimer): the batch waits behind a delay kernel
    long enough for the host to queue all its launches, so the events time the GPU running them back to back, the
    steady state of a busy stream or a CUDA graph, which is when the choice of kernel matters (a host-bound caller
    waits on its own launches, whatever the kernel)."""
    if device == "cuda":
        from tiledispatch import cuda

        return cuda.QueuedTimer(stream or 0).batch

    def timed(fn, calls: int) -> tuple[float, bool]:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) * 1e3 / calls, False
    return timed


PACED_CALLS = 50  # launches in one batch at the host's pace at most: a few microseconds each


# batches of one measurement further apart than this: a host stall between launches or a clock dip disturbed it
SPREAD_LIMIT = 1.3
# a batch shorter than this share of the asked length was sized by a probe launch that a stall slowed down
SHORT_BATCH = 0.25
MAX_CALLS = 10000  # launches in one batch at most: a batch of this many is as long as it gets, never "short"
DEFAULT_BATCH_MS = {"cpu": 5.0, "cuda": 1.0}


def disturbed(line: dict) -> bool:
    """Whether a stored timing line (or a fresh record) was disturbed: its batches more than SPREAD_LIMIT apart, far
    shorter than the batch length asked for (lines from before batch_ms was recorded: the GPU default), or a batch
    whose launches the host had not all queued when the GPU reached them (_timer)."""
    samples = line.get("samples_ms") or ([line["ms"]] if line.get("ms") is not None else [])
    if not samples:
        return False
    if line.get("host_behind"):
        return True
    fastest = min(samples)
    if max(samples) > SPREAD_LIMIT * fastest:
        return True
    calls = line.get("calls")
    asked = line.get("batch_ms", DEFAULT_BATCH_MS["cuda"])
    return calls is not None and calls < MAX_CALLS and calls * fastest < SHORT_BATCH * asked


def time_problem(bundles: tuple[str, ...], problem_dict: dict, kernel_names: list[str], settings: dict) -> dict:
    """Time the named kernels on one problem (a Dask task). {"machine": ..., "records": [...]}: one record per
    kernel, with its median and raw batch times, or the reason it cannot run the problem."""
    from tiledispatch.errors import TileDispatchError
    from tiledispatch.ops import get as ops_get

    reg = _registry(tuple(bundles))
    problem = problem_from_dict(problem_dict, op=problem_dict["op"])
    stream = None
    if reg.device == "cuda":
        import torch

        stream = torch.cuda.current_stream().cuda_stream
    tensors = _operands(problem, reg.device, settings.get("seed", 0))
    ops = ops_get(problem.op).operands_for(problem, tensors)
    timed, method = _timer(reg.device, stream), timing_method(reg.device)
    records = []
    for name in kernel_names:
        record = {"problem": problem.to_dict(), "problem_id": problem_id(problem), "kernel": name}
        try:  # a refusal by td_can_run, or at launch (e.g. by CUTLASS), is recorded: that kernel cannot run it
            plan = reg.plan(problem, kernel=name, stream=stream)
            plan.prepare(ops)
            plan.launch()  # warm-up: first-touch of the operands, instruction caches, lazy module loading
            # the fastest of three single launches sizes the batches (one launch slowed by a host stall would
            # make them a few launches long, each batch then timing the stall)
            probe = min(timed(plan.launch, 1)[0] for _ in range(3))
            batch_ms = settings["batch_ms"]
            timing = {"batch_ms": batch_ms}
            if method:
                timing["timing"] = method
            for _ in range(2):  # a disturbed measurement is taken again once, batches sized from its fastest
                calls = max(1, min(MAX_CALLS, int(batch_ms / max(probe, 1e-4))))
                batches = [timed(plan.launch, calls) for _ in range(settings["repeats"])]
                samples = [ms for ms, _ in batches]
                timing.update(ms=statistics.median(samples), samples_ms=samples, calls=calls)
                timing.pop("host_behind", None)
                if any(behind for _, behind in batches):
                    timing["host_behind"] = True
                if not disturbed(timing):
                    break
                probe = min(samples)
                timing["retaken"] = True
            if method:  # also at the host's pace (a loop of prepared calls, the host's cost per launch included):
                # a kernel whose launch costs the host more (a TMA kernel's) can be faster on the GPU and slower there
                from tiledispatch import cuda

                timing["paced_ms"] = statistics.median(cuda.time_paced(
                    plan.launch, stream=stream or 0, batch_ms=batch_ms, repeats=settings["repeats"],
                    max_calls=PACED_CALLS))
        except TileDispatchError as e:
            records.append({**record, "ms": None, "refused": f"{type(e).__name__}: {e}"})
            continue
        records.append({**record, **timing})
    return {"machine": machine(reg.device), "records": records}


# -- the driver -------------------------------------------------------------------------------------
def visible_gpus() -> list[str]:
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def local_cluster(device: str, workers: Optional[int]):
    """One single-threaded worker process per visible GPU (each sees only its GPU), or `workers` processes on
    the cpu backend, each with its share of the cores for the kernels' OpenMP threads."""
    import logging

    from dask.distributed import Nanny, Scheduler, SpecCluster

    logging.getLogger("distributed").setLevel(logging.WARNING)  # the nannies and scheduler live in this process
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")  # read by the workers as they import distributed

    if device == "cuda":
        gpus = visible_gpus()
        if workers:
            gpus = gpus[:workers]
        if not gpus:
            raise SystemExit("no visible GPU for the local cluster (CUDA_VISIBLE_DEVICES, nvidia-smi -L)")
        envs = {f"gpu{g}": {"CUDA_VISIBLE_DEVICES": g} for g in gpus}
    else:
        count = workers or 1
        threads = str(max(1, (os.cpu_count() or 1) // count))
        envs = {f"cpu{i}": {"OMP_NUM_THREADS": threads} for i in range(count)}
    # no host memory limit: Dask's default share of the machine's memory (its total over the core count) is
    # below what a CUDA context and torch map in one process, and a worker paused at that limit sweeps nothing
    specs = {name: {"cls": Nanny, "options": {"nthreads": 1, "env": env, "dashboard": False, "memory_limit": 0}}
             for name, env in envs.items()}
    return SpecCluster(workers=specs, scheduler={"cls": Scheduler, "options": {"dashboard": False}}, silence_logs=40)


def bundle_facts(bundles: list[str]) -> dict:
    """backend, arch, kernels (name, op, direction), binaries (name: the prefix of the kernel's build_id, the hash
    of the inputs that built it, or for a bundle that records none the sha256 of its shared object; the first
    bundle's where several hold a name, as the sweep's registry loads it) and the toolchain of the bundles, from
    their manifests."""
    facts = {"kernels": [], "binaries": {}, "toolchain": [], "bundles": []}
    for b in bundles:
        manifest_path = Path(b) / "manifest.json"
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"{b}: not a bundle ({manifest_path}: {e})") from None
        for field in ("backend", "arch"):
            if facts.setdefault(field, manifest[field]) != manifest[field]:
                raise SystemExit(f"the bundles differ in {field}: sweep each backend / arch separately")
        facts["toolchain"].append(manifest.get("toolchain", {}))
        facts["bundles"].append({"path": str(Path(b).resolve()),
                                 "manifest_sha256": hashlib.sha256(manifest_path.read_bytes()).hexdigest()})
        for k in manifest["kernels"]:
            sig = k["key"]["signature"]
            if k["name"] not in facts["binaries"]:
                facts["kernels"].append((k["name"], sig["op"], sig.get("direction")))
                facts["binaries"][k["name"]] = (k.get("build_id") or k["sha256"])[:BINARY_DIGITS]
    return facts


def git_describe() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                              text=True, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def sweep(bundles: list[str], op: str, problems: list[dict], *, direction: Optional[str] = None,
          out_dir: Path = RESULTS, scheduler: Optional[str] = None, workers: Optional[int] = None,
          batch_ms: float = 1.0, repeats: int = 5, budget_s: Optional[float] = None, retime_disturbed: bool = False,
          log=print) -> dict:
    """Time every kernel of the bundles for the op / direction on every problem the store lacks (retime_disturbed:
    and the pairs whose every stored line of the current binary is disturbed()); returns {"store", "timed",
    "skipped", "failed" (problems whose task raised: nothing stored), "problems"}."""
    from dask.distributed import Client, as_completed

    facts = bundle_facts(bundles)
    names = sorted({n for n, o, d in facts["kernels"] if o == op and (op != "conv" or d == direction)})
    if not names:
        raise SystemExit(f"the bundles hold no {op} {direction or ''} kernels")
    store = store_path(out_dir, op, direction, facts["backend"], facts["arch"])
    binaries = facts["binaries"]
    stored = read_store(store)[1]
    device = "cpu" if facts["backend"] == "cpu" else "cuda"
    method = timing_method(device)
    current = [r for r in stored if r.get("binary") == binaries.get(r["kernel"]) and r.get("timing") == method]
    done = {(r["problem_id"], r["kernel"]) for r in current if not (retime_disturbed and disturbed(r))}
    if retime_disturbed:
        shaky = {(r["problem_id"], r["kernel"]) for r in current} - done
        log(f"{len(shaky)} stored pair(s) with only disturbed measurements of the current binary, timed again")
    problems = problems + stored_problems(stored, op, exclude={problem_id(e["problem"]) for e in problems})
    keys = {n: parse_kernel_name(n) for n in names}
    todo, skipped = [], 0
    for entry in problems:  # the kernels whose signature serves the problem (rank, dtypes, layout, epilogue)
        pid = problem_id(entry["problem"])
        serving = [n for n in names if entry["problem"].mismatch(keys[n]) is None]
        missing = [n for n in serving if (pid, n) not in done]
        skipped += len(serving) - len(missing)
        if missing:
            todo.append((entry, missing))
    timed_now = {(r["problem_id"], r["kernel"]) for r in current}
    rebuilt = sorted({r["kernel"] for r in stored
                      if r["kernel"] in keys and (r["problem_id"], r["kernel"]) not in timed_now})
    if rebuilt:  # stored lines of another build, from before the stamps or of another timing method: timed again
        log(f"{store}: {len(rebuilt)} kernel(s) with times of another binary or timing method, timed again: "
            + ", ".join(rebuilt[:5]) + (" ..." if len(rebuilt) > 5 else ""))
    log(f"{store}: {len(problems)} problem(s), {len(names)} kernel(s); {skipped} pair(s) stored, "
        f"{sum(len(m) for _, m in todo)} to time")
    result = {"store": str(store), "timed": 0, "skipped": skipped, "failed": 0, "problems": len(problems)}
    if not todo:
        return result
    sources = {"git": git_describe(), "bundles": facts["bundles"], "toolchain": facts["toolchain"],
               "backend": facts["backend"], "arch": facts["arch"], "op": op, "direction": direction,
               "timing": f"median of {repeats} batches of back-to-back launches of the prepared call (Plan) on the "
                         f"same operands, about {batch_ms} ms each" + (
                             ", queued behind a delay kernel so that the GPU runs them back to back, CUDA events on "
                             "the launch stream" if facts["backend"] != "cpu" else "")
                         + f"; taken again once where disturbed (batches over {SPREAD_LIMIT}x apart or short)",
               "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    cluster = None if scheduler else local_cluster(device, workers)
    start, known = time.time(), {}
    settings = {"batch_ms": batch_ms, "repeats": repeats}
    with Client(scheduler or cluster) as client:
        # problems largest first keeps a slow one from finishing last on an otherwise idle cluster
        todo.sort(key=lambda t: -t[0]["problem"].flops())
        futures = [client.submit(time_problem, tuple(str(Path(b).resolve()) for b in bundles),
                                 entry["problem"].to_dict(), missing, {**settings, "seed": i}, pure=False,
                                 key=f"time-{i}-{hashlib.sha1(problem_id(entry['problem']).encode()).hexdigest()[:12]}")
                   for i, (entry, missing) in enumerate(todo)]
        groups = {problem_id(e["problem"]): e["groups"] for e, _ in todo}
        problem_of = {f.key: problem_id(e["problem"]) for f, (e, _) in zip(futures, todo)}
        for future in as_completed(futures):
            try:
                out = future.result()
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: nothing is stored, a rerun tries again
                result["failed"] += 1
                log(f"{problem_of[future.key]}: failed ({type(e).__name__}: {e}); a rerun tries it again")
                continue
            tag = hashlib.sha256(json.dumps(out["machine"], sort_keys=True).encode()).hexdigest()[:16]
            lines = []
            if tag not in known:
                known[tag] = out["machine"]
                lines.append({"meta": {"machine_id": tag, "machine": out["machine"], **sources}})
            lines += [{**r, "groups": groups[r["problem_id"]], "machine_id": tag, "binary": binaries[r["kernel"]]}
                      for r in out["records"]]
            append_store(store, lines)
            result["timed"] += len(out["records"])
            best = min((r["ms"] for r in out["records"] if r["ms"] is not None), default=float("nan"))
            log(f"{out['records'][0]['problem_id']}: {len(out['records'])} kernel(s), best {best:.4f} ms")
            if budget_s is not None and time.time() - start > budget_s:
                log(f"time budget of {budget_s:g} s reached: rerun the command to go on")
                for f in futures:
                    f.cancel()
                break
    if cluster is not None:
        cluster.close()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="+", help="bundle directories of one backend / arch, then the op")
    ap.add_argument("--direction", choices=CONV_DIRECTIONS, help="conv: the direction to sweep")
    ap.add_argument("--suite", action="append", default=[], help="a JSON file of problems (repeatable)")
    ap.add_argument("--random", type=int, default=0, help="this many log-uniform random problems besides")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-gflop", type=float, default=MAX_FLOP / 1e9, help="cap on a random problem's work")
    ap.add_argument("--dtype", default="fp16", help="the dtype of problems that name none")
    ap.add_argument("--layout", help="the layout of problems that name none (default rcr / nhwgc)")
    ap.add_argument("--out", default=str(RESULTS), help="the store's folder")
    ap.add_argument("--scheduler", help="address of a running Dask scheduler (default: a local cluster)")
    ap.add_argument("--workers", type=int, help="local workers (default: one per visible GPU; cpu: 1)")
    ap.add_argument("--batch-ms", type=float, default=None, help="length of one timed batch (gpu 1, cpu 5)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, help="stop collecting after this long (a rerun goes on)")
    ap.add_argument("--retime-disturbed", action="store_true",
                    help="also time again the stored pairs whose every line of the current binary is disturbed")
    a = ap.parse_args(argv)
    *bundles, op = a.bundle
    if op not in OPS or not bundles:
        ap.error(f"give one or more bundles, then the op ({' or '.join(OPS)})")
    if (op == "conv") != (a.direction is not None):
        ap.error("conv needs --direction; gemm takes none")
    problems = [p for s in a.suite for p in load_suite(Path(s), op=op, direction=a.direction, dtype=a.dtype,
                                                        layout=a.layout)]
    problems += random_problems(op, a.random, a.seed, direction=a.direction, dtype=a.dtype, layout=a.layout,
                                max_flop=a.max_gflop * 1e9)
    facts = bundle_facts(bundles)
    backend = facts["backend"]
    if not problems and not store_path(Path(a.out), op, a.direction, backend, facts["arch"]).exists():
        ap.error("no problems: give --suite FILE and / or --random N (or rerun on a store, which sweeps its own)")
    batch_ms = a.batch_ms or DEFAULT_BATCH_MS["cpu" if backend == "cpu" else "cuda"]
    result = sweep(bundles, op, problems, direction=a.direction, out_dir=Path(a.out), scheduler=a.scheduler,
                   workers=a.workers, batch_ms=batch_ms, repeats=a.repeats, budget_s=a.budget_s,
                   retime_disturbed=a.retime_disturbed)
    print(json.dumps(result))
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    # run through the module named sweep, so that Dask sends its tasks by reference (the workers import this
    # file, and keep each loaded bundle between tasks) rather than as pickled copies of __main__
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sweep as _module

    sys.exit(_module.main())
