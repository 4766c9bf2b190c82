#!/usr/bin/env python3
"""The coverage map (issue #17, DESIGN.md invariant 10): which problem classes find no kernel in a kernel set.

A problem class is one GEMM (dtype, layout, M, N, K, leading dimensions dense or odd) or one convolution
(direction, rank, N / G / C / K, filter, stride, dilation, padding). For every preselected essential set and each
backend/arch it declares, the classes the set is built for (some kernel's signature matches: op, dtypes, layout,
direction, rank) are checked against its kernels:

  model mode (default, no compiler or device): a kernel admits a class when its family's Python model of its
  td_can_run (the family module's refusal(problem, key)) accepts it. Families without a model (the cpu and
  ck_tile backends) are reported as not modelled.
  --bundle DIR: the compiled kernels' own td_can_run decides (Registry.explain; no data, no launch), for any
  backend, e.g. a cpu bundle here or a cutlass bundle on the GPU machine.

    python3 bench/benchmarks/coverage.py                       # every essential set, model mode
    python3 bench/benchmarks/coverage.py --sets fp16_rcr_essential --show 5
    python3 bench/benchmarks/coverage.py --bundle build/b --json out.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "runtime"))

from tiledispatch import backends  # noqa: E402
from tiledispatch.errors import InvalidInputError  # noqa: E402
from tiledispatch.ops.conv import ConvProblem  # noqa: E402
from tiledispatch.ops.gemm import GemmProblem  # noqa: E402

ESSENTIAL_SETS = ("fp16_rcr_essential", "bf16_rcr_essential", "fp32_rcr_essential", "int8_rcr_essential",
                  "fp8_rcr_essential", "fp16_all_layouts", "conv_fp16_fwd_essential", "conv_fp16_bwd_essential",
                  "conv_fp16_all_essential")

# GEMM classes: sizes that are 1, odd or just past a tile, and an aligned one (64), in each of M, N, K
GEMM_SIZES = (1, 3, 7, 64, 65, 777)
GEMM_DTYPES = (("fp16", "fp16", "fp16"), ("bf16", "bf16", "bf16"), ("fp32", "fp32", "fp32"), ("int8", "int8", "int32"),
               ("fp8e4m3", "fp8e4m3", "fp16"), ("fp8e4m3", "fp8e4m3", "bf16"), ("fp8e5m2", "fp8e5m2", "fp16"))
GEMM_LAYOUTS = ("rcr", "rrr", "crr", "ccr")
# the problems, named
GEMM_NAMED = ((777, 1234, 4320), (65, 129, 256), (3, 50257, 768))


def gemm_classes(dtypes=GEMM_DTYPES, layouts=GEMM_LAYOUTS, sizes=GEMM_SIZES):
    """(label, problem, leading dimensions or None) for every GEMM class: dense operands and operands whose
    leading dimension is one element longer than their contiguous extent (a view into a padded buffer)."""
    shapes = list(itertools.product(sizes, sizes, sizes)) + list(GEMM_NAMED)
    for (a, b, c), layout, (m, n, k) in itertools.product(dtypes, layouts, shapes):
        p = GemmProblem(m, n, k, a, b, c, layout)
        extents = {"a": k if layout[0] == "r" else m, "b": n if layout[1] == "r" else k, "c": n}
        for ld_kind in ("dense", "ld+1"):
            ld = None if ld_kind == "dense" else {r: e + 1 for r, e in extents.items()}
            yield f"gemm {a}/{c} {layout} {m}x{n}x{k} {ld_kind}", p, ld


# conv classes: (label, G, C, K); channel counts 1, 3, odd, C/G and K/G odd, and aligned references
CONV_CHANNELS = (("C1 K64", 1, 1, 64), ("C3 K64", 1, 3, 64), ("C64 K3", 1, 64, 3), ("C64 K1", 1, 64, 1),
                 ("C5 K7", 1, 5, 7), ("C65 K65", 1, 65, 65), ("C257 K255", 1, 257, 255),
                 ("G4 C/G3 K/G3", 4, 12, 12), ("G3 C/G3 K/G5", 3, 9, 15), ("G8 C/G5 K/G5", 8, 40, 40),
                 ("depthwise 32", 32, 32, 32), ("dense 64", 1, 64, 64))
# geometry per rank: (label, filter, stride, dilation, pad_lo, pad_hi) for the innermost dims
CONV_GEOMETRIES = (("3 s1 p1", 3, 1, 1, 1, 1), ("7 s2 p3", 7, 2, 1, 3, 3), ("3 s2 d2 pad 0/2", 3, 2, 2, 0, 2),
                   ("1 s1", 1, 1, 1, 0, 0), ("4 s3 pad 1/0", 4, 3, 1, 1, 0))
CONV_SIZES = {1: (997,), 2: (29, 31), 3: (7, 9, 11)}
# named classes from real models, (label, N, G, C, K, size, filter, stride, dilation, pad_lo, pad_hi): the ResNet
# stem and a raw-audio front end (wav2vec 2.0's first layer)
CONV_NAMED = (("resnet stem 7x7/2 C3 K64", 2, 1, 3, 64, (224, 224), (7, 7), (2, 2), (1, 1), (3, 3), (3, 3)),
              ("audio front end 10/5 C1 K512", 1, 1, 1, 512, (16000,), (10,), (5,), (1,), (0,), (0,)))


def conv_classes(directions=("fwd", "bwd_data", "bwd_weight"), ranks=(1, 2, 3), dtype="fp16", n=2,
                 channels=CONV_CHANNELS, geometries=CONV_GEOMETRIES, sizes=CONV_SIZES, named=CONV_NAMED):
    """(label, problem, None) for every conv class (dense channels-last operands)."""
    for direction, rank, (clabel, g, c, k), (glabel, f, s, d, lo, hi) in itertools.product(
            directions, ranks, channels, geometries):
        try:
            p = ConvProblem(direction, n, g, c, k, sizes[rank], (f,) * rank, (s,) * rank, (d,) * rank, (lo,) * rank,
                            (hi,) * rank, dtype, dtype, dtype)
        except InvalidInputError:  # a geometry too large for the rank's sizes
            continue
        yield f"conv{rank}d {direction} {clabel} f{glabel}", p, None
    for direction, (label, nb, g, c, k, size, f, s, d, lo, hi) in itertools.product(directions, named):
        if len(size) in ranks:
            yield (f"conv{len(size)}d {direction} {label}",
                   ConvProblem(direction, nb, g, c, k, size, f, s, d, lo, hi, dtype, dtype, dtype), None)


def all_classes():
    return list(gemm_classes()) + list(conv_classes())


def model_refusal(problem, key, ld):
    """The family model's verdict: None (admits), a reason, or NotImplemented (the family has no model)."""
    model = getattr(backends.family_of(key).module, "refusal", None)
    if model is None:
        return NotImplemented
    return model(problem, key, ld) if problem.op == "gemm" else model(problem, key)


def set_targets(name: str) -> list[str]:
    from tiledispatch.generator import kernelset

    return kernelset.targets(kernelset.find(name))


def set_keys(name: str, target: str) -> list:
    from tiledispatch.generator import kernelset

    backend, arch = target.split("/")
    return [e.key for e in kernelset.expand_file(kernelset.find(name), backend, arch)]


def coverage(keys, classes, admits) -> dict:
    """{relevant, uncovered: [labels], unmodelled: [labels]} over the classes some key's signature matches.
    admits(problem, key, ld) -> None | reason | NotImplemented."""
    out = {"relevant": 0, "uncovered": [], "unmodelled": []}
    for label, problem, ld in classes:
        matching = [k for k in keys if problem.mismatch(k) is None]
        if not matching:
            continue  # the set is not built for this dtype / layout / op / direction / rank: a clear error
        out["relevant"] += 1
        verdicts = [admits(problem, k, ld) for k in matching]
        if any(v is None for v in verdicts):
            continue
        (out["unmodelled"] if any(v is NotImplemented for v in verdicts) else out["uncovered"]).append(label)
    return out


def model_map(sets=ESSENTIAL_SETS, exclude: str | None = None) -> dict:
    """{"set backend/arch": coverage} from the family models; exclude: a regex of kernel names left out (e.g. the
    low-alignment kernels, for the map without them)."""
    classes = all_classes()
    result = {}
    for name in sets:
        # a conv set's GEMM kernels serve its pointwise convolutions (ops/conv_as_gemm), not GEMM calls
        op_classes = [c for c in classes if (c[1].op == "conv") == name.startswith("conv")]
        for target in set_targets(name):
            keys = [k for k in set_keys(name, target) if not (exclude and re.search(exclude, k.name))]
            result[f"{name} {target}"] = coverage(keys, op_classes, model_refusal)
    return result


def bundle_map(bundle: Path) -> dict:
    """The compiled kernels' own td_can_run over every class (with ld: strided views of a larger buffer)."""
    import tiledispatch as td
    from tiledispatch import abi, ops

    reg = td.load(bundle)
    keys = [k.key for k in reg.kernels]
    by_name = {k.key.name: k for k in reg.kernels}

    def admits(problem, key, ld):
        kern = by_name[key.name]
        args = ops.get(problem.op).make_args(problem, key)
        if ld:  # leading dimensions: the arguments' strides over m / k rows (shapes unchanged)
            _apply_ld(args, problem, ld)
        status, why = kern.library.can_run(args)
        return None if status == abi.OK else why

    return {f"bundle {bundle}": coverage(keys, all_classes(), admits)}


def _apply_ld(args, problem, ld) -> None:
    """Set the leading strides of A, B, D (and C) of GEMM arguments to ld (elements), batch strides to match."""
    layout = problem.layout
    for slot, role, letter in ((0, "a", layout[0]), (1, "b", layout[1]), (2, "c", "r"), (3, "c", "r")):
        t = args.tensors[slot]
        if not t.data:
            continue
        if letter == "r":
            t.stride[1] = ld[role]
        else:
            t.stride[2] = ld[role]
        t.stride[0] = ld[role] * (t.shape[1] if letter == "r" else t.shape[2])


def report(result: dict, show: int) -> str:
    lines = [f"{'set / target':58s} {'classes':>8s} {'no kernel':>10s} {'not modelled':>13s}"]
    for where, r in result.items():
        lines.append(f"{where:58s} {r['relevant']:8d} {len(r['uncovered']):10d} {len(r['unmodelled']):13d}")
        for label in r["uncovered"][:show]:
            lines.append(f"    no kernel: {label}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="*", default=list(ESSENTIAL_SETS), help="kernel sets (default: the essential ones)")
    ap.add_argument("--bundle", type=Path, help="ask a built bundle's kernels (td_can_run) instead of the models")
    ap.add_argument("--exclude", help="regex of kernel names to leave out (model mode), e.g. '_xalign' for the map "
                    "without the low-alignment kernels")
    ap.add_argument("--show", type=int, default=3, help="uncovered classes listed per set / target")
    ap.add_argument("--json", type=Path, help="write the full map (every uncovered class) as JSON")
    a = ap.parse_args(argv)
    result = bundle_map(a.bundle) if a.bundle else model_map(a.sets, a.exclude)
    print(report(result, a.show))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
