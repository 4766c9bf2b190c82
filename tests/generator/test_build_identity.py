"""The build identity is derived, never listed (tiledispatch.generator.deps): every file that renders or compiles a
kernel is among its dependencies, and editing one rebuilds exactly the kernels that use it.

cpu for real: a small bundle is built, then each of its kernels' input files is edited in turn (a comment: the
source re-renders to the same text, or, for a header or the toolchain, the kernels recompile) and the test checks
which sources were re-rendered and which kernels recompiled against what the folder layout says must depend on the
file. cutlass and ck_tile by dependency listing (no nvcc): every file the rendering reads is listed, and nothing of
another kernel family or backend is."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from conftest import REPO, compiled_names, copy_repo, scons
from tiledispatch import backends
from tiledispatch.generator import codegen, deps, kernelset, rules
from tiledispatch.spec.key import parse_kernel_name

SET = """\
schema: 1
name: ident
groups:
  - backend: cpu
    op: gemm
    dtype: fp32
    layout: rcr
    pipeline: packed
    tile: [48, 128, 128]
    mma: [6, 32, 1]
  - backend: cpu
    op: conv
    direction: fwd
    spatial_dims: 2
    dtype: fp32
    layout: nhwgc
    pipeline: [packed, direct]
    tile: [48, 64, 64]
    mma: [6, 32, 1]
"""
ARCH = backends.get("cpu").detect_arch()


def family(name: str) -> str:
    return "gemm" if name.startswith("gemm") else ("conv_direct" if "_pdirect_" in name else "conv_packed")


def expected(rel: str, names: list[str]) -> set[str]:
    """The kernels of the bundle that must depend on a file, from where the file lies (the layout's promise)."""
    parts = rel.split("/")
    if parts[0] == "templates":
        if len(parts) > 2 and parts[1] != "cpu":
            return set()                                        # another backend's folder
        if len(parts) > 3:                                      # a family folder
            return {n for n in names if family(n) == parts[2]}
        if parts[-1] == "_conv_common.j2":                      # a partial of the conv families only
            return {n for n in names if n.startswith("conv")}
    if parts[-2] == "activations" and parts[-1].endswith(".h"):  # one activation: the kernels applying it
        return {n for n in names if parse_kernel_name(n).signature.epilogue.activation == parts[-1][:-2]}
    return set(names)                                           # backend-wide and generator files


def _stamps(build: Path) -> dict[str, tuple[int, int]]:
    return {p.name.split(".")[0]: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (build / "src").iterdir()}


def _build(repo: Path) -> tuple[set[str], set[str]]:
    """Build the bundle; (kernels whose source was re-rendered, kernels that were recompiled)."""
    build = repo / "build"
    before = _stamps(build) if (build / "src").is_dir() else {}
    proc = scons(repo, "kernels=ident", "backend=cpu", f"arch={ARCH}", f"build_dir={build}",
                 f"cache_dir={repo / 'cache'}", "bundle=b")
    after = _stamps(build)
    return {n for n, s in after.items() if before.get(n) != s}, compiled_names(proc)


def _edit(path: Path, rendered: bool = False) -> None:
    """A change of content that changes no rendered text and no compiled code: a comment in the file's language
    (Jinja's for a file the rendering reads, such as an activation's header)."""
    comment = {".py": "# edited\n", ".yaml": "# edited\n", ".j2": "{# edited #}\n", ".h": "// edited\n",
               ".cuh": "// edited\n"}[path.suffix]
    if rendered and path.suffix in (".h", ".cuh"):
        comment = "{# edited #}\n"
    path.write_text(path.read_text() + comment)


@pytest.fixture
def repo(tmp_path):
    root = copy_repo(tmp_path / "repo")
    (root / "kernel_specs" / "ident.yaml").write_text(SET)
    return root


def _keys(folder: Path):
    path = folder / "ident.yaml"
    if not path.is_file():
        path.write_text(SET)
    return [e.key for e in kernelset.load([str(path)], "cpu", ARCH)]


def _inputs(keys) -> tuple[dict, dict]:
    """{checkout-relative path: {kernel names}} of render and of compile inputs (this checkout's files)."""
    render, compile_ = {}, {}
    for key in keys:
        for table, files in ((render, deps.render_inputs(key)), (compile_, deps.compile_inputs(key))):
            for p in files:
                table.setdefault(str(p.relative_to(REPO)), set()).add(key.name)
    return render, compile_


def test_dependencies_follow_the_layout(tmp_path):
    """The derived lists say what the folder layout promises, for each file of the cpu kernels."""
    keys = _keys(tmp_path)
    names = [k.name for k in keys]
    render, compile_ = _inputs(keys)
    for rel, users in render.items():
        assert users == expected(rel, names), rel
    for rel, users in compile_.items():  # the plain C++ headers of the family and backend folders too
        assert users == expected(rel, names), rel
    assert compile_["templates/cpu/cpu_common.h"] == compile_["templates/cpu/cpu_includes.h"] == set(names)
    assert compile_["templates/cpu/conv_direct/conv_direct.h"] == {n for n in names if family(n) == "conv_direct"}
    assert compile_["runtime/tiledispatch/include/tiledispatch_abi.h"] == set(names)
    assert compile_["runtime/tiledispatch/include/tiledispatch_export.h"] == set(names)  # the ABI's export block
    assert compile_["templates/cpu/toolchain.py"] == set(names)
    for must in ("templates/cpu/gemm/__init__.py", "templates/cpu/conv_direct/conv_fwd_direct.cpp.j2",
                 "templates/cpu/_microkernel.j2", "templates/cpu/__init__.py", "templates/cpu/rules.yaml",
                 "runtime/tiledispatch/generator/codegen.py", "runtime/tiledispatch/spec/key.py"):
        assert must in render, must
    assert not any(r.startswith(("templates/cutlass", "templates/ck_tile")) for r in render)
    assert "runtime/tiledispatch/registry.py" not in render  # the runtime's launch path renders nothing


def _one_key_per_family(backend: str, arch: str) -> dict:
    found = {}
    for path in sorted((REPO / "preselected").glob("*.yaml")):
        try:
            entries = kernelset.expand_file(path, backend, arch)
        except Exception:  # noqa: BLE001 - a set for another backend
            continue
        for e in entries:
            found.setdefault(backends.family_of(e.key).name, e.key)
    return found


@pytest.mark.parametrize("backend, arch", [("cpu", "x86v4"), ("cutlass", "sm90a"), ("cutlass", "sm80"),
                                           ("ck_tile", "gfx942")])
def test_every_file_the_rendering_reads_is_listed(backend, arch):
    """Render one key of each family while recording every file opened: each is in its render inputs; no file of
    another family's folder or another backend's is."""
    keys = _one_key_per_family(backend, arch)
    assert keys, f"no preselected {backend}/{arch} kernels"
    opened: list[str] = []
    recording = [False]

    def hook(event, args):
        if recording[0] and event == "open" and isinstance(args[0], (str, os.PathLike)):
            opened.append(str(args[0]))

    sys.addaudithook(hook)
    b = backends.get(backend)
    for fam, key in keys.items():
        listed = set(deps.render_inputs(key))
        codegen.render(key)  # warm: rules and modules loaded once
        opened.clear()
        recording[0] = True
        try:
            codegen.render(key)
        finally:
            recording[0] = False
        read = {Path(p).resolve() for p in opened if Path(p).resolve().is_relative_to(REPO)}
        assert read and read <= listed, (key.name, sorted(map(str, read - listed)))
        others = [f.path for f in b.families if f.name != fam]
        others += [o.path for n, o in backends.all_backends().items() if n != backend]
        # (every rule of a backend, whichever family's fragment holds it, applies to every key its `when`
        # selects: the backend's rules files are inputs of all its kernels)
        assert not [p for p in listed if any(p.is_relative_to(o) for o in others) and p.name != "rules.yaml"], key.name
        assert set(rules.rules_files(backend)) <= listed
        assert backends.family_of(key).path / "__init__.py" in listed and b.path / "rules.yaml" in listed
        compiled = deps.compile_inputs(key)
        assert REPO / "runtime/tiledispatch/include/tiledispatch_abi.h" in compiled
        assert b.path / "toolchain.py" in compiled


def _included(key) -> set[Path]:
    """The headers of ours the key's rendered source includes, transitively: what the compiler opens of ours."""
    dirs = codegen.include_dirs(key)
    found, todo = set(), [codegen.render(key)]
    while todo:
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', todo.pop(), re.M):
            path = next((d / name for d in dirs if (d / name).is_file()), None)
            if path is not None and path.resolve() not in found:
                found.add(path.resolve())
                todo.append(path.read_text())
    return found


@pytest.mark.parametrize("backend, arch", [("cpu", "x86v4"), ("cutlass", "sm90a"), ("cutlass", "sm80"),
                                           ("ck_tile", "gfx942")])
def test_every_header_the_source_includes_is_a_compile_input(backend, arch):
    """Every header of ours a kernel's source includes (the ABI's, its backend's, its family's plain C++) is one of
    its compile inputs, so editing it recompiles the kernel; none of another family's or backend's is. (A header
    named under a Jinja condition counts for every kernel of its template: an edit may recompile a few kernels
    more than the ones that include it, never fewer.)"""
    b = backends.get(backend)
    seen, users = set(), {}
    for path in sorted((REPO / "preselected").glob("*.yaml")):
        if f"{backend}/{arch}" not in kernelset.targets(path):
            continue
        for e in kernelset.expand_file(path, backend, arch):
            fam = backends.family_of(e.key)
            variant = (fam.name, tuple(fam.templates(e.key)), e.key.signature.direction, e.key.algorithm.warps)
            if variant in seen:
                continue
            seen.add(variant)
            included, listed = _included(e.key), set(deps.compile_inputs(e.key))
            assert included and included <= listed, (e.key.name, sorted(map(str, included - listed)))
            own = (fam.path, b.path, REPO / "runtime/tiledispatch/include")
            assert all(any(p.is_relative_to(d) for d in own) for p in listed if p.suffix in (".h", ".cuh")), e.key.name
            for p in included:
                users.setdefault(p.name, set()).add((fam.name, e.key.signature.direction))
    assert {"tiledispatch_abi.h", "tiledispatch_export.h", "tiledispatch_kernel.h"} <= set(users)
    if arch == "sm90a":  # the sm90 kernels' plain CUDA headers, each included by the kernels that use it
        assert {f for f, _ in users["tma_driver.cuh"]} == {"gemm_sm90", "conv_tma_ws"}
        assert users["conv_sm90_wgrad_run.cuh"] == {("conv_tma_ws", "bwd_weight")}
        assert {d for _, d in users["conv_sm90_consumers.cuh"]} == {"fwd", "bwd_data"}


def test_editing_a_file_rebuilds_exactly_its_dependents(repo):
    """cpu, for real: a family module, a family template and a shared partial re-render exactly their kernels, a
    family's C++ header or a C++ change recompiles only its kernels, another backend's file rebuilds nothing."""
    names = [k.name for k in _keys(repo / "kernel_specs")]
    _build(repo)
    for rel in ("templates/cpu/gemm/__init__.py", "templates/cpu/conv_direct/conv_fwd_direct.cpp.j2",
                "templates/cpu/_conv_common.j2", "templates/cutlass/common.py"):
        _edit(repo / rel)
        rendered, compiled = _build(repo)
        assert rendered == expected(rel, names) and compiled == set(), rel
    rel = "templates/cpu/conv_direct/conv_direct.h"  # a family's plain C++ header: a compile input
    _edit(repo / rel)
    rendered, compiled = _build(repo)
    assert rendered == set() and compiled == expected(rel, names), rel
    path = repo / "templates/cpu/conv_packed/conv_fwd.cpp.j2"
    path.write_text(path.read_text() + "// edited\n")
    rendered, compiled = _build(repo)
    assert rendered == compiled == {n for n in names if family(n) == "conv_packed"}


@pytest.mark.slow
def test_editing_each_input_rebuilds_exactly_its_dependents(repo):
    """Every render and compile input of the bundle's kernels, edited one at a time."""
    keys = _keys(repo / "kernel_specs")
    names = [k.name for k in keys]
    render, compile_ = _inputs(keys)
    _build(repo)
    for rel in sorted(set(render) | set(compile_)):
        _edit(repo / rel, rendered=rel in render)
        rendered, compiled = _build(repo)
        if rel in render:
            assert rendered == render[rel] == expected(rel, names), rel
        else:
            assert rendered == set(), rel
        assert compiled == compile_.get(rel, set()), rel
