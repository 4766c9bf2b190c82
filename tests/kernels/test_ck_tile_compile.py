"""ck_tile compile check (front end + device LLVM IR, not a build) of a small sample, and the negative
controls that must fail it. Skipped unless .ci/install_ck_check.sh has installed clang-19, zig and the
headers. The full check of every preselected ck_tile config runs through
`scons kernels=<sets> backend=ck_tile arch=<arch> check=1` (or scripts/ck_check.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tiledispatch.generator import toolchains

ck_tile = toolchains.get("ck_tile")
from tiledispatch.generator import rules
from tiledispatch.spec.key import parse_kernel_name

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import ck_check  # noqa: E402

try:
    TOOLCHAIN, WHY = ck_tile.check_toolchain(), ""
except RuntimeError as e:
    TOOLCHAIN, WHY = None, str(e)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(TOOLCHAIN is None, reason=f"ck_tile compile-check toolchain missing: {WHY}")]

# One of each compiler (clang-19 for gfx90a/gfx942, zig's clang 22 for gfx950), pipeline and kernel family.
SAMPLE = [
    "gemm_fp16xfp16xfp16xfp32_rcr_identity_cktile_gfx90a_t32x64x32_w2x2x1_i16x16x16_pmem_sinterwave_k1_c1x1x1_st0"
    "_xpadm1_xpadn1",
    "gemm_fp8e4m3xfp8e4m3xfp16xfp32_rcr_identity_cktile_gfx950_t128x128x64_w2x2x1_i32x32x16_pcompv4_sintrawave_k1"
    "_c1x1x1_st0",
    "conv2dbwdd_fp16xfp16xfp16xfp32_nhwgc_identity_cktile_gfx942_t128x128x32_w2x2x1_i32x32x16_pcompv3_sintrawave_k1"
    "_c1x1x1_st0",
]


def test_sample_passes_the_compile_check(tmp_path):
    keys = [parse_kernel_name(n) for n in SAMPLE]
    for key in keys:
        assert not rules.check(key), key.name
    results = ck_check.check_keys(keys, jobs=2, workdir=str(tmp_path), progress=None)
    failed = {r.name: r.log[-3000:] for r in results if not r.ok}
    assert not failed, failed
    for key in keys:  # the stamp says what was done
        assert "not a build" in (tmp_path / f"{key.name}.check").read_text()


# gfx942 through clang-19 and gfx950 through zig: both compilers must reject illegal code.
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_negative_controls_fail_the_compile_check(tmp_path, arch):
    controls = ck_check.negative_controls(arch)
    for key, why in controls:
        assert rules.check(key), f"control is legal: {why}"
    texts = {k.name: ck_check.render_unchecked(k) for k, _ in controls}
    results = ck_check.check_keys([k for k, _ in controls], jobs=2, workdir=str(tmp_path), texts=texts, progress=None)
    expected_error = {"warp tile 32x32x12": "WarpGemmDispatcher", "block tile N 100": "static assertion failed",
                      "compv4 256x256x128": "fits_lds"}
    for (key, why), result in zip(controls, results):
        assert not result.ok, f"negative control compiled: {why} ({key.name})"
        marker = next(v for k, v in expected_error.items() if why.startswith(k))
        assert marker in result.log, result.log[-3000:]
        assert not (tmp_path / f"{key.name}.check").exists()    # no stamp for a failed check


def test_source_refuses_another_arch(tmp_path):
    """Device code guarded by arch macros compiles to nothing for a wrong arch and would pass trivially:
    the generated source stops such a check with an #error."""
    key = parse_kernel_name(SAMPLE[2])             # a gfx942 kernel
    src = tmp_path / "k.hip"
    src.write_text(ck_check.codegen.render(key))
    cmd = ck_tile.check_command(key, TOOLCHAIN, str(src), str(tmp_path / "k.check"))
    cmd = [a.replace("--offload-arch=gfx942", "--offload-arch=gfx90a") for a in cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode != 0 and "generated for gfx942" in proc.stderr, proc.stderr[-2000:]
