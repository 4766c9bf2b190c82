"""What selection costs on the cpu backend with a 200-kernel bundle: the first select of a new problem (one after
thousands of repeated selects, and back to back over 500 new problems) and a repeated one, with the first split
into its parts (matching: each kernel's td_can_run, which select asks only of the best-ranked kernels until one
accepts; the learned model's features; its trees, also with the CPU's caches emptied first), and apart the
process's first select (which loads the kernels' libraries).

    python bench/sweeps/selection_cost.py [--kernels 200] [--problems 30] [--out bench/results/selection_cost_cpu.json]
    python bench/sweeps/selection_cost.py --shipped-only   # the shipped models alone, JSON to stdout
    TD_NATIVE=0 python bench/sweeps/selection_cost.py      # the trees evaluated by numpy instead of native/forest.c

The bundle (conv fwd 2D fp32, packed and direct kernels of many tile shapes) is built with scons into
build/selection_cost (cached). The model is LightGBM trained on a synthetic target over those kernels with the
training defaults of bench/sweeps/train.py (150 rounds, 63 leaves), so it has the size a real model has: the cost
of evaluating it does not depend on what it learned. Targets (issue 22): first select <= 200 us, repeated <= 1 us.
Also timed: each shipped cutlass sm90a model on the kernels of the preselected GEMM and conv sets it ranks (keys
only), its features and its trees, plainly and with the kernel-only columns' masks kept as the ranker keeps them.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiledispatch as td  # noqa: E402
from tiledispatch import learned  # noqa: E402
from tiledispatch.ops.conv import ConvProblem  # noqa: E402

SHIPPED_MODELS = learned.MODELS_DIR  # main() points MODELS_DIR at the synthetic model's folder


def kernel_set(count: int) -> str:
    packed = [[m, n, k] for m, n, k in itertools.product((8, 16, 32, 48, 64, 96, 128), (16, 32, 48, 64, 128),
                                                         (8, 16, 24, 32, 64, 128, 256))]
    direct = [[m, n, k] for m, n, k in itertools.product((8, 16, 32, 64), (32, 64, 128), (8, 16, 32))]
    tiles = [("direct", t) for t in direct] + [("packed", t) for t in packed]
    configs = "\n".join(f"      - {{pipeline: {p}, tile: {t}}}" for p, t in tiles[:count])
    return f"""schema: 1
name: selection_cost
description: many cpu conv fwd kernels for bench/sweeps/selection_cost.py
groups:
  - backend: cpu
    op: conv
    direction: fwd
    spatial_dims: 2
    dtype: fp32
    layout: nhwgc
    mma: [4, 16, 1]
    configs:
{configs}
"""


def build(count: int) -> Path:
    build_dir = REPO / "build"
    spec = build_dir / "selection_cost.yaml"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(kernel_set(count))
    subprocess.run([sys.executable, "-m", "SCons", "-Q", "-C", str(REPO), f"kernels={spec}", "backend=cpu",
                    f"build_dir={build_dir}", "bundle=selection_cost"], check=True, stdout=subprocess.DEVNULL)
    return build_dir / "selection_cost"


def problems(count: int, seed: int) -> list[ConvProblem]:
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        g = int(rng.choice([1, 1, 2, 8]))
        c, k = g * int(rng.integers(1, 64)), g * int(rng.integers(1, 64))
        size, f = int(rng.integers(4, 64)), int(rng.choice([1, 3, 5]))
        out.append(ConvProblem("fwd", int(rng.integers(1, 9)), g, c, k, (size, size), (f, f), (1, 1), (1, 1),
                               (f // 2,) * 2, (f // 2,) * 2, "fp32", "fp32", "fp32"))
    return out


def synthetic_model(reg, models: Path) -> Path:
    """A model of the size training makes, fitted to the analytic cost plus noise."""
    sys.path.insert(0, str(REPO / "bench" / "sweeps"))
    import lightgbm as lgb
    import train

    xs, ys = [], []
    for p in problems(60, 99):
        fits = reg.candidates(p)
        x = learned.features(p, [k.key for k in fits])
        xs.append(x)
        ys.append(-x[:, learned.CONV_FEATURES.index("log2_analytic_cost")] + np.random.default_rng(0).normal(size=len(x)))
    booster = lgb.train(train.PARAMS, lgb.Dataset(np.concatenate(xs), np.concatenate(ys)), num_boost_round=train.ROUNDS)
    model = {"schema": learned.MODEL_SCHEMA, "features": list(learned.CONV_FEATURES),
             "applies_to": {"backend": "cpu", "arch": reg.arch, "op": "conv", "direction": "fwd", "dtypes": ["fp32"],
                            "layouts": ["nhwgc"], "algorithm": {"pipeline": ["direct", "packed"]}},
             "target": "synthetic: higher is better", "higher_is_better": True,
             "trained": {"date": "synthetic", "kernel_names": [k.name for k in reg.kernels],
                         "params": training_params()},
             "trees": train.tree_arrays(booster)}
    path = models / f"cpu_{reg.arch}_conv_fwd.json"
    path.write_text(json.dumps(model))
    return path


def training_params() -> dict:
    """What a synthetic model is trained with: train.py's defaults (a kept model trained otherwise is made again)."""
    sys.path.insert(0, str(REPO / "bench" / "sweeps"))
    import train

    return {"rounds": train.ROUNDS, **train.PARAMS}


def shipped_models(count: int = 30, folder: Path = SHIPPED_MODELS) -> dict:
    """Each shipped cutlass sm90a model on the kernels of the preselected sets it ranks (fp16_rcr_full,
    fp16_rcr_essential, conv_fp16_all_essential; keys only: no GPU needed), on random problems: its features, and
    its trees evaluated plainly and as the ranker calls them (the kernel-only columns' masks kept per kernel
    list). Conv problems are 2D, and a model sees the kernels of the problem's rank, as select gives them."""
    from tiledispatch.generator import kernelset
    from tiledispatch.ops.gemm import GemmProblem

    pool = [e.key for e in kernelset.load(["fp16_rcr_full", "fp16_rcr_essential", "conv_fp16_all_essential"],
                                          "cutlass", "sm90a")]
    rng = np.random.default_rng(3)
    out = {}
    for task in learned.TASKS:
        path = folder / f"cutlass_sm90a_{task}.json"
        if not path.exists():
            continue
        model = learned.Model(json.loads(path.read_text()))
        keys = [k for k in pool if model.applies(None, k) and (task == "gemm" or k.signature.spatial_dims == 2)]
        names = tuple(key.name for key in keys)
        rows = []
        for _ in range(count):
            if task == "gemm":
                p = GemmProblem(int(rng.integers(1, 8193)), 8 * int(rng.integers(1, 1025)),
                                8 * int(rng.integers(1, 1025)), "fp16", "fp16", "fp16")
            else:
                size, f = int(rng.integers(4, 113)), int(rng.choice((1, 3, 5, 7)))
                p = ConvProblem(task.split("_", 1)[1], int(rng.integers(1, 65)), 1, 8 * int(rng.integers(1, 65)),
                                8 * int(rng.integers(1, 65)), (size, size), (f, f), (1, 1), (1, 1), (f // 2,) * 2,
                                (f // 2,) * 2, "fp16", "fp16", "fp16")
            x = learned.features(p, keys, names)
            rows.append({"features_us": statistics.median(us(lambda: learned.features(p, keys, names))
                                                          for _ in range(5)),
                         "trees_us": statistics.median(us(lambda: model.trees.predict(x)) for _ in range(5)),
                         "trees_kept_us": statistics.median(
                             us(lambda: model.trees.predict(x, names, model.kernel_columns)) for _ in range(5))})
        out[task] = {"kernels": len(keys), "trees": len(model.trees.roots),
                     "median": {k: statistics.median(r[k] for r in rows) for k in rows[0]}}
    return out


@functools.lru_cache(maxsize=1)
def _eviction_buffer() -> np.ndarray:
    return np.ones(8 << 20)  # 64 MiB, twice the dev machine's last-level cache; made when first needed


def cold_us(fn) -> float:
    """us(fn) after reading 64 MiB: fn finds its tables out of the CPU's caches, as after other work."""
    _eviction_buffer().sum()
    return us(fn)


def us(fn, repeat: int = 1) -> float:
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=200)
    ap.add_argument("--problems", type=int, default=30)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "selection_cost_cpu.json"))
    ap.add_argument("--shipped-only", action="store_true",
                    help="only the shipped models on the preselected sets' keys (no bundle is built); JSON to stdout")
    ap.add_argument("--models", type=Path, default=SHIPPED_MODELS,
                    help="with --shipped-only: the folder of cutlass sm90a model files to time instead")
    a = ap.parse_args()
    if a.shipped_only:
        print(json.dumps(shipped_models(folder=a.models), indent=1))
        return 0
    bundle_dir = build(a.kernels)
    reg = td.load(bundle_dir)
    with tempfile.TemporaryDirectory() as tmp:
        learned.MODELS_DIR = Path(tmp)
        kept = bundle_dir.parent / "selection_cost_model.json"  # reused while the kernels and training stay the same
        trained = json.loads(kept.read_text())["trained"] if kept.exists() else {}
        if trained.get("kernel_names") == [k.name for k in reg.kernels] and trained.get("params") == training_params():
            (Path(tmp) / f"cpu_{reg.arch}_conv_fwd.json").write_text(kept.read_text())
        else:
            kept.write_text(synthetic_model(reg, Path(tmp)).read_text())
        learned.clear_models()
        model = learned.model_for("cpu", reg.arch, "conv_fwd")
        rows = []
        fresh = td.load(bundle_dir)
        # the first select of the process loads every kernel's library and derives what the kernels alone decide
        # (selection's statics, the features' key columns): once per process, reported apart
        once = us(lambda: fresh.select(problems(1, 7)[0]))
        for p in problems(a.problems, 1):
            first = us(lambda: fresh.select(p))
            fits = fresh.candidates(p)
            keys, names = [k.key for k in fits], tuple(k.name for k in fits)
            x = learned.features(p, keys, names)
            # as the ranker calls them: the kernel columns' leaf masks kept for this kernel list; timed cold first,
            # so that the next problem's first select still follows thousands of repeated selects
            predict = lambda: model.trees.predict(x, names, model.kernel_columns)  # noqa: E731
            trees_cold = statistics.median(cold_us(predict) for _ in range(5))
            repeated = statistics.median(us(lambda: fresh.select(p), 1000) for _ in range(5))
            features = statistics.median(us(lambda: learned.features(p, keys, names)) for _ in range(20))
            trees = statistics.median(us(predict) for _ in range(5))
            other = ConvProblem("fwd", p.n + 1, p.g, p.c, p.k, p.in_size, p.filter_size, p.stride, p.dilation,
                                p.pad_lo, p.pad_hi, "fp32", "fp32", "fp32")
            matching = us(lambda: fresh.explain(other))
            rows.append({"problem": str(p), "candidates": len(fits), "first_select_us": first,
                         "repeated_select_us": repeated, "matching_us": matching, "features_us": features,
                         "trees_us": trees, "trees_cold_us": trees_cold})
            print(json.dumps(rows[-1]), flush=True)
        # first selects of new problems one after another: the select path's code and tables stay in the CPU's
        # caches, where first_select_us times one select after thousands of repeated ones
        new_problems = problems(500, 2)
        back_to_back = us(lambda: [fresh.select(p) for p in new_problems]) / len(new_problems)
        assert learned.model_of(fresh.candidates(new_problems[0])) is model  # the model ranked them
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_us") or k == "candidates"}
    report = {"kernels": len(reg.kernels), "model": {"trees": len(model.trees.roots), "depth": model.trees.depth,
                                                     "nodes": len(model.trees.feature)},
              # TD_NATIVE=0 (or no C compiler): numpy
              "tree_evaluator": "numpy" if model.trees._compiled is None else "native (forest.c)",
              "machine": {"cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                                       if ln.startswith("model name")), "?")},
              "first_select_of_the_process_us": once, "median": med, "back_to_back_first_select_us": back_to_back,
              "targets_us": {"first_select": 200, "repeated_select": 1}, "rows": rows,
              "shipped_models": shipped_models()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("kernels", "model", "first_select_of_the_process_us", "median",
                                             "back_to_back_first_select_us", "shipped_models")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
