"""ck_tile grouped convolution: CK Tile's implicit-GEMM grouped convolution kernels, one per direction:
  fwd         m = N x output pixels, n = K/G, k = C/G x filter taps      (A = X, B = W, C = Y)
  bwd_data    m = N x input pixels,  n = C/G, k = K/G x filter taps      (A = dY, B = W, C = dX)
  bwd_weight  m = K/G, n = C/G x filter taps, k = N x output pixels     (A = dY, B = X, C = dW)
on the GEMM families' pipelines; extras vector_a / _b / _c set the vector accesses of A / B / C."""
from .. import common


def claims(key) -> bool:
    return key.signature.op == "conv"


def templates(key) -> list[str]:
    return ["conv.hip.j2", "_common.j2", "_pipeline.j2"]


context = common.context
