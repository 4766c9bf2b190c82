"""python -m tiledispatch {list, info, select, run, bench} BUNDLE [gemm | conv | layernorm | maxpool ...]: every command prints
one JSON object (standard JSON: a non-finite number prints as null). BUNDLE is a bundle directory, a pack
(NAME.tdpack) or the name of an installed pack.

python -m tiledispatch pack BUNDLE [BUNDLE ...] -o NAME.tdpack [--sign KEYFILE] [--tuning FILE] [--model FILE]
python -m tiledispatch keygen KEYFILE        (writes KEYFILE, private, and KEYFILE.pub)
python -m tiledispatch extract NAME.tdpack [--trust PUBLIC_KEY]   (the checked bundle directories, e.g. for C++)
python -m tiledispatch wheel NAME.tdpack [-o DIR] [--name NAME] [--version X.Y.Z]
python -m tiledispatch native     (builds the native torch fast path into its cache now; README, "Repeated calls")

Exit status: 0 success; 1 validation failed (run --validate); 2 any error, printed as
{"status": "error", "error": TYPE, "message": ...}; 141 (128 + SIGPIPE, as a shell reports for a tool
killed by a closed pipe) when stdout is closed before everything was written, e.g. `... | head -1`: the
rest is dropped without a message.

run and bench choose the kernel (asking its td_can_run, without data) and check the inputs' size against
the memory available (and --max-bytes) before allocating any input.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np

from . import errors, learned, loader, selection, validation
from .ops import conv as conv_op
from .ops import gemm as gemm_op
from .ops import layernorm as ln_op
from .ops import maxpool as pool_op
from .spec.dtypes import DTYPES, dtype
from .spec.key import ACTIVATIONS

EXIT_ERROR, EXIT_FAILED, EXIT_BROKEN_PIPE = 2, 1, 141


class UsageError(Exception):
    """The command line itself is wrong (argparse's complaint)."""


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # a GEMM option (--m) on a conv is no prefix of --max-bytes
        super().__init__(*args, **kwargs)

    def error(self, message):  # argparse prints usage and exits 2; the CLI's errors are JSON
        raise UsageError(f"{self.prog}: {message}")

    def print_help(self, file=None):  # argparse ignores a failed write; a closed pipe must show (exit 141)
        (file or sys.stdout).write(self.format_help())


def _finite(obj):
    """obj with every non-finite float replaced by None (JSON has no NaN or Infinity)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _print(obj) -> None:
    sys.stdout.write(json.dumps(_finite(obj), indent=1, allow_nan=False) + "\n")


def _error(e: BaseException) -> dict:
    return {"status": "error", "error": type(e).__name__, "message": str(e) or repr(e)}


# -- problems ---------------------------------------------------------------------------------------
def _bundle_value(kernels, what: str, given, flag: str):
    """A problem field the user did not give: the value of the op's kernels if they have exactly one, else an error."""
    if given is not None:
        return given
    values = sorted({getattr(k.key.signature, what) for k in kernels})
    if len(values) == 1:
        return values[0]
    raise errors.InvalidInputError(f"the bundle has kernels for several {what} values ({', '.join(map(str, values))}): "
                                   f"give {flag}")


def _op_kernels(reg, op: str) -> list:
    kernels = [k for k in reg.kernels if k.key.signature.op == op]
    if not kernels:
        raise errors.UnsupportedProblemError(f"the bundle has no {op} kernels (it has: {', '.join(sorted(reg.ops))})")
    return kernels


def _dtypes(kernels, given):
    dt = _bundle_value(kernels, "dtype_a", given, "--dtype")
    return dt, next((k.key.signature.dtype_c for k in kernels if k.key.signature.dtype_a == dt), dt)


def _gemm_problem(reg, a) -> gemm_op.GemmProblem:
    kernels = _op_kernels(reg, "gemm")
    dt, dtype_c = _dtypes(kernels, a.dtype)
    layout = _bundle_value(kernels, "layout", a.layout, "--layout")
    epi = gemm_op.Epilogue(a.activation, a.bias, a.residuals)
    return gemm_op.GemmProblem(a.m, a.n, a.k, dt, dt, dtype_c, layout, a.batch, epi)


def _per_dim(values, name: str, rank: int):
    """One value for every spatial dim, or one per dim."""
    if values is None or len(values) == 1:
        return values[0] if values else None
    if len(values) != rank:
        raise errors.InvalidInputError(f"--{name} takes 1 or {rank} values (one per spatial dim of --in), "
                                       f"got {len(values)}")
    return tuple(values)


def _conv_problem(reg, a) -> conv_op.ConvProblem:
    kernels = _op_kernels(reg, "conv")
    dt, dtype_y = _dtypes(kernels, a.dtype)
    layout = _bundle_value(kernels, "layout", a.layout, "--layout")
    rank = len(a.in_size)
    if a.padding is not None and (a.pad_lo is not None or a.pad_hi is not None):
        raise errors.InvalidInputError("give either --padding (both sides) or --pad-lo / --pad-hi, not both")
    if a.padding is not None:
        lo = hi = _per_dim(a.padding, "padding", rank)
    else:
        lo, hi = _per_dim(a.pad_lo, "pad-lo", rank), _per_dim(a.pad_hi, "pad-hi", rank)
    if len(a.filter) != rank:
        raise errors.InvalidInputError(f"--filter has {len(a.filter)} sizes, --in {rank}: give one per spatial dim")
    return conv_op.ConvProblem(a.direction, a.n, a.groups, a.c, a.k, tuple(a.in_size), tuple(a.filter),
                               _per_dim(a.stride, "stride", rank), _per_dim(a.dilation, "dilation", rank),
                               0 if lo is None else lo, 0 if hi is None else hi, dt, dt, dtype_y, layout)


def _layernorm_problem(reg, a) -> ln_op.LayerNormProblem:
    dt, dtype_y = _dtypes(_op_kernels(reg, "layernorm"), a.dtype)
    return ln_op.LayerNormProblem(a.rows, a.cols, dt, dt, dtype_y)


def _maxpool_problem(reg, a) -> pool_op.MaxPoolProblem:
    dt, _ = _dtypes(_op_kernels(reg, "maxpool"), a.dtype)
    rank = len(a.in_size)
    geo = [_per_dim(getattr(a, name), name, rank) for name in ("window", "stride", "padding", "dilation")]
    return pool_op.problem_of(a.n, a.c, tuple(a.in_size), dt, geo[0], geo[1], 0 if geo[2] is None else geo[2],
                              1 if geo[3] is None else geo[3], a.ceil_mode)


def _problem(reg, a):
    return {"gemm": _gemm_problem, "conv": _conv_problem, "layernorm": _layernorm_problem,
            "maxpool": _maxpool_problem}[a.op](reg, a)


# -- inputs: sized before they are allocated ---------------------------------------------------------
def _arrays(p) -> list[tuple[int, str, bool]]:
    """(elements, dtype, written) of every array the CLI allocates for p."""
    if p.op == "gemm":
        out = p.batch * p.m * p.n
        arrays = [(p.batch * p.m * p.k, p.dtype_a, False), (p.batch * p.k * p.n, p.dtype_b, False),
                  (out, p.dtype_c, True)] + [(out, p.dtype_c, False)] * p.epilogue.residuals
        return arrays + ([(p.n, p.dtype_c, False)] if p.epilogue.bias else [])
    if p.op == "layernorm":
        return [(p.rows * p.cols, p.dtype_x, False), (p.rows * p.cols, p.dtype_y, True), (2 * p.cols, p.dtype_w, False)]
    if p.op == "maxpool":
        return [(p.n * p.c * math.prod(p.in_size), p.dtype, False), (p.n * p.c * math.prod(p.out_size), p.dtype, True)]
    shapes, written = p.shapes(), conv_op.WRITES[p.direction]
    dtypes = {"x": p.dtype_x, "w": p.dtype_w, "y": p.dtype_y}
    return [(math.prod(shapes[r]), dtypes[r], r == written) for r in ("x", "w", "y")]


def _host_bytes(p, validate: bool) -> int:
    """An upper estimate of the host memory run / bench need: the arrays, the float64 temporaries that
    generate the largest one and, with --validate, float64 copies of the inputs, the reference and the
    comparison's temporaries."""
    arrays = _arrays(p)
    need = sum(n * dtype(dt).itemsize for n, dt, _ in arrays) + 24 * max(n for n, _, _ in arrays)
    if validate:
        need += 16 * sum(n for n, _, written in arrays if not written) + 48 * sum(n for n, _, w in arrays if w)
    return need


def _available_bytes():
    """The memory available now, or None when the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _size(n: int) -> str:
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def _check_size(p, a) -> None:
    validate = getattr(a, "validate", False)
    need = _host_bytes(p, validate)
    limits = [(a.max_bytes, f"--max-bytes {a.max_bytes}")] if a.max_bytes is not None else []
    available = _available_bytes()
    if available is not None:
        limits.append((available, f"the {_size(available)} available now"))
    for limit, what in limits:
        if need > limit:
            raise errors.InvalidInputError(f"{p} needs about {_size(need)} of host memory for its inputs"
                                           f"{' and the float64 reference' if validate else ''}, more than {what}: "
                                           f"refused before allocating anything")


def _inputs(p, a) -> dict:
    _check_size(p, a)
    rng = np.random.default_rng(a.seed)
    if p.op == "layernorm":
        return validation.layernorm_case(p, rng, a.eps)[0]
    if p.op == "maxpool":
        return validation.maxpool_case(p, rng)[0]
    return validation.gemm_inputs(p, rng) if p.op == "gemm" else validation.conv_inputs(p, rng)


def _kernel(reg, p, a):
    """The kernel to run: the one named by --kernel, if its td_can_run accepts the problem, else the selected one."""
    if not a.kernel:
        return reg.select(p, a.ranker)
    kern = reg.kernel(a.kernel)
    reason = next(r for k, r in reg.explain(p) if k is kern)
    if reason is not None:
        raise errors.UnsupportedProblemError(f"kernel {kern.name} cannot run {p}: {reason}")
    return kern


# -- launching --------------------------------------------------------------------------------------
def _launch(reg, p, data, kernel, a) -> float:
    """One launch of kernel on data; milliseconds."""
    start = time.perf_counter()
    if p.op == "gemm":
        reg.gemm(data["a"], data["b"], data["out"], bias=data["bias"], residuals=data["residuals"],
                 activation=p.epilogue.activation, kernel=kernel, alpha=a.alpha, beta=0.0,
                 clamp=(a.clamp_low, a.clamp_high))
    elif p.op == "layernorm":
        reg.layer_norm(data["x"], data["weight"], data["bias"], data["out"], eps=a.eps, kernel=kernel)
    elif p.op == "maxpool":
        dims = slice(3 - p.rank, 3)
        reg.max_pool(data["x"], p.window[dims], p.stride[dims], p.padding[dims], p.dilation[dims],
                     ceil_mode=a.ceil_mode, out=data["out"], kernel=kernel)
    else:
        geo = {"stride": p.stride, "dilation": p.dilation, "pad_lo": p.pad_lo, "pad_hi": p.pad_hi}
        if p.direction == "fwd":
            reg.conv_fwd(data["x"], data["w"], data["y"], kernel=kernel, alpha=a.alpha, **geo)
        elif p.direction == "bwd_data":
            reg.conv_bwd_data(data["y"], data["w"], data["x"], kernel=kernel, alpha=a.alpha, **geo)
        else:
            reg.conv_bwd_weight(data["x"], data["y"], data["w"], kernel=kernel, alpha=a.alpha, **geo)
    return (time.perf_counter() - start) * 1e3


def _reference(p, data, a):
    from . import reference

    if p.op == "gemm":
        return reference.gemm(data["a"], data["b"], None, data["bias"], data["residuals"], a.alpha, 0.0,
                              p.epilogue.activation, (a.clamp_low, a.clamp_high))
    if p.op == "layernorm":
        return reference.layer_norm(data["x"], data["weight"], data["bias"], a.eps)
    if p.op == "maxpool":
        dims = slice(3 - p.rank, 3)
        return reference.max_pool(data["x"], p.window[dims], p.stride[dims], p.dilation[dims], p.padding[dims],
                                  p.out_size[dims])
    return a.alpha * validation.conv_reference(p, data)


def _written(p, data):
    return data["out"] if p.op in ("gemm", "layernorm", "maxpool") else data[conv_op.WRITES[p.direction]]


def _gflops(p, ms: float):
    return p.flops() / ms / 1e6 if ms > 0 else None


# -- commands ---------------------------------------------------------------------------------------
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
                "selection_models": learned.describe(m["backend"], m["arch"], reg.models),
                "ranked_by": reg.selection_models(),
                **({"pack": m["pack"], "skipped": reg.skipped} if "pack" in m else {})})
    return 0


def cmd_select(reg, a) -> int:
    p = _problem(reg, a)
    explained = reg.explain(p)
    fits = [k for k, r in explained if r is None]
    ranked = selection.RANKERS["learned" if a.ranker == "auto" else a.ranker](p, fits) if fits else []
    result = {"problem": p.to_dict(), "selected": None,
              "ranked": [{"kernel": k.name, "estimated_cost": selection.estimated_cost(p, k.key)} for k in ranked],
              "rejected": {k.name: r for k, r in explained if r is not None}}
    if a.explain:
        result["explain"] = _explain_model(reg, p, fits, a.top)
    try:
        result["selected"] = reg.select(p, a.ranker).name  # auto: a tuning record may override the ranking
    except errors.UnsupportedProblemError as e:  # no kernel: an error object that still lists the reasons
        result = {**_error(e), **result}
    _print(result)
    return EXIT_ERROR if result["selected"] is None else 0


def _explain_model(reg, p, fits: list, top: int) -> dict:
    """The learned model's view of the problem: which model (file, version, card), its top `top` kernels with
    their predicted times and, when this device has a tuning record for the problem and these candidates, the
    measured ones (at the caller's pace, and on a GPU queued: tuning.measure); the candidates the model does not
    cover (ranked after its own, analytically) and those it covers but never saw in training."""
    model = learned.model_of(fits, reg.models)
    if model is None:
        return {"model": None, "why": f"no learned model for {reg.backend}/{reg.arch} "
                                      f"{_task(p)}: analytic ranking"}
    covered, rest = learned.split(p, fits, reg.models)
    record = reg.tuning_record(p, fits)
    measured, on_gpu = ((record or {}).get(field, {}) for field in ("times_ms", "gpu_times_ms"))
    predicted, unit = model.predicted_times(p, [k.key for k in covered], tuple(k.name for k in covered))
    order = sorted(range(len(covered)), key=lambda i: (predicted[i], covered[i].name))[:top]
    return {"model": {"file": learned.model_file(reg.backend, reg.arch, model.task, reg.models),
                      "version": model.version,
                      "trained": {k: model.meta.get(k) for k in ("date", "machine", "machines", "shapes", "kernels")
                                  if k in model.meta},
                      "target": model.target, "bundle_recorded": (reg.manifest.get("selection_models") or {}).get(
                          model.task)},
            "top": [{"kernel": covered[i].name, f"predicted_{unit}": float(predicted[i]),
                     "measured_ms": measured.get(covered[i].name), "measured_queued_ms": on_gpu.get(covered[i].name)}
                    for i in order],
            "tuned": None if record is None else {"kernel": record.get("kernel"), "when": record.get("when")},
            "not_covered": [k.name for k in rest], "unseen_in_training": model.unseen([k.key for k in covered])}


def _task(p) -> str:
    return p.op if p.op != "conv" else f"conv_{p.direction}"


def cmd_run(reg, a) -> int:
    p = _problem(reg, a)
    kernel = _kernel(reg, p, a)
    data = _inputs(p, a)
    ms = _launch(reg, p, data, kernel, a)
    result = {"problem": p.to_dict(), "kernel": kernel.name,
              "execution": {"time_ms": ms, "gflops": _gflops(p, ms)}, "status": "success"}
    if a.validate:
        result["validation"] = validation.compare(_written(p, data), _reference(p, data, a), kernel.key)
        if not result["validation"]["passed"]:
            result["status"] = "failed"
    _print(result)
    return 0 if result["status"] == "success" else EXIT_FAILED


def cmd_bench(reg, a) -> int:
    p = _problem(reg, a)
    selected = reg.select(p, a.ranker)
    candidates = reg.candidates(p)
    data = _inputs(p, a)
    rows = []
    for k in candidates:
        for _ in range(a.warmup):
            _launch(reg, p, data, k, a)
        ms = statistics.median(_launch(reg, p, data, k, a) for _ in range(a.repeat))
        rows.append({"kernel": k.name, "median_ms": ms, "gflops": _gflops(p, ms), "selected": k is selected})
    rows.sort(key=lambda r: r["median_ms"])
    _print({"problem": p.to_dict(), "selected": selected.name, "results": rows})
    return 0


# -- arguments --------------------------------------------------------------------------------------
def _at_least(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def _common_options(sp, command: str, alpha: bool = True) -> None:
    """Options of every op (alpha: of those that scale their result)."""
    sp.add_argument("--dtype", choices=sorted(DTYPES), help="input dtype (default: the bundle's, when it has one)")
    if alpha:
        sp.add_argument("--alpha", type=float, default=1.0)
    sp.add_argument("--ranker", choices=["auto", *sorted(selection.RANKERS)], default="auto",
                    help="auto: this device's tuning record, else learned (a shipped model), else analytic")
    sp.add_argument("--kernel", help="run this kernel instead of the selected one")
    sp.add_argument("--seed", type=_at_least(0), default=0)
    sp.add_argument("--max-bytes", type=_at_least(1),
                    help="refuse problems whose inputs need more host memory (default: the memory available)")
    if command == "run":
        sp.add_argument("--validate", action="store_true", help="compare with a float64 numpy reference")
    if command == "select":
        sp.add_argument("--explain", action="store_true",
                        help="show the learned model (version, card) and its top kernels with predicted and, where "
                             "this device tuned the problem, measured times")
        sp.add_argument("--top", type=_at_least(1), default=8, help="how many of the model's best kernels --explain lists")
    if command == "bench":
        sp.add_argument("--warmup", type=_at_least(0), default=2)
        sp.add_argument("--repeat", type=_at_least(1), default=10)


def _op_parsers(sp, command: str) -> None:
    ops = sp.add_subparsers(dest="op", required=True, metavar="{gemm,conv,layernorm,maxpool}")
    g = ops.add_parser("gemm", help="D = act(alpha * A @ B + bias + residuals)")
    for dim in ("m", "n", "k"):
        g.add_argument(f"--{dim}", type=int, required=True)
    g.add_argument("--batch", type=int, default=1)
    g.add_argument("--layout", help="rcr, rrr, crr, ccr (default: the bundle's, when it has one)")
    g.add_argument("--activation", choices=ACTIVATIONS, default="identity")
    g.add_argument("--bias", action="store_true")
    g.add_argument("--residuals", type=_at_least(0), default=0)
    g.add_argument("--clamp-low", type=float, default=-1.0)
    g.add_argument("--clamp-high", type=float, default=1.0)
    _common_options(g, command)

    c = ops.add_parser("conv", help="grouped convolution, channels-last with an explicit group axis")
    c.add_argument("--direction", choices=conv_op.CONV_DIRECTIONS, required=True)
    c.add_argument("--n", type=int, required=True, help="batch")
    c.add_argument("--c", type=int, required=True, help="input channels (all groups)")
    c.add_argument("--k", type=int, required=True, help="output channels (all groups)")
    c.add_argument("--groups", type=int, default=1)
    c.add_argument("--in", dest="in_size", type=int, nargs="+", required=True, metavar="SIZE",
                   help="input spatial sizes, outermost first: W, H W or D H W")
    c.add_argument("--filter", type=int, nargs="+", required=True, metavar="SIZE", help="filter sizes, one per dim")
    c.add_argument("--stride", type=int, nargs="+", default=[1], metavar="S", help="one value or one per dim")
    c.add_argument("--dilation", type=int, nargs="+", default=[1], metavar="D", help="one value or one per dim")
    c.add_argument("--padding", type=int, nargs="+", metavar="P", help="both sides: one value or one per dim")
    c.add_argument("--pad-lo", type=int, nargs="+", metavar="P", help="leading side (asymmetric padding)")
    c.add_argument("--pad-hi", type=int, nargs="+", metavar="P", help="trailing side (asymmetric padding)")
    c.add_argument("--layout", help="default: the bundle's (nhwgc)")
    _common_options(c, command)

    n = ops.add_parser("layernorm", help="y = (x - mean) / sqrt(var + eps) * weight + bias over each row of x")
    n.add_argument("--rows", type=int, required=True)
    n.add_argument("--cols", type=int, required=True, help="the normalized dim")
    n.add_argument("--eps", type=float, default=ln_op.DEFAULT_EPS)
    _common_options(n, command, alpha=False)

    m = ops.add_parser("maxpool", help="max pooling of a channels-last map [N, spatial..., C], as torch's")
    m.add_argument("--n", type=int, required=True, help="batch")
    m.add_argument("--c", type=int, required=True, help="channels")
    m.add_argument("--in", dest="in_size", type=int, nargs="+", required=True, metavar="SIZE",
                   help="input spatial sizes, outermost first: W, H W or D H W")
    m.add_argument("--window", type=int, nargs="+", required=True, metavar="K", help="one value or one per dim")
    m.add_argument("--stride", type=int, nargs="+", metavar="S", help="one value or one per dim (default: the window)")
    m.add_argument("--padding", type=int, nargs="+", metavar="P", help="one value or one per dim")
    m.add_argument("--dilation", type=int, nargs="+", metavar="D", help="one value or one per dim")
    m.add_argument("--ceil-mode", action="store_true")
    _common_options(m, command, alpha=False)


def cmd_pack(a) -> int:
    from . import pack

    manifest = pack.create(a.bundles, a.output, tuning_files=a.tuning or (), model_files=a.model or (),
                           sign_key=a.sign)
    _print({"pack": a.output, "signed": a.sign is not None,
            "bundles": [{"name": b["name"], "backend": b["backend"], "arch": b["arch"], "kernels": len(b["kernels"])}
                        for b in manifest["bundles"]],
            "models": [m["file"] for m in manifest["models"]], "tuning": [t["file"] for t in manifest["tuning"]]})
    return 0


def cmd_keygen(a) -> int:
    from . import signing

    private, public, key_id = signing.keygen(a.keyfile)
    _print({"private_key": str(private), "public_key": str(public), "key_id": key_id})
    return 0


def cmd_extract(a) -> int:
    from . import pack

    opened = pack.open_pack(a.pack, trust=a.trust)
    _print({"pack": a.pack, "sha256": opened.digest, "cache": str(opened.root), "signed_by": opened.signed_by,
            "bundles": [{"name": b["name"], "backend": b["backend"], "arch": b["arch"], "kernels": len(b["kernels"]),
                         "dir": str(opened.bundle_dir(b))} for b in opened.manifest["bundles"]]})
    return 0


def cmd_wheel(a) -> int:
    from . import wheel

    path = wheel.build(a.pack, a.output, name=a.name, version=a.version)
    _print({"wheel": str(path)})
    return 0


def cmd_native(a) -> int:
    from . import native

    _print(native.build_now())
    return 0


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m tiledispatch", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for name, fn, with_problem in (("list", cmd_list, False), ("info", cmd_info, False), ("select", cmd_select, True),
                                   ("run", cmd_run, True), ("bench", cmd_bench, True)):
        sp = sub.add_parser(name)
        sp.set_defaults(fn=fn)
        sp.add_argument("bundle",
                        help="bundle directory (holds manifest.json), NAME.tdpack or an installed pack's name")
        sp.add_argument("--trust", metavar="PUBLIC_KEY", help="a pack must be signed with this ed25519 key (PEM file)")
        sp.add_argument("--models", metavar="DIR", help="rank with the learned models in DIR (<backend>_<arch>_<task>"
                                                         ".json, as bench/sweeps/train.py --out writes them) instead "
                                                         "of the shipped ones")
        if name == "info":
            sp.add_argument("--kernel", help="show one kernel's key")
        if with_problem:
            _op_parsers(sp, name)
    sp = sub.add_parser("pack", help="write bundles into one archive, NAME.tdpack")
    sp.set_defaults(fn=cmd_pack, standalone=True)
    sp.add_argument("bundles", nargs="+", metavar="BUNDLE", help="bundle directories (any backends and arches)")
    sp.add_argument("-o", "--output", required=True, help="the pack file to write (NAME.tdpack)")
    sp.add_argument("--sign", metavar="KEYFILE", help="sign the pack with this ed25519 private key (keygen)")
    sp.add_argument("--tuning", action="append", metavar="FILE", help="a tuning records file to carry (repeatable)")
    sp.add_argument("--model", action="append", metavar="FILE",
                    help="a learned model to carry, <backend>_<arch>_<op>.json (repeatable)")
    sp = sub.add_parser("keygen", help="write a new ed25519 key pair for signing packs")
    sp.set_defaults(fn=cmd_keygen, standalone=True)
    sp.add_argument("keyfile", help="the private key file to write (its public key: KEYFILE.pub)")
    sp = sub.add_parser("extract", help="check a pack, extract it into the cache, print its bundle directories")
    sp.set_defaults(fn=cmd_extract, standalone=True)
    sp.add_argument("pack", help="NAME.tdpack")
    sp.add_argument("--trust", metavar="PUBLIC_KEY", help="the pack must be signed with this ed25519 key (PEM file)")
    sp = sub.add_parser("wheel", help="build a pip-installable wheel carrying a pack")
    sp.set_defaults(fn=cmd_wheel, standalone=True)
    sp.add_argument("pack", help="NAME.tdpack")
    sp.add_argument("-o", "--output", default=".", help="directory for the wheel (default: .)")
    sp.add_argument("--name", help="the name td.load finds it by (default: the pack file's name without .tdpack)")
    sp.add_argument("--version", default="1.0.0", help="the wheel's version (default: 1.0.0)")
    sp = sub.add_parser("native", help="build the native helpers now: the torch fast path and the learned ranker's "
                                       "tree evaluator (else their first use does)")
    sp.set_defaults(fn=cmd_native, standalone=True)
    return ap


def _main(argv) -> int:
    try:
        a = parser().parse_args(argv)
        if getattr(a, "standalone", False):
            return a.fn(a)
        reg = loader.load(a.bundle, trust=a.trust, models=a.models)
        return a.fn(reg, a)
    except BrokenPipeError:
        raise
    except Exception as e:
        # one JSON object with the type and message, for a project error, a bad environment (OSError,
        # MemoryError) and a bug alike: nothing is hidden, nothing prints a traceback
        _print(_error(e))
        return EXIT_ERROR


def main(argv=None) -> int:
    try:
        try:
            code = _main(argv)
        except SystemExit as e:  # -h: argparse printed the help and exits
            code = e.code if isinstance(e.code, int) else 0
        sys.stdout.flush()  # a closed pipe shows here at the latest, not at interpreter exit
        return code
    except BrokenPipeError:
        # the reader is gone (`| head`): point stdout at /dev/null so the interpreter's final flush is quiet
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
