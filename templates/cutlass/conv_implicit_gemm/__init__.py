"""cutlass grouped convolution, pipeline implicit_gemm (dense and wide groups, sm90a and sm80): a tensor-core
implicit GEMM per group (mma.sync m16n8k16, ldmatrix, cp.async multistage), its operands gathered from X / W / Y
per 16-byte chunk (no im2col buffer). tile [m, n, k] of the GEMM the direction performs (fwd: pixels x K/G x
taps*C/G; bwd_data: input pixels x C/G x taps*K/G; bwd_weight: K/G x taps*C/G x pixels, split over the pixels at
run time into an fp32 workspace); warps [m, n, 1]; C/G and K/G must be multiples of 8. Scheduler data_parallel,
split_k 1, cluster [1, 1, 1].

Extra cutlass.align 1: the generic kernel (DESIGN.md invariant 10): any channel count, pointer and stride. The
reduction's channels per group are padded to chunks of 8 (zeros past the group's end), chunks are loaded element by
element (no cp.async) and outputs stored element by element; the ranker puts it last (cost_factor).
Extra cutlass.align 4: chunks of 4 channels (8-byte cp.async), for C/G and K/G multiples of 4: a 3-channel stem
zero-padded to 4 (tiledispatch.torch's channel padding) reduces over half the taps x channels of one padded to 8.

A strided bwd_data (every kernel of the family) walks the input pixels phase by phase (stride phases): a tile inside
one phase skips the taps that reach none of its pixels (3 of 4 at stride 2 in 2D, 4 of 5 at stride 5 in 1D; all of
them in the phases a 1x1 filter never reaches, whose tiles only write alpha * 0 + beta * old)."""
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
            "stages": alg.stages or DEFAULT_STAGES, "mma_type": common.MMA_TYPE[key.signature.dtype_a], "rows": 0,
            "generic": generic(key), "vector": vector(key), "min_blocks": min_blocks(key)}


def generic(key) -> bool:
    """The any-channel-count kernel (cutlass.align 1)."""
    return common.extra(key, "align") == 1


def vector(key) -> int:
    """Channels per chunk the kernel moves: 4 for cutlass.align 4 (8-byte copies), else 8 (16 bytes; the generic
    kernel's chunks of 8 are loaded element by element)."""
    return 4 if common.extra(key, "align") == 4 else 8


def cost_factor(key) -> float:
    """The generic kernel is the fallback for what no other kernel runs: synchronous element-wise loads, the
    reduction padded to chunks of 8 channels: x8, after every other conv kernel of the set. 8-byte chunks (align 4)
    take twice the copies of 16-byte ones: x1.1, after the 16-byte kernel wherever both run (measured on the H200,
    bench/results/channel_padding_align4_h200: C = 12 as it is 0.029 ms, padded to 16 0.044 with the copy; the
    ResNet-50 stem padded to 4 0.184, to 8 0.228). In bwd_weight x1.5: there the 8-byte kernel ran the ResNet-50 and
    R3D-18 stems' dW (padded to 4 channels) 1.27x and 1.42x slower than the 16-byte kernel ran them on their
    space-to-depth copies (0.247 against 0.194 ms, 0.659 against 0.465), where the tile model with x1.1 rated the
    8-byte route 0.82x and 1.02x as costly (bench/results/space_to_depth_h200). The learned models' splits on log2_cost_factor place 1.1 and 1.5 alike."""
    if generic(key):
        return 8.0
    if vector(key) == 4:
        return 1.5 if key.signature.direction == "bwd_weight" else 1.1
    return 1.0


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
    """Shared memory of the main loop's stages as conv_igemm.cu.j2 lays them out (rule cutlass.conv_igemm_smem): per
    stage an A and a B tile of fp16 / bf16, each stored with its global rows contiguous and those rows padded by 8
    elements (16 bytes): A [m][k] (fwd, bwd_data) or [k][m] (bwd_weight), B [n][k] (fwd) or [k][n]."""
    tm, tn, tk = key.algorithm.tile
    direction = key.signature.direction
    a = tm * (tk + 8) if direction != "bwd_weight" else tk * (tm + 8)
    b = tn * (tk + 8) if direction == "fwd" else tk * (tn + 8)
    return (key.algorithm.stages or DEFAULT_STAGES) * (a + b) * 2


def min_blocks(key) -> int:
    """The blocks per SM the kernel's __launch_bounds__ asks registers for (conv_igemm.cu.j2 says why): where the
    warp tile holds at most 64x32 accumulators, as many as 128 registers a thread allow (2 blocks of 8 warps, 4 of
    4) and their shared memory fits, when that is 2 or more; else none is asked (1), the compiler's own choice. The
    cutlass.align 4 / 1 kernels ask none: they spilled 76-392 bytes a thread at 128 registers (nvcc 13.0, sm90a)."""
    if generic(key) or vector(key) == 4:
        return 1
    alg = key.algorithm
    threads = alg.warps[0] * alg.warps[1] * 32
    warp_tile = alg.tile[0] // alg.warps[0] * (alg.tile[1] // alg.warps[1])
    fit = common.arch(key)["sm_smem_bytes"] // (smem_bytes(key) + 1024)  # 1 KiB reserved per block
    blocks = min(65536 // (threads * 128), fit)
    return blocks if warp_tile <= 64 * 32 and blocks >= 2 else 1


def refusal(problem, key):
    """Why the kernel's td_can_run refuses the problem (dense channels-last operands), None when it runs it:
    conv_igemm.cu.j2's check_chunks (8-channel chunks) and its 32-bit GEMM and tile-count bounds."""
    cg, kg = problem.c // problem.g, problem.k // problem.g
    if generic(key):  # the reduction walks C/G (fwd, bwd_weight) or K/G (bwd_data) in whole chunks of 8
        cg, kg = -(-cg // 8) * 8, -(-kg // 8) * 8
    elif cg % vector(key) or kg % vector(key):
        return (f"implicit_gemm moves {vector(key)} channels at a time: C/G ({cg}) and K/G ({kg}) must be multiples "
                f"of {vector(key)}")
    m, n, k, _ = problem.gemm_shape()
    taps = math.prod(problem.filter_size)
    if problem.direction == "fwd":
        k = taps * cg
    elif problem.direction == "bwd_data":
        k = taps * kg
    else:
        n = taps * cg
    if max(m, n, k) >= 2 ** 31 - 1:
        return f"GEMM {m} x {n} x {k} exceeds 32-bit indexing"
    tm, tn, _ = key.algorithm.tile
    if math.ceil(n / tn) > 65535 or math.ceil(m / tm) * problem.g >= 2 ** 31 - 1:
        return "too many tiles"
    return None
