"""Validate every conv kernel of cutlass bundles on the GPU against the float64 reference.

    python bench/validation/validate_conv_gpu.py BUNDLE_DIR [BUNDLE_DIR ...] [--json out.json]

Per kernel: the problem kinds it is meant for (tma_ws_conv: dense with channels below and above one 64-wide
k tile; implicit_gemm: dense, C/G = 16, C/G = 64; direct: depthwise,
C/G = 4, and for the generic direct kernel also channel multipliers and odd channel counts) in every
geometry (stride 1/2 x dilation 1/2, all with asymmetric padding), random inputs (never zeros), the output
poisoned with NaN first; pass = every element written and ||out - ref|| / ||ref|| within the rules'
tolerance; a case the kernel documents it refuses (tma_ws_conv: strided bwd_data) passes when td_can_run
refuses it with that reason. Then per direction and rank, through the runtime's own selection on torch channels_last
tensors (groups=G form), against torch's float32 convolution; alpha/beta on one problem per kernel; and
refusals (misaligned channels for implicit_gemm and tma_ws_conv, groups > 1 for tma_ws_conv); tma_ws_conv
bwd_weight's split of its pixel sum with S = 1, uneven k ranges, K not a multiple of the tile and more tiles
than resident CTAs, each with beta = 0 and alpha/beta. Fused forward epilogues (kernels whose key has an
activation, bias or residuals): every such kernel on its kinds and geometries with random bias and residuals against
the float64 reference (act(alpha * conv + beta * Y + bias + residuals); clamp bounds validation.VALIDATION_CLAMP),
alpha/beta with the epilogue (beta = 0 where tma_ws_conv adds a residual as its C operand), the runtime's own
selection of each epilogue on torch channels_last tensors against torch, and pointwise layers on the bundle's fused
GEMM kernels through the runtime. Exit status 1 on any failure.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared modules

import _gpu_common as gc
from _conv_common import TORCH_DTYPE, ConvLauncher, expected_refusal, kind_groups, kind_of, machine
from tiledispatch import abi, backends, load, reference, validation
from tiledispatch.ops import conv, conv_as_gemm, gemm
from tiledispatch.plan import bind
from tiledispatch.spec.key import Epilogue

# (G, C/G, K/G): a partial lane block, partial GEMM tiles
KINDS = {"dense": (1, 32, 48), "dense_wide": (1, 96, 136), "g16": (4, 16, 16), "g64": (2, 64, 64), "g4": (32, 4, 4), "depthwise": (96, 1, 1),
         "multiplier": (24, 1, 2), "odd": (6, 3, 5), "g2": (16, 2, 2)}
GEOMETRIES = {  # stride, dilation, pad_lo, pad_hi per dim (innermost last; cut to the rank)
    "s1d1": ((1, 1, 1), (1, 1, 1), (1, 0, 2), (0, 2, 1)),
    "s2d1": ((2, 2, 2), (1, 1, 1), (0, 1, 1), (2, 0, 0)),
    "s1d2": ((1, 1, 1), (2, 2, 2), (2, 1, 0), (1, 0, 3)),
    "s2d2": ((2, 2, 2), (2, 2, 2), (1, 2, 0), (0, 1, 2)),
}
SIZES = {1: (3, (67,), (5,)), 2: (2, (19, 23), (3, 3)), 3: (2, (5, 9, 11), (3, 3, 3))}  # N, spatial, filter


def filter_of(key, rank) -> tuple[int, ...]:
    """The filter the kernel's cases use: SIZES', or the kernel's compile-time one (cutlass.fx / cutlass.fy)."""
    filt = SIZES[rank][2]
    fx, fy = key.algorithm.extra("cutlass.fx", 0), key.algorithm.extra("cutlass.fy", 0)
    if not fx:
        return filt
    return (fx,) if rank == 1 else filt[:-2] + (fy, fx)


def make_case(rng, direction, rank, kind, geometry, dtype, filt=None, epilogue=Epilogue()):
    """A problem, its host data (with a fused epilogue's random bias and residuals) and the float64 reference."""
    n, in_size, default_filt = SIZES[rank]
    filt = filt or default_filt
    g, cg, kg = kind_groups(kind, KINDS)
    stride, dilation, pad_lo, pad_hi = (v[-rank:] for v in GEOMETRIES[geometry])
    p = conv.ConvProblem(direction, n, g, g * cg, g * kg, in_size, filt, stride, dilation, pad_lo, pad_hi,
                         dtype, dtype, dtype, epilogue=epilogue)
    host, expect = validation.conv_case(p, rng)
    return p, host, expect


def _device(a, dtype: str):
    return torch.from_numpy(a.astype(np.float32)).to("cuda", TORCH_DTYPE[dtype])


def to_device(host: dict, dtype: str, written: str) -> dict:
    dev = {}
    for role, a in host.items():
        if role == "residuals":
            dev[role] = tuple(_device(r, dtype) for r in a)
            continue
        t = _device(a, dtype)
        dev[role] = t.fill_(float("nan")) if role == written else t
    return dev


def run_kernel(kern, p, dev, alpha=1.0, beta=0.0) -> np.ndarray:
    launch = ConvLauncher(kern, p, dev["x"], dev["w"], dev["y"], alpha=alpha, beta=beta, bias=dev.get("bias"),
                          residuals=dev.get("residuals", ()), clamp=validation.VALIDATION_CLAMP)
    status, reason = launch.can_run()
    if status != abi.OK:
        raise RuntimeError(f"refused: {reason}")
    launch()
    torch.cuda.synchronize()
    return dev[conv.WRITES[p.direction]].float().cpu().numpy()


def attempt(entry: dict, check, results: list, label: str) -> None:
    """entry.update(check(entry)) (a validation.compare-style dict), an exception recorded as a failure; then
    append entry to results and print one line."""
    try:
        entry.update(check(entry))
    except Exception as e:  # noqa: BLE001 - record and go on
        entry.update(passed=False, error=str(e)[:400])
    results.append(entry)
    print(f"{'ok  ' if entry['passed'] else 'FAIL'} {label} {entry.get('kernel', '-')[:90]}: "
          f"{entry.get('rel_error', entry.get('error'))}", flush=True)


ONLY = None  # --only: a regular expression; the per-kernel checks then take only the kernels whose names match it


def kernels_of(reg) -> list:
    return gc.matching(reg.kernels, ONLY)


def check_kernels(registries, cases_cache, rng) -> list[dict]:
    results = []
    for reg in registries:
        for kern in kernels_of(reg):
            sig = kern.key.signature
            if sig.op != "conv":
                continue
            t0 = time.time()
            fails = 0
            for kind, geometry in itertools.product(kind_of(kern.key), GEOMETRIES):
                ck = (sig.direction, sig.spatial_dims, kind, geometry, sig.dtype_a, filter_of(kern.key, sig.spatial_dims),
                      sig.epilogue)
                if ck not in cases_cache:
                    cases_cache[ck] = make_case(rng, *ck)
                p, host, expect = cases_cache[ck]
                entry = {"kernel": kern.name, "problem": str(p), "kind": kind, "geometry": geometry}
                refusal = expected_refusal(kern.key, p)
                if refusal:
                    status, reason = kern.library.can_run(conv.make_args(p, kern.key))
                    entry.update(refused=reason, passed=status == abi.UNSUPPORTED and refusal in reason)
                    fails += not entry["passed"]
                    results.append(entry)
                    continue
                try:
                    dev = to_device(host, sig.dtype_a, conv.WRITES[p.direction])
                    out = run_kernel(kern, p, dev)
                    entry.update(validation.compare(out, expect, kern.key))
                except Exception as e:  # noqa: BLE001 - record and go on
                    entry.update(passed=False, error=str(e)[:400])
                fails += not entry["passed"]
                results.append(entry)
                if not entry["passed"]:
                    print(f"  FAIL {kern.name} {kind} {geometry}: {entry.get('rel_error', entry.get('error'))}")
            # alpha / beta: out = 0.75 conv - 1.25 out on the first kind, geometry s2d1 (s1d1 where s2d1 is refused)
            kind = kind_of(kern.key)[0]
            geometry = "s2d1"
            filt = filter_of(kern.key, sig.spatial_dims)
            p, host, expect = cases_cache[(sig.direction, sig.spatial_dims, kind, geometry, sig.dtype_a, filt, sig.epilogue)]
            if expected_refusal(kern.key, p):
                geometry = "s1d1"
                p, host, expect = cases_cache[(sig.direction, sig.spatial_dims, kind, geometry, sig.dtype_a, filt,
                                               sig.epilogue)]
            written = conv.WRITES[p.direction]
            host2 = dict(host)
            host2[written] = validation.random_array(rng, host[written].shape, sig.dtype_a)
            dev = to_device(host2, sig.dtype_a, None)
            old = dev[written].double().cpu().numpy()
            # tma_ws_conv adds a residual as CUTLASS's C operand and refuses beta != 0 next to it
            beta = 0.0 if sig.epilogue.residuals and kern.key.algorithm.pipeline == "tma_ws_conv" else -1.25
            entry = {"kernel": kern.name, "problem": str(p), "kind": kind, "geometry": geometry, "alpha": 0.75,
                     "beta": beta}
            try:
                out = run_kernel(kern, p, dev, alpha=0.75, beta=beta)
                if sig.epilogue != Epilogue():  # the epilogue applies to alpha * conv + beta * old
                    want = reference.conv_fwd_fused(
                        host["x"], host["w"], p.stride, p.dilation, p.pad_lo, p.pad_hi, y=old, bias=host.get("bias"),
                        residuals=host.get("residuals", ()), alpha=0.75, beta=beta, activation=sig.epilogue.activation,
                        clamp=validation.VALIDATION_CLAMP)
                else:
                    want = 0.75 * expect - 1.25 * old
                entry.update(validation.compare(out, want, kern.key))
            except Exception as e:  # noqa: BLE001
                entry.update(passed=False, error=str(e)[:400])
            fails += not entry["passed"]
            results.append(entry)
            print(f"{'ok  ' if not fails else 'FAIL'} {kern.name}: {fails} failures ({time.time() - t0:.1f} s)",
                  flush=True)
    return results


# tma_ws_conv bwd_weight splits its pixel sum into S k ranges on persistent CTAs (templates/cutlass/conv_tma_ws/_conv_sm90_wgrad.j2);
# per rank, problems (N, C, K, spatial, filter) tried in order until each wanted kind of split is found for the
# kernel's tile: S = 1, S > 1 with uneven k ranges, S > 1 with K not a multiple of tile m (padded partial rows),
# more tiles than resident CTAs (unsplit, each CTA looping over tiles); each also with alpha/beta.
SPLIT_PROBLEMS = {
    1: [(3, 64, 64, (37,), (5,)), (7, 64, 48, (301,), (5,)), (3, 1024, 1024, (9,), (5,)), (16, 64, 64, (2048,), (3,))],
    2: [(3, 64, 64, (9, 11), (3, 3)), (5, 64, 48, (27, 29), (3, 3)), (3, 1024, 1024, (5, 5), (3, 3)),
        (16, 64, 64, (56, 56), (3, 3))],
    3: [(3, 32, 48, (3, 5, 7), (3, 3, 3)), (5, 64, 48, (7, 9, 11), (3, 3, 3)), (3, 256, 256, (3, 5, 7), (3, 3, 3)),
        (2, 512, 512, (3, 5, 7), (3, 3, 3))],
}


def wgrad_split(p, key) -> tuple[int, int, int, int]:
    """(S, units, ktiles, resident CTAs) of the kernel on the problem (the ranker models its rule)."""
    from tiledispatch import backends
    from tiledispatch.selection import compute_units

    family = backends.family_of(key)  # conv_tma_ws: the split its kernel chooses
    s, tiles, ktiles, _ = family.module.conv_partials_split(p, key)
    return s, tiles * s, ktiles, compute_units(key.backend, key.arch) * family.resident_ctas(key)


def split_cases(key) -> list:
    """[(label, problem)] for a tma_ws_conv bwd_weight key: each kind of split of SPLIT_PROBLEMS's comment."""
    rank, tm = key.signature.spatial_dims, key.algorithm.tile[0]
    want = {"S=1": lambda s, u, kt, r, k: s == 1,
            "uneven k": lambda s, u, kt, r, k: s > 1 and kt % s,
            "K%m": lambda s, u, kt, r, k: s > 1 and k % tm,
            "tiles>CTAs": lambda s, u, kt, r, k: s == 1 and u > r}
    found = {}
    for n, c, k, sp, f in SPLIT_PROBLEMS[rank]:
        p = conv.ConvProblem("bwd_weight", n, 1, c, k, sp, f, (1,) * rank, (1,) * rank, (1,) * rank, (0,) * rank,
                             key.signature.dtype_a, key.signature.dtype_a, key.signature.dtype_a)
        s, units, ktiles, resident = wgrad_split(p, key)
        for label, ok in want.items():
            if label not in found and ok(s, units, ktiles, resident, k):
                found[label] = (f"{label} (S={s}, {units} units, {ktiles} k tiles)", p)
    missing = set(want) - set(found)
    if missing:
        raise RuntimeError(f"{key.name}: no SPLIT_PROBLEMS case for {sorted(missing)}")
    return list(found.values())


def check_splits(registries, rng) -> list[dict]:
    """tma_ws_conv bwd_weight's split: every kind of split, with beta = 0 and with alpha/beta."""
    results = []
    for reg in registries:
        for kern in kernels_of(reg):
            k = kern.key
            if k.algorithm.pipeline != "tma_ws_conv" or k.signature.direction != "bwd_weight":
                continue
            try:
                cases = split_cases(k)
            except RuntimeError as e:  # a tile SPLIT_PROBLEMS does not cover: a failure, not a crash
                results.append({"kernel": kern.name, "split": "cases", "passed": False, "error": str(e)})
                print(f"FAIL split cases: {e}", flush=True)
                continue
            for label, p in cases:
                host, expect = validation.conv_case(p, rng)
                for alpha, beta in ((1.0, 0.0), (0.75, -1.25)):
                    def check(entry, host=host):  # called at once, in this iteration
                        if beta:
                            host = dict(host, w=validation.random_array(rng, host["w"].shape, k.signature.dtype_a))
                            dev = {r: torch.from_numpy(a.astype(np.float32)).to("cuda", TORCH_DTYPE[k.signature.dtype_a])
                                   for r, a in host.items()}
                            ref = alpha * expect + beta * dev["w"].double().cpu().numpy()
                        else:
                            dev, ref = to_device(host, k.signature.dtype_a, "w"), expect
                        return validation.compare(run_kernel(kern, p, dev, alpha=alpha, beta=beta), ref, k)

                    entry = {"kernel": kern.name, "problem": str(p), "split": label, "alpha": alpha, "beta": beta}
                    attempt(entry, check, results, f"split {label} alpha {alpha} beta {beta}")
    return results


def torch_reference(direction, x, w, dy, stride, dilation, pad_lo, pad_hi, groups):
    """float32 torch result with asymmetric padding (pad first, convolve unpadded, crop)."""
    rank = x.dim() - 2
    pads = [v for d in reversed(range(rank)) for v in (pad_lo[d], pad_hi[d])]
    xp = torch.nn.functional.pad(x.float(), pads)
    fn = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}[rank]
    if direction == "fwd":
        return fn(xp, w.float(), None, stride, 0, dilation, groups)
    mask = [direction == "bwd_data", direction == "bwd_weight", False]
    gi, gw, _ = torch.ops.aten.convolution_backward(dy.float(), xp, w.float(), None, list(stride), [0] * rank,
                                                    list(dilation), False, [0] * rank, groups, mask)
    if direction == "bwd_weight":
        return gw
    return gi[(slice(None), slice(None)) + tuple(slice(pad_lo[d], pad_lo[d] + x.shape[2 + d]) for d in range(rank))]


def check_selection(registries) -> list[dict]:
    """The runtime picks a kernel itself for torch channels_last tensors (logical [N, C, ...] form)."""
    results = []
    gen = torch.Generator(device="cuda").manual_seed(5)
    for reg in registries:
        dtypes = sorted({k.key.signature.dtype_a for k in reg.kernels})
        for dtype, direction, rank, kind in itertools.product(dtypes, conv.CONV_DIRECTIONS, (1, 2, 3),
                                                              ("dense", "g4", "depthwise")):
            g, cg, kg = KINDS[kind]
            n, in_size, filt = SIZES[rank]
            stride, dilation, pad_lo, pad_hi = (v[-rank:] for v in GEOMETRIES["s2d1"])
            p = conv.ConvProblem(direction, n, g, g * cg, g * kg, in_size, filt, stride, dilation, pad_lo, pad_hi,
                                 dtype, dtype, dtype)
            if not any(p.mismatch(k.key) is None and kind in kind_of(k.key) for k in reg.kernels):
                continue  # a bundle of variants need not cover every direction, rank and kind
            td = TORCH_DTYPE[dtype]

            def logical(shape, role):  # the frameworks' [N, C, sp...] / [K, C/G, f...] form, channels-last memory
                if role == "w":
                    lead, chan, sp = shape[0] * shape[1], shape[-1], shape[2:-1]
                else:
                    lead, chan, sp = shape[0], shape[-2] * shape[-1], shape[1:-2]
                t = (torch.rand((lead, *sp, chan), generator=gen, device="cuda") - 0.5).to(td)
                return t.permute(0, rank + 1, *range(1, rank + 1))

            shapes = p.shapes()
            x, w, y = (logical(shapes[r], r) for r in ("x", "w", "y"))
            written = {"fwd": y, "bwd_data": x, "bwd_weight": w}[direction]
            written.fill_(float("nan"))

            def check(entry):  # called at once, in this iteration
                geo = dict(stride=stride, dilation=dilation, pad_lo=pad_lo, pad_hi=pad_hi, groups=g)
                kern = reg.select(p)
                entry["kernel"] = kern.name
                if direction == "fwd":
                    reg.conv_fwd(x, w, y, **geo)
                elif direction == "bwd_data":
                    reg.conv_bwd_data(y, w, x, **geo)
                else:
                    reg.conv_bwd_weight(x, y, w, **geo)
                torch.cuda.synchronize()
                return _against(written, torch_reference(direction, x, w, y, stride, dilation, pad_lo, pad_hi, g),
                                kern.key)

            attempt({"selection": True, "problem": str(p)}, check, results, f"selected for {kind} {p}")
    return results


def check_pointwise(registries) -> list[dict]:
    """Pointwise dense convolutions as GEMMs (ops/conv_as_gemm.py): every GEMM kernel of a bundle that runs the
    lowered problem, launched on views of the conv's tensors, and the runtime's own call (no kernel named),
    which must take the GEMM path; against torch, outputs poisoned first."""
    results = []
    gen = torch.Generator(device="cuda").manual_seed(7)
    for reg in registries:
        if "gemm" not in reg.ops:
            continue
        for direction, rank in itertools.product(conv_as_gemm.DIRECTIONS, (1, 2, 3)):
            n, in_size, _ = SIZES[rank]
            p = conv.ConvProblem(direction, n, 1, 96, 136, in_size, (1,) * rank, 1, 1, 0, 0, "fp16", "fp16", "fp16")
            x, w, y = (((torch.rand(p.shapes()[r], generator=gen, device="cuda") - 0.5).half()) for r in "xwy")
            written = x if direction == "bwd_data" else y
            logical = [t.squeeze(-2).movedim(-1, 1) if r != "w" else t[0].movedim(-1, 1)  # [N, C, sp...], [K, C, f...]
                       for t, r in ((x, "x"), (w, "w"), (y, "y"))]
            ref = torch_reference(direction, *logical, (1,) * rank, (1,) * rank, (0,) * rank, (0,) * rank, 1)
            ref = ref.movedim(1, -1).unsqueeze(-2)  # explicit group axis: [N, sp..., 1, channels]
            _, ops = conv.operands(direction, x, w, y)
            gp, gops = gemm.operands(*conv_as_gemm.operands(p, ops))
            for kern in reg.kernels:
                if gp.mismatch(kern.key) is not None:
                    continue

                def check(entry, kern=kern):  # called at once, in this iteration
                    args = bind(reg, gp, kern, gops)
                    status, reason = kern.library.can_run(args)
                    if status != abi.OK:
                        return {"passed": True, "refused": reason}  # selection skips it; nothing to validate
                    written.fill_(float("nan"))
                    status, reason = kern.library.run(args)
                    torch.cuda.synchronize()
                    return _against(written, ref, kern.key) if status == abi.OK else {"passed": False, "reason": reason}

                attempt({"kernel": kern.name, "problem": str(p), "as_gemm": True}, check, results, f"as GEMM {p}")

            for alpha, beta in ((1.0, 0.0), (0.5, -1.5)):
                def check_runtime(entry, alpha=alpha, beta=beta):  # called at once, in this iteration
                    ran = []
                    real = reg._launch  # every launch of a public call is prepared there
                    reg._launch = lambda prob, *a, **kw: ran.append(prob.op) or real(prob, *a, **kw)
                    try:
                        if beta:  # out = alpha * conv + beta * out, in place (the GEMM's C is its D)
                            written.copy_(torch.rand(written.shape, generator=gen, device="cuda") - 0.5)
                        else:
                            written.fill_(float("nan"))
                        want = alpha * ref + (beta * written.float() if beta else 0.0)
                        if direction == "fwd":
                            conv.fwd(reg, x, w, y, alpha=alpha, beta=beta)
                        else:
                            conv.bwd_data(reg, y, w, x, alpha=alpha, beta=beta)
                        torch.cuda.synchronize()
                    finally:
                        del reg._launch
                    entry["ran"] = ran
                    result = _against(written, want, reg.select(gp).key)
                    result["passed"] = result["passed"] and ran == ["gemm"]
                    return result

                attempt({"selection": True, "problem": str(p), "as_gemm": True, "alpha": alpha, "beta": beta},
                        check_runtime, results, f"runtime as GEMM alpha {alpha} beta {beta} {p}")
    return results


def _fused_call(reg, epi: Epilogue, p, gen, geo: dict, key) -> dict:
    """reg.conv_fwd with the epilogue on random torch channels_last tensors ([N, C, sp...] form, bias [K],
    residuals like y), through the runtime's own selection; the verdict against torch in float32, and which op ran
    (a pointwise layer must run on a GEMM kernel)."""
    rank = p.spatial_dims
    td = TORCH_DTYPE[p.dtype_x]

    def logical(shape, role):  # channels-last memory in the frameworks' form
        if role == "w":
            lead, chan, sp = shape[0] * shape[1], shape[-1], shape[2:-1]
        else:
            lead, chan, sp = shape[0], shape[-2] * shape[-1], shape[1:-2]
        t = (torch.rand((lead, *sp, chan), generator=gen, device="cuda") - 0.5).to(td)
        return t.permute(0, rank + 1, *range(1, rank + 1))

    shapes = p.shapes()
    x, w, y = (logical(shapes[r], r) for r in ("x", "w", "y"))
    bias = ((torch.rand(p.k, generator=gen, device="cuda") - 0.5).to(td)) if epi.bias else None
    residuals = tuple(logical(shapes["y"], "y") for _ in range(epi.residuals))
    y.fill_(float("nan"))
    ran = []
    real = reg._launch
    reg._launch = lambda prob, *a, **kw: ran.append(prob.op) or real(prob, *a, **kw)
    try:
        options = dict(geo, bias=bias, residuals=residuals, activation=epi.activation)
        if epi.activation == "clamp":
            options["clamp"] = validation.VALIDATION_CLAMP
        reg.conv_fwd(x, w, y, **options)
        torch.cuda.synchronize()
    finally:
        del reg._launch
    ref = torch_reference("fwd", x, w, None, geo["stride"], geo["dilation"], geo["pad_lo"], geo["pad_hi"], geo["groups"])
    if bias is not None:
        ref = ref + bias.float().reshape(1, -1, *(1,) * rank)
    for r in residuals:
        ref = ref + r.float()
    ref = gc.activation(ref, epi.activation, *validation.VALIDATION_CLAMP)
    return {**_against(y, ref, key), "ran": ran}  # key: one that fuses the epilogue, for the dtype's tolerance


def check_fused_selection(registries) -> list[dict]:
    """Each fused epilogue of a bundle's conv kernels through the runtime's own selection, on the kinds and filter of
    the kernels that fuse it (dense 3x3, depthwise with the compile-time filter, a C = 3 stem), and each epilogue of
    its GEMM kernels on a pointwise layer, which must run on a GEMM kernel."""
    results = []
    gen = torch.Generator(device="cuda").manual_seed(11)
    for reg in registries:
        cases = {}
        for kern in kernels_of(reg):
            sig, alg = kern.key.signature, kern.key.algorithm
            if sig.epilogue == Epilogue() or (sig.op == "conv" and sig.direction != "fwd"):
                continue
            if sig.op == "gemm":  # pointwise: 1x1, unit stride, no padding, fp16
                if sig.dtype_a == "fp16" and sig.layout == "rcr":
                    cases[("pointwise", sig.epilogue)] = (2, 1, 96, 136, (19, 23), (1, 1), "s1d1", kern.key)
                continue
            if sig.spatial_dims != 2:
                continue
            filt = filter_of(kern.key, 2)
            for kind in kind_of(kern.key)[:1]:
                g, cg, kg = kind_groups(kind, KINDS)
                cases[(kind, sig.epilogue, filt, sig.dtype_a)] = (2, g, g * cg, g * kg, (19, 23), filt, "s2d1", kern.key)
            if alg.extra("cutlass.align", 0) == 1:  # the generic kernel: a stem with C = 3
                cases[("stem", sig.epilogue, sig.dtype_a)] = (2, 1, 3, 64, (29, 31), (7, 7), "s2d1", kern.key)
        for label, (n, g, c, k, sp, filt, geometry, key) in cases.items():
            epi = label[1]
            stride, dilation, pad_lo, pad_hi = (v[-2:] for v in GEOMETRIES[geometry])
            if label[0] == "pointwise":
                stride, dilation, pad_lo, pad_hi = (1, 1), (1, 1), (0, 0), (0, 0)
            dtype = label[-1] if label[0] != "pointwise" else "fp16"
            p = conv.ConvProblem("fwd", n, g, c, k, sp, filt, stride, dilation, pad_lo, pad_hi, dtype, dtype, dtype)
            geo = dict(stride=stride, dilation=dilation, pad_lo=pad_lo, pad_hi=pad_hi, groups=g)

            def check(entry, p=p, epi=epi, geo=geo, key=key, pointwise=label[0] == "pointwise"):  # called at once
                result = _fused_call(reg, epi, p, gen, geo, key)
                entry["ran"] = result.pop("ran")
                if pointwise:
                    result["passed"] = result["passed"] and entry["ran"] == ["gemm"]
                return result

            attempt({"selection": True, "fused": True, "problem": f"{p} epilogue {epi}"}, check, results,
                    f"fused {label[0]} {epi}")
    return results


def _against(out, ref, key) -> dict:
    """validation.compare's verdict for a torch output against a torch reference: finite and within the
    kernel's tolerance."""
    out = out.float()
    finite = bool(torch.isfinite(out).all())
    err = float((out - ref).norm() / ref.norm()) if finite else float("inf")
    tol = validation.tolerance(key)
    return {"rel_error": err, "tolerance": tol, "passed": finite and err <= tol}


def check_refusals(registries) -> list[dict]:
    """implicit_gemm and tma_ws_conv refuse channel counts that are not multiples of 8 (implicit_gemm's cutlass.align
    4 kernels: 4; its generic kernel, cutlass.align 1, runs them), tma_ws_conv refuses groups > 1: each kernel's
    verdict is its family's model (refusal()); nothing is launched."""
    results = []
    for reg in registries:
        for kern in kernels_of(reg):
            pipeline = kern.key.algorithm.pipeline
            if pipeline not in ("implicit_gemm", "tma_ws_conv"):
                continue
            sig = kern.key.signature
            cases = [(1 if pipeline == "tma_ws_conv" else 2, 12, 16, "must be multiples of")]
            if pipeline == "tma_ws_conv":
                cases.append((2, 64, 64, "groups = 1"))
            for g, c, k, want in cases:
                p = conv.ConvProblem(sig.direction, 1, g, c, k, (9,) * sig.spatial_dims, (3,) * sig.spatial_dims, 1,
                                     1, 1, 1, sig.dtype_a, sig.dtype_a, sig.dtype_a)
                status, reason = kern.library.can_run(conv.make_args(p, kern.key))
                if backends.family_of(kern.key).module.refusal(p, kern.key) is None:
                    ok = status == abi.OK
                else:
                    ok = status == abi.UNSUPPORTED and want in reason
                results.append({"kernel": kern.name, "refusal": True, "passed": ok, "reason": reason})
                if not ok:
                    print(f"FAIL refusal {kern.name}: {status} {reason}")
    return results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--json")
    ap.add_argument("--only", help="a regular expression: the per-kernel checks take only the kernels it matches")
    args = ap.parse_args()
    global ONLY
    ONLY = args.only
    registries = [load(b) for b in args.bundles]
    rng = np.random.default_rng(2026)
    t0 = time.time()
    results = check_kernels(registries, {}, rng)
    results += check_splits(registries, rng)
    results += check_selection(registries)
    results += check_pointwise(registries)
    results += check_fused_selection(registries)
    results += check_refusals(registries)
    failed = [r for r in results if not r["passed"]]
    kernels = {r["kernel"] for r in results if "kernel" in r and not r.get("selection") and not r.get("refusal")}
    summary = {"kernels": len(kernels), "cases": len(results), "failed": len(failed), "seconds": round(time.time() - t0, 1)}
    print(f"conv validation: {summary}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "summary": summary, "results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
