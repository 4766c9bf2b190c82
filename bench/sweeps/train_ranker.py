"""Train the learned GEMM ranker from sweep data (bench/sweeps/sweep_gemm.py) and ship it as a model file.

    python bench/sweeps/train_ranker.py bench/results/sweep_gemm_h100.json bench/results/sweep_gemm_structured_h100.json \
        [--out runtime/tiledispatch/models]

Target: log(time / best time of the shape) per (shape, kernel), so the model learns how far each kernel
is from the best, not how slow the shape is. The features are the runtime's own (learned.gemm_features).
Quality is efficiency against the exhaustive oracle (best time / time of the ranker's pick) on shapes
the model did not see: 5-fold cross-validation grouped by shape over the random shapes, and the
benchmark-suite shapes, which are never trained on. The analytic ranker is scored on the same shapes.
Needs lightgbm (pip install lightgbm); the runtime only needs numpy.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))

from tiledispatch import learned, selection  # noqa: E402
from tiledispatch.ops.gemm import GemmProblem  # noqa: E402
from tiledispatch.spec.key import parse_kernel_name  # noqa: E402

PARAMS = {"objective": "regression", "learning_rate": 0.05, "num_leaves": 31, "min_child_samples": 10,
          "subsample": 0.85, "subsample_freq": 1, "colsample_bytree": 0.85, "reg_lambda": 0.5, "verbose": -1,
          "seed": 42, "deterministic": True, "num_threads": 2}
ROUNDS = 300
TUNE_TOP = 12  # Registry.tune's default: how many of the model's best-ranked kernels tuning times


class _Named:  # what the rankers take: an object with .key and .name
    def __init__(self, key):
        self.key, self.name = key, key.name


def load_shapes(paths: list[str]) -> tuple[dict, list[dict]]:
    """Every shape of the sweep files; a shape measured in several files (the benchmark suite is in
    each) gets the geometric mean of its times."""
    datas = [json.loads(Path(p).read_text()) for p in paths]
    dtype, layout = datas[0]["dtype"], datas[0]["layout"]
    if any((d["dtype"], d["layout"]) != (dtype, layout) for d in datas):
        raise SystemExit("the sweeps differ in dtype or layout")
    merged: dict = {}
    for data in datas:
        for row in data["rows"]:
            entry = merged.setdefault((row["m"], row["n"], row["k"]), {"role": row.get("role", "random"), "runs": []})
            entry["runs"].append(row["times_ms"])
    shapes = []
    for (m, n, k), entry in merged.items():
        names = sorted(set.intersection(*(set(t) for t in entry["runs"])))
        if len(names) < 2:
            continue
        problem = GemmProblem(m, n, k, dtype, dtype, dtype, layout)
        keys = [parse_kernel_name(n) for n in names]
        times = np.exp(np.mean([[math.log(t[n]) for n in names] for t in entry["runs"]], axis=0))
        x = np.array([learned.gemm_features(problem, key) for key in keys])
        shapes.append({"problem": problem, "names": names, "keys": keys, "times": times, "x": x,
                       "y": np.log(times / times.min()), "role": entry["role"]})
    return datas[0], shapes


def train(shapes: list[dict], rounds: int = ROUNDS):
    import lightgbm as lgb

    x = np.concatenate([s["x"] for s in shapes])
    y = np.concatenate([s["y"] for s in shapes])
    return lgb.train(PARAMS, lgb.Dataset(x, y, feature_name=list(learned.GEMM_FEATURES)), num_boost_round=rounds)


def efficiency(shape: dict, scores, top: int = 1) -> float:
    """best time / time of the fastest of the `top` kernels with the lowest scores (top > 1: what
    measured tuning of the model's top few reaches)."""
    order = sorted(range(len(scores)), key=lambda i: (scores[i], shape["names"][i]))[:top]
    return float(shape["times"].min() / min(shape["times"][i] for i in order))


def analytic_efficiency(shape: dict) -> float:
    kernels = [_Named(k) for k in shape["keys"]]
    pick = selection.analytic(shape["problem"], kernels)[0].name
    return float(shape["times"].min() / shape["times"][shape["names"].index(pick)])


def summary(effs: list[float]) -> dict:
    s = sorted(effs)
    return {"shapes": len(s), "mean": statistics.fmean(s), "median": statistics.median(s),
            "p10": s[len(s) // 10], "min": s[0], "within_10pct": sum(e >= 0.9 for e in s) / len(s)}


def to_model(booster, applies_to: dict, trained: dict) -> dict:
    """LightGBM's dump as flat node arrays (learned.TreeEnsemble's format)."""
    feature, threshold, left, right, value, roots = [], [], [], [], [], []
    depth = 0

    def add(node: dict, level: int) -> int:
        nonlocal depth
        depth = max(depth, level)
        i = len(feature)
        feature.append(0), threshold.append(math.inf), left.append(i), right.append(i), value.append(0.0)
        if "leaf_value" in node:
            value[i] = node["leaf_value"]
            return i
        if node["decision_type"] != "<=":
            raise ValueError(f"unsupported split {node['decision_type']}")
        feature[i], threshold[i] = node["split_feature"], node["threshold"]
        left[i] = add(node["left_child"], level + 1)
        right[i] = add(node["right_child"], level + 1)
        return i

    dump = booster.dump_model()
    for tree in dump["tree_info"]:
        roots.append(add(tree["tree_structure"], 0))
    return {"schema": learned.MODEL_SCHEMA, "features": list(learned.GEMM_FEATURES), "applies_to": applies_to,
            "target": "log(time / best time of the problem's candidates); rank ascending",
            "trained": trained, "trees": {"feature": feature, "threshold": threshold, "left": left,
                                          "right": right, "value": value, "roots": roots, "depth": depth}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", nargs="+")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "runtime" / "tiledispatch" / "models"))
    ap.add_argument("--folds", type=int, default=5)
    a = ap.parse_args()
    data, shapes = load_shapes(a.sweep)
    random_shapes = [s for s in shapes if s["role"] != "suite"]  # random and structured: the training shapes
    suite = [s for s in shapes if s["role"] == "suite"]
    cv, cv_analytic, cv_tuned = [], [], []
    for fold in range(a.folds):  # grouped by shape: a shape is in exactly one held-out fold
        held = random_shapes[fold::a.folds]
        booster = train([s for i, s in enumerate(random_shapes) if i % a.folds != fold])
        cv += [efficiency(s, booster.predict(s["x"])) for s in held]
        cv_tuned += [efficiency(s, booster.predict(s["x"]), TUNE_TOP) for s in held]
        cv_analytic += [analytic_efficiency(s) for s in held]
    booster = train(random_shapes)
    suite_rows = [{"shape": [s["problem"].m, s["problem"].n, s["problem"].k],
                   "learned": efficiency(s, booster.predict(s["x"])), "analytic": analytic_efficiency(s),
                   f"best_of_learned_top{TUNE_TOP}": efficiency(s, booster.predict(s["x"]), TUNE_TOP)}
                  for s in suite]
    keys = shapes[0]["keys"]
    trained = {"sweeps": [Path(p).name for p in a.sweep], "machine": data["machine"].get("gpu"), "date": date.today().isoformat(),
               "dtype": data["dtype"], "layout": data["layout"], "kernels": len(data["kernels"]),
               "shapes": len(random_shapes), "rows": int(sum(len(s["names"]) for s in random_shapes)),
               "lightgbm": {**PARAMS, "rounds": ROUNDS},
               "cross_validated": {"learned": summary(cv), "analytic": summary(cv_analytic),
                                   f"best_of_learned_top{TUNE_TOP}": summary(cv_tuned)},
               "benchmark_suite_unseen": {"learned": summary([r["learned"] for r in suite_rows]) if suite_rows else None,
                                          "analytic": summary([r["analytic"] for r in suite_rows]) if suite_rows else None,
                                          f"best_of_learned_top{TUNE_TOP}": summary(
                                              [r[f"best_of_learned_top{TUNE_TOP}"] for r in suite_rows]) if suite_rows else None,
                                          "per_shape": suite_rows}}
    # fp16 and bf16 share the tensor-core rate and element size on sm90, so one model serves both
    applies_to = {"backend": keys[0].backend, "arch": keys[0].arch, "op": "gemm",
                  "dtypes": sorted({data["dtype"], "bf16"} if data["dtype"] in ("fp16", "bf16") else {data["dtype"]}),
                  "layouts": [data["layout"]],
                  # the pipelines it saw: kernels of others (the low-alignment fallbacks) rank after its own
                  "algorithm": {"pipeline": sorted({k.algorithm.pipeline for k in keys})}}
    model = to_model(booster, applies_to, trained)
    check = learned.Model(model).trees.predict(shapes[0]["x"])  # the numpy evaluator agrees with LightGBM
    if not np.allclose(check, booster.predict(shapes[0]["x"]), rtol=1e-9, atol=1e-9):
        raise SystemExit("numpy tree evaluation differs from LightGBM's prediction")
    out = Path(a.out) / learned.model_path(keys[0].backend, keys[0].arch, "gemm").name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(model, separators=(",", ":")) + "\n")
    print(json.dumps({k: trained[k] for k in ("cross_validated", "benchmark_suite_unseen")}, indent=1))
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB, {len(model['trees']['roots'])} trees)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
