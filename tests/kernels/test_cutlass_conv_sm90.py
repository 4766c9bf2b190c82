"""cutlass tma_ws_conv (CUTLASS 3.x SM90 implicit-GEMM convolution, groups = 1) without nvcc or a GPU: legality
rules with their ids, the CUTLASS types each direction and rank renders, and the analytic ranker's choice
between it and the project's own kernels."""
from __future__ import annotations

import re
from dataclasses import replace

import pytest

from tiledispatch import backends
from tiledispatch.generator import codegen, kernelset
from tiledispatch.ops import conv
from tiledispatch.selection import analytic, estimated_cost
from tiledispatch.generator import rules
from tiledispatch.spec.key import Algorithm, Epilogue, KernelKey, Signature, parse_kernel_name

cutlass = backends.get("cutlass")


def templates(key) -> list[str]:
    return cutlass.family(key).templates(key)


def key(direction="fwd", rank=2, tile=(128, 128, 64), dtype="fp16", warps=(4, 1, 1), mma=None, cluster=(1, 1, 1),
        stages=0, arch="sm90a", scheduler="data_parallel", epi=Epilogue(), extras=()) -> KernelKey:
    mma = mma or (64, tile[1], 16)
    return KernelKey(Signature("conv", dtype, dtype, dtype, "fp32", "nhwgc", epi, direction, rank),
                     Algorithm(tile, "tma_ws_conv", warps, mma, scheduler, 1, cluster, stages, extras), "cutlass", arch)


def source(k) -> str:
    """The rendered source with the headers of ours it includes written in place (what the compiler reads)."""
    dirs = codegen.include_dirs(k)

    def expand(text: str, seen: set) -> str:
        out = []
        for line in text.splitlines(keepends=True):
            m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            path = next((d / m.group(1) for d in dirs if (d / m.group(1)).is_file()), None) if m else None
            if path is None:
                out.append(line)
            elif path not in seen:
                seen.add(path)
                out.append(expand(path.read_text(), seen))
        return "".join(out)
    return expand(codegen.render(k), set())


def broken(k) -> set[str]:
    return {v.rule for v in rules.check(k)}


LEGAL = [key(), key("bwd_data", 1, (128, 64, 64)), key("bwd_weight", 3, (64, 128, 64), "bf16"),
         key(tile=(64, 256, 64), cluster=(2, 1, 1)), key("fwd", 3, cluster=(1, 2, 1), stages=4),
         key("bwd_data", 2, cluster=(2, 2, 1), stages=6),
         key("fwd", 2, (128, 64, 64), stages=4, extras=(("cutlass.occupancy", 2),)),
         key("bwd_weight", 3, (64, 64, 64), stages=4, extras=(("cutlass.occupancy", 3),)),
         # two consumer warpgroups stacked along m
         key("fwd", 1, (128, 256, 64), warps=(8, 1, 1)), key("bwd_data", 2, (256, 128, 64), warps=(8, 1, 1), cluster=(1, 2, 1)),
         key("fwd", 3, (128, 128, 64), warps=(8, 1, 1), stages=4, extras=(("cutlass.occupancy", 1),)),
         key("bwd_weight", 1, (256, 128, 64), warps=(8, 1, 1))]


@pytest.mark.parametrize("k", LEGAL, ids=lambda k: k.name[:60])
def test_legal_keys_pass_and_round_trip(k):
    assert rules.check(k) == []
    assert parse_kernel_name(k.name) == k


@pytest.mark.parametrize("k, rule", [
    (key(arch="sm80"), "cutlass.conv_sm90_arch"),
    (key(dtype="fp32", tile=(128, 128, 32), mma=(64, 128, 8)), "cutlass.conv_sm90_dtype"),
    (key(warps=(2, 1, 1)), "cutlass.conv_sm90_shape"),
    (key(warps=(4, 2, 1)), "cutlass.conv_sm90_shape"),
    (key(mma=(64, 64, 16)), "cutlass.conv_sm90_shape"),
    (key(tile=(128, 256, 64)), "cutlass.conv_sm90_tile"),       # 256 accumulators per thread
    (key(tile=(256, 64, 64)), "cutlass.conv_sm90_tile"),
    (key(tile=(128, 96, 64)), "cutlass.conv_sm90_tile"),
    (key(tile=(128, 128, 32)), "cutlass.conv_sm90_tile"),
    (key(tile=(64, 128, 64), warps=(8, 1, 1)), "cutlass.conv_sm90_tile"),       # 32 rows a warpgroup
    (key(tile=(256, 256, 64), warps=(8, 1, 1)), "cutlass.conv_sm90_tile"),      # 256 accumulators per thread
    (key(warps=(8, 1, 1), stages=3, extras=(("cutlass.occupancy", 2),)), "cutlass.conv_sm90_consumers"),
    (key(tile=(128, 64, 64), stages=3, extras=(("cutlass.occupancy", 3),)), "cutlass.conv_sm90_registers"),
    (key(stages=3, extras=(("cutlass.occupancy", 2),)), "cutlass.conv_sm90_registers"),  # 128 accumulators
    (key(cluster=(4, 1, 1)), "cutlass.conv_sm90_cluster"),
    (key(cluster=(1, 1, 2)), "cutlass.conv_sm90_cluster"),
    (key(stages=9), "cutlass.conv_sm90_smem"),
    (key(tile=(128, 128, 64), stages=8), "cutlass.conv_sm90_smem"),
    (key(scheduler="persistent"), "cutlass.conv_scheduler"),
    (key("bwd_data", epi=Epilogue("relu")), "cutlass.conv_epilogue"),       # fused epilogues: forward only
    (key("bwd_weight", epi=Epilogue(bias=True)), "cutlass.conv_epilogue"),
    (key(epi=Epilogue("relu", True, 2)), "cutlass.conv_sm90_residual"),      # the residual is CUTLASS's C
    (key(epi=Epilogue("relu", True, 3)), "cutlass.conv_epilogue_residuals"),
    (key(extras=(("cutlass.cpg", 4), ("cutlass.kpg", 4))), "cutlass.conv_extras"),
    (key(extras=(("cutlass.occupancy", 2),)), "cutlass.conv_occupancy"),              # stages 0 fill the SM
    (key(stages=4, extras=(("cutlass.occupancy", 4),)), "cutlass.conv_occupancy"),
    (key(stages=4, extras=(("cutlass.occupancy", 2),)), "cutlass.conv_sm90_smem"),    # 2 x 128 KiB
])
def test_illegal_keys_name_their_rule(k, rule):
    assert rule in broken(k)


def test_tma_ws_conv_is_no_gemm_pipeline():
    gemm = KernelKey(Signature("gemm", "fp16", "fp16", "fp16", "fp32", "rcr"),
                     Algorithm((128, 128, 64), "tma_ws_conv", (4, 1, 1), (64, 128, 16), "persistent"), "cutlass", "sm90a")
    assert "cutlass.conv_pipeline_not_gemm" in broken(gemm)


def test_own_conv_pipelines_keep_cluster_1():
    own = KernelKey(Signature("conv", "fp16", "fp16", "fp16", "fp32", "nhwgc", Epilogue(), "fwd", 2),
                    Algorithm((128, 64, 32), "implicit_gemm", (2, 2, 1), (16, 8, 16), "data_parallel", 1, (2, 1, 1)),
                    "cutlass", "sm90a")
    assert "cutlass.conv_scheduler" in broken(own)


@pytest.mark.parametrize("direction, rank, op, act, out", [
    ("fwd", 1, "kFprop", "TensorNWC", "TensorNWC"),
    ("fwd", 2, "kFprop", "TensorNHWC", "TensorNHWC"),
    ("bwd_data", 3, "kDgrad", "TensorNDHWC", "TensorNDHWC"),
    ("bwd_weight", 1, "kWgrad", "TensorNWC", "TensorKCS"),
    ("bwd_weight", 2, "kWgrad", "TensorNHWC", "TensorKCSR"),
    ("bwd_weight", 3, "kWgrad", "TensorNDHWC", "TensorKCSRT"),
])
def test_render_names_the_cutlass_types(direction, rank, op, act, out):
    k = key(direction, rank, (64, 128, 64) if direction == "bwd_weight" else (128, 64, 64))
    text = source(k)
    assert k.to_json() in text and "{{" not in text and "{%" not in text
    assert f"constexpr cutlass::conv::Operator CONV_OP = cutlass::conv::Operator::{op};" in text
    assert "cutlass::conv::collective::CollectiveBuilder<" in text
    assert "cutlass::conv::kernel::ConvUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>" in text
    assert "cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>" in text
    assert f"Element, cutlass::layout::{act}, ALIGN, Element, cutlass::layout::{act}, ALIGN, float" in text
    if direction == "bwd_weight":  # fp32 partial dW per batch slice
        assert f"ElementOut, cutlass::layout::{out}, OUT_ALIGN, ElementOut, cutlass::layout::{out}, OUT_ALIGN" in text
    else:
        assert f"Element, cutlass::layout::{out}, ALIGN, Element, cutlass::layout::{out}, ALIGN" in text
    assert "using Element = cutlass::half_t;" in text and "cuTensorMapEncodeIm2col" in text
    if direction == "bwd_weight":  # N is the (C, filter...) mode: a rank-1 tile tuple, direct-store epilogue
        assert "cute::Shape<cute::_64, cute::Shape<cute::_128>, cute::Shape<cute::_64>>" in text
        assert "cutlass::epilogue::NoSmemWarpSpecialized" in text
    else:
        assert "cute::Shape<cute::_128, cute::_64, cute::Shape<cute::_64>>" in text
        assert "cutlass::epilogue::TmaWarpSpecialized>" in text
    assert "StageCountAutoCarveout" in text


def test_render_shapes_cluster_stages_and_dtype():
    text = source(key("bwd_data", 2, cluster=(2, 1, 1), stages=5, dtype="bf16"))
    assert "using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;" in text
    assert "cutlass::conv::collective::StageCount<5>," in text and "StageCountAutoCarveout" not in text
    assert "using Element = cutlass::bfloat16_t;" in text and "using T = __nv_bfloat16;" in text
    assert templates(key()) == ["conv_sm90.cu.j2", "_conv_common.j2"]


def test_bwd_weight_splits_the_pixel_sum_and_finalizes():
    text = source(key("bwd_weight", 2, (64, 128, 64)))
    assert "using ElementOut = float;" in text
    assert "constexpr int UNITS = 132;" in text and "constexpr double SM_FLOPS_PER_BYTE = 2.0;" in text
    assert "constexpr int EPILOGUE_KTILES = 2;" in text
    # our persistent kernel body on CUTLASS's collectives: units of (split, tile) over a grid of resident CTAs
    assert "wgrad_split(const __grid_constant__ SplitParams sp)" in text
    assert "for (int unit = int(blockIdx.x); unit < sp.units; unit += int(gridDim.x))" in text
    assert "mainloop.load(params.mainloop, pipeline, load_state, inputs," in text and "load_state.advance(count);" in text
    assert "mainloop.mma_tail(pipeline, mma_state, count);" in text and "mma_state.advance(count);" in text
    assert "raise_smem_limit(device, wgrad_split);" in text and "std::min(params.units, sms * OCCUPANCY)" in text
    # fp32 partials with alpha 1 / beta 0, then the finalize kernel applies alpha / beta
    assert "arguments.epilogue.thread.beta = 0.0f;" in text
    assert "__global__ void finalize_splits(" in text and "finalize_splits<<<" in text
    assert "constexpr int OCCUPANCY = 1;" in text
    for gone in ("wgrad_slices", "SliceParams", "MAX_SLICES", "slice_args"):
        assert gone not in text
    assert templates(key("bwd_weight")) == ["conv_sm90.cu.j2", "_conv_common.j2", "_conv_sm90_wgrad.j2"]


def test_bwd_weight_clusters_are_single_ctas():
    assert "cutlass.conv_wgrad_cluster" in broken(key("bwd_weight", 2, (64, 128, 64), cluster=(2, 1, 1)))
    assert "cutlass.conv_wgrad_cluster" not in broken(key("fwd", 2, cluster=(2, 1, 1)))


@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
def test_fwd_and_bwd_data_keep_the_unsplit_kernel(direction):
    text = source(key(direction, 2, (128, 64, 64)))
    for split_only in ("ElementOut", "wgrad_split", "finalize_splits", "SplitParams", "choose_splits"):
        assert split_only not in text
    assert "raise_smem_limit(device, conv_kernel);" in text and "Conv::get_workspace_size(arguments);" in text
    # the launch takes the parameters its launch cache kept (built again only when td_args change)
    assert "launch(conv_kernel, Conv::get_grid_shape(last.params), last.params, stream);" in text
    assert "static thread_local TdLastLaunch<typename Conv::Arguments, typename ConvKernel::Params> last;" in text


@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
def test_two_consumer_warpgroups_run_our_kernel_body(direction):
    """warps [8, 1, 1]: the builder's mainloop types with a 2 x 1 warpgroup GMMA layout, the cooperative epilogue
    (128-row subtiles over both warpgroups), and TwoConsumerConv's body on CUTLASS's host side."""
    k = key(direction, 1, (128, 256, 64), warps=(8, 1, 1))
    text = source(k)
    assert "cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));" in text
    assert "typename MainloopBuilder::DispatchPolicy, TileShape, Element, Element, TwoWarpgroupMma," in text
    assert "cutlass::epilogue::TmaWarpSpecializedCooperative>" in text
    assert "struct TwoConsumerConv : ConvBase {" in text and "using ConvKernel = TwoConsumerConv;" in text
    # both consumer warpgroups arrive on the pipelines and take the producer's registers
    assert "mainloop_params.num_consumers = MMA_THREADS;" in text and "epi_load_params.consumer_arv_count = MMA_THREADS;" in text
    assert "warpgroup_reg_alloc<CONSUMER_REGISTERS>" in text and "warpgroup_reg_dealloc<PRODUCER_REGISTERS>" in text
    assert "mma_thread, storage.tensors.mainloop, params.mainloop);" in text
    assert '#include "conv_sm90_consumers.cuh"' in codegen.render(k)
    one = source(key(direction, 1, (128, 128, 64)))
    assert "TwoConsumerConv" not in one and "TwoWarpgroupMma" not in one
    assert "using ConvKernel = cutlass::conv::kernel::ConvUniversal<" in one


def test_two_consumer_bwd_weight_keeps_its_split_body():
    k = key("bwd_weight", 1, (256, 128, 64), warps=(8, 1, 1))
    text = source(k)
    assert "TwoWarpgroupMma" in text and "struct TwoConsumerConv" not in text
    assert "cutlass::epilogue::NoSmemWarpSpecialized" in text
    assert "pipeline_params.num_consumers = MMA_THREADS;" in text
    assert "mainloop.mma(pipeline, mma_state, acc, count, mma_thread," in text
    assert "warpgroup_reg_alloc<CONSUMER_REGISTERS>" in text  # the producer's registers to both consumers
    assert "warpgroup_reg_alloc" not in source(key("bwd_weight", 1, (128, 128, 64)))
    assert "conv_sm90_consumers.cuh" not in codegen.render(k)


@pytest.mark.parametrize("direction", ["fwd", "bwd_weight"])
def test_occupancy_sets_the_launch_bounds_and_checks_shared_memory(direction):
    """cutlass.occupancy: the launched kernel's minimum resident CTAs, a compile-time check that that many CTAs'
    shared memory fits the SM, and (bwd_weight) a persistent grid of that many CTAs per SM."""
    k = key(direction, 2, (64, 64, 64), stages=4, extras=(("cutlass.occupancy", 2),))
    text = source(k)
    assert "constexpr int OCCUPANCY = 2;" in text
    assert "__launch_bounds__(ConvKernel::MaxThreadsPerBlock, OCCUPANCY)" in text
    assert "static_assert(OCCUPANCY * (int(ConvKernel::SharedStorageSize) + 1024) <= 233472," in text
    assert "constexpr int OCCUPANCY = 1;" in source(key(direction, 2, (64, 64, 64), stages=4))


def test_preselected_sets_have_every_direction_and_rank():
    for name, directions in (("conv_fp16_fwd_essential", {"fwd"}),
                             ("conv_fp16_bwd_essential", {"bwd_data", "bwd_weight"}),
                             ("conv_fp16_all_essential", {"fwd", "bwd_data", "bwd_weight"})):
        keys = [e.key for e in kernelset.load([name], "cutlass", "sm90a") if e.key.algorithm.pipeline == "tma_ws_conv"]
        have = {(k.signature.direction, k.signature.spatial_dims) for k in keys}
        assert have == {(d, r) for d in directions for r in (1, 2, 3)}, name
        # each costs ~60 s and ~3.3 GB of nvcc: keep the sets small (fused forward epilogues: on two 2D tiles)
        plain = [k for k in keys if k.signature.epilogue == Epilogue()]
        for d in directions:
            assert sum(k.signature.direction == d for k in plain) <= (10 if d == "bwd_weight" else 7), (name, d)
        fused = {k for k in keys if k.signature.epilogue != Epilogue()}
        assert len(fused) <= 6 and all(k.signature.direction == "fwd" for k in fused), name


# ---- selection --------------------------------------------------------------------------------------
class _Kernel:
    def __init__(self, k):
        self.key, self.name = k, k.name


def _ranked(problem):
    kernels = [_Kernel(e.key) for e in kernelset.load(["conv_fp16_all_essential"], "cutlass", "sm90a")
               if problem.mismatch(e.key) is None and _could_run(problem, e.key)]
    return [k.key for k in analytic(problem, kernels)]


def _could_run(p, k) -> bool:
    """What td_can_run decides on the device, for the pipelines that compete on dense problems."""
    alg = k.algorithm
    if alg.pipeline == "tma_ws_conv":
        return p.g == 1 and (p.direction != "bwd_data" or set(p.stride) == {1})
    return alg.pipeline == "implicit_gemm"


def _problem(direction, n, c, k, sp, f, stride=1, pad=1):
    r = len(sp)
    return conv.ConvProblem(direction, n, 1, c, k, sp, f, (stride,) * r, (1,) * r, (pad,) * r, (pad,) * r,
                            "fp16", "fp16", "fp16")


@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
@pytest.mark.parametrize("shape", [
    (32, 64, 64, (56, 56), (3, 3)), (32, 256, 64, (56, 56), (1, 1)), (32, 256, 256, (14, 14), (3, 3)),
    (8, 64, 64, (16, 56, 56), (3, 3, 3)), (16, 512, 512, (2048,), (3,)), (3, 96, 136, (67,), (5,)),
])
def test_dense_problems_rank_tma_ws_conv_first(direction, shape):
    assert _ranked(_problem(direction, *shape))[0].algorithm.pipeline == "tma_ws_conv"


@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
def test_wide_1d_layers_rank_the_two_warpgroup_tile_first(direction):
    # 512 channels: 128 x 256 over two consumer warpgroups (bench/results/conv_run36_consumers); 64 channels
    # would pad it 4x, so the 128 x 64 tile with two resident CTAs leads there
    wide = _ranked(_problem(direction, 16, 512, 512, (2048,), (3,)))[0].algorithm
    assert (wide.tile, wide.warps, wide.cluster) == ((128, 256, 64), (8, 1, 1), (1, 2, 1))
    narrow = _ranked(_problem(direction, 16, 64, 64, (2048,), (3,)))[0].algorithm
    assert (narrow.tile, narrow.warps) == ((128, 64, 64), (4, 1, 1))


@pytest.mark.parametrize("shape", [
    (32, 64, 64, (56, 56), (3, 3)), (32, 256, 64, (56, 56), (1, 1)), (32, 256, 256, (14, 14), (3, 3)),
    (8, 64, 64, (16, 56, 56), (3, 3, 3)), (16, 512, 512, (2048,), (3,)), (8, 1024, 1024, (14, 14), (3, 3)),
])
def test_dense_bwd_weight_ranks_tma_ws_conv_first(shape):
    # few output tiles (K x taps*C = 64 x 576) and a pixel sum of 100k: tma_ws_conv splits the batch into slices
    # that fill the GPU; many output tiles (1024 x 9216): one CTA per tile fills it unsplit
    assert _ranked(_problem("bwd_weight", *shape))[0].algorithm.pipeline == "tma_ws_conv"


def test_per_tap_channel_padding_is_modelled():
    # CUTLASS pads each tap's channels to the tile: C = 32 under a 64-deep k tile is half zeros
    p = _problem("fwd", 3, 32, 48, (67,), (5,))
    assert p.gemm_shape(key("fwd", 1))[2] == 5 * 64 and p.gemm_shape()[2] == 5 * 32
    wgrad = _problem("bwd_weight", 32, 64, 64, (56, 56), (3, 3))
    assert wgrad.gemm_shape(key("bwd_weight", 2, (64, 128, 64)))[1] == 9 * 128


def test_strided_bwd_data_falls_back_to_implicit_gemm():
    p = _problem("bwd_data", 32, 64, 64, (56, 56), (3, 3), stride=2)
    assert _ranked(p)[0].algorithm.pipeline == "implicit_gemm"


def test_runtime_split_is_modelled_for_bwd_weight_only():
    own = KernelKey(Signature("conv", "fp16", "fp16", "fp16", "fp32", "nhwgc", Epilogue(), "bwd_weight", 2),
                    Algorithm((64, 128, 32), "implicit_gemm", (2, 2, 1), (16, 8, 16), "data_parallel"), "cutlass", "sm90a")
    igemm = cutlass.family(own)
    # a few output tiles with a long reduction: splits until the blocks fill 2 waves, at most one per k tile
    assert igemm.runtime_split(own, 4, 64 * 32, 132) == 64 and igemm.runtime_split(own, 4, 10 * 32, 132) == 10
    assert igemm.runtime_split(own.replace(signature=replace(own.signature, direction="fwd")), 4, 64 * 32, 132) == 1
    tma = key("bwd_weight", 2, (64, 128, 64))
    p = _problem("bwd_weight", 32, 256, 64, (56, 56), (1, 1), pad=0)
    assert cutlass.family(tma).partials_cost(p, tma) is not None and cutlass.family(tma).module.EPILOGUE_KTILES == 2
    assert cutlass.family(tma).partials_cost(p, key("fwd")) is None
    assert cutlass.family(tma).partials_cost(p, key("bwd_data")) is None


def _split(n, c, k, sp, f, tile=(64, 128, 64), occupancy=0):
    """(S, units, cost) the ranker models for a tma_ws_conv bwd_weight key: choose_splits' rule."""
    conv_partials_split = cutlass.family(key()).module.conv_partials_split
    extras = (("cutlass.occupancy", occupancy),) if occupancy else ()
    kk = key("bwd_weight", len(sp), tile, stages=4 if occupancy else 0, extras=extras)
    s, tiles, _, cost = conv_partials_split(_problem("bwd_weight", n, c, k, sp, f, pad=1 if f[0] == 3 else 0), kk)
    return s, tiles * s, cost


@pytest.mark.parametrize("n, c, k, sp, f, tile, occupancy, splits", [
    # ResNet-50 1x1 (64 x 256, 1568 k tiles): 33 splits of 4 tiles fill the 132 SMs in one wave
    (32, 256, 64, (56, 56), (1, 1), (64, 64, 64), 0, 33),
    # three CTAs per SM: 396 slots, 98 splits x 4 tiles
    (32, 256, 64, (56, 56), (1, 1), (64, 64, 64), 3, 98),
    # late 14x14 (256 x 2304, 98 k tiles): a big fp32 partial per split, so 3 splits of 36 tiles in one wave
    (32, 256, 256, (14, 14), (3, 3), (128, 128, 64), 0, 3),
    # video 3D (27 tiles, 6272 k tiles): 4 splits, 108 units (one wave: never a second one of units)
    (8, 64, 64, (16, 56, 56), (3, 3, 3), (64, 64, 64), 0, 4),
    # three CTAs per SM: 14 splits, 378 units
    (8, 64, 64, (16, 56, 56), (3, 3, 3), (64, 64, 64), 3, 14),
    # conv1d (48 tiles of 128 x 128, 512 k tiles): 2 splits, 96 units
    (16, 512, 512, (2048,), (3,), (128, 128, 64), 0, 2),
    # ResNet-50 3x3 (9 tiles): 14 splits of 112 k tiles (whole images allowed 11 slices of 3 images)
    (32, 64, 64, (56, 56), (3, 3), (64, 64, 64), 0, 14),
    # 1024 x 9216 of 128 x 128 tiles fill the GPU unsplit
    (8, 1024, 1024, (14, 14), (3, 3), (128, 128, 64), 0, 1),
])
def test_split_of_tma_ws_conv_bwd_weight(n, c, k, sp, f, tile, occupancy, splits):
    """The rule the kernel applies (_conv_sm90_wgrad.j2, choose_splits) as the ranker models it."""
    assert _split(n, c, k, sp, f, tile, occupancy)[0] == splits


def test_split_cost_counts_waves_and_partials():
    partials_split = cutlass.family(key()).module.partials_split
    kk = key("bwd_weight", 2, (64, 64, 64))
    # splits never start a second wave of units; more tiles than CTAs: unsplit, the cost counts its waves
    assert partials_split(kk, 67, 1000, 0, 2)[0] == 1
    assert partials_split(kk, 300, 10, 0, 2) == (1, 3 * (10 + 2))
    # 1 tile, 100 k tiles, a tiny partial: more splits are nearly free until the 132 slots are full
    s, cost = partials_split(kk, 1, 100, 64, 2)
    assert s == 100 and cost == pytest.approx(1 * (1 + 2) + 100 * 4.0 * 64 * 2.0 / (64 * 64 * 64))
    # a partial as costly as the whole reduction: never split
    assert partials_split(kk, 1, 100, 64 * 64 * 64 * 100, 2)[0] == 1
    # ties keep the fewer splits: 50 to 66 splits of 2 tiles all give 2 k tiles per unit in one wave of 132
    assert partials_split(kk, 2, 100, 0, 2)[0] == 50


def test_split_estimate_is_the_kernels_cost():
    p = _problem("bwd_weight", 32, 256, 64, (56, 56), (1, 1), pad=0)
    kk = key("bwd_weight", 2, (64, 64, 64))
    s, units, cost = _split(32, 256, 64, (56, 56), (1, 1), (64, 64, 64))
    assert estimated_cost(p, kk) == pytest.approx(cost * 64 * 64 * 64 / min(1.0, 32 / 96) * cutlass.family(kk).cost_factor(kk))


def test_cluster_grid_rounding_is_modelled():
    """CUTLASS launches whole clusters: a [1, 2, 1] cluster on a layer with one tile along N runs twice the CTAs."""
    p = _problem("fwd", 16, 64, 64, (2048,), (3,))  # 256 tiles along M, 1 along N (K = 64 < 128)
    alone, pair = key("fwd", 1), key("fwd", 1, cluster=(1, 2, 1))
    assert estimated_cost(p, pair) == pytest.approx(2 * estimated_cost(p, alone))
    wide = _problem("fwd", 16, 512, 512, (2048,), (3,))  # 4 tiles along N: nothing to round
    assert estimated_cost(wide, pair) == pytest.approx(estimated_cost(wide, alone))


def _direct(tile, direction="fwd", rank=2):
    return KernelKey(Signature("conv", "fp16", "fp16", "fp16", "fp32", "nhwgc", Epilogue(), direction, rank),
                     Algorithm(tile, "direct", (16, 1, 1), (tile[0] // 4, 4, 1), "data_parallel", 1, (1, 1, 1), 0,
                               (("cutlass.cpg", 1), ("cutlass.fx", 3), ("cutlass.fy", 3), ("cutlass.kpg", 1))),
                     "cutlass", "sm90a")


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
def test_direct_rows_round_up_to_whole_tiles(direction):
    """A cutlass direct kernel computes whole tiles of tile[0] pixels along W by tile[2] rows along H: the
    ranker counts those pixels, so a 56-wide map prefers 28-wide tiles and a 64-wide one 32-wide tiles."""
    def pixels(size, tile):
        p = conv.ConvProblem(direction, 2, 8, 8, 8, size, (3, 3), 1, 1, 1, 1, "fp16", "fp16", "fp16")
        m, n, k, _ = p.gemm_shape(_direct(tile, direction))
        return k if direction == "bwd_weight" else m
    assert pixels((56, 56), (32, 64, 8)) == 2 * 56 * 64 and pixels((56, 56), (28, 64, 8)) == 2 * 56 * 56
    assert pixels((50, 64), (32, 64, 8)) == 2 * 56 * 64  # rows too: 50 rounds up to 7 tiles of 8
    for size, wide in (((56, 56), 28), ((64, 64), 32)):
        p = conv.ConvProblem(direction, 32, 128, 128, 128, size, (3, 3), 1, 1, 1, 1, "fp16", "fp16", "fp16")
        keys = [_Kernel(_direct(t, direction)) for t in ((32, 64, 8), (28, 64, 8))]
        assert analytic(p, keys)[0].key.algorithm.tile[0] == wide


def test_direct_fwd_with_one_block_per_sm_ranks_after_narrow_tiles():
    """problem_factor: at stride 2 a 28-wide fwd tile's halo (57 x 17 pixels x 64 lanes) leaves one block per SM,
    x2, and a 16-wide tile runs MobileNetV2's 112 x 112 stride-2 depthwise layer first (bench/results/depthwise_h200:
    65.2 us against 45.6); at stride 1 the same tiles keep two blocks per SM and the wide one stays first. bwd_data and
    bwd_weight keep their cost (not measured)."""
    wide, narrow = _direct((28, 64, 8), "fwd"), _direct((16, 64, 8), "fwd")
    factor = cutlass.family(wide).problem_factor

    def layer(stride, direction="fwd"):
        return conv.ConvProblem(direction, 32, 96, 96, 96, (112, 112), (3, 3), stride, 1, 1, 1, "fp16", "fp16", "fp16")
    assert factor(layer(2), wide) == 2.0 and factor(layer(2), narrow) == 1.0
    assert factor(layer(1), wide) == 1.0
    assert factor(layer(2, "bwd_data"), _direct((28, 64, 8), "bwd_data")) == 1.0
    assert analytic(layer(2), [_Kernel(wide), _Kernel(narrow)])[0].key is narrow
    assert analytic(layer(1), [_Kernel(wide), _Kernel(narrow)])[0].key is wide
