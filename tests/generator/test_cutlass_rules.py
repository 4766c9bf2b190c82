"""cutlass backend without nvcc or a GPU: legality rules, the symbol map, rendering of every preselected
cutlass kernel, compile flags and toolchain identity."""
from __future__ import annotations

import dataclasses
import re

import pytest

from tiledispatch import backends, drivers
from tiledispatch.generator import codegen, kernelset
from tiledispatch.generator import toolchains
from tiledispatch.generator import rules
from tiledispatch.spec.key import Algorithm, Epilogue, KernelKey, Signature, parse_kernel_name

cutlass = toolchains.get("cutlass")


def context(key) -> dict:
    return backends.family_of(key).context(key)


def sm90(dtype="fp16", out=None, layout="rcr", tile=(128, 256, 64), pipeline="tma_ws_cooperative",
         scheduler="persistent", cluster=(1, 1, 1), split_k=1, stages=0, epi=Epilogue(), extras=(), warps=None,
         mma=None):
    size = {"fp16": 2, "bf16": 2, "fp32": 4, "int8": 1, "fp8e4m3": 1, "fp8e5m2": 1}[dtype]
    out = out or {"int8": "int32"}.get(dtype, dtype)
    acc = "int32" if dtype == "int8" else "fp32"
    warps = warps or ((8, 1, 1) if pipeline == "tma_ws_cooperative" else (4, 1, 1))
    mma = mma or (64, tile[1], 32 // size)
    return KernelKey(Signature("gemm", dtype, dtype, out, acc, layout, epi),
                     Algorithm(tile, pipeline, warps, mma, scheduler, split_k, cluster, stages, extras), "cutlass", "sm90a")


def sm80(dtype="fp16", layout="rcr", tile=(128, 128, 32), warps=(2, 2, 1), stages=0, epi=Epilogue(), mma=None):
    out = {"int8": "int32"}.get(dtype, dtype)
    acc = "int32" if dtype == "int8" else "fp32"
    mma = mma or {"fp32": (16, 8, 8), "int8": (16, 8, 32)}.get(dtype, (16, 8, 16))
    return KernelKey(Signature("gemm", dtype, dtype, out, acc, layout, epi),
                     Algorithm(tile, "multistage", warps, mma, "data_parallel", 1, (1, 1, 1), stages), "cutlass", "sm80")


def broken(key) -> set[str]:
    return {v.rule for v in rules.check(key)}


LEGAL = [
    sm90(), sm90("bf16", layout="rrr", tile=(64, 128, 64), pipeline="tma_ws_pingpong", cluster=(1, 2, 1)),
    sm90("fp32", tile=(128, 128, 32), scheduler="stream_k", split_k=2),
    sm90("int8", tile=(128, 256, 128), cluster=(2, 1, 1), epi=Epilogue("silu", True)),
    sm90("fp8e4m3", out="bf16", tile=(128, 256, 128), extras=(("cutlass.fp8_fast_accum", True),)),
    sm90(layout="ccr", pipeline="tma_ws_pingpong", tile=(128, 128, 64), stages=4, epi=Epilogue("clamp")),
    sm80(), sm80("bf16", layout="crr", tile=(128, 256, 32), warps=(2, 4, 1), epi=Epilogue("gelu_erf", True, 2)),
    sm80("fp32", layout="ccr", tile=(128, 128, 16)), sm80("int8", tile=(128, 128, 64)),
]


@pytest.mark.parametrize("key", LEGAL, ids=lambda k: k.name[:70])
def test_legal_keys_pass_and_round_trip(key):
    assert rules.check(key) == []
    assert parse_kernel_name(key.name) == key


@pytest.mark.parametrize("key, rule", [
    (sm90(pipeline="tma_ws_pingpong", scheduler="stream_k", tile=(64, 128, 64)), "cutlass.stream_k_cooperative"),
    (sm90(split_k=2), "cutlass.split_k"),
    (sm90(tile=(64, 128, 64)), "cutlass.sm90_tile_m"),
    (sm90(warps=(2, 1, 1)), "cutlass.sm90_warps"),
    (sm90(mma=(64, 128, 16)), "cutlass.sm90_mma"),
    (sm90(cluster=(4, 2, 1)), "cutlass.sm90_cluster"),
    (sm90(tile=(256, 256, 64), stages=4), "cutlass.sm90_smem"),
    (sm90("int8", layout="rrr", tile=(128, 256, 128)), "cutlass.k_major_only"),
    (sm90(tile=(128, 256, 48)), "cutlass.tile_k_bytes"),
    (sm90(extras=(("cutlass.fp8_fast_accum", True),)), "cutlass.fp8_fast_accum"),
    (sm80(mma=(16, 8, 8)), "cutlass.sm80_mma"),
    (sm80(warps=(3, 1, 1), tile=(96, 128, 32)), "cutlass.sm80_warps"),
    (sm80(tile=(256, 256, 64), stages=5), "cutlass.sm80_smem"),
    (sm80(stages=2), "cutlass.sm80_stages"),
    (sm80("int8", layout="crr", tile=(128, 128, 64)), "cutlass.k_major_only"),
])
def test_illegal_keys_name_their_rule(key, rule):
    assert rule in broken(key)


def test_fp8_needs_sm90a():
    key = sm80().replace(signature=Signature("gemm", "fp8e4m3", "fp8e4m3", "fp16", "fp32", "rcr"))
    assert "cutlass.fp8_arch" in broken(key)


def test_symbol_map():
    ctx = context(sm90("fp8e4m3", out="bf16", tile=(128, 256, 128), extras=(("cutlass.fp8_fast_accum", True),)))
    assert ctx["ctype"]["a"] == "cutlass::float_e4m3_t" and ctx["ctype"]["c"] == "cutlass::bfloat16_t"
    assert ctx["kernel_schedule"] == "cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum"
    assert ctx["align"] == {"a": 16, "b": 16, "c": 8}
    ctx = context(sm90("int8", tile=(128, 256, 128)))
    assert ctx["compute"] == "double" and ctx["int_out"]  # exact int32 results
    ctx = context(sm80("fp32", tile=(128, 128, 16)))
    assert ctx["ctype"]["a"] == "cutlass::tfloat32_t" and ctx["warp_tile"] == [64, 64, 16] and ctx["stages"] == 4
    assert context(sm80(tile=(128, 256, 64), warps=(2, 4, 1)))["stages"] == 3


def test_sm90_default_tile_order():
    small = context(sm90(tile=(64, 128, 64), pipeline="tma_ws_pingpong"))
    assert (small["default_raster"], small["default_swizzle"]) == ("AlongM", 2)
    clustered = context(sm90(tile=(64, 128, 64), pipeline="tma_ws_pingpong", cluster=(2, 1, 1)))
    assert (clustered["default_raster"], clustered["default_swizzle"]) == ("AlongM", 1)
    tall = context(sm90(tile=(256, 128, 64)))
    assert (tall["default_raster"], tall["default_swizzle"]) == ("Heuristic", 1)
    assert "RasterOrder::AlongM;" in codegen.render(sm90(tile=(64, 128, 64), pipeline="tma_ws_pingpong"))


def preselected_cutlass_keys() -> list[KernelKey]:
    keys = {}
    for name in kernelset.available_sets():
        for arch in rules.archs("cutlass"):
            if f"cutlass/{arch}" not in kernelset.targets(kernelset.find(name)):
                continue
            for entry in kernelset.load([name], "cutlass", arch):
                keys[entry.key.name] = entry.key
    return list(keys.values())


@pytest.mark.slow
def test_every_preselected_cutlass_kernel_renders():
    keys = preselected_cutlass_keys()
    assert len(keys) >= 40
    for key in keys:
        text = codegen.render(key)
        assert key.to_json() in text
        assert "{{" not in text and "{%" not in text
        if key.signature.op == "gemm":
            # CUTLASS 3.x on sm90a but for the low-alignment multistage (CUTLASS 2.x) kernels built for it
            assert ("CollectiveBuilder" in text) == (key.algorithm.pipeline != "multistage")
        elif key.algorithm.pipeline == "tma_ws_conv":  # CUTLASS's SM90 conv (dense)
            assert "cutlass::conv::collective::CollectiveBuilder<" in text
        else:  # the project's own conv CUDA (templates/cutlass/conv_*)
            assert "#include \"cutlass/" not in text and "__global__" in text


def test_preselected_sets_have_both_archs():
    for name in ("fp16_rcr_essential", "bf16_rcr_essential", "fp32_rcr_essential", "int8_rcr_essential",
                 "fp16_all_layouts", "fp16_rcr_fused"):
        for arch in ("sm90a", "sm80"):
            assert kernelset.load([name], "cutlass", arch), f"{name} has no cutlass {arch} kernels"
    assert len(kernelset.load(["fp16_rcr_full"], "cutlass", "sm90a")) >= 40


def test_compile_flags():
    tc = toolchains.Toolchain(compiler="nvcc", identity="x")
    flags = cutlass.compile_flags(sm90(), tc)
    assert {"-O3", "-DNDEBUG", "-std=c++17", "--expt-relaxed-constexpr", "-shared"} <= set(flags)
    assert "-gencode=arch=compute_90a,code=sm_90a" in flags
    assert any(f.startswith("-gencode=arch=compute_80,code=") for f in cutlass.compile_flags(sm80(), tc))
    cmd = cutlass.compile_command(sm90(), toolchains.Toolchain("nvcc", "x", ("/cutlass/include",)), "k.cu", "k.so",
                                  ["/abi"])
    assert cmd[0] == "nvcc" and "-I/abi" in cmd and cmd[cmd.index("-isystem") + 1] == "/cutlass/include"


def test_toolchain_identity_names_nvcc_and_cutlass():
    try:
        tc = cutlass.toolchain()
    except RuntimeError as e:
        pytest.skip(str(e))
    assert re.search(r"nvcc release \d+\.\d+", tc.identity) and re.search(r"nvidia-cutlass \d+\.", tc.identity)


def test_arch_detection_mapping():
    archs = backends.get("cutlass").archs  # the one cc -> arch map: the archs' cc / ptx facts
    assert drivers.arch_of_cc("9.0", archs) == "sm90a"
    assert drivers.arch_of_cc("8.6", archs) == "sm80" and drivers.arch_of_cc("8.0", archs) == "sm80"
    assert drivers.arch_of_cc("7.5", archs) is None and drivers.arch_of_cc("10.0", archs) is None


def direct_conv(direction="fwd", rank=2, extras=(), tile=(32, 64, 8), mma=(8, 4, 1), pipeline="direct"):
    warps, stages = ((8, 1, 1), 0) if pipeline == "direct" else ((2, 2, 1), 3)
    if pipeline == "implicit_gemm":
        tile, mma = (64, 64, 32), (16, 8, 16)
    return KernelKey(Signature("conv", "fp16", "fp16", "fp16", "fp32", "nhwgc", Epilogue(), direction, rank),
                     Algorithm(tile, pipeline, warps, mma, "data_parallel", 1, (1, 1, 1), stages, extras),
                     "cutlass", "sm90a")


DW = (("cutlass.cpg", 1), ("cutlass.kpg", 1))
FILTER_LEGAL = [
    direct_conv(extras=DW + (("cutlass.fx", 3), ("cutlass.fy", 3))),
    direct_conv("bwd_data", extras=DW + (("cutlass.fx", 7), ("cutlass.fy", 7))),
    direct_conv(extras=(("cutlass.cpg", 4), ("cutlass.kpg", 4), ("cutlass.fx", 3), ("cutlass.fy", 3))),
    direct_conv(rank=1, tile=(64, 64, 1), extras=DW + (("cutlass.fx", 4),)),
    direct_conv("bwd_data", rank=3, extras=DW + (("cutlass.fx", 3), ("cutlass.fy", 3))),
    # bwd_weight: mma[0] (taps along W per thread) divides fx
    direct_conv("bwd_weight", tile=(16, 64, 8), mma=(3, 8, 1), extras=DW + (("cutlass.fx", 3), ("cutlass.fy", 3))),
    direct_conv("bwd_weight", tile=(32, 64, 8), mma=(7, 8, 1), extras=DW + (("cutlass.fx", 7), ("cutlass.fy", 7))),
    direct_conv("bwd_weight", tile=(32, 32, 8), mma=(3, 4, 1),
                extras=(("cutlass.cpg", 4), ("cutlass.kpg", 4), ("cutlass.fx", 3), ("cutlass.fy", 3))),
    direct_conv("bwd_weight", tile=(16, 64, 8), mma=(1, 8, 1), extras=DW + (("cutlass.fx", 5), ("cutlass.fy", 5))),
    direct_conv("bwd_weight", rank=1, tile=(256, 64, 1), mma=(4, 8, 1), extras=DW + (("cutlass.fx", 8),)),
]


@pytest.mark.parametrize("key", FILTER_LEGAL, ids=lambda k: k.name[-40:])
def test_compile_time_filter_keys_are_legal_and_round_trip(key):
    assert rules.check(key) == []
    assert parse_kernel_name(key.name) == key
    fx, fy = key.algorithm.extra("cutlass.fx"), key.algorithm.extra("cutlass.fy")
    assert f"_xfx{fx}_" in key.name and (f"_xfy{fy}_" in key.name) == (fy is not None)


@pytest.mark.parametrize("key, rule", [
    (direct_conv("bwd_weight", mma=(2, 4, 1), extras=DW + (("cutlass.fx", 3), ("cutlass.fy", 3))),
     "cutlass.conv_direct_filter_wgrad"),                                            # mma[0] 2 does not divide 3
    (direct_conv("bwd_weight", mma=(3, 8, 1), extras=DW + (("cutlass.fx", 7), ("cutlass.fy", 7))),
     "cutlass.conv_direct_filter_wgrad"),
    (direct_conv("bwd_weight", mma=(3, 4, 1), extras=(("cutlass.fx", 3), ("cutlass.fy", 3))),
     "cutlass.conv_direct_filter"),                                                  # no cpg / kpg
    (direct_conv(extras=(("cutlass.fx", 3), ("cutlass.fy", 3))), "cutlass.conv_direct_filter"),  # no cpg / kpg
    (direct_conv(extras=DW + (("cutlass.fx", 3),)), "cutlass.conv_direct_filter"),   # 2D: both or neither
    (direct_conv(extras=DW + (("cutlass.fy", 3),)), "cutlass.conv_direct_filter"),
    (direct_conv(extras=DW + (("cutlass.fx", 16), ("cutlass.fy", 3))), "cutlass.conv_direct_filter"),
    (direct_conv(rank=1, tile=(64, 64, 1), extras=DW + (("cutlass.fx", 4), ("cutlass.fy", 1))),
     "cutlass.conv_direct_filter"),                                                  # 1D: fx only
    (direct_conv(pipeline="implicit_gemm", extras=(("cutlass.fx", 3), ("cutlass.fy", 3))), "cutlass.conv_extras"),
])
def test_compile_time_filter_illegal_combinations_name_their_rule(key, rule):
    assert rule in broken(key)


def test_compile_time_filter_renders():
    """The filter constants, the register window and the refusal appear only in a kernel with fx / fy; the same
    key without them renders without any of it (kernels built before these extras keep their sources)."""
    fixed = direct_conv(extras=DW + (("cutlass.fx", 3), ("cutlass.fy", 3)))
    text = codegen.render(fixed)
    assert "constexpr int FX = 3, FY = 3;" in text and "accumulate_window<1, 1>(" in text
    assert "accumulate_window<BWD ? 1 : 2, 1>(" in text and "filter (height x width" in text
    assert "{{" not in text and "{%" not in text and fixed.to_json() in text
    plain = codegen.render(direct_conv(extras=DW))
    assert "FX" not in plain and "accumulate_window" not in plain and "cutlass.fx" not in plain
    one_d = codegen.render(direct_conv(rank=1, tile=(64, 64, 1), extras=DW + (("cutlass.fx", 4),)))
    assert "constexpr int FX = 4, FY = 1;" in one_d and "Filter: width 4" in one_d


def test_compile_time_filter_renders_bwd_weight():
    """bwd_weight: the filter constants, the register window (PXW: the largest of 4 / 2 / 1 dividing tile[0]) and
    the refusal only with fx / fy; without them the kernel's source has none of it (byte-identical to before)."""
    fixed = direct_conv("bwd_weight", tile=(16, 64, 8), mma=(3, 8, 1), extras=DW + (("cutlass.fx", 3), ("cutlass.fy", 3)))
    text = codegen.render(fixed)
    assert "constexpr int FX = 3, FY = 3;" in text and "constexpr int PXW = 4;" in text
    for inst in ("<1, 1>(", "<1, 2>(", "<2, 1>("):
        assert "accumulate_window" + inst in text
    assert "r % (FX / FWT)" in text and "filter (height x width" in text and "Filter: 3 x 3 (height x width)" in text
    assert "{{" not in text and "{%" not in text and fixed.to_json() in text
    plain = codegen.render(direct_conv("bwd_weight", tile=(16, 64, 8), mma=(3, 8, 1), extras=DW))
    assert "FX" not in plain and "PXW" not in plain and "accumulate_window" not in plain and "cutlass.fx" not in plain
    assert "r % w.nfx" in plain
    six = direct_conv("bwd_weight", tile=(6, 64, 8), mma=(3, 8, 1), extras=DW + (("cutlass.fx", 3), ("cutlass.fy", 3)))
    assert "constexpr int PXW = 2;" in codegen.render(six)
    one_d = direct_conv("bwd_weight", rank=1, tile=(256, 64, 1), mma=(4, 8, 1), extras=DW + (("cutlass.fx", 8),))
    assert "constexpr int FX = 8, FY = 1;" in codegen.render(one_d)


def mma_conv(direction="fwd", rank=2, cpg=4, kpg=None, tile=(28, 32, 8), warps=(7, 1, 1), f=3, dtype="fp16",
             extras=()):
    filt = (("cutlass.fx", f),) + ((("cutlass.fy", f),) if rank > 1 else ())
    groups = (("cutlass.cpg", cpg), ("cutlass.kpg", cpg if kpg is None else kpg))
    return KernelKey(Signature("conv", dtype, dtype, dtype, "fp32", "nhwgc", Epilogue(), direction, rank),
                     Algorithm(tile, "direct_mma", warps, (16, 8, 16), "data_parallel", 1, (1, 1, 1), 0,
                               groups + filt + extras), "cutlass", "sm90a")


@pytest.mark.parametrize("key", [
    mma_conv(), mma_conv("bwd_data", cpg=1, f=7), mma_conv(cpg=16, tile=(16, 32, 2), warps=(1, 2, 1)),
    mma_conv(rank=1, cpg=1, tile=(128, 64, 1), warps=(4, 2, 1), f=4), mma_conv(rank=3, dtype="bf16"),
    mma_conv(cpg=64, tile=(32, 32, 8), warps=(4, 2, 1)), mma_conv(extras=(("cutlass.occupancy", 3),)),
    # the few-channel form: K/G at run time, or a multiple of the lane tile
    mma_conv(cpg=3, kpg=0, tile=(16, 32, 8), warps=(4, 1, 1)),
    mma_conv(cpg=8, kpg=64, tile=(16, 64, 8), warps=(4, 2, 1)),
    direct_conv(extras=DW + (("cutlass.occupancy", 2),)),
    direct_conv("bwd_weight", mma=(3, 8, 1), extras=DW + (("cutlass.occupancy", 3),)),
    mma_conv("bwd_weight", warps=(8, 1, 1)), mma_conv("bwd_weight", cpg=1, f=7, tile=(28, 64, 8), warps=(16, 1, 1)),
    mma_conv("bwd_weight", cpg=1, f=7, tile=(28, 64, 8), warps=(8, 2, 1), extras=(("cutlass.occupancy", 1),)),
    mma_conv("bwd_weight", cpg=1, f=9, tile=(28, 32, 8), warps=(4, 2, 1)),  # 41 pairs in two groups
    mma_conv("bwd_weight", cpg=1, f=7, tile=(56, 16, 8), warps=(8, 1, 1), extras=(("cutlass.rows", 1),)),
    mma_conv("bwd_weight", rank=1, cpg=1, tile=(256, 64, 1), warps=(8, 1, 1), f=4),
    mma_conv("bwd_weight", rank=3, tile=(16, 32, 4), warps=(8, 1, 1), dtype="bf16"),
], ids=lambda k: k.name[-60:])
def test_direct_mma_and_direct_occupancy_keys_are_legal_and_round_trip(key):
    assert rules.check(key) == []
    assert parse_kernel_name(key.name) == key


@pytest.mark.parametrize("key, rule", [
    (mma_conv(dtype="fp32"), "cutlass.conv_direct_mma_shape"),                      # tensor cores: 16-bit inputs
    (mma_conv(warps=(4, 1, 1)), "cutlass.conv_direct_mma_warps"),                   # 224 pixels over 4 warps: 56
    (mma_conv(tile=(28, 36, 8)), "cutlass.conv_direct_mma_shape"),                  # lanes not a multiple of 8
    (mma_conv(tile=(32, 64, 8), warps=(2, 1, 1)), "cutlass.conv_direct_mma_warps"),  # 64 mma tiles a warp
    (mma_conv("bwd_weight"), "cutlass.conv_direct_mma_wgrad"),                      # 7 warps for 4 lane chunks
    (mma_conv("bwd_weight", tile=(28, 32, 1), warps=(4, 1, 1)), "cutlass.conv_direct_mma_wgrad"),  # 28 pixels
    (mma_conv("bwd_weight", cpg=16, tile=(16, 32, 2), warps=(4, 1, 1)), "cutlass.conv_direct_mma_wgrad"),  # C/G 16
    (mma_conv("bwd_weight", f=9, warps=(8, 1, 1)), "cutlass.conv_direct_mma_wgrad"),  # 81 taps: 41 pairs
    (mma_conv("bwd_weight", f=11, warps=(4, 2, 1)), "cutlass.conv_direct_mma_wgrad"),  # 61 pairs: 31 a group
    (mma_conv("bwd_weight", tile=(16, 8, 2), warps=(1, 6, 1)), "cutlass.conv_direct_mma_wgrad"),  # 6 groups, 5 pairs
    (mma_conv(cpg=4, kpg=8), "cutlass.conv_direct_mma_few_channels"),               # K/G 8 splits a 32-lane tile
    (mma_conv("bwd_data", cpg=3, kpg=0, tile=(16, 32, 8), warps=(4, 1, 1)), "cutlass.conv_direct_mma_few_channels"),
    (mma_conv(cpg=12, kpg=32, tile=(16, 32, 8), warps=(4, 1, 1)), "cutlass.conv_direct_mma_few_channels"),  # C/G > 8
    (mma_conv(cpg=1, extras=(("cutlass.rows", 1),)), "cutlass.conv_direct_mma_rows"),  # fwd
    (mma_conv("bwd_weight", cpg=4, tile=(56, 16, 8), warps=(8, 1, 1), extras=(("cutlass.rows", 1),)),
     "cutlass.conv_direct_mma_rows"),                                               # C/G 4
    (mma_conv("bwd_weight", cpg=1, tile=(28, 16, 8), warps=(8, 1, 1), extras=(("cutlass.rows", 1),)),
     "cutlass.conv_direct_mma_rows"),                                               # 28 pixels: no 8-pixel groups
    (mma_conv("bwd_weight", cpg=1, f=11, tile=(56, 16, 8), warps=(8, 1, 1), extras=(("cutlass.rows", 1),)),
     "cutlass.conv_direct_mma_rows"),                                               # 11 taps along W
    (dataclasses.replace(mma_conv("bwd_weight", cpg=1, f=7, tile=(56, 16, 8), warps=(8, 1, 1),
                                  extras=(("cutlass.rows", 1),)), arch="sm80"), "cutlass.conv_direct_mma_rows"),  # stmatrix
    (mma_conv(cpg=3), "cutlass.conv_direct_mma_groups"),                            # 3 neither divides 8 nor is a multiple
    (mma_conv(cpg=64, tile=(28, 48, 8), warps=(7, 2, 1)), "cutlass.conv_direct_mma_groups"),  # 48 vs 64 per group
    (mma_conv(f=0), "cutlass.conv_direct_filter"),                                  # always a compile-time filter
    (mma_conv(extras=(("cutlass.occupancy", 10),)), "cutlass.conv_occupancy"),
    (direct_conv(extras=DW + (("cutlass.occupancy", 16),)), "cutlass.conv_occupancy"),  # 16 x 256 threads
    (direct_conv(extras=DW + (("cutlass.occupancy", 9),)), "cutlass.conv_occupancy"),
])
def test_direct_mma_illegal_combinations_name_their_rule(key, rule):
    assert rule in broken(key)


def test_direct_mma_renders_and_ranks():
    """direct_mma renders the tensor-core path only (no CUDA-core window) with its launch bounds; the ranker puts
    it before the CUDA-core direct kernel on C/G = 4 and after it on depthwise (rules' cost factors)."""
    from tiledispatch.ops.conv import ConvProblem
    from tiledispatch.selection import estimated_cost

    text = codegen.render(mma_conv())
    assert "mma16816(acc[mi][ni], a, b[ni])" in text and "accumulate_window" not in text
    assert "__launch_bounds__(THREADS, MIN_BLOCKS)" in text and "{{" not in text and "{%" not in text
    assert "__launch_bounds__(THREADS, 3)" in codegen.render(mma_conv(extras=(("cutlass.occupancy", 3),)))
    assert "mma16816" not in codegen.render(direct_conv(extras=DW))
    g4 = ConvProblem("fwd", 32, 32, 128, 128, (56, 56), (3, 3), 1, 1, 1, 1, "fp16", "fp16", "fp16")
    dw = ConvProblem("fwd", 32, 128, 128, 128, (56, 56), (3, 3), 1, 1, 1, 1, "fp16", "fp16", "fp16")
    cuda_core = dict(tile=(28, 64, 8), mma=(7, 4, 1))
    direct4 = direct_conv(extras=(("cutlass.cpg", 4), ("cutlass.kpg", 4), ("cutlass.fx", 3), ("cutlass.fy", 3)),
                          **cuda_core)
    direct1 = direct_conv(extras=DW + (("cutlass.fx", 3), ("cutlass.fy", 3)), **cuda_core)
    assert estimated_cost(g4, mma_conv()) < estimated_cost(g4, direct4)
    assert estimated_cost(dw, mma_conv(cpg=1)) > estimated_cost(dw, direct1)


def test_direct_mma_bwd_weight_renders_and_ranks_first():
    """direct_mma bwd_weight renders the tensor-core pixel sums (padded dY pitch, ldmatrix .x2.trans) without the
    CUDA-core register window, and the ranker puts it before the CUDA-core kernel on depthwise and C/G = 4."""
    from tiledispatch.ops.conv import ConvProblem
    from tiledispatch.selection import estimated_cost

    key = mma_conv("bwd_weight", cpg=1, warps=(8, 1, 1))
    text = codegen.render(key)
    assert "accumulate_mma(p, xs, dys, chunk" in text and "ldsm_x2_trans(bf" in text
    assert "accumulate_window" not in text and "constexpr int DPITCH = BN % (2 * VEC) ? BN : BN + VEC;" in text
    assert "{{" not in text and "{%" not in text
    assert "constexpr int DPITCH = BN;" in codegen.render(direct_conv("bwd_weight", mma=(3, 8, 1), extras=DW))
    filt = (("cutlass.fx", 3), ("cutlass.fy", 3))
    for cpg in (1, 4):
        prob = ConvProblem("bwd_weight", 32, 128 // cpg, 128, 128, (56, 56), (3, 3), 1, 1, 1, 1, "fp16", "fp16", "fp16")
        cuda_core = direct_conv("bwd_weight", tile=(28, 64, 8), mma=(3, 8 // cpg, 1),
                                extras=(("cutlass.cpg", cpg), ("cutlass.kpg", cpg)) + filt)
        assert estimated_cost(prob, mma_conv("bwd_weight", cpg=cpg, warps=(8, 1, 1))) < estimated_cost(prob, cuda_core)


def test_direct_mma_rows_renders_and_ranks_first_on_depthwise_7x7():
    """The row form renders its transpose (ldmatrix .trans into stmatrix) and diagonal reduce, and the ranker puts
    the sets' row-form kernel before the channel-chunk one on depthwise 7 x 7 (bench/results/conv_run32)."""
    from tiledispatch.ops.conv import ConvProblem
    from tiledispatch.selection import estimated_cost

    rows = mma_conv("bwd_weight", cpg=1, f=7, tile=(56, 16, 8), warps=(8, 1, 1),
                    extras=(("cutlass.rows", 1), ("cutlass.occupancy", 2)))
    text = codegen.render(rows)
    header = '#include "conv_direct_wgrad_rows.cuh"'  # the row form's plain CUDA, in the family's folder
    assert header in text
    text += (backends.family_of(rows).path / "conv_direct_wgrad_rows.cuh").read_text()
    assert "stsm_x4(dst, r4)" in text and "accumulate_rows(p, rl" in text and "reduce_rows(p, red, ctile" in text
    assert "accumulate_mma(p, xs" not in text and "{{" not in text and "{%" not in text
    chunk_text = codegen.render(mma_conv("bwd_weight", warps=(8, 1, 1)))
    assert header not in chunk_text
    assert "transpose_step" not in chunk_text and "stmatrix" not in chunk_text  # sm80 builds have no stmatrix
    chunk = mma_conv("bwd_weight", cpg=1, f=7, tile=(28, 64, 8), warps=(8, 1, 1))
    prob = ConvProblem("bwd_weight", 32, 128, 128, 128, (56, 56), (7, 7), 1, 1, 3, 3, "fp16", "fp16", "fp16")
    assert estimated_cost(prob, rows) < estimated_cost(prob, chunk)


def igemm_key(direction, tile, warps, stages, extras=()):
    return KernelKey(Signature("conv", "fp16", "fp16", "fp16", "fp32", "nhwgc", Epilogue(), direction, 2),
                     Algorithm(tile, "implicit_gemm", warps, (16, 8, 16), "data_parallel", 1, (1, 1, 1), stages,
                               extras),
                     "cutlass", "sm90a")


@pytest.mark.parametrize("direction, tile, warps, stages, smem, blocks", [
    # A [m][k] + B [k][n] (bwd_data), rows padded by 8: 3 x (128 x 72 + 64 x 136) x 2 bytes, fits twice per SM
    ("bwd_data", (128, 128, 64), (2, 4, 1), 3, 107520, 2),
    ("fwd", (128, 128, 64), (2, 4, 1), 3, 110592, 2),               # B [n][k]: 128 x 72
    ("bwd_weight", (64, 128, 32), (2, 2, 1), 0, 39936, 4),          # 4 warps: 4 blocks at 128 registers
    ("bwd_data", (64, 64, 64), (2, 2, 1), 4, 4 * (64 * 72 + 64 * 72) * 2, 3),  # 72 KiB: 3 fit
    ("bwd_data", (256, 128, 32), (4, 2, 1), 3, 87552, 1),           # warp tile 64x64: 128 registers too few
    ("fwd", (256, 128, 64), (2, 4, 1), 4, 4 * (256 * 72 + 128 * 72) * 2, 1),  # 221 KiB: once per SM
    ("fwd", (128, 64, 32), (2, 2, 1), 0, 3 * (128 * 40 + 64 * 40) * 2, 4),
    ("fwd", (128, 64, 32), (2, 2, 1), 0, 3 * (128 * 40 + 64 * 40) * 2, (("cutlass.align", 4),)),  # spilled
    ("fwd", (128, 64, 32), (2, 2, 1), 0, 3 * (128 * 40 + 64 * 40) * 2, (("cutlass.align", 1),)),
])
def test_implicit_gemm_shared_memory_and_blocks_per_sm(direction, tile, warps, stages, smem, blocks):
    """smem_bytes is the template's stage layout (the rule cutlass.conv_igemm_smem checks it) and min_blocks what the
    kernel's __launch_bounds__ asks: a count only where it is 2 or more (an explicit 1 changes the compiler's
    registers); none for the align variants. blocks: the count, or the variant's extras (count 1)."""
    extras = () if isinstance(blocks, int) else blocks
    blocks = blocks if isinstance(blocks, int) else 1
    key = igemm_key(direction, tile, warps, stages, extras)
    family = backends.family_of(key).module
    assert family.smem_bytes(key) == smem and family.min_blocks(key) == blocks
    text = codegen.render(key)
    assert f"constexpr int MIN_BLOCKS = {blocks};" in text
    assert ("__launch_bounds__(THREADS, MIN_BLOCKS)" in text) == (blocks > 1)
    assert ("__launch_bounds__(THREADS)" in text) == (blocks == 1)
