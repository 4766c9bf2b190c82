"""The learned ranker: a tree ensemble, trained on the project's own benchmark sweeps, that predicts how
much slower each kernel is than the best one for a problem; the ranker sorts by that prediction.

Models are data (models/<backend>_<arch>_<task>.json, written by bench/sweeps/train.py from LightGBM):
per node a feature, a threshold and two children, evaluated here by leaf masks for every tree and every
candidate at once (by native/forest.c where it is built, else by numpy). The features come from one function
(features) that both training and the runtime call, so the two can never disagree about what a feature means.
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import json
import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np

from . import native

MODELS_DIR = Path(__file__).with_name("models")
MODEL_SCHEMA = 1

GEMM_FEATURES = (
    "log2_m", "log2_n", "log2_k", "log2_mnk", "log2_batch",
    "tile_m", "tile_n", "tile_k", "cluster_m", "cluster_n", "cooperative", "stream_k", "split_k", "stages",
    "tiles", "log2_tiles", "waves", "last_wave_fill", "edge_fill_m", "edge_fill_n", "edge_fill",
    "k_iterations", "log2_k_iterations", "log2_analytic_cost", "tile_intensity", "cluster_tiles_idle",
)
# conv, one model per direction: the problem, the kernel and how the kernel's family maps the problem onto its
# tiles (its cost model in templates/<backend>/<family>/__init__.py, through selection.cost_terms)
CONV_FEATURES = (
    "log2_batch_n", "log2_groups", "log2_c_per_group", "log2_k_per_group", "spatial_dims", "log2_in_pixels",
    "log2_out_pixels", "log2_taps", "stride", "dilation", "log2_problem_flops", "depthwise", "pointwise",
    "tile_m", "tile_n", "tile_k", "mma_m", "mma_n", "mma_k", "warps", "stages", "split_k", "cluster_m", "cluster_n",
    "resident_ctas", "log2_cost_factor",
    "log2_m", "log2_n", "log2_k", "log2_view_batch", "lanes", "log2_tiles", "runtime_split", "waves",
    "last_wave_fill", "edge_fill_m", "edge_fill_n", "edge_fill", "log2_k_iterations", "persistent_partials",
    "log2_analytic_cost", "tile_intensity", "log2_c_align", "log2_k_align",
)
# log2_c_align / log2_k_align: the largest power of two (up to 16) dividing C/G and K/G. A kernel that needs fewer
# aligned channels (cutlass.align 1 / 4) is the fastest one on the problems no other kernel runs, and slower than
# its aligned twins where those run too; without these columns the trees could not tell the two cases apart and
# ranked the generic kernels first on aligned problems (2-2.5x misses; bench/results/conv_model_h200/align_features)
ALIGN_CAP = 16
FEATURES = {"gemm": GEMM_FEATURES, "conv": CONV_FEATURES}
# the features a kernel alone decides (its key and selection's per-key statics), whatever the problem
KERNEL_FEATURES = frozenset({
    "tile_m", "tile_n", "tile_k", "mma_m", "mma_n", "mma_k", "warps", "stages", "split_k", "cluster_m", "cluster_n",
    "cooperative", "stream_k", "resident_ctas", "log2_cost_factor", "tile_intensity"})
TASKS = ("gemm", "conv_fwd", "conv_bwd_data", "conv_bwd_weight")  # one model per backend, arch and task


def task_of(key) -> str:
    """A kernel's (or problem's) model task: gemm, or conv_<direction>."""
    sig = getattr(key, "signature", key)
    return sig.op if sig.op != "conv" else f"conv_{sig.direction}"


class _KernelBlock(NamedTuple):
    """What a list of kernels alone decides of their features (_kernel_block): the feature matrix with the
    kernel-only columns (KERNEL_FEATURES) filled, and the per-key statics the other columns are computed from,
    as floats."""
    template: np.ndarray
    tm: np.ndarray
    tn: np.ndarray
    tk: np.ndarray
    cm: np.ndarray
    cn: np.ndarray
    split_k: np.ndarray
    units: np.ndarray
    slots: np.ndarray  # units x resident CTAs


def _kernel_block(op: str, keys, s) -> _KernelBlock:
    alg = [key.algorithm for key in keys]
    col = lambda f: np.array([f(a) for a in alg], dtype=np.float64)  # noqa: E731
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    tm, tn, tk = f64(s.tm), f64(s.tn), f64(s.tk)
    kernel = {"tile_m": tm, "tile_n": tn, "tile_k": tk, "cluster_m": f64(s.cm), "cluster_n": f64(s.cn),
              "split_k": f64(s.split_k), "tile_intensity": tm * tn / (tm + tn),
              "resident_ctas": f64(s.resident), "log2_cost_factor": np.log2(s.cost_factor),
              "mma_m": col(lambda a: a.mma[0]), "mma_n": col(lambda a: a.mma[1]), "mma_k": col(lambda a: a.mma[2]),
              "warps": col(lambda a: a.warps[0] * a.warps[1] * a.warps[2]), "stages": col(lambda a: a.stages),
              "cooperative": col(lambda a: a.pipeline.endswith("cooperative")),
              "stream_k": col(lambda a: a.scheduler == "stream_k")}
    template = np.full((len(keys), len(FEATURES[op])), np.nan)  # a column features() leaves unfilled shows
    for name in KERNEL_FEATURES.intersection(FEATURES[op]):
        template[:, COLUMN[op][name]] = kernel[name]
    units = f64(s.units)
    return _KernelBlock(template, tm, tn, tk, kernel["cluster_m"], kernel["cluster_n"], kernel["split_k"], units,
                        units * kernel["resident_ctas"])


def features(problem, keys, names=None) -> np.ndarray:
    """The features (rows: keys, columns: FEATURES[problem.op]) of a problem with each kernel: the one function
    training (bench/sweeps/train.py) and the runtime ranker call. names: the keys' names where the caller has
    them (they key the caches of what the keys alone decide)."""
    from .selection import cost_terms

    keys = list(keys)
    t = cost_terms(problem, keys, names)
    op = problem.op
    b = _memo(_KEY_COLUMNS, (op, names if names is not None else tuple(keys)),
              lambda: _kernel_block(op, keys, t["static"]))
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    m, n, k, batch = (f64(t[c]) for c in ("m", "n", "k", "batch"))
    tiles_m, tiles_n = f64(t["tiles_m"]), f64(t["tiles_n"])
    cols = {"log2_analytic_cost": np.log2(t["cost"]), "log2_m": np.log2(m), "log2_n": np.log2(n),
            "log2_k": np.log2(k), "edge_fill_m": m / (tiles_m * b.tm), "edge_fill_n": n / (tiles_n * b.tn),
            "edge_fill": m * n / (tiles_m * b.tm * tiles_n * b.tn)}
    if op == "gemm":  # the shipped GEMM model's definitions: the key's split_k, no cluster rounding
        tiles = tiles_m * tiles_n * batch * b.split_k
        waves = tiles / b.units
        k_iters = np.ceil(np.ceil(k / b.split_k) / b.tk)
        cluster_tiles = np.ceil(tiles_m / b.cm) * b.cm * np.ceil(tiles_n / b.cn) * b.cn * batch * b.split_k
        cols.update({"log2_mnk": np.log2(m * n * k), "log2_batch": np.log2(batch), "tiles": tiles,
                     "log2_tiles": np.log2(tiles), "waves": waves,
                     "last_wave_fill": tiles / (np.ceil(waves) * b.units), "k_iterations": k_iters,
                     "log2_k_iterations": np.log2(k_iters), "cluster_tiles_idle": (cluster_tiles - tiles) / cluster_tiles})
    else:
        tiles = f64(t["output_tiles"] * t["split"])
        waves = tiles / b.slots
        cols.update({"log2_view_batch": np.log2(batch), "lanes": f64((batch == 1) & (problem.g > 1)),
                     "log2_tiles": np.log2(tiles), "runtime_split": f64(t["runtime_split"]), "waves": waves,
                     "last_wave_fill": tiles / (np.ceil(waves) * b.slots),
                     "log2_k_iterations": np.log2(np.ceil(np.ceil(k / f64(t["split"])) / b.tk)),
                     "persistent_partials": f64(~np.isnan(t["partials_steps"]))})
    out = b.template.copy()
    if op == "conv":
        out[:, _CONV_PROBLEM_COLUMNS] = _conv_problem_columns(problem)  # one row, broadcast
    for name, value in cols.items():
        out[:, COLUMN[op][name]] = value
    return out


# the conv features of the problem alone, in this order (_conv_problem_columns)
_CONV_PROBLEM = ("log2_batch_n", "log2_groups", "log2_c_per_group", "log2_k_per_group", "spatial_dims",
                 "log2_in_pixels", "log2_out_pixels", "log2_taps", "stride", "dilation", "log2_problem_flops",
                 "depthwise", "pointwise", "log2_c_align", "log2_k_align")
COLUMN = {op: {name: i for i, name in enumerate(names)} for op, names in FEATURES.items()}
_CONV_PROBLEM_COLUMNS = np.array([COLUMN["conv"][name] for name in _CONV_PROBLEM])


def _conv_problem_columns(p) -> list[float]:
    cg, kg, taps = p.c // p.g, p.k // p.g, math.prod(p.filter_size)
    pointwise = taps == 1 and set(p.stride) == {1} and not any(p.pad_lo) and not any(p.pad_hi)
    return [math.log2(p.n), math.log2(p.g), math.log2(cg), math.log2(kg), p.spatial_dims,
            math.log2(math.prod(p.in_size)), math.log2(math.prod(p.out_size)), math.log2(taps), max(p.stride),
            max(p.dilation), math.log2(p.flops()), float(cg == 1 and kg == 1), float(pointwise),
            math.log2(min(ALIGN_CAP, cg & -cg)), math.log2(min(ALIGN_CAP, kg & -kg))]


_KEY_COLUMNS: OrderedDict = OrderedDict()


def _memo(cache: OrderedDict, token, make):
    """cache[token], made by make() the first time; the oldest of more than 64 entries dropped."""
    value = cache.get(token)
    if value is None:
        value = cache[token] = make()
        if len(cache) > 64:
            cache.popitem(last=False)
    return value


def gemm_features(problem, key) -> list[float]:
    """The features of one (problem, kernel) pair, in GEMM_FEATURES order."""
    return features(problem, [key])[0].tolist()


class _MaskBits(NamedTuple):
    """Leaf masks of one width: the mask's type, the float type of that width that converts a power of two
    exactly, its bit pattern as an int, the mantissa's bits and the exponent's bias."""
    type: type
    float: type
    int: type
    mantissa: int
    bias: int


_MASK_32 = _MaskBits(np.uint32, np.float32, np.int32, 23, 127)
_MASK_64 = _MaskBits(np.uint64, np.float64, np.int64, 52, 1023)


class _Masks(NamedTuple):
    """An ensemble's leaf masks (TreeEnsemble._masks builds them)."""
    tables: dict            # feature -> (its splits' sorted thresholds, table [prefix length, tree] -> leaves left)
    leaf_values: np.ndarray  # [tree * width + leaf]
    offsets: np.ndarray     # each tree's offset into leaf_values, less the float exponent's bias
    bits: _MaskBits
    stack: np.ndarray       # every table's rows one after another, so that one gather reads rows of many tables
    base: dict              # feature -> its table's first row in stack
    thresholds: dict        # feature -> its thresholds as a list, searched by bisect for a value of the problem


# odd 64-bit multipliers: a row of table indices hashed to one number (_distinct_rows)
_ROW_HASH = (np.random.default_rng(2026).integers(0, 2 ** 62, size=256, dtype=np.int64) * 2 + 1).view(np.uint64)


def _distinct_rows(at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct rows of a non-negative int64 matrix, each row's index among them). Rows are hashed to one
    number each, made unique in 1D and checked against the rows they stand for (np.unique over rows, 10x slower,
    where two rows' hashes collide or a row is wider than the multipliers)."""
    if at.shape[1] <= len(_ROW_HASH):
        _, first, inverse = np.unique(at.view(np.uint64) @ _ROW_HASH[:at.shape[1]], return_index=True,
                                      return_inverse=True)
        inverse = inverse.reshape(-1)
        if (at[first[inverse]] == at).all():
            return at[first], inverse
    distinct, inverse = np.unique(at, axis=0, return_inverse=True)
    return distinct, inverse.reshape(-1)


class _Compiled(NamedTuple):
    """An ensemble's leaf masks as the native evaluator (native/forest.c) takes them."""
    function: object         # td_forest_u32 or td_forest_u64
    trees: int
    width: int               # leaves per tree in leaf_values
    tables: tuple            # pointers to per feature base, first, count; thresholds; stack (forest.c's order)
    leaves: int              # pointer to leaf_values
    arrays: tuple            # the arrays behind those pointers, kept alive with them
    columns: dict            # frozenset of row columns -> the other features' indices (int64), made once each


class TreeEnsemble:
    """Sum of regression trees stored as flat node arrays. A leaf is a node that sends every row to
    itself (feature 0, threshold +inf), so walking a fixed number of levels ends at each row's leaf.

    predict() does not walk the trees: it evaluates them by leaf masks (QuickScorer, Lucchese et al. 2015). Each
    tree's leaves, numbered left to right, are bits of a mask; a split whose test x <= threshold fails rules out
    the leaves of its left subtree, and a row exits at the leftmost leaf no failed test ruled out. The tests that
    fail for a value of a feature are the splits on it with a threshold below the value, a prefix of those splits
    sorted by threshold, so per feature one table holds, for each prefix length and tree, the AND of those
    splits' masks: a row's mask in a tree is the AND over the features of one table row each (found by binary
    search of the row's value). numpy work per prediction: features x rows x trees, with no loop over depth."""

    def __init__(self, trees: dict):
        self.feature = np.asarray(trees["feature"], dtype=np.int64)
        self.threshold = np.asarray(trees["threshold"], dtype=np.float64)
        self.left = np.asarray(trees["left"], dtype=np.int64)
        self.right = np.asarray(trees["right"], dtype=np.int64)
        self.value = np.asarray(trees["value"], dtype=np.float64)
        self.roots = np.asarray(trees["roots"], dtype=np.int64)
        self.depth = int(trees["depth"])
        n = len(self.feature)
        if not (len(self.threshold) == len(self.left) == len(self.right) == len(self.value) == n):
            raise ValueError("tree arrays differ in length")
        if n and (self.left.min() < 0 or self.right.max() >= n or self.left.max() >= n or self.right.min() < 0):
            raise ValueError("tree child index out of range")
        self._row_masks: OrderedDict = OrderedDict()  # rows token -> _keep_row_masks' [row, tree] masks

    def predict(self, x: np.ndarray, rows_token=None, row_columns: frozenset = frozenset()) -> np.ndarray:
        """One prediction per row of x (rows x features). row_columns: columns whose values depend on the row's
        kernel alone (its tile, warps, ...), the same for every problem while the rows are the kernels that
        rows_token names; what those columns leave of each tree's leaves is then kept per token, so that a new
        problem only searches the columns it changes.

        numpy's cost per operation, not per element, dominates at a bundle's size (tens of rows, hundreds of
        trees), so the work is batched: a column alike in every row (a feature of the problem alone) is searched
        in Python and all such columns' table rows ANDed by one gather; the varying columns' table rows are
        gathered for the distinct rows of their values only (kernels of one tile shape share them)."""
        masks = self._masks
        if masks is None:  # a tree with more leaves than a mask has bits
            return self.walk(x)
        rows, bits = x.shape[0], masks.bits
        if not rows:
            return np.zeros(0)
        if self._compiled is not None:
            return self._predict_compiled(x, rows_token, row_columns)
        kept = None if rows_token is None else self._row_masks.get(rows_token)
        features = [f for f in masks.tables if kept is None or f not in row_columns]
        alike = (x[:, features] == x[0, features]).all(axis=0).tolist()  # NaN is never alike: searched per row
        first = x[0].tolist()
        common, varying, keep = [], [], False
        for f, same in zip(features, alike):
            if same:
                thresholds = masks.thresholds[f]
                value = first[f]
                # NaN fails every split's x <= threshold, as np.searchsorted places it: past every threshold
                common.append(masks.base[f] + (len(thresholds) if value != value else
                                               bisect.bisect_left(thresholds, value)))
            elif rows_token is not None and f in row_columns:
                keep = True
            else:
                varying.append(f)
        if keep:
            kept = self._keep_row_masks(x, rows_token, row_columns)  # every row column, constant ones too
        together = np.bitwise_and.reduce(masks.stack[common], axis=0) if common else None
        if varying:
            at = np.empty((rows, len(varying)), dtype=np.int64)
            for j, f in enumerate(varying):
                at[:, j] = np.searchsorted(masks.tables[f][0], x[:, f], side="left")
            at += [masks.base[f] for f in varying]
            distinct, inverse = _distinct_rows(at)
            # one gather per feature, ANDed in place: cheaper than a reduce over the middle axis of one gather
            left = masks.stack.take(distinct[:, 0], axis=0)
            for j in range(1, distinct.shape[1]):
                left &= masks.stack.take(distinct[:, j], axis=0)
            if together is not None:
                left &= together
            alive = left[inverse]
        else:
            alive = np.empty((rows, len(self.roots)), dtype=bits.type)
            alive[:] = ~bits.type(0) if together is None else together
        if kept is not None:
            alive &= kept
        lowest = np.negative(alive)  # two's complement: -a & a is the lowest set bit, the leftmost leaf left
        lowest &= alive
        # its index: the exponent of the power of two as a float (exact, whatever the float's width)
        exponent = lowest.astype(bits.float).view(bits.int)
        exponent >>= bits.mantissa
        exponent += masks.offsets
        return masks.leaf_values.take(exponent).sum(axis=1)

    def _predict_compiled(self, x: np.ndarray, rows_token, row_columns: frozenset) -> np.ndarray:
        """predict() by the native evaluator: the same tables and the same kept masks, one call per prediction."""
        compiled = self._compiled
        x = np.ascontiguousarray(x, dtype=np.float64)
        kept = None if rows_token is None else self._row_masks.get(rows_token)
        if kept is None and rows_token is not None:
            mine = sorted(row_columns & self._masks.tables.keys())
            if mine and not (x[:, mine] == x[0, mine]).all():  # as the numpy path: kept where a row column varies
                kept = self._keep_row_masks(x, rows_token, row_columns)
        searched = frozenset() if kept is None else row_columns
        columns = compiled.columns.get(searched)
        if columns is None:
            columns = compiled.columns[searched] = np.array(
                [f for f in self._masks.tables if f not in searched], dtype=np.int64)
        out = np.empty(x.shape[0])
        self._run_compiled(x, columns, kept, None, out)
        return out

    def _run_compiled(self, x: np.ndarray, columns: np.ndarray, start, masks_out, out) -> None:
        compiled = self._compiled
        trees = compiled.trees
        scratch = np.empty(3 * trees, dtype=self._masks.bits.type)  # forest.c's shared (two parts) and alive
        varying = np.empty(max(len(columns), 1), dtype=np.int64)
        status = compiled.function(
            x.shape[0], trees, compiled.width, x.ctypes.data, x.shape[1], len(columns), columns.ctypes.data,
            *compiled.tables, None if start is None else start.ctypes.data, trees, compiled.leaves,
            scratch.ctypes.data, scratch[2 * trees:].ctypes.data, varying.ctypes.data,
            None if masks_out is None else masks_out.ctypes.data, None if out is None else out.ctypes.data)
        if status != 0:
            raise RuntimeError("the native tree evaluator found a tree with no leaf left: its tables are broken")

    @functools.cached_property
    def _compiled(self) -> Optional[_Compiled]:
        """The leaf masks' tables for native/forest.c, or None without it (TD_NATIVE=0, no C compiler) or without
        leaf masks (the walk evaluates those trees)."""
        masks = self._masks
        library = None if masks is None else native.forest()
        if library is None:
            return None
        size = max(masks.tables, default=-1) + 1
        base, first, count = (np.zeros(size, dtype=np.int64) for _ in range(3))
        at = 0
        for f, (thresholds, _) in masks.tables.items():
            base[f], first[f], count[f] = masks.base[f], at, len(thresholds)
            at += len(thresholds)
        thresholds = np.concatenate([t for t, _ in masks.tables.values()] or [np.zeros(0)]).astype(np.float64)
        stack, leaves = np.ascontiguousarray(masks.stack), np.ascontiguousarray(masks.leaf_values, dtype=np.float64)
        tables = (base, first, count, thresholds, stack)
        function = library.td_forest_u32 if masks.bits is _MASK_32 else library.td_forest_u64
        return _Compiled(function, len(self.roots), len(leaves) // max(len(self.roots), 1),
                         tuple(a.ctypes.data for a in tables), leaves.ctypes.data, (*tables, leaves), {})

    def _keep_row_masks(self, x: np.ndarray, rows_token, row_columns: frozenset) -> np.ndarray:
        """[row, tree]: what the row_columns leave of each tree's leaves, kept for the token (the most recent 64)."""
        tables, bits = self._masks.tables, self._masks.bits
        mine = sorted(row_columns & tables.keys())
        if self._compiled is not None:
            alive = np.empty((x.shape[0], len(self.roots)), dtype=bits.type)
            self._run_compiled(x, np.array(mine, dtype=np.int64), None, alive, None)
        else:
            alive = np.full((x.shape[0], len(self.roots)), ~bits.type(0))
            for f in mine:
                thresholds, table = tables[f]
                alive &= table[np.searchsorted(thresholds, x[:, f], side="left")]
        self._row_masks[rows_token] = alive
        if len(self._row_masks) > 64:
            self._row_masks.popitem(last=False)
        return alive

    @functools.cached_property
    def _masks(self):
        """_Masks: per feature the sorted thresholds of its splits and the table [prefix length, tree] -> what
        those splits leave of the tree's leaves, the leaves' values, the mask width's bits; None when a tree has
        more than 64 leaves."""
        trees = len(self.roots)
        leaves_of, masks_of, tree_of = [], {}, {}
        left, right = self.left.tolist(), self.right.tolist()
        for t, root in enumerate(self.roots.tolist()):
            leaves, stack, first = [], [root], {}
            while stack:  # depth first, left child first: the leaves in left-to-right order
                node = stack.pop()
                if left[node] == node:
                    leaves.append(node)
                    continue
                first[node] = len(leaves)  # its subtree's first leaf; the right child's is its left subtree's end
                stack += [right[node], left[node]]
            if len(leaves) > 64:
                return None
            leaves_of.append(leaves)
            position = {leaf: i for i, leaf in enumerate(leaves)}
            for node, start in first.items():
                end = first[right[node]] if right[node] in first else position[right[node]]
                masks_of[node] = ((1 << end) - 1) ^ ((1 << start) - 1)  # its left subtree's leaves
                tree_of[node] = t
        width = max(map(len, leaves_of), default=1)
        bits = _MASK_32 if width <= 32 else _MASK_64
        leaf_values = np.zeros((trees, width))
        for t, leaves in enumerate(leaves_of):
            leaf_values[t, :len(leaves)] = self.value[leaves]
        # leaf_values.take(exponent + offsets): an exponent of 2**i as a float is bias + i
        offsets = np.arange(trees, dtype=np.int64) * width - bits.bias
        tables = {}
        splits = np.array(sorted(masks_of), dtype=np.int64)
        for f in np.unique(self.feature[splits]).tolist():
            mine = splits[self.feature[splits] == f]
            mine = mine[np.argsort(self.threshold[mine], kind="stable")]
            every = ~bits.type(0)
            step = np.full((len(mine), trees), every)
            step[np.arange(len(mine)), [tree_of[n] for n in mine.tolist()]] = [
                every ^ bits.type(masks_of[n]) for n in mine.tolist()]
            table = np.empty((len(mine) + 1, trees), dtype=bits.type)
            table[0] = every
            np.bitwise_and.accumulate(step, axis=0, out=table[1:])
            tables[f] = (self.threshold[mine], table)
        stack = np.concatenate([table for _, table in tables.values()]) if tables else np.zeros((0, trees), bits.type)
        base = dict(zip(tables, np.cumsum([0] + [len(table) for _, table in tables.values()]).tolist()))
        return _Masks(tables, leaf_values.ravel(), offsets, bits, stack, base,
                      {f: thresholds.tolist() for f, (thresholds, _) in tables.items()})

    def walk(self, x: np.ndarray) -> np.ndarray:
        """predict() by walking the trees: every (tree, row) pair goes down one level per step and leaves the walk
        at its leaf (the reference the leaf masks are tested against, and the evaluator of trees too wide for
        them)."""
        rows = x.shape[0]
        node = np.repeat(self.roots, rows)
        row = np.tile(np.arange(rows), len(self.roots))
        out = np.zeros(rows)
        for _ in range(self.depth + 1):
            at_leaf = self.left[node] == node
            if at_leaf.any():
                out += np.bincount(row[at_leaf], weights=self.value[node[at_leaf]], minlength=rows)
                walking = ~at_leaf
                node, row = node[walking], row[walking]
                if not len(node):
                    break
            go_left = x[row, self.feature[node]] <= self.threshold[node]
            node = np.where(go_left, self.left[node], self.right[node])
        return out


class Model:
    """One trained ranker: the ensemble, its feature list, what it applies to and the kernels it was trained on."""

    def __init__(self, data: dict, origin: str = ""):
        if data.get("schema") != MODEL_SCHEMA:
            raise ValueError(f"{origin}: model schema {data.get('schema')!r}, expected {MODEL_SCHEMA}")
        self.applies_to = data["applies_to"]
        self.op = self.applies_to["op"]
        if self.op not in FEATURES:
            raise ValueError(f"{origin}: a model for op {self.op!r}; this runtime has features for "
                             f"{', '.join(FEATURES)}")
        self.direction = self.applies_to.get("direction") if self.op == "conv" else None
        self.task = self.op if self.op != "conv" else f"conv_{self.direction}"
        if self.task not in TASKS:
            raise ValueError(f"{origin}: a conv model names no direction (applies_to.direction)")
        # a model names the features it was trained on, in its own column order: any of this runtime's (a model
        # trained before a feature was added keeps working on the features it knows)
        names = tuple(data["features"])
        unknown = [name for name in names if name not in FEATURES[self.op]]
        if unknown:
            raise ValueError(f"{origin}: the model uses features this runtime does not compute ({self.op}): "
                             f"{', '.join(unknown)}")
        self.columns = None if names == FEATURES[self.op] else np.array([FEATURES[self.op].index(n) for n in names])
        self.trees = TreeEnsemble(data["trees"])
        self.kernel_columns = frozenset(i for i, name in enumerate(names) if name in KERNEL_FEATURES)
        self.meta = data.get("trained", {})
        # what identifies this model: its trees, features and domain (not where the file lies)
        body = json.dumps({k: data[k] for k in ("features", "applies_to", "trees")}, sort_keys=True)
        self.version = f"{self.meta.get('date', 'undated')}-{hashlib.sha256(body.encode()).hexdigest()[:12]}"
        self.kernel_names = tuple(self.meta.get("kernel_names") or ())
        # the ranker sorts ascending: a model of a quantity where higher is better (throughput) is negated
        self.sign = -1.0 if data.get("higher_is_better") else 1.0
        self._target = data.get("target", "log_time_ratio")

    def applies(self, problem, key) -> bool:
        want = self.applies_to
        return (key.backend == want["backend"] and key.arch == want["arch"] and key.signature.op == self.op
                and (self.direction is None or key.signature.direction == self.direction)
                and key.signature.dtype_a in want["dtypes"] and key.signature.layout in want["layouts"]
                and all(getattr(key.algorithm, f) in v for f, v in want.get("algorithm", {}).items()))

    @functools.cached_property
    def _seen(self) -> frozenset:
        from .spec.key import parse_kernel_name

        return frozenset(_what_the_model_sees(parse_kernel_name(n)) for n in self.kernel_names)

    def knows(self, key) -> bool:
        """Whether the model was trained on this kernel: one of its training kernels has the same layout and
        algorithm (a dtype of the model's domain, any epilogue: neither is a feature)."""
        return _what_the_model_sees(key) in self._seen

    def unseen(self, keys) -> list[str]:
        """The names of the keys this model covers (applies) but was never trained on; every covered key when
        the model does not list its training kernels (an older model file)."""
        return [key.name for key in keys if self.applies(None, key) and not self.knows(key)]

    @property
    def target(self) -> str:
        return self._target

    def predicted_times(self, problem, keys, names=None) -> tuple[np.ndarray, str]:
        """(each key's predicted time, its unit): milliseconds for a throughput model (log1p_tflops), else the
        time relative to the problem's best kernel ("x_best")."""
        raw = self._predict(problem, keys, names)
        kind = self._target.split(":", 1)[0]
        if kind == "log1p_tflops":
            return problem.flops() / (np.maximum(np.expm1(raw), 1e-12) * 1e12) * 1e3, "ms"
        if kind == "ratio":
            return 1.0 / np.maximum(raw, 1e-6), "x_best"
        return np.exp(raw), "x_best"  # log(time / best time)

    def predict(self, problem, keys, names=None) -> np.ndarray:
        """The model's score of each key on the problem, lower is better (e.g. the predicted log(time / best
        time), or minus a predicted throughput)."""
        return self.sign * self._predict(problem, keys, names)

    def _predict(self, problem, keys, names) -> np.ndarray:
        # with the kernels' names, what the kernel-only features leave of the trees is kept per kernel list
        x = features(problem, keys, names)
        return self.trees.predict(x if self.columns is None else x[:, self.columns], names, self.kernel_columns)


def _what_the_model_sees(key) -> tuple:
    return key.backend, key.arch, key.signature.op, key.signature.direction, key.signature.layout, key.algorithm


_PACK_MODELS: dict[str, Path] = {}  # file name -> a model a loaded pack carries (loader.py)


def _model_places(backend: str, arch: str, task: str, models: Optional[Path]) -> list[str]:
    """Where a task's model file is looked for, in order: the folder a registry was loaded with (`models`), the
    runtime's own models, a loaded pack's."""
    name = f"{backend}_{arch}_{task}.json"
    places = [os.path.join(MODELS_DIR, name), _PACK_MODELS.get(name)]
    return [str(place) for place in ([None if models is None else os.path.join(models, name)] + places) if place]


def model_path(backend: str, arch: str, task: str, models: Optional[Path] = None) -> Path:
    """The model file for a task (gemm, conv_fwd, conv_bwd_data, conv_bwd_weight): the first of _model_places that
    exists, else the runtime's own (absent)."""
    found = next((place for place in _model_places(backend, arch, task, models) if os.path.exists(place)), None)
    return Path(found) if found else MODELS_DIR / f"{backend}_{arch}_{task}.json"


def model_file(backend: str, arch: str, task: str, models: Optional[Path] = None) -> str:
    """The model file as a user is shown it: its name for one the runtime ships, its path where a models folder
    is in use."""
    path = model_path(backend, arch, task, models)
    return path.name if models is None else str(path)


def add_pack_models(paths) -> None:
    """Use these model files (named <backend>_<arch>_<task>.json) for backends / arches / tasks the runtime
    ships no model for; the first pack loaded that carries one wins."""
    new = [path for path in map(Path, paths) if path.name not in _PACK_MODELS]
    for path in new:
        _PACK_MODELS[path.name] = path
    if new:
        clear_models()


def model_for(backend: str, arch: str, task: str, models: Optional[Path] = None) -> Optional[Model]:
    """The model for a backend, arch and task (gemm or conv_<direction>), or None when there is none; models: a
    folder whose files replace the shipped ones (model_path). A file is read once while it stays the same (a model
    retrained into the same folder is read again)."""
    if task not in TASKS:
        return None
    for path in _model_places(backend, arch, task, models):  # one stat each: this runs on every first select
        try:
            stat = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        return _read_model(str(path), stat.st_mtime_ns, stat.st_size)
    return None


@functools.lru_cache(maxsize=64)
def _read_model(path: str, mtime_ns: int, size: int) -> Model:
    return Model(json.loads(Path(path).read_text()), path)


def clear_models() -> None:
    """Forget the model files read so far (model_for reads them again)."""
    _read_model.cache_clear()


def model_of(kernels, models: Optional[Path] = None) -> Optional[Model]:
    """The model for the kernels' backend, arch and task (taken from the first), or None."""
    if not kernels:
        return None
    first = kernels[0].key
    return model_for(first.backend, first.arch, task_of(first), models)


def split(problem, kernels, models: Optional[Path] = None) -> tuple[list, list]:
    """(the kernels a shipped model covers, the others). Where the model's domain holds a kernel its card says it
    was never trained on, it ranks none of them (its prediction for that kernel would be a guess, and the
    kernels it knows would all rank before it): the caller's analytic order takes them all."""
    return _split(model_of(kernels, models), kernels)


def _split(model, kernels, listed=None) -> tuple[list, list]:
    if model is None:
        return [], list(kernels)
    token = (model.version, (listed or _listed(kernels)).names)  # applies() and knows() read the keys alone
    covers, every = _memo(_COVERS, token, lambda: _coverage(model, kernels))
    if every or not covers:
        return (list(kernels), []) if every else ([], list(kernels))
    covered, rest = [], []
    for kern, covered_by_model in zip(kernels, covers):
        (covered if covered_by_model else rest).append(kern)
    return covered, rest


_COVERS: OrderedDict = OrderedDict()  # (model version, kernel names) -> _coverage's


def _coverage(model, kernels) -> tuple[list, bool]:
    """(whether the model applies to each kernel, whether to all of them); ([], False) where it applies to one it
    never saw (a card that lists no kernels, an older model file, vouches for all of them)."""
    covers = [model.applies(None, kern.key) for kern in kernels]
    if model.kernel_names and any(c and not model.knows(kern.key) for c, kern in zip(covers, kernels)):
        return [], False
    return covers, all(covers)


def scores(problem, kernels, models: Optional[Path] = None) -> Optional[np.ndarray]:
    """The model's prediction for each kernel, or None when no model covers every kernel (split)."""
    model = model_of(kernels, models)
    covered, rest = _split(model, kernels)
    if not covered or rest:
        return None
    listed = _listed(kernels)
    return model.predict(problem, listed.keys, listed.names)


def rank(problem, kernels, models: Optional[Path] = None) -> Optional[list]:
    """Kernels sorted by the model's prediction, or None when no model covers every kernel (mixing
    predictions with another ranker's estimates would compare unlike numbers). models: as model_for's."""
    if not kernels:
        return []
    ranked, rest = order(problem, kernels, models)
    return None if rest else ranked


def order(problem, kernels, models: Optional[Path] = None) -> tuple[Optional[list], list]:
    """(the kernels the model covers in its order, or None where it covers none; the others, as split gives
    them): rank and split with one look for the model file, as selection.learned calls them on every first
    select."""
    model = model_of(kernels, models)
    listed = None if model is None else _listed(kernels)  # made once for the split and, covering all, the order
    covered, rest = _split(model, kernels, listed)
    if not covered:
        return None, rest
    return _ordered(model, problem, covered, None if rest else listed), rest


def _ordered(model, problem, kernels, listed=None) -> list:
    listed = listed or _listed(kernels)  # the caller's, where it has them for these kernels
    predicted = model.predict(problem, listed.keys, listed.names)
    # by score, then by name (unique) on ties: one sort in C over the names' precomputed places
    return [kernels[i] for i in np.lexsort((listed.name_places, predicted)).tolist()]


class _Listed(NamedTuple):
    """What a list of kernels alone decides, made once per list (_listed)."""
    names: tuple
    keys: list
    name_places: np.ndarray  # each kernel's place in the names' sorted order


_LISTS: OrderedDict = OrderedDict()  # tuple of kernels -> _Listed, the most recent 64 lists


def _listed(kernels) -> _Listed:
    def make():
        names = tuple(kern.name for kern in kernels)
        places = np.empty(len(names), dtype=np.int64)
        places[sorted(range(len(names)), key=names.__getitem__)] = np.arange(len(names))
        return _Listed(names, [kern.key for kern in kernels], places)

    try:
        return _memo(_LISTS, tuple(kernels), make)
    except TypeError:  # kernel-like objects that cannot be hashed (tools' SimpleNamespace): made each time
        return make()


def describe(backend: str, arch: str, models: Optional[Path] = None) -> dict:
    """What each model of a backend/arch (the shipped ones, or a folder's: model_path) was trained on and how well
    it did (for `info`)."""
    out = {}
    for task in TASKS:
        model = model_for(backend, arch, task, models)
        if model is not None:
            brief = {k: model.meta.get(k) for k in ("machine", "date", "shapes", "kernels", "cross_validated")}
            out[task] = {"applies_to": model.applies_to, "version": model.version, "trained": brief}
    return out
