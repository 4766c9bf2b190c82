"""Validation on random data: inputs that are never zeros, outputs poisoned first, and a per-dtype
tolerance on ||out - ref|| / ||ref|| (the backend's facts, templates/<backend>/__init__.py)."""
from __future__ import annotations

from math import prod

import numpy as np

from . import backends
from .spec.dtypes import dtype, numpy_dtype
from .spec.key import KernelKey


def random_array(rng: np.random.Generator, shape, dtype_name: str, scale: float = 1.0) -> np.ndarray:
    """Uniform values with no exact zeros: scale * [-1, 1] for floats, [-8, 8] \\ {0} for integers."""
    if dtype(dtype_name).kind == "int":
        v = rng.integers(1, 9, size=shape) * rng.choice([-1, 1], size=shape)
        return v.astype(numpy_dtype(dtype_name))
    v = rng.uniform(0.05, 1.0, size=shape) * rng.choice([-scale, scale], size=shape)
    return v.astype(numpy_dtype(dtype_name))


def poison(a: np.ndarray) -> np.ndarray:
    """Fill with NaN (floats) or a sentinel (integers) so an unwritten element cannot pass."""
    a[...] = np.nan if dtype_kind(a) == "float" else np.iinfo(a.dtype).min
    return a


def dtype_kind(a: np.ndarray) -> str:
    return "int" if np.issubdtype(a.dtype, np.integer) else "float"


def tolerance(key: KernelKey) -> float:
    table = backends.get(key.backend).tolerance
    if key.signature.dtype_c not in table:
        raise ValueError(f"no validation tolerance for output {key.signature.dtype_c} in the {key.backend} rules")
    return float(table[key.signature.dtype_c])


def compare(out, ref: np.ndarray, key: KernelKey) -> dict:
    """rel_error = ||out - ref|| / ||ref|| (float64); NaN or an unwritten sentinel fails."""
    out64 = np.asarray(out).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    tol = tolerance(key)
    finite = bool(np.isfinite(out64).all())
    if dtype_kind(np.asarray(out)) == "int":
        finite = finite and not (np.asarray(out) == np.iinfo(np.asarray(out).dtype).min).any()
    denom = float(np.linalg.norm(ref)) or 1.0
    err = float(np.linalg.norm(out64 - ref) / denom) if finite else float("inf")
    return {"rel_error": err, "tolerance": tol, "all_written": finite, "passed": finite and err <= tol}


def operand(rng, rows: int, cols: int, batch: int, letter: str, dtype_name: str) -> np.ndarray:
    """A random [batch, rows, cols] array stored row-major (letter r or *) or column-major (c)."""
    if letter == "c":
        return np.swapaxes(random_array(rng, (batch, cols, rows), dtype_name), 1, 2)
    return random_array(rng, (batch, rows, cols), dtype_name)


def gemm_inputs(p, rng, with_c: bool = False) -> dict:
    """Random inputs for a GemmProblem in its layout, and a poisoned output."""
    return {
        "a": operand(rng, p.m, p.k, p.batch, p.layout[0], p.dtype_a),
        "b": operand(rng, p.k, p.n, p.batch, p.layout[1], p.dtype_b),
        "c": operand(rng, p.m, p.n, p.batch, "r", p.dtype_c) if with_c else None,
        "out": poison(operand(rng, p.m, p.n, p.batch, p.layout[2], p.dtype_c)),
        "bias": random_array(rng, (p.n,), p.dtype_c) if p.epilogue.bias else None,
        "residuals": tuple(random_array(rng, (p.batch, p.m, p.n), p.dtype_c) for _ in range(p.epilogue.residuals)),
    }


def conv_terms(p) -> int:
    """The most products summed into one output element: C/G x taps (fwd), K/G x taps (bwd_data),
    N x output pixels (bwd_weight)."""
    if p.direction == "fwd":
        return p.c // p.g * prod(p.filter_size)
    if p.direction == "bwd_data":
        return p.k // p.g * prod(p.filter_size)
    return p.n * prod(p.out_size)


def conv_inputs(p, rng) -> dict:
    """Random x, w, y for a ConvProblem, the written one poisoned. Float inputs are scaled down where a
    sum of conv_terms(p) products, all at their largest and of one sign, could pass 1/16 of the output
    dtype's largest value (fp16: 4094), so no output overflows whatever the problem's size."""
    import ml_dtypes  # finfo for bf16 and fp8 too

    from .ops.conv import WRITES

    shapes = p.shapes()
    dtypes = {"x": p.dtype_x, "w": p.dtype_w, "y": p.dtype_y}
    written = WRITES[p.direction]
    scale = 1.0
    if dtype(dtypes[written]).kind == "float":
        limit = float(ml_dtypes.finfo(numpy_dtype(dtypes[written])).max) / 16
        scale = min(1.0, (limit / conv_terms(p)) ** 0.5)  # per read operand: their product scales by scale**2
    data = {role: random_array(rng, shapes[role], dtypes[role], scale) for role in ("x", "w", "y") if role != written}
    data[written] = poison(np.empty(shapes[written], numpy_dtype(dtypes[written])))
    data.update(conv_epilogue_inputs(p, rng))
    return data


def conv_epilogue_inputs(p, rng) -> dict:
    """The fused forward epilogue's random operands: bias [G, K/G] and residuals shaped like Y (absent: nothing)."""
    epi = p.epilogue
    out = {}
    if epi.bias:
        out["bias"] = random_array(rng, (p.g, p.k // p.g), p.dtype_y)
    if epi.residuals:
        out["residuals"] = tuple(random_array(rng, p.shapes()["y"], p.dtype_y) for _ in range(epi.residuals))
    return out


# clamp bounds a validation uses for activation "clamp": inside the outputs' range, so both bounds bite
VALIDATION_CLAMP = (-0.25, 0.5)


def conv_reference(p, data: dict) -> np.ndarray:
    """The float64 result of the ConvProblem's direction on data's read tensors (reference.py)."""
    from . import reference

    geo = (p.stride, p.dilation, p.pad_lo, p.pad_hi)
    if p.direction == "fwd" and p.epilogue != type(p.epilogue)():
        return reference.conv_fwd_fused(data["x"], data["w"], *geo, bias=data.get("bias"),
                                        residuals=data.get("residuals", ()), activation=p.epilogue.activation,
                                        clamp=VALIDATION_CLAMP)
    if p.direction == "fwd":
        return reference.conv_fwd(data["x"], data["w"], *geo)
    if p.direction == "bwd_data":
        return reference.conv_bwd_data(data["y"], data["w"], p.in_size, *geo)
    return reference.conv_bwd_weight(data["x"], data["y"], p.filter_size, *geo)


def conv_case(p, rng) -> tuple[dict, np.ndarray]:
    """Random x, w, y for a ConvProblem (the written one poisoned), with a fused epilogue its bias and residuals, and
    the float64 reference result (activation clamp: VALIDATION_CLAMP)."""
    from .ops.conv import WRITES

    shapes = p.shapes()
    data = {role: random_array(rng, shapes[role], p.dtype_a if role == "x" else (p.dtype_b if role == "w" else p.dtype_c))
            for role in ("x", "w", "y")}
    data.update(conv_epilogue_inputs(p, rng))
    expect = conv_reference(p, data)
    poison(data[WRITES[p.direction]])
    return data, expect


def layernorm_case(p, rng, eps: float = 1e-5, affine: bool = True) -> tuple[dict, np.ndarray]:
    """Random x (rows offset from zero and of different spreads, so both statistics matter), weight and bias for a
    LayerNormProblem, a poisoned out, and the float64 reference result."""
    from . import reference

    x = random_array(rng, (p.rows, p.cols), "fp64") * rng.uniform(0.5, 4.0, size=(p.rows, 1)) \
        + rng.uniform(-3.0, 3.0, size=(p.rows, 1))
    data = {"x": x.astype(numpy_dtype(p.dtype_x)),
            "weight": random_array(rng, (p.cols,), p.dtype_w, 2.0) if affine else None,
            "bias": random_array(rng, (p.cols,), p.dtype_w) if affine else None,
            "out": poison(np.empty((p.rows, p.cols), dtype=numpy_dtype(p.dtype_y)))}
    return data, reference.layer_norm(data["x"], data["weight"], data["bias"], eps)


def maxpool_case(p, rng, nan: bool = False) -> tuple[dict, np.ndarray]:
    """Random x for a MaxPoolProblem in its own rank ([N, spatial..., C]), a poisoned out, and the float64 reference
    (with nan: a few NaN inputs, which must come out as NaN where a window holds one)."""
    from . import reference

    dims = slice(3 - p.rank, 3)
    x = random_array(rng, (p.n, *p.in_size[dims], p.c), p.dtype, 4.0)
    if nan and dtype(p.dtype).kind == "float":
        x.reshape(-1)[rng.integers(0, x.size, size=max(1, x.size // 500))] = np.nan
    out = poison(np.empty((p.n, *p.out_size[dims], p.c), dtype=numpy_dtype(p.dtype)))
    expect = reference.max_pool(x, p.window[dims], p.stride[dims], p.dilation[dims], p.padding[dims],
                                p.out_size[dims])
    return {"x": x, "out": out}, expect
