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

from .spec import rules


def first_fit(problem, kernels) -> list:
    return list(kernels)


def compute_units(backend: str, arch: str) -> int:
    units = rules.archs(backend)[arch].get("compute_units")
    return int(units) if units else (os.cpu_count() or 1)


def resident_ctas(key) -> int:
    """CTAs per compute unit the kernel is compiled to keep resident (its backend's `occupancy` extra, 0 or
    absent = 1)."""
    return int(key.algorithm.extra(f"{key.backend}.occupancy", 0) or 1)


def estimated_cost(problem, key) -> float:
    """Relative time of one kernel on one problem (lower is better); only the ranking matters."""
    tm, tn, tk = key.algorithm.tile
    knee = rules.backend_rules(key.backend).get("selection", {}).get("intensity_knee", 64.0)
    efficiency = min(1.0, (tm * tn / (tm + tn)) / knee)
    if rules.runtime_split(key).get("over") == "partials":  # persistent split-K: the kernel's own cost model
        _, _, _, steps = conv_partials_split(problem, key)
        return steps * tm * tn * tk * resident_ctas(key) / efficiency * rules.cost_factor(key)
    m, n, k, batch = gemm_view(problem, key)
    units = compute_units(key.backend, key.arch)
    cm, cn, _ = key.algorithm.cluster  # a cluster grid rounds the tiles up to whole clusters
    output_tiles = _round_up(math.ceil(m / tm), cm) * _round_up(math.ceil(n / tn), cn) * batch
    runtime = _runtime_split(key, output_tiles, k, units)
    split = key.algorithm.split_k * runtime
    waves = math.ceil(output_tiles * split / units)
    k_per_tile = math.ceil(math.ceil(k / split) / tk) * tk
    return waves * tm * tn * k_per_tile / efficiency * rules.cost_factor(key)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _runtime_split(key, output_tiles: int, k: int, units: int) -> int:
    """Reduction splits a kernel chooses at run time (rules' selection.runtime_splits `waves`): enough to fill
    the given waves of blocks, at most one per k tile (the rule of templates/cutlass/conv_igemm.cu.j2)."""
    waves = int(rules.runtime_split(key).get("waves", 0))
    if not waves:
        return 1
    ktiles = max(1, math.ceil(k / key.algorithm.tile[2]))
    want = min(max(1, math.ceil(waves * units / output_tiles)), ktiles)
    per = math.ceil(ktiles / want)
    return math.ceil(ktiles / per)


def conv_partials_split(problem, key) -> tuple[int, int, int, float]:
    """(S, output tiles, k tiles, cost) of a tma_ws_conv bwd_weight kernel on a conv problem: its tiles of the
    (K, taps x C) output, the k tiles of its pixel sum and one partial of (K rounded up to the tile) x taps x C."""
    m, n, k, _ = gemm_view(problem, key)
    tm, tn, tk = key.algorithm.tile
    tiles, ktiles = math.ceil(m / tm) * math.ceil(n / tn), math.ceil(k / tk)
    partial = _round_up(m, tm) * (problem.c // problem.g) * math.prod(problem.filter_size)
    s, cost = partials_split(key, tiles, ktiles, partial, int(rules.runtime_split(key)["epilogue_ktiles"]))
    return s, tiles, ktiles, cost


def partials_split(key, tiles: int, ktiles: int, partial_elems: int, epilogue_ktiles: int) -> tuple[int, float]:
    """(S, cost) of a persistent split-K kernel writing S fp32 partials (templates/cutlass/_conv_sm90_wgrad.j2,
    choose_splits, the same rule): S in [1, max(1, slots / tiles)] (one wave of units) minimizing (k tiles per
    unit + epilogue) + S x (one partial written and summed), in k tiles of one CTA's main loop; ties keep the
    fewer splits. The cost counts the waves of an unsplit kernel with more tiles than resident CTAs."""
    tm, tn, tk = key.algorithm.tile
    occupancy = resident_ctas(key)
    slots = compute_units(key.backend, key.arch) * occupancy
    flops_per_byte = float(rules.archs(key.backend)[key.arch]["sm_flops_per_byte"])
    partial = 4.0 * partial_elems * flops_per_byte / (tm * tn * tk * occupancy)
    best, best_cost = 1, 0.0
    for s in range(1, max(1, min(ktiles, slots // tiles)) + 1):
        cost = (math.ceil(ktiles / s) + epilogue_ktiles) + s * partial
        if s == 1 or cost < best_cost:
            best, best_cost = s, cost
    waves = math.ceil(tiles * best / slots)
    return best, best_cost + (waves - 1) * (math.ceil(ktiles / best) + epilogue_ktiles)


def analytic(problem, kernels) -> list:
    return sorted(kernels, key=lambda kern: (estimated_cost(problem, kern.key), kern.name))


def gemm_view(problem, key) -> tuple[int, int, int, int]:
    """(m, n, k, batch) of the (implicit) GEMM the kernel performs for the problem."""
    if hasattr(problem, "gemm_shape"):
        return problem.gemm_shape(key)
    return problem.m, problem.n, problem.k, problem.batch


def learned(problem, kernels) -> list:
    from . import learned as learned_models

    ranked = learned_models.rank(problem, list(kernels))
    return ranked if ranked is not None else analytic(problem, kernels)


RANKERS = {"first_fit": first_fit, "analytic": analytic, "learned": learned}
