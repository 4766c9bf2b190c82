"""On-demand kernels (opt in: td.load(bundle, jit=True)): a problem that no kernel of the registry can run gets
the kernel the ranker would want built, cached, added to the registry and run; so does a kernel asked for by
name or key that the bundle lacks.

The kernel is chosen, never invented: its signature is the problem's (dtypes, layout, epilogue, conv direction
and rank), its algorithm one the registry's own kernels or the preselected sets of its backend and arch use for
that op (those declared for the same dtypes first), kept only where the backend's rules allow it, and the best
of those by the registry's ranker. It is built by tiledispatch.build (the command line's build and CacheDir), so
a second process or a later run fetches it from the cache instead of compiling it again.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

from .. import selection
from ..errors import InvalidInputError, SpecError, UnsupportedProblemError
from ..spec.key import KernelKey, Signature, parse_kernel_name
from . import kernelset, rules

log = logging.getLogger("tiledispatch.jit")

BUILD_OPTIONS = ("build_dir", "cache_dir", "jobs", "launcher", "progress")


class OnDemand:
    """A registry's on-demand builder; the options are tiledispatch.build's (build_dir, cache_dir, jobs,
    launcher, progress)."""

    def __init__(self, **build_options):
        unknown = set(build_options) - set(BUILD_OPTIONS)
        if unknown:
            raise InvalidInputError(f"jit options: unknown {', '.join(sorted(unknown))} (known: "
                                    f"{', '.join(BUILD_OPTIONS)})")
        self.build_options = build_options

    def add_for(self, registry, problem) -> int:
        """Build the kernel the ranker would want for a problem no kernel of the registry runs and add it;
        returns how many kernels were added (0: no legal kernel of this backend and arch computes it)."""
        present = [k.key for k in registry.kernels]
        # a candidate the registry holds already has refused the problem (td_can_run: alignment, sizes): the next
        # best is built instead
        keys = candidate_keys(problem, registry.backend, registry.arch, present, exclude=set(present))
        if not keys:
            log.warning("no legal %s/%s kernel computes %s: nothing to build on demand", registry.backend,
                        registry.arch, problem)
            return 0
        key = registry.ranked(problem, [_Candidate(k) for k in keys])[0].key
        log.info("no kernel of the bundle runs %s; building %s on demand (jit)", problem, key.name)
        self._add(registry, key)
        return 1

    def add_named(self, registry, name: str):
        """The registry's kernel named (or keyed) so, built and added when the bundle lacks it."""
        try:
            key = parse_kernel_name(name)
        except ValueError as e:
            raise UnsupportedProblemError(f"no kernel named {name} in this registry, and it is no kernel name: "
                                          f"{e}") from None
        if (key.backend, key.arch) != (registry.backend, registry.arch):
            raise UnsupportedProblemError(f"no kernel named {name} in this registry, and it is a {key.backend}/"
                                          f"{key.arch} kernel; the registry's bundle is {registry.backend}/"
                                          f"{registry.arch}")
        violations = rules.check(key)
        if violations:
            raise SpecError(f"kernel {name} is illegal: " + "; ".join(map(str, violations)))
        log.info("the bundle has no kernel %s; building it on demand (jit)", name)
        return self._add(registry, key)

    def _add(self, registry, key: KernelKey):
        from .build import build  # (build imports the registry: import on use)

        built = build([key], backend=registry.backend, arch=registry.arch, **self.build_options)
        kernel = built.kernel(key.name)
        if all(k.name != kernel.name for k in registry.kernels):
            registry.kernels.append(kernel)
            registry.ops.add(key.signature.op)
            registry.clear_caches()  # (launches, selections and candidate lists were made among the old set)
        return kernel


class _Candidate:
    """A key that is not built yet, in the shape the rankers take (.key, .name)."""

    def __init__(self, key: KernelKey):
        self.key, self.name = key, key.name


def candidate_keys(problem, backend: str, arch: str, known: list[KernelKey], exclude=frozenset()) -> list[KernelKey]:
    """The legal keys for problem on backend/arch, less those in exclude: the problem's signature with the
    algorithms that the known keys and the preselected sets use for its op; those declared for the problem's own
    dtypes when there are any (their tiles were chosen for them), else all."""
    signatures = _signatures(problem, backend)
    same_dtypes, other = {}, {}
    for source in [*known, *_preselected(backend, arch)]:
        s = source.signature
        if (s.op, s.direction, s.spatial_dims) != (problem.op, getattr(problem, "direction", "none"),
                                                   getattr(problem, "spatial_dims", 0)):
            continue
        for sig in signatures:
            key = KernelKey(sig, source.algorithm, backend, arch)
            if key in same_dtypes or key in other or key in exclude or problem.mismatch(key) is not None \
                    or rules.check(key):
                continue
            dtypes = (s.dtype_a, s.dtype_b, s.dtype_c, s.dtype_acc)
            tier = same_dtypes if dtypes == (sig.dtype_a, sig.dtype_b, sig.dtype_c, sig.dtype_acc) else other
            tier[key] = None
    return list(same_dtypes or other)


def _signatures(problem, backend: str) -> list[Signature]:
    """The signatures that compute the problem on the backend: each legal accumulator for its dtypes, each
    layout its '*' letters allow."""
    if problem.op == "gemm":
        dtypes = (problem.dtype_a, problem.dtype_b, problem.dtype_c)
        layouts = [""]
        for letter in problem.layout:
            layouts = [done + pick for done in layouts for pick in ("rc" if letter == "*" else letter)]
        extra = {}
    else:
        dtypes = (problem.dtype_x, problem.dtype_w, problem.dtype_y)
        layouts = [problem.layout]
        extra = {"direction": problem.direction, "spatial_dims": problem.spatial_dims}
    legal = rules.backend_rules(backend)["dtypes"].get(problem.op, [])
    out = []
    for a, b, c, acc in legal:
        if (a, b, c) != dtypes:
            continue
        for layout in layouts:
            try:
                out.append(Signature(op=problem.op, dtype_a=a, dtype_b=b, dtype_c=c, dtype_acc=acc, layout=layout,
                                     epilogue=problem.epilogue, **extra))
            except ValueError:  # a layout the op does not have
                continue
    return out


@functools.lru_cache(maxsize=None)
def _preselected(backend: str, arch: str) -> tuple[KernelKey, ...]:
    """Every key the preselected sets declare for backend/arch (a set that has none, or is broken, adds none)."""
    out = []
    for name, description in kernelset.available_sets().items():
        if description.startswith("broken:"):
            continue
        try:
            out += [e.key for e in kernelset.load([name], backend, arch)]
        except SpecError:
            continue
    return tuple(out)


def on_demand(option) -> Optional[OnDemand]:
    """load()'s jit argument as an OnDemand: False / None: off; True: build()'s defaults; a dict: build() options."""
    if option is None or option is False:
        return None
    if option is True:
        return OnDemand()
    if isinstance(option, dict):
        return OnDemand(**option)
    raise InvalidInputError(f"jit must be True, False or a dict of build options ({', '.join(BUILD_OPTIONS)}), "
                            f"got {option!r}")

