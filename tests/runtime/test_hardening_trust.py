"""Loading a bundle trusts nothing but its manifest: kernel paths confined to the bundle, every file read
once and checked (sha256, then the key embedded in its ELF section .td_key) before it is loaded from a
sealed private copy, and every malformed manifest or library refused with a BundleError."""
from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import tiledispatch as td
from conftest import REPO, scons
from tiledispatch import abi, bundle
from tiledispatch.generator import codegen, kernelset
from tiledispatch import backends
from tiledispatch.generator import toolchains

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="checks Linux mappings and ELF files")

SET = """schema: 1
name: trust_set
description: two small cpu GEMMs for the trust tests
groups:
  - backend: cpu
    op: gemm
    dtype: fp32
    layout: rcr
    pipeline: packed
    configs:
      - {tile: [24, 128, 256], mma: [6, 32, 1]}
      - {tile: [48, 128, 128], mma: [6, 32, 1]}
"""

# A library that is not the kernel its manifest entry names: its constructor leaves a marker file, so a test
# can tell whether its code ran. @KEY@ becomes the definition of td_kernel_key.
FOREIGN = r"""
#include <cstdio>
#include "tiledispatch_abi.h"
__attribute__((constructor)) static void foreign_constructor() {
  if (FILE* f = std::fopen("@MARKER@", "a")) { std::fputs("foreign code ran\n", f); std::fclose(f); }
}
extern "C" {
TD_EXPORT uint32_t td_abi_version(void) { return TD_ABI_VERSION; }
@KEY@
TD_EXPORT int32_t td_can_run(const td_args*, char*, uint64_t) { return TD_OK; }
TD_EXPORT uint64_t td_workspace_bytes(const td_args*) { return 0; }
TD_EXPORT int32_t td_run(const td_args*, char*, uint64_t) { return TD_OK; }
}
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    build = tmp_path_factory.mktemp("trust_build")
    spec = build / "trust_set.yaml"
    spec.write_text(SET)
    scons(REPO, f"kernels={spec}", "backend=cpu", f"arch={backends.get('cpu').detect_arch()}", f"build_dir={build}",
          f"cache_dir={build / 'cache'}", "bundle=trust")
    return build / "trust"


@pytest.fixture
def bundle_dir(built, tmp_path) -> Path:
    dest = tmp_path / "bundle"
    shutil.copytree(built, dest)
    return dest


def manifest_of(bundle_dir: Path) -> dict:
    return json.loads((bundle_dir / "manifest.json").read_text())


def write_manifest(bundle_dir: Path, manifest) -> None:
    (bundle_dir / "manifest.json").write_text(json.dumps(manifest))


def foreign_library(tmp_path: Path, key_definition: str, marker: Path) -> Path:
    src, lib = tmp_path / "foreign.cpp", tmp_path / "foreign.so"
    src.write_text(FOREIGN.replace("@MARKER@", str(marker)).replace("@KEY@", key_definition))
    subprocess.run([toolchains.get("cpu").toolchain().compiler, "-std=c++17", "-shared", "-fPIC", f"-I{abi.INCLUDE_DIR}", str(src),
                    "-o", str(lib)], check=True, capture_output=True)
    return lib


def runtime_key(key_json: str) -> str:
    """td_kernel_key() returning the key, without the static .td_key section."""
    return f'TD_EXPORT const char* td_kernel_key(void) {{ return R"TDKEY({key_json})TDKEY"; }}'


def static_key(key_json: str) -> str:
    return f'TD_DEFINE_KERNEL_KEY(R"TDKEY({key_json})TDKEY")'


def put_in_bundle(bundle_dir: Path, index: int, library: Path) -> dict:
    """Replace kernel `index`'s file with `library` and edit its sha256 into the manifest."""
    manifest = manifest_of(bundle_dir)
    entry = manifest["kernels"][index]
    shutil.copyfile(library, bundle_dir / entry["file"])
    entry["sha256"] = hashlib.sha256(library.read_bytes()).hexdigest()
    write_manifest(bundle_dir, manifest)
    return entry


def check_gemm(reg) -> None:
    rng = np.random.default_rng(5)
    a, w = rng.standard_normal((37, 29)).astype(np.float32), rng.standard_normal((53, 29)).astype(np.float32)
    for kern in reg.kernels:
        out = reg.gemm(a, w.T, kernel=kern.name)
        assert np.allclose(out, a.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4), kern.name


# -- 1. paths confined to the bundle ---------------------------------------------------------------------

@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_kernel_file_outside_the_bundle_is_refused(bundle_dir, tmp_path, where):
    manifest = manifest_of(bundle_dir)
    entry = manifest["kernels"][0]
    outside = tmp_path / "outside" / Path(entry["file"]).name
    outside.parent.mkdir()
    shutil.copyfile(bundle_dir / entry["file"], outside)  # a genuine copy: only its place is wrong
    entry["file"] = "../outside/" + outside.name if where == "parent" else str(outside)
    write_manifest(bundle_dir, manifest)
    with pytest.raises(td.BundleError, match=r"file must be kernels/.*\.so"):
        td.load(bundle_dir)


@pytest.mark.parametrize("what", ["file", "directory"])
def test_symbolic_links_in_the_bundle_are_refused(bundle_dir, tmp_path, what):
    outside = tmp_path / "outside"
    shutil.copytree(bundle_dir / "kernels", outside)  # genuine copies reached through a link
    if what == "file":
        so = sorted((bundle_dir / "kernels").glob("*.so"))[0]
        so.unlink()
        so.symlink_to(outside / so.name)
    else:
        shutil.rmtree(bundle_dir / "kernels")
        (bundle_dir / "kernels").symlink_to(outside)
    with pytest.raises(td.BundleError, match="symbolic link"):
        td.load(bundle_dir)


def test_a_kernel_file_that_is_not_a_regular_file_is_refused_without_hanging(bundle_dir):
    so = sorted((bundle_dir / "kernels").glob("*.so"))[0]
    so.unlink()
    os.mkfifo(so)  # opening a FIFO for reading would wait for a writer
    with pytest.raises(td.BundleError, match="not a regular file"):
        td.load(bundle_dir)


# -- 2. no swap between check and load ------------------------------------------------------------------

def _memfd_seals() -> list[int]:
    seals = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:tiledispatch"):
                seals.append(fcntl.fcntl(int(fd), fcntl.F_GET_SEALS))
        except OSError:  # the fd of the listing itself
            pass
    return seals


def test_kernels_are_loaded_from_sealed_memory_not_from_the_bundle(bundle_dir):
    reg = td.load(bundle_dir)
    maps = Path("/proc/self/maps").read_text()
    assert str(bundle_dir) not in maps, "a kernel was mapped from the bundle's file, which can change after the check"
    assert "/memfd:tiledispatch" in maps
    want = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    seals = _memfd_seals()
    assert seals and all(s & want == want for s in seals), seals
    check_gemm(reg)


def test_a_file_swapped_after_its_check_is_not_what_gets_loaded(bundle_dir, tmp_path, monkeypatch):
    """A rebuild that replaces a kernel file between the sha256 check and dlopen (the foreign file reports
    the right key at run time): the bytes that were checked are the bytes that are loaded."""
    entry = manifest_of(bundle_dir)["kernels"][0]
    marker = tmp_path / "foreign_ran"
    foreign = foreign_library(tmp_path, runtime_key(json.dumps(entry["key"], sort_keys=True, separators=(",", ":"))),
                              marker)
    target = bundle_dir / entry["file"]

    class SwapAfterDigest:  # hashes as sha256 does, then swaps the file as a concurrent rebuild would
        def __init__(self, *data):
            self.h = hashlib.sha256(*data)

        def update(self, data):
            self.h.update(data)

        def hexdigest(self):
            if not marker.with_suffix(".swapped").exists():
                marker.with_suffix(".swapped").touch()
                shutil.copyfile(foreign, target.with_suffix(".new"))
                os.replace(target.with_suffix(".new"), target)
            return self.h.hexdigest()

    monkeypatch.setattr(bundle, "hashlib", SimpleNamespace(sha256=SwapAfterDigest))
    reg = td.load(bundle_dir)
    assert marker.with_suffix(".swapped").exists(), "the test did not swap the file"
    assert not marker.exists(), "the swapped-in library was loaded and its code ran"
    check_gemm(reg)


def test_each_image_is_loaded_once_per_process(bundle_dir):
    td.load(bundle_dir)
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        check_gemm(td.load(bundle_dir))
    assert len(os.listdir("/proc/self/fd")) == fds


def test_without_memfd_a_private_copy_is_loaded(bundle_dir, monkeypatch):
    monkeypatch.delattr(os, "memfd_create")
    monkeypatch.setattr(abi, "_IMAGES", {})  # load again rather than reuse this process's memfd copies
    reg = td.load(bundle_dir)
    maps = Path("/proc/self/maps").read_text()
    assert str(bundle_dir) not in maps
    private = {m.group(1) for m in re.finditer(r"(\S*/tiledispatch-[^/\s]+)/[0-9a-f]{64}\.so \(deleted\)", maps)}
    assert len(private) == 1, "expected the copies in one private directory"
    assert os.stat(private.pop()).st_mode & 0o777 == 0o700
    check_gemm(reg)


# -- 3. verified before any foreign code runs ----------------------------------------------------------

def test_a_library_without_the_static_key_never_runs(bundle_dir, tmp_path):
    """A foreign library whose td_kernel_key() returns the right key, its sha256 edited into the manifest:
    refused before dlopen, so its constructor never runs."""
    entry = manifest_of(bundle_dir)["kernels"][0]
    marker = tmp_path / "foreign_ran"
    key_json = json.dumps(entry["key"], sort_keys=True, separators=(",", ":"))
    put_in_bundle(bundle_dir, 0, foreign_library(tmp_path, runtime_key(key_json), marker))
    with pytest.raises(td.BundleError, match=r"no embedded key \(ELF section \.td_key\)"):
        td.load(bundle_dir)
    assert not marker.exists(), "the library's constructor ran before the key check"


def test_a_library_embedding_another_key_never_runs(bundle_dir, tmp_path):
    manifest = manifest_of(bundle_dir)
    other = json.dumps(manifest["kernels"][1]["key"], sort_keys=True, separators=(",", ":"))
    marker = tmp_path / "foreign_ran"
    put_in_bundle(bundle_dir, 0, foreign_library(tmp_path, static_key(other), marker))
    with pytest.raises(td.BundleError, match=r"the library reports key gemm_.*\(its embedded key, section \.td_key\)"):
        td.load(bundle_dir)
    assert not marker.exists(), "the library's constructor ran before the key check"


def test_built_kernels_embed_their_key_statically(built):
    for entry in manifest_of(built)["kernels"]:
        data = (built / entry["file"]).read_bytes()
        assert bundle.embedded_key(data, entry["file"]) == json.dumps(entry["key"], sort_keys=True,
                                                                      separators=(",", ":"))


def test_every_main_template_defines_the_key_with_the_macro():
    """The five ABI functions, td_kernel_key's ELF section included, come from one macro (tiledispatch_export.h):
    no template defines one itself, and every main template renders exactly one TD_EXPORT_KERNEL of its key."""
    files = [p for p in (REPO / "templates").rglob("*") if p.suffix in (".j2", ".h", ".cuh")]
    sources = [p for p in files if re.search(r"\btd_kernel_key\b|\btd_abi_version\b|TD_DEFINE_KERNEL_KEY|TD_EXPORT\b",
                                             p.read_text())]
    assert not sources, f"an ABI function defined without TD_EXPORT_KERNEL in {sources}"
    # one rendered key per main template of every backend, from the preselected sets
    seen = {}
    for backend, arch in (("cpu", "x86v4"), ("cutlass", "sm90a"), ("cutlass", "sm80"), ("ck_tile", "gfx942")):
        for name in sorted(kernelset.available_sets()):
            for entry in kernelset.expand_file(kernelset.find(name), backend, arch):
                seen.setdefault((backend, backends.family_of(entry.key).templates(entry.key)[0]), entry.key)
    mains = {(p.relative_to(REPO / "templates").parts[0], p.name) for p in files
             if re.search(r"^TD_EXPORT_KERNEL\(", p.read_text(), re.M)}
    assert mains and mains <= set(seen), f"no preselected kernel renders {sorted(mains - set(seen))}"
    for (backend, template), key in seen.items():
        text = codegen.render(key)
        assert len(re.findall(r"^TD_EXPORT_KERNEL\(", text, re.M)) == 1, (backend, template)
        assert f'TD_EXPORT_KERNEL(R"TDKEY({key.to_json()})TDKEY", ' in text, (backend, template)


# -- 4. malformed manifests -----------------------------------------------------------------------------

def _dup_first(m):
    m["kernels"].append(copy.deepcopy(m["kernels"][0]))


MALFORMED = {
    "not an object": lambda m: [m],
    "null": lambda m: None,
    "schema a string": lambda m: {**m, "schema": "1"},
    "backend not a string": lambda m: {**m, "backend": ["cpu"]},
    "kernels not a list": lambda m: {**m, "kernels": {"a": 1}},
    "kernels missing": lambda m: {k: v for k, v in m.items() if k != "kernels"},
    "entry not an object": lambda m: {**m, "kernels": ["gemm"]},
    "name missing": lambda m: m["kernels"][0].pop("name") and m,
    "name a number": lambda m: m["kernels"][0].update(name=5) or m,
    "file missing": lambda m: m["kernels"][0].pop("file") and m,
    "file a list": lambda m: m["kernels"][0].update(file=["kernels"]) or m,
    "sha256 missing": lambda m: m["kernels"][0].pop("sha256") and m,
    "sha256 short": lambda m: m["kernels"][0].update(sha256="abc") or m,
    "sha256 not hex": lambda m: m["kernels"][0].update(sha256="z" * 64) or m,
    "sha256 a number": lambda m: m["kernels"][0].update(sha256=5) or m,
    "key missing": lambda m: m["kernels"][0].pop("key") and m,
    "key a string": lambda m: m["kernels"][0].update(key="gemm") or m,
    "key of another kernel": lambda m: m["kernels"][0].update(key=m["kernels"][1]["key"]) or m,
    "key signature a list": lambda m: m["kernels"][0]["key"].update(signature=[1]) or m,
    "key tile a number": lambda m: m["kernels"][0]["key"]["algorithm"].update(tile=5) or m,
    "origin a number": lambda m: m["kernels"][0].update(origin=5) or m,
    "duplicate names": lambda m: _dup_first(m) or m,
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_manifest_is_a_bundle_error(bundle_dir, case):
    write_manifest(bundle_dir, MALFORMED[case](manifest_of(bundle_dir)))
    with pytest.raises(td.BundleError):
        td.load(bundle_dir)


def test_malformed_manifest_cli_exit_code(bundle_dir):
    write_manifest(bundle_dir, MALFORMED["entry not an object"](manifest_of(bundle_dir)))
    proc = subprocess.run([sys.executable, "-m", "tiledispatch", "list", str(bundle_dir)], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and json.loads(proc.stdout)["error"] == "BundleError", proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_huge_manifest_is_refused_before_parsing(bundle_dir, monkeypatch):
    monkeypatch.setattr(bundle, "MAX_MANIFEST_BYTES", 4096, raising=False)
    (bundle_dir / "manifest.json").write_text(json.dumps(manifest_of(bundle_dir)) + " " * 8192)
    with pytest.raises(td.BundleError, match="larger than"):
        td.load(bundle_dir)


def _paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, path + (i,))


def _mutate(manifest, rng: random.Random):
    values = [None, True, False, 0, -1, 2 ** 64, 1.5, "", "x", "../kernels/x.so", "/etc/passwd", "0" * 64, [], {},
              [1, 2, 3], {"a": None}, "kernels/" + manifest["kernels"][0]["name"] + ".so", manifest["kernels"][1]]
    m = copy.deepcopy(manifest)
    path = rng.choice(list(_paths(m))[1:])
    parent = m
    for p in path[:-1]:
        parent = parent[p]
    last, action = path[-1], rng.randrange(4)
    if action == 0:
        del parent[last]
    elif action == 1:
        parent[last] = copy.deepcopy(rng.choice(values))
    elif action == 2 and isinstance(parent[last], str) and parent[last]:
        s = parent[last]
        i = rng.randrange(len(s))
        parent[last] = s[:i] + rng.choice("0x_/.a9\0") + s[i + 1:]
    else:
        if isinstance(parent, list):
            parent.insert(rng.randrange(len(parent) + 1), copy.deepcopy(parent[last]))
        else:
            parent[rng.choice(["extra", "name", "file", "key", "sha256"])] = copy.deepcopy(parent[last])
    return m, f"{path} action {action}"


def test_fuzzed_manifests_load_or_raise_bundle_error(bundle_dir):
    manifest = manifest_of(bundle_dir)
    rng, refused = random.Random(1234), 0
    for _ in range(400):
        mutated, what = _mutate(manifest, rng)
        write_manifest(bundle_dir, mutated)
        try:
            td.load(bundle_dir)
        except td.BundleError as e:
            assert "\n" not in str(e), what
            refused += 1
        except Exception as e:  # noqa: BLE001 - the point of the test
            pytest.fail(f"mutation {what}: {type(e).__name__}: {e}")
    assert refused > 300


# -- 5. truncated and corrupt libraries -----------------------------------------------------------------

TRUNCATE = r"""
import hashlib, json, os, sys
from pathlib import Path
import tiledispatch as td
b = Path(sys.argv[1])
m = json.loads((b / "manifest.json").read_text())
entry = m["kernels"][0]
so = b / entry["file"]
whole = so.read_bytes()
for cut in (0, 16, 63, 64, 300, len(whole) // 4, len(whole) // 2, 3 * len(whole) // 4, len(whole) - 1):
    part = whole[:cut]
    Path(str(so) + ".new").write_bytes(part)
    os.replace(str(so) + ".new", so)  # a new file each time, as a truncated copy would be
    entry["sha256"] = hashlib.sha256(part).hexdigest()
    (b / "manifest.json").write_text(json.dumps(m))
    try:
        td.load(b)
        print(cut, "loaded", flush=True)
    except td.BundleError as e:
        print(cut, "BundleError", e, flush=True)
"""


def test_truncated_libraries_are_refused_cleanly(bundle_dir):
    """A truncated .so whose sha256 was edited into the manifest: a clean BundleError, never SIGBUS."""
    proc = subprocess.run([sys.executable, "-c", TRUNCATE, str(bundle_dir)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert len(lines) == 9 and all(line.split()[1] == "BundleError" for line in lines), proc.stdout


def test_malformed_elf_images_are_bundle_errors(built):
    entry = manifest_of(built)["kernels"][0]
    whole = (built / entry["file"]).read_bytes()
    key_json = bundle.embedded_key(whole, "x")
    assert key_json.startswith('{"algorithm"')
    for data in (b"", b"\x7fELF", b"MZ" + whole[2:], whole[:4] + b"\x01" + whole[5:], whole[:5] + b"\x03" + whole[6:]):
        with pytest.raises(td.BundleError):
            bundle.embedded_key(data, "x")
    rng = random.Random(7)
    header_end = 64 + 56 * 16  # the ELF header and the program headers
    shoff = int.from_bytes(whole[0x28:0x30], "little")
    for i in range(3000):
        data = bytearray(whole)
        region = rng.choice([(0, 64), (64, header_end), (shoff, len(whole)), (0, len(whole))])
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(*region)
            data[pos] = rng.randrange(256) if i % 2 else data[pos] ^ 0xFF
        if i % 5 == 0:
            data = data[:rng.randrange(len(data))]
        try:
            bundle.embedded_key(bytes(data), "x")
        except td.BundleError as e:
            assert "\n" not in str(e)
