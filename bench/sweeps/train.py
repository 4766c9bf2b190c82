"""Train the learned rankers from sweep stores (bench/sweeps/sweep.py) and ship them as model files.

    python bench/sweeps/train.py bench/results/sweeps/*.jsonl.gz [--out runtime/tiledispatch/models]
        [--target ratio|log1p_tflops|log_time_ratio] [--folds 5] [--rounds 300]

One LightGBM model per (backend, arch, task) found in the stores (task: gemm, conv_fwd, conv_bwd_data,
conv_bwd_weight), on the runtime's own features (learned.features, the function the ranker calls). Targets
(higher is better; the model file says so, and the runtime ranks by it): ratio (the problem's best time / the
kernel's time; the default: on the H200 GEMM sweep of bench/results/gemm_model_h200 it held out best, mean 0.946
and P10 0.859 of the oracle against 0.933 / 0.831 for log1p_tflops and 0.944 / 0.851 for log_time_ratio),
log1p_tflops, log1p of the kernel's TFLOP/s (CK's finding on their data: it lifts the low tail, since small,
slow problems are not drowned by fast ones), or log_time_ratio (-log of time / best time: the first GEMM
model's target). Validation, on problems the model did not see: group k-fold by problem shape (each problem in
one held-out fold) and leave-one-model-family-out (every problem of one suite family, e.g. one network, or the
random problems, held out at once). Quality is efficiency against the exhaustive oracle, best time / time of
the pick, summarised as mean, median, P10 and min, next to the analytic ranker's on the same problems and the
best of the model's top k (what measured tuning of the top k reaches). The model file carries its card under
"trained" (data, machines, kernels, features, target, parameters, metrics, date), and a Markdown card is
written beside it. Needs lightgbm (the `train` extra); the runtime evaluates the trees with numpy.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
from collections import defaultdict
from datetime import date
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
sys.path.insert(0, str(REPO / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sweep import disturbed, problem_from_dict, read_store  # noqa: E402
from tiledispatch import learned, selection  # noqa: E402
from tiledispatch.spec.key import parse_kernel_name  # noqa: E402

# num_leaves 63 / min_child_samples 20: on the 2026-11-29 conv sweeps (3,100 problems per direction) they held out
# better than 31 / 10 in every direction (mean +0.002-0.004, P10 +0.011-0.021), 127 leaves little more
# (bench/results/conv_model_h200/params_comparison.json)
# 150 rounds at rate 0.1: held out by shape as 300 at 0.05 within the seeds' noise (mean +-0.002, P10 -0.000 to
# -0.004 on the 2026-11-29 H200 sweeps; with a model family left out, P10 up to -0.017) for 20-40% less tree
# evaluation per first select (bench/results/model_size_h200)
PARAMS = {"objective": "regression", "learning_rate": 0.1, "num_leaves": 63, "min_child_samples": 20,
          "subsample": 0.85, "subsample_freq": 1, "colsample_bytree": 0.85, "reg_lambda": 0.5, "verbose": -1,
          "seed": 42, "deterministic": True, "num_threads": 2}
ROUNDS = 150
TOP_K = 4  # also reported: the best of the model's top k, what tuning the top k reaches
DECODE_M = 4  # GEMMs with at most this many rows: decode steps, whose held-out picks are reported apart
TARGETS = {
    "log1p_tflops": lambda p: np.log1p(p["flops"] / (p["times"] * 1e-3) / 1e12),
    "ratio": lambda p: p["times"].min() / p["times"],
    "log_time_ratio": lambda p: -np.log(p["times"] / p["times"].min()),
}


class _Named:  # what the rankers take: an object with .key and .name
    def __init__(self, key, name):
        self.key, self.name = key, name


def load_problems(paths: list[str]) -> dict:
    """{(backend, arch, task): {"problems": [...], "machines": {...}, "stores": [...]}}; a problem's kernels are
    those timed on it (refusals left out); a pair's times are those of the kernel binary and timing method its last
    stored line names (a rebuilt kernel's new times replace the old ones, as times taken the current way replace
    those of an earlier method, and a refusal by the new binary drops the pair; a problem whose kernels' times come
    from different methods is left out), and a pair
    timed in several stores or runs of that binary gets the geometric mean of its undisturbed ones (sweep.disturbed;
    of all of them where every one was disturbed)."""
    found: dict = defaultdict(lambda: {"problems": {}, "machines": {}, "stores": [], "sources": []})
    for path in paths:
        metas, rows = read_store(Path(path))
        if not rows:
            print(f"{path}: no results", file=sys.stderr)
            continue
        for meta in metas:
            task = meta["op"] if meta["op"] != "conv" else f"conv_{meta['direction']}"
            entry = found[(meta["backend"], meta["arch"], task)]
            entry["machines"][meta["machine_id"]] = meta["machine"]
            entry["sources"].append({k: meta.get(k) for k in ("git", "toolchain", "timing", "started")})
        for row in rows:
            key = parse_kernel_name(row["kernel"])
            entry = found[(key.backend, key.arch, learned.task_of(key))]
            if Path(path).name not in entry["stores"]:
                entry["stores"].append(Path(path).name)
            p = entry["problems"].setdefault(row["problem_id"], {"dict": row["problem"], "groups": set(),
                                                                  "times": {}})
            # None: stored before the lines named their binary / their timing method (sweep.GPU_TIMING)
            version = (row.get("binary"), row.get("timing"))
            last = p["times"].get(row["kernel"])
            if last is None or last[0] != version:
                last = p["times"][row["kernel"]] = (version, [])
            if row.get("ms") is not None:
                p["groups"].update(row.get("groups") or [row.get("group", "?")])
                last[1].append((row["ms"], disturbed(row)))
    out = {}
    for target, entry in found.items():
        problems = []
        for pid, p in sorted(entry["problems"].items()):
            times_of = {n: [ms for ms, shaky in runs if not shaky] or [ms for ms, _ in runs]
                        for n, (_, runs) in p["times"].items() if runs}
            names = sorted(times_of)
            if len(names) < 2:  # nothing to choose between
                continue
            methods = {version[1] for version, _ in (p["times"][n] for n in names)}  # version: (binary, timing)
            if len(methods) > 1:  # timed by two methods (a resweep cut short): their times do not compare, so the
                continue  # problem waits for the rest of its kernels
            problem = problem_from_dict(p["dict"], op=p["dict"]["op"])
            keys = [parse_kernel_name(n) for n in names]
            times = np.array([math.exp(statistics.fmean(math.log(t) for t in times_of[n])) for n in names])
            problems.append({"id": pid, "problem": problem, "groups": p["groups"], "names": names, "keys": keys,
                             "times": times, "flops": float(problem.flops()),
                             "x": learned.features(problem, keys)})
        if problems:
            out[target] = {**entry, "problems": problems}
    return out


def shape_fold(problem_id: str, folds: int) -> int:
    """The fold of a problem shape: a stable hash, so a shape is in one held-out fold in every run."""
    return int(hashlib.sha256(problem_id.encode()).hexdigest(), 16) % folds


def fit(problems: list[dict], target: str, rounds: int, params: dict):
    import lightgbm as lgb

    x = np.concatenate([p["x"] for p in problems])
    y = np.concatenate([TARGETS[target](p) for p in problems])
    op = problems[0]["problem"].op
    return lgb.train(params, lgb.Dataset(x, y, feature_name=list(learned.FEATURES[op])), num_boost_round=rounds)


def efficiency(p: dict, score: np.ndarray, top: int = 1) -> float:
    """best time / time of the fastest of the `top` kernels the model scores highest."""
    order = sorted(range(len(score)), key=lambda i: (-score[i], p["names"][i]))[:top]
    return float(p["times"].min() / min(p["times"][i] for i in order))


def against_efficiency(p: dict, model) -> Optional[float]:
    """best time of all the problem's kernels / time of what another model (e.g. the one a retrain replaces) picks
    among the kernels it knows; None when it knows none of them."""
    mine = [i for i, key in enumerate(p["keys"]) if model.applies(p["problem"], key) and model.knows(key)]
    if not mine:
        return None
    names = tuple(p["names"][i] for i in mine)
    score = model.predict(p["problem"], [p["keys"][i] for i in mine], names)  # lower is better
    pick = mine[min(range(len(mine)), key=lambda j: (score[j], names[j]))]
    return float(p["times"].min() / p["times"][pick])


def analytic_efficiency(p: dict) -> float:
    pick = selection.analytic(p["problem"], [_Named(k, n) for k, n in zip(p["keys"], p["names"])])[0].name
    return float(p["times"].min() / p["times"][p["names"].index(pick)])


def summary(effs: list[float]) -> dict:
    s = sorted(effs)
    if not s:
        return {"problems": 0}
    return {"problems": len(s), "mean": statistics.fmean(s), "median": statistics.median(s),
            "p10": s[len(s) // 10], "min": s[0], "within_10pct": sum(e >= 0.9 for e in s) / len(s)}


def held_out(train_on: list[dict], test_on: list[dict], target: str, rounds: int, params: dict) -> dict:
    booster = fit(train_on, target, rounds, params)
    out = {"learned": [], "analytic": [], f"best_of_top{TOP_K}": []}
    for p in test_on:
        score = booster.predict(p["x"])
        out["learned"].append(efficiency(p, score))
        out[f"best_of_top{TOP_K}"].append(efficiency(p, score, TOP_K))
        out["analytic"].append(analytic_efficiency(p))
    return out


def validate(problems: list[dict], target: str, folds: int, rounds: int, params: dict) -> dict:
    """Group k-fold by problem shape, and leave-one-model-family-out."""
    kfold, tested = defaultdict(list), []
    folds = min(folds, len(problems))
    for fold in range(folds):
        test_on = [p for p in problems if shape_fold(p["id"], folds) == fold]
        train_on = [p for p in problems if shape_fold(p["id"], folds) != fold]
        if test_on and train_on:
            for k, v in held_out(train_on, test_on, target, rounds, params).items():
                kfold[k] += v
            tested += test_on
    result = {"group_kfold_by_shape": {"folds": folds, **{k: summary(v) for k, v in kfold.items()}}}
    decode = [i for i, p in enumerate(tested) if p["problem"].op == "gemm" and p["problem"].m <= DECODE_M]
    if decode:  # the decode GEMMs, CK's model's worst case: held out like the rest, reported apart
        result["group_kfold_by_shape"][f"learned, decode (M <= {DECODE_M})"] = summary(
            [kfold["learned"][i] for i in decode])
    families = sorted({g for p in problems for g in p["groups"]})
    if len(families) > 1:
        per_family, pooled = {}, defaultdict(list)
        for family in families:  # a problem several families use is held out with each of them
            test_on = [p for p in problems if family in p["groups"]]
            train_on = [p for p in problems if family not in p["groups"]]
            if not train_on:
                continue
            out = held_out(train_on, test_on, target, rounds, params)
            per_family[family] = {k: summary(v) for k, v in out.items()}
            for k, v in out.items():
                pooled[k] += v
        result["leave_one_family_out"] = {"families": per_family, **{k: summary(v) for k, v in pooled.items()}}
    return result


def tree_arrays(booster) -> dict:
    """LightGBM's dump as flat node arrays (learned.TreeEnsemble's format: a leaf sends every row to itself)."""
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

    for tree in booster.dump_model()["tree_info"]:
        roots.append(add(tree["tree_structure"], 0))
    return {"feature": feature, "threshold": threshold, "left": left, "right": right, "value": value,
            "roots": roots, "depth": depth}


def applies_to(backend: str, arch: str, task: str, problems: list[dict]) -> dict:
    keys = [k for p in problems for k in p["keys"]]
    sigs = {k.signature for k in keys}
    dtypes = {s.dtype_a for s in sigs}
    if dtypes <= {"fp16", "bf16"}:  # same tensor-core rate and element size: one model serves both
        dtypes |= {"fp16", "bf16"}
    out = {"backend": backend, "arch": arch, "op": keys[0].signature.op, "dtypes": sorted(dtypes),
           "layouts": sorted({s.layout for s in sigs}),
           # the pipelines it saw: kernels of others rank after its own, in analytic order
           "algorithm": {"pipeline": sorted({k.algorithm.pipeline for k in keys})}}
    if out["op"] == "conv":
        out["direction"] = task.split("_", 1)[1]
    return out


def card_markdown(name: str, model: dict) -> str:
    t = model["trained"]
    lines = [f"# {name}", "", f"Trained {t['date']} by bench/sweeps/train.py on {t['problems']} problems "
             f"({t['rows']} timed (problem, kernel) pairs) of {t['kernel_count']} kernels, from "
             f"{', '.join(t['stores'])}.", "", f"Machines: {'; '.join(sorted({json.dumps(m, sort_keys=True) for m in t['machines'].values()}))}",
             "", f"Applies to: `{json.dumps(model['applies_to'])}`", "", f"Target: {model['target']}", "",
             f"Features ({len(model['features'])}): {', '.join(model['features'])}", "",
             f"LightGBM: {json.dumps(t.get('lightgbm', {}), sort_keys=True)}", "",
             "| validation | ranker | problems | mean | median | P10 | min |", "|---|---|---|---|---|---|---|"]
    for how, res in t["validation"].items():
        for ranker, s in res.items():
            if isinstance(s, dict) and "mean" in s:
                lines.append(f"| {how} | {ranker} | {s['problems']} | {s['mean']:.3f} | {s['median']:.3f} | "
                             f"{s['p10']:.3f} | {s['min']:.3f} |")
    lines += ["", f"Kernels ({t['kernel_count']}):", ""] + [f"- `{n}`" for n in t["kernel_names"]]
    return "\n".join(lines) + "\n"


def train(paths: list[str], out_dir: Path, *, target: str = "ratio", folds: int = 5, rounds: int = ROUNDS,
          params: dict = PARAMS, against: Sequence[str] = (), log=print) -> list[Path]:
    """against: model files to score on the same problems (the one a retrain replaces, say); a file of another
    backend, arch or task is skipped."""
    others = [learned.Model(json.loads(Path(f).read_text()), str(f)) for f in against]
    written = []
    for (backend, arch, task), data in sorted(load_problems(paths).items()):
        problems = data["problems"]
        if len(problems) < 4:
            log(f"{backend}/{arch} {task}: only {len(problems)} problem(s) with two or more kernels; not trained")
            continue
        validation = validate(problems, target, folds, rounds, params)
        for other, path in zip(others, against):
            if other.task != task or other.applies_to["backend"] != backend or other.applies_to["arch"] != arch:
                continue
            effs = [e for e in (against_efficiency(p, other) for p in problems) if e is not None]
            # its pick among the kernels it knows, against the best of all: what the retrain gains over it
            # (unless it was trained on these problems, which this cannot tell)
            validation[f"against {Path(path).name}"] = {
                "version": other.version, "trained": {k: other.meta.get(k) for k in ("date", "machine", "stores")},
                "note": "its pick among the kernels it knows, against the best of all kernels",
                "model": summary(effs)}
        booster = fit(problems, target, rounds, params)
        names = sorted({n for p in problems for n in p["names"]})
        trained = {"date": date.today().isoformat(), "stores": data["stores"], "machines": data["machines"],
                   "sources": data["sources"], "problems": len(problems),
                   "families": sorted({g for p in problems for g in p["groups"]}),
                   "rows": int(sum(len(p["names"]) for p in problems)), "kernel_count": len(names),
                   "kernel_names": names, "lightgbm": {**params, "rounds": rounds}, "validation": validation,
                   # for `info` (learned.describe): the headline held-out numbers
                   "shapes": len(problems), "kernels": len(names),
                   "cross_validated": validation["group_kfold_by_shape"]}
        model = {"schema": learned.MODEL_SCHEMA, "features": list(learned.FEATURES[problems[0]["problem"].op]),
                 "applies_to": applies_to(backend, arch, task, problems),
                 "target": f"{target}: higher is better", "higher_is_better": True,
                 "trained": trained, "trees": tree_arrays(booster)}
        check = learned.Model(model)  # the numpy evaluator agrees with LightGBM
        x = problems[0]["x"]
        if not np.allclose(check.trees.predict(x), booster.predict(x),
                           rtol=1e-9, atol=1e-9):
            raise SystemExit("numpy tree evaluation differs from LightGBM's prediction")
        out = Path(out_dir) / f"{backend}_{arch}_{task}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(model, separators=(",", ":")) + "\n")
        out.with_suffix(".md").write_text(card_markdown(out.stem, model))
        kf = validation["group_kfold_by_shape"]
        log(f"wrote {out} ({len(problems)} problems, {len(names)} kernels, {len(model['trees']['roots'])} trees): "
            f"held-out learned mean {kf['learned']['mean']:.3f} p10 {kf['learned']['p10']:.3f} "
            f"min {kf['learned']['min']:.3f}; analytic mean {kf['analytic']['mean']:.3f} p10 {kf['analytic']['p10']:.3f}"
            + "".join(f"; {how}: mean {v['model']['mean']:.3f} p10 {v['model']['p10']:.3f}"
                      for how, v in validation.items() if how.startswith("against") and v["model"]["problems"]))
        written.append(out)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", nargs="+", help="sweep stores (.jsonl.gz)")
    ap.add_argument("--out", default=str(REPO / "runtime" / "tiledispatch" / "models"))
    ap.add_argument("--target", choices=sorted(TARGETS), default="ratio")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--min-child-samples", type=int, default=PARAMS["min_child_samples"])
    ap.add_argument("--num-leaves", type=int, default=PARAMS["num_leaves"])
    ap.add_argument("--learning-rate", type=float, default=PARAMS["learning_rate"])
    ap.add_argument("--against", action="append", default=[],
                    help="a model file to score on the same problems, e.g. the one being replaced (repeatable)")
    a = ap.parse_args(argv)
    params = {**PARAMS, "min_child_samples": a.min_child_samples, "num_leaves": a.num_leaves,
              "learning_rate": a.learning_rate}
    written = train(a.store, Path(a.out), target=a.target, folds=a.folds, rounds=a.rounds, params=params,
                    against=a.against)
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
