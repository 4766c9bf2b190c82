"""The float activations of the fused epilogues (include/activations/*.h) against float64, compiled by g++ as the cpu
backend compiles them: sigmoid, silu and both gelu forms are built on 1 / x and 2^x (on the GPU one special-function
instruction each), gelu_erf through a fitted lower tail of the normal CDF; each must stay within a few float ulps of
the exact value, in the tails too, and pass infinities and NaN through as the plain formulas do."""
from __future__ import annotations

import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

INCLUDE = Path(__file__).resolve().parents[2] / "runtime" / "tiledispatch" / "include"
NAMES = ("gelu_erf", "gelu_tanh", "silu", "sigmoid")

# float64 forms without cancellation, so the comparison holds far into the negative tail
EXACT = {
    "gelu_erf": lambda v: 0.5 * v * math.erfc(-v / math.sqrt(2.0)),
    "gelu_tanh": lambda v: v / (1.0 + math.exp(min(700.0, -2.0 * math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))),
    "silu": lambda v: v / (1.0 + math.exp(min(700.0, -v))),
    "sigmoid": lambda v: 1.0 / (1.0 + math.exp(min(700.0, -v))),
}

PROGRAM = """#include <cstdio>
#include <cstdlib>
#include "tiledispatch_activation.h"
{namespaces}
int main(int argc, char** argv) {{
  float v;
  while (std::scanf("%a", &v) == 1) {{
    std::printf("%a{formats}\\n", (double)v{values});
  }}
}}
"""


@pytest.fixture(scope="module")
def activations(tmp_path_factory) -> dict:
    """name -> f(values): each activation's float form, as the header computes it on the host."""
    work = tmp_path_factory.mktemp("activations")
    namespaces = "\n".join(f"namespace {n} {{\n#include \"activations/{n}.h\"\n}}" for n in NAMES)
    values = "".join(f", (double){n}::td_activate<float>(v, 0.0f, 0.0f)" for n in NAMES)
    (work / "act.cpp").write_text(PROGRAM.format(namespaces=namespaces, formats=" %a" * len(NAMES), values=values))
    subprocess.run(["g++", "-std=c++17", "-O2", f"-I{INCLUDE}", "act.cpp", "-o", "act"], cwd=work, check=True,
                   capture_output=True)

    def run(v: np.ndarray) -> dict:
        text = "\n".join(float(x).hex() for x in v.astype(np.float32))
        out = subprocess.run([str(work / "act")], input=text, capture_output=True, text=True, check=True).stdout
        rows = np.array([[float.fromhex(t) for t in line.split()] for line in out.splitlines()])
        assert rows.shape == (len(v), len(NAMES) + 1)
        return {n: rows[:, i + 1] for i, n in enumerate(NAMES)}
    return run


def test_float_activations_stay_within_a_few_ulps_of_float64(activations):
    v = np.concatenate([np.linspace(-12.0, 12.0, 48_001), np.linspace(-1e-3, 1e-3, 2_001),
                        np.geomspace(1e-30, 1.0, 301), -np.geomspace(1e-30, 1.0, 301)]).astype(np.float32)
    got = activations(v)
    for name in NAMES:
        exact = np.array([EXACT[name](float(x)) for x in v])
        keep = np.abs(exact) > 1e-30  # below, float's own range ends (flushed to zero on the GPU)
        rel = np.abs(got[name][keep] - exact[keep]) / np.abs(exact[keep])
        worst = rel.max()
        # 2e-5 at most (the far tail, where 2^x's argument is large), 2e-6 on the values an fp16 output holds
        assert worst < 2e-5, f"{name}: relative error {worst:.3g} at v = {v[keep][rel.argmax()]}"
        near = rel[np.abs(exact[keep]) > 6e-5].max()
        assert near < 2e-6, name


def test_float_activations_pass_infinities_and_nan_through(activations):
    got = activations(np.array([np.inf, -np.inf, np.nan, 0.0], dtype=np.float32))
    for name in NAMES:
        pos, neg, nan, zero = got[name]
        assert pos == (1.0 if name == "sigmoid" else np.inf), name
        assert np.isnan(nan), name
        assert zero == (0.5 if name == "sigmoid" else 0.0), name
        # -inf: sigmoid 0; the others 0 * -inf as the plain formulas (and PyTorch's) give: NaN
        assert (neg == 0.0) if name == "sigmoid" else np.isnan(neg), name
