"""Held-out quality against model size: fewer, larger-step boosting rounds cost less per first select (the
runtime's tree evaluation scales with the number of trees). Runs train.validate on the shipped stores.

    python bench/results/model_size_h200/study.py STORE [STORE ...] --out study.json
"""
import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench" / "sweeps"))
sys.path.insert(0, str(REPO / "runtime"))
import train  # noqa: E402

CONFIGS = [(300, 0.05), (150, 0.1), (100, 0.15), (60, 0.25)]  # (rounds, learning rate): rounds x rate about equal


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("stores", nargs="+")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    results = {}
    for (backend, arch, task), data in sorted(train.load_problems(a.stores).items()):
        for rounds, rate in CONFIGS:
            t0 = time.time()
            params = {**train.PARAMS, "learning_rate": rate}
            v = train.validate(data["problems"], "ratio", 5, rounds, params)
            row = {"rounds": rounds, "learning_rate": rate, "seconds": round(time.time() - t0, 1),
                   **{how: {k: v[how][k] for k in v[how] if isinstance(v[how][k], dict) and "mean" in v[how][k]}
                      for how in ("group_kfold_by_shape", "leave_one_family_out") if how in v}}
            results.setdefault(task, []).append(row)
            kf = row["group_kfold_by_shape"]["learned"]
            print(task, rounds, rate, f"mean {kf['mean']:.3f} p10 {kf['p10']:.3f} min {kf['min']:.3f}", flush=True)
            Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
