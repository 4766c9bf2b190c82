"""Hardening of the tuning record (concurrent writers, wrong structures, non-regular files, unwritable
paths) and of the command line (exit codes, JSON on every path, broken pipes, bounded inputs, conv)."""
from __future__ import annotations

import json
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

import tiledispatch as td
from tiledispatch import reference, selection, tuning, validation
from tiledispatch.ops import conv
from tiledispatch.ops.gemm import GemmProblem

from conftest import build_cpu_bundle

# one small cpu GEMM kernel and one conv kernel per direction: builds in seconds
CLI_SET = """\
schema: 1
name: cli_test
description: one cpu GEMM and one cpu conv kernel per direction, for the CLI and tuning tests
groups:
  - backend: cpu
    op: gemm
    dtype: fp16
    layout: rcr
    pipeline: packed
    configs:
      - {tile: [16, 32, 32], mma: [4, 16, 1]}
      - {tile: [32, 64, 64], mma: [4, 16, 1]}
  - backend: cpu
    op: conv
    direction: [fwd, bwd_data, bwd_weight]
    spatial_dims: 2
    dtype: fp16
    layout: nhwgc
    pipeline: packed
    tile: [16, 16, 24]
    mma: [4, 16, 1]
"""


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    build = tmp_path_factory.mktemp("cli_build")
    build_cpu_bundle(build, "cli_test", CLI_SET)
    return build / "cli_test"


# -- the tuning record ------------------------------------------------------------------------------
def _writer(path: str, proc: int, start) -> None:
    start.wait()
    cache = tuning.TuningCache(Path(path))
    for j in range(40):
        cache.put("cpu:test:1 cpus", f"problem {proc}-{j}", {"kernel": f"k{j}", "times_ms": {f"k{j}": 1.0}})


def test_concurrent_writers_keep_every_record(tmp_path):
    path = tmp_path / "tuning.json"
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(str(path), i, start)) for i in range(3)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    records = json.loads(path.read_text())["devices"]["cpu:test:1 cpus"]
    assert sorted(records) == sorted(f"problem {i}-{j}" for i in range(3) for j in range(40))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tuning.json", "tuning.json.lock"]  # no stray temp files


def test_a_writer_sees_the_records_of_the_others(tmp_path):
    path = tmp_path / "tuning.json"
    first, second = tuning.TuningCache(path), tuning.TuningCache(path)
    assert first.get("dev", "a") is None and second.get("dev", "b") is None  # both read the (missing) file
    first.put("dev", "a", {"kernel": "ka"})
    second.put("dev", "b", {"kernel": "kb"})
    assert second.get("dev", "a") == {"kernel": "ka"}
    assert set(json.loads(path.read_text())["devices"]["dev"]) == {"a", "b"}


def _gemm_inputs(m, n, k, seed=3):
    p = GemmProblem(m, n, k, "fp16", "fp16", "fp16", "rcr")
    t = validation.gemm_inputs(p, np.random.default_rng(seed))
    return p, t["a"][0], t["b"][0]


OTHER = "cuda:Some Other GPU:1 SMs"
GOOD = {"kernel": "gemm_other", "times_ms": {"gemm_other": 1.0}}

# (name, file contents given (device, key), whether OTHER's good record survives)
STRUCTURES = [
    ("a list", lambda dev, key: [dev, key], False),
    ("devices not a dict", lambda dev, key: {"schema": 1, "devices": [dev]}, False),
    ("records not a dict", lambda dev, key: {"schema": 1, "devices": {dev: [key], OTHER: {key: GOOD}}}, True),
    ("record a string", lambda dev, key: {"schema": 1, "devices": {dev: {key: "gemm_x"}, OTHER: {key: GOOD}}}, True),
    ("kernel not a string", lambda dev, key: {"schema": 1, "devices": {dev: {key: {"kernel": 5}}, OTHER: {key: GOOD}}},
     True),
    ("record without kernel", lambda dev, key: {"schema": 1, "devices": {dev: {key: {}}, OTHER: {key: GOOD}}}, True),
]


@pytest.mark.parametrize("name,contents,keeps_other", STRUCTURES, ids=[s[0] for s in STRUCTURES])
def test_wrong_structure_is_reported_once_and_ignored(bundle, tmp_path, name, contents, keeps_other):
    path = tmp_path / "tuning.json"
    p, a, b = _gemm_inputs(40, 48, 32)
    plain = td.load(bundle, tuning_cache=tuning.TuningCache(None))
    key = tuning.problem_key(p, [k.name for k in plain.candidates(p)])
    path.write_text(json.dumps(contents(tuning.device_identity("cpu"), key)))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reg = td.load(bundle, tuning_cache=tuning.TuningCache(path))
        out = reg.gemm(a, b)  # a plain call consults the record
        assert validation.compare(out, reference.gemm(a, b), reg.kernels[0].key)["passed"]
        tuned = td.load(bundle, autotune=True, tuning_cache=reg.tuning)  # the same record, now written to
        tuned.gemm(a, b)
        p2, a2, b2 = _gemm_inputs(24, 40, 16)
        tuned.gemm(a2, b2)
    messages = [str(w.message) for w in caught if "tuning" in str(w.message)]
    assert len(messages) == 1, messages
    assert str(path) in messages[0]
    devices = json.loads(path.read_text())["devices"]  # rewritten with the good parts only
    assert len(devices[tuning.device_identity("cpu")]) == 2
    assert (OTHER in devices) == keeps_other
    assert all(isinstance(r, dict) and isinstance(r.get("kernel"), str)
               for records in devices.values() for r in records.values())


@pytest.mark.parametrize("text", [b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe{}", b"{not json"],
                         ids=["deep nesting", "not UTF-8", "not JSON"])
def test_unparsable_file_is_reported_once_and_ignored(tmp_path, text):
    path = tmp_path / "tuning.json"
    path.write_bytes(text)
    cache = tuning.TuningCache(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.get("dev", "p") is None
        cache.put("dev", "p", {"kernel": "k"})
    assert len(caught) == 1 and "unreadable tuning cache" in str(caught[0].message)
    assert json.loads(path.read_text())["devices"] == {"dev": {"p": {"kernel": "k"}}}


def test_good_records_beside_bad_ones_still_select(bundle, tmp_path):
    path = tmp_path / "tuning.json"
    p, _, _ = _gemm_inputs(40, 48, 32)
    plain = td.load(bundle, tuning_cache=tuning.TuningCache(None))
    fits = plain.candidates(p)
    assert len(fits) >= 2
    last = selection.learned(p, fits)[-1].name
    dev = tuning.device_identity("cpu")
    path.write_text(json.dumps({"schema": 1, "devices": {
        dev: {tuning.problem_key(p, [k.name for k in fits]): {"kernel": last}, "other problem": 7},
        OTHER: "not records"}}))
    with pytest.warns(UserWarning, match="ignoring"):
        assert td.load(bundle, tuning_cache=tuning.TuningCache(path)).select(p).name == last


def test_unwritable_path_is_reported_once_and_kept_in_memory(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cache = tuning.TuningCache(blocker / "tuning.json")  # its parent is a file: nothing can be written there
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for j in range(3):
            cache.put("dev", f"p{j}", {"kernel": f"k{j}"})
    assert len(caught) == 1 and "kept in memory" in str(caught[0].message)
    assert [cache.get("dev", f"p{j}") for j in range(3)] == [{"kernel": f"k{j}"} for j in range(3)]


NON_REGULAR = textwrap.dedent("""\
    import json, os, stat, sys, warnings
    from pathlib import Path
    import numpy as np
    import tiledispatch as td
    from tiledispatch import reference, tuning, validation
    from tiledispatch.ops.gemm import GemmProblem

    bundle, path, kind = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    errors = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reg = td.load(bundle, autotune=True, tuning_cache=tuning.TuningCache(path))
        for m, n, k in ((40, 48, 32), (24, 40, 16)):
            p = GemmProblem(m, n, k, "fp16", "fp16", "fp16", "rcr")
            t = validation.gemm_inputs(p, np.random.default_rng(1))
            a, b = t["a"][0], t["b"][0]
            errors.append(validation.compare(reg.gemm(a, b), reference.gemm(a, b), reg.kernels[0].key)["rel_error"])
    mode = os.stat(path).st_mode
    print(json.dumps({"warnings": [str(w.message) for w in caught], "errors": errors,
                      "unchanged": stat.S_ISFIFO(mode) if kind == "fifo" else stat.S_ISDIR(mode),
                      "in_memory": len(reg.tuning.records()[tuning.device_identity("cpu")])}))
""")


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_non_regular_file_is_reported_once_and_never_blocks(bundle, tmp_path, kind):
    script = tmp_path / "probe.py"
    script.write_text(NON_REGULAR)
    proc = subprocess.run([sys.executable, str(script), str(bundle), str(tmp_path / "tuning.json"), kind],
                          capture_output=True, text=True, timeout=60)  # a regression hangs: the timeout fails it
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert len(result["warnings"]) == 1 and "not a regular file" in result["warnings"][0], result["warnings"]
    assert all(e < 2e-3 for e in result["errors"])
    assert result["unchanged"] and result["in_memory"] == 2  # left in place; records kept in memory


# -- the command line -------------------------------------------------------------------------------
def cli(*args, limit_bytes: int = 0, stdout=subprocess.PIPE):
    """(exit code, parsed JSON or None, stderr); limit_bytes caps the address space (an allocation beyond
    it fails at once instead of swapping the machine)."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    proc = subprocess.run([sys.executable, "-m", "tiledispatch", *map(str, args)], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=300, preexec_fn=cap if limit_bytes else None,
                          env={**os.environ, "TD_TUNING_CACHE": "none"})
    out = None
    if stdout == subprocess.PIPE:
        def no_constants(name):
            raise AssertionError(f"non-standard JSON constant {name}")
        out = json.loads(proc.stdout, parse_constant=no_constants)
    return proc.returncode, out, proc.stderr


def assert_error(result, error: str = "", match: str = ""):
    code, out, err = result
    assert code == 2 and out["status"] == "error", out
    assert set(out) >= {"status", "error", "message"} and out["message"]
    assert "Traceback" not in err, err
    if error:
        assert out["error"] == error, out
    if match:
        assert match in out["message"], out["message"]
    return out


GEMM = ("gemm", "--layout", "rcr")


def test_usage_errors_are_json_with_exit_2(bundle):
    assert_error(cli("run", bundle, *GEMM, "--m", 4, "--n", 4), "UsageError", "--k")
    assert_error(cli("run", bundle, "matmul", "--m", 4), "UsageError")
    assert_error(cli("bench", bundle, *GEMM, "--m", 4, "--n", 4, "--k", 4, "--repeat", 0), "UsageError")
    assert_error(cli("run", bundle, "conv", "--direction", "fwd", "--n", 1, "--c", 8, "--k", 8, "--in", 6, 6,
                     "--filter", 3, 3, "--m", 5), "UsageError", "--m")  # a GEMM option on a conv
    assert_error(cli("list", bundle / "nowhere"), "BundleError")


@pytest.mark.parametrize("manifest", ["[]", '{"backend": "cpu", "arch": "x86v3", "kernels": 5}',
                                      '{"backend": "cpu", "kernels": [{"file": 7}]}', '{"kernels": [[]]}'])
@pytest.mark.parametrize("command", ["list", "info"])
def test_malformed_manifest_is_a_json_error(bundle, tmp_path, manifest, command):
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    (copy / "manifest.json").write_text(manifest)
    out = assert_error(cli(command, copy))
    assert out["error"] not in ("", "Exception")


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), MemoryError(), KeyError("backend")],
                         ids=["OSError", "MemoryError", "KeyError"])
def test_any_escaping_exception_is_a_json_error(monkeypatch, capsys, exc):
    """Not only the project's errors: whatever escapes keeps its type and message, as JSON, exit 2."""
    from tiledispatch import cli as cli_module

    def load(path, **options):
        raise exc

    monkeypatch.setattr(cli_module.loader, "load", load)
    assert cli_module.main(["list", "somewhere"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out == {"status": "error", "error": type(exc).__name__, "message": str(exc) or repr(exc)}


def test_select_without_a_kernel_is_an_error_object(bundle):
    out = assert_error(cli("select", bundle, *GEMM, "--m", 8, "--n", 8, "--k", 8, "--dtype", "fp32"),
                       "UnsupportedProblemError", "no kernel can run")
    assert out["ranked"] == [] and out["selected"] is None and out["rejected"]


def test_non_finite_values_print_as_null(bundle):
    # fp16 overflows to inf: the output is not finite, its relative error infinite
    code, out, err = cli("run", bundle, *GEMM, "--m", 8, "--n", 8, "--k", 8, "--alpha", "1e30", "--validate")
    assert code == 1 and out["status"] == "failed" and out["validation"]["rel_error"] is None, (out, err)
    code, out, err = cli("run", bundle, *GEMM, "--m", 8, "--n", 8, "--k", 8, "--alpha", "nan", "--validate")
    assert code in (1, 2), (out, err)  # standard JSON either way (cli() refuses NaN / Infinity)


def test_a_closed_stdout_ends_quietly(bundle, tmp_path):
    read, write = os.pipe()
    os.close(read)  # nobody will ever read: the first write fails with EPIPE, as when `head` has exited
    try:
        for args in (("list", bundle), ("run", bundle, *GEMM, "--m", 8, "--n", 8, "--k", 8, "--validate"), ("-h",)):
            code, _, err = cli(*args, stdout=write)
            assert code == 141 and err == "", (args, code, err)
    finally:
        os.close(write)


LIMIT = 3 << 30  # address space of the child: enough for Python, numpy and the kernels, far below the problems


def test_inputs_beyond_available_memory_are_refused_before_allocating(bundle):
    out = assert_error(cli("run", bundle, *GEMM, "--m", 2_000_000_000, "--n", 1000, "--k", 1000, "--batch", 100000,
                           limit_bytes=LIMIT), "InvalidInputError", "available")
    assert "TB" in out["message"] or "PB" in out["message"]
    assert_error(cli("run", bundle, *GEMM, "--m", 1_000_000_000, "--n", 8, "--k", 8, "--max-bytes", 1 << 30,
                     limit_bytes=LIMIT), "InvalidInputError", "--max-bytes")
    assert_error(cli("bench", bundle, "conv", "--direction", "fwd", "--n", 100000, "--c", 16, "--k", 16,
                     "--in", 1000, 1000, "--filter", 3, 3, limit_bytes=LIMIT), "InvalidInputError", "available")


def test_the_kernel_is_chosen_before_allocating(bundle):
    # no kernel runs fp32: the refusal comes before a single input is allocated
    assert_error(cli("run", bundle, *GEMM, "--m", 400_000_000, "--n", 8, "--k", 8, "--dtype", "fp32",
                     limit_bytes=LIMIT), "UnsupportedProblemError")
    # --kernel: that kernel's own td_can_run is asked first (here it refuses M >= 2^31)
    name = next(k.name for k in td.load(bundle).kernels if k.name.startswith("gemm"))
    assert_error(cli("run", bundle, *GEMM, "--m", 3_000_000_000, "--n", 1, "--k", 1, "--kernel", name,
                     limit_bytes=LIMIT), "UnsupportedProblemError", "2^31")
    conv_name = next(k.name for k in td.load(bundle).kernels if k.name.startswith("conv"))
    assert_error(cli("run", bundle, *GEMM, "--m", 8, "--n", 8, "--k", 8, "--kernel", conv_name),
                 "UnsupportedProblemError", "conv")


CONV = ("conv", "--n", 2, "--c", 16, "--k", 32, "--groups", 2, "--in", 9, 8, "--filter", 3, 3, "--dtype", "fp16")


@pytest.mark.parametrize("direction", ["fwd", pytest.param("bwd_data", marks=pytest.mark.slow),
                                       pytest.param("bwd_weight", marks=pytest.mark.slow)])
def test_conv_run_select_bench(bundle, direction):
    code, out, err = cli("run", bundle, *CONV, "--direction", direction, "--stride", 2, 1, "--pad-lo", 1, 0,
                         "--pad-hi", 0, 2, "--dilation", 1, 2, "--alpha", 0.5, "--validate")
    assert code == 0 and out["status"] == "success" and out["validation"]["passed"], (out, err)
    assert out["kernel"].startswith(f"conv2d{ {'fwd': 'fwd', 'bwd_data': 'bwdd', 'bwd_weight': 'bwdw'}[direction]}_")
    assert out["problem"]["stride"] == [2, 1] and out["problem"]["pad_hi"] == [0, 2] and out["problem"]["g"] == 2
    code, out, _ = cli("select", bundle, *CONV, "--direction", direction, "--padding", 1)
    assert code == 0 and out["selected"] == out["ranked"][0]["kernel"] and out["problem"]["pad_lo"] == [1, 1]
    assert all(not name.startswith("gemm") for name in [r["kernel"] for r in out["ranked"]])
    code, out, _ = cli("bench", bundle, *CONV, "--direction", direction, "--repeat", 2, "--warmup", 0)
    assert code == 0 and len(out["results"]) == 1 and out["results"][0]["selected"]


def test_conv_argument_errors(bundle):
    assert_error(cli("run", bundle, *CONV, "--direction", "fwd", "--padding", 1, "--pad-lo", 1), "InvalidInputError",
                 "--padding")
    assert_error(cli("run", bundle, *CONV, "--direction", "fwd", "--stride", 1, 1, 1), "InvalidInputError", "stride")
    assert_error(cli("run", bundle, *CONV, "--direction", "fwd", "--groups", 3), "InvalidInputError", "groups")
    assert_error(cli("run", bundle, "conv", "--direction", "fwd", "--n", 1, "--c", 8, "--k", 8, "--in", 6, 6, 6,
                     "--filter", 3, 3, 3), "UnsupportedProblemError", "3D")  # the bundle has 2D kernels only


@pytest.mark.parametrize("direction", conv.CONV_DIRECTIONS)
def test_conv_inputs_cannot_overflow_fp16(direction):
    """The worst case (every product of the sum at its largest, one sign) stays far below fp16's largest
    value for sums of over 10^4 terms (unscaled inputs in [-1, 1] would allow 1.3 to 1.8 x 10^4); no input is zero."""
    p = conv.ConvProblem(direction, 32, 1, 512, 512, (24, 24), (5, 5), 1, 1, 2, 2, "fp16", "fp16", "fp16")
    data = validation.conv_inputs(p, np.random.default_rng(0))
    read = [r for r in ("x", "w", "y") if r != conv.WRITES[direction]]
    terms = validation.conv_terms(p)
    assert terms == {"fwd": 512 * 25, "bwd_data": 512 * 25, "bwd_weight": 32 * 24 * 24}[direction]
    worst = terms * np.prod([np.abs(data[r].astype(np.float64)).max() for r in read])
    assert worst <= 65504 / 16
    assert all((data[r] != 0).all() for r in read)
    assert np.isnan(data[conv.WRITES[direction]]).all()  # the written one poisoned
    small = conv.ConvProblem(direction, 2, 1, 8, 8, (6, 6), (3, 3), 1, 1, 1, 1, "fp16", "fp16", "fp16")
    assert max(np.abs(v).max() for r, v in validation.conv_inputs(small, np.random.default_rng(0)).items()
               if r != conv.WRITES[direction]) > 0.9  # small sums are not scaled
