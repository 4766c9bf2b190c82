"""The float64 conv references, checked independently of themselves: forward against a direct loop
over every output element (tiny sizes), backward data and backward weight against forward through the
adjoint identity <conv(x, w), dy> = <x, bwd_data(dy, w)> = <w, bwd_weight(x, dy)>."""
import itertools

import numpy as np
import pytest

from tiledispatch import reference as ref

# (G, C/G, K/G): dense, grouped with C/G in {4, 16, 64}, depthwise
KINDS = {"dense": (1, 3, 5), "g4": (3, 4, 2), "g16": (2, 16, 3), "g64": (2, 64, 2), "depthwise": (4, 1, 1)}
# (stride, dilation, pad_lo, pad_hi) per dim: every combination of stride 1/2 and dilation 1/2, asymmetric pads
GEOMETRIES = {
    "s1d1": ((1, 1, 1), (1, 1, 1), (1, 0, 2), (0, 2, 1)),
    "s2d1": ((2, 2, 1), (1, 1, 1), (0, 1, 1), (2, 0, 0)),
    "s1d2": ((1, 1, 2), (2, 2, 1), (2, 1, 0), (1, 0, 3)),
    "s2d2": ((2, 1, 2), (2, 2, 2), (1, 2, 0), (0, 1, 2)),
}
IN_SIZES = (7, 6, 5)
FILTERS = (3, 2, 3)


def direct_fwd(x, w, stride, dilation, pad_lo, pad_hi):
    """One dot product per output element: the definition, written as plainly as possible."""
    rank = x.ndim - 3
    n, in_sp, g = x.shape[0], x.shape[1:-2], x.shape[-2]
    kg, filt = w.shape[1], w.shape[2:-1]
    out = [(in_sp[d] + pad_lo[d] + pad_hi[d] - dilation[d] * (filt[d] - 1) - 1) // stride[d] + 1 for d in range(rank)]
    y = np.zeros((n, *out, g, kg))
    for b, o, gi, k in itertools.product(range(n), itertools.product(*map(range, out)), range(g), range(kg)):
        acc = 0.0
        for t in itertools.product(*map(range, filt)):
            i = [o[d] * stride[d] + t[d] * dilation[d] - pad_lo[d] for d in range(rank)]
            if all(0 <= i[d] < in_sp[d] for d in range(rank)):
                acc += float(np.dot(x[(b, *i, gi)], w[(gi, k, *t)]))
        y[(b, *o, gi, k)] = acc
    return y


def problem(rng, rank, kind, geometry):
    g, cg, kg = KINDS[kind]
    stride, dilation, pad_lo, pad_hi = (v[:rank] for v in GEOMETRIES[geometry])
    x = rng.standard_normal((2, *IN_SIZES[:rank], g, cg))
    w = rng.standard_normal((g, kg, *FILTERS[:rank], cg))
    return x, w, (stride, dilation, pad_lo, pad_hi)


CASES = list(itertools.product((1, 2, 3), KINDS, GEOMETRIES))


@pytest.mark.parametrize("rank,kind,geometry", CASES)
def test_fwd_matches_direct_loop(rank, kind, geometry):
    rng = np.random.default_rng(rank * 100 + len(kind))
    x, w, geo = problem(rng, rank, kind, geometry)
    np.testing.assert_allclose(ref.conv_fwd(x, w, *geo), direct_fwd(x, w, *geo), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rank,kind,geometry", CASES)
def test_backward_is_the_adjoint_of_forward(rank, kind, geometry):
    rng = np.random.default_rng(rank * 10 + len(geometry))
    x, w, geo = problem(rng, rank, kind, geometry)
    y = ref.conv_fwd(x, w, *geo)
    dy = rng.standard_normal(y.shape)
    dx = ref.conv_bwd_data(dy, w, x.shape[1:-2], *geo)
    dw = ref.conv_bwd_weight(x, dy, w.shape[2:-1], *geo)
    assert dx.shape == x.shape and dw.shape == w.shape
    forward = np.vdot(y, dy)
    scale = np.linalg.norm(y) * np.linalg.norm(dy)
    assert abs(np.vdot(x, dx) - forward) <= 1e-12 * scale
    assert abs(np.vdot(w, dw) - forward) <= 1e-12 * scale


def test_input_pixels_no_output_reads_get_zero_gradient():
    """Stride 3 with a 1-tap filter skips input pixels: their gradient is exactly 0, and the pixels
    cut off by a short pad_hi too."""
    x = np.ones((1, 8, 1, 1))
    w = np.ones((1, 1, 1, 1))
    dy = np.ones((1, 3, 1, 1))
    dx = ref.conv_bwd_data(dy, w, (8,), (3,), (1,), (0,), (0,))
    assert ref.conv_fwd(x, w, (3,), (1,), (0,), (0,)).shape == dy.shape
    assert dx[0, :, 0, 0].tolist() == [1, 0, 0, 1, 0, 0, 1, 0]


@pytest.mark.parametrize("call,match", [
    (lambda: ref.conv_fwd(np.ones((1, 5, 2, 3)), np.ones((2, 1, 3, 4)), (1,), (1,), (0,), (0,)), "channels per group"),
    (lambda: ref.conv_fwd(np.ones((1, 5, 1, 3)), np.ones((1, 1, 3, 3)), (1, 1), (1,), (0,), (0,)), "stride has 2"),
    (lambda: ref.conv_fwd(np.ones((1, 5, 1, 3)), np.ones((1, 1, 3, 3)), (1,), (1,), (-1,), (0,)), "pad_lo must be >= 0"),
    (lambda: ref.conv_fwd(np.ones((1, 5, 1, 3)), np.ones((1, 1, 3, 3)), (0,), (1,), (0,), (0,)), "stride must be >= 1"),
    (lambda: ref.conv_fwd(np.ones((1, 2, 1, 3)), np.ones((1, 1, 3, 3)), (1,), (1,), (0,), (0,)), "smaller than"),
    (lambda: ref.conv_bwd_data(np.ones((1, 4, 1, 1)), np.ones((1, 1, 3, 1)), (5,), (1,), (1,), (0,), (0,)),
     "spatial sizes"),
])
def test_reference_rejects_inconsistent_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
