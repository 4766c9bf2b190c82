"""The few-channel routes of tiledispatch.torch on the GPU: dense convs whose C is not a multiple of 8 (the
3-channel stems of ResNet-50, MobileNetV2, ConvNeXt and the 3D video models, wav2vec2's 1-channel front end, small
odd C), fwd and bwd_weight, run as the operators choose ("auto": space to depth, channel padding or as they are),
on a space-to-depth copy wherever it applies (strided layers), zero-padded as the operators choose (8- or 16-byte
vectors), to 8-byte or to 16-byte vectors only, and as they are (the generic implicit GEMM); the copies included;
against cuDNN (benchmark mode); CUDA graphs, outputs checked against float32.

    scons kernels=bench/sets/channel_padding.yaml backend=cutlass arch=sm90a bundle=channel_padding
    python3 bench/benchmarks/channel_padding.py --bundle build/channel_padding [--out DIR]  # channel_padding_<gpu>.json
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _gpu_common as gc  # noqa: E402
from models import rel_err  # noqa: E402
from stem_probe import graph_ms, setup  # noqa: E402  (models.py's CUDA-graph runner and timer)
import tiledispatch.torch as tdt  # noqa: E402

# name: (x shape, K, filter, stride, padding), from the real-workload suite's models
LAYERS = {
    "wav2vec2_conv0": ((32, 1, 16000), 512, (10,), (5,), (0,)),
    "r3d_18_stem": ((8, 3, 16, 112, 112), 64, (3, 7, 7), (1, 2, 2), (1, 3, 3)),
    "r2plus1d_18_stem": ((8, 3, 16, 112, 112), 45, (1, 7, 7), (1, 2, 2), (0, 3, 3)),
    "resnet50_stem": ((32, 3, 224, 224), 64, (7, 7), (2, 2), (3, 3)),
    "mobilenet_v2_stem": ((32, 3, 224, 224), 32, (3, 3), (2, 2), (1, 1)),
    "efficientnet_b4_stem": ((32, 3, 380, 380), 48, (3, 3), (2, 2), (1, 1)),
    "convnext_tiny_stem": ((32, 3, 224, 224), 96, (4, 4), (4, 4), (0, 0)),
    "c5_3x3": ((32, 5, 64, 64), 64, (3, 3), (1, 1), (1, 1)),
    "c12_3x3": ((32, 12, 56, 56), 64, (3, 3), (1, 1), (1, 1)),
}
# route: (the vector widths in bytes the channel padding may pad to, () for none; the space-to-depth route)
ROUTES = {"auto": ((8, 16), "auto"), "space_to_depth": ((8, 16), "on"), "padded": ((8, 16), "off"),
          "padded_8_bytes": ((8,), "off"), "padded_16_bytes": ((16,), "off"), "as_is": ((), "off")}
CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
GRAD_W = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight, 3: torch.nn.grad.conv3d_weight}


def main() -> None:
    a, reg, gen, results = setup(__doc__, "layers")
    handle = tdt.register(reg)
    default_bytes = tdt._PAD_VECTOR_BYTES
    for name, (shape, k, f, s, p) in LAYERS.items():
        rank = len(f)
        x = tdt._channels_last(gc.random_tensor(shape, "fp16", gen))
        w = tdt._channels_last(gc.random_tensor((k, shape[1], *f), "fp16", gen))
        ref = CONV[rank](x.float(), w.float(), stride=s, padding=p)
        dy = tdt._channels_last(gc.random_tensor(tuple(ref.shape), "fp16", gen))
        ref_dw = GRAD_W[rank](x.float(), w.shape, dy.float(), stride=s, padding=p)
        row = {"cudnn_fwd_ms": graph_ms(lambda: CONV[rank](x, w, stride=s, padding=p)),
               "cudnn_bwd_weight_ms": graph_ms(lambda: GRAD_W[rank](x, w.shape, dy, stride=s, padding=p))}
        for route, (vector_bytes, space_to_depth) in ROUTES.items():
            tdt._PAD_ROUTES.clear()
            reg.clear_caches()  # the eager fast path remembers an as-is call on the caller's tensors: forgotten
            tdt._PAD_VECTOR_BYTES = vector_bytes
            tdt.set_space_to_depth(space_to_depth)
            try:
                def fwd():
                    return tdt.conv(x, w, registry=reg, stride=s, padding=p)

                def bwd_weight():
                    return tdt._conv_bwd_weight(x, dy, f, s, (1,) * rank, p, p, 1, handle)
                y, dw = fwd(), bwd_weight()
                row[route] = {"channels": sorted(set(tdt._PAD_ROUTES.values())) or [0],
                              "space_to_depth": [d for d in ("fwd", "bwd_weight")
                                                 if any(k[1] == d and v for k, v in tdt._S2D_ROUTES.items())],
                              "fwd_ms": graph_ms(fwd), "fwd_rel_err": rel_err(y, ref),
                              "bwd_weight_ms": graph_ms(bwd_weight), "bwd_weight_rel_err": rel_err(dw, ref_dw)}
            finally:
                tdt._PAD_VECTOR_BYTES = default_bytes
                tdt.set_space_to_depth("auto")
            r = row[route]
            print(f"{name:17s} {route:16s} padded to {r['channels']}, space to depth {r['space_to_depth']}: fwd {r['fwd_ms']:.4f} ms (err "
                  f"{r['fwd_rel_err']:.1e})  bwd_weight {r['bwd_weight_ms']:.4f} ms "
                  f"(err {r['bwd_weight_rel_err']:.1e})", flush=True)
        print(f"{name:17s} cuDNN fwd {row['cudnn_fwd_ms']:.4f} ms, bwd_weight {row['cudnn_bwd_weight_ms']:.4f} ms",
              flush=True)
        results["layers"][name] = row
    gc.write_results(results, a.out, "channel_padding")


if __name__ == "__main__":
    main()
