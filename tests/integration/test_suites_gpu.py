"""bench/benchmarks/suite.py on an NVIDIA GPU, for a few real layers and shapes of the issue #20 suites: every point is
measured or reported as having no kernel, none gives a wrong result, the peer of each comes from both processes.

Marked gpu; skipped without torch + CUDA or without prebuilt bundles: $TD_CUTLASS_CONV_BUNDLE (fp16 conv kernels,
e.g. build/gpu/suite_conv of bench/benchmarks/suite_gpu_run.sh) and $TD_CUTLASS_BUNDLE (fp16 GEMM kernels).
"""
from __future__ import annotations

import json
import os
import re

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from test_suites import CONV, smallest_layers, suite_runner  # noqa: E402

pytestmark = pytest.mark.gpu


def bundle(variable: str) -> str:
    path = os.environ.get(variable)
    if not path:
        pytest.skip(f"${variable} names no prebuilt bundle")
    return path


def test_conv_points_on_the_gpu(tmp_path):
    ids = smallest_layers()
    only = "^(" + "|".join(map(re.escape, ids)) + ")$"
    assert suite_runner.main(["conv", bundle("TD_CUTLASS_CONV_BUNDLE"), "--out", str(tmp_path), "--only", only]) == 0
    result = json.loads((tmp_path / "conv.json").read_text())
    assert len(result["rows"]) == sum(len(e["directions"]) for e in CONV["layers"] if e["id"] in ids)
    assert {r["status"] for r in result["rows"]} <= {"ok", "no kernel"}
    timed = [r for r in result["rows"] if r["status"] == "ok"]
    assert timed and all(any(name.endswith("@2") for name in r["peer_ms"]) for r in timed)  # two processes
    assert result["machine"]["gpu"] and result["machine"]["cudnn"]


def test_gemm_points_on_the_gpu(tmp_path):
    args = ["gemm", bundle("TD_CUTLASS_BUNDLE"), "--out", str(tmp_path), "--only", "^fwd_(1|2048)x4096x4096_",
            "--dtypes", "fp16"]
    assert suite_runner.main(args) == 0
    rows = json.loads((tmp_path / "gemm.json").read_text())["rows"]
    assert len(rows) == 2 and {r["status"] for r in rows} == {"ok"}
    assert all(r["speedup"] > 0.1 and r["kernel_ms"] > 0 for r in rows)
