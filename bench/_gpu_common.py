"""Shared by the GPU validators (bench/validation/) and benchmarks (bench/benchmarks/): torch inputs on the GPU, a
float64 reference, and launching one kernel of a bundle through the C ABI with a persistent workspace."""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from tiledispatch import abi, cuda  # noqa: E402
from tiledispatch.arrays import ArrayView, view  # noqa: E402
from tiledispatch.spec.key import Epilogue  # noqa: E402
from tiledispatch.ops import gemm as gemm_op  # noqa: E402

TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "int8": torch.int8,
               "int32": torch.int32, "fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}


def random_tensor(shape, dtype: str, gen: torch.Generator, layout: str = "r") -> torch.Tensor:
    """Random values with no zeros ([-1, -0.05] U [0.05, 1] floats, +-1..8 ints), stored row-major
    (layout r) or column-major in the last two dims (layout c), on the generator's device."""
    if layout == "c":
        return random_tensor((*shape[:-2], shape[-1], shape[-2]), dtype, gen).transpose(-1, -2)
    if dtype in ("int8", "int32"):
        mag = torch.randint(1, 9, shape, generator=gen, device=gen.device)
    else:
        mag = torch.rand(shape, generator=gen, device=gen.device) * 0.95 + 0.05
    sign = torch.randint(0, 2, shape, generator=gen, device=gen.device) * 2 - 1
    return (mag * sign).to(TORCH_DTYPE[dtype])


def poisoned(shape, dtype: str) -> torch.Tensor:
    t = torch.empty(shape, dtype=TORCH_DTYPE[dtype], device="cuda")
    return t.fill_(torch.iinfo(t.dtype).min if dtype in ("int8", "int32") else float("nan"))


def matching(kernels, pattern) -> list:
    """The kernels whose names the regular expression `pattern` matches, all of them where it is None (the
    validators' --only)."""
    return [k for k in kernels if pattern is None or re.search(pattern, k.name)]


def activation(v: torch.Tensor, name: str, low: float, high: float) -> torch.Tensor:
    if name == "identity":
        return v
    if name == "relu":
        return torch.relu(v)
    if name == "gelu_tanh":
        return torch.nn.functional.gelu(v, approximate="tanh")
    if name == "gelu_erf":
        return torch.nn.functional.gelu(v)
    if name == "silu":
        return torch.nn.functional.silu(v)
    if name == "sigmoid":
        return torch.sigmoid(v)
    if name == "tanh":
        return torch.tanh(v)
    if name == "clamp":
        return torch.clamp(v, low, high)
    if name == "hardswish":
        return torch.nn.functional.hardswish(v)
    if name == "hardsigmoid":
        return torch.nn.functional.hardsigmoid(v)
    raise ValueError(name)


def reference(a, b, c, bias, residuals, *, act, alpha, beta, low, high, int_out: bool) -> torch.Tensor:
    """act(alpha * a @ b + beta * c + bias + sum residuals) in float64 from the stored inputs."""
    v = alpha * torch.matmul(a.double(), b.double())
    if c is not None and beta != 0:
        v = v + beta * c.double()
    if bias is not None:
        v = v + bias.double()
    for r in residuals:
        v = v + r.double()
    v = activation(v, act, low, high)
    if int_out:
        v = torch.round(v.clamp(-2.0**31, 2.0**31 - 1))
    return v


class Launcher:
    """Runs one kernel library on torch operands: td_args from the runtime's GEMM binding, the
    workspace from tiledispatch.cuda's per-stream cache."""

    def __init__(self, kernel):
        self.kernel, self.lib, self.key = kernel, kernel.library, kernel.key

    def args(self, problem, operands, stream: int, **scalars) -> abi.TdArgs:
        args = gemm_op.make_args(problem, self.key, operands, **scalars)
        args.stream = stream
        need = self.lib.workspace_bytes(args)
        args.workspace = cuda.workspace(need, stream) if need else None
        args.workspace_bytes = need
        return args

    def run(self, args: abi.TdArgs) -> None:
        status, reason = self.lib.run(args)
        if status != abi.OK:
            raise RuntimeError(f"{self.kernel.name}: status {status}: {reason}")


def operands(a, b, d, c=None, bias=None, residuals=(), act="identity"):
    """(GemmProblem, Operands) for torch tensors a [batch, m, k], b [batch, k, n], d [batch, m, n].

    Built here rather than by gemm_op.operands so the output dtype is d's (fp8 inputs with a C)."""
    va, vb, vd = (view(t, role) for t, role in ((a, "A"), (b, "B"), (d, "D")))
    vc = view(c, "C") if c is not None else None
    vbias = view(bias, "bias") if bias is not None else None
    if vbias is not None:  # [n] -> [1, n], shared by every batch
        vbias = ArrayView(vbias.ptr, (1, *vbias.shape), (0, *vbias.strides), vbias.dtype, vbias.device, vbias.obj)
    vres = tuple(view(r, f"R{i}") for i, r in enumerate(residuals))
    batch, m, k = va.shape
    n = vb.shape[2]
    layout = "".join("r" if v.strides[2] == 1 else "c" for v in (va, vb, vd))
    problem = gemm_op.GemmProblem(m, n, k, va.dtype, vb.dtype, vd.dtype, layout, batch,
                                  Epilogue(act, bias is not None, len(residuals)))
    return problem, gemm_op.Operands(va, vb, vd, vc, vbias, vres, d)


def machine() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "cuda_torch": torch.version.cuda, "cudart": cuda.versions(), "cudart_path": cuda.library_path()}


def write_results(results: dict, out: str, prefix: str) -> Path:
    """results (with its "machine") as out/<prefix>_<gpu>.json, e.g. stem_probe_h200.json."""
    path = Path(out) / f"{prefix}_{results['machine']['gpu'].split()[-1].lower()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return path


def time_batch(fn, batch: int, repeats: int, warmup: int = 0) -> float:
    """Median milliseconds per call over `repeats` batches of `batch` back-to-back calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(batch):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / batch)
    return statistics.median(times)


def graph_us(fn, calls: int = 10, replays: int = 20, rounds: int = 7) -> float:
    """Microseconds per call of fn, `calls` calls captured in one CUDA graph: the median over `rounds` rounds of
    `replays` replays. Warm-up calls (compilation, a first selection) run on a side stream first, as capture needs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(replays):
            graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / (replays * calls))
    return statistics.median(times)


# -- suites measured against the peers (bench/benchmarks/layernorm.py, maxpool.py): per shape a row with "id",
# "passed" and the microseconds of each variant (tiledispatch, torch, compile), eagerly and in CUDA graphs
def peer_ratios(row: dict) -> None:
    """The row's ratios: the better peer's time / ours, eagerly and in graphs (> 1: ours faster)."""
    for mode in ("eager", "graph"):
        times = row[f"{mode}_us"]
        row[f"{mode}_ratio"] = min(times["torch"], times["compile"]) / times["tiledispatch"]


def peer_suite(shapes, measure, budget_s: float) -> list[dict]:
    """measure(shape) for the shapes in order until budget_s seconds are spent, each row printed as it comes."""
    start, rows = time.monotonic(), []
    for shape in shapes:
        if time.monotonic() - start > budget_s:
            break
        row = measure(shape)
        peer_ratios(row)
        rows.append(row)
        eager, graph = row["eager_us"], row["graph_us"]
        print(f"{row['id']:>44s} eager us: ours {eager['tiledispatch']:7.1f} torch {eager['torch']:7.1f} compile "
              f"{eager['compile']:7.1f} ({row['eager_ratio']:.2f}x) | graph: {graph['tiledispatch']:7.1f} "
              f"{graph['torch']:7.1f} {graph['compile']:7.1f} ({row['graph_ratio']:.2f}x)"
              f"{'' if row['passed'] else ' FAILED'}", flush=True)
    return rows


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def peer_summary(rows: list[dict]) -> dict:
    return {"eager_geomean": geomean(r["eager_ratio"] for r in rows),
            "graph_geomean": geomean(r["graph_ratio"] for r in rows),
            "eager_min": min((r["eager_ratio"] for r in rows), default=None),
            "graph_min": min((r["graph_ratio"] for r in rows), default=None),
            "all_passed": all(r["passed"] for r in rows)}


# -- every kernel of an op on every case (bench/validation/validate_layernorm_gpu.py, validate_maxpool_gpu.py) --------
def validator_args(doc: str, argv=None) -> argparse.Namespace:
    """--bundle, --out and --device (cpu: the same cases on a cpu bundle, to check the script without a GPU)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    return ap.parse_args(argv)


def validate_case(reg, problem, operands, kernels, entry: dict, run_one, results: list) -> bool:
    """Each kernel on one case: its refusal recorded with the reason td_can_run gives, else run_one(kernel), a dict
    holding "passed"; whether any kernel ran the case."""
    explained = dict(reg.explain(problem, operands))
    ran = False
    for k in kernels:
        row = {"kernel": k.name, **entry}
        if explained[k] is not None:
            results.append({**row, "refused": explained[k]})
            continue
        results.append({**row, **run_one(k)})
        ran = True
    return ran


def write_validation(a: argparse.Namespace, results: list, uncovered: list, prefix: str) -> int:
    """Print the counts, write the JSON (out/<prefix>_<gpu>.json); the exit status: 1 on a failure or a case no
    kernel ran."""
    failures = sum(not r["passed"] for r in results if "passed" in r)
    print(f"{sum('passed' in r for r in results)} runs, {failures} failed, "
          f"{sum('refused' in r for r in results)} refusals, {len(uncovered)} cases no kernel ran: {uncovered}")
    where = machine() if a.device == "cuda" else {"gpu": "cpu", "torch": torch.__version__}
    write_results({"machine": where, "bundle": str(a.bundle), "runs": results, "failures": failures,
                   "uncovered": uncovered}, a.out, prefix)
    return 1 if failures or uncovered else 0
