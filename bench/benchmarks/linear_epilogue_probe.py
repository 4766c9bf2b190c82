"""A model's Linear layers with their bias (and GELU, or a residual add) on the GPU: fp16, the shapes read from
torchvision's model (ConvNeXt-T by default, batch 32) by hooks on its nn.Linear layers. F.linear (cuBLAS, with
torch's GELU or add) against each GEMM kernel of a bundle that computes the epilogue, the kernel Registry.gemm
selects, and the public operator tiledispatch.torch.linear (which adds bias and residual through beta * C where the
bundle has no kernel fusing them); every time in CUDA graphs (no host work), every output checked against
PyTorch's float32 result.

    scons kernels=fp16_rcr_essential,fp16_rcr_fused,bench/sets/linear_bias_probe.yaml backend=cutlass arch=sm90a \
        bundle=linear_probe
    python3 bench/benchmarks/linear_epilogue_probe.py --bundle build/linear_probe [--model convnext_tiny] [--out DIR]
        # DIR/linear_epilogue_probe_<gpu>.json, written after every layer

Why: ConvNeXt-T's Linear layers ran at 0.33-0.63x of cuBLAS per layer in the models benchmark
(bench/results/fusion_layer_scale_h200/patched_layers) where the same GEMMs without the bias reached 0.69-0.93x
(plain_gemms): the bundle had no kernel fusing a bias alone, so each call filled its output with the bias first.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _gpu_common as gc  # noqa: E402
import models  # noqa: E402
from models import rel_err  # noqa: E402
from stem_probe import graph_ms, setup, time_kernels  # noqa: E402
import tiledispatch as td  # noqa: E402
import tiledispatch.torch as tdt  # noqa: E402
from tiledispatch.ops import gemm as gemm_op  # noqa: E402

TIMER = models.Timer("cuda", rounds=3, target_ms=3)
OPTIONS = {"--model": {"default": "convnext_tiny", "help": "a torchvision classification model"},
           "--batch": {"type": int, "default": 32}}
# label -> (activation, whether a residual of the output's shape is added): ConvNeXt's expanding Linear is
# followed by GELU, its second one (layer scale folded) by the block's residual add
EPILOGUES = {"bias": ("identity", False), "bias_gelu": ("gelu_erf", False), "bias_residual": ("identity", True)}


def linear_shapes(model_name: str, batch: int) -> list[tuple[int, int, int]]:
    """The distinct (rows, out_features, in_features) of the model's nn.Linear calls on a batch of 224^2 images."""
    import torchvision

    model = getattr(torchvision.models, model_name)().eval().cuda().half()
    shapes = []
    hooks = [m.register_forward_hook(lambda m, i, o: shapes.append((i[0].numel() // m.in_features, m.out_features,
                                                                    m.in_features)))
             for m in model.modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        model(torch.zeros(batch, 3, 224, 224, device="cuda", dtype=torch.float16))
    for hook in hooks:
        hook.remove()
    return list(dict.fromkeys(shapes))


def main() -> None:
    a, reg, gen, results = setup(__doc__, "layers", OPTIONS)
    results.update(model=a.model, batch=a.batch)
    for m, n, k in linear_shapes(a.model, a.batch):
        x, w = gc.random_tensor((m, k), "fp16", gen), gc.random_tensor((n, k), "fp16", gen)
        bias = gc.random_tensor((n,), "fp16", gen)
        for label, (activation, residual) in EPILOGUES.items():
            act = (lambda y: y) if activation == "identity" else F.gelu
            res = (gc.random_tensor((m, n), "fp16", gen),) if residual else ()

            def peer(x, w, bias, res):  # no add without a residual: a "+ 0" would launch a pass of its own
                y = F.linear(x, w, bias)
                return act(y + res[0] if res else y)

            ref = peer(x.float(), w.float(), bias.float(), tuple(r.float() for r in res))
            row = {"m": m, "n": n, "k": k, "epilogue": label,
                   "cublas_ms": graph_ms(lambda: peer(x, w, bias, res), TIMER)}
            operator_out = tdt.linear(x, w, bias, registry=reg, activation=activation, residuals=res)
            row["operator"] = {"ms": graph_ms(lambda: tdt.linear(x, w, bias, registry=reg, activation=activation,
                                                                 residuals=res), TIMER),
                               "rel_err": rel_err(operator_out, ref)}

            def run(kernel, out):
                reg.gemm(x, w.t(), out=out, bias=bias, residuals=res, activation=activation, kernel=kernel)

            out = gc.poisoned((m, n), "fp16")
            try:
                run(None, out)
                problem, operands = gemm_op.operands(x, w.t(), out, bias=bias, residuals=res, activation=activation)
                row["selected"] = {"ms": graph_ms(lambda: run(None, out), TIMER), "rel_err": rel_err(out, ref),
                                   "kernel": reg.select(problem, operands=operands).name}
            except td.TileDispatchError as e:
                row["selected"] = {"error": f"{type(e).__name__}: {e}"[:300]}
            row["kernels"], row["best_kernel"] = time_kernels(reg.kernels, run, lambda: gc.poisoned((m, n), "fp16"),
                                                              ref, TIMER)
            results["layers"][f"{m}x{n}x{k} {label}"] = row
            selected = row["selected"].get("ms", math.nan)
            best = row["kernels"].get(row["best_kernel"], {}).get("ms", math.nan)
            print(f"{m:7d}x{n:5d}x{k:5d} {label:9s} cuBLAS {row['cublas_ms'] * 1e3:7.1f} us  operator "
                  f"{row['operator']['ms'] * 1e3:7.1f}  selected {selected * 1e3:7.1f}"
                  f"  best {best * 1e3:7.1f} ({(row['best_kernel'] or '-')[:80]})", flush=True)
            gc.write_results(results, a.out, "linear_epilogue_probe")


if __name__ == "__main__":
    main()
