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


class BuildError(TileDispatchError, RuntimeError):
    """Building kernels failed (tiledispatch.build, on-demand kernels): failures maps each kernel that did not
    compile to its compiler output; a build that failed before compiling (no toolchain, an unusable cache) has
    none and says why."""

    def __init__(self, message: str, failures: dict | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})
