"""bench/benchmarks/pointwise_pools.py without a GPU: a pool's oracle is its fastest kernel, its ranked figure the
kernel the runtime's ranker puts first among the pool's, and kernels outside the pool or GEMMs outside --narrow
never count."""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from types import SimpleNamespace

from conftest import REPO
from tiledispatch import selection
from tiledispatch.ops.gemm import GemmProblem
from tiledispatch.spec.key import Epilogue, parse_kernel_name

SCRIPT = REPO / "bench" / "benchmarks" / "pointwise_pools.py"
_spec = importlib.util.spec_from_file_location("pointwise_pools", SCRIPT)
pools = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pools)


def _name(tile, pipeline, warps):
    m, n, k = tile
    return (f"gemm_fp16xfp16xfp16xfp32_rcr_identitybias_cutlass_sm90a_t{m}x{n}x{k}_w{warps}x1x1_i64x{n}x16_"
            f"ptmaws{pipeline}_spersistent_k1_c1x1x1_st0")


PING = _name((128, 64, 64), "pingpong", 4)
COOP = _name((256, 64, 64), "cooperative", 8)
NARROW_ONLY = _name((128, 32, 32), "pingpong", 4)
RESULTS = {"gemms": {
    "401408x96x16": {"peer_ms": 0.05, "kernels": {PING: {"ms": 0.10}, COOP: {"ms": 0.08}, NARROW_ONLY: {"ms": 0.04}}},
    "25088x192x32": {"peer_ms": 0.01, "kernels": {PING: {"ms": 0.02}, COOP: {"ms": 0.0125}}},
    "6272x512x256": {"peer_ms": 0.03, "kernels": {PING: {"ms": 0.03}, COOP: {"ms": 0.06}}},
}}


def _ranked_pick(shape, names):
    m, n, k = map(int, shape.split("x"))
    problem = GemmProblem(m, n, k, "fp16", "fp16", "fp16", "rcr", 1, Epilogue("identity", True, 0))
    kernels = [SimpleNamespace(key=parse_kernel_name(name), name=name) for name in names]
    return selection.learned(problem, kernels)[0].name


def test_tiles_name_kernels_by_shape_and_pipeline():
    assert pools.tile_of(PING) == "t128x64x64p" and pools.tile_of(COOP) == "t256x64x64c"


def test_a_pool_counts_only_its_kernels():
    gemms = RESULTS["gemms"]
    ranked, worst, oracle = pools.pool_quality(gemms, {"t128x64x64p", "t256x64x64c"})
    # the oracle ignores the faster kernel outside the pool (0.04 ms on the first GEMM)
    assert math.isclose(oracle, (0.05 / 0.08 * 0.01 / 0.0125 * 0.03 / 0.03) ** (1 / 3))
    picks = [gemms[s]["kernels"][_ranked_pick(s, [PING, COOP])]["ms"] for s in gemms]
    expected = [gemms[s]["peer_ms"] / ms for s, ms in zip(gemms, picks)]
    assert math.isclose(ranked, math.exp(sum(map(math.log, expected)) / 3)) and worst == min(expected)
    assert ranked <= oracle
    _, _, every = pools.pool_quality(gemms, set())  # the empty pool: every kernel
    assert every > oracle


def test_the_command_filters_narrow_gemms(tmp_path):
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(RESULTS))
    out = subprocess.run([sys.executable, str(SCRIPT), str(path), "--narrow", "48", "--pool", "ping=t128x64x64p"],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("2 GEMMs") and "ping" in out
    assert f"oracle {math.sqrt(0.05 / 0.10 * 0.01 / 0.02):.3f}" in out
