"""A backend is two checked interfaces: its Toolchain (the generator's: identity, compile and check commands,
detection) and its Driver (the runtime's: device kind, arch detection, streams, workspaces, identity), plus its
kernel families. Each is checked when the backend registers or its toolchain is first loaded, and what is missing
is named in one line."""
from __future__ import annotations

import types

import pytest

from conftest import copy_repo, scons
from tiledispatch import backends, drivers, tuning
from tiledispatch.generator import toolchains
from tiledispatch.registry import Registry


def test_every_backend_meets_both_interfaces():
    for name, backend in backends.all_backends().items():
        assert all(callable(getattr(backend.driver, m)) for m in drivers.DRIVER_API), name
        assert backend.driver.device == backend.device
        assert toolchains.missing(toolchains.get(name), toolchains.TOOLCHAIN_API) == [], name
        assert backend.families, name


def _register(name, path, driver):
    return backends.register(name, path, device=driver.device, auto_priority=0, archs={"a": {}}, pipeline=["p"],
                             scheduler=["s"], extras={}, tolerance={}, selection={}, driver=driver)


def test_a_driver_without_the_interface_is_refused_in_one_line(tmp_path):
    class HalfDriver:  # no Driver base: nothing inherited
        device = "cpu"

        def present(self):
            return True, ""

    with pytest.raises(backends.RegistrationError) as e:
        _register("halfway", [str(tmp_path)], HalfDriver())
    message = str(e.value)
    assert "\n" not in message and "HalfDriver" in message
    for method in ("detect_arch", "runnable", "identity", "stream", "allocate"):
        assert method in message


def test_a_family_without_its_functions_is_refused_in_one_line(tmp_path, monkeypatch):
    from tiledispatch import families

    folder = tmp_path / "fakebackend"
    (folder / "broken").mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / "broken" / "__init__.py").write_text("def claims(key):\n    return True\n")
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    with pytest.raises(backends.RegistrationError) as e:
        _register("fakebackend", [str(folder)], drivers.CpuDriver())
    message = str(e.value)
    assert "\n" not in message and "fakebackend/broken" in message
    assert "templates" in message and "context" in message and "claims" not in message.split("defines no")[1]


def test_a_toolchain_without_the_interface_is_refused_in_one_line(monkeypatch):
    stub = types.ModuleType("tiledispatch.families.cpu.toolchain")
    stub.__file__ = "stub.py"
    stub.SOURCE_SUFFIX = ".cpp"
    stub.toolchain = lambda: None
    monkeypatch.setattr(toolchains.importlib, "import_module", lambda name: stub)
    with pytest.raises(toolchains.ToolchainError) as e:
        toolchains.get.__wrapped__("cpu")
    message = str(e.value)
    assert "\n" not in message
    for name in ("JOB_MEMORY_BYTES", "compile_flags", "compile_command", "available"):
        assert name in message


def test_a_backend_without_a_check_mode_says_so():
    with pytest.raises(toolchains.ToolchainError, match="backend cpu has no compile-check mode") as e:
        toolchains.check("cpu")
    assert "\n" not in str(e.value) and "ck_tile" in str(e.value)  # names the backends that have one
    assert toolchains.check("ck_tile") is toolchains.get("ck_tile")


def test_scons_check_on_cpu_ends_in_one_line(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    proc = scons(repo, "kernels=fp16_rcr_essential", "backend=cpu", "check=1", f"build_dir={tmp_path / 'b'}",
                 check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and "AttributeError" not in proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert "backend cpu has no compile-check mode" in last and "check=1" in last


def test_one_workspace_per_device_and_stream():
    torch = pytest.importorskip("torch")
    reg = Registry([], "cutlass", "sm90a")      # no kernels needed: the workspace is the registry's
    like = torch.empty(4)
    a1, b1 = reg.workspace(1000, like, stream=11), reg.workspace(1000, like, stream=22)
    assert a1 != b1                              # kernels on two streams at once never share scratch memory
    assert reg.workspace(500, like, stream=11) == a1  # the same stream reuses its buffer
    a2 = reg.workspace(10_000, like, stream=11)  # and grows it (the old one stays alive for plans holding it)
    assert a2 != a1 and reg.workspace(1000, like, stream=22) == b1
    assert len(reg._workspaces[(str(like.device), 11)]) == 2


def test_tuning_records_use_the_drivers_identity():
    reg = Registry([], "cpu", "generic")
    assert reg._identity() == drivers.CpuDriver().identity() == tuning.device_identity("cpu")
    assert reg._identity().startswith("cpu:") and reg._identity().endswith(" cpus")
