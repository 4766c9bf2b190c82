"""The benchmark suites of issue #20 (bench/suites) and their runner (bench/benchmarks/suite.py), without torchvision
and without a GPU: the generator's layer extraction on small modules of known shapes, the suite files against what
the generator's own logic makes of their records (and its LLM configs), their invariants, and the runner's problem
construction, checks and reports on the cpu backend for a few real layers and shapes."""
from __future__ import annotations

import importlib.util
import json
import math
import re

import pytest
import torch
from torch import nn

from conftest import REPO, build_cpu_bundle


def _module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


generate = _module("suites_generate", REPO / "bench" / "suites" / "generate.py")
CONV = json.loads((REPO / "bench" / "suites" / "conv.json").read_text())
GEMM = json.loads((REPO / "bench" / "suites" / "gemm.json").read_text())


# ---- the generator's extraction -------------------------------------------------------------------------------
class Small(nn.Module):
    """Layers of every kind the suites hold: a stem on the input, depthwise dilated, grouped, a module run twice,
    1D with 'same' padding of an even filter (asymmetric), 3D with replicate padding, a linear over tokens."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.depthwise = nn.Conv2d(8, 16, 3, padding=2, dilation=2, groups=8)
        self.grouped = nn.Conv2d(16, 16, 1, groups=4)
        self.audio = nn.Conv1d(16, 4, 4, padding="same")
        self.video = nn.Conv3d(2, 2, 3, padding=1, padding_mode="replicate")
        self.head = nn.Linear(4, 6)

    def forward(self, x):
        y = self.grouped(self.grouped(self.depthwise(self.stem(x))))  # grouped: twice
        a = self.audio(y.flatten(2))  # [N, 4, 25]
        self.video(a[:, :2].reshape(2, 2, 1, 5, 5))
        return self.head(a.transpose(1, 2))  # 2 x 25 tokens


def test_record_model_sees_every_layer_as_run():
    convs, gemms = generate.record_model(Small(), torch.randn(2, 3, 10, 10))
    common = {"dilation": [1, 1], "n": 2}
    assert convs[0] == {**common, "rank": 2, "c": 3, "k": 8, "groups": 1, "in_size": [10, 10], "filter": [3, 3],
                        "stride": [2, 2], "pad_lo": [1, 1], "pad_hi": [1, 1], "directions": ["fwd", "bwd_weight"]}
    assert convs[1] == {**common, "rank": 2, "c": 8, "k": 16, "groups": 8, "in_size": [5, 5], "filter": [3, 3],
                        "stride": [1, 1], "dilation": [2, 2], "pad_lo": [2, 2], "pad_hi": [2, 2],
                        "directions": list(generate.DIRECTIONS)}
    assert convs[2] == convs[3] and convs[2]["groups"] == 4 and convs[2]["filter"] == [1, 1]
    assert convs[4] == {"rank": 1, "n": 2, "c": 16, "k": 4, "groups": 1, "in_size": [25], "filter": [4],
                        "stride": [1], "dilation": [1], "pad_lo": [1], "pad_hi": [2],
                        "directions": list(generate.DIRECTIONS)}
    # replicate padding happens before the convolution: it sees the padded size and no padding
    assert convs[5]["in_size"] == [3, 7, 7] and convs[5]["pad_lo"] == convs[5]["pad_hi"] == [0, 0, 0]
    assert len(convs) == 6
    assert gemms == [{"pass": "fwd", "m": 50, "n": 6, "k": 4, "layout": "rcr"},
                     {"pass": "bwd_data", "m": 50, "n": 4, "k": 6, "layout": "rrr"},
                     {"pass": "bwd_weight", "m": 6, "n": 4, "k": 50, "layout": "crr"}]


def test_record_model_checks_the_output_size_formula():
    class Wrong(nn.Conv2d):  # a module whose output is not what its attributes say
        def forward(self, x):
            return super().forward(x)[..., :-1]

    with pytest.raises(AssertionError, match="formula"):
        generate.record_model(Wrong(3, 4, 3), torch.randn(1, 3, 8, 8))


def test_build_conv_suite_deduplicates_counts_and_classifies():
    convs, _ = generate.record_model(Small(), torch.randn(2, 3, 10, 10))
    again, _ = generate.record_model(Small(), torch.randn(2, 3, 10, 10).requires_grad_())
    suite = generate.build_conv_suite({"a": convs, "b": again}, {"schema": 1})
    layers = {e["id"]: e for e in suite["layers"]}
    assert len(layers) == 5  # the grouped layer once
    grouped = next(e for e in layers.values() if e["groups"] == 4)
    assert grouped["uses"] == {"a": 2, "b": 2} and grouped["weight"] == 4 and grouped["cls"] == "grouped"
    stem = next(e for e in layers.values() if e["c"] == 3)
    assert stem["directions"] == list(generate.DIRECTIONS)  # b's input needs a gradient: the union
    assert stem["id"] == "2d_n2_c3_k8_g1_10x10_f3x3_s2x2_p1x1_d1x1" and stem["out_size"] == [5, 5]
    assert stem["flops"] == 2 * 2 * 8 * 3 * 25 * 9
    assert next(e for e in layers.values() if e["groups"] == 8)["cls"] == "depthwise"  # channel multiplier 2
    audio = next(e for e in layers.values() if e["rank"] == 1)
    assert audio["id"].endswith("_p1-2_d1") and audio["out_size"] == [25]
    assert [e["rank"] for e in suite["layers"]] == sorted(e["rank"] for e in suite["layers"])
    assert generate.build_conv_suite(generate.records_of_conv_suite(suite), {"schema": 1}) == suite


def test_meta_tensors_of_modules_allocates_nothing_and_restores_nn():
    with generate.meta_tensors_of_modules():
        m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    assert all(p.is_meta and p.requires_grad for p in m.parameters()) and all(b.is_meta for b in m.buffers())
    assert not nn.Conv2d(3, 4, 3).weight.is_meta


# ---- the suite files ------------------------------------------------------------------------------------------
def test_conv_suite_is_what_the_generator_makes_of_its_records():
    header = {k: v for k, v in CONV.items() if k != "layers"}
    assert generate.build_conv_suite(generate.records_of_conv_suite(CONV), header) == CONV
    assert generate.dump(CONV) == (REPO / "bench" / "suites" / "conv.json").read_text()


def test_conv_suite_invariants():
    assert CONV["schema"] == generate.SCHEMA and CONV["sources"]["torch"] and CONV["sources"]["torchvision"]
    ids = [e["id"] for e in CONV["layers"]]
    assert len(ids) == len(set(ids)) > 1000
    used = set()
    for e in CONV["layers"]:
        assert e["c"] % e["groups"] == 0 and e["k"] % e["groups"] == 0, e["id"]
        assert e["out_size"] == generate.out_size(e) and min(e["out_size"]) > 0, e["id"]
        assert len(e["in_size"]) == len(e["filter"]) == len(e["stride"]) == e["rank"], e["id"]
        assert e["id"] == generate.conv_id(e) and e["cls"] == generate.conv_class(e), e["id"]
        assert e["flops"] == generate.conv_flops(e), e["id"]
        assert e["uses"] and set(e["uses"]) <= set(CONV["models"]) and e["weight"] == sum(e["uses"].values())
        assert e["directions"][0] == "fwd" and "bwd_weight" in e["directions"]
        assert e["n"] == CONV["models"][next(iter(e["uses"]))]["batch"]
        used |= set(e["uses"])
    assert used == set(CONV["models"])  # every model contributes layers
    assert {(e["rank"], e["cls"]) for e in CONV["layers"]} >= {(1, "dense"), (2, "dense"), (2, "grouped"),
                                                               (2, "depthwise"), (3, "dense")}
    families = ("resnet50", "resnext50_32x4d", "wide_resnet50_2", "mobilenet_v2", "mobilenet_v3_large",
                "efficientnet_b0", "efficientnet_b4", "efficientnet_v2_s", "convnext_tiny", "regnet_y_400mf",
                "densenet121", "shufflenet_v2_x1_0", "mnasnet1_0", "squeezenet1_0", "vgg16", "googlenet",
                "inception_v3", "r3d_18", "mc3_18", "r2plus1d_18", "deeplabv3_resnet50", "fcn_resnet50",
                "wav2vec2_feature_extractor")
    assert set(families) <= set(CONV["models"]) and "efficientnet_b5" not in CONV["models"]
    layers = {e["id"]: e for e in CONV["layers"]}
    stem = layers["2d_n32_c3_k64_g1_224x224_f7x7_s2x2_p3x3_d1x1"]  # ResNet's stem: no gradient for the image
    assert stem["uses"]["resnet50"] == 1 and stem["directions"] == ["fwd", "bwd_weight"]
    assert layers["1d_n32_c1_k512_g1_16000_f10_s5_p0_d1"]["uses"] == {"wav2vec2_feature_extractor": 1}
    assert any(e["dilation"] == [12, 12] and "deeplabv3_resnet50" in e["uses"] for e in CONV["layers"])
    assert any(e["rank"] == 3 and e["n"] == 8 and "r2plus1d_18" in e["uses"] for e in CONV["layers"])


def test_gemm_suite_is_what_the_generator_makes_of_the_configs_and_records():
    header = {k: v for k, v in GEMM.items() if k != "shapes"}
    assert header["llms"] == generate.LLMS and header["tokens"] == list(generate.LLM_TOKENS)
    torchvision = generate.records_of_gemm_suite(GEMM, set(GEMM["torchvision_models"]))
    assert generate.build_gemm_suite({**generate.llm_records(), **torchvision}, header) == GEMM
    assert generate.dump(GEMM) == (REPO / "bench" / "suites" / "gemm.json").read_text()


def test_pointwise_gemm_suite_is_what_conv_json_gives():
    pointwise = _module("pointwise_gemms", REPO / "bench" / "suites" / "pointwise_gemms.py")
    assert pointwise.main(["--check"]) == 0, "run python3 bench/suites/pointwise_gemms.py"
    shapes = json.loads(pointwise.OUT.read_text())["shapes"]
    layers = {e["id"]: e for e in CONV["layers"]}
    covered = [ly for ly in CONV["layers"] if pointwise.is_pointwise(ly) and ly["c"] % 8 == 0 and ly["k"] % 8 == 0]
    assert sum(len(s["layers"]) for s in shapes) == len(covered) and len({s["id"] for s in shapes}) == len(shapes)
    for s in shapes:  # each layer's GEMM: pixels x K x C, and its uses summed
        for lid in s["layers"]:
            ly = layers[lid]
            assert (s["m"], s["n"], s["k"]) == (ly["n"] * math.prod(ly["in_size"]), ly["k"], ly["c"])
        assert sum(s["uses"].values()) == sum(sum(layers[lid]["uses"].values()) for lid in s["layers"])
    mobilenet = next(s for s in shapes if (s["m"], s["n"], s["k"]) == (32 * 112 * 112, 96, 16))
    assert "mobilenet_v2" in mobilenet["uses"]


def test_gemm_suite_invariants():
    ids = [e["id"] for e in GEMM["shapes"]]
    assert len(ids) == len(set(ids)) and GEMM["dtypes"] == ["fp16", "bf16"]
    shapes = {(e["pass"], e["m"], e["n"], e["k"]): e for e in GEMM["shapes"]}
    for e in GEMM["shapes"]:
        assert min(e["m"], e["n"], e["k"]) >= 1 and e["layout"] == generate.LINEAR_PASSES[e["pass"]]
        assert e["uses"] and e["weight"] == sum(e["uses"].values())
        if e["pass"] == "fwd":  # a linear layer's backward GEMMs are there too
            assert ("bwd_weight", e["n"], e["k"], e["m"]) in shapes
            assert ("bwd_data", e["m"], e["k"], e["n"]) in shapes
    for m in generate.LLM_TOKENS:  # Llama-3 8B: 32 blocks with a gate and an up projection 4096 -> 14336 each
        assert shapes[("fwd", m, 14336, 4096)]["uses"]["llama3_8b"] == 64
        assert shapes[("fwd", m, 4096, 14336)]["uses"]["mistral_7b"] == 32  # down_proj
        assert shapes[("fwd", m, 1024, 8192)]["uses"]["llama3_70b"] == 160  # k_proj, v_proj: 8 kv heads x 128
        assert shapes[("fwd", m, 50257, 768)]["uses"]["gpt2"] == 1
        assert shapes[("fwd", m, 30522, 1024)]["uses"]["bert_large"] == 1
    assert shapes[("fwd", 32, 1000, 2048)]["uses"]["resnet50"] == 1  # a torchvision classifier at batch 32
    assert any("convnext_tiny" in e["uses"] and e["m"] == 32 * 56 * 56 for e in GEMM["shapes"])


# ---- the runner on the cpu backend ------------------------------------------------------------------------------
suite_runner = _module("suite_runner", REPO / "bench" / "benchmarks" / "suite.py")

SMOKE_SET = """\
schema: 1
name: suite_smoke
description: small cpu kernels for the suite runner's test
groups:
  - backend: cpu
    op: conv
    direction: [fwd, bwd_data, bwd_weight]
    dtype: fp16
    layout: nhwgc
    configs:  # what the test's layers need: 2D / 3D dense, 1D C = 1, 2D narrow groups and depthwise
      - {spatial_dims: [2, 3], pipeline: packed, tile: [64, 64, 256], mma: [4, 32, 1]}
      - {spatial_dims: [1, 2], pipeline: direct, tile: [64, 128, 64], mma: [4, 32, 1]}
  - {backend: cpu, op: gemm, dtype: fp16, layout: [rcr, rrr, crr], pipeline: packed, tile: [96, 256, 256],
     mma: [8, 32, 1]}
"""


@pytest.fixture(scope="module")
def smoke_bundle(tmp_path_factory):
    build = tmp_path_factory.mktemp("suite_smoke")
    build_cpu_bundle(build, "suite_smoke", SMOKE_SET)
    return build / "suite_smoke"


def smallest_layers() -> list[str]:
    """The cheapest layer of each (rank, class) of the suite, and the cheapest 3x3 one: real layers, batch 1."""
    best = {}
    for e in CONV["layers"]:
        for key in ((e["rank"], e["cls"]), ("3x3",) if e["filter"] == [3, 3] and e["groups"] == 1 else None):
            if key and (key not in best or e["flops"] // e["n"] < best[key]["flops"] // best[key]["n"]):
                best[key] = e
    return sorted({e["id"] for e in best.values()})


def test_runner_conv_points_on_cpu(smoke_bundle, tmp_path):
    ids = smallest_layers()
    only = "^(" + "|".join(map(re.escape, ids)) + ")$"
    args = ["conv", str(smoke_bundle), "--out", str(tmp_path), "--device", "cpu", "--batch", "1", "--only", only]
    assert suite_runner.main(args) == 0
    result = json.loads((tmp_path / "conv.json").read_text())
    rows = result["rows"]
    expected = sum(len(e["directions"]) for e in CONV["layers"] if e["id"] in ids)
    assert len(rows) == result["points"] == expected == result["summary"]["all"]["points"]  # none dropped
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["status"] for r in rows} == {"ok"}, [r for r in rows if r["status"] != "ok"]
    for r in ok:
        assert r["rel_error"] <= suite_runner.TOLERANCE["fp16"] and r["kernel"] and r["ours_ms"] > 0
        assert r["speedup"] == pytest.approx(min(r["peer_ms"].values()) / r["ours_ms"])
    assert any(r["kernel"].startswith("gemm_") for r in ok)  # the pointwise layer ran on a GEMM kernel
    assert any("cudnn_as_2d" in r["peer_ms"] for r in ok)  # 1D also timed as 2D
    assert {r["direction"] for r in ok} == set(generate.DIRECTIONS)
    assert all(("copy_ms" in r) == (r["cls"] != "dense") for r in ok)  # the memory floor of memory-bound layers



@pytest.mark.parametrize("route", ["kernel", "phases", "auto"])
def test_runner_conv_through_the_torch_operators(smoke_bundle, tmp_path, route):
    """--api torch: the operators a patched model calls, checked against the peer like the registry's calls; the
    strided layers' input gradient by either route."""
    import tiledispatch.torch as tdt
    strided = [e for e in CONV["layers"] if max(e["stride"]) > 1 and "bwd_data" in e["directions"]]
    cheapest_strided = min(strided, key=lambda e: e["flops"] // e["n"])["id"]
    ids = sorted(set(smallest_layers()) | {cheapest_strided})
    only = "^(" + "|".join(map(re.escape, ids)) + ")$"
    args = ["conv", str(smoke_bundle), "--out", str(tmp_path), "--device", "cpu", "--batch", "1", "--only", only,
            "--api", "torch"]
    tdt.set_strided_bwd_data(route)
    try:
        assert suite_runner.main(args) == 0
    finally:
        tdt.set_strided_bwd_data("auto")
    rows = json.loads((tmp_path / "conv.json").read_text())["rows"]
    assert {r["status"] for r in rows} == {"ok"}, [r for r in rows if r["status"] != "ok"]
    assert {r["direction"] for r in rows} == set(generate.DIRECTIONS)
    assert any(r["id"] == cheapest_strided and r["direction"] == "bwd_data" for r in rows)

def test_runner_gemm_two_processes_shards_and_report(smoke_bundle, tmp_path):
    for i in range(2):
        args = ["gemm", str(smoke_bundle), "--out", str(tmp_path / f"s{i}"), "--device", "cpu", "--shard", f"{i}/2",
                "--only", "_(1|8)x768x768_", "--peer-processes", "2"]
        assert suite_runner.main(args) == 0
        assert (tmp_path / f"s{i}" / f"gemm_shard{i}of2_peer.jsonl").exists()
    assert suite_runner.main(["report", str(tmp_path / "s0"), str(tmp_path / "s1"), "--out", str(tmp_path)]) == 0
    merged = json.loads((tmp_path / "gemm_all.json").read_text())
    assert len(merged["rows"]) == 2 * 4  # 4 shapes x fp16, bf16
    timed = [r for r in merged["rows"] if r["status"] == "ok"]
    assert len(timed) == 4 and all({"torch.mm", "F.linear", "torch.mm@2", "F.linear@2"} <= set(r["peer_ms"])
                                   for r in timed)
    assert {r["status"] for r in merged["rows"] if r["dtype"] == "bf16"} == {"no kernel"}  # reported, not dropped
    assert merged["summary"]["bf16"]["no_kernel"] == 4 and merged["summary"]["fp16"]["timed"] == 4


def test_runner_check_catches_wrong_and_missing_results():
    want = torch.ones(8, dtype=torch.float16)
    out = torch.empty(8, dtype=torch.float16)

    def run(ours):
        return suite_runner.ours_and_check({"dtype": "fp16"}, ours, out, want,
                                           lambda: ("k", lambda: None), "cpu")

    assert run(lambda: out.fill_(1.0))["status"] == "ok"
    assert run(lambda: out.fill_(1.1))["status"] == "wrong result"
    assert run(lambda: None)["status"] == "wrong result"  # nothing written: the poison stays
    # where ours and the peer disagree, the float64 result decides which one is off
    exact = lambda: torch.ones(8, dtype=torch.float64)  # noqa: E731
    peer_off = suite_runner.ours_and_check({"dtype": "fp16"}, lambda: out.fill_(1.0), out, want * 1.1,
                                           lambda: ("k", lambda: None), "cpu", exact)
    assert peer_off["status"] == "ok" and peer_off["peer_off"] and peer_off["peer_rel_error_f64"] > 0.05
    ours_off = suite_runner.ours_and_check({"dtype": "fp16"}, lambda: out.fill_(1.1), out, want,
                                           lambda: ("k", lambda: None), "cpu", exact)
    assert ours_off["status"] == "wrong result" and ours_off["rel_error_f64"] > 0.05
    from tiledispatch.errors import UnsupportedProblemError

    def refuse():
        raise UnsupportedProblemError("no kernel can run it\n  details")

    assert run(refuse) == {"dtype": "fp16", "status": "no kernel", "reason": "no kernel can run it\n  details"}


# ---- preselected sets: kernel counts and cold build times (item 5) ---------------------------------------------
preselected_build = _module("preselected_build", REPO / "bench" / "benchmarks" / "preselected_build.py")


def test_preselected_readme_table_is_what_the_sets_and_results_give():
    text = preselected_build.README.read_text()
    start, stop = text.index(preselected_build.BEGIN), text.index(preselected_build.END)
    written = text[start:stop + len(preselected_build.END)]
    want = preselected_build.render_table(preselected_build.read_results(preselected_build.RESULTS))
    assert written == want, "run: python3 bench/benchmarks/preselected_build.py table"


def test_preselected_table_shows_counts_and_measured_times():
    sets = preselected_build.counts()
    assert sets["fp16_rcr_full"] == {"cutlass/sm90a": 53}
    assert sets["conv_fp16_all_essential"]["cutlass/sm90a"] >= sets["conv_fp16_fwd_essential"]["cutlass/sm90a"]
    results = {"machine": {"cpu_count": 16, "jobs": 16, "nvcc": "Build cuda_13.0"},
               "sets": {"fp16_rcr_full cutlass/sm90a": {"kernels": 53, "cold_seconds": 150.0},
                        "fp16_rcr_essential cutlass/sm90a": {"kernels": 5, "cold_seconds": 30.0}}}
    table = preselected_build.render_table(results)
    assert "Cold builds: 16 cores, -j16, Build cuda_13.0." in table
    row = next(line for line in table.splitlines() if line.startswith("| `fp16_rcr_full` |"))
    assert "| 53 |" in row and "| 2.5 min |" in row
    # a set that changed since its build was timed: the time says how many kernels it is for
    row = next(line for line in table.splitlines() if line.startswith("| `fp16_rcr_essential` |"))
    assert f"| 0.5 min (5 of {sets['fp16_rcr_essential']['cutlass/sm90a']} kernels) |" in row
    results["sets"].pop("fp16_rcr_essential cutlass/sm90a")
    table = preselected_build.render_table(results)
    row = next(line for line in table.splitlines() if line.startswith("| `fp16_rcr_essential` |"))
    assert "not measured" in row


def test_preselected_measure_goes_on_across_calls(monkeypatch, tmp_path):
    """A set cut off by the budget goes on at the next call; its cold time is the sum of its attempts."""
    attempts = iter([{"seconds": 500.0, "rc": None}, {"seconds": 70.0, "rc": 0}, {"seconds": 90.0, "rc": 0}])
    sets = {"big": {"cutlass/sm90a": 9}, "small": {"cutlass/sm90a": 2}, "amd": {"ck_tile/gfx942": 3}}
    monkeypatch.setattr(preselected_build, "counts", lambda: sets)
    seen, dirs = [], []

    def build(name, arch, jobs, build_dir, cache_dir, seconds):
        seen.append(name)
        dirs.append((build_dir, cache_dir, sorted(p.name for p in cache_dir.glob("*")) if cache_dir.exists() else []))
        cache_dir.mkdir(parents=True, exist_ok=True)
        (cache_dir / f"kernel{len(seen)}").write_text("built")  # what the attempt stored in the set's cache
        return next(attempts)

    monkeypatch.setattr(preselected_build, "build", build)
    stale = tmp_path / "small_sm90a.cache"
    stale.mkdir()
    (stale / "old").write_text("a previous measurement's kernel")
    args = ["measure", "--archs", "sm90a", "--out", str(tmp_path / "r.json"), "--state", str(tmp_path)]
    assert preselected_build.main(args) == 3  # the smallest set first, cut off: call again
    assert preselected_build.main(args) == 0
    result = json.loads((tmp_path / "r.json").read_text())["sets"]
    assert seen == ["small", "small", "big"]
    assert result["small cutlass/sm90a"]["cold_seconds"] == 570.0
    assert result["big cutlass/sm90a"]["cold_seconds"] == 90.0 and "amd cutlass/sm90a" not in result
    # the first attempt starts from an empty cache of the set's own; the next one has what the first stored
    assert dirs[0][1] == dirs[1][1] == stale and dirs[0][2] == [] and dirs[1][2] == ["kernel1"]
    assert dirs[2][1] != stale and dirs[0][0] == dirs[1][0] != dirs[2][0]


def test_preselected_cold_time_of_attempts():
    """The sum of the attempts, except that one which compiled every kernel started over (results from before the
    per-set cache: a killed scons kept no record of the kernels it had built)."""
    cut = {"seconds": 147.6, "rc": None, "compiled": 217}
    resumed = {"seconds": 40.0, "rc": 0, "kernels": 334, "compiled": 117, "cached": 217, "up_to_date": 0}
    again = {"seconds": 371.5, "rc": 0, "kernels": 334, "compiled": 334, "cached": 0, "up_to_date": 0}
    assert preselected_build.cold_seconds([cut, resumed]) == 187.6
    assert preselected_build.cold_seconds([cut, again]) == 371.5
    assert preselected_build.cold_seconds([again]) == 371.5


def test_runner_markdown_table_has_a_row_per_group():
    rows = [{"id": "a", "direction": "fwd", "dtype": "fp16", "cls": "dense", "rank": 2, "weight": 3, "status": "ok",
             "peer_ms": {"cudnn": 1.0}, "ours_ms": 2.0, "kernel_ms": 1.0},
            {"id": "b", "direction": "fwd", "dtype": "fp16", "cls": "grouped", "rank": 2, "weight": 1,
             "status": "no kernel", "reason": "none"},
            {"id": "c", "direction": "fwd", "dtype": "fp16", "cls": "depthwise", "rank": 2, "weight": 1, "status": "ok",
             "peer_ms": {"cudnn": 0.3}, "ours_ms": 0.2, "kernel_ms": 0.1, "copy_ms": 0.1}]
    for r in rows:  # as merged_rows completes them
        if "ours_ms" in r:
            r.update(speedup=r["peer_ms"]["cudnn"] / r["ours_ms"],
                     speedup_kernel=r["peer_ms"]["cudnn"] / r["kernel_ms"])
    summary = suite_runner.summarize(rows)
    assert summary["fwd"]["points"] == 3 and summary["fwd"]["no_kernel"] == 1
    assert summary["fwd"]["geomean"] == pytest.approx((0.5 * 1.5) ** 0.5)
    assert summary["fwd dense"]["below_0_7"] == 1 and "geomean" not in summary["fwd grouped"]
    assert summary["fwd depthwise"]["peer_over_copy"] == pytest.approx(3.0)
    assert summary["fwd depthwise"]["ours_over_copy"] == pytest.approx(2.0)
    assert "ours_over_copy" not in summary["fwd dense"]
    table = suite_runner.markdown(summary, "t").splitlines()
    body = [line for line in table if line.startswith("| ") and not line.startswith("| group")]
    assert len(body) == len(summary) and all(line.count("|") == table[2].count("|") for line in body)
    assert "0.50 (`a fwd fp16`)" in next(line for line in body if line.startswith("| fwd dense |"))


def test_compare_two_runs_point_by_point(tmp_path):
    """compare: the points both runs timed, the peer at its fastest over both, picks changed apart from kept."""
    def row(pid, cls, peer, ours, kernel_ms, kernel):
        return {"id": pid, "direction": "fwd", "dtype": "fp16", "cls": cls, "rank": 2, "status": "ok",
                "peer_ms": {"cudnn": peer}, "ours_ms": ours, "kernel_ms": kernel_ms, "kernel": kernel}

    before = [row("a", "dense", 1.0, 2.0, 1.0, "k1"), row("b", "dense", 2.0, 2.0, 2.0, "k2"),
              row("c", "grouped", 1.0, 1.0, 1.0, "k3")]
    after = [row("a", "dense", 0.5, 1.0, 0.5, "k4"), row("b", "dense", 2.0, 2.5, 2.5, "k2")]  # c: not timed
    for d, rows in (("before", before), ("after", after)):
        (tmp_path / d).mkdir()
        (tmp_path / d / "conv.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["compare", str(tmp_path / "before"), str(tmp_path / "after"), "--out", str(tmp_path / "cmp")]
    assert suite_runner.main(args) == 0
    groups = json.loads((tmp_path / "cmp.json").read_text())["groups"]
    assert set(groups) == {"all", "fwd", "fwd dense", "fwd 2D"} and groups["all"]["points"] == 2
    g = groups["fwd dense"]
    # peers 0.5 (a, the faster run's) and 2.0 (b): before 0.5/2 and 2/2, after 0.5/1 and 2/2.5
    assert g["before"] == pytest.approx((0.25 * 1.0) ** 0.5) and g["after"] == pytest.approx((0.5 * 0.8) ** 0.5)
    assert g["picks_changed"] == 1 and g["changed_picks_kernel_speedup"] == pytest.approx(2.0)
    assert g["kept_picks_kernel_drift"] == pytest.approx(0.8)
    assert g["changed_picks_call_speedup"] == pytest.approx(2.0) and g["changed_picks_call_slower"] == 0
    assert "| fwd dense | 2 |" in (tmp_path / "cmp.md").read_text()
    with pytest.raises(SystemExit):  # no point in common
        suite_runner.main(["compare", str(tmp_path / "before"), str(tmp_path / "before" / "none")])


def test_runner_versus_times_a_second_bundle_beside_ours(smoke_bundle, tmp_path):
    """--versus: another bundle's public call measured at each point right beside ours (here one without the direct
    kernels, so the layers only those run have no kernel there); `compare DIR` reads it as the before."""
    packed_only = SMOKE_SET.replace("      - {spatial_dims: [1, 2], pipeline: direct", "      # - no direct")
    build_cpu_bundle(tmp_path, "suite_smoke_packed", packed_only.replace("name: suite_smoke", "name: suite_smoke_packed"))
    ids = smallest_layers()
    only = "^(" + "|".join(map(re.escape, ids)) + ")$"
    args = ["conv", str(smoke_bundle), "--versus", str(tmp_path / "suite_smoke_packed"), "--out", str(tmp_path / "r"),
            "--device", "cpu", "--batch", "1", "--only", only, "--directions", "fwd"]
    assert suite_runner.main(args) == 0
    rows = json.loads((tmp_path / "r" / "conv.json").read_text())["rows"]
    assert rows and all(r["status"] == "ok" and "versus" in r for r in rows)
    versus = [r["versus"] for r in rows]
    timed = [v for v in versus if v["status"] == "ok"]
    assert timed and all(v["ours_ms"] > 0 and v["kernel_ms"] > 0 and "_ppacked_" in v["kernel"] for v in timed)
    assert {v["status"] for v in versus} == {"ok", "no kernel"}  # 1D C = 1 and depthwise need the direct kernels
    assert suite_runner.main(["compare", str(tmp_path / "r"), "--out", str(tmp_path / "cmp")]) == 0
    result = json.loads((tmp_path / "cmp.json").read_text())
    assert result["before"].endswith("(--versus)") and result["groups"]["all"]["points"] == len(timed)
    assert result["groups"]["all"]["picks_changed"] == sum(v["kernel"] != r["kernel"] for v, r in zip(versus, rows)
                                                           if v["status"] == "ok")


def test_runner_versus_models_ranks_the_before_with_other_models(smoke_bundle, tmp_path):
    """--versus-models DIR: our bundle again as the before, ranked by DIR's model (here one split preferring the
    kernels of the larger k tile, the packed ones of the smoke set), where no cpu model ships and the analytic cost
    decides ours."""
    import tiledispatch as td
    from tiledispatch import learned

    fwd = [k.key for k in td.load(smoke_bundle).kernels if k.key.signature.direction == "fwd"]
    model = {"schema": learned.MODEL_SCHEMA, "features": list(learned.CONV_FEATURES),
             "applies_to": {"backend": "cpu", "arch": fwd[0].arch, "op": "conv", "direction": "fwd",
                            "dtypes": sorted({k.signature.dtype_a for k in fwd}),
                            "layouts": sorted({k.signature.layout for k in fwd})},
             "target": "ratio: higher is better", "higher_is_better": True, "trained": {"date": "test"},
             "trees": {"feature": [learned.CONV_FEATURES.index("tile_k"), 0, 0],
                       "threshold": [160.0, float("inf"), float("inf")], "left": [1, 1, 2], "right": [2, 1, 2],
                       "value": [0.0, 0.0, 1.0], "roots": [0], "depth": 1}}
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / f"cpu_{fwd[0].arch}_conv_fwd.json").write_text(json.dumps(model))
    only = "^(" + "|".join(map(re.escape, smallest_layers())) + ")$"
    args = ["conv", str(smoke_bundle), "--versus-models", str(tmp_path / "models"), "--out", str(tmp_path / "r"),
            "--device", "cpu", "--batch", "1", "--only", only, "--directions", "fwd"]
    assert suite_runner.main(args) == 0
    result = json.loads((tmp_path / "r" / "conv.json").read_text())
    rows = result["rows"]
    assert rows and all(r["status"] == "ok" and r["versus"]["status"] == "ok" for r in rows)
    assert result["versus_models"] == str(tmp_path / "models")
    changed = [r for r in rows if r["versus"]["kernel"] != r["kernel"]]
    assert changed and all("_ppacked_" in r["versus"]["kernel"] and "_pdirect_" in r["kernel"] for r in changed)


def test_runner_autotune_tunes_each_point_on_its_first_call(smoke_bundle, tmp_path, monkeypatch):
    """--autotune: ours tunes each point on its first public call (a record per point, kept in memory), and the
    tuned call's output is checked like any other."""
    from tiledispatch import tuning

    recorded = []
    put = tuning.TuningCache.put
    monkeypatch.setattr(tuning.TuningCache, "put", lambda self, *a: (recorded.append(a[1]), put(self, *a)))
    only = "^(" + "|".join(map(re.escape, smallest_layers())) + ")$"
    args = ["conv", str(smoke_bundle), "--autotune", "--out", str(tmp_path / "r"), "--device", "cpu", "--batch", "1",
            "--only", only, "--directions", "fwd"]
    assert suite_runner.main(args) == 0
    result = json.loads((tmp_path / "r" / "conv.json").read_text())
    assert result["autotune"] is True
    rows = result["rows"]
    assert rows and all(r["status"] == "ok" for r in rows)
    assert len(set(recorded)) == len(rows)  # one problem tuned per point


# -- the LayerNorm suite (bench/suites/layernorm_suite.py) ---------------------------------------------------------
layernorm_suite = _module("suites_layernorm", REPO / "bench" / "suites" / "layernorm_suite.py")
LAYERNORM = json.loads((REPO / "bench" / "suites" / "layernorm.json").read_text())


def test_layernorm_record_model_sees_module_and_functional_layer_norms():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)

        def forward(self, x):
            return torch.nn.functional.layer_norm(self.norm(x).permute(0, 2, 1), (5,))

    assert layernorm_suite.record_model(Net(), torch.randn(3, 5, 8)) == [(15, 8), (24, 5)]


def test_layernorm_suite_is_what_the_generator_makes_of_its_records():
    records: dict = {}
    for s in LAYERNORM["shapes"]:
        for model, count in s["uses"].items():
            records.setdefault(model, []).extend([(s["rows"], s["cols"])] * count)
    header = {k: v for k, v in LAYERNORM.items() if k != "shapes"}
    assert layernorm_suite.build_suite(records, header) == LAYERNORM
    assert generate.dump(LAYERNORM) == (REPO / "bench" / "suites" / "layernorm.json").read_text()
    # what the models are known to run: ConvNeXt-T's 23 layer norms at batch 32 (its stem's and first stage's
    # 100,352 rows of 96 channels: 1 + 3 blocks + the first downsample's), GPT-2's 25 per token count
    uses = {(s["rows"], s["cols"]): s["uses"] for s in LAYERNORM["shapes"]}
    assert uses[(100352, 96)]["convnext_tiny"] == 5
    assert sum(u.get("convnext_tiny", 0) for u in uses.values()) == 23
    assert all(uses[(t, 768)]["gpt2"] == 25 for t in LAYERNORM["tokens"])
    assert {"convnext_tiny", "swin_t", "vit_b_16", "maxvit_t"} <= set(LAYERNORM["models"])


# -- the max pooling suite (bench/suites/pool_suite.py) ------------------------------------------------------------
pool_suite = _module("suites_pool", REPO / "bench" / "suites" / "pool_suite.py")
MAXPOOL = json.loads((REPO / "bench" / "suites" / "maxpool.json").read_text())


def test_pool_record_model_sees_every_max_pool_with_torchs_defaults():
    net = nn.Sequential(nn.MaxPool2d(3, 2, 1), nn.MaxPool2d(2, ceil_mode=True), nn.Flatten(2), nn.MaxPool1d(2))
    calls = pool_suite.record_model(net, torch.randn(2, 3, 9, 9))
    assert [(c["in_size"], c["window"], c["stride"], c["padding"], c["ceil_mode"]) for c in calls] == [
        ([9, 9], [3, 3], [2, 2], [1, 1], False), ([5, 5], [2, 2], [2, 2], [0, 0], True), ([9], [2], [2], [0], False)]


def test_pool_suite_is_what_the_generator_makes_of_its_records():
    records: dict = {}
    for s in MAXPOOL["shapes"]:
        for model, count in s["uses"].items():
            records.setdefault(model, []).extend([{f: s[f] for f in pool_suite.FIELDS}] * count)
    header = {k: v for k, v in MAXPOOL.items() if k != "shapes"}
    assert pool_suite.build_suite(records, header) == MAXPOOL
    assert generate.dump(MAXPOOL) == (REPO / "bench" / "suites" / "maxpool.json").read_text()
    stem = next(s for s in MAXPOOL["shapes"] if s["id"] == "pool2d_n32_c64_112x112_w3x3_s2x2_p1x1_d1x1")
    assert stem["uses"]["resnet50"] == 1 and {"resnet18", "resnext50_32x4d", "wide_resnet50_2"} <= set(stem["uses"])
