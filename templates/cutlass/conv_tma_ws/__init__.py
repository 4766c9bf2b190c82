"""cutlass dense convolution (groups = 1), pipeline tma_ws_conv, sm90a: CUTLASS 3.x's SM90 implicit-GEMM
convolution (TMA im2col loads, GMMA, one producer and one or two consumer warpgroups, TMA or direct-store
epilogue), D = alpha * conv + beta * D. warps [4, 1, 1] runs CUTLASS's kernel body, [8, 1, 1] ours
(conv_sm90_consumers.cuh). bwd_weight runs our own persistent kernel body on CUTLASS's collectives
(_conv_sm90_wgrad.j2): the pixel sum split into S k ranges writing fp32 partial dW into the workspace, summed into
dW with alpha / beta by a finalize kernel. S comes from a cost model the kernel applies at run time (choose_splits
in _conv_sm90_wgrad.j2) and the ranker here (partials_split), the same rule in the two languages;
tests/kernels/test_cutlass_conv_sm90.py checks they agree. Extra cutlass.occupancy: CTAs kept resident per SM."""
import math

from .. import common

# CUTLASS names per direction and rank
_ELEMENT = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}
_OP = {"fwd": "kFprop", "bwd_data": "kDgrad", "bwd_weight": "kWgrad"}
_ACT_LAYOUT = {1: "TensorNWC", 2: "TensorNHWC", 3: "TensorNDHWC"}   # activations, filters (K first) and dY
_WGRAD_OUT_LAYOUT = {1: "TensorKCS", 2: "TensorKCSR", 3: "TensorKCSRT"}  # dW seen as K x (C, filter...)
# bwd_weight's split cost model: the epilogue of one unit costs about this many k tiles of its main loop
EPILOGUE_KTILES = 2


def claims(key) -> bool:
    return key.signature.op == "conv" and key.algorithm.pipeline == "tma_ws_conv"


def templates(key) -> list[str]:
    wgrad = ["_conv_sm90_wgrad.j2"] if key.signature.direction == "bwd_weight" else []
    epilogue = ["_epilogue.j2"] if _fused(key) else []
    return ["conv_sm90.cu.j2", "_conv_common.j2"] + wgrad + epilogue


def _fused(key) -> bool:
    """Whether the key fuses an epilogue (fwd only): an epilogue tree on CUTLASS's collective epilogue
    (conv_sm90.cu.j2), the GEMM's functors (_epilogue.j2)."""
    epi = key.signature.epilogue
    return epi.activation != "identity" or epi.bias or epi.residuals > 0


def _consumers(key) -> int:
    """Consumer warpgroups of a tile: warps [4, 1, 1] one (CUTLASS's kernel body), [8, 1, 1] two (fwd / bwd_data:
    conv_sm90_consumers.cuh; bwd_weight: its split body)."""
    return key.algorithm.warps[0] // 4


def context(key) -> dict:
    """CUTLASS types of a key: the operator, layouts, tile and epilogue per direction and rank."""
    sig, alg = key.signature, key.algorithm
    wgrad = sig.direction == "bwd_weight"
    tm, tn, tk = alg.tile
    consumers = _consumers(key)
    arch = common.arch(key)
    return {
        **common.conv_context(key),
        "element": _ELEMENT[sig.dtype_a],
        "conv_op": "cutlass::conv::Operator::" + _OP[sig.direction],
        "act_layout": "cutlass::layout::" + _ACT_LAYOUT[sig.spatial_dims],
        "out_layout": "cutlass::layout::" + (_WGRAD_OUT_LAYOUT if wgrad else _ACT_LAYOUT)[sig.spatial_dims],
        # the K mode of the tile is a rank-1 tuple (CUTLASS tiles the hierarchical (C, S, R, T) mode with it);
        # so is bwd_weight's N mode, which is (C, S, R, T) there
        "tile_shape": f"cute::Shape<cute::_{tm}, {f'cute::Shape<cute::_{tn}>' if wgrad else f'cute::_{tn}'}, "
                      f"cute::Shape<cute::_{tk}>>",
        # dY / dW of bwd_weight are small next to its reduction; CUTLASS's own wgrad kernels store directly
        # two consumer warpgroups share each epilogue subtile (128 rows, both warpgroups' 64-row slices)
        "epilogue_schedule": "cutlass::epilogue::" + ("NoSmemWarpSpecialized" if wgrad else
                                                      "TmaWarpSpecializedCooperative" if consumers == 2 else
                                                      "TmaWarpSpecialized"),
        "consumers": consumers,
        "fused": _fused(key),
        "compute": "float",
        "int_out": False,
        "align": 16 // common.dtype(sig.dtype_a).itemsize,
        # bwd_weight writes fp32 partial dW per k range (the workspace) from our persistent kernel body
        # (wgrad_split), then finalize_splits sums and converts them into W
        "out_element": "ElementOut" if wgrad else "Element",
        "out_align": "OUT_ALIGN" if wgrad else "ALIGN",
        "occupancy": resident_ctas(key),
        "sm_smem_bytes": arch["sm_smem_bytes"],
        "compute_units": arch["compute_units"],
    } | ({"sm_flops_per_byte": arch["sm_flops_per_byte"], "epilogue_ktiles": EPILOGUE_KTILES} if wgrad else {})


def smem_bytes(key) -> int:
    """Shared memory of one CTA (rule cutlass.conv_sm90_smem, times the resident CTAs): the main-loop stages of A
    and B tiles (2 for auto) and the pipeline barriers; the epilogue's buffers share the same memory."""
    sig, alg = key.signature, key.algorithm
    tm, tn, tk = alg.tile
    return (alg.stages or 2) * (tm + tn) * tk * common.dtype(sig.dtype_a).itemsize + 2048


def resident_ctas(key) -> int:
    """CTAs per SM the kernel is compiled to keep resident (cutlass.occupancy, 0 = 1)."""
    return common.extra(key, "occupancy") or 1


def cost_factor(key) -> float:
    """CUTLASS's SM90 conv (TMA + GMMA) against the mma.sync implicit_gemm on the same tile: implicit_gemm reached
    0.14-0.63x cuDNN on dense layers (bench/results/conv_h100.md), GMMA kernels run at roughly 2-4x the mma.sync
    rate: x0.4, first wherever it can run (groups = 1). Two or three resident CTAs hide the non-persistent kernel's
    prologue and epilogue: 1.05-1.26x the same tile with one CTA on ResNet-50 56x56, the 3D and 1D layers
    (bench/results/conv_run8_explore): x0.9 more."""
    return math.prod([0.4] + ([0.9] if common.extra(key, "occupancy") > 1 else []))


def gemm_view(problem, key) -> tuple[int, int, int, int]:
    """CUTLASS's GEMM view, one per group: it tiles the channels of each filter tap separately (the (C, taps)
    mode is hierarchical), so a tap's channels pad up to the tile, e.g. C = 64 under a 128-wide bwd_weight tile is
    half waste."""
    cg, kg, taps = problem.c // problem.g, problem.k // problem.g, math.prod(problem.filter_size)
    _, tn, tk = key.algorithm.tile

    def per_tap(channels: int, t: int) -> int:
        return taps * -(-channels // t) * t

    if problem.direction == "fwd":
        return problem.n * math.prod(problem.out_size), kg, per_tap(cg, tk), problem.g
    if problem.direction == "bwd_data":
        return problem.n * math.prod(problem.in_size), cg, per_tap(kg, tk), problem.g
    return kg, per_tap(cg, tn), problem.n * math.prod(problem.out_size), problem.g


def view_key(key) -> tuple[int, int]:
    """What gemm_view reads of the key: the tile's n and k."""
    return key.algorithm.tile[1], key.algorithm.tile[2]


def partials_cost(problem, key):
    """bwd_weight: its persistent split-K cost in main-loop steps of one tile (conv_partials_split); None for the
    other directions (one CTA per tile: the ranker's tiles-in-waves model)."""
    if key.signature.direction != "bwd_weight":
        return None
    return conv_partials_split(problem, key)[3]


def conv_partials_split(problem, key) -> tuple[int, int, int, float]:
    """(S, output tiles, k tiles, cost) of a bwd_weight kernel on a conv problem: its tiles of the (K, taps x C)
    output, the k tiles of its pixel sum and one partial of (K rounded up to the tile) x taps x C."""
    m, n, k, _ = problem.gemm_shape(key)
    tm, tn, tk = key.algorithm.tile
    tiles, ktiles = math.ceil(m / tm) * math.ceil(n / tn), math.ceil(k / tk)
    partial = -(-m // tm) * tm * (problem.c // problem.g) * math.prod(problem.filter_size)
    s, cost = partials_split(key, tiles, ktiles, partial, EPILOGUE_KTILES)
    return s, tiles, ktiles, cost


def partials_split(key, tiles: int, ktiles: int, partial_elems: int, epilogue_ktiles: int) -> tuple[int, float]:
    """(S, cost) of the persistent split-K kernel writing S fp32 partials (the rule of choose_splits in
    _conv_sm90_wgrad.j2): S in [1, max(1, slots / tiles)] (one wave of units) minimizing (k tiles per unit +
    epilogue) + S x (one partial written and summed), in k tiles of one CTA's main loop; ties keep the fewer
    splits. The cost counts the waves of an unsplit kernel with more tiles than resident CTAs."""
    tm, tn, tk = key.algorithm.tile
    occupancy = resident_ctas(key)
    slots = common.arch(key)["compute_units"] * occupancy
    flops_per_byte = float(common.arch(key)["sm_flops_per_byte"])
    partial = 4.0 * partial_elems * flops_per_byte / (tm * tn * tk * occupancy)
    best, best_cost = 1, 0.0
    for s in range(1, max(1, min(ktiles, slots // tiles)) + 1):
        cost = (math.ceil(ktiles / s) + epilogue_ktiles) + s * partial
        if s == 1 or cost < best_cost:
            best, best_cost = s, cost
    waves = math.ceil(tiles * best / slots)
    return best, best_cost + (waves - 1) * (math.ceil(ktiles / best) + epilogue_ktiles)


def refusal(problem, key):
    """Why the kernel's td_can_run refuses the problem (dense channels-last operands), None when it runs it:
    conv_sm90.cu.j2's checks (groups, 16-byte channel rows, unit-stride bwd_data, the TMA im2col limits)."""
    s, align = problem.spatial_dims, 16 // common.dtype(key.signature.dtype_a).itemsize
    if problem.g != 1:
        return f"CUTLASS SM90 conv handles groups = 1 (got G = {problem.g})"
    if problem.c % align or problem.k % align:
        return f"tma_ws_conv moves channels in 16-byte TMA rows: C ({problem.c}) and K ({problem.k}) must be multiples of {align}"
    if problem.direction == "bwd_data" and any(v != 1 for v in problem.stride):
        return "CUTLASS SM90 bwd_data (dgrad) runs unit stride only"
    pad_limit = {1: 65536, 2: 256, 3: 16}[s]
    corner, offset = 1 << (16 // s - 1), (1 << (16 // s)) - 1
    out = problem.out_size
    for d in range(s):
        lo, hi, span = problem.pad_lo[d], problem.pad_hi[d], (problem.filter_size[d] - 1) * problem.dilation[d]
        if lo > pad_limit or hi > pad_limit:
            return f"TMA im2col pads at most {pad_limit} per side in {s}D"
        if span >= offset:
            return f"TMA im2col: dilated filter extent {span} must be below {offset} in {s}D"
        lower = lo - span if problem.direction == "bwd_data" else -lo
        upper = lo - span + problem.in_size[d] - out[d] if problem.direction == "bwd_data" else hi - span
        if not (-corner <= lower <= corner - 1 and -corner <= upper <= corner - 1):
            return f"TMA im2col box corners {lower} / {upper} outside [{-corner}, {corner - 1}] in {s}D"
    return None
