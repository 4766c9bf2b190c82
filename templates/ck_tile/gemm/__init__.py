"""ck_tile GEMM: CK Tile's universal GEMM kernel (GemmPipelineAgBgCr{Mem,CompV3,CompV4}), a block tile [m, n, k]
of waves [m, n, k] each computing MFMA warp tiles (mma), the default or CShuffle epilogue, optionally persistent."""
from .. import common


def claims(key) -> bool:
    return key.signature.op == "gemm"


def templates(key) -> list[str]:
    return ["gemm.hip.j2", "_common.j2", "_pipeline.j2"]


context = common.context
