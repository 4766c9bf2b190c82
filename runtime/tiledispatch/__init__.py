"""tiledispatch: load a bundle of generated kernels, select the best one for a problem, launch it.

    import tiledispatch as td
    reg = td.load("build/fp16_rcr_essential")
    d = reg.gemm(a, b)                      # numpy (cpu backend), torch or cupy arrays
"""
from .errors import (BundleError, InvalidInputError, KernelRuntimeError, SpecError, TileDispatchError,  # noqa: F401
                     UnsupportedProblemError)
from .ops.conv import ConvProblem  # noqa: F401
from .ops.gemm import GemmProblem  # noqa: F401
from .loader import load  # noqa: F401
from .registry import Kernel, Registry  # noqa: F401
from .spec.key import Algorithm, Epilogue, KernelKey, Signature, kernel_name, parse_kernel_name  # noqa: F401

__version__ = "0.1.0"
