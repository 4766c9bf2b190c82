"""cpu grouped convolution, pipeline direct (narrow groups, depthwise): the channels of all groups are the vector
lanes and each input halo is expanded once per block. tile m = pixels along the innermost spatial dim, n =
channel lanes over all groups, k = a chunk of reduction steps; mma = [pixels (fwd, bwd_data) or reduction outputs
(bwd_weight), lanes, 1]."""
from math import prod

from .. import common


def claims(key) -> bool:
    return key.signature.op == "conv" and key.algorithm.pipeline == "direct"


def templates(key) -> list[str]:
    return [f"conv_{key.signature.direction}_direct.cpp.j2", "_conv_common.j2",
            "_microkernel.j2"]


context = common.context



def gemm_view(problem, key) -> tuple[int, int, int, int]:
    """One GEMM with the channels of all groups as its columns (lanes), over every pixel of the image."""
    return problem.lanes_gemm(problem.n * prod(problem.out_size), problem.n * prod(problem.in_size))


def view_key(key) -> None:
    """gemm_view reads nothing of the key: every kernel of the family shares one view of a problem."""
    return None
