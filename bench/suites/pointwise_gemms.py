"""The pointwise layers of conv.json as the GEMMs they run as, a GEMM suite derived from the conv suite.

    python bench/suites/pointwise_gemms.py            # writes bench/suites/pointwise_gemms.json
    python bench/suites/pointwise_gemms.py --check    # compares with the file (exit 1 on a difference)

A dense 1x1 convolution with unit stride and no padding runs as the GEMM Y[pixels, K] = X[pixels, C] . W[K, C]^T
(layout rcr; runtime/tiledispatch/ops/conv_as_gemm.py): M = the batch's pixels, N = K, K = C. Each distinct (M, N,
K) of the suite's pointwise fwd layers whose channel counts are multiples of 8 (the 16-byte rows the TMA kernels
need; the others run on the conv kernels) is one shape, with the layers it stands for and their uses summed. The
GEMM sweep (bench/sweeps/sweep.py BUNDLE gemm --suite bench/suites/pointwise_gemms.json) and the pointwise probe
(bench/benchmarks/pointwise_probe.py) read it: GEMMs with K or N of 8-48 are memory-bound shapes the LLM suite
(gemm.json) lacks.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONV = HERE / "conv.json"
OUT = HERE / "pointwise_gemms.json"


def is_pointwise(layer: dict) -> bool:
    return (layer["cls"] == "dense" and set(layer["filter"]) == {1} and set(layer["stride"]) == {1}
            and not any(layer["pad_lo"]) and not any(layer["pad_hi"]) and "fwd" in layer["directions"])


def pointwise_gemms(conv_layers: list[dict]) -> list[dict]:
    """The GEMM shapes, in the conv suite's order of first use."""
    shapes: dict[tuple[int, int, int], dict] = {}
    for layer in conv_layers:
        if not is_pointwise(layer) or layer["c"] % 8 or layer["k"] % 8:
            continue
        m, n, k = layer["n"] * math.prod(layer["in_size"]), layer["k"], layer["c"]
        shape = shapes.setdefault((m, n, k), {"id": f"pointwise_{m}x{n}x{k}_rcr", "m": m, "n": n, "k": k,
                                              "layout": "rcr", "layers": [], "uses": {}})
        shape["layers"].append(layer["id"])
        for model, count in layer["uses"].items():
            shape["uses"][model] = shape["uses"].get(model, 0) + count
    return list(shapes.values())


def suite() -> dict:
    return {"schema": 1, "generator": "bench/suites/pointwise_gemms.py", "source": "bench/suites/conv.json",
            "shapes": pointwise_gemms(json.loads(CONV.read_text())["layers"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    a = ap.parse_args(argv)
    data = suite()
    text = json.dumps(data, indent=1) + "\n"
    if a.check:
        same = OUT.exists() and OUT.read_text() == text
        print(f"{OUT.name}: {'up to date' if same else 'differs from what conv.json gives'}")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(data['shapes'])} shapes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
