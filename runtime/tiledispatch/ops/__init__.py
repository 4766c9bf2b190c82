"""One module per op: the problem descriptor, matching against keys, and binding arrays to the C ABI."""
import importlib
from types import ModuleType

from ..errors import UnsupportedProblemError


def get(op: str) -> ModuleType:
    """The op module for problem.op ("gemm", "conv")."""
    try:
        return importlib.import_module(f"{__name__}.{op}")
    except ModuleNotFoundError:
        raise UnsupportedProblemError(f"op {op!r} is not supported by this runtime") from None
