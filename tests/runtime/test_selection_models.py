"""The learned ranker (a shipped tree ensemble evaluated by leaf masks, compiled or with numpy) and measured
tuning (autotune with a persistent per-device record)."""
import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import tiledispatch as td
from tiledispatch import backends, learned, reference, selection, tuning, validation
from tiledispatch.registry import TUNE_MARGIN
from tiledispatch.ops.conv import ConvProblem
from tiledispatch.ops.gemm import GemmProblem
from tiledispatch.spec.key import parse_kernel_name

REPO = Path(__file__).resolve().parents[2]
SWEEP = REPO / "bench" / "results" / "sweep_gemm_h100.json"


class Named:  # what rankers take
    def __init__(self, key):
        self.key, self.name = key, key.name


def sweep_kernels():
    return [Named(parse_kernel_name(n)) for n in json.loads(SWEEP.read_text())["kernels"]]


def fp16(m, n, k, dtype="fp16"):
    return GemmProblem(m, n, k, dtype, dtype, dtype, "rcr")


# -- the model ------------------------------------------------------------------------------------
def test_numpy_trees_match_lightgbm():
    lgb = pytest.importorskip("lightgbm")
    sys.path.insert(0, str(REPO / "bench" / "sweeps"))
    import train_ranker

    kernels = sweep_kernels()
    rng = np.random.default_rng(0)
    problems = [fp16(int(rng.integers(1, 5000)), 8 * int(rng.integers(1, 600)), 8 * int(rng.integers(1, 600)))
                for _ in range(30)]
    x = np.array([learned.gemm_features(p, k.key) for p in problems for k in kernels])
    y = rng.normal(size=len(x)) + x[:, 5] / 100  # any target: only the evaluation is under test
    booster = lgb.train({"objective": "regression", "num_leaves": 15, "verbose": -1, "min_child_samples": 5},
                        lgb.Dataset(x, y), num_boost_round=20)
    model = learned.Model(train_ranker.to_model(booster, {"backend": "cutlass", "arch": "sm90a", "op": "gemm",
                                                          "dtypes": ["fp16"], "layouts": ["rcr"]}, {}))
    np.testing.assert_allclose(model.trees.predict(x), booster.predict(x), rtol=1e-12, atol=1e-12)



def random_trees(rng, trees: int, leaves: int, features: int) -> dict:
    """A random ensemble in the flat node format (learned.TreeEnsemble), each tree grown by splitting a random
    leaf until it has `leaves` leaves, with thresholds drawn from a few values (so rows hit them exactly)."""
    out = {"feature": [], "threshold": [], "left": [], "right": [], "value": [], "roots": [], "depth": 0}

    def node(feature, threshold, value):
        i = len(out["feature"])
        out["feature"].append(feature), out["threshold"].append(threshold), out["value"].append(value)
        out["left"].append(i), out["right"].append(i)  # a leaf until split
        return i

    for _ in range(trees):
        root = node(0, math.inf, float(rng.normal()))
        out["roots"].append(root)
        open_leaves, depth = [(root, 0)], {root: 0}
        while len(open_leaves) < leaves:
            at, d = open_leaves.pop(int(rng.integers(len(open_leaves))))
            out["feature"][at], out["threshold"][at] = int(rng.integers(features)), float(rng.integers(-3, 4))
            out["left"][at], out["right"][at] = (node(0, math.inf, float(rng.normal())) for _ in range(2))
            open_leaves += [(out["left"][at], d + 1), (out["right"][at], d + 1)]
            out["depth"] = max(out["depth"], d + 1)
    return out


def ensemble_of(trees: dict, evaluator: str) -> learned.TreeEnsemble:
    """A TreeEnsemble whose leaf masks are evaluated by native/forest.c ("native") or by numpy ("numpy", what runs
    where the native evaluator cannot be built or TD_NATIVE=0 turns it off)."""
    ensemble = learned.TreeEnsemble(trees)
    if evaluator == "numpy":
        ensemble._compiled = None  # the cached property, set before its first use
    elif ensemble._masks is not None:
        assert ensemble._compiled is not None, "the native tree evaluator was not built: see its warning"
    return ensemble


@pytest.mark.parametrize("evaluator", ["native", "numpy"])
@pytest.mark.parametrize("leaves", [1, 2, 31, 32, 33, 64, 65])
def test_leaf_mask_evaluation_matches_the_tree_walk(leaves, evaluator):
    """predict() (leaf masks: 32-bit up to 32 leaves, 64-bit up to 64, the walk beyond) against walking the trees,
    on rows that hit thresholds exactly, lie between and beyond them, and hold NaN and infinities."""
    rng = np.random.default_rng(leaves)
    ensemble = ensemble_of(random_trees(rng, 40, leaves, 5), evaluator)
    x = rng.integers(-4, 5, size=(300, 5)).astype(np.float64) + rng.choice([0.0, 0.5], size=(300, 5))
    x[::7, 1], x[::11, 2], x[::13, 3] = np.nan, np.inf, -np.inf
    x[:, 4] = 1.0  # a column alike in every row (a feature of the problem alone), on a threshold
    np.testing.assert_allclose(ensemble.predict(x), ensemble.walk(x), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ensemble.predict(x[5:6]), ensemble.walk(x[5:6]), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ensemble.predict(x[::-3]), ensemble.walk(x[::-3]), rtol=1e-12, atol=1e-12)  # a view
    x[:, 3] = np.nan  # NaN in every row: alike to the eye, never to a test
    np.testing.assert_allclose(ensemble.predict(x), ensemble.walk(x), rtol=1e-12, atol=1e-12)
    assert ensemble.predict(x[:0]).shape == (0,)
    assert (ensemble._masks is None) == (leaves > 64)
    if ensemble._masks is not None:
        assert ensemble._masks[3].type == (np.uint32 if leaves <= 32 else np.uint64)


@pytest.mark.parametrize("evaluator", ["native", "numpy"])
@pytest.mark.parametrize("leaves", [31, 33, 65])
def test_kept_kernel_column_masks_change_no_prediction(leaves, evaluator):
    """Columns 0-1 play the kernels' (the same per row whatever the problem), 2-4 the problem's: predictions with
    the kernel columns' masks kept per rows token equal the plain ones, for the call that keeps them, for later
    problems on the same rows, for another row set, and with every kernel column alike across the rows."""
    rng = np.random.default_rng(leaves)
    ensemble = ensemble_of(random_trees(rng, 40, leaves, 5), evaluator)
    kernels = rng.integers(-4, 5, size=(60, 2)).astype(np.float64)
    for token, rows in (("a", kernels), ("b", kernels[::-1]), ("a", kernels), ("c", np.ones((60, 2)))):
        for _ in range(3):  # new problems on the same kernels
            problem = rng.integers(-4, 5, size=(60, 3)) + rng.choice([0.0, 0.5], size=(60, 3))
            problem[:, 2] = problem[0, 2]  # one feature of the problem alone, another varying with the kernel
            x = np.column_stack([rows, problem])
            np.testing.assert_allclose(ensemble.predict(x, token, frozenset({0, 1})), ensemble.walk(x),
                                       rtol=1e-12, atol=1e-12)
    # kept for the row sets whose kernel columns differ between rows; "c"'s are alike, looked up once per problem
    assert ensemble._masks is None or set(ensemble._row_masks) == {"a", "b"}


def test_native_evaluator_refuses_tables_that_leave_a_tree_no_leaf():
    ensemble = ensemble_of(random_trees(np.random.default_rng(0), 10, 8, 3), "native")
    x = np.zeros((4, 3))
    expected = ensemble.walk(x)
    np.testing.assert_allclose(ensemble.predict(x), expected, rtol=1e-12, atol=1e-12)
    ensemble._masks.stack[:] = 0  # every table row rules out every leaf
    with pytest.raises(RuntimeError, match="no leaf left"):
        ensemble.predict(x)


def test_kernel_features_are_the_keys_alone():
    """The features the ranker keeps per kernel list are the same for a kernel list on any two problems, and
    features() fills every column (its template holds NaN until then)."""
    from tiledispatch.generator import kernelset

    keys = [e.key for e in kernelset.load(["fp16_rcr_full"], "cutlass", "sm90a")]
    one, two = (learned.features(GemmProblem(m, n, k, "fp16", "fp16", "fp16"), keys)
                for m, n, k in ((1, 4096, 14336), (8192, 256, 64)))
    columns = [i for i, name in enumerate(learned.GEMM_FEATURES) if name in learned.KERNEL_FEATURES]
    assert len(columns) == 10 and np.array_equal(one[:, columns], two[:, columns])
    assert not np.array_equal(one, two) and np.isfinite(one).all() and np.isfinite(two).all()
    conv = [e.key for e in kernelset.load(["conv_fp16_all_essential"], "cutlass", "sm90a")
            if e.key.signature.op == "conv" and e.key.signature.direction == "fwd" and e.key.signature.spatial_dims == 2]
    one, two = (learned.features(ConvProblem("fwd", n, g, c, k, size, f, (1, 1), (1, 1), pad, pad, "fp16", "fp16",
                                             "fp16"), conv)
                for n, g, c, k, size, f, pad in ((32, 1, 64, 64, (56, 56), (3, 3), (1, 1)),
                                                 (8, 96, 96, 96, (14, 14), (5, 5), (2, 2))))
    columns = [i for i, name in enumerate(learned.CONV_FEATURES) if name in learned.KERNEL_FEATURES]
    assert len(columns) == 14 and np.array_equal(one[:, columns], two[:, columns])
    assert np.isfinite(one).all() and np.isfinite(two).all()


def test_batched_costs_equal_each_kernels_own():
    """cost_terms (one gemm_view per view key, one problem_factor per factor key, the defaults once per problem,
    arrays over the kernels) gives every kernel of the preselected conv sets the cost estimated_cost gives it alone
    (a family whose view key or factor key leaves out what its gemm_view or problem_factor reads would fail here
    where two of these kernels differ only in what it leaves out). Problems of every direction and rank, with stride, groups and depthwise, on which the direct kernels' stride-2
    halo rule (problem_factor) fires."""
    from tiledispatch.generator import kernelset

    keys = [e.key for e in kernelset.load(["conv_fp16_all_essential"], "cutlass", "sm90a")]
    rng = np.random.default_rng(7)
    halved = 0
    for direction in ("fwd", "bwd_data", "bwd_weight"):
        for dims in (1, 2, 3):
            mine = [k for k in keys if k.signature.direction == direction and k.signature.spatial_dims == dims]
            # depthwise 7x7 / 2 and 5x5 / 2 (the halo rule), then random layers
            shapes = [(96, 96, 96, 7, 2), (8, 8, 8, 5, 2)]
            for _ in range(8):
                g = int(rng.choice([1, 1, 4, 32]))
                shapes.append((g, g * int(rng.choice([1, 4, 8, 24])), g * int(rng.choice([1, 4, 8, 24])),
                               int(rng.choice([1, 3, 5, 7])), int(rng.choice([1, 2]))))
            for g, c, k, f, st in shapes:
                size = (int(rng.integers(7, 120)),) * dims
                p = ConvProblem(direction, int(rng.integers(1, 33)), g, c, k, size, (f,) * dims, (st,) * dims,
                                (1,) * dims, (f // 2,) * dims, (f // 2,) * dims, "fp16", "fp16", "fp16")
                alone = [selection.estimated_cost(p, key) for key in mine]
                np.testing.assert_allclose(selection.cost_terms(p, mine)["cost"], alone, rtol=1e-12)
                halved += sum(backends.family_of(key).problem_factor(p, key) == 2.0 for key in mine)
    assert halved  # the rule fired on some kernels and not on others of the same problems


def test_shipped_model_beat_analytic_in_training():
    model = learned.model_for("cutlass", "sm90a", "gemm")
    assert model is not None, "runtime/tiledispatch/models/cutlass_sm90a_gemm.json is missing"
    cv = model.meta["cross_validated"]
    # recorded at training time on held-out shapes: the learned ranker must beat the analytic one
    assert cv["learned"]["mean"] > cv["analytic"]["mean"] and cv["learned"]["p10"] > cv["analytic"]["p10"]
    assert model.meta["shapes"] >= 200


@pytest.mark.parametrize("task", learned.TASKS)
def test_learned_ranking_on_its_sweep(task):
    """Each shipped model, evaluated with numpy through the runtime's ranker, on the sweep it was trained on: its
    picks reach at least what training measured on held-out folds, and beat the analytic ranker's (a broken
    evaluation, features or tree walk, falls far below)."""
    sys.path.insert(0, str(REPO / "bench" / "sweeps"))
    import train

    model = learned.model_for("cutlass", "sm90a", task)
    stores = [str(REPO / "bench" / "results" / "sweeps" / s) for s in model.meta["stores"]]
    problems = train.load_problems(stores)[("cutlass", "sm90a", task)]["problems"]
    assert len(problems) == model.meta["problems"]
    learned_effs, analytic_effs = [], []
    for p in problems:
        pick = selection.learned(p["problem"], [Named(k) for k in p["keys"]])[0]
        learned_effs.append(p["times"].min() / p["times"][p["names"].index(pick.name)])
        analytic_effs.append(train.analytic_efficiency(p))
    held_out = model.meta["cross_validated"]
    assert sum(learned_effs) / len(learned_effs) >= held_out["learned"]["mean"]
    # the analytic ranker's mean as training measured it, within what its cost model's later refinements moved it
    # (the align-4 kernels' bwd_weight cost factor: conv_bwd_weight 0.8659 -> 0.8673)
    assert abs(sum(analytic_effs) / len(analytic_effs) - held_out["analytic"]["mean"]) < 0.01
    assert sum(learned_effs) > sum(analytic_effs)


@pytest.mark.parametrize("task", learned.TASKS)
def test_native_and_numpy_evaluators_rank_alike_with_the_shipped_models(task):
    """Each shipped model, its leaf masks evaluated by native/forest.c and by numpy, on the first 60 problems of the
    sweep it was trained on with their kernels, the kernel columns' masks kept as the ranker keeps them: the same
    scores up to rounding, so the same order."""
    sys.path.insert(0, str(REPO / "bench" / "sweeps"))
    import train

    model = learned.model_for("cutlass", "sm90a", task)
    trees = json.loads(learned.model_path("cutlass", "sm90a", task).read_text())["trees"]
    native, plain = ensemble_of(trees, "native"), ensemble_of(trees, "numpy")
    stores = [str(REPO / "bench" / "results" / "sweeps" / s) for s in model.meta["stores"]]
    for p in train.load_problems(stores)[("cutlass", "sm90a", task)]["problems"][:60]:
        x = learned.features(p["problem"], p["keys"])
        x = x if model.columns is None else x[:, model.columns]
        names = tuple(p["names"])
        one, two = (e.predict(x, names, model.kernel_columns) for e in (native, plain))
        np.testing.assert_allclose(one, two, rtol=1e-12, atol=1e-12)
        assert [n for _, n in sorted(zip(one.tolist(), names))] == [n for _, n in sorted(zip(two.tolist(), names))]


@pytest.mark.parametrize("c, k, groups, filt, stride, built_for", [
    (3, 32, 1, 3, 2, "few_channel"), (3, 64, 1, 7, 2, "few_channel"),  # RGB stems (bench/results/few_channel_h200)
    (16, 16, 16, 3, 1, 16), (32, 32, 32, 3, 1, 32), (16, 16, 16, 3, 2, 16)])  # depthwise, few channels: lanes
def test_shipped_fwd_model_picks_the_kernels_built_for_few_channels(c, k, groups, filt, stride, built_for):
    """The rules the sweeps measured (bench/results/few_channel_h200, narrow_depthwise_h200) as the shipped fwd
    model ranks conv_fp16_all_essential's kernels that run the layer (N = 32, 112 x 112): an RGB stem on direct_mma's
    few-channel form, a depthwise layer on a block as wide as its channels (16 or 32 lanes, not 64)."""
    from tiledispatch.families.cutlass.conv_direct import few_channel
    from tiledispatch.generator import kernelset

    problem = ConvProblem("fwd", 32, groups, c, k, (112, 112), (filt, filt), (stride, stride), (1, 1),
                          (filt // 2,) * 2, (filt // 2,) * 2, "fp16", "fp16", "fp16")
    kernels = [Named(e.key) for e in kernelset.load(["conv_fp16_all_essential"], "cutlass", "sm90a")
               if problem.mismatch(e.key) is None and backends.family_of(e.key).module.refusal(problem, e.key) is None]
    assert len(kernels) > 1 and learned.scores(problem, kernels) is not None  # ranked by the model, among several
    pick = selection.learned(problem, kernels)[0].key
    if built_for == "few_channel":
        assert few_channel(pick), pick.name
    else:
        assert pick.algorithm.pipeline == "direct" and pick.algorithm.tile[1] == built_for, pick.name


def test_learned_falls_back_to_analytic_where_no_model_applies():
    fp16_kernels = sweep_kernels()[:6]
    problem = fp16(512, 512, 512)
    assert learned.rank(problem, fp16_kernels) is not None

    def retyped(kern, dtype):
        sig = dataclasses.replace(kern.key.signature, dtype_a=dtype, dtype_b=dtype, dtype_c=dtype)
        return Named(dataclasses.replace(kern.key, signature=sig))

    assert learned.rank(fp16(512, 512, 512, "bf16"), [retyped(k, "bf16") for k in fp16_kernels]) is not None
    fp32_kernels = [retyped(k, "fp32") for k in fp16_kernels]  # the model covers fp16/bf16 only
    fp32_problem = fp16(512, 512, 512, "fp32")
    assert learned.rank(fp32_problem, fp32_kernels) is None
    assert selection.learned(fp32_problem, fp32_kernels) == selection.analytic(fp32_problem, fp32_kernels)


def test_a_model_reads_the_features_it_names():
    """A model names its features in its own column order (one trained before a feature was added names fewer):
    the runtime evaluates its trees on those columns; a feature the runtime does not compute, or another schema,
    is refused."""
    data = json.loads(learned.model_path("cutlass", "sm90a", "gemm").read_text())
    shipped = learned.Model(data, "shipped")
    names = data["features"]
    reordered = json.loads(json.dumps(data))
    reordered["features"] = names[::-1]
    reordered["trees"]["feature"] = [len(names) - 1 - f for f in data["trees"]["feature"]]
    kernels = sweep_kernels()
    keys, kernel_names = [k.key for k in kernels], tuple(k.name for k in kernels)
    for m, n, k in ((1, 4096, 14336), (8192, 256, 64), (777, 1234, 4320)):
        problem = fp16(m, n, k)
        np.testing.assert_array_equal(learned.Model(reordered, "reordered").predict(problem, keys, kernel_names),
                                      shipped.predict(problem, keys, kernel_names))
    data["features"] = names[:-1] + ["not_a_feature"]
    with pytest.raises(ValueError, match="does not compute.*not_a_feature"):
        learned.Model(data, "unknown")
    data["schema"] = 99
    with pytest.raises(ValueError, match="model schema 99"):
        learned.Model(data, "future")


@pytest.mark.parametrize("c, k, groups, c_align, k_align", [
    (64, 64, 1, 4, 4), (3, 64, 1, 0, 4), (12, 36, 1, 2, 2), (96, 96, 96, 0, 0), (256, 512, 32, 3, 4),
    (48, 40, 1, 4, 3)])
def test_conv_alignment_columns(c, k, groups, c_align, k_align):
    """log2 of the largest power of two, up to 16, that divides C/G and K/G: the same for every kernel."""
    from tiledispatch.generator import kernelset

    keys = [e.key for e in kernelset.load(["conv_fp16_all_essential"], "cutlass", "sm90a")
            if e.key.signature.op == "conv" and e.key.signature.direction == "fwd" and e.key.signature.spatial_dims == 2]
    x = learned.features(ConvProblem("fwd", 8, groups, c, k, (14, 14), (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), "fp16",
                                     "fp16", "fp16"), keys)
    names = learned.CONV_FEATURES
    assert set(x[:, names.index("log2_c_align")]) == {c_align}
    assert set(x[:, names.index("log2_k_align")]) == {k_align}


# -- tuning ---------------------------------------------------------------------------------------
@pytest.fixture
def cache_file(tmp_path):
    return tmp_path / "tuning.json"


def inputs(m=96, n=80, k=64, with_c=False):
    p = GemmProblem(m, n, k, "fp16", "fp16", "fp16", "rcr")
    return p, validation.gemm_inputs(p, np.random.default_rng(5), with_c=with_c)


def test_autotune_records_and_reuses_the_winner(gemm_bundle, cache_file):
    reg = td.load(gemm_bundle, autotune=True, tuning_cache=tuning.TuningCache(cache_file))
    p, t = inputs()
    out = reg.gemm(t["a"][0], t["b"][0], t["out"][0])
    assert validation.compare(out, reference.gemm(t["a"][0], t["b"][0]), reg.kernels[0].key)["passed"]
    (device, records), = json.loads(cache_file.read_text())["devices"].items()
    assert device == tuning.device_identity("cpu")
    (key, rec), = records.items()
    fits = reg.candidates(p)
    assert key == tuning.problem_key(p, [k.name for k in fits])
    times, ranked_first = rec["times_ms"], selection.learned(p, fits)[0].name
    # the ranking's pick, unless another kernel beat it by more than noise (then the fastest of them)
    assert (rec["kernel"] == ranked_first or (rec["kernel"] == min(times, key=times.get) and
                                              times[rec["kernel"]] < TUNE_MARGIN * times[ranked_first]))
    assert 1 <= len(rec["times_ms"]) <= 12 and set(rec["times_ms"]) <= {k.name for k in fits}

    # a fresh registry (another process) selects the recorded kernel without timing: make the record
    # name the candidate the learned/analytic ranking puts last, so only the record can explain the pick
    last = selection.learned(p, fits)[-1].name
    rec["kernel"] = last
    cache_file.write_text(json.dumps({"schema": tuning.SCHEMA, "devices": {device: {key: rec}}}))
    again = td.load(gemm_bundle, tuning_cache=tuning.TuningCache(cache_file))
    assert again.select(p).name == last
    assert again.select(p, ranker="analytic").name == selection.analytic(p, fits)[0].name


def test_records_of_other_devices_or_kernels_are_ignored(gemm_bundle, cache_file):
    p, _ = inputs()
    reg = td.load(gemm_bundle, tuning_cache=tuning.TuningCache(cache_file))
    fits = reg.candidates(p)
    key = tuning.problem_key(p, [k.name for k in fits])
    default = selection.learned(p, fits)[0].name
    other = next(k.name for k in fits if k.name != default)
    cache_file.write_text(json.dumps({"schema": 1, "devices": {
        "cuda:Some Other GPU:1 SMs": {key: {"kernel": other}},
        tuning.device_identity("cpu"): {key: {"kernel": "gemm_no_such_kernel"}}}}))
    assert td.load(gemm_bundle, tuning_cache=tuning.TuningCache(cache_file)).select(p).name == default


def test_unreadable_cache_is_reported_and_ignored(gemm_bundle, cache_file):
    cache_file.write_text("{not json")
    reg = td.load(gemm_bundle, autotune=True, tuning_cache=tuning.TuningCache(cache_file))
    p, t = inputs()
    with pytest.warns(UserWarning, match="unreadable tuning cache"):
        reg.gemm(t["a"][0], t["b"][0], t["out"][0])
    assert json.loads(cache_file.read_text())["schema"] == tuning.SCHEMA  # replaced by a valid file


def test_tuning_with_beta_keeps_the_old_output(gemm_bundle, cache_file):
    """The timing launches write the output; with beta != 0 the result still uses the caller's values."""
    reg = td.load(gemm_bundle, autotune=True, tuning_cache=tuning.TuningCache(cache_file))
    p, t = inputs(with_c=True)
    a, b, c = t["a"][0], t["b"][0], t["c"][0]
    out = c.copy()  # accumulate into out: out = a @ b + 1.0 * out
    expect = reference.gemm(a, b, out.copy(), beta=1.0)
    reg.gemm(a, b, out, c=out, beta=1.0)
    assert validation.compare(out, expect, reg.kernels[0].key)["passed"]
    assert json.loads(cache_file.read_text())["devices"]


def test_tune_api_times_only_top_candidates(gemm_bundle, cache_file):
    """top bounds the kernels timed; the record is what select() uses afterwards."""
    reg = td.load(gemm_bundle, tuning_cache=tuning.TuningCache(cache_file))
    p, t = inputs()
    kern = reg.tune(p, {"a": t["a"], "b": t["b"], "out": t["out"]}, top=2)
    (rec,) = next(iter(json.loads(cache_file.read_text())["devices"].values())).values()
    assert len(rec["times_ms"]) == min(2, len(reg.candidates(p))) and kern.name == rec["kernel"]
    assert reg.select(p).name == kern.name


def test_tuning_keeps_the_ranked_pick_unless_another_is_faster_beyond_noise(gemm_bundle, cache_file, monkeypatch):
    """A candidate timed faster than the ranking's pick replaces it only when it is more than TUNE_MARGIN faster
    in every way it was timed (at the caller's pace and, on a GPU, queued), also after two more interleaved timings
    of the two: a kernel faster by chance, or faster on the GPU but slower in a loop of calls (a costlier launch),
    never displaces the learned choice."""
    reg = td.load(gemm_bundle, tuning_cache=tuning.TuningCache(cache_file))
    p, t = inputs()
    ranked = [k.name for k in reg.ranked(p, reg.candidates(p))]
    assert len(ranked) >= 2
    ops = {"a": t["a"][0], "b": t["b"][0], "out": t["out"][0]}
    pick = {"paced": 1.0, "queued": 1.0}
    cases = [({"paced": 0.99, "queued": 0.5}, ranked[0], 0),  # within noise at the caller's pace: no retiming
             ({"paced": 0.5, "queued": 1.2}, ranked[0], 0),  # slower on the GPU
             ({"paced": 0.5, "queued": 0.5}, ranked[1], 2),  # faster both ways, confirmed
             ({"paced": 0.5}, ranked[1], 2)]  # the cpu backend: one way
    for challenger, expect, retimings in cases:
        timed = []

        def fake_measure(launch, device, stream):
            name = launch.__self__.kernel.name  # a Plan's launch
            timed.append(name)
            return {how: ms for how, ms in (challenger if name == ranked[1] else pick).items() if how in challenger}

        monkeypatch.setattr(tuning, "measure", fake_measure)
        assert reg.tune(p, ops, top=2).name == expect
        # both candidates once, then (a challenger that qualified) the pick and the challenger, interleaved
        assert timed == ranked[:2] + [ranked[0], ranked[1]] * retimings
        rec = reg.tuning_record(p, reg.candidates(p))
        assert rec["kernel"] == expect and set(rec["times_ms"]) == set(ranked[:2])
        assert ("gpu_times_ms" in rec) == ("queued" in challenger)


def test_distinct_rows_of_table_indices():
    """predict() gathers table rows once per distinct row of the varying columns' indices: _distinct_rows gives
    those rows and each row's index among them (hashed rows, checked; np.unique over rows where the hash cannot
    serve: rows wider than its multipliers)."""
    rng = np.random.default_rng(5)
    for width in (1, 10, len(learned._ROW_HASH) + 1):
        pool = rng.integers(0, 4000, size=(7, width))
        at = pool[rng.integers(0, 7, size=60)]
        distinct, inverse = learned._distinct_rows(at)
        assert len(distinct) == len(np.unique(at, axis=0)) and inverse.shape == (60,)
        np.testing.assert_array_equal(distinct[inverse], at)


def test_distinct_rows_survive_a_hash_collision(monkeypatch):
    """Rows whose hashes collide (here every multiplier 1: [1, 2] and [2, 1] sum alike) stay apart."""
    monkeypatch.setattr(learned, "_ROW_HASH", np.ones(4, dtype=np.uint64))
    at = np.array([[1, 2], [2, 1], [1, 2], [3, 0]], dtype=np.int64)
    distinct, inverse = learned._distinct_rows(at)
    assert len(distinct) == 3
    np.testing.assert_array_equal(distinct[inverse], at)
