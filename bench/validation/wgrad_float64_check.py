"""1x1 bwd_weight layers on every conv2d bwd_weight kernel of a bundle and on cuDNN, each against a float64 einsum.

    python bench/validation/wgrad_float64_check.py BUNDLE OUT.json

Written when the conv suite found ours and cuDNN 1.5e-2 apart on 2d_n32_c120_k40_65x65 1x1 bwd_weight: its pixel sum
(135,200) is an odd number of half k tiles of 64, the shape where a lost or repeated partial k tile would show. The
other layers: the same pixel count with other channels, a smaller odd image, an even one, and a small one. Result on
the H200: bench/results/conv_model_h200/wgrad_check.json (cuDNN's result was the one off).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
import tiledispatch as td  # noqa: E402
from tiledispatch.errors import TileDispatchError  # noqa: E402

LAYERS = [(32, 120, 40, 65), (32, 64, 64, 65), (8, 120, 40, 33), (32, 120, 40, 64), (4, 256, 128, 17)]  # N, C, K, H=W


def channels_last(*shape, device, fill=None):
    t = torch.randn(*shape, device=device) if fill is None else torch.full(shape, fill, device=device)
    return t.half().to(memory_format=torch.channels_last)


def main(bundle: str, out_path: str) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reg = td.load(bundle)
    names = sorted({k.name for k in reg.kernels if k.name.startswith("conv2dbwdw")})
    torch.manual_seed(0)
    rows = []
    for n, c, k, hw in LAYERS:
        x, dy = channels_last(n, c, hw, hw, device=device), channels_last(n, k, hw, hw, device=device)
        exact = torch.einsum("nchw,nkhw->kc", x.double(), dy.double())

        def rel(t):
            return float((t.double().reshape(k, c) - exact).norm() / exact.norm())

        cudnn = torch.ops.aten.convolution_backward(dy, x, torch.empty(k, c, 1, 1, device=device, dtype=torch.half),
                                                    None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                                    [False, True, False])[1]
        row = {"n": n, "c": c, "k": k, "hw": hw, "cudnn_rel": rel(cudnn), "ours": {}, "refused": {}}
        for name in names:
            w = channels_last(k, c, 1, 1, device=device, fill=float("nan"))  # poisoned: unwritten values show
            try:
                reg.conv_bwd_weight(x, dy, out=w, groups=1, kernel=name)
            except TileDispatchError as e:  # the kernel does not run this problem
                row["refused"][name] = str(e)[:160]
                continue
            row["ours"][name] = rel(w)
        default = channels_last(k, c, 1, 1, device=device, fill=float("nan"))
        reg.conv_bwd_weight(x, dy, out=default, groups=1)
        row["default_rel"] = rel(default)
        worst = max(row["ours"].values(), default=None)
        print(f"N={n} C={c} K={k} {hw}x{hw}: cudnn {row['cudnn_rel']:.2e}  ours default {row['default_rel']:.2e}, "
              f"worst of {len(row['ours'])} kernels {worst:.2e}", flush=True)
        rows.append(row)
    Path(out_path).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:3])
