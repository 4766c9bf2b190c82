"""python -m tiledispatch {list, info, select, run, bench} BUNDLE ... : every command prints JSON.

Exit status: 0 success, 1 validation failed, 2 error (the JSON says which).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from . import errors, learned, reference, registry as registry_mod, selection, validation
from .ops import gemm as gemm_op
from .spec.key import ACTIVATIONS


def _print(obj) -> None:
    json.dump(obj, sys.stdout, indent=1)
    sys.stdout.write("\n")


def _bundle_value(reg, what: str, given):
    """A problem field the user did not give: the bundle's value if it has exactly one, else an error."""
    if given is not None:
        return given
    values = sorted({getattr(k.key.signature, what) for k in reg.kernels})
    if len(values) == 1:
        return values[0]
    raise errors.InvalidInputError(f"the bundle has kernels for several {what} values ({', '.join(map(str, values))}): "
                                   f"give --{what.replace('dtype_a', 'dtype')}")


def _gemm_problem(reg, a: argparse.Namespace) -> gemm_op.GemmProblem:
    dt = _bundle_value(reg, "dtype_a", a.dtype)
    layout = _bundle_value(reg, "layout", a.layout)
    dtype_c = next((k.key.signature.dtype_c for k in reg.kernels if k.key.signature.dtype_a == dt), dt)
    epi = gemm_op.Epilogue(a.activation, a.bias, a.residuals)
    return gemm_op.GemmProblem(a.m, a.n, a.k, dt, dt, dtype_c, layout, a.batch, epi)


def _run_once(reg, p, data, kernel, scalars) -> float:
    start = time.perf_counter()
    reg.gemm(data["a"], data["b"], data["out"], bias=data["bias"], residuals=data["residuals"],
             activation=p.epilogue.activation, kernel=kernel, **scalars)
    return (time.perf_counter() - start) * 1e3


def cmd_list(reg, a) -> int:
    _print({"backend": reg.backend, "arch": reg.arch, "kernels": [k.name for k in reg.kernels]})
    return 0


def cmd_info(reg, a) -> int:
    if a.kernel:
        k = reg.kernel(a.kernel)
        _print({"name": k.name, "file": str(k.path), "origin": k.origin, "key": k.key.to_dict()})
    else:
        m = reg.manifest
        _print({"backend": m["backend"], "arch": m["arch"], "kernel_sets": m.get("kernel_sets"),
                "toolchain": m.get("toolchain"), "created": m.get("created"), "kernels": len(m["kernels"]),
                "selection_models": learned.describe(m["backend"], m["arch"])})
    return 0


def cmd_select(reg, a) -> int:
    p = _gemm_problem(reg, a)
    explained = reg.explain(p)
    fits = [k for k, r in explained if r is None]
    ranked = selection.RANKERS["learned" if a.ranker == "auto" else a.ranker](p, fits)
    selected = reg.select(p, a.ranker).name if ranked else None  # auto: a tuning record may override
    _print({"problem": p.to_dict(), "selected": selected,
            "ranked": [{"kernel": k.name, "estimated_cost": selection.estimated_cost(p, k.key)} for k in ranked],
            "rejected": {k.name: r for k, r in explained if r is not None}})
    return 0 if ranked else 2


def cmd_run(reg, a) -> int:
    p = _gemm_problem(reg, a)
    data = validation.gemm_inputs(p, np.random.default_rng(a.seed))
    scalars = {"alpha": a.alpha, "beta": 0.0, "clamp": (a.clamp_low, a.clamp_high)}
    kernel = reg.kernel(a.kernel) if a.kernel else reg.select(p, a.ranker)
    ms = _run_once(reg, p, data, kernel, scalars)
    result = {"problem": p.to_dict(), "kernel": kernel.name,
              "execution": {"time_ms": ms, "gflops": p.flops() / ms / 1e6}, "status": "success"}
    if a.validate:
        ref = reference.gemm(data["a"], data["b"], None, data["bias"], data["residuals"], a.alpha, 0.0,
                             p.epilogue.activation, (a.clamp_low, a.clamp_high))
        result["validation"] = validation.compare(data["out"], ref, kernel.key)
        if not result["validation"]["passed"]:
            result["status"] = "failed"
    _print(result)
    return 0 if result["status"] == "success" else 1


def cmd_bench(reg, a) -> int:
    p = _gemm_problem(reg, a)
    data = validation.gemm_inputs(p, np.random.default_rng(a.seed))
    scalars = {"alpha": 1.0, "beta": 0.0, "clamp": (a.clamp_low, a.clamp_high)}
    selected = reg.select(p, a.ranker)
    rows = []
    for k in reg.candidates(p):
        for _ in range(a.warmup):
            _run_once(reg, p, data, k, scalars)
        ms = statistics.median(_run_once(reg, p, data, k, scalars) for _ in range(a.repeat))
        rows.append({"kernel": k.name, "median_ms": ms, "gflops": p.flops() / ms / 1e6, "selected": k is selected})
    rows.sort(key=lambda r: r["median_ms"])
    _print({"problem": p.to_dict(), "selected": selected.name, "results": rows})
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tiledispatch", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    for name, fn, with_problem in (("list", cmd_list, False), ("info", cmd_info, False), ("select", cmd_select, True),
                                   ("run", cmd_run, True), ("bench", cmd_bench, True)):
        sp = sub.add_parser(name)
        sp.set_defaults(fn=fn)
        sp.add_argument("bundle", help="bundle directory (holds manifest.json)")
        if name == "info":
            sp.add_argument("--kernel", help="show one kernel's key")
        if not with_problem:
            continue
        sp.add_argument("op", choices=["gemm"])
        for dim in ("m", "n", "k"):
            sp.add_argument(f"--{dim}", type=int, required=True)
        sp.add_argument("--batch", type=int, default=1)
        sp.add_argument("--dtype", help="input dtype (default: the bundle's, when it has one)")
        sp.add_argument("--layout", help="rcr, rrr, crr, ccr (default: the bundle's, when it has one)")
        sp.add_argument("--activation", choices=ACTIVATIONS, default="identity")
        sp.add_argument("--bias", action="store_true")
        sp.add_argument("--residuals", type=int, default=0)
        sp.add_argument("--alpha", type=float, default=1.0)
        sp.add_argument("--clamp-low", type=float, default=-1.0)
        sp.add_argument("--clamp-high", type=float, default=1.0)
        sp.add_argument("--ranker", choices=["auto", *sorted(selection.RANKERS)], default="auto",
                        help="auto: this device's tuning record, else learned (a shipped model), else analytic")
        sp.add_argument("--kernel", help="run this kernel instead of the selected one")
        sp.add_argument("--seed", type=int, default=0)
        if name == "run":
            sp.add_argument("--validate", action="store_true", help="compare with a float64 numpy reference")
        if name == "bench":
            sp.add_argument("--warmup", type=int, default=2)
            sp.add_argument("--repeat", type=int, default=10)
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    try:
        reg = registry_mod.load(a.bundle)
        return a.fn(reg, a)
    except errors.TileDispatchError as e:
        _print({"status": "error", "error": type(e).__name__, "message": str(e)})
        return 2
