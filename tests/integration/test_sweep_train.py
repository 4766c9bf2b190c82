"""The learned-ranker pipeline on the cpu backend: the sharded sweep (Dask, two local worker processes),
its resumable store, training per task, the model card, and the runtime ranking conv with the trained model.

The GPU runs the same commands (bench/sweeps/sweep.py, bench/sweeps/train.py) on the cutlass bundles."""
from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, build_cpu_bundle, scons
from tiledispatch import backends, learned, selection
from tiledispatch.ops.conv import ConvProblem

sys.path.insert(0, str(REPO / "bench" / "sweeps"))
import sweep  # noqa: E402

pytest.importorskip("distributed")
ARCH = backends.get("cpu").detect_arch()
SET = """\
schema: 1
name: sweep_tiny
description: a few cpu conv and GEMM kernels for the sweep / train tests
groups:
  - backend: cpu
    op: conv
    direction: [fwd, bwd_data, bwd_weight]
    spatial_dims: 2
    dtype: fp32
    layout: nhwgc
    mma: [4, 16, 1]
    configs:
      - {pipeline: packed, tile: [16, 16, 24]}
      - {pipeline: packed, tile: [64, 32, 64]}
      - {pipeline: direct, tile: [8, 32, 8]}
  - backend: cpu
    op: gemm
    dtype: fp32
    layout: rcr
    pipeline: packed
    mma: [4, 16, 1]
    configs:
      - {tile: [16, 16, 32]}
      - {tile: [64, 64, 128]}
"""
# a suite as bench/suites/conv.json holds them: problems with the model family they come from
SUITE = [
    {"model": "netA", "n": 2, "c": 16, "k": 32, "in_size": [10, 10], "filter_size": [3, 3], "padding": 1},
    {"model": "netA", "n": 1, "g": 8, "c": 8, "k": 8, "in_size": [12, 12], "filter_size": [3, 3], "stride": 2,
     "padding": 1},
    {"model": "netB", "n": 2, "c": 24, "k": 8, "in_size": [6, 6], "filter_size": [1, 1]},
    {"uses": {"netB2": 1, "netC": 3}, "directions": ["bwd_data", "bwd_weight"], "n": 1, "c": 8, "k": 8,
     "in_size": [5, 5], "filter": [3, 3]},
]


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory):
    build = tmp_path_factory.mktemp("sweep_build")
    build_cpu_bundle(build, "sweep_tiny", SET)
    return build / "sweep_tiny"


def pairs(store: Path) -> set:
    return {(r["problem_id"], r["kernel"]) for r in sweep.read_store(store)[1]}


def suite_problems(tmp_path, direction="fwd"):
    path = tmp_path / "conv.json"
    path.write_text(json.dumps({"schema": 1, "layers": SUITE}))
    return sweep.load_suite(path, op="conv", direction=direction, dtype="fp32", layout=None)


def random_2d(count: int, seed: int, direction: str) -> list[dict]:
    """count random 2D problems (the tiny bundle's kernels are 2D)."""
    drawn = sweep.random_problems("conv", 4 * count, seed, direction=direction, dtype="fp32", layout=None, max_flop=2e7)
    return [e for e in drawn if e["problem"].spatial_dims == 2][:count]


def test_suite_files_and_random_problems(tmp_path):
    fwd = suite_problems(tmp_path)
    assert [e["groups"] for e in fwd] == [["neta"], ["neta"], ["netb"]]  # the last entry is for the backward sweeps
    assert fwd[1]["problem"] == ConvProblem("fwd", 1, 8, 8, 8, (12, 12), (3, 3), (2, 2), (1, 1), (1, 1), (1, 1),
                                            "fp32", "fp32", "fp32")
    bwd = suite_problems(tmp_path, "bwd_data")
    assert [e["problem"].n for e in bwd] == [2, 1, 2, 1] and bwd[3]["groups"] == ["netb", "netc"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"n": 1, "c": 3, "k": 8, "g": 2, "in_size": [4, 4], "filter_size": [1, 1]}]))
    with pytest.raises(SystemExit, match="problem 0: .*groups G = 2 do not divide C = 3"):
        sweep.load_suite(bad, op="conv", direction="fwd", dtype="fp32", layout=None)
    drawn = sweep.random_problems("conv", 12, 5, direction="bwd_weight", dtype="fp32", layout=None, max_flop=1e8)
    assert len({str(e["problem"]) for e in drawn}) == 12
    assert all(e["problem"].direction == "bwd_weight" and e["problem"].flops() <= 1e8 for e in drawn)
    assert drawn == sweep.random_problems("conv", 12, 5, direction="bwd_weight", dtype="fp32", layout=None,
                                          max_flop=1e8)
    ranks = [e["problem"].spatial_dims for e in sweep.random_problems("conv", 60, 5, direction="fwd", dtype="fp32",
                                                                      layout=None, max_flop=1e8)]
    assert set(ranks) == {1, 2, 3} and ranks.count(2) > 20
    gemms = sweep.random_problems("gemm", 8, 1, direction=None, dtype="fp32", layout=None, max_flop=1e8)
    assert all(e["problem"].n % 8 == 0 and e["problem"].layout == "rcr" for e in gemms)


def test_store_drops_a_cut_short_append(tmp_path):
    store = tmp_path / "s.jsonl.gz"
    sweep.append_store(store, [{"meta": {"machine_id": "m"}}, {"problem_id": "p", "kernel": "a", "ms": 1.0}])
    sweep.append_store(store, [{"problem_id": "p", "kernel": "b", "ms": 2.0}])
    whole = store.read_bytes()
    store.write_bytes(whole + gzip.compress(b'{"problem_id": "p", "kernel": "c", "ms": 3.0}\n')[:-9])  # a crash
    metas, rows = sweep.read_store(store)
    assert metas == [{"machine_id": "m"}] and [r["kernel"] for r in rows] == ["a", "b"]


def test_build_ids_name_the_inputs_not_the_bytes(tiny_bundle, tmp_path):
    """Each kernel's build_id in the manifest (what the sweep stamps its times with) is the hash of its build's
    inputs, the CacheDir key: a cold build in another build directory, the cache off, records the same ids."""
    (tmp_path / "sweep_tiny.yaml").write_text(SET)
    scons(REPO, f"kernels={tmp_path / 'sweep_tiny.yaml'}", "backend=cpu", f"arch={ARCH}", f"build_dir={tmp_path}",
          "cache_dir=none", "bundle=again")

    def ids(bundle_dir):
        return {k["name"]: k["build_id"] for k in json.loads((bundle_dir / "manifest.json").read_text())["kernels"]}

    assert ids(tmp_path / "again") == ids(tiny_bundle) and all(len(v) >= 32 for v in ids(tiny_bundle).values())
    assert sweep.bundle_facts([str(tiny_bundle)])["binaries"] == {n: v[:16] for n, v in ids(tiny_bundle).items()}


def test_sharded_sweep_resumes_and_matches_one_worker(tiny_bundle, tmp_path):
    problems = suite_problems(tmp_path) + random_2d(3, 2, "fwd")
    kw = dict(direction="fwd", batch_ms=0.2, repeats=2, log=lambda *_: None)
    two = sweep.sweep([str(tiny_bundle)], "conv", problems, out_dir=tmp_path / "two", workers=2, **kw)
    store = Path(two["store"])
    assert store.name == f"conv_fwd_cpu_{ARCH}.jsonl.gz"
    metas, rows = sweep.read_store(store)
    kernels = {r["kernel"] for r in rows}
    assert len(kernels) == 3 and all("conv2dfwd" in k for k in kernels)
    assert len(rows) == two["timed"] == 3 * len(problems)
    timed = [r for r in rows if r["ms"] is not None]
    # the direct kernel refuses the wide groups (C/G > 8): recorded with its reason, so a rerun skips it too
    assert all(r["refused"] for r in rows if r["ms"] is None) and len(timed) >= 2 * len(problems)
    assert all(r["ms"] > 0 and len(r["samples_ms"]) == 2 and r["machine_id"] == metas[0]["machine_id"] for r in timed)
    assert metas[0]["machine"]["cores"] and metas[0]["op"] == "conv" and metas[0]["toolchain"][0]["identity"]
    assert {g for r in rows for g in r["groups"]} == {"neta", "netb", "random"}
    recorded = json.loads((tiny_bundle / "manifest.json").read_text())["selection_models"]
    assert set(recorded) == {"gemm", "conv_fwd", "conv_bwd_data", "conv_bwd_weight"}
    assert all((v is None) == (learned.model_for("cpu", ARCH, t) is None) for t, v in recorded.items())

    again = sweep.sweep([str(tiny_bundle)], "conv", problems, out_dir=tmp_path / "two", workers=2, **kw)
    assert again["timed"] == 0 and again["skipped"] == len(rows)
    assert len(sweep.read_store(store)[1]) == len(rows)  # nothing appended
    # the store's own problems are swept besides those given: a rerun with fewer still covers all of them
    fewer = sweep.sweep([str(tiny_bundle)], "conv", problems[:1], out_dir=tmp_path / "two", workers=2, **kw)
    assert fewer["problems"] == len(problems) and fewer["timed"] == 0 and fewer["skipped"] == len(rows)

    one = sweep.sweep([str(tiny_bundle)], "conv", problems, out_dir=tmp_path / "one", workers=1, **kw)
    assert pairs(Path(one["store"])) == pairs(store)

    # every line names the build it timed (the manifest's build_id) and, on a GPU, the timing method
    # (sweep.GPU_TIMING; none on the cpu backend); lines of another build of a kernel (here: rewritten as if the
    # kernel had been rebuilt since, or stored before the stamps) or of another method do not count as done, so
    # those pairs are timed again
    manifest = {k["name"]: k["build_id"] for k in json.loads((tiny_bundle / "manifest.json").read_text())["kernels"]}
    assert all(manifest[r["kernel"]].startswith(r["binary"]) and len(r["binary"]) == 16 for r in rows)
    assert sweep.timing_method("cpu") is None and not any("timing" in r for r in rows)
    rebuilt, requeued = sorted(kernels)[:2]
    stale = tmp_path / "stale" / store.name
    sweep.append_store(stale, [{"meta": m} for m in metas] +
                       [{**r, "binary": "0" * 16} if r["kernel"] == rebuilt else
                        {**r, "timing": sweep.GPU_TIMING} if r["kernel"] == requeued else
                        {k: v for k, v in r.items() if k != "binary"} if r["problem_id"] == rows[0]["problem_id"]
                        else r for r in rows])
    said = []
    retimed = sweep.sweep([str(tiny_bundle)], "conv", [], out_dir=tmp_path / "stale", workers=1,
                          **{**kw, "log": said.append})
    # every kernel is named: the first problem's lines of all of them are unstamped
    assert f"{len(kernels)} kernel(s) with times of another binary or timing method, timed again" in said[0]
    redone = {(r["problem_id"], r["kernel"]) for r in sweep.read_store(stale)[1][len(rows):]}
    assert redone == {(pid, k) for pid, k in pairs(store)
                      if k in (rebuilt, requeued) or pid == rows[0]["problem_id"]}
    assert retimed["timed"] == len(redone) and retimed["skipped"] == len(rows) - len(redone)

    # a stored measurement whose batches disagree counts as done, unless retime_disturbed asks for it again (the
    # other lines made steady here: this machine's own timings may be disturbed too)
    first = timed[0]
    shaky = tmp_path / "shaky" / store.name
    sweep.append_store(shaky, [{"meta": m} for m in metas] +
                       [{**r, "samples_ms": [r["ms"], 3 * r["ms"]]} if r is first else
                        {**r, "samples_ms": [r["ms"]] * 2, "calls": 10000} if r["ms"] is not None else r
                        for r in rows])
    assert sweep.sweep([str(tiny_bundle)], "conv", [], out_dir=tmp_path / "shaky", workers=1, **kw)["timed"] == 0
    again = sweep.sweep([str(tiny_bundle)], "conv", [], out_dir=tmp_path / "shaky", workers=1,
                        retime_disturbed=True, **kw)
    added = sweep.read_store(shaky)[1][len(rows):]
    assert again["timed"] == 1 and [(r["problem_id"], r["kernel"]) for r in added] == [(first["problem_id"],
                                                                                        first["kernel"])]
    assert added[0]["batch_ms"] == 0.2 and added[0]["calls"] >= 1


@pytest.mark.parametrize("line, shaky", [
    ({"ms": 1.0, "samples_ms": [1.0, 1.1, 1.2], "calls": 1000, "batch_ms": 1.0}, False),
    ({"ms": 1.0, "samples_ms": [1.0, 1.5], "calls": 1000, "batch_ms": 1.0}, True),  # batches 1.5x apart
    ({"ms": 0.025, "samples_ms": [0.025] * 3, "calls": 1}, True),  # 1 launch a batch where 1 ms was asked for
    ({"ms": 0.025, "samples_ms": [0.025] * 3, "calls": 40}, False),
    ({"ms": 3.0, "samples_ms": [3.0] * 3, "calls": 1}, False),  # a long kernel: one launch is the batch
    ({"ms": 0.025, "samples_ms": [0.025] * 3, "calls": 40, "host_behind": True}, True),  # the GPU caught up
    ({"ms": None, "refused": "UnsupportedProblemError: no"}, False)])
def test_disturbed_measurements(line, shaky):
    assert sweep.disturbed(line) is shaky


def test_training_takes_the_newest_binary_of_each_pair(tmp_path):
    """A pair's times come from the binary and timing method its last stored line names: a rebuilt kernel's new
    times replace the old build's, a refusal by the new build drops the pair, and times of one build from several runs are averaged
    (geometric mean), its disturbed runs left out where it has others."""
    import train

    problem = ConvProblem("fwd", 1, 1, 8, 8, (6, 6), (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), "fp32", "fp32", "fp32")
    names = [f"conv2dfwd_fp32xfp32xfp32xfp32_nhwgc_identity_cpu_{ARCH}_t{t}_w1x1x1_i4x16x1_ppacked_sdataparallel_"
             f"k1_c1x1x1_st0" for t in ("16x16x24", "64x32x64", "32x32x32")]
    meta = {"machine_id": "m", "machine": {}, "op": "conv", "direction": "fwd", "backend": "cpu", "arch": ARCH}

    def line(kernel, ms, binary=None):
        row = {"problem": problem.to_dict(), "problem_id": sweep.problem_id(problem), "kernel": kernel, "ms": ms,
               "groups": ["random"], "machine_id": "m"}
        if ms is None:
            row["refused"] = "CannotRun: no"
        return row if binary is None else {**row, "binary": binary}

    store = tmp_path / f"conv_fwd_cpu_{ARCH}.jsonl.gz"
    sweep.append_store(store, [{"meta": meta}, line(names[0], 1.0), line(names[1], 2.0), line(names[2], 3.0)])
    sweep.append_store(store, [line(names[0], 4.0, "a" * 16), line(names[0], 9.0, "a" * 16),  # rebuilt: 6 ms
                               line(names[1], 8.0), line(names[2], None, "b" * 16)])  # another run; a refusal
    # a disturbed run of a binary (batches 2.5x apart) is left out where the binary has undisturbed ones
    sweep.append_store(store, [{**line(names[1], 50.0), "samples_ms": [20.0, 50.0, 55.0]}])
    [entry] = train.load_problems([str(store)]).values()
    [p] = entry["problems"]
    assert p["names"] == names[:2]
    np.testing.assert_allclose(p["times"], [6.0, 4.0])  # sqrt(4 * 9); sqrt(2 * 8)
    # where every run of the newest binary was disturbed, they are what there is
    sweep.append_store(store, [{**line(names[0], 10.0, "c" * 16), "samples_ms": [10.0, 30.0]}])
    [entry] = train.load_problems([str(store)]).values()
    np.testing.assert_allclose(entry["problems"][0]["times"], [10.0, 4.0])
    # times of the same binary taken by another method (queued on a GPU) replace the earlier method's; until every
    # kernel of the problem has them, the problem is left out (times of two methods do not compare)
    sweep.append_store(store, [{**line(names[1], 3.0), "timing": sweep.GPU_TIMING}])
    assert not train.load_problems([str(store)])
    sweep.append_store(store, [{**line(names[0], 5.0, "c" * 16), "timing": sweep.GPU_TIMING}])
    [entry] = train.load_problems([str(store)]).values()
    np.testing.assert_allclose(entry["problems"][0]["times"], [5.0, 3.0])


def _train(tiny_bundle, tmp_path, direction, count=24):
    import train

    problems = suite_problems(tmp_path, direction) + random_2d(count, 7, direction)
    sweep.sweep([str(tiny_bundle)], "conv", problems, direction=direction, out_dir=tmp_path / "sweeps", workers=1,
                batch_ms=0.2, repeats=2, log=lambda *_: None)
    stores = sorted(str(p) for p in (tmp_path / "sweeps").glob("*.jsonl.gz"))
    # a throughput model (the GEMM test trains the default, ratio): the runtime predicts times in ms from it
    written = train.train(stores, tmp_path / "models", target="log1p_tflops", folds=3, rounds=25,
                          params={**train.PARAMS, "min_child_samples": 3}, log=lambda *_: None)
    return problems, written


def test_train_and_rank_conv_with_the_model(tiny_bundle, tmp_path, monkeypatch):
    pytest.importorskip("lightgbm")
    problems, written = _train(tiny_bundle, tmp_path, "bwd_data")
    assert [p.name for p in written] == [f"cpu_{ARCH}_conv_bwd_data.json"]
    data = json.loads(written[0].read_text())
    card = data["trained"]
    assert data["applies_to"]["direction"] == "bwd_data" and data["features"] == list(learned.CONV_FEATURES)
    assert card["kernel_count"] == 3 and all("conv2dbwdd" in n for n in card["kernel_names"])
    kfold = card["validation"]["group_kfold_by_shape"]
    assert kfold["learned"]["problems"] == card["problems"] and 0 < kfold["learned"]["min"] <= kfold["learned"]["mean"] <= 1
    families = card["validation"]["leave_one_family_out"]["families"]
    assert set(families) == {"neta", "netb", "netc", "random"}
    assert families["netb"]["learned"]["problems"] == 2  # its own layer and the one it shares with netc
    assert "| group_kfold_by_shape | learned |" in written[0].with_suffix(".md").read_text()

    monkeypatch.setattr(learned, "MODELS_DIR", written[0].parent)
    learned.clear_models()
    try:
        reg = __import__("tiledispatch").load(tiny_bundle)
        model = learned.model_for("cpu", ARCH, "conv_bwd_data")
        assert model is not None and model.task == "conv_bwd_data" and not model.unseen([k.key for k in reg.kernels])
        assert learned.model_for("cpu", ARCH, "conv_fwd") is None  # not trained here
        p = problems[0]["problem"]
        fits = reg.candidates(p)
        scores = model.predict(p, [k.key for k in fits])
        ranked = selection.learned(p, fits)
        assert [k.name for k in ranked] == [fits[i].name for i in sorted(range(len(fits)),
                                                                           key=lambda i: (scores[i], fits[i].name))]
        assert reg.select(p, "learned") is ranked[0]
        x = learned.features(p, [k.key for k in fits])
        np.testing.assert_allclose(model.trees.predict(x), -scores)  # a throughput model: higher is better
        # the bundle recorded that no model ranked it when it was built; now this one does
        assert reg.selection_models()["conv_bwd_data"] == {
            "now": {"model": written[0].name, "version": model.version, "covers": 3, "unseen": []},
            "built_with": None}

        # select --explain: the model's top kernels with predicted times, and measured ones once tuned here
        monkeypatch.setenv("TD_TUNING_CACHE", str(tmp_path / "tuning.json"))
        args = ["select", str(tiny_bundle), "conv", "--direction", "bwd_data", "--dtype", "fp32", "--n", str(p.n),
                "--c", str(p.c), "--k", str(p.k), "--groups", str(p.g), "--in", *map(str, p.in_size),
                "--filter", *map(str, p.filter_size), "--stride", *map(str, p.stride),
                "--padding", *map(str, p.pad_lo), "--explain", "--top", "2"]
        explain = _cli(args)["explain"]
        assert explain["model"]["version"] == model.version and explain["model"]["file"] == written[0].name
        assert [row["kernel"] for row in explain["top"]] == [k.name for k in ranked[:2]]
        assert all(row["predicted_ms"] > 0 and row["measured_ms"] is None for row in explain["top"])
        assert explain["tuned"] is None and explain["unseen_in_training"] == []
        tuned_reg = __import__("tiledispatch").load(tiny_bundle)
        tuned_reg.tune(p, {"x": np.ones(p.shapes()["x"], np.float32), "w": np.ones(p.shapes()["w"], np.float32),
                           "y": np.ones(p.shapes()["y"], np.float32)})
        explain = _cli(args)["explain"]
        assert explain["tuned"]["kernel"] in {k.name for k in fits}
        assert all(row["measured_ms"] > 0 and row["measured_queued_ms"] is None for row in explain["top"])  # no GPU
    finally:
        learned.clear_models()


def test_a_registry_ranks_with_the_models_it_was_loaded_with(tiny_bundle, tmp_path):
    """load(models=DIR): that folder's model ranks the registry's kernels (select, the public call's pick, select
    --explain, info), where the shipped models and other registries stay as they were; a folder or file that cannot
    be used is refused when loading."""
    import tiledispatch as td
    from tiledispatch import cli
    from tiledispatch.errors import InvalidInputError

    default = td.load(tiny_bundle)
    p = ConvProblem("bwd_data", 2, 1, 16, 24, (7, 7), (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), "fp32", "fp32", "fp32")
    fits = default.candidates(p)
    assert len(fits) >= 2 and default.select(p) is selection.analytic(p, fits)[0]  # no cpu model ships
    # a one-split model that prefers the kernel the analytic ranking puts last: a split on a feature where that
    # kernel's value is above every other candidate's sends it alone to the leaf of value 1
    worst = selection.analytic(p, fits)[-1]
    x = learned.features(p, [k.key for k in fits])
    i = fits.index(worst)
    column = next(c for c in range(x.shape[1]) if all(x[i, c] > x[j, c] for j in range(len(fits)) if j != i))
    below = max(x[j, column] for j in range(len(fits)) if j != i)
    key = fits[0].key
    model = {"schema": learned.MODEL_SCHEMA, "features": list(learned.CONV_FEATURES),
             "applies_to": {"backend": "cpu", "arch": ARCH, "op": "conv", "direction": "bwd_data",
                            "dtypes": ["fp32"], "layouts": [key.signature.layout]},
             "target": "ratio: higher is better", "higher_is_better": True, "trained": {"date": "test"},
             "trees": {"feature": [column, 0, 0], "threshold": [float(below + x[i, column]) / 2, math.inf, math.inf],
                       "left": [1, 1, 2], "right": [2, 1, 2], "value": [0.0, 0.0, 1.0], "roots": [0], "depth": 1}}
    models = tmp_path / "models"
    models.mkdir()
    (models / f"cpu_{ARCH}_conv_bwd_data.json").write_text(json.dumps(model))

    reg = td.load(tiny_bundle, models=models)
    assert reg.select(p).name == reg.select(p, "learned").name == worst.name != default.select(p).name
    dx = np.zeros(p.shapes()["x"], np.float32)
    rng = np.random.default_rng(0)
    reg.conv_bwd_data(rng.standard_normal(p.shapes()["y"], dtype=np.float32),
                      rng.standard_normal(p.shapes()["w"], dtype=np.float32), dx, stride=p.stride, padding=p.pad_lo)
    from tiledispatch.plan import last_launcher

    assert last_launcher().plan.kernel.name == worst.name
    assert reg.selection_models()["conv_bwd_data"]["now"]["model"] == str(models.resolve() / f"cpu_{ARCH}_conv_bwd_data.json")
    assert default.selection_models()["conv_bwd_data"]["now"] is None
    assert learned.model_for("cpu", ARCH, "conv_bwd_data") is None  # the shipped models are untouched
    reg.use_models(None)
    assert reg.select(p).name == default.select(p).name

    args = ["select", str(tiny_bundle), "--models", str(models), "conv", "--direction", "bwd_data", "--dtype", "fp32",
            "--n", "2", "--c", "16", "--k", "24", "--in", "7", "7", "--filter", "3", "3", "--padding", "1", "1",
            "--explain"]
    out = _cli(args)
    assert out["selected"] == worst.name and out["explain"]["top"][0]["kernel"] == worst.name

    with pytest.raises(InvalidInputError, match="not a folder"):
        td.load(tiny_bundle, models=tmp_path / "missing")
    (models / f"cpu_{ARCH}_conv_bwd_data.json").write_text("{not json")
    with pytest.raises(InvalidInputError, match=f"cpu_{ARCH}_conv_bwd_data.json cannot be used"):
        td.load(tiny_bundle, models=models)
    assert cli.main(["info", str(tiny_bundle), "--models", str(models)]) != 0


def _cli(args) -> dict:
    import contextlib
    import io

    from tiledispatch import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(args) == 0
    return json.loads(out.getvalue())


def test_cost_terms_equal_estimated_cost():
    """The vectorised cost model (selection.cost_terms, which the features read) is estimated_cost's, for every
    kernel of the preselected sets on every backend and arch; its views (one per family and view key) are each
    kernel's own gemm_view."""
    from tiledispatch.generator import kernelset
    from tiledispatch.ops.gemm import GemmProblem

    conv_problems = [ConvProblem(d, 2, g, 64 * g if g < 32 else g, 32 * g if g < 32 else g, (28, 28), (3, 3),
                                 (s, s), (1, 1), (1, 1), (1, 1), "fp16", "fp16", "fp16")
                     for d in ("fwd", "bwd_data", "bwd_weight") for g in (1, 4, 64) for s in (1, 2)]
    checked = 0
    for backend in backends.names():
        for arch in backends.get(backend).archs:
            for name in kernelset.available_sets():
                try:
                    keys = [e.key for e in kernelset.load([name], backend, arch)]
                except Exception:  # a set with nothing for this backend / arch
                    continue
                for dtype in {k.signature.dtype_a for k in keys}:
                    problems = [GemmProblem(m, 4096, 4096, dtype, dtype, dtype, "rcr") for m in (1, 77, 4096)]
                    for p in problems + conv_problems:
                        mine = [k for k in keys if p.mismatch(k) is None]
                        if mine:
                            expect = [selection.estimated_cost(p, k) for k in mine]
                            terms = selection.cost_terms(p, mine)
                            assert list(terms["cost"]) == expect, (backend, arch, name, p)
                            views = [tuple(int(v) for v in view) for view in zip(*(terms[c] for c in "mnk"),
                                                                                 terms["batch"])]
                            assert views == [selection.gemm_view(p, k) for k in mine], (backend, arch, name, p)
                            checked += len(mine)
    assert checked > 200


def test_train_a_gemm_model_on_the_shipped_features(tiny_bundle, tmp_path, monkeypatch):
    """GEMM goes through the same commands and keeps its features (those of the shipped cutlass model)."""
    pytest.importorskip("lightgbm")
    import train

    problems = sweep.random_problems("gemm", 16, 3, direction=None, dtype="fp32", layout=None, max_flop=2e7)
    sweep.sweep([str(tiny_bundle)], "gemm", problems, out_dir=tmp_path / "sweeps", workers=1, batch_ms=0.2,
                repeats=2, log=lambda *_: None)
    written = train.train([str(p) for p in (tmp_path / "sweeps").glob("*.jsonl.gz")], tmp_path / "models",
                          target="ratio", folds=3, rounds=15, params={**train.PARAMS, "min_child_samples": 3},
                          log=lambda *_: None)
    assert [p.name for p in written] == [f"cpu_{ARCH}_gemm.json"]
    data = json.loads(written[0].read_text())
    assert data["features"] == list(learned.GEMM_FEATURES) and data["target"].startswith("ratio")
    # retrained against the model it replaces: that model's picks on the same problems, in the card
    again = train.train([str(p) for p in (tmp_path / "sweeps").glob("*.jsonl.gz")], tmp_path / "again",
                        folds=3, rounds=15, params={**train.PARAMS, "min_child_samples": 3},
                        against=[str(written[0])], log=lambda *_: None)
    scored = json.loads(again[0].read_text())["trained"]["validation"][f"against {written[0].name}"]
    assert scored["model"]["problems"] == data["trained"]["problems"] and 0 < scored["model"]["mean"] <= 1
    assert scored["version"] == learned.Model(data).version
    assert f"against {written[0].name}" in again[0].with_suffix(".md").read_text()
    monkeypatch.setattr(learned, "MODELS_DIR", written[0].parent)
    learned.clear_models()
    try:
        reg = __import__("tiledispatch").load(tiny_bundle)
        p = problems[0]["problem"]
        fits = reg.candidates(p)
        model = learned.model_for("cpu", ARCH, "gemm")
        predicted, unit = model.predicted_times(p, [k.key for k in fits])
        assert unit == "x_best" and (predicted > 0).all()
        scores = model.predict(p, [k.key for k in fits])  # minus the predicted ratio to the best
        np.testing.assert_allclose(scores, -1 / predicted, rtol=1e-9)
        best = min(range(len(fits)), key=lambda i: (scores[i], fits[i].name))
        assert selection.learned(p, fits)[0] is fits[best]
    finally:
        learned.clear_models()


def test_identity_set_has_every_tile_of_the_set_with_identity_epilogues(tmp_path):
    import identity_set

    from tiledispatch import learned
    from tiledispatch.generator import kernelset

    out = tmp_path / "conv_sweep.yaml"
    assert identity_set.main(["conv_fp16_all_essential", "--backend", "cutlass", "--op", "conv", "-o", str(out)]) == 0
    swept = [e.key for e in kernelset.load([str(out)], "cutlass", "sm90a")]
    shipped = [e.key for e in kernelset.load(["conv_fp16_all_essential"], "cutlass", "sm90a") if e.key.signature.op == "conv"]
    assert all(k.signature.epilogue.activation == "identity" and not k.signature.epilogue.bias for k in swept)
    assert any(k.signature.epilogue.bias for k in shipped)  # the fused kernels the model ranks by their tiles
    seen = {learned._what_the_model_sees(k) for k in swept}
    assert {learned._what_the_model_sees(k) for k in shipped} == seen
    with pytest.raises(SystemExit, match="no ck_tile gemm groups"):
        identity_set.main(["conv_fp16_all_essential", "--backend", "ck_tile", "--op", "gemm", "-o", str(out)])


def test_agreement_of_two_sweeps(tmp_path):
    """agreement.py: per-pair ratios by kernel length, and each selection's fastest kernel judged by the other's
    times; a store's lines are selected by timing method."""
    import agreement

    a = {"p1": {"k1": 0.005, "k2": 0.006}, "p2": {"k1": 1.0, "k2": 2.0}}
    b = {"p1": {"k1": 0.006, "k2": 0.003}, "p2": {"k1": 1.0, "k2": 2.0}}
    result = agreement.agreement(a, b)
    assert result["pairs"] == 4
    short, long_ = result["b_over_a_by_a_time"]
    assert short["below_ms"] == 0.01 and short["pairs"] == 2 and long_["below_ms"] is None and long_["p50"] == 1.0
    # p1: A picks k1, which B times at 0.006 against its best 0.003; p2 agrees
    assert result["a_oracle_on_b"] == {"problems": 2, "mean": 0.75, "median": 0.75, "p10": 0.5, "min": 0.5,
                                       "within_10pct": 0.5}
    assert result["b_oracle_on_a"]["min"] == pytest.approx(0.005 / 0.006)
    store = tmp_path / "s.jsonl.gz"
    row = {"problem_id": "p1", "kernel": "k1", "ms": 2.0}
    sweep.append_store(store, [row, {**row, "ms": 1.0, "timing": sweep.GPU_TIMING}])
    assert agreement.selected(f"{store}@launched")[1] == {"p1": {"k1": 2.0}}
    assert agreement.selected(f"{store}@queued")[1] == {"p1": {"k1": 1.0}}
    with pytest.raises(SystemExit, match="launched or queued"):
        agreement.selected(f"{store}@paced")
