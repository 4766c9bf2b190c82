"""Exception types. Each kind of failure has its own type, so callers can tell them apart."""


class TileDispatchError(Exception):
    """Base of every tiledispatch error."""


class SpecError(TileDispatchError, ValueError):
    """A kernel set (YAML) is malformed or declares an illegal kernel. The message names the file,
    the kernel and the rule."""


class BundleError(TileDispatchError):
    """A bundle is missing, malformed or tampered with (sha256 or embedded key mismatch)."""


class InvalidInputError(TileDispatchError, ValueError):
    """The arrays passed in are inconsistent: wrong dtype, shape mismatch, bad strides, wrong device."""


class UnsupportedProblemError(TileDispatchError):
    """No kernel of the registry (or not the one asked for) can run this problem; says why."""


class KernelRuntimeError(TileDispatchError, RuntimeError):
    """A kernel launch failed on the device."""
