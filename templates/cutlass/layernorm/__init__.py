"""cutlass LayerNorm over rows, the project's own CUDA (no CUDA library call): a team of mma m threads (a power of two
up to a warp) owns one row and reduces with warp shuffles; each access reads mma n elements (16 bytes for fp16 at
8). pipeline rows holds the row in registers (at most tile n columns: the row is read once and written once);
rows_loop reads it three times (mean, centered variance, store), any length. tile [rows per block = warps m x 32 /
mma m, tile n, 1]. What the fields may be: rules.yaml next to this file."""
from tiledispatch import backends

from .. import common


def claims(key) -> bool:
    return key.signature.op == "layernorm"


def templates(key) -> list[str]:
    return ["layernorm.cu.j2"]


def context(key) -> dict:
    sig, alg = key.signature, key.algorithm
    return {
        "ctype": {role: common.CONV_CTYPE[getattr(sig, f"dtype_{role}")] for role in ("a", "b", "c")},
        "code": {role: common.dtype(getattr(sig, f"dtype_{role}")).code for role in ("a", "b", "c")},
        "threads": alg.warps[0] * 32,
        "loop": alg.pipeline == "rows_loop",
    }


def cost_factor(key) -> float:
    """A row kernel reuses nothing, so the tile-intensity efficiency the analytic ranker divides by is undone here:
    its cost is the padded elements of its blocks in waves, the narrowest kernel that holds the row first. rows_loop
    reads the row three times: x2, after a register kernel that holds the row. Accesses narrower than 16 bytes take
    proportionally more instructions for the same bytes: x 16 / access bytes (the one-element kernels are the
    fallback for rows not aligned to 16 bytes)."""
    access = key.algorithm.mma[1] * common.dtype(key.signature.dtype_a).itemsize
    return (backends.tile_efficiency(key) * (2.0 if key.algorithm.pipeline == "rows_loop" else 1.0)
            * max(1.0, 16 / access))


def gemm_view(problem, key) -> tuple[int, int, int, int]:
    """rows: blocks of tile m rows, each row across one tile of n columns; rows_loop: the same blocks, stepping
    along the row tile n columns at a time (the steps counted as the reduction's)."""
    if key.algorithm.pipeline == "rows_loop":
        step = key.algorithm.tile[1]
        return problem.rows, step, -(-problem.cols // step), 1
    return problem.gemm_shape()


def view_key(key):
    """What gemm_view reads of the key."""
    return key.algorithm.pipeline, key.algorithm.tile[1] if key.algorithm.pipeline == "rows_loop" else None
