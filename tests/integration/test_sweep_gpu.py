"""The sweep on an NVIDIA GPU: a local Dask cluster with one worker per visible GPU times a cutlass bundle's GEMM
kernels through the prepared call, between CUDA events, and a rerun times nothing new.

Marked gpu; needs torch with CUDA, Dask distributed and $TD_CUTLASS_BUNDLE (a built cutlass bundle with GEMM
kernels for this GPU, e.g. build/fp16_rcr_essential)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("distributed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)
if not os.environ.get("TD_CUTLASS_BUNDLE"):
    pytest.skip("no $TD_CUTLASS_BUNDLE", allow_module_level=True)

from conftest import REPO  # noqa: E402

sys.path.insert(0, str(REPO / "bench" / "sweeps"))
import sweep  # noqa: E402

pytestmark = pytest.mark.gpu


def test_gemm_sweep_on_the_gpu(tmp_path):
    bundle = os.environ["TD_CUTLASS_BUNDLE"]
    problems = [{"problem": sweep.problem_from_dict({"m": m, "n": 1024, "k": 512}, op="gemm", dtype="fp16"),
                 "groups": ["test"]} for m in (1, 300, 2048)]
    first = sweep.sweep([bundle], "gemm", problems, out_dir=tmp_path, workers=1, log=lambda *_: None)
    metas, rows = sweep.read_store(Path(first["store"]))
    timed = [r for r in rows if r["ms"] is not None]
    assert timed and all(0 < r["ms"] < 100 and r["calls"] >= 1 for r in timed)
    # timed queued (the GPU alone) and at the host's pace, which can only add the host's gaps
    assert all(r["timing"] == "queued" and r["paced_ms"] > 0.9 * r["ms"] for r in timed)
    assert metas[0]["machine"]["gpu"] == torch.cuda.get_device_name(0) and metas[0]["machine"]["cudart"]
    assert sweep.sweep([bundle], "gemm", problems, out_dir=tmp_path, workers=1, log=lambda *_: None)["timed"] == 0
