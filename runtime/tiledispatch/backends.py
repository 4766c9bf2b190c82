"""Backends as the runtime sees them: their facts, their kernel families and their device driver.

Each backend is a folder of templates/, which is the package `tiledispatch.families` (runtime/tiledispatch/
families is a link to it, so a checkout, an editable install, the SCons build and an installed wheel see the same
package). Its __init__.py registers the backend with register(): the facts every layer reads (the device its data
lives on, its archs and their properties, the pipeline / scheduler / extra-field vocabulary of its keys,
validation tolerances, ranker knobs) as plain Python data, and its Driver (drivers.py). Its kernel families are
the subfolders that hold an __init__.py, each a small pure-Python module (its templates, render context, cost
model for the ranker and resource limits): adding a family is adding a folder. Registration checks the driver and
every family module and names what is missing in one line. The backend's toolchain.py and rules.yaml files are
the generator's (tiledispatch.generator), never imported here.

Nothing here imports the generator (rules, template rendering, toolchains): the runtime needs numpy alone.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping, Optional

from .drivers import DRIVER_API, Driver

FAMILIES_PACKAGE = f"{__package__}.families"

# What a family module must define, and what it may (the defaults below otherwise).
FAMILY_REQUIRED = {
    "claims": "claims(key) -> bool: the key is one of this family's kernels",
    "templates": "templates(key) -> [template names]: main template first (rendering any other is an error)",
    "context": "context(key) -> dict: the values its templates see",
}
FAMILY_OPTIONAL = {
    "gemm_view": "gemm_view(problem, key) -> (m, n, k, batch): the (implicit) GEMM the kernel performs",
    "view_key": "view_key(key) -> hashable: all of the key that gemm_view reads; the ranker computes one gemm_view "
                "per problem for the family's keys with equal view keys",
    "runtime_split": "runtime_split(key, output_tiles, k, units) -> int: reduction splits chosen at run time",
    "resident_ctas": "resident_ctas(key) -> int: blocks per compute unit the kernel is compiled to keep resident",
    "cost_factor": "cost_factor(key) -> float: how much slower than its tile shape suggests the kernel runs",
    "problem_factor": "problem_factor(problem, key) -> float: how much slower than cost_factor says the kernel runs "
                      "on this problem (e.g. where the problem's geometry leaves one block per compute unit)",
    "factor_key": "factor_key(key) -> hashable: all of the key that problem_factor reads; the ranker computes one "
                  "problem_factor per problem for the family's keys with equal factor keys",
    "partials_cost": "partials_cost(problem, key) -> float | None: the cost of a persistent split-K kernel, in "
                     "main-loop steps of one tile (None: the tiles-in-waves model applies)",
}
# Resource limits are the family's too, read where they are needed: smem_bytes(key) (the shared memory a CTA
# takes, called by its backend's rules as smem_bytes()), and problem-dependent ones such as the cutlass direct
# conv family's problem_smem_bytes(problem, key).


def tile_efficiency(key) -> float:
    """The analytic ranker's efficiency of a key's tile (selection.py): its intensity m n / (m + n) against the
    backend's knee (selection["intensity_knee"]), at most 1."""
    tm, tn, _ = key.algorithm.tile
    return min(1.0, (tm * tn / (tm + tn)) / get(key.backend).selection.get("intensity_knee", 64.0))


def _default_gemm_view(problem, key) -> tuple[int, int, int, int]:
    if hasattr(problem, "gemm_shape"):  # a conv problem: the implicit GEMM per group its direction performs
        return problem.gemm_shape()
    return problem.m, problem.n, problem.k, problem.batch


_DEFAULTS: dict[str, Callable] = {
    "gemm_view": _default_gemm_view,
    "view_key": lambda key: key,  # the whole key: no two keys share a view
    "runtime_split": lambda key, output_tiles, k, units: 1,
    "resident_ctas": lambda key: 1,
    "cost_factor": lambda key: 1,
    "problem_factor": lambda problem, key: 1,
    "factor_key": lambda key: key,  # the whole key: no two keys share a factor
    "partials_cost": lambda problem, key: None,
}


@dataclass(frozen=True)
class Family:
    """One kernel family: its folder and the functions of its module (or the defaults)."""
    backend: str
    name: str
    path: Path
    module: ModuleType
    claims: Callable
    templates: Callable
    context: Callable
    gemm_view: Callable
    view_key: Callable
    runtime_split: Callable
    resident_ctas: Callable
    cost_factor: Callable
    problem_factor: Callable
    factor_key: Callable
    partials_cost: Callable


@dataclass(frozen=True)
class Backend:
    name: str
    device: str                      # where the kernels' data lives: cpu, cuda or hip
    auto_priority: int               # backend=auto takes the available backend of highest priority
    archs: Mapping[str, Mapping]     # arch -> properties (read by the legality rules, the ranker, the driver)
    pipeline: tuple[str, ...]        # the key's pipeline vocabulary
    scheduler: tuple[str, ...]       # the key's scheduler vocabulary
    extras: Mapping[str, Mapping]    # extra field -> {type: bool|int|enum, default, values}
    tolerance: Mapping[str, float]   # validation: max ||out - ref|| / ||ref|| per output dtype
    selection: Mapping[str, Any]     # analytic ranker knobs (intensity_knee)
    driver: Driver
    path: Path                       # the backend's folder (templates/<backend>)
    families: tuple[Family, ...] = field(default=())

    def family(self, key) -> Family:
        """The family whose module claims the key; ValueError naming the key otherwise."""
        found = [f for f in self.families if f.claims(key)]
        if len(found) != 1:
            which = "no kernel family" if not found else "more than one kernel family (" + ", ".join(
                f.name for f in found) + ")"
            raise ValueError(f"{which} of backend {self.name} claims {key.name} (families: "
                             f"{', '.join(f.name for f in self.families)})")
        return found[0]

    def extra(self, key, name: str):
        """The key's value of one of this backend's extra fields, its default when the key omits it."""
        return key.algorithm.extra(f"{self.name}.{name}", self.extras[name].get("default"))

    def detect_arch(self) -> Optional[str]:
        return self.driver.detect_arch(self.archs)

    def runnable(self, arch: str) -> tuple[bool, str]:
        return self.driver.runnable(arch, self.archs)


class RegistrationError(RuntimeError):
    """A backend or family that does not provide what the runtime calls."""


def register(name: str, path, *, device: str, auto_priority: int, archs: dict, pipeline, scheduler, extras: dict,
             tolerance: dict, selection: dict, driver: Driver) -> Backend:
    """A backend from its facts and driver, its families found in the subfolders of `path` (the package's
    __path__) that hold an __init__.py. Raises RegistrationError naming what is missing."""
    folder = Path(list(path)[0] if not isinstance(path, (str, Path)) else path).resolve()
    missing = [m for m in DRIVER_API if not callable(getattr(driver, m, None))]
    if missing or getattr(driver, "device", None) != device:
        raise RegistrationError(f"backend {name}: its driver {type(driver).__name__} lacks "
                                f"{', '.join(missing) or f'device {device!r}'} (the Driver interface, drivers.py)")
    families = []
    package = f"{FAMILIES_PACKAGE}.{name}"
    for info in sorted(pkgutil.iter_modules([str(folder)]), key=lambda i: i.name):
        if not info.ispkg:
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        lacking = [f for f in FAMILY_REQUIRED if not callable(getattr(module, f, None))]
        if lacking:
            raise RegistrationError(f"kernel family {name}/{info.name} ({folder / info.name}): its module defines no "
                                    + ", ".join(lacking) + " (" + "; ".join(FAMILY_REQUIRED[f] for f in lacking) + ")")
        funcs = {f: getattr(module, f, None) or _DEFAULTS[f] for f in (*FAMILY_REQUIRED, *FAMILY_OPTIONAL)}
        families.append(Family(name, info.name, folder / info.name, module, **funcs))
    return Backend(name=name, device=device, auto_priority=auto_priority, archs=archs, pipeline=tuple(pipeline),
                   scheduler=tuple(scheduler), extras=extras, tolerance=tolerance, selection=selection, driver=driver,
                   path=folder, families=tuple(families))


@functools.lru_cache(maxsize=None)
def all_backends() -> dict[str, Backend]:
    """name -> Backend, for every backend folder of the families package (each defines BACKEND)."""
    from . import families

    out = {}
    for info in sorted(pkgutil.iter_modules(families.__path__), key=lambda i: i.name):
        if info.ispkg:
            backend = importlib.import_module(f"{families.__name__}.{info.name}").BACKEND
            if backend.name != info.name:
                raise RegistrationError(f"templates/{info.name} registers a backend named {backend.name!r}")
            out[backend.name] = backend
    return out


def names() -> list[str]:
    return list(all_backends())


def get(name: str) -> Backend:
    backends = all_backends()
    if name not in backends:
        raise ValueError(f"unknown backend {name!r} (known: {', '.join(backends)})")
    return backends[name]


def family_of(key) -> Family:
    return get(key.backend).family(key)


@functools.lru_cache(maxsize=None)
def vocabulary() -> dict:
    """Every pipeline and scheduler spelling and every backend's extras, for parsing kernel names."""
    vocab = {"pipeline": set(), "scheduler": set(), "extras": {}}
    for name, backend in all_backends().items():
        vocab["pipeline"].update(backend.pipeline)
        vocab["scheduler"].update(backend.scheduler)
        vocab["extras"][name] = dict(backend.extras)
    vocab["pipeline"] = sorted(vocab["pipeline"])
    vocab["scheduler"] = sorted(vocab["scheduler"])
    return vocab


def auto_order() -> list[str]:
    """Backend names, highest auto_priority first (backend=auto takes the first available one)."""
    return sorted(names(), key=lambda n: -get(n).auto_priority)
