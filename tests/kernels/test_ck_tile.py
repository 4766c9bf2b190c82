"""ck_tile backend without a compiler: every preselected config renders, every legality rule rejects
what it must (by name), and the command builders say what the recipe says."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import yaml

from tiledispatch import backends
from tiledispatch.generator import codegen, kernelset
from tiledispatch.generator import toolchains
from tiledispatch.generator.toolchains import Toolchain
from tiledispatch.errors import SpecError
from tiledispatch.generator import rules
from tiledispatch.spec.key import Algorithm, Epilogue, KernelKey, Signature, parse_kernel_name

ARCHS = ("gfx90a", "gfx942", "gfx950")
ck_tile = toolchains.get("ck_tile")
ck_common = importlib.import_module("tiledispatch.families.ck_tile.common")  # the symbol map


def _context(key):
    return backends.family_of(key).context(key)


def preselected_ck_tile() -> dict[tuple[str, str], list[KernelKey]]:
    out = {}
    for path in sorted((Path(kernelset.REPO_ROOT) / "preselected").glob("*.yaml")):
        for arch in ARCHS:
            keys = [e.key for e in kernelset.expand_file(path, "ck_tile", arch)]
            if keys:
                out[(path.stem, arch)] = keys
    return out


PRESELECTED = preselected_ck_tile()


def test_preselected_sets_cover_every_arch():
    sets = {s for s, _ in PRESELECTED}
    assert {"fp16_rcr_essential", "bf16_rcr_essential", "int8_rcr_essential", "fp8_rcr_essential",
            "conv_fp16_fwd_essential", "conv_fp16_bwd_essential", "conv_fp16_all_essential"} <= sets
    for arch in ARCHS:
        assert ("fp16_rcr_essential", arch) in PRESELECTED and ("conv_fp16_all_essential", arch) in PRESELECTED
    # every conv direction and rank on every arch
    for arch in ARCHS:
        convs = {(k.signature.direction, k.signature.spatial_dims) for k in PRESELECTED[("conv_fp16_all_essential", arch)]}
        assert convs == {(d, s) for d in ("fwd", "bwd_data", "bwd_weight") for s in (1, 2, 3)}


@pytest.mark.parametrize("set_arch", sorted(PRESELECTED), ids=lambda sa: f"{sa[0]}-{sa[1]}")
def test_every_preselected_config_renders(set_arch):
    for key in PRESELECTED[set_arch]:
        assert parse_kernel_name(key.name) == key
        text = codegen.render(key)
        assert key.to_json() in text                       # the .so reports its own key
        assert f"__{key.arch}__" in text                     # and refuses to compile for another arch
        assert 'TD_EXPORT_KERNEL(R"TDKEY(' in text             # the ABI's five functions
        pipeline_class, _ = ck_common._PIPELINE[key.algorithm.pipeline]
        assert f"ck_tile::{pipeline_class}<Problem>" in text
        tile = ", ".join(map(str, key.algorithm.tile))
        assert f"kTileM = {key.algorithm.tile[0]}, kTileN = {key.algorithm.tile[1]}, kTileK = {key.algorithm.tile[2]}" in text, tile
        if key.signature.op == "conv":
            assert ck_common._CONV_KERNEL[key.signature.direction] in text
        # templates stay dumb: no Jinja left, nothing undeclared rendered
        assert "{{" not in text and "{%" not in text


def _gemm(arch="gfx942", dtypes=("fp16", "fp16", "fp16", "fp32"), layout="rcr", tile=(128, 128, 32), warps=(2, 2, 1),
          mma=(32, 32, 16), pipeline="compv3", scheduler="intrawave", epilogue=Epilogue(), extras=None) -> KernelKey:
    """A key; `extras` without the "ck_tile." prefix."""
    return KernelKey(Signature("gemm", *dtypes, layout, epilogue),
                     Algorithm(tile, pipeline, warps, mma, scheduler,
                               extras=tuple((f"ck_tile.{k}", v) for k, v in (extras or {}).items())), "ck_tile", arch)


def _conv(direction="fwd", dims=2, arch="gfx942", pipeline="compv3", **kw) -> KernelKey:
    key = _gemm(arch=arch, pipeline=pipeline, **kw)
    sig = key.signature
    return key.replace(signature=Signature("conv", sig.dtype_a, sig.dtype_b, sig.dtype_c, sig.dtype_acc, "nhwgc",
                                           sig.epilogue, direction, dims))


# One illegal key per rule; each must be rejected naming that rule (and render must refuse it).
ILLEGAL = {
    "ck_tile.arch": _gemm(arch="gfx908"),
    "ck_tile.dtypes": _conv(dtypes=("fp32", "fp32", "fp32", "fp32"), mma=(16, 16, 16)),
    "ck_tile.layout": _gemm(layout="rrc"),
    "ck_tile.pipeline": _gemm(pipeline="compv5"),
    "ck_tile.fixed.split_k": _gemm().replace(algorithm=Algorithm((128, 128, 32), "compv3", (2, 2, 1), (32, 32, 16),
                                                                 "intrawave", split_k=2)),
    "ck_tile.extras.epilogue": _gemm(extras={"epilogue": "fancy"}),
    "ck_tile.wave_layout": _gemm(arch="gfx942", tile=(256, 256, 32), warps=(4, 4, 1)),
    "ck_tile.warp_tile": _gemm(mma=(32, 32, 12), tile=(128, 128, 24)),
    "ck_tile.fp8_encoding": _gemm(arch="gfx942", dtypes=("fp8e4m3", "fp8e4m3", "fp16", "fp32"), tile=(128, 128, 64)),
    "ck_tile.int8_mfma": _gemm(arch="gfx90a", dtypes=("int8", "int8", "int32", "int32"), tile=(128, 128, 64)),
    "ck_tile.block_size": _gemm(arch="gfx950", tile=(256, 128, 32), warps=(8, 4, 1)),   # 2048 threads
    "ck_tile.tile_divisible": _gemm(tile=(128, 100, 32)),
    "ck_tile.min_tile": _gemm(arch="gfx950", tile=(16, 16, 4), warps=(1, 1, 1), mma=(16, 16, 4),
                              dtypes=("fp32", "fp32", "fp32", "fp32")),
    "ck_tile.lds_budget": _gemm(tile=(256, 256, 64), pipeline="compv4"),
    "ck_tile.scheduler": _gemm(scheduler="roundrobin"),
    "ck_tile.pipeline_scheduler": _gemm(pipeline="compv3", scheduler="interwave"),
    "ck_tile.cshuffle_odd_repeat": _gemm(tile=(192, 128, 32)),
    "ck_tile.pad_k_col_b": _gemm(layout="rcr", extras={"pad_k": True}),
    "ck_tile.epilogue_fusion": _gemm(epilogue=Epilogue("relu", True, 0)),
    "ck_tile.gemm_vectors": _gemm(extras={"vector_a": 8}),
    "ck_tile.conv_pipeline": _conv(direction="bwd_data", pipeline="compv4"),
    "ck_tile.conv_traits": _conv(extras={"pad_m": True}),
    "ck_tile.conv_vectors": _conv(extras={"vector_a": 16}),
    "ck_tile.conv_transposed_vectors": _conv(direction="bwd_weight", extras={"vector_a": 4}),
}
# the wave-layout rule is per arch: 4x4x1 is legal on gfx950 only
ILLEGAL_ELSEWHERE = {"ck_tile.wave_layout": _gemm(arch="gfx950", tile=(256, 256, 32), warps=(4, 4, 1))}


@pytest.mark.parametrize("rule_id", sorted(ILLEGAL))
def test_illegal_config_names_its_rule(rule_id):
    key = ILLEGAL[rule_id]
    ids = [v.rule for v in rules.check(key)]
    assert rule_id in ids, (key.name, ids)
    with pytest.raises(ValueError, match=re.escape(rule_id)):
        codegen.render(key)


def test_every_rule_in_the_yaml_has_a_test():
    data = rules.backend_rules("ck_tile")  # its rules.yaml and its families'
    assert {r["id"] for r in data["rules"]} <= set(ILLEGAL)


def test_arch_dependent_rules_accept_what_the_arch_has():
    assert not rules.check(ILLEGAL_ELSEWHERE["ck_tile.wave_layout"])
    assert not rules.check(_gemm(arch="gfx950", dtypes=("fp8e4m3", "fp8e4m3", "fp16", "fp32"), tile=(128, 128, 64)))
    assert not rules.check(_gemm(arch="gfx942", dtypes=("int8", "int8", "int32", "int32"), tile=(128, 128, 64)))
    assert not rules.check(_gemm(arch="gfx950", tile=(256, 256, 64), pipeline="compv4"))   # 160 KiB of LDS
    assert not rules.check(_gemm(pipeline="mem", scheduler="interwave"))
    assert not rules.check(_conv(direction="bwd_weight", dims=3, pipeline="mem"))
    assert not rules.check(_conv(direction="bwd_data", extras={"vector_a": 4, "vector_c": 2}))
    assert rules.check(_conv(direction="bwd_data", extras={"vector_b": 4}))
    assert not rules.check(_conv(direction="fwd", extras={"vector_a": 1, "vector_b": 1, "vector_c": 1}))


def test_illegal_config_in_a_kernel_set_names_file_and_rule(tmp_path):
    path = tmp_path / "bad_set.yaml"
    path.write_text(yaml.safe_dump({
        "schema": 1, "name": "bad_set", "description": "x",
        "groups": [{"backend": "ck_tile", "arch": "gfx942", "op": "gemm", "dtype": "fp16", "layout": "rcr",
                    "tile": [128, 128, 32], "warps": [2, 2, 1], "mma": [32, 32, 16], "pipeline": "compv3",
                    "scheduler": "interwave"}]}))
    with pytest.raises(SpecError, match=r"bad_set\.yaml.*groups\[0\].*ck_tile\.pipeline_scheduler"):
        kernelset.expand_file(path, "ck_tile", "gfx942")


def test_symbol_map():
    ctx = _context(_gemm(arch="gfx950", dtypes=("fp8e4m3", "fp8e5m2", "fp16", "fp32"), tile=(128, 128, 64),
                                pipeline="compv4", layout="crr"))
    assert ctx["ck_type"] == {"a": "ck_tile::fp8_t", "b": "ck_tile::bf8_t", "c": "ck_tile::half_t", "acc": "float"}
    assert ctx["double_smem"] and ctx["pipeline_class"] == "GemmPipelineAgBgCrCompV4"
    assert ctx["layout"]["a"].endswith("ColumnMajor") and ctx["layout"]["b"].endswith("RowMajor")
    assert ctx["lds_bytes"] == 163840 and ctx["cshuffle"]
    conv = _context(_conv(direction="bwd_data", dims=3))
    assert conv["gemm_roles"] == {"a": "Y", "b": "W", "c": "X"}
    assert conv["conv_layout"] == {"in": "NDHWGC", "wei": "GKZYXC", "out": "NDHWGK"}
    assert conv["vector"] == {"a": 8, "b": 8, "c": 8}          # 16 bytes of fp16
    assert _context(_conv(extras={"vector_b": 4}))["vector"]["b"] == 4


FAKE_CHECK = ck_tile.CheckToolchain(compiler="/usr/bin/clang-19", identity="fake", include_dirs=("/ck", "/hip"),
                                    zig="/zig/zig", resource_dir="/res")


@pytest.mark.parametrize("arch", ARCHS)
def test_check_command_follows_the_recipe(arch):
    cmd = ck_tile.check_command(_gemm(arch=arch), FAKE_CHECK, "k.hip", "k.check")
    assert cmd[:2] == ["sh", "-c"] and cmd[3] == "k.check"      # the output is a stamp written on success
    compile_ = cmd[4:]
    assert compile_[:2] == (["/zig/zig", "clang"] if arch == "gfx950" else ["/usr/bin/clang-19", "-target"])
    for flag in (f"--offload-arch={arch}", "-emit-llvm", "-S", "-O0", "-DNDEBUG", "-nogpulib", "--cuda-device-only",
                 "-std=c++20", "--rocm-path=/usr"):
        assert flag in compile_, flag
    assert compile_[compile_.index("-resource-dir") + 1] == "/res"
    assert compile_[-1] == "k.hip" and compile_[compile_.index("-o") + 1] == "/dev/null"


def test_compile_command_for_a_real_build():
    tc = Toolchain(compiler="/opt/rocm/bin/hipcc", identity="x", include_dirs=("/opt/rocm/include",))
    cmd = ck_tile.compile_command(_gemm(arch="gfx90a"), tc, "k.hip", "k.so", ["/abi"])
    for flag in ("--offload-arch=gfx90a", "-O3", "-DNDEBUG", "-fPIC", "-shared", "-isystem/opt/rocm/include", "-I/abi"):
        assert flag in cmd, flag
    assert cmd[0] == "/opt/rocm/bin/hipcc" and cmd[-2:] == ["-o", "k.so"]


def test_missing_rocm_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    monkeypatch.delenv("HIPCC", raising=False)
    monkeypatch.delenv("CK_TILE_INCLUDE", raising=False)
    ck_tile.toolchain.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="no HIP compiler"):
            ck_tile.toolchain()
        ok, why = ck_tile.available()
        assert not ok and "hipcc" in why
    finally:
        ck_tile.toolchain.cache_clear()


def test_missing_check_pieces_name_the_install_script(monkeypatch, tmp_path):
    monkeypatch.setenv("TD_CK_CHECK_DIR", str(tmp_path))
    for var in ("TD_ZIG", "TD_CK_TILE_INCLUDE", "TD_HIP71_INCLUDE"):
        monkeypatch.delenv(var, raising=False)
    ck_tile.check_toolchain.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"install_ck_check\.sh"):
            ck_tile.check_toolchain()
    finally:
        ck_tile.check_toolchain.cache_clear()


def test_rocm_toolchain_identity_covers_compiler_and_headers(monkeypatch, tmp_path):
    rocm = tmp_path / "rocm"
    (rocm / "bin").mkdir(parents=True)
    hipcc = rocm / "bin" / "hipcc"
    hipcc.write_text("#!/bin/sh\necho 'HIP version: 6.4.1'\necho 'AMD clang version 19.0.0git'\n")
    hipcc.chmod(0o755)
    (rocm / ".info").mkdir()
    (rocm / ".info" / "version").write_text("6.4.1\n")
    header = rocm / "include" / "ck_tile" / "core.hpp"
    header.parent.mkdir(parents=True)
    header.write_text("// v1\n")
    monkeypatch.setenv("ROCM_PATH", str(rocm))
    for var in ("HIPCC", "CK_TILE_INCLUDE"):
        monkeypatch.delenv(var, raising=False)
    try:
        ck_tile.toolchain.cache_clear()
        ck_tile._tree_hash.cache_clear()
        tc = ck_tile.toolchain()
        assert tc.compiler == str(hipcc) and tc.include_dirs == (str(rocm / "include"),)
        for part in ("HIP version: 6.4.1", "AMD clang version 19.0.0git", "ROCm 6.4.1", "sha256:"):
            assert part in tc.identity, part
        header.write_text("// v2\n")     # another CK version: another build identity
        ck_tile.toolchain.cache_clear()
        ck_tile._tree_hash.cache_clear()
        assert ck_tile.toolchain().identity != tc.identity
        ok, why = toolchains.available("ck_tile")     # compiler and headers, but no GPU here
        assert ok == Path("/dev/kfd").exists(), why
    finally:
        ck_tile.toolchain.cache_clear()
        ck_tile._tree_hash.cache_clear()
