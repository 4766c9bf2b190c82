"""cutlass conv kernels without a GPU: each template rendered, compiled by g++ against tests/kernels/emulate/td_emulate.h
(GPU threads as OS threads) and run through the C ABI against the float64 reference, every direction and
rank, small tiles so that problems span several blocks, partial lane blocks and partial GEMM tiles. This
checks the kernels' index arithmetic and host checks; bench/validation/validate_conv_gpu.py checks them on the GPU.
Skipped without g++ or the CUDA headers (cuda_fp16.h)."""
from __future__ import annotations

import shutil

import pytest

import conv_emulation as ce
from tiledispatch import abi, backends
from tiledispatch.ops import conv

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("g++") is None or ce.cuda_include() is None,
                                                     reason="g++ or the CUDA headers (cuda_fp16.h) missing")]

DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")
DIRECT_TILE = {1: (32, 16, 1), 2: (8, 16, 4), 3: (8, 16, 2)}


def direct(direction, rank, vl=4, cpg=0, kpg=0, dtype="fp16", fx=0, fy=0, tile=None, mm=None):
    mm = mm or (2 if direction == "bwd_weight" else 4)
    return ce.conv_key(direction, rank, "direct", tile or DIRECT_TILE[rank], (mm, vl, 1), (2, 1, 1), dtype, cpg, kpg,
                       fx=fx, fy=fy)


def igemm(direction, rank, dtype="fp16", extras=()):
    return ce.conv_key(direction, rank, "implicit_gemm", (32, 32, 32), (16, 8, 16), (2, 1, 1), dtype, stages=3,
                       extras=extras)


ALIGN4 = (("cutlass.align", 4),)  # chunks of 4 channels (8-byte copies)


# (key, kinds, geometries): every direction and rank, both pipelines, the specializations and the generic path
CASES = []
for d in DIRECTIONS:
    for r in (1, 2, 3):
        geos = ("s1d1", "s2d2") if r != 2 else tuple(ce.GEOMETRIES)
        CASES.append((direct(d, r), ("g4", "odd"), geos))
        CASES.append((direct(d, r, vl=8, cpg=1, kpg=1, dtype="bf16" if r == 2 else "fp16"), ("depthwise",), geos))
        CASES.append((igemm(d, r, dtype="bf16" if r == 3 else "fp16"), ("dense", "g16"), geos))
        CASES.append((igemm(d, r, dtype="bf16" if r == 1 else "fp16", extras=ALIGN4), ("c4", "g4", "dense"), geos))
    CASES.append((direct(d, 2, cpg=4, kpg=4), ("g4",), ("s1d1", "s2d1")))


# compile-time filter (cutlass.fx / cutlass.fy): the register window along W (fwd: stride 1 / dilation 1, stride 1 /
# dilation 2, stride 2 / dilation 1; bwd_data: unit stride, dilation 1 or 2) and the unrolled per-tap loop of the
# other geometries, with asymmetric padding; (key, kind, filter size, geometries)
def _filter_sizes(rank, f):
    return {1: (2, (4 * f + 9,), (f,)), 2: (2, (2 * f + 5, 2 * f + 8), (f, f)), 3: (1, (5, 2 * f + 3, 2 * f + 4), (3, f, f))}[rank]


ALL_2D = tuple(ce.GEOMETRIES) + tuple(ce.MIXED_GEOMETRIES)
FILTER_CASES = []
for d in ("fwd", "bwd_data"):
    FILTER_CASES += [
        (direct(d, 2, cpg=1, kpg=1, fx=3, fy=3), "depthwise", 3, ALL_2D),
        # two pixel groups per thread (PPT 2), 8 lanes per thread, bf16
        (direct(d, 2, vl=8, cpg=1, kpg=1, fx=7, fy=7, tile=(16, 32, 8), dtype="bf16"), "depthwise", 7, ALL_2D),
        (direct(d, 2, cpg=4, kpg=4, fx=3, fy=3), "g4", 3, ALL_2D),
        (direct(d, 2, cpg=1, kpg=2, fx=3, fy=3), "multiplier", 3, ("s1d1", "s2d1", "s1d2")),
        (direct(d, 2, cpg=1, kpg=1, fx=5, fy=3, mm=8), "depthwise", (3, 5), ("s1d1", "s2d2", "sh2dw2", "sw2dh2")),
        # 7 pixels per thread (the shipped 28-wide tiles for 56-wide maps), rows of two pixel groups
        (direct(d, 2, cpg=1, kpg=1, fx=3, fy=3, tile=(14, 16, 4), mm=7), "depthwise", 3, ALL_2D),
        # the small-map tiles: one 7-pixel group per row, 7 rows, 2 lanes per thread, a square 5x5 filter
        (direct(d, 2, vl=2, cpg=1, kpg=1, fx=5, fy=5, tile=(7, 16, 7), mm=7), "depthwise", 5, ALL_2D),
        # the narrow-lane tiles (16 and 32 lanes for depthwise layers with few channels): 2 lanes per thread,
        # 8-pixel groups; 32 lanes: 16 lane vectors, so 4 pixel slots a block, most lanes past the 9 channels
        (direct(d, 2, vl=2, cpg=1, kpg=1, fx=3, fy=3, tile=(16, 16, 4), mm=8), "depthwise", 3, ALL_2D),
        (direct(d, 2, vl=2, cpg=1, kpg=1, fx=5, fy=5, tile=(16, 32, 2), mm=8), "depthwise", 5,
         ("s1d1", "s2d1", "sh2dw2")),
        (direct(d, 1, vl=8, cpg=1, kpg=1, fx=4), "depthwise", 4, tuple(ce.GEOMETRIES)),
        (direct(d, 3, cpg=1, kpg=1, fx=3, fy=3), "depthwise", 3, ("s1d1", "s2d1", "s1d2")),
    ]
# bwd_weight: the register window (PXW pixels along W x mma[0] taps; stride / dilation along W (1, 1), (1, 2),
# (2, 1)) and the unrolled per-pixel loop of (2, 2); PXW 4 (tile width 8 / 12 / 16), 2 (width 6) and 1 (width 9)
FILTER_CASES += [
    (direct("bwd_weight", 2, cpg=1, kpg=1, fx=3, fy=3, mm=3), "depthwise", 3, ALL_2D),
    (direct("bwd_weight", 2, vl=8, cpg=1, kpg=1, fx=7, fy=7, mm=7, tile=(16, 32, 8), dtype="bf16"), "depthwise", 7,
     ALL_2D),
    (direct("bwd_weight", 2, cpg=4, kpg=4, fx=3, fy=3, mm=3, tile=(12, 16, 4)), "g4", 3, ALL_2D),
    (direct("bwd_weight", 2, cpg=1, kpg=1, fx=3, fy=3, mm=3, tile=(6, 16, 4)), "depthwise", 3,
     ("s1d1", "s2d1", "s1d2", "sw2dh2")),
    (direct("bwd_weight", 2, cpg=1, kpg=1, fx=3, fy=3, mm=1, tile=(9, 16, 4)), "depthwise", 3, ("s1d1", "s2d1")),
    (direct("bwd_weight", 2, cpg=1, kpg=2, fx=3, fy=3, mm=3), "multiplier", 3, ("s1d1", "s2d1", "s1d2")),
    (direct("bwd_weight", 2, cpg=1, kpg=1, fx=6, fy=3, mm=3), "depthwise", (3, 6), ("s1d1", "s2d2", "sh2dw2")),
    (direct("bwd_weight", 1, vl=8, cpg=1, kpg=1, fx=4), "depthwise", 4, tuple(ce.GEOMETRIES)),
    (direct("bwd_weight", 3, cpg=1, kpg=1, fx=3, fy=3, mm=3), "depthwise", 3, ("s1d1", "s2d1", "s1d2")),
]



def mma(direction, rank, cpg, f, tile, warps, dtype="fp16", extras=()):
    fx, fy = (f, 0) if rank == 1 else (f, f)
    return ce.conv_key(direction, rank, "direct_mma", tile, (16, 8, 16), warps, dtype, cpg, cpg, fx=fx, fy=fy,
                       extras=extras)


# direct_mma (tensor cores over block-diagonal weights): each group width's k items (C/G <= 8: a chunk's own
# channels; C/G >= 8: 8-channel blocks of its group), warps along pixels and along lanes, warp tiles of several m16
# blocks and n8 chunks, m16 blocks spanning tile rows (tile width 8 / 12 / 28), partial lane blocks (12 lanes in a
# 16-lane block, no 16-byte rows), an odd k item count (3 x 3 taps); bwd_data at unit stride only
UNIT = ("s1d1", "s1d2")
MMA_CASES = []
for d in ("fwd", "bwd_data"):
    geos = ALL_2D if d == "fwd" else UNIT
    MMA_CASES += [
        (mma(d, 2, 4, 3, (8, 16, 4), (2, 1, 1)), ("g4", "g4x3"), 3, geos),
        (mma(d, 2, 1, 3, (12, 16, 4), (1, 2, 1), "bf16"), ("depthwise",), 3, geos),
        (mma(d, 2, 2, 3, (28, 8, 4), (7, 1, 1)), ("g2",), 3, UNIT + ("s2d1",)),
        (mma(d, 2, 8, 3, (8, 16, 4), (2, 1, 1)), ("g8",), 3, UNIT + ("s2d2",)),
        (mma(d, 2, 16, 3, (16, 32, 2), (1, 2, 1)), ("g16",), 3, UNIT + ("s2d1",)),
        (mma(d, 2, 32, 3, (8, 16, 4), (2, 1, 1)), ("g32",), 3, ("s1d1",)),
        (mma(d, 1, 1, 4, (32, 16, 1), (2, 1, 1)), ("depthwise",), 4, geos if d == "bwd_data" else tuple(ce.GEOMETRIES)),
        (mma(d, 3, 4, 3, (8, 16, 2), (1, 2, 1)), ("g4",), 3, UNIT + ("s2d2",)),
    ]
# bwd_weight: warps per 8-lane chunk splitting the 16-pixel blocks (1, 2), blocks spanning tile rows (widths 8,
# 12, 28), an odd tap count (the last tap paired with itself), 25 tap pairs (7 x 7), partial lane blocks (g4x3:
# 12 lanes of 16), every geometry (the A rows are gathered per pixel); 3D one depth tap per sweep; tap pairs
# split over warps (7 x 7: 13 + 12 pairs; 3 x 3 in three groups: 2 + 2 + 1, with slices and several chunks)
MMA_CASES += [
    (mma("bwd_weight", 2, 1, 3, (8, 16, 4), (2, 1, 1)), ("depthwise",), 3, ALL_2D),
    (mma("bwd_weight", 2, 1, 7, (16, 16, 2), (2, 2, 1)), ("depthwise",), 7, ("s1d1", "s2d1")),
    (mma("bwd_weight", 2, 4, 3, (8, 16, 4), (4, 3, 1)), ("g4", "g4x3"), 3, ("s1d1", "s2d2")),
    (mma("bwd_weight", 3, 1, 3, (8, 16, 2), (2, 2, 1)), ("depthwise",), 3, ("s1d1", "s2d1")),
    (mma("bwd_weight", 2, 4, 3, (12, 16, 4), (4, 1, 1), "bf16"), ("g4", "g4x3"), 3, ALL_2D),
    (mma("bwd_weight", 2, 2, 3, (28, 8, 4), (2, 1, 1)), ("g2",), 3, ("s1d1", "s2d1", "s1d2")),
    (mma("bwd_weight", 2, 8, 3, (8, 16, 4), (2, 1, 1)), ("g8",), 3, ("s1d1", "s2d2")),
    (mma("bwd_weight", 2, 1, 7, (16, 16, 2), (2, 1, 1)), ("depthwise",), 7, ("s1d1", "s2d1")),
    (mma("bwd_weight", 1, 1, 4, (32, 16, 1), (2, 1, 1)), ("depthwise",), 4, tuple(ce.GEOMETRIES)),
    (mma("bwd_weight", 3, 4, 3, (8, 16, 2), (2, 1, 1)), ("g4",), 3, ("s1d1", "s2d2")),
]
# the few-channel form (fwd, C/G <= 8 < K/G: RGB stems): 3 channels (the halo's own copy, zero-padded to 8), a
# full 16-byte pixel (C = 8: the cp.async copy), 1 channel in 1D (raw audio); 3x3 and 7x7 filters; K/G at run time
# (kpg 0: one partial lane block, K = 40 in 16-lane blocks, two groups of 32) and compile time; warps along pixels
# and lanes; the staged store (its pitch the lanes', not the halo's) where the output is packed
def few(rank, cpg, kpg, f, tile, warps, dtype="fp16"):
    fx, fy = (f, 0) if rank == 1 else (f, f)
    return ce.conv_key("fwd", rank, "direct_mma", tile, (16, 8, 16), warps, dtype, cpg, kpg, fx=fx, fy=fy)


MMA_CASES += [
    (few(2, 3, 0, 3, (8, 16, 4), (2, 1, 1)), ("c3k16", "c3k40", "g2c3k32"), 3, ALL_2D),
    (few(2, 3, 32, 7, (16, 16, 2), (1, 2, 1), "bf16"), ("c3k32",), 7, ("s1d1", "s2d1", "s2d2")),
    (few(2, 8, 0, 3, (8, 8, 4), (2, 1, 1)), ("c8k16",), 3, ("s1d1", "s2d1")),
    (few(1, 1, 0, 4, (32, 8, 1), (2, 1, 1)), ("c1k24",), 4, tuple(ce.GEOMETRIES)),
]
# the depthwise row form (cutlass.rows): 8-pixel groups along W, a full and a partial last k block (24 and 12
# groups), two and four channels per warp (partial lane blocks: 12 of 16), filter widths 3 / 7 / 4 (1D) with
# dilation along W, stride and dilation along H; geometries it refuses (stride 2 along W) are checked below
ROWS = (("cutlass.rows", 1),)
MMA_CASES += [
    (mma("bwd_weight", 2, 1, 3, (16, 16, 12), (8, 1, 1), extras=ROWS), ("depthwise",), 3, ("s1d1", "s1d2", "sh2dw2")),
    (mma("bwd_weight", 2, 1, 7, (24, 16, 4), (4, 1, 1), "bf16", ROWS), ("depthwise",), 7, ("s1d1",)),
    (mma("bwd_weight", 1, 1, 4, (64, 16, 1), (2, 1, 1), extras=ROWS), ("depthwise",), 4, ("s1d1", "s1d2")),
    (mma("bwd_weight", 3, 1, 3, (16, 16, 2), (4, 1, 1), extras=ROWS), ("depthwise",), 3, ("s1d1", "s1d2")),
]


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    return {}, tmp_path_factory.mktemp("emulated")


def built(libs, key, smem_limit=None):
    """The key's emulated library, compiled once per module (and per shared-memory limit)."""
    cache, tmp = libs
    name = f"{key.name}_{smem_limit}" if smem_limit else key.name
    if name not in cache:
        cache[name] = ce.build(key, tmp, smem_limit=smem_limit)
    return cache[name]


def assert_all_match(lib, key, cases, sizes=None):
    """Run the key's kernel on each (kind, geometry) case (seeded by its index) against the reference."""
    sig = key.signature
    failures = []
    for i, (kind, geo) in enumerate(cases):
        res = ce.check(lib, key, sig.direction, sig.spatial_dims, kind, geo, seed=i, sizes=sizes)
        if not res["passed"]:
            failures.append(f"{kind} {geo}: {res}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("key,kinds,geos", CASES, ids=lambda v: v.name[:44] if hasattr(v, "name") else None)
def test_matches_reference(libs, key, kinds, geos):
    lib = built(libs, key)
    assert_all_match(lib, key, [(k, g) for k in kinds for g in geos])


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_alpha_beta(libs, direction):
    import numpy as np

    from tiledispatch import validation

    key = direct(direction, 2)
    lib = built(libs, key)
    rng = np.random.default_rng(3)
    p, data, expect = ce.case(rng, direction, 2, "g4", "s2d1")
    written = conv.WRITES[direction]
    data[written][...] = validation.random_array(rng, data[written].shape, "fp16")
    old = data[written].astype(np.float64)
    status, reason, out = ce.run(lib, key, p, data, alpha=0.75, beta=-1.25)
    assert status == abi.OK, reason
    assert validation.compare(out, 0.75 * expect - 1.25 * old, key)["passed"]


@pytest.mark.parametrize("rank", (1, 2, 3))
def test_implicit_gemm_strided_bwd_data_by_phase(libs, rank):
    """A strided bwd_data walks the input pixels phase by phase: with a 1x1 filter, the phases no tap reaches run
    no k tile and write alpha * 0 + beta * old; a 3x3 filter at stride 3 leaves each phase one tap per dim. Sizes
    that the stride does not divide leave the last phases short (their padding rows are never written). The larger
    sizes give phases of several tiles (the tiles inside one phase take the per-tap offsets, the others the per-row
    division), with a dilation of 2 at stride 2 (taps of one parity reach no phase of the other)."""
    import numpy as np

    from tiledispatch import validation

    key = igemm("bwd_data", rank)
    lib = built(libs, key)
    rng = np.random.default_rng(11 + rank)
    small, large = {1: ((25,), (150,)), 2: ((9, 10), (16, 17)), 3: ((5, 6, 7), (6, 8, 9))}[rank]
    for in_size, f, stride, dilation in ((small, 1, 2, 1), (small, 3, 3, 1), (large, 3, 2, 1), (large, 3, 2, 2)):
        p = conv.ConvProblem("bwd_data", 2, 1, 24, 16, in_size, (f,) * rank, (stride,) * rank, (dilation,) * rank,
                             (0,) * rank, (f // 2 * dilation,) * rank, "fp16", "fp16", "fp16")
        data, expect = validation.conv_case(p, rng)
        data["x"][...] = validation.random_array(rng, data["x"].shape, "fp16")
        old = data["x"].astype(np.float64)
        status, reason, out = ce.run(lib, key, p, data, alpha=0.75, beta=-1.25)
        assert status == abi.OK, reason
        assert validation.compare(out, 0.75 * expect - 1.25 * old, key)["passed"], (in_size, f, stride, dilation)


def test_refusals(libs):
    """Specialized and implicit-GEMM kernels refuse what they cannot run, with a reason; nothing runs."""
    spec = direct("fwd", 2, cpg=4, kpg=4)
    lib = built(libs, spec)
    p = conv.ConvProblem("fwd", 1, 2, 6, 8, (9, 9), (3, 3), 1, 1, 1, 1, "fp16", "fp16", "fp16")
    status, reason = lib.can_run(conv.make_args(p, spec))
    assert status == abi.UNSUPPORTED and "specialized for C/G = 4" in reason
    ig = igemm("fwd", 2)
    lib = built(libs, ig)
    status, reason = lib.can_run(conv.make_args(p, ig))
    assert status == abi.UNSUPPORTED and "multiples of 8" in reason
    assert lib.workspace_bytes(conv.make_args(p, ig)) == 0
    ig4 = igemm("fwd", 2, extras=ALIGN4)
    lib = built(libs, ig4)
    status, reason = lib.can_run(conv.make_args(p, ig4))  # C/G = 3
    assert status == abi.UNSUPPORTED and "multiples of 4" in reason
    wg = igemm("bwd_weight", 2)
    lib = built(libs, wg)
    pw = conv.ConvProblem("bwd_weight", 1, 2, 16, 16, (9, 9), (3, 3), 1, 1, 1, 1, "fp16", "fp16", "fp16")
    args = conv.make_args(pw, wg)
    assert lib.workspace_bytes(args) >= 2 * 8 * 9 * 8 * 4
    status, reason = lib.run(args)  # no workspace given
    assert status == abi.INVALID_ARGUMENT and "workspace" in reason


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("smem_limit", (9000, 20000), ids=("one_plane", "one_buffer"))
def test_shared_memory_fallbacks(libs, direction, smem_limit):
    """3D halos that do not fit twice (one buffer) or at all (one depth plane at a time) still compute right."""
    key = direct(direction, 3)
    lib = built(libs, key, smem_limit=smem_limit)
    assert_all_match(lib, key, [(k, g) for k in ("g4", "depthwise") for g in ("s1d1", "s2d2", "s1d2")])


@pytest.mark.parametrize("key,kind,f,geos", FILTER_CASES, ids=lambda v: v.name[:40] + v.name[-24:]
                         if hasattr(v, "name") else None)
def test_compile_time_filter_matches_reference(libs, key, kind, f, geos):
    lib = built(libs, key)
    sig = key.signature
    fy, fx = f if isinstance(f, tuple) else (f, f)
    sizes = _filter_sizes(sig.spatial_dims, fx)
    sizes = (sizes[0], sizes[1], sizes[2][:-2] + (fy, fx)) if sig.spatial_dims > 1 else sizes
    assert_all_match(lib, key, [(kind, g) for g in geos], sizes)


@pytest.mark.parametrize("direction", ("fwd", "bwd_data", "bwd_weight"))
def test_compile_time_filter_one_plane(libs, direction):
    """3D halos taken one depth plane at a time (small shared memory) through the register window."""
    key = direct(direction, 3, cpg=1, kpg=1, fx=3, fy=3, mm=3 if direction == "bwd_weight" else None)
    lib = built(libs, key, smem_limit=9000)
    assert_all_match(lib, key, [("depthwise", g) for g in ("s1d1", "s2d2", "s1d2")], _filter_sizes(3, 3))


def test_compile_time_filter_refusals(libs):
    """A kernel compiled for one filter size refuses another, naming both (selection then takes another kernel)."""
    def prob(direction, size, filt, pad):
        return conv.ConvProblem(direction, 1, 8, 8, 8, size, filt, 1, 1, pad, pad, "fp16", "fp16", "fp16")

    # (kernel, a problem with another filter and the phrases its refusal names, a problem it runs)
    cases = [
        (direct("fwd", 2, cpg=1, kpg=1, fx=3, fy=3), prob("fwd", (9, 9), (5, 3), 1), ("3 x 3 filter", "filter is 5 x 3"),
         prob("fwd", (9, 9), (3, 3), 1)),
        (direct("bwd_data", 1, vl=8, cpg=1, kpg=1, fx=4), prob("bwd_data", (20,), (3,), 1),
         ("filter width 4", "has width 3"), None),
        (direct("bwd_weight", 2, cpg=1, kpg=1, fx=7, fy=7, mm=7), prob("bwd_weight", (12, 12), (3, 3), 1),
         ("7 x 7 filter", "filter is 3 x 3"), prob("bwd_weight", (12, 12), (7, 7), 3)),
    ]
    for key, other, phrases, same in cases:
        lib = built(libs, key)
        status, reason = lib.can_run(conv.make_args(other, key))
        assert status == abi.UNSUPPORTED and all(ph in reason for ph in phrases), (key.name, reason)
        if same is not None:
            assert lib.can_run(conv.make_args(same, key)) == (abi.OK, ""), key.name


@pytest.mark.parametrize("key,kinds,f,geos", MMA_CASES, ids=lambda v: v.name[:40] + v.name[-30:]
                         if hasattr(v, "name") else None)
def test_direct_mma_matches_reference(libs, key, kinds, f, geos):
    lib = built(libs, key)
    sig = key.signature
    geos = tuple(g for g in geos if sig.direction != "bwd_data" or g in UNIT)  # bwd_data: unit stride only
    assert_all_match(lib, key, [(k, g) for k in kinds for g in geos], _filter_sizes(sig.spatial_dims, f))


@pytest.mark.parametrize("direction", ("fwd", "bwd_data"))
def test_direct_mma_alpha_beta_one_plane(libs, direction):
    """alpha / beta on the 32-bit pair stores, and a 3D halo taken one depth plane at a time (small shared memory)."""
    import numpy as np

    from tiledispatch import validation

    key = mma(direction, 3, 4, 3, (8, 16, 2), (1, 2, 1))
    # s1d2 on a 3 x 3 x 3 filter: the whole halo (5 x 6 x 12 pixels x 24-element pitch, 17280 bytes) and the weight
    # fragments (3 planes x 2560) exceed 12000 bytes; one plane (3456) and the fragments fit in one buffer
    lib = built(libs, key, smem_limit=12000)
    rng = np.random.default_rng(5)
    p, data, expect = ce.case(rng, direction, 3, "g4", "s1d2", sizes=_filter_sizes(3, 3))
    written = conv.WRITES[direction]
    data[written][...] = validation.random_array(rng, data[written].shape, "fp16")
    old = data[written].astype(np.float64)
    status, reason, out = ce.run(lib, key, p, data, alpha=0.75, beta=-1.25)
    assert status == abi.OK, reason
    res = validation.compare(out, 0.75 * expect - 1.25 * old, key)
    assert res["passed"], res


def test_direct_mma_refusals(libs):
    """direct_mma refuses strided bwd_data, other group widths and other filters, saying why."""
    key = mma("bwd_data", 2, 4, 3, (8, 16, 4), (2, 1, 1))
    lib = built(libs, key)

    def prob(g, cg, stride, filt=(3, 3)):
        return conv.ConvProblem("bwd_data", 1, g, g * cg, g * cg, (9, 9), filt, stride, 1, 1, 1, "fp16", "fp16", "fp16")

    for problem, phrase in ((prob(4, 4, 2), "unit stride only"), (prob(2, 8, 1), "specialized for C/G = 4"),
                            (prob(4, 4, 1, (5, 5)), "3 x 3 filter")):
        status, reason = lib.can_run(conv.make_args(problem, key))
        assert status == abi.UNSUPPORTED and phrase in reason, reason
    assert lib.can_run(conv.make_args(prob(4, 4, 1), key)) == (abi.OK, "")


def test_direct_mma_few_channel_refusals(libs):
    """The few-channel form with K/G at run time refuses groups whose K/G splits a lane block, and other C/G."""
    key = few(2, 3, 0, 3, (8, 16, 4), (2, 1, 1))
    lib = built(libs, key)

    def prob(g, cg, kg):
        return conv.ConvProblem("fwd", 1, g, g * cg, g * kg, (9, 9), (3, 3), 2, 1, 1, 1, "fp16", "fp16", "fp16")

    for problem, phrase in ((prob(2, 3, 24), "inside one group"), (prob(1, 4, 16), "specialized for C/G = 3")):
        status, reason = lib.can_run(conv.make_args(problem, key))
        assert status == abi.UNSUPPORTED and phrase in reason, reason
        assert phrase in backends.family_of(key).module.refusal(problem, key)
    for problem in (prob(1, 3, 24), prob(2, 3, 32)):
        assert lib.can_run(conv.make_args(problem, key)) == (abi.OK, "")
        assert backends.family_of(key).module.refusal(problem, key) is None


def test_direct_mma_rows_refusals(libs):
    """The depthwise row form refuses a stride along W and taps past 16 columns ((fx - 1) x dilation > 8)."""
    key = mma("bwd_weight", 2, 1, 7, (24, 16, 4), (4, 1, 1), "bf16", ROWS)
    lib = built(libs, key)

    def prob(stride, dilation):
        return conv.ConvProblem("bwd_weight", 1, 16, 16, 16, (20, 20), (7, 7), stride, dilation, 3, 3, "bf16", "bf16",
                                "bf16")

    for problem in (prob((1, 2), (1, 1)), prob((1, 1), (1, 2))):
        status, reason = lib.can_run(conv.make_args(problem, key))
        assert status == abi.UNSUPPORTED and "row form" in reason and "along W" in reason, reason
    assert lib.can_run(conv.make_args(prob((2, 1), (2, 1)), key)) == (abi.OK, "")
