"""cpu GEMM: packed A / B panels of the cache block (tile) and a register micro-kernel of the micro-tile (mma),
with the fused epilogue D = act(alpha * A@B + beta * C + bias + residuals)."""
from .. import common


def claims(key) -> bool:
    return key.signature.op == "gemm"


def templates(key) -> list[str]:
    return ["gemm.cpp.j2", "_microkernel.j2", "_epilogue.j2"]


context = common.context
