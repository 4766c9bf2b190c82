"""The cutlass conv kernels' fused forward epilogues without a GPU (tests/kernels/conv_emulation.py: the rendered CUDA
compiled by g++ against tests/emulate/td_emulate.h): implicit_gemm (its vector and generic stores), direct (vector
and scalar lanes) and direct_mma (the staged store; the pair stores where beta != 0) with every activation, bias and
one or two residuals on random data, outputs poisoned, against the float64 reference; a residual with its own
strides; the fused ABI's refusals. bench/validation/validate_conv_gpu.py runs the same kernels on the GPU."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

import conv_emulation as ce
from tiledispatch import abi, validation
from tiledispatch.ops import conv
from tiledispatch.spec.key import ACTIVATIONS, Epilogue

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("g++") is None or ce.cuda_include() is None,
                                                     reason="g++ or the CUDA headers (cuda_fp16.h) missing")]


def igemm(epi, dtype="fp16", extras=()):
    return ce.conv_key("fwd", 2, "implicit_gemm", (32, 32, 32), (16, 8, 16), (2, 1, 1), dtype, stages=3,
                       extras=extras, epilogue=epi)


def direct(epi, vl=4, cpg=0, kpg=0, dtype="fp16"):
    return ce.conv_key("fwd", 2, "direct", (8, 16, 4), (4, vl, 1), (2, 1, 1), dtype, cpg, kpg, epilogue=epi)


def direct_mma(epi, dtype="fp16"):
    return ce.conv_key("fwd", 2, "direct_mma", (8, 16, 4), (16, 8, 16), (2, 1, 1), dtype, 4, 4, fx=3, fy=3,
                       epilogue=epi)


# (key, kinds, filter size or None): every activation with bias + residual on implicit_gemm, the rest spread over
# the pipelines and their store paths (vector / generic, specialized / runtime channels)
CASES = [(igemm(Epilogue(a, True, 1)), ("dense", "g16"), None) for a in ACTIVATIONS]
CASES += [
    (igemm(Epilogue("relu", True, 2), "bf16"), ("dense", "g16"), None),
    (igemm(Epilogue("clamp", True, 0), extras=(("cutlass.align", 1),)), ("odd", "dense"), None),  # generic stores
    (direct(Epilogue("relu", True, 1)), ("g4", "odd"), None),
    (direct(Epilogue("clamp", True, 0), vl=8, cpg=1, kpg=1, dtype="bf16"), ("depthwise",), None),
    (direct(Epilogue("silu", False, 2), vl=8, cpg=1, kpg=1), ("depthwise",), None),
    (direct_mma(Epilogue("relu", True, 1)), ("g4", "g4x3"), 3),
    (direct_mma(Epilogue("gelu_tanh", True, 0), "bf16"), ("g4",), 3),
    # the few-channel form (a stem: folded batch norm + relu / hard-swish)
    (ce.conv_key("fwd", 2, "direct_mma", (8, 16, 4), (16, 8, 16), (2, 1, 1), "fp16", 3, 0, fx=3, fy=3,
                 epilogue=Epilogue("relu", True, 0)), ("c3k16",), 3),
    (ce.conv_key("fwd", 2, "direct_mma", (8, 16, 4), (16, 8, 16), (1, 2, 1), "fp16", 3, 0, fx=3, fy=3,
                 epilogue=Epilogue("hardswish", True, 1)), ("c3k40",), 3),
]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("emulated_epilogue")


def sizes(f):
    return None if f is None else (2, (2 * f + 5, 2 * f + 8), (f, f))


def fused_case(rng, key, kind, geometry, f=None):
    n, in_size, filt = sizes(f) or ce.SIZES[2]
    g, cg, kg = ce.KINDS[kind]
    stride, dilation, pad_lo, pad_hi = (v[-2:] for v in ce.GEOMETRIES[geometry])
    sig = key.signature
    p = conv.ConvProblem("fwd", n, g, g * cg, g * kg, in_size, filt, stride, dilation, pad_lo, pad_hi,
                         sig.dtype_a, sig.dtype_a, sig.dtype_a, epilogue=sig.epilogue)
    return (p, *validation.conv_case(p, rng))


@pytest.mark.parametrize("key,kinds,f", CASES, ids=lambda v: v.name[:60] if hasattr(v, "name") else None)
def test_fused_epilogue_matches_reference(tmp, key, kinds, f):
    lib = ce.build(key, tmp)
    failures = []
    for i, (kind, geo) in enumerate((k, g) for k in kinds for g in ("s1d1", "s2d1", "s1d2")):
        p, data, expect = fused_case(np.random.default_rng(i), key, kind, geo, f)
        status, reason, out = ce.run(lib, key, p, data)
        res = validation.compare(out, expect, key) if status == abi.OK else {"passed": False, "reason": reason}
        if not res["passed"]:
            failures.append(f"{kind} {geo}: {res}")
    assert not failures, "\n".join(failures)


FEW_CHANNEL_RESIDUAL = ce.conv_key("fwd", 2, "direct_mma", (8, 16, 4), (16, 8, 16), (2, 1, 1), "fp16", 3, 0, fx=3,
                                   fy=3, epilogue=Epilogue("relu", True, 1))


GENERIC_RESIDUAL = igemm(Epilogue("relu", True, 1), extras=(("cutlass.align", 1),))


@pytest.mark.parametrize("key,kind,f", [(GENERIC_RESIDUAL, "dense", None), (FEW_CHANNEL_RESIDUAL, "c3k16", 3)],
                         ids=("implicit_gemm", "direct_mma"))
def test_alpha_beta_and_strided_residual(tmp, key, kind, f):
    """beta * old Y next to the bias and a residual that is a channel slice of a wider tensor (its own strides)."""
    lib = ce.build(key, tmp)
    rng = np.random.default_rng(11)
    p, data, _ = fused_case(rng, key, kind, "s2d1", f)
    old = validation.random_array(rng, data["y"].shape, "fp16")
    data["y"][...] = old
    wide = np.zeros(data["y"].shape[:-1] + (24,), np.float16)
    wide[..., 3:19] = data["residuals"][0]
    data["residuals"] = (wide[..., 3:19],)
    from tiledispatch import reference

    want = reference.conv_fwd_fused(data["x"], data["w"], p.stride, p.dilation, p.pad_lo, p.pad_hi, y=old,
                                    bias=data["bias"], residuals=data["residuals"], alpha=0.75, beta=-0.5,
                                    activation="relu")
    status, reason, out = ce.run(lib, key, p, data, alpha=0.75, beta=-0.5)
    assert status == abi.OK, reason
    assert validation.compare(out, want, key)["passed"]


def test_fused_abi_refusals(tmp):
    key = igemm(Epilogue("relu", True, 1))
    lib = ce.build(key, tmp)
    p, data, _ = fused_case(np.random.default_rng(1), key, "dense", "s1d1")
    _, ops = conv.operands("fwd", data["x"], data["w"], data["y"], stride=p.stride, dilation=p.dilation,
                           pad_lo=p.pad_lo, pad_hi=p.pad_hi, bias=data["bias"], residuals=data["residuals"],
                           activation="relu")
    args = conv.make_args(p, key, ops)
    assert lib.can_run(args)[0] == abi.OK
    args.num_tensors = 3
    status, why = lib.can_run(args)
    assert status == abi.INVALID_ARGUMENT and "expected 5 tensors (X, W, Y, bias, 1 residuals)" in why
    args = conv.make_args(p, key, ops)
    args.tensors[3].data = None
    assert lib.can_run(args) == (abi.INVALID_ARGUMENT, "bias is missing (NULL data)")
    args = conv.make_args(p, key, ops)
    args.tensors[4].shape[1] += 1
    status, why = lib.can_run(args)
    assert status == abi.INVALID_ARGUMENT and "residual 0 has shape" in why
    args = conv.make_args(p, key, ops)
    args.scalars[2], args.scalars[3] = 1.0, -1.0  # the runtime refuses this before the kernel; the kernel too
    status, why = lib.can_run(args)
    assert status == abi.INVALID_ARGUMENT and "clamp needs low <= high" in why
