"""The learned ranker: a tree ensemble, trained on the project's own benchmark sweeps, that predicts how
much slower each kernel is than the best one for a problem; the ranker sorts by that prediction.

Models are data (models/<backend>_<arch>_<op>.json, written by bench/sweeps/train_ranker.py from LightGBM):
per node a feature, a threshold and two children, evaluated here with numpy for every tree and every
candidate at once. The features come from one function (gemm_features) that both training and the
runtime call, so the two can never disagree about what a feature means.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Optional

import numpy as np

MODELS_DIR = Path(__file__).with_name("models")
MODEL_SCHEMA = 1

GEMM_FEATURES = (
    "log2_m", "log2_n", "log2_k", "log2_mnk", "log2_batch",
    "tile_m", "tile_n", "tile_k", "cluster_m", "cluster_n", "cooperative", "stream_k", "split_k", "stages",
    "tiles", "log2_tiles", "waves", "last_wave_fill", "edge_fill_m", "edge_fill_n", "edge_fill",
    "k_iterations", "log2_k_iterations", "log2_analytic_cost", "tile_intensity", "cluster_tiles_idle",
)


def gemm_features(problem, key) -> list[float]:
    """The features of one (problem, kernel) pair, in GEMM_FEATURES order."""
    from .selection import compute_units, estimated_cost, gemm_view

    m, n, k, batch = gemm_view(problem, key)
    alg = key.algorithm
    tm, tn, tk = alg.tile
    cm, cn = alg.cluster[0], alg.cluster[1]
    split = alg.split_k
    tiles_m, tiles_n = math.ceil(m / tm), math.ceil(n / tn)
    tiles = tiles_m * tiles_n * batch * split
    units = compute_units(key.backend, key.arch)
    waves = tiles / units
    k_iters = math.ceil(math.ceil(k / split) / tk)
    # tiles a cluster launches beyond the grid (clusters round the grid up to their shape)
    cluster_tiles = math.ceil(tiles_m / cm) * cm * math.ceil(tiles_n / cn) * cn * batch * split
    return [
        math.log2(m), math.log2(n), math.log2(k), math.log2(m * n * k), math.log2(batch),
        tm, tn, tk, cm, cn, float(alg.pipeline.endswith("cooperative")), float(alg.scheduler == "stream_k"),
        split, alg.stages,
        tiles, math.log2(tiles), waves, tiles / (math.ceil(waves) * units), m / (tiles_m * tm), n / (tiles_n * tn),
        m * n / (tiles_m * tm * tiles_n * tn),
        k_iters, math.log2(k_iters), math.log2(estimated_cost(problem, key)), tm * tn / (tm + tn),
        (cluster_tiles - tiles) / cluster_tiles,
    ]


FEATURES = {"gemm": (GEMM_FEATURES, gemm_features)}


class TreeEnsemble:
    """Sum of regression trees stored as flat node arrays. A leaf is a node that sends every row to
    itself (feature 0, threshold +inf), so walking a fixed number of levels ends at each row's leaf."""

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

    def predict(self, x: np.ndarray) -> np.ndarray:
        """One prediction per row of x (rows x features)."""
        rows = np.arange(x.shape[0])[None, :]
        node = np.repeat(self.roots[:, None], x.shape[0], axis=1)
        for _ in range(self.depth):
            go_left = x[rows, self.feature[node]] <= self.threshold[node]
            node = np.where(go_left, self.left[node], self.right[node])
        return self.value[node].sum(axis=0)


class Model:
    """One trained ranker: the ensemble, its feature list and what it applies to."""

    def __init__(self, data: dict, origin: str = ""):
        if data.get("schema") != MODEL_SCHEMA:
            raise ValueError(f"{origin}: model schema {data.get('schema')!r}, expected {MODEL_SCHEMA}")
        self.op = data["applies_to"]["op"]
        names, self._features = FEATURES[self.op]
        if tuple(data["features"]) != names:
            raise ValueError(f"{origin}: the model's features differ from this runtime's ({self.op})")
        self.applies_to = data["applies_to"]
        self.trees = TreeEnsemble(data["trees"])
        self.meta = data.get("trained", {})

    def applies(self, problem, key) -> bool:
        want = self.applies_to
        return (key.backend == want["backend"] and key.arch == want["arch"] and key.signature.op == self.op
                and key.signature.dtype_a in want["dtypes"] and key.signature.layout in want["layouts"]
                and all(getattr(key.algorithm, f) in v for f, v in want.get("algorithm", {}).items()))

    def predict(self, problem, keys) -> np.ndarray:
        """Predicted log(time / best time) of each key on the problem (lower is better)."""
        x = np.array([self._features(problem, key) for key in keys], dtype=np.float64)
        return self.trees.predict(x)


_PACK_MODELS: dict[str, Path] = {}  # file name -> a model a loaded pack carries (loader.py)


def model_path(backend: str, arch: str, op: str) -> Path:
    """The runtime's own model; where it has none, one a loaded pack carries."""
    own = MODELS_DIR / f"{backend}_{arch}_{op}.json"
    return own if own.exists() or own.name not in _PACK_MODELS else _PACK_MODELS[own.name]


def add_pack_models(paths) -> None:
    """Use these model files (named <backend>_<arch>_<op>.json) for backends / arches / ops the runtime ships
    no model for; the first pack loaded that carries one wins."""
    new = [path for path in map(Path, paths) if path.name not in _PACK_MODELS]
    for path in new:
        _PACK_MODELS[path.name] = path
    if new:
        model_for.cache_clear()


@functools.lru_cache(maxsize=None)
def model_for(backend: str, arch: str, op: str) -> Optional[Model]:
    """The shipped model for a backend, arch and op, or None when there is none."""
    path = model_path(backend, arch, op)
    if op not in FEATURES or not path.exists():
        return None
    return Model(json.loads(path.read_text()), str(path))


def split(problem, kernels) -> tuple[list, list]:
    """(the kernels a shipped model covers, the others)."""
    if not kernels:
        return [], []
    first = kernels[0].key
    model = model_for(first.backend, first.arch, first.signature.op)
    if model is None:
        return [], list(kernels)
    covered = [kern for kern in kernels if model.applies(problem, kern.key)]
    return covered, [kern for kern in kernels if not model.applies(problem, kern.key)]


def rank(problem, kernels) -> Optional[list]:
    """Kernels sorted by the model's prediction, or None when no model covers every kernel (mixing
    predictions with another ranker's estimates would compare unlike numbers)."""
    if not kernels:
        return []
    first = kernels[0].key
    model = model_for(first.backend, first.arch, first.signature.op)
    if model is None or not all(model.applies(problem, kern.key) for kern in kernels):
        return None
    scores = model.predict(problem, [kern.key for kern in kernels])
    order = sorted(range(len(kernels)), key=lambda i: (scores[i], kernels[i].name))
    return [kernels[i] for i in order]


def describe(backend: str, arch: str) -> dict:
    """What each shipped model of a backend/arch was trained on and how well it did (for `info`)."""
    out = {}
    for op in FEATURES:
        model = model_for(backend, arch, op)
        if model is not None:
            brief = {k: model.meta.get(k) for k in ("machine", "date", "shapes", "kernels", "cross_validated")}
            out[op] = {"applies_to": model.applies_to, "trained": brief}
    return out
