"""PyTorch's max pooling on channels-last fp16 maps, in every formulation PyTorch offers (a diagnostic, no
tiledispatch call): F.max_pool2d on the channels-last tensor (the NHWC kernel), on a contiguous copy (the NCHW
kernel; the copy not timed), max_pool3d on the channels-last memory viewed as [N, 1, H, W, C] (pooled over H and W,
C a unit window), and maxima of strided slices of a -inf padded copy. Each is checked equal to F.max_pool2d and
timed in a CUDA graph (_gpu_common.graph_us: 20 calls per replay, median of 10 replays), beside the time of reading
the input and writing the output once at 4 TB/s. Maps: ResNet-50's stem pool, GoogLeNet's and Inception's, a 2 x 2 pool and a
stride-1 pool.

    python bench/benchmarks/pool_probe.py        # JSON to $OUT/pool_probe.json (or bench/results/pool_probe.json)
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _gpu_common import graph_us  # noqa: E402

torch.backends.cudnn.benchmark = True
MAPS = (((32, 64, 112, 112), 3, 2, 1), ((32, 192, 56, 56), 3, 2, 1), ((32, 64, 56, 56), 3, 2, 1),
        ((32, 480, 28, 28), 3, 2, 1), ((32, 64, 112, 112), 2, 2, 0), ((32, 256, 56, 56), 3, 1, 1))


def pool_3d_view(x, k, s, p):
    """max_pool3d on channels-last memory viewed as [N, 1, H, W, C]: a unit window over C."""
    view = x.permute(0, 2, 3, 1).unsqueeze(1)
    assert view.is_contiguous()
    return F.max_pool3d(view, (k, k, 1), (s, s, 1), (p, p, 0)).squeeze(1).permute(0, 3, 1, 2)


def pool_slices(x, k, s, p):
    """The maximum of the k x k strided slices of a -inf padded copy."""
    padded = F.pad(x, (p, p, p, p), value=float("-inf"))
    oh, ow = (x.shape[2] + 2 * p - k) // s + 1, (x.shape[3] + 2 * p - k) // s + 1
    out = None
    for i in range(k):
        rows = padded[:, :, i:i + s * (oh - 1) + 1:s]
        for j in range(k):
            window = rows[:, :, :, j:j + s * (ow - 1) + 1:s]
            out = window if out is None else torch.maximum(out, window)
    return out


def main() -> None:
    rows = {}
    for shape, k, s, p in MAPS:
        x = torch.randn(shape, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
        ref = F.max_pool2d(x, k, s, p)
        view, sliced = pool_3d_view(x, k, s, p), pool_slices(x, k, s, p)
        contiguous = x.contiguous()
        row = {"shape": shape, "k": k, "s": s, "p": p, "equal": torch.equal(view, ref) and torch.equal(sliced, ref),
               "out_channels_last": view.is_contiguous(memory_format=torch.channels_last),
               "nhwc_us": graph_us(lambda: F.max_pool2d(x, k, s, p), 20, 1, 10),
               "view3d_us": graph_us(lambda: pool_3d_view(x, k, s, p), 20, 1, 10),
               "slices_us": graph_us(lambda: pool_slices(x, k, s, p), 20, 1, 10),
               "nchw_contig_us": graph_us(lambda: F.max_pool2d(contiguous, k, s, p), 20, 1, 10),
               "min_bytes_us_at_4TBs": (x.numel() + ref.numel()) * 2 / 4e6}
        rows[f"{shape}k{k}s{s}p{p}"] = row
        print(row, flush=True)
    out = os.path.join(os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "..", "results")), "pool_probe.json")
    with open(out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
