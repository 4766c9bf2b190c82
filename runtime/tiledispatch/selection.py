"""Rankers: order the kernels that can run a problem, best first.

first_fit keeps the registry's order. analytic estimates each kernel's time from its tile shape:
output tiles spread over the machine's compute units in waves, padded work at the edges, and a tile
efficiency that grows with the tile's arithmetic intensity until it saturates. learned sorts by a
model trained on measurements (learned.py) where one is shipped for the kernels, else falls back to
analytic. (Measured tuning, which needs data and a device, lives in the registry: Registry.tune.)
"""
from __future__ import annotations

import math
import os

from . import backends


def first_fit(problem, kernels) -> list:
    return list(kernels)


def compute_units(backend: str, arch: str) -> int:
    units = backends.get(backend).archs[arch].get("compute_units")
    return int(units) if units else (os.cpu_count() or 1)


def estimated_cost(problem, key) -> float:
    """Relative time of one kernel on one problem (lower is better); only the ranking matters. The kernel's family
    module says what it computes (gemm_view), how it splits (runtime_split, partials_cost) and how much slower than
    its tile shape suggests it runs (cost_factor); backends.py has the defaults."""
    family = backends.family_of(key)
    tm, tn, tk = key.algorithm.tile
    knee = backends.get(key.backend).selection.get("intensity_knee", 64.0)
    efficiency = min(1.0, (tm * tn / (tm + tn)) / knee)
    steps = family.partials_cost(problem, key)
    if steps is not None:  # a persistent split-K kernel: its own cost model, in main-loop steps of one tile
        return steps * tm * tn * tk * family.resident_ctas(key) / efficiency * family.cost_factor(key)
    m, n, k, batch = family.gemm_view(problem, key)
    units = compute_units(key.backend, key.arch)
    cm, cn, _ = key.algorithm.cluster  # a cluster grid rounds the tiles up to whole clusters
    output_tiles = _round_up(math.ceil(m / tm), cm) * _round_up(math.ceil(n / tn), cn) * batch
    split = key.algorithm.split_k * family.runtime_split(key, output_tiles, k, units)
    waves = math.ceil(output_tiles * split / units)
    k_per_tile = math.ceil(math.ceil(k / split) / tk) * tk
    return waves * tm * tn * k_per_tile / efficiency * family.cost_factor(key)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def analytic(problem, kernels) -> list:
    return sorted(kernels, key=lambda kern: (estimated_cost(problem, kern.key), kern.name))


def gemm_view(problem, key) -> tuple[int, int, int, int]:
    """(m, n, k, batch) of the (implicit) GEMM the kernel performs for the problem (its family's view)."""
    return backends.family_of(key).gemm_view(problem, key)


def learned(problem, kernels) -> list:
    """The shipped model's order where one covers the kernels, else analytic. Kernels outside the model's domain
    (its applies_to, e.g. the low-alignment fallbacks it was never trained on: DESIGN.md invariant 10) rank after
    the ones it covers, in analytic order; with none covered, analytic orders all."""
    from . import learned as learned_models

    kernels = list(kernels)
    covered, rest = learned_models.split(problem, kernels)
    ranked = learned_models.rank(problem, covered) if covered else None
    return ranked + analytic(problem, rest) if ranked is not None else analytic(problem, kernels)


RANKERS = {"first_fit": first_fit, "analytic": analytic, "learned": learned}
