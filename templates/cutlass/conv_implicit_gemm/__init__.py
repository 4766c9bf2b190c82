"""cutlass grouped convolution, pipeline implicit_gemm (dense and wide groups, sm90a and sm80): a tensor-core
implicit GEMM per group (mma.sync m16n8k16, ldmatrix, cp.async multistage), its operands gathered from X / W / Y
per 16-byte chunk (no im2col buffer). tile [m, n, k] of the GEMM the direction performs (fwd: pixels x K/G x
taps*C/G; bwd_data: input pixels x C/G x taps*K/G; bwd_weight: K/G x taps*C/G x pixels, split over the pixels at
run time into an fp32 workspace); warps [m, n, 1]; C/G and K/G must be multiples of 8. Scheduler data_parallel,
split_k 1, cluster [1, 1, 1]."""
import math

from .. import common

DEFAULT_STAGES = 3
SPLIT_WAVES = 2  # bwd_weight splits its pixel reduction until its blocks fill this many waves (conv_igemm.cu.j2)


def claims(key) -> bool:
    return key.signature.op == "conv" and key.algorithm.pipeline == "implicit_gemm"


def templates(key) -> list[str]:
    return ["conv_igemm.cu.j2", "_conv_common.j2", "_mma_sync.j2"]


def context(key) -> dict:
    alg = key.algorithm
    return {**common.conv_context(key), "threads": alg.warps[0] * alg.warps[1] * 32,
            "stages": alg.stages or DEFAULT_STAGES, "mma_type": common.MMA_TYPE[key.signature.dtype_a], "rows": 0}


def runtime_split(key, output_tiles: int, k: int, units: int) -> int:
    """bwd_weight's reduction splits, as td_run chooses them: enough to fill SPLIT_WAVES waves of blocks, at most
    one per k tile, in equal whole k tiles."""
    if key.signature.direction != "bwd_weight":
        return 1
    ktiles = max(1, math.ceil(k / key.algorithm.tile[2]))
    want = min(max(1, math.ceil(SPLIT_WAVES * units / output_tiles)), ktiles)
    per = math.ceil(ktiles / want)
    return math.ceil(ktiles / per)


def smem_bytes(key) -> int:
    """Shared memory of the main loop's stages (rule cutlass.conv_igemm_smem): A and B tiles with rows and columns
    padded by 8 elements (16 bytes), in fp16 / bf16; stages 0 counts the default 3."""
    tm, tn, tk = key.algorithm.tile
    return (key.algorithm.stages or 3) * ((tm + 8) * (tk + 8) + (tn + 8) * (tk + 8)) * 2
