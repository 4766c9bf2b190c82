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
from collections import OrderedDict

import numpy as np

from . import backends


def first_fit(problem, kernels) -> list:
    return list(kernels)


def compute_units(backend: str, arch: str) -> int:
    units = backends.get(backend).archs[arch].get("compute_units")
    return int(units) if units else (os.cpu_count() or 1)


def estimated_cost(problem, key) -> float:
    """Relative time of one kernel on one problem (lower is better); only the ranking matters. The kernel's family
    module says what it computes (gemm_view), how it splits (runtime_split, partials_cost) and how much slower than
    its tile shape suggests it runs (cost_factor, and problem_factor on this problem); backends.py has the
    defaults."""
    family = backends.family_of(key)
    return _tile_cost(problem, key, family) * family.problem_factor(problem, key)


def _tile_cost(problem, key, family) -> float:
    tm, tn, tk = key.algorithm.tile
    efficiency = backends.tile_efficiency(key)
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
    kernels = list(kernels)
    if not kernels:
        return []
    cost = cost_terms(problem, [kern.key for kern in kernels], tuple(kern.name for kern in kernels))["cost"]
    return [kernels[i] for i in sorted(range(len(kernels)), key=lambda i: (cost[i], kernels[i].name))]


class _Static:
    """What estimated_cost reads from the keys alone, as arrays over a list of keys, and which keys' families
    define their own gemm_view / runtime_split / partials_cost / problem_factor (those are asked per key, gemm_view
    and problem_factor once per group of keys with equal view / factor keys; the defaults are computed once per
    problem)."""

    def __init__(self, keys):
        fams = [backends.family_of(key) for key in keys]
        alg = [key.algorithm for key in keys]
        ints = lambda f: np.array([f(a) for a in alg], dtype=np.int64)  # noqa: E731
        self.tm, self.tn, self.tk = (ints(lambda a, i=i: a.tile[i]) for i in range(3))
        self.cm, self.cn = ints(lambda a: a.cluster[0]), ints(lambda a: a.cluster[1])
        self.split_k = ints(lambda a: a.split_k)
        self.units = np.array([compute_units(key.backend, key.arch) for key in keys], dtype=np.int64)
        knee = np.array([backends.get(key.backend).selection.get("intensity_knee", 64.0) for key in keys])
        self.efficiency = np.minimum(1.0, (self.tm * self.tn / (self.tm + self.tn)) / knee)
        self.cost_factor = np.array([f.cost_factor(key) for f, key in zip(fams, keys)], dtype=np.float64)
        self.resident = np.array([f.resident_ctas(key) for f, key in zip(fams, keys)], dtype=np.int64)
        default = backends._DEFAULTS
        self.view_groups = _own_groups(fams, keys, "gemm_view", "view_key")
        self.shared_view = np.array([i for i, f in enumerate(fams) if f.gemm_view is default["gemm_view"]],
                                    dtype=np.int64)
        self.own_split = [i for i, f in enumerate(fams) if f.runtime_split is not default["runtime_split"]]
        self.own_partials = [i for i, f in enumerate(fams) if f.partials_cost is not default["partials_cost"]]
        self.factor_groups = _own_groups(fams, keys, "problem_factor", "factor_key")
        self.families = fams
        # what cost_terms returns where no key's family has its own partials cost / runtime split
        self.no_partials, self.no_split = np.full(len(keys), np.nan), np.ones(len(keys), dtype=np.int64)
        for constant in (self.no_partials, self.no_split, self.split_k):
            constant.flags.writeable = False


def _own_groups(fams, keys, hook: str, key_of: str) -> list[np.ndarray]:
    """The indices of the keys whose family has its own `hook` (gemm_view, problem_factor), grouped by family and by
    what of the key the hook reads (the family's `key_of`: view_key, factor_key): the hook is asked once per group."""
    groups: dict = {}
    for i, f in enumerate(fams):
        if getattr(f, hook) is not backends._DEFAULTS[hook]:
            groups.setdefault((f.backend, f.name, getattr(f, key_of)(keys[i])), []).append(i)
    return [np.array(group) for group in groups.values()]


_STATICS: OrderedDict = OrderedDict()  # kernel names (or keys) -> _Static, the most recent 64 kernel lists


def _static(keys, names) -> _Static:
    token = names if names is not None else tuple(keys)
    found = _STATICS.get(token)
    if found is None:
        found = _STATICS[token] = _Static(keys)
        if len(_STATICS) > 64:
            _STATICS.popitem(last=False)
    return found


def _ceil_div(a, b):
    return -(-a // b)


def cost_terms(problem, keys, names=None) -> dict:
    """estimated_cost for many keys at once, with its intermediate terms (arrays over the keys): the family's
    view m, n, k, batch; output tiles (rounded up to whole clusters); the reduction split (split_k times the
    family's runtime split); waves; k per tile; a persistent split-K family's partials cost (nan where the
    tiles-in-waves model applies); and cost. names: the keys' names, when the caller has them (they key a
    cache of what the keys alone decide)."""
    s = _static(keys, names)
    count = len(keys)
    steps = s.no_partials  # read-only: made per problem below only where a family has its own
    if s.own_partials:
        steps = steps.copy()
        for i in s.own_partials:
            value = s.families[i].partials_cost(problem, keys[i])
            if value is not None:
                steps[i] = value
    view = np.ones((count, 4), dtype=np.int64)
    if len(s.shared_view):
        view[s.shared_view] = backends._DEFAULTS["gemm_view"](problem, keys[s.shared_view[0]])
    for group in s.view_groups:
        view[group] = s.families[group[0]].gemm_view(problem, keys[group[0]])
    m, n, k, batch = view.T
    tiles_m, tiles_n = _ceil_div(m, s.tm), _ceil_div(n, s.tn)
    output_tiles = _ceil_div(tiles_m, s.cm) * s.cm * _ceil_div(tiles_n, s.cn) * s.cn * batch
    runtime, split = s.no_split, s.split_k  # read-only, as steps
    if s.own_split:
        runtime = runtime.copy()
        for i in s.own_split:
            runtime[i] = s.families[i].runtime_split(keys[i], int(output_tiles[i]), int(k[i]), int(s.units[i]))
        split = s.split_k * runtime
    waves = _ceil_div(output_tiles * split, s.units)
    k_per_tile = _ceil_div(_ceil_div(k, split), s.tk) * s.tk
    cost = waves * s.tm * s.tn * k_per_tile / s.efficiency * s.cost_factor
    if s.own_partials:  # the same product, in the same order, as estimated_cost's
        partial = ~np.isnan(steps)
        cost[partial] = (steps * s.tm * s.tn * s.tk * s.resident / s.efficiency * s.cost_factor)[partial]
    for group in s.factor_groups:
        factor = s.families[group[0]].problem_factor(problem, keys[group[0]])
        if factor != 1:  # mostly 1: no pass over the group
            cost[group] *= factor
    return {"m": m, "n": n, "k": k, "batch": batch, "tiles_m": tiles_m, "tiles_n": tiles_n,
            "output_tiles": output_tiles, "runtime_split": runtime, "split": split, "waves": waves,
            "k_per_tile": k_per_tile, "partials_steps": steps, "cost": cost, "static": s}


def gemm_view(problem, key) -> tuple[int, int, int, int]:
    """(m, n, k, batch) of the (implicit) GEMM the kernel performs for the problem (its family's view)."""
    return backends.family_of(key).gemm_view(problem, key)


def learned(problem, kernels, models=None) -> list:
    """The learned model's order where one covers the kernels, else analytic. Kernels outside the model's domain
    (its applies_to, e.g. the low-alignment fallbacks it was never trained on: DESIGN.md invariant 10) rank after
    the ones it covers, in analytic order; with none covered, analytic orders all. models: a folder of model files
    used instead of the shipped ones (learned.model_path), None for the shipped ones."""
    from . import learned as learned_models

    ranked, rest = learned_models.order(problem, list(kernels), models)
    return ranked + analytic(problem, rest) if ranked is not None else analytic(problem, rest)


RANKERS = {"first_fit": first_fit, "analytic": analytic, "learned": learned}
