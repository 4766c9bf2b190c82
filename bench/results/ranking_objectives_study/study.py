"""Would a ranking objective pick better than the shipped regression on the kernel/problem ratio? Each store's
problems, held out by shape (5 folds) and by model family (one left out at a time), under three LightGBM
objectives at train.py's parameters: regression on best time / time (shipped), lambdarank and rank_xendcg on
that ratio graded in tenths (per problem one query group, lambdarank truncated at 5).

    python bench/results/ranking_objectives_study/study.py bench/results/sweeps/*.jsonl.gz --out results.json
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench" / "sweeps"))
sys.path.insert(0, str(REPO / "runtime"))
import train  # noqa: E402
from tiledispatch import learned  # noqa: E402

GRADES = 10


def fit_ranker(train_on: list, objective: str):
    import lightgbm as lgb

    x = np.concatenate([p["x"] for p in train_on])
    grade = np.concatenate([np.floor(p["times"].min() / p["times"] * GRADES) for p in train_on]).astype(int)
    params = dict(train.PARAMS, objective=objective, lambdarank_truncation_level=5)
    data = lgb.Dataset(x, grade, group=[len(p["times"]) for p in train_on],
                       feature_name=list(learned.FEATURES[train_on[0]["problem"].op]))
    return lgb.train(params, data, num_boost_round=train.ROUNDS)


def by_shape(problems: list):
    for fold in range(5):
        yield ([p for p in problems if train.shape_fold(p["id"], 5) != fold],
               [p for p in problems if train.shape_fold(p["id"], 5) == fold])


def by_family(problems: list):
    for family in sorted({g for p in problems for g in p["groups"]}):
        yield [p for p in problems if family not in p["groups"]], [p for p in problems if family in p["groups"]]


def held_out(problems: list, split, objective: str) -> dict:
    effs = []
    for train_on, test_on in split(problems):
        if train_on and test_on:
            model = (train.fit(train_on, "ratio", train.ROUNDS, train.PARAMS) if objective == "regression"
                     else fit_ranker(train_on, objective))
            effs += [train.efficiency(p, model.predict(p["x"])) for p in test_on]
    return train.summary(effs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", nargs="+")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    results = {}
    for (backend, arch, task), entry in train.load_problems(a.store).items():
        for split in (by_shape, by_family):
            for objective in ("regression", "lambdarank", "rank_xendcg"):
                s = held_out(entry["problems"], split, objective)
                results[f"{backend}_{arch}_{task} {split.__name__} {objective}"] = s
                print(f"{task:16s} {split.__name__:9s} {objective:11s} mean {s['mean']:.4f} p10 {s['p10']:.4f} "
                      f"min {s['min']:.3f}", flush=True)
    a.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
