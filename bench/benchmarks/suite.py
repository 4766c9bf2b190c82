"""Issue #20's suites (bench/suites/*.json) through the public call path, against the peer at its best in the same run.

    python bench/benchmarks/suite.py conv BUNDLE [BUNDLE ...] --out DIR [--shard I/N] [--limit N] [--only REGEX]
    python bench/benchmarks/suite.py gemm BUNDLE [BUNDLE ...] --out DIR [--dtypes fp16,bf16] [--shard I/N]
    python bench/benchmarks/suite.py report DIR [DIR ...]      # summary and PNG over every shard's results
    python bench/benchmarks/suite.py compare BEFORE_DIR AFTER_DIR [--out FILE_STEM]   # two runs, point by point
    python bench/benchmarks/suite.py conv BUNDLE --versus OLD_BUNDLE --out DIR; suite.py compare DIR   # interleaved
    python bench/benchmarks/suite.py conv BUNDLE --versus-models OLD_MODELS_DIR --out DIR   # same bundle, other models
    python bench/benchmarks/suite.py conv BUNDLE --autotune --versus-models runtime/tiledispatch/models --out DIR
                                                                   # autotuned against the learned pick

Ours: reg.conv_fwd / conv_bwd_data / conv_bwd_weight (x, w, out=..., groups=...) and reg.gemm(a, b, out=d) on one
registry of the bundles' kernels, no tuning records: every host cost of a user's repeated call is in the time.
Beside it, as a diagnostic, the kernel that call selects launched alone (its td_args built once).
The peer at its best: cuDNN through PyTorch on the same channels-last tensors with cudnn.benchmark (F.conv*d,
aten.convolution_backward), a 1D layer also as 2D with H = 1; cuBLAS through torch.mm(out=) and F.linear; the
fastest form kept, and the fastest of two processes (a second one times the peer alone first: cuDNN's autotuning
does not pick the same algorithm every time). Timing: CUDA events around batches of back-to-back calls (about
2 ms a batch), median of the batches. Inputs random, never zero; our output poisoned (NaN) before it is checked
against the peer's (relative L2 error in float64). A point that no kernel of the bundles runs is reported as such.
Grouped and depthwise points also time a device copy of the layer's minimum bytes: the memory floor.

Points are (layer, direction) of the conv suite (the directions a training step runs on it) or (shape, dtype) of
the GEMM suite; --shard I/N takes every N-th point from the I-th (0-based) so shards have alike mixes, --limit
the first N of those. Results are appended to DIR/<suite>[_shard].jsonl as each point finishes (a call cut off
keeps what it measured; --resume DIR skips the points already there), then DIR/<suite>[_shard].json (machine,
versions, summary: per direction / pass, class and rank / dtype, the geomean and minimum of peer / ours), the
summary as a markdown table (.md) and a PNG of the sorted ratios when matplotlib is present. `report` merges
shards the same way.

--device cpu (with a cpu bundle) runs the same construction and checks on the CPU against PyTorch's CPU ops,
timed with perf_counter: a test of this script (tests/test_suites.py), not a benchmark.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO / "runtime"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _gpu_common import random_tensor, time_batch  # noqa: E402
import tiledispatch as td  # noqa: E402
from tiledispatch import abi  # noqa: E402
from tiledispatch.errors import UnsupportedProblemError  # noqa: E402
from tiledispatch.ops import conv, conv_as_gemm, gemm as gemm_op  # noqa: E402
from tiledispatch.plan import bind  # noqa: E402
from tiledispatch.registry import Registry  # noqa: E402
from tiledispatch.tuning import TuningCache  # noqa: E402

SUITES = BENCH / "suites"
TOLERANCE = {"fp16": 1e-2, "bf16": 2e-2}  # relative L2 error against the peer (both round the output)
TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}
DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")
TARGET_MS = 2.0  # one timed batch of back-to-back calls
REPEATS = 7


# ---- the registry and timing ----------------------------------------------------------------------------------
def registry_of(dirs: list[str], models=None, autotune: bool = False) -> Registry:
    """One registry of the bundles' kernels (first bundle's copy of a kernel in several), no tuning records; models:
    a folder of learned models to rank with instead of the shipped ones (Registry.use_models); autotune: the first
    call of a problem tunes it, the records kept in memory."""
    regs = [td.load(d, tuning_cache=TuningCache(None), autotune=autotune) for d in dirs]
    if len(regs) == 1:
        regs[0].use_models(models)
        return regs[0]
    kernels, seen = [], set()
    for reg in regs:
        for k in reg.kernels:
            if k.name not in seen:
                seen.add(k.name)
                kernels.append(k)
    reg = Registry(kernels, regs[0].backend, regs[0].arch, regs[0].manifest, tuning_cache=TuningCache(None),
                   autotune=autotune)
    reg.use_models(models)
    return reg


def median_ms(fn, device: str) -> float:
    """Median milliseconds per call over REPEATS batches of back-to-back calls, each batch about TARGET_MS."""
    if device == "cuda":
        probe = time_batch(fn, 1, 3, warmup=2)
        return time_batch(fn, max(1, min(500, int(TARGET_MS / max(probe, 1e-4)))), REPEATS)
    start = time.perf_counter()  # the cpu mode tests this script: one call
    fn()
    return (time.perf_counter() - start) * 1e3


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double().reshape(got.shape)
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def launch(kern, args):
    def call():
        status, reason = kern.library.run(args)
        if status != abi.OK:
            raise RuntimeError(f"{kern.name}: status {status}: {reason}")
    return call


# ---- conv ------------------------------------------------------------------------------------------------------
def channels_last(lead: int, chan: int, sp, dtype: str, gen) -> torch.Tensor:
    """[lead, chan, *sp] with channels-last memory (the layout cuDNN and our kernels take)."""
    t = random_tensor((lead, *sp, chan), dtype, gen)
    return t.permute(0, len(sp) + 1, *range(1, len(sp) + 1))


def conv_tensors(layer: dict, direction: str, dtype: str, batch: int, gen):
    n = batch or layer["n"]
    p = conv.ConvProblem(direction, n, layer["groups"], layer["c"], layer["k"], *(tuple(layer[f]) for f in (
        "in_size", "filter", "stride", "dilation", "pad_lo", "pad_hi")), dtype, dtype, dtype)
    x = channels_last(n, p.c, p.in_size, dtype, gen)
    w = channels_last(p.k, p.c // p.g, p.filter_size, dtype, gen)
    y = channels_last(n, p.k, p.out_size, dtype, gen)
    return p, x, w, y


def cudnn_forms(p: conv.ConvProblem, x, w, y) -> dict:
    """name -> call returning the direction's result: the layer at its rank, and a 1D layer also as 2D, H = 1."""
    if p.pad_lo != p.pad_hi:
        raise ValueError(f"padding {p.pad_lo} / {p.pad_hi}: PyTorch's convolutions take symmetric padding only")
    forms = {"cudnn": (x, w, y, list(p.stride), list(p.pad_lo), list(p.dilation))}
    if p.spatial_dims == 1:
        as_2d = [t.unsqueeze(2).contiguous(memory_format=torch.channels_last) for t in (x, w, y)]  # NHWC, H = 1
        forms["cudnn_as_2d"] = (*as_2d, [1, *p.stride], [0, *p.pad_lo], [1, *p.dilation])
    calls = {}
    for name, (tx, tw, ty, s, pad, dil) in forms.items():
        rank = tx.dim() - 2
        if p.direction == "fwd":
            fn = (F.conv1d, F.conv2d, F.conv3d)[rank - 1]
            calls[name] = lambda fn=fn, tx=tx, tw=tw, s=s, pad=pad, dil=dil: fn(tx, tw, None, s, pad, dil, p.g)
        else:
            mask = [p.direction == "bwd_data", p.direction == "bwd_weight", False]
            which = 0 if p.direction == "bwd_data" else 1
            calls[name] = lambda tx=tx, tw=tw, ty=ty, s=s, pad=pad, dil=dil, rank=rank, mask=mask, which=which: \
                torch.ops.aten.convolution_backward(ty, tx, tw, None, s, pad, dil, False, [0] * rank, p.g, mask)[which]
    return calls


def conv_selected(reg, p: conv.ConvProblem, x, w, y):
    """(name, call) of the kernel reg's public call selects for the problem, launched alone: a pointwise layer on a
    GEMM kernel where one runs it (the runtime's lowering, ops/conv_as_gemm.py), else a conv kernel."""
    _, ops = conv.operands(p.direction, x, w, y, stride=p.stride, dilation=p.dilation, pad_lo=p.pad_lo,
                           pad_hi=p.pad_hi, groups=p.g)
    views = conv_as_gemm.operands(p, ops) if "gemm" in reg.ops else None
    if views is not None:
        gp, gops = gemm_op.operands(*views)
        try:
            kern = reg.select(gp, operands=gops)
            return kern.name, launch(kern, bind(reg, gp, kern, gops))
        except UnsupportedProblemError:
            pass
    kern = reg.select(p, operands=ops)
    return kern.name, launch(kern, bind(reg, p, kern, ops))


def conv_point(reg, layer: dict, direction: str, dtype: str, batch: int, device: str, gen, peer_only: bool,
               api: str = "registry", versus=None, versus_first: bool = False) -> dict:
    p, x, w, y = conv_tensors(layer, direction, dtype, batch, gen)
    row = {"id": layer["id"], "direction": direction, "dtype": dtype, "cls": layer["cls"], "rank": layer["rank"],
           "n": p.n, "weight": layer["weight"], "flops": p.flops()}
    peers = cudnn_forms(p, x, w, y)
    want = None
    row["peer_ms"] = {}
    for name, call in peers.items():
        out = call()
        want = out if want is None else want
        row["peer_ms"][name] = median_ms(call, device)
    if peer_only:
        return row
    want = want.clone()
    if layer["cls"] != "dense":  # memory-bound: the floor is a copy of the layer's minimum bytes (issue #20 item 2)
        row["bytes"] = sum(t.numel() for t in (x, w, y)) * x.element_size()
        src = torch.empty(row["bytes"] // 2 // x.element_size(), dtype=x.dtype, device=device)  # half read,
        dst = torch.empty_like(src)  # half written
        row["copy_ms"] = median_ms(lambda: dst.copy_(src), device)
        del src, dst
    written = {"fwd": y, "bwd_data": x, "bwd_weight": w}[direction]
    geo = dict(stride=p.stride, dilation=p.dilation, pad_lo=p.pad_lo, pad_hi=p.pad_hi, groups=p.g)
    exact = lambda: cudnn_forms(p, x.double(), w.double(), y.double())["cudnn"]()  # noqa: E731

    def measure(reg, into: dict) -> dict:
        if api == "torch":  # the operators a patched model's forward and autograd backward call (each a new tensor)
            import tiledispatch.torch as tdt
            ops, handle = torch.ops.tiledispatch, tdt.register(reg)
            args = (list(p.stride), list(p.dilation), list(p.pad_lo), list(p.pad_hi), p.g, handle)
            ours = {"fwd": lambda: ops.conv_fwd(x, w, None, [], "identity", 0.0, 0.0, *args),
                    "bwd_data": lambda: ops.conv_bwd_data(y, w, list(x.shape[2:]), *args),
                    "bwd_weight": lambda: ops.conv_bwd_weight(x, y, list(w.shape[2:]), *args)}[direction]
        else:
            ours = {"fwd": lambda: reg.conv_fwd(x, w, out=y, **geo),
                    "bwd_data": lambda: reg.conv_bwd_data(y, w, out=x, **geo),
                    "bwd_weight": lambda: reg.conv_bwd_weight(x, y, out=w, **geo)}[direction]
        return ours_and_check(into, ours, written, want, lambda: conv_selected(reg, p, x, w, y), device, exact)

    return measured(row, measure, reg, versus, versus_first)


VERSUS_FIELDS = ("status", "reason", "rel_error", "rel_error_f64", "peer_off", "ours_ms", "kernel", "kernel_ms")


def measured(row: dict, measure, reg, versus, versus_first: bool) -> dict:
    """measure(reg, row): ours on the row. With a versus registry (--versus: the other side of a before / after),
    also measure(versus, ...) into row["versus"], the two taken one right after the other on the same operands;
    which goes first alternates by point, so that neither always finds the caches warm from the other."""
    if versus is None:
        return measure(reg, row)
    other = {"dtype": row["dtype"]}
    for r, into in ([(versus, other), (reg, row)] if versus_first else [(reg, row), (versus, other)]):
        measure(r, into)
    row["versus"] = {k: other[k] for k in VERSUS_FIELDS if k in other}
    return row


def ours_and_check(row: dict, ours, written: torch.Tensor, want: torch.Tensor, selected, device: str,
                   reference=None) -> dict:
    """Our public call checked against the peer's result, timed; the selected kernel alone timed beside it. Where
    the two disagree, reference() (the float64 result) decides which is off: the peer is wrong at times too (cuDNN's
    1x1 bwd_weight on 65x65 images, bench/results/conv_model_h200/wgrad_check.json)."""
    written.fill_(float("nan"))
    try:
        got = ours()  # the output: `written` for the registry's calls, a new tensor for the torch operators
        got = written if got is None else got
    except UnsupportedProblemError as e:
        row.update(status="no kernel", reason=str(e)[:2000])
        return row
    sync(device)
    tol = TOLERANCE[row["dtype"]]
    row["rel_error"] = rel_error(got, want)
    row["status"] = "ok" if row["rel_error"] <= tol else "wrong result"
    if row["status"] != "ok" and reference is not None:
        exact = reference()
        row["rel_error_f64"], row["peer_rel_error_f64"] = rel_error(got, exact), rel_error(want, exact)
        if row["rel_error_f64"] <= tol:
            row["status"] = "ok"
            row["peer_off"] = row["peer_rel_error_f64"] > tol
    row["ours_ms"] = median_ms(ours, device)
    name, alone = selected()
    row["kernel"] = name
    row["kernel_ms"] = median_ms(alone, device)
    return row


# ---- GEMM ------------------------------------------------------------------------------------------------------
def gemm_point(reg, shape: dict, dtype: str, device: str, gen, peer_only: bool, versus=None,
               versus_first: bool = False) -> dict:
    m, n, k, layout = shape["m"], shape["n"], shape["k"], shape["layout"]
    a = random_tensor((m, k), dtype, gen, layout[0])
    b = random_tensor((k, n), dtype, gen, layout[1])
    d = torch.empty((m, n), dtype=TORCH_DTYPE[dtype], device=device)
    theirs = torch.empty_like(d)
    row = {"id": shape["id"], "pass": shape["pass"], "dtype": dtype, "m": m, "n": n, "k": k, "layout": layout,
           "weight": shape["weight"], "flops": 2 * m * n * k}
    peers = {"torch.mm": lambda: torch.mm(a, b, out=theirs), "F.linear": lambda: F.linear(a, b.t())}
    want = peers["torch.mm"]().clone()
    row["peer_ms"] = {name: median_ms(call, device) for name, call in peers.items()}
    if peer_only:
        return row

    def measure(reg, into: dict) -> dict:
        def selected():
            problem, ops = gemm_op.operands(a, b, d)
            kern = reg.select(problem, operands=ops)
            return kern.name, launch(kern, bind(reg, problem, kern, ops))

        return ours_and_check(into, lambda: reg.gemm(a, b, out=d), d, want, selected, device,
                              lambda: torch.mm(a.double(), b.double()))

    return measured(row, measure, reg, versus, versus_first)


# ---- the run ---------------------------------------------------------------------------------------------------
def point_key(row: dict) -> str:
    return f"{row['id']}|{row.get('direction', row.get('pass'))}|{row['dtype']}"


def points(suite_name: str, suite: dict, a) -> list[tuple]:
    """(entry, direction or pass, dtype) of the selection, sharded and limited."""
    only = re.compile(a.only) if a.only else None
    classes = set(a.classes.split(",")) if a.classes else None
    dirs = set(a.directions.split(",")) if a.directions else None
    out = []
    if suite_name == "conv":
        for layer in suite["layers"]:
            for direction in layer["directions"]:
                if (only is None or only.search(layer["id"])) and (classes is None or layer["cls"] in classes) \
                        and (dirs is None or direction in dirs):
                    out.append((layer, direction, a.dtypes.split(",")[0]))
    else:
        dtypes = a.dtypes.split(",") if a.dtypes else suite["dtypes"]
        for shape in suite["shapes"]:
            if (only is None or only.search(shape["id"])) and (dirs is None or shape["pass"] in dirs):
                out.extend((shape, shape["pass"], dt) for dt in dtypes)
    i, n = a.shard
    out = out[i::n]
    return out[:a.limit] if a.limit else out


def run_points(a, suite_name: str, selection: list[tuple], out_jsonl: Path, peer_only: bool, done: set) -> None:
    torch.backends.cudnn.benchmark = True
    reg = None if peer_only else registry_of(a.bundles, autotune=a.autotune)
    versus = None
    if (a.versus or a.versus_models) and not peer_only:  # the before: other bundles, or ours ranked by other models
        versus = registry_of(a.versus or a.bundles, models=a.versus_models)
    gen = torch.Generator(device=a.device).manual_seed(20)
    start = time.time()
    with out_jsonl.open("a") as f:
        for i, (entry, direction, dtype) in enumerate(selection):
            key = f"{entry['id']}|{direction}|{dtype}"
            if key in done:
                continue
            try:
                if suite_name == "conv":
                    row = conv_point(reg, entry, direction, dtype, a.batch, a.device, gen, peer_only, a.api,
                                     versus, i % 2 == 1)
                else:
                    row = gemm_point(reg, entry, dtype, a.device, gen, peer_only, versus, i % 2 == 1)
            except Exception as e:  # noqa: BLE001  (one point's failure must not hide the others')
                row = {"id": entry["id"], "direction" if suite_name == "conv" else "pass": direction, "dtype": dtype,
                       "status": "error", "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
            f.write(json.dumps(row) + "\n")
            f.flush()
            if not peer_only:
                print(f"[{i + 1}/{len(selection)} {time.time() - start:6.0f} s] {one_line(row)}", flush=True)


def one_line(r: dict) -> str:
    what = f"{r['id']:60s} {r.get('direction', r.get('pass')):10s} {r['dtype']}"
    if r.get("status") in ("ok", "wrong result"):
        peer = min(r["peer_ms"].values())
        return (f"{what} peer {peer * 1e3:9.1f} us  ours {r['ours_ms'] * 1e3:9.1f} us  x{peer / r['ours_ms']:.2f}  "
                f"kernel x{peer / r['kernel_ms']:.2f}  err {r['rel_error']:.1e} {r['status']}  {r['kernel']}")
    return f"{what} {r.get('status')}: {(r.get('reason') or r.get('error') or '').splitlines()[0]}"


def machine(device: str) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "commit": subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                                     text=True).stdout.strip()}
    if device == "cuda":
        from _conv_common import machine as gpu_machine

        info.update(gpu_machine())
    return info


# ---- the summary -----------------------------------------------------------------------------------------------
def merged_rows(paths: list[Path]) -> list[dict]:
    """Rows of the result files, the peer of each point at its fastest over the files of the peer-only process
    (*_peer.jsonl) and its own; the last row of a point wins (a resumed run)."""
    rows, peers = {}, {}
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            (peers if path.name.endswith("_peer.jsonl") else rows)[point_key(row)] = row
    out = []
    for key, row in rows.items():
        if "peer_ms" in row:
            second = peers.get(key, {}).get("peer_ms", {})
            row["peer_ms"].update({f"{name}@2": ms for name, ms in second.items()})
            row["peer"] = min(row["peer_ms"], key=row["peer_ms"].get)
            if "ours_ms" in row:
                best = row["peer_ms"][row["peer"]]
                row["speedup"] = best / row["ours_ms"]
                row["speedup_kernel"] = best / row["kernel_ms"]
        out.append(row)
    return out


def geomean(values, weights=None) -> float:
    weights = weights or [1] * len(values)
    return math.exp(sum(w * math.log(v) for v, w in zip(values, weights)) / sum(weights))


def group_names(r: dict) -> list[str]:
    """The summary groups a point counts in: all; conv: its direction, direction x class, direction x rank;
    GEMM: its dtype, dtype x pass, and for fwd decode (M <= 32, memory-bound) apart from prefill."""
    if "direction" in r:
        d = r["direction"]
        return ["all", d, f"{d} {r.get('cls', '?')}", f"{d} {r.get('rank', '?')}D"]
    names = ["all", f"{r['dtype']}", f"{r['dtype']} {r['pass']}"]
    if r["pass"] == "fwd":
        names.append(f"{r['dtype']} fwd M {'<=' if r['m'] <= 32 else '>'} 32")
    return names


SLOWER = 1.05  # a changed pick whose public call got this much slower is counted (noise between runs: a few %)


def compare(before: list[dict], after: list[dict]) -> dict:
    """Two runs of the same points in one call (e.g. the shipped models, then retrained ones): per group, over the
    points both timed, the geomeans of peer / ours for each (the peer at its fastest over both runs, so the ratio
    of the two is ours alone), the kernel alone for each, how many points picked another kernel, and before / after
    of the selected kernel alone, apart for the points that changed their pick and those that kept it (whose ratio
    is the drift between the two runs, the noise to read the first against)."""
    mine = {point_key(r): r for r in after if "ours_ms" in r and "peer_ms" in r}
    groups: dict[str, list[tuple]] = {}
    for b in before:
        a = mine.get(point_key(b))
        if a is None or "ours_ms" not in b or "peer_ms" not in b:
            continue
        peer = min(min(b["peer_ms"].values()), min(a["peer_ms"].values()))
        for name in group_names(a):
            groups.setdefault(name, []).append((b, a, peer))
    out = {}
    for name, pairs in sorted(groups.items()):
        out[name] = {"points": len(pairs),
                     "before": geomean([peer / b["ours_ms"] for b, a, peer in pairs]),
                     "after": geomean([peer / a["ours_ms"] for b, a, peer in pairs]),
                     "before_kernel_only": geomean([peer / b["kernel_ms"] for b, a, peer in pairs]),
                     "after_kernel_only": geomean([peer / a["kernel_ms"] for b, a, peer in pairs]),
                     "picks_changed": sum(b["kernel"] != a["kernel"] for b, a, peer in pairs)}
        for kept, field in ((False, "changed_picks_kernel_speedup"), (True, "kept_picks_kernel_drift")):
            ratios = [b["kernel_ms"] / a["kernel_ms"] for b, a, peer in pairs if (b["kernel"] == a["kernel"]) == kept]
            out[name][field] = geomean(ratios) if ratios else None
        calls = [b["ours_ms"] / a["ours_ms"] for b, a, peer in pairs if b["kernel"] != a["kernel"]]
        out[name]["changed_picks_call_speedup"] = geomean(calls) if calls else None
        out[name]["changed_picks_call_slower"] = sum(r < 1 / SLOWER for r in calls)
    return out



def compare_markdown(result: dict, before: str, after: str) -> str:
    lines = [f"Before: {before}; after: {after}. Peer time (fastest over both runs) / ours, geomean over the points "
             "both runs timed; kernel alone: the selected kernel launched by itself (diagnostic); selected kernel "
             "before / after: its time in the first run over the second's (> 1: the second faster), on the points "
             "that changed their pick, and on those that kept it (the drift between the runs); their public call "
             f"before / after, and how many of them got over {SLOWER:g}x slower.", "",
             "| group | points | public call before | after | kernel alone before | after | picks changed "
             "| their kernel before / after | their call before / after | slower | kept picks' drift |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    cell = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for name, g in result.items():
        cells = [g["before"], g["after"], g["before_kernel_only"], g["after_kernel_only"], g["picks_changed"],
                 g["changed_picks_kernel_speedup"], g["changed_picks_call_speedup"], g["changed_picks_call_slower"],
                 g["kept_picks_kernel_drift"]]
        lines.append(f"| {name} | {g['points']} | "
                     + " | ".join(str(v) if isinstance(v, int) else cell(v) for v in cells) + " |")
    return "\n".join(lines) + "\n"


def summarize(rows: list[dict]) -> dict:
    """Per group (conv: direction x class, direction x rank; GEMM: dtype x pass, dtype x decode / prefill): points,
    geomean of peer / ours (public call), its minimum and worst point, the use-weighted geomean, the selected
    kernel alone (diagnostic), and the points no kernel runs, with wrong results or errors; for grouped and depthwise
    layers also the geomeans of peer / copy and ours / copy (copy: the layer's minimum bytes moved once)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        for name in group_names(r):
            groups.setdefault(name, []).append(r)
    out = {}
    for name, rs in sorted(groups.items()):
        timed = [r for r in rs if "speedup" in r]
        g = {"points": len(rs), "timed": len(timed), "no_kernel": sum(r.get("status") == "no kernel" for r in rs),
             "wrong_result": sum(r.get("status") == "wrong result" for r in rs),
             "error": sum(r.get("status") == "error" for r in rs),
             "peer_off": sum(bool(r.get("peer_off")) for r in rs)}  # the peer's result off float64, ours right
        if timed:
            worst = min(timed, key=lambda r: r["speedup"])
            g.update(geomean=geomean([r["speedup"] for r in timed]),
                     geomean_weighted=geomean([r["speedup"] for r in timed], [r.get("weight", 1) for r in timed]),
                     min=worst["speedup"], worst=point_key(worst),
                     geomean_kernel_only=geomean([r["speedup_kernel"] for r in timed]),
                     below_0_7=sum(r["speedup"] < 0.7 for r in timed))
            floored = [r for r in timed if "copy_ms" in r]
            if floored:  # how far the peer and ours are from the memory floor (1.0: at it)
                g.update(peer_over_copy=geomean([min(r["peer_ms"].values()) / r["copy_ms"] for r in floored]),
                         ours_over_copy=geomean([r["ours_ms"] / r["copy_ms"] for r in floored]))
        out[name] = g
    return out


def plot(rows: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = "direction" if any("direction" in r for r in rows) else "dtype"
    panels = sorted({r[by] for r in rows if "speedup" in r})
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False, sharey=True)
    for ax, panel in zip(axes[0], panels):
        rs = [r for r in rows if r[by] == panel and "speedup" in r]
        line_of = (lambda r: f"{r['cls']} {r['rank']}D") if by == "direction" else (lambda r: r["pass"])  # noqa: E731
        for line in sorted({line_of(r) for r in rs}):
            ys = sorted(r["speedup"] for r in rs if line_of(r) == line)
            ax.plot([i / max(1, len(ys) - 1) for i in range(len(ys))], ys, ".-", ms=3, label=f"{line} ({len(ys)})")
        ks = sorted(r["speedup_kernel"] for r in rs)
        ax.plot([i / max(1, len(ks) - 1) for i in range(len(ks))], ks, "k:", lw=0.8, label="kernel alone, all")
        ax.axhline(1.0, color="k", lw=0.6)
        ax.axhline(0.7, color="r", lw=0.6, ls="--")
        ax.set_yscale("log")
        ax.set_title(f"{panel}: geomean x{geomean([r['speedup'] for r in rs]):.2f}")
        ax.set_xlabel("points, sorted (fraction)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("peer time / ours (public call)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown(summary: dict, title: str) -> str:
    """The summary as a table for the README: one row per group."""
    lines = [f"{title}: peer time / ours through the public call (> 1: ours faster); kernel alone: the selected "
             "kernel launched by itself (diagnostic); copy: a device copy of the layer's minimum bytes (the memory "
             "floor of grouped and depthwise layers)", "",
             "| group | points | timed | geomean | weighted by use | min (worst point) | below 0.7x | kernel alone "
             "| no kernel | wrong / error | peer / copy | ours / copy |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for name, g in summary.items():
        if "geomean" in g:
            worst = g["worst"].replace("|", " ")  # a point's key, not a table cell's end
            cells = [f"{g['geomean']:.3f}", f"{g['geomean_weighted']:.3f}", f"{g['min']:.2f} (`{worst}`)",
                     str(g["below_0_7"]), f"{g['geomean_kernel_only']:.3f}"]
        else:
            cells = ["-"] * 5
        floor = [f"{g[f]:.2f}" if f in g else "-" for f in ("peer_over_copy", "ours_over_copy")]
        lines.append(f"| {name} | {g['points']} | {g['timed']} | " + " | ".join(cells)
                     + f" | {g['no_kernel']} | {g['wrong_result']} / {g['error']} | " + " | ".join(floor) + " |")
    return "\n".join(lines) + "\n"


def write_report(paths: list[Path], out: Path, info: dict) -> dict:
    rows = merged_rows(paths)
    summary = summarize(rows)
    result = {**info, "summary": summary, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    title = f"{info.get('suite', '')} suite, {info.get('machine', {}).get('gpu') or 'cpu'}"
    out.with_suffix(".md").write_text(markdown(summary, title))
    drawn = plot(rows, out.with_suffix(".png"), title)
    for name, g in summary.items():
        if "geomean" in g:
            print(f"{name:36s} {g['timed']:5d} timed  x{g['geomean']:.3f} (weighted x{g['geomean_weighted']:.3f}, "
                  f"kernel alone x{g['geomean_kernel_only']:.3f})  min x{g['min']:.2f}  <0.7: {g['below_0_7']}  "
                  f"no kernel {g['no_kernel']}  wrong {g['wrong_result']}  error {g['error']}  peer off {g['peer_off']}")
        else:
            print(f"{name:36s} {g['points']:5d} points, none timed (no kernel {g['no_kernel']}, error {g['error']})")
    print(f"wrote {out.with_suffix('.json')}, .md" + (" and .png" if drawn else ""))
    return result


def shard(text: str) -> tuple[int, int]:
    i, n = (int(v) for v in text.split("/"))
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"--shard I/N needs 0 <= I < N, got {text}")
    return i, n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", choices=("conv", "gemm", "report", "compare"))
    ap.add_argument("bundles", nargs="+", help="bundle directories (report: result directories; compare: two, "
                                               "before and after, or one run made with --versus)")
    ap.add_argument("--out", type=Path, help="results directory")
    ap.add_argument("--shard", type=shard, default=(0, 1), help="I/N: every N-th point from the I-th (0-based)")
    ap.add_argument("--limit", type=int, default=0, help="at most this many points (after sharding)")
    ap.add_argument("--only", default="", help="points whose id matches this regular expression")
    ap.add_argument("--classes", default="", help="conv: dense,grouped,depthwise")
    ap.add_argument("--directions", default="", help="conv directions or GEMM passes: fwd,bwd_data,bwd_weight")
    ap.add_argument("--dtypes", default="", help="conv: one dtype (fp16); GEMM: the suite's (fp16,bf16)")
    ap.add_argument("--batch", type=int, default=0, help="conv: this batch instead of the suite's")
    ap.add_argument("--peer-processes", type=int, choices=(1, 2), help="default: 2 on cuda, 1 on cpu")
    ap.add_argument("--peer-only", action="store_true", help=argparse.SUPPRESS)  # the second process
    ap.add_argument("--resume", type=Path, help="skip the points whose results are in this directory")
    ap.add_argument("--versus", nargs="+", default=[], metavar="BUNDLE",
                    help="the other side of a before / after (e.g. the bundle built before a change): its public "
                         "call and selected kernel timed at each point right beside ours, in the row's 'versus'; "
                         "`compare DIR` reads them as the before")
    ap.add_argument("--versus-models", metavar="DIR",
                    help="the same, with the before ranked by the learned models in DIR (e.g. the ones a retrain "
                         "replaces) on our bundles (or the --versus ones)")
    ap.add_argument("--autotune", action="store_true",
                    help="ours with autotune: each point's first call tunes it (records in memory); beside "
                         "--versus-models runtime/tiledispatch/models, tuned against the learned pick")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--api", choices=("registry", "torch"), default="registry",
                    help="conv: ours through reg.conv_* (default) or the tiledispatch.torch operators a patched model "
                         "calls (TD_STRIDED_BWD_DATA picks their strided bwd_data route)")
    a = ap.parse_args(argv)
    if a.suite == "compare":
        if len(a.bundles) == 2:
            before, after = (merged_rows(sorted(Path(d).glob("*.jsonl"))) for d in a.bundles)
            labels = a.bundles
        elif len(a.bundles) == 1:  # one run with --versus: its versus measurements are the before
            after = merged_rows(sorted(Path(a.bundles[0]).glob("*.jsonl")))
            before = [{**{k: v for k, v in r.items() if k not in VERSUS_FIELDS}, **r["versus"]}
                      for r in after if "versus" in r]
            labels = [f"{a.bundles[0]} (--versus)", a.bundles[0]]
        else:
            ap.error("compare takes two result directories (before, after) or one run with --versus")
        result = compare(before, after)
        if not result:
            ap.error(f"{' and '.join(a.bundles)}: no timed point in both")
        stem = a.out or Path(a.bundles[-1]).parent / "compare"  # a stem: a dot in it (run.1) is kept
        stem.with_name(stem.name + ".json").write_text(json.dumps({"before": labels[0], "after": labels[1],
                                                                   "groups": result}, indent=1) + "\n")
        stem.with_name(stem.name + ".md").write_text(compare_markdown(result, *labels))
        print(stem.with_name(stem.name + ".md").read_text())
        return 0
    if a.suite == "report":
        paths = sorted(p for d in a.bundles for p in Path(d).glob("*.jsonl"))
        out = a.out or Path(a.bundles[0])
        suite_names = {p.name.split("_")[0].split(".")[0] for p in paths}
        for suite_name in sorted(suite_names):
            mine = [p for p in paths if p.name.split("_")[0].split(".")[0] == suite_name]
            infos = [json.loads(p.with_suffix(".json").read_text()).get("machine") for p in mine
                     if p.with_suffix(".json").exists()]
            write_report(mine, out / f"{suite_name}_all", {"suite": suite_name, "machine": next(
                (i for i in infos if i), {}), "shards": [p.name for p in mine if not p.name.endswith("_peer.jsonl")]})
        return 0
    if a.out is None:
        ap.error("--out DIR is needed")
    a.peer_processes = a.peer_processes or (2 if a.device == "cuda" else 1)
    a.dtypes = a.dtypes or ("fp16" if a.suite == "conv" else "")
    suite = json.loads((SUITES / f"{a.suite}.json").read_text())
    selection = points(a.suite, suite, a)
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.suite + ("" if a.shard == (0, 1) else f"_shard{a.shard[0]}of{a.shard[1]}")
    done = set()
    if a.resume:
        for p in a.resume.glob(f"{stem}.jsonl"):
            done |= {point_key(json.loads(line)) for line in p.read_text().splitlines() if line.strip()}
    if a.peer_only:
        run_points(a, a.suite, selection, a.out / f"{stem}_peer.jsonl", True, done)
        return 0
    start = time.time()
    if a.peer_processes == 2:  # the peer alone in a process of its own first
        child = [sys.executable, str(Path(__file__).resolve()), *[x for x in (argv or sys.argv[1:])], "--peer-only"]
        subprocess.run(child, check=False)
        print(f"peer-only process: {time.time() - start:.0f} s", flush=True)
    run_points(a, a.suite, selection, a.out / f"{stem}.jsonl", False, done)
    paths = [p for p in (a.out / f"{stem}.jsonl", a.out / f"{stem}_peer.jsonl") if p.exists()]
    bundles = {b: {k: v for k, v in json.loads((Path(b) / "manifest.json").read_text()).items() if k != "kernels"}
               for b in a.bundles}  # what built them (toolchain, sets), not the kernel list
    info = {"suite": a.suite, "machine": machine(a.device), "device": a.device, "api": a.api, "versus": a.versus,
            "versus_models": a.versus_models, "autotune": a.autotune,
            "strided_bwd_data": os.environ.get("TD_STRIDED_BWD_DATA", "auto"), "bundles": bundles,
            "shard": list(a.shard), "points": len(selection), "seconds": round(time.time() - start, 1),
            "timing": f"median of {REPEATS} batches of back-to-back calls (about {TARGET_MS} ms a batch), CUDA events; "
                      "speedup = fastest peer (either form, either process) / our public call; speedup_kernel: the "
                      "selected kernel launched alone (diagnostic)"}
    result = write_report(paths, a.out / stem, info)
    bad = sum(g["wrong_result"] + g["error"] for name, g in result["summary"].items() if name == "all")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
