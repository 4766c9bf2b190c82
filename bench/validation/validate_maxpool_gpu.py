"""Validate every maxpool kernel of a bundle on the GPU: each kernel on every case it accepts (1D / 2D / 3D maps,
channel counts aligned to 16 bytes or not, channels of a wider buffer, pointers one element off alignment; windows
with stride, padding, dilation and ceil_mode), on random maps with NaNs and a poisoned output, against torch's
F.max_pool on the same data, element for element (a maximum is exact: NaN where torch has NaN, the same values
elsewhere). The cases a kernel refuses are recorded with its reason, and every case must run on some kernel.

    python3 bench/validation/validate_maxpool_gpu.py --bundle DIR [--out DIR] [--device cpu]

(--device cpu: the same cases on a cpu bundle, for checking this script where there is no GPU.)
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from _gpu_common import TORCH_DTYPE, validate_case, validator_args, write_validation  # noqa: E402

import tiledispatch as td  # noqa: E402
from tiledispatch.ops import maxpool as pool_op  # noqa: E402

# (N, spatial, window, stride, padding, dilation, ceil_mode)
GEOMETRIES = [(2, (112, 112), 3, 2, 1, 1, False), (3, (7, 9), 2, 2, 0, 1, True), (1, (9, 10), 3, 1, 1, 2, False),
              (2, (13,), 3, 2, 1, 1, True), (1, (5, 6, 7), (3, 2, 2), (2, 1, 1), (1, 1, 0), 1, False)]
CHANNELS = (1, 3, 8, 64, 100)
POOLS = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def case_tensor(n, spatial, c, dtype, how, gen, device):
    """x [N, spatial..., C] with a few NaNs: dense, 'strided' (the channels of a wider buffer) or 'offset' (one
    element past 16-byte alignment)."""
    wide, shift = (c + 8 if how == "strided" else c), (1 if how == "offset" else 0)
    count = n * wide * int(torch.tensor(spatial).prod())
    buf = torch.empty(count + shift, dtype=dtype, device=device)
    x = buf[shift:].view(n, *spatial, wide)[..., :c]
    values = torch.randn(n, *spatial, c, generator=gen, device=device) * 4
    values.view(-1)[::97] = float("nan")
    x.copy_(values)
    return x


def main(argv=None) -> int:
    a = validator_args(__doc__, argv)
    device = a.device
    reg = td.load(a.bundle)
    kernels = [k for k in reg.kernels if k.key.signature.op == "maxpool"]
    gen = torch.Generator(device=device).manual_seed(0)
    results, uncovered = [], []
    for dtype in sorted({k.key.signature.dtype_a for k in kernels}):
        mine = [k for k in kernels if k.key.signature.dtype_a == dtype]
        for (n, spatial, window, stride, padding, dilation, ceil_mode), c, how in itertools.product(
                GEOMETRIES, CHANNELS, ("dense", "strided", "offset")):
            x = case_tensor(n, spatial, c, TORCH_DTYPE[dtype], how, gen, device)
            geo = (window, stride, padding, dilation)
            ref = POOLS[len(spatial)](x.movedim(-1, 1), *geo, ceil_mode=ceil_mode).movedim(1, -1)
            out = torch.full(ref.shape, 12345.0, dtype=x.dtype, device=device)  # poisoned: no valid max

            def run_one(k, x=x, geo=geo, ceil_mode=ceil_mode, out=out, ref=ref):
                out.fill_(12345.0)
                reg.max_pool(x, *geo, ceil_mode=ceil_mode, out=out, kernel=k)
                return {"passed": bool(torch.equal(torch.isnan(out), torch.isnan(ref))
                                       and torch.equal(out.nan_to_num(0.0), ref.nan_to_num(0.0)))}

            problem, operands = pool_op.operands(x, *geo, ceil_mode, out)
            if not validate_case(reg, problem, operands, mine, {"dtype": dtype, "problem": str(problem), "case": how},
                                 run_one, results):
                uncovered.append(f"{dtype} {problem} {how}")
    return write_validation(a, results, uncovered, "validate_maxpool")

if __name__ == "__main__":
    sys.exit(main())
