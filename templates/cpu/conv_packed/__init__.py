"""cpu grouped convolution, pipeline packed: an implicit GEMM per group whose operands are gathered from the
channels-last tensors straight into packed panels (no im2col buffer), on the GEMM's micro-kernel. tile / mma
mean what they mean for the GEMM the direction performs (ConvProblem.gemm_shape)."""
from .. import common


def claims(key) -> bool:
    return key.signature.op == "conv" and key.algorithm.pipeline == "packed"


def templates(key) -> list[str]:
    return [f"conv_{key.signature.direction}.cpp.j2", "_conv_common.j2",
            "_microkernel.j2"]


context = common.context
