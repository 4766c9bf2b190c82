"""A pack of cpu + cutlass sm80 + cutlass sm90a bundles on an NVIDIA GPU: the runtime takes the bundle of this
GPU's arch, says what it skipped, and its kernels run through torch.

Marked gpu; skipped without torch + CUDA. The cutlass bundle comes from $TD_CUTLASS_BUNDLE (built for this GPU's
arch), else one kernel is built here with scons. The other cutlass arch is a bundle whose library only carries
its key (it is skipped, never opened)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

import tiledispatch as td  # noqa: E402
from tiledispatch import backends, pack  # noqa: E402
from tiledispatch.generator import toolchains  # noqa: E402

from conftest import REPO, scons  # noqa: E402
from test_pack import build_cpu_bundle, cache, key_only_bundle, NATIVE  # noqa: E402,F401

pytestmark = pytest.mark.gpu

ONE_KERNEL = """schema: 1
name: pack_gpu
description: one fp16 rcr kernel for the pack GPU test
groups:
  - backend: cutlass
    arch: {arch}
    op: gemm
    dtype: fp16
    layout: rcr
    configs:
      - {config}
"""
CONFIGS = {
    "sm90a": "{tile: [128, 128, 64], warps: [8, 1, 1], mma: [64, 128, 16], pipeline: tma_ws_cooperative, "
             "scheduler: persistent}",
    "sm80": "{tile: [128, 128, 32], warps: [2, 2, 1], mma: [16, 8, 16], pipeline: multistage, "
            "scheduler: data_parallel}",
}


@pytest.fixture(scope="module")
def gpu_bundle(tmp_path_factory) -> Path:
    path = os.environ.get("TD_CUTLASS_BUNDLE")
    if path:
        return Path(path)
    try:
        toolchains.get("cutlass").toolchain()
    except RuntimeError as e:
        pytest.skip(f"no prebuilt bundle ($TD_CUTLASS_BUNDLE) and no toolchain: {e}")
    arch = backends.get("cutlass").detect_arch()
    build = tmp_path_factory.mktemp("pack_gpu")
    spec = build / "set.yaml"
    spec.write_text(ONE_KERNEL.replace("{arch}", arch).replace("{config}", CONFIGS[arch]))
    scons(REPO, f"kernels={spec}", "backend=cutlass", f"arch={arch}", f"build_dir={build}",
          f"cache_dir={build / 'cache'}", f"bundle=cutlass_{arch}")
    return build / f"cutlass_{arch}"


def test_pack_takes_this_gpus_bundle_and_runs(gpu_bundle, cache, tmp_path):  # noqa: F811
    arch = backends.get("cutlass").detect_arch()
    other = "sm80" if arch == "sm90a" else "sm90a"
    cpu_dir = build_cpu_bundle(tmp_path / "cpu", NATIVE, "cpu_bundle")
    out = tmp_path / "multi.tdpack"
    pack.create([cpu_dir, key_only_bundle(tmp_path, "cutlass", other), gpu_bundle], out)
    reg = td.load(out)
    assert (reg.backend, reg.arch) == ("cutlass", arch), reg.summary
    skipped = {s["bundle"]: s["reason"] for s in reg.skipped}
    assert skipped["cpu_bundle"] == "the cutlass bundle is preferred here", reg.summary
    assert f"cutlass_{other}" in skipped, reg.summary
    print("\n" + reg.summary)
    m, n, k = 300, 256, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    a = (torch.rand((m, k), generator=g, device="cuda") * 2 - 1).half()
    bt = (torch.rand((n, k), generator=g, device="cuda") * 2 - 1).half()
    out_t = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
    reg.gemm(a, bt.t(), out_t)
    torch.cuda.synchronize()
    ref = a.double() @ bt.t().double()
    assert float(torch.linalg.norm(out_t.double() - ref) / torch.linalg.norm(ref)) < 1e-2
    assert not any(k.opened for k in reg.kernels if k.key.arch != arch)
