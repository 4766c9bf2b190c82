"""The native module (runtime/tiledispatch/native): what its fingerprint reader reads and refuses, when its eager
checks refuse a call, what its launch records refuse, how it is built, cached and turned off, and that a build that
fails leaves the Python paths in place."""
import json
import warnings

import numpy as np
import pytest

from tiledispatch import cli, native, plan

torch = pytest.importorskip("torch")


@pytest.fixture
def prints():
    found = plan._native_prints()
    assert found is not None, "the native reader was not built: see the warning and its .failed file"
    return found


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """native with an empty cache of its own and nothing loaded yet."""
    monkeypatch.setenv("TD_NATIVE_CACHE", str(tmp_path / "native"))
    monkeypatch.setattr(native, "_LOADED", {})
    return tmp_path / "native"


def test_reads_pointers_and_tells_apart_every_property_the_checks_read(prints):
    a = torch.randn(6, 5, dtype=torch.float64)
    ptrs, base = prints(a, None, a[1:])
    assert ptrs == (a.data_ptr(), None, a[1:].data_ptr())
    assert prints(a.clone(), None, a[1:])[1] == base  # equal metadata, other memory: the same fingerprint
    changed = {"shape": a[:4], "stride": a.T.contiguous().T, "dtype": a.float(), "negative bit": torch._neg_view(a),
               "requires grad": a.clone().requires_grad_(True),
               "alignment": torch.randn(31, dtype=torch.float64)[1:].view(6, 5), "rank": a.view(30)}
    for what, other in changed.items():
        assert prints(other, None, a[1:])[1] != base, what
    z = torch.randn(3, dtype=torch.complex64)
    assert prints(z.conj())[1] != prints(z)[1]
    assert prints(None, a, a[1:])[1] != base  # where the None stands counts
    meta = torch.empty(6, 5, dtype=torch.float64, device="meta")
    assert prints(meta)[1] != prints(a)[1] and prints(meta)[0] == (0,)


def test_refuses_what_the_python_path_must_read(prints):
    class Marked(torch.Tensor):
        pass

    dense = torch.randn(4, 4)
    refused = {"a subclass": dense.as_subclass(Marked), "a sparse tensor": dense.to_sparse(),
               "an array": np.zeros((4, 4)), "a number": 3, "too many dimensions": torch.zeros([1] * 13)}
    for what, other in refused.items():
        assert prints(dense, other) is None, what
    assert prints(*[dense] * 9) is None  # more arguments than it takes
    # a Parameter is a tensor to the checks
    assert prints(torch.nn.Parameter(dense, requires_grad=False))[1] == prints(dense)[1]


def test_prints3_of_a_subclass_or_mixed_types_takes_the_python_readers(prints):
    class Marked(torch.Tensor):  # as torch's own subclasses (e.g. FakeTensor) are: a module under torch
        __module__ = "torch.testing.marked"

    plan._printer_for(Marked)
    assert plan._TRIPLE_PRINTERS[Marked] is plan._torch_prints3
    plain = torch.randn(3, 3)
    assert type(plan.prints3(plain, plain, plain)[1]) is bytes
    assert type(plan.prints3(plain, plain, torch.nn.Parameter(plain))[1]) is tuple


def run_cli(capsys, *argv) -> tuple[int, dict, str]:
    """(exit status, the JSON printed, what went to stderr)."""
    code = cli.main(list(argv))
    printed = capsys.readouterr()
    return code, json.loads(printed.out), printed.err


def test_built_once_into_its_cache_and_loaded_from_there(fresh, capsys):
    """`python -m tiledispatch native` builds it (as the first torch call would); later processes load the file."""
    code, out, err = run_cli(capsys, "native")
    assert code == 0 and out["native"] == "built" and out["path"] == str(native.built_path())
    assert out["forest"] == str(native.forest_path())
    assert "compiling the native torch fast path" in err and "compiling the native tree evaluator" in err
    assert native.built_path().exists() and native.torch_fastpath() is not None
    # no temporary file left
    assert sorted(p.name for p in fresh.iterdir()) == sorted([native.built_path().name, native.forest_path().name])
    native._LOADED.clear()  # a new process: loads the file without compiling
    assert native.torch_fastpath() is not None
    assert "compiling" not in capsys.readouterr().err
    assert run_cli(capsys, "native") == (0, {**out, "native": "loaded"}, "")


def test_a_failed_build_warns_once_keeps_its_reason_and_falls_back(fresh, monkeypatch, capsys):
    monkeypatch.setenv("CXX", "false")
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert native.torch_fastpath() is None
    failed = native.built_path().with_name(native.built_path().name + ".failed")
    assert "exit status 1" in failed.read_text()
    native._LOADED.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.torch_fastpath() is None  # the reason's file stops another attempt, without a new warning
    capsys.readouterr()
    code, out, err = run_cli(capsys, "native")  # an explicit request tries again, and says why it failed
    assert code == cli.EXIT_ERROR and out["error"] == "RuntimeError" and "exit status 1" in out["message"]
    assert "compiling" in err and failed.exists()  # it compiled again, and kept the new reason


def test_a_tree_evaluator_that_cannot_be_built_leaves_numpy_ranking(fresh, monkeypatch):
    """Without a C compiler the learned ranker's trees are evaluated by numpy: warned once, the same predictions."""
    from test_selection_models import random_trees

    from tiledispatch import learned

    trees = random_trees(np.random.default_rng(1), 20, 16, 4)
    x = np.random.default_rng(2).integers(-4, 5, size=(50, 4)).astype(np.float64)
    compiled = learned.TreeEnsemble(trees)
    assert compiled._compiled is not None
    monkeypatch.setattr(native, "_LOADED", {})
    monkeypatch.setenv("CC", "false")  # another compiler: another file, which fails
    with pytest.warns(RuntimeWarning, match="tree evaluator could not be built, so the learned ranker uses numpy"):
        plain = learned.TreeEnsemble(trees)
        assert plain._compiled is None
    np.testing.assert_allclose(plain.predict(x), compiled.predict(x), rtol=1e-12, atol=1e-12)
    assert native.forest_path().with_name(native.forest_path().name + ".failed").exists()


def test_turned_off_by_td_native_0(fresh, monkeypatch, capsys):
    monkeypatch.setenv("TD_NATIVE", "0")
    assert native.torch_fastpath() is None and native.forest() is None
    assert run_cli(capsys, "native") == (0, {"native": "off", "why": "TD_NATIVE turns it off"}, "")
    assert not fresh.exists()


def test_eager_prints_refuses_calls_a_mode_tracer_profiler_or_autocast_may_intercept(prints):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.overrides import TorchFunctionMode

    module = native.torch_fastpath()
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    assert module.eager_prints(a, b, None) == prints(a, b, None)

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class PassingFunction(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    for context in (Passing(), PassingFunction(), torch.autocast("cpu"), torch.autograd.profiler.profile()):
        with context:
            assert module.eager_prints(a, b, None) is None, type(context).__name__
    assert module.eager_prints(a, b, None) == prints(a, b, None)  # nothing left switched on
    traced = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace's own: the tracer is what is tested
        torch.jit.trace(lambda t: traced.append(module.eager_prints(t, b)) or t * 2, (a,), check_trace=False)
    assert traced == [None]
    assert module.eager_prints() is None and module.eager_prints(np.zeros(2), b) is None


def test_launch_records_refuse_malformed_layouts_and_arguments():
    module = native.torch_fastpath()
    buffers = [torch.zeros(64, dtype=torch.uint8) for _ in range(2)]
    run, args = buffers[0].data_ptr(), buffers[1].data_ptr()  # addresses only: nothing is launched here
    good = (run, args, args, 8, (0, -2), 1, (0, 16), ((0, 0, 16),), -1, 0)
    module.launcher(*good)
    for bad, error in [(good[:9], TypeError), (good[:4] + ((0,) * 200,) + good[5:], ValueError),
                       (good[:5] + (7,) + good[6:], ValueError), (good[:7] + (((9, 0, 16),),) + good[8:], ValueError),
                       (good[:6] + ((0,),) + good[7:], ValueError), ((0,) + good[1:], ValueError)]:
        with pytest.raises(error):
            module.launcher(*bad)
    like = torch.zeros(4)
    prototype = torch.empty(4, device="meta")
    with pytest.raises(TypeError):
        module.launch(object(), prototype, like, (0,), None)  # not a record
    with pytest.raises(TypeError):
        module.launch(module.launcher(*good), prototype, like, [0], None)  # pointers not a tuple
    # more tensors than the fingerprints take: not launched (None), the caller's Python path runs the call
    assert module.launch(module.launcher(*good), prototype, like, (0,) * 9, None) is None
