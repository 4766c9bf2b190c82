"""cutlass max pooling (pipeline window), the project's own CUDA: one thread per output pixel and mma n channels (a
16-byte access for fp16 at 8; 1 for any channel count or alignment), looping over the window's taps inside the input;
blocks of warps m x 32 threads, as many as the problem needs (a grid-stride loop past 2^31 - 1). tile [warps m x 32,
mma n, 1]. What the fields may be: rules.yaml next to this file."""
from tiledispatch import backends

from .. import common


def claims(key) -> bool:
    return key.signature.op == "maxpool"


def templates(key) -> list[str]:
    return ["maxpool.cu.j2"]


def context(key) -> dict:
    sig, alg = key.signature, key.algorithm
    return {"ctype": common.CONV_CTYPE[sig.dtype_a], "code": common.dtype(sig.dtype_a).code,
            "threads": alg.warps[0] * 32, "vec": alg.mma[1]}


def gemm_view(problem, key) -> tuple[int, int, int, int]:
    """The kernel's threads as m (an output pixel and mma n channels each), mma n as n, the window's taps as k."""
    vec = key.algorithm.mma[1]
    pixels, channels, taps, _ = problem.gemm_shape()
    return pixels * -(-channels // vec), vec, taps, 1


def view_key(key) -> int:
    """What gemm_view reads of the key."""
    return key.algorithm.mma[1]


def cost_factor(key) -> float:
    """A pooling kernel reuses nothing across threads, so the tile-intensity efficiency the analytic ranker divides
    by is undone. Narrower accesses are the fallback for channel counts or pointers not aligned to 16 bytes: x
    (16 / access bytes)^2, so a kernel of 16-byte accesses runs first wherever it runs (more threads and more
    instructions for the same bytes)."""
    access = key.algorithm.mma[1] * common.dtype(key.signature.dtype_a).itemsize
    return backends.tile_efficiency(key) * max(1.0, 16 / access) ** 2
