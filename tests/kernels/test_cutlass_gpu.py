"""cutlass kernels on an NVIDIA GPU, end to end through the runtime (td.load -> Registry.gemm).

Marked gpu; skipped without torch + CUDA. The bundle comes from $TD_CUTLASS_BUNDLE (a built cutlass
bundle for this GPU's arch), else one small kernel set is built here with scons (a few minutes).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

import tiledispatch as td  # noqa: E402
from tiledispatch import backends, cuda  # noqa: E402
from tiledispatch.generator import toolchains  # noqa: E402

from conftest import REPO, scons  # noqa: E402

pytestmark = pytest.mark.gpu

SMALL_SET = """schema: 1
name: cutlass_gpu_test
description: two fp16 rcr kernels for the GPU tests
groups:
  - backend: cutlass
    arch: sm90a
    op: gemm
    dtype: fp16
    layout: rcr
    configs:
      - {tile: [128, 128, 64], warps: [8, 1, 1], mma: [64, 128, 16], pipeline: tma_ws_cooperative, scheduler: stream_k}
      - {tile: [64, 128, 64], warps: [4, 1, 1], mma: [64, 128, 16], pipeline: tma_ws_pingpong, scheduler: persistent,
         epilogue: {activation: relu, bias: true}}
  - backend: cutlass
    arch: sm80
    op: gemm
    dtype: fp16
    layout: rcr
    pipeline: multistage
    scheduler: data_parallel
    tile: [128, 128, 32]
    warps: [2, 2, 1]
    mma: [16, 8, 16]
"""


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    path = os.environ.get("TD_CUTLASS_BUNDLE")
    if not path:
        try:
            toolchains.get("cutlass").toolchain()
        except RuntimeError as e:
            pytest.skip(f"no prebuilt bundle ($TD_CUTLASS_BUNDLE) and no toolchain: {e}")
        build = tmp_path_factory.mktemp("cutlass_gpu")
        spec = build / "set.yaml"
        spec.write_text(SMALL_SET)
        arch = backends.get("cutlass").detect_arch()
        scons(REPO, f"kernels={spec}", "backend=cutlass", f"arch={arch}", f"build_dir={build}",
              f"cache_dir={build / 'cache'}", "bundle=b")
        path = str(build / "b")
    return td.load(Path(path))


def rcr(m, n, k, dtype=torch.float16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.rand((m, k), generator=g, device="cuda") * 2 - 1).to(dtype)
    bt = (torch.rand((n, k), generator=g, device="cuda") * 2 - 1).to(dtype)
    return a, bt.t()


def relerr(out, ref):
    return float(torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref))


def test_device_arch_matches_bundle(registry):
    assert cuda.device_arch() in ("sm90a", "sm80")
    assert backends.get("cutlass").runnable(registry.arch)[0]


def test_gemm_torch_in_place_on_current_stream(registry):
    a, b = rcr(1000, 1008, 1024)
    out = torch.full((1000, 1008), float("nan"), dtype=torch.float16, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        result = registry.gemm(a, b, out=out)
    stream.synchronize()
    assert result is out
    assert relerr(out, a.double() @ b.double()) < 2e-3


def test_gemm_alpha_beta(registry):
    a, b = rcr(272, 208, 336, seed=1)
    c = torch.rand((272, 208), device="cuda").half()
    out = torch.full_like(c, float("nan"))
    registry.gemm(a, b, out=out, c=c, alpha=0.5, beta=-2.0)
    torch.cuda.synchronize()
    assert relerr(out, 0.5 * (a.double() @ b.double()) - 2.0 * c.double()) < 2e-3


def test_misaligned_problem_runs_only_on_narrow_alignment_kernels(registry):
    """K = 73: rows of 146 bytes. A kernel reading 16-byte rows (TMA, 8-element cp.async) refuses the problem when
    named; one with a narrower access (the xalign variants) runs it; the default call takes such a kernel when the
    bundle has one and refuses the problem otherwise."""
    from tiledispatch.ops.gemm import GemmProblem

    m, n, k = 64, 64, 73
    a, b = rcr(m, n, k, seed=4)
    ref = a.double() @ b.double()
    problem = GemmProblem(m, n, k, "fp16", "fp16", "fp16", "rcr")
    narrow, refused = 0, 0
    for kern in registry.kernels:
        if problem.mismatch(kern.key) is not None:
            continue
        out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
        if backends.family_of(kern.key).module.refusal(problem, kern.key) is not None:
            with pytest.raises(td.UnsupportedProblemError, match="not a multiple of"):
                registry.gemm(a, b, out=out, kernel=kern.name)
            refused += 1
        else:
            registry.gemm(a, b, out=out, kernel=kern.name)
            torch.cuda.synchronize()
            assert relerr(out, ref) < 2e-3, kern.name
            narrow += 1
    assert refused, "every bundle here has a 16-byte-row kernel for fp16 rcr"
    if narrow:
        out = registry.gemm(a, b)
        torch.cuda.synchronize()
        assert relerr(out, ref) < 2e-3
    else:
        with pytest.raises(td.UnsupportedProblemError, match="multiple of 8"):
            registry.gemm(a, b)


def test_numpy_inputs_are_copied(registry):
    np = pytest.importorskip("numpy")
    a = np.random.default_rng(0).uniform(-1, 1, (128, 256)).astype(np.float16)
    b = np.asfortranarray(np.random.default_rng(1).uniform(-1, 1, (256, 192)).astype(np.float16))
    try:
        out = registry.gemm(a, b)
    except td.InvalidInputError as e:  # the runtime may refuse host arrays for a GPU bundle
        pytest.skip(f"runtime does not copy numpy arrays to the device: {e}")
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert np.linalg.norm(np.asarray(out, dtype=np.float64) - ref) / np.linalg.norm(ref) < 2e-3


def test_cuda_module_memory_round_trip():
    import numpy as np

    host = np.swapaxes(np.arange(24, dtype=np.float32).reshape(2, 3, 4), 1, 2)  # dense, not C-ordered
    dev = cuda.DeviceArray(host)
    assert dev.__cuda_array_interface__["strides"] == host.strides
    assert (dev.to_host() == host).all()
    ptr = cuda.workspace(1000)
    assert ptr and cuda.workspace(10) == ptr  # grown only, reused
    timer = cuda.Timer()
    timer.start()
    timer.stop()
    assert timer.elapsed_ms() >= 0


def test_every_kernel_by_name(registry):
    """Each fp16 rcr identity kernel of the bundle, named explicitly (stream-K ones need a workspace)."""
    a, b = rcr(528, 784, 1040, seed=3)
    ref = a.double() @ b.double()
    ran = 0
    for kern in registry.kernels:
        sig = kern.key.signature
        if (sig.dtype_a, sig.layout, sig.epilogue.activation, sig.epilogue.bias, sig.epilogue.residuals) != \
                ("fp16", "rcr", "identity", False, 0):
            continue
        out = torch.full((528, 784), float("nan"), dtype=torch.float16, device="cuda")
        registry.gemm(a, b, out=out, kernel=kern.name)
        torch.cuda.synchronize()
        assert relerr(out, ref) < 2e-3, kern.name
        ran += 1
    assert ran


def test_cupy_arrays_in_place(registry):
    cupy = pytest.importorskip("cupy")
    rng = cupy.random.default_rng(5)
    a = rng.uniform(-1, 1, (256, 512), dtype=cupy.float32).astype(cupy.float16)
    b = cupy.asfortranarray(rng.uniform(-1, 1, (512, 384), dtype=cupy.float32).astype(cupy.float16))
    out = cupy.full((256, 384), cupy.nan, dtype=cupy.float16)
    with cupy.cuda.Stream(non_blocking=True) as s:
        registry.gemm(a, b, out=out)
        s.synchronize()
    ref = a.astype(cupy.float64) @ b.astype(cupy.float64)
    assert float(cupy.linalg.norm(out.astype(cupy.float64) - ref) / cupy.linalg.norm(ref)) < 2e-3


def test_numpy_through_device_arrays(registry):
    """numpy inputs with explicit copies: tiledispatch.cuda.DeviceArray in, to_host() out."""
    import numpy as np

    rng = np.random.default_rng(2)
    a = rng.uniform(-1, 1, (192, 320)).astype(np.float16)
    b = np.asfortranarray(rng.uniform(-1, 1, (320, 256)).astype(np.float16))
    da, db = cuda.DeviceArray(a), cuda.DeviceArray(b)
    dout = cuda.DeviceArray(np.full((192, 256), np.nan, dtype=np.float16))
    registry.gemm(da, db, out=dout)
    cuda.synchronize()
    out = dout.to_host().astype(np.float64)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-3


def test_autotune_on_the_gpu(registry, tmp_path):
    """Tuning times candidates with CUDA events on the caller's stream (paced and queued), records the winner under this
    GPU's identity, and the result of the tuned call is still right (beta != 0: the output is restored)."""
    from tiledispatch import tuning

    cache = tmp_path / "tuning.json"
    reg = td.Registry(registry.kernels, registry.backend, registry.arch, registry.manifest, autotune=True,
                      tuning_cache=tuning.TuningCache(cache))
    a, b = rcr(512, 384, 256, seed=3)
    c = torch.rand((512, 384), device="cuda").half()
    out = c.clone()
    reg.gemm(a, b, out=out, c=out, beta=1.0)
    torch.cuda.synchronize()
    assert relerr(out, a.double() @ b.double() + c.double()) < 2e-3
    devices = json.loads(cache.read_text())["devices"]
    (device,) = devices
    assert device.startswith("cuda:") and torch.cuda.get_device_name() in device
    (rec,) = devices[device].values()
    assert rec["kernel"] in {k.name for k in reg.kernels} and all(t > 0 for t in rec["times_ms"].values())
    # timed at the caller's pace and queued (the GPU alone): the queued time is never the longer by much
    assert set(rec["gpu_times_ms"]) == set(rec["times_ms"])
    assert all(0 < rec["gpu_times_ms"][k] < 1.1 * rec["times_ms"][k] for k in rec["times_ms"])
