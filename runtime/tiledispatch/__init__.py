"""tiledispatch: load a bundle of generated kernels, select the best one for a problem, launch it.

    import tiledispatch as td
    reg = td.load("build/fp16_rcr_essential")
    d = reg.gemm(a, b)                      # numpy (cpu backend), torch or cupy arrays
    y = reg.layer_norm(x, weight, bias)     # with a layernorm set (layernorm_essential)
    y = reg.max_pool(x, 3, 2, 1)            # channels-last [N, H, W, C], with pool_essential

    reg = td.build(["fp16_rcr_essential"])  # the same build from Python (needs the `build` extra)
"""
from .errors import (BundleError, InvalidInputError, KernelRuntimeError, SpecError, TileDispatchError,  # noqa: F401
                     UnsupportedProblemError, BuildError)
from .ops.conv import ConvProblem  # noqa: F401
from .ops.gemm import GemmProblem  # noqa: F401
from .ops.layernorm import LayerNormProblem  # noqa: F401
from .ops.maxpool import MaxPoolProblem  # noqa: F401
from .loader import load  # noqa: F401
from .registry import Kernel, Registry  # noqa: F401
from .spec.key import Algorithm, Epilogue, KernelKey, Signature, kernel_name, parse_kernel_name  # noqa: F401

__version__ = "0.1.0"


def __getattr__(name: str):
    # td.build is the generator's (PyYAML, Jinja2, SCons): imported on first use, so that importing the runtime
    # needs numpy alone
    if name == "build":
        from importlib import import_module

        return import_module("tiledispatch.generator.build").build
    raise AttributeError(f"module 'tiledispatch' has no attribute {name!r}")
