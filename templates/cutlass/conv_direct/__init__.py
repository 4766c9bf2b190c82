"""cutlass grouped convolution, pipelines direct and direct_mma (narrow groups and depthwise), the project's own
CUDA: a block owns tile_m output pixels along the innermost spatial dim x tile_k rows along the next one (1 plane
in 3D) x tile_n channel lanes over all groups; the block's input halo is copied once into shared memory (16-byte
cp.async) and reused by every filter tap. direct sums the taps on CUDA cores, direct_mma on tensor cores (mma.sync
over block-diagonal weights). bwd_weight blocks loop over many pixel tiles, reduce in shared memory and add into
an fp32 workspace, then a second kernel applies alpha / beta. What the fields and the extras cpg / kpg / fx / fy /
rows / occupancy mean: templates/cutlass/rules.yaml (rules cutlass.conv_direct_*)."""
import math

from .. import common


def claims(key) -> bool:
    return key.signature.op == "conv" and key.algorithm.pipeline in ("direct", "direct_mma")


def templates(key) -> list[str]:
    sig, alg = key.signature, key.algorithm
    if alg.pipeline == "direct":
        main = "conv_direct_bwd_weight.cu.j2" if sig.direction == "bwd_weight" else "conv_direct.cu.j2"
        return [main, "_conv_common.j2", "_conv_direct.j2"]
    if sig.direction == "bwd_weight":
        return ["conv_direct_bwd_weight.cu.j2", "_conv_common.j2", "_conv_direct.j2", "_conv_direct_wgrad_mma.j2",
                "_mma_sync.j2"]
    return ["conv_direct.cu.j2", "_conv_common.j2", "_conv_direct.j2", "_conv_direct_mma.j2", "_mma_sync.j2"]


def context(key) -> dict:
    sig, alg = key.signature, key.algorithm
    # lanes per group (LG) and reduction channels per group (RG), 0 = read at run time
    cpg, kpg = common.extra(key, "cpg"), common.extra(key, "kpg")
    lg, rg = (cpg, kpg) if sig.direction == "bwd_data" else (kpg, cpg)
    return {
        **common.conv_context(key),
        "threads": alg.warps[0] * alg.warps[1] * 32, "lg": lg, "rg": rg,
        # compile-time filter width / height (cutlass.fx / cutlass.fy), 0 = read at run time
        "fx": common.extra(key, "fx"), "fy": common.extra(key, "fy"),
        "tc": alg.pipeline == "direct_mma", "mma_type": common.MMA_TYPE.get(sig.dtype_a),
        "rows": common.extra(key, "rows"),
        # bwd_weight's register window: pixels along W a thread takes at a time (the largest of 4, 2, 1 dividing
        # the tile width tile[0])
        "pxw": next(n for n in (4, 2, 1) if alg.tile[0] % n == 0),
    }


def cost_factor(key) -> float:
    """How the analytic ranker orders this family's kernels against kernels of the same tile shape that can run
    the same problem (factors multiply):
    - the generic direct kernel (channels per group read at run time, scalar shared-memory reads) is the fallback:
      x4, below the specialized and tensor-core kernels;
    - a direct kernel compiled for the problem's filter size keeps its input window in registers: 1.2-2x faster
      than the run-time-filter kernels on depthwise 3x3 / 7x7 and C/G = 4 (bench/results/conv_run5,
      conv_run7_explore): x0.5 (other filter sizes are refused by its td_can_run);
    - direct_mma on C/G = K/G >= 4 took 0.89-0.92x the CUDA-core kernel's time on ResNeXt C/G = 4 (conv_run19)
      while the tile model rates its narrower tiles ~2.6x costlier: x0.3, first where it runs; bwd_weight on tensor
      cores took 0.51-0.87x the CUDA-core kernels' time (conv_run26_wgrad_mma): x0.3; depthwise fwd / bwd_data
      (an eighth of each mma useful) took 1.3x: x2, after the CUDA-core kernels."""
    alg, direction = key.algorithm, key.signature.direction
    cpg, fx = common.extra(key, "cpg"), common.extra(key, "fx")
    factors = []
    if alg.pipeline == "direct" and cpg == 0:
        factors.append(4.0)
    if alg.pipeline == "direct" and fx > 0:
        factors.append(0.5)
    if few_channel(key):
        factors.append(FEW_CHANNEL_FACTOR)
    elif alg.pipeline == "direct_mma" and (cpg >= 4 or direction == "bwd_weight"):
        factors.append(0.3)
    elif alg.pipeline == "direct_mma" and cpg < 4 and direction != "bwd_weight":
        factors.append(2.0)
    return math.prod(factors)


# The few-channel form (RGB stems) against the kernels that also run those problems: the implicit GEMMs, rated x8
# (generic) or x1.1 after padding C to 4; the tile model sees the stem's thin reduction (27-147 deep) as cheap on
# every one of them, so the factor places the kernel built for the stem first.
FEW_CHANNEL_FACTOR = 0.1


def few_channel(key) -> bool:
    """direct_mma's few-channel form: C/G (cpg) <= 8 input channels and more output channels per group (kpg, or 0:
    read at run time)."""
    cpg, kpg = common.extra(key, "cpg"), common.extra(key, "kpg")
    return key.algorithm.pipeline == "direct_mma" and cpg != kpg


def problem_factor(problem, key) -> float:
    """x2 for a fwd kernel whose shared memory on this problem (problem_smem_bytes: a halo plane and the weights)
    leaves one block per SM, unless it is compiled for one (cutlass.occupancy 1): its persistent block then waits
    for each halo copy with no other block to run meanwhile. Wide tiles at stride 2 (a 28- or 32-wide tile's halo is
    57-65 pixels wide) took 1.3-4x the time of narrower ones on the suite's depthwise layers, where the tile model
    alone ranks them first (bench/results/depthwise_h200)."""
    if key.signature.direction != "fwd":
        return 1.0
    cpg = common.extra(key, "cpg")
    if (cpg and problem.c // problem.g != cpg) or common.extra(key, "occupancy") == 1:
        return 1.0  # a kernel specialized for other groups refuses the problem: its rank does not matter
    need = problem_smem_bytes(problem, key)
    return 2.0 if need and common.arch(key)["smem_bytes"] // need < 2 else 1.0


def factor_key(key) -> tuple:
    """What problem_factor reads of the key: its direction, pipeline and tile, the groups it is specialized for, its
    compiled occupancy and arch (through problem_smem_bytes, which also reads the bwd_weight rows option)."""
    return (key.signature.direction, key.algorithm.pipeline, key.algorithm.tile, common.extra(key, "cpg"),
            common.extra(key, "occupancy"), common.extra(key, "rows"), key.arch)


def gemm_view(problem, key) -> tuple[int, int, int, int]:
    """One GEMM with the channels of all groups as its columns (lanes), over the pixels the blocks compute: tile[0]
    pixels along W by tile[2] rows along H, so rows and columns round up to whole tiles (a 56-wide row in 32-wide
    tiles computes 64 pixels; in 28-wide ones, 56)."""
    tw, th = key.algorithm.tile[0], key.algorithm.tile[2]

    def pixels(sizes) -> int:
        padded = list(sizes)
        padded[-1] = -(-padded[-1] // tw) * tw
        if len(padded) > 1:
            padded[-2] = -(-padded[-2] // th) * th
        return problem.n * math.prod(padded)

    return problem.lanes_gemm(pixels(problem.out_size), pixels(problem.in_size))


def view_key(key) -> tuple[int, int]:
    """What gemm_view reads of the key: the tile's width along W and its rows along H."""
    return key.algorithm.tile[0], key.algorithm.tile[2]


def problem_smem_bytes(problem, key) -> int:
    """Shared memory a 2D fwd / bwd_weight block takes on a problem: one input halo plane (fp16) with the block's
    weights (fwd: fp32; direct_mma: fp16 mma B fragments, 16 x 8 per pair of 8-channel taps and 8 lanes, halo
    pixels padded to an odd number of 16-byte pieces) or its dY tile (fp16) and sums (fp32) (bwd_weight). A large
    filter with stride and dilation 2 can outgrow the arch's limit (the kernel refuses the problem; selection takes
    the next kernel). 0 for the problems whose footprint does not depend on the problem's geometry."""
    alg = key.algorithm
    if not (problem.spatial_dims == 2 and problem.direction in ("fwd", "bwd_weight")):
        return 0
    (tw, lanes, th), (fy, fx) = alg.tile, problem.filter_size
    (sy, sx), (dy, dx) = problem.stride, problem.dilation
    pixels = ((th - 1) * sy + (fy - 1) * dy + 1) * ((tw - 1) * sx + (fx - 1) * dx + 1)
    if alg.pipeline == "direct_mma":
        cpg, pitch = common.extra(key, "cpg"), mma_halo_pitch(key)
        if problem.direction == "bwd_weight":  # the halo, the dY tile (the same padded pitch) and the sums
            need = (pixels + th * tw) * pitch * 2 + fy * fx * cpg * lanes * 4
            if common.extra(key, "rows"):  # their transposed copies
                need += (pixels + 8 * th + th * tw + 8) * lanes * 2
        else:
            ksteps = -(-(fy * fx * max(1, cpg // 8)) // 2)
            need = max(pixels * pitch, th * tw * stage_pitch(key)) * 2 + ksteps * lanes // 8 * 256
    elif problem.direction == "fwd":
        need = pixels * lanes * 2 + fy * fx * lanes * 4
    else:
        cg, kg = problem.c // problem.g, problem.k // problem.g
        channels = max(1, lanes // kg) * cg  # the halo's channels: the groups of the block's lanes
        need = pixels * channels * 2 + th * tw * lanes * 2 + fy * fx * cg * lanes * 4
    return need


def refusal(problem, key):
    """Why the kernel's td_can_run refuses the problem (dense channels-last operands), None when it runs it: the
    checks of its plan() (conv_direct.cu.j2, conv_direct_bwd_weight.cu.j2) in Python: the specialization (cpg /
    kpg, fx / fy), direct_mma's unit-stride bwd_data, and whether the smallest shared-memory arrangement (one halo
    plane, one buffer) fits next to the weights or sums. direct_mma's weight fragments are approximated by the
    problem_smem_bytes model."""
    sig, alg = key.signature, key.algorithm
    s, itemsize = problem.spatial_dims, common.dtype(sig.dtype_a).itemsize
    vec = 16 // itemsize
    cg, kg = problem.c // problem.g, problem.k // problem.g
    cpg, kpg, fx, fy = (common.extra(key, n) for n in ("cpg", "kpg", "fx", "fy"))
    tc, wgrad, bwd = alg.pipeline == "direct_mma", sig.direction == "bwd_weight", sig.direction == "bwd_data"
    pad3 = lambda t, one=1: (one,) * (3 - s) + tuple(t)  # noqa: E731  (D, H, W), missing dims of size 1
    f, st, dil = pad3(problem.filter_size), pad3(problem.stride), pad3(problem.dilation)
    if cpg and (cg != cpg or (kpg and kg != kpg)):
        return f"specialized for C/G = {cpg} and K/G = {kpg}; the problem has C/G = {cg} and K/G = {kg}"
    if few_channel(key) and problem.g > 1 and kg % alg.tile[1]:
        return f"direct_mma's few-channel form needs a block's {alg.tile[1]} lanes inside one group"
    if fx and (f[2] != fx or f[1] != (fy or 1)):
        return f"compiled for a {fy or 1} x {fx} filter; the problem's is {f[1]} x {f[2]}"
    if tc and bwd and any(v != 1 for v in st):
        return "direct_mma bwd_data runs unit stride only"
    if common.extra(key, "rows") and (st[2] != 1 or (fx - 1) * dil[2] > 8):
        return "the depthwise row form needs unit stride along W and (fx - 1) x dilation <= 8"
    tw, bn, th = alg.tile
    lg, rg = (cg, kg) if bwd else (kg, cg)
    lanes, threads, limit = problem.g * lg, alg.warps[0] * alg.warps[1] * 32, common.arch(key)["smem_bytes"]
    lg_ct, rg_ct = (cpg, kpg) if bwd else (kpg, cpg)
    ngb_ct = 0 if not lg_ct else (bn // lg_ct if bn % lg_ct == 0 else (1 if lg_ct % bn == 0 else 0))
    cbs_ct = -(-(ngb_ct * rg_ct) // vec) * vec if ngb_ct else 0
    if cbs_ct:
        cbs = cbs_ct
    else:
        ngb = min(bn // lg if bn % lg == 0 else (1 if lg % bn == 0 else bn // lg + 2), problem.g)
        cbs = -(-(ngb * rg) // vec) * vec
    pitch = (cbs if cbs % (2 * vec) else cbs + vec) if tc else cbs
    tile = (1, th, tw)
    if bwd:
        ext = [((tile[e] - 1) + (f[e] - 1) * dil[e] + st[e] - 1) // st[e] + 1 for e in range(3)]
    else:
        ext = [(tile[e] - 1) * st[e] + (f[e] - 1) * dil[e] + 1 for e in range(3)]
    taps = math.prod(f)
    if wgrad:
        dpitch = (bn if bn % (2 * vec) else bn + vec) if tc else bn
        extra = taps * rg * bn * 4
        fixed = _round16(th * tw * dpitch * itemsize)
    else:
        extra = f[0] * -(-(f[1] * f[2] * max(1, cpg // 8)) // 2) * (bn // 8) * 256 if tc else taps * rg * bn * 4
        fixed = 0

    stage = th * tw * stage_pitch(key) * itemsize if tc and not wgrad else 0

    def bytes_(hd):
        return _round16(max(hd * ext[1] * ext[2] * pitch * itemsize, stage)) + fixed

    blocks = 1 if common.extra(key, "occupancy") == 1 else 2
    chosen = None
    for plane in ((1,) if tc and wgrad else (0, 1)):
        b = bytes_(1 if plane else ext[0])
        for nbuf in (2, 1):
            if chosen is None and nbuf * b + extra <= (limit // blocks if nbuf == 2 else limit):
                chosen = f[0] if plane else 1  # zchunks
    if chosen is None:
        return (f"a halo plane ({ext[1]} x {ext[2]} pixels x {cbs} channels) and {'the sums' if wgrad else 'the weights'}"
                f" need {bytes_(1) + extra} bytes of shared memory, more than the {limit} of {key.arch}")
    if -(-lanes // bn) > 65535:
        return "too many lane blocks"
    if wgrad and not tc:
        nfx = -(-f[2] // alg.mma[0])
        items = (bn // alg.mma[1]) * (1 if chosen > 1 else f[0]) * f[1] * nfx * (1 if rg_ct else rg)
        if items > threads and rg_ct:
            return f"{items} work items exceed the block's {threads} threads"
        if items > 64 * threads:
            return f"{items} work items exceed 64 passes of the block's {threads} threads"
    return None


def mma_halo_pitch(key) -> int:
    """Elements per halo pixel of a direct_mma kernel (PITCH_CT): its channels (8 in the few-channel form, else the
    block's lanes or one group's channels, in 8s), padded to an odd number of 16-byte pieces."""
    bn, cpg = key.algorithm.tile[1], common.extra(key, "cpg")
    cbs = 8 if few_channel(key) else -(-(bn if bn % cpg == 0 else cpg) // 8) * 8
    return cbs + 8 if cbs % 16 == 0 else cbs


def stage_pitch(key) -> int:
    """Elements per pixel of direct_mma fwd / bwd_data's output tile staged in a halo buffer (STAGE_PITCH): the
    halo pitch, which holds the lanes in the grouped form; the lanes, an odd number of 16-byte pieces, in the
    few-channel form, whose halo pitch is 8."""
    bn = key.algorithm.tile[1]
    if few_channel(key):
        return bn if bn // 8 % 2 else bn + 8
    return mma_halo_pitch(key)


def _round16(n: int) -> int:
    return -(-n // 16) * 16
