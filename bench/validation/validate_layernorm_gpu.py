"""Validate every layernorm kernel of a bundle on the GPU: each kernel on every case it accepts (rows, row lengths
it holds or not, 16-byte aligned or not, rows with a stride, in place), on random rows of different means and
spreads with a poisoned output, against a float64 LayerNorm (the backend's tolerance on the relative error); the
cases a kernel refuses are recorded with its reason, and every case must run on at least one kernel.

    python3 bench/validation/validate_layernorm_gpu.py --bundle DIR [--out DIR] [--device cpu]

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
from tiledispatch import validation  # noqa: E402
from tiledispatch.ops import layernorm as ln_op  # noqa: E402

ROWS = (1, 7, 1000)
COLS = (1, 8, 96, 100, 768, 1000, 1024, 3000, 4096, 5000)
EPS = 1e-5


def case_tensors(rows: int, cols: int, dtype: torch.dtype, how: str, gen: torch.Generator, device: str):
    """x, out for one case: dense; 'strided' (rows of a wider buffer); 'offset' (pointers one element past 16-byte
    alignment); 'in_place' (out is x)."""
    pad = 8 if how == "strided" else 0
    shift = 1 if how == "offset" else 0
    base = torch.randn(rows * (cols + pad) + shift, generator=gen, device=device)
    x = base[shift:].view(rows, cols + pad)[:, :cols]
    x = (x * (0.5 + 3.5 * torch.rand(rows, 1, generator=gen, device=device))
         + 6 * torch.rand(rows, 1, generator=gen, device=device) - 3)
    buf = torch.empty(rows * (cols + pad) + shift, dtype=dtype, device=device)
    xs = buf[shift:].view(rows, cols + pad)[:, :cols]
    xs.copy_(x)
    if how == "in_place":
        return xs, xs
    out_buf = torch.full((rows * (cols + pad) + shift,), float("nan"), dtype=dtype, device=device)
    return xs, out_buf[shift:].view(rows, cols + pad)[:, :cols]


def main(argv=None) -> int:
    a = validator_args(__doc__, argv)
    device = a.device
    reg = td.load(a.bundle)
    kernels = [k for k in reg.kernels if k.key.signature.op == "layernorm"]
    gen = torch.Generator(device=device).manual_seed(0)
    results, uncovered = [], []
    for dtype in sorted({k.key.signature.dtype_a for k in kernels}):
        mine = [k for k in kernels if k.key.signature.dtype_a == dtype]
        for rows, cols, how in itertools.product(ROWS, COLS, ("dense", "strided", "offset", "in_place")):
            x, out = case_tensors(rows, cols, TORCH_DTYPE[dtype], how, gen, device)
            x0 = x.clone()
            w = (1 + 0.5 * torch.randn(cols, generator=gen, device=device)).to(x.dtype)
            b = (0.5 * torch.randn(cols, generator=gen, device=device)).to(x.dtype)
            ref = F.layer_norm(x0.double(), (cols,), w.double(), b.double(), EPS).cpu().numpy()

            def run_one(k, x=x, x0=x0, w=w, b=b, out=out, ref=ref, how=how):
                if how == "in_place":
                    x.copy_(x0)  # a previous kernel overwrote it
                else:
                    out.fill_(float("nan"))
                reg.layer_norm(x, w, b, out, eps=EPS, kernel=k)
                return validation.compare(out.cpu().float().numpy(), ref, k.key)

            problem, operands = ln_op.operands(x, w, b, out)
            entry = {"dtype": dtype, "rows": rows, "cols": cols, "case": how}
            if not validate_case(reg, problem, operands, mine, entry, run_one, results):
                uncovered.append(f"{dtype} {rows}x{cols} {how}")
    return write_validation(a, results, uncovered, "validate_layernorm")

if __name__ == "__main__":
    sys.exit(main())
